// DdpStrategy and OffloadStrategy (strategy.h).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/trainer/optim/fused_adamw.h"
#include "worker/trainer/parallel/ddp.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/strategy/strategy.h"

namespace trainyard::trainer {
namespace {

// Whole parameters and optimizer on every rank; every rank starts from rank 0's parameters and
// averages its gradients in buckets (PyTorch's DDP). Rank 0 writes the checkpoints.
class DdpStrategy : public DataParallelStrategy {
 public:
  // `offloaded`: the optimizer's state lives elsewhere (OffloadStrategy), not in this rank's
  // model state.
  explicit DdpStrategy(const StrategyInputs& in, bool offloaded = false)
      : DataParallelStrategy(in),
        params_(in.model->parameters()),
        trainable_(TrainableParameters(*in.model)),
        state_bytes_(
            DenseStateBytes(CountElements(params_), trainable_, in.train->optimizer, offloaded)) {}

  // The optimizer, resumed from the latest checkpoint, and every rank on rank 0's parameters.
  absl::Status Resume(Resumed* resumed) {
    optimizer_ = MakeOptimizer(trainable_, in_.hyper, train().lr, DecayFlags(trainable_));
    if (!in_.checkpoint_dir.empty()) {
      ASSIGN_OR_RETURN(
          const std::optional<CheckpointInfo> loaded,
          LoadLatestCheckpoint(in_.checkpoint_dir, model(), *optimizer_, &resumed->extra));
      LogResumed(loaded);
      if (loaded.has_value()) resumed->step = loaded->step;
    }
    groups().world->Broadcast(params_, 0);
    return absl::OkStatus();
  }

  // The buckets (one rank that is not a NCCL test has nothing to average); the first of 1 MiB like
  // PyTorch's, or smaller when the buckets are.
  void MakeReducer() {
    if (dims().world_size > 1 || groups().nccl_one_rank) {
      const double mb = parallel().bucket_mb;
      reducer_ =
          std::make_unique<GradientReducer>(trainable_, *groups().world, mb, std::min(1.0, mb));
    }
  }

  absl::Status ComputeGradNorm(StepResult& r) override {
    if (in_.device.is_cuda() && train().precision != Precision::kFp16 &&
        dynamic_cast<torch::optim::AdamW*>(optimizer_.get()) != nullptr) {
      // CUDA with the fused AdamW: the norm and the clipping stay on the device.
      r.grad_norm_device = GradNormTensor(params_);
    } else {
      r.grad_norm = GradNorm(params_);
    }
    return absl::OkStatus();
  }

  absl::Status OptimizerStep(double lr, double clip_scale, const StepResult& r) override {
    if (r.grad_norm_device.defined()) {
      const double clip = train().grad_clip;
      FusedAdamWStep(dynamic_cast<torch::optim::AdamW&>(*optimizer_), lr,
                     clip > 0 ? ClipDivisor(r.grad_norm_device, clip) : torch::Tensor());
    } else {
      trainyard::trainer::OptimizerStep(*optimizer_, lr, clip_scale);
    }
    if (graphs_) {  // what a graph captured after this step updates
      updated_.clear();
      for (const auto& p : trainable_) {
        if (p.grad().defined()) updated_.push_back(p);
      }
    }
    // zero_grad(set_to_none=True): the next backward hands its gradients over instead of adding
    // them to zeros (and the reducer's bucket views are dropped).
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
    return absl::OkStatus();
  }

  std::string StepGraphBlocker() const override {
    if (reducer_) {
      return absl::StrCat("the gradients are averaged through c10d's ProcessGroupNCCL (",
                          dims().world_size, (dims().world_size == 1 ? " rank" : " ranks"),
                          "), whose collectives are not captured; one rank without NCCL has "
                          "none to average");
    }
    if (dynamic_cast<torch::optim::AdamW*>(optimizer_.get()) == nullptr) {
      if (train().optimizer != OptimizerKind::kAdamW) {
        return absl::StrCat("train.optimizer ", Name(train().optimizer), " is not AdamW");
      }
      return "train.no_weight_decay gives AdamW a parameter group each, stepped by the "
             "per-parameter optimizer, not the fused AdamW";
    }
    return "";
  }

  void UseStepGraphs(std::unique_ptr<StepGraphs> graphs) override {
    graphs_ = std::move(graphs);
    const auto opts = torch::TensorOptions().device(in_.device).dtype(torch::kFloat);
    graph_lr_ = torch::zeros({}, opts);
    graph_step_ = torch::zeros({}, opts);
  }

  // The step as a graph: its windows copied into the graph's inputs, AdamW's step counts advanced
  // on the host and the learning rate and step count filled into the graph's device tensors,
  // then one replay. The capture records ForwardBackward, the gradient norm, the clipping
  // divisor and FusedAdamWFromDevice, reading the same tensors, as the eager step runs them.
  bool GraphedStep(StepWork& work, double lr, StepResult& r) override {
    if (!graphs_ || !graphs_->on()) return false;
    const int n = work.micro.count;
    std::vector<torch::Tensor> windows;
    std::string shapes;
    for (int i = 0; i < n; ++i) {
      windows.push_back(work.micro.windows(i));
      absl::StrAppend(&shapes, i > 0 ? " " : "", absl::StrJoin(windows.back().sizes(), "x"));
    }
    if (shapes != graph_shapes_) {  // the graph's inputs, made before its capture
      graph_windows_.clear();
      for (const auto& w : windows) graph_windows_.push_back(torch::empty_like(w));
      graph_shapes_ = shapes;
    }
    auto& adamw = dynamic_cast<torch::optim::AdamW&>(*optimizer_);
    // The parameters the graph updates: those that had a gradient in the last eager step (with
    // these shapes: the warm-up's). A graph reads their storage and their AdamW moments where
    // they were at its capture: should any have moved, it is captured again.
    if (!graphs_->captured()) graph_params_ = updated_;
    if (graphs_->captured() && StateAddresses(adamw) != graph_addresses_) {
      graphs_->Drop(work.step + 1, "parameters or AdamW moments moved since the capture");
    }
    // (What the body holds it holds by value or is a member: a graph records it once, and the
    // CPU tests' stand-in for a graph runs it again at each replay.)
    StepWork captured = work;
    captured.micro.windows = [this](int i) { return graph_windows_[i]; };
    captured.seed_dropout = nullptr;
    auto body = [this, &adamw, captured] {
      StepResult cr;
      ForwardBackward(captured, cr);
      const torch::Tensor norm = GradNormTensor(params_);
      const double clip = train().grad_clip;
      FusedAdamWFromDevice(adamw, graph_params_, graph_lr_, graph_step_,
                           clip > 0 ? ClipDivisor(norm, clip) : torch::Tensor());
      for (auto& p : params_) p.mutable_grad() = torch::Tensor();
      graph_addresses_ = StateAddresses(adamw);
      // (On the CPU the micro-batches' losses are summed on the host.)
      graph_loss_ =
          cr.loss_device.defined() ? cr.loss_device : torch::full({}, cr.loss_sum, torch::kDouble);
      graph_norm_ = norm;
    };
    auto before_replay = [&] {
      for (int i = 0; i < n; ++i) graph_windows_[i].copy_(windows[i], /*non_blocking=*/true);
      const int64_t step = AdvanceAdamWSteps(adamw, graph_params_);
      graph_lr_.fill_(lr);
      graph_step_.fill_(static_cast<double>(step));
    };
    if (!graphs_->Run(shapes, work.step + 1, body, before_replay)) {
      // (A failed capture may have left gradients in the graph's memory.)
      for (auto& p : params_) p.mutable_grad() = torch::Tensor();
      work.micro.windows = [windows = std::move(windows)](int i) { return windows[i]; };
      return false;
    }
    r.loss_device = graph_loss_;
    r.grad_norm_device = graph_norm_;
    return true;
  }

  absl::StatusOr<std::optional<SavedCheckpoint>> Save(const std::string& dir, int64_t step,
                                                      const MetaNotes& notes,
                                                      const ExtraState& extra) override {
    std::optional<SavedCheckpoint> saved;
    if (rank0()) {
      RETURN_IF_ERROR(BeforeRankZeroWrites(step));
      ASSIGN_OR_RETURN(CheckpointInfo info,
                       WriteCheckpoint(dir, step, model(), *optimizer_, notes, extra));
      saved = SavedCheckpoint{std::move(info), ""};
    }
    groups().world->Barrier();  // no rank runs ahead of (or exits before) a durable checkpoint
    return saved;
  }

  absl::Status GatherModel() override {
    if (in_.device.is_cuda()) MoveModel(model(), torch::kCPU);
    return absl::OkStatus();
  }

  LayoutStepStats LayoutStats() const override {
    LayoutStepStats s;
    s.allreduce_bytes = reducer_ ? reducer_->bytes_per_step() : 0;
    s.model_state_peak_bytes = state_bytes_;
    return s;
  }

  int64_t BytesSent() const override { return groups().world->bytes_sent(); }
  std::string Describe() const override { return std::string(Name(parallel().strategy)); }
  int num_buckets() const override { return reducer_ ? reducer_->num_buckets() : 0; }

 protected:
  void BeforeMicroBatch(bool last, int64_t) override {
    if (reducer_) reducer_->Prepare(last);
  }
  double AfterMicroBatches() override { return reducer_ ? reducer_->Finish() : 0; }
  // Offload: the servers' state into the optimizer before rank 0 writes it.
  virtual absl::Status BeforeRankZeroWrites(int64_t) { return absl::OkStatus(); }

  std::vector<torch::Tensor> params_, trainable_;
  const int64_t state_bytes_;  // weights, gradients and (unless offloaded) optimizer state
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<GradientReducer> reducer_;
  // Where the graph's parameters and their AdamW moments are (their storage).
  std::vector<const void*> StateAddresses(torch::optim::AdamW& adamw) const {
    std::vector<const void*> out;
    for (const auto& p : graph_params_) {
      out.push_back(p.data_ptr());
      const auto& st = AdamWStateOf(adamw, p, "StateAddresses");
      out.push_back(st.exp_avg().data_ptr());
      out.push_back(st.exp_avg_sq().data_ptr());
    }
    return out;
  }

  // CUDA graphs: the step's graph, its inputs (the windows, the learning rate and AdamW's step
  // count), the parameters it updates and its outputs (the loss sum and the gradient norm).
  std::unique_ptr<StepGraphs> graphs_;
  std::string graph_shapes_;
  std::vector<torch::Tensor> graph_windows_, graph_params_;
  std::vector<torch::Tensor> updated_;        // the parameters the last eager step updated
  std::vector<const void*> graph_addresses_;  // StateAddresses at the capture
  torch::Tensor graph_lr_, graph_step_, graph_loss_, graph_norm_;
};

// DDP whose optimizer lives on the parameter servers: each rank reduces and pushes its slice of
// the gradients, the servers apply AdamW and the ranks pull the parameters back. The optimizer
// here (DDP's) only carries the state into and out of checkpoints.
class OffloadStrategy : public DdpStrategy {
 public:
  explicit OffloadStrategy(const StrategyInputs& in) : DdpStrategy(in, /*offloaded=*/true) {}

  std::string StepGraphBlocker() const override {
    return "parallel.strategy offload: the parameter servers apply the update, called from the "
           "host";
  }

  absl::Status Connect(int64_t step) {
    ASSIGN_OR_RETURN(offloaded_, OffloadOptimizer::Create(params_, *groups().world, in_.ps_ranges,
                                                          in_.offload, parallel().bucket_mb));
    if (rank0()) {
      Log(absl::StrCat("parameter-server connections: TCP congestion control ",
                       offloaded_->servers().TcpCongestionInUse()));
      Log(absl::StrCat("parameter-server transfers: ", offloaded_->servers().TransportSummary()));
    }
    return offloaded_->Initialize(step, *optimizer_);
  }

  absl::Status ComputeGradNorm(StepResult& r) override {
    ASSIGN_OR_RETURN(r.grad_norm, offloaded_->FinishBackward(&r.comm_wait_s));
    return absl::OkStatus();
  }
  // The parameter servers scale the gradients (clipping) as they apply AdamW.
  absl::Status OptimizerStep(double lr, double clip_scale, const StepResult&) override {
    return offloaded_->Step(lr, clip_scale);
  }
  absl::StatusOr<std::optional<SavedCheckpoint>> Save(const std::string& dir, int64_t step,
                                                      const MetaNotes& notes,
                                                      const ExtraState& extra) override {
    // delayed_update: the checkpoint holds the parameters after `step`'s update (every rank).
    RETURN_IF_ERROR(offloaded_->Flush());
    return DdpStrategy::Save(dir, step, notes, extra);
  }
  absl::Status GatherModel() override {
    RETURN_IF_ERROR(offloaded_->Flush());
    return DdpStrategy::GatherModel();
  }
  LayoutStepStats LayoutStats() const override {
    LayoutStepStats s = DdpStrategy::LayoutStats();
    s.log_fields = absl::StrFormat(" ps_push_bytes %d ps_pull_bytes %d", offloaded_->pushed_bytes(),
                                   offloaded_->pulled_bytes());
    return s;
  }
  int num_buckets() const override { return offloaded_->num_buckets(); }

 protected:
  void BeforeMicroBatch(bool last, int64_t step) override { offloaded_->Prepare(last, step + 1); }
  absl::Status BeforeRankZeroWrites(int64_t step) override {
    return offloaded_->ReadIntoShadow(step, *optimizer_);
  }

 private:
  std::unique_ptr<OffloadOptimizer> offloaded_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakeDdpStrategy(const StrategyInputs& inputs,
                                                                  Resumed* resumed) {
  auto strategy = std::make_unique<DdpStrategy>(inputs);
  RETURN_IF_ERROR(strategy->Resume(resumed));
  strategy->MakeReducer();
  return strategy;
}

absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakeOffloadStrategy(const StrategyInputs& inputs,
                                                                      Resumed* resumed) {
  auto strategy = std::make_unique<OffloadStrategy>(inputs);
  RETURN_IF_ERROR(strategy->Resume(resumed));
  RETURN_IF_ERROR(strategy->Connect(resumed->step));
  return strategy;
}

}  // namespace trainyard::trainer
