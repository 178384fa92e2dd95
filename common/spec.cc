#include "common/spec.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/field_limits.h"
#include "common/llama_config.h"
#include "common/status_macros.h"

namespace trainyard {
namespace {

// The tables of job_config.h against the generated enums: each row's number is the wire's value
// of the same meaning, in the same order.
template <typename E, size_t N, typename W, size_t M>
constexpr bool SameNumbers(const EnumEntry<E> (&table)[N], const W (&wire)[M]) {
  if (N != M) return false;
  for (size_t i = 0; i < N; ++i) {
    if (table[i].wire != static_cast<int>(wire[i])) return false;
  }
  return true;
}
static_assert(SameNumbers(kStrategies, {v1::DDP, v1::FSDP, v1::OFFLOAD}));
static_assert(SameNumbers(kShardings,
                          {v1::FULL_SHARD, v1::SHARD_GRAD_OP, v1::NO_SHARD, v1::HYBRID_SHARD}));
static_assert(SameNumbers(kWrapPolicies, {v1::TRANSFORMER_BASED_WRAP, v1::SIZE_BASED_WRAP}));
static_assert(SameNumbers(kBackwardPrefetches,
                          {v1::BACKWARD_PRE, v1::BACKWARD_POST, v1::NO_PREFETCH}));
static_assert(SameNumbers(kPrecisions, {v1::FP32, v1::BF16, v1::FP16}));
static_assert(SameNumbers(kPipelineSchedules, {v1::GPIPE, v1::ONE_F_ONE_B}));
static_assert(SameNumbers(kExportFormats,
                          {v1::EXPORT_FORMAT_UNSPECIFIED, v1::EXPORT_HF, v1::EXPORT_HF_MERGED}));
static_assert(SameNumbers(kOptimizers, {v1::ADAMW, v1::ADAFACTOR, v1::LION, v1::ADAMW_8BIT}));

// A spec field's choices: the table's names, each with its wire value (the unset row left out).
template <typename W, typename E, size_t N>
std::vector<std::pair<std::string, W>> Choices(const EnumEntry<E> (&table)[N]) {
  std::vector<std::pair<std::string, W>> choices;
  for (const auto& row : table) {
    if (row.wire != 0) choices.emplace_back(row.name, static_cast<W>(row.wire));
  }
  return choices;
}

// The spec name of a wire value; the generated name, lower-cased, for a number with no row.
template <typename E, size_t N, typename W>
std::string WireName(const EnumEntry<E> (&table)[N], W wire) {
  for (const auto& row : table) {
    if (row.wire == static_cast<int>(wire)) return row.name;
  }
  const auto* value =
      google::protobuf::GetEnumDescriptor<W>()->FindValueByNumber(static_cast<int>(wire));
  return value != nullptr ? absl::AsciiStrToLower(value->name())
                          : absl::StrCat(static_cast<int>(wire));
}

using v1::JobSpec;

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
  RETURN_IF_ERROR(p.Mapping(n, "resources", {"gpus"}));
  int32_t gpus = 0;
  RETURN_IF_ERROR(p.Integer(n, "gpus", "resources", gpus));
  if (n["gpus"] && gpus <= 0) {
    return p.Error(n["gpus"], absl::StrCat("resources.gpus: must be >= 1, got ", gpus));
  }
  spec.mutable_resources()->set_gpus(gpus);
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
  RETURN_IF_ERROR(p.Mapping(n, "data", {"path", "format", "loss_mask"}));
  RETURN_IF_ERROR(p.String(n, "loss_mask", "data", *spec.mutable_data()->mutable_loss_mask()));
  RETURN_IF_ERROR(p.String(n, "path", "data", *spec.mutable_data()->mutable_path()));
  RETURN_IF_ERROR(p.String(n, "format", "data", *spec.mutable_data()->mutable_format()));
  return absl::OkStatus();
}

// The spec's `train`.
absl::Status ParseTrain(const YAML::Node& n, SpecParser& p, JobSpec& spec) {
  RETURN_IF_ERROR(p.Mapping(n, "train",
                            {"steps", "micro_batch", "grad_accum", "lr", "warmup",
                             "mixed_precision", "activation_checkpointing", "seed", "weight_decay",
                             "grad_clip", "lora", "optimizer", "micro_batches"}));
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
  RETURN_IF_ERROR(p.Mapping(n, "checkpoint", {"every_steps", "export"}));
  int64_t every = 0;
  RETURN_IF_ERROR(p.Integer(n, "every_steps", "checkpoint", every));
  spec.mutable_checkpoint()->set_every_steps(every);
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

void ApplyJobSpecDefaults(JobSpec& spec) {
  if (spec.priority() == 0) spec.set_priority(50);
  if (IsCommandJob(spec)) return;  // the program's own settings are its business
  auto& m = *spec.mutable_model();
  if (m.kind().empty()) m.set_kind("gpt");
  if (m.kind() == "mlp" && m.d_hidden() == 0) m.set_d_hidden(4 * m.d_model());
  // llama without a checkpoint: Llama's MLP width (8/3 d_model, rounded up to a multiple of 64)
  // and defaults; with one, its config.json fills what is left at 0 (in the trainer).
  if (m.kind() == "llama" && m.from().empty()) {
    if (m.d_hidden() == 0) m.set_d_hidden((8 * m.d_model() / 3 + 63) / 64 * 64);
    if (m.n_kv_head() == 0) m.set_n_kv_head(m.n_head());
    if (m.rope_theta() == 0) m.set_rope_theta(10000);
    if (m.rms_norm_eps() == 0) m.set_rms_norm_eps(1e-6);
  }
  auto& d = *spec.mutable_data();
  if (d.format().empty()) d.set_format("bytes");
  if (m.vocab() == 0 && d.format() == "bytes") m.set_vocab(256);
  auto& t = *spec.mutable_train();
  if (t.micro_batch() == 0) t.set_micro_batch(8);
  if (t.grad_accum() == 0) t.set_grad_accum(1);
  if (t.lr() == 0) t.set_lr(3e-4);
  if (t.mixed_precision() == v1::MIXED_PRECISION_UNSPECIFIED) t.set_mixed_precision(v1::FP32);
  if (t.optimizer() == v1::OPTIMIZER_UNSPECIFIED) t.set_optimizer(v1::ADAMW);
  if (t.seed() == 0) t.set_seed(1);
  if (t.has_lora()) {  // PEFT's LoraConfig defaults, with its llama targets
    auto& lora = *t.mutable_lora();
    if (lora.r() == 0) lora.set_r(8);
    if (lora.alpha() == 0) lora.set_alpha(8);
    if (lora.target_modules().empty()) {
      lora.add_target_modules("q_proj");
      lora.add_target_modules("v_proj");
    }
  }
  auto& p = *spec.mutable_parallel();
  if (p.strategy() == v1::STRATEGY_UNSPECIFIED) p.set_strategy(v1::DDP);
  if (p.sharding_strategy() == v1::SHARDING_STRATEGY_UNSPECIFIED) {
    p.set_sharding_strategy(v1::FULL_SHARD);
  }
  if (p.bucket_mb() == 0) p.set_bucket_mb(25);
  if (p.auto_wrap_policy() == v1::WRAP_POLICY_UNSPECIFIED) {
    p.set_auto_wrap_policy(v1::TRANSFORMER_BASED_WRAP);
  }
  if (p.min_num_params() == 0) p.set_min_num_params(100'000'000);  // PyTorch's default
  if (p.backward_prefetch() == v1::BACKWARD_PREFETCH_UNSPECIFIED) {
    p.set_backward_prefetch(v1::BACKWARD_PRE);
  }
  if (p.max_gathered_units() == 0) p.set_max_gathered_units(2);
  if (!p.has_cpu_ram_efficient_loading()) p.set_cpu_ram_efficient_loading(true);
  if (p.pipeline_stages() == 0) p.set_pipeline_stages(1);
  if (p.tensor_parallel() == 0) p.set_tensor_parallel(1);
  if (p.pipeline_schedule() == v1::PIPELINE_SCHEDULE_UNSPECIFIED) {
    p.set_pipeline_schedule(v1::ONE_F_ONE_B);
  }
  if (t.micro_batches() == 0 && p.pipeline_stages() > 1) {
    t.set_micro_batches(2 * p.pipeline_stages());
  }
}

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
  RETURN_IF_ERROR(CheckRange("parallel.pipeline_stages", p.pipeline_stages(), 1, 1024));
  if (!v1::PipelineSchedule_IsValid(p.pipeline_schedule()) ||
      p.pipeline_schedule() == v1::PIPELINE_SCHEDULE_UNSPECIFIED) {
    return FieldError("parallel.pipeline_schedule",
                      absl::StrCat("unknown value ", p.pipeline_schedule(), " (gpipe or 1f1b)"));
  }
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
  if (spec.resources().gpus() % stages != 0) {
    return FieldError("resources.gpus",
                      absl::StrCat(spec.resources().gpus(), " ranks do not split into ", stages,
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
  RETURN_IF_ERROR(CheckRange("parallel.tensor_parallel", p.tensor_parallel(), 1, 1024));
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
  if (spec.resources().gpus() % group != 0) {
    return FieldError("resources.gpus",
                      absl::StrCat(spec.resources().gpus(), " ranks do not split into ",
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
                                                  "MASTER_ADDR",
                                                  "MASTER_PORT",
                                                  "TORCHELASTIC_RESTART_COUNT",
                                                  "TORCHELASTIC_RUN_ID",
                                                  "CUDA_VISIBLE_DEVICES",
                                                  "HOME",
                                                  "USER",
                                                  "LOGNAME"};
  return kReserved.count(name) > 0 || absl::StartsWith(name, "TRAINYARD_");
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
  RETURN_IF_ERROR(CheckRange("max_restarts", spec.max_restarts(), 0, 100));
  RETURN_IF_ERROR(CheckRange("max_runtime", spec.max_runtime_seconds(), 0, int64_t{1} << 40));
  return CheckRange("preemption_grace", spec.preemption_grace_seconds(), 0, int64_t{1} << 40);
}

}  // namespace

bool IsCommandJob(const JobSpec& spec) { return spec.command_size() > 0; }

namespace {

// The spec's `model` (a training job).
absl::Status ValidateModel(const JobSpec& spec) {
  const auto& m = spec.model();
  if (m.kind() != "gpt" && m.kind() != "mlp" && m.kind() != "llama") {
    return FieldError("model.kind",
                      absl::StrCat("unknown value '", m.kind(), "' (gpt, mlp or llama)"));
  }
  RETURN_IF_ERROR(CheckRequired("model.seq_len", m.seq_len(), 1, 1 << 20));
  if (m.kind() != "llama" && !m.from().empty()) {
    return FieldError("model.from", "only model.kind llama starts from a checkpoint");
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
    RETURN_IF_ERROR(CheckRange("model.n_kv_head", m.n_kv_head(), 0, 1024));
    RETURN_IF_ERROR(CheckRange("model.head_dim", m.head_dim(), 0, 4096));
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
  return absl::OkStatus();
}

// The spec's `train`.
absl::Status ValidateTrain(const JobSpec& spec) {
  const auto& m = spec.model();
  const auto& t = spec.train();
  RETURN_IF_ERROR(CheckRequired("train.steps", t.steps(), 1, int64_t{1} << 40));
  RETURN_IF_ERROR(CheckRange("train.micro_batch", t.micro_batch(), 1, 1 << 16));
  RETURN_IF_ERROR(CheckRange("train.grad_accum", t.grad_accum(), 1, 1 << 16));
  if (!(t.lr() > 0) || !std::isfinite(t.lr()) || t.lr() > 10) {
    return FieldError("train.lr", absl::StrCat("must be in (0, 10], got ", t.lr()));
  }
  RETURN_IF_ERROR(CheckRange("train.warmup", t.warmup(), 0, t.steps()));
  if (!v1::MixedPrecision_IsValid(t.mixed_precision()) ||
      t.mixed_precision() == v1::MIXED_PRECISION_UNSPECIFIED) {
    return FieldError("train.mixed_precision",
                      absl::StrCat("unknown value ", t.mixed_precision(), " (fp32, bf16 or fp16)"));
  }
  if (!v1::Optimizer_IsValid(t.optimizer()) || t.optimizer() == v1::OPTIMIZER_UNSPECIFIED) {
    return FieldError("train.optimizer", absl::StrCat("unknown value ", t.optimizer(),
                                                      " (adamw, adafactor, lion or adamw_8bit)"));
  }
  if (t.optimizer() != v1::ADAMW && spec.parallel().strategy() == v1::OFFLOAD) {
    return FieldError("train.optimizer",
                      absl::StrCat(OptimizerName(t.optimizer()),
                                   " does not run on the parameter servers, which apply AdamW: "
                                   "use adamw with parallel.strategy offload, or ddp or fsdp"));
  }
  if (t.weight_decay() < 0 || !std::isfinite(t.weight_decay())) {
    return FieldError("train.weight_decay", absl::StrCat("must be >= 0, got ", t.weight_decay()));
  }
  if (t.grad_clip() < 0 || !std::isfinite(t.grad_clip())) {
    return FieldError("train.grad_clip", absl::StrCat("must be >= 0, got ", t.grad_clip()));
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
    RETURN_IF_ERROR(CheckRange("train.lora.r", lora.r(), 1, 4096));
    if (!(lora.alpha() > 0) || !std::isfinite(lora.alpha())) {
      return FieldError("train.lora.alpha", absl::StrCat("must be > 0, got ", lora.alpha()));
    }
    if (!(lora.dropout() >= 0 && lora.dropout() < 1)) {
      return FieldError("train.lora.dropout",
                        absl::StrCat("must be in [0, 1), got ", lora.dropout()));
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
  if (!v1::Strategy_IsValid(p.strategy()) || p.strategy() == v1::STRATEGY_UNSPECIFIED) {
    return FieldError("parallel.strategy",
                      absl::StrCat("unknown value ", p.strategy(), " (ddp, fsdp or offload)"));
  }
  if (!v1::ShardingStrategy_IsValid(p.sharding_strategy()) ||
      p.sharding_strategy() == v1::SHARDING_STRATEGY_UNSPECIFIED) {
    return FieldError("parallel.sharding_strategy",
                      absl::StrCat("unknown value ", p.sharding_strategy(),
                                   " (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD)"));
  }
  if (!(p.bucket_mb() > 0) || p.bucket_mb() > 1024) {
    return FieldError("parallel.bucket_mb",
                      absl::StrCat("must be in (0, 1024], got ", p.bucket_mb()));
  }
  if (p.delayed_update() && p.strategy() != v1::OFFLOAD) {
    return FieldError("parallel.delayed_update", "only applies to strategy offload");
  }
  if (!v1::WrapPolicy_IsValid(p.auto_wrap_policy()) ||
      p.auto_wrap_policy() == v1::WRAP_POLICY_UNSPECIFIED) {
    return FieldError("parallel.auto_wrap_policy",
                      absl::StrCat("unknown value ", p.auto_wrap_policy(),
                                   " (TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP)"));
  }
  RETURN_IF_ERROR(CheckRange("parallel.min_num_params", p.min_num_params(), 1, int64_t{1} << 50));
  if (!v1::BackwardPrefetch_IsValid(p.backward_prefetch()) ||
      p.backward_prefetch() == v1::BACKWARD_PREFETCH_UNSPECIFIED) {
    return FieldError("parallel.backward_prefetch",
                      absl::StrCat("unknown value ", p.backward_prefetch(),
                                   " (BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH)"));
  }
  RETURN_IF_ERROR(CheckRange("parallel.max_gathered_units", p.max_gathered_units(), 1, 1024));
  RETURN_IF_ERROR(ValidatePipeline(spec));
  RETURN_IF_ERROR(ValidateTensorParallel(spec));
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
  RETURN_IF_ERROR(
      CheckRange("checkpoint.every_steps", spec.checkpoint().every_steps(), 0, int64_t{1} << 40));
  if (const v1::ExportFormat f = spec.checkpoint().export_format();
      f != v1::EXPORT_FORMAT_UNSPECIFIED) {
    if (!v1::ExportFormat_IsValid(f)) {
      return FieldError("checkpoint.export",
                        absl::StrCat("unknown value ", f, " (hf or hf_merged)"));
    }
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
  RETURN_IF_ERROR(CheckRange("priority", spec.priority(), 1, 100));
  RETURN_IF_ERROR(CheckRequired("resources.gpus", spec.resources().gpus(), 1, 4096));
  if (IsCommandJob(spec)) return ValidateCommandJob(spec);
  if (!spec.workdir().empty()) return FieldError("workdir", "only a command job has a workdir");
  if (!spec.env().empty()) return FieldError("env", "only a command job has env");

  RETURN_IF_ERROR(ValidateModel(spec));
  RETURN_IF_ERROR(ValidateData(spec));
  RETURN_IF_ERROR(ValidateTrain(spec));
  RETURN_IF_ERROR(ValidateParallel(spec));
  RETURN_IF_ERROR(ValidateCheckpoint(spec));
  RETURN_IF_ERROR(CheckRange("max_restarts", spec.max_restarts(), 0, 100));
  RETURN_IF_ERROR(CheckRange("max_runtime", spec.max_runtime_seconds(), 0, int64_t{1} << 40));
  RETURN_IF_ERROR(
      CheckRange("preemption_grace", spec.preemption_grace_seconds(), 0, int64_t{1} << 40));
  return absl::OkStatus();
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

int RankBlockOf(const v1::JobSpec& spec) {
  const auto& p = spec.parallel();
  const int tensor = std::max(1, p.tensor_parallel()), stages = std::max(1, p.pipeline_stages());
  if (p.strategy() == v1::FSDP && p.sharding_strategy() == v1::HYBRID_SHARD &&
      stages * tensor > 1) {
    return stages * tensor;
  }
  return tensor;
}

std::string StrategyName(v1::Strategy s) { return WireName(kStrategies, s); }

std::string ShardingStrategyName(v1::ShardingStrategy s) { return WireName(kShardings, s); }

std::string MixedPrecisionName(v1::MixedPrecision p) { return WireName(kPrecisions, p); }

std::string OptimizerName(v1::Optimizer o) { return WireName(kOptimizers, o); }

ModelConfig ToModelConfig(const v1::ModelSpec& m) {
  ModelConfig c;
  c.kind = m.kind();
  c.n_layer = m.n_layer();
  c.n_head = m.n_head();
  c.d_model = m.d_model();
  c.seq_len = m.seq_len();
  c.vocab = m.vocab();
  c.tie_weights = m.tie_weights();
  c.d_hidden = m.d_hidden();
  c.from = m.from();
  c.n_kv_head = m.n_kv_head();
  c.head_dim = m.head_dim();
  if (m.rope_theta() > 0) c.rope_theta = m.rope_theta();
  if (m.rms_norm_eps() > 0) c.rms_norm_eps = m.rms_norm_eps();
  return c;
}

absl::Status FillModelFromCheckpoint(v1::JobSpec& spec) {
  if (spec.model().kind() != "llama" || spec.model().from().empty()) return absl::OkStatus();
  v1::ModelSpec& m = *spec.mutable_model();
  ModelConfig c = ToModelConfig(m);
  RETURN_IF_ERROR(ResolveFromCheckpoint(&c).status());
  m.set_n_layer(c.n_layer);
  m.set_d_model(c.d_model);
  m.set_n_head(c.n_head);
  m.set_n_kv_head(c.n_kv_head);
  m.set_head_dim(c.head_dim);
  m.set_d_hidden(c.d_hidden);
  m.set_vocab(c.vocab);
  m.set_tie_weights(c.tie_weights);
  return absl::OkStatus();
}

int64_t ModelParameterCount(const v1::ModelSpec& m) {
  return ModelParameterCount(ToModelConfig(m));
}

JobConfig ToJobConfig(const v1::JobSpec& spec) {
  JobConfig c;
  c.model = ToModelConfig(spec.model());
  c.data.path = spec.data().path();
  c.data.format = spec.data().format();
  c.data.loss_mask = spec.data().loss_mask();
  const v1::TrainSpec& t = spec.train();
  c.train.steps = t.steps();
  c.train.micro_batch = t.micro_batch();
  c.train.grad_accum = t.grad_accum();
  c.train.lr = t.lr();
  c.train.warmup = t.warmup();
  c.train.precision = FromWire(kPrecisions, t.mixed_precision(), Precision::kFp32);
  c.train.activation_checkpointing = t.activation_checkpointing();
  c.train.seed = t.seed();
  c.train.weight_decay = t.weight_decay();
  c.train.grad_clip = t.grad_clip();
  c.train.optimizer = FromWire(kOptimizers, t.optimizer(), OptimizerKind::kAdamW);
  if (t.has_lora()) {
    c.train.lora.r = t.lora().r();
    c.train.lora.alpha = t.lora().alpha();
    c.train.lora.dropout = t.lora().dropout();
    c.train.lora.target_modules.assign(t.lora().target_modules().begin(),
                                       t.lora().target_modules().end());
  }
  const v1::ParallelSpec& p = spec.parallel();
  c.parallel.strategy = FromWire(kStrategies, p.strategy(), Strategy::kDdp);
  c.parallel.sharding = FromWire(kShardings, p.sharding_strategy(), Sharding::kFullShard);
  c.parallel.bucket_mb = p.bucket_mb();
  c.parallel.delayed_update = p.delayed_update();
  c.parallel.wrap = FromWire(kWrapPolicies, p.auto_wrap_policy(), WrapPolicy::kTransformerBased);
  c.parallel.min_num_params = p.min_num_params();
  c.parallel.backward_prefetch =
      FromWire(kBackwardPrefetches, p.backward_prefetch(), BackwardPrefetch::kBackwardPre);
  c.parallel.forward_prefetch = p.forward_prefetch();
  c.parallel.max_gathered_units = p.max_gathered_units();
  c.parallel.cpu_ram_efficient_loading = p.cpu_ram_efficient_loading();
  c.parallel.pipeline_stages = p.pipeline_stages();
  c.parallel.pipeline_schedule =
      FromWire(kPipelineSchedules, p.pipeline_schedule(), PipelineSchedule::kOneFOneB);
  c.parallel.pipeline_split.assign(p.pipeline_split().begin(), p.pipeline_split().end());
  c.parallel.tensor_parallel = p.tensor_parallel();
  c.parallel.sequence_parallel = p.sequence_parallel();
  c.train.micro_batches = std::max(1, t.micro_batches());
  c.checkpoint_every_steps = spec.checkpoint().every_steps();
  c.export_format =
      FromWire(kExportFormats, spec.checkpoint().export_format(), ExportFormat::kNone);
  return c;
}

}  // namespace trainyard
