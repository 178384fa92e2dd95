// GptModel, MlpModel and the activation-checkpointing autograd function (see model.h).
#include "worker/trainer/model.h"

#include <c10/core/CPUAllocator.h>

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "worker/trainer/onednn_matmul.h"

namespace trainyard::trainer {
namespace {

namespace F = torch::nn::functional;

// y = x W^T + b, in bf16 when asked (autograd casts the gradients back to fp32); fp32 on oneDNN.
torch::Tensor Dense(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                    bool bf16) {
  if (!bf16) return Linear(x, weight, bias);
  const auto b16 = torch::kBFloat16;
  return torch::linear(x.to(b16), weight.to(b16), bias.defined() ? bias.to(b16) : bias)
      .to(torch::kFloat);
}

torch::Tensor Dense(const torch::Tensor& x, torch::nn::Linear& linear, bool bf16) {
  return Dense(x, linear->weight, linear->bias, bf16);
}

// A freshly built module, its parameters' storage freed unless options.materialize.
template <typename M>
M Keep(M module, const ModelOptions& options) {
  if (!options.materialize) {
    for (const auto& p : module->parameters()) FreeStorage(p);
  }
  return module;
}

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t n_head, bool bf16)
      : n_head_(n_head),
        bf16_(bf16),
        ln1_(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        qkv_(register_module("qkv", torch::nn::Linear(d_model, 3 * d_model))),
        proj_(register_module("proj", torch::nn::Linear(d_model, d_model))),
        ln2_(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        fc_(register_module("fc", torch::nn::Linear(d_model, 4 * d_model))),
        fc_out_(register_module("fc_out", torch::nn::Linear(4 * d_model, d_model))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = x + Attention(ln1_(x));
    return h + Dense(F::gelu(Dense(ln2_(h), fc_, bf16_)), fc_out_, bf16_);
  }

 private:
  torch::Tensor Attention(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / n_head_;
    // unbind, not qkv[i]: its backward stacks the three gradients in one pass, where three
    // selects would each zero a buffer of all three and then add them up.
    const std::vector<torch::Tensor> qkv =
        Dense(x, qkv_, bf16_).view({b, t, 3, n_head_, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
    // [b * h, t, hd] each
    torch::Tensor q = qkv[0].reshape({b * n_head_, t, hd}),
                  k = qkv[1].reshape({b * n_head_, t, hd}),
                  v = qkv[2].reshape({b * n_head_, t, hd});
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
      blocks.push_back(y.view({b, n_head_, rows, hd}).transpose(1, 2));
    }
    // One copy puts the blocks side by side as [b, t, h * hd].
    torch::Tensor y = torch::cat(blocks, 1).view({b, t, d});
    return Dense(y, proj_, bf16_);
  }

  int64_t n_head_;
  bool bf16_;
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
class CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               BlockImpl* block) {
    ctx->saved_data["block"] = reinterpret_cast<int64_t>(block);
    ctx->save_for_backward({x});
    torch::NoGradGuard no_grad;  // apply() already disables grad; stated for the reader
    return block->forward(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto* block = reinterpret_cast<BlockImpl*>(ctx->saved_data["block"].toInt());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = block->forward(x);
    }
    torch::autograd::backward({y}, {grad_outputs[0]});
    return {x.grad(), torch::Tensor()};
  }
};

class GptModel : public LanguageModel {
 public:
  GptModel(const ModelConfig& spec, const ModelOptions& options)
      : options_(options), tie_weights_(spec.tie_weights), seq_len_(spec.seq_len) {
    const int64_t d = spec.d_model, v = spec.vocab;
    tok_emb_ = register_module("tok_emb", Keep(torch::nn::Embedding(v, d), options));
    pos_emb_ = register_module("pos_emb", Keep(torch::nn::Embedding(spec.seq_len, d), options));
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < spec.n_layer; ++i) {
      blocks_->push_back(Keep(Block(d, spec.n_head, options.bf16), options));
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

  torch::Tensor Loss(const torch::Tensor& windows) override {
    const int64_t t = windows.size(1) - 1;
    torch::Tensor logits = Logits(windows.narrow(1, 0, t));
    torch::Tensor targets = windows.narrow(1, 1, t);
    return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }

  torch::Tensor NextTokenLogits(const torch::Tensor& context) override {
    const int64_t t = std::min<int64_t>(context.size(1), seq_len_);
    return Logits(context.narrow(1, context.size(1) - t, t)).select(1, t - 1).squeeze(0);
  }

  int64_t TokensPerWindow() const override { return seq_len_; }

 private:
  // [b, t, vocab] logits of every position of `inputs` ([b, t], t <= seq_len).
  torch::Tensor Logits(const torch::Tensor& inputs) {
    const int64_t t = inputs.size(1);
    torch::Tensor x = tok_emb_(inputs) + pos_emb_(torch::arange(t, torch::kLong));
    const bool checkpoint = options_.activation_checkpointing && torch::GradMode::is_enabled();
    for (size_t i = 0; i < blocks_->size(); ++i) {
      auto* block = (*blocks_)[i]->as<BlockImpl>();
      if (hooks_ != nullptr) hooks_->BeforeBlock(static_cast<int>(i));
      x = checkpoint ? CheckpointedBlock::apply(x, block) : block->forward(x);
      if (hooks_ != nullptr) hooks_->AfterBlock(static_cast<int>(i), x);
    }
    x = ln_f_(x);
    return tie_weights_ ? Dense(x, tok_emb_->weight, torch::Tensor(), options_.bf16)
                        : Dense(x, head_, options_.bf16);
  }

 private:
  ModelOptions options_;
  bool tie_weights_;
  int64_t seq_len_;
  torch::nn::Embedding tok_emb_{nullptr}, pos_emb_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};

class MlpModel : public LanguageModel {
 public:
  MlpModel(const ModelConfig& spec, const ModelOptions& options)
      : options_(options), seq_len_(spec.seq_len) {
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

  torch::Tensor Loss(const torch::Tensor& windows) override {
    const int64_t t = windows.size(1) - 1;
    return F::cross_entropy(Logits(windows.narrow(1, 0, t)), windows.select(1, t));
  }

  torch::Tensor NextTokenLogits(const torch::Tensor& context) override {
    const int64_t t = std::min<int64_t>(context.size(1), seq_len_);
    return Logits(context.narrow(1, context.size(1) - t, t)).squeeze(0);
  }

  // [b, vocab] logits of the token after each context ([b, t]).
  torch::Tensor Logits(const torch::Tensor& contexts) {
    torch::Tensor x = tok_emb_(contexts).mean(1);  // [b, d]
    for (size_t i = 0; i < up_.size(); ++i) {
      if (hooks_ != nullptr) hooks_->BeforeBlock(static_cast<int>(i));
      x = x + Dense(F::gelu(Dense(x, up_[i], options_.bf16)), down_[i], options_.bf16);
      if (hooks_ != nullptr) hooks_->AfterBlock(static_cast<int>(i), x);
    }
    return Dense(x, head_, options_.bf16);
  }

  int64_t TokensPerWindow() const override { return seq_len_; }

 private:
  ModelOptions options_;
  int64_t seq_len_;
  torch::nn::Embedding tok_emb_{nullptr};
  std::vector<torch::nn::Linear> up_, down_;
  torch::nn::Linear head_{nullptr};
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
    }
  }
}

}  // namespace

std::shared_ptr<LanguageModel> BuildModel(const ModelConfig& spec, const ModelOptions& options,
                                          uint64_t seed) {
  torch::manual_seed(seed);
  std::shared_ptr<LanguageModel> model;
  if (spec.kind == "mlp") {
    model = std::make_shared<MlpModel>(spec, options);
  } else {
    model = std::make_shared<GptModel>(spec, options);
  }
  if (options.materialize) Initialize(*model);
  return model;
}

void FreeStorage(const torch::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

void AllocateStorage(const torch::Tensor& t, int64_t bytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::GetCPUAllocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

std::vector<int64_t> Generate(LanguageModel& model, const std::vector<int64_t>& prompt, int length,
                              double temperature, uint64_t seed, int64_t seq_len) {
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> tokens = prompt;
  std::vector<int64_t> out;
  for (int i = 0; i < length; ++i) {
    const int64_t t = std::min<int64_t>(static_cast<int64_t>(tokens.size()), seq_len);
    torch::Tensor context =
        torch::tensor(std::vector<int64_t>(tokens.end() - t, tokens.end()), torch::kLong)
            .unsqueeze(0);
    torch::Tensor probs = torch::softmax(model.NextTokenLogits(context) / temperature, -1);
    const int64_t next = torch::multinomial(probs, 1, false, generator).item<int64_t>();
    tokens.push_back(next);
    out.push_back(next);
  }
  return out;
}

}  // namespace trainyard::trainer
