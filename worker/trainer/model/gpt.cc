// GPT-2: pre-norm transformer blocks with fused qkv, GELU MLP, learned positions (see model.h).
#include "worker/trainer/kernels/fused_norm.h"
#include "worker/trainer/kernels/split_heads.h"
#include "worker/trainer/model/layers.h"

#include <array>
#include <cmath>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace trainyard::trainer {
namespace {

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t n_head, bool bf16, bool fused_norms, bool gelu_tanh,
            const TensorParallel* tp)
      : n_head_(n_head),
        bf16_(bf16),
        gelu_tanh_(gelu_tanh),
        fused_norms_(fused_norms),
        tp_(tp),
        ln1_(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        qkv_(register_module("qkv", torch::nn::Linear(d_model, 3 * d_model))),
        proj_(register_module("proj", torch::nn::Linear(d_model, d_model))),
        ln2_(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        fc_(register_module("fc", torch::nn::Linear(d_model, 4 * d_model))),
        fc_out_(register_module("fc_out", torch::nn::Linear(4 * d_model, d_model))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    if (fused_norms_ && !tp_->on() && UsesFusedNorms(x)) {
      // On the GPU: ln1 and its cast in one kernel, the residual add, ln2 and its cast in
      // another (kernels/fused_norm.h), forward and backward. x reaches the add through ln1's
      // node, whose backward kernel sums the stream's two gradients.
      const double eps1 = ln1_->options.eps(), eps2 = ln2_->options.eps();
      const auto [stream, normed1] = LayerNormResidual(x, ln1_->weight, ln1_->bias, eps1);
      const auto [h, normed] =
          AddLayerNorm(stream, Attention(normed1), ln2_->weight, ln2_->bias, eps2);
      return GeluMlpOf(h, normed, fc_, fc_out_, gelu_tanh_, bf16_);
    }
    torch::Tensor h = x + Attention(ln1_(x));
    if (!tp_->on()) return GeluMlpOf(h, ln2_(h), fc_, fc_out_, gelu_tanh_, bf16_);
    return h + RowOutput(Gelu(Dense(ColumnInput(ln2_(h), *tp_), fc_, bf16_), gelu_tanh_), fc_out_,
                         bf16_, *tp_);
  }

 private:
  torch::Tensor Attention(const torch::Tensor& in) {
    // Tensor parallelism: this rank's heads.
    const int64_t heads = n_head_ / tp_->size;
    // Sequence parallelism: `in` is this rank's part of the sequence, x the whole of it.
    const torch::Tensor x = ColumnInput(in, *tp_);
    const int64_t b = x.size(0), t = x.size(1), hd = x.size(2) / n_head_, d = heads * hd;
    // [b, heads, t, hd] each; the backward writes the three gradients into one buffer of the
    // product's layout in one pass (kernels/split_heads.h).
    const std::array<torch::Tensor, 3> qkv = SplitHeads(Dense(x, qkv_, bf16_), heads);
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
  bool gelu_tanh_;
  bool fused_norms_;
  const TensorParallel* tp_;
  torch::nn::LayerNorm ln1_;
  torch::nn::Linear qkv_, proj_;
  torch::nn::LayerNorm ln2_;
  torch::nn::Linear fc_, fc_out_;
};
TORCH_MODULE(Block);

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
      blocks_->push_back(Keep(
          Block(d, spec.n_head, options.bf16, options.fused_norms, spec.gelu_tanh, &tp_), options));
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
  torch::Tensor HeadWeight() const override {
    return tie_weights_ ? tok_emb_->weight : head_->weight;
  }
  torch::Tensor HeadInput(const torch::Tensor& h) override { return ln_f_(h); }
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

}  // namespace

std::shared_ptr<LanguageModel> MakeGpt(const ModelConfig& spec, const ModelOptions& options) {
  return std::make_shared<GptModel>(spec, options);
}

}  // namespace trainyard::trainer
