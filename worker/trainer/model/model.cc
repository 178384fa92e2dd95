// GptModel, MlpModel and the activation-checkpointing autograd function (see model.h).
#include "worker/trainer/model/model.h"

#include <c10/core/CPUAllocator.h>

#include <cmath>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "worker/trainer/kernels/onednn_matmul.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

namespace F = torch::nn::functional;

// y = x W^T + b, in bf16 when asked (autograd casts the gradients back to fp32); fp32 on oneDNN.
// On a GPU the product's precision is autocast's (AutocastScope), so `bf16` is not looked at.
torch::Tensor Dense(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                    bool bf16) {
  if (!bf16 || x.is_cuda()) return Linear(x, weight, bias);
  const auto b16 = torch::kBFloat16;
  return torch::linear(x.to(b16), weight.to(b16), bias.defined() ? bias.to(b16) : bias)
      .to(torch::kFloat);
}

torch::Tensor Dense(const torch::Tensor& x, torch::nn::Linear& linear, bool bf16) {
  return Dense(x, linear->weight, linear->bias, bf16);
}

// A LoRA adapter's matrix: a module of its own so that it is named "lora_A.weight" /
// "lora_B.weight" under its projection, as in PEFT's state dicts.
class LoraWeightImpl : public torch::nn::Module {
 public:
  LoraWeightImpl(int64_t out, int64_t in)
      : weight(register_parameter("weight", torch::zeros({out, in}))) {}
  torch::Tensor weight;
};
TORCH_MODULE(LoraWeight);

// The adapter of one projection; empty when LoRA does not target it.
struct Adapter {
  LoraWeight a{nullptr}, b{nullptr};
  double scale = 0, dropout = 0;
};

// The projection's output, plus (alpha / r) * B(A(dropout(x))) when it has an adapter (PEFT's
// LoRA Linear forward).
torch::Tensor Project(const torch::Tensor& x, torch::nn::Linear& linear, const Adapter& adapter,
                      bool bf16, bool training) {
  torch::Tensor y = Dense(x, linear, bf16);
  if (adapter.a.is_empty()) return y;
  const torch::Tensor in =
      adapter.dropout > 0 && training
          ? F::dropout(x, F::DropoutFuncOptions().p(adapter.dropout).training(true))
          : x;
  const torch::Tensor low = Dense(in, adapter.a->weight, torch::Tensor(), bf16);
  return y + Dense(low, adapter.b->weight, torch::Tensor(), bf16) * adapter.scale;
}

// sum_i weights_i * cross_entropy(logits_i, targets_i) over every leading position.
torch::Tensor WeightedCrossEntropySum(const torch::Tensor& logits, const torch::Tensor& targets,
                                      const torch::Tensor& weights) {
  const torch::Tensor each =
      F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                       F::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (each * weights.reshape({-1})).sum();
}

// A freshly built module, its parameters' storage freed unless options.materialize.
template <typename M>
M Keep(M module, const ModelOptions& options) {
  if (!options.materialize) {
    for (const auto& p : module->parameters()) FreeStorage(p);
  }
  return module;
}

// Tensor parallelism: the input of column-parallel layers (f) and the sum of row-parallel ones (g,
// then the bias once); identities without it.
torch::Tensor ColumnInput(const torch::Tensor& x, const TensorParallel& tp) {
  return tp.on() ? CopyToTensorParallel(x, tp) : x;
}
torch::Tensor RowOutput(const torch::Tensor& x, torch::nn::Linear& linear, bool bf16,
                        const TensorParallel& tp) {
  if (!tp.on()) return Dense(x, linear, bf16);
  torch::Tensor y = ReduceFromTensorParallel(Dense(x, linear->weight, torch::Tensor(), bf16), tp);
  return linear->bias.defined() ? y + linear->bias : y;
}

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t n_head, bool bf16, const TensorParallel* tp)
      : n_head_(n_head),
        bf16_(bf16),
        tp_(tp),
        ln1_(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        qkv_(register_module("qkv", torch::nn::Linear(d_model, 3 * d_model))),
        proj_(register_module("proj", torch::nn::Linear(d_model, d_model))),
        ln2_(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        fc_(register_module("fc", torch::nn::Linear(d_model, 4 * d_model))),
        fc_out_(register_module("fc_out", torch::nn::Linear(4 * d_model, d_model))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = x + Attention(ln1_(x));
    return h +
           RowOutput(F::gelu(Dense(ColumnInput(ln2_(h), *tp_), fc_, bf16_)), fc_out_, bf16_, *tp_);
  }

 private:
  torch::Tensor Attention(const torch::Tensor& in) {
    // Tensor parallelism: this rank's heads.
    const int64_t heads = n_head_ / tp_->size;
    // Sequence parallelism: `in` is this rank's part of the sequence, x the whole of it.
    const torch::Tensor x = ColumnInput(in, *tp_);
    const int64_t b = x.size(0), t = x.size(1), hd = x.size(2) / n_head_, d = heads * hd;
    // unbind, not qkv[i]: its backward stacks the three gradients in one pass, where three
    // selects would each zero a buffer of all three and then add them up.
    const std::vector<torch::Tensor> qkv =
        Dense(x, qkv_, bf16_).view({b, t, 3, heads, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
#if TRAINYARD_TORCH2
    if (x.is_cuda()) {
      // On the GPU: fused causal attention (flash or memory-efficient kernels; [b, h, t, hd]).
      const torch::Tensor y =
          at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], {}, 0.0, /*is_causal=*/true);
      return RowOutput(y.transpose(1, 2).reshape({b, t, d}), proj_, bf16_, *tp_);
    }
#endif
    // [b * h, t, hd] each
    torch::Tensor q = qkv[0].reshape({b * heads, t, hd}), k = qkv[1].reshape({b * heads, t, hd}),
                  v = qkv[2].reshape({b * heads, t, hd});
    // Causal attention in two query blocks: the first half of the queries attends to the first
    // half of the keys only, so the upper-right quarter of the scores (all masked) is neither
    // computed nor softmaxed, forward or backward: a quarter less attention work than one
    // masked [t, t] product. Within a block, softmax(q k^T / sqrt(hd) + mask) takes one batched
    // GEMM: the scale is its alpha and the mask (0, or -inf above the diagonal) its C.
    const torch::Tensor mask = torch::full({t, t}, -std::numeric_limits<float>::infinity(),
                                           x.options().requires_grad(false))
                                   .triu(1);
    const double scale = 1.0 / std::sqrt(double(hd));
    const int64_t half = t >= 32 ? t / 2 : t;
    std::vector<torch::Tensor> blocks;  // [b, rows, h, hd] each, rows of the output in order
    for (int64_t row = 0; row < t; row += half) {
      const int64_t rows = std::min(half, t - row), keys = row + rows;
      torch::Tensor scores =
          BatchedMatmul(q.narrow(1, row, rows), k.narrow(1, 0, keys).transpose(1, 2), scale,
                        mask.slice(0, row, keys).slice(1, 0, keys));
      torch::Tensor y =
          BatchedMatmul(torch::softmax(scores, -1), v.narrow(1, 0, keys), 1.0, torch::Tensor());
      blocks.push_back(y.view({b, heads, rows, hd}).transpose(1, 2));
    }
    // One copy puts the blocks side by side as [b, t, h * hd].
    torch::Tensor y = torch::cat(blocks, 1).view({b, t, d});
    return RowOutput(y, proj_, bf16_, *tp_);
  }

  int64_t n_head_;
  bool bf16_;
  const TensorParallel* tp_;
  torch::nn::LayerNorm ln1_;
  torch::nn::Linear qkv_, proj_;
  torch::nn::LayerNorm ln2_;
  torch::nn::Linear fc_, fc_out_;
};
TORCH_MODULE(Block);

// Reentrant activation checkpointing (as torch.utils.checkpoint with use_reentrant=True): forward
// runs the block without recording a graph and saves only its input; backward recomputes the block
// with grad enabled and backpropagates the incoming gradient through it, which accumulates the
// block's parameter gradients (firing their hooks, so DDP buckets see them) and yields the input's.
// With `preserve_rng` (a block with dropout) the CPU generator is set back to its state at forward
// for the recompute (preserve_rng_state), so dropout draws the same masks.
class CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               LanguageModel* model, int64_t block, bool preserve_rng) {
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    ctx->saved_data["block"] = block;
    // The recompute runs in backward, outside the forward's autocast: it takes the same one.
    ctx->saved_data["autocast"] = static_cast<int64_t>(AutocastScope::ActivePrecision());
    if (preserve_rng) ctx->saved_data["rng"] = at::detail::getDefaultCPUGenerator().get_state();
    ctx->save_for_backward({x});
    torch::NoGradGuard no_grad;  // apply() already disables grad; stated for the reader
    return model->BlockForward(static_cast<int>(block), x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto* model = reinterpret_cast<LanguageModel*>(ctx->saved_data["model"].toInt());
    const int block = static_cast<int>(ctx->saved_data["block"].toInt());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      const bool preserve_rng = ctx->saved_data.count("rng") > 0;
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      torch::Tensor now;
      if (preserve_rng) {
        now = generator.get_state();
        generator.set_state(ctx->saved_data["rng"].toTensor());
      }
      torch::AutoGradMode enable(true);
      AutocastScope autocast(x.device(),
                             static_cast<Precision>(ctx->saved_data["autocast"].toInt()));
      y = model->BlockForward(block, x);
      if (preserve_rng) generator.set_state(now);
    }
    torch::autograd::backward({y}, {grad_outputs[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

class GptModel : public LanguageModel {
 public:
  GptModel(const ModelConfig& spec, const ModelOptions& options)
      : LanguageModel(spec.seq_len, options.activation_checkpointing),
        options_(options),
        tie_weights_(spec.tie_weights),
        d_model_(spec.d_model) {
    const int64_t d = spec.d_model, v = spec.vocab;
    tok_emb_ = register_module("tok_emb", Keep(torch::nn::Embedding(v, d), options));
    pos_emb_ = register_module("pos_emb", Keep(torch::nn::Embedding(spec.seq_len, d), options));
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < spec.n_layer; ++i) {
      blocks_->push_back(Keep(Block(d, spec.n_head, options.bf16, &tp_), options));
    }
    ln_f_ = register_module("ln_f",
                            Keep(torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})), options));
    if (!tie_weights_) {
      head_ = register_module(
          "head", Keep(torch::nn::Linear(torch::nn::LinearOptions(d, v).bias(false)), options));
    }
  }

  int NumBlocks() const override { return static_cast<int>(blocks_->size()); }

  // "blocks.<i>.<...>"
  int BlockOf(const std::string& name) const override {
    absl::string_view rest = name;
    int block = -1;
    if (!absl::ConsumePrefix(&rest, "blocks.")) return -1;
    const std::vector<absl::string_view> parts = absl::StrSplit(rest, absl::MaxSplits('.', 1));
    return absl::SimpleAtoi(parts[0], &block) ? block : -1;
  }

  bool IsEmbedding(const std::string& name) const override {
    return absl::StartsWith(name, "tok_emb.") || absl::StartsWith(name, "pos_emb.");
  }
  std::string TiedWeight() const override { return tie_weights_ ? "tok_emb.weight" : ""; }

  // Heads (q, k and v each), the MLP's hidden units and the vocabulary are split; the output
  // projections are row-parallel.
  TensorParallelSplit TensorParallelSplitOf(const std::string& name) const override {
    if (name == "tok_emb.weight" || name == "head.weight") return {0, 1};
    if (BlockOf(name) < 0) return {};
    if (absl::EndsWith(name, ".qkv.weight") || absl::EndsWith(name, ".qkv.bias")) return {0, 3};
    if (absl::EndsWith(name, ".fc.weight") || absl::EndsWith(name, ".fc.bias")) return {0, 1};
    if (absl::EndsWith(name, ".proj.weight") || absl::EndsWith(name, ".fc_out.weight")) {
      return {1, 1};
    }
    return {};
  }

  torch::Tensor Embed(const torch::Tensor& inputs) override {
    const torch::Tensor tokens =
        tp_.on() ? VocabParallelEmbedding(inputs, tok_emb_->weight, tp_) : tok_emb_(inputs);
    // Sequence parallelism: this rank's part of the sequence.
    const int64_t t = tokens.size(1), first = tp_.sequence ? tp_.rank * t : 0;
    return tokens + pos_emb_(torch::arange(first, first + t, inputs.options().dtype(torch::kLong)));
  }
  torch::Tensor BlockForward(int i, const torch::Tensor& x) override {
    return (*blocks_)[i]->as<BlockImpl>()->forward(x);
  }
  torch::Tensor Head(const torch::Tensor& h) override {
    const torch::Tensor x = ColumnInput(ln_f_(h), tp_);
    return tie_weights_ ? Dense(x, tok_emb_->weight, torch::Tensor(), options_.bf16)
                        : Dense(x, head_, options_.bf16);
  }
  std::vector<int64_t> HiddenShape(int64_t batch) const override {
    return {batch, tp_.sequence ? seq_len_ / tp_.size : seq_len_, d_model_};
  }

 private:
  ModelOptions options_;
  bool tie_weights_;
  int64_t d_model_;
  torch::nn::Embedding tok_emb_{nullptr}, pos_emb_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};

class MlpModel : public LanguageModel {
 public:
  MlpModel(const ModelConfig& spec, const ModelOptions& options)
      : LanguageModel(spec.seq_len, options.activation_checkpointing),
        options_(options),
        d_model_(spec.d_model) {
    const int64_t d = spec.d_model, v = spec.vocab, h = spec.d_hidden;
    tok_emb_ = register_module("tok_emb", Keep(torch::nn::Embedding(v, d), options));
    for (int i = 0; i < spec.n_layer; ++i) {
      up_.push_back(
          register_module("up" + std::to_string(i), Keep(torch::nn::Linear(d, h), options)));
      down_.push_back(
          register_module("down" + std::to_string(i), Keep(torch::nn::Linear(h, d), options)));
    }
    head_ = register_module("head", Keep(torch::nn::Linear(d, v), options));
  }

  int NumBlocks() const override { return static_cast<int>(up_.size()); }

  // "up<i>.<...>" and "down<i>.<...>": residual block i.
  int BlockOf(const std::string& name) const override {
    absl::string_view rest = name;
    if (!absl::ConsumePrefix(&rest, "up") && !absl::ConsumePrefix(&rest, "down")) return -1;
    const std::vector<absl::string_view> parts = absl::StrSplit(rest, absl::MaxSplits('.', 1));
    int block = -1;
    return absl::SimpleAtoi(parts[0], &block) ? block : -1;
  }

  bool IsEmbedding(const std::string& name) const override {
    return absl::StartsWith(name, "tok_emb.");
  }

  // The mean of the context's token embeddings ([b, d]).
  torch::Tensor Embed(const torch::Tensor& contexts) override { return tok_emb_(contexts).mean(1); }
  torch::Tensor BlockForward(int i, const torch::Tensor& x) override {
    return x + Dense(F::gelu(Dense(x, up_[i], options_.bf16)), down_[i], options_.bf16);
  }
  torch::Tensor Head(const torch::Tensor& x) override { return Dense(x, head_, options_.bf16); }
  std::vector<int64_t> HiddenShape(int64_t batch) const override { return {batch, d_model_}; }

 protected:
  bool PredictsLastTokenOnly() const override { return true; }

 private:
  ModelOptions options_;
  int64_t d_model_;
  torch::nn::Embedding tok_emb_{nullptr};
  std::vector<torch::nn::Linear> up_, down_;
  torch::nn::Linear head_{nullptr};
};

// Rotary position embeddings as transformers' LlamaRotaryEmbedding computes them: inverse
// frequencies theta^(-2i/head_dim) (rescaled for linear, dynamic or llama3 rope_scaling), and cos
// and sin of position * frequency, each frequency twice ([t, head_dim]); cached per length.
class Rope {
 public:
  explicit Rope(const ModelConfig& m) : m_(m), dim_(m.HeadDim()) {}

  // cos and sin for positions 0..t-1.
  // cos and sin for positions 0..t-1, on `device` (computed on the CPU, as transformers does
  // in fp32).
  std::pair<torch::Tensor, torch::Tensor> CosSin(int64_t t, const torch::Device& device) {
    auto it = cache_.find(t);
    if (it != cache_.end() && it->second.first.device() == device) return it->second;
    torch::NoGradGuard no_grad;
    torch::Tensor inv_freq = InverseFrequencies(t);
    torch::Tensor freqs = torch::outer(torch::arange(t, torch::kFloat), inv_freq);
    torch::Tensor emb = torch::cat({freqs, freqs}, -1);
    return cache_[t] = std::make_pair(emb.cos().to(device), emb.sin().to(device));
  }

 private:
  torch::Tensor Default(double base) const {
    return 1.0 / torch::pow(base, torch::arange(0, dim_, 2, torch::kLong).to(torch::kFloat) /
                                      static_cast<double>(dim_));
  }

  torch::Tensor InverseFrequencies(int64_t t) const {
    const double factor = m_.rope_factor;
    if (m_.rope_scaling == "linear") return Default(m_.rope_theta) / factor;
    if (m_.rope_scaling == "dynamic") {
      // NTK-aware: the base grows once a sequence is longer than max_position_embeddings.
      const double max_pos = static_cast<double>(m_.max_position_embeddings);
      if (max_pos <= 0 || t <= max_pos) return Default(m_.rope_theta);
      const double base = m_.rope_theta * std::pow(factor * t / max_pos - (factor - 1),
                                                   double(dim_) / double(dim_ - 2));
      return Default(base);
    }
    torch::Tensor inv_freq = Default(m_.rope_theta);
    if (m_.rope_scaling != "llama3") return inv_freq;
    // Llama 3.1: long wavelengths divided by the factor, short ones kept, a blend in between.
    const double old_len = static_cast<double>(m_.rope_original_max_position);
    const double low = m_.rope_low_freq_factor, high = m_.rope_high_freq_factor;
    const double low_wavelen = old_len / low, high_wavelen = old_len / high;
    torch::Tensor wavelen = 2 * M_PI / inv_freq;
    torch::Tensor scaled = torch::where(wavelen > low_wavelen, inv_freq / factor, inv_freq);
    torch::Tensor smooth = (old_len / wavelen - low) / (high - low);
    torch::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    torch::Tensor medium = wavelen.ge(high_wavelen).logical_and(wavelen.le(low_wavelen));
    return torch::where(medium, smoothed, scaled);
  }

  ModelConfig m_;
  int64_t dim_;
  std::map<int64_t, std::pair<torch::Tensor, torch::Tensor>> cache_;
};

// x * rsqrt(mean(x^2) + eps) * weight, in fp32 (as transformers' LlamaRMSNorm).
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t d, double eps)
      : eps_(eps), weight(register_parameter("weight", torch::ones({d}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return weight * (x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_));
  }

 private:
  double eps_;

 public:
  torch::Tensor weight;
};
TORCH_MODULE(RmsNorm);

// [.., d] -> [.., d] with its halves swapped and the new first half negated.
torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::nn::Linear NoBias(int64_t in, int64_t out, const ModelOptions& options) {
  return Keep(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)), options);
}

// Registers the adapter of projection `name` under it when LoRA targets it (uninitialized: see
// InitializeLora).
Adapter Attach(torch::nn::Linear& projection, const std::string& name,
               const ModelOptions& options) {
  Adapter adapter;
  if (!options.lora.enabled() || !options.lora.Targets(name)) return adapter;
  const int64_t out = projection->weight.size(0), in = projection->weight.size(1),
                r = options.lora.r;
  adapter.a = projection->register_module("lora_A", Keep(LoraWeight(r, in), options));
  adapter.b = projection->register_module("lora_B", Keep(LoraWeight(out, r), options));
  adapter.scale = options.lora.scale();
  adapter.dropout = options.lora.dropout;
  return adapter;
}

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const ModelConfig& m, const ModelOptions& options, const TensorParallel* tp)
      : heads_(m.n_head),
        kv_heads_(m.KvHeads()),
        head_dim_(m.HeadDim()),
        bf16_(options.bf16),
        tp_(tp) {
    const int64_t d = m.d_model;
    q_proj = register_module("q_proj", NoBias(d, heads_ * head_dim_, options));
    k_proj = register_module("k_proj", NoBias(d, kv_heads_ * head_dim_, options));
    v_proj = register_module("v_proj", NoBias(d, kv_heads_ * head_dim_, options));
    o_proj = register_module("o_proj", NoBias(heads_ * head_dim_, d, options));
    q_lora_ = Attach(q_proj, "q_proj", options);
    k_lora_ = Attach(k_proj, "k_proj", options);
    v_lora_ = Attach(v_proj, "v_proj", options);
    o_lora_ = Attach(o_proj, "o_proj", options);
  }

  torch::Tensor forward(const torch::Tensor& in, const torch::Tensor& cos,
                        const torch::Tensor& sin) {
    // Tensor parallelism: this rank's query heads and their key-value heads.
    const int64_t heads = heads_ / tp_->size, kv_heads = kv_heads_ / tp_->size;
    const torch::Tensor x = ColumnInput(in, *tp_);  // the whole sequence
    const int64_t b = x.size(0), t = x.size(1), hd = head_dim_, rep = heads / kv_heads;
    // [b, heads, t, hd], rotated
    auto heads_of = [&](torch::nn::Linear& proj, const Adapter& lora, int64_t n) {
      return Project(x, proj, lora, bf16_, is_training()).view({b, t, n, hd}).transpose(1, 2);
    };
    torch::Tensor q = heads_of(q_proj, q_lora_, heads), k = heads_of(k_proj, k_lora_, kv_heads),
                  v = heads_of(v_proj, v_lora_, kv_heads);
    q = q * cos + RotateHalf(q) * sin;
    k = k * cos + RotateHalf(k) * sin;
#if TRAINYARD_TORCH2
    if (x.is_cuda()) {
      // On the GPU: fused causal attention, grouped-query heads shared inside the kernel.
      torch::Tensor y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true,
                                                         std::nullopt, /*enable_gqa=*/rep > 1);
      y = y.transpose(1, 2).reshape({b, t, heads * hd});
      if (tp_->on()) return RowOutput(y, o_proj, bf16_, *tp_);
      return Project(y, o_proj, o_lora_, bf16_, is_training());
    }
#endif
    // Grouped-query attention: each key-value head serves `rep` query heads.
    auto expand = [&](const torch::Tensor& kv) {
      if (rep == 1) return kv.reshape({b * heads, t, hd});
      return kv.unsqueeze(2).expand({b, kv_heads, rep, t, hd}).reshape({b * heads, t, hd});
    };
    const torch::Tensor mask = torch::full({t, t}, -std::numeric_limits<float>::infinity(),
                                           x.options().requires_grad(false))
                                   .triu(1);
    torch::Tensor scores = BatchedMatmul(q.reshape({b * heads, t, hd}), expand(k).transpose(1, 2),
                                         1.0 / std::sqrt(double(hd)), mask);
    torch::Tensor y = BatchedMatmul(torch::softmax(scores, -1), expand(v), 1.0, torch::Tensor());
    y = y.view({b, heads, t, hd}).transpose(1, 2).reshape({b, t, heads * hd});
    if (tp_->on()) return RowOutput(y, o_proj, bf16_, *tp_);  // no LoRA under it
    return Project(y, o_proj, o_lora_, bf16_, is_training());
  }

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  Adapter q_lora_, k_lora_, v_lora_, o_lora_;
  int64_t heads_, kv_heads_, head_dim_;
  bool bf16_;
  const TensorParallel* tp_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMlpImpl : public torch::nn::Module {
 public:
  LlamaMlpImpl(const ModelConfig& m, const ModelOptions& options, const TensorParallel* tp)
      : bf16_(options.bf16), tp_(tp) {
    gate_proj = register_module("gate_proj", NoBias(m.d_model, m.d_hidden, options));
    up_proj = register_module("up_proj", NoBias(m.d_model, m.d_hidden, options));
    down_proj = register_module("down_proj", NoBias(m.d_hidden, m.d_model, options));
    gate_lora_ = Attach(gate_proj, "gate_proj", options);
    up_lora_ = Attach(up_proj, "up_proj", options);
    down_lora_ = Attach(down_proj, "down_proj", options);
  }
  torch::Tensor forward(const torch::Tensor& in) {
    const bool training = is_training();
    const torch::Tensor x = ColumnInput(in, *tp_);
    const torch::Tensor hidden = F::silu(Project(x, gate_proj, gate_lora_, bf16_, training)) *
                                 Project(x, up_proj, up_lora_, bf16_, training);
    if (tp_->on()) return RowOutput(hidden, down_proj, bf16_, *tp_);  // no LoRA under it
    return Project(hidden, down_proj, down_lora_, bf16_, training);
  }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  Adapter gate_lora_, up_lora_, down_lora_;
  bool bf16_;
  const TensorParallel* tp_;
};
TORCH_MODULE(LlamaMlp);

class LlamaLayerImpl : public torch::nn::Module {
 public:
  LlamaLayerImpl(const ModelConfig& m, const ModelOptions& options, Rope* rope,
                 const TensorParallel* tp)
      : rope_(rope), tp_(tp) {
    self_attn = register_module("self_attn", LlamaAttention(m, options, tp));
    mlp = register_module("mlp", LlamaMlp(m, options, tp));
    input_layernorm =
        register_module("input_layernorm", Keep(RmsNorm(m.d_model, m.rms_norm_eps), options));
    post_attention_layernorm = register_module("post_attention_layernorm",
                                               Keep(RmsNorm(m.d_model, m.rms_norm_eps), options));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    // Sequence parallelism: x is this rank's part; attention sees the whole sequence.
    const auto [cos, sin] = rope_->CosSin(x.size(1) * (tp_->sequence ? tp_->size : 1), x.device());
    torch::Tensor h = x + self_attn(input_layernorm(x), cos, sin);
    return h + mlp(post_attention_layernorm(h));
  }
  LlamaAttention self_attn{nullptr};
  LlamaMlp mlp{nullptr};
  RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};

 private:
  Rope* rope_;
  const TensorParallel* tp_;
};
TORCH_MODULE(LlamaLayer);

// transformers' LlamaModel: its parameters are named as in a LlamaForCausalLM's state dict.
class LlamaBodyImpl : public torch::nn::Module {
 public:
  LlamaBodyImpl(const ModelConfig& m, const ModelOptions& options, Rope* rope,
                const TensorParallel* tp) {
    embed_tokens =
        register_module("embed_tokens", Keep(torch::nn::Embedding(m.vocab, m.d_model), options));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < m.n_layer; ++i) layers->push_back(LlamaLayer(m, options, rope, tp));
    norm = register_module("norm", Keep(RmsNorm(m.d_model, m.rms_norm_eps), options));
  }
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RmsNorm norm{nullptr};
};
TORCH_MODULE(LlamaBody);

class LlamaModel : public LanguageModel {
 public:
  LlamaModel(const ModelConfig& spec, const ModelOptions& options)
      : LanguageModel(spec.seq_len, options.activation_checkpointing),
        options_(options),
        tie_weights_(spec.tie_weights),
        d_model_(spec.d_model),
        rope_(spec) {
    model_ = register_module("model", LlamaBody(spec, options, &rope_, &tp_));
    if (!tie_weights_)
      lm_head_ = register_module("lm_head", NoBias(spec.d_model, spec.vocab, options));
  }

  int NumBlocks() const override { return static_cast<int>(model_->layers->size()); }

  // "model.layers.<i>.<...>"
  int BlockOf(const std::string& name) const override {
    absl::string_view rest = name;
    if (!absl::ConsumePrefix(&rest, "model.layers.")) return -1;
    const std::vector<absl::string_view> parts = absl::StrSplit(rest, absl::MaxSplits('.', 1));
    int block = -1;
    return absl::SimpleAtoi(parts[0], &block) ? block : -1;
  }

  bool IsEmbedding(const std::string& name) const override {
    return absl::StartsWith(name, "model.embed_tokens.");
  }
  std::string TiedWeight() const override {
    return tie_weights_ ? "model.embed_tokens.weight" : "";
  }

  // Query and key-value heads, the MLP's hidden units and the vocabulary are split; o_proj and
  // down_proj are row-parallel.
  TensorParallelSplit TensorParallelSplitOf(const std::string& name) const override {
    if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return {0, 1};
    if (BlockOf(name) < 0 || absl::StrContains(name, "layernorm")) return {};
    if (absl::EndsWith(name, "o_proj.weight") || absl::EndsWith(name, "down_proj.weight")) {
      return {1, 1};
    }
    return {0, 1};  // q, k, v, gate and up
  }

  torch::Tensor Embed(const torch::Tensor& inputs) override {
    return tp_.on() ? VocabParallelEmbedding(inputs, model_->embed_tokens->weight, tp_)
                    : model_->embed_tokens(inputs);
  }
  torch::Tensor BlockForward(int i, const torch::Tensor& x) override {
    return (*model_->layers)[i]->as<LlamaLayerImpl>()->forward(x);
  }
  torch::Tensor Head(const torch::Tensor& h) override {
    const torch::Tensor x = ColumnInput(model_->norm(h), tp_);
    return tie_weights_ ? Dense(x, model_->embed_tokens->weight, torch::Tensor(), options_.bf16)
                        : Dense(x, lm_head_, options_.bf16);
  }
  std::vector<int64_t> HiddenShape(int64_t batch) const override {
    return {batch, tp_.sequence ? seq_len_ / tp_.size : seq_len_, d_model_};
  }

 protected:
  bool BlockUsesRng() const override { return options_.lora.dropout > 0; }

 private:
  ModelOptions options_;
  bool tie_weights_;
  int64_t d_model_;
  Rope rope_;
  LlamaBody model_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
};

// GPT-2 style initialization, in registration order so it depends on the seed only.
void Initialize(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& module : model.modules(/*include_self=*/false)) {
    if (auto* linear = module->as<torch::nn::LinearImpl>()) {
      linear->weight.normal_(0.0, 0.02);
      if (linear->bias.defined()) linear->bias.zero_();
    } else if (auto* embedding = module->as<torch::nn::EmbeddingImpl>()) {
      embedding->weight.normal_(0.0, 0.02);
    } else if (auto* norm = module->as<torch::nn::LayerNormImpl>()) {
      norm->weight.fill_(1.0);
      norm->bias.zero_();
    } else if (auto* rms = module->as<RmsNormImpl>()) {
      rms->weight.fill_(1.0);
    }
  }
}

// PEFT's init_lora_weights=True: A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with a =
// sqrt(5), as torch.nn.Linear), B = 0. From a generator of its own, so that the base weights are
// the same with LoRA as without.
void InitializeLora(torch::nn::Module& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x4c6f5241);  // "LoRA"
  for (const auto& item : model.named_modules()) {
    auto* weight = item.value()->as<LoraWeightImpl>();
    if (weight == nullptr) continue;
    if (absl::EndsWith(item.key(), "lora_A")) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(weight->weight.size(1)));
      weight->weight.uniform_(-bound, bound, generator);
    } else {
      weight->weight.zero_();
    }
  }
}

}  // namespace

torch::Tensor LanguageModel::RunBlock(int i, torch::Tensor x) {
  const bool checkpoint = activation_checkpointing_ && torch::GradMode::is_enabled();
  // A frozen embedding (LoRA) gives an input that needs no gradient, and a checkpointed block
  // whose inputs need none records no backward, so its adapters would never learn (what
  // transformers' enable_input_require_grads is for).
  if (checkpoint && !x.requires_grad()) x.requires_grad_(true);
  if (hooks_ != nullptr) hooks_->BeforeBlock(i);
  x = checkpoint ? CheckpointedBlock::apply(x, this, int64_t{i}, BlockUsesRng())
                 : BlockForward(i, x);
  if (hooks_ != nullptr) hooks_->AfterBlock(i, x);
  return x;
}

torch::Tensor LanguageModel::Logits(const torch::Tensor& inputs) {
  torch::Tensor x = Embed(inputs);
  for (int i = 0; i < NumBlocks(); ++i) x = RunBlock(i, x);
  return Head(x);
}

torch::Tensor LanguageModel::LossOf(const torch::Tensor& logits,
                                    const torch::Tensor& windows) const {
  const int64_t t = windows.size(1) - 1;
  if (PredictsLastTokenOnly()) return F::cross_entropy(logits, windows.select(1, t));
  if (tp_.on()) {
    return VocabParallelCrossEntropy(logits.reshape({-1, logits.size(-1)}),
                                     windows.narrow(1, 1, t).reshape({-1}), tp_)
        .mean();
  }
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                          windows.narrow(1, 1, t).reshape({-1}));
}

torch::Tensor LanguageModel::MaskedLossSumOf(const torch::Tensor& logits,
                                             const torch::Tensor& windows,
                                             const torch::Tensor& weights) const {
  const int64_t t = windows.size(1) - 1;
  if (PredictsLastTokenOnly()) {
    return WeightedCrossEntropySum(logits, windows.select(1, t), weights.select(1, t - 1));
  }
  if (tp_.on()) {
    return (VocabParallelCrossEntropy(logits.reshape({-1, logits.size(-1)}),
                                      windows.narrow(1, 1, t).reshape({-1}), tp_) *
            weights.reshape({-1}))
        .sum();
  }
  return WeightedCrossEntropySum(logits, windows.narrow(1, 1, t), weights);
}

torch::Tensor LanguageModel::Loss(const torch::Tensor& windows) {
  return LossOf(Logits(windows.narrow(1, 0, windows.size(1) - 1)), windows);
}

torch::Tensor LanguageModel::MaskedLossSum(const torch::Tensor& windows,
                                           const torch::Tensor& weights) {
  return MaskedLossSumOf(Logits(windows.narrow(1, 0, windows.size(1) - 1)), windows, weights);
}

torch::Tensor LanguageModel::NextTokenLogits(const torch::Tensor& context) {
  TORCH_CHECK(!tp_.on(), "NextTokenLogits: the parameters are tensor-parallel shards");
  const int64_t t = std::min<int64_t>(context.size(1), seq_len_);
  const torch::Tensor logits = Logits(context.narrow(1, context.size(1) - t, t));
  return PredictsLastTokenOnly() ? logits.squeeze(0) : logits.select(1, t - 1).squeeze(0);
}

bool IsLoraParameter(const std::string& name) {
  return absl::StrContains(name, ".lora_A.") || absl::StrContains(name, ".lora_B.");
}

std::shared_ptr<LanguageModel> BuildModel(const ModelConfig& spec, const ModelOptions& options,
                                          uint64_t seed) {
  torch::manual_seed(seed);
  std::shared_ptr<LanguageModel> model;
  if (spec.kind == "mlp") {
    model = std::make_shared<MlpModel>(spec, options);
  } else if (spec.kind == "llama") {
    model = std::make_shared<LlamaModel>(spec, options);
  } else {
    model = std::make_shared<GptModel>(spec, options);
  }
  if (options.materialize) Initialize(*model);
  if (options.lora.enabled()) {
    if (options.materialize) InitializeLora(*model, seed);
    for (const auto& item : model->named_parameters()) {
      if (!IsLoraParameter(item.key())) item.value().set_requires_grad(false);
    }
  }
  return model;
}

void FreeStorage(const torch::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

void AllocateStorage(const torch::Tensor& t, int64_t bytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::GetAllocator(t.device().type())->allocate(bytes));
  storage->set_nbytes(bytes);
}

std::vector<int64_t> Generate(LanguageModel& model, const std::vector<int64_t>& prompt, int length,
                              double temperature, uint64_t seed, int64_t seq_len) {
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Device device = model.parameters().at(0).device();
  std::vector<int64_t> tokens = prompt;
  std::vector<int64_t> out;
  for (int i = 0; i < length; ++i) {
    const int64_t t = std::min<int64_t>(static_cast<int64_t>(tokens.size()), seq_len);
    torch::Tensor context =
        torch::tensor(std::vector<int64_t>(tokens.end() - t, tokens.end()), torch::kLong)
            .unsqueeze(0)
            .to(device);
    // Sampled on the CPU, from its generator: the same text on every device.
    torch::Tensor probs = torch::softmax(
        model.NextTokenLogits(context).to(torch::kCPU, torch::kFloat) / temperature, -1);
    const int64_t next = torch::multinomial(probs, 1, false, generator).item<int64_t>();
    tokens.push_back(next);
    out.push_back(next);
  }
  return out;
}

std::vector<torch::Tensor> TrainableParameters(torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& p : model.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

}  // namespace trainyard::trainer
