// A dense layer's product on a GPU under autocast, with a backward that computes the weight's and
// the bias's gradients in one cuBLASLt call: dW = dy^T x written in fp32 (the master weights'
// dtype) and db = the column sums of dy in the same GEMM's epilogue (CUBLASLT_EPILOGUE_BGRADB),
// where eager runs the weight product in bf16, a separate reduction over every row of dy for the
// bias (48 of them in a GPT-2-small step: 1.8 ms on an H200, bench/RESULTS.md), and autocast's
// casts of both gradients back to fp32. The forward and the input's gradient are eager's own
// (the same cuBLAS products on the same bf16 operands). Apex's and Transformer Engine's fused
// dense layers take the same epilogue. On the CPU, without autocast, and where cuBLASLt has no
// algorithm for the product, the same function gives torch::linear's results. LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_DENSE_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_DENSE_H_

#include <torch/torch.h>

#include "worker/trainer/kernels/fused_loss.h"  // TRAINYARD_CUDA_KERNELS

namespace trainyard::trainer {

// x W^T + b for x [..., in], weight [out, in], bias [out] or undefined, differentiable in all
// three: GpuLinear's product where UsesGpuLinear, else torch::linear. (The fused path's output of a
// 3-D input is a view made inside an autograd Function: autograd refuses in-place operations on
// it, which no model makes.)
torch::Tensor GpuLinear(const torch::Tensor& x, const torch::Tensor& weight,
                        const torch::Tensor& bias);

// Whether GpuLinear takes the fused path for these tensors: a CUDA build, the path enabled, CUDA
// tensors under bf16 or fp16 autocast (AutocastScope) with gradients recorded, fp32 weight and
// bias, x in fp32 or in autocast's dtype, matching sizes.
bool UsesGpuLinear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

// GpuLinear's autograd Function itself, on any device, with its products in `dtype` (bf16, fp16
// or fp32): for the CPU tests of its wiring (gradients, dtypes, no bias, frozen weights). Off the
// GPU its weight gradient is the composition's.
torch::Tensor LinearThroughOneProductForTest(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias, c10::ScalarType dtype);

// The process's choice (the trainer's --fused-linear; on by default). Set before training.
void SetGpuLinearEnabled(bool enabled);
bool GpuLinearEnabled();

// How the last fused backward computed the weight's gradient: "cublaslt" (the one GEMM with its
// bias-gradient epilogue), "composition" (cuBLASLt offered no algorithm: ATen's product and
// sum; the rank's log says so once, on stderr), or "none" before any. For tests.
const char* GpuLinearBackwardPath();

#if TRAINYARD_CUDA_KERNELS
// dense_cuda.cc: dw = dy^T x (fp32 [out, in], contiguous) and, when db is defined, db = the sum of
// dy's rows (fp32 [out]), in one cuBLASLt GEMM on the current stream. dy [rows, out] and x [rows,
// in] contiguous, one dtype (bf16 or fp16). False, with nothing written, when cuBLASLt has no
// algorithm for it (said once on stderr); any other error of cuBLASLt throws.
bool WeightGradientCublasLt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dw,
                            const at::Tensor& db);
#endif

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_DENSE_H_
