#include "common/memory_estimate.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/spec.h"

namespace trainyard {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct BytesPerParam {
  int64_t param, grad, master;
};

BytesPerParam ForPrecision(v1::MixedPrecision p) {
  // bf16 / fp16 weights and grads; fp32 master weights
  if (p == v1::BF16 || p == v1::FP16) return {2, 2, 4};
  return {4, 4, 0};
}

int64_t ActivationBytes(const v1::JobSpec& spec, v1::MixedPrecision precision) {
  const auto& m = spec.model();
  const int64_t s = m.seq_len(), b = spec.train().micro_batch(), h = m.d_model();
  const int64_t value_bytes = precision == v1::FP32 ? 4 : 2;
  const int64_t logits = s * b * m.vocab() * 4 * 2;  // fp32 logits and their gradient
  if (m.kind() == "mlp") {
    return b * s * h * value_bytes + m.n_layer() * b * (m.d_hidden() + h) * value_bytes * 2 +
           b * m.vocab() * 4 * 2;
  }
  const int64_t a = std::max(1, m.n_head());
  // Korthikanti et al. count 2-byte values; scale to the precision actually used.
  const int64_t per_layer =
      s * b * h * (34 + 5 * a * s / std::max<int64_t>(1, h)) / 2 * value_bytes;
  const int64_t layers = m.n_layer();
  if (spec.train().activation_checkpointing()) {
    return layers * s * b * h * value_bytes + per_layer + logits;
  }
  return layers * per_layer + logits;
}

}  // namespace

std::string MemoryEstimate::Name() const {
  if (pipeline_stages > 1 || tensor_parallel > 1) {
    std::string name;
    if (pipeline_stages > 1) {
      name = absl::StrCat(
          "pipeline ", pipeline_stages, " (",
          trainyard::Name(FromWire(kPipelineSchedules, schedule, PipelineSchedule::kOneFOneB)),
          ")");
    }
    if (tensor_parallel > 1) {
      absl::StrAppend(&name, name.empty() ? "" : " x ", "tensor ", tensor_parallel);
    }
    if (strategy == v1::FSDP) absl::StrAppend(&name, " + fsdp ", ShardingStrategyName(sharding));
    return name;
  }
  if (strategy == v1::FSDP) return "fsdp " + ShardingStrategyName(sharding);
  return StrategyName(strategy);
}

int64_t LargestUnitParameters(const v1::ModelSpec& m) {
  const int64_t d = m.d_model(), v = m.vocab();
  const int64_t block = BlockParameterCount(ToModelConfig(m));
  if (m.kind() == "mlp") return std::max({v * d, block, d * v + v});
  if (m.kind() == "llama") {  // a decoder layer, or the root (embedding, norm, untied head)
    return std::max(block, v * d + d + (m.tie_weights() ? 0 : v * d));
  }
  return std::max(block, v * d + int64_t{m.seq_len()} * d);
}

namespace {

// Pipeline stages and/or tensor parallelism, with ddp or fsdp over the replicas: the busiest rank
// (see the header).
MemoryEstimate ModelParallelEstimate(const v1::JobSpec& spec, MemoryEstimate e, int world_size,
                                     int ranks_per_node) {
  const JobConfig config = ToJobConfig(spec);
  const ModelConfig& model = config.model;
  const int stages = e.pipeline_stages, tensor = e.tensor_parallel;
  const int m = stages > 1 ? std::max(1, spec.train().micro_batches()) : 1;
  const BytesPerParam bpp = ForPrecision(e.precision);
  const int64_t lora = LoraParameterCount(model, config.train.lora);
  const int64_t whole = ModelParameterCount(model);
  const int64_t optimizer_state = OptimizerStateBytes(
      config.train.optimizer, TrainedParameterShapes(model, config.train.lora), 1);
  const int64_t value_bytes = e.precision == v1::FP32 ? 4 : 2;
  const int64_t s = model.seq_len, b = spec.train().micro_batch(), h = model.d_model;
  const int64_t a = std::max(1, model.n_head);
  // Korthikanti et al.: with tensor parallelism the norms' and dropouts' 10 s*b*h stay whole on
  // every rank, unless sequence parallelism splits them too.
  const bool sequence = tensor > 1 && spec.parallel().sequence_parallel();
  const int64_t per_layer = s * b * h *
                            ((sequence ? 34 / tensor : 10 + 24 / tensor) +
                             5 * a * s / (std::max<int64_t>(1, h) * tensor)) /
                            2 * value_bytes;
  const int64_t logits = s * b * model.vocab * 4 * 2 / tensor;
  const std::vector<int> bounds = PipelineBoundaries(model, stages, config.parallel.pipeline_split);
  const std::vector<int64_t> held = StageParameterCounts(model, bounds);
  // FSDP: a stage's replicas (HYBRID_SHARD: those on one node) shard its state; FULL_SHARD and
  // HYBRID_SHARD gather one unit at a time (the largest of the model, at most), SHARD_GRAD_OP
  // keeps the stage's from forward to backward.
  const bool sharded = e.strategy == v1::FSDP && e.sharding != v1::NO_SHARD;
  const int64_t all_replicas = std::max<int64_t>(1, world_size / std::max(1, stages * tensor));
  const int64_t replicas =
      !sharded ? 1
      : e.sharding == v1::HYBRID_SHARD
          ? std::clamp<int64_t>(ranks_per_node / std::max(1, stages * tensor), 1, all_replicas)
          : all_replicas;
  const int64_t block_unit = CeilDiv(BlockParameterCount(model), tensor);
  int64_t busiest = -1;
  for (int stage = 0; stage < stages; ++stage) {
    const int layers = bounds[stage + 1] - bounds[stage];
    const int64_t alive =
        spec.parallel().pipeline_schedule() == v1::GPIPE ? m : std::min<int64_t>(m, stages - stage);
    MemoryEstimate here = e;
    const int64_t params = CeilDiv(held[stage], tensor);
    // LoRA: the stage's layers' adapters train.
    const int64_t trained =
        config.train.lora.enabled() ? lora * layers / std::max(1, model.n_layer) : params;
    const int64_t all = params + (config.train.lora.enabled() ? trained : 0);
    // Gathered at once: the stage's root (embeddings, final norm and head: kept for the step)
    // and a block unit.
    const int64_t root = std::max<int64_t>(0, params - layers * block_unit);
    const int64_t unit = root + block_unit;
    here.parameters =
        bpp.param *
        (!sharded || e.sharding == v1::SHARD_GRAD_OP ? all : CeilDiv(all, replicas) + unit);
    here.gradients =
        bpp.grad * (sharded ? CeilDiv(trained, replicas) + std::min(unit, trained) : trained);
    const int64_t trained_whole = config.train.lora.enabled() ? lora : whole;
    // The stage's share of the state (in double: the product overflows for billions), over the
    // replicas that shard it.
    here.optimizer =
        bpp.master * CeilDiv(trained, replicas) +
        static_cast<int64_t>(static_cast<double>(optimizer_state) * double(trained) /
                             double(std::max<int64_t>(1, trained_whole)) / double(replicas));
    here.activations = spec.train().activation_checkpointing()
                           ? layers * s * b * h * value_bytes * alive + per_layer
                           : layers * per_layer * alive;
    if (stage == stages - 1) here.activations += logits * alive;
    if (here.total() > busiest) {
      busiest = here.total();
      e = here;
    }
  }
  return e;
}

}  // namespace

MemoryEstimate EstimateMemory(const v1::JobSpec& spec, int world_size, int ranks_per_node) {
  MemoryEstimate e;
  e.pipeline_stages = std::max(1, spec.parallel().pipeline_stages());
  e.tensor_parallel = std::max(1, spec.parallel().tensor_parallel());
  e.schedule = spec.parallel().pipeline_schedule() == v1::GPIPE ? v1::GPIPE : v1::ONE_F_ONE_B;
  e.strategy = spec.parallel().strategy();
  e.precision = spec.train().mixed_precision() == v1::MIXED_PRECISION_UNSPECIFIED
                    ? v1::FP32
                    : spec.train().mixed_precision();
  // LoRA: the base weights are frozen (weights only: no gradients, no optimizer state); only the
  // adapters train.
  const JobConfig config = ToJobConfig(spec);
  const int64_t lora = LoraParameterCount(config.model, config.train.lora);
  const int64_t params = ModelParameterCount(spec.model()) + lora;
  const int64_t unit = LargestUnitParameters(spec.model());
  const int64_t trained = config.train.lora.enabled() ? lora : params;
  // Gradients of the unit being reduce-scattered: a layer's adapters under LoRA.
  const int64_t trained_unit =
      config.train.lora.enabled() ? lora / std::max(1, config.model.n_layer) : unit;
  const BytesPerParam bpp = ForPrecision(e.precision);
  const std::vector<std::vector<int64_t>> shapes =
      TrainedParameterShapes(config.model, config.train.lora);
  const int64_t w = std::max(1, world_size);
  e.activations = ActivationBytes(spec, e.precision);

  const v1::ShardingStrategy sharding = spec.parallel().sharding_strategy();
  if (e.pipeline_stages > 1 || e.tensor_parallel > 1) {
    if (e.strategy == v1::FSDP) e.sharding = sharding;
    return ModelParallelEstimate(spec, e, world_size, ranks_per_node);
  }
  if (e.strategy == v1::OFFLOAD) {
    // Weights and gradients stay on the device (each rank keeps its reduce-scattered slice of the
    // gradients plus one bucket in flight); master weights and moments live on the PS shards.
    e.parameters = bpp.param * params;
    e.gradients = bpp.grad * CeilDiv(params, w) + bpp.grad * unit;
    e.offloaded = (4 + 8 + 4) * params;  // fp32 master, m, v, gradient staging
    return e;
  }
  if (e.strategy != v1::FSDP || sharding == v1::NO_SHARD) {  // NO_SHARD behaves as DDP
    e.sharding = e.strategy == v1::FSDP ? sharding : v1::SHARDING_STRATEGY_UNSPECIFIED;
    e.parameters = bpp.param * params;
    e.gradients = bpp.grad * trained;
    e.optimizer = bpp.master * trained + OptimizerStateBytes(config.train.optimizer, shapes, 1);
    return e;
  }
  e.sharding = sharding;
  const int64_t group =
      sharding == v1::HYBRID_SHARD ? std::max<int64_t>(1, std::min<int64_t>(w, ranks_per_node)) : w;
  const int64_t shard = CeilDiv(params, group);
  e.optimizer = bpp.master * CeilDiv(trained, group) +
                OptimizerStateBytes(config.train.optimizer, shapes, group);
  e.gradients = bpp.grad * CeilDiv(trained, group) + bpp.grad * trained_unit;
  e.parameters = sharding == v1::SHARD_GRAD_OP
                     ? bpp.param * params  // gathered from forward to backward
                 : config.train.lora.enabled()
                     // a frozen unit is freed after its input's gradient, when the next one is
                     // gathered already: two units (with their adapters) at once
                     ? bpp.param * shard + 2 * bpp.param * (unit + trained_unit)
                     : bpp.param * shard + bpp.param * unit;  // one unit gathered at a time
  return e;
}

std::vector<MemoryEstimate> EstimateAllStrategies(const v1::JobSpec& spec, int world_size,
                                                  int ranks_per_node) {
  std::vector<MemoryEstimate> out;
  for (v1::MixedPrecision p : {v1::FP32, v1::BF16}) {
    v1::JobSpec s = spec;
    s.mutable_train()->set_mixed_precision(p);
    s.mutable_parallel()->set_strategy(v1::DDP);
    out.push_back(EstimateMemory(s, world_size, ranks_per_node));
    s.mutable_parallel()->set_strategy(v1::FSDP);
    for (v1::ShardingStrategy ss :
         {v1::FULL_SHARD, v1::SHARD_GRAD_OP, v1::NO_SHARD, v1::HYBRID_SHARD}) {
      s.mutable_parallel()->set_sharding_strategy(ss);
      out.push_back(EstimateMemory(s, world_size, ranks_per_node));
    }
    // LoRA and optimizers other than AdamW do not run under offload.
    if (s.train().has_lora() || (s.train().optimizer() != v1::ADAMW &&
                                 s.train().optimizer() != v1::OPTIMIZER_UNSPECIFIED)) {
      continue;
    }
    s.mutable_parallel()->set_strategy(v1::OFFLOAD);
    out.push_back(EstimateMemory(s, world_size, ranks_per_node));
  }
  // Model-parallel layouts (ddp over the rest, and fsdp FULL_SHARD where there are replicas).
  const auto& m = spec.model();
  const bool splittable =
      (m.kind() == "gpt" || m.kind() == "llama") && !spec.train().has_lora() &&
      (spec.train().optimizer() == v1::ADAMW || spec.train().optimizer() == v1::LION ||
       spec.train().optimizer() == v1::OPTIMIZER_UNSPECIFIED);
  auto divides = [](int t, int64_t n) { return n <= 0 || n % t == 0; };
  for (v1::MixedPrecision p : {v1::FP32, v1::BF16}) {
    for (int stages = 1; stages <= world_size; ++stages) {
      if (world_size % stages != 0 || stages > std::max(1, m.n_layer())) continue;
      for (int tensor = 1; stages * tensor <= world_size; ++tensor) {
        if (world_size % (stages * tensor) != 0 || stages * tensor == 1) continue;
        if (tensor > 1 &&
            !(splittable && divides(tensor, m.n_head()) && divides(tensor, m.vocab()) &&
              (m.kind() != "llama" ||
               (divides(tensor, m.n_kv_head()) && divides(tensor, m.d_hidden()))))) {
          continue;
        }
        v1::JobSpec s = spec;
        s.mutable_train()->set_mixed_precision(p);
        auto* par = s.mutable_parallel();
        par->set_strategy(v1::DDP);
        par->set_pipeline_stages(stages);
        par->set_tensor_parallel(tensor);
        if (stages != spec.parallel().pipeline_stages()) par->clear_pipeline_split();
        if (s.train().micro_batches() == 0) s.mutable_train()->set_micro_batches(2 * stages);
        out.push_back(EstimateMemory(s, world_size, ranks_per_node));
        // With replicas, fsdp shards each part over them.
        if (world_size > stages * tensor) {
          par->set_strategy(v1::FSDP);
          par->set_sharding_strategy(v1::FULL_SHARD);
          out.push_back(EstimateMemory(s, world_size, ranks_per_node));
        }
      }
    }
  }
  return out;
}

}  // namespace trainyard
