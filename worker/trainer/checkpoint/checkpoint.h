// Checkpoints of a DDP job: rank 0 writes DIR/step-<N>/ (model.pt: every parameter by name;
// optimizer.pt: the optimizer's state; rng.pt: the CPU generator; meta.json: {"step": N,
// "optimizer": train.optimizer}) into a temp
// directory, fsyncs every file and the directory, renames it into place and fsyncs DIR, then
// replaces DIR/latest (the text "step-<N>\n") by write-temp, fsync, rename, fsync DIR. A crash
// at any point leaves `latest` naming the previous complete checkpoint. Every rank loads
// DIR/latest on start, which assumes that the ranks share DIR (true of the local cluster and of
// shared filesystems; a multi-node cluster without one needs a copy step).
//
// The data position is the step itself (the sampler is a pure function of it), so the step is the
// whole training state besides model, optimizer and RNG. Functions only; the training thread
// calls them. LibTorch errors come back as INTERNAL statuses naming the file.
#ifndef TRAINYARD_WORKER_TRAINER_CHECKPOINT_CHECKPOINT_H_
#define TRAINYARD_WORKER_TRAINER_CHECKPOINT_CHECKPOINT_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/trainer/comm/communicator.h"

namespace trainyard::trainer {

struct CheckpointInfo {
  int64_t step = 0;
  std::string path;  // DIR/step-<N>
  int64_t bytes = 0;
};

// What a meta.json records besides the step and the optimizer: the training settings a resume
// must keep (a JSON object's text, "settings"; "" for none) and the evaluation loss of the step
// being checkpointed ("eval_loss"; nullopt: none ran at it). The trainer passes them with each
// checkpoint; consolidation copies the sharded checkpoint's.
struct MetaNotes {
  std::string settings;
  std::optional<double> eval_loss;
};

// Writes the checkpoint of `step` (optimizer steps completed). If DIR/step-<N> already exists
// complete (written by an earlier attempt at the same step: training is deterministic, so it is
// the same state) it is kept and only `latest` moves.
// Tensors are written from the CPU whatever device they live on (checkpoints load anywhere).
// `extra`: more training state by name (fp16's loss scale), written to amp.pt when not empty.
// `notes`: what meta.json records besides the step and the optimizer (MetaNotes).
using ExtraState = std::vector<std::pair<std::string, torch::Tensor>>;
absl::StatusOr<CheckpointInfo> WriteCheckpoint(const std::string& dir, int64_t step,
                                               torch::nn::Module& model,
                                               torch::optim::Optimizer& optimizer,
                                               const MetaNotes& notes,
                                               const ExtraState& extra = {});

// Loads DIR/latest into `model` and `optimizer` and restores the RNG; nullopt when there is none.
// Reads DDP checkpoints and pipeline ones (stage-<s>.pt, pipeline.h) alike: whatever the stages
// that wrote it, every parameter and its optimizer state are found by name. Tensors are read onto
// the CPU and copied to the device of the model's parameters (the optimizer state follows them).
// `extra`: receives amp.pt's tensors, empty when the checkpoint has none.
absl::StatusOr<std::optional<CheckpointInfo>> LoadLatestCheckpoint(
    const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
    ExtraState* extra = nullptr);

// A checkpoint that the ranks of `world` write together (FSDP's shards, pipeline stages); every
// rank calls it. Unless DIR/step-<N> is complete already (an earlier attempt's, kept), rank 0
// makes the empty folder DIR/.step-<N>.tmp, every rank runs `write_part` into it (its files, or
// none), then rank 0 runs `finish` (meta.json and the like), fsyncs the folder and renames it to
// DIR/step-<N>; then rank 0 publishes DIR/latest. A failure on any rank fails every rank, before
// anything is published.
using CheckpointPartWriter = std::function<absl::Status(const std::string& tmp)>;
absl::StatusOr<CheckpointInfo> WriteCollectiveCheckpoint(const std::string& dir, int64_t step,
                                                         Communicator& world,
                                                         const CheckpointPartWriter& write_part,
                                                         const CheckpointPartWriter& finish);

// Building blocks shared with the sharded checkpoints (fsdp_checkpoint.h).
absl::Status SyncPath(const std::string& path);  // fsync of a file or directory
// Runs `fill` on a new archive and, when it returns true, saves the archive as `path` and fsyncs
// it. A LibTorch error on the way (in `fill` too: a collective that failed) comes back as
// INTERNAL naming the file, so that a collective checkpoint's part writer fails on every rank
// instead of throwing on one.
absl::Status WriteSyncedArchive(const std::string& path,
                                const std::function<bool(torch::serialize::OutputArchive&)>& fill);
absl::Status WriteSyncedFile(const std::string& path, const std::string& content);
// Replaces DIR/latest by the text "<name>\n": write-temp, fsync, rename, fsync DIR.
absl::Status PublishLatest(const std::string& dir, const std::string& name);
// The checkpoint DIR/latest names (its step and DIR/step-<N>); nullopt when there is none.
absl::StatusOr<std::optional<CheckpointInfo>> FindLatestCheckpoint(const std::string& dir);
int64_t DirectoryBytes(const std::string& path);  // of the regular files directly in it
// meta.json's text, and the optimizer a checkpoint directory's meta.json names ("adamw" when it
// names none, as before train.optimizer).
// `pipeline_stages` > 0: written by a pipeline (pipeline.h), which records its stages.
std::string MetaJson(int64_t step, const std::string& optimizer, const MetaNotes& notes,
                     int pipeline_stages = 0);
absl::StatusOr<std::string> CheckpointOptimizer(const std::string& path);
// The settings a checkpoint folder's meta.json records, as JSON text ("" when it has none: one
// written before they were recorded). DATA_LOSS when meta.json cannot be read or parsed.
absl::StatusOr<std::string> CheckpointSettings(const std::string& path);
torch::Tensor SaveRngState();
void RestoreRngState(const torch::Tensor& state);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CHECKPOINT_CHECKPOINT_H_
