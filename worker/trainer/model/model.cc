// LanguageModel's shared parts (blocks, activation checkpointing, losses, generation), the
// initializations and BuildModel; the architectures are in gpt.cc, mlp.cc and llama.cc.
#include "worker/trainer/model/model.h"

#include <c10/core/CPUAllocator.h>

#include <cmath>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "worker/trainer/kernels/fused_loss.h"
#include "worker/trainer/model/layers.h"

namespace trainyard::trainer {
namespace {

namespace F = torch::nn::functional;

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

torch::Tensor LanguageModel::Hidden(const torch::Tensor& inputs) {
  torch::Tensor x = Embed(inputs);
  for (int i = 0; i < NumBlocks(); ++i) x = RunBlock(i, x);
  return x;
}

bool LanguageModel::UsesFusedLoss(const torch::Device& device, int64_t rows) const {
  if (fused_loss_ == FusedLoss::kOff || (fused_loss_ == FusedLoss::kAuto && !device.is_cuda())) {
    return false;
  }
  if (tp_.on() || PredictsLastTokenOnly()) return false;
  const torch::Tensor weight = HeadWeight();
  if (!weight.defined()) return false;
  const int64_t vocab = weight.size(0);
  return fused_loss_ == FusedLoss::kOn || rows >= (kFusedLossMinLogits + vocab - 1) / vocab;
}

torch::Tensor LanguageModel::FusedLossSum(const torch::Tensor& windows,
                                          const torch::Tensor& weights) {
  const int64_t t = windows.size(1) - 1;
  const torch::Tensor x = HeadInput(Hidden(windows.narrow(1, 0, t)));
  return FusedLinearCrossEntropySum(x.reshape({-1, x.size(-1)}), HeadWeight(),
                                    windows.narrow(1, 1, t).reshape({-1}),
                                    weights.defined() ? weights.reshape({-1}) : weights);
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
  if (UsesFusedLoss(windows.device(), windows.size(0) * (windows.size(1) - 1))) {
    return FusedLossSum(windows, torch::Tensor()) /
           static_cast<double>(windows.size(0) * (windows.size(1) - 1));
  }
  return LossOf(Logits(windows.narrow(1, 0, windows.size(1) - 1)), windows);
}

torch::Tensor LanguageModel::MaskedLossSum(const torch::Tensor& windows,
                                           const torch::Tensor& weights) {
  if (UsesFusedLoss(windows.device(), windows.size(0) * (windows.size(1) - 1))) {
    return FusedLossSum(windows, weights);
  }
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

MatmulWork GemmWorkOf(const LanguageModel& model, const ModelConfig& spec, int64_t micro_batch,
                      bool fp32_linear) {
  MatmulWork work;
  const bool last_token_only = spec.kind == "mlp";  // its blocks see one row a window
  const int64_t rows = micro_batch * (last_token_only ? 1 : spec.seq_len);
  if (fp32_linear) {
    std::map<std::tuple<int64_t, int64_t, bool>, int64_t> shapes;  // (in, out, bias) -> count
    for (const auto& item : model.named_modules()) {
      if (const auto* linear = item.value()->as<torch::nn::Linear>()) {
        ++shapes[{linear->weight.size(1), linear->weight.size(0), linear->bias.defined()}];
      }
    }
    if (!model.TiedWeight().empty()) {
      const torch::Tensor head = model.HeadWeight();
      ++shapes[{head.size(1), head.size(0), false}];
    }
    for (const auto& [shape, count] : shapes) {
      work.linear.push_back(
          {rows, std::get<0>(shape), std::get<1>(shape), std::get<2>(shape), count});
    }
  }
  if (!last_token_only && spec.n_head > 0) {
    const int64_t heads = spec.n_head / std::max(model.tensor_parallel().size, 1);
    work.attention.push_back({micro_batch * heads, spec.seq_len, spec.HeadDim(),
                              static_cast<int64_t>(model.NumBlocks())});
  }
  return work;
}

std::shared_ptr<LanguageModel> BuildModel(const ModelConfig& spec, const ModelOptions& options,
                                          uint64_t seed) {
  torch::manual_seed(seed);
  std::shared_ptr<LanguageModel> model;
  if (spec.kind == "mlp") {
    model = MakeMlp(spec, options);
  } else if (spec.kind == "llama") {
    model = MakeLlama(spec, options);
  } else {
    model = MakeGpt(spec, options);
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
