// The parameter dump that `trainyard-trainer --dump-params FILE` writes at the end of training,
// and its reader (for tests and tools; no LibTorch needed).
//
// Format (little-endian): "TYPDUMP1", uint32 count, then per parameter in name order: uint32
// name length, name bytes, uint32 ndim, ndim int64 dims, prod(dims) float32 values.
#ifndef TRAINYARD_WORKER_TRAINER_IO_PARAM_DUMP_H_
#define TRAINYARD_WORKER_TRAINER_IO_PARAM_DUMP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainyard::trainer {

struct DumpedParam {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, fp32
};

// Writes `params` (sorted by name here) to `path` through a temp file and a rename.
absl::Status WriteParamDump(const std::string& path, std::vector<DumpedParam> params);

// INVALID_ARGUMENT for a truncated or foreign file, NOT_FOUND if it cannot be opened.
absl::StatusOr<std::vector<DumpedParam>> ReadParamDump(const std::string& path);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_IO_PARAM_DUMP_H_
