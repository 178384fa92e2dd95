// Offload: the ZeRO-Offload data flow with the optimizer on parameter servers
// (parallel.strategy: offload). After the synchronizing backward (gradients averaged over the
// data-parallel ranks by the GradientReducer), rank r owns slice r of the flat parameter vector
// (every parameter in registration order, split into world_size equal slices). It pushes its
// slice's gradients to the parameter servers holding it, asks each to apply AdamW for the step
// (UpdateAndPull) and receives the updated fp32 parameters; an all-gather of the slices gives
// every rank the whole model again.
//
// Checkpoints keep the DDP format: before saving, rank 0 reads the servers' master weights, m and
// v into the model and a shadow torch AdamW (ReadIntoShadow); on resume, Initialize sends the
// loaded state back. Called from the training thread only.
#ifndef TRAINYARD_WORKER_TRAINER_OFFLOAD_H_
#define TRAINYARD_WORKER_TRAINER_OFFLOAD_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/trainer/communicator.h"

namespace trainyard::trainer {

struct PsRangeRef {
  std::string address;
  int64_t begin = 0;
  int64_t end = 0;
};

// Parses --ps "ADDRESS=BEGIN:END,..." (contiguous ranges from 0, in order). INVALID_ARGUMENT
// names what is wrong.
absl::StatusOr<std::vector<PsRangeRef>> ParsePsRanges(const std::string& flag);

struct OffloadConfig {
  std::string job_id;
  int attempt = 1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
};

class OffloadOptimizer {
 public:
  // `params` in registration order; `comm` must outlive this. The ranges must cover exactly the
  // parameters' element count (else Create fails with INVALID_ARGUMENT).
  static absl::StatusOr<std::unique_ptr<OffloadOptimizer>> Create(std::vector<torch::Tensor> params,
                                                                  Communicator& comm,
                                                                  std::vector<PsRangeRef> ranges,
                                                                  OffloadConfig config);
  ~OffloadOptimizer();

  // Every rank: rank 0 sends the current parameters (and the shadow optimizer's m and v if it has
  // state, i.e. after a resume) as the servers' initial state at `step`; then all ranks meet.
  absl::Status Initialize(int64_t step, torch::optim::Optimizer& shadow);

  // After the synchronizing backward (grads averaged): pushes this rank's slice, applies step
  // `step` (1-based) with `lr` and gradient scale `grad_scale` on the servers, pulls the slice
  // back and all-gathers the parameters into the model. Clears the gradients.
  absl::Status Step(int64_t step, double lr, double grad_scale);

  // Rank 0: copies the servers' master weights into the parameters and their m, v (at `step`)
  // into `shadow`'s AdamW state, so a DDP-format checkpoint can be written.
  absl::Status ReadIntoShadow(int64_t step, torch::optim::Optimizer& shadow);

  int64_t num_params() const { return total_; }
  // Bytes this rank sent to and received from the parameter servers in the last step.
  int64_t pushed_bytes() const { return pushed_bytes_; }
  int64_t pulled_bytes() const { return pulled_bytes_; }

 private:
  struct Server;
  OffloadOptimizer(std::vector<torch::Tensor> params, Communicator& comm, OffloadConfig config);

  // [begin, end) of this rank's slice, clipped to the parameters.
  std::pair<int64_t, int64_t> OwnedSlice() const;
  torch::Tensor Flatten(bool grads) const;
  void Unflatten(const torch::Tensor& flat);

  std::vector<torch::Tensor> params_;
  Communicator& comm_;
  const OffloadConfig config_;
  std::vector<std::unique_ptr<Server>> servers_;
  int64_t total_ = 0;
  int64_t slice_ = 0;  // elements per rank (the last slice is padded)
  int64_t pushed_bytes_ = 0, pulled_bytes_ = 0;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_OFFLOAD_H_
