// AdamW steps for the trainer with the parameter server's fused, vectorized kernel
// (kernels/adam/cpu_adam.h: Google Highway, runtime dispatch). torch::optim::AdamW::step makes
// about eight passes over every tensor (and allocates a temporary for the denominator); this makes
// one, with the gradient-clipping scale folded in. The arithmetic is PyTorch's torch.optim.AdamW
// (the Python one, whose lerp LibTorch's C++ AdamW writes as a multiply and an add: the two agree
// to fp32 rounding), and the moments and step count stay in the torch::optim::AdamW's state, so
// checkpoints are unchanged and can be read either way. Parameters on a GPU go to LibTorch's own
// fused CUDA AdamW (torch.optim.AdamW(fused=True)), one launch for all of them.
#ifndef TRAINYARD_WORKER_TRAINER_OPTIM_FUSED_ADAMW_H_
#define TRAINYARD_WORKER_TRAINER_OPTIM_FUSED_ADAMW_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace torch::optim {
class AdamW;
}

namespace trainyard::trainer {

// One AdamW update of every parameter of `optimizer` that has a gradient (fp32; CPU or CUDA), with
// learning rate `lr` and the gradients multiplied by `grad_scale` first; the optimizer's betas,
// eps and weight decay. Creates the state of parameters seen for the first time as
// torch::optim::AdamW does (zero moments, step 0). Splits large tensors over LibTorch's intra-op
// threads. Leaves the gradients as they are.
void FusedAdamWStep(torch::optim::AdamW& optimizer, double lr, double grad_scale);

// The same for CUDA parameters with the gradients divided by `grad_divisor` (a one-element fp32
// tensor on their device, computed there: gradient clipping without reading the norm back).
void FusedAdamWStep(torch::optim::AdamW& optimizer, double lr, const torch::Tensor& grad_divisor);

// LibTorch's fused CUDA AdamW over GPU tensors at optimizer step `step` (already counted), the
// gradients multiplied by `grad_scale`; one launch for all of them. The CUDA LibTorch only (a
// TORCH_CHECK failure in the CPU one).
void FusedAdamWOnDevice(const std::vector<torch::Tensor>& params,
                        const std::vector<torch::Tensor>& grads,
                        const std::vector<torch::Tensor>& m, const std::vector<torch::Tensor>& v,
                        int64_t step, double lr, double beta1, double beta2, double weight_decay,
                        double eps, double grad_scale);
// With the gradients divided by `grad_divisor` (one fp32 element on the device; undefined: 1).
void FusedAdamWOnDevice(const std::vector<torch::Tensor>& params,
                        const std::vector<torch::Tensor>& grads,
                        const std::vector<torch::Tensor>& m, const std::vector<torch::Tensor>& v,
                        int64_t step, double lr, double beta1, double beta2, double weight_decay,
                        double eps, const torch::Tensor& grad_divisor);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_OPTIM_FUSED_ADAMW_H_
