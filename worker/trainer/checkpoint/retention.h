// Checkpoint retention (checkpoint.keep_last): after a checkpoint is complete and DIR/latest names
// it, rank 0 removes the oldest DIR/step-<N> folders beyond the newest `keep_last`. The one
// DIR/latest names (what a restart resumes from) is always kept, as is DIR/export. A folder is
// first renamed to DIR/.step-<N>.removing, then deleted, so a crash halfway leaves no partial
// step-<N> that looks like a checkpoint; leftovers are removed by the next pruning. No LibTorch.
#ifndef TRAINYARD_WORKER_TRAINER_CHECKPOINT_RETENTION_H_
#define TRAINYARD_WORKER_TRAINER_CHECKPOINT_RETENTION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainyard::trainer {

// Removes what `keep_last` (>= 1; 0 keeps everything) does not keep; returns the folder names
// removed, oldest first. An error names the folder it could not remove (the rest stay).
absl::StatusOr<std::vector<std::string>> PruneCheckpoints(const std::string& dir,
                                                          int64_t keep_last);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CHECKPOINT_RETENTION_H_
