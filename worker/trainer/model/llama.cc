// Llama as transformers' LlamaForCausalLM: RoPE (with rope_scaling), RMSNorm, grouped-query
// attention, a gated MLP (SwiGLU, or GELU or ReLU by hidden_act); LoRA adapters on its projections
// (see model.h). The same with Mistral's sliding window (MistralForCausalLM) and Qwen2's q/k/v
// biases (Qwen2ForCausalLM).
#include "worker/trainer/model/layers.h"

#include <cmath>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "worker/trainer/kernels/rotary.h"
#include "worker/trainer/kernels/split_heads.h"
#include "worker/trainer/kernels/swiglu.h"

namespace trainyard::trainer {
namespace {

namespace F = torch::nn::functional;

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

// The attention mask of `t` positions: 0 where query i may see key j (j <= i, and i - j < window
// when window > 0), -inf elsewhere; as transformers' causal mask with Mistral's sliding window.
torch::Tensor CausalMask(int64_t t, int64_t window, const torch::TensorOptions& options) {
  const float inf = std::numeric_limits<float>::infinity();
  torch::Tensor mask = torch::full({t, t}, -inf, options.requires_grad(false)).triu(1);
  if (window > 0 && t > window) {
    mask = mask + torch::full({t, t}, -inf, options.requires_grad(false)).tril(-window);
  }
  return mask;
}

// The gated MLP, act(gate) * up, by config.json's hidden_act (transformers' ACT2FN): silu (Llama's,
// and anything else) as one fused product on a GPU (kernels/swiglu.h).
torch::Tensor Gated(const std::string& act, const torch::Tensor& gate, const torch::Tensor& up) {
  if (act == "gelu") return torch::gelu(gate) * up;
  if (act == "gelu_pytorch_tanh") return torch::gelu(gate, "tanh") * up;
  if (act == "relu") return torch::relu(gate) * up;
  return SwiGlu(gate, up);
}

// A projection with a bias (Qwen2's q/k/v) or without.
torch::nn::Linear Projection(int64_t in, int64_t out, bool bias, const ModelOptions& options) {
  return Keep(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)), options);
}

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const ModelConfig& m, const ModelOptions& options, const TensorParallel* tp)
      : heads_(m.n_head),
        kv_heads_(m.KvHeads()),
        head_dim_(m.HeadDim()),
        window_(m.sliding_window),
        bf16_(options.bf16),
        tp_(tp) {
    const int64_t d = m.d_model;
    q_proj = register_module("q_proj", Projection(d, heads_ * head_dim_, m.qkv_bias, options));
    k_proj = register_module("k_proj", Projection(d, kv_heads_ * head_dim_, m.qkv_bias, options));
    v_proj = register_module("v_proj", Projection(d, kv_heads_ * head_dim_, m.qkv_bias, options));
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
    torch::Tensor q, k, v;
    if (OneProduct(x)) {
      // q, k and v from one product of the three weights stacked (views of its output), where
      // three products each read x and their input gradients meet in two bf16 adds (1.15 ms of a
      // Llama 3.2 1B step on an H200, bench/RESULTS.md). The stacking costs a copy of the three
      // fp32 weights a step; their gradients reach each weight through the stack's backward.
      const torch::Tensor w = torch::cat({q_proj->weight, k_proj->weight, v_proj->weight});
      const torch::Tensor bias = q_proj->bias.defined()
                                     ? torch::cat({q_proj->bias, k_proj->bias, v_proj->bias})
                                     : torch::Tensor();
      const std::array<torch::Tensor, 3> qkv = SplitQkv(GpuLinear(x, w, bias), heads, kv_heads);
      q = qkv[0];
      k = qkv[1];
      v = qkv[2];
    } else {
      q = heads_of(q_proj, q_lora_, heads);
      k = heads_of(k_proj, k_lora_, kv_heads);
      v = heads_of(v_proj, v_lora_, kv_heads);
    }
    // (On a GPU one kernel each way: kernels/rotary.h.)
    q = ApplyRotary(q, cos, sin);
    k = ApplyRotary(k, cos, sin);
#if TRAINYARD_TORCH2
    if (x.is_cuda()) {
      // On the GPU: fused causal attention, grouped-query heads shared inside the kernel; a
      // window shorter than the sequence as a boolean mask (true: attend).
      const bool windowed = window_ > 0 && t > window_;
      const torch::Tensor allowed =
          windowed ? CausalMask(t, window_, x.options()).eq(0) : torch::Tensor();
      torch::Tensor y = at::scaled_dot_product_attention(
          q, k, v, windowed ? std::optional<torch::Tensor>(allowed) : std::nullopt, 0.0,
          /*is_causal=*/!windowed, std::nullopt, /*enable_gqa=*/rep > 1);
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
    const torch::Tensor mask = CausalMask(t, window_, x.options());
    torch::Tensor scores = BatchedMatmul(q.reshape({b * heads, t, hd}), expand(k).transpose(1, 2),
                                         1.0 / std::sqrt(double(hd)), mask);
    torch::Tensor y = BatchedMatmul(torch::softmax(scores, -1), expand(v), 1.0, torch::Tensor());
    y = y.view({b, heads, t, hd}).transpose(1, 2).reshape({b, t, heads * hd});
    if (tp_->on()) return RowOutput(y, o_proj, bf16_, *tp_);  // no LoRA under it
    return Project(y, o_proj, o_lora_, bf16_, is_training());
  }

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  // Whether q, k and v come from one product: GpuLinear's fused path (a GPU under autocast,
  // training), no tensor parallelism, no adapter on any of the three, and the three biased alike.
  bool OneProduct(const torch::Tensor& x) const {
    return x.is_cuda() && !tp_->on() && q_lora_.a.is_empty() && k_lora_.a.is_empty() &&
           v_lora_.a.is_empty() && q_proj->bias.defined() == k_proj->bias.defined() &&
           q_proj->bias.defined() == v_proj->bias.defined() &&
           UsesGpuLinear(x, q_proj->weight, q_proj->bias);
  }

  Adapter q_lora_, k_lora_, v_lora_, o_lora_;
  int64_t heads_, kv_heads_, head_dim_, window_;
  bool bf16_;
  const TensorParallel* tp_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMlpImpl : public torch::nn::Module {
 public:
  LlamaMlpImpl(const ModelConfig& m, const ModelOptions& options, const TensorParallel* tp)
      : act_(m.hidden_act), bf16_(options.bf16), tp_(tp) {
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
    const torch::Tensor hidden = Gated(act_, Project(x, gate_proj, gate_lora_, bf16_, training),
                                       Project(x, up_proj, up_lora_, bf16_, training));
    if (tp_->on()) return RowOutput(hidden, down_proj, bf16_, *tp_);  // no LoRA under it
    return Project(hidden, down_proj, down_lora_, bf16_, training);
  }
  // residual + forward(in): on a GPU without tensor parallelism or an adapter on down_proj, the
  // residual added by down_proj's product itself (GpuLinearResidual: the fp32 sum out of the
  // GEMM, no bf16 output and mixed-dtype add after it).
  torch::Tensor AddedTo(const torch::Tensor& residual, const torch::Tensor& in) {
    if (!in.is_cuda() || tp_->on() || !down_lora_.a.is_empty()) return residual + forward(in);
    const bool training = is_training();
    const torch::Tensor hidden = Gated(act_, Project(in, gate_proj, gate_lora_, bf16_, training),
                                       Project(in, up_proj, up_lora_, bf16_, training));
    return GpuLinearResidual(hidden, down_proj->weight, residual);
  }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  Adapter gate_lora_, up_lora_, down_lora_;
  std::string act_;
  bool bf16_;
  const TensorParallel* tp_;
};
TORCH_MODULE(LlamaMlp);

class LlamaLayerImpl : public torch::nn::Module {
 public:
  LlamaLayerImpl(const ModelConfig& m, const ModelOptions& options, Rope* rope,
                 const TensorParallel* tp)
      : rope_(rope), tp_(tp), fused_norms_(options.fused_norms) {
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
    if (fused_norms_ && !tp_->on() && UsesFusedNorms(x)) {
      // On the GPU: input_layernorm and its cast in one kernel, the residual add,
      // post_attention_layernorm and its cast in another (kernels/fused_norm.h), each way; x
      // reaches the add through the first norm's node, whose backward sums its two gradients.
      const auto [stream, normed1] =
          RmsNormResidual(x, input_layernorm->weight, input_layernorm->eps());
      const auto [h, normed] =
          AddRmsNorm(stream, self_attn(normed1, cos, sin), post_attention_layernorm->weight,
                     post_attention_layernorm->eps());
      return mlp->AddedTo(h, normed);
    }
    torch::Tensor h = x + self_attn(input_layernorm(x), cos, sin);
    return h + mlp(post_attention_layernorm(h));
  }
  LlamaAttention self_attn{nullptr};
  LlamaMlp mlp{nullptr};
  RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};

 private:
  Rope* rope_;
  const TensorParallel* tp_;
  bool fused_norms_;
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
  torch::Tensor HeadWeight() const override {
    return tie_weights_ ? model_->embed_tokens->weight : lm_head_->weight;
  }
  torch::Tensor HeadInput(const torch::Tensor& h) override { return model_->norm(h); }
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

}  // namespace

std::shared_ptr<LanguageModel> MakeLlama(const ModelConfig& spec, const ModelOptions& options) {
  return std::make_shared<LlamaModel>(spec, options);
}

}  // namespace trainyard::trainer
