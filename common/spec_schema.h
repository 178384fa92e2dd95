// The job spec's schema: trainyard.v1.JobSpec read through protobuf reflection, plus one table of
// what the protobuf types do not say (YAML names that differ, units, defaults, ranges, the shape a
// list must have). The YAML parser (spec_yaml.cc), the defaults (spec_defaults.cc) and the
// validator (spec_validate.cc) all read this table: a field with a default or a range is one row
// in spec_schema.cc, beside its protobuf field; a field with neither needs no row. Internal to
// common/spec*.cc. Pure functions over static tables; thread-safe.
#ifndef TRAINYARD_COMMON_SPEC_SCHEMA_H_
#define TRAINYARD_COMMON_SPEC_SCHEMA_H_

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "trainyard/v1/job.pb.h"

namespace trainyard::spec_schema {

// How a field's YAML text reads, beyond its protobuf type.
enum class Unit {
  kPlain,    // the protobuf type's own: 12, 3e-4, true, a name of the enum's table
  kBytes,    // int64 bytes from a size such as 16GiB or 512MiB (common/units.h)
  kSeconds,  // int64 seconds from an integer or an absl duration such as 2h30m
};

// Which jobs a row's default and range apply to.
enum class Scope {
  kEveryJob,     // command jobs too
  kTrainingJob,  // the built-in trainer's (model, data, train, parallel, checkpoint)
};

// One field with more to it than its protobuf type. Ranges are written as read, and the error
// says them as written: "1..100" (integers, both ends in), "[0, 1)" and the like (numbers), "> 0",
// ">= 0". A range on a field with presence (`optional`, or inside an option group such as
// train.lora) applies only when the field is set.
struct Field {
  absl::string_view path;        // as written in specs: "resources.memory"
  absl::string_view proto = {};  // the JobSpec field's path where it differs: "...memory_bytes"
  Scope scope = Scope::kTrainingJob;
  Unit unit = Unit::kPlain;
  absl::string_view default_value = {};  // YAML text filled in when unset (lists: "a, b")
  absl::string_view range = {};          // after defaults (ValidateJobSpec)
  bool required = false;                 // unset after defaults: "required"
  // Checked as the YAML is read, on a value given there: where an explicit 0 must not read as
  // unset (and so become the default), or where 0 means "not given" later on.
  absl::string_view given = {};
  absl::string_view what = {};      // a unit's or `given`'s error text: "CPUs per rank, ..."
  absl::string_view shape = {};     // lists and maps: what the YAML must be, for the error
  bool non_empty = false;           // a list given must have an entry
  absl::string_view alias_of = {};  // an old name, read as this path (its own row has none else)
};

// Every row, in the spec's order.
absl::Span<const Field> AllFields();

// The row of a path as written in specs ("train.lr"); nullptr if the field has none.
const Field* FindField(absl::string_view yaml_path);

// A path as written in specs to the path of its JobSpec field ("resources.memory" ->
// "resources.memory_bytes"); the path itself where they agree.
std::string ProtoPath(absl::string_view yaml_path);

// The name a JobSpec field is written as in specs under `parent` (a YAML path, "" at the top);
// empty if the field is not written in specs under its own name (a row renames it).
std::string YamlName(absl::string_view parent, const google::protobuf::FieldDescriptor& field);

// Sets `field` of `message` from YAML text (a list's field: appends one entry), in the unit of
// its row (nullptr: none; an enum's names are common/job_config.h's tables'). INVALID_ARGUMENT with
// the message only ("expected an integer, got 'x'"), for the caller to prefix with the field and
// where it was.
absl::Status SetFromText(google::protobuf::Message& message,
                         const google::protobuf::FieldDescriptor& field, const Field* row,
                         const std::string& text);

// A singular numeric field's value; nullopt for any other field.
std::optional<double> NumberOf(const google::protobuf::Message& message,
                               const google::protobuf::FieldDescriptor& field);

// Whether `value` (a number read from a field) is in the row's `range` text; the error's
// "must be ..." part in `why` when not.
bool InRange(absl::string_view range, double value, bool integer, std::string* why);

// The row's `given` check of a value just read from YAML `text` into `field`: INVALID_ARGUMENT
// with the message only ("must be >= 1, got 0", or the row's `what` and the value) if it fails.
absl::Status CheckGiven(const Field& row, const google::protobuf::Message& message,
                        const google::protobuf::FieldDescriptor& field, const std::string& text);

// Every row's default filled into `spec` where unset, for the rows of `scope`. Sections (model,
// train, ...) are created; an option group inside one (train.lora) only gets defaults when given.
void ApplyDefaults(v1::JobSpec& spec, Scope scope);

// Every row's range and `required`, and every enum field's value against its table, for the
// rows (and sections) of `scope`: INVALID_ARGUMENT "FIELD: ..." for the first that fails.
absl::Status CheckRanges(const v1::JobSpec& spec, Scope scope);

}  // namespace trainyard::spec_schema

#endif  // TRAINYARD_COMMON_SPEC_SCHEMA_H_
