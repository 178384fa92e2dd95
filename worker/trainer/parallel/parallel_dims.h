// ParallelDims: a rank's place in its job's parallel layout, worked out and validated once, as
// torchtitan's distributed/parallel_dims.py does, and the communicator groups that layout needs.
//
// Make checks, before any rank waits for another, what the spec asks against the model's sizes,
// the ranks: pipeline stages x tensor-parallel ranks dividing the world, HYBRID_SHARD's nodes of
// equal size holding whole model-parallel groups, fp16 with DDP only. (Every layout and optimizer
// runs on CPUs and GPUs alike.) Each refusal is one line naming the spec field.
//
// BuildGroups then joins the attempt's process group through the coordinator's rendezvous (a
// world of one needs none) and makes every subgroup the layout needs, with the same back end as
// the world: NCCL for a GPU rank (Gloo with TRAINYARD_COLLECTIVES=gloo), Gloo on CPUs, shared
// memory for all-reduces among the ranks of one host. Every rank builds the same groups in the
// same order.
#ifndef TRAINYARD_WORKER_TRAINER_PARALLEL_PARALLEL_DIMS_H_
#define TRAINYARD_WORKER_TRAINER_PARALLEL_PARALLEL_DIMS_H_

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "worker/trainer/comm/communicator.h"

namespace trainyard::trainer {

struct ParallelDims {
  int rank = 0;
  int world_size = 1;
  int local_world = 1;  // the job's ranks on this rank's node (consecutive ranks)
  bool offload = false;
  // FSDP that shards (NO_SHARD keeps whole parameters: DDP runs it).
  bool fsdp = false;
  bool hybrid = false;  // HYBRID_SHARD: shards within a node, replicas across nodes
  int stages = 1;       // pipeline stages
  int tensor = 1;       // tensor-parallel ranks
  bool pipelined = false;
  bool model_parallel = false;    // pipeline stages or tensor parallelism
  std::vector<int> stage_bounds;  // model parallelism: the first block of each stage, then the end
  // FSDP with cpu_ram_efficient_loading: only rank 0 materializes the model, the others receive
  // their shards from it.
  bool from_rank0 = false;
  // Whether every rank that materializes the model loads model.from's weights itself (FSDP, model
  // parallelism), or rank 0 alone, whose parameters the others receive (DDP, offload).
  bool every_rank_loads = false;

  // The ranks that hold one copy of the model (stages x tensor-parallel ranks).
  int group() const { return stages * tensor; }

  // `m`: the model as the trainer builds it (model.from's config.json read). `local_world_size`
  // 0: every rank on this node.
  static absl::StatusOr<ParallelDims> Make(const JobConfig& spec, const ModelConfig& m, int rank,
                                           int world_size, int local_world_size);
};

// The rank's communicator groups; those its layout does not use are null, but for `world` (always
// set) and, under fsdp, `shard`.
struct CommGroups {
  std::unique_ptr<Communicator> world;
  std::unique_ptr<Communicator> shard, replica;  // FSDP: a shard's ranks; a shard's holders
  std::unique_ptr<Communicator> stage;           // pipeline: the ranks that run this stage
  std::unique_ptr<Communicator> tensor;          // tensor parallelism: the ranks of its layers
  // The step's agreement and evaluation's sums (small host tensors), over Gloo where the world is
  // NCCL with several ranks: through NCCL a host tensor is all-reduced on the group's stream,
  // behind the step's gradient all-reduces, and the host would wait for the backward with it.
  // Null where the world serves (Gloo's, or one rank).
  std::unique_ptr<Communicator> host;
  Communicator& Host() const { return host ? *host : *world; }
  // Tests: one GPU rank that still sends its gradients through NCCL (TRAINYARD_NCCL_ONE_RANK),
  // so that a machine with one GPU runs the NCCL path.
  bool nccl_one_rank = false;
};

// Where the rendezvous is: the coordinator and the attempt the rank belongs to.
struct RendezvousTarget {
  std::string coordinator;
  std::string job_id;
  int attempt = 1;
  std::string gloo_hostname = "127.0.0.1";  // where Gloo's transport listens
};

absl::StatusOr<CommGroups> BuildGroups(const ParallelDims& dims, const torch::Device& device,
                                       const RendezvousTarget& target);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_PARALLEL_PARALLEL_DIMS_H_
