// Where an offload job's optimizer state goes: the job's flat parameter vector [0, total) split
// into contiguous ranges over parameter servers, balanced by bytes (each server gets an equal
// share, or all its free memory when that is less, the rest spread over the others; ps-lite's
// range partitioning). Pure logic, no I/O.
#ifndef TRAINYARD_SERVER_COORDINATOR_PS_PLACEMENT_H_
#define TRAINYARD_SERVER_COORDINATOR_PS_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trainyard/v1/node.pb.h"

namespace trainyard::coordinator {

struct PsCapacity {
  std::string node_id;
  std::string address;
  int64_t free_bytes = 0;
};

// Ranges in the order of `servers` (servers that get nothing are left out), covering [0, total)
// exactly. RESOURCE_EXHAUSTED when the servers' free memory together is too small.
absl::StatusOr<std::vector<v1::PsRange>> PlaceOnParameterServers(
    int64_t total_params, int64_t bytes_per_param, const std::vector<PsCapacity>& servers);

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_PS_PLACEMENT_H_
