// The job spec from YAML: the parser (field names, lines, size limits), one function per
// section, and the file loaders. Defaults are in spec_defaults.cc, checks in spec_validate.cc.
#include "common/spec.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "common/units.h"

namespace trainyard {

using v1::JobSpec;

namespace {

// A spec field's choices: the table's names, each with its wire value (the unset row left out).
template <typename W, typename E, size_t N>
std::vector<std::pair<std::string, W>> Choices(const EnumEntry<E> (&table)[N]) {
  std::vector<std::pair<std::string, W>> choices;
  for (const auto& row : table) {
    if (row.wire != 0) choices.emplace_back(row.name, static_cast<W>(row.wire));
  }
  return choices;
}

// Walks one YAML document, recording field lines and reporting errors as FILE:LINE: message.
class SpecParser {
 public:
  SpecParser(const std::string& filename, ParsedSpec& out) : filename_(filename), out_(out) {}

  absl::Status Error(const YAML::Node& node, const std::string& message) const {
    return absl::InvalidArgumentError(
        absl::StrCat(filename_, ":", node.Mark().line + 1, ": ", message));
  }

  // Checks that `node` is a mapping whose keys are all in `known`.
  absl::Status Mapping(const YAML::Node& node, const std::string& path,
                       const std::set<std::string>& known) {
    if (!node.IsMap()) {
      return Error(node, absl::StrCat(path.empty() ? "the spec" : path, ": expected a mapping"));
    }
    for (const auto& kv : node) {
      const std::string key = kv.first.as<std::string>();
      const std::string field = path.empty() ? key : absl::StrCat(path, ".", key);
      if (known.count(key) == 0) {
        return Error(kv.first, absl::StrCat("unknown field '", field,
                                            "' (known: ", absl::StrJoin(known, ", "), ")"));
      }
      out_.field_lines[field] = kv.first.Mark().line + 1;
    }
    return absl::OkStatus();
  }

  absl::Status Scalar(const YAML::Node& node, const std::string& field, std::string& text) {
    if (!node.IsScalar()) return Error(node, absl::StrCat(field, ": expected a scalar value"));
    text = node.Scalar();
    return absl::OkStatus();
  }

  template <typename Int>
  absl::Status Integer(const YAML::Node& parent, const char* key, const std::string& path,
                       Int& value) {
    const YAML::Node node = parent[key];
    if (!node) return absl::OkStatus();
    const std::string field = Join(path, key);
    std::string text;
    RETURN_IF_ERROR(Scalar(node, field, text));
    int64_t parsed = 0;
    if (!absl::SimpleAtoi(text, &parsed) ||
        parsed < static_cast<int64_t>(std::numeric_limits<Int>::min()) ||
        (parsed > 0 && static_cast<uint64_t>(parsed) > std::numeric_limits<Int>::max())) {
      return Error(node, absl::StrCat(field, ": expected an integer, got '", text, "'"));
    }
    value = static_cast<Int>(parsed);
    return absl::OkStatus();
  }

  absl::Status Double(const YAML::Node& parent, const char* key, const std::string& path,
                      double& value) {
    const YAML::Node node = parent[key];
    if (!node) return absl::OkStatus();
    const std::string field = Join(path, key);
    std::string text;
    RETURN_IF_ERROR(Scalar(node, field, text));
    if (!absl::SimpleAtod(text, &value) || !std::isfinite(value)) {
      return Error(node, absl::StrCat(field, ": expected a number, got '", text, "'"));
    }
    return absl::OkStatus();
  }

  absl::Status Bool(const YAML::Node& parent, const char* key, const std::string& path,
                    bool& value) {
    const YAML::Node node = parent[key];
    if (!node) return absl::OkStatus();
    const std::string field = Join(path, key);
    std::string text;
    RETURN_IF_ERROR(Scalar(node, field, text));
    if (!absl::SimpleAtob(text, &value)) {
      return Error(node, absl::StrCat(field, ": expected true or false, got '", text, "'"));
    }
    return absl::OkStatus();
  }

  absl::Status String(const YAML::Node& parent, const char* key, const std::string& path,
                      std::string& value) {
    const YAML::Node node = parent[key];
    if (!node) return absl::OkStatus();
    return Scalar(node, Join(path, key), value);
  }

  // A string from `names` (matched case-insensitively) mapped to its enum value.
  template <typename Enum>
  absl::Status Choice(const YAML::Node& parent, const char* key, const std::string& path,
                      const std::vector<std::pair<std::string, Enum>>& names, Enum& value) {
    const YAML::Node node = parent[key];
    if (!node) return absl::OkStatus();
    const std::string field = Join(path, key);
    std::string text;
    RETURN_IF_ERROR(Scalar(node, field, text));
    std::vector<std::string> allowed;
    for (const auto& [name, v] : names) {
      if (absl::EqualsIgnoreCase(name, text)) {
        value = v;
        return absl::OkStatus();
      }
      allowed.push_back(name);
    }
    return Error(node, absl::StrCat(field, ": unknown value '", text, "' (one of ",
                                    absl::StrJoin(allowed, ", "), ")"));
  }

  // Seconds as an integer, or an absl duration string such as "90m" or "2h30m".
  absl::Status Duration(const YAML::Node& parent, const char* key, const std::string& path,
                        int64_t& seconds) {
    const YAML::Node node = parent[key];
    if (!node) return absl::OkStatus();
    const std::string field = Join(path, key);
    std::string text;
    RETURN_IF_ERROR(Scalar(node, field, text));
    if (absl::SimpleAtoi(text, &seconds)) return absl::OkStatus();
    absl::Duration d;
    if (!absl::ParseDuration(text, &d)) {
      return Error(node, absl::StrCat(field,
                                      ": expected seconds or a duration such as '2h30m', "
                                      "got '",
                                      text, "'"));
    }
    seconds = absl::ToInt64Seconds(d);
    return absl::OkStatus();
  }

  static std::string Join(const std::string& path, const char* key) {
    return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
  }

 private:
  std::string filename_;
  ParsedSpec& out_;
};

// The spec's `command`.
absl::Status ParseCommand(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  if (!n.IsSequence() || n.size() == 0) {
    return p.Error(n, "command: expected a non-empty list, e.g. [python3, train.py]");
  }
  for (const auto& item : n) {
    std::string arg;
    RETURN_IF_ERROR(p.Scalar(item, "command", arg));
    spec.add_command(arg);
  }
  return absl::OkStatus();
}

// The spec's `env`.
absl::Status ParseEnv(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  if (!n.IsMap()) return p.Error(n, "env: expected a mapping of NAME: value");
  for (const auto& kv : n) {
    std::string name, value;
    RETURN_IF_ERROR(p.Scalar(kv.first, "env", name));
    RETURN_IF_ERROR(p.Scalar(kv.second, absl::StrCat("env.", name), value));
    (*spec.mutable_env())[name] = value;
  }
  return absl::OkStatus();
}

// The spec's `resources`.
absl::Status ParseResources(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  RETURN_IF_ERROR(p.Mapping(n, "resources", {"gpus", "cpus", "memory"}));
  int32_t gpus = 0;
  RETURN_IF_ERROR(p.Integer(n, "gpus", "resources", gpus));
  if (n["gpus"] && gpus <= 0) {
    return p.Error(n["gpus"], absl::StrCat("resources.gpus: must be >= 1, got ", gpus));
  }
  spec.mutable_resources()->set_gpus(gpus);
  double cpus = 0;
  RETURN_IF_ERROR(p.Double(n, "cpus", "resources", cpus));
  if (n["cpus"] && (cpus <= 0 || cpus > kMaxRankCpus)) {
    return p.Error(n["cpus"],
                   absl::StrCat("resources.cpus: CPUs per rank, more than 0 and at most ",
                                kMaxRankCpus, ", got ", cpus));
  }
  spec.mutable_resources()->set_cpus(cpus);
  if (n["memory"]) {
    std::string text;
    RETURN_IF_ERROR(p.Scalar(n["memory"], "resources.memory", text));
    const std::optional<int64_t> bytes = ParseBytes(text);
    if (!bytes.has_value() || *bytes <= 0 || *bytes > kMaxRankMemoryBytes) {
      return p.Error(n["memory"],
                     absl::StrCat("resources.memory: a size per rank such as 16GiB or 512MiB, at "
                                  "most 64TiB, got '",
                                  text, "'"));
    }
    spec.mutable_resources()->set_memory_bytes(*bytes);
  }
  return absl::OkStatus();
}

// The spec's `model`.
absl::Status ParseModel(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  RETURN_IF_ERROR(
      p.Mapping(n, "model",
                {"kind", "n_layer", "n_head", "d_model", "seq_len", "vocab", "tie_weights",
                 "d_hidden", "from", "n_kv_head", "head_dim", "rope_theta", "rms_norm_eps"}));
  auto& m = *spec.mutable_model();
  RETURN_IF_ERROR(p.String(n, "kind", "model", *m.mutable_kind()));
  int32_t v = 0;
  bool b = false;
  RETURN_IF_ERROR(p.Integer(n, "n_layer", "model", v));
  m.set_n_layer(v);
  v = 0;
  RETURN_IF_ERROR(p.Integer(n, "n_head", "model", v));
  m.set_n_head(v);
  v = 0;
  RETURN_IF_ERROR(p.Integer(n, "d_model", "model", v));
  m.set_d_model(v);
  v = 0;
  RETURN_IF_ERROR(p.Integer(n, "seq_len", "model", v));
  m.set_seq_len(v);
  v = 0;
  RETURN_IF_ERROR(p.Integer(n, "vocab", "model", v));
  m.set_vocab(v);
  v = 0;
  RETURN_IF_ERROR(p.Integer(n, "d_hidden", "model", v));
  m.set_d_hidden(v);
  RETURN_IF_ERROR(p.Bool(n, "tie_weights", "model", b));
  m.set_tie_weights(b);
  RETURN_IF_ERROR(p.String(n, "from", "model", *m.mutable_from()));
  v = 0;
  RETURN_IF_ERROR(p.Integer(n, "n_kv_head", "model", v));
  m.set_n_kv_head(v);
  v = 0;
  RETURN_IF_ERROR(p.Integer(n, "head_dim", "model", v));
  m.set_head_dim(v);
  double d = 0;
  RETURN_IF_ERROR(p.Double(n, "rope_theta", "model", d));
  m.set_rope_theta(d);
  d = 0;
  RETURN_IF_ERROR(p.Double(n, "rms_norm_eps", "model", d));
  m.set_rms_norm_eps(d);
  return absl::OkStatus();
}

// The spec's `data`.
absl::Status ParseData(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  RETURN_IF_ERROR(
      p.Mapping(n, "data", {"path", "format", "loss_mask", "eval_path", "eval_loss_mask"}));
  RETURN_IF_ERROR(p.String(n, "loss_mask", "data", *spec.mutable_data()->mutable_loss_mask()));
  RETURN_IF_ERROR(p.String(n, "eval_path", "data", *spec.mutable_data()->mutable_eval_path()));
  RETURN_IF_ERROR(
      p.String(n, "eval_loss_mask", "data", *spec.mutable_data()->mutable_eval_loss_mask()));
  RETURN_IF_ERROR(p.String(n, "path", "data", *spec.mutable_data()->mutable_path()));
  RETURN_IF_ERROR(p.String(n, "format", "data", *spec.mutable_data()->mutable_format()));
  return absl::OkStatus();
}

// The spec's `train`.
absl::Status ParseTrain(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  RETURN_IF_ERROR(p.Mapping(n, "train",
                            {"steps",
                             "micro_batch",
                             "grad_accum",
                             "lr",
                             "warmup",
                             "mixed_precision",
                             "activation_checkpointing",
                             "seed",
                             "weight_decay",
                             "grad_clip",
                             "lora",
                             "optimizer",
                             "micro_batches",
                             "lr_schedule",
                             "warmup_ratio",
                             "min_lr_ratio",
                             "eval_every",
                             "eval_batches",
                             "adam_beta1",
                             "adam_beta2",
                             "adam_epsilon",
                             "adafactor_eps",
                             "adafactor_clip_threshold",
                             "adafactor_decay_rate",
                             "no_weight_decay"}));
  auto& t = *spec.mutable_train();
  int64_t i64 = 0;
  int32_t i32 = 0;
  double d = 0;
  bool b = false;
  RETURN_IF_ERROR(p.Integer(n, "steps", "train", i64));
  t.set_steps(i64);
  RETURN_IF_ERROR(p.Integer(n, "micro_batch", "train", i32));
  t.set_micro_batch(i32);
  i32 = 0;
  RETURN_IF_ERROR(p.Integer(n, "grad_accum", "train", i32));
  t.set_grad_accum(i32);
  i32 = 0;
  RETURN_IF_ERROR(p.Integer(n, "micro_batches", "train", i32));
  t.set_micro_batches(i32);
  RETURN_IF_ERROR(p.Double(n, "lr", "train", d));
  t.set_lr(d);
  i64 = 0;
  RETURN_IF_ERROR(p.Integer(n, "warmup", "train", i64));
  t.set_warmup(i64);
  v1::MixedPrecision mp = v1::MIXED_PRECISION_UNSPECIFIED;
  RETURN_IF_ERROR(
      p.Choice(n, "mixed_precision", "train", Choices<v1::MixedPrecision>(kPrecisions), mp));
  t.set_mixed_precision(mp);
  v1::Optimizer optimizer = v1::OPTIMIZER_UNSPECIFIED;
  RETURN_IF_ERROR(
      p.Choice(n, "optimizer", "train", Choices<v1::Optimizer>(kOptimizers), optimizer));
  t.set_optimizer(optimizer);
  RETURN_IF_ERROR(p.Bool(n, "activation_checkpointing", "train", b));
  t.set_activation_checkpointing(b);
  uint64_t seed = 0;
  RETURN_IF_ERROR(p.Integer(n, "seed", "train", seed));
  t.set_seed(seed);
  d = 0;
  RETURN_IF_ERROR(p.Double(n, "weight_decay", "train", d));
  t.set_weight_decay(d);
  d = 0;
  RETURN_IF_ERROR(p.Double(n, "grad_clip", "train", d));
  t.set_grad_clip(d);
  v1::LrSchedule schedule = v1::LR_SCHEDULE_UNSPECIFIED;
  RETURN_IF_ERROR(
      p.Choice(n, "lr_schedule", "train", Choices<v1::LrSchedule>(kLrSchedules), schedule));
  t.set_lr_schedule(schedule);
  d = 0;
  RETURN_IF_ERROR(p.Double(n, "warmup_ratio", "train", d));
  t.set_warmup_ratio(d);
  i64 = 0;
  RETURN_IF_ERROR(p.Integer(n, "eval_every", "train", i64));
  t.set_eval_every(i64);
  i32 = 0;
  RETURN_IF_ERROR(p.Integer(n, "eval_batches", "train", i32));
  t.set_eval_batches(i32);
  // Present ones only: an absent one is its default (the schedule's, the optimizer's), not 0.
  for (const auto& [field, set] :
       std::vector<std::pair<const char*, void (v1::TrainSpec::*)(double)>>{
           {"min_lr_ratio", &v1::TrainSpec::set_min_lr_ratio},
           {"adam_beta1", &v1::TrainSpec::set_adam_beta1},
           {"adam_beta2", &v1::TrainSpec::set_adam_beta2},
           {"adam_epsilon", &v1::TrainSpec::set_adam_epsilon},
           {"adafactor_eps", &v1::TrainSpec::set_adafactor_eps},
           {"adafactor_clip_threshold", &v1::TrainSpec::set_adafactor_clip_threshold},
           {"adafactor_decay_rate", &v1::TrainSpec::set_adafactor_decay_rate}}) {
    if (!n[field]) continue;
    RETURN_IF_ERROR(p.Double(n, field, "train", d));
    (t.*set)(d);
  }
  if (const YAML::Node kinds = n["no_weight_decay"]) {
    if (!kinds.IsSequence()) {
      return p.Error(kinds, "train.no_weight_decay: expected a list, e.g. [bias, norm]");
    }
    for (const auto& item : kinds) {
      std::string kind;
      RETURN_IF_ERROR(p.Scalar(item, "train.no_weight_decay", kind));
      t.add_no_weight_decay(kind);
    }
  }
  if (const YAML::Node l = n["lora"]) {
    RETURN_IF_ERROR(p.Mapping(l, "train.lora", {"r", "alpha", "dropout", "target_modules"}));
    auto& lora = *t.mutable_lora();
    i32 = 0;
    RETURN_IF_ERROR(p.Integer(l, "r", "train.lora", i32));
    // Explicit zeros must not read as "unset" and silently become the defaults.
    if (l["r"] && i32 <= 0) {
      return p.Error(l["r"], absl::StrCat("train.lora.r: must be >= 1, got ", i32));
    }
    lora.set_r(i32);
    d = 0;
    RETURN_IF_ERROR(p.Double(l, "alpha", "train.lora", d));
    if (l["alpha"] && !(d > 0)) {
      return p.Error(l["alpha"], absl::StrCat("train.lora.alpha: must be > 0, got ", d));
    }
    lora.set_alpha(d);
    d = 0;
    RETURN_IF_ERROR(p.Double(l, "dropout", "train.lora", d));
    lora.set_dropout(d);
    if (const YAML::Node targets = l["target_modules"]) {
      if (!targets.IsSequence() || targets.size() == 0) {
        return p.Error(targets,
                       "train.lora.target_modules: expected a non-empty list of module names");
      }
      for (const auto& item : targets) {
        std::string name;
        RETURN_IF_ERROR(p.Scalar(item, "train.lora.target_modules", name));
        lora.add_target_modules(name);
      }
    }
  }
  return absl::OkStatus();
}

// The spec's `parallel`.
absl::Status ParseParallel(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  RETURN_IF_ERROR(
      p.Mapping(n, "parallel",
                {"strategy", "sharding_strategy", "bucket_mb", "delayed_update", "auto_wrap_policy",
                 "min_num_params", "backward_prefetch", "forward_prefetch", "max_gathered_units",
                 "cpu_ram_efficient_loading", "pipeline_stages", "pipeline_schedule",
                 "pipeline_split", "tensor_parallel", "sequence_parallel"}));
  auto& par = *spec.mutable_parallel();
  v1::Strategy s = v1::STRATEGY_UNSPECIFIED;
  RETURN_IF_ERROR(p.Choice(n, "strategy", "parallel", Choices<v1::Strategy>(kStrategies), s));
  par.set_strategy(s);
  v1::ShardingStrategy ss = v1::SHARDING_STRATEGY_UNSPECIFIED;
  RETURN_IF_ERROR(
      p.Choice(n, "sharding_strategy", "parallel", Choices<v1::ShardingStrategy>(kShardings), ss));
  par.set_sharding_strategy(ss);
  double mb = 0;
  RETURN_IF_ERROR(p.Double(n, "bucket_mb", "parallel", mb));
  par.set_bucket_mb(mb);
  bool delayed = false;
  RETURN_IF_ERROR(p.Bool(n, "delayed_update", "parallel", delayed));
  par.set_delayed_update(delayed);
  v1::WrapPolicy wrap = v1::WRAP_POLICY_UNSPECIFIED;
  RETURN_IF_ERROR(
      p.Choice(n, "auto_wrap_policy", "parallel", Choices<v1::WrapPolicy>(kWrapPolicies), wrap));
  par.set_auto_wrap_policy(wrap);
  int64_t min_params = 0;
  RETURN_IF_ERROR(p.Integer(n, "min_num_params", "parallel", min_params));
  par.set_min_num_params(min_params);
  v1::BackwardPrefetch prefetch = v1::BACKWARD_PREFETCH_UNSPECIFIED;
  RETURN_IF_ERROR(p.Choice(n, "backward_prefetch", "parallel",
                           Choices<v1::BackwardPrefetch>(kBackwardPrefetches), prefetch));
  par.set_backward_prefetch(prefetch);
  bool forward_prefetch = false;
  RETURN_IF_ERROR(p.Bool(n, "forward_prefetch", "parallel", forward_prefetch));
  par.set_forward_prefetch(forward_prefetch);
  int32_t max_gathered = 0;
  RETURN_IF_ERROR(p.Integer(n, "max_gathered_units", "parallel", max_gathered));
  par.set_max_gathered_units(max_gathered);
  if (n["cpu_ram_efficient_loading"]) {
    bool efficient = true;
    RETURN_IF_ERROR(p.Bool(n, "cpu_ram_efficient_loading", "parallel", efficient));
    par.set_cpu_ram_efficient_loading(efficient);
  }
  int32_t stages = 0;
  RETURN_IF_ERROR(p.Integer(n, "pipeline_stages", "parallel", stages));
  par.set_pipeline_stages(stages);
  int32_t tensor = 0;
  RETURN_IF_ERROR(p.Integer(n, "tensor_parallel", "parallel", tensor));
  par.set_tensor_parallel(tensor);
  bool sequence = false;
  RETURN_IF_ERROR(p.Bool(n, "sequence_parallel", "parallel", sequence));
  par.set_sequence_parallel(sequence);
  v1::PipelineSchedule schedule = v1::PIPELINE_SCHEDULE_UNSPECIFIED;
  RETURN_IF_ERROR(p.Choice(n, "pipeline_schedule", "parallel",
                           Choices<v1::PipelineSchedule>(kPipelineSchedules), schedule));
  par.set_pipeline_schedule(schedule);
  if (const YAML::Node split = n["pipeline_split"]) {
    if (!split.IsSequence() || split.size() == 0) {
      return p.Error(split,
                     "parallel.pipeline_split: expected a list of blocks per stage, e.g. [3, 5]");
    }
    for (const auto& item : split) {
      std::string text;
      RETURN_IF_ERROR(p.Scalar(item, "parallel.pipeline_split", text));
      int32_t blocks = 0;
      if (!absl::SimpleAtoi(text, &blocks)) {
        return p.Error(
            item, absl::StrCat("parallel.pipeline_split: expected an integer, got '", text, "'"));
      }
      par.add_pipeline_split(blocks);
    }
  }
  return absl::OkStatus();
}

// The spec's `checkpoint`.
absl::Status ParseCheckpoint(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  RETURN_IF_ERROR(p.Mapping(n, "checkpoint", {"every_steps", "export", "keep_last", "keep_best"}));
  int64_t every = 0;
  RETURN_IF_ERROR(p.Integer(n, "every_steps", "checkpoint", every));
  spec.mutable_checkpoint()->set_every_steps(every);
  if (n["keep_last"]) {
    int32_t keep = 0;
    RETURN_IF_ERROR(p.Integer(n, "keep_last", "checkpoint", keep));
    spec.mutable_checkpoint()->set_keep_last(keep);
  }
  bool keep_best = false;
  RETURN_IF_ERROR(p.Bool(n, "keep_best", "checkpoint", keep_best));
  spec.mutable_checkpoint()->set_keep_best(keep_best);
  v1::ExportFormat format = v1::EXPORT_FORMAT_UNSPECIFIED;
  RETURN_IF_ERROR(
      p.Choice(n, "export", "checkpoint", Choices<v1::ExportFormat>(kExportFormats), format));
  spec.mutable_checkpoint()->set_export_format(format);
  return absl::OkStatus();
}

absl::Status ParseDocument(const YAML::Node& root, SpecParser& p, JobSpec& spec) {
  RETURN_IF_ERROR(p.Mapping(root, "",
                            {"name", "priority", "resources", "model", "data", "train", "parallel",
                             "checkpoint", "max_restarts", "max_runtime", "preemptible",
                             "preemption_grace", "command", "workdir", "env"}));
  RETURN_IF_ERROR(p.String(root, "name", "", *spec.mutable_name()));
  if (const YAML::Node n = root["command"]) RETURN_IF_ERROR(ParseCommand(n, p, spec));
  RETURN_IF_ERROR(p.String(root, "workdir", "", *spec.mutable_workdir()));
  if (const YAML::Node n = root["env"]) RETURN_IF_ERROR(ParseEnv(n, p, spec));
  int32_t priority = 0;
  RETURN_IF_ERROR(p.Integer(root, "priority", "", priority));
  if (root["priority"]) {
    // An explicit 0 must not read as "unset" and silently become the default.
    if (priority == 0) return p.Error(root["priority"], "priority: must be in 1..100, got 0");
    spec.set_priority(priority);
  }
  int32_t max_restarts = 0;
  RETURN_IF_ERROR(p.Integer(root, "max_restarts", "", max_restarts));
  spec.set_max_restarts(max_restarts);
  // Optional durations, positive when given.
  auto positive_duration = [&](const char* key, int64_t& seconds) -> absl::Status {
    RETURN_IF_ERROR(p.Duration(root, key, "", seconds));
    if (root[key] && seconds <= 0) {
      return p.Error(root[key], absl::StrCat(key, ": must be positive"));
    }
    return absl::OkStatus();
  };
  int64_t max_runtime = 0, grace = 0;
  RETURN_IF_ERROR(positive_duration("max_runtime", max_runtime));
  spec.set_max_runtime_seconds(max_runtime);
  RETURN_IF_ERROR(positive_duration("preemption_grace", grace));
  spec.set_preemption_grace_seconds(grace);
  if (root["preemptible"]) {
    bool preemptible = true;
    RETURN_IF_ERROR(p.Bool(root, "preemptible", "", preemptible));
    spec.set_preemptible(preemptible);
  }

  if (const YAML::Node n = root["resources"]) RETURN_IF_ERROR(ParseResources(n, p, spec));
  if (const YAML::Node n = root["model"]) RETURN_IF_ERROR(ParseModel(n, p, spec));
  if (const YAML::Node n = root["data"]) RETURN_IF_ERROR(ParseData(n, p, spec));
  if (const YAML::Node n = root["train"]) RETURN_IF_ERROR(ParseTrain(n, p, spec));
  if (const YAML::Node n = root["parallel"]) RETURN_IF_ERROR(ParseParallel(n, p, spec));
  if (const YAML::Node n = root["checkpoint"]) RETURN_IF_ERROR(ParseCheckpoint(n, p, spec));
  return absl::OkStatus();
}

// 1-based line of the innermost '{' or '[' that is never closed, or 0 if none is found. yaml-cpp
// reports an unclosed flow collection where it gave up (often the end of the file), not where the
// collection opened. A light scan: an opening bracket counts where a token may start (after the
// line start, ':', ',', '-', '[' or '{'); quoted scalars and comments are skipped.
int UnclosedFlowLine(const std::string& text) {
  std::vector<std::pair<char, int>> open;  // bracket, line
  int line = 1;
  char last = '\n';  // last character that is not a blank
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool after_blank =
        i == 0 || text[i - 1] == ' ' || text[i - 1] == '\t' || text[i - 1] == '\n';
    const bool token_start = std::string_view("\n:,-[{").find(last) != std::string_view::npos;
    if (c == '\n') {
      ++line;
      last = '\n';
    } else if (c == ' ' || c == '\t' || c == '\r') {
      continue;
    } else if (c == '#' && after_blank) {
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
    } else if ((c == '\'' || c == '"') && token_start) {
      for (++i; i < text.size(); ++i) {
        if (text[i] == '\n') ++line;
        if (c == '"' && text[i] == '\\') {
          ++i;
        } else if (text[i] == c) {
          if (c == '\'' && i + 1 < text.size() && text[i + 1] == '\'') {
            ++i;  // '' is an escaped quote
          } else {
            break;
          }
        }
      }
      if (i >= text.size()) return 0;  // unterminated quote: a different error
      last = c;
    } else if ((c == '{' || c == '[') && token_start) {
      open.emplace_back(c, line);
      last = c;
    } else if ((c == '}' || c == ']') && !open.empty()) {
      open.pop_back();
      last = c;
    } else {
      last = c;
    }
  }
  return open.empty() ? 0 : open.back().second;
}

}  // namespace

absl::StatusOr<ParsedSpec> ParseJobSpecYaml(const std::string& yaml_text,
                                            const std::string& filename) {
  if (yaml_text.size() > kMaxSpecYamlBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        filename, ": ", yaml_text.size(), " bytes; a job spec is at most ", kMaxSpecYamlBytes));
  }
  ParsedSpec parsed;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    int line = e.mark.line + 1;
    std::string message = e.msg;
    if (e.msg == YAML::ErrorMsg::END_OF_MAP_FLOW || e.msg == YAML::ErrorMsg::END_OF_SEQ_FLOW) {
      if (const int opened = UnclosedFlowLine(yaml_text); opened > 0) {
        line = opened;
        absl::StrAppend(&message, " (the ",
                        e.msg == YAML::ErrorMsg::END_OF_MAP_FLOW ? "'{'" : "'['",
                        " on this line is never closed)");
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat(filename, ":", line, ": malformed YAML: ", message));
  }
  if (!root || root.IsNull()) {
    return absl::InvalidArgumentError(absl::StrCat(filename, ":1: the spec is empty"));
  }
  SpecParser parser(filename, parsed);
  try {
    RETURN_IF_ERROR(ParseDocument(root, parser, parsed.spec));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(filename, ":", e.mark.line + 1, ": ", e.msg));
  }
  return parsed;
}

absl::StatusOr<ParsedSpec> LoadJobSpecFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the file"));
  // One byte more than allowed is enough to refuse it, without reading a huge file whole.
  std::string text(kMaxSpecYamlBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  return ParseJobSpecYaml(text, path);
}

absl::StatusOr<ParsedSpec> LoadValidJobSpecFile(const std::string& path) {
  ASSIGN_OR_RETURN(ParsedSpec parsed, LoadJobSpecFile(path));
  // In a file, a command job's relative workdir is the spec file's folder's (`workdir: .` runs
  // the program beside its spec); sent on, every workdir is absolute.
  JobSpec& spec = parsed.spec;
  if (IsCommandJob(spec) && !spec.workdir().empty() && spec.workdir()[0] != '/') {
    std::error_code ec;
    const std::filesystem::path folder =
        std::filesystem::absolute(std::filesystem::path(path), ec).parent_path();
    if (!ec) spec.set_workdir((folder / spec.workdir()).lexically_normal().string());
    if (spec.workdir().size() > 1 && spec.workdir().back() == '/')
      spec.mutable_workdir()->pop_back();
  }
  ApplyJobSpecDefaults(parsed.spec);
  if (absl::Status s = ValidateJobSpec(parsed.spec); !s.ok()) {
    return AnnotateWithLine(s, parsed, path);
  }
  return parsed;
}

absl::Status AnnotateWithLine(const absl::Status& status, const ParsedSpec& parsed,
                              const std::string& filename) {
  if (status.ok()) return status;
  const std::string message(status.message());
  const size_t colon = message.find(':');
  if (colon == std::string::npos) return status;
  std::string field = message.substr(0, colon);
  // The field itself may be absent (e.g. required); fall back to its closest present parent.
  while (!field.empty()) {
    auto it = parsed.field_lines.find(field);
    if (it != parsed.field_lines.end()) {
      return absl::Status(status.code(), absl::StrCat(filename, ":", it->second, ": ", message));
    }
    const size_t dot = field.rfind('.');
    field = dot == std::string::npos ? "" : field.substr(0, dot);
  }
  return absl::Status(status.code(), absl::StrCat(filename, ": ", message));
}

}  // namespace trainyard
