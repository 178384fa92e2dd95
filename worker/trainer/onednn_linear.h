// y = x W^T + b with oneDNN's matmul, forward and backward, for fp32 CPU training.
//
// LibTorch 1.13 does its fp32 matmuls in the system BLAS (OpenBLAS on Debian), whose kernels are
// picked by CPU model, or by OPENBLAS_CORETYPE when the environment sets it. oneDNN, which Debian's
// LibTorch links anyway, JIT-compiles its GEMM for the instruction set it finds at run time
// (AVX-512, AVX2, ...), independently of OpenBLAS's choice. The transformer's Linear layers are
// ~90% of a step's matmul work, so they run through here: the three GEMMs of a Linear (forward,
// input gradient, weight gradient) on the tensors' own memory, described by strides (no copies,
// no layout conversion), each shape's primitive built once and cached.
//
// Used for fp32 tensors on the CPU with autocast off; anything else goes to torch::linear. The
// environment variable TRAINYARD_MATMUL=blas sends everything to torch::linear (for comparisons).
#ifndef TRAINYARD_WORKER_TRAINER_ONEDNN_LINEAR_H_
#define TRAINYARD_WORKER_TRAINER_ONEDNN_LINEAR_H_

#include <torch/torch.h>

#include <string>

namespace trainyard::trainer {

// x: [..., in]; weight: [out, in]; bias: [out] or undefined. Same result as torch::linear
// (up to fp32 rounding), differentiable in all three.
torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias);

// Whether Linear uses oneDNN for fp32 (false when TRAINYARD_MATMUL=blas).
bool OneDnnLinearEnabled();

// The implementations oneDNN picks for a Linear's three GEMMs (forward, input gradient, weight
// gradient) with `rows` rows of input, space-separated, e.g. "brg:avx512_core brg:avx512_core
// brg:avx512_core"; a "ref" one would be a slow reference loop.
std::string LinearImplementations(int64_t rows, int64_t in, int64_t out, bool bias);

// One line for the log, e.g. "Linear matmuls: oneDNN 2.6.3 (avx512_core_bf16)" or
// "Linear matmuls: BLAS (TRAINYARD_MATMUL=blas)".
std::string DescribeLinearMatmuls();

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_ONEDNN_LINEAR_H_
