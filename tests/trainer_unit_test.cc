// Unit tests of trainyard-trainer's pure parts and models, in process: parameter counts against
// common/job_config.h, the LR schedule, the sampler's sharding, activation checkpointing's
// gradients, the bucketed gradient reducer on one rank, the fused AdamW against
// torch::optim::AdamW, and the parameter-dump format.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "common/job_config.h"
#include "tests/testing/subprocess.h"
#include "worker/trainer/checkpoint/retention.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/comm/shm_allreduce.h"
#include "worker/trainer/io/data.h"
#include "worker/trainer/io/param_dump.h"
#include "worker/trainer/kernels/matmul_choice.h"
#include "worker/trainer/kernels/onednn_matmul.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/fused_adamw.h"
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/parallel/ddp.h"
#include "worker/trainer/parallel/fsdp.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

using ::testing::ElementsAre;

ModelConfig Gpt(int n_layer, int d_model, int n_head, int seq_len, int vocab, bool tie) {
  ModelConfig m;
  m.kind = "gpt";
  m.n_layer = n_layer;
  m.d_model = d_model;
  m.n_head = n_head;
  m.seq_len = seq_len;
  m.vocab = vocab;
  m.tie_weights = tie;
  return m;
}

// For failure messages.
std::string Describe(const ModelConfig& m) {
  return m.kind + " n_layer " + std::to_string(m.n_layer) + " d_model " +
         std::to_string(m.d_model) + " seq_len " + std::to_string(m.seq_len) + " vocab " +
         std::to_string(m.vocab) + (m.tie_weights ? " tied" : "");
}

int64_t Numel(torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  return n;
}

TEST(ModelTest, GptParameterCountMatchesSpecFormula) {
  for (const ModelConfig& m : {Gpt(2, 32, 2, 16, 256, false), Gpt(2, 32, 2, 16, 256, true),
                               Gpt(4, 64, 4, 128, 300, true), Gpt(1, 48, 3, 7, 1000, false)}) {
    auto model = BuildModel(m, {}, 1);
    EXPECT_EQ(Numel(*model), ModelParameterCount(m)) << Describe(m);
  }
}

TEST(ModelTest, MlpParameterCountMatchesSpecFormula) {
  for (int layers : {1, 3}) {
    ModelConfig m;
    m.kind = "mlp";
    m.n_layer = layers;
    m.d_model = 32;
    m.d_hidden = 96;
    m.seq_len = 16;
    m.vocab = 256;
    auto model = BuildModel(m, {}, 1);
    EXPECT_EQ(Numel(*model), ModelParameterCount(m)) << Describe(m);
  }
}

TEST(ModelTest, LlamaParameterCountMatchesSpecFormulaAndTheHfNames) {
  for (auto [kv_heads, tied, head_dim] :
       {std::tuple{4, false, 0}, std::tuple{2, true, 0}, std::tuple{1, false, 6}}) {
    ModelConfig m;
    m.kind = "llama";
    m.n_layer = 2;
    m.d_model = 32;
    m.n_head = 4;
    m.n_kv_head = kv_heads;
    m.head_dim = head_dim;
    m.d_hidden = 56;
    m.seq_len = 16;
    m.vocab = 96;
    m.tie_weights = tied;
    auto model = BuildModel(m, {}, 1);
    EXPECT_EQ(Numel(*model), ModelParameterCount(m)) << Describe(m);
    // Named as transformers names them, so checkpoints load by name.
    const auto params = model->named_parameters();
    EXPECT_TRUE(params.contains("model.layers.1.self_attn.k_proj.weight"));
    EXPECT_EQ(params["model.layers.1.self_attn.k_proj.weight"].size(0), kv_heads * m.HeadDim());
    EXPECT_EQ(params.contains("lm_head.weight"), !tied);
    EXPECT_EQ(model->BlockOf("model.layers.1.mlp.up_proj.weight"), 1);
    EXPECT_EQ(model->BlockOf("model.norm.weight"), -1);
  }
}

// Recomputing each layer in backward gives the same loss and gradients as keeping activations.
TEST(ModelTest, LlamaActivationCheckpointingChangesNothing) {
  ModelConfig m;
  m.kind = "llama";
  m.n_layer = 2;
  m.d_model = 32;
  m.n_head = 4;
  m.n_kv_head = 2;
  m.d_hidden = 56;
  m.seq_len = 16;
  m.vocab = 96;
  ModelOptions checkpointed;
  checkpointed.activation_checkpointing = true;
  auto a = BuildModel(m, {}, 3), b = BuildModel(m, checkpointed, 3);
  const torch::Tensor windows = torch::randint(0, 96, {2, 17}, torch::kLong);
  torch::Tensor la = a->Loss(windows), lb = b->Loss(windows);
  la.backward();
  lb.backward();
  EXPECT_EQ(la.item<float>(), lb.item<float>());
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(pa[i].grad().equal(pb[i].grad())) << i;
}

TEST(ModelTest, SameSeedSameParameters) {
  auto a = BuildModel(Gpt(2, 32, 2, 16, 256, false), {}, 7);
  auto b = BuildModel(Gpt(2, 32, 2, 16, 256, false), {}, 7);
  auto c = BuildModel(Gpt(2, 32, 2, 16, 256, false), {}, 8);
  auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(pa[i].equal(pb[i]));
  EXPECT_FALSE(pa[0].equal(pc[0]));
}

torch::Tensor Windows(int batch, int seq_len, int vocab) {
  torch::manual_seed(3);
  return torch::randint(vocab, {batch, seq_len + 1}, torch::kLong);
}

TEST(ModelTest, ActivationCheckpointingGivesTheSameLossAndGradients) {
  const ModelConfig m = Gpt(3, 32, 4, 16, 256, true);
  auto plain = BuildModel(m, {}, 5);
  ModelOptions ckpt_options;
  ckpt_options.activation_checkpointing = true;
  auto ckpt = BuildModel(m, ckpt_options, 5);
  const torch::Tensor batch = Windows(4, 16, 256);
  torch::Tensor l1 = plain->Loss(batch);
  torch::Tensor l2 = ckpt->Loss(batch);
  l1.backward();
  l2.backward();
  EXPECT_EQ(l1.item<float>(), l2.item<float>());
  auto p1 = plain->named_parameters(), p2 = ckpt->named_parameters();
  ASSERT_EQ(p1.size(), p2.size());
  for (const auto& item : p1) {
    const torch::Tensor g1 = item.value().grad(), g2 = p2[item.key()].grad();
    ASSERT_TRUE(g1.defined() && g2.defined()) << item.key();
    EXPECT_TRUE(torch::allclose(g1, g2, /*rtol=*/1e-6, /*atol=*/1e-9)) << item.key();
  }
}

// The GPT's logits against a plain, unoptimized transformer in double precision computed from the
// same parameters: full [t, t] scores with the causal mask, per-head softmax. The model works
// out attention in query blocks that skip the masked upper-right part, so the prefixes of every
// length (odd and even, below and above the blocking threshold) check that shortcut too.
torch::Tensor ReferenceGptLogits(LanguageModel& model, const ModelConfig& m,
                                 const torch::Tensor& tokens) {
  auto p = model.named_parameters();
  auto P = [&](const std::string& name) { return p[name].detach().to(torch::kDouble); };
  auto Ln = [&](const torch::Tensor& x, const std::string& name) {
    return torch::layer_norm(x, {m.d_model}, P(name + ".weight"), P(name + ".bias"), 1e-5);
  };
  auto Lin = [&](const torch::Tensor& x, const std::string& name) {
    return torch::linear(x, P(name + ".weight"),
                         p.contains(name + ".bias") ? P(name + ".bias") : torch::Tensor());
  };
  const int64_t t = tokens.size(0), d = m.d_model, h = m.n_head, hd = d / h;
  torch::Tensor x =
      P("tok_emb.weight").index_select(0, tokens) + P("pos_emb.weight").narrow(0, 0, t);
  const torch::Tensor future = torch::ones({t, t}, torch::kBool).triu(1);
  for (int i = 0; i < m.n_layer; ++i) {
    const std::string block = "blocks." + std::to_string(i);
    const torch::Tensor qkv = Lin(Ln(x, block + ".ln1"), block + ".qkv");  // [t, 3d]
    std::vector<torch::Tensor> heads;
    for (int64_t j = 0; j < h; ++j) {
      const torch::Tensor q = qkv.narrow(1, j * hd, hd), k = qkv.narrow(1, d + j * hd, hd),
                          v = qkv.narrow(1, 2 * d + j * hd, hd);
      const torch::Tensor scores =
          (q.matmul(k.t()) / std::sqrt(double(hd))).masked_fill(future, -INFINITY);
      heads.push_back(torch::softmax(scores, -1).matmul(v));
    }
    x = x + Lin(torch::cat(heads, 1), block + ".proj");
    x = x + Lin(torch::gelu(Lin(Ln(x, block + ".ln2"), block + ".fc")), block + ".fc_out");
  }
  return Lin(Ln(x, "ln_f"), "head");  // [t, vocab]
}

TEST(ModelTest, GptLogitsMatchAPlainCausalTransformerAtEveryPrefixLength) {
  const ModelConfig m = Gpt(2, 32, 4, 64, 256, false);
  auto model = BuildModel(m, {}, 7);
  torch::NoGradGuard no_grad;
  const torch::Tensor tokens = Windows(1, 63, 256).view({-1});  // 64 tokens
  const torch::Tensor reference = ReferenceGptLogits(*model, m, tokens);
  for (int64_t len = 1; len <= 64; ++len) {
    const torch::Tensor logits = model->NextTokenLogits(tokens.narrow(0, 0, len).view({1, len}));
    const torch::Tensor want = ReferenceGptLogits(*model, m, tokens.narrow(0, 0, len))[len - 1];
    EXPECT_TRUE(torch::allclose(logits.to(torch::kDouble), want, /*rtol=*/1e-5, /*atol=*/1e-5))
        << "prefix " << len << ": max diff " << (logits - want).abs().max().item<double>();
    // Causal: what comes after a position does not change its logits.
    EXPECT_TRUE(torch::allclose(want, reference[len - 1], 1e-9, 1e-9)) << "prefix " << len;
  }
}

// The oneDNN Linear against torch::linear (OpenBLAS) in double precision: output and the three
// gradients, for a 3-D input with bias, a 2-D one without, a transposed (non-contiguous) input,
// an input that needs no gradient, and a weight that is a view (as a tied head's or FSDP's).
TEST(OneDnnMatmulTest, MatchesTorchLinearForwardAndBackward) {
  ASSERT_TRUE(OneDnnMatmulsEnabled()) << "TRAINYARD_MATMUL=blas is set: nothing here is oneDNN";
  torch::manual_seed(3);
  struct Case {
    std::string name;
    torch::Tensor x, w, b;
  };
  const torch::Tensor storage = torch::randn({2, 48, 40});
  std::vector<Case> cases = {
      {"3-D input, bias", torch::randn({3, 17, 40}), torch::randn({24, 40}), torch::randn({24})},
      {"2-D input, no bias", torch::randn({50, 40}), torch::randn({8, 40}), torch::Tensor()},
      {"transposed input", torch::randn({40, 33}).t(), torch::randn({16, 40}), torch::randn({16})},
      {"weight is a view", torch::randn({5, 40}), storage[1].narrow(0, 4, 30), torch::randn({30})},
  };
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    const bool x_needs_grad = c.name != "2-D input, no bias";
    torch::Tensor x = c.x.detach().requires_grad_(x_needs_grad);
    torch::Tensor w = c.w.detach().requires_grad_(true);
    torch::Tensor b = c.b.defined() ? c.b.detach().requires_grad_(true) : c.b;
    torch::Tensor xd = c.x.to(torch::kDouble).requires_grad_(x_needs_grad);
    torch::Tensor wd = c.w.to(torch::kDouble).requires_grad_(true);
    torch::Tensor bd = c.b.defined() ? c.b.to(torch::kDouble).requires_grad_(true) : c.b;

    const torch::Tensor y = Linear(x, w, b);
    const torch::Tensor want = torch::linear(xd, wd, bd);
    ASSERT_EQ(y.sizes(), want.sizes());
    EXPECT_TRUE(torch::allclose(y.to(torch::kDouble), want, 1e-5, 1e-5));

    const torch::Tensor dy = torch::randn(y.sizes());
    y.backward(dy);
    want.backward(dy.to(torch::kDouble));
    EXPECT_TRUE(torch::allclose(w.grad().to(torch::kDouble), wd.grad(), 1e-5, 1e-4));
    if (b.defined()) {
      EXPECT_TRUE(torch::allclose(b.grad().to(torch::kDouble), bd.grad(), 1e-5, 1e-4));
    }
    if (x_needs_grad) {
      ASSERT_EQ(x.grad().sizes(), x.sizes());
      EXPECT_TRUE(torch::allclose(x.grad().to(torch::kDouble), xd.grad(), 1e-5, 1e-4));
    } else {
      EXPECT_FALSE(x.grad().defined());
    }
  }
}

// BatchedMatmul against torch::baddbmm in double: the attention's products on narrowed and
// transposed views, with and without a mask, and the gradients of both factors.
TEST(OneDnnMatmulTest, BatchedMatmulMatchesBaddbmmForwardAndBackward) {
  torch::manual_seed(4);
  const torch::Tensor qkv = torch::randn({6, 40, 16});  // [batch * heads, t, head_dim]
  const torch::Tensor mask = torch::full({40, 40}, -std::numeric_limits<float>::infinity()).triu(1);
  for (const int64_t row : {0, 20}) {
    SCOPED_TRACE(row);
    const int64_t rows = 20, keys = row + rows;
    torch::Tensor q = qkv.clone().requires_grad_(true), k = qkv.clone().requires_grad_(true);
    torch::Tensor qd = qkv.to(torch::kDouble).requires_grad_(true),
                  kd = qkv.to(torch::kDouble).requires_grad_(true);
    const torch::Tensor m = mask.slice(0, row, keys).slice(1, 0, keys);
    // scores = q k^T / 4 + mask, then p v with p = softmax(scores) and v = k.
    const torch::Tensor scores =
        BatchedMatmul(q.narrow(1, row, rows), k.narrow(1, 0, keys).transpose(1, 2), 0.25, m);
    const torch::Tensor scores_d = torch::baddbmm(m.to(torch::kDouble), qd.narrow(1, row, rows),
                                                  kd.narrow(1, 0, keys).transpose(1, 2), 1, 0.25);
    EXPECT_TRUE(torch::allclose(scores.to(torch::kDouble), scores_d, 1e-5, 1e-5));
    const torch::Tensor y =
        BatchedMatmul(torch::softmax(scores, -1), k.narrow(1, 0, keys), 1.0, torch::Tensor());
    const torch::Tensor y_d = torch::bmm(torch::softmax(scores_d, -1), kd.narrow(1, 0, keys));
    EXPECT_TRUE(torch::allclose(y.to(torch::kDouble), y_d, 1e-5, 1e-5));
    const torch::Tensor dy = torch::randn(y.sizes());
    y.backward(dy);
    y_d.backward(dy.to(torch::kDouble));
    EXPECT_TRUE(torch::allclose(q.grad().to(torch::kDouble), qd.grad(), 1e-5, 1e-4));
    EXPECT_TRUE(torch::allclose(k.grad().to(torch::kDouble), kd.grad(), 1e-5, 1e-4));
  }
}

TEST(OneDnnMatmulTest, FallsBackToTorchForOtherDtypesAndWrongShapes) {
  const torch::Tensor xd = torch::randn({4, 6}, torch::kDouble),
                      wd = torch::randn({3, 6}, torch::kDouble);
  EXPECT_TRUE(torch::equal(Linear(xd, wd, torch::Tensor()), torch::linear(xd, wd)));
  // torch's own error for mismatched sizes, not a oneDNN one.
  EXPECT_THROW(Linear(torch::randn({4, 5}), torch::randn({3, 6}), torch::Tensor()), c10::Error);
  EXPECT_THROW(BatchedMatmul(torch::randn({2, 4, 5}), torch::randn({2, 6, 3}), 1, torch::Tensor()),
               c10::Error);
  EXPECT_THROW(
      BatchedMatmul(torch::randn({2, 4, 5}), torch::randn({2, 5, 3}), 1, torch::zeros({3, 4})),
      c10::Error);
}

// The GEMMs of the model's shapes run on a JIT kernel, not oneDNN's slow reference loops.
TEST(OneDnnMatmulTest, ModelShapesUseJitKernels) {
  for (const auto& [in, out] : std::vector<std::pair<int64_t, int64_t>>{
           {256, 768}, {256, 256}, {256, 1024}, {1024, 256}, {256, 96}, {32, 256}}) {
    const std::string impls = LinearImplementations(1024, in, out, true);
    EXPECT_THAT(impls, ::testing::Not(::testing::HasSubstr("ref"))) << in << " -> " << out;
  }
  // The bench model's attention: 8 sequences x 4 heads, t 128, head_dim 64, two query blocks.
  EXPECT_THAT(AttentionImplementations(32, 128, 64, 0, 64),
              ::testing::Not(::testing::HasSubstr("ref")));
  EXPECT_THAT(AttentionImplementations(32, 128, 64, 64, 64),
              ::testing::Not(::testing::HasSubstr("ref")));
  EXPECT_THAT(DescribeMatmuls(), ::testing::StartsWith("Matmuls: oneDNN "));
}

// The path chosen by timing: the BLAS only when it beats oneDNN by more than the margin.
TEST(MatmulChoiceTest, TheBlasWinsOnlyByMoreThanTheMargin) {
  EXPECT_EQ(FasterPath(100, 50), MatmulPath::kBlas);
  EXPECT_EQ(FasterPath(100, 94.9), MatmulPath::kBlas);
  EXPECT_EQ(FasterPath(100, 95.1), MatmulPath::kOneDnn);  // within 5%: noise keeps oneDNN
  EXPECT_EQ(FasterPath(100, 100), MatmulPath::kOneDnn);
  EXPECT_EQ(FasterPath(50, 100), MatmulPath::kOneDnn);
  EXPECT_EQ(FasterPath(100, 80, 0.25), MatmulPath::kOneDnn);
  MatmulTiming t;
  t.onednn_ms = 12.34;
  t.blas_ms = 20;
  EXPECT_EQ(t.Describe(),
            "oneDNN: 12.3 ms a micro-batch's GEMMs (forward and backward), the BLAS 20.0 ms "
            "(timed at start)");
  t.path = MatmulPath::kBlas;
  t.blas_ms = 6;
  EXPECT_THAT(t.Describe(), ::testing::StartsWith("the BLAS: 6.0 ms a micro-batch's GEMMs"));
  t.path = MatmulPath::kOneDnn;
  t.blas_ms = 12;
  EXPECT_THAT(t.Describe(), ::testing::HasSubstr("within the 5% that keeps oneDNN"));
}

// TRAINYARD_MATMUL: auto (or unset, or empty) leaves the choice to the timing; onednn and blas pin
// it; anything else is refused, naming the variable (its value escaped).
TEST(MatmulChoiceTest, TheEnvironmentPinsThePathOrLeavesItToTheTiming) {
  const char* was = std::getenv("TRAINYARD_MATMUL");
  const std::string saved = was == nullptr ? "" : was;
  for (const auto& [value, want] : std::vector<std::pair<std::string, std::optional<MatmulPath>>>{
           {"", std::nullopt},
           {"auto", std::nullopt},
           {"onednn", MatmulPath::kOneDnn},
           {"blas", MatmulPath::kBlas}}) {
    ::setenv("TRAINYARD_MATMUL", value.c_str(), 1);
    absl::StatusOr<std::optional<MatmulPath>> got = MatmulPathFromEnvironment();
    ASSERT_TRUE(got.ok()) << value << ": " << got.status();
    EXPECT_EQ(*got, want) << value;
  }
  ::unsetenv("TRAINYARD_MATMUL");
  EXPECT_EQ(MatmulPathFromEnvironment().value(), std::nullopt);
  ::setenv("TRAINYARD_MATMUL", "mkl\nx", 1);
  absl::StatusOr<std::optional<MatmulPath>> bad = MatmulPathFromEnvironment();
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "TRAINYARD_MATMUL: \"mkl\\nx\" is none of auto, onednn, blas");
  if (was != nullptr) {
    ::setenv("TRAINYARD_MATMUL", saved.c_str(), 1);
  } else {
    ::unsetenv("TRAINYARD_MATMUL");
  }
}

// What the timing runs is the model's own GEMMs: each Linear shape (counted), a tied head, the
// attention on every block's heads; the MLP's rows are one a window and it has no attention.
TEST(MatmulChoiceTest, TheModelsGemmsAreItsLinearShapesHeadAndAttention) {
  const ModelConfig gpt = Gpt(3, 64, 4, 32, 256, /*tie=*/true);
  auto model = BuildModel(gpt, ModelOptions(), 1);
  const MatmulWork work = GemmWorkOf(*model, gpt, 8, /*fp32_linear=*/true);
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, int64_t> linear;  // (rows, in, out, bias)
  for (const LinearWork& l : work.linear) linear[{l.rows, l.in, l.out, l.bias}] += l.count;
  const std::map<std::tuple<int64_t, int64_t, int64_t, bool>, int64_t> want = {
      {{256, 64, 192, true}, 3},   // qkv
      {{256, 64, 64, true}, 3},    // proj
      {{256, 64, 256, true}, 3},   // fc
      {{256, 256, 64, true}, 3},   // fc_out
      {{256, 64, 256, false}, 1},  // the head, tied to the token embedding
  };
  EXPECT_EQ(linear, want);
  ASSERT_EQ(work.attention.size(), 1u);
  EXPECT_EQ(work.attention[0].batch_heads, 8 * 4);
  EXPECT_EQ(work.attention[0].seq_len, 32);
  EXPECT_EQ(work.attention[0].head_dim, 16);
  EXPECT_EQ(work.attention[0].count, 3);
  // bf16 Linear layers are torch's: the attention only.
  EXPECT_TRUE(GemmWorkOf(*model, gpt, 8, /*fp32_linear=*/false).linear.empty());

  ModelConfig mlp = Gpt(2, 32, 0, 16, 256, false);
  mlp.kind = "mlp";
  mlp.d_hidden = 48;
  auto mlp_model = BuildModel(mlp, ModelOptions(), 1);
  const MatmulWork mlp_work = GemmWorkOf(*mlp_model, mlp, 8, true);
  EXPECT_TRUE(mlp_work.attention.empty());
  ASSERT_FALSE(mlp_work.linear.empty());
  for (const LinearWork& l : mlp_work.linear) EXPECT_EQ(l.rows, 8) << l.in << " -> " << l.out;
}

// The timing runs both paths and leaves the process's path as it was; its choice is FasterPath
// of what it measured.
TEST(MatmulChoiceTest, TimingMeasuresBothPathsAndLeavesThePathAlone) {
  ASSERT_TRUE(OneDnnMatmulsAvailable());
  MatmulWork work;
  work.linear.push_back({512, 64, 128, true, 2});
  work.attention.push_back({8, 32, 16, 2});
  const bool before = OneDnnMatmulsEnabled();
  const MatmulTiming t = TimeMatmulPaths(work, 3);
  EXPECT_EQ(OneDnnMatmulsEnabled(), before);
  EXPECT_GT(t.onednn_ms, 0);
  EXPECT_GT(t.blas_ms, 0);
  EXPECT_EQ(t.path, FasterPath(t.onednn_ms, t.blas_ms));
  EXPECT_EQ(TimeMatmulPaths(MatmulWork(), 1).onednn_ms, 0);  // nothing to time
}

TEST(ModelTest, Bf16LossIsCloseToFp32) {
  const ModelConfig m = Gpt(2, 32, 2, 16, 256, false);
  ModelOptions bf16;
  bf16.bf16 = true;
  auto a = BuildModel(m, {}, 5);
  auto b = BuildModel(m, bf16, 5);
  const torch::Tensor batch = Windows(4, 16, 256);
  const float fp32_loss = a->Loss(batch).item<float>();
  torch::Tensor bf16_loss = b->Loss(batch);
  EXPECT_NEAR(bf16_loss.item<float>(), fp32_loss, 0.02 * fp32_loss);
  bf16_loss.backward();
  for (const auto& p : b->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);  // fp32 master gradients
  }
}

TEST(ScheduleTest, WarmsUpLinearlyThenDecaysToATenth) {
  EXPECT_DOUBLE_EQ(LearningRate(0, 100, 10, 1e-3), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRate(4, 100, 10, 1e-3), 5e-4);
  EXPECT_DOUBLE_EQ(LearningRate(9, 100, 10, 1e-3), 1e-3);
  EXPECT_DOUBLE_EQ(LearningRate(10, 100, 10, 1e-3), 1e-3);
  EXPECT_NEAR(LearningRate(55, 100, 10, 1e-3), 0.55e-3, 1e-12);  // halfway down the cosine
  EXPECT_NEAR(LearningRate(100, 100, 10, 1e-3), 1e-4, 1e-12);
  EXPECT_NEAR(LearningRate(0, 50, 0, 2e-3), 2e-3, 1e-12);  // no warmup
  EXPECT_GT(LearningRate(30, 100, 10, 1e-3), LearningRate(31, 100, 10, 1e-3));
}

// checkpoint.keep_last: the newest checkpoints up to the one `latest` names are kept, a newer one
// (an attempt that wrote past it) too, and removals a crash interrupted are finished.
TEST(RetentionTest, KeepsTheNewestAndNeverWhatLatestNames) {
  testing::TempDir dir;
  const std::string d = dir.path();
  for (int step : {2, 4, 6, 8, 10})
    std::filesystem::create_directories(d + "/step-" + std::to_string(step));
  std::filesystem::create_directories(d + "/.step-1.removing/sub");  // a crash halfway
  std::filesystem::create_directories(d + "/export");
  std::ofstream(d + "/step-4/model.pt") << "x";
  auto names = [&] {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(d)) {
      out.push_back(e.path().filename().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  // Nothing published yet: nothing is known to be safe to remove.
  auto none = PruneCheckpoints(d, {1});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->removed.empty());
  EXPECT_EQ(none->kept.size(), 5u);
  std::ofstream(d + "/latest") << "step-8\n";
  auto pruned = PruneCheckpoints(d, {2});
  ASSERT_TRUE(pruned.ok()) << pruned.status();
  EXPECT_THAT(pruned->removed, ::testing::ElementsAre("step-2", "step-4"));
  EXPECT_THAT(names(), ::testing::ElementsAre("export", "latest", "step-10", "step-6", "step-8"));
  ASSERT_EQ(pruned->kept.size(), 3u);
  EXPECT_EQ(pruned->kept[0].name, "step-6");
  EXPECT_EQ(pruned->kept[2].step, 10);
  // keep_last 0 keeps everything.
  pruned = PruneCheckpoints(d, {0});
  ASSERT_TRUE(pruned.ok());
  EXPECT_TRUE(pruned->removed.empty());
  pruned = PruneCheckpoints(d, {1});
  ASSERT_TRUE(pruned.ok());
  EXPECT_THAT(pruned->removed, ::testing::ElementsAre("step-6"));
  EXPECT_THAT(names(), ::testing::ElementsAre("export", "latest", "step-10", "step-8"));
}

// checkpoint.keep_best: besides the newest keep_last, the checkpoint whose meta.json records the
// lowest eval_loss (the newest of equals); checkpoints without one never count as best.
TEST(RetentionTest, KeepBestKeepsTheLowestEvalLossBesidesTheNewest) {
  testing::TempDir dir;
  const std::string d = dir.path();
  const std::map<int, std::string> metas = {{2, R"({"step": 2, "eval_loss": 3.0})"},
                                            {4, R"({"step": 4, "eval_loss": 1.5})"},
                                            {6, R"({"step": 6, "eval_loss": 2.0})"},
                                            {8, R"({"step": 8, "eval_loss": 1.5})"},
                                            {10, R"({"step": 10})"},
                                            {12, R"({"step": 12, "eval_loss": 2.5})"}};
  for (const auto& [step, meta] : metas) {
    const std::string folder = d + "/step-" + std::to_string(step);
    std::filesystem::create_directories(folder);
    std::ofstream(folder + "/meta.json") << meta;
  }
  std::ofstream(d + "/latest") << "step-12\n";
  auto pruned = PruneCheckpoints(d, {1, /*keep_best=*/true});
  ASSERT_TRUE(pruned.ok()) << pruned.status();
  // The best is step 8 (1.5, newer than step 4's 1.5); the newest is 12.
  EXPECT_THAT(pruned->removed, ::testing::ElementsAre("step-2", "step-4", "step-6", "step-10"));
  ASSERT_EQ(pruned->kept.size(), 2u);
  EXPECT_EQ(pruned->kept[0].step, 8);
  EXPECT_EQ(pruned->kept[0].eval_loss, 1.5);
  EXPECT_EQ(pruned->kept[1].step, 12);
  EXPECT_EQ(pruned->kept[1].eval_loss, 2.5);
  // Without keep_best the best goes too.
  pruned = PruneCheckpoints(d, {1, false});
  ASSERT_TRUE(pruned.ok());
  EXPECT_THAT(pruned->removed, ::testing::ElementsAre("step-8"));
  EXPECT_EQ(CheckpointEvalLoss(d + "/step-12"), 2.5);
  EXPECT_EQ(CheckpointEvalLoss(d + "/step-8"), std::nullopt);
}

TEST(SamplerTest, RankShardsAreDisjointAndCoverTheGlobalBatch) {
  const int world = 4, micro = 3, accum = 2;
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < world; ++r) ranks.emplace_back(100, 9, micro, accum, world, r);
  DistributedSampler global(100, 9, micro, accum, world, 0);
  for (int64_t step : {0, 1, 4, 7}) {  // step 4 crosses into the second epoch (24 per step)
    std::vector<int64_t> joined;
    for (int r = 0; r < world; ++r) {
      for (int m = 0; m < accum; ++m) {
        auto part = ranks[r].MicroBatch(step, m);
        EXPECT_EQ(part.size(), static_cast<size_t>(micro));
        joined.insert(joined.end(), part.begin(), part.end());
      }
    }
    EXPECT_EQ(joined, global.GlobalBatch(step)) << step;
    if (step == 0) {
      EXPECT_EQ(std::set<int64_t>(joined.begin(), joined.end()).size(), joined.size());
    }
  }
}

TEST(SamplerTest, EachEpochIsAPermutationThatDependsOnSeedAndEpoch) {
  DistributedSampler s(50, 1, 5, 1, 1, 0);
  std::vector<int64_t> e0, e1;
  for (int i = 0; i < 50; ++i) e0.push_back(s.StreamAt(i));
  for (int i = 50; i < 100; ++i) e1.push_back(s.StreamAt(i));
  std::vector<int64_t> sorted0 = e0, sorted1 = e1;
  std::sort(sorted0.begin(), sorted0.end());
  std::sort(sorted1.begin(), sorted1.end());
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(sorted0[i], i);
    EXPECT_EQ(sorted1[i], i);
  }
  EXPECT_NE(e0, e1);
  DistributedSampler other_seed(50, 2, 5, 1, 1, 0);
  EXPECT_NE(other_seed.StreamAt(0) * 100 + other_seed.StreamAt(1),
            s.StreamAt(0) * 100 + s.StreamAt(1));
}

TEST(SamplerTest, SingleRankWithWholeBatchEqualsTwoRanksWithHalves) {
  DistributedSampler one(40, 3, 8, 1, 1, 0);
  DistributedSampler r0(40, 3, 4, 1, 2, 0), r1(40, 3, 4, 1, 2, 1);
  for (int64_t step = 0; step < 6; ++step) {
    auto a = r0.MicroBatch(step, 0), b = r1.MicroBatch(step, 0);
    a.insert(a.end(), b.begin(), b.end());
    EXPECT_EQ(a, one.MicroBatch(step, 0));
  }
}

TEST(DataTest, NumSamplesCountsNonOverlappingWindows) {
  EXPECT_EQ(NumSamples(33, 32), 1);
  EXPECT_EQ(NumSamples(32, 32), 0);
  EXPECT_EQ(NumSamples(65, 32), 2);
  EXPECT_EQ(NumSamples(64, 32), 1);
}

TEST(DataTest, Uint16TokensAtOrAboveVocabAreRejectedNamingTheFile) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/tokens.bin";
  {
    std::ofstream f(path, std::ios::binary);
    const uint16_t tokens[] = {1, 2, 300, 4};
    f.write(reinterpret_cast<const char*>(tokens), sizeof(tokens));
  }
  auto ok = TokenData::Load(path, "uint16", 301);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tokens(), (std::vector<int32_t>{1, 2, 300, 4}));
  auto bad = TokenData::Load(path, "uint16", 300);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr(path));
  auto missing = TokenData::Load(dir.path() + "/nope", "bytes", 256);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST(GradientReducerTest, OneRankKeepsGradientsAndSplitsBuckets) {
  auto comm = MakeLocalCommunicator();
  auto model = BuildModel(Gpt(2, 32, 2, 16, 256, false), {}, 1);
  // 10 KiB buckets: several of them for this ~35k-parameter model.
  GradientReducer reducer(model->parameters(), *comm, 0.01, 0.01);
  EXPECT_GT(reducer.num_buckets(), 5);
  EXPECT_EQ(reducer.bytes_per_step(), Numel(*model) * 4);
  reducer.Prepare(true);
  model->Loss(Windows(2, 16, 256)).backward();
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.grad().clone());
  reducer.Finish();
  auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].grad().equal(before[i]));
  // The gradients are views of the buckets (no copy back): neighbours share a buffer.
  int shared = 0;
  for (size_t i = 1; i < params.size(); ++i) {
    shared += params[i].grad().storage().data() == params[i - 1].grad().storage().data();
  }
  EXPECT_GT(shared, 0);

  // Without setting the gradients to none, the next backward accumulates into the views, and
  // the sums are still right.
  reducer.Prepare(true);
  model->Loss(Windows(2, 16, 256)).backward();
  reducer.Finish();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i].grad().allclose(2 * before[i], 1e-6, 1e-7)) << i;
  }
}

// The fused Highway AdamW against torch::optim::AdamW::step: same updates and state (to fp32
// rounding), with the clipping scale applied to the gradients in the fused pass.
TEST(FusedAdamWTest, MatchesTorchAdamWWithClippingAndWeightDecay) {
  torch::manual_seed(7);
  std::vector<torch::Tensor> ours = {torch::randn({1000, 70}), torch::randn({3}),
                                     torch::randn({65537})};
  std::vector<torch::Tensor> theirs;
  for (auto& p : ours) theirs.push_back(p.clone().set_requires_grad(true));
  for (auto& p : ours) p.set_requires_grad(true);
  const auto options =
      torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
  torch::optim::AdamW fused(ours, options), reference(theirs, options);
  const double scale = 0.37;
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < ours.size(); ++i) {
      torch::Tensor g = torch::randn_like(ours[i]);
      ours[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g * scale;
    }
    FusedAdamWStep(fused, 1e-2, scale);
    reference.step();
  }
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_TRUE(ours[i].allclose(theirs[i], 1e-6, 1e-7)) << i;
    const auto key = [](const torch::Tensor& p) { return OptimizerStateKey(p); };
    auto& a = static_cast<torch::optim::AdamWParamState&>(*fused.state().at(key(ours[i])));
    auto& b = static_cast<torch::optim::AdamWParamState&>(*reference.state().at(key(theirs[i])));
    EXPECT_EQ(a.step(), 5);
    // Absolute: m is a sum of terms of either sign (~0.1 here), and the kernel follows Python's
    // lerp where LibTorch's C++ AdamW multiplies and adds.
    EXPECT_TRUE(a.exp_avg().allclose(b.exp_avg(), 1e-6, 1e-7)) << i;
    EXPECT_TRUE(a.exp_avg_sq().allclose(b.exp_avg_sq(), 1e-6, 1e-12)) << i;
  }
}

// Two real Gloo ranks in one process (threads, a shared in-memory store).
template <typename Fn>
void RunTwoGlooRanks(Fn fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto comm = MakeGlooCommunicator(store, rank, 2, "127.0.0.1", std::chrono::seconds(30));
      ASSERT_TRUE(comm.ok()) << comm.status();
      fn(**comm);
    });
  }
  for (auto& t : threads) t.join();
}

// A rendezvous through files in a directory: works across threads and forked processes alike.
ShmAllReduce::Rendezvous FileRendezvous(const std::string& dir) {
  auto path = [dir](std::string key) {
    std::replace(key.begin(), key.end(), '/', '_');
    return dir + "/" + key;
  };
  ShmAllReduce::Rendezvous r;
  r.set = [path](const std::string& key, const std::string& value) {
    std::ofstream(path(key) + ".tmp") << value;
    std::filesystem::rename(path(key) + ".tmp", path(key));
  };
  r.get = [path](const std::string& key) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!std::filesystem::exists(path(key)) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));  // a file appearing has no event to wait on
    }
    std::ifstream in(path(key));
    std::string value;
    std::getline(in, value);
    return value;
  };
  return r;
}

TEST(ShmAllReduceTest, SumsEveryRanksArraysOverSeveralChunks) {
  testing::TempDir dir;
  constexpr int kRanks = 3;
  constexpr int64_t kChunk = 64;
  const std::vector<int64_t> sizes = {0, 1, kChunk, 2 * kChunk + 37, 1000};
  std::vector<std::vector<std::vector<float>>> data(kRanks);
  std::vector<std::thread> ranks;
  std::vector<absl::Status> status(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      auto shm =
          ShmAllReduce::Create(FileRendezvous(dir.path()), r, kRanks, absl::Seconds(30), kChunk);
      if (!shm.ok()) {
        status[r] = shm.status();
        return;
      }
      for (int64_t n : sizes) {
        std::vector<float>& v = data[r].emplace_back(n);
        for (int64_t i = 0; i < n; ++i) v[i] = float((r + 1) * 1000 + i % 97);  // exact sums
        if (status[r].ok()) status[r] = (*shm)->SumInPlace(v.data(), n);
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    for (size_t k = 0; k < sizes.size(); ++k) {
      for (int64_t i = 0; i < sizes[k]; ++i) {
        ASSERT_EQ(data[r][k][i], float(6000 + 3 * (i % 97)))
            << "rank " << r << " size " << sizes[k] << " element " << i;
      }
    }
  }
  // Rank 0 removed the segment's name once all had it mapped.
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_EQ(entry.path().filename().string().find(absl::StrCat("trainyard-allreduce-", getpid())),
              std::string::npos)
        << entry.path();
  }
}

// Rank 0 and rank 1 of a 2-rank segment in `dir`, rank 1 never calling SumInPlace.
struct PairWithIdlePeer {
  std::unique_ptr<ShmAllReduce> shm, idle;
};
PairWithIdlePeer ConnectWithIdlePeer(const std::string& dir, absl::Duration timeout) {
  PairWithIdlePeer pair;
  std::thread peer(
      [&] { pair.idle = *ShmAllReduce::Create(FileRendezvous(dir), 1, 2, timeout, 64); });
  auto shm = ShmAllReduce::Create(FileRendezvous(dir), 0, 2, timeout, 64);
  peer.join();
  EXPECT_TRUE(shm.ok()) << shm.status();
  if (shm.ok()) pair.shm = *std::move(shm);
  return pair;
}

TEST(ShmAllReduceTest, APeerThatNeverComesTimesOut) {
  testing::TempDir dir;
  PairWithIdlePeer pair = ConnectWithIdlePeer(dir.path(), absl::Milliseconds(300));
  ASSERT_NE(pair.shm, nullptr);
  auto& shm = pair.shm;
  std::vector<float> v(10, 1.0f);
  const absl::Status s = shm->SumInPlace(v.data(), 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("did not arrive within 300ms"));
  EXPECT_EQ(shm->SumInPlace(v.data(), 10).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ShmAllReduceTest, AbortEndsAWaitForAPeerThatStaysAway) {
  testing::TempDir dir;
  PairWithIdlePeer pair = ConnectWithIdlePeer(dir.path(), absl::Seconds(60));
  ASSERT_NE(pair.shm, nullptr);
  auto& shm = pair.shm;
  std::vector<float> v(10, 1.0f);
  absl::Status s;
  const absl::Time start = absl::Now();
  std::thread waiter([&] { s = shm->SumInPlace(v.data(), 10); });
  shm->Abort();  // before or during the wait: either way it ends
  waiter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
}

TEST(ShmAllReduceTest, APeerProcessThatDiedFailsTheOthersAtOnce) {
  testing::TempDir dir;
  const pid_t child = fork();
  if (child == 0) {  // rank 1: maps the segment, then exits without taking part
    auto shm =
        ShmAllReduce::Create(FileRendezvous(dir.path()), 1, 2, absl::Seconds(60), /*chunk=*/64);
    _exit(shm.ok() ? 0 : 1);
  }
  ASSERT_GT(child, 0);
  auto shm = ShmAllReduce::Create(FileRendezvous(dir.path()), 0, 2, absl::Seconds(60), 64);
  int child_status = 0;
  ASSERT_EQ(waitpid(child, &child_status, 0), child);
  ASSERT_TRUE(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0);
  ASSERT_TRUE(shm.ok()) << shm.status();
  std::vector<float> v(10, 1.0f);
  const absl::Time start = absl::Now();
  const absl::Status s = (*shm)->SumInPlace(v.data(), 10);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "waited for the timeout, not the pid";
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr(absl::StrCat("rank 1 of this host (pid ", child, ") is gone")));
}

TEST(CommunicatorTest, RingReduceScatterSumsEachRanksChunkWithUnevenCounts) {
  for (const std::vector<int64_t>& counts :
       {std::vector<int64_t>{5, 3}, std::vector<int64_t>{0, 7}, std::vector<int64_t>{4, 0}}) {
    RunTwoGlooRanks([&](Communicator& comm) {
      const int64_t total = counts[0] + counts[1];
      // Rank r holds (r + 1) * (i + 1) at element i: the sum is 3 * (i + 1).
      torch::Tensor flat =
          torch::arange(1, total + 1, torch::kFloat) * static_cast<float>(comm.rank() + 1);
      torch::Tensor mine = comm.ReduceScatterSum(flat, counts);
      const int64_t first = comm.rank() == 0 ? 0 : counts[0];
      ASSERT_EQ(mine.numel(), counts[comm.rank()]);
      for (int64_t i = 0; i < mine.numel(); ++i) {
        EXPECT_EQ(mine[i].item<float>(), 3.0f * (first + i + 1)) << "rank " << comm.rank();
      }
      // Bandwidth-optimal: each rank sends only the other rank's chunk.
      EXPECT_EQ(comm.bytes_sent(), counts[1 - comm.rank()] * 4);
    });
  }
}

TEST(CommunicatorTest, AllGatherReturnsEveryRanksTensorInRankOrder) {
  RunTwoGlooRanks([](Communicator& comm) {
    auto parts = comm.AllGather(torch::full({3}, static_cast<float>(comm.rank() + 10)));
    ASSERT_EQ(parts.size(), 2u);
    EXPECT_TRUE(parts[0].equal(torch::full({3}, 10.0f)));
    EXPECT_TRUE(parts[1].equal(torch::full({3}, 11.0f)));
    EXPECT_EQ(comm.bytes_sent(), 3 * 4);
  });
}

TEST(CommunicatorTest, AllGatherIntoFillsConsecutiveChunksOfOneBuffer) {
  RunTwoGlooRanks([](Communicator& comm) {
    torch::Tensor flat = torch::zeros({6});
    comm.AllGatherInto(torch::full({3}, static_cast<float>(comm.rank() + 1)),
                       {flat.narrow(0, 0, 3), flat.narrow(0, 3, 3)});
    EXPECT_TRUE(flat.equal(torch::tensor({1.0f, 1.0f, 1.0f, 2.0f, 2.0f, 2.0f})));
    EXPECT_EQ(comm.bytes_sent(), 3 * 4);
  });
}

TEST(FsdpWrapTest, TransformerPolicyMakesEveryBlockAUnit) {
  EXPECT_THAT(WrapBlocks({10, 10, 10}, WrapPolicy::kTransformerBased, 1000),
              ElementsAre(std::pair(0, 0), std::pair(1, 1), std::pair(2, 2)));
}

TEST(FsdpWrapTest, SizePolicyGroupsBlocksAndLeavesTheRestToTheRoot) {
  // 4 + 4 reaches 8; 9 alone does; the last 3 never reach it and stay in the root.
  EXPECT_THAT(WrapBlocks({4, 4, 9, 3}, WrapPolicy::kSizeBased, 8),
              ElementsAre(std::pair(0, 1), std::pair(2, 2)));
  EXPECT_THAT(WrapBlocks({4, 4}, WrapPolicy::kSizeBased, 100), ::testing::IsEmpty());
}

TEST(ModelTest, BlockOfNamesEachParametersBlock) {
  auto gpt = BuildModel(Gpt(2, 32, 2, 16, 256, false), {}, 1);
  EXPECT_EQ(gpt->NumBlocks(), 2);
  std::set<int> blocks;
  for (const auto& item : gpt->named_parameters()) blocks.insert(gpt->BlockOf(item.key()));
  EXPECT_THAT(blocks, ElementsAre(-1, 0, 1));
  EXPECT_EQ(gpt->BlockOf("blocks.1.qkv.weight"), 1);
  EXPECT_EQ(gpt->BlockOf("tok_emb.weight"), -1);
  ModelConfig mlp = Gpt(3, 16, 1, 8, 256, false);
  mlp.kind = "mlp";
  mlp.d_hidden = 24;
  auto m = BuildModel(mlp, {}, 1);
  EXPECT_EQ(m->NumBlocks(), 3);
  EXPECT_EQ(m->BlockOf("up2.weight"), 2);
  EXPECT_EQ(m->BlockOf("down0.bias"), 0);
  EXPECT_EQ(m->BlockOf("head.weight"), -1);
}

TEST(ModelTest, UnmaterializedModelHasShapesButNoBytes) {
  ModelOptions options;
  options.materialize = false;
  auto model = BuildModel(Gpt(2, 32, 2, 16, 256, false), options, 1);
  auto full = BuildModel(Gpt(2, 32, 2, 16, 256, false), {}, 1);
  auto a = model->named_parameters(), b = full->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].value().sizes(), b[i].value().sizes()) << a[i].key();
    EXPECT_EQ(a[i].value().storage().nbytes(), 0u) << a[i].key();
  }
}

TEST(ModelTest, FreedStorageComesBackForEveryViewThatSharesIt) {
  torch::Tensor flat = torch::arange(6, torch::kFloat);
  torch::Tensor view = flat.narrow(0, 2, 2).view({1, 2});
  FreeStorage(flat);
  EXPECT_EQ(view.storage().nbytes(), 0u);
  AllocateStorage(flat, 6 * sizeof(float));
  flat.copy_(torch::arange(10, 16, torch::kFloat));
  EXPECT_TRUE(view.equal(torch::tensor({{12.0f, 13.0f}})));
}

TEST(ParamDumpTest, RoundTrips) {
  testing::TempDir dir;
  std::vector<DumpedParam> params = {{"b", {2, 2}, {1, 2, 3, 4}}, {"a", {3}, {5, 6, 7}}};
  ASSERT_TRUE(WriteParamDump(dir.path() + "/d", params).ok());
  auto read = ReadParamDump(dir.path() + "/d");
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[0].name, "a");  // sorted by name
  EXPECT_EQ((*read)[1].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ((*read)[1].values, (std::vector<float>{1, 2, 3, 4}));
}

// A GPU steps Lion in tensor operations over flat views of its slots; on CPU slots that path
// (UseDeviceArithmetic) gives the CPU loop's parameters and state to fp32 rounding, for whole
// parameters of any shape, with weight decay and a gradient scale, over several steps.
TEST(SlotOptimizerTest, LionOnTheDeviceStepsAsTheCpuLoop) {
  torch::manual_seed(3);
  const std::vector<std::vector<int64_t>> shapes = {{7}, {16, 12}, {2, 3, 5}};
  std::vector<OptimizerSlot> loop_slots, device_slots;
  for (const auto& shape : shapes) {
    const torch::Tensor p = torch::randn(shape);
    loop_slots.push_back({p.clone(), 0, {{shape, 0}}});
    device_slots.push_back({p.clone(), 0, {{shape, 0}}});
  }
  SlotOptimizer loop(HyperFor(OptimizerKind::kLion, 0.1), loop_slots, nullptr);
  SlotOptimizer device(HyperFor(OptimizerKind::kLion, 0.1), device_slots, nullptr);
  device.UseDeviceArithmetic();
  for (int k = 0; k < 4; ++k) {
    for (size_t j = 0; j < shapes.size(); ++j) {
      const torch::Tensor g = torch::randn(shapes[j]);
      loop_slots[j].param.mutable_grad() = g.clone();
      device_slots[j].param.mutable_grad() = g.clone();
    }
    loop.Step(1e-2, 0.5);
    device.Step(1e-2, 0.5);
  }
  for (size_t j = 0; j < shapes.size(); ++j) {
    EXPECT_TRUE(torch::allclose(loop_slots[j].param, device_slots[j].param, 1e-6, 1e-7)) << j;
    EXPECT_TRUE(torch::allclose(loop.State(static_cast<int>(j)).at("exp_avg"),
                                device.State(static_cast<int>(j)).at("exp_avg"), 1e-6, 1e-7))
        << j;
    // The update moved every parameter (sign(c) is ±1 almost surely).
    EXPECT_FALSE(torch::equal(device_slots[j].param, torch::zeros(shapes[j])));
  }
  EXPECT_THROW(
      SlotOptimizer(HyperFor(OptimizerKind::kAdafactor, 0), {}, nullptr).UseDeviceArithmetic(),
      c10::Error);
}

// Optimizer slots that are the two shards of a flat buffer of parameters (FSDP's view) step as

// A GPU steps Adafactor and 8-bit AdamW through host copies of its slots (StepOnHost); on CPU
// slots that path (UseHostStepping) gives the CPU loop's parameters and state exactly, for whole
// parameters of several shapes (a large one quantized, a small one in fp32), with weight decay, a
// gradient scale and a slot without a gradient in one step, and leaves the slots' own tensors
// (not their host copies) holding the result.
TEST(SlotOptimizerTest, HostSteppedAdafactorAndEightBitAdamWStepAsTheCpuLoop) {
  const std::vector<std::vector<int64_t>> shapes = {{7}, {96, 80}, {2, 3, 5}};
  for (OptimizerKind kind : {OptimizerKind::kAdafactor, OptimizerKind::kAdamW8bit}) {
    SCOPED_TRACE(Name(kind));
    torch::manual_seed(5);
    std::vector<OptimizerSlot> loop_slots, host_slots;
    std::vector<torch::Tensor> initial;
    for (const auto& shape : shapes) {
      initial.push_back(torch::randn(shape));
      loop_slots.push_back({initial.back().clone(), 0, {{shape, 0}}});
      host_slots.push_back({initial.back().clone(), 0, {{shape, 0}}});
    }
    SlotOptimizer loop(HyperFor(kind, 0.1), loop_slots, nullptr);
    SlotOptimizer host(HyperFor(kind, 0.1), host_slots, nullptr);
    host.UseHostStepping();
    for (int k = 0; k < 4; ++k) {
      for (size_t j = 0; j < shapes.size(); ++j) {
        const bool none = k == 2 && j == 0;  // no gradient: left alone
        const torch::Tensor g = torch::randn(shapes[j]);
        loop_slots[j].param.mutable_grad() = none ? torch::Tensor() : g.clone();
        host_slots[j].param.mutable_grad() = none ? torch::Tensor() : g.clone();
      }
      loop.Step(1e-2, 0.5);
      host.Step(1e-2, 0.5);
    }
    for (size_t j = 0; j < shapes.size(); ++j) {
      SCOPED_TRACE(j);
      EXPECT_TRUE(torch::equal(loop_slots[j].param, host_slots[j].param));
      EXPECT_FALSE(torch::equal(initial[j], host_slots[j].param));  // it trained
      const auto a = loop.State(static_cast<int>(j)), b = host.State(static_cast<int>(j));
      ASSERT_EQ(a.size(), b.size());
      for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
      // The slot's gradient is still its own.
      EXPECT_TRUE(host_slots[j].param.grad().defined());
    }
    EXPECT_EQ(host.step(), 4);
  }
}
// the whole parameters do: Lion and Adafactor (its statistics summed over the two ranks) to
// rounding; 8-bit AdamW exactly, but for the one block of a parameter that the shard boundary
// cuts, whose two parts have absmaxes of their own. The cut falls inside a row of a matrix; the
// buffer holds a vector, a 3-D tensor and a second matrix too, and padding. Then 8-bit state goes
// through Elementwise (resharding's form) and back within the quantization's resolution.
TEST(SlotOptimizerTest, ShardsOfAFlatBufferStepAsTheWholeParameters) {
  const std::vector<std::vector<int64_t>> shapes = {{97}, {3, 20, 30}, {40, 130}, {64, 80}};
  std::vector<OptimizerSlot::Param> layout;
  int64_t numel = 0;
  for (const auto& shape : shapes) {
    layout.push_back({shape, numel});
    numel += std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  }
  const int64_t shard = (numel + 1) / 2;  // 6109: element 4212 of the 40x130 matrix
  const int64_t cut_param = 2, cut_block_begin = layout[2].offset + 4096;
  constexpr int kSteps = 3;
  torch::manual_seed(5);
  const torch::Tensor initial = torch::randn({2 * shard});
  std::vector<torch::Tensor> grads;
  for (int k = 0; k < kSteps; ++k) grads.push_back(torch::randn({2 * shard}) * (k + 1));

  for (const OptimizerKind kind :
       {OptimizerKind::kLion, OptimizerKind::kAdafactor, OptimizerKind::kAdamW8bit}) {
    // The whole parameters.
    std::vector<OptimizerSlot> whole_slots;
    for (const auto& p : layout) {
      const int64_t n =
          std::accumulate(p.shape.begin(), p.shape.end(), int64_t{1}, std::multiplies<>());
      whole_slots.push_back({initial.narrow(0, p.offset, n).clone(), 0, {{p.shape, 0}}});
    }
    SlotOptimizer whole(HyperFor(kind, 0.1), whole_slots, nullptr);
    for (int k = 0; k < kSteps; ++k) {
      for (size_t j = 0; j < layout.size(); ++j) {
        whole_slots[j].param.mutable_grad() =
            grads[k].narrow(0, layout[j].offset, whole_slots[j].param.numel()).clone();
      }
      whole.Step(1e-2, 0.5);
    }
    // Two ranks, a shard each.
    std::vector<torch::Tensor> shards(2);
    std::vector<std::map<std::string, torch::Tensor>> states(2);
    RunTwoGlooRanks([&](Communicator& comm) {
      const int r = comm.rank();
      OptimizerSlot slot{initial.narrow(0, r * shard, shard).clone(), r * shard, layout};
      SlotOptimizer mine(HyperFor(kind, 0.1), {slot}, &comm);
      for (int k = 0; k < kSteps; ++k) {
        slot.param.mutable_grad() = grads[k].narrow(0, r * shard, shard).clone();
        mine.Step(1e-2, 0.5);
      }
      shards[r] = slot.param;
      states[r] = mine.State(0);
    });
    const torch::Tensor got = torch::cat(shards);
    for (size_t j = 0; j < layout.size(); ++j) {
      const torch::Tensor want = whole_slots[j].param.reshape({-1});
      const torch::Tensor mine = got.narrow(0, layout[j].offset, want.numel());
      if (kind != OptimizerKind::kAdamW8bit) {
        EXPECT_LT((mine - want).abs().max().item<double>(), 1e-6) << Name(kind) << " " << j;
        continue;
      }
      if (static_cast<int>(j) != cut_param) {
        EXPECT_TRUE(mine.equal(want)) << j;
        continue;
      }
      // The cut block [4096, 4352) of the matrix differs within the quantization's resolution.
      const int64_t b = cut_block_begin - layout[j].offset;
      EXPECT_TRUE(mine.narrow(0, 0, b).equal(want.narrow(0, 0, b)));
      EXPECT_TRUE(mine.narrow(0, b + 256, want.numel() - b - 256)
                      .equal(want.narrow(0, b + 256, want.numel() - b - 256)));
      EXPECT_LT((mine - want).abs().max().item<double>(), 1e-3);
    }
    if (kind != OptimizerKind::kAdamW8bit) continue;
    // Rank 1's 8-bit state, dequantized and quantized again into a new optimizer's blocks.
    auto dequantized = SlotOptimizer::Elementwise(kind, layout, shard, shard, states[1]);
    ASSERT_TRUE(dequantized.ok()) << dequantized.status();
    ASSERT_EQ(dequantized->at("exp_avg").numel(), shard);
    SlotOptimizer again(HyperFor(kind, 0.1), {{torch::zeros({shard}), shard, layout}}, nullptr);
    ASSERT_TRUE(again.SetState(0, *dequantized, kSteps).ok());
    EXPECT_EQ(again.step(), kSteps);
    auto round_trip = SlotOptimizer::Elementwise(kind, layout, shard, shard, again.State(0));
    ASSERT_TRUE(round_trip.ok()) << round_trip.status();
    for (const char* name : {"exp_avg", "exp_avg_sq"}) {
      const torch::Tensor a = dequantized->at(name), c = round_trip->at(name);
      EXPECT_LE((a - c).abs().max().item<double>(), 0.02 * a.abs().max().item<double>()) << name;
    }
    // A state that does not fit the slot is refused, naming the tensor.
    std::map<std::string, torch::Tensor> cut = states[1];
    cut["exp_avg.absmax"] = cut["exp_avg.absmax"].narrow(0, 0, 3);
    auto refused = SlotOptimizer::Elementwise(kind, layout, shard, shard, cut);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("exp_avg.absmax"));
    // A slot of padding alone (past the buffer's last parameter) has no state and zero moments,
    // so a shard group gathers the same keys from every rank; a slot with elements and no state
    // (no step yet) gives none.
    auto padding = SlotOptimizer::Elementwise(kind, layout, numel + 1, 5, {});
    ASSERT_TRUE(padding.ok()) << padding.status();
    ASSERT_EQ(padding->size(), 2u);
    for (const char* name : {"exp_avg", "exp_avg_sq"}) {
      EXPECT_TRUE(padding->at(name).equal(torch::zeros({5}))) << name;
    }
    auto none = SlotOptimizer::Elementwise(kind, layout, shard, shard, {});
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_TRUE(none->empty());
  }
}

// The 8-bit quantizer's table lookup finds what a search of the whole map finds: the nearest
// value, the lower of two as near, for floats all over [-1.01, 1.01] (every 1021st bit pattern,
// and each map's values and the midpoints between them).
TEST(SlotOptimizerTest, TheCodeLookupFindsTheNearestValueOfTheMap) {
  for (const bool is_signed : {true, false}) {
    const std::array<float, 256>& map = DynamicMap(is_signed);
    auto nearest = [&](float v) {
      int best = 0;
      for (int c = 1; c < 256; ++c) {
        if (std::abs(v - map[c]) < std::abs(v - map[best])) best = c;
      }
      return best;
    };
    std::vector<float> values;
    for (uint32_t bits = 0; bits < 0x3f820000u; bits += 1021) {  // 0 .. 1.0156
      float v;
      std::memcpy(&v, &bits, sizeof v);
      values.push_back(v);
      values.push_back(-v);
    }
    for (int c = 0; c < 256; ++c) {
      values.push_back(map[c]);
      if (c > 0) values.push_back((map[c - 1] + map[c]) / 2);
    }
    int checked = 0;
    for (const float v : values) {
      ASSERT_EQ(NearestCode(v, is_signed), nearest(v)) << v << (is_signed ? " signed" : "");
      ++checked;
    }
    EXPECT_GT(checked, 2'000'000);
  }
}

}  // namespace
}  // namespace trainyard::trainer
