// ParallelDims and BuildGroups (see parallel_dims.h).
#include "worker/trainer/parallel/parallel_dims.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/trainer/comm/coordinator_store.h"
#include "worker/trainer/comm/cuda_support.h"
#include "worker/trainer/control/rendezvous_client.h"
#include "worker/trainer/parallel/pipeline.h"

namespace trainyard::trainer {

absl::StatusOr<ParallelDims> ParallelDims::Make(const JobConfig& spec, const ModelConfig& m,
                                                int rank, int world_size, int local_world_size) {
  const ParallelConfig& par = spec.parallel;
  const TrainConfig& t = spec.train;
  ParallelDims d;
  d.rank = rank;
  d.world_size = world_size;
  d.local_world = local_world_size > 0 ? local_world_size : world_size;
  d.offload = par.strategy == Strategy::kOffload;
  // FSDP's NO_SHARD keeps whole parameters, gradients and optimizer state on every rank and
  // all-reduces the gradients: DDP, which runs it.
  d.fsdp = par.strategy == Strategy::kFsdp && par.sharding != Sharding::kNoShard;
  d.hybrid = d.fsdp && par.sharding == Sharding::kHybridShard;
  // Model parallelism (pipeline stages, tensor parallelism or both): the ranks run PipelineStage.
  d.stages = par.pipeline_stages;
  d.tensor = par.tensor_parallel;
  d.pipelined = d.stages > 1;
  d.model_parallel = d.pipelined || d.tensor > 1;
  // (Model parallelism: every rank keeps its part of the model it built.)
  d.from_rank0 = d.fsdp && par.cpu_ram_efficient_loading && world_size > 1 && !d.model_parallel;
  d.every_rank_loads = d.fsdp || d.model_parallel;
  if (d.model_parallel) {
    // The sizes the layout cuts, model.from's config.json read by now.
    if (const std::string misfit = ModelParallelMisfit(m, par); !misfit.empty()) {
      return absl::InvalidArgumentError(misfit);
    }
    if (world_size % d.group() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parallel.pipeline_stages: ", world_size, " ranks do not split into ",
                       d.stages, " stages of ", d.tensor, " tensor-parallel ranks"));
    }
    d.stage_bounds = PipelineBoundaries(m, d.stages, par.pipeline_split);
  }
  if (d.hybrid && (d.local_world > world_size || world_size % d.local_world != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel.sharding_strategy: HYBRID_SHARD needs the same number of ranks on every node; ",
        world_size, " ranks do not split into nodes of ", d.local_world));
  }
  if (d.hybrid && d.model_parallel && d.local_world % d.group() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel.sharding_strategy: HYBRID_SHARD shards each part of the model over its "
        "replicas on one node, so every node needs whole replicas of ",
        d.group(), " ranks (pipeline stages x tensor-parallel ranks); this node runs ",
        d.local_world));
  }
  if (t.precision == Precision::kFp16 && (d.model_parallel || d.offload || d.fsdp)) {
    return absl::UnimplementedError(
        "train.mixed_precision: fp16 (dynamic loss scaling) runs with strategy ddp only so far; "
        "use bf16");
  }
  return d;
}

absl::StatusOr<CommGroups> BuildGroups(const ParallelDims& d, const torch::Device& device,
                                       const RendezvousTarget& target) {
  constexpr auto kTimeout = std::chrono::minutes(5);
  CommGroups g;
  g.nccl_one_rank =
      device.is_cuda() && d.world_size == 1 && std::getenv("TRAINYARD_NCCL_ONE_RANK") != nullptr;
  // A GPU rank's collectives are NCCL's, unless TRAINYARD_COLLECTIVES=gloo: Gloo through host
  // copies, for ranks that share one GPU (NCCL refuses two ranks on one device), as on a test
  // machine with one GPU.
  const char* collectives = std::getenv("TRAINYARD_COLLECTIVES");
  const bool use_nccl =
      device.is_cuda() && !(collectives != nullptr && std::string_view(collectives) == "gloo");
  if (g.nccl_one_rank) {
    ASSIGN_OR_RETURN(g.world,
                     MakeNcclCommunicator(c10::make_intrusive<c10d::HashStore>(), 0, 1, kTimeout));
  } else if (d.world_size == 1) {
    g.world = MakeLocalCommunicator();
  } else {
    auto store = c10::make_intrusive<CoordinatorStore>(
        std::make_shared<RendezvousClient>(target.coordinator, target.job_id, target.attempt),
        kTimeout);
    if (use_nccl) {
      // NCCL's unique id travels through the coordinator's rendezvous, as Gloo's addresses do.
      ASSIGN_OR_RETURN(g.world, MakeNcclCommunicator(store, d.rank, d.world_size, kTimeout));
      ASSIGN_OR_RETURN(g.host,
                       MakeSubgroupCommunicator(store, "host-agreement", d.rank, d.world_size,
                                                target.gloo_hostname, kTimeout));
    } else {
      // All ranks on this host (the worker says how many of the job's ranks it runs): gradients
      // are summed through shared memory instead of loopback TCP.
      ASSIGN_OR_RETURN(
          g.world, MakeGlooCommunicator(store, d.rank, d.world_size, target.gloo_hostname, kTimeout,
                                        /*same_host=*/d.local_world == d.world_size));
    }
    // A group of some of the ranks, with its keys under `name`: NCCL's or Gloo's, as the world.
    auto make_group = [&](const std::string& name, int group_rank,
                          int group_size) -> absl::StatusOr<std::unique_ptr<Communicator>> {
      if (group_size == 1) return MakeLocalCommunicator();
      if (use_nccl) {
        return MakeNcclCommunicator(c10::make_intrusive<c10d::PrefixStore>(name, store), group_rank,
                                    group_size, kTimeout);
      }
      return MakeSubgroupCommunicator(store, name, group_rank, group_size, target.gloo_hostname,
                                      kTimeout);
    };
    // Model parallelism: the ranks holding the same shards (one per replica; under fsdp its
    // group below), and the tensor-parallel group (consecutive ranks).
    const int group = d.group();
    if (d.model_parallel && d.world_size > group && (!d.fsdp || d.hybrid)) {
      ASSIGN_OR_RETURN(g.stage, make_group(absl::StrCat("data-parallel-", d.rank % group),
                                           d.rank / group, d.world_size / group));
    }
    if (d.tensor > 1) {
      ASSIGN_OR_RETURN(g.tensor, make_group(absl::StrCat("tensor-parallel-", d.rank / d.tensor),
                                            d.rank % d.tensor, d.tensor));
    }
    if (d.fsdp && d.model_parallel) {
      // FSDP within each part of the model: its replicas shard it (a group of their own, as
      // below); under HYBRID_SHARD its replicas on one node, the nodes' shards replicated.
      const int replica = d.rank / group, replicas = d.world_size / group;
      const int per_node = d.hybrid ? d.local_world / group : replicas;
      ASSIGN_OR_RETURN(g.shard, make_group(absl::StrCat("fsdp-stage-", d.rank % group, "-shard-",
                                                        replica / per_node),
                                           replica % per_node, per_node));
      if (d.hybrid) {
        ASSIGN_OR_RETURN(g.replica, make_group(absl::StrCat("fsdp-stage-", d.rank % group,
                                                            "-replica-", replica % per_node),
                                               replica / per_node, replicas / per_node));
      }
    } else if (d.fsdp) {
      // Every rank builds its own groups, also without HYBRID_SHARD: the FSDP communication
      // thread must not share a process group with the training thread's collectives.
      const int shard_size = d.hybrid ? d.local_world : d.world_size;
      ASSIGN_OR_RETURN(g.shard, make_group(absl::StrCat("fsdp-shard-", d.rank / shard_size),
                                           d.rank % shard_size, shard_size));
      if (d.hybrid) {
        ASSIGN_OR_RETURN(g.replica, make_group(absl::StrCat("fsdp-replica-", d.rank % shard_size),
                                               d.rank / shard_size, d.world_size / shard_size));
      }
    }
  }
  if (d.fsdp && !g.shard) g.shard = MakeLocalCommunicator();
  if (d.hybrid && d.model_parallel && !g.stage) g.stage = MakeLocalCommunicator();
  if (d.hybrid) {
    // Every node must hold the same number of ranks (consecutive ones).
    torch::Tensor sizes = torch::tensor(
        {double(d.local_world), double(d.local_world) * d.local_world}, torch::kDouble);
    g.world->AllReduceSum({sizes})->Wait();
    const double sum = sizes[0].item<double>(), sum_sq = sizes[1].item<double>();
    if (std::abs(sum * sum - sum_sq * d.world_size) > 0.5) {
      return absl::InvalidArgumentError(
          "parallel.sharding_strategy: HYBRID_SHARD needs the same number of ranks on every "
          "node, and the ranks of this job are spread unevenly");
    }
  }
  return g;
}

}  // namespace trainyard::trainer
