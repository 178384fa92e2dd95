// Checkpoint retention (checkpoint.keep_last, keep_best): after a checkpoint is complete and
// DIR/latest names it, rank 0 removes the oldest DIR/step-<N> folders beyond the newest
// `keep_last`, except, with `keep_best`, the one whose meta.json records the lowest eval_loss (the
// newest of equals). The one DIR/latest names (what a restart resumes from) is always kept, as is
// DIR/export. A folder is first renamed to DIR/.step-<N>.removing, then deleted, so a crash halfway
// leaves no partial step-<N> that looks like a checkpoint; leftovers are removed by the next
// pruning. No LibTorch.
#ifndef TRAINYARD_WORKER_TRAINER_CHECKPOINT_RETENTION_H_
#define TRAINYARD_WORKER_TRAINER_CHECKPOINT_RETENTION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/trainer/control/reporter.h"

namespace trainyard::trainer {

struct RetentionPolicy {
  int64_t keep_last = 0;  // >= 1; 0 keeps everything
  bool keep_best = false;
};

struct Retained {
  struct Checkpoint {
    int64_t step = 0;
    std::string name;                 // "step-<N>"
    std::optional<double> eval_loss;  // from its meta.json, when an evaluation ran at it
  };
  std::vector<std::string> removed;  // folder names, oldest first
  std::vector<Checkpoint> kept;      // the complete ones left, oldest first
};

// Removes what `policy` does not keep. An error names the folder it could not remove (the rest
// stay).
absl::StatusOr<Retained> PruneCheckpoints(const std::string& dir, const RetentionPolicy& policy);

// After the checkpoint of `step` at `path` (`bytes` big) is durable and DIR/latest names it:
// prunes `dir` by `policy`, logging what went (or why nothing could), and returns the coordinator's
// report of the checkpoint and of what retention kept.
CheckpointReport RetainAfterCheckpoint(const std::string& dir, const RetentionPolicy& policy,
                                       int64_t step, const std::string& path, int64_t bytes,
                                       void (*log)(const std::string& line));

// The eval_loss a checkpoint folder's meta.json records (nullopt: none, or unreadable).
std::optional<double> CheckpointEvalLoss(const std::string& path);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CHECKPOINT_RETENTION_H_
