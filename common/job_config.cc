// Names and the parameter count of JobConfig (see job_config.h).
#include "common/job_config.h"

#include <utility>

namespace trainyard {

const char* Name(Strategy s) {
  switch (s) {
    case Strategy::kDdp:
      return "ddp";
    case Strategy::kFsdp:
      return "fsdp";
    case Strategy::kOffload:
      return "offload";
  }
  return "?";
}

const char* Name(Sharding s) {
  switch (s) {
    case Sharding::kFullShard:
      return "FULL_SHARD";
    case Sharding::kShardGradOp:
      return "SHARD_GRAD_OP";
    case Sharding::kNoShard:
      return "NO_SHARD";
    case Sharding::kHybridShard:
      return "HYBRID_SHARD";
  }
  return "?";
}

const char* Name(WrapPolicy p) {
  return p == WrapPolicy::kSizeBased ? "SIZE_BASED_WRAP" : "TRANSFORMER_BASED_WRAP";
}

const char* Name(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::kBackwardPre:
      return "BACKWARD_PRE";
    case BackwardPrefetch::kBackwardPost:
      return "BACKWARD_POST";
    case BackwardPrefetch::kNoPrefetch:
      return "NO_PREFETCH";
  }
  return "?";
}

const char* Name(Precision p) { return p == Precision::kBf16 ? "bf16" : "fp32"; }

int64_t ModelParameterCount(const ModelConfig& m) {
  const int64_t d = m.d_model, v = m.vocab, layers = m.n_layer;
  if (m.kind == "mlp") {
    const int64_t h = m.d_hidden;
    return v * d + layers * (d * h + h + h * d + d) + d * v + v;
  }
  if (m.kind == "llama") {
    // Per layer two RMSNorms, q/k/v/o projections without bias, gate/up/down; a final RMSNorm.
    const int64_t q = int64_t{m.n_head} * m.HeadDim(), kv = int64_t{m.KvHeads()} * m.HeadDim();
    const int64_t per_layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * m.d_hidden;
    return v * d + layers * per_layer + d + (m.tie_weights ? 0 : v * d);
  }
  // Token + position embeddings; per block two LayerNorms, qkv and output projections, a 4x MLP;
  // a final LayerNorm; the head (shares the token embedding when tied).
  const int64_t per_block =
      2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
  return v * d + int64_t{m.seq_len} * d + layers * per_block + 2 * d + (m.tie_weights ? 0 : v * d);
}

bool LoraConfig::Targets(const std::string& module) const {
  for (const std::string& t : target_modules) {
    if (t == module) return true;
  }
  return false;
}

const std::vector<std::string>& LoraTargetNames() {
  static const auto* names = new std::vector<std::string>{
      "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return *names;
}

int64_t LoraParameterCount(const ModelConfig& m, const LoraConfig& lora) {
  if (!lora.enabled() || m.kind != "llama") return 0;
  const int64_t d = m.d_model, q = int64_t{m.n_head} * m.HeadDim(),
                kv = int64_t{m.KvHeads()} * m.HeadDim(), h = m.d_hidden;
  // (in, out) of each projection.
  const std::pair<int64_t, int64_t> shapes[] = {{d, q}, {d, kv}, {d, kv}, {q, d},
                                                {d, h}, {d, h},  {h, d}};
  int64_t per_layer = 0;
  for (size_t i = 0; i < LoraTargetNames().size(); ++i) {
    if (lora.Targets(LoraTargetNames()[i]))
      per_layer += lora.r * (shapes[i].first + shapes[i].second);
  }
  return int64_t{m.n_layer} * per_layer;
}

}  // namespace trainyard
