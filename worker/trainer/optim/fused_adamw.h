// AdamW steps for the trainer with the parameter server's fused, vectorized kernel
// (kernels/adam/cpu_adam.h: Google Highway, runtime dispatch). torch::optim::AdamW::step makes
// about eight passes over every tensor (and allocates a temporary for the denominator); this makes
// one, with the gradient-clipping scale folded in. The arithmetic is PyTorch's torch.optim.AdamW
// (the Python one, whose lerp LibTorch's C++ AdamW writes as a multiply and an add: the two agree
// to fp32 rounding), and the moments and step count stay in the torch::optim::AdamW's state, so
// checkpoints are unchanged and can be read either way. Parameters on a GPU go to the project's
// multi-tensor CUDA kernel (kernels/adamw_cuda.h) in the CUDA build, or to LibTorch's own fused
// CUDA AdamW (torch.optim.AdamW(fused=True)).
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

// AdamW over GPU tensors at optimizer step `step` (already counted), the gradients multiplied by
// `grad_scale`: the project's kernel (SetOwnAdamWKernel) or LibTorch's fused one. The CUDA
// LibTorch only (a TORCH_CHECK failure in the CPU one).
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

// The process's choice of kernel for CUDA parameters (the trainer's --adamw-kernel): the
// project's multi-tensor kernel where the build has it and the tensors suit it (contiguous fp32;
// the default), or LibTorch's _fused_adamw_ always (false). Set before training.
void SetOwnAdamWKernel(bool enabled);
// Which kernel the last update of CUDA parameters ran: "trainyard", "torch", or "none" before
// any. For tests.
const char* DeviceAdamWKernel();

// A CUDA graph's AdamW (runtime/step_graph.h): the update's host side and device side apart.
// AdvanceAdamWSteps counts one more step for each of `params` (each must have its state: the
// eager steps before a capture made it) and returns the step count they are now at (the same for
// all); FusedAdamWFromDevice applies the update to those of `params` with a gradient, reading the
// learning rate and the step count from one-element fp32 tensors on their device and dividing
// the gradients by `grad_divisor` (undefined: 1), and writes nothing on the host: a graph replays
// it with each step's values filled into `lr` and `step`. (CPU parameters, for tests of the
// graphs' bookkeeping: the values are read back, the step checked against the host's count, and
// the CPU kernel steps them.)
int64_t AdvanceAdamWSteps(torch::optim::AdamW& optimizer, const std::vector<torch::Tensor>& params);
// The AdamW state of `p`, which must have one (a TORCH_CHECK failure naming `caller` otherwise).
torch::optim::AdamWParamState& AdamWStateOf(torch::optim::AdamW& optimizer, const torch::Tensor& p,
                                            const char* caller);
void FusedAdamWFromDevice(torch::optim::AdamW& optimizer, const std::vector<torch::Tensor>& params,
                          const torch::Tensor& lr, const torch::Tensor& step,
                          const torch::Tensor& grad_divisor);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_OPTIM_FUSED_ADAMW_H_
