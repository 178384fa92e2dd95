// The job spec's table (one row per field with a default, a range, a unit or another YAML name)
// and the reflection that reads, fills and checks JobSpec fields by it.
#include "common/spec_schema.h"

#include <cmath>
#include <iterator>
#include <limits>
#include <map>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/job_config.h"
#include "common/units.h"

namespace trainyard::spec_schema {
namespace {

using google::protobuf::EnumDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr Scope kEvery = Scope::kEveryJob;

// Every spec field with more to it than its protobuf type, in the spec's order. A new field needs
// a row here only for a default, a range, a unit, a list's shape or a YAML name of its own.
constexpr Field kFields[] = {
    // The job.
    {.path = "priority",
     .scope = kEvery,
     .default_value = "50",
     .range = "1..100",
     .given = "1..100"},
    {.path = "max_restarts", .scope = kEvery, .range = "0..100"},
    {.path = "max_runtime",
     .proto = "max_runtime_seconds",
     .scope = kEvery,
     .unit = Unit::kSeconds,
     .range = "0..1099511627776",
     .given = "> 0",
     .what = "must be positive"},
    {.path = "preemption_grace",
     .proto = "preemption_grace_seconds",
     .scope = kEvery,
     .unit = Unit::kSeconds,
     .range = "0..1099511627776",
     .given = "> 0",
     .what = "must be positive"},
    {.path = "stop_grace",
     .proto = "stop_grace_seconds",
     .scope = kEvery,
     .unit = Unit::kSeconds,
     .range = "0..86400",
     .given = "1..86400",
     .what = "a duration such as 30s or 5m, at most a day"},
    {.path = "command",
     .scope = kEvery,
     .shape = "a non-empty list, e.g. [python3, train.py]",
     .non_empty = true},
    {.path = "env", .scope = kEvery, .shape = "a mapping of NAME: value"},
    // resources: per rank.
    {.path = "resources.slots",
     .scope = kEvery,
     .range = "1..4096",
     .required = true,
     .given = ">= 1"},
    {.path = "resources.gpus", .scope = kEvery, .alias_of = "resources.slots"},
    {.path = "resources.nodes", .scope = kEvery, .range = "0..1024", .given = "1..1024"},
    {.path = "resources.ranks_per_node", .scope = kEvery, .range = "0..1024", .given = "1..1024"},
    {.path = "resources.cpus",
     .scope = kEvery,
     .range = "[0, 4096]",
     .given = "(0, 4096]",
     .what = "CPUs per rank, more than 0 and at most 4096"},
    {.path = "resources.memory",
     .proto = "resources.memory_bytes",
     .scope = kEvery,
     .unit = Unit::kBytes,
     .range = "0..70368744177664",
     .given = "1..70368744177664",
     .what = "a size per rank such as 16GiB or 512MiB, at most 64TiB"},
    // model: the sizes that model.from may give are checked in spec_validate.cc.
    {.path = "model.kind", .default_value = "gpt"},
    {.path = "model.seq_len", .range = "1..1048576", .required = true},
    {.path = "model.n_kv_head", .range = "0..1024"},
    {.path = "model.head_dim", .range = "0..4096"},
    // data
    {.path = "data.format", .default_value = "bytes"},
    // train
    {.path = "train.steps", .range = "1..1099511627776", .required = true},
    {.path = "train.micro_batch", .default_value = "8", .range = "1..65536"},
    {.path = "train.grad_accum", .default_value = "1", .range = "1..65536"},
    {.path = "train.lr", .default_value = "3e-4", .range = "(0, 10]"},
    {.path = "train.mixed_precision", .default_value = "fp32"},
    {.path = "train.optimizer", .default_value = "adamw"},
    {.path = "train.lr_schedule", .default_value = "warmup_cosine"},
    {.path = "train.warmup_ratio", .range = "[0, 1]"},
    {.path = "train.min_lr_ratio", .range = "[0, 1]"},
    {.path = "train.seed", .default_value = "1"},
    {.path = "train.weight_decay", .range = ">= 0"},
    {.path = "train.grad_clip", .range = ">= 0"},
    {.path = "train.eval_batches", .range = "0..65536"},  // kMaxEvalWindows
    {.path = "train.adam_beta1", .range = "[0, 1)"},
    {.path = "train.adam_beta2", .range = "[0, 1)"},
    {.path = "train.adam_epsilon", .range = "(0, 1]"},
    {.path = "train.adafactor_eps", .range = "(0, 1e-3]"},
    {.path = "train.adafactor_clip_threshold", .range = "> 0"},
    {.path = "train.adafactor_decay_rate", .range = "[-1, 0)"},
    {.path = "train.no_weight_decay", .shape = "a list, e.g. [bias, norm]"},
    // train.lora: PEFT's LoraConfig defaults, with its llama targets.
    {.path = "train.lora.r", .default_value = "8", .range = "1..4096", .given = ">= 1"},
    {.path = "train.lora.alpha", .default_value = "8", .range = "> 0", .given = "> 0"},
    {.path = "train.lora.dropout", .range = "[0, 1)"},
    {.path = "train.lora.target_modules",
     .default_value = "q_proj, v_proj",
     .shape = "a non-empty list of module names",
     .non_empty = true},
    // parallel
    {.path = "parallel.strategy", .default_value = "ddp"},
    {.path = "parallel.sharding_strategy", .default_value = "FULL_SHARD"},
    {.path = "parallel.bucket_mb", .default_value = "25", .range = "(0, 1024]"},
    {.path = "parallel.auto_wrap_policy", .default_value = "TRANSFORMER_BASED_WRAP"},
    {.path = "parallel.min_num_params",
     .default_value = "100000000",  // PyTorch's
     .range = "1..1125899906842624"},
    {.path = "parallel.backward_prefetch", .default_value = "BACKWARD_PRE"},
    {.path = "parallel.max_gathered_units", .default_value = "2", .range = "1..1024"},
    {.path = "parallel.cpu_ram_efficient_loading", .default_value = "true"},
    {.path = "parallel.pipeline_stages", .default_value = "1", .range = "1..1024"},
    {.path = "parallel.pipeline_schedule", .default_value = "1f1b"},
    {.path = "parallel.pipeline_split",
     .shape = "a list of blocks per stage, e.g. [3, 5]",
     .non_empty = true},
    {.path = "parallel.tensor_parallel", .default_value = "1", .range = "1..1024"},
    // checkpoint
    {.path = "checkpoint.every_steps", .range = "0..1099511627776"},
    {.path = "checkpoint.keep_last", .default_value = "3", .range = "0..1000000"},
    {.path = "checkpoint.export", .proto = "checkpoint.export_format"},
};

template <typename E, size_t N>
std::vector<std::pair<std::string, int>> Rows(const EnumEntry<E> (&table)[N]) {
  std::vector<std::pair<std::string, int>> rows;
  for (const auto& row : table) rows.emplace_back(row.name, row.wire);
  return rows;
}

// An enum's rows, every one (the unset one included where the table has it).
const std::vector<std::pair<std::string, int>>& AllEnumRows(const EnumDescriptor& e) {
  static const auto* const kTables =
      new std::map<const EnumDescriptor*, std::vector<std::pair<std::string, int>>>{
          {v1::Strategy_descriptor(), Rows(kStrategies)},
          {v1::ShardingStrategy_descriptor(), Rows(kShardings)},
          {v1::WrapPolicy_descriptor(), Rows(kWrapPolicies)},
          {v1::BackwardPrefetch_descriptor(), Rows(kBackwardPrefetches)},
          {v1::MixedPrecision_descriptor(), Rows(kPrecisions)},
          {v1::PipelineSchedule_descriptor(), Rows(kPipelineSchedules)},
          {v1::ExportFormat_descriptor(), Rows(kExportFormats)},
          {v1::Optimizer_descriptor(), Rows(kOptimizers)},
          {v1::LrSchedule_descriptor(), Rows(kLrSchedules)},
      };
  static const auto* const kNone = new std::vector<std::pair<std::string, int>>();
  auto it = kTables->find(&e);
  return it == kTables->end() ? *kNone : it->second;
}

// A parsed range text.
struct Range {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false, hi_open = false;
};

std::optional<Range> ParseRange(absl::string_view text) {
  Range r;
  double a = 0, b = 0;
  if (absl::ConsumePrefix(&text, ">= ")) {
    if (!absl::SimpleAtod(text, &r.lo)) return std::nullopt;
    return r;
  }
  if (absl::ConsumePrefix(&text, "> ")) {
    if (!absl::SimpleAtod(text, &r.lo)) return std::nullopt;
    r.lo_open = true;
    return r;
  }
  if (const size_t dots = text.find(".."); dots != absl::string_view::npos) {
    if (!absl::SimpleAtod(text.substr(0, dots), &a) ||
        !absl::SimpleAtod(text.substr(dots + 2), &b)) {
      return std::nullopt;
    }
    r.lo = a;
    r.hi = b;
    return r;
  }
  if (text.size() < 5 || (text.front() != '[' && text.front() != '(') ||
      (text.back() != ']' && text.back() != ')')) {
    return std::nullopt;
  }
  const std::vector<absl::string_view> ends = absl::StrSplit(text.substr(1, text.size() - 2), ", ");
  if (ends.size() != 2 || !absl::SimpleAtod(ends[0], &a) || !absl::SimpleAtod(ends[1], &b)) {
    return std::nullopt;
  }
  r.lo = a;
  r.hi = b;
  r.lo_open = text.front() == '(';
  r.hi_open = text.back() == ')';
  return r;
}

// The field at a JobSpec path, with the message that holds it; for `create`, the sections on the
// way are created and an option group (a message inside a section) must be present already.
struct Located {
  Message* message = nullptr;
  const Message* const_message = nullptr;
  const FieldDescriptor* field = nullptr;
};

// A row as the checks use it, worked out once: its JobSpec field, as the fields on the way to it
// from JobSpec (empty for an alias, or a path that names no field), and its range, read.
struct Resolved {
  std::vector<const FieldDescriptor*> chain;
  std::optional<Range> range;
};

const std::vector<Resolved>& ResolvedRows() {
  static const auto* const kResolved = [] {
    auto* rows = new std::vector<Resolved>();
    for (const Field& row : kFields) {
      Resolved& r = rows->emplace_back();
      if (!row.range.empty()) r.range = ParseRange(row.range);
      if (!row.alias_of.empty()) continue;
      const google::protobuf::Descriptor* d = v1::JobSpec::descriptor();
      for (absl::string_view part : absl::StrSplit(ProtoPath(row.path), '.')) {
        const FieldDescriptor* f = d == nullptr ? nullptr : d->FindFieldByName(std::string(part));
        if (f == nullptr) {
          r.chain.clear();
          break;
        }
        r.chain.push_back(f);
        d = f->message_type();
      }
    }
    return rows;
  }();
  return *kResolved;
}

Located Locate(const Message& root, Message* mutable_root,
               const std::vector<const FieldDescriptor*>& chain) {
  if (chain.empty()) return {};
  const Message* at = &root;
  Message* mutable_at = mutable_root;
  for (size_t i = 0; i + 1 < chain.size(); ++i) {
    const FieldDescriptor* f = chain[i];
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE || f->is_repeated()) return {};
    const Reflection& r = *at->GetReflection();
    if (i > 0 && !r.HasField(*at, f)) return {};  // an option group not given
    if (mutable_at != nullptr) {
      mutable_at = mutable_at->GetReflection()->MutableMessage(mutable_at, f);
      at = mutable_at;
    } else {
      at = &r.GetMessage(*at, f);
    }
  }
  return {mutable_at, at, chain.back()};
}

// Whether a singular field holds nothing: not set where it has presence, else its zero.
bool IsUnset(const Message& m, const FieldDescriptor& f) {
  const Reflection& r = *m.GetReflection();
  if (f.is_repeated()) return r.FieldSize(m, &f) == 0;
  if (f.has_presence()) return !r.HasField(m, &f);
  if (const std::optional<double> number = NumberOf(m, f)) return *number == 0;
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_BOOL:
      return !r.GetBool(m, &f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return r.GetEnumValue(m, &f) == 0;
    case FieldDescriptor::CPPTYPE_STRING:
      return r.GetString(m, &f).empty();
    default:
      return !r.HasField(m, &f);
  }
}

bool IsInteger(const FieldDescriptor& f) {
  return f.cpp_type() != FieldDescriptor::CPPTYPE_DOUBLE &&
         f.cpp_type() != FieldDescriptor::CPPTYPE_FLOAT;
}

std::string NumberText(double value, bool integer) {
  return integer ? absl::StrCat(static_cast<int64_t>(value)) : absl::StrCat(value);
}

// Whether `value` is in `r` (the parse of `text`, the range as the table writes it); the error's
// "must be ..." part in `why` when not.
bool InParsedRange(const std::optional<Range>& r, absl::string_view text, double value,
                   bool integer, std::string* why) {
  if (!r.has_value()) {  // a table's typo: refuse loudly rather than let anything through
    *why = absl::StrCat("has an unreadable range in the spec's table: '", text, "'");
    return false;
  }
  const bool in = std::isfinite(value) && (r->lo_open ? value > r->lo : value >= r->lo) &&
                  (r->hi_open ? value < r->hi : value <= r->hi);
  if (!in) {
    *why = absl::StrCat("must be ", std::isinf(r->hi) ? "" : "in ", text, ", got ",
                        NumberText(value, integer));
  }
  return in;
}

// "a, b or c" of an enum's names (the unset one left out).
std::string NamesOr(const std::vector<std::pair<std::string, int>>& rows) {
  std::vector<std::string> names;
  for (const auto& [name, wire] : rows) {
    if (wire != 0) names.push_back(name);
  }
  if (names.size() <= 1) return absl::StrJoin(names, "");
  const std::string last = names.back();
  names.pop_back();
  return absl::StrCat(absl::StrJoin(names, ", "), " or ", last);
}

// Every singular enum field of `m` and of the messages it holds, against its table.
absl::Status CheckEnums(const Message& m, const std::string& path) {
  const google::protobuf::Descriptor& d = *m.GetDescriptor();
  const Reflection& r = *m.GetReflection();
  for (int i = 0; i < d.field_count(); ++i) {
    const FieldDescriptor& f = *d.field(i);
    if (f.is_repeated()) continue;
    if (f.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {  // sections keep their names
      if (r.HasField(m, &f)) {
        const std::string section = path.empty() ? f.name() : absl::StrCat(path, ".", f.name());
        if (absl::Status s = CheckEnums(r.GetMessage(m, &f), section); !s.ok()) return s;
      }
      continue;
    }
    if (f.cpp_type() != FieldDescriptor::CPPTYPE_ENUM) continue;
    const auto& rows = AllEnumRows(*f.enum_type());
    if (rows.empty()) continue;
    const int value = r.GetEnumValue(m, &f);
    bool known = false;
    for (const auto& [name, wire] : rows) known = known || wire == value;
    if (!known) {
      const std::string yaml = YamlName(path, f);
      return absl::InvalidArgumentError(absl::StrCat(path.empty() ? "" : absl::StrCat(path, "."),
                                                     yaml, ": unknown value ", value, " (",
                                                     NamesOr(rows), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Span<const Field> AllFields() { return kFields; }

const Field* FindField(absl::string_view yaml_path) {
  for (const Field& f : kFields) {
    if (f.path == yaml_path) return &f;
  }
  return nullptr;
}

std::string ProtoPath(absl::string_view yaml_path) {
  const Field* f = FindField(yaml_path);
  if (f == nullptr) return std::string(yaml_path);
  if (!f->alias_of.empty()) return ProtoPath(f->alias_of);
  return std::string(f->proto.empty() ? f->path : f->proto);
}

std::string YamlName(absl::string_view parent, const FieldDescriptor& field) {
  const std::string proto = parent.empty() ? field.name() : absl::StrCat(parent, ".", field.name());
  for (const Field& f : kFields) {
    if (f.proto == proto) return std::string(f.path.substr(f.path.rfind('.') + 1));
  }
  return field.name();
}

absl::Status SetFromText(Message& message, const FieldDescriptor& field, const Field* row,
                         const std::string& text) {
  const Reflection& r = *message.GetReflection();
  const Unit unit = row != nullptr ? row->unit : Unit::kPlain;
  const bool list = field.is_repeated();
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_INT64:
    case FieldDescriptor::CPPTYPE_UINT64: {
      int64_t value = 0;
      if (unit == Unit::kBytes) {
        const std::optional<int64_t> bytes = ParseBytes(text);
        if (!bytes.has_value()) {
          return absl::InvalidArgumentError(absl::StrCat(
              row->what.empty() ? "expected a size such as 16GiB or 512MiB" : row->what, ", got '",
              text, "'"));
        }
        value = *bytes;
      } else if (unit == Unit::kSeconds && !absl::SimpleAtoi(text, &value)) {
        absl::Duration d;
        if (!absl::ParseDuration(text, &d)) {
          return absl::InvalidArgumentError(
              absl::StrCat("expected seconds or a duration such as '2h30m', got '", text, "'"));
        }
        value = absl::ToInt64Seconds(d);
      } else if (unit == Unit::kPlain) {
        const bool fits = absl::SimpleAtoi(text, &value) &&
                          (field.cpp_type() != FieldDescriptor::CPPTYPE_INT32 ||
                           (value >= std::numeric_limits<int32_t>::min() &&
                            value <= std::numeric_limits<int32_t>::max())) &&
                          (field.cpp_type() != FieldDescriptor::CPPTYPE_UINT64 || value >= 0);
        if (!fits) {
          return absl::InvalidArgumentError(absl::StrCat("expected an integer, got '", text, "'"));
        }
      }
      if (field.cpp_type() == FieldDescriptor::CPPTYPE_INT32) {
        list ? r.AddInt32(&message, &field, static_cast<int32_t>(value))
             : r.SetInt32(&message, &field, static_cast<int32_t>(value));
      } else if (field.cpp_type() == FieldDescriptor::CPPTYPE_INT64) {
        list ? r.AddInt64(&message, &field, value) : r.SetInt64(&message, &field, value);
      } else {
        list ? r.AddUInt64(&message, &field, static_cast<uint64_t>(value))
             : r.SetUInt64(&message, &field, static_cast<uint64_t>(value));
      }
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      double value = 0;
      if (!absl::SimpleAtod(text, &value) || !std::isfinite(value)) {
        return absl::InvalidArgumentError(absl::StrCat("expected a number, got '", text, "'"));
      }
      list ? r.AddDouble(&message, &field, value) : r.SetDouble(&message, &field, value);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      bool value = false;
      if (!absl::SimpleAtob(text, &value)) {
        return absl::InvalidArgumentError(absl::StrCat("expected true or false, got '", text, "'"));
      }
      list ? r.AddBool(&message, &field, value) : r.SetBool(&message, &field, value);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_STRING:
      list ? r.AddString(&message, &field, text) : r.SetString(&message, &field, text);
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_ENUM: {
      std::vector<std::string> allowed;
      for (const auto& [name, wire] : AllEnumRows(*field.enum_type())) {
        if (wire == 0) continue;  // the unset value is not written in specs
        if (absl::EqualsIgnoreCase(name, text)) {
          list ? r.AddEnumValue(&message, &field, wire) : r.SetEnumValue(&message, &field, wire);
          return absl::OkStatus();
        }
        allowed.push_back(name);
      }
      return absl::InvalidArgumentError(
          absl::StrCat("unknown value '", text, "' (one of ", absl::StrJoin(allowed, ", "), ")"));
    }
    default:  // no JobSpec field of another type is written as text
      return absl::InvalidArgumentError("cannot be written as text");
  }
}

std::optional<double> NumberOf(const Message& m, const FieldDescriptor& f) {
  const Reflection& r = *m.GetReflection();
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return r.GetInt32(m, &f);
    case FieldDescriptor::CPPTYPE_INT64:
      return static_cast<double>(r.GetInt64(m, &f));
    case FieldDescriptor::CPPTYPE_UINT32:
      return r.GetUInt32(m, &f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return static_cast<double>(r.GetUInt64(m, &f));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return r.GetDouble(m, &f);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return r.GetFloat(m, &f);
    default:
      return std::nullopt;
  }
}

bool InRange(absl::string_view range, double value, bool integer, std::string* why) {
  return InParsedRange(ParseRange(range), range, value, integer, why);
}

absl::Status CheckGiven(const Field& row, const Message& message, const FieldDescriptor& field,
                        const std::string& text) {
  const std::optional<double> value = NumberOf(message, field);
  std::string why;
  if (row.given.empty() || !value.has_value() ||
      InRange(row.given, *value, IsInteger(field), &why)) {
    return absl::OkStatus();
  }
  if (row.what.empty()) return absl::InvalidArgumentError(why);
  return absl::InvalidArgumentError(absl::StrCat(row.what, ", got ",
                                                 row.unit == Unit::kPlain
                                                     ? NumberText(*value, IsInteger(field))
                                                     : absl::StrCat("'", text, "'")));
}

void ApplyDefaults(v1::JobSpec& spec, Scope scope) {
  for (size_t i = 0; i < std::size(kFields); ++i) {
    const Field& row = kFields[i];
    if (row.scope != scope || row.default_value.empty()) continue;
    const Located at = Locate(spec, &spec, ResolvedRows()[i].chain);
    if (at.field == nullptr || !IsUnset(*at.message, *at.field)) continue;
    const std::vector<std::string> values =
        at.field->is_repeated() ? absl::StrSplit(row.default_value, ", ")
                                : std::vector<std::string>{std::string(row.default_value)};
    for (const std::string& value : values) {
      // The table's own texts: a failure is a typo there, which spec_test's defaults catch.
      (void)SetFromText(*at.message, *at.field, &row, value);
    }
  }
}

absl::Status CheckRanges(const v1::JobSpec& spec, Scope scope) {
  for (size_t i = 0; i < std::size(kFields); ++i) {
    const Field& row = kFields[i];
    if (row.scope != scope || (row.range.empty() && !row.required)) continue;
    const Resolved& resolved = ResolvedRows()[i];
    const Located at = Locate(spec, nullptr, resolved.chain);
    if (at.field == nullptr || at.field->is_repeated()) continue;
    const Message& m = *at.const_message;
    if (at.field->has_presence() && !m.GetReflection()->HasField(m, at.field)) continue;
    const std::optional<double> value = NumberOf(m, *at.field);
    if (!value.has_value()) continue;
    if (row.required && *value == 0) {
      return absl::InvalidArgumentError(absl::StrCat(row.path, ": required"));
    }
    std::string why;
    if (!row.range.empty() &&
        !InParsedRange(resolved.range, row.range, *value, IsInteger(*at.field), &why)) {
      return absl::InvalidArgumentError(absl::StrCat(row.path, ": ", why));
    }
  }
  if (scope == Scope::kTrainingJob) return CheckEnums(spec, "");
  return absl::OkStatus();
}

}  // namespace trainyard::spec_schema
