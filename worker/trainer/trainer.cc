// RunTrainer (see trainer.h): setup, the step loop, and the rank-0 reporter that talks to the
// coordinator's TrainerService from its own thread so that a slow or missing coordinator never
// stalls training.
#include "worker/trainer/trainer.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/lr_schedule.h"
#include "common/status_macros.h"
#include "worker/trainer/checkpoint/checkpoint.h"
#include "worker/trainer/checkpoint/fsdp_checkpoint.h"
#include "worker/trainer/checkpoint/hf_weights.h"
#include "worker/trainer/checkpoint/retention.h"
#include "worker/trainer/checkpoint/staged_checkpoint.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/comm/coordinator_store.h"
#include "worker/trainer/comm/cuda_support.h"
#include "worker/trainer/control/reporter.h"
#include "worker/trainer/io/data.h"
#include "worker/trainer/io/hf_checkpoint.h"
#include "worker/trainer/io/param_dump.h"
#include "worker/trainer/kernels/blas.h"
#include "worker/trainer/kernels/onednn_matmul.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/fused_adamw.h"
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/parallel/ddp.h"
#include "worker/trainer/parallel/fsdp.h"
#include "worker/trainer/parallel/offload.h"
#include "worker/trainer/parallel/parallel_dims.h"
#include "worker/trainer/parallel/pipeline.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

void Log(const std::string& line) {
  std::cout << line << std::endl;  // flushed: the worker ships lines as they come
}

volatile std::sig_atomic_t sigterm_received = 0;

void OnSigterm(int) { sigterm_received = 1; }

// True once SIGTERM arrived (see InstallSigtermHandler). Consumes it.
bool TakeSigterm() {
  if (sigterm_received == 0) return false;
  sigterm_received = 0;
  return true;
}

int64_t ResidentBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// This process's CPU time so far, user and system.
double CpuSeconds() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The windows of `samples` as a [batch, seq_len + 1] int64 tensor.
torch::Tensor MakeBatch(const TokenData& data, const std::vector<int64_t>& samples, int seq_len) {
  torch::Tensor batch =
      torch::empty({static_cast<int64_t>(samples.size()), seq_len + 1}, torch::kLong);
  auto acc = batch.accessor<int64_t, 2>();
  const std::vector<int32_t>& tokens = data.tokens();
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t start = samples[i] * seq_len;
    for (int j = 0; j <= seq_len; ++j) acc[i][j] = tokens[start + j];
  }
  return batch;
}

// The loss weights of `samples`' targets ([batch, seq_len] float, see TargetWeights).
torch::Tensor MaskWeights(const std::vector<uint8_t>& mask, const std::vector<int64_t>& samples,
                          int seq_len) {
  std::vector<float> w = TargetWeights(mask, samples, seq_len);
  return torch::from_blob(w.data(), {static_cast<int64_t>(samples.size()), seq_len}, torch::kFloat)
      .clone();
}

absl::Status WriteDump(const std::string& path, torch::nn::Module& model) {
  std::vector<DumpedParam> params;
  for (const auto& item : model.named_parameters()) {
    torch::Tensor t = item.value().detach().to(torch::kCPU, torch::kFloat).contiguous();
    DumpedParam p;
    p.name = item.key();
    p.shape.assign(t.sizes().begin(), t.sizes().end());
    p.values.assign(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    params.push_back(std::move(p));
  }
  return WriteParamDump(path, std::move(params));
}

// A llama job's model as Hugging Face files in `out_dir`: under LoRA the adapter alone in PEFT's
// layout, or with `merge_lora` the model with it merged in; otherwise the model.
absl::Status ExportModel(const ModelConfig& m, const LoraConfig& lora, LanguageModel& model,
                         bool merge_lora, const std::string& out_dir) {
  if (lora.enabled() && !merge_lora) return ExportLoraAdapter(lora, model, m.from, out_dir);
  return ExportHfModel(m, lora, model, out_dir);
}

// checkpoint.export at the end of a run: written into DIR/.export.tmp-PID, every file fsynced, then
// renamed to DIR/export (replacing an earlier attempt's), which `yard fetch` serves.
absl::Status WriteJobExport(const ModelConfig& m, const LoraConfig& lora, LanguageModel& model,
                            ExportFormat format, const std::string& checkpoint_dir) {
  namespace fs = std::filesystem;
  // Of this process: an earlier attempt's rank 0 may still be writing its own.
  const std::string tmp = absl::StrCat(checkpoint_dir, "/.export.tmp-", ::getpid());
  const std::string final_dir = checkpoint_dir + "/export";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", ec.message()));
  RETURN_IF_ERROR(ExportModel(m, lora, model, format == ExportFormat::kHfMerged, tmp));
  for (fs::directory_iterator it(tmp, ec), end; !ec && it != end; it.increment(ec)) {
    RETURN_IF_ERROR(SyncPath(it->path().string()));
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list '", tmp, "': ", ec.message()));
  RETURN_IF_ERROR(SyncPath(tmp));
  fs::remove_all(final_dir, ec);
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename '", tmp, "' to '", final_dir, "'"));
  }
  return SyncPath(checkpoint_dir);
}

// One rank's training run: Setup (the model, its layout and groups, the optimizer, a resumed
// checkpoint), then Step until the last step or a stop, then Finish. Members are declared in the
// order the run makes them, so that they go in the reverse one (the communicators last).
// train.no_weight_decay: whether weight decay applies to the parameter `name` of `model` (of
// `dim` dimensions): "bias" leaves out biases, "norm" normalization weights (the other vectors),
// "embedding" the embeddings (a tied head's weight with them), as HF Trainer's
// get_decay_parameter_names.
bool Decays(const LanguageModel& model, const std::vector<std::string>& skip,
            const std::string& name, int64_t dim) {
  auto skips = [&](const char* kind) {
    return std::find(skip.begin(), skip.end(), kind) != skip.end();
  };
  const bool bias = absl::EndsWith(name, ".bias");
  if (bias) return !skips("bias");
  if (dim == 1) return !skips("norm");
  if (model.IsEmbedding(name)) return !skips("embedding");
  return true;
}

// The settings a resume must keep, as meta.json records them: the schedule and the optimizer's
// constants in effect, by their spec names under train.
std::string TrainingSettings(const TrainConfig& t, const OptimizerHyper& hyper) {
  nlohmann::json j = {{"lr", t.lr},
                      {"lr_schedule", Name(t.lr_schedule)},
                      {"warmup", t.warmup},
                      {"min_lr_ratio", t.min_lr_ratio},
                      {"weight_decay", t.weight_decay}};
  if (t.optimizer == OptimizerKind::kAdafactor) {
    j["adafactor_eps"] = hyper.adafactor_eps1;
    j["adafactor_clip_threshold"] = hyper.adafactor_clip;
    j["adafactor_decay_rate"] = hyper.adafactor_decay;
  } else {
    j["adam_beta1"] = hyper.beta1;
    j["adam_beta2"] = hyper.beta2;
    if (t.optimizer != OptimizerKind::kLion) j["adam_epsilon"] = hyper.eps;
  }
  std::vector<std::string> skip = t.no_weight_decay;
  std::sort(skip.begin(), skip.end());
  j["no_weight_decay"] = skip;
  return j.dump();
}

// A resume from `path` (its meta.json's settings) under `settings` (TrainingSettings) with
// `optimizer`: the first setting that differs, named, as FAILED_PRECONDITION; a checkpoint that
// records none (written before they were) is taken as it is, one of another optimizer is left to
// the load, which refuses it naming train.optimizer.
absl::Status CheckResumeSettings(const std::string& path, const std::string& settings,
                                 OptimizerKind optimizer) {
  // Another optimizer's checkpoint: its load refuses it, naming train.optimizer.
  if (auto written = CheckpointOptimizer(path); written.ok() && *written != Name(optimizer)) {
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(const std::string recorded, CheckpointSettings(path));
  if (recorded.empty()) return absl::OkStatus();
  const nlohmann::json then = nlohmann::json::parse(recorded, nullptr, false);
  const nlohmann::json now = nlohmann::json::parse(settings, nullptr, false);
  if (!then.is_object() || !now.is_object()) return absl::OkStatus();
  for (const auto& [key, value] : now.items()) {
    auto it = then.find(key);
    if (it == then.end() || *it == value) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "train.", key, ": the checkpoint ", path, " was trained with ", it->dump(),
        ", the spec says ", value.dump(),
        "; a resume keeps the schedule and the optimizer's settings (to change them, start a "
        "new job from the checkpoint's weights)"));
  }
  return absl::OkStatus();
}

class Trainer {
 public:
  explicit Trainer(const TrainerOptions& o)
      : o_(o),
        spec_(o.job),
        m_(o.job.model),
        t_(o.job.train),
        par_(o.job.parallel),
        rank0_(o.rank == 0) {}

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
    double loss_sum = 0, backward_s = 0, comm_wait_s = 0;
    bool inject_overflow = false;  // fp16 tests: this step's loss scaled by inf on rank 0
    bool overflow = false;         // fp16: inf or NaN gradients, the update skipped
    double grad_norm = 0, lr = 0;
    // CUDA: the loss summed and the gradient norm computed on the device, read back once after
    // the update (ReadBack) rather than each at its own wait inside the step.
    torch::Tensor loss_device, grad_norm_device;
    int64_t comm_bytes = 0;
    Clock::time_point end;            // of the step's training, before an evaluation
    std::optional<double> eval_loss;  // train.eval_every: when an evaluation ran after it
  };
  // What every rank agrees on after a step (one small all-reduce).
  struct Agreement {
    double loss = 0;
    bool checkpoint_requested = false, stop_requested = false, sigterm = false;
    std::vector<double> stage_idle;  // pipeline: each stage's idle share of the schedule
  };

  absl::Status Setup();
  absl::Status OpenHfCheckpoint();
  absl::Status LoadData();
  absl::Status MakeModel();
  absl::Status BuildStrategy();
  absl::Status ResumeModelParallel(std::unique_ptr<torch::optim::Optimizer> whole,
                                   const std::optional<CheckpointInfo>& loaded);
  absl::Status BuildOffload();
  absl::Status BuildLoop();
  void LogSetup() const;

  // One optimizer step, its report and checkpoint; true when the run stops after it.
  absl::StatusOr<bool> Step();
  void ForwardBackward(StepStats& s);
  absl::Status Update(StepStats& s);
  void ReadBack(StepStats& s);
  Agreement Agree(double loss_sum);
  void Report(const StepStats& s, const Agreement& a);
  absl::Status Checkpoint();
  absl::Status Finish();
  // train.eval_every: the mean loss over the held-out windows, the same every time: each replica
  // forwards its share (no autograd), the last stages' sums added over the ranks. Every rank calls
  // it.
  double Evaluate();
  // Whether weight decay applies to each of `params` (train.no_weight_decay).
  std::vector<bool> DecayFlags(const std::vector<torch::Tensor>& params) const;

  // Bytes this rank sent for gradients and parameters so far (model parallelism: activations,
  // and over its data- and tensor-parallel groups too).
  int64_t BytesSent() const {
    if (fsdp_ && !dims_.model_parallel) return fsdp_->bytes_sent();
    return groups_.world->bytes_sent() + (groups_.stage ? groups_.stage->bytes_sent() : 0) +
           (groups_.tensor ? groups_.tensor->bytes_sent() : 0) + (fsdp_ ? fsdp_->bytes_sent() : 0);
  }

  const TrainerOptions& o_;
  const JobConfig& spec_;
  ModelConfig m_;  // the spec's, with model.from's config.json sizes
  const TrainConfig& t_;
  const ParallelConfig& par_;
  const bool rank0_;
  torch::Device device_{torch::kCPU};
  ParallelDims dims_;
  std::unique_ptr<HfCheckpoint> hf_checkpoint_;  // model.from, until its weights are loaded
  std::vector<PsRangeRef> ps_ranges_;
  std::optional<TokenData> data_;
  std::vector<uint8_t> loss_mask_;
  // data.eval_path: the held-out tokens, their mask, and the windows one evaluation reads.
  std::optional<TokenData> eval_data_;
  std::vector<uint8_t> eval_mask_;
  int64_t eval_windows_ = 0;
  std::string settings_;  // TrainingSettings, recorded in every checkpoint
  int64_t num_samples_ = 0;
  CommGroups groups_;
  std::shared_ptr<LanguageModel> model_;
  bool from_rank0_ = false;  // FSDP: rank 0 alone materializes the model and sends the shards
  std::vector<torch::Tensor> params_;
  // What the optimizer updates and the ranks average: every parameter, or the LoRA adapters.
  std::vector<torch::Tensor> trainable_;
  OptimizerHyper hyper_;
  // Pipeline: the parameters this rank's stage holds, and of them those that train (what its
  // optimizer steps and its replicas average).
  std::optional<PipelineLayout> layout_;
  std::vector<std::pair<std::string, torch::Tensor>> stage_params_;
  std::vector<torch::Tensor> optimized_;
  std::unique_ptr<FsdpModel> fsdp_;
  FsdpConfig fsdp_config_;  // model parallelism: a stage's FsdpModel's, less what it holds
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  ExtraState extra_state_;  // amp.pt of the checkpoint resumed from
  int64_t step_ = 0;
  int64_t run_start_step_ = 0;
  // Offload: the optimizer lives on the parameter servers; `optimizer_` only carries its state
  // into and out of checkpoints.
  std::unique_ptr<OffloadOptimizer> offloaded_;
  std::optional<LossScaler> scaler_;  // fp16: dynamic loss scaling, its state in checkpoints
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<PipelineStage> pipeline_;
  std::unique_ptr<Reporter> reporter_;
  std::ofstream metrics_;
  // Pipeline: the micro-batches flow through the stages; the replicas split the batch.
  int grad_accum_ = 1;
  int replicas_ = 1;
  std::optional<DistributedSampler> sampler_;
  int64_t params_count_ = 0, trainable_count_ = 0, held_count_ = 0;
  int64_t dense_state_bytes_ = 0;
};

int64_t CountElements(const std::vector<torch::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& p : tensors) n += p.numel();
  return n;
}

absl::Status Trainer::Setup() {
  if (spec_.export_format != ExportFormat::kNone && o_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("checkpoint.export: the trainer has no --checkpoint-dir");
  }
  RETURN_IF_ERROR(OpenHfCheckpoint());
  // Bad input fails here, before this rank makes the others wait at the rendezvous.
  ASSIGN_OR_RETURN(device_, ResolveDevice(o_.device));
  ASSIGN_OR_RETURN(dims_,
                   ParallelDims::Make(spec_, m_, o_.rank, o_.world_size, o_.local_world_size));
  RETURN_IF_ERROR(LoadData());
  torch::set_num_threads(o_.threads);
  ASSIGN_OR_RETURN(groups_, BuildGroups(dims_, device_,
                                        {o_.coordinator, o_.job_id, o_.attempt, o_.gloo_hostname}));
  RETURN_IF_ERROR(MakeModel());
  RETURN_IF_ERROR(BuildStrategy());
  RETURN_IF_ERROR(BuildOffload());
  RETURN_IF_ERROR(BuildLoop());
  LogSetup();
  return absl::OkStatus();
}

// A Hugging Face checkpoint: its config.json gives the sizes the spec left out, and every tensor
// is checked (names, shapes, dtypes; headers only) before any rank waits for another.
absl::Status Trainer::OpenHfCheckpoint() {
  if (m_.from.empty()) return absl::OkStatus();
  auto prefixed = [](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("model.from: ", s.message()));
  };
  ASSIGN_OR_RETURN(const LlamaConfig config, ResolveFromCheckpoint(&m_));
  auto opened = HfCheckpoint::Open(m_.from);
  if (!opened.ok()) return prefixed(opened.status());
  hf_checkpoint_ = *std::move(opened);
  if (absl::Status s = hf_checkpoint_->Check(LlamaTensors(config)); !s.ok()) return prefixed(s);
  return absl::OkStatus();
}

absl::Status Trainer::LoadData() {
  if (dims_.offload) {
    if (o_.ps_ranges.empty()) {
      return absl::InvalidArgumentError(
          "parallel.strategy: offload needs parameter-server ranges (--ps), which the "
          "coordinator assigns");
    }
    ASSIGN_OR_RETURN(ps_ranges_, ParsePsRanges(o_.ps_ranges));
  }
  ASSIGN_OR_RETURN(data_, TokenData::Load(spec_.data.path, spec_.data.format, m_.vocab));
  if (!spec_.data.loss_mask.empty()) {
    ASSIGN_OR_RETURN(loss_mask_, LoadLossMask(spec_.data.loss_mask, data_->size()));
  }
  num_samples_ = NumSamples(data_->size(), m_.seq_len);
  if (num_samples_ < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.seq_len: ", m_.seq_len, " needs at least ", m_.seq_len + 1,
                     " tokens, but data.path '", spec_.data.path, "' has only ", data_->size()));
  }
  if (!spec_.data.eval_path.empty()) {
    auto eval = TokenData::Load(spec_.data.eval_path, spec_.data.format, m_.vocab);
    if (!eval.ok()) {
      return absl::Status(eval.status().code(),
                          absl::StrCat("data.eval_path: ", eval.status().message()));
    }
    eval_data_ = *std::move(eval);
    if (!spec_.data.eval_loss_mask.empty()) {
      auto mask = LoadLossMask(spec_.data.eval_loss_mask, eval_data_->size());
      if (!mask.ok()) {
        return absl::Status(mask.status().code(),
                            absl::StrCat("data.eval_loss_mask: ", mask.status().message()));
      }
      eval_mask_ = *std::move(mask);
    }
    eval_windows_ = std::min(NumSamples(eval_data_->size(), m_.seq_len), kMaxEvalWindows);
    if (eval_windows_ < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data.eval_path: '", spec_.data.eval_path, "' has ", eval_data_->size(),
          " tokens; one window of model.seq_len + 1 = ", m_.seq_len + 1, " needs more"));
    }
  }
  return absl::OkStatus();
}

// Moves the model's parameters and buffers to `device` in place: the parameters keep their
// identity (the optimizer's state keys). A parameter whose storage is freed (one this rank does
// not hold: another pipeline stage's, or FSDP's sent from rank 0) stays freed there: nothing to
// copy.
void MoveModel(LanguageModel& model, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  for (torch::Tensor p : model.parameters()) {
    if (p.numel() > 0 && p.storage().nbytes() == 0) {
      torch::Tensor empty = torch::empty(p.sizes(), p.options().device(device));
      FreeStorage(empty);
      p.set_data(empty);
    } else {
      p.set_data(p.to(device));
    }
  }
  for (torch::Tensor b : model.buffers()) b.set_data(b.to(device));
}

absl::Status Trainer::MakeModel() {
  ModelOptions model_options;
  // On a GPU autocast picks each operation's precision; on the CPU the model runs its Linear
  // layers in bf16 itself. fp16 on the CPU scales the loss as on a GPU but computes in fp32
  // (Debian's LibTorch has no fp16 CPU matmuls).
  model_options.bf16 = t_.precision == Precision::kBf16 && !device_.is_cuda();
  model_options.activation_checkpointing = t_.activation_checkpointing;
  model_options.fused_norms = o_.fused_norm != "off";
  model_options.lora = t_.lora;
  // FSDP with cpu_ram_efficient_loading: only rank 0 holds the whole model, the others receive
  // their shards from it. (Not under model parallelism, where every rank keeps its part of the
  // model it built.)
  from_rank0_ =
      dims_.fsdp && par_.cpu_ram_efficient_loading && o_.world_size > 1 && !dims_.model_parallel;
  model_options.materialize = !from_rank0_ || rank0_;
  model_ = BuildModel(m_, model_options, t_.seed);
  // fp16: the loss scale must reach the logits' gradient before it is rounded to fp16 (small
  // probabilities would underflow); the fused loss applies the scale after, so fp16 keeps the
  // plain head.
  if (o_.fused_loss == "off" || t_.precision == Precision::kFp16) {
    model_->set_fused_loss(LanguageModel::FusedLoss::kOff);
  }
  // The checkpoint's weights, on the ranks whose parameters are not sent to them from rank 0
  // (model parallelism broadcasts nothing: every rank keeps its part of what it loaded).
  if (hf_checkpoint_ != nullptr && model_options.materialize &&
      (rank0_ || dims_.fsdp || dims_.model_parallel)) {
    RETURN_IF_ERROR(LoadHfWeights(*hf_checkpoint_, *model_));
    if (rank0_) Log(absl::StrCat("loaded ", hf_checkpoint_->size(), " tensors from ", m_.from));
  }
  hf_checkpoint_.reset();  // unmapped
  // In place: the parameters keep their identity (the optimizer's state keys). Parameters this
  // rank did not materialize (FSDP's from rank 0) get an empty storage on the device, as they had
  // on the CPU: nothing to copy.
  if (device_.is_cuda()) MoveModel(*model_, device_);
  params_ = model_->parameters();
  trainable_ = TrainableParameters(*model_);
  // train.optimizer (AdamW's betas (0.9, 0.95) as in GPT-3 / nanoGPT, unless the spec sets its
  // constants); weight decay on every parameter that trains but the kinds train.no_weight_decay
  // names.
  hyper_ = HyperFor(t_);
  settings_ = TrainingSettings(t_, hyper_);
  SetMetaNotes({settings_, std::nullopt});
  optimized_ = trainable_;
  if (dims_.model_parallel) {
    layout_ =
        MakePipelineLayout(o_.rank, o_.world_size, dims_.stages, dims_.tensor, dims_.stage_bounds);
    stage_params_ = StageParameters(*model_, *layout_);
    optimized_.clear();
    for (const auto& [name, p] : stage_params_) {
      if (p.requires_grad()) optimized_.push_back(p);
    }
  }
  return absl::OkStatus();
}

std::vector<bool> Trainer::DecayFlags(const std::vector<torch::Tensor>& params) const {
  if (t_.no_weight_decay.empty()) return {};
  std::map<const void*, std::string> names;
  for (const auto& item : model_->named_parameters()) {
    names[item.value().unsafeGetTensorImpl()] = item.key();
  }
  std::vector<bool> out;
  for (const torch::Tensor& p : params) {
    out.push_back(Decays(*model_, t_.no_weight_decay, names[p.unsafeGetTensorImpl()], p.dim()));
  }
  return out;
}

FsdpConfig MakeFsdpConfig(const ParallelConfig& par, const OptimizerHyper& hyper) {
  FsdpConfig c;
  c.sharding = par.sharding;
  c.wrap = par.wrap;
  c.min_num_params = par.min_num_params;
  c.backward_prefetch = par.backward_prefetch;
  c.forward_prefetch = par.forward_prefetch;
  c.max_gathered_units = par.max_gathered_units;
  c.optimizer = hyper;
  return c;
}

// The strategy's model and optimizer (FsdpModel, or an optimizer of the whole parameters), and
// the checkpoint resumed from.
absl::Status Trainer::BuildStrategy() {
  // A resume keeps the settings its checkpoint was trained with (every rank reads the same one).
  if (!o_.checkpoint_dir.empty()) {
    ASSIGN_OR_RETURN(const std::optional<CheckpointInfo> latest,
                     FindLatestCheckpoint(o_.checkpoint_dir));
    if (latest.has_value()) {
      RETURN_IF_ERROR(CheckResumeSettings(latest->path, settings_, t_.optimizer));
    }
  }
  FsdpConfig fsdp_config = MakeFsdpConfig(par_, hyper_);
  if (!t_.no_weight_decay.empty()) {
    fsdp_config.decays = [this](const std::string& name, int64_t dim) {
      return Decays(*model_, t_.no_weight_decay, name, dim);
    };
  }
  if (dims_.fsdp && !dims_.model_parallel) {
    ASSIGN_OR_RETURN(fsdp_, FsdpModel::Create(*model_, *groups_.world, *groups_.shard,
                                              groups_.replica.get(), fsdp_config, from_rank0_));
    if (!o_.checkpoint_dir.empty()) {
      ASSIGN_OR_RETURN(auto loaded, LoadLatestShardedCheckpoint(o_.checkpoint_dir, *fsdp_));
      if (loaded.has_value()) {
        step_ = loaded->step;
        Log(absl::StrCat("resumed from ", loaded->path, " at step ", step_));
      }
    }
    return absl::OkStatus();
  }
  if (!dims_.fsdp) optimizer_ = MakeOptimizer(optimized_, hyper_, t_.lr, DecayFlags(optimized_));
  // Model parallelism: the checkpoint (of any layout) is read into the whole model and an
  // optimizer of every parameter that trains; the stage keeps its part of both.
  std::unique_ptr<torch::optim::Optimizer> whole;
  if (dims_.model_parallel) {
    whole = MakeOptimizer(trainable_, hyper_, t_.lr, DecayFlags(trainable_));
  }
  fsdp_config_ = std::move(fsdp_config);
  std::optional<CheckpointInfo> loaded;
  if (!o_.checkpoint_dir.empty()) {
    ASSIGN_OR_RETURN(loaded, LoadLatestCheckpoint(o_.checkpoint_dir, *model_,
                                                  whole ? *whole : *optimizer_, &extra_state_));
    if (loaded.has_value()) {
      step_ = loaded->step;
      Log(absl::StrCat("resumed from ", loaded->path, " at step ", step_));
    }
  }
  if (dims_.model_parallel) return ResumeModelParallel(std::move(whole), loaded);
  // Like DDP: every rank starts from rank 0's parameters.
  groups_.world->Broadcast(params_, 0);
  return absl::OkStatus();
}

absl::Status Trainer::ResumeModelParallel(std::unique_ptr<torch::optim::Optimizer> whole,
                                          const std::optional<CheckpointInfo>& loaded) {
  if (dims_.tensor > 1) KeepTensorParallelShards(*model_, stage_params_, *layout_);
  if (dims_.fsdp) {
    // The stage's replicas shard its parameters (an FsdpModel over their group, or under
    // HYBRID_SHARD over those on this node), which averages the gradients too.
    FsdpConfig config = fsdp_config_;
    config.holds = [this](const std::string& name) { return StageHolds(*model_, *layout_, name); };
    // (`world`: the part's replicas, over which the gradients are averaged.)
    ASSIGN_OR_RETURN(fsdp_,
                     FsdpModel::Create(*model_, dims_.hybrid ? *groups_.stage : *groups_.shard,
                                       *groups_.shard, groups_.replica.get(), config,
                                       /*from_rank0=*/false));
    if (loaded.has_value()) {
      int64_t state_step = 0;
      const auto states = StageStates(*model_, *whole, *layout_, &state_step);
      RETURN_IF_ERROR(ImportParameterStates(*fsdp_, states, state_step));
    }
  } else if (loaded.has_value()) {
    RETURN_IF_ERROR(KeepStageState(*model_, *whole, *optimizer_, *layout_));
  }
  whole.reset();
  if (dims_.tensor > 1) {
    model_->SetTensorParallel(
        {groups_.tensor.get(), layout_->tp_rank, dims_.tensor, par_.sequence_parallel});
  }
  // Every rank built the same model from the seed and loaded the same checkpoint; a stage keeps
  // only its parameters.
  for (const auto& item : model_->named_parameters()) {
    if (!StageHolds(*model_, *layout_, item.key())) FreeStorage(item.value());
  }
  return absl::OkStatus();
}

absl::Status Trainer::BuildOffload() {
  if (!dims_.offload) return absl::OkStatus();
  OffloadConfig config;
  config.servers.job_id = o_.job_id;
  config.servers.attempt = o_.attempt;
  config.servers.beta1 = hyper_.beta1;
  config.servers.beta2 = hyper_.beta2;
  config.servers.eps = hyper_.eps;
  config.servers.weight_decay = hyper_.weight_decay;
  config.servers.rpc_timeout = absl::Seconds(o_.ps_rpc_timeout_s);
  config.servers.tcp_congestion = o_.ps_tcp_congestion;
  config.servers.transport = o_.ps_transport;
  config.delayed_update = par_.delayed_update;
  ASSIGN_OR_RETURN(offloaded_,
                   OffloadOptimizer::Create(params_, *groups_.world, std::move(ps_ranges_), config,
                                            par_.bucket_mb));
  if (rank0_) {
    Log(absl::StrCat("parameter-server connections: TCP congestion control ",
                     offloaded_->servers().TcpCongestionInUse()));
    Log(absl::StrCat("parameter-server transfers: ", offloaded_->servers().TransportSummary()));
  }
  return offloaded_->Initialize(step_, *optimizer_);
}

// The loop's parts: loss scaling, gradient averaging or the pipeline schedule, reports, the
// sampler, and what the reports count.
absl::Status Trainer::BuildLoop() {
  if (t_.precision == Precision::kFp16) {
    scaler_.emplace();
    if (!extra_state_.empty()) RETURN_IF_ERROR(scaler_->SetState(extra_state_));
  }
  if (dims_.model_parallel) {
    if (groups_.stage && !fsdp_) {
      reducer_ = std::make_unique<GradientReducer>(optimized_, *groups_.stage, par_.bucket_mb,
                                                   std::min(1.0, par_.bucket_mb));
    }
    pipeline_ = std::make_unique<PipelineStage>(*model_, *groups_.world, *layout_,
                                                par_.pipeline_schedule, t_.micro_batch,
                                                reducer_.get(), fsdp_.get(), groups_.tensor.get());
  } else if ((o_.world_size > 1 || groups_.nccl_one_rank) && !dims_.offload && !fsdp_) {
    // The first bucket is 1 MiB like PyTorch's, or smaller when the buckets are.
    reducer_ = std::make_unique<GradientReducer>(trainable_, *groups_.world, par_.bucket_mb,
                                                 std::min(1.0, par_.bucket_mb));
  }
  if (rank0_ && !o_.job_id.empty()) {
    reporter_ = std::make_unique<Reporter>(o_.coordinator, o_.job_id, o_.attempt, o_.rank, &Log);
  }
  if (rank0_ && !o_.metrics_file.empty()) {
    metrics_.open(o_.metrics_file, std::ios::app);
    if (!metrics_) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics-file: cannot open '", o_.metrics_file, "'"));
    }
  }
  grad_accum_ = dims_.pipelined ? t_.micro_batches : t_.grad_accum;
  replicas_ = dims_.model_parallel ? layout_->replicas : o_.world_size;
  sampler_.emplace(num_samples_, t_.seed, t_.micro_batch, grad_accum_, replicas_,
                   dims_.model_parallel ? layout_->replica : o_.rank);
  params_count_ = CountElements(params_);
  trainable_count_ = CountElements(trainable_);
  // Model parallelism: what this rank's stage holds (its tensor-parallel shards).
  held_count_ = params_count_;
  if (dims_.model_parallel) {
    held_count_ = 0;
    for (const auto& [name, p] : stage_params_) held_count_ += p.numel();
  }
  // Model-state bytes of DDP (and offload's device side): weights, and of the parameters that
  // train gradients, and the optimizer's state on the device unless offloaded.
  // Model parallelism: of the stage's parameters.
  std::vector<std::vector<int64_t>> trainable_shapes;
  for (const auto& p : optimized_) trainable_shapes.push_back(p.sizes().vec());
  dense_state_bytes_ = held_count_ * int64_t{4} + CountElements(optimized_) * int64_t{4} +
                       (dims_.offload ? 0 : OptimizerStateBytes(t_.optimizer, trainable_shapes, 1));
  run_start_step_ = step_;
  return absl::OkStatus();
}

void Trainer::LogSetup() const {
  const std::string fsdp_summary =
      fsdp_ ? absl::StrFormat("fsdp %s: %d units, shard group %d", Name(par_.sharding),
                              fsdp_->num_units(), fsdp_->shard_count())
            : "";
  Log(absl::StrFormat(
      "trainer rank %d/%d: %s model, %d parameters%s, %d tokens (%d samples), global batch %d, "
      "%d buckets, %s, optimizer %s, steps %d..%d",
      o_.rank, o_.world_size, m_.kind, params_count_,
      t_.lora.enabled() ? absl::StrFormat(" (%d trainable: LoRA r %d on %s)", trainable_count_,
                                          t_.lora.r, absl::StrJoin(t_.lora.target_modules, ","))
                        : "",
      data_->size(), num_samples_, sampler_->global_batch(),
      reducer_ ? reducer_->num_buckets() : (offloaded_ ? offloaded_->num_buckets() : 0),
      dims_.model_parallel
          ? absl::StrFormat(
                "pipeline stage %d/%d (blocks %d..%d, %d parameters), tensor-parallel rank "
                "%d/%d, %s, %d micro-batches, %d replicas (%s)",
                layout_->stage, dims_.stages, dims_.stage_bounds[layout_->stage],
                dims_.stage_bounds[layout_->stage + 1] - 1, held_count_, layout_->tp_rank,
                dims_.tensor, Name(par_.pipeline_schedule), grad_accum_, replicas_,
                fsdp_ ? fsdp_summary : "ddp")
      : fsdp_ ? fsdp_summary
              : std::string(Name(par_.strategy)),
      Name(t_.optimizer), step_, t_.steps));
  Log(absl::StrCat("collectives: ", groups_.world->Describe()));
  Log(absl::StrCat(
      "device: ", DescribeDevice(device_), "; precision ", Name(t_.precision),
      device_.is_cuda() && t_.precision != Precision::kFp32 ? " (autocast, fp32 master weights)"
                                                            : "",
      scaler_ ? absl::StrCat(", dynamic loss scale from ", scaler_->scale()) : "",
      !pipeline_ && model_->UsesFusedLoss(device_, int64_t{t_.micro_batch} * m_.seq_len)
          ? "; fused LM head + cross-entropy"
          : ""));
  if (device_.is_cuda()) CudaResetPeak();
  // A tensor-parallel group is consecutive ranks; the scheduler gives each node whole groups, but
  // ranks started otherwise may split one.
  if (dims_.tensor > 1 && o_.local_world_size > 0 && o_.local_world_size % dims_.tensor != 0) {
    Log(absl::StrCat("warning: this node runs ", o_.local_world_size,
                     " of the job's ranks, not a multiple of parallel.tensor_parallel (",
                     dims_.tensor,
                     "): a tensor-parallel group spans nodes, and its all-reduces cross the "
                     "network"));
  }
}

absl::StatusOr<bool> Trainer::Step() {
  StepStats s;
  s.start = Clock::now();
  s.bytes_before = BytesSent();
  ForwardBackward(s);
  RETURN_IF_ERROR(Update(s));
  ReadBack(s);
  ++step_;
  s.comm_bytes = BytesSent() - s.bytes_before;  // before the flags' all-reduce
  s.end = Clock::now();
  // train.eval_every (and after the last step): every rank knows when.
  if (eval_data_ && ((t_.eval_every > 0 && step_ % t_.eval_every == 0) || step_ == t_.steps)) {
    const double loss = Evaluate();
    if (std::isfinite(loss)) s.eval_loss = loss;
  }
  SetMetaNotes({settings_, s.eval_loss});  // what a checkpoint of this step records
  const Agreement a = Agree(s.loss_sum);
  if (rank0_) Report(s, a);

  const bool stop_after = o_.stop_after_steps > 0 && step_ - run_start_step_ >= o_.stop_after_steps;
  const bool stop = a.stop_requested || a.sigterm || stop_after;
  const int64_t every = spec_.checkpoint_every_steps;
  if (!o_.checkpoint_dir.empty() &&
      (stop || a.checkpoint_requested || step_ == t_.steps || (every > 0 && step_ % every == 0))) {
    RETURN_IF_ERROR(Checkpoint());
  }
  if (stop) {
    Log(absl::StrCat("stopping after step ", step_, " (",
                     a.sigterm          ? "SIGTERM"
                     : a.stop_requested ? "stop requested"
                                        : "--stop-after-steps",
                     ")"));
  }
  return stop;
}

// The step's micro-batches forward and backward (or the pipeline's schedule), the gradients
// averaged over the ranks.
void Trainer::ForwardBackward(StepStats& s) {
  // fp16: the loss is scaled before backward (an injected overflow scales it by inf on rank 0:
  // every gradient becomes inf or NaN, as a real fp16 overflow makes them).
  s.inject_overflow = scaler_ && o_.inject_overflow_step == step_ + 1 && rank0_;
  const double loss_scale = !scaler_            ? 1.0
                            : s.inject_overflow ? std::numeric_limits<double>::infinity()
                                                : scaler_->scale();
  // data.loss_mask: the targets the whole global batch counts (every rank knows the batch), so
  // that the step's loss is their mean however they fall on ranks and micro-batches.
  const int64_t counted =
      loss_mask_.empty()
          ? 0
          : std::max<int64_t>(1, CountedTargets(loss_mask_, sampler_->GlobalBatch(step_),
                                                m_.seq_len, /*last_only=*/m_.kind == "mlp"));
  if (pipeline_) {
    // The stage runs every micro-batch by the schedule; the reducer syncs in its last backward.
    if (t_.lora.dropout > 0) torch::manual_seed(DropoutSeed(t_.seed, o_.rank, step_, 0));
    auto windows = [&](int micro) {
      return ToDevice(MakeBatch(*data_, sampler_->MicroBatch(step_, micro), m_.seq_len), device_);
    };
    auto loss_of = [&](int micro, const torch::Tensor& logits, const torch::Tensor& w) {
      if (loss_mask_.empty()) return model_->LossOf(logits, w) / grad_accum_;
      return model_->MaskedLossSumOf(
                 logits, w,
                 ToDevice(MaskWeights(loss_mask_, sampler_->MicroBatch(step_, micro), m_.seq_len),
                          device_)) *
             (static_cast<double>(replicas_) / static_cast<double>(counted));
    };
    {
      // (On a GPU autocast covers the schedule's backwards too, as it does not touch them:
      // autograd runs them on its device threads.)
      AutocastScope autocast(device_, t_.precision);
      s.loss_sum = pipeline_->Step(grad_accum_, windows, loss_of);
    }
    s.backward_s = pipeline_->last_step().seconds;
    s.comm_wait_s = pipeline_->last_step().comm_wait_seconds;
    if (reducer_) s.comm_wait_s = reducer_->Finish();  // the replicas' average
    pipeline_->SyncTiedGradient();
    pipeline_->SyncSequenceParallelGradients();
    return;
  }
  for (int micro = 0; micro < grad_accum_; ++micro) {
    const bool last = micro == grad_accum_ - 1;
    if (reducer_) reducer_->Prepare(last);
    if (offloaded_) offloaded_->Prepare(last, step_ + 1);
    if (fsdp_) fsdp_->BeginForward(last);
    const std::vector<int64_t> samples = sampler_->MicroBatch(step_, micro);
    if (t_.lora.dropout > 0) torch::manual_seed(DropoutSeed(t_.seed, o_.rank, step_, micro));
    torch::Tensor batch = ToDevice(MakeBatch(*data_, samples, m_.seq_len), device_);
    // Gradients are averaged over the ranks: the masked sum is scaled by world / counted.
    torch::Tensor loss;
    {
      AutocastScope autocast(device_, t_.precision);
      loss = loss_mask_.empty()
                 ? model_->Loss(batch) / grad_accum_
                 : model_->MaskedLossSum(
                       batch, ToDevice(MaskWeights(loss_mask_, samples, m_.seq_len), device_)) *
                       (static_cast<double>(o_.world_size) / static_cast<double>(counted));
    }
    if (fsdp_) fsdp_->WatchLoss(loss);
    const auto backward_start = Clock::now();
    if (scaler_) {
      (loss * loss_scale).backward();
    } else {
      loss.backward();
    }
    if (fsdp_) s.comm_wait_s += fsdp_->FinishBackward();
    s.backward_s += Seconds(backward_start);
    if (device_.is_cuda()) {
      const torch::Tensor l = loss.detach().to(torch::kDouble);
      s.loss_device = s.loss_device.defined() ? s.loss_device + l : l;
    } else {
      s.loss_sum += loss.item<double>();
    }
  }
  if (reducer_) s.comm_wait_s = reducer_->Finish();
}

// The optimizer's update with the step's learning rate and clipping, or under fp16 a skipped
// step when the gradients overflowed.
absl::Status Trainer::Update(StepStats& s) {
  // fp16: the gradients divided by the loss scale; an inf or NaN among them (the same on every
  // rank: they were summed) skips this step's update.
  s.overflow = scaler_ && scaler_->Unscale(params_);
  const double scale_used = scaler_ ? scaler_->scale() : 1.0;
  if (scaler_) scaler_->Update(s.overflow);
  if (s.overflow) {
    s.grad_norm = std::numeric_limits<double>::quiet_NaN();
  } else if (pipeline_) {
    s.grad_norm = std::sqrt(pipeline_->GradNormSquared(optimized_));
  } else if (offloaded_) {
    ASSIGN_OR_RETURN(s.grad_norm, offloaded_->FinishBackward(&s.comm_wait_s));
  } else if (fsdp_) {
    s.grad_norm = fsdp_->GradNorm();
  } else if (device_.is_cuda() && !scaler_ &&
             dynamic_cast<torch::optim::AdamW*>(optimizer_.get()) != nullptr) {
    // CUDA with the fused AdamW: the norm and the clipping stay on the device.
    s.grad_norm_device = GradNormTensor(params_);
  } else {
    s.grad_norm = GradNorm(params_);
  }
  const double clip_scale =
      t_.grad_clip > 0 && s.grad_norm > t_.grad_clip ? t_.grad_clip / (s.grad_norm + 1e-6) : 1.0;
  s.lr = ScheduledLearningRate(step_, t_);
  if (s.overflow) {
    // Skipped, as GradScaler skips optimizer.step(): parameters and optimizer state stay.
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
    Log(absl::StrFormat("step %d skipped: inf or NaN gradients in fp16%s; loss scale %g -> %g",
                        step_ + 1, s.inject_overflow ? " (injected)" : "", scale_used,
                        scaler_->scale()));
  } else if (offloaded_) {
    // The parameter servers scale the gradients (clipping) as they apply AdamW.
    RETURN_IF_ERROR(offloaded_->Step(s.lr, clip_scale));
  } else if (fsdp_) {
    fsdp_->Step(s.lr, clip_scale);
  } else if (s.grad_norm_device.defined()) {
    FusedAdamWStep(
        dynamic_cast<torch::optim::AdamW&>(*optimizer_), s.lr,
        t_.grad_clip > 0 ? ClipDivisor(s.grad_norm_device, t_.grad_clip) : torch::Tensor());
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  } else {
    OptimizerStep(*optimizer_, s.lr, clip_scale);
    // zero_grad(set_to_none=True): the next backward hands its gradients over instead of adding
    // them to zeros (and the reducer's bucket views are dropped).
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  }
  return absl::OkStatus();
}

// The step's one wait for the device (CUDA): its loss and gradient norm in one copy to the host.
void Trainer::ReadBack(StepStats& s) {
  std::vector<torch::Tensor> parts;
  if (s.loss_device.defined()) parts.push_back(s.loss_device.reshape({1}));
  if (s.grad_norm_device.defined()) {
    parts.push_back(s.grad_norm_device.to(torch::kDouble).reshape({1}));
  }
  if (parts.empty()) return;
  const torch::Tensor host = torch::cat(parts).to(torch::kCPU);
  const double* v = host.data_ptr<double>();
  if (s.loss_device.defined()) s.loss_sum += *v++;
  if (s.grad_norm_device.defined()) s.grad_norm = *v;
}

// One tiny all-reduce per step: the global mean loss, and the flags every rank must agree on
// (coordinator commands reach rank 0 only; SIGTERM may reach any rank).
Trainer::Agreement Trainer::Agree(double loss_sum) {
  TrainerCommands commands;
  if (reporter_) commands = reporter_->TakeCommands();
  // Tensor parallelism: the group's ranks all compute the loss; rank 0 of it counts it.
  if (layout_ && layout_->tp_rank != 0) loss_sum = 0;
  std::vector<double> flags = {loss_sum, commands.checkpoint_requested ? 1.0 : 0.0,
                               commands.stop_requested ? 1.0 : 0.0, TakeSigterm() ? 1.0 : 0.0};
  // Pipeline: also each stage's idle share of the schedule (from the first replica).
  if (dims_.pipelined) {
    flags.resize(4 + dims_.stages, 0.0);
    const PipelineStepStats& ps = pipeline_->last_step();
    if (layout_->replica == 0 && layout_->tp_rank == 0) {
      flags[4 + layout_->stage] = ps.idle_seconds / ps.seconds;
    }
  }
  torch::Tensor agree = torch::tensor(flags, torch::kDouble);
  groups_.world->AllReduceSum({agree})->Wait();
  Agreement a;
  // The loss is the last stages' under pipeline parallelism (one per replica).
  a.loss = agree[0].item<double>() / replicas_;
  a.checkpoint_requested = agree[1].item<double>() > 0;
  a.stop_requested = agree[2].item<double>() > 0;
  a.sigterm = agree[3].item<double>() > 0;
  for (int st = 0; dims_.pipelined && st < dims_.stages; ++st) {
    a.stage_idle.push_back(agree[4 + st].item<double>());
  }
  return a;
}

// Rank 0: the step's line in the log, the --metrics-file and the report to the coordinator.
void Trainer::Report(const StepStats& s, const Agreement& a) {
  // (Without the evaluation, which has a line of its own.)
  const double step_s = std::chrono::duration<double>(s.end - s.start).count();
  const double tokens_per_s =
      sampler_->global_batch() * model_->TokensPerWindow() / std::max(step_s, 1e-9);
  const int64_t model_state_bytes = fsdp_ ? fsdp_->peak_bytes() : dense_state_bytes_;
  // The measured bubble (the stages' mean idle share) and its theory, (P - 1) / (m + P - 1).
  double bubble = 0;
  for (double idle : a.stage_idle) bubble += idle / dims_.stages;
  const double bubble_theory =
      dims_.pipelined ? double(dims_.stages - 1) / double(grad_accum_ + dims_.stages - 1) : 0.0;
  Log(absl::StrFormat(
      "step %d/%d loss %.4f lr %.2e grad_norm %.2f tok/s %.0f step_ms %.0f backward_ms %.0f "
      "comm_wait_ms %.1f allreduce_bytes %d comm_bytes %d model_state_peak_bytes %d%s%s",
      step_, t_.steps, a.loss, s.lr, s.grad_norm, tokens_per_s, step_s * 1e3, s.backward_s * 1e3,
      s.comm_wait_s * 1e3, reducer_ ? reducer_->bytes_per_step() : 0, s.comm_bytes,
      model_state_bytes,
      offloaded_ ? absl::StrFormat(" ps_push_bytes %d ps_pull_bytes %d", offloaded_->pushed_bytes(),
                                   offloaded_->pulled_bytes())
      : pipeline_ ? absl::StrFormat(" pipeline_bubble %.3f (theory %.3f) in_flight_peak %d "
                                    "activation_peak_bytes %d",
                                    bubble, bubble_theory, pipeline_->last_step().peak_in_flight,
                                    pipeline_->last_step().peak_activation_bytes)
                  : "",
      absl::StrCat(
          scaler_ ? absl::StrFormat(" loss_scale %g skipped_steps %d", scaler_->scale(),
                                    scaler_->skipped_steps())
                  : "",
          device_.is_cuda() ? absl::StrCat(" device_peak_bytes ", CudaPeakAllocatedBytes()) : "")));
  if (s.eval_loss.has_value()) {
    Log(absl::StrFormat("eval step %d eval_loss %.4f perplexity %.3f (%d held-out windows)", step_,
                        *s.eval_loss, std::exp(*s.eval_loss), eval_windows_));
  }
  if (metrics_.is_open()) {
    nlohmann::json line = {
        {"step", step_},
        {"loss", a.loss},
        {"lr", s.lr},
        {"grad_norm", s.grad_norm},
        {"tokens_per_second", tokens_per_s},
        {"step_seconds", step_s},
        {"backward_seconds", s.backward_s},
        {"comm_wait_seconds", s.comm_wait_s},
        {"allreduce_bytes", reducer_ ? reducer_->bytes_per_step() : 0},
        {"comm_bytes", s.comm_bytes},
        {"pipeline_bubble", bubble},
        {"pipeline_bubble_theory", bubble_theory},
        {"pipeline_in_flight_peak", pipeline_ ? pipeline_->last_step().peak_in_flight : 0},
        {"pipeline_activation_peak_bytes",
         pipeline_ ? pipeline_->last_step().peak_activation_bytes : 0},
        {"model_state_peak_bytes", model_state_bytes}};
    if (scaler_) {
      line["loss_scale"] = scaler_->scale();
      line["skipped"] = s.overflow;
      line["skipped_steps"] = scaler_->skipped_steps();
    }
    if (device_.is_cuda()) line["device_peak_bytes"] = CudaPeakAllocatedBytes();
    if (s.eval_loss.has_value()) {
      line["eval_loss"] = *s.eval_loss;
      line["eval_perplexity"] = std::exp(*s.eval_loss);
    }
    metrics_ << line.dump() << std::endl;
  }
  if (reporter_) {
    StepReport r;
    r.step = step_;
    r.total_steps = t_.steps;
    r.loss = a.loss;
    r.lr = s.lr;
    r.tokens_per_second = tokens_per_s;
    r.step_seconds = step_s;
    r.grad_norm = s.grad_norm;
    r.resident_bytes = ResidentBytes();
    r.device_peak_bytes = device_.is_cuda() ? CudaPeakAllocatedBytes() : 0;
    r.cpu_seconds = CpuSeconds();
    r.model_state_peak_bytes = model_state_bytes;
    r.comm_bytes = s.comm_bytes;
    r.time_ms = UnixMillis();
    r.pipeline_stage_idle = a.stage_idle;
    r.pipeline_bubble_theory = bubble_theory;
    r.eval_loss = s.eval_loss;
    reporter_->ReportStep(r);
  }
}

absl::Status Trainer::Checkpoint() {
  auto reported = [this](const CheckpointInfo& info, const std::string& kind) {
    if (!rank0_) return;
    Log(absl::StrCat("checkpoint step ", info.step, " path ", info.path, " bytes ", info.bytes,
                     kind));
    CheckpointReport report{info.step, info.path, info.bytes, CheckpointEvalLoss(info.path), {}};
    // Durable and published: the oldest beyond checkpoint.keep_last go (but the best, with
    // keep_best).
    auto pruned = PruneCheckpoints(o_.checkpoint_dir,
                                   {spec_.checkpoint_keep_last, spec_.checkpoint_keep_best});
    if (!pruned.ok()) {
      Log(absl::StrCat("checkpoint retention: ", pruned.status().message()));
    } else {
      if (!pruned->removed.empty()) {
        Log(absl::StrCat("removed ", absl::StrJoin(pruned->removed, ", "),
                         " (checkpoint.keep_last ", spec_.checkpoint_keep_last,
                         spec_.checkpoint_keep_best ? ", keep_best" : "", ")"));
      }
      for (const Retained::Checkpoint& c : pruned->kept) {
        report.kept.push_back({c.step, o_.checkpoint_dir + "/" + c.name, c.eval_loss});
      }
    }
    if (reporter_) reporter_->ReportCheckpoint(report);
  };
  if (pipeline_) {
    // Each stage's first replica writes its part; rank 0 meta.json. Under fsdp, the stage's
    // shards put together whole first (by all of its replicas).
    WholeModel gathered;
    if (fsdp_) {
      ASSIGN_OR_RETURN(gathered, GatherWhole(*fsdp_, t_.lr));
    }
    ASSIGN_OR_RETURN(CheckpointInfo info,
                     WriteStagedCheckpoint(o_.checkpoint_dir, step_, *layout_, *model_,
                                           fsdp_ ? gathered.params : stage_params_,
                                           fsdp_ ? *gathered.optimizer : *optimizer_,
                                           *groups_.world, groups_.tensor.get()));
    reported(info, absl::StrCat(" (", dims_.stages, " pipeline stages)"));
    return absl::OkStatus();
  }
  if (fsdp_) {
    // Every rank writes its shard; rank 0 the manifest.
    ASSIGN_OR_RETURN(CheckpointInfo info, WriteShardedCheckpoint(o_.checkpoint_dir, step_, *fsdp_,
                                                                 *groups_.world, t_.lr));
    reported(info, " (sharded)");
    return absl::OkStatus();
  }
  // delayed_update: the checkpoint holds the parameters after `step`'s update (every rank).
  if (offloaded_) RETURN_IF_ERROR(offloaded_->Flush());
  if (rank0_) {
    // Offload: the servers hold the optimizer state; bring it into the DDP-format files.
    if (offloaded_) RETURN_IF_ERROR(offloaded_->ReadIntoShadow(step_, *optimizer_));
    ASSIGN_OR_RETURN(CheckpointInfo info,
                     WriteCheckpoint(o_.checkpoint_dir, step_, *model_, *optimizer_,
                                     scaler_ ? scaler_->State() : ExtraState{}));
    reported(info, "");
  }
  groups_.world->Barrier();  // no rank runs ahead of (or exits before) a durable checkpoint
  return absl::OkStatus();
}

// After the last step (or a stop): the parameter dump, a sample of what the model learned and
// the export, each from the whole model.
absl::Status Trainer::Finish() {
  if (offloaded_) RETURN_IF_ERROR(offloaded_->Flush());
  // What follows (the dump, the sample, the export) reads the parameters on the CPU.
  // FSDP: every rank takes part in gathering the whole model for the dump and the sample (on a
  // GPU before the move, which copies what the gathered views show).
  if (fsdp_) fsdp_->GatherFullParameters();
  // (Model parallelism: the other stages' parameters stay freed, on the CPU.)
  if (device_.is_cuda()) MoveModel(*model_, torch::kCPU);
  // Pipeline: rank 0 gathers the stages' parameters; the other ranks hold only their stage's.
  if (pipeline_) pipeline_->GatherToRankZero();
  if (!o_.dump_params.empty() && (!pipeline_ || rank0_)) {
    RETURN_IF_ERROR(WriteDump(o_.dump_params, *model_));
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
  // Replica r reads windows [r * per, (r + 1) * per) of the first eval_windows_ (or eval_batches
  // global batches of them) in micro-batches; every replica runs as many (FSDP's gathers and the
  // pipeline's sends match up), the windows past the end weighing nothing.
  const int64_t total =
      t_.eval_batches > 0
          ? std::min(eval_windows_, int64_t{t_.eval_batches} * sampler_->global_batch())
          : eval_windows_;
  const int replica = dims_.model_parallel ? layout_->replica : o_.rank;
  const int64_t per = (total + replicas_ - 1) / replicas_, micro = t_.micro_batch;
  const int micro_batches = static_cast<int>((per + micro - 1) / micro);
  // Each micro-batch's windows and target weights (a padding window is window 0, weighing 0).
  std::vector<std::vector<int64_t>> samples(micro_batches);
  std::vector<torch::Tensor> weights(micro_batches);
  double sum = 0, count = 0;
  for (int b = 0; b < micro_batches; ++b) {
    std::vector<bool> padding;
    for (int64_t j = 0; j < micro; ++j) {
      const int64_t in_share = b * micro + j, window = int64_t{replica} * per + in_share;
      padding.push_back(in_share >= per || window >= total);
      samples[b].push_back(padding.back() ? 0 : window);
    }
    weights[b] = eval_mask_.empty() ? torch::ones({micro, m_.seq_len}, torch::kFloat)
                                    : MaskWeights(eval_mask_, samples[b], m_.seq_len);
    for (int64_t j = 0; j < micro; ++j) {
      if (padding[j]) weights[b][j].zero_();
    }
    // The MLP predicts each window's last token only.
    const torch::Tensor& w = weights[b];
    count += (m_.kind == "mlp" ? w.select(1, m_.seq_len - 1) : w).sum().item<double>();
  }
  auto batch = [&](int b) {
    return ToDevice(MakeBatch(*eval_data_, samples[b], m_.seq_len), device_);
  };
  {
    AutocastScope autocast(device_, t_.precision);
    if (pipeline_) {
      sum = pipeline_->Evaluate(
          micro_batches, batch, [&](int b, const torch::Tensor& logits, const torch::Tensor& w) {
            return model_->MaskedLossSumOf(logits, w, ToDevice(weights[b], device_));
          });
    } else {
      for (int b = 0; b < micro_batches; ++b) {
        if (fsdp_) fsdp_->BeginForward(/*sync_gradients=*/false);
        sum += model_->MaskedLossSum(batch(b), ToDevice(weights[b], device_)).item<double>();
      }
      if (fsdp_) fsdp_->ReleaseAfterForward();
    }
  }
  model_->train();
  // One rank of a tensor-parallel group counts (all compute the sum); the last stage's.
  if (layout_ && (layout_->tp_rank != 0 || !layout_->last())) sum = count = 0;
  torch::Tensor both = torch::tensor({sum, count}, torch::kDouble);
  groups_.world->AllReduceSum({both})->Wait();
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
  try {
    // The consolidated checkpoint records what the sharded one does (the settings a resume must
    // keep, the eval loss), so that a resume from it is checked as from the original.
    // (A copy without meta.json records none; the manifest decides whether it consolidates.)
    std::string settings;
    if (std::filesystem::exists(sharded + "/meta.json")) {
      ASSIGN_OR_RETURN(settings, CheckpointSettings(sharded));
    }
    SetMetaNotes({std::move(settings), CheckpointEvalLoss(sharded)});
    ASSIGN_OR_RETURN(CheckpointInfo info, ConsolidateShardedCheckpoint(sharded, out_dir));
    Log(absl::StrCat("consolidated step ", info.step, " into ", info.path, " (", info.bytes,
                     " bytes)"));
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

absl::Status RunExportHf(const JobConfig& job, const std::string& checkpoint_dir,
                         const std::string& out_dir, bool merge_lora) {
  ModelConfig m = job.model;
  const LoraConfig& lora = job.train.lora;
  if (m.kind != "llama") {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.kind: --export-hf writes Llama-family models (llama), this job trains ", m.kind));
  }
  if (merge_lora && !lora.enabled()) {
    return absl::InvalidArgumentError(
        "--merge-lora: the job has no train.lora; its export is the whole model already");
  }
  if (!m.from.empty()) RETURN_IF_ERROR(ResolveFromCheckpoint(&m).status());
  try {
    ASSIGN_OR_RETURN(std::optional<CheckpointInfo> latest, FindLatestCheckpoint(checkpoint_dir));
    if (!latest.has_value()) {
      return absl::NotFoundError(
          absl::StrCat("--export-hf: no checkpoint in '", checkpoint_dir, "' (no 'latest')"));
    }
    std::string source = checkpoint_dir;
    const std::string consolidated = out_dir + "/.consolidated";
    // Removed however this ends.
    const std::unique_ptr<const std::string, void (*)(const std::string*)> cleanup(
        &consolidated, [](const std::string* path) {
          std::error_code ec;
          std::filesystem::remove_all(*path, ec);
        });
    if (std::filesystem::exists(latest->path + "/manifest.json")) {  // sharded (fsdp)
      ASSIGN_OR_RETURN(CheckpointInfo info,
                       ConsolidateShardedCheckpoint(latest->path, consolidated));
      (void)info;
      source = consolidated;
    }
    ModelOptions options;
    options.lora = lora;
    std::shared_ptr<LanguageModel> model = BuildModel(m, options, job.train.seed);
    // The checkpoint holds the optimizer's state too (of the parameters that train).
    const std::unique_ptr<torch::optim::Optimizer> optimizer =
        MakeOptimizer(TrainableParameters(*model),
                      HyperFor(job.train.optimizer, job.train.weight_decay), job.train.lr);
    absl::StatusOr<std::optional<CheckpointInfo>> loaded =
        LoadLatestCheckpoint(source, *model, *optimizer);
    if (!loaded.ok()) return loaded.status();
    RETURN_IF_ERROR(ExportModel(m, lora, *model, merge_lora, out_dir));
    Log(absl::StrCat("exported ", lora.enabled() && !merge_lora ? "the LoRA adapter of " : "",
                     "step ", latest->step, " of ", checkpoint_dir, " to ", out_dir,
                     lora.enabled() && merge_lora ? " (LoRA merged)" : ""));
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

std::string DescribeCompute() {
  return absl::StrCat("LibTorch ", TorchVersionString(), CudaBuild() ? " (CUDA)" : "", "\n",
                      DescribeBlas(), "\n", DescribeMatmuls());
}

std::string SupportedDevices() { return CudaUsable() ? "cpu cuda" : "cpu"; }

void InstallSigtermHandler() {
  struct sigaction action = {};
  action.sa_handler = OnSigterm;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
}

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
