// GradientReducer: PyTorch-DDP-style gradient averaging. Parameters are grouped into buckets
// (the first of 1 MiB, the others of parallel.bucket_mb MiB) in reverse registration order, which
// is roughly the order in which backward produces their gradients. A post-hook on each
// parameter's AccumulateGrad node copies the gradient into its bucket's flat buffer; once a
// bucket is complete it is all-reduced asynchronously while backward goes on. Buckets are
// launched strictly in index order, so every rank issues the same collectives in the same order.
// Finish() waits for them all and makes each param.grad() a view of its averaged slice of the
// bucket (PyTorch's gradient_as_bucket_view: no copy back). Callers should set the gradients to
// none (undefined) after the optimizer step, so that the next backward hands its gradients over
// (one copy into the bucket per step); if they do not, backward accumulates into the bucket views,
// which still gives the right sums.
//
// Gradient accumulation: only the backward after Prepare(sync = true) communicates.
// One thread at a time: the training thread (CPU backward runs its hooks on the calling thread;
// CUDA backward on LibTorch's device thread while the training thread waits in backward()).
#ifndef TRAINYARD_WORKER_TRAINER_PARALLEL_DDP_H_
#define TRAINYARD_WORKER_TRAINER_PARALLEL_DDP_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "worker/trainer/comm/communicator.h"

namespace trainyard::trainer {

class GradientReducer {
 public:
  // `params` in registration order; `comm` must outlive the reducer.
  GradientReducer(std::vector<torch::Tensor> params, Communicator& comm, double bucket_mb,
                  double first_bucket_mb = 1.0);
  ~GradientReducer();  // removes the hooks

  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Call before each backward: `sync` when it is the last micro-step of the optimizer step.
  void Prepare(bool sync);
  // After the synchronizing backward: launches buckets whose gradients never arrived (unused
  // parameters count as zero), waits for every all-reduce and points the grads at the means.
  // Returns the seconds spent waiting.
  double Finish();

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Bytes all-reduced per optimizer step.
  int64_t bytes_per_step() const { return bytes_per_step_; }

 private:
  struct Slot {
    int bucket;
    int64_t offset;  // elements into the bucket buffer
  };
  struct Bucket {
    std::vector<int> params;
    torch::Tensor buffer;  // flat fp32
    int pending = 0;       // gradients not yet copied in this step
    std::unique_ptr<CommHandle> handle;
  };
  class Hook;

  // Called by a parameter's hook once its gradient is accumulated.
  void MarkReady(int param);
  // Launches consecutive complete buckets starting at next_launch_.
  void LaunchReady();

  std::vector<torch::Tensor> params_;
  Communicator& comm_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<bool> ready_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  bool sync_ = false;
  int next_launch_ = 0;
  int64_t bytes_per_step_ = 0;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_PARALLEL_DDP_H_
