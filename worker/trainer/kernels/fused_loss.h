// The language-model head and its cross-entropy in one step that never holds the logits of the
// whole batch (Liger's FusedLinearCrossEntropy, llm.c's fused classifier). Rows are taken in
// chunks: a chunk's logits (in the matmul's precision: bf16 under autocast) are computed, their
// loss and gradient written over them by one kernel, and the chunk's gradients of the input and
// the weight computed at once, so that backward only scales what forward kept. Eager PyTorch
// instead keeps an fp32 copy of the logits and its log-softmax (2 x 4 bytes per logit) and makes
// several passes of that size; here a chunk of bf16 logits is the largest temporary.
// Used by the models' Loss and MaskedLossSum (model.cc) on CUDA; LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_FUSED_LOSS_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_FUSED_LOSS_H_

#include <torch/torch.h>

#include <cstdint>

// 1 in the CUDA flavour, which builds cross_entropy_cuda.cu (worker/CMakeLists.txt).
#ifndef TRAINYARD_CUDA_KERNELS
#define TRAINYARD_CUDA_KERNELS 0
#endif

namespace trainyard::trainer {

// sum_i weights_i * cross_entropy(x_i W^T, targets_i), fp32, differentiable in x ([rows, d]) and
// weight ([vocab, d]); weights ([rows] fp32) may be undefined (all ones). Under CUDA autocast the
// product runs in autocast's dtype, as the unfused Linear would; otherwise in x's dtype.
// `chunk_rows` 0 picks chunks of about 256 MiB of logits (SetFusedLossChunkBytes). Targets must
// lie in [0, vocab).
torch::Tensor FusedLinearCrossEntropySum(const torch::Tensor& x, const torch::Tensor& weight,
                                         const torch::Tensor& targets, const torch::Tensor& weights,
                                         int64_t chunk_rows = 0);

// The logits' bytes a chunk of FusedLinearCrossEntropySum takes when not told its rows (0: the
// default, 256 MiB). Larger chunks: fewer, larger products, and a higher peak. Process-wide (the
// trainer's --loss-chunk-mib).
void SetFusedLossChunkBytes(int64_t bytes);

// The kernel's contract, for a [rows, vocab] block of logits (unit column stride): loss[i] =
// weights_i * (logsumexp(row i) - row_i[targets_i]) in fp32; with `write_grad`, row i is
// overwritten by weights_i * (softmax(row i) - one_hot(targets_i)) in the logits' dtype. The CUDA
// kernel on CUDA tensors where this build has it, LibTorch operations otherwise.
void CrossEntropyRows(const torch::Tensor& logits, const torch::Tensor& targets,
                      const torch::Tensor& weights, const torch::Tensor& loss, bool write_grad);

// Whether CrossEntropyRows runs the project's own CUDA kernel for CUDA tensors (the CUDA
// flavour), rather than the LibTorch composition.
bool HasCrossEntropyKernel();

// How the last chunk of FusedLinearCrossEntropySum added its weight gradient: "cublaslt" (one
// GEMM with fp32 output adding to the sum so far: CUDA tensors in bf16 or fp16, the CUDA
// flavour), "composition" (a product, then an add), or "none" before any. For tests.
const char* FusedLinearCrossEntropyWeightPath();

#if TRAINYARD_CUDA_KERNELS
// cross_entropy_cuda.cu.
void CrossEntropyRowsCuda(const at::Tensor& logits, const at::Tensor& targets,
                          const at::Tensor& weights, const at::Tensor& loss, bool write_grad);
#endif

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_FUSED_LOSS_H_
