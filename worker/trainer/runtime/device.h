// The rank's device: where the model, its gradients, the optimizer state and every batch live.
// CPU and CUDA run the same trainer code; what differs is kept here (LibTorch side only):
//  - batches are built in host memory and copied over, pinned and without blocking on CUDA;
//  - mixed precision on CUDA is autocast (bf16 or fp16 matmuls and attention, fp32 master
//    weights, fp32 reductions), as torch.autocast; on the CPU the model casts its Linear layers
//    itself (model.h);
//  - fp16 scales the loss (LossScaler, as torch.amp.GradScaler): bf16 and fp32 need no scaling;
//  - reductions over all the gradients are one device-to-host copy, not one per tensor.
#ifndef TRAINYARD_WORKER_TRAINER_RUNTIME_DEVICE_H_
#define TRAINYARD_WORKER_TRAINER_RUNTIME_DEVICE_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_config.h"

namespace trainyard::trainer {

// True when this LibTorch was built with CUDA and the process sees a GPU.
bool CudaUsable();

// "cpu" or "cuda" (cuda:0: the worker makes the rank's own GPU the only one it sees).
// FAILED_PRECONDITION for cuda where CudaUsable() is false, saying why.
absl::StatusOr<torch::Device> ResolveDevice(const std::string& name);

// For the rank's log: "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB, compute 9.0)".
std::string DescribeDevice(const torch::Device& device);

// A host tensor on `device`: itself on the CPU; on CUDA copied from pinned memory without
// blocking the host (the copy is ordered on the current stream before the kernels that read it).
torch::Tensor ToDevice(const torch::Tensor& host, const torch::Device& device);

// Waits for the device's queued work (CUDA); a no-op on the CPU. For step timings.
void SynchronizeDevice(const torch::Device& device);

// Autocast for the scope on a CUDA device in bf16 or fp16; nothing on the CPU or in fp32. The
// cast weights are cached for the scope (one cast per weight per forward), as torch.autocast.
class AutocastScope {
 public:
  AutocastScope(const torch::Device& device, Precision precision);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

  // Whether autocast is on in this thread (CUDA), for recomputes in backward that must see the
  // forward's precision (activation checkpointing).
  static bool Active();
  static Precision ActivePrecision();
  // The dtype a product of `x` runs in: autocast's (bf16 or fp16) for a CUDA tensor while it is
  // active, else x's own.
  static c10::ScalarType ProductType(const torch::Tensor& x);

 private:
  bool on_ = false;
  bool was_on_ = false;
};

// sqrt(sum of squares) of every defined gradient among `params`, read back once.
double GradNorm(const std::vector<torch::Tensor>& params);
// The same as a 0-dim fp64 tensor on the gradients' device, not read back (CUDA: one
// multi-tensor kernel and a reduction, queued); an undefined tensor when no gradient is defined.
torch::Tensor GradNormTensor(const std::vector<torch::Tensor>& params);
// The divisor that clips gradients of norm `norm` (a 0-dim tensor) to `max_norm`, computed where
// `norm` is: (norm + 1e-6) / max_norm when norm > max_norm, else 1 (torch's clip_grad_norm_).
// fp32, 0-dim.
torch::Tensor ClipDivisor(const torch::Tensor& norm, double max_norm);

// Dynamic loss scaling for fp16, torch.amp.GradScaler's: the loss is multiplied by scale() before
// backward; Unscale divides the gradients by it and says whether any is inf or NaN; the step is
// then skipped, and Update halves the scale (backoff), or doubles it after growth_interval steps
// in a row without one. The scale and the count of clean steps go into checkpoints.
class LossScaler {
 public:
  struct Options {
    double init_scale = 65536.0;
    double growth_factor = 2.0;
    double backoff_factor = 0.5;
    int64_t growth_interval = 2000;
  };
  LossScaler() : LossScaler(Options()) {}
  explicit LossScaler(const Options& options);

  double scale() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  // Steps skipped for inf or NaN gradients since the start of this run.
  int64_t skipped_steps() const { return skipped_; }

  // Divides every defined gradient by scale() in place; true when one of them (before or after)
  // holds an inf or a NaN. One device-to-host read.
  bool Unscale(const std::vector<torch::Tensor>& params) const;
  // After a step: `found_inf` from Unscale (agreed by every rank).
  void Update(bool found_inf);

  // {"loss_scale": [scale], "loss_scale_growth_tracker": [n]} (CPU tensors), and back.
  std::vector<std::pair<std::string, torch::Tensor>> State() const;
  // INVALID_ARGUMENT when a tensor is missing or not a positive finite scale.
  absl::Status SetState(const std::vector<std::pair<std::string, torch::Tensor>>& state);

 private:
  Options options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_RUNTIME_DEVICE_H_
