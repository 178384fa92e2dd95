// The training step as a CUDA graph (at::cuda::CUDAGraph): once the step's shapes are fixed and a
// few eager steps have run with them, the whole step (forward and backward of every micro-batch,
// the gradient norm, the clipping divisor and the fused AdamW update) is captured once and
// replayed, one launch for hundreds of kernels, as PyTorch's whole-network capture
// (torch.cuda.graphs) and torch.compile's mode="reduce-overhead" do. What changes between steps
// travels through device tensors the graph reads: the micro-batches' tokens (copied into static
// inputs), the learning rate and AdamW's step count (filled before each replay).
//
// PlanStepGraphs says whether a rank's step can be captured, and if not, why (the rank logs it);
// StepGraphs keeps the warm-up, the capture and the replays, and captures again after the step's
// shapes change. The capture itself is the CUDA flavour's (comm/cuda_support.h); StepGraphs takes
// it as a function, so that its bookkeeping is tested on the CPU.
#ifndef TRAINYARD_WORKER_TRAINER_RUNTIME_STEP_GRAPH_H_
#define TRAINYARD_WORKER_TRAINER_RUNTIME_STEP_GRAPH_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "common/job_config.h"

namespace trainyard::trainer {

// What decides whether a rank's step runs as a CUDA graph.
struct StepGraphFacts {
  bool requested = true;     // --cuda-graphs auto (false: off)
  bool cuda = false;         // the rank trains on a GPU
  bool can_capture = false;  // this trainer's LibTorch captures CUDA graphs (the CUDA flavour)
  // Why the layout's step cannot be captured ("": it can); ParallelStrategy::StepGraphBlocker.
  std::string layout_blocker;
  Precision precision = Precision::kFp32;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  bool loss_mask = false;     // data.loss_mask
  bool lora_dropout = false;  // train.lora.dropout > 0
};

struct StepGraphPlan {
  bool on = false;
  // For the rank's log: why not (or "" on the CPU, where there is nothing to say).
  std::string why_not;
};

StepGraphPlan PlanStepGraphs(const StepGraphFacts& facts);

// Replays a captured graph; destroying it waits for the device and frees the graph's memory.
using GraphReplay = std::function<void()>;
// Captures `body` (whose kernels are recorded, not run) into a graph: its replay, or why the
// capture failed.
using GraphCapture = std::function<absl::StatusOr<GraphReplay>(const std::function<void()>& body)>;

class StepGraphs {
 public:
  // Eager steps before the capture with the same shapes (the optimizer's state made, workspaces
  // and caches of the step's stream allocated, lazily built tensors built), as PyTorch's
  // make_graphed_callables warms up.
  static constexpr int kWarmupSteps = 3;

  StepGraphs(GraphCapture capture, std::function<void(const std::string&)> log,
             int warmup_steps = kWarmupSteps);

  // One step whose graph depends on `shapes` (a key: the inputs' sizes). Returns true when the
  // step ran as the graph: captured first when none matches (from `body`, which must record the
  // whole step reading only device tensors), then `before_replay` (which fills the graph's
  // inputs) and the replay. False: the caller runs the step eagerly (a warm-up step, or graphs
  // are off, or the capture failed: then off for the rest of the run, said in the log). A change
  // of shapes drops the graph and warms up again.
  bool Run(const std::string& shapes, int64_t step, const std::function<void()>& body,
           const std::function<void()>& before_replay);

  // Drops the graph (it read tensors that are gone: `why`, said in the log); the next steps warm
  // up and capture again.
  void Drop(int64_t step, const std::string& why);

  bool on() const { return on_; }
  bool captured() const { return static_cast<bool>(replay_); }
  int captures() const { return captures_; }
  int64_t replays() const { return replays_; }

 private:
  GraphCapture capture_;
  std::function<void(const std::string&)> log_;
  const int warmup_steps_;
  bool on_ = true;
  std::string shapes_;
  int eager_steps_ = 0;  // with shapes_
  GraphReplay replay_;   // null until captured (for shapes_)
  int captures_ = 0;
  int64_t replays_ = 0;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_RUNTIME_STEP_GRAPH_H_
