// The llama model against the reference implementation itself: Hugging Face transformers (from
// PyPI, in the virtual environment scripts/setup.sh creates at build/hf-venv) builds small random
// LlamaForCausalLMs and saves them sharded (tests/hf_llama_reference.py); trainyard loads each
// checkpoint the way the trainer does and must give the same logits on the same tokens, the same
// loss and the same gradients, in fp32. Then trainyard's export must load in transformers and give
// trainyard's logits. LoRA likewise against PEFT: logits, loss and adapter gradients, and the
// exported adapter (PEFT's layout) and merged model loaded back.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/job_config.h"
#include "tests/testing/reference_venv.h"
#include "tests/testing/subprocess.h"
#include "worker/trainer/checkpoint/hf_weights.h"
#include "worker/trainer/io/hf_checkpoint.h"
#include "worker/trainer/io/safetensors.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {
namespace {

using testing::TempDir;

// Runs the reference script; fails the test with its output when it fails.
void RunReference(const std::vector<std::string>& args) {
  testing::RunReferenceScript("hf_llama_reference.py", args);
}

std::map<std::string, torch::Tensor> ReadAll(const std::string& path) {
  return testing::ReadSafetensorsTensors(path);
}

// The model a trainer builds from `dir`, as Train does.
std::shared_ptr<LanguageModel> Load(const std::string& dir, ModelConfig* m,
                                    const ModelOptions& options = ModelOptions{}) {
  m->kind = "llama";
  m->from = dir;
  m->seq_len = 64;
  auto config = ReadLlamaConfig(dir);
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok()) return nullptr;
  EXPECT_TRUE(ResolveLlamaConfig(*config, dir + "/config.json", m).ok());
  auto checkpoint = HfCheckpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  if (!checkpoint.ok()) return nullptr;
  absl::Status checked = (*checkpoint)->Check(LlamaTensors(*config));
  EXPECT_TRUE(checked.ok()) << checked;
  std::shared_ptr<LanguageModel> model = BuildModel(*m, options, /*seed=*/1);
  absl::Status loaded = LoadHfWeights(**checkpoint, *model);
  EXPECT_TRUE(loaded.ok()) << loaded;
  return model;
}

// [batch, t, vocab]: the logits of every position, one next-token prediction per prefix.
torch::Tensor AllLogits(LanguageModel& model, const torch::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < tokens.size(0); ++b) {
    std::vector<torch::Tensor> positions;
    for (int64_t t = 1; t <= tokens.size(1); ++t) {
      positions.push_back(model.NextTokenLogits(tokens.narrow(0, b, 1).narrow(1, 0, t)));
    }
    rows.push_back(torch::stack(positions));
  }
  return torch::stack(rows);
}

double MaxDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// Checks `model`'s logits on the reference's tokens and its loss against `expected`, then runs
// backward for the caller to compare gradients. Returns the logits.
torch::Tensor ExpectReferenceLogitsAndLoss(LanguageModel& model,
                                           const std::map<std::string, torch::Tensor>& expected) {
  const torch::Tensor tokens = expected.at("tokens");
  const torch::Tensor logits = AllLogits(model, tokens);
  EXPECT_EQ(logits.sizes(), expected.at("logits").sizes());
  if (logits.sizes() == expected.at("logits").sizes()) {
    EXPECT_LT(MaxDiff(logits, expected.at("logits")), 1e-4);
  }
  torch::Tensor loss = model.Loss(tokens);
  EXPECT_NEAR(loss.item<double>(), expected.at("loss").item<double>(), 1e-5);
  loss.backward();
  return logits;
}

struct Variant {
  std::string name, dtype;
};
void PrintTo(const Variant& v, std::ostream* os) { *os << v.name << " saved as " << v.dtype; }

class LlamaReferenceTest : public ::testing::TestWithParam<Variant> {};

TEST_P(LlamaReferenceTest, LogitsLossAndGradientsMatchTransformers) {
  TempDir dir;
  const std::string ref = dir.path() + "/model";
  ASSERT_NO_FATAL_FAILURE(RunReference({ref, GetParam().name, GetParam().dtype}));
  // Sharded, as save_pretrained wrote it.
  ASSERT_TRUE(std::filesystem::exists(ref + "/model.safetensors.index.json"));
  std::map<std::string, torch::Tensor> expected = ReadAll(ref + "/reference.safetensors");
  ModelConfig m;
  std::shared_ptr<LanguageModel> model = Load(ref, &m);
  ASSERT_NE(model, nullptr);
  const std::string& name = GetParam().name;
  const bool qwen2 = absl::StartsWith(name, "qwen2");
  EXPECT_EQ(m.tie_weights, name == "tied" || name == "qwen2_tied");
  EXPECT_EQ(m.n_kv_head, name == "tied" ? 1
                         : name == "mha" || name == "gelu" || name == "gelu_tanh" || name == "relu"
                             ? 4
                             : 2);
  EXPECT_EQ(m.qkv_bias, qwen2);
  EXPECT_EQ(m.sliding_window, name == "mistral" ? 5 : 0);
  EXPECT_EQ(m.family, qwen2 ? "qwen2" : name == "mistral" ? "mistral" : "llama");

  // The logits, one training step's loss and every gradient.
  ExpectReferenceLogitsAndLoss(*model, expected);
  int compared = 0;
  for (const auto& item : model->named_parameters()) {
    SCOPED_TRACE(item.key());
    ASSERT_TRUE(expected.count("grad." + item.key()) > 0);
    ASSERT_TRUE(item.value().grad().defined());
    EXPECT_LT(MaxDiff(item.value().grad(), expected.at("grad." + item.key())), 1e-5);
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(model->named_parameters().size()));
  // 9 tensors per layer (12 with Qwen2's biases), embedding, norm (and lm_head)
  EXPECT_GE(compared, 2 * (qwen2 ? 12 : 9) + 2);
}

// Ten AdamW steps (lr 1e-2, betas 0.9 and 0.95, eps 1e-8) from the checkpoint on the reference's
// tokens: the losses transformers and torch.optim.AdamW give, step by step.
TEST_P(LlamaReferenceTest, TenTrainingStepsGiveTransformersLosses) {
  TempDir dir;
  const std::string ref = dir.path() + "/model";
  ASSERT_NO_FATAL_FAILURE(RunReference({ref, GetParam().name, GetParam().dtype}));
  std::map<std::string, torch::Tensor> expected = ReadAll(ref + "/reference.safetensors");
  ModelConfig m;
  std::shared_ptr<LanguageModel> model = Load(ref, &m);
  ASSERT_NE(model, nullptr);
  ParameterOptimizer optimizer(model->parameters(), HyperFor(OptimizerKind::kAdamW, 0.0));
  const torch::Tensor tokens = expected.at("tokens");
  const torch::Tensor want = expected.at("train_losses");
  ASSERT_EQ(want.numel(), 10);
  for (int64_t step = 0; step < want.numel(); ++step) {
    optimizer.zero_grad();
    torch::Tensor loss = model->Loss(tokens);
    loss.backward();
    optimizer.Update(1e-2, 1.0);
    EXPECT_NEAR(loss.item<double>(), want[step].item<double>(), 1e-4) << "step " << step;
  }
  // Training moved: the last loss is well below the first.
  EXPECT_LT(want[9].item<double>(), want[0].item<double>() - 0.1);
}

class LlamaExportTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaExportTest, AnExportedModelLoadsInTransformersWithTheSameLogits) {
  TempDir dir;
  const std::string ref = dir.path() + "/model", out = dir.path() + "/exported";
  ASSERT_NO_FATAL_FAILURE(RunReference({ref, GetParam()}));
  ModelConfig m;
  std::shared_ptr<LanguageModel> model = Load(ref, &m);
  ASSERT_NE(model, nullptr);
  {  // a step of training, so the export is not just the checkpoint read back
    torch::NoGradGuard no_grad;
    for (const auto& p : model->parameters()) p.add_(0.01 * torch::randn_like(p));
  }
  ASSERT_TRUE(ExportHfModel(m, LoraConfig{}, *model, out).ok());
  ASSERT_NO_FATAL_FAILURE(RunReference({"--check-export", ref, out}));
  std::map<std::string, torch::Tensor> expected = ReadAll(ref + "/reference.safetensors");
  const torch::Tensor theirs = ReadAll(out + "/transformers_logits.safetensors").at("logits");
  EXPECT_LT(MaxDiff(AllLogits(*model, expected.at("tokens")), theirs), 1e-4);
}

// PEFT's LoRA on every projection of the gqa model (r 4, alpha 8), its adapter weights random.
LoraConfig PeftLora() {
  LoraConfig lora;
  lora.r = 4;
  lora.alpha = 8;
  lora.target_modules = LoraTargetNames();
  return lora;
}

// The base from `ref`, with LoRA and the adapter weights PEFT saved in `ref`/adapter.
std::shared_ptr<LanguageModel> LoadWithPeftAdapter(const std::string& ref, ModelConfig* m) {
  ModelOptions options;
  options.lora = PeftLora();
  std::shared_ptr<LanguageModel> model = Load(ref, m, options);
  if (model == nullptr) return nullptr;
  std::map<std::string, torch::Tensor> adapter =
      ReadAll(ref + "/adapter/adapter_model.safetensors");
  torch::NoGradGuard no_grad;
  int copied = 0;
  for (const auto& item : model->named_parameters()) {
    if (!IsLoraParameter(item.key())) continue;
    auto it = adapter.find("base_model.model." + item.key());
    EXPECT_NE(it, adapter.end()) << item.key();
    if (it == adapter.end()) return nullptr;
    item.value().copy_(it->second);
    ++copied;
  }
  EXPECT_EQ(copied, static_cast<int>(adapter.size()));
  return model;
}

// The gqa Llama and Qwen2 (whose q/k/v have biases besides their adapters).
class LlamaLoraReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaLoraReferenceTest, LogitsLossAndAdapterGradientsMatchPeft) {
  TempDir dir;
  const std::string ref = dir.path() + "/model";
  ASSERT_NO_FATAL_FAILURE(RunReference({"--lora", ref, GetParam()}));
  std::map<std::string, torch::Tensor> expected = ReadAll(ref + "/lora_reference.safetensors");
  ModelConfig m;
  std::shared_ptr<LanguageModel> model = LoadWithPeftAdapter(ref, &m);
  ASSERT_NE(model, nullptr);

  const torch::Tensor logits = ExpectReferenceLogitsAndLoss(*model, expected);
  // The adapters matter: the base alone computes something else.
  const std::map<std::string, torch::Tensor> base = ReadAll(ref + "/reference.safetensors");
  EXPECT_GT(MaxDiff(logits, base.at("logits")), 1e-2);
  int compared = 0;
  for (const auto& item : model->named_parameters()) {
    SCOPED_TRACE(item.key());
    if (!IsLoraParameter(item.key())) {
      EXPECT_FALSE(item.value().requires_grad());
      EXPECT_FALSE(item.value().grad().defined());  // frozen: no gradient at all
      continue;
    }
    const std::string name = "grad.base_model.model." + item.key();
    ASSERT_TRUE(expected.count(name) > 0);
    ASSERT_TRUE(item.value().grad().defined());
    EXPECT_LT(MaxDiff(item.value().grad(), expected.at(name)), 1e-5);
    ++compared;
  }
  EXPECT_EQ(compared, 2 * 7 * m.n_layer);
}

TEST_P(LlamaLoraReferenceTest, ExportedAdapterLoadsInPeftAndMergedModelInTransformers) {
  TempDir dir;
  const std::string ref = dir.path() + "/model", adapter = dir.path() + "/adapter",
                    merged = dir.path() + "/merged";
  ASSERT_NO_FATAL_FAILURE(RunReference({"--lora", ref, GetParam()}));
  ModelConfig m;
  std::shared_ptr<LanguageModel> model = LoadWithPeftAdapter(ref, &m);
  ASSERT_NE(model, nullptr);
  {  // trained adapters, not the ones read
    torch::NoGradGuard no_grad;
    for (const auto& item : model->named_parameters()) {
      if (IsLoraParameter(item.key())) item.value().add_(0.05 * torch::randn_like(item.value()));
    }
  }
  ASSERT_TRUE(ExportLoraAdapter(PeftLora(), *model, ref, adapter).ok());
  ASSERT_TRUE(ExportHfModel(m, PeftLora(), *model, merged).ok());
  ASSERT_NO_FATAL_FAILURE(RunReference({"--check-adapter", ref, adapter}));
  ASSERT_NO_FATAL_FAILURE(RunReference({"--check-export", ref, merged}));
  const torch::Tensor tokens = ReadAll(ref + "/reference.safetensors").at("tokens");
  const torch::Tensor ours = AllLogits(*model, tokens);
  EXPECT_LT(MaxDiff(ours, ReadAll(adapter + "/peft_logits.safetensors").at("logits")), 1e-4);
  EXPECT_LT(MaxDiff(ours, ReadAll(merged + "/transformers_logits.safetensors").at("logits")), 1e-4);
  // The adapter file holds the adapters alone.
  EXPECT_EQ(ReadAll(adapter + "/adapter_model.safetensors").size(), size_t{2 * 7} * m.n_layer);
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaReferenceTest,
                         ::testing::Values(Variant{"mha", "float32"}, Variant{"gqa", "float32"},
                                           Variant{"tied", "float32"}, Variant{"gqa", "bfloat16"},
                                           Variant{"mha", "float16"}, Variant{"gelu", "float32"},
                                           Variant{"gelu_tanh", "float32"},
                                           Variant{"relu", "float32"},
                                           Variant{"mistral", "float32"},
                                           Variant{"qwen2", "float32"},
                                           Variant{"qwen2_tied", "bfloat16"}),
                         [](const auto& info) { return info.param.name + "_" + info.param.dtype; });
INSTANTIATE_TEST_SUITE_P(Variants, LlamaLoraReferenceTest, ::testing::Values("gqa", "qwen2"));
INSTANTIATE_TEST_SUITE_P(Variants, LlamaExportTest,
                         ::testing::Values("mha", "gqa", "tied", "gelu_tanh", "mistral", "qwen2",
                                           "qwen2_tied"));

}  // namespace
}  // namespace trainyard::trainer
