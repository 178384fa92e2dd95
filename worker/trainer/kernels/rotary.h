// Rotary position embedding (RoPE) for the Llama family on a GPU: x * cos + rotate_half(x) * sin
// in one kernel forward and one backward (rotary_cuda.cu), where eager runs the two slices, the
// negation, the concatenation, two products and the sum forward, and backward their gradients and
// an fp32 accumulation: about a dozen passes over q and k per layer become two. Each thread takes
// one pair (i, i + head_dim / 2) of a row, reads it once and writes both outputs, in the input's
// layout (q and k arrive as transposed views of their projections: no copy). The arithmetic is
// eager's, product by product in fp32 without fused multiply-adds, so fp32 results are eager's
// to the bit; the output is rounded once to the input's dtype (bf16 under autocast, where eager
// computes in fp32 and autocast rounds the same value to bf16 before attention). On the CPU, and
// for inputs the kernel does not take, the same function runs the ATen composition. LibTorch side
// only.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_ROTARY_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_ROTARY_H_

#include <torch/torch.h>

#include "worker/trainer/kernels/fused_loss.h"  // TRAINYARD_CUDA_KERNELS

namespace trainyard::trainer {

// transformers' rotate_half: the second half of the last dimension negated, then the first.
torch::Tensor RotateHalf(const torch::Tensor& x);

// x * cos + RotateHalf(x) * sin for x of [batch, heads, t, head_dim] and cos, sin of
// [t, head_dim]; differentiable in x (cos and sin are constants).
torch::Tensor ApplyRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin);

// Whether ApplyRotary runs the project's CUDA kernel for these tensors.
bool UsesRotaryKernel(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

#if TRAINYARD_CUDA_KERNELS
// rotary_cuda.cu: in and out of [b, n, t, hd] with the last dimension contiguous (any other
// strides, each its own), one dtype (fp32, bf16, fp16); cos and sin contiguous fp32 [t, hd].
// `inverse`: the backward (the rotation by -angle: in is the output's gradient, out the input's).
void RotaryCuda(const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& out, bool inverse);
#endif

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_ROTARY_H_
