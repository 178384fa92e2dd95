// RunTrainer (see trainer.h): the Trainer sets the run up and drives the step loop; what differs
// between parallel layouts is its ParallelStrategy's (strategy/strategy.h), what a step reports
// its StepReporter's (control/step_report.h).
#include "worker/trainer/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/lr_schedule.h"
#include "common/mfu.h"
#include "common/status_macros.h"
#include "worker/trainer/checkpoint/checkpoint.h"
#include "worker/trainer/checkpoint/export.h"
#include "worker/trainer/checkpoint/hf_weights.h"
#include "worker/trainer/checkpoint/retention.h"
#include "worker/trainer/checkpoint/settings.h"
#include "worker/trainer/comm/cuda_support.h"
#include "worker/trainer/control/reporter.h"
#include "worker/trainer/control/step_report.h"
#include "worker/trainer/control/stop_signal.h"
#include "worker/trainer/io/data.h"
#include "worker/trainer/io/hf_checkpoint.h"
#include "worker/trainer/kernels/blas.h"
#include "worker/trainer/kernels/dense.h"
#include "worker/trainer/kernels/matmul_choice.h"
#include "worker/trainer/kernels/onednn_matmul.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/fused_adamw.h"
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/parallel/parallel_dims.h"
#include "worker/trainer/runtime/batches.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/profiler.h"
#include "worker/trainer/runtime/step_graph.h"
#include "worker/trainer/runtime/torch_compat.h"
#include "worker/trainer/strategy/strategy.h"

#if TRAINYARD_TORCH2  // CUDA's events, for the read-back without a wait (torch_compat.h)
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#endif

namespace trainyard::trainer {
namespace {

using Clock = std::chrono::steady_clock;

void Log(const std::string& line) {
  std::cout << line << std::endl;  // flushed: the worker ships lines as they come
}

// One rank's training run: Setup (the data, the layout and its groups, the model, its strategy and
// a resumed checkpoint), then Step until the last step or a stop, then Finish. The loop knows no
// parallel layout: its ParallelStrategy does. Members are declared in the order the run makes
// them, so that they go in the reverse one (the communicators last).
class Trainer {
 public:
  explicit Trainer(const TrainerOptions& o)
      : o_(o), spec_(o.job), m_(o.job.model), t_(o.job.train), rank0_(o.rank == 0) {}

  absl::Status Run() {
    RETURN_IF_ERROR(Setup());
    bool stop = false;
    while (step_ < t_.steps && !stop) {
      ASSIGN_OR_RETURN(stop, Step());
    }
    return Finish();
  }

 private:
  // What one step measured, for its report.
  struct StepStats {
    Clock::time_point start;
    int64_t bytes_before = 0;
    StepResult r;                  // the strategy's: loss, gradient norm, backward and waits
    bool inject_overflow = false;  // fp16 tests: this step's loss scaled by inf on rank 0
    bool overflow = false;         // fp16: inf or NaN gradients, the update skipped
    double loss_scale = 0;         // fp16: the scale after the step's update, and the steps
    int64_t skipped_steps = 0;     // skipped so far (the report comes a step later)
    double lr = 0;
    int64_t comm_bytes = 0;
    int64_t step = 0;                 // optimizer steps done after it
    std::optional<double> eval_loss;  // train.eval_every: when an evaluation ran after it
    std::vector<double> idle;         // pipeline: this rank's stage idle shares (StageIdleShares)
    // The loss and gradient norm on their way to the host (StartReadBack): CUDA's copy into
    // pinned memory and the event after it; undefined once read (or on the CPU, where they are
    // read already).
    torch::Tensor host_values;
    std::shared_ptr<void> copied;  // a c10::Event (CUDA), recorded after the copy
    Clock::time_point ready;       // when the host had its values
  };
  // What every rank agrees on after a step (one small all-reduce): the flags of the step just run,
  // the loss and stage idle shares of the step being reported.
  struct Agreement {
    bool checkpoint_requested = false, stop_requested = false, sigterm = false;
    double loss = 0;
    std::vector<double> stage_idle;  // pipeline: each stage's idle share of the schedule
  };

  absl::Status Setup();
  absl::Status MakeModel();
  absl::Status BuildStrategy();
  // The fp32 CPU matmul path (kernels/matmul_choice.h): TRAINYARD_MATMUL's, or rank 0 times both
  // on this rank's shapes of the model and every rank takes its choice (the replicas round alike).
  absl::Status ChooseMatmuls();
  absl::Status BuildLoop();
  // CUDA graphs (runtime/step_graph.h): on where the plan allows, the rank then queueing its work
  // on a stream of its own.
  void PlanGraphs();
  void LogSetup() const;

  // One optimizer step, its report and checkpoint; true when the run stops after it.
  absl::StatusOr<bool> Step();
  StepWork Work(StepStats& s);
  absl::Status Update(StepStats& s);
  // The step's loss and gradient norm to the host without waiting for the device: on CUDA one
  // non-blocking copy queued behind the step's kernels; FinishReadBack waits for it, by when the
  // next step's work is queued (so the device never idles while the host waits).
  void StartReadBack(StepStats& s);
  void FinishReadBack(StepStats& s);
  // The flags of the step just run (every rank), with `reported`'s loss and idle shares when
  // not null. `take_flags` false: the flags stay for the next agreement (a step's second one).
  Agreement Agree(const StepStats* reported, bool take_flags = true);
  void Report(const StepStats& s, const Agreement& a);
  absl::Status Checkpoint(const std::optional<double>& eval_loss);
  absl::Status Finish();
  // train.eval_every: the mean loss over the held-out windows, the same every time: each replica
  // forwards its share (no autograd), the counting ranks' sums added over the ranks. Every rank
  // calls it.
  double Evaluate();

  const TrainerOptions& o_;
  const JobConfig& spec_;
  ModelConfig m_;  // the spec's, with model.from's config.json sizes
  const TrainConfig& t_;
  const bool rank0_;
  torch::Device device_{torch::kCPU};
  ParallelDims dims_;
  std::unique_ptr<HfCheckpoint> hf_checkpoint_;  // model.from, until its weights are loaded
  std::vector<PsRangeRef> ps_ranges_;
  TrainingData data_;
  std::string settings_;  // TrainingSettings, recorded in every checkpoint
  CommGroups groups_;
  std::shared_ptr<LanguageModel> model_;
  std::vector<torch::Tensor> params_;
  OptimizerHyper hyper_;
  std::unique_ptr<ParallelStrategy> strategy_;
  ExtraState extra_state_;  // amp.pt of the checkpoint resumed from
  int64_t step_ = 0;
  int64_t run_start_step_ = 0;
  std::optional<LossScaler> scaler_;  // fp16: dynamic loss scaling, its state in checkpoints
  std::unique_ptr<Reporter> reporter_;
  std::unique_ptr<StepReporter> step_reporter_;  // rank 0
  std::optional<DistributedSampler> sampler_;
  // The last step whose report waits for the next step (its values read back meanwhile), and when
  // the host had the values of the last step reported.
  std::optional<StepStats> pending_;
  Clock::time_point last_ready_;
  std::optional<MatmulPath> pinned_matmuls_;  // TRAINYARD_MATMUL
  std::string matmuls_;                       // the choice and why, for the log ("": none made)
  std::string graphs_;                        // CUDA graphs: on, or off and why ("": the CPU)
  int64_t params_count_ = 0, trainable_count_ = 0;
  StepProfiler profiler_;  // rank 0: --profile-steps
  // Rank 0's MFU (common/mfu.h): the model's FLOPs a token, each GPU's peak (0: unknown, none).
  double flops_per_token_ = 0, peak_flops_ = 0;
};

absl::Status Trainer::Setup() {
  if (spec_.export_format != ExportFormat::kNone && o_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("checkpoint.export: the trainer has no --checkpoint-dir");
  }
  ASSIGN_OR_RETURN(hf_checkpoint_, OpenModelFrom(&m_));
  // Bad input fails here, before this rank makes the others wait at the rendezvous.
  ASSIGN_OR_RETURN(device_, ResolveDevice(o_.device));
  ASSIGN_OR_RETURN(pinned_matmuls_, MatmulPathFromEnvironment());
  if (rank0_) {
    ASSIGN_OR_RETURN(profiler_,
                     StepProfiler::Make(o_.profile_steps, o_.profile_out, device_.is_cuda()));
  }
  ASSIGN_OR_RETURN(dims_,
                   ParallelDims::Make(spec_, m_, o_.rank, o_.world_size, o_.local_world_size));
  ASSIGN_OR_RETURN(ps_ranges_, OffloadRanges(dims_, o_.ps_ranges));
  ASSIGN_OR_RETURN(data_, LoadTrainingData(spec_.data, m_));
  torch::set_num_threads(o_.threads);
  SetBlasThreads(o_.threads);
  ASSIGN_OR_RETURN(groups_, BuildGroups(dims_, device_,
                                        {o_.coordinator, o_.job_id, o_.attempt, o_.gloo_hostname}));
  RETURN_IF_ERROR(MakeModel());
  RETURN_IF_ERROR(BuildStrategy());
  RETURN_IF_ERROR(ChooseMatmuls());
  RETURN_IF_ERROR(BuildLoop());
  PlanGraphs();
  LogSetup();
  return absl::OkStatus();
}

absl::Status Trainer::MakeModel() {
  ModelOptions model_options;
  // On a GPU autocast picks each operation's precision; on the CPU the model runs its Linear
  // layers in bf16 itself. fp16 on the CPU scales the loss as on a GPU but computes in fp32
  // (Debian's LibTorch has no fp16 CPU matmuls).
  model_options.bf16 = t_.precision == Precision::kBf16 && !device_.is_cuda();
  model_options.activation_checkpointing = t_.activation_checkpointing;
  model_options.fused_norms = o_.fused_norm != "off";
  SetGpuLinearEnabled(o_.fused_linear != "off");
  SetFusedLossChunkBytes(o_.loss_chunk_mib << 20);
  SetOwnAdamWKernel(o_.adamw_kernel != "torch");
  SetGemmTuning(o_.gemm_tune != "off");
  model_options.lora = t_.lora;
  model_options.materialize = !dims_.from_rank0 || rank0_;
  model_ = BuildModel(m_, model_options, t_.seed);
  // fp16: the loss scale must reach the logits' gradient before it is rounded to fp16 (small
  // probabilities would underflow); the fused loss applies the scale after, so fp16 keeps the
  // plain head.
  if (o_.fused_loss == "off" || t_.precision == Precision::kFp16) {
    model_->set_fused_loss(LanguageModel::FusedLoss::kOff);
  }
  // The checkpoint's weights, on the ranks whose parameters are not sent to them from rank 0.
  if (hf_checkpoint_ != nullptr && model_options.materialize &&
      (rank0_ || dims_.every_rank_loads)) {
    RETURN_IF_ERROR(LoadHfWeights(*hf_checkpoint_, *model_));
    if (rank0_) Log(absl::StrCat("loaded ", hf_checkpoint_->size(), " tensors from ", m_.from));
  }
  hf_checkpoint_.reset();  // unmapped
  // In place: the parameters keep their identity (the optimizer's state keys). Parameters this
  // rank did not materialize (FSDP's from rank 0) get an empty storage on the device, as they had
  // on the CPU: nothing to copy.
  if (device_.is_cuda()) MoveModel(*model_, device_);
  params_ = model_->parameters();
  params_count_ = CountElements(params_);
  trainable_count_ = CountElements(TrainableParameters(*model_));
  if (rank0_ && (device_.is_cuda() || o_.peak_tflops > 0)) {  // (the CPU's: given only)
    flops_per_token_ = ModelFlopsPerToken(params_count_, m_.n_layer, m_.d_model, m_.seq_len,
                                          params_count_ - trainable_count_);
    peak_flops_ =
        PeakFlops(device_.is_cuda() ? CudaDeviceName(std::max<int>(device_.index(), 0)) : "",
                  t_.precision != Precision::kFp32, o_.peak_tflops);
  }
  // train.optimizer (AdamW's betas (0.9, 0.95) as in GPT-3 / nanoGPT, unless the spec sets its
  // constants); weight decay on every parameter that trains but the kinds train.no_weight_decay
  // names.
  hyper_ = HyperFor(t_);
  settings_ = TrainingSettings(t_, hyper_);
  return absl::OkStatus();
}

// The layout's strategy, resumed from the latest checkpoint; a resume keeps the settings its
// checkpoint was trained with (every rank reads the same one).
absl::Status Trainer::BuildStrategy() {
  if (!o_.checkpoint_dir.empty()) {
    ASSIGN_OR_RETURN(const std::optional<CheckpointInfo> latest,
                     FindLatestCheckpoint(o_.checkpoint_dir));
    if (latest.has_value()) {
      RETURN_IF_ERROR(CheckResumeSettings(latest->path, settings_, t_.optimizer));
    }
  }
  StrategyInputs in;
  in.model = model_.get();
  in.dims = &dims_;
  in.groups = &groups_;
  in.train = &t_;
  in.parallel = &spec_.parallel;
  in.hyper = hyper_;
  in.device = device_;
  in.checkpoint_dir = o_.checkpoint_dir;
  in.ps_ranges = std::move(ps_ranges_);
  PsClientConfig& servers = in.offload.servers;
  servers.job_id = o_.job_id;
  servers.attempt = o_.attempt;
  servers.beta1 = hyper_.beta1;
  servers.beta2 = hyper_.beta2;
  servers.eps = hyper_.eps;
  servers.weight_decay = hyper_.weight_decay;
  servers.rpc_timeout = absl::Seconds(o_.ps_rpc_timeout_s);
  servers.tcp_congestion = o_.ps_tcp_congestion;
  servers.transport = o_.ps_transport;
  in.offload.delayed_update = spec_.parallel.delayed_update;
  in.log = &Log;
  Resumed resumed;
  ASSIGN_OR_RETURN(strategy_, MakeStrategy(in, &resumed));
  step_ = resumed.step;
  extra_state_ = std::move(resumed.extra);
  return absl::OkStatus();
}

absl::Status Trainer::ChooseMatmuls() {
  if (device_.is_cuda() || !OneDnnMatmulsAvailable()) return absl::OkStatus();  // no choice
  if (pinned_matmuls_.has_value()) {
    SetMatmulPath(*pinned_matmuls_);
    matmuls_ = absl::StrCat(MatmulPathName(*pinned_matmuls_), " (TRAINYARD_MATMUL)");
    return absl::OkStatus();
  }
  MatmulPath path = MatmulPath::kOneDnn;
  if (rank0_) {
    // bf16 on the CPU: the Linear layers compute in bf16 (torch's), the attention in fp32.
    const MatmulWork work =
        GemmWorkOf(*model_, m_, t_.micro_batch, t_.precision != Precision::kBf16);
    if (!work.empty()) {
      const MatmulTiming timing = TimeMatmulPaths(work);
      path = timing.path;
      matmuls_ = timing.Describe();
    }
  }
  if (o_.world_size > 1) {
    torch::Tensor choice = torch::full({1}, static_cast<float>(path));
    groups_.world->Broadcast({choice}, 0);
    path = static_cast<MatmulPath>(static_cast<int>(choice.item<float>()));
    if (!rank0_) matmuls_ = absl::StrCat(MatmulPathName(path), " (rank 0's timing)");
  }
  SetMatmulPath(path);
  return absl::OkStatus();
}

// The loop's parts: loss scaling, reports and the sampler.
absl::Status Trainer::BuildLoop() {
  if (t_.precision == Precision::kFp16) {
    scaler_.emplace();
    if (!extra_state_.empty()) RETURN_IF_ERROR(scaler_->SetState(extra_state_));
  }
  if (rank0_ && !o_.job_id.empty()) {
    reporter_ = std::make_unique<Reporter>(o_.coordinator, o_.job_id, o_.attempt, o_.rank, &Log);
  }
  if (rank0_) {
    ASSIGN_OR_RETURN(step_reporter_, StepReporter::Open(o_.metrics_file, reporter_.get(), &Log));
  }
  sampler_.emplace(data_.num_samples, t_.seed, t_.micro_batch, strategy_->micro_batches(),
                   strategy_->replicas(), strategy_->replica());
  run_start_step_ = step_;
  return absl::OkStatus();
}

void Trainer::PlanGraphs() {
  StepGraphFacts facts;
  facts.requested = o_.cuda_graphs != "off";
  facts.cuda = device_.is_cuda();
  facts.can_capture = CudaGraphsBuilt();
  facts.layout_blocker = strategy_->StepGraphBlocker();
  facts.precision = t_.precision;
  facts.optimizer = t_.optimizer;
  facts.loss_mask = !data_.loss_mask.empty();
  facts.lora_dropout = t_.lora.enabled() && t_.lora.dropout > 0;
  const StepGraphPlan plan = PlanStepGraphs(facts);
  if (!plan.on) {
    if (!plan.why_not.empty()) graphs_ = absl::StrCat("off (", plan.why_not, ")");
    return;
  }
  UseStreamOfItsOwn(std::max<int>(device_.index(), 0));
  strategy_->UseStepGraphs(std::make_unique<StepGraphs>(&CaptureCudaGraph, &Log));
  graphs_ = absl::StrCat("on (the step captured after ", StepGraphs::kWarmupSteps,
                         " eager steps, then replayed)");
}

void Trainer::LogSetup() const {
  Log(absl::StrFormat(
      "trainer rank %d/%d: %s model, %d parameters%s, %d tokens (%d samples), global batch %d, "
      "%d buckets, %s, optimizer %s, steps %d..%d",
      o_.rank, o_.world_size, m_.kind, params_count_,
      t_.lora.enabled() ? absl::StrFormat(" (%d trainable: LoRA r %d on %s)", trainable_count_,
                                          t_.lora.r, absl::StrJoin(t_.lora.target_modules, ","))
                        : "",
      data_.train.size(), data_.num_samples, sampler_->global_batch(), strategy_->num_buckets(),
      strategy_->Describe(), Name(t_.optimizer), step_, t_.steps));
  Log(absl::StrCat(
      "collectives: ", groups_.world->Describe(),
      groups_.host ? absl::StrCat("; the step's agreement over ", groups_.host->Describe()) : ""));
  Log(absl::StrCat("device: ", DescribeDevice(device_), "; precision ", Name(t_.precision),
                   device_.is_cuda() && t_.precision != Precision::kFp32
                       ? " (autocast, fp32 master weights)"
                       : "",
                   scaler_ ? absl::StrCat(", dynamic loss scale from ", scaler_->scale()) : "",
                   strategy_->UsesModelLoss() &&
                           model_->UsesFusedLoss(device_, int64_t{t_.micro_batch} * m_.seq_len)
                       ? "; fused LM head + cross-entropy"
                       : ""));
  if (!matmuls_.empty()) Log(absl::StrCat("matmuls: ", matmuls_));
  if (!graphs_.empty()) Log(absl::StrCat("cuda graphs: ", graphs_));
  if (device_.is_cuda()) CudaResetPeak();
}

// A step reports one step behind: its loss and gradient norm travel to the host while the next
// step runs (no wait for the device inside a step), and that step's agreement carries them. A step
// that checkpoints, evaluates, stops or ends the run reports at once: its line comes before what
// follows it, and no step goes unreported.
absl::StatusOr<bool> Trainer::Step() {
  StepStats s;
  s.start = Clock::now();
  s.bytes_before = strategy_->BytesSent();
  profiler_.Before(step_ + 1);
  StepWork work = Work(s);
  s.lr = ScheduledLearningRate(step_, t_);
  if (!strategy_->GraphedStep(work, s.lr, s.r)) {
    strategy_->ForwardBackward(work, s.r);
    RETURN_IF_ERROR(Update(s));
  }
  if (scaler_) {
    s.loss_scale = scaler_->scale();
    s.skipped_steps = scaler_->skipped_steps();
  }
  StartReadBack(s);
  s.step = ++step_;
  if (absl::Status traced = profiler_.After(step_); !traced.ok()) {
    Log(absl::StrCat("no trace of the steps: ", traced.message()));
  } else if (step_ == profiler_.last_step()) {
    Log(absl::StrCat("traced steps ", o_.profile_steps, " into ", o_.profile_out));
  }
  s.comm_bytes = strategy_->BytesSent() - s.bytes_before;  // before the flags' all-reduce
  s.idle = strategy_->StageIdleShares();
  // The previous step's values (its time is when they came back); this step's too before an
  // evaluation, which waits for the device and is no part of either step's time.
  if (pending_) FinishReadBack(*pending_);
  // train.eval_every (and after the last step): every rank knows when.
  const bool evaluate =
      data_.eval && ((t_.eval_every > 0 && step_ % t_.eval_every == 0) || step_ == t_.steps);
  if (evaluate) {
    FinishReadBack(s);
    const double loss = Evaluate();
    if (std::isfinite(loss)) s.eval_loss = loss;
  }
  const Agreement a = Agree(pending_ ? &*pending_ : nullptr);
  if (pending_ && rank0_) Report(*pending_, a);
  pending_.reset();

  const bool stop_after = o_.stop_after_steps > 0 && step_ - run_start_step_ >= o_.stop_after_steps;
  const bool stop = a.stop_requested || a.sigterm || stop_after;
  const int64_t every = spec_.checkpoint_every_steps;
  const bool checkpoint =
      !o_.checkpoint_dir.empty() &&
      (stop || a.checkpoint_requested || step_ == t_.steps || (every > 0 && step_ % every == 0));
  const std::optional<double> eval_loss = s.eval_loss;
  if (checkpoint || stop || evaluate || step_ == t_.steps) {
    FinishReadBack(s);
    const Agreement now = Agree(&s, /*take_flags=*/false);
    if (rank0_) Report(s, now);
  } else {
    pending_ = std::move(s);
  }
  if (checkpoint) RETURN_IF_ERROR(Checkpoint(eval_loss));
  if (stop) {
    Log(absl::StrCat("stopping after step ", step_, " (",
                     a.sigterm          ? "SIGTERM"
                     : a.stop_requested ? "stop requested"
                                        : "--stop-after-steps",
                     ")"));
  }
  return stop;
}

// The step's micro-batches for the strategy: their windows, their losses (a masked loss is the
// mean over the targets the whole global batch counts, however they fall on ranks and
// micro-batches), the loss scale and LoRA dropout's seeds.
StepWork Trainer::Work(StepStats& s) {
  StepWork w;
  w.step = step_;
  // fp16: the loss is scaled before backward (an injected overflow scales it by inf on rank 0:
  // every gradient becomes inf or NaN, as a real fp16 overflow makes them).
  s.inject_overflow = scaler_ && o_.inject_overflow_step == step_ + 1 && rank0_;
  if (scaler_) {
    w.loss_scale = s.inject_overflow ? std::numeric_limits<double>::infinity() : scaler_->scale();
  }
  const int64_t step = step_;
  const int accumulation = strategy_->micro_batches();
  const double weight =
      data_.loss_mask.empty()
          ? 0
          : static_cast<double>(strategy_->replicas()) /
                static_cast<double>(std::max<int64_t>(
                    1, CountedTargets(data_.loss_mask, sampler_->GlobalBatch(step), m_.seq_len,
                                      /*last_only=*/m_.kind == "mlp")));
  // Each micro-batch's windows, drawn once: its tokens and its loss weights read them.
  auto samples = std::make_shared<std::vector<std::vector<int64_t>>>();
  for (int micro = 0; micro < accumulation; ++micro) {
    samples->push_back(sampler_->MicroBatch(step, micro));
  }
  auto mask = [this, samples](int micro) {
    return ToDevice(MaskWeights(data_.loss_mask, (*samples)[micro], m_.seq_len), device_);
  };
  w.micro.count = accumulation;
  w.micro.windows = [this, samples](int micro) {
    return ToDevice(MakeBatch(data_.train, (*samples)[micro], m_.seq_len), device_);
  };
  w.micro.loss = [=](int micro, const torch::Tensor& windows) {
    if (data_.loss_mask.empty()) return model_->Loss(windows) / accumulation;
    return model_->MaskedLossSum(windows, mask(micro)) * weight;
  };
  w.micro.loss_of = [=](int micro, const torch::Tensor& logits, const torch::Tensor& windows) {
    if (data_.loss_mask.empty()) return model_->LossOf(logits, windows) / accumulation;
    return model_->MaskedLossSumOf(logits, windows, mask(micro)) * weight;
  };
  if (t_.lora.dropout > 0) {
    w.seed_dropout = [this, step](int micro) {
      torch::manual_seed(DropoutSeed(t_.seed, o_.rank, step, micro));
    };
  }
  return w;
}

// The optimizer's update with the step's learning rate (s.lr, set by Step) and clipping, or under
// fp16 a skipped step when the gradients overflowed.
absl::Status Trainer::Update(StepStats& s) {
  // fp16: the gradients divided by the loss scale; an inf or NaN among them (the same on every
  // rank: they were summed) skips this step's update.
  s.overflow = scaler_ && scaler_->Unscale(params_);
  const double scale_used = scaler_ ? scaler_->scale() : 1.0;
  if (scaler_) scaler_->Update(s.overflow);
  if (s.overflow) {
    // Skipped, as GradScaler skips optimizer.step(): parameters and optimizer state stay.
    s.r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
    Log(absl::StrFormat("step %d skipped: inf or NaN gradients in fp16%s; loss scale %g -> %g",
                        step_ + 1, s.inject_overflow ? " (injected)" : "", scale_used,
                        scaler_->scale()));
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(strategy_->ComputeGradNorm(s.r));
  const double norm = s.r.grad_norm, clip = t_.grad_clip;
  const double clip_scale = clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
  return strategy_->OptimizerStep(s.lr, clip_scale, s.r);
}

void Trainer::StartReadBack(StepStats& s) {
  StepResult& r = s.r;
  std::vector<torch::Tensor> parts;
  if (r.loss_device.defined()) parts.push_back(r.loss_device.reshape({1}));
  if (r.grad_norm_device.defined()) {
    parts.push_back(r.grad_norm_device.to(torch::kDouble).reshape({1}));
  }
  if (parts.empty()) {  // the CPU's strategies have them on the host already
    s.ready = Clock::now();
    return;
  }
  // From CUDA, a non-blocking copy lands in pinned memory; the event says when it has.
  s.host_values =
      torch::cat(parts).to(torch::TensorOptions().device(torch::kCPU), /*non_blocking=*/true);
#if TRAINYARD_TORCH2
  if (device_.is_cuda()) {
    auto event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    event->record(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device_));
    s.copied = std::move(event);
  }
#endif
}

void Trainer::FinishReadBack(StepStats& s) {
  if (!s.host_values.defined()) return;
#if TRAINYARD_TORCH2
  if (s.copied) static_cast<c10::Event*>(s.copied.get())->synchronize();
#endif
  s.ready = Clock::now();
  StepResult& r = s.r;
  const double* v = s.host_values.data_ptr<double>();
  if (r.loss_device.defined()) r.loss_sum += *v++;
  if (r.grad_norm_device.defined()) r.grad_norm = *v;
  s.host_values = torch::Tensor();
  s.copied.reset();
  // (The device tensors go with the step's stats; nothing reads them again.)
  r.loss_device = torch::Tensor();
  r.grad_norm_device = torch::Tensor();
}

// One tiny all-reduce per step: the flags every rank must agree on (coordinator commands reach
// rank 0 only; SIGTERM may reach any rank), and for the step being reported its global mean loss
// and, under a pipeline, each stage's idle share of the schedule.
Trainer::Agreement Trainer::Agree(const StepStats* reported, bool take_flags) {
  TrainerCommands commands;
  if (reporter_ && take_flags) commands = reporter_->TakeCommands();
  const bool signalled = take_flags && TakeStopSignal();
  const double loss_sum = reported != nullptr && strategy_->CountsLoss() ? reported->r.loss_sum : 0;
  std::vector<double> flags = {loss_sum, commands.checkpoint_requested ? 1.0 : 0.0,
                               commands.stop_requested ? 1.0 : 0.0, signalled ? 1.0 : 0.0};
  const std::vector<double> idle = reported != nullptr ? reported->idle : std::vector<double>();
  flags.insert(flags.end(), idle.begin(), idle.end());
  torch::Tensor agree = torch::tensor(flags, torch::kDouble);
  groups_.Host().AllReduceSum({agree})->Wait();
  Agreement a;
  const double* v = agree.data_ptr<double>();
  // The loss is the last stages' under pipeline parallelism (one per replica).
  a.loss = v[0] / strategy_->replicas();
  a.checkpoint_requested = v[1] > 0;
  a.stop_requested = v[2] > 0;
  a.sigterm = v[3] > 0;
  a.stage_idle.assign(v + 4, v + 4 + idle.size());
  return a;
}

// Rank 0: the step's line in the log, the --metrics-file and the report to the coordinator.
void Trainer::Report(const StepStats& s, const Agreement& a) {
  StepRecord r;
  r.step = s.step;
  r.total_steps = t_.steps;
  r.loss = a.loss;
  r.lr = s.lr;
  r.grad_norm = s.r.grad_norm;
  // From its start, or from when the previous step's values came back if that was later (the
  // host queues a CUDA step while the device still runs the one before); without the evaluation,
  // which has a line of its own.
  r.step_seconds = std::chrono::duration<double>(s.ready - std::max(s.start, last_ready_)).count();
  last_ready_ = s.ready;
  r.tokens_per_second =
      sampler_->global_batch() * model_->TokensPerWindow() / std::max(r.step_seconds, 1e-9);
  // Over world_size GPUs like rank 0's (ranks sharing one GPU through Gloo, as tests do,
  // under-report by their number).
  if (peak_flops_ > 0) {
    r.mfu = Mfu(r.tokens_per_second, flops_per_token_, peak_flops_, o_.world_size);
  }
  if (!device_.is_cuda()) r.backward_seconds = s.r.backward_s;
  r.comm_wait_seconds = s.r.comm_wait_s;
  r.comm_bytes = s.comm_bytes;
  r.stage_idle = a.stage_idle;
  r.layout = strategy_->LayoutStats();
  if (scaler_) r.loss_scale = {s.loss_scale, s.overflow, s.skipped_steps};
  if (device_.is_cuda()) r.device_peak_bytes = CudaPeakAllocatedBytes();
  r.eval_loss = s.eval_loss;
  r.eval_windows = data_.eval_windows;
  step_reporter_->Report(r);
}

absl::Status Trainer::Checkpoint(const std::optional<double>& eval_loss) {
  ASSIGN_OR_RETURN(const std::optional<SavedCheckpoint> saved,
                   strategy_->Save(o_.checkpoint_dir, step_, {settings_, eval_loss},
                                   scaler_ ? scaler_->State() : ExtraState{}));
  if (!rank0_ || !saved.has_value()) return absl::OkStatus();
  const CheckpointInfo& info = saved->info;
  Log(absl::StrCat("checkpoint step ", info.step, " path ", info.path, " bytes ", info.bytes,
                   saved->kind));
  const CheckpointReport report = RetainAfterCheckpoint(
      o_.checkpoint_dir, {spec_.checkpoint_keep_last, spec_.checkpoint_keep_best}, info.step,
      info.path, info.bytes, &Log);
  if (reporter_) reporter_->ReportCheckpoint(report);
  return absl::OkStatus();
}

// After the last step (or a stop): the parameter dump, a sample of what the model learned and
// the export, each from the whole model on the CPU.
absl::Status Trainer::Finish() {
  RETURN_IF_ERROR(strategy_->GatherModel());
  if (!o_.dump_params.empty() && strategy_->HoldsWholeModel()) {
    RETURN_IF_ERROR(WriteParameterDump(o_.dump_params, *model_));
  }
  // What the model learned, for people: rank 0 of a finished byte-level run writes a sample.
  if (rank0_ && step_ == t_.steps && spec_.data.format == "bytes") {
    const std::string prompt = "The ";
    model_->eval();
    const std::vector<int64_t> sampled =
        Generate(*model_, std::vector<int64_t>(prompt.begin(), prompt.end()), 240,
                 /*temperature=*/0.8, t_.seed, m_.seq_len);
    std::string text = prompt;
    for (int64_t token : sampled) text.push_back(static_cast<char>(token & 0xff));
    Log("sample (temperature 0.8):");
    for (absl::string_view line : absl::StrSplit(text, '\n')) Log(absl::StrCat("| ", line));
  }
  if (rank0_ && step_ == t_.steps && spec_.export_format != ExportFormat::kNone) {
    RETURN_IF_ERROR(WriteJobExport(m_, t_.lora, *model_, spec_.export_format, o_.checkpoint_dir));
    Log(absl::StrCat("exported the ",
                     t_.lora.enabled() && spec_.export_format == ExportFormat::kHf
                         ? "LoRA adapter (PEFT)"
                         : "model (Hugging Face)",
                     " to ", o_.checkpoint_dir, "/export"));
  }
  Log(absl::StrCat("trainer rank ", o_.rank, " done at step ", step_));
  return absl::OkStatus();
}

double Trainer::Evaluate() {
  torch::NoGradGuard no_grad;
  model_->eval();  // no LoRA dropout
  // The first eval_windows (or eval_batches global batches of them), each replica its share.
  const int64_t total =
      t_.eval_batches > 0
          ? std::min(data_.eval_windows, int64_t{t_.eval_batches} * sampler_->global_batch())
          : data_.eval_windows;
  const EvalShare share =
      PlanEvalShare(total, strategy_->replica(), strategy_->replicas(), t_.micro_batch);
  const int micro_batches = static_cast<int>(share.windows.size());
  const std::vector<std::vector<int64_t>>& samples = share.windows;
  std::vector<torch::Tensor> weights(micro_batches);  // of each micro-batch's targets
  double count = 0;
  for (int b = 0; b < micro_batches; ++b) {
    weights[b] = data_.eval_mask.empty() ? torch::ones({t_.micro_batch, m_.seq_len}, torch::kFloat)
                                         : MaskWeights(data_.eval_mask, samples[b], m_.seq_len);
    for (int j = 0; j < t_.micro_batch; ++j) {
      if (share.padding[b][j]) weights[b][j].zero_();
    }
    // The MLP predicts each window's last token only.
    const torch::Tensor& w = weights[b];
    count += (m_.kind == "mlp" ? w.select(1, m_.seq_len - 1) : w).sum().item<double>();
  }
  MicroBatches batches;
  batches.count = micro_batches;
  batches.windows = [&](int b) {
    return ToDevice(MakeBatch(*data_.eval, samples[b], m_.seq_len), device_);
  };
  batches.loss = [&](int b, const torch::Tensor& windows) {
    return model_->MaskedLossSum(windows, ToDevice(weights[b], device_));
  };
  batches.loss_of = [&](int b, const torch::Tensor& logits, const torch::Tensor& windows) {
    return model_->MaskedLossSumOf(logits, windows, ToDevice(weights[b], device_));
  };
  double sum = strategy_->EvalLossSum(batches);
  model_->train();
  // One rank of a tensor-parallel group counts (all compute the sum); the last stage's.
  if (!strategy_->CountsLoss()) sum = count = 0;
  torch::Tensor both = torch::tensor({sum, count}, torch::kDouble);
  groups_.Host().AllReduceSum({both})->Wait();
  const double total_count = both[1].item<double>();
  if (total_count == 0) {
    Log("eval: data.eval_loss_mask counts no target of the held-out windows; no eval_loss");
    return std::numeric_limits<double>::quiet_NaN();
  }
  return both[0].item<double>() / total_count;
}

absl::Status Train(const TrainerOptions& o) { return Trainer(o).Run(); }

}  // namespace

absl::Status RunConsolidate(const std::string& sharded, const std::string& out_dir) {
  return ConsolidateCheckpoint(sharded, out_dir, &Log);
}

absl::Status RunExportHf(const JobConfig& job, const std::string& checkpoint_dir,
                         const std::string& out_dir, bool merge_lora) {
  return ExportCheckpointToHf(job, checkpoint_dir, out_dir, merge_lora, &Log);
}

std::string DescribeCompute() {
  return absl::StrCat("LibTorch ", TorchVersionString(), CudaBuild() ? " (CUDA)" : "", "\n",
                      DescribeBlas(), "\n", DescribeMatmuls());
}

std::string SupportedDevices() { return CudaUsable() ? "cpu cuda" : "cpu"; }

absl::Status RunTrainer(const TrainerOptions& options) {
  try {
    return Train(options);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    std::replace(what.begin(), what.end(), '\n', ' ');
    return absl::InternalError(absl::StrCat("rank ", options.rank, ": LibTorch: ", what));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("rank ", options.rank, ": ", e.what()));
  }
}

}  // namespace trainyard::trainer
