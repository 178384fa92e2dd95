// AdamW over many fp32 CUDA tensors in a few launches of one kernel of the project's own
// (adamw_cuda.cu), for the trainer's optimizer on a GPU. LibTorch's _fused_adamw_
// (torch.optim.AdamW(fused=True)) walks the tensors in launches of at most 320 blocks, which fill
// about 60% of an H200's 132 SMs, one after another: on Llama 3.2 1B it took 11.95 ms a step
// where its traffic (28 bytes a parameter) needs about 7.2 ms at the card's bandwidth
// (bench/RESULTS.md). This kernel takes up to kAdamWTensorsPerLaunch tensors a launch, in chunks
// of 16384 values, with one wave of blocks that fills the card striding over all the chunks, 16
// bytes a load. The arithmetic is torch.optim.AdamW's, in fp32 (PyTorch's fused kernel carries
// some of it in double: the two agree to fp32 rounding). The gradients are left as they are
// (_fused_adamw_ writes them back divided by its grad_scale). Built by nvcc in the CUDA flavour
// only; ATen's headers only.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_ADAMW_CUDA_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_ADAMW_CUDA_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace trainyard::trainer {

constexpr int kAdamWTensorsPerLaunch = 64;

// Whether AdamWMultiTensorCuda takes these: four lists of one length, each tensor contiguous
// fp32 on one CUDA device, a parameter's gradient and moments of its number of values.
bool AdamWMultiTensorCudaTakes(const std::vector<at::Tensor>& params,
                               const std::vector<at::Tensor>& grads,
                               const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v);

// One AdamW update of every params[i] (with grads[i], moments m[i] and v[i]) at step `step`
// (counted already: 1 for the first) with learning rate `lr`, or, where `lr_tensor` and
// `step_tensor` are defined (one fp32 value each on the device), with the values they hold when
// the kernel runs (a CUDA graph's replay). The gradients are divided by `grad_divisor` (one fp32
// value on the device; undefined: 1). On the current stream; nothing is read back.
void AdamWMultiTensorCuda(const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& m,
                          const std::vector<at::Tensor>& v, double lr, int64_t step,
                          const at::Tensor& lr_tensor, const at::Tensor& step_tensor, double beta1,
                          double beta2, double weight_decay, double eps,
                          const at::Tensor& grad_divisor);

// Tests: launch at most `blocks` blocks (0: one wave, as many as fit on the card), so that a few
// blocks walk many chunks and cross from tensor to tensor.
void SetAdamWBlocksForTest(int64_t blocks);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_ADAMW_CUDA_H_
