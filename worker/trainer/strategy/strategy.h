// ParallelStrategy: a rank's parallel layout behind one interface, as torchtitan's parallelisms
// wrap the model and its trainer knows none of them. The Trainer (trainer.cc) builds the model, the
// ParallelDims and the communicator groups; MakeStrategy then picks the layout's strategy, which
// owns what the layout adds (gradient buckets, FSDP's shards, the parameter servers' optimizer, the
// pipeline's stage), resumes from a checkpoint of the layout's format, and each step runs forward
// and backward, the gradient norm, the optimizer's update and, when asked, the checkpoint.
//
//  - DdpStrategy (ddp_strategy.cc): whole parameters and optimizer on every rank, the gradients
//    averaged in buckets (GradientReducer). fsdp NO_SHARD runs as this.
//  - OffloadStrategy (ddp_strategy.cc): DDP whose optimizer lives on the parameter servers
//    (OffloadOptimizer); its checkpoints are DDP's.
//  - FsdpStrategy (fsdp_strategy.cc): FsdpModel's shards; sharded checkpoints.
//  - PipelineStrategy (pipeline_strategy.cc): pipeline stages and tensor parallelism
//    (PipelineStage), the stage's replicas averaging (ddp) or sharding (fsdp) it; staged
//    checkpoints.
// The three data-parallel ones share one micro-batch loop (DataParallelStrategy).
//
// The training thread alone calls a strategy. Every rank calls each method that communicates (all
// but the accessors) in the same order.
#ifndef TRAINYARD_WORKER_TRAINER_STRATEGY_STRATEGY_H_
#define TRAINYARD_WORKER_TRAINER_STRATEGY_STRATEGY_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "worker/trainer/checkpoint/checkpoint.h"
#include "worker/trainer/control/parameter_servers.h"
#include "worker/trainer/control/step_report.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/parallel/fsdp.h"
#include "worker/trainer/parallel/offload.h"
#include "worker/trainer/parallel/parallel_dims.h"
#include "worker/trainer/runtime/step_graph.h"

namespace trainyard::trainer {

// What a strategy is built from; the pointers are the trainer's and outlive it.
struct StrategyInputs {
  LanguageModel* model = nullptr;
  const ParallelDims* dims = nullptr;
  CommGroups* groups = nullptr;
  const TrainConfig* train = nullptr;
  const ParallelConfig* parallel = nullptr;
  OptimizerHyper hyper;
  torch::Device device{torch::kCPU};
  std::string checkpoint_dir;  // where a resume reads from; "": none
  // Offload: the parameter servers' ranges (OffloadRanges) and how to call them.
  std::vector<PsRangeRef> ps_ranges;
  OffloadConfig offload;
  void (*log)(const std::string& line) = nullptr;
};

// What a resume brought besides the model and optimizer state.
struct Resumed {
  int64_t step = 0;  // optimizer steps the checkpoint had taken; 0: none resumed
  ExtraState extra;  // amp.pt's tensors (fp16's loss scale)
};

// A step's (or an evaluation's) micro-batches, as the trainer gives them.
struct MicroBatches {
  int count = 1;
  // Micro-batch i's windows ([micro_batch, seq_len + 1], on the device).
  std::function<torch::Tensor(int i)> windows;
  // Its loss (scaled for accumulation and the loss mask) from the whole model...
  std::function<torch::Tensor(int i, const torch::Tensor& windows)> loss;
  // ... or from the logits of a pipeline's last stage.
  std::function<torch::Tensor(int i, const torch::Tensor& logits, const torch::Tensor& windows)>
      loss_of;
};

struct StepWork {
  int64_t step = 0;  // optimizer steps before this one
  MicroBatches micro;
  std::optional<double> loss_scale;         // fp16: each loss is multiplied by it before backward
  std::function<void(int i)> seed_dropout;  // LoRA dropout: seeds micro-batch i's (null: none)
};

// What a step measured and computed, filled by ForwardBackward and ComputeGradNorm.
struct StepResult {
  double loss_sum = 0;  // this rank's micro-batch losses summed
  // CUDA: the loss sum and the gradient norm kept on the device, read back once after the update.
  torch::Tensor loss_device, grad_norm_device;
  double backward_s = 0, comm_wait_s = 0;
  double grad_norm = 0;
};

// A checkpoint a strategy wrote.
struct SavedCheckpoint {
  CheckpointInfo info;
  std::string kind;  // for the log line: "" (DDP's format), " (sharded)", " (2 pipeline stages)"
};

class ParallelStrategy {
 public:
  virtual ~ParallelStrategy() = default;

  // The step's micro-batches forward and backward (under autocast), the gradients averaged over
  // the ranks that hold copies of them.
  virtual void ForwardBackward(const StepWork& work, StepResult& r) = 0;
  // The global norm of the averaged gradients, into r.grad_norm (or r.grad_norm_device).
  virtual absl::Status ComputeGradNorm(StepResult& r) = 0;
  // The optimizer's update with `lr`, the gradients scaled by `clip_scale`; clears the gradients.
  virtual absl::Status OptimizerStep(double lr, double clip_scale, const StepResult& r) = 0;
  // Writes the checkpoint of `step` (optimizer steps done) into `dir` in the layout's format, its
  // meta.json with `notes`, amp.pt with `extra`. What was written, where this rank knows it (rank 0
  // always); nullopt elsewhere. No rank returns before it is durable.
  virtual absl::StatusOr<std::optional<SavedCheckpoint>> Save(const std::string& dir, int64_t step,
                                                              const MetaNotes& notes,
                                                              const ExtraState& extra) = 0;
  // Held-out micro-batches forward (no autograd, under autocast): the sum of their losses on this
  // rank; CountsLoss says whether it counts.
  virtual double EvalLossSum(const MicroBatches& micro) = 0;
  // After the last step: the whole model in the model's parameters, on the CPU, on the ranks that
  // HoldsWholeModel (FSDP gathers its shards, offload brings the last update in, a pipeline
  // gathers its stages on rank 0).
  virtual absl::Status GatherModel() = 0;

  // CUDA graphs (runtime/step_graph.h): why this layout's step cannot be captured ("": it can).
  virtual std::string StepGraphBlocker() const;
  // Steps through `graphs` from now on (the Trainer's plan allows them; a layout whose
  // StepGraphBlocker is "").
  virtual void UseStepGraphs(std::unique_ptr<StepGraphs> graphs) {}
  // The whole step (ForwardBackward, ComputeGradNorm and OptimizerStep with `lr` and the
  // clipping) replayed as a CUDA graph: true when it was, its loss and gradient norm in r's device
  // tensors. False: the caller runs the step eagerly, with `work` (whose windows may have been
  // drawn already, and then are handed over).
  virtual bool GraphedStep(StepWork& work, double lr, StepResult& r) { return false; }

  virtual bool HoldsWholeModel() const { return true; }
  // Whether this rank's loss counts in the ranks' sum (of a tensor-parallel group, its rank 0; of
  // a pipeline, its last stage).
  virtual bool CountsLoss() const { return true; }
  // Pipeline: the step's idle share of each stage's schedule, this rank's entry filled where it
  // speaks for its stage (its first replica's tensor-parallel rank 0), 0 elsewhere; summed over
  // the ranks they are every stage's. Empty without pipeline stages.
  virtual std::vector<double> StageIdleShares() const { return {}; }
  virtual LayoutStepStats LayoutStats() const = 0;
  // Bytes this rank sent for gradients, parameters and activations so far.
  virtual int64_t BytesSent() const = 0;
  // The layout for the rank's log ("ddp", "fsdp full_shard: 4 units, shard group 2", ...).
  virtual std::string Describe() const = 0;
  virtual int num_buckets() const { return 0; }
  // Whether the loss comes from the model's Loss (which may fuse the head and cross-entropy)
  // rather than from logits (a pipeline's last stage).
  virtual bool UsesModelLoss() const { return true; }

  // How the data is split: micro-batches a step, replicas of the model and this rank's replica.
  int micro_batches() const { return micro_batches_; }
  int replicas() const { return replicas_; }
  int replica() const { return replica_; }

 protected:
  ParallelStrategy(const StrategyInputs& in, int micro_batches, int replicas, int replica)
      : in_(in), micro_batches_(micro_batches), replicas_(replicas), replica_(replica) {}

  LanguageModel& model() const { return *in_.model; }
  const TrainConfig& train() const { return *in_.train; }
  const ParallelConfig& parallel() const { return *in_.parallel; }
  CommGroups& groups() const { return *in_.groups; }
  const ParallelDims& dims() const { return *in_.dims; }
  bool rank0() const { return in_.dims->rank == 0; }
  void Log(const std::string& line) const { in_.log(line); }
  void LogResumed(const std::optional<CheckpointInfo>& loaded) const;
  // Whether weight decay applies to each of `params` (train.no_weight_decay; empty: to all).
  std::vector<bool> DecayFlags(const std::vector<torch::Tensor>& params) const;
  FsdpConfig MakeFsdpConfig() const;

  const StrategyInputs in_;

 private:
  const int micro_batches_, replicas_, replica_;
};

// DDP, offload and FSDP: the model whole on every rank, the step's micro-batches one after the
// other, the hooks below marking where each layout communicates.
class DataParallelStrategy : public ParallelStrategy {
 public:
  void ForwardBackward(const StepWork& work, StepResult& r) final;
  double EvalLossSum(const MicroBatches& micro) final;

 protected:
  explicit DataParallelStrategy(const StrategyInputs& in)
      : ParallelStrategy(in, in.train->grad_accum, in.dims->world_size, in.dims->rank) {}

  virtual void BeforeMicroBatch(bool last, int64_t step) = 0;  // `last`: it syncs the gradients
  virtual void AfterForward(const torch::Tensor& loss) {}
  virtual double AfterBackward() { return 0; }      // seconds waited for communication
  virtual double AfterMicroBatches() { return 0; }  // the same
  virtual void BeforeEvalForward() {}
  virtual void AfterEval() {}
};

// The layout's strategy, resumed from the latest checkpoint in inputs.checkpoint_dir (if any);
// `resumed` gets what the resume brought. Every rank calls it.
absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakeStrategy(const StrategyInputs& inputs,
                                                               Resumed* resumed);
absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakeDdpStrategy(const StrategyInputs& inputs,
                                                                  Resumed* resumed);
absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakeOffloadStrategy(const StrategyInputs& inputs,
                                                                      Resumed* resumed);
absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakeFsdpStrategy(const StrategyInputs& inputs,
                                                                   Resumed* resumed);
absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakePipelineStrategy(const StrategyInputs& inputs,
                                                                       Resumed* resumed);

// The parameter servers' ranges of an offload job from --ps ("ADDRESS=BEGIN:END,..."), checked
// before any rendezvous: INVALID_ARGUMENT when an offload job has none. Empty for the others.
absl::StatusOr<std::vector<PsRangeRef>> OffloadRanges(const ParallelDims& dims,
                                                      const std::string& flag);

// Moves the model's parameters and buffers to `device` in place: the parameters keep their
// identity (the optimizer's state keys). A parameter whose storage is freed (one this rank does
// not hold: another pipeline stage's, or FSDP's sent from rank 0) stays freed there.
void MoveModel(LanguageModel& model, const torch::Device& device);

// Model-state bytes of a rank holding `held` parameter elements whose `optimized` train on it:
// fp32 weights and gradients, and the optimizer's state unless `offloaded`.
int64_t DenseStateBytes(int64_t held, const std::vector<torch::Tensor>& optimized,
                        OptimizerKind optimizer, bool offloaded);

// "fsdp full_shard: 4 units, shard group 2", for the rank's log.
std::string DescribeFsdp(const ParallelConfig& parallel, const FsdpModel& fsdp);

int64_t CountElements(const std::vector<torch::Tensor>& tensors);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_STRATEGY_STRATEGY_H_
