// trainyard's optimizers (worker/trainer/optim/optimizers.h) against the reference implementations
// themselves (tests/optimizer_reference.py, run by build/hf-venv): transformers' Adafactor,
// lion-pytorch's Lion and bitsandbytes' AdamW8bit (its quantization maps and quantizer; the
// update in its CUDA kernel's order). Six steps over a matrix, a matrix with a partial last
// 8-bit block, a 3-D tensor, a vector and a long vector, some with gradient scales other than 1.
// And: the optimizer state the trainer holds for each model is what `yard estimate-memory`
// counts.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/job_config.h"
#include "tests/testing/reference_venv.h"
#include "tests/testing/subprocess.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {
namespace {

using testing::TempDir;

// Each optimizer with its defaults, and with the spec's constants set otherwise
// (train.adam_beta1/2, adam_epsilon, adafactor_*) and a parameter weight decay leaves alone
// (train.no_weight_decay; the reference puts it in a group without weight decay).
struct Case {
  OptimizerKind kind;
  bool settings;
};

class OptimizerReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(OptimizerReferenceTest, ParametersAndStateMatchTheReferenceAfterSixSteps) {
  const OptimizerKind kind = GetParam().kind;
  TempDir dir;
  std::vector<std::string> args = {Name(kind), dir.path()};
  if (GetParam().settings) args.push_back("--settings");
  ASSERT_NO_FATAL_FAILURE(testing::RunReferenceScript("optimizer_reference.py", args));
  auto in = testing::ReadSafetensorsTensors(dir.path() + "/input.safetensors");
  auto want = testing::ReadSafetensorsTensors(dir.path() + "/expected.safetensors");
  ASSERT_FALSE(in.empty());
  const double lr = in.at("hyper")[0].item<double>(), wd = in.at("hyper")[1].item<double>();
  std::vector<torch::Tensor> params;
  while (in.count(absl::StrCat("param.", params.size())) != 0) {
    params.push_back(in.at(absl::StrCat("param.", params.size())).clone());
  }
  ASSERT_EQ(params.size(), 5u);

  // [beta1, beta2, eps, adafactor eps[0], clip_threshold, decay_rate, undecayed parameter]
  const torch::Tensor st = in.at("settings");
  auto setting = [&](int i) { return st[i].item<double>(); };
  OptimizerHyper hyper = HyperFor(kind, wd);
  if (GetParam().settings) {
    TrainConfig train;
    train.optimizer = kind;
    train.weight_decay = wd;
    if (kind == OptimizerKind::kAdafactor) {
      train.adafactor_eps = setting(3);
      train.adafactor_clip_threshold = setting(4);
      train.adafactor_decay_rate = setting(5);
    } else {
      train.adam_beta1 = setting(0);
      train.adam_beta2 = setting(1);
      if (kind != OptimizerKind::kLion) train.adam_epsilon = setting(2);
    }
    hyper = HyperFor(train);
  }
  // The defaults are the reference's.
  if (kind == OptimizerKind::kAdafactor) {
    EXPECT_EQ(hyper.adafactor_eps1, setting(3));
    EXPECT_EQ(hyper.adafactor_clip, setting(4));
    EXPECT_EQ(hyper.adafactor_decay, setting(5));
  } else {
    EXPECT_EQ(hyper.beta1, setting(0));
    EXPECT_EQ(hyper.beta2, setting(1));
    if (kind != OptimizerKind::kLion) {
      EXPECT_EQ(hyper.eps, setting(2));
    }
  }
  std::vector<bool> decay(params.size(), true);
  if (setting(6) >= 0) decay[static_cast<size_t>(setting(6))] = false;
  ParameterOptimizer optimizer(params, hyper, decay);
  const torch::Tensor scales = in.at("grad_scale");
  for (int64_t k = 0; k < scales.numel(); ++k) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = in.at(absl::StrCat("grad.", k, ".", i));
    }
    optimizer.Update(lr, scales[k].item<double>());
  }

  // 8-bit: a moment within an fp32 rounding of the midpoint between two codes may land on either
  // (the kernel's and the reference's roundings differ), so a few codes may differ by one.
  const double tolerance = kind == OptimizerKind::kAdamW8bit ? 1e-5 : 1e-6;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& expected = want.at(absl::StrCat("param.", i));
    EXPECT_LT((params[i] - expected).abs().max().item<double>(),
              tolerance * (1 + expected.abs().max().item<double>()))
        << "parameter " << i;
    const auto state = optimizer.core().State(static_cast<int>(i));
    for (const auto& [name, mine] : state) {
      const std::string key = absl::StrCat("state.", i, ".", name);
      ASSERT_EQ(want.count(key), 1u) << key << " is not in the reference's state";
      const torch::Tensor theirs = want.at(key).reshape({-1});
      ASSERT_EQ(mine.numel(), theirs.numel()) << key;
      if (mine.scalar_type() == torch::kUInt8) {
        const double same = mine.eq(theirs).to(torch::kDouble).mean().item<double>();
        EXPECT_GT(same, 0.999) << key;
        EXPECT_LE((mine.to(torch::kInt) - theirs.to(torch::kInt)).abs().max().item<int>(), 1)
            << key;
        continue;
      }
      EXPECT_LT((mine - theirs).abs().max().item<double>(),
                1e-5 * (1 + theirs.abs().max().item<double>()))
          << key;
    }
    int theirs = 0;
    for (const auto& [key, t] : want)
      theirs += absl::StartsWith(key, absl::StrCat("state.", i, ".")) ? 1 : 0;
    EXPECT_EQ(static_cast<size_t>(theirs), state.size()) << "parameter " << i;
  }
  if (kind == OptimizerKind::kAdamW8bit) {  // bitsandbytes' create_dynamic_map, bit for bit
    for (bool is_signed : {true, false}) {
      const torch::Tensor theirs = want.at(is_signed ? "map.signed" : "map.unsigned");
      const auto& mine = DynamicMap(is_signed);
      ASSERT_EQ(theirs.numel(), 256);
      for (int c = 0; c < 256; ++c) EXPECT_EQ(mine[c], theirs[c].item<float>()) << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, OptimizerReferenceTest,
    ::testing::Values(Case{OptimizerKind::kAdafactor, false}, Case{OptimizerKind::kLion, false},
                      Case{OptimizerKind::kAdamW8bit, false}, Case{OptimizerKind::kAdamW, false},
                      Case{OptimizerKind::kAdafactor, true}, Case{OptimizerKind::kLion, true},
                      Case{OptimizerKind::kAdamW8bit, true}, Case{OptimizerKind::kAdamW, true}),
    [](const auto& info) {
      std::string name = Name(info.param.kind);
      name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
      return name + (info.param.settings ? "WithSettings" : "");
    });

// The state each optimizer holds after a step of each model is what estimate-memory counts
// (common/job_config's TrainedParameterShapes and OptimizerStateBytes).
TEST(OptimizerStateTest, WhatTheOptimizersHoldIsWhatTheEstimateCounts) {
  struct Case {
    std::string kind;
    bool lora;
  };
  for (const Case& c :
       {Case{"gpt", false}, Case{"mlp", false}, Case{"llama", false}, Case{"llama", true}}) {
    ModelConfig m;
    m.kind = c.kind;
    m.n_layer = 2;
    m.n_head = 4;
    m.d_model = 64;
    m.seq_len = 16;
    m.vocab = 256;
    m.d_hidden = c.kind == "mlp" ? 96 : 176;
    m.n_kv_head = 2;
    ModelOptions options;
    if (c.lora) {
      options.lora.r = 4;
      options.lora.alpha = 8;
      options.lora.target_modules = {"q_proj", "v_proj", "down_proj"};
    }
    std::shared_ptr<LanguageModel> model = BuildModel(m, options, /*seed=*/1);
    const std::vector<torch::Tensor> trainable = TrainableParameters(*model);
    int64_t numel = 0;
    for (const auto& p : trainable) numel += p.numel();
    EXPECT_EQ(numel, c.lora ? LoraParameterCount(m, options.lora) : ModelParameterCount(m))
        << c.kind;
    for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdafactor,
                               OptimizerKind::kLion, OptimizerKind::kAdamW8bit}) {
      SlotOptimizer optimizer(
          HyperFor(kind, 0),
          [&] {
            std::vector<OptimizerSlot> slots;
            for (const auto& p : trainable) {
              slots.push_back(OptimizerSlot{p, 0, {{p.sizes().vec(), 0}}});
              p.mutable_grad() = torch::ones_like(p);
            }
            return slots;
          }(),
          nullptr);
      optimizer.Step(1e-3, 1);
      EXPECT_EQ(optimizer.StateBytes(),
                OptimizerStateBytes(kind, TrainedParameterShapes(m, options.lora), 1))
          << c.kind << (c.lora ? " lora " : " ") << Name(kind);
    }
  }
}

}  // namespace
}  // namespace trainyard::trainer
