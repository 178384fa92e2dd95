// FsdpStrategy (strategy.h).
#include "common/status_macros.h"
#include "worker/trainer/checkpoint/fsdp_checkpoint.h"
#include "worker/trainer/strategy/strategy.h"

namespace trainyard::trainer {
namespace {

// The parameters, gradients and optimizer state sharded over the shard group (FsdpModel: units
// gathered before their forward and backward, gradients reduce-scattered after); every rank writes
// its shard of the checkpoint. With cpu_ram_efficient_loading rank 0 alone builds the model and
// sends the others their shards.
class FsdpStrategy : public DataParallelStrategy {
 public:
  explicit FsdpStrategy(const StrategyInputs& in) : DataParallelStrategy(in) {}

  absl::Status Build(Resumed* resumed) {
    CommGroups& g = groups();
    ASSIGN_OR_RETURN(fsdp_, FsdpModel::Create(model(), *g.world, *g.shard, g.replica.get(),
                                              MakeFsdpConfig(), dims().from_rank0));
    if (!in_.checkpoint_dir.empty()) {
      ASSIGN_OR_RETURN(const auto loaded, LoadLatestShardedCheckpoint(in_.checkpoint_dir, *fsdp_));
      LogResumed(loaded);
      if (loaded.has_value()) resumed->step = loaded->step;
    }
    return absl::OkStatus();
  }

  absl::Status ComputeGradNorm(StepResult& r) override {
    r.grad_norm = fsdp_->GradNorm();
    return absl::OkStatus();
  }
  absl::Status OptimizerStep(double lr, double clip_scale, const StepResult&) override {
    fsdp_->Step(lr, clip_scale);
    return absl::OkStatus();
  }
  // Every rank writes its shard; rank 0 the manifest.
  absl::StatusOr<std::optional<SavedCheckpoint>> Save(const std::string& dir, int64_t step,
                                                      const MetaNotes& notes,
                                                      const ExtraState&) override {
    ASSIGN_OR_RETURN(CheckpointInfo info,
                     WriteShardedCheckpoint(dir, step, *fsdp_, *groups().world, train().lr, notes));
    return SavedCheckpoint{std::move(info), " (sharded)"};
  }
  // Every rank takes part in gathering the whole model (on a GPU before the move, which copies
  // what the gathered views show).
  absl::Status GatherModel() override {
    fsdp_->GatherFullParameters();
    if (in_.device.is_cuda()) MoveModel(model(), torch::kCPU);
    return absl::OkStatus();
  }
  LayoutStepStats LayoutStats() const override {
    LayoutStepStats s;
    s.model_state_peak_bytes = fsdp_->peak_bytes();
    return s;
  }
  int64_t BytesSent() const override { return fsdp_->bytes_sent(); }
  std::string Describe() const override { return DescribeFsdp(parallel(), *fsdp_); }

 protected:
  void BeforeMicroBatch(bool last, int64_t) override { fsdp_->BeginForward(last); }
  void AfterForward(const torch::Tensor& loss) override { fsdp_->WatchLoss(loss); }
  double AfterBackward() override { return fsdp_->FinishBackward(); }
  void BeforeEvalForward() override { fsdp_->BeginForward(/*sync_gradients=*/false); }
  void AfterEval() override { fsdp_->ReleaseAfterForward(); }

 private:
  std::unique_ptr<FsdpModel> fsdp_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakeFsdpStrategy(const StrategyInputs& inputs,
                                                                   Resumed* resumed) {
  auto strategy = std::make_unique<FsdpStrategy>(inputs);
  RETURN_IF_ERROR(strategy->Build(resumed));
  return strategy;
}

}  // namespace trainyard::trainer
