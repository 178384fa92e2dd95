// LayerNorm (the GPT block's) and RMSNorm (the Llama family's) fused with the residual add before
// it and the cast after it, on a GPU: where eager runs `h = x + branch`, the norm and autocast's
// cast of its output to bf16 as three kernels (and three more in backward, plus the add of the
// residual's gradients), AddLayerNorm and AddRmsNorm run one each way (layer_norm_cuda.cu); a
// block's first norm hands the residual stream on through its own node (LayerNormResidual), so the
// stream's two gradients meet inside the norm's backward kernel instead of in an fp32 add. The
// arithmetic is torch's layer_norm in fp32; only the output is rounded, once, to the dtype the next
// product reads. On the CPU, and wherever the kernel does not apply (a width over 4096), the same
// functions run the ATen composition, which the tests compare the kernels with. LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_FUSED_NORM_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_FUSED_NORM_H_

#include <torch/torch.h>

#include <utility>

#include "worker/trainer/kernels/fused_loss.h"  // TRAINYARD_CUDA_KERNELS
#if TRAINYARD_CUDA_KERNELS
#include "worker/trainer/kernels/layer_norm_cuda.h"
#endif

namespace trainyard::trainer {

// layer_norm(x) over the last dimension with `weight` and `bias` (fp32, [d]) and `eps`, its output
// in autocast's dtype on CUDA (as the Linear after it would cast it), else in x's. x fp32.
torch::Tensor LayerNormCast(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias, double eps);

// {h, layer_norm(h)} for h = x + y (x fp32, y any float dtype of x's shape); the norm's output as
// LayerNormCast's. Differentiable in x, y, weight and bias.
std::pair<torch::Tensor, torch::Tensor> AddLayerNorm(const torch::Tensor& x, const torch::Tensor& y,
                                                     const torch::Tensor& weight,
                                                     const torch::Tensor& bias, double eps);

// {x', layer_norm(x)}: x' is x itself (the same values and storage) as an output of the norm's
// autograd node, its norm as LayerNormCast's. A pre-norm block hands x' to its residual add, so
// the residual stream has one user, and the add's gradient to it is summed into the norm's input
// gradient inside the norm's backward kernel (eager: the norm's backward, then autograd's fp32
// add of x's two gradients, one a block). Differentiable in x, weight and bias. Neither x nor x'
// may be changed in place after (x' is a view that refuses it on the fused path, x itself on the
// composition's).
std::pair<torch::Tensor, torch::Tensor> LayerNormResidual(const torch::Tensor& x,
                                                          const torch::Tensor& weight,
                                                          const torch::Tensor& bias, double eps);

// RMSNorm as the Llama family's (x * rsqrt(mean(x^2) + eps) * weight, weight fp32 [d]) over the
// last dimension, its output as LayerNormCast's. x fp32.
torch::Tensor RmsNormCast(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// {h, rms_norm(h)} for h = x + y, as AddLayerNorm. Differentiable in x, y and weight.
std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(const torch::Tensor& x, const torch::Tensor& y,
                                                   const torch::Tensor& weight, double eps);

// {x', rms_norm(x)}, as LayerNormResidual. Differentiable in x and weight.
std::pair<torch::Tensor, torch::Tensor> RmsNormResidual(const torch::Tensor& x,
                                                        const torch::Tensor& weight, double eps);

// The RMSNorm of a module (layers.h RmsNorm): LibTorch's fused rms_norm for fp32 CUDA tensors
// (the CUDA LibTorch), else the composition, both in x's dtype.
torch::Tensor RmsNormOf(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// Whether these run the project's CUDA kernels for CUDA tensors of width `d`.
bool HasLayerNormKernel(int64_t d);

// Whether the functions above take their fused path (one autograd node a norm, with the add and
// the cast) for x, given fp32 weights: x fp32 on a GPU with a kernel for its width, or on the CPU
// while a FusedNormsOnTheCpuForTest lives. The models' blocks ask it before they arrange their
// residual stream around these functions.
bool UsesFusedNorms(const torch::Tensor& x);

// While one lives (in any thread), the fused path applies to CPU tensors too, the kernels'
// arithmetic written in ATen, the norms' outputs in `out_type` (as autocast's dtype on a GPU): for
// the CPU tests of its autograd wiring, in both flavours. One at a time.
class FusedNormsOnTheCpuForTest {
 public:
  explicit FusedNormsOnTheCpuForTest(c10::ScalarType out_type = torch::kFloat);
  ~FusedNormsOnTheCpuForTest();
  FusedNormsOnTheCpuForTest(const FusedNormsOnTheCpuForTest&) = delete;
  FusedNormsOnTheCpuForTest& operator=(const FusedNormsOnTheCpuForTest&) = delete;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_FUSED_NORM_H_
