// A dense layer's product on a GPU under autocast, with a backward that computes the weight's and
// the bias's gradients in one cuBLASLt call: dW = dy^T x written in fp32 (the master weights'
// dtype) and db = the column sums of dy in the same GEMM's epilogue (CUBLASLT_EPILOGUE_BGRADB),
// where eager runs the weight product in bf16, a separate reduction over every row of dy for the
// bias (48 of them in a GPT-2-small step: 1.8 ms on an H200, bench/RESULTS.md), and autocast's
// casts of both gradients back to fp32. The forward and the input's gradient are eager's products
// on the same bf16 operands, through cuBLASLt with the tuned algorithm (SetGemmTuning; eager's own
// calls with the tuning off). Apex's and Transformer Engine's fused
// dense layers take the same epilogue. On the CPU, without autocast, and where cuBLASLt has no
// algorithm for the product, the same function gives torch::linear's results. LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_DENSE_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_DENSE_H_

#include <torch/torch.h>

#include "worker/trainer/kernels/fused_loss.h"  // TRAINYARD_CUDA_KERNELS

namespace trainyard::trainer {

// x W^T + b for x [..., in], weight [out, in], bias [out] or undefined, differentiable in all
// three: GpuLinear's product where UsesGpuLinear, else torch::linear. (With the tuning off, the
// fused path's output of a 3-D input with a bias is torch::linear's view, made inside an autograd
// Function: autograd refuses in-place operations on it, which no model makes.)
torch::Tensor GpuLinear(const torch::Tensor& x, const torch::Tensor& weight,
                        const torch::Tensor& bias);

// residual + x W^T for x [..., in], weight [out, in] (no bias) and residual [..., out], the fp32
// residual stream (the Llama layer's add after its MLP): where UsesGpuLinear and the residual is
// fp32 and contiguous, one cuBLASLt product whose output is the fp32 sum (the stream as its C,
// beta 1), where eager rounds the product to bf16 and adds it in an unvectorised mixed-dtype
// kernel (1.06 ms of a Llama 3.2 1B step on an H200, bench/RESULTS.md); its backward is
// GpuLinear's, the residual's gradient the output's. Otherwise residual + GpuLinear(x, weight).
torch::Tensor GpuLinearResidual(const torch::Tensor& x, const torch::Tensor& weight,
                                const torch::Tensor& residual);
// How the last GpuLinearResidual added the residual: "cublaslt" (in the product), "composition"
// (an add after it), or "none" before any. For tests.
const char* GpuLinearResidualPath();

// The name of a fused kernel's path as the *Path() functions give it: 1 "cublaslt" (in the
// product or its epilogue), 2 "composition" (ATen's kernels), anything else "none" (none yet).
const char* KernelPathName(int path);

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

// Whether the products this file runs through cuBLASLt (the weight and bias gradients, the GELU
// and residual epilogues, the fused head's products) and the dense layers' forward products and
// input gradients take the fastest of the heuristic's first 8 algorithms for their problem, each
// timed on the problem's own operands at its first call (a few launches each; the rank's log gives
// each tuned problem's choice), or, with the trainer's --gemm-tune off, the heuristic's first (the
// forward products and input gradients then ATen's own calls, as before the tuning). On by default:
// the trade PyTorch leaves off by default (TunableOp, cuDNN's benchmark mode), made here because
// the trainer's products are its step's largest cost; the choice, and so a product's last bits, may
// differ run to run, and off gives the same algorithm in every run. A problem first met while its
// stream is captured (a CUDA graph) takes the heuristic's first: waiting on the stream is not
// allowed there. No candidate, the heuristic's first included, is a split-K algorithm that adds
// its parts up in a 16-bit output's own type (each part would be rounded). A product that adds into
// its output in place (the fused head's weight gradient after its first chunk) is not timed: it
// takes the first chunk's choice where its problem matches (else the heuristic's first). Set
// before training.
void SetGemmTuning(bool enabled);
bool GemmTuning();
// Whether a product of x [rows, k] with w [out, in] (k one of w's widths: x W^T or x W) takes the
// tuned cuBLASLt call rather than ATen's: a CUDA build, CUDA tensors, the tuning on, both in bf16
// or both in fp16, rows to multiply, contiguous operands, and both of w's widths multiples of 8
// (16-byte rows, where cuBLASLt's tensor-core algorithms apply; another width keeps ATen's call, as
// before the tuning).
bool TakesTunedProduct(const torch::Tensor& x, const torch::Tensor& w);

// Problems tuned so far in this process, how many of them took another algorithm than the
// heuristic's first, how many were not timed because the heuristic offered one algorithm, and how
// many adds in place took their twin's choice. For tests (zero without the CUDA build).
struct GemmTuningStats {
  int64_t tuned = 0;
  int64_t not_first = 0;
  int64_t single = 0;
  int64_t twinned = 0;
};
GemmTuningStats GemmTuningStatsForTest();

// How the last fused backward computed the weight's gradient: "cublaslt" (the one GEMM with its
// bias-gradient epilogue), "composition" (cuBLASLt offered no algorithm: ATen's product and
// sum; the rank's log says so once, on stderr), or "none" before any. For tests.
const char* GpuLinearBackwardPath();

// A GPT MLP's fc_out(gelu(fc(x))): x W1^T + b1, GELU (tanh's approximation when `gelu_tanh`, else
// the exact erf), then W2 and b2; weights fp32 [hidden, in] and [out, hidden], biases [hidden] and
// [out]. Where UsesGeluEpilogue: one autograd Function whose first product adds the bias and
// applies the GELU in cuBLASLt's epilogue (CUBLASLT_EPILOGUE_GELU_AUX_BIAS, keeping the
// pre-activation for backward: eager's separate GELU pass forward is gone), and whose backward
// applies GELU's derivative in the epilogue of the product that computes the hidden gradient
// (CUBLASLT_EPILOGUE_DGELU: eager's gelu_backward pass is gone); the weight and bias gradients as
// GpuLinear's (one cuBLASLt product each). cuBLASLt's GELU is the tanh approximation only, so the
// exact GELU keeps the composition. Else GpuLinear, torch::gelu, GpuLinear.
// With `residual` (the block's residual stream, x's shape but for the last dimension, `out`),
// residual + that: on the Function's path the second product adds the bias (fp32) and the
// residual (fp32) in its epilogue and writes the fp32 sum (eager: a bf16 product, then an fp32
// add that reads it back), and the residual's gradient is the output's, untouched.
torch::Tensor GeluMlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                      const torch::Tensor& w2, const torch::Tensor& b2, bool gelu_tanh,
                      const torch::Tensor& residual = torch::Tensor());

// Whether GeluMlp takes its one Function: `gelu_tanh`, both products on GpuLinear's path
// (UsesGpuLinear), both biases given, and a hidden width that is a multiple of 8 (cuBLASLt's
// auxiliary matrix).
bool UsesGeluEpilogue(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                      const torch::Tensor& w2, const torch::Tensor& b2, bool gelu_tanh);

// GeluMlp's Function on any device, its products in `dtype`: for the CPU tests of its wiring.
// Off the GPU (and where cuBLASLt has no algorithm) the epilogues are ATen's linear, gelu and
// gelu_backward in `dtype`, as eager's autocast runs them.
torch::Tensor GeluMlpThroughEpiloguesForTest(const torch::Tensor& x, const torch::Tensor& w1,
                                             const torch::Tensor& b1, const torch::Tensor& w2,
                                             const torch::Tensor& b2, c10::ScalarType dtype,
                                             const torch::Tensor& residual = torch::Tensor());

// How the last GeluMlp Function applied its GELU, forward then backward: "cublaslt" (both in the
// epilogues), "composition" (either without: no CUDA, or no algorithm, said once on stderr),
// or "none" before any. For tests.
const char* GeluMlpPath();
// How the last GeluMlp Function with a residual added it: "cublaslt" (in the second product's
// epilogue), "composition" (an add after it), or "none" before any. For tests.
const char* GeluMlpResidualPath();
// Sets every *Path() above back to "none": a test's next reading is from what ran after this.
void ResetKernelPathsForTest();

#if TRAINYARD_CUDA_KERNELS
// dense_cuda.cc: out = gelu_tanh(x w^T + b) and pre = x w^T + b ([rows, hidden] each, x's dtype,
// contiguous) in one cuBLASLt GEMM (CUBLASLT_EPILOGUE_GELU_AUX_BIAS). x [rows, in], w [hidden,
// in], b [hidden], contiguous, one dtype (bf16 or fp16); hidden a multiple of 8. False, with
// nothing written, when cuBLASLt's heuristic offers no algorithm for it (said once on stderr,
// with its status); an error of the product itself throws.
bool GeluForwardCublasLt(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                         const at::Tensor& out, const at::Tensor& pre);
// dpre = (dy w) * gelu_tanh'(pre) [rows, hidden] in one cuBLASLt GEMM (CUBLASLT_EPILOGUE_DGELU).
// dy [rows, out], w [out, hidden], pre and dpre [rows, hidden], contiguous, one dtype. As above.
bool GeluBackwardCublasLt(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& pre,
                          const at::Tensor& dpre);
// y = h w^T + b + residual in one cuBLASLt GEMM (CUBLASLT_EPILOGUE_BIAS, beta 1): h [rows,
// hidden] and w [out, hidden] in one dtype (bf16 or fp16), b fp32 [out] or undefined (no bias),
// residual and y fp32 [rows, out] (y a tensor of its own), all contiguous. As above.
bool ResidualForwardCublasLt(const at::Tensor& h, const at::Tensor& w, const at::Tensor& b,
                             const at::Tensor& residual, const at::Tensor& y);

// dense_cuda.cc: y = x w^T (+ b) [rows, out] in one cuBLASLt GEMM (CUBLASLT_EPILOGUE_BIAS with
// b): x [rows, in], w [out, in], b [out] or undefined, y, all contiguous in one dtype (bf16 or
// fp16). torch::linear's product, tuned (SetGemmTuning). As above.
bool LinearCublasLt(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                    const at::Tensor& y);
// dx = dy w [rows, in] in one cuBLASLt GEMM: dy [rows, out], w [out, in], dx, all contiguous in
// one dtype (bf16 or fp16). torch::mm's product, tuned. As above.
bool DataGradientCublasLt(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& dx);

// dense_cuda.cc: dw = dy^T x (fp32 [out, in], contiguous) and, when db is defined, db = the sum of
// dy's rows (fp32 [out]), in one cuBLASLt GEMM on the current stream; with `add` (and no db), dw
// += dy^T x in the same GEMM (beta 1: no product rounded to dy's dtype and added after). dy
// [rows, out] and x [rows, in] contiguous, one dtype (bf16 or fp16). False, with nothing written,
// when cuBLASLt's heuristic offers no algorithm for it (said once on stderr, with its status); an
// error of the product itself throws.
bool WeightGradientCublasLt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dw,
                            const at::Tensor& db, bool add = false);
#endif

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_DENSE_H_
