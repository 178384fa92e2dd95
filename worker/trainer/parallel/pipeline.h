// Model parallelism: pipeline stages (parallel.pipeline_stages) and tensor parallelism
// (parallel.tensor_parallel, tensor_parallel.h), with data parallelism over the rest.
//
// Pipeline parallelism: the model's blocks split into P consecutive
// stages, each run by its own rank; the first stage also embeds the tokens, the last also runs the
// final norm, the head and the loss. A step's micro-batches (train.micro_batches, m) flow forward
// stage to stage as activations and back as their gradients, sent point to point; every stage
// accumulates its parameters' gradients over the m micro-batches and the optimizer steps once.
// Tensor parallelism splits each stage's layers over T ranks, which run the stage together; each
// sends its (whole, replicated) activations to the same tensor-parallel rank of the next stage.
// Data parallelism runs over the rest: rank = (replica * P + stage) * T + tensor rank, so a
// tensor-parallel group is consecutive ranks (on one node), then a replica's stages. The ranks
// that hold the same part of the model (one per replica) average their gradients through a
// GradientReducer of their own group (ddp), or shard that part over their group (fsdp: an
// FsdpModel of the stage's parameters, whose block units are gathered for each micro-batch's
// forward and backward and whose gradients are reduce-scattered after each backward, as
// PyTorch's pipelining runs FSDP within a stage; under HYBRID_SHARD over the replicas on one
// node, all-reduced across nodes).
//
// Schedules (as PyTorch's torch.distributed.pipelining and DeepSpeed name them):
//  - gpipe: all m forwards, then all m backwards; m micro-batches of activations alive at once.
//  - 1f1b (PipeDream-flush): stage s runs P - s - 1 forwards, then alternates one forward and one
//    backward, then drains the backwards; at most P - s micro-batches alive.
// Both leave the same idle share, the bubble: (P - 1) / (m + P - 1) of a step in theory.
//
// Tied weights (model.tie_weights): the first and the last stage each hold the embedding; after
// backward they add each other's gradient (as Megatron-LM's embedding group does), so both copies
// take the same steps.
//
// Every rank builds the whole model (deterministically, from train.seed), loads a checkpoint into
// it, keeps its tensor-parallel shards, and frees the storage of the parameters its stage does
// not hold.
//
// Checkpoints: checkpoint/staged_checkpoint.h.
//
// One training thread per rank calls everything.
#ifndef TRAINYARD_WORKER_TRAINER_PARALLEL_PIPELINE_H_
#define TRAINYARD_WORKER_TRAINER_PARALLEL_PIPELINE_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/parallel/ddp.h"
#include "worker/trainer/parallel/fsdp.h"

namespace trainyard::trainer {

struct PipelineLayout {
  int stages = 1;
  int replicas = 1;
  int tensor_parallel = 1;
  int stage = 0;
  int replica = 0;
  int tp_rank = 0;
  std::vector<int> bounds;  // stage s runs blocks [bounds[s], bounds[s + 1])

  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
  // The rank of stage `s` of replica `r` with this rank's tensor-parallel rank.
  int RankOf(int s, int r) const { return (r * stages + s) * tensor_parallel + tp_rank; }
};

// The layout of `rank` of `world` ranks in `stages` stages of the blocks `bounds`
// (PipelineBoundaries), each run by `tensor_parallel` ranks.
PipelineLayout MakePipelineLayout(int rank, int world, int stages, int tensor_parallel,
                                  std::vector<int> bounds);

// Whether the stage holds parameter `name` of `model`: its blocks', the first stage's embeddings,
// the last stage's final norm and head, and the tied embedding on both.
bool StageHolds(const LanguageModel& model, const PipelineLayout& layout, const std::string& name);

// The parameter ("name", tensor) pairs the stage holds, in registration order.
std::vector<std::pair<std::string, torch::Tensor>> StageParameters(LanguageModel& model,
                                                                   const PipelineLayout& layout);

// Tensor parallelism: replaces each of `params` that the model splits by this rank's shard.
void KeepTensorParallelShards(LanguageModel& model,
                              const std::vector<std::pair<std::string, torch::Tensor>>& params,
                              const PipelineLayout& layout);

// After a resume: the optimizer state (ParameterState's form) of the stage's trainable
// parameters, by name, taken from `whole` (an optimizer of every trainable parameter, loaded from
// a checkpoint of any layout; the parameters already cut to this rank's tensor-parallel shards),
// elementwise state cut as its parameter; `step` gets the optimizer steps taken.
std::map<std::string, std::map<std::string, torch::Tensor>> StageStates(
    const LanguageModel& model, torch::optim::Optimizer& whole, const PipelineLayout& layout,
    int64_t* step);

// `t` whole: all-gathered over the tensor-parallel group and put together by `split` (every rank
// of the group calls it; replicated tensors come back as they are).
torch::Tensor Whole(const torch::Tensor& t, TensorParallelSplit split, Communicator* tensor);

// `cut` (a shard or an unshard) applied to optimizer state `state` of a parameter of shape
// `shape`: elementwise state is shaped as its parameter or flat (Lion's), and comes back so;
// anything else (a step count) as it is.
torch::Tensor CutAsParameter(const torch::Tensor& state, torch::IntArrayRef shape,
                             const std::function<torch::Tensor(const torch::Tensor&)>& cut);

// `stage` (an optimizer of the stage's trainable parameters) takes their StageStates.
absl::Status KeepStageState(const LanguageModel& model, torch::optim::Optimizer& whole,
                            torch::optim::Optimizer& stage, const PipelineLayout& layout);

// Per step, of this rank.
struct PipelineStepStats {
  double seconds = 0;            // the schedule's wall time
  double idle_seconds = 0;       // of it, waiting for activations or gradients from other stages
  double comm_wait_seconds = 0;  // of it, waiting for fsdp's reduce-scatters after a backward
  int peak_in_flight = 0;        // micro-batches whose activations were alive at once
  // Growth of the process's heap over the step's start (glibc's in-use bytes, sampled after every
  // forward): the activations the stage keeps for backward.
  int64_t peak_activation_bytes = 0;
};

class PipelineStage {
 public:
  // `world` carries the activations (ranks as in `layout`); the stage's replicas average its
  // gradients through `reducer` (ddp; nullable: one replica) or shard it with `fsdp` (nullable);
  // `tensor` (nullable: no tensor parallelism) is the model's tensor-parallel group. None is
  // owned.
  PipelineStage(LanguageModel& model, Communicator& world, PipelineLayout layout,
                PipelineSchedule schedule, int micro_batch, GradientReducer* reducer,
                FsdpModel* fsdp, Communicator* tensor);

  // One step: `windows(i)` gives micro-batch i's windows ([micro_batch, seq_len + 1]; read on the
  // first and the last stage), `loss(i, logits, windows)` its loss (last stage), already scaled
  // for accumulation. Returns the sum of the losses on the last stage, a 0-dim fp64 tensor where
  // they were computed (on a GPU: not read back, so that the host never waits for a micro-batch's
  // forward); undefined elsewhere.
  torch::Tensor Step(
      int micro_batches, const std::function<torch::Tensor(int)>& windows,
      const std::function<torch::Tensor(int, const torch::Tensor&, const torch::Tensor&)>& loss);
  // Forwards alone (evaluation, under no_grad): micro-batch i's activations flow from stage to
  // stage as in Step, none back; `loss(i, logits, windows)` on the last stage gives what it sums.
  // Returns the sum on the last stage, 0 elsewhere. Every rank of the replica calls it.
  double Evaluate(
      int micro_batches, const std::function<torch::Tensor(int)>& windows,
      const std::function<torch::Tensor(int, const torch::Tensor&, const torch::Tensor&)>& loss);
  // Tied weights: adds the gradient of the other end's copy (first and last stage); call after
  // the reducer's Finish (under fsdp, the two ends' shard groups put it together whole to send
  // it). No-op elsewhere.
  void SyncTiedGradient();
  // Sequence parallelism: sums the replicated parameters' gradients (each rank's is of its part
  // of the sequence) over the tensor-parallel group. Call after the reducer's Finish.
  void SyncSequenceParallelGradients();
  // The squared gradient norm of the whole model summed from every stage and tensor-parallel
  // shard (the tied weight and replicated parameters counted once; under fsdp from the gradient
  // shards). Every rank calls it.
  double GradNormSquared(const std::vector<torch::Tensor>& trainable);

  // Rank 0 receives every stage's parameters (of the first replica, their tensor-parallel shards
  // gathered) into its model, whose freed storage it allocates again, and runs it without tensor
  // parallelism from then on; the others send theirs. Every rank calls it (under fsdp, after
  // GatherFullParameters).
  void GatherToRankZero();

  const PipelineLayout& layout() const { return layout_; }
  const PipelineStepStats& last_step() const { return stats_; }

 private:
  struct Op {
    bool forward;
    int micro;
  };
  std::vector<Op> Schedule(int micro_batches) const;

  LanguageModel& model_;
  Communicator& world_;
  PipelineLayout layout_;
  PipelineSchedule schedule_;
  int micro_batch_;
  torch::TensorOptions hidden_options_;  // fp32 on the model's device: boundary tensors
  GradientReducer* reducer_;
  FsdpModel* fsdp_;
  Communicator* tensor_;
  torch::Tensor tied_;  // the tied embedding on the first and the last stage
  std::string tied_name_;
  // Tensor parallelism: the stage's trainable parameters every rank of the group holds whole
  // (norms, biases of row-parallel layers, position embeddings).
  std::vector<torch::Tensor> replicated_;
  std::vector<std::string> replicated_names_;
  PipelineStepStats stats_;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_PARALLEL_PIPELINE_H_
