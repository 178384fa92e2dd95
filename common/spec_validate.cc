// The job spec's checks: the table's ranges and enums (spec_schema.cc), then the rules between
// fields, one function per section, each error naming its field.
#include "common/spec.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/context_archive.h"
#include "common/field_limits.h"
#include "common/llama_config.h"
#include "common/spec_schema.h"
#include "common/status_macros.h"

namespace trainyard {

using v1::JobSpec;

namespace {

absl::Status FieldError(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

absl::Status CheckRange(const std::string& field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return FieldError(field, absl::StrCat("must be in ", lo, "..", hi, ", got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckRequired(const std::string& field, int64_t value, int64_t lo, int64_t hi) {
  if (value == 0 && lo > 0) return FieldError(field, "required");
  return CheckRange(field, value, lo, hi);
}

}  // namespace

namespace {

// The data-parallel strategy over pipeline stages or tensor-parallel groups (`field` is what
// asked for them, `what` names them): ddp, or fsdp sharding each part over its replicas.
absl::Status ValidateModelParallelStrategy(const v1::ParallelSpec& p, const std::string& field,
                                           const std::string& what) {
  if (p.strategy() == v1::OFFLOAD) {
    return FieldError(field, absl::StrCat(what,
                                          " are replicated with ddp or fsdp; parallel.strategy is "
                                          "offload"));
  }
  return absl::OkStatus();
}

// parallel.pipeline_* and train.micro_batches.
absl::Status ValidatePipeline(const JobSpec& spec) {
  const auto& p = spec.parallel();
  const auto& t = spec.train();
  const int stages = p.pipeline_stages();
  if (stages == 1) {
    if (p.pipeline_split_size() > 0) {
      return FieldError("parallel.pipeline_split", "applies to parallel.pipeline_stages > 1");
    }
    if (t.micro_batches() != 0) {
      return FieldError("train.micro_batches",
                        "applies to pipeline parallelism (parallel.pipeline_stages > 1); without "
                        "it, accumulate gradients with train.grad_accum");
    }
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(ValidateModelParallelStrategy(p, "parallel.pipeline_stages", "pipeline stages"));
  if (spec.resources().slots() % stages != 0) {
    return FieldError("resources.slots",
                      absl::StrCat(spec.resources().slots(), " ranks do not split into ", stages,
                                   " pipeline stages (parallel.pipeline_stages): use a multiple"));
  }
  RETURN_IF_ERROR(CheckRange("train.micro_batches", t.micro_batches(), 1, 1 << 16));
  if (t.grad_accum() != 1) {
    return FieldError("train.grad_accum",
                      absl::StrCat("must be 1 with pipeline parallelism, got ", t.grad_accum(),
                                   ": the stages accumulate over train.micro_batches"));
  }
  if (p.pipeline_split_size() > 0) {
    if (p.pipeline_split_size() != stages) {
      return FieldError("parallel.pipeline_split",
                        absl::StrCat("has ", p.pipeline_split_size(), " entries for ", stages,
                                     " pipeline stages"));
    }
    for (int blocks : p.pipeline_split()) {
      if (blocks < 1) {
        return FieldError("parallel.pipeline_split",
                          absl::StrCat("every stage needs at least one block, got ", blocks));
      }
    }
  }
  return absl::OkStatus();
}

// parallel.tensor_parallel.
absl::Status ValidateTensorParallel(const JobSpec& spec) {
  const auto& p = spec.parallel();
  const auto& m = spec.model();
  const auto& t = spec.train();
  const int tp = p.tensor_parallel();
  if (tp == 1) {
    if (p.sequence_parallel()) {
      return FieldError("parallel.sequence_parallel",
                        "splits the sequence over tensor-parallel ranks: set "
                        "parallel.tensor_parallel > 1");
    }
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(
      ValidateModelParallelStrategy(p, "parallel.tensor_parallel", "tensor-parallel groups"));
  if (m.kind() != "gpt" && m.kind() != "llama") {
    return FieldError(
        "parallel.tensor_parallel",
        absl::StrCat("splits the layers of gpt and llama models; model.kind is ", m.kind()));
  }
  const int64_t group = int64_t{p.pipeline_stages()} * tp;
  if (spec.resources().slots() % group != 0) {
    return FieldError("resources.slots",
                      absl::StrCat(spec.resources().slots(), " ranks do not split into ",
                                   p.pipeline_stages(), " pipeline stages x ", tp,
                                   " tensor-parallel ranks: use a multiple of ", group));
  }
  if (t.has_lora()) {
    return FieldError("train.lora",
                      "not with parallel.tensor_parallel (the adapters are not "
                      "split): use pipeline stages or fsdp");
  }
  if (t.optimizer() != v1::ADAMW && t.optimizer() != v1::LION) {
    return FieldError("train.optimizer",
                      absl::StrCat(OptimizerName(t.optimizer()),
                                   " keeps state across whole rows and columns (or blocks), which "
                                   "tensor-parallel shards cut: use adamw or lion with "
                                   "parallel.tensor_parallel"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// Environment names that trainyard sets for every rank of a command job: a spec's env may not
// set them (the job could not trust its own rank or credential otherwise).
bool ReservedEnvName(const std::string& name) {
  static const std::set<std::string> kReserved = {"RANK",
                                                  "LOCAL_RANK",
                                                  "WORLD_SIZE",
                                                  "LOCAL_WORLD_SIZE",
                                                  "GROUP_RANK",
                                                  "GROUP_WORLD_SIZE",
                                                  "ROLE_RANK",
                                                  "ROLE_WORLD_SIZE",
                                                  "ROLE_NAME",
                                                  "MASTER_ADDR",
                                                  "MASTER_PORT",
                                                  "TORCHELASTIC_RESTART_COUNT",
                                                  "TORCHELASTIC_RUN_ID",
                                                  "TORCHELASTIC_MAX_RESTARTS",
                                                  "TORCHELASTIC_USE_AGENT_STORE",
                                                  "TORCHELASTIC_ERROR_FILE",
                                                  "CUDA_VISIBLE_DEVICES",
                                                  "HOME",
                                                  "USER",
                                                  "LOGNAME"};
  return kReserved.count(name) > 0 || absl::StartsWith(name, "TRAINYARD_");
}

// resources.nodes and ranks_per_node (torchrun's --nnodes and --nproc-per-node): command jobs,
// whole devices per node, whole ranks per device.
absl::Status ValidateNodes(const JobSpec& spec) {
  const v1::Resources& r = spec.resources();
  if (r.nodes() == 0 && r.ranks_per_node() == 0) return absl::OkStatus();
  const char* field = r.nodes() > 0 ? "resources.nodes" : "resources.ranks_per_node";
  if (!IsCommandJob(spec)) {
    return FieldError(field,
                      "only a command job (the built-in trainer places a rank on each "
                      "device, as parallel: says)");
  }
  if (r.nodes() == 0) {
    return FieldError("resources.ranks_per_node",
                      "give resources.nodes too (torchrun's --nnodes; 1 for one node)");
  }
  if (r.slots() % r.nodes() != 0) {
    return FieldError("resources.slots",
                      absl::StrCat(r.slots(), " devices do not split evenly over ", r.nodes(),
                                   " nodes (resources.nodes)"));
  }
  const int per_node = r.slots() / r.nodes();
  if (r.ranks_per_node() > 0 && r.ranks_per_node() % per_node != 0) {
    return FieldError("resources.ranks_per_node",
                      absl::StrCat(r.ranks_per_node(), " ranks do not share ", per_node,
                                   " devices a node evenly: give a multiple of ", per_node,
                                   " (resources.slots / resources.nodes)"));
  }
  // Each rank costs its node a root shepherd, descriptors and a thread in the worker, and its own
  // cgroups: a one-device job of 65,536 ranks ran them all on one node.
  if (r.ranks_per_node() > kMaxRanksPerDevice * per_node) {
    return FieldError(
        "resources.ranks_per_node",
        absl::StrCat(r.ranks_per_node(), " ranks on ", per_node, " devices a node: at most ",
                     kMaxRanksPerDevice, " ranks share a device"));
  }
  if (static_cast<int64_t>(r.nodes()) * std::max(r.ranks_per_node(), per_node) > 65536) {
    return FieldError(field, "more than 65536 ranks in all");
  }
  return absl::OkStatus();
}

absl::Status ValidateCommandJob(const JobSpec& spec) {
  if (spec.has_model() || spec.has_data() || spec.has_train() || spec.has_parallel()) {
    const char* given = spec.has_model()   ? "model"
                        : spec.has_data()  ? "data"
                        : spec.has_train() ? "train"
                                           : "parallel";
    return FieldError(given, absl::StrCat("a command job runs its own program: give command or ",
                                          given, ", not both"));
  }
  if (spec.command(0).empty()) return FieldError("command[0]", "the program is empty");
  for (int i = 0; i < spec.command_size(); ++i) {
    if (spec.command(i).find('\0') != std::string::npos) {
      return FieldError(absl::StrCat("command[", i, "]"), "contains a NUL byte");
    }
  }
  if (!spec.workdir().empty() && spec.workdir()[0] != '/') {
    return FieldError("workdir", absl::StrCat("must be an absolute path (the ranks run elsewhere), "
                                              "got '",
                                              spec.workdir(), "'"));
  }
  if (!spec.context().empty()) {
    // Uploaded: its digest. In a spec file yard has not sent yet: the folder it packs.
    if (!IsContextDigest(spec.context()) && spec.context()[0] != '/') {
      return FieldError("context", absl::StrCat("a folder to upload (yard makes it absolute) or an "
                                                "uploaded context's sha256:<64 hex>, got '",
                                                spec.context(), "'"));
    }
    if (!spec.workdir().empty()) {
      return FieldError("workdir", "not with context: the ranks start in the unpacked context");
    }
  }
  for (const auto& [name, value] : spec.env()) {
    bool valid = !name.empty() && !absl::ascii_isdigit(static_cast<unsigned char>(name[0]));
    for (char c : name) {
      valid = valid && (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_');
    }
    if (!valid) {
      return FieldError("env", absl::StrCat("'", name,
                                            "' is not a variable name (letters, digits and _, "
                                            "not starting with a digit)"));
    }
    if (ReservedEnvName(name)) {
      return FieldError(absl::StrCat("env.", name),
                        "is set by trainyard for every rank (torchrun's and TRAINYARD_* names)");
    }
    if (value.find('\0') != std::string::npos) {
      return FieldError(absl::StrCat("env.", name), "contains a NUL byte");
    }
  }
  if (spec.checkpoint().export_format() != v1::EXPORT_FORMAT_UNSPECIFIED) {
    return FieldError("checkpoint.export", "only the built-in trainer exports models");
  }
  return absl::OkStatus();
}

}  // namespace

bool IsCommandJob(const JobSpec& spec) { return spec.command_size() > 0; }

int RanksPerDevice(const JobSpec& spec) {
  const v1::Resources& r = spec.resources();
  if (r.nodes() <= 0 || r.ranks_per_node() <= 0 || r.slots() < r.nodes()) return 1;
  return std::max(1, r.ranks_per_node() / (r.slots() / r.nodes()));
}

int WorldSizeOf(const JobSpec& spec) { return spec.resources().slots() * RanksPerDevice(spec); }

namespace {

// The spec's `model` (a training job).
absl::Status ValidateModel(const JobSpec& spec) {
  const auto& m = spec.model();
  if (m.kind() != "gpt" && m.kind() != "mlp" && m.kind() != "llama") {
    return FieldError("model.kind",
                      absl::StrCat("unknown value '", m.kind(), "' (gpt, mlp or llama)"));
  }
  if (m.kind() != "llama" && !m.from().empty()) {
    return FieldError("model.from", "only model.kind llama starts from a checkpoint");
  }
  if (!m.activation().empty()) {
    if (m.kind() == "llama") {
      return FieldError("model.activation",
                        "llama's MLP is SwiGLU, or hidden_act from model.from's config.json; "
                        "leave it out");
    }
    if (m.activation() != "gelu" && m.activation() != "gelu_tanh") {
      return FieldError("model.activation",
                        absl::StrCat("unknown value '", m.activation(), "' (gelu or gelu_tanh)"));
    }
  }
  const bool from_checkpoint = !m.from().empty();
  if (from_checkpoint && m.from()[0] != '/') {
    return FieldError("model.from",
                      absl::StrCat("must be an absolute path (the trainer runs elsewhere), got '",
                                   m.from(), "'"));
  }
  // Sizes a checkpoint's config.json gives may be left at 0; any given must be in range.
  auto size = [&](const char* field, int64_t value, int64_t max) {
    if (from_checkpoint && value == 0) return absl::OkStatus();
    return CheckRequired(field, value, 1, max);
  };
  RETURN_IF_ERROR(size("model.n_layer", m.n_layer(), 1024));
  RETURN_IF_ERROR(size("model.d_model", m.d_model(), 65536));
  RETURN_IF_ERROR(size("model.vocab", m.vocab(), 1 << 24));
  if (m.kind() == "llama") {
    RETURN_IF_ERROR(size("model.n_head", m.n_head(), 1024));
    RETURN_IF_ERROR(size("model.d_hidden", m.d_hidden(), 1 << 20));
    if (m.n_head() > 0 && m.n_kv_head() > 0 && m.n_head() % m.n_kv_head() != 0) {
      return FieldError("model.n_kv_head", absl::StrCat("must divide model.n_head (", m.n_head(),
                                                        "), got ", m.n_kv_head()));
    }
    if (m.head_dim() == 0 && m.n_head() > 0 && m.d_model() % m.n_head() != 0) {
      return FieldError("model.n_head", absl::StrCat("must divide model.d_model (", m.d_model(),
                                                     "), got ", m.n_head()));
    }
    const int head_dim = m.head_dim() > 0 ? m.head_dim()
                         : m.n_head() > 0 ? m.d_model() / m.n_head()
                                          : 0;
    if (head_dim % 2 != 0) {  // rotary embeddings turn pairs of values
      return FieldError(
          m.head_dim() > 0 ? "model.head_dim" : "model.n_head",
          absl::StrCat("the head dimension must be even for rotary embeddings, got ", head_dim));
    }
    // With a checkpoint they are its config.json's.
    if (from_checkpoint && m.rope_theta() != 0) {
      return FieldError("model.rope_theta", "comes from model.from's config.json; leave it out");
    }
    if (from_checkpoint && m.rms_norm_eps() != 0) {
      return FieldError("model.rms_norm_eps", "comes from model.from's config.json; leave it out");
    }
    // Offload places the parameters on parameter servers at submit, by their count.
    if (from_checkpoint && spec.parallel().strategy() == v1::OFFLOAD) {
      for (const auto& [field, value] : {std::pair<const char*, int>{"model.n_layer", m.n_layer()},
                                         {"model.d_model", m.d_model()},
                                         {"model.n_head", m.n_head()},
                                         {"model.d_hidden", m.d_hidden()},
                                         {"model.vocab", m.vocab()}}) {
        if (value == 0) {
          return FieldError(field,
                            "required with parallel.strategy offload (the coordinator sizes the "
                            "parameter servers from the spec; model.from is read by the trainer)");
        }
      }
    }
    if (m.rope_theta() < 0 || !std::isfinite(m.rope_theta())) {
      return FieldError("model.rope_theta", absl::StrCat("must be > 0, got ", m.rope_theta()));
    }
    if (m.rms_norm_eps() < 0 || !std::isfinite(m.rms_norm_eps())) {
      return FieldError("model.rms_norm_eps", absl::StrCat("must be > 0, got ", m.rms_norm_eps()));
    }
  } else if (m.kind() == "gpt") {
    RETURN_IF_ERROR(CheckRequired("model.n_head", m.n_head(), 1, 1024));
    if (m.d_model() % m.n_head() != 0) {
      return FieldError("model.n_head", absl::StrCat("must divide model.d_model (", m.d_model(),
                                                     "), got ", m.n_head()));
    }
  } else {
    RETURN_IF_ERROR(CheckRequired("model.d_hidden", m.d_hidden(), 1, 1 << 20));
  }
  return absl::OkStatus();
}

// The spec's `data`, against the model's vocabulary.
absl::Status ValidateData(const JobSpec& spec) {
  const auto& m = spec.model();
  const bool from_checkpoint = !m.from().empty();
  const auto& d = spec.data();
  if (d.path().empty()) return FieldError("data.path", "required");
  if (d.format() != "bytes" && d.format() != "uint16" && d.format() != "uint32") {
    return FieldError("data.format",
                      absl::StrCat("unknown value '", d.format(), "' (bytes, uint16 or uint32)"));
  }
  if (d.format() == "bytes" && m.vocab() < 256 && !(from_checkpoint && m.vocab() == 0)) {
    return FieldError("model.vocab",
                      absl::StrCat("must be >= 256 for data.format bytes, got ", m.vocab()));
  }
  if (d.format() == "uint16" && m.vocab() > 65536) {
    return FieldError("model.vocab",
                      absl::StrCat("must be <= 65536 for data.format uint16, got ", m.vocab()));
  }
  if (!d.eval_loss_mask().empty() && d.eval_path().empty()) {
    return FieldError("data.eval_loss_mask", "needs data.eval_path (the held-out tokens it masks)");
  }
  if (d.eval_path().empty() && spec.train().eval_every() > 0) {
    return FieldError("train.eval_every", "needs data.eval_path (the held-out tokens)");
  }
  return absl::OkStatus();
}

// The optimizer's constants (train.adam_*, train.adafactor_*, train.no_weight_decay) against the
// optimizer (their ranges are the table's).
absl::Status ValidateOptimizerSettings(const JobSpec& spec) {
  const auto& t = spec.train();
  const bool adafactor = t.optimizer() == v1::ADAFACTOR, lion = t.optimizer() == v1::LION;
  const std::string name = OptimizerName(t.optimizer());
  for (const auto& [field, has] : std::vector<std::pair<const char*, bool>>{
           {"train.adam_beta1", t.has_adam_beta1()}, {"train.adam_beta2", t.has_adam_beta2()}}) {
    if (has && adafactor) {
      return FieldError(field, "adafactor has no betas (see train.adafactor_decay_rate)");
    }
  }
  if (t.has_adam_epsilon() && (adafactor || lion)) {
    return FieldError("train.adam_epsilon",
                      absl::StrCat(name, " has no epsilon",
                                   adafactor ? " of Adam's (see train.adafactor_eps)" : ""));
  }
  for (const auto& [field, has] : std::vector<std::pair<const char*, bool>>{
           {"train.adafactor_eps", t.has_adafactor_eps()},
           {"train.adafactor_clip_threshold", t.has_adafactor_clip_threshold()},
           {"train.adafactor_decay_rate", t.has_adafactor_decay_rate()}}) {
    if (has && !adafactor) {
      return FieldError(field, absl::StrCat("is adafactor's; train.optimizer is ", name));
    }
  }
  std::set<std::string> kinds;
  for (const std::string& kind : t.no_weight_decay()) {
    if (kind != "bias" && kind != "norm" && kind != "embedding") {
      return FieldError("train.no_weight_decay",
                        absl::StrCat("unknown kind '", kind, "' (bias, norm or embedding)"));
    }
    if (!kinds.insert(kind).second) {
      return FieldError("train.no_weight_decay", absl::StrCat("'", kind, "' is listed twice"));
    }
  }
  if (!kinds.empty() && spec.parallel().strategy() == v1::OFFLOAD) {
    return FieldError("train.no_weight_decay",
                      "not with parallel.strategy offload (the parameter servers decay every "
                      "parameter): use ddp or fsdp");
  }
  return absl::OkStatus();
}

// The spec's `train`.
absl::Status ValidateTrain(const JobSpec& spec) {
  const auto& m = spec.model();
  const auto& t = spec.train();
  RETURN_IF_ERROR(CheckRange("train.warmup", t.warmup(), 0, t.steps()));
  RETURN_IF_ERROR(CheckRange("train.eval_every", t.eval_every(), 0, t.steps()));
  if (t.warmup_ratio() > 0 && t.warmup() > 0) {
    return FieldError("train.warmup_ratio",
                      "give train.warmup (steps) or train.warmup_ratio, "
                      "not both");
  }
  if (t.lr_schedule() == v1::CONSTANT && (t.warmup() > 0 || t.warmup_ratio() > 0)) {
    return FieldError("train.lr_schedule",
                      "constant has no warmup: use constant_with_warmup, or drop train.warmup");
  }
  const bool ends_at_min = t.lr_schedule() == v1::COSINE_WITH_MIN_LR ||
                           t.lr_schedule() == v1::WARMUP_COSINE ||
                           t.lr_schedule() == v1::LR_SCHEDULE_UNSPECIFIED;
  if (t.has_min_lr_ratio() && !ends_at_min) {
    return FieldError("train.min_lr_ratio",
                      absl::StrCat("only warmup_cosine and cosine_with_min_lr end at a minimum; ",
                                   LrScheduleName(t.lr_schedule()), " does not"));
  }
  if (t.lr_schedule() == v1::COSINE_WITH_MIN_LR && !t.has_min_lr_ratio()) {
    return FieldError("train.min_lr_ratio",
                      "cosine_with_min_lr needs it (transformers' min_lr_rate), in [0, 1]");
  }
  if (t.optimizer() != v1::ADAMW && spec.parallel().strategy() == v1::OFFLOAD) {
    return FieldError("train.optimizer",
                      absl::StrCat(OptimizerName(t.optimizer()),
                                   " does not run on the parameter servers, which apply AdamW: "
                                   "use adamw with parallel.strategy offload, or ddp or fsdp"));
  }
  if (t.has_lora()) {
    const auto& lora = t.lora();
    if (m.kind() != "llama") {
      return FieldError("train.lora",
                        absl::StrCat("adapts llama's projections; model.kind is ", m.kind()));
    }
    if (spec.parallel().strategy() == v1::OFFLOAD) {
      return FieldError("train.lora",
                        "not with parallel.strategy offload (the adapters are small enough to "
                        "train where they are: use ddp or fsdp)");
    }
    std::set<std::string> seen;
    for (const std::string& target : lora.target_modules()) {
      const auto& known = LoraTargetNames();
      if (std::find(known.begin(), known.end(), target) == known.end()) {
        return FieldError("train.lora.target_modules",
                          absl::StrCat("unknown module '", target,
                                       "' (known: ", absl::StrJoin(known, ", "), ")"));
      }
      if (!seen.insert(target).second) {
        return FieldError("train.lora.target_modules",
                          absl::StrCat("'", target, "' is listed twice"));
      }
    }
    if (lora.target_modules().empty()) {
      return FieldError("train.lora.target_modules", "must name at least one module");
    }
  }
  return absl::OkStatus();
}

// The spec's `parallel`, and the layout against the model's sizes.
absl::Status ValidateParallel(const JobSpec& spec) {
  const auto& p = spec.parallel();
  if (p.delayed_update() && p.strategy() != v1::OFFLOAD) {
    return FieldError("parallel.delayed_update", "only applies to strategy offload");
  }
  RETURN_IF_ERROR(ValidatePipeline(spec));
  RETURN_IF_ERROR(ValidateTensorParallel(spec));
  // fp16's dynamic loss scaling is DDP's only (the trainer's ParallelDims says the same, for a
  // spec that reached it another way): refused at submit, not on a rank after placement.
  const bool sharded = p.strategy() == v1::FSDP && p.sharding_strategy() != v1::NO_SHARD;
  if (spec.train().mixed_precision() == v1::FP16 &&
      (sharded || p.strategy() == v1::OFFLOAD || p.pipeline_stages() > 1 ||
       p.tensor_parallel() > 1)) {
    return FieldError("train.mixed_precision",
                      "fp16 (dynamic loss scaling) runs with strategy ddp (or fsdp NO_SHARD) "
                      "without pipeline stages or tensor parallelism only so far; use bf16");
  }
  // The sizes the layout cuts (those model.from fills are checked by the trainer).
  if (const std::string misfit =
          ModelParallelMisfit(ToModelConfig(spec.model()), ToJobConfig(spec).parallel);
      !misfit.empty()) {
    return absl::InvalidArgumentError(misfit);
  }
  return absl::OkStatus();
}

// The spec's `checkpoint`.
absl::Status ValidateCheckpoint(const JobSpec& spec) {
  const auto& m = spec.model();
  const auto& t = spec.train();
  if (spec.checkpoint().keep_best() && spec.data().eval_path().empty()) {
    return FieldError("checkpoint.keep_best",
                      "needs an evaluation to rank checkpoints by (data.eval_path)");
  }
  if (const v1::ExportFormat f = spec.checkpoint().export_format();
      f != v1::EXPORT_FORMAT_UNSPECIFIED) {
    if (m.kind() != "llama") {
      return FieldError("checkpoint.export", absl::StrCat("writes Llama-family models (llama); "
                                                          "model.kind is ",
                                                          m.kind()));
    }
    if (f == v1::EXPORT_HF_MERGED && !t.has_lora()) {
      return FieldError("checkpoint.export",
                        "hf_merged merges train.lora's adapters, and the job has none: use hf");
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// `after`: job ids ("job-7"), each once, at most 64.
absl::Status ValidateAfter(const JobSpec& spec) {
  if (spec.after_size() > 64) {
    return FieldError("after", absl::StrCat("at most 64 jobs, got ", spec.after_size()));
  }
  std::set<std::string> seen;
  for (int i = 0; i < spec.after_size(); ++i) {
    const std::string& id = spec.after(i);
    const std::string field = absl::StrCat("after[", i, "]");
    int64_t number = 0;
    if (!absl::StartsWith(id, "job-") || !absl::SimpleAtoi(id.substr(4), &number) || number < 1 ||
        id != absl::StrCat("job-", number)) {
      return FieldError(field, absl::StrCat("expected a job id such as job-7, got '", id, "'"));
    }
    if (!seen.insert(id).second) return FieldError(field, absl::StrCat(id, " is given twice"));
  }
  return absl::OkStatus();
}

// `array`: a name (letters, digits, '-', '_', '.'; at most 64), an index below the count (at most
// 10000), a limit on running tasks that is not negative.
absl::Status ValidateArray(const JobSpec& spec) {
  if (!spec.has_array()) return absl::OkStatus();
  const v1::ArraySpec& a = spec.array();
  if (a.id().empty() || a.id().size() > 64) {
    return FieldError("array.id", "required, at most 64 characters");
  }
  for (char c : a.id()) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return FieldError("array.id", absl::StrCat("only letters, digits, '-', '_' and '.' are "
                                                 "allowed, got '",
                                                 a.id(), "'"));
    }
  }
  if (a.count() < 1 || a.count() > 10000) {
    return FieldError("array.count", absl::StrCat("must be in 1..10000, got ", a.count()));
  }
  if (a.index() < 0)
    return FieldError("array.index", absl::StrCat("must be >= 0, got ", a.index()));
  if (a.max_running() < 0) {
    return FieldError("array.max_running", absl::StrCat("must be >= 0, got ", a.max_running()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobSpec(const JobSpec& spec) {
  RETURN_IF_ERROR(CheckFieldSizes(spec, JobSpecFieldLimits(), ""));
  if (spec.name().empty()) return FieldError("name", "required");
  if (spec.name().size() > 128) {
    return FieldError("name", absl::StrCat("at most 128 characters, got ", spec.name().size()));
  }
  for (char c : spec.name()) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return FieldError("name", absl::StrCat("only letters, digits, '-', '_' and '.' are allowed, "
                                             "got '",
                                             spec.name(), "'"));
    }
  }
  RETURN_IF_ERROR(spec_schema::CheckRanges(spec, spec_schema::Scope::kEveryJob));
  RETURN_IF_ERROR(ValidateNodes(spec));
  RETURN_IF_ERROR(ValidateAfter(spec));
  RETURN_IF_ERROR(ValidateArray(spec));
  if (IsCommandJob(spec)) return ValidateCommandJob(spec);
  if (!spec.workdir().empty()) return FieldError("workdir", "only a command job has a workdir");
  if (!spec.env().empty()) return FieldError("env", "only a command job has env");
  if (!spec.context().empty()) {
    return FieldError("context",
                      "only a command job has a context (the built-in trainer's code "
                      "is on every worker)");
  }
  RETURN_IF_ERROR(spec_schema::CheckRanges(spec, spec_schema::Scope::kTrainingJob));

  RETURN_IF_ERROR(ValidateModel(spec));
  RETURN_IF_ERROR(ValidateData(spec));
  RETURN_IF_ERROR(ValidateTrain(spec));
  RETURN_IF_ERROR(ValidateOptimizerSettings(spec));
  RETURN_IF_ERROR(ValidateParallel(spec));
  return ValidateCheckpoint(spec);
}

}  // namespace trainyard
