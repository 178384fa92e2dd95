// The job spec: YAML parsing (with file:line errors), defaults and validation. Shared by `yard`,
// which validates before it sends, and the coordinator, which validates every SubmitJob again.
// Pure functions; thread-safe.
#ifndef TRAINYARD_COMMON_SPEC_H_
#define TRAINYARD_COMMON_SPEC_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/field_limits.h"
#include "common/job_config.h"
#include "trainyard/v1/job.pb.h"

namespace trainyard {

struct ParsedSpec {
  v1::JobSpec spec;
  // 1-based line of every field that was present in the YAML, by dotted path ("model.n_head").
  std::map<std::string, int> field_lines;
};

// Parses a YAML job spec. Errors are INVALID_ARGUMENT with "FILENAME:LINE: message" for malformed
// YAML, unknown fields, and values of the wrong type. Does not apply defaults or validate ranges.
absl::StatusOr<ParsedSpec> ParseJobSpecYaml(const std::string& yaml_text,
                                            const std::string& filename);

// Sets the fields that `yaml_text` gives (in the spec's shape: "resources: {slots: 2}") over
// `spec`, as a file would have set them: names, units and checks as ParseJobSpecYaml's; a list or
// map given replaces the spec's. For command-line flags (`yard submit --gpus 2 -- ...`): errors
// are INVALID_ARGUMENT "ORIGIN: FIELD: message", without lines. Does not apply defaults or
// validate.
absl::Status OverrideJobSpecYaml(ParsedSpec& parsed, const std::string& yaml_text,
                                 const std::string& origin);

// Reads and parses a spec file; NOT_FOUND if it cannot be read.
absl::StatusOr<ParsedSpec> LoadJobSpecFile(const std::string& path);

// LoadJobSpecFile, then ApplyJobSpecDefaults and ValidateJobSpec on the spec; a validation error
// carries the file and line of the field (AnnotateWithLine). A command job's relative workdir is
// made absolute first, from the folder of the file (`workdir: .` is the spec's own folder), and so
// is its context's folder (`context: .`), which yard then uploads.
// `overrides_yaml` (OverrideJobSpecYaml, errors from `overrides_origin`) is set over the file's
// fields before defaults and validation.
absl::StatusOr<ParsedSpec> LoadValidJobSpecFile(const std::string& path,
                                                const std::string& overrides_yaml = "",
                                                const std::string& overrides_origin = "");

// Fills unset optional fields with their defaults (priority 50, grad_accum 1, ddp, ...).
// Fields that are required (name, resources.slots, model sizes, data.path, train.steps) stay unset.
void ApplyJobSpecDefaults(v1::JobSpec& spec);

// The largest YAML job spec read or parsed (1 MiB), and the limits on its fields once parsed:
// each string at most 4096 bytes, each list or map at most 1024 entries, the whole spec at most
// 64 KiB serialized. ValidateJobSpec applies them first.
inline constexpr size_t kMaxSpecYamlBytes = 1 << 20;
inline FieldLimits JobSpecFieldLimits() { return FieldLimits{4096, 1024, 64 * 1024}; }

// Checks every field of a spec (after defaults). INVALID_ARGUMENT whose message starts with the
// dotted field path, e.g. "model.n_head: must divide model.d_model (256), got 3". A command job
// (IsCommandJob) gives no model, data, train or parallel; its workdir is absolute and its env
// sets no name trainyard sets for its ranks.
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// Whether the spec runs the user's own program (`command`) rather than the built-in trainer.
bool IsCommandJob(const v1::JobSpec& spec);

// The ranks of a job that must share a node (the scheduler places whole blocks of them): a
// tensor-parallel group; under fsdp HYBRID_SHARD with pipeline stages or tensor parallelism, a
// whole replica (pipeline_stages x tensor_parallel), whose parts are sharded over the node's
// replicas. 1 otherwise.
int RankBlockOf(const v1::JobSpec& spec);

// Ranks that share each of the job's devices: resources.ranks_per_node over the devices per node
// (slots / nodes); 1 without them.
int RanksPerDevice(const v1::JobSpec& spec);
// The most ranks that share one device (resources.ranks_per_node / devices a node).
inline constexpr int kMaxRanksPerDevice = 16;
// The job's ranks: its devices times RanksPerDevice.
int WorldSizeOf(const v1::JobSpec& spec);

// If `status` names a field that `parsed` has a line for, prefixes "FILENAME:LINE: ".
absl::Status AnnotateWithLine(const absl::Status& status, const ParsedSpec& parsed,
                              const std::string& filename);

// Names as written in specs and shown to users.
std::string StrategyName(v1::Strategy s);                  // "ddp"
std::string ShardingStrategyName(v1::ShardingStrategy s);  // "FULL_SHARD"
std::string MixedPrecisionName(v1::MixedPrecision p);      // "fp32"
std::string OptimizerName(v1::Optimizer o);                // "adamw_8bit"
std::string LrScheduleName(v1::LrSchedule s);              // "cosine_with_min_lr"

// A llama spec's sizes left at 0 filled from model.from's config.json when this process can read
// it (yard does, so that the coordinator's memory check at submit sees the model): NOT_FOUND when
// it cannot (the trainer reads it on its host), INVALID_ARGUMENT naming the field when a size
// given disagrees with it. Other specs are left as they are.
absl::Status FillModelFromCheckpoint(v1::JobSpec& spec);

// Number of parameters of the spec's model (embeddings included, tied head counted once).
int64_t ModelParameterCount(const v1::ModelSpec& model);
// The trainer's view of the model part of a spec.
ModelConfig ToModelConfig(const v1::ModelSpec& model);

// What a training rank reads of a spec (defaults applied and validated), without protobuf: the
// trainer's LibTorch side takes this (common/job_config.h).
JobConfig ToJobConfig(const v1::JobSpec& spec);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_SPEC_H_
