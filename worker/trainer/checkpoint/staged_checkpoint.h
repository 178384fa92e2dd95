// Pipeline checkpoints: DIR/step-N/stage-<s>.pt, written by each stage's first replica (its
// tensor-parallel rank 0, which gathers the group's shards into whole tensors): its parameters
// ("param/<name>") and their optimizer state ("state/<name>/<key>", "step/<name>"), keyed by
// name, so that LoadLatestCheckpoint (checkpoint.h) reads them into any layout: other numbers of
// stages and tensor-parallel ranks, or none.
#ifndef TRAINYARD_WORKER_TRAINER_CHECKPOINT_STAGED_CHECKPOINT_H_
#define TRAINYARD_WORKER_TRAINER_CHECKPOINT_STAGED_CHECKPOINT_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/trainer/checkpoint/checkpoint.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/parallel/pipeline.h"

namespace trainyard::trainer {

// Writes the pipeline checkpoint of `step`: every stage's first replica its stage-<s>.pt (the
// stage's `params` and their state in `optimizer`, whose parameters are the trainable ones among
// them, in order; tensor-parallel shards of `model` gathered over `tensor` into whole tensors),
// rank 0 rng.pt and meta.json, then DIR/latest; every rank of `world` calls it. A complete
// DIR/step-N from an earlier attempt is kept. meta.json records `notes`.
absl::StatusOr<CheckpointInfo> WriteStagedCheckpoint(
    const std::string& dir, int64_t step, const PipelineLayout& layout, const LanguageModel& model,
    const std::vector<std::pair<std::string, torch::Tensor>>& params,
    torch::optim::Optimizer& optimizer, Communicator& world, Communicator* tensor,
    const MetaNotes& notes);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CHECKPOINT_STAGED_CHECKPOINT_H_
