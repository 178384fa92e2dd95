// SwiGLU's product for the Llama MLP on a GPU: silu(gate) * up in one kernel forward and one
// backward (swiglu_cuda.cu), where eager runs silu and the product forward and, backward, the
// product's two gradients, silu's backward and its own products: five passes over tensors of
// [tokens, d_hidden] (8192 wide in Llama 3.2 1B) become two. The arithmetic is fp32; each output
// is rounded once, to the inputs' dtype (bf16 under autocast, as eager's outputs). On the CPU,
// and for inputs the kernel does not take, the same function runs the ATen composition, which the
// tests compare the kernel with. LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_SWIGLU_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_SWIGLU_H_

#include <torch/torch.h>

#include "worker/trainer/kernels/fused_loss.h"  // TRAINYARD_CUDA_KERNELS

namespace trainyard::trainer {

// silu(gate) * up, differentiable in both; gate and up of one shape and dtype.
torch::Tensor SwiGlu(const torch::Tensor& gate, const torch::Tensor& up);

// Whether SwiGlu runs the project's CUDA kernel for these tensors.
bool UsesSwiGluKernel(const torch::Tensor& gate, const torch::Tensor& up);

#if TRAINYARD_CUDA_KERNELS
// swiglu_cuda.cu: gate, up, out contiguous, one shape and dtype (fp32, bf16, fp16).
void SwiGluForwardCuda(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out);
// dout, gate, up, dgate, dup contiguous, one shape and dtype.
void SwiGluBackwardCuda(const at::Tensor& dout, const at::Tensor& gate, const at::Tensor& up,
                        const at::Tensor& dgate, const at::Tensor& dup);
#endif

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_SWIGLU_H_
