// Sharded checkpoints of an FSDP job. DIR/step-<N>/ holds
//   shard-<r>-of-<S>.pt  per shard rank r: each flat buffer's parameter shard and optimizer
//                        state ("u<i>.param", "u<i>.<name>" for SlotOptimizer::State's names:
//                        AdamW's "u<i>.exp_avg", "u<i>.exp_avg_sq"), the optimizer's step count
//                        "adam_step", and in shard 0's the CPU RNG state ("rng");
//   manifest.json        format, step, shard count, train.optimizer ("optimizer"; absent: adamw),
//                        its hyper-parameters and the layout: each
//                        flat buffer's element count (and "frozen": true for LoRA's frozen
//                        base, which has no moments) and each parameter's name, shape, offset,
//                        index;
//   meta.json            {"step": N, "optimizer": train.optimizer}.
// Writing follows checkpoint.h's rules: every shard writer (replica 0 under HYBRID_SHARD) writes
// its file into DIR/.step-<N>.tmp and fsyncs it; rank 0 then writes the manifest and meta,
// fsyncs the directory, renames it into place, fsyncs DIR and moves DIR/latest. A crash at any
// point leaves `latest` naming the previous complete checkpoint.
//
// Loading with the same shard count reads one file per rank; with another count (reshard on
// load: a job resumed on a different world size) each rank reads, one old file at a time, the
// parts of every old shard that overlap its new one (8-bit moments dequantized, then quantized in
// the new shard's blocks; Adafactor's factors, whole in every shard, as they are).
// ConsolidateShardedCheckpoint turns a sharded checkpoint into a DDP one (model.pt, optimizer.pt,
// rng.pt), loadable by any strategy's LoadLatestCheckpoint. All functions are collective where they
// take a Communicator.
#ifndef TRAINYARD_WORKER_TRAINER_CHECKPOINT_FSDP_CHECKPOINT_H_
#define TRAINYARD_WORKER_TRAINER_CHECKPOINT_FSDP_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/trainer/checkpoint/checkpoint.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/parallel/fsdp.h"

namespace trainyard::trainer {

// Every rank calls it after the step's optimizer update; `world` is every rank. The manifest
// records `fsdp`'s optimizer and its hyper-parameters, and the job's learning rate `lr`, which a
// consolidated checkpoint's optimizer is built with; meta.json `notes`.
absl::StatusOr<CheckpointInfo> WriteShardedCheckpoint(const std::string& dir, int64_t step,
                                                      FsdpModel& fsdp, Communicator& world,
                                                      double lr, const MetaNotes& notes);

// Loads DIR/latest into `fsdp`'s shards (and the RNG); nullopt when there is none.
// FAILED_PRECONDITION for a checkpoint of another model or a DDP-format one.
absl::StatusOr<std::optional<CheckpointInfo>> LoadLatestShardedCheckpoint(const std::string& dir,
                                                                          FsdpModel& fsdp);

// Whole parameters by name (in the layout's order: the model's registration order) and an
// optimizer (MakeOptimizer) over those that train, holding their state.
struct WholeModel {
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

// The parameters of `layout` and their optimizer state cut out of flat buffers put together:
// per flat buffer its `flat` values ([numel]) and `state` (elementwise, [numel] each, and
// Adafactor's factors) after `step` optimizer steps (0: no state), with `hyper` and `lr`.
// DATA_LOSS naming the parameter whose state is missing or misshapen.
absl::StatusOr<WholeModel> Unflatten(const FsdpLayout& layout,
                                     const std::vector<torch::Tensor>& flat,
                                     const std::vector<std::map<std::string, torch::Tensor>>& state,
                                     const OptimizerHyper& hyper, double lr, int64_t step);

// `fsdp`'s parameters and optimizer state, whole (8-bit moments dequantized): a pipeline stage's
// checkpoint under FSDP (WriteStagedCheckpoint). Collective over its shard group, every rank of
// which gets it.
absl::StatusOr<WholeModel> GatherWhole(FsdpModel& fsdp, double lr);

// Installs per-parameter optimizer state (ParameterState's form, of whole parameters, by name)
// after `step` optimizer steps into `fsdp`'s shards: a pipeline stage resumed from a checkpoint of
// any layout. DATA_LOSS naming a trained parameter without state.
absl::Status ImportParameterStates(
    FsdpModel& fsdp, const std::map<std::string, std::map<std::string, torch::Tensor>>& states,
    int64_t step);

// Writes the consolidated checkpoint of `sharded` (a DIR/step-<N>) as OUT/step-<N> and points
// OUT/latest at it. Its meta.json records what the sharded one's does (the settings a resume must
// keep, the eval loss), so that a resume from it is checked as from the original.
absl::StatusOr<CheckpointInfo> ConsolidateShardedCheckpoint(const std::string& sharded,
                                                            const std::string& out_dir);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CHECKPOINT_FSDP_CHECKPOINT_H_
