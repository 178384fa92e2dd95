// libFuzzer target: the YAML job-spec parser and validation (common/spec), which yard runs on a
// user's file and the coordinator on every submitted spec. Any input must give a spec or an
// INVALID_ARGUMENT, never a crash, a hang or undefined behaviour; a spec that validates must
// survive the field limits and a serialization round trip unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/field_limits.h"
#include "common/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto parsed = trainyard::ParseJobSpecYaml(text, "fuzz.yaml");
  if (!parsed.ok()) {
    if (parsed.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  trainyard::v1::JobSpec spec = parsed->spec;
  trainyard::ApplyJobSpecDefaults(spec);
  const absl::Status valid = trainyard::ValidateJobSpec(spec);
  if (!valid.ok()) {
    if (valid.code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  if (!trainyard::CheckFieldSizes(spec, trainyard::JobSpecFieldLimits()).ok()) std::abort();
  trainyard::v1::JobSpec again;
  if (!again.ParseFromString(spec.SerializeAsString()) ||
      again.SerializeAsString() != spec.SerializeAsString()) {
    std::abort();
  }
  return 0;
}
