// Memory per rank of a training job under each parallel strategy and precision, as `yard
// estimate-memory` prints it and the coordinator checks it at submit. Pure functions.
//
// Model state follows the ZeRO paper's accounting per parameter: fp32 training keeps 4 bytes of
// weights, 4 of gradients and 8 of Adam moments; bf16 (and fp16) mixed precision keeps 2 + 2 and 12
// of optimizer state (fp32 master weights + moments). train.optimizer changes the moments' part
// (OptimizerStateBytes: Lion 4, 8-bit AdamW about 2, Adafactor a row and a column per matrix).
// FSDP shards these over the shard group (Adafactor's factors are replicated) and adds
// the largest unit while it is gathered. Activations follow Korthikanti et al. (2022), "Reducing
// Activation Recomputation in Large Transformer Models": s*b*h*(34 + 5*a*s/h) bytes per layer at
// 2 bytes per value, plus the logits; with activation checkpointing only each layer's input and
// one layer's activations stay alive. Under LoRA the frozen base holds weights only: gradients and
// optimizer state are the adapters' (their activations are not counted).
//
// Model parallelism (parallel.pipeline_stages P and parallel.tensor_parallel T, ddp or fsdp over
// the D replicas): the busiest rank's share. A stage holds its blocks (the first also the
// embeddings, the last the head), split T ways (the replicated norms and biases counted as split
// too); its activations are its layers' for every micro-batch alive at once (GPipe: all m;
// 1F1B: P - stage on stage s) at Korthikanti et al.'s tensor-parallel size,
// s*b*h*(10 + 24/T + 5*a*s/(h*T)) per layer (s*b*h*(34/T + 5*a*s/(h*T)) with sequence
// parallelism), and the last stage's logits split T ways. Under fsdp the stage's replicas shard
// its gradients and optimizer state D ways (under HYBRID_SHARD those on one node), and under
// FULL_SHARD and HYBRID_SHARD its parameters too, plus the largest unit (split T ways) while it
// is gathered.
#ifndef TRAINYARD_COMMON_MEMORY_ESTIMATE_H_
#define TRAINYARD_COMMON_MEMORY_ESTIMATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "trainyard/v1/job.pb.h"

namespace trainyard {

struct MemoryEstimate {
  v1::Strategy strategy = v1::DDP;
  v1::ShardingStrategy sharding = v1::SHARDING_STRATEGY_UNSPECIFIED;  // FSDP only
  v1::MixedPrecision precision = v1::FP32;
  // Bytes on each rank's device.
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
  int64_t activations = 0;
  int64_t total() const { return parameters + gradients + optimizer + activations; }
  // Bytes of optimizer state and master weights held off the device (offload), whole job.
  int64_t offloaded = 0;
  int pipeline_stages = 1;
  int tensor_parallel = 1;
  v1::PipelineSchedule schedule = v1::ONE_F_ONE_B;

  // "ddp", "fsdp FULL_SHARD", "offload", "pipeline 2 (1f1b) x tensor 2",
  // "pipeline 2 (1f1b) + fsdp FULL_SHARD"
  std::string Name() const;
};

// Parameters of the largest FSDP unit (a transformer block, or the embedding if larger).
int64_t LargestUnitParameters(const v1::ModelSpec& model);

// The estimate for `spec` as written (its strategy, sharding and precision), on `world_size`
// ranks of which `ranks_per_node` share a node (the HYBRID_SHARD group).
MemoryEstimate EstimateMemory(const v1::JobSpec& spec, int world_size, int ranks_per_node);

// Every strategy (DDP, each FSDP sharding strategy, offload unless LoRA or an optimizer other
// than AdamW) for both precisions, then the model-parallel layouts the job could use on
// `world_size` ranks (pipeline stages and tensor-parallel ranks whose product divides it, each a
// divisor of the blocks or heads and vocabulary it splits; the spec's schedule, or 1F1B), for
// both precisions, each with ddp and, where there are replicas, fsdp FULL_SHARD over them.
std::vector<MemoryEstimate> EstimateAllStrategies(const v1::JobSpec& spec, int world_size,
                                                  int ranks_per_node);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_MEMORY_ESTIMATE_H_
