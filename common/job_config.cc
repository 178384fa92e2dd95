// Names and the parameter count of JobConfig (see job_config.h).
#include "common/job_config.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace trainyard {

int64_t BlockParameterCount(const ModelConfig& m) {
  const int64_t d = m.d_model;
  if (m.kind == "mlp") return d * m.d_hidden + m.d_hidden + m.d_hidden * d + d;
  if (m.kind == "llama") {
    // Two RMSNorms, q/k/v/o projections (Qwen2: q/k/v with biases), gate/up/down.
    const int64_t q = int64_t{m.n_head} * m.HeadDim(), kv = int64_t{m.KvHeads()} * m.HeadDim();
    return 2 * d + d * q + 2 * d * kv + q * d + 3 * d * m.d_hidden + (m.qkv_bias ? q + 2 * kv : 0);
  }
  // Two LayerNorms, qkv and output projections, a 4x MLP.
  return 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
}

namespace {

// Parameters before the blocks (embeddings) and after them (final norm, head; the head counted
// even when tied, as a pipeline's last stage holds it).
std::pair<int64_t, int64_t> EndParameterCounts(const ModelConfig& m) {
  const int64_t d = m.d_model, v = m.vocab;
  if (m.kind == "mlp") return {v * d, d * v + v};
  if (m.kind == "llama") return {v * d, d + v * d};
  return {v * d + int64_t{m.seq_len} * d, 2 * d + v * d};
}

}  // namespace

int64_t ModelParameterCount(const ModelConfig& m) {
  const auto [embed, head] = EndParameterCounts(m);
  const int64_t tied = m.tie_weights && m.kind != "mlp" ? int64_t{m.vocab} * m.d_model : 0;
  return embed + int64_t{m.n_layer} * BlockParameterCount(m) + head - tied;
}

std::vector<int64_t> StageParameterCounts(const ModelConfig& m, const std::vector<int>& bounds) {
  const int stages = static_cast<int>(bounds.size()) - 1;
  const auto [embed, head] = EndParameterCounts(m);
  std::vector<int64_t> out;
  for (int s = 0; s < stages; ++s) {
    int64_t n = (bounds[s + 1] - bounds[s]) * BlockParameterCount(m);
    if (s == 0) n += embed;
    if (s == stages - 1) n += head;
    out.push_back(n);
  }
  // One stage holds the tied embedding once.
  if (stages == 1 && m.tie_weights && m.kind != "mlp") out[0] -= int64_t{m.vocab} * m.d_model;
  return out;
}

std::string ModelParallelMisfit(const ModelConfig& m, const ParallelConfig& p) {
  const int stages = p.pipeline_stages, tp = p.tensor_parallel, layers = m.n_layer;
  if (stages > 1 && layers > 0) {
    int64_t sum = 0;
    for (int blocks : p.pipeline_split) sum += blocks;
    if (!p.pipeline_split.empty() && sum != layers) {
      return absl::StrCat("parallel.pipeline_split: sums to ", sum, " blocks; model.n_layer is ",
                          layers);
    }
    if (p.pipeline_split.empty() && stages > layers) {
      return absl::StrCat("parallel.pipeline_stages: ", stages,
                          " stages need at least as many blocks; model.n_layer is ", layers);
    }
  }
  if (tp <= 1) return "";
  std::vector<std::pair<const char*, int64_t>> sizes = {{"model.n_head", m.n_head},
                                                        {"model.vocab", m.vocab}};
  if (m.kind == "llama") {
    sizes.push_back({"model.n_kv_head", m.KvHeads()});
    sizes.push_back({"model.d_hidden", m.d_hidden});
  }
  for (const auto& [field, value] : sizes) {
    if (value > 0 && value % tp != 0) {
      return absl::StrCat(field, ": must be a multiple of parallel.tensor_parallel (", tp,
                          "), got ", value);
    }
  }
  if (p.sequence_parallel && m.seq_len > 0 && m.seq_len % tp != 0) {
    return absl::StrCat("model.seq_len: must be a multiple of parallel.tensor_parallel (", tp,
                        ") with parallel.sequence_parallel, got ", m.seq_len);
  }
  return "";
}

std::vector<int> PipelineBoundaries(const ModelConfig& m, int stages,
                                    const std::vector<int>& split) {
  const int n = m.n_layer;
  std::vector<int> bounds = {0};
  if (!split.empty()) {
    for (int blocks : split) bounds.push_back(bounds.back() + blocks);
    return bounds;
  }
  // Contiguous stages of at least one block each, the largest stage's parameters as small as
  // can be (ties: the earlier boundary, so later stages, which hold fewer activations under
  // 1F1B, get the extra block).
  // (Plain variables: a lambda may not capture a structured binding before C++20, and clang
  // refuses it.)
  const std::pair<int64_t, int64_t> ends = EndParameterCounts(m);
  const int64_t embed = ends.first, head = ends.second;
  const int64_t block = BlockParameterCount(m);
  auto cost = [&](int stage, int begin, int end) {
    return (end - begin) * block + (stage == 0 ? embed : 0) + (stage == stages - 1 ? head : 0);
  };
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  // best[s][e]: the smallest largest stage of stages 0..s-1 covering blocks [0, e).
  std::vector<std::vector<int64_t>> best(stages + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<int>> from(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s) {
    for (int e = s; e <= n; ++e) {
      for (int b = s - 1; b < e; ++b) {
        if (best[s - 1][b] == kInf) continue;
        const int64_t v = std::max(best[s - 1][b], cost(s - 1, b, e));
        if (v < best[s][e]) {
          best[s][e] = v;
          from[s][e] = b;
        }
      }
    }
  }
  bounds.assign(stages + 1, n);
  for (int s = stages; s > 0; --s) bounds[s - 1] = from[s][bounds[s]];
  return bounds;
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

std::vector<std::vector<int64_t>> TrainedParameterShapes(const ModelConfig& m,
                                                         const LoraConfig& lora) {
  const int64_t d = m.d_model, v = m.vocab, layers = m.n_layer;
  std::vector<std::vector<int64_t>> shapes;
  auto repeat = [&](std::initializer_list<std::vector<int64_t>> per_layer) {
    for (int64_t i = 0; i < layers; ++i) shapes.insert(shapes.end(), per_layer);
  };
  if (m.kind == "llama") {
    const int64_t q = int64_t{m.n_head} * m.HeadDim(), kv = int64_t{m.KvHeads()} * m.HeadDim(),
                  h = m.d_hidden;
    // (out, in) of each projection, in LoraTargetNames' order.
    const std::pair<int64_t, int64_t> projections[] = {{q, d}, {kv, d}, {kv, d}, {d, q},
                                                       {h, d}, {h, d},  {d, h}};
    if (lora.enabled()) {
      for (int64_t i = 0; i < layers; ++i) {
        for (size_t j = 0; j < LoraTargetNames().size(); ++j) {
          if (!lora.Targets(LoraTargetNames()[j])) continue;
          shapes.push_back({lora.r, projections[j].second});  // lora_A
          shapes.push_back({projections[j].first, lora.r});   // lora_B
        }
      }
      return shapes;
    }
    shapes.push_back({v, d});
    for (int64_t i = 0; i < layers; ++i) {
      shapes.push_back({d});
      shapes.push_back({d});
      for (const auto& [out, in] : projections) shapes.push_back({out, in});
    }
    shapes.push_back({d});
    if (!m.tie_weights) shapes.push_back({v, d});
    return shapes;
  }
  if (m.kind == "mlp") {
    const int64_t h = m.d_hidden;
    shapes.push_back({v, d});
    repeat({{h, d}, {h}, {d, h}, {d}});
    shapes.insert(shapes.end(), {{v, d}, {v}});
    return shapes;
  }
  shapes.insert(shapes.end(), {{v, d}, {m.seq_len, d}});
  repeat(
      {{d}, {d}, {3 * d, d}, {3 * d}, {d, d}, {d}, {d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}});
  shapes.insert(shapes.end(), {{d}, {d}});
  if (!m.tie_weights) shapes.push_back({v, d});
  return shapes;
}

int64_t OptimizerStateBytes(OptimizerKind kind, const std::vector<std::vector<int64_t>>& shapes,
                            int64_t shards) {
  shards = std::max<int64_t>(1, shards);
  auto per_rank = [shards](int64_t n) { return (n + shards - 1) / shards; };
  // 8-bit AdamW: parameters of 4096 elements or more (bitsandbytes' min_8bit_size) keep a byte
  // per moment per element and an fp32 absmax per 256-element block of each; smaller ones fp32
  // moments. Whole parameters count their own blocks (`blocks`); under FSDP each rank holds its
  // shard's share, with a byte per moment for every element of a shard that holds part of a large
  // parameter.
  int64_t numel = 0, factored = 0, small = 0, large = 0, blocks = 0;
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    if (n == 0) continue;  // sizes not known yet (a checkpoint's, read by the trainer)
    numel += n;
    factored += shape.size() >= 2 ? n / shape.back() + n / shape[shape.size() - 2] : n;
    (n >= 4096 ? large : small) += n;
    if (n >= 4096) blocks += (n + 255) / 256;
  }
  switch (kind) {
    case OptimizerKind::kAdamW:
      return 8 * per_rank(numel);
    case OptimizerKind::kLion:
      return 4 * per_rank(numel);
    case OptimizerKind::kAdafactor:
      return 4 * factored;  // replicated, not sharded
    case OptimizerKind::kAdamW8bit:
      if (shards == 1) return 2 * large + 8 * blocks + 8 * small;
      return (large > 0 ? 2 * per_rank(numel) : 0) + 8 * per_rank(small) +
             8 * per_rank((large + 255) / 256);
  }
  return 0;
}

}  // namespace trainyard
