#include "common/memory_estimate.h"

#include <algorithm>

#include "common/spec.h"

namespace trainyard {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct BytesPerParam {
  int64_t param, grad, master;
};

BytesPerParam ForPrecision(v1::MixedPrecision p) {
  if (p == v1::BF16) return {2, 2, 4};  // bf16 weights and grads; fp32 master weights
  return {4, 4, 0};
}

int64_t ActivationBytes(const v1::JobSpec& spec, v1::MixedPrecision precision) {
  const auto& m = spec.model();
  const int64_t s = m.seq_len(), b = spec.train().micro_batch(), h = m.d_model();
  const int64_t value_bytes = precision == v1::BF16 ? 2 : 4;
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
  if (strategy == v1::FSDP) return "fsdp " + ShardingStrategyName(sharding);
  return StrategyName(strategy);
}

int64_t LargestUnitParameters(const v1::ModelSpec& m) {
  const int64_t d = m.d_model(), v = m.vocab();
  if (m.kind() == "mlp") {
    const int64_t h = m.d_hidden();
    return std::max({v * d, d * h + h + h * d + d, d * v + v});
  }
  if (m.kind() == "llama") {  // a decoder layer, or the root (embedding, norm, untied head)
    ModelConfig c = ToModelConfig(m);
    const int64_t root = v * d + d + (c.tie_weights ? 0 : v * d);
    c.n_layer = 1;
    return std::max(ModelParameterCount(c) - root, root);
  }
  const int64_t block = 12 * d * d + 13 * d;
  return std::max(block, v * d + int64_t{m.seq_len()} * d);
}

MemoryEstimate EstimateMemory(const v1::JobSpec& spec, int world_size, int ranks_per_node) {
  MemoryEstimate e;
  e.strategy = spec.parallel().strategy();
  e.precision = spec.train().mixed_precision() == v1::BF16 ? v1::BF16 : v1::FP32;
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
  return out;
}

}  // namespace trainyard
