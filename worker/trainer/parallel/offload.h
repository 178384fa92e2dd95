// Offload: the ZeRO-Offload data flow with the optimizer on parameter servers
// (parallel.strategy: offload). Rank r owns slice r of the flat parameter vector (every parameter
// in registration order, split into world_size equal slices). During the synchronizing backward,
// gradients land in one flat buffer through AccumulateGrad hooks; as soon as a bucket (a
// contiguous range of it, filled in reverse registration order like DDP's) is complete, a pusher
// thread reduce-scatters it (ring over Gloo send/recv: each rank ends up with the mean of its own
// part only, half an all-reduce's traffic) and sends that part to the parameter servers holding
// it, while backward goes on. The pusher is the only thread issuing collectives until
// FinishBackward has drained it. After backward, each rank asks the
// servers to apply AdamW to its slice (UpdateAndPull) and receives the updated fp32 parameters;
// an all-gather of the slices gives every rank the whole model again.
//
// Checkpoints keep the DDP format: before saving, rank 0 reads the servers' master weights, m and
// v into the model and a shadow torch AdamW (ReadIntoShadow); on resume, Initialize sends the
// loaded state back.
//
// On a GPU the same flow runs with the flat buffer (and the pulled slice) in pinned host memory:
// each gradient is copied out of the device as its AccumulateGrad completes, and the parameters
// are copied back after the all-gather.
//
// Called from the training thread only, and from backward's hooks (on the training thread on a
// CPU; on autograd's device thread on a GPU, while the training thread waits in backward); the
// pusher thread is internal.
#ifndef TRAINYARD_WORKER_TRAINER_PARALLEL_OFFLOAD_H_
#define TRAINYARD_WORKER_TRAINER_PARALLEL_OFFLOAD_H_

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/control/parameter_servers.h"

namespace trainyard::trainer {

struct OffloadConfig {
  // The job, the servers' AdamW and how to reach them.
  PsClientConfig servers;
  // Step t's update and pull run on the pusher thread while step t+1 computes with the
  // parameters of step t-1; they reach the model after step t+1's backward.
  bool delayed_update = false;
};

class OffloadOptimizer {
 public:
  // `params` in registration order; `comm` must outlive this. The ranges must cover exactly the
  // parameters' element count (else Create fails with INVALID_ARGUMENT). Gradients are reduced
  // and pushed in buckets of about `bucket_mb`.
  static absl::StatusOr<std::unique_ptr<OffloadOptimizer>> Create(std::vector<torch::Tensor> params,
                                                                  Communicator& comm,
                                                                  std::vector<PsRangeRef> ranges,
                                                                  OffloadConfig config,
                                                                  double bucket_mb);
  ~OffloadOptimizer();

  // Every rank: rank 0 sends the current parameters (and the shadow optimizer's m and v if it has
  // state, i.e. after a resume) as the servers' initial state at `step`; then all ranks meet.
  absl::Status Initialize(int64_t step, torch::optim::Optimizer& shadow);

  // Before each backward: `sync` on the last micro-step of optimizer step `step` (1-based), whose
  // backward then reduces and pushes the gradients.
  void Prepare(bool sync, int64_t step);
  // After the synchronizing backward: reduces and pushes what backward did not (unused
  // parameters count as zero), waits for every push. Returns the global norm of the averaged
  // gradients; `waited_s` gets the seconds spent waiting after backward.
  absl::StatusOr<double> FinishBackward(double* waited_s);
  // Applies the step on the servers with `lr` and gradient scale `grad_scale` (clipping), pulls
  // this rank's slice back and all-gathers the parameters into the model. Clears the gradients.
  // With delayed_update the update and pull only start here, and the parameters arrive in the
  // next FinishBackward (or Flush).
  absl::Status Step(double lr, double grad_scale);
  // delayed_update: waits for the update in flight and brings its parameters into the model
  // (before a checkpoint and at the end). A no-op otherwise.
  absl::Status Flush();

  // Rank 0: copies the servers' master weights into the parameters and their m, v (at `step`)
  // into `shadow`'s AdamW state, so a DDP-format checkpoint can be written.
  absl::Status ReadIntoShadow(int64_t step, torch::optim::Optimizer& shadow);

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // The servers' connections, for the rank's log (ParameterServers).
  const ParameterServers& servers() const { return *servers_; }
  // Bytes this rank sent to and received from the parameter servers in the last step.
  int64_t pushed_bytes() const { return pushed_bytes_; }
  int64_t pulled_bytes() const { return pulled_bytes_; }

 private:
  struct Bucket {
    int64_t begin = 0, end = 0;  // flat elements [begin, end): params first_param..last_param
    int first_param = 0, last_param = 0;
    int pending = 0;  // gradients not yet copied in this step
  };
  class Hook;
  OffloadOptimizer(std::vector<torch::Tensor> params, Communicator& comm, OffloadConfig config);

  void MarkReady(int param);
  // Hands consecutive complete buckets, from next_launch_ on, to the pusher (training thread).
  void LaunchReady();
  // The pusher thread: reduces each launched bucket and pushes this rank's part.
  void PusherLoop();
  // Reduce-scatter of the bucket: this rank's part of grads_ becomes the mean over the ranks.
  void ReduceBucket(const Bucket& bucket);
  absl::Status PushBucket(const Bucket& bucket, int64_t step);
  // Applies `step` to this rank's slice on every server holding part of it and pulls the result
  // into `slice` (slice_ elements, from the slice's start).
  absl::Status UpdateAndPull(int64_t step, double lr, double grad_scale, torch::Tensor& slice);
  // Waits until the pusher finished every task queued so far; its first error, if any.
  absl::Status Drain();
  // All-gathers the slices and copies the whole vector into the parameters.
  void GatherIntoModel(const torch::Tensor& slice);

  // [begin, end) of this rank's slice, clipped to the parameters.
  std::pair<int64_t, int64_t> OwnedSlice() const;
  torch::Tensor Flatten() const;  // the parameters
  void Unflatten(const torch::Tensor& flat);

  std::vector<torch::Tensor> params_;
  std::vector<int64_t> offsets_;  // flat offset of each parameter
  Communicator& comm_;
  const OffloadConfig config_;
  std::unique_ptr<ParameterServers> servers_;
  int64_t total_ = 0;
  int64_t slice_ = 0;    // elements per rank (the last slice is padded)
  torch::Tensor grads_;  // flat fp32 gradients, averaged once their bucket is reduced
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // parameter -> bucket
  std::vector<bool> ready_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  bool sync_ = false;
  int64_t step_ = 0;  // the optimizer step being computed
  int next_launch_ = 0;
  std::atomic<int64_t> pushed_bytes_{0};
  std::atomic<int64_t> pulled_bytes_{0};

  // delayed_update: the slice pulled by the update in flight (or done), not yet in the model.
  torch::Tensor pending_slice_;
  bool pending_ = false;

  // Work for the pusher thread: a complete bucket to reduce and push, or (delayed update) the
  // update-and-pull of a step.
  struct Task {
    int bucket = -1;
    bool update = false;
    int64_t step = 0;
    double lr = 0, grad_scale = 1;
  };
  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  int64_t tasks_queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t tasks_done_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status push_status_ ABSL_GUARDED_BY(mu_);  // the first failure; fatal for the run
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread pusher_;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_PARALLEL_OFFLOAD_H_
