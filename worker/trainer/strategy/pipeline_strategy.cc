// PipelineStrategy (strategy.h).
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/trainer/checkpoint/fsdp_checkpoint.h"
#include "worker/trainer/checkpoint/staged_checkpoint.h"
#include "worker/trainer/parallel/ddp.h"
#include "worker/trainer/parallel/pipeline.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/strategy/strategy.h"

namespace trainyard::trainer {
namespace {

// Model parallelism: the rank runs one pipeline stage (PipelineStage's schedule moves the
// micro-batches' activations between stages) and, with tensor parallelism, its shard of the
// stage's layers; the stage's replicas average its gradients (ddp) or shard it (fsdp). Every rank
// builds the whole model from the seed and the same checkpoint (of any layout), then keeps its
// part.
class PipelineStrategy : public ParallelStrategy {
 public:
  PipelineStrategy(const StrategyInputs& in, PipelineLayout layout)
      : ParallelStrategy(in, in.dims->pipelined ? in.train->micro_batches : in.train->grad_accum,
                         layout.replicas, layout.replica),
        layout_(std::move(layout)),
        params_(in.model->parameters()),
        stage_params_(StageParameters(*in.model, layout_)) {
    for (const auto& [name, p] : stage_params_) {
      if (p.requires_grad()) optimized_.push_back(p);
    }
  }

  absl::Status Build(Resumed* resumed) {
    if (!dims().fsdp) {
      optimizer_ = MakeOptimizer(optimized_, in_.hyper, train().lr, DecayFlags(optimized_));
    }
    // The checkpoint (of any layout) is read into the whole model and an optimizer of every
    // parameter that trains; the stage keeps its part of both.
    const std::vector<torch::Tensor> trainable = TrainableParameters(model());
    std::unique_ptr<torch::optim::Optimizer> whole =
        MakeOptimizer(trainable, in_.hyper, train().lr, DecayFlags(trainable));
    std::optional<CheckpointInfo> loaded;
    if (!in_.checkpoint_dir.empty()) {
      ASSIGN_OR_RETURN(loaded,
                       LoadLatestCheckpoint(in_.checkpoint_dir, model(), *whole, &resumed->extra));
      LogResumed(loaded);
      if (loaded.has_value()) resumed->step = loaded->step;
    }
    RETURN_IF_ERROR(KeepStagePart(*whole, loaded.has_value()));
    CommGroups& g = groups();
    if (g.stage && !fsdp_) {
      const double mb = parallel().bucket_mb;
      reducer_ = std::make_unique<GradientReducer>(optimized_, *g.stage, mb, std::min(1.0, mb));
    }
    pipeline_ = std::make_unique<PipelineStage>(model(), *g.world, layout_,
                                                parallel().pipeline_schedule, train().micro_batch,
                                                reducer_.get(), fsdp_.get(), g.tensor.get());
    for (const auto& [name, p] : stage_params_) held_count_ += p.numel();  // its shards
    state_bytes_ = DenseStateBytes(held_count_, optimized_, train().optimizer, /*offloaded=*/false);
    WarnOfSplitTensorGroups();
    return absl::OkStatus();
  }

  // The stage runs every micro-batch by the schedule; the reducer syncs in its last backward.
  void ForwardBackward(const StepWork& work, StepResult& r) override {
    if (work.seed_dropout) work.seed_dropout(0);
    {
      // (On a GPU autocast covers the schedule's backwards too, as it does not touch them:
      // autograd runs them on its device threads.)
      AutocastScope autocast(in_.device, train().precision);
      const torch::Tensor loss =
          pipeline_->Step(work.micro.count, work.micro.windows, work.micro.loss_of);
      // (A GPU's loss is read back a step later, with the step's report.)
      if (loss.defined() && loss.is_cuda()) {
        r.loss_device = loss;
      } else if (loss.defined()) {
        r.loss_sum = loss.item<double>();
      }
    }
    r.backward_s = pipeline_->last_step().seconds;
    r.comm_wait_s = pipeline_->last_step().comm_wait_seconds;
    if (reducer_) r.comm_wait_s = reducer_->Finish();  // the replicas' average
    pipeline_->SyncTiedGradient();
    pipeline_->SyncSequenceParallelGradients();
  }

  absl::Status ComputeGradNorm(StepResult& r) override {
    r.grad_norm = std::sqrt(pipeline_->GradNormSquared(optimized_));
    return absl::OkStatus();
  }

  absl::Status OptimizerStep(double lr, double clip_scale, const StepResult&) override {
    if (fsdp_) {
      fsdp_->Step(lr, clip_scale);
      return absl::OkStatus();
    }
    trainyard::trainer::OptimizerStep(*optimizer_, lr, clip_scale);
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
    return absl::OkStatus();
  }

  // Each stage's first replica writes its part; rank 0 meta.json. Under fsdp, the stage's shards
  // put together whole first (by all of its replicas).
  absl::StatusOr<std::optional<SavedCheckpoint>> Save(const std::string& dir, int64_t step,
                                                      const MetaNotes& notes,
                                                      const ExtraState&) override {
    WholeModel gathered;
    if (fsdp_) {
      ASSIGN_OR_RETURN(gathered, GatherWhole(*fsdp_, train().lr));
    }
    ASSIGN_OR_RETURN(
        CheckpointInfo info,
        WriteStagedCheckpoint(dir, step, layout_, model(), fsdp_ ? gathered.params : stage_params_,
                              fsdp_ ? *gathered.optimizer : *optimizer_, *groups().world,
                              groups().tensor.get(), notes));
    return SavedCheckpoint{std::move(info),
                           absl::StrCat(" (", layout_.stages, " pipeline stages)")};
  }

  double EvalLossSum(const MicroBatches& micro) override {
    AutocastScope autocast(in_.device, train().precision);
    return pipeline_->Evaluate(micro.count, micro.windows, micro.loss_of);
  }

  // Rank 0 gathers the stages' parameters (under fsdp each stage's shards first); the other ranks
  // hold only their stage's, on the CPU.
  absl::Status GatherModel() override {
    if (fsdp_) fsdp_->GatherFullParameters();
    if (in_.device.is_cuda()) MoveModel(model(), torch::kCPU);
    pipeline_->GatherToRankZero();
    return absl::OkStatus();
  }

  bool HoldsWholeModel() const override { return rank0(); }
  bool CountsLoss() const override { return layout_.tp_rank == 0 && layout_.last(); }
  bool UsesModelLoss() const override { return false; }

  std::vector<double> StageIdleShares() const override {
    if (!dims().pipelined) return {};
    std::vector<double> shares(layout_.stages, 0.0);
    const PipelineStepStats& ps = pipeline_->last_step();
    if (layout_.replica == 0 && layout_.tp_rank == 0) {
      shares[layout_.stage] = ps.idle_seconds / ps.seconds;
    }
    return shares;
  }

  LayoutStepStats LayoutStats() const override {
    LayoutStepStats s;
    s.allreduce_bytes = reducer_ ? reducer_->bytes_per_step() : 0;
    s.model_state_peak_bytes = fsdp_ ? fsdp_->peak_bytes() : state_bytes_;
    const int stages = layout_.stages;
    s.pipeline_bubble_theory =
        dims().pipelined ? double(stages - 1) / double(micro_batches() + stages - 1) : 0.0;
    s.pipeline_fields = true;
    s.pipeline_in_flight_peak = pipeline_->last_step().peak_in_flight;
    s.pipeline_activation_peak_bytes = pipeline_->last_step().peak_activation_bytes;
    return s;
  }

  // Activations, and over the stage's data- and tensor-parallel groups too.
  int64_t BytesSent() const override {
    const CommGroups& g = groups();
    return g.world->bytes_sent() + (g.stage ? g.stage->bytes_sent() : 0) +
           (g.tensor ? g.tensor->bytes_sent() : 0) + (fsdp_ ? fsdp_->bytes_sent() : 0);
  }

  std::string Describe() const override {
    const std::vector<int>& bounds = dims().stage_bounds;
    return absl::StrFormat(
        "pipeline stage %d/%d (blocks %d..%d, %d parameters), tensor-parallel rank %d/%d, %s, %d "
        "micro-batches, %d replicas (%s)",
        layout_.stage, layout_.stages, bounds[layout_.stage], bounds[layout_.stage + 1] - 1,
        held_count_, layout_.tp_rank, layout_.tensor_parallel, Name(parallel().pipeline_schedule),
        micro_batches(), replicas(), fsdp_ ? DescribeFsdp(parallel(), *fsdp_) : "ddp");
  }
  int num_buckets() const override { return reducer_ ? reducer_->num_buckets() : 0; }

 private:
  // After the whole model loaded: the tensor-parallel shards, the stage's optimizer state (or its
  // FsdpModel's), and the storage of every other stage's parameters freed.
  absl::Status KeepStagePart(torch::optim::Optimizer& whole, bool resumed) {
    const int tensor = layout_.tensor_parallel;
    if (tensor > 1) KeepTensorParallelShards(model(), stage_params_, layout_);
    CommGroups& g = groups();
    if (dims().fsdp) {
      // The stage's replicas shard its parameters (an FsdpModel over their group, or under
      // HYBRID_SHARD over those on this node), which averages the gradients too. (`world`: the
      // part's replicas, over which the gradients are averaged.)
      FsdpConfig config = MakeFsdpConfig();
      config.holds = [this](const std::string& name) { return StageHolds(model(), layout_, name); };
      ASSIGN_OR_RETURN(fsdp_, FsdpModel::Create(model(), dims().hybrid ? *g.stage : *g.shard,
                                                *g.shard, g.replica.get(), config,
                                                /*from_rank0=*/false));
      if (resumed) {
        int64_t state_step = 0;
        const auto states = StageStates(model(), whole, layout_, &state_step);
        RETURN_IF_ERROR(ImportParameterStates(*fsdp_, states, state_step));
      }
    } else if (resumed) {
      RETURN_IF_ERROR(KeepStageState(model(), whole, *optimizer_, layout_));
    }
    if (tensor > 1) {
      model().SetTensorParallel(
          {g.tensor.get(), layout_.tp_rank, tensor, parallel().sequence_parallel});
    }
    for (const auto& item : model().named_parameters()) {
      if (!StageHolds(model(), layout_, item.key())) FreeStorage(item.value());
    }
    return absl::OkStatus();
  }

  // A tensor-parallel group is consecutive ranks; the scheduler gives each node whole groups, but
  // ranks started otherwise may split one.
  void WarnOfSplitTensorGroups() const {
    const int tensor = layout_.tensor_parallel, local = dims().local_world;
    if (tensor > 1 && local > 0 && local % tensor != 0) {
      Log(absl::StrCat("warning: this node runs ", local,
                       " of the job's ranks, not a multiple of parallel.tensor_parallel (", tensor,
                       "): a tensor-parallel group spans nodes, and its all-reduces cross the "
                       "network"));
    }
  }

  const PipelineLayout layout_;
  const std::vector<torch::Tensor> params_;
  // The parameters this rank's stage holds, and of them those that train (what its optimizer
  // steps and its replicas average).
  const std::vector<std::pair<std::string, torch::Tensor>> stage_params_;
  std::vector<torch::Tensor> optimized_;
  int64_t held_count_ = 0;  // elements of the stage's parameters (its tensor-parallel shards)
  int64_t state_bytes_ = 0;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;  // without fsdp
  std::unique_ptr<FsdpModel> fsdp_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<PipelineStage> pipeline_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakePipelineStrategy(const StrategyInputs& inputs,
                                                                       Resumed* resumed) {
  const ParallelDims& d = *inputs.dims;
  auto strategy = std::make_unique<PipelineStrategy>(
      inputs, MakePipelineLayout(d.rank, d.world_size, d.stages, d.tensor, d.stage_bounds));
  RETURN_IF_ERROR(strategy->Build(resumed));
  return strategy;
}

}  // namespace trainyard::trainer
