// The layers the architectures share (model/gpt.cc, mlp.cc, llama.cc): dense products in bf16 or
// fp32, LoRA adapters (PEFT's names), tensor-parallel inputs and outputs, RMSNorm, the weighted
// cross-entropy. Internal to model/; the interface is model.h.
#pragma once

#include <memory>
#include <string>

#include "worker/trainer/kernels/dense.h"
#include "worker/trainer/kernels/fused_norm.h"
#include "worker/trainer/kernels/onednn_matmul.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {

// y = x W^T + b, in bf16 when asked (autograd casts the gradients back to fp32); fp32 on oneDNN.
// On a GPU the product's precision is autocast's (AutocastScope), so `bf16` is not looked at, and
// the weight's and bias's gradients come from one cuBLASLt product (kernels/dense.h).
inline torch::Tensor Dense(const torch::Tensor& x, const torch::Tensor& weight,
                           const torch::Tensor& bias, bool bf16) {
  if (x.is_cuda()) return GpuLinear(x, weight, bias);
  if (!bf16) return Linear(x, weight, bias);
  const auto b16 = torch::kBFloat16;
  return torch::linear(x.to(b16), weight.to(b16), bias.defined() ? bias.to(b16) : bias)
      .to(torch::kFloat);
}

inline torch::Tensor Dense(const torch::Tensor& x, torch::nn::Linear& linear, bool bf16) {
  return Dense(x, linear->weight, linear->bias, bf16);
}

// GELU, exact (erf) or tanh's approximation (GPT-2's gelu_new).
inline torch::Tensor Gelu(const torch::Tensor& x, bool gelu_tanh) {
  return torch::gelu(x, gelu_tanh ? "tanh" : "none");
}

// residual + out(gelu(fc(x))), the GPT's MLP and the mlp model's block: on a GPU GeluMlp (the
// GELU and the residual add in cuBLASLt's epilogues where they apply, kernels/dense.h), else
// Dense's products around Gelu, and the add.
inline torch::Tensor GeluMlpOf(const torch::Tensor& residual, const torch::Tensor& x,
                               torch::nn::Linear& fc, torch::nn::Linear& out, bool gelu_tanh,
                               bool bf16) {
  if (x.is_cuda()) {
    return GeluMlp(x, fc->weight, fc->bias, out->weight, out->bias, gelu_tanh, residual);
  }
  return residual + Dense(Gelu(Dense(x, fc, bf16), gelu_tanh), out, bf16);
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
inline torch::Tensor Project(const torch::Tensor& x, torch::nn::Linear& linear,
                             const Adapter& adapter, bool bf16, bool training) {
  torch::Tensor y = Dense(x, linear, bf16);
  if (adapter.a.is_empty()) return y;
  const torch::Tensor in =
      adapter.dropout > 0 && training
          ? torch::nn::functional::dropout(
                x, torch::nn::functional::DropoutFuncOptions().p(adapter.dropout).training(true))
          : x;
  const torch::Tensor low = Dense(in, adapter.a->weight, torch::Tensor(), bf16);
  return y + Dense(low, adapter.b->weight, torch::Tensor(), bf16) * adapter.scale;
}

// sum_i weights_i * cross_entropy(logits_i, targets_i) over every leading position.
inline torch::Tensor WeightedCrossEntropySum(const torch::Tensor& logits,
                                             const torch::Tensor& targets,
                                             const torch::Tensor& weights) {
  const torch::Tensor each = torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
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
inline torch::Tensor ColumnInput(const torch::Tensor& x, const TensorParallel& tp) {
  return tp.on() ? CopyToTensorParallel(x, tp) : x;
}
inline torch::Tensor RowOutput(const torch::Tensor& x, torch::nn::Linear& linear, bool bf16,
                               const TensorParallel& tp) {
  if (!tp.on()) return Dense(x, linear, bf16);
  torch::Tensor y = ReduceFromTensorParallel(Dense(x, linear->weight, torch::Tensor(), bf16), tp);
  return linear->bias.defined() ? y + linear->bias : y;
}

// x * rsqrt(mean(x^2) + eps) * weight, in fp32 (as transformers' LlamaRMSNorm).
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t d, double eps)
      : eps_(eps), weight(register_parameter("weight", torch::ones({d}))) {}
  // (On the GPU LibTorch's fused RMSNorm: kernels/fused_norm.h RmsNormOf.)
  torch::Tensor forward(const torch::Tensor& x) { return RmsNormOf(x, weight, eps_); }
  double eps() const { return eps_; }

 private:
  double eps_;

 public:
  torch::Tensor weight;
};
TORCH_MODULE(RmsNorm);

inline torch::nn::Linear NoBias(int64_t in, int64_t out, const ModelOptions& options) {
  return Keep(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)), options);
}

// Registers the adapter of projection `name` under it when LoRA targets it (uninitialized: see
// InitializeLora).
inline Adapter Attach(torch::nn::Linear& projection, const std::string& name,
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

// The architectures, each in its file: built by BuildModel (model.cc).
std::shared_ptr<LanguageModel> MakeGpt(const ModelConfig& spec, const ModelOptions& options);
std::shared_ptr<LanguageModel> MakeMlp(const ModelConfig& spec, const ModelOptions& options);
std::shared_ptr<LanguageModel> MakeLlama(const ModelConfig& spec, const ModelOptions& options);

}  // namespace trainyard::trainer
