// The model's matmuls on oneDNN, forward and backward, for fp32 CPU training: Linear layers
// (y = x W^T + b) and the attention's batched products (alpha a b + mask).
//
// LibTorch 1.13 does its fp32 matmuls in the system BLAS (OpenBLAS on Debian), whose kernels are
// picked by CPU model, or by OPENBLAS_CORETYPE when the environment sets it. oneDNN, which Debian's
// LibTorch links anyway, JIT-compiles its GEMM for the instruction set it finds at run time
// (AVX-512, AVX2, ...), independently of OpenBLAS's choice. Each GEMM (a Linear has three: output,
// input gradient, weight gradient) runs on the tensors' own memory, described by strides (no
// copies, no layout conversion), with the scale and the accumulation into a mask fused in; each
// shape's primitive is built once and cached. A shape for which oneDNN has only its reference
// loops goes to LibTorch instead.
//
// Used for fp32 tensors on the CPU with autocast off; anything else goes to torch::linear and
// torch::baddbmm. Which of the two libraries runs the fp32 CPU matmuls is the process's matmul
// path: the trainer times both on its model's own GEMM shapes at start and takes the faster
// (matmul_choice.h); TRAINYARD_MATMUL=onednn or =blas pins it (for comparisons).
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_ONEDNN_MATMUL_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_ONEDNN_MATMUL_H_

#include <torch/torch.h>

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace trainyard::trainer {

// x: [..., in]; weight: [out, in]; bias: [out] or undefined. Same result as torch::linear
// (up to fp32 rounding), differentiable in all three.
torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias);

// alpha a b + addend, batched: a [batch, m, k], b [batch, k, n] (any strides, e.g. narrowed or
// transposed views), addend [m, n] or undefined, added to every batch entry and not
// differentiated (an attention mask). As torch::baddbmm(addend, a, b, 1, alpha); differentiable in
// a and b.
torch::Tensor BatchedMatmul(const torch::Tensor& a, const torch::Tensor& b, double alpha,
                            const torch::Tensor& addend);

// The library that runs Linear's and BatchedMatmul's fp32 CPU matmuls.
enum class MatmulPath { kOneDnn, kBlas };
const char* MatmulPathName(MatmulPath path);  // (in matmul_choice.cc: both flavours build it)

// TRAINYARD_MATMUL: "onednn" or "blas" pin the path; unset, "" or "auto" give nullopt (the trainer
// chooses by timing). Anything else is an error naming the variable and the values it takes.
absl::StatusOr<std::optional<MatmulPath>> MatmulPathFromEnvironment();

// The process's path from now on; set before training (a step must not see it change). Until
// set: BLAS when TRAINYARD_MATMUL=blas, else oneDNN.
void SetMatmulPath(MatmulPath path);

// False in builds without callable oneDNN GEMMs (the CUDA LibTorch's): every matmul is then
// LibTorch's, and there is nothing to choose.
bool OneDnnMatmulsAvailable();

// Whether Linear and BatchedMatmul use oneDNN for fp32 now.
bool OneDnnMatmulsEnabled();

// The implementations oneDNN picks for a Linear's three GEMMs (forward, input gradient, weight
// gradient) with `rows` rows of input, space-separated, e.g. "brg:avx512_core brg:avx512_core
// brg:avx512_core"; a "ref" one would be a slow reference loop.
std::string LinearImplementations(int64_t rows, int64_t in, int64_t out, bool bias);
// The same for the six GEMMs of the model's causal attention over query rows [row, row + rows).
std::string AttentionImplementations(int64_t batch_heads, int64_t seq_len, int64_t head_dim,
                                     int64_t row, int64_t rows);

// One line for --version, e.g. "Matmuls: oneDNN 2.6.3 (avx512_core_bf16) or the BLAS, the faster
// on the model's GEMMs (timed at start)" or "Matmuls: BLAS (TRAINYARD_MATMUL=blas)".
std::string DescribeMatmuls();

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_ONEDNN_MATMUL_H_
