// The residual MLP language model (see model.h).
#include "worker/trainer/model/layers.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace trainyard::trainer {
namespace {

class MlpModel : public LanguageModel {
 public:
  MlpModel(const ModelConfig& spec, const ModelOptions& options)
      : LanguageModel(spec.seq_len, options.activation_checkpointing),
        options_(options),
        gelu_tanh_(spec.gelu_tanh),
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
    return GeluMlpOf(x, x, up_[i], down_[i], gelu_tanh_, options_.bf16);
  }
  torch::Tensor Head(const torch::Tensor& x) override { return Dense(x, head_, options_.bf16); }
  std::vector<int64_t> HiddenShape(int64_t batch) const override { return {batch, d_model_}; }

 protected:
  bool PredictsLastTokenOnly() const override { return true; }

 private:
  ModelOptions options_;
  bool gelu_tanh_;
  int64_t d_model_;
  torch::nn::Embedding tok_emb_{nullptr};
  std::vector<torch::nn::Linear> up_, down_;
  torch::nn::Linear head_{nullptr};
};

}  // namespace

std::shared_ptr<LanguageModel> MakeMlp(const ModelConfig& spec, const ModelOptions& options) {
  return std::make_shared<MlpModel>(spec, options);
}

}  // namespace trainyard::trainer
