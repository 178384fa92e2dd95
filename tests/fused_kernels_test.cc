// The GPU step's fused pieces against the unfused LibTorch composition, on fresh random inputs,
// gradients included: the cross-entropy rows kernel (kernels/fused_loss.h) against
// F::cross_entropy in fp64; the fused linear + cross-entropy against linear then cross_entropy;
// the models' Loss with the fused head against their plain head; the on-device gradient norm and
// clipping divisor against the host's; AdamW's update of CUDA parameters (the project's
// multi-tensor kernel and LibTorch's) against the update in fp64; SplitHeads against view,
// permute and unbind; SwiGlu
// against silu(gate) * up; the rotary embedding against each pair rotated in fp64; GpuLinear's
// one-product weight and bias gradients against autocast's linear and exact sums. The CPU cases
// run everywhere (the LibTorch composition behind the same interface); the Cuda cases run the
// project's CUDA kernel on a GPU and skip elsewhere, unless TRAINYARD_REQUIRE_CUDA=1
// (scripts/test-gpu.sh), where a missing GPU fails.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "worker/trainer/kernels/dense.h"
#include "worker/trainer/kernels/fused_loss.h"
#include "worker/trainer/kernels/fused_norm.h"
#include "worker/trainer/kernels/rotary.h"
#include "worker/trainer/kernels/split_heads.h"
#include "worker/trainer/kernels/swiglu.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/fused_adamw.h"
#if TRAINYARD_CUDA_KERNELS
#include "worker/trainer/kernels/adamw_cuda.h"
#endif
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

namespace F = torch::nn::functional;

// ||a - b|| / ||b|| in fp64.
double RelativeError(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor a64 = a.detach().to(torch::kCPU, torch::kDouble);
  const torch::Tensor b64 = b.detach().to(torch::kCPU, torch::kDouble);
  return (a64 - b64).norm().item<double>() / std::max(b64.norm().item<double>(), 1e-30);
}

bool RequireCuda() {
  const char* v = std::getenv("TRAINYARD_REQUIRE_CUDA");
  return v != nullptr && std::string(v) == "1";
}

#define SKIP_WITHOUT_CUDA()                                                      \
  do {                                                                           \
    if (!CudaUsable()) {                                                         \
      if (RequireCuda()) FAIL() << "TRAINYARD_REQUIRE_CUDA=1 but no usable GPU"; \
      GTEST_SKIP() << "no usable GPU";                                           \
    }                                                                            \
  } while (0)

// Reference: loss_i = w_i * CE(logits_i, t_i) and its gradient w.r.t. the logits, in fp64.
struct RowsReference {
  torch::Tensor loss, grad;
};
RowsReference ReferenceRows(const torch::Tensor& logits, const torch::Tensor& targets,
                            const torch::Tensor& weights) {
  torch::Tensor x = logits.detach().to(torch::kCPU, torch::kDouble).requires_grad_(true);
  torch::Tensor each = F::cross_entropy(x, targets.to(torch::kCPU),
                                        F::CrossEntropyFuncOptions().reduction(torch::kNone));
  if (weights.defined()) each = each * weights.to(torch::kCPU, torch::kDouble);
  each.sum().backward();
  return {each.detach(), x.grad()};
}

// Logits, targets and weights (some zero) on `device`; vocab need not be a multiple of 8.
struct Rows {
  torch::Tensor logits, targets, weights;
};
Rows RandomRows(int64_t rows, int64_t vocab, torch::Dtype type, const torch::Device& device,
                uint64_t seed) {
  torch::manual_seed(seed);
  Rows r;
  r.logits = (torch::randn({rows, vocab}, torch::kDouble) * 3).to(device, type);
  r.targets = torch::randint(vocab, {rows}, torch::kLong).to(device);
  r.weights = (torch::rand({rows}) > 0.25).to(torch::kFloat).to(device);
  return r;
}

void CheckRows(const torch::Device& device, torch::Dtype type, int64_t rows, int64_t vocab,
               bool weighted, double tolerance, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << device << " " << type << " rows " << rows << " vocab " << vocab
                                  << (weighted ? " weighted" : ""));
  Rows r = RandomRows(rows, vocab, type, device, seed);
  if (!weighted) r.weights = torch::Tensor();
  const RowsReference ref = ReferenceRows(r.logits, r.targets, r.weights);
  // Poisoned outputs: every element must be written.
  torch::Tensor loss = torch::full({rows}, std::nanf(""), r.logits.options().dtype(torch::kFloat));
  torch::Tensor grad = r.logits.clone();
  CrossEntropyRows(grad, r.targets, r.weights, loss, /*write_grad=*/true);
  EXPECT_TRUE(torch::isfinite(loss).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(grad).all().item<bool>());
  EXPECT_LT(RelativeError(loss, ref.loss), tolerance);
  EXPECT_LT(RelativeError(grad, ref.grad), tolerance);
  // Loss only: the logits are left as they were.
  torch::Tensor kept = r.logits.clone();
  torch::Tensor loss_only = torch::zeros({rows}, loss.options());
  CrossEntropyRows(kept, r.targets, r.weights, loss_only, /*write_grad=*/false);
  EXPECT_TRUE(kept.equal(r.logits));
  EXPECT_LT(RelativeError(loss_only, ref.loss), tolerance);
}

TEST(CrossEntropyRowsTest, MatchesCrossEntropyAndItsGradientOnTheCpu) {
  CheckRows(torch::kCPU, torch::kFloat, 37, 301, /*weighted=*/false, 1e-6, 1);
  CheckRows(torch::kCPU, torch::kFloat, 16, 256, /*weighted=*/true, 1e-6, 2);
  // (The loss is fp32 whatever the logits.)
  CheckRows(torch::kCPU, torch::kDouble, 5, 1000, /*weighted=*/true, 1e-7, 3);
}

TEST(CrossEntropyRowsTest, CudaKernelMatchesCrossEntropyAndItsGradient) {
  SKIP_WITHOUT_CUDA();
  ASSERT_TRUE(HasCrossEntropyKernel()) << "the CUDA flavour builds the kernel";
  const torch::Device cuda(torch::kCUDA, 0);
  // Vector loads (vocab a multiple of 8) and the scalar path (not), large and small rows.
  CheckRows(cuda, torch::kFloat, 64, 50304, /*weighted=*/false, 1e-6, 4);
  CheckRows(cuda, torch::kFloat, 33, 1001, /*weighted=*/true, 1e-6, 5);
  CheckRows(cuda, torch::kDouble, 9, 515, /*weighted=*/true, 1e-6, 6);
  // 16-bit logits: the kernel computes in fp32 from the rounded inputs and rounds the gradient.
  CheckRows(cuda, torch::kBFloat16, 128, 50304, /*weighted=*/true, 8e-3, 7);
  CheckRows(cuda, torch::kBFloat16, 7, 77, /*weighted=*/false, 8e-3, 8);
  CheckRows(cuda, torch::kHalf, 64, 32000, /*weighted=*/false, 1e-3, 9);
}

// The fused linear + cross-entropy against the unfused composition: loss and the gradients of x
// and the weight, in fp64.
void CheckFusedLinear(const torch::Device& device, int64_t rows, int64_t d, int64_t vocab,
                      int64_t chunk_rows, bool weighted, bool bf16, double tolerance,
                      uint64_t seed) {
  SCOPED_TRACE(testing::Message() << device << " rows " << rows << " d " << d << " vocab " << vocab
                                  << " chunk " << chunk_rows << (bf16 ? " bf16" : ""));
  torch::manual_seed(seed);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  torch::Tensor x = torch::randn({rows, d}, opts).requires_grad_(true);
  torch::Tensor w = (torch::randn({vocab, d}, opts) * 0.2).requires_grad_(true);
  const torch::Tensor targets = torch::randint(vocab, {rows}, torch::kLong).to(device);
  const torch::Tensor weights =
      weighted ? (torch::rand({rows}) > 0.3).to(torch::kFloat).to(device) : torch::Tensor();

  torch::Tensor x64 = x.detach().to(torch::kCPU, torch::kDouble).requires_grad_(true);
  torch::Tensor w64 = w.detach().to(torch::kCPU, torch::kDouble).requires_grad_(true);
  torch::Tensor each = F::cross_entropy(torch::mm(x64, w64.t()), targets.to(torch::kCPU),
                                        F::CrossEntropyFuncOptions().reduction(torch::kNone));
  if (weighted) each = each * weights.to(torch::kCPU, torch::kDouble);
  // A loss gradient other than 1 (as a mean over grad_accum micro-batches gives).
  (each.sum() * 0.25).backward();

  torch::Tensor loss;
  {
    AutocastScope autocast(device, bf16 ? Precision::kBf16 : Precision::kFp32);
    loss = FusedLinearCrossEntropySum(x, w, targets, weights, chunk_rows);
  }
  (loss * 0.25).backward();
  // The weight gradient's chunks add up in one product each where the GPU's products are bf16
  // (cuBLASLt's heuristic may refuse widths that are not a multiple of 8: either path then).
  if (!device.is_cuda() || !bf16 || !HasCrossEntropyKernel()) {
    EXPECT_STREQ(FusedLinearCrossEntropyWeightPath(), "composition");
  } else if (vocab % 8 == 0 && d % 8 == 0) {
    EXPECT_STREQ(FusedLinearCrossEntropyWeightPath(), "cublaslt");
  }
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
  EXPECT_LT(RelativeError(loss, each.sum()), tolerance);
  EXPECT_LT(RelativeError(x.grad(), x64.grad()), tolerance);
  EXPECT_LT(RelativeError(w.grad(), w64.grad()), tolerance);
  EXPECT_EQ(x.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(w.grad().scalar_type(), torch::kFloat);

  // Without gradients (evaluation): the same loss.
  torch::NoGradGuard no_grad;
  AutocastScope autocast(device, bf16 ? Precision::kBf16 : Precision::kFp32);
  EXPECT_LT(
      RelativeError(FusedLinearCrossEntropySum(x, w, targets, weights, chunk_rows), each.sum()),
      tolerance);
}

TEST(FusedLinearCrossEntropyTest, MatchesLinearThenCrossEntropyOnTheCpu) {
  // Chunks that do not divide the rows, one chunk, one row per chunk.
  CheckFusedLinear(torch::kCPU, 29, 24, 131, 8, /*weighted=*/false, false, 1e-5, 11);
  CheckFusedLinear(torch::kCPU, 16, 32, 256, 0, /*weighted=*/true, false, 1e-5, 12);
  CheckFusedLinear(torch::kCPU, 5, 8, 40, 1, /*weighted=*/true, false, 1e-5, 13);
  // Chunks of the logits' bytes (--loss-chunk-mib): 3 rows of 131 fp32 logits a chunk.
  SetFusedLossChunkBytes(3 * 131 * 4);
  CheckFusedLinear(torch::kCPU, 29, 24, 131, 0, /*weighted=*/true, false, 1e-5, 19);
  SetFusedLossChunkBytes(0);
}

TEST(FusedLinearCrossEntropyTest, NoRowsGiveZeroGradients) {
  const torch::Tensor x = torch::randn({0, 8}).requires_grad_(true);
  const torch::Tensor w = torch::randn({20, 8}).requires_grad_(true);
  const torch::Tensor loss =
      FusedLinearCrossEntropySum(x, w, torch::zeros({0}, torch::kLong), torch::Tensor());
  loss.backward();
  EXPECT_EQ(loss.item<double>(), 0.0);
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().abs().max().item<double>(), 0.0);
}

TEST(FusedLinearCrossEntropyTest, BackwardRunsOnce) {
  // (The node scales its gradients in place on a GPU: a second backward would scale them twice.)
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({6, 8}).requires_grad_(true);
  const torch::Tensor w = torch::randn({20, 8}).requires_grad_(true);
  const torch::Tensor loss = FusedLinearCrossEntropySum(x, w, torch::randint(20, {6}), {});
  loss.backward({}, /*retain_graph=*/true);
  try {
    loss.backward();
    FAIL() << "a second backward ran";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("backward runs once"), std::string::npos) << e.what();
  }
}

TEST(FusedLinearCrossEntropyTest, CudaMatchesLinearThenCrossEntropy) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  CheckFusedLinear(cuda, 300, 64, 1000, 64, /*weighted=*/true, false, 1e-5, 14);
  CheckFusedLinear(cuda, 2048, 256, 50304, 512, /*weighted=*/false, false, 1e-5, 15);
  // bf16 products (autocast): the error of bf16 operands, against fp64.
  CheckFusedLinear(cuda, 2048, 256, 50304, 0, /*weighted=*/true, true, 2e-2, 16);
  CheckFusedLinear(cuda, 77, 64, 1001, 16, /*weighted=*/false, true, 2e-2, 17);
  // Several chunks, the last a short one: the weight gradient added up in fp32 by the products.
  CheckFusedLinear(cuda, 1000, 256, 50304, 384, /*weighted=*/true, true, 2e-2, 18);
}

ModelConfig SmallModel(const std::string& kind, bool tied) {
  ModelConfig m;
  m.kind = kind;
  m.n_layer = 2;
  m.d_model = 32;
  m.n_head = 4;
  m.seq_len = 16;
  m.vocab = 200;
  m.tie_weights = tied;
  if (kind == "llama") {
    m.n_kv_head = 2;
    m.d_hidden = 56;
  }
  return m;
}

// Two models of `m` from the same seed, each with its own options, on `device`, and the batch
// (3 windows from `batch_seed`) both train on.
struct ModelPair {
  std::shared_ptr<LanguageModel> a, b;
  torch::Tensor windows;
};
ModelPair TwoModels(const ModelConfig& m, const ModelOptions& a_options,
                    const ModelOptions& b_options, const torch::Device& device, uint64_t model_seed,
                    uint64_t batch_seed) {
  ModelPair pair{BuildModel(m, a_options, model_seed), BuildModel(m, b_options, model_seed), {}};
  pair.a->to(device);
  pair.b->to(device);
  torch::manual_seed(batch_seed);
  pair.windows = torch::randint(m.vocab, {3, m.seq_len + 1}, torch::kLong).to(device);
  return pair;
}

// Each of `reference`'s parameters has a gradient in `model`, within `tolerance` of its own.
void ExpectGradientsMatch(LanguageModel& model, LanguageModel& reference, double tolerance,
                          const std::string& what = "") {
  auto got = model.named_parameters();
  for (const auto& item : reference.named_parameters()) {
    ASSERT_TRUE(got[item.key()].grad().defined()) << what << item.key();
    EXPECT_LT(RelativeError(got[item.key()].grad(), item.value().grad()), tolerance)
        << what << item.key();
  }
}

// A model's Loss and MaskedLossSum with the fused head give the plain head's loss and gradients.
void CheckModel(const ModelConfig& m, const torch::Device& device, bool bf16, double tolerance) {
  SCOPED_TRACE(testing::Message() << m.kind << (m.tie_weights ? " tied" : "") << " " << device
                                  << (bf16 ? " bf16" : ""));
  ModelPair pair = TwoModels(m, {}, {}, device, 7, 21);
  LanguageModel &fused = *pair.a, &plain = *pair.b;
  fused.set_fused_loss(LanguageModel::FusedLoss::kOn);
  plain.set_fused_loss(LanguageModel::FusedLoss::kOff);
  ASSERT_TRUE(fused.UsesFusedLoss(device));
  ASSERT_FALSE(plain.UsesFusedLoss(device));
  const torch::Tensor& windows = pair.windows;
  const torch::Tensor weights = (torch::rand({3, m.seq_len}) > 0.5).to(torch::kFloat).to(device);
  const Precision precision = bf16 ? Precision::kBf16 : Precision::kFp32;
  torch::Tensor lf, lp;
  {
    AutocastScope autocast(device, precision);
    lf = fused.Loss(windows) + fused.MaskedLossSum(windows, weights) * 0.1;
    lp = plain.Loss(windows) + plain.MaskedLossSum(windows, weights) * 0.1;
  }
  lf.backward();
  lp.backward();
  EXPECT_LT(RelativeError(lf, lp), tolerance);
  ExpectGradientsMatch(fused, plain, tolerance);
}

TEST(FusedLossModelTest, GptAndLlamaMatchThePlainHeadOnTheCpu) {
  for (const std::string kind : {"gpt", "llama"}) {
    for (bool tied : {false, true}) CheckModel(SmallModel(kind, tied), torch::kCPU, false, 1e-5);
  }
  // Where it applies: kAuto only on CUDA and for logits of at least kFusedLossMinLogits values;
  // never for the MLP (last token only).
  auto model = BuildModel(SmallModel("gpt", true), {}, 1);
  const torch::Device cuda(torch::kCUDA, 0);
  const int64_t enough = (LanguageModel::kFusedLossMinLogits + 199) / 200;  // vocab 200
  EXPECT_FALSE(model->UsesFusedLoss(torch::kCPU, enough));
  EXPECT_TRUE(model->UsesFusedLoss(cuda, enough));
  EXPECT_FALSE(model->UsesFusedLoss(cuda, enough - 1));
  model->set_fused_loss(LanguageModel::FusedLoss::kOn);
  EXPECT_TRUE(model->UsesFusedLoss(torch::kCPU, 1));
  ModelConfig mlp = SmallModel("gpt", false);
  mlp.kind = "mlp";
  mlp.d_hidden = 32;
  auto mlp_model = BuildModel(mlp, {}, 1);
  mlp_model->set_fused_loss(LanguageModel::FusedLoss::kOn);
  EXPECT_FALSE(mlp_model->UsesFusedLoss(torch::kCPU));
}

TEST(FusedLossModelTest, CudaGptAndLlamaMatchThePlainHead) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  for (const std::string kind : {"gpt", "llama"}) {
    for (bool tied : {false, true}) {
      CheckModel(SmallModel(kind, tied), cuda, false, 1e-5);
      // bf16: the plain head's logits are bf16 too; both round the products alike.
      CheckModel(SmallModel(kind, tied), cuda, true, 3e-2);
    }
  }
}

// LayerNormCast and AddLayerNorm against layer_norm (and the add) in fp64: outputs and the
// gradients of x, y, weight and bias, for a random upstream gradient of both outputs. `rms`:
// RmsNormCast and AddRmsNorm against the Llama family's RMSNorm (no bias). `residual` (without
// `add`): LayerNormResidual or RmsNormResidual, x handed on beside the norm with a gradient of its
// own. `bf16_norm`: the norm's output is bf16 (autocast's on a GPU; FusedNormsOnTheCpuForTest's).
void CheckNorm(const torch::Device& device, int64_t rows, int64_t d, bool add, bool bf16,
               double tolerance, uint64_t seed, bool rms = false, bool residual = false,
               std::optional<bool> bf16_norm = std::nullopt) {
  SCOPED_TRACE(testing::Message() << device << " rows " << rows << " d " << d << (add ? " add" : "")
                                  << (residual ? " residual" : "") << (bf16 ? " bf16" : "")
                                  << (rms ? " rms" : ""));
  const bool two_outputs = add || residual;
  torch::manual_seed(seed);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  torch::Tensor x = (torch::randn({2, rows, d}, opts) * 2 + 0.5).requires_grad_(true);
  torch::Tensor y = torch::randn({2, rows, d}, opts)
                        .to(bf16 ? torch::kBFloat16 : torch::kFloat)
                        .requires_grad_(true);
  torch::Tensor w = (torch::randn({d}, opts) * 0.3 + 1).requires_grad_(true);
  torch::Tensor b = (torch::randn({d}, opts) * 0.1).requires_grad_(true);
  const torch::Tensor dn = torch::randn({2, rows, d}, opts);
  const torch::Tensor dh = torch::randn({2, rows, d}, opts);

  auto f64 = [](const torch::Tensor& t) {
    return t.detach().to(torch::kCPU, torch::kDouble).requires_grad_(true);
  };
  torch::Tensor x64 = f64(x), y64 = f64(y), w64 = f64(w), b64 = f64(b);
  const torch::Tensor h64 = add ? x64 + y64 : x64;
  const torch::Tensor n64 =
      rms ? w64 * (h64 * torch::rsqrt(h64.pow(2).mean(-1, /*keepdim=*/true) + 1e-5))
          : torch::layer_norm(h64, {d}, w64, b64, 1e-5);
  torch::Tensor total = (n64 * dn.to(torch::kCPU, torch::kDouble)).sum();
  if (two_outputs) total = total + (h64 * dh.to(torch::kCPU, torch::kDouble)).sum();
  total.backward();

  torch::Tensor h, n;
  {
    AutocastScope autocast(device, bf16 ? Precision::kBf16 : Precision::kFp32);
    if (add) {
      std::tie(h, n) = rms ? AddRmsNorm(x, y, w, 1e-5) : AddLayerNorm(x, y, w, b, 1e-5);
    } else if (residual) {
      std::tie(h, n) = rms ? RmsNormResidual(x, w, 1e-5) : LayerNormResidual(x, w, b, 1e-5);
    } else {
      n = rms ? RmsNormCast(x, w, 1e-5) : LayerNormCast(x, w, b, 1e-5);
    }
  }
  EXPECT_EQ(n.scalar_type(),
            bf16_norm.value_or(bf16 && device.is_cuda()) ? torch::kBFloat16 : torch::kFloat);
  // The fused path (one node: the norm, and h beside it) wherever it applies.
  const bool fused = UsesFusedNorms(x);
  EXPECT_EQ(n.grad_fn()->name().find("FusedLayerNorm") != std::string::npos, fused)
      << n.grad_fn()->name();
  if (two_outputs) EXPECT_EQ(h.grad_fn() == n.grad_fn(), fused);
  torch::Tensor loss = (n.to(torch::kFloat) * dn).sum();
  if (two_outputs) {
    EXPECT_EQ(h.scalar_type(), torch::kFloat);
    EXPECT_LT(RelativeError(h, h64), 1e-6);
    if (residual) EXPECT_TRUE(torch::equal(h, x));
    loss = loss + (h * dh).sum();
  }
  loss.backward();
  EXPECT_LT(RelativeError(n, n64), tolerance);
  EXPECT_LT(RelativeError(x.grad(), x64.grad()), tolerance);
  EXPECT_LT(RelativeError(w.grad(), w64.grad()), tolerance);
  if (rms) {
    EXPECT_FALSE(b.grad().defined());
  } else {
    EXPECT_LT(RelativeError(b.grad(), b64.grad()), tolerance);
  }
  if (add) {
    EXPECT_EQ(y.grad().scalar_type(), y.scalar_type());
    EXPECT_LT(RelativeError(y.grad(), y64.grad()), tolerance);
  }
}

TEST(FusedNormTest, MatchesLayerNormOnTheCpu) {
  EXPECT_FALSE(UsesFusedNorms(torch::zeros({2, 48})));  // the composition
  CheckNorm(torch::kCPU, 7, 48, /*add=*/false, false, 1e-5, 41);
  CheckNorm(torch::kCPU, 7, 48, /*add=*/true, false, 1e-5, 42);
}

TEST(FusedNormTest, MatchesRmsNormOnTheCpu) {
  CheckNorm(torch::kCPU, 7, 48, /*add=*/false, false, 1e-5, 47, /*rms=*/true);
  CheckNorm(torch::kCPU, 7, 48, /*add=*/true, false, 1e-5, 48, /*rms=*/true);
}

// The fused path's autograd node on the CPU (the kernels' arithmetic in ATen): the norm alone,
// with the add, handing x on; fp32, and the outputs in bf16 with a bf16 branch (whose gradient
// the backward rounds itself).
TEST(FusedNormTest, TheNodeMatchesTheNormsOnTheCpu) {
  for (bool rms : {false, true}) {
    {
      FusedNormsOnTheCpuForTest fused;
      ASSERT_TRUE(UsesFusedNorms(torch::zeros({2, 48})));
      EXPECT_FALSE(UsesFusedNorms(torch::zeros({2, 48}, torch::kDouble)));
      CheckNorm(torch::kCPU, 7, 48, /*add=*/false, false, 1e-5, 141, rms);
      CheckNorm(torch::kCPU, 7, 48, /*add=*/true, false, 1e-5, 142, rms);
      CheckNorm(torch::kCPU, 7, 48, /*add=*/false, false, 1e-5, 143, rms, /*residual=*/true);
      CheckNorm(torch::kCPU, 1, 5, /*add=*/true, false, 1e-5, 144, rms);
    }
    FusedNormsOnTheCpuForTest fused(torch::kBFloat16);
    for (bool add : {false, true}) {
      CheckNorm(torch::kCPU, 9, 64, add, /*bf16=*/true, 1e-2, 145, rms, /*residual=*/!add,
                /*bf16_norm=*/true);
    }
  }
}

// Every edge of the graph under `root` that leads to `target`, each node visited once.
int EdgesTo(const std::shared_ptr<torch::autograd::Node>& root,
            const torch::autograd::Node* target) {
  std::vector<torch::autograd::Node*> todo = {root.get()};
  std::set<torch::autograd::Node*> seen = {root.get()};
  int count = 0;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (!edge.is_valid()) continue;
      if (edge.function.get() == target) ++count;
      if (seen.insert(edge.function.get()).second) todo.push_back(edge.function.get());
    }
  }
  return count;
}

// A pre-norm block's residual stream around the fused norms has one user: x's gradient comes from
// one node (its two parts summed in the norm's backward), where the composition sums two or more
// in adds. The gradients are the composition's.
TEST(FusedNormTest, TheResidualStreamReachesTheAddThroughTheNorm) {
  for (bool rms : {false, true}) {
    SCOPED_TRACE(rms ? "rms" : "layer norm");
    torch::manual_seed(146);
    const torch::Tensor x0 = torch::randn({2, 5, 32}), w0 = torch::randn({32}) * 0.3 + 1,
                        b0 = torch::randn({32}) * 0.1, m = torch::randn({32, 32}) * 0.2;
    auto block = [&](bool fused, std::vector<torch::Tensor>* grads) {
      std::optional<FusedNormsOnTheCpuForTest> on;
      if (fused) on.emplace();
      const torch::Tensor x = x0.clone().requires_grad_(true);
      const torch::Tensor w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      const auto [stream, n1] =
          rms ? RmsNormResidual(x, w, 1e-5) : LayerNormResidual(x, w, b, 1e-5);
      const torch::Tensor branch = torch::tanh(torch::matmul(n1, m));
      const auto [h, n2] =
          rms ? AddRmsNorm(stream, branch, w, 1e-5) : AddLayerNorm(stream, branch, w, b, 1e-5);
      const torch::Tensor loss = (h * h).sum() + (n2 * torch::sin(h)).sum();
      const int users = EdgesTo(loss.grad_fn(), torch::autograd::impl::grad_accumulator(x).get());
      loss.backward();
      grads->assign({x.grad(), w.grad(), rms ? torch::zeros({1}) : b.grad()});
      return users;
    };
    std::vector<torch::Tensor> fused_grads, plain_grads;
    EXPECT_EQ(block(true, &fused_grads), 1);
    EXPECT_GE(block(false, &plain_grads), 2);  // RMSNorm's composition: 3 (x, x^2 and the add)
    for (size_t i = 0; i < fused_grads.size(); ++i) {
      EXPECT_LT(RelativeError(fused_grads[i], plain_grads[i]), 1e-5) << "gradient " << i;
    }
  }
}

TEST(FusedNormTest, CudaKernelsMatchLayerNorm) {
  SKIP_WITHOUT_CUDA();
  ASSERT_TRUE(HasLayerNormKernel(768));
  const torch::Device cuda(torch::kCUDA, 0);
  // GPT-2's width and odd ones (not a multiple of 32), many rows (several backward blocks
  // each), fp32 and bf16 autocast (the output rounded to bf16 once). The backward's vectorised
  // kernel takes widths that are multiples of 4 up to 2048 (all its lanes' chunks full: 768,
  // 2048, 512; some lanes idle: 1536, 36), the other kernel the rest (100, 37, 3000).
#if TRAINYARD_CUDA_KERNELS
  for (const auto& [d, vectorised] : std::vector<std::pair<int64_t, bool>>{{768, true},
                                                                           {2048, true},
                                                                           {512, true},
                                                                           {1536, true},
                                                                           {36, true},
                                                                           {100, true},
                                                                           {37, false},
                                                                           {3000, false}}) {
    EXPECT_EQ(LayerNormBackwardIsVectorisedCuda(d, torch::kBFloat16), vectorised) << d;
    EXPECT_EQ(LayerNormBackwardIsVectorisedCuda(d, torch::kFloat), vectorised) << d;
  }
#endif
  for (bool add : {false, true}) {
    CheckNorm(cuda, 4096, 768, add, false, 1e-5, 43);
    CheckNorm(cuda, 33, 100, add, false, 1e-5, 44);
    CheckNorm(cuda, 1000, 2048, add, true, 1e-2, 45);
    CheckNorm(cuda, 5, 37, add, true, 1e-2, 46);
    CheckNorm(cuda, 1001, 512, add, true, 1e-2, 47);
    CheckNorm(cuda, 300, 1536, add, false, 1e-5, 48);
    CheckNorm(cuda, 7, 36, add, true, 1e-2, 51);
    CheckNorm(cuda, 20, 3000, add, false, 1e-5, 52);
  }
  // x handed on through the norm's node: the kernel adds its gradient in.
  CheckNorm(cuda, 4096, 768, false, false, 1e-5, 143, false, /*residual=*/true);
  CheckNorm(cuda, 1000, 2048, false, true, 1e-2, 145, false, /*residual=*/true);
}

TEST(FusedNormTest, CudaKernelsMatchRmsNorm) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  // Llama 3.2 1B's width and odd ones, fp32 and bf16 autocast.
  for (bool add : {false, true}) {
    CheckNorm(cuda, 4096, 2048, add, false, 1e-5, 49, /*rms=*/true);
    CheckNorm(cuda, 33, 100, add, false, 1e-5, 50, /*rms=*/true);
    CheckNorm(cuda, 1000, 2048, add, true, 1e-2, 56, /*rms=*/true);
    CheckNorm(cuda, 5, 37, add, true, 1e-2, 57, /*rms=*/true);
  }
  CheckNorm(cuda, 4096, 2048, false, false, 1e-5, 149, /*rms=*/true, /*residual=*/true);
  CheckNorm(cuda, 33, 100, false, true, 1e-2, 150, /*rms=*/true, /*residual=*/true);
}

#if TRAINYARD_CUDA_KERNELS
// The backward kernels one against another on one input (GPT-2 small's LayerNorm rows under
// autocast, with the stream's gradient and the branch's rounded copy; Llama 3.2 1B's RMSNorm
// rows): the same ds, its bf16 copy and dgamma and dbeta (summed over the blocks), within float
// rounding (they sum in other orders); and each one's time a call, printed for bench/RESULTS.md.
void CompareBackwardKernels(int64_t rows, int64_t d, bool rms, bool cast) {
  SCOPED_TRACE(testing::Message() << "rows " << rows << " d " << d << (rms ? " rms" : ""));
  torch::manual_seed(rows + d);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA, 0);
  const torch::Tensor dn = torch::randn({rows, d}, f32).to(torch::kBFloat16);
  const torch::Tensor s = torch::randn({rows, d}, f32) * 2 + 0.5;
  const torch::Tensor mean = rms ? torch::zeros({rows}, f32) : s.mean(1);
  const torch::Tensor rstd = torch::rand({rows}, f32) + 0.5;
  const torch::Tensor gamma = torch::randn({d}, f32) * 0.3 + 1;
  const torch::Tensor extra = torch::randn({rows, d}, f32);
  using K = LayerNormBackwardKernel;
  struct Result {
    torch::Tensor ds, ds_cast, dgamma, dbeta;
  };
  const auto run = [&](K kernel) {
    const int64_t blocks = LayerNormBackwardBlocksCuda(rows, d, torch::kBFloat16, rms, kernel);
    Result r{torch::empty({rows, d}, f32),
             cast ? torch::empty({rows, d}, f32.dtype(torch::kBFloat16)) : torch::Tensor(),
             torch::empty({blocks, d}, f32),
             rms ? torch::Tensor() : torch::empty({blocks, d}, f32)};
    LayerNormBackwardCuda(dn, s, mean, rstd, gamma, extra, r.ds, r.ds_cast, r.dgamma, r.dbeta, rms,
                          kernel);
    return r;
  };
  const Result want = run(K::kScalar);
  std::vector<std::pair<const char*, K>> kernels = {{"scalar", K::kScalar}, {"reread", K::kReread}};
  if (d <= 1024 || rms) kernels.emplace_back("held", K::kHeld);
  std::string times;
  for (const auto& [name, kernel] : kernels) {
    const Result got = run(kernel);
    EXPECT_LT(RelativeError(got.ds, want.ds), 1e-5) << name;
    if (cast) {
      EXPECT_LE(RelativeError(got.ds_cast, want.ds_cast), 1e-2) << name;
    }
    // (The partials summed by the kernel the node uses, against ATen's sum.)
    torch::Tensor dgamma = torch::empty({d}, f32),
                  dbeta = rms ? torch::Tensor() : torch::empty({d}, f32);
    LayerNormSumPartialsCuda(got.dgamma, got.dbeta, dgamma, dbeta);
    EXPECT_LT(RelativeError(dgamma, got.dgamma.sum(0)), 1e-6) << name;
    if (!rms) {
      EXPECT_LT(RelativeError(dbeta, got.dbeta.sum(0)), 1e-6) << name;
    }
    EXPECT_LT(RelativeError(got.dgamma.sum(0), want.dgamma.sum(0)), 1e-5) << name;
    if (!rms) {
      EXPECT_LT(RelativeError(got.dbeta.sum(0), want.dbeta.sum(0)), 1e-5) << name;
    }
    constexpr int kCalls = 20;
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) run(kernel);
    torch::cuda::synchronize();
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
            .count() /
        kCalls;
    const double bytes = static_cast<double>(rows * d) * (2 + 4 + 4 + 4 + (cast ? 2 : 0));
    times += std::string(" ") + name + " " + std::to_string(static_cast<int>(us)) + " us (" +
             std::to_string(static_cast<int>(bytes / us / 1e3)) + " GB/s);";
  }
  std::cout << "norm backward, rows " << rows << " d " << d << (rms ? " rms" : "") << ":" << times
            << std::endl;
}

TEST(FusedNormTest, CudaBackwardKernelsAgree) {
  SKIP_WITHOUT_CUDA();
  CompareBackwardKernels(16384, 768, false, true);
  CompareBackwardKernels(8192, 2048, true, false);
  CompareBackwardKernels(1001, 512, false, true);
}
#endif

// Whether a node named with `name` is in the graph under `root`.
bool GraphHas(const std::shared_ptr<torch::autograd::Node>& root, const std::string& name) {
  std::vector<torch::autograd::Node*> todo = {root.get()};
  std::set<torch::autograd::Node*> seen = {root.get()};
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (node->name().find(name) != std::string::npos) return true;
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.is_valid() && seen.insert(edge.function.get()).second) {
        todo.push_back(edge.function.get());
      }
    }
  }
  return false;
}

// The GPT (with GPT-2's GELU) and the Llama with their fused norms (the blocks' arrangement of the
// residual stream around them) give the plain modules' loss and gradients; so do they under
// activation checkpointing, each block's forward run again in backward with its fused Functions
// (the norms, and on a GPU GeluMlp's epilogues, the residual in the product, the stacked q/k/v
// split, rotary, SwiGLU).
void CheckModelNorms(const torch::Device& device, bool bf16) {
  for (const std::string kind : {"gpt", "llama"}) {
    SCOPED_TRACE(kind + (bf16 ? " bf16" : " fp32"));
    ModelConfig m = SmallModel(kind, true);
    m.gelu_tanh = kind == "gpt";
    ModelOptions plain_options, recomputed_options;
    plain_options.fused_norms = false;
    recomputed_options.activation_checkpointing = true;
    ModelPair pair = TwoModels(m, {}, plain_options, device, 9, 22);
    LanguageModel &fused = *pair.a, &plain = *pair.b;
    const torch::Tensor& windows = pair.windows;
    const Precision precision = bf16 ? Precision::kBf16 : Precision::kFp32;
    torch::Tensor lf, lp;
    {
      AutocastScope autocast(device, precision);
      lf = fused.Loss(windows);
      lp = plain.Loss(windows);
    }
    EXPECT_TRUE(GraphHas(lf.grad_fn(), "FusedLayerNorm"));
    EXPECT_FALSE(GraphHas(lp.grad_fn(), "FusedLayerNorm"));
    lf.backward();
    lp.backward();
    const double tolerance = bf16 ? 3e-2 : 1e-5;
    EXPECT_LT(RelativeError(lf, lp), tolerance);
    ExpectGradientsMatch(fused, plain, tolerance);
    // A block's input reaches the graph through one node (the first norm's), where the plain
    // block's reaches it through two or more.
    {
      AutocastScope autocast(device, precision);
      auto users = [&](LanguageModel& model) {
        const torch::Tensor x =
            model.Embed(windows.slice(1, 0, m.seq_len)).detach().requires_grad_(true);
        const torch::Tensor out = model.BlockForward(0, x).sum();
        return EdgesTo(out.grad_fn(), torch::autograd::impl::grad_accumulator(x).get());
      };
      EXPECT_EQ(users(fused), 1);
      EXPECT_GE(users(plain), 2);
    }
    // Evaluation (no gradients recorded) and activation checkpointing give the same.
    {
      torch::NoGradGuard no_grad;
      AutocastScope autocast(device, precision);
      EXPECT_LT(RelativeError(fused.Loss(windows), lp), tolerance);
    }
    auto recomputed = BuildModel(m, recomputed_options, 9);
    recomputed->to(device);
    ResetKernelPathsForTest();
    torch::Tensor lr;
    {
      AutocastScope autocast(device, precision);
      lr = recomputed->Loss(windows);
    }
    lr.backward();
    if (device.is_cuda() && bf16 && kind == "gpt") {
      // (The last GeluMlp to run was a block's forward run again in backward.)
      EXPECT_STREQ(GeluMlpPath(), "cublaslt") << "recomputed";
      EXPECT_STREQ(GeluMlpResidualPath(), "cublaslt") << "recomputed";
    }
    EXPECT_LT(RelativeError(lr, lp), tolerance);
    ExpectGradientsMatch(*recomputed, plain, tolerance, "recomputed ");
  }
}

TEST(FusedNormTest, GptAndLlamaMatchTheirPlainNormsOnTheCpu) {
  FusedNormsOnTheCpuForTest fused;
  CheckModelNorms(torch::kCPU, false);
}

TEST(FusedNormTest, CudaGptAndLlamaMatchTheirPlainNorms) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  for (bool bf16 : {false, true}) CheckModelNorms(cuda, bf16);
}

// The on-device gradient norm and clipping divisor give the host's norm and clip_grad_norm_'s
// scale.
void CheckClip(const torch::Device& device) {
  SCOPED_TRACE(testing::Message() << device);
  torch::manual_seed(31);
  std::vector<torch::Tensor> params;
  for (int64_t n : {10, 1000, 33}) {
    torch::Tensor p = torch::zeros({n}, torch::TensorOptions().device(device));
    p.mutable_grad() = torch::randn({n}).to(device);
    params.push_back(p);
  }
  params.push_back(torch::zeros({4}, torch::TensorOptions().device(device)));  // no gradient
  double sq = 0;
  for (size_t i = 0; i < 3; ++i)
    sq += params[i].grad().to(torch::kDouble).pow(2).sum().item<double>();
  const double norm = std::sqrt(sq);
  const torch::Tensor t = GradNormTensor(params);
  EXPECT_EQ(t.device(), params[0].device());
  EXPECT_NEAR(t.item<double>(), norm, 1e-5 * norm);
  EXPECT_NEAR(GradNorm(params), norm, 1e-5 * norm);
  // Clipped: (norm + 1e-6) / max_norm; not clipped: 1.
  EXPECT_NEAR(ClipDivisor(t, norm / 4).item<float>(), (norm + 1e-6) / (norm / 4), 1e-5);
  EXPECT_EQ(ClipDivisor(t, norm * 2).item<float>(), 1.0f);
  EXPECT_FALSE(GradNormTensor({params[3]}).defined());
}

TEST(DeviceClipTest, NormAndDivisorMatchTheHost) { CheckClip(torch::kCPU); }

TEST(DeviceClipTest, CudaNormAndDivisorMatchTheHost) {
  SKIP_WITHOUT_CUDA();
  CheckClip(torch::Device(torch::kCUDA, 0));
}

// SplitHeads gives unbind's q, k and v (the same views) and, through attention (SDPA on the GPU,
// whose gradients have layouts of their own; a product on the CPU), the same gradient of the qkv
// product; a head left unused gets a zero gradient.
void CheckSplitHeads(torch::Device device, torch::Dtype dtype) {
  torch::manual_seed(7);
  const int64_t b = 2, t = 16, heads = 4, hd = 8;
  const auto options = torch::TensorOptions().device(device).dtype(dtype);
  const torch::Tensor x0 = torch::randn({b, t, 3 * heads * hd}, options);
  const torch::Tensor w = torch::randn({b, heads, t, hd}, options);
  const auto attend = [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
#if TRAINYARD_TORCH2
    if (device.is_cuda()) {
      return (at::scaled_dot_product_attention(q, k, v, {}, 0.0, true) * w).sum();
    }
#endif
    return (torch::softmax(torch::matmul(q, k.transpose(-2, -1)), -1).matmul(v) * w).sum();
  };
  // mode 0: attention (on a GPU its gradients come in [b, t, heads, hd] order); 1: v unused;
  // 2: the three read through [b, t, heads, hd] copies (their gradients in that order on any
  // device: one cat writes them).
  const torch::Tensor w_bshd = w.transpose(1, 2).contiguous();
  for (const int mode : {0, 1, 2}) {
    torch::Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
    const std::array<torch::Tensor, 3> split = SplitHeads(xa, heads);
    const std::vector<torch::Tensor> unbound =
        xb.view({b, t, 3, heads, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(torch::equal(split[i], unbound[i])) << i;
      EXPECT_EQ(split[i].sizes(), unbound[i].sizes());
      EXPECT_EQ(split[i].strides(), unbound[i].strides());
    }
    if (mode == 0) {
      attend(split[0], split[1], split[2]).backward();
      attend(unbound[0], unbound[1], unbound[2]).backward();
    } else if (mode == 1) {
      (split[0] * split[1] * w).sum().backward();
      (unbound[0] * unbound[1] * w).sum().backward();
      EXPECT_EQ(xa.grad().slice(2, 2 * heads * hd).abs().max().item<double>(), 0.0);
    } else {
      const auto bshd = [&](const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v) {
        const auto copy = [](const torch::Tensor& x) { return x.transpose(1, 2).contiguous(); };
        return ((copy(q) + 2 * copy(k) - copy(v)) * w_bshd).sum();
      };
      bshd(split[0], split[1], split[2]).backward();
      bshd(unbound[0], unbound[1], unbound[2]).backward();
    }
    ASSERT_TRUE(xa.grad().defined());
    EXPECT_EQ(xa.grad().sizes(), x0.sizes());
    EXPECT_EQ(xa.grad().scalar_type(), dtype);
    // (The GPU's attention backward may sum in another order run to run.)
    EXPECT_LT(RelativeError(xa.grad(), xb.grad()), dtype == torch::kFloat ? 1e-6 : 1e-2)
        << "mode " << mode;
  }
}

// SplitQkv gives the narrows' views of a [b, t, (heads + 2 kv) hd] product and, through a loss of
// all three, of q and k only, and of [b, t, n, hd] copies, the narrows' gradient.
void CheckSplitQkv(torch::Device device, torch::Dtype dtype) {
  torch::manual_seed(8);
  const int64_t b = 2, t = 16, heads = 4, kv = 2, hd = 8;
  const auto options = torch::TensorOptions().device(device).dtype(dtype);
  const torch::Tensor x0 = torch::randn({b, t, (heads + 2 * kv) * hd}, options);
  const torch::Tensor wq = torch::randn({b, heads, t, hd}, options);
  const torch::Tensor wk = torch::randn({b, kv, t, hd}, options);
  for (const int mode : {0, 1, 2}) {
    torch::Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
    const std::array<torch::Tensor, 3> split = SplitQkv(xa, heads, kv);
    auto part = [&](int64_t first, int64_t n) {
      return xb.narrow(2, first * hd, n * hd).view({b, t, n, hd}).transpose(1, 2);
    };
    const std::array<torch::Tensor, 3> want = {part(0, heads), part(heads, kv),
                                               part(heads + kv, kv)};
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(torch::equal(split[i], want[i])) << i;
      EXPECT_EQ(split[i].strides(), want[i].strides()) << i;
    }
    auto loss = [&](const std::array<torch::Tensor, 3>& s) {
      if (mode == 1) return (s[0] * wq).sum() + (s[1] * wk).sum();
      const auto copy = [](const torch::Tensor& x) { return x.transpose(1, 2).contiguous(); };
      if (mode == 2) {
        return (copy(s[0]) * copy(wq)).sum() + (copy(s[1]) * copy(wk)).sum() -
               (copy(s[2]) * copy(wk)).sum();
      }
      return (s[0] * wq).sum() + (s[1] * wk).sum() + (s[2] * s[1]).sum();
    };
    loss(split).backward();
    loss(want).backward();
    EXPECT_EQ(xa.grad().scalar_type(), dtype);
    EXPECT_LT(RelativeError(xa.grad(), xb.grad()), 1e-6) << "mode " << mode;
    if (mode == 1) {
      EXPECT_EQ(xa.grad().slice(2, (heads + kv) * hd).abs().max().item<double>(), 0.0);
    }
  }
}

TEST(SplitQkvTest, MatchesTheNarrowsAndTheirGradientOnTheCpu) {
  CheckSplitQkv(torch::kCPU, torch::kFloat);
  CheckSplitQkv(torch::kCPU, torch::kBFloat16);
}

TEST(SplitQkvTest, CudaMatchesTheNarrows) {
  SKIP_WITHOUT_CUDA();
  CheckSplitQkv(torch::Device(torch::kCUDA, 0), torch::kBFloat16);
}

TEST(SplitHeadsTest, MatchesUnbindAndItsGradientOnTheCpu) {
  CheckSplitHeads(torch::kCPU, torch::kFloat);
  CheckSplitHeads(torch::kCPU, torch::kBFloat16);
}

TEST(SplitHeadsTest, CudaMatchesUnbindThroughAttention) {
  SKIP_WITHOUT_CUDA();
  CheckSplitHeads(torch::Device(torch::kCUDA, 0), torch::kFloat);
  CheckSplitHeads(torch::Device(torch::kCUDA, 0), torch::kBFloat16);
}

}  // namespace
}  // namespace trainyard::trainer

namespace trainyard::trainer {
namespace {

// SwiGlu of [rows, width] on `device` in `dtype` against silu(gate) * up in fp64: the output and
// both gradients (of a random upstream gradient), within `tolerance` (relative, the whole tensor).
// `offset`: gate and up start one value into their storage (contiguous, but not at an address the
// kernel's 16-byte loads take).
void CheckSwiGlu(const torch::Device& device, torch::ScalarType dtype, int64_t rows, int64_t width,
                 double tolerance, uint64_t seed, bool offset = false) {
  SCOPED_TRACE(testing::Message() << device << " " << dtype << " " << rows << "x" << width
                                  << (offset ? " offset" : ""));
  torch::manual_seed(seed);
  const auto options = torch::TensorOptions().device(device).dtype(dtype);
  const auto place = [&](const torch::Tensor& t) {
    if (!offset) return t.to(options).requires_grad_(true);
    const torch::Tensor storage = torch::empty({t.numel() + 1}, options);
    storage.narrow(0, 1, t.numel()).copy_(t.flatten());
    return storage.narrow(0, 1, t.numel()).view(t.sizes()).detach().requires_grad_(true);
  };
  torch::Tensor gate = place(torch::randn({rows, width}) * 3);
  torch::Tensor up = place(torch::randn({rows, width}));
  const torch::Tensor dout = torch::randn({rows, width}).to(options);
  auto f64 = [](const torch::Tensor& t) {
    return t.detach().to(torch::kCPU, torch::kDouble).requires_grad_(true);
  };
  torch::Tensor g64 = f64(gate), u64 = f64(up);
  const torch::Tensor out64 = torch::silu(g64) * u64;
  (out64 * dout.to(torch::kCPU, torch::kDouble)).sum().backward();

  const torch::Tensor out = SwiGlu(gate, up);
  EXPECT_EQ(out.scalar_type(), dtype);
  out.backward(dout);
  EXPECT_EQ(gate.grad().scalar_type(), dtype);
  EXPECT_LT(RelativeError(out, out64), tolerance) << rows << "x" << width;
  EXPECT_LT(RelativeError(gate.grad(), g64.grad()), tolerance) << rows << "x" << width;
  EXPECT_LT(RelativeError(up.grad(), u64.grad()), tolerance) << rows << "x" << width;
}

TEST(SwiGluTest, MatchesSiluTimesUpOnTheCpu) {
  EXPECT_FALSE(UsesSwiGluKernel(torch::zeros({2, 3}), torch::zeros({2, 3})));
  CheckSwiGlu(torch::kCPU, torch::kFloat, 9, 40, 1e-6, 51);
}

TEST(SwiGluTest, CudaKernelMatchesSiluTimesUp) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  const torch::Tensor probe = torch::zeros({2, 3}, torch::TensorOptions().device(cuda));
  ASSERT_TRUE(UsesSwiGluKernel(probe, probe));
  EXPECT_FALSE(UsesSwiGluKernel(probe, torch::zeros({3, 2}, probe.options())));
  // Llama 3.2 1B's width on a batch of tokens (more elements than the grid: the loop strides),
  // and an odd size; fp32, and bf16 rounded once per output.
  CheckSwiGlu(cuda, torch::kFloat, 4096, 8192, 1e-6, 52);
  CheckSwiGlu(cuda, torch::kFloat, 7, 37, 1e-6, 53);
  CheckSwiGlu(cuda, torch::kBFloat16, 2048, 8192, 1e-2, 54);
  CheckSwiGlu(cuda, torch::kHalf, 33, 100, 5e-3, 55);
  // (Widths and addresses off the 16-byte loads: the remainder and the one-value kernel.)
  CheckSwiGlu(cuda, torch::kBFloat16, 5, 64, 1e-2, 56, /*offset=*/true);
  CheckSwiGlu(cuda, torch::kFloat, 3, 33, 1e-6, 57, /*offset=*/true);
}

// The Llama MLP through SwiGlu on the GPU gives the CPU's loss and gradients (fp32).
TEST(SwiGluTest, CudaLlamaMatchesTheCpu) {
  SKIP_WITHOUT_CUDA();
  const ModelConfig m = SmallModel("llama", /*tied=*/false);
  auto cpu = BuildModel(m, ModelOptions(), 7);
  auto gpu = BuildModel(m, ModelOptions(), 7);
  gpu->to(torch::Device(torch::kCUDA, 0));
  torch::manual_seed(8);
  const torch::Tensor windows = torch::randint(0, m.vocab, {4, m.seq_len + 1}, torch::kLong);
  cpu->Loss(windows).backward();
  const torch::Tensor loss = gpu->Loss(windows.to(torch::kCUDA));
  loss.backward();
  ExpectGradientsMatch(*gpu, *cpu, 1e-4);
}

}  // namespace
}  // namespace trainyard::trainer

namespace trainyard::trainer {
namespace {

// cos and sin of [t, hd] as the Llama rope makes them (each frequency twice), fp32 on `device`.
std::pair<torch::Tensor, torch::Tensor> RopeTables(int64_t t, int64_t hd,
                                                   const torch::Device& device) {
  const torch::Tensor inv_freq =
      1.0 / torch::pow(10000.0, torch::arange(0, hd, 2, torch::kLong).to(torch::kFloat) / hd);
  const torch::Tensor freqs = torch::outer(torch::arange(t, torch::kFloat), inv_freq);
  const torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(device), emb.sin().to(device)};
}

// ApplyRotary of q as the attention has it ([b, heads, t, hd], a transposed view of a
// [b, t, heads, hd] projection) on `device` in `dtype`: against each pair (i, i + hd/2) rotated
// by its angle in fp64 (the output, and the input's gradient of a random upstream gradient: the
// rotation back), within `tolerance`; and for fp32, against the ATen composition on the same
// device to the bit.
// `others`: q is the first `heads` heads of a projection with `others` more (the Llama layer's
// stacked q, k and v): not dense.
void CheckRotary(const torch::Device& device, torch::ScalarType dtype, int64_t b, int64_t heads,
                 int64_t t, int64_t hd, double tolerance, uint64_t seed, int64_t others = 0) {
  SCOPED_TRACE(testing::Message() << device << " " << dtype << " others " << others);
  torch::manual_seed(seed);
  const auto options = torch::TensorOptions().device(device).dtype(dtype);
  const torch::Tensor base = torch::randn({b, t, heads + others, hd}).to(options);
  torch::Tensor x = base.clone().requires_grad_(true);
  const torch::Tensor q = x.narrow(2, 0, heads).transpose(1, 2);
  const auto [cos, sin] = RopeTables(t, hd, device);
  const torch::Tensor dy = torch::randn({b, heads, t, hd}).to(options);

  // fp64: each pair as a complex number times e^(i angle); the gradient rotates back.
  const int64_t half = hd / 2;
  auto f64 = [](const torch::Tensor& v) { return v.detach().to(torch::kCPU, torch::kDouble); };
  const torch::Tensor q64 = f64(q), dy64 = f64(dy);
  const torch::Tensor c = f64(cos).narrow(1, 0, half), s = f64(sin).narrow(1, 0, half);
  auto rotate = [&](const torch::Tensor& v, double sign) {
    const torch::Tensor a = v.narrow(-1, 0, half), bb = v.narrow(-1, half, half);
    return torch::cat({a * c - sign * bb * s, bb * c + sign * a * s}, -1);
  };
  const torch::Tensor want = rotate(q64, 1.0), want_grad = rotate(dy64, -1.0);

  const torch::Tensor y = ApplyRotary(q, cos, sin);
  EXPECT_EQ(y.scalar_type(), dtype);
  EXPECT_EQ(y.sizes(), q.sizes());
  y.backward(dy);
  EXPECT_EQ(x.grad().scalar_type(), dtype);
  const std::string what = std::to_string(b) + "x" + std::to_string(heads) + "x" +
                           std::to_string(t) + "x" + std::to_string(hd);
  EXPECT_LT(RelativeError(y, want), tolerance) << what;
  EXPECT_LT(RelativeError(x.grad().narrow(2, 0, heads).transpose(1, 2), want_grad), tolerance)
      << what;
  if (others > 0) {
    EXPECT_EQ(x.grad().narrow(2, heads, others).abs().max().item<double>(), 0.0);
  }
  if (dtype == torch::kFloat) {
    torch::Tensor x2 = base.clone().requires_grad_(true);
    const torch::Tensor q2 = x2.narrow(2, 0, heads).transpose(1, 2);
    const torch::Tensor composed = q2 * cos + RotateHalf(q2) * sin;
    composed.backward(dy);
    EXPECT_TRUE(torch::equal(y, composed)) << what;
    EXPECT_TRUE(torch::equal(x.grad(), x2.grad())) << what;
  }
}

TEST(RotaryTest, RotatesEachPairByItsAngleOnTheCpu) {
  const auto [cos, sin] = RopeTables(5, 8, torch::kCPU);
  EXPECT_FALSE(UsesRotaryKernel(torch::zeros({1, 2, 5, 8}), cos, sin));
  CheckRotary(torch::kCPU, torch::kFloat, 2, 3, 5, 8, 1e-6, 61);
}

TEST(RotaryTest, CudaKernelRotatesAsTheComposition) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  const auto [cos, sin] = RopeTables(5, 8, cuda);
  const auto options = torch::TensorOptions().device(cuda);
  EXPECT_TRUE(UsesRotaryKernel(torch::zeros({1, 5, 2, 8}, options).transpose(1, 2), cos, sin));
  EXPECT_FALSE(UsesRotaryKernel(torch::zeros({1, 2, 5, 6}, options), cos, sin));  // cos's hd
  EXPECT_FALSE(UsesRotaryKernel(torch::zeros({1, 2, 5, 8}, options), cos.to(torch::kBFloat16),
                                sin.to(torch::kBFloat16)));
  // Llama 3.2 1B's query heads at T 2048, and at T 4096 on 5 windows (20.9M pairs: more than the
  // grid's 16.8M threads, so the loop strides), its key heads, and odd sizes; fp32 to the
  // composition's bit, bf16 and fp16 rounded once.
  CheckRotary(cuda, torch::kFloat, 2, 32, 2048, 64, 1e-6, 62);
  CheckRotary(cuda, torch::kFloat, 5, 32, 4096, 64, 1e-6, 66);
  CheckRotary(cuda, torch::kFloat, 3, 5, 7, 6, 1e-6, 63);
  CheckRotary(cuda, torch::kBFloat16, 4, 8, 2048, 64, 1e-2, 64);
  CheckRotary(cuda, torch::kHalf, 1, 3, 33, 128, 5e-3, 65);
  // q and k as Llama 3.2 1B's stacked product gives them (not dense): 16 bytes a load; and a head
  // width the 16-byte kernel does not take (one pair a thread).
  EXPECT_TRUE(UsesRotaryKernel(torch::zeros({1, 5, 6, 8}, options).narrow(2, 0, 2).transpose(1, 2),
                               cos, sin));
  CheckRotary(cuda, torch::kBFloat16, 2, 32, 2048, 64, 1e-2, 67, /*others=*/16);
  CheckRotary(cuda, torch::kFloat, 2, 8, 512, 64, 1e-6, 68, /*others=*/16);
  CheckRotary(cuda, torch::kBFloat16, 2, 3, 9, 12, 1e-2, 69, /*others=*/2);
}

}  // namespace
}  // namespace trainyard::trainer

namespace trainyard::trainer {
namespace {

// GpuLinear against autocast's linear (kernels/dense.h): x [shape..., in], weight [out, in] and
// bias [out] (when `bias`) in fp32 on `device`, the product under `precision`'s autocast, and the
// gradients of a random upstream gradient. The output and the input's gradient are autocast's own
// products on the same operands (compared at 1e-6: the same cuBLAS calls give the same bits;
// a LibTorch that laid out its linear's backward otherwise could differ by the dtype's rounding,
// and this tolerance would say so); the weight's and bias's gradients are compared
// with fp64 sums of the same rounded operands, where the fused product, accumulating and writing
// in fp32, must be close to exact (autocast's rounds its weight gradient to the dtype).
void CheckGpuLinear(const torch::Device& device, Precision precision, std::vector<int64_t> shape,
                    int64_t out, bool bias, bool weight_trained, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << device << " rows " << shape[0] << " in " << shape.back()
                                  << " out " << out << (bias ? " bias" : "")
                                  << (weight_trained ? "" : " frozen weight"));
  torch::manual_seed(seed);
  const int64_t in = shape.back();
  const auto f32 = torch::TensorOptions().device(device);
  const torch::Tensor x0 = torch::randn(shape, f32);
  const torch::Tensor w0 = torch::randn({out, in}, f32) / std::sqrt(double(in));
  const torch::Tensor b0 = torch::randn({out}, f32);
  std::vector<int64_t> out_shape = shape;
  out_shape.back() = out;
  const torch::Tensor dy = torch::randn(out_shape, f32);
  auto leaf = [](const torch::Tensor& t, bool grad) { return t.clone().requires_grad_(grad); };
  struct Run {
    torch::Tensor x, w, b, y;
  };
  auto run = [&](bool fused) {
    Run r{leaf(x0, true), leaf(w0, weight_trained), bias ? leaf(b0, true) : torch::Tensor(), {}};
    {
      AutocastScope autocast(device, precision);
      if (fused) {
        EXPECT_EQ(UsesGpuLinear(r.x, r.w, r.b), device.is_cuda());
        r.y = GpuLinear(r.x, r.w, r.b);
      } else {
        r.y = torch::linear(r.x, r.w, r.b);
      }
    }
    r.y.backward(dy.to(r.y.scalar_type()));
    return r;
  };
  const Run fused = run(true), plain = run(false);
  const bool half = precision != Precision::kFp32;
  // The exact sums of the operands the products read (rounded to autocast's dtype).
  const auto product_type =
      half ? (precision == Precision::kBf16 ? torch::kBFloat16 : torch::kHalf) : torch::kFloat;
  auto rounded = [&](const torch::Tensor& t) {
    return t.to(product_type).to(torch::kCPU, torch::kDouble).reshape({-1, t.size(-1)});
  };
  const torch::Tensor dy64 = rounded(dy), x64 = rounded(x0), w64 = rounded(w0);
  EXPECT_EQ(fused.y.scalar_type(), plain.y.scalar_type());
  EXPECT_EQ(fused.x.grad().scalar_type(), torch::kFloat);
  if (device.is_cuda() && GemmTuning()) {
    // The forward and the input's gradient: eager's products through cuBLASLt's tuned algorithm,
    // whose sums may be made in another order: no further from the exact ones than eager's
    // (rounded to the dtype), 1.5 times at most.
    torch::Tensor y64 = x64.mm(w64.t());
    if (bias) y64 = y64 + rounded(b0).view({1, -1});
    const torch::Tensor dx64 = dy64.mm(w64);
    EXPECT_LE(RelativeError(fused.y.reshape({-1, out}), y64),
              1.5 * RelativeError(plain.y.reshape({-1, out}), y64) + 1e-6);
    EXPECT_LE(RelativeError(fused.x.grad().reshape({-1, in}), dx64),
              1.5 * RelativeError(plain.x.grad().reshape({-1, in}), dx64) + 1e-6);
  } else {
    EXPECT_LT(RelativeError(fused.y, plain.y), 1e-6);
    EXPECT_LT(RelativeError(fused.x.grad(), plain.x.grad()), 1e-6);
  }
  if (weight_trained) {
    ASSERT_TRUE(fused.w.grad().defined());
    EXPECT_EQ(fused.w.grad().scalar_type(), torch::kFloat);
    const torch::Tensor dw64 = dy64.t().mm(x64);
    // (1e-4: fp32 accumulation over thousands of rows; the dtype's rounding is 2e-3 for bf16.)
    EXPECT_LT(RelativeError(fused.w.grad(), dw64), half ? 1e-4 : 1e-5);
    EXPECT_LT(RelativeError(plain.w.grad(), dw64), half ? 1e-2 : 1e-5);
  } else {
    EXPECT_FALSE(fused.w.grad().defined());
  }
  if (bias) {
    EXPECT_EQ(fused.b.grad().scalar_type(), torch::kFloat);
    const torch::Tensor db64 = dy64.sum(0);
    // (A frozen weight's trained bias: eager's reduction, rounded to the dtype.)
    EXPECT_LT(RelativeError(fused.b.grad(), db64), weight_trained ? 1e-4 : 1e-2);
    EXPECT_LT(RelativeError(plain.b.grad(), db64), 1e-2);
  }
}

// Turns GpuLinear's path off for a scope and on again after it, whatever happens in between.
struct GpuLinearOff {
  GpuLinearOff() { SetGpuLinearEnabled(false); }
  ~GpuLinearOff() { SetGpuLinearEnabled(true); }
};

TEST(GpuLinearTest, IsTorchsLinearOnTheCpu) {
  EXPECT_FALSE(UsesGpuLinear(torch::zeros({2, 3}), torch::zeros({4, 3}), torch::zeros({4})));
  CheckGpuLinear(torch::kCPU, Precision::kFp32, {9, 40}, 24, true, true, 61);
  CheckGpuLinear(torch::kCPU, Precision::kFp32, {2, 5, 16}, 8, false, true, 62);
}

// GpuLinear's autograd Function on the CPU (its weight gradient is the composition there):
// against torch::linear on the same operands cast to `dtype`, every gradient, with and without a
// bias, a frozen weight, an input without a gradient, a 3-D input.
TEST(GpuLinearTest, TheFunctionGivesTheCompositionsGradientsOnTheCpu) {
  struct Case {
    std::vector<int64_t> shape;
    int64_t out;
    bool bias, weight_trained, x_grad;
  };
  for (const auto dtype : {torch::kFloat, torch::kBFloat16})
    for (const Case& c :
         {Case{{9, 40}, 24, true, true, true}, Case{{2, 5, 16}, 8, false, true, true},
          Case{{7, 16}, 12, true, false, true}, Case{{7, 16}, 12, false, true, false},
          Case{{3, 8}, 4, true, true, false}}) {
      SCOPED_TRACE(testing::Message()
                   << dtype << " in " << c.shape.back() << " out " << c.out
                   << (c.bias ? " bias" : "") << (c.weight_trained ? "" : " frozen")
                   << (c.x_grad ? "" : " x without gradient"));
      torch::manual_seed(60);
      const int64_t in = c.shape.back();
      const torch::Tensor x0 = torch::randn(c.shape), w0 = torch::randn({c.out, in}),
                          b0 = torch::randn({c.out});
      std::vector<int64_t> out_shape = c.shape;
      out_shape.back() = c.out;
      const torch::Tensor dy = torch::randn(out_shape).to(dtype);
      torch::Tensor x = x0.clone().requires_grad_(c.x_grad),
                    w = w0.clone().requires_grad_(c.weight_trained),
                    b = c.bias ? b0.clone().requires_grad_(true) : torch::Tensor();
      torch::Tensor xr = x0.clone().requires_grad_(c.x_grad),
                    wr = w0.clone().requires_grad_(c.weight_trained),
                    br = c.bias ? b0.clone().requires_grad_(true) : torch::Tensor();
      const torch::Tensor y = LinearThroughOneProductForTest(x, w, b, dtype);
      const torch::Tensor yr =
          torch::linear(xr.to(dtype), wr.to(dtype), c.bias ? br.to(dtype) : torch::Tensor());
      EXPECT_EQ(y.scalar_type(), dtype);
      EXPECT_EQ(y.sizes(), yr.sizes());
      EXPECT_LT(RelativeError(y, yr), 1e-6);
      y.backward(dy);
      yr.backward(dy);
      EXPECT_EQ(x.grad().defined(), c.x_grad);
      if (c.x_grad) {
        EXPECT_EQ(x.grad().scalar_type(), torch::kFloat);
        EXPECT_LT(RelativeError(x.grad(), xr.grad()), 1e-6);
      }
      EXPECT_EQ(w.grad().defined(), c.weight_trained);
      if (c.weight_trained) {
        EXPECT_EQ(w.grad().scalar_type(), torch::kFloat);
        EXPECT_LT(RelativeError(w.grad(), wr.grad()), 1e-6);
      }
      if (c.bias) {
        EXPECT_EQ(b.grad().scalar_type(), torch::kFloat);
        EXPECT_LT(RelativeError(b.grad(), br.grad()), dtype == torch::kFloat ? 1e-6 : 1e-2);
      }
    }
  EXPECT_STREQ(GpuLinearBackwardPath(), "composition");
}

TEST(GpuLinearTest, CudaWeightAndBiasGradientsFromOneProduct) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  const torch::Tensor probe = torch::zeros({2, 8}, torch::TensorOptions().device(cuda));
  const torch::Tensor w = torch::zeros({4, 8}, probe.options());
  EXPECT_FALSE(UsesGpuLinear(probe, w, torch::Tensor()));  // no autocast: fp32 is torch's
  EXPECT_FALSE(UsesGpuLinear(probe.to(torch::kBFloat16), w, torch::Tensor()));
  {
    AutocastScope autocast(cuda, Precision::kBf16);
    EXPECT_TRUE(UsesGpuLinear(probe, w, torch::Tensor()));
    EXPECT_FALSE(UsesGpuLinear(probe, w.to(torch::kBFloat16), torch::Tensor()));
    {
      GpuLinearOff off;
      EXPECT_FALSE(UsesGpuLinear(probe, w, torch::Tensor()));
    }
    torch::NoGradGuard no_grad;  // (evaluation: autocast's cached casts)
    EXPECT_FALSE(UsesGpuLinear(probe, w, torch::Tensor()));
  }
  // GPT-2 small's qkv product on a batch of 4096 tokens (bias), its MLP's down projection on an
  // odd number of rows, a 3-D input without bias, a frozen weight (LoRA's base) with a trained
  // bias, fp16.
  CheckGpuLinear(cuda, Precision::kBf16, {4096, 768}, 2304, true, true, 63);
  EXPECT_STREQ(GpuLinearBackwardPath(), "cublaslt");
  CheckGpuLinear(cuda, Precision::kBf16, {1001, 3072}, 768, true, true, 64);
  CheckGpuLinear(cuda, Precision::kBf16, {2, 33, 64}, 96, false, true, 65);
  CheckGpuLinear(cuda, Precision::kBf16, {37, 40}, 24, true, false, 66);
  CheckGpuLinear(cuda, Precision::kFp16, {300, 128}, 256, true, true, 67);
  EXPECT_STREQ(GpuLinearBackwardPath(), "cublaslt");
}

#if TRAINYARD_CUDA_KERNELS
struct GemmTuningOff {
  GemmTuningOff() { SetGemmTuning(false); }
  ~GemmTuningOff() { SetGemmTuning(true); }
};

// The tuned products (--gemm-tune, on by default): a problem met for the first time times the
// heuristic's candidates on its own operands, and the call's result is still the one product's,
// within fp32 accumulation of the rounded operands; the weight gradient added in place (beta 1,
// the fused head's chunks after the first) is not timed (each launch would add once more): it
// takes the choice made for the same product without the add, and adds once. Off, a new problem
// is not timed. (Shapes of their own: a problem met before is not tuned again.)
TEST(GpuLinearTest, CudaTunedProductsGiveTheOneProductsResult) {
  SKIP_WITHOUT_CUDA();
  ASSERT_TRUE(GemmTuning());
  const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);
  torch::manual_seed(71);
  const int64_t rows = 4000, in = 640, out = 1536;
  const torch::Tensor dy = torch::randn({rows, out}, cuda).to(torch::kBFloat16);
  const torch::Tensor x = torch::randn({rows, in}, cuda).to(torch::kBFloat16);
  const torch::Tensor dw0 = torch::randn({out, in}, cuda);
  const torch::Tensor dy64 = dy.to(torch::kCPU, torch::kDouble),
                      x64 = x.to(torch::kCPU, torch::kDouble);
  const torch::Tensor product64 = dy64.t().mm(x64);
  // (A problem for which the heuristic offers one algorithm is not timed: `single`.)
  auto met = [](const GemmTuningStats& s) { return s.tuned + s.single; };
  auto say = [](const GemmTuningStats& s) {
    return testing::Message() << "tuned " << s.tuned << " (another than the heuristic's first "
                              << s.not_first << "), one algorithm offered " << s.single
                              << ", twinned " << s.twinned;
  };

  const GemmTuningStats before = GemmTuningStatsForTest();
  torch::Tensor dw = torch::empty({out, in}, cuda);
  ASSERT_TRUE(WeightGradientCublasLt(dy, x, dw, torch::Tensor()));
  const GemmTuningStats first = GemmTuningStatsForTest();
  EXPECT_EQ(met(first), met(before) + 1) << say(first);
  EXPECT_LT(RelativeError(dw, product64), 1e-4);
  // Added in place: the first call's choice, the product added once.
  dw.copy_(dw0);
  ASSERT_TRUE(WeightGradientCublasLt(dy, x, dw, torch::Tensor(), /*add=*/true));
  const GemmTuningStats added = GemmTuningStatsForTest();
  EXPECT_EQ(met(added), met(first)) << say(added);
  EXPECT_EQ(added.twinned, first.twinned + 1) << say(added);
  EXPECT_LT(RelativeError(dw, dw0.to(torch::kCPU, torch::kDouble) + product64), 1e-4);
  // Again (the choice cached), and again added once.
  ASSERT_TRUE(WeightGradientCublasLt(dy, x, dw, torch::Tensor(), /*add=*/true));
  EXPECT_EQ(GemmTuningStatsForTest().twinned, added.twinned);
  EXPECT_LT(RelativeError(dw, dw0.to(torch::kCPU, torch::kDouble) + 2 * product64), 1e-4);

  // With the bias gradient in the epilogue (another problem), written once, not summed per launch.
  torch::Tensor dw1 = torch::empty({out, in}, cuda), db = torch::empty({out}, cuda);
  ASSERT_TRUE(WeightGradientCublasLt(dy, x, dw1, db));
  const GemmTuningStats bias = GemmTuningStatsForTest();
  EXPECT_EQ(met(bias), met(added) + 1) << say(bias);
  EXPECT_LT(RelativeError(dw1, product64), 1e-4);
  EXPECT_LT(RelativeError(db, dy64.sum(0)), 1e-4);

  // Off: a new problem (another row count) takes the heuristic's first, untimed.
  GemmTuningOff off;
  const int64_t other = 3000;
  torch::Tensor dw2 = torch::empty({out, in}, cuda);
  ASSERT_TRUE(WeightGradientCublasLt(dy.narrow(0, 0, other).contiguous(),
                                     x.narrow(0, 0, other).contiguous(), dw2, torch::Tensor()));
  EXPECT_EQ(met(GemmTuningStatsForTest()), met(bias));
  EXPECT_LT(RelativeError(dw2, dy64.narrow(0, 0, other).t().mm(x64.narrow(0, 0, other))), 1e-4);
}
#endif

// A GPT (its MLP with the exact GELU, and with tanh's: GeluMlp's epilogues), an mlp model and a
// Llama in bf16 give the same loss and gradients with the fused dense layers as with autocast's
// linear.
TEST(GpuLinearTest, CudaGptAndLlamaMatchAutocastsLinear) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  for (const std::string name : {"gpt", "gpt gelu_tanh", "mlp gelu_tanh", "llama"}) {
    SCOPED_TRACE(name);
    const std::string kind = name.substr(0, name.find(' '));
    ModelConfig m = SmallModel(kind, true);
    m.gelu_tanh = name.find("gelu_tanh") != std::string::npos;
    if (kind == "mlp") m.d_hidden = 64;
    ModelPair pair = TwoModels(m, {}, {}, cuda, 9, 23);
    LanguageModel &fused = *pair.a, &plain = *pair.b;
    torch::Tensor lf, lp;
    std::string residual_path;
    {
      AutocastScope autocast(cuda, Precision::kBf16);
      lf = fused.Loss(pair.windows);
      residual_path = GpuLinearResidualPath();
      GpuLinearOff off;
      lp = plain.Loss(pair.windows);
    }
    const bool stacked_f = GraphHas(lf.grad_fn(), "CatBackward"),
               stacked_p = GraphHas(lp.grad_fn(), "CatBackward");
    lf.backward();
    lp.backward();
    // (The Llama layer's MLP adds the residual stream in down_proj's product, and q, k and v
    // come from one product of the three weights stacked.)
    if (kind == "llama") {
      EXPECT_EQ(residual_path, "cublaslt");
      EXPECT_TRUE(stacked_f);
      EXPECT_FALSE(stacked_p);
    }
    if (m.gelu_tanh) {
      EXPECT_STREQ(GeluMlpPath(), "cublaslt");
      EXPECT_STREQ(GeluMlpResidualPath(), "cublaslt");
    }
    EXPECT_LT(RelativeError(lf, lp), 1e-2);
    ExpectGradientsMatch(fused, plain, 3e-2);
    for (const auto& item : fused.named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_EQ(item.value().grad().scalar_type(), torch::kFloat) << item.key();
    }
  }
}

// GpuLinearResidual against residual + linear under autocast: the output (fp32) and the
// gradients of x, the weight and the residual, for a random upstream gradient.
void CheckLinearResidual(const torch::Device& device, const std::vector<int64_t>& shape,
                         int64_t out, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << device << " in " << shape.back() << " out " << out);
  torch::manual_seed(seed);
  const auto f32 = torch::TensorOptions().device(device);
  std::vector<int64_t> out_shape = shape;
  out_shape.back() = out;
  const torch::Tensor x0 = torch::randn(shape, f32),
                      w0 = torch::randn({out, shape.back()}, f32) * 0.1;
  const torch::Tensor r0 = torch::randn(out_shape, f32), dy = torch::randn(out_shape, f32);
  const Precision precision = device.is_cuda() ? Precision::kBf16 : Precision::kFp32;
  auto run = [&](bool fused) {
    torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
                  r = r0.clone().requires_grad_(true);
    torch::Tensor y;
    {
      AutocastScope autocast(device, precision);
      if (fused) {
        y = GpuLinearResidual(x, w, r);
      } else {
        y = r + torch::linear(x, w);
      }
    }
    (y * dy).sum().backward();
    return std::vector<torch::Tensor>{y, x.grad(), w.grad(), r.grad()};
  };
  const std::vector<torch::Tensor> got = run(true);
  if (device.is_cuda()) {
    EXPECT_STREQ(GpuLinearResidualPath(), "cublaslt");
  }
  const std::vector<torch::Tensor> want = run(false);
  EXPECT_EQ(got[0].scalar_type(), torch::kFloat);
  const double tolerance = device.is_cuda() ? 1e-2 : 1e-6;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), torch::kFloat) << i;
    EXPECT_LT(RelativeError(got[i], want[i]), tolerance) << i;
  }
  EXPECT_TRUE(torch::equal(got[3], dy));  // the residual's gradient: the output's
}

TEST(GpuLinearTest, ResidualIsTheCompositionOnTheCpu) {
  CheckLinearResidual(torch::kCPU, {2, 7, 24}, 16, 81);
}

TEST(GpuLinearTest, CudaResidualAddedInTheProduct) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  // Llama 3.2 1B's down projection on 2 x 512 tokens, and a small one.
  CheckLinearResidual(cuda, {2, 512, 8192}, 2048, 82);
  CheckLinearResidual(cuda, {3, 16, 64}, 32, 83);
}

// GeluMlp: the MLP as separate operations, each a leaf's gradient comparable.
struct MlpLeaves {
  torch::Tensor x, w1, b1, w2, b2;
  torch::Tensor residual;  // (where the case has one)
  torch::Tensor y;
};
MlpLeaves Leaves(const std::vector<torch::Tensor>& init, bool x_grad, bool w1_grad) {
  MlpLeaves l;
  l.x = init[0].clone().requires_grad_(x_grad);
  l.w1 = init[1].clone().requires_grad_(w1_grad);
  l.b1 = init[2].clone().requires_grad_(true);
  l.w2 = init[3].clone().requires_grad_(true);
  l.b2 = init[4].clone().requires_grad_(true);
  if (init.size() > 5) l.residual = init[5].clone().requires_grad_(true);
  return l;
}
// x [shape], w1 [hidden, in], b1, w2 [out, hidden], b2, and with `residual` a residual stream
// [shape but out]: random, fp32, on `device`.
std::vector<torch::Tensor> MlpInputs(const std::vector<int64_t>& shape, int64_t hidden, int64_t out,
                                     const torch::Device& device, uint64_t seed,
                                     bool residual = false) {
  torch::manual_seed(seed);
  const int64_t in = shape.back();
  const auto f32 = torch::TensorOptions().device(device);
  std::vector<torch::Tensor> init = {
      torch::randn(shape, f32), torch::randn({hidden, in}, f32) / std::sqrt(double(in)),
      torch::randn({hidden}, f32) * 0.5,
      torch::randn({out, hidden}, f32) / std::sqrt(double(hidden)), torch::randn({out}, f32) * 0.5};
  if (residual) {
    std::vector<int64_t> out_shape = shape;
    out_shape.back() = out;
    init.push_back(torch::randn(out_shape, f32) * 2);
  }
  return init;
}
// The MLP in fp64 on the CPU from the operands rounded to `dtype` (as the products read them):
// the reference both paths are measured against.
MlpLeaves MlpReference(const std::vector<torch::Tensor>& init, torch::Dtype dtype,
                       const torch::Tensor& dy, bool gelu_tanh) {
  std::vector<torch::Tensor> r;
  for (const auto& t : init) r.push_back(t.to(dtype).to(torch::kCPU, torch::kDouble));
  if (r.size() > 5) r[5] = init[5].to(torch::kCPU, torch::kDouble);  // (fp32: not rounded)
  MlpLeaves l = Leaves(r, true, true);
  l.y = torch::linear(torch::gelu(torch::linear(l.x, l.w1, l.b1), gelu_tanh ? "tanh" : "none"),
                      l.w2, l.b2);
  if (l.residual.defined()) l.y = l.residual + l.y;
  l.y.backward(dy.to(torch::kCPU, torch::kDouble));
  return l;
}

TEST(GeluMlpTest, IsTheCompositionOnTheCpu) {
  const std::vector<torch::Tensor> init = MlpInputs({5, 3, 16}, 64, 16, torch::kCPU, 71);
  for (const bool gelu_tanh : {false, true}) {
    SCOPED_TRACE(gelu_tanh ? "gelu_tanh" : "gelu");
    MlpLeaves l = Leaves(init, true, true);
    EXPECT_FALSE(UsesGeluEpilogue(l.x, l.w1, l.b1, l.w2, l.b2, gelu_tanh));
    l.y = GeluMlp(l.x, l.w1, l.b1, l.w2, l.b2, gelu_tanh);
    const torch::Tensor dy = torch::randn(l.y.sizes());
    l.y.backward(dy);
    const MlpLeaves ref = MlpReference(init, torch::kFloat, dy, gelu_tanh);
    EXPECT_LT(RelativeError(l.y, ref.y), 1e-6);
    EXPECT_LT(RelativeError(l.x.grad(), ref.x.grad()), 1e-6);
    EXPECT_LT(RelativeError(l.w1.grad(), ref.w1.grad()), 1e-6);
    EXPECT_LT(RelativeError(l.b2.grad(), ref.b2.grad()), 1e-6);
    // The other GELU is measurably different: the flag reaches the activation.
    const MlpLeaves other = MlpReference(init, torch::kFloat, dy, !gelu_tanh);
    EXPECT_GT(RelativeError(l.y, other.y), 1e-5);
  }
}

// model.activation reaches the GPT's and the mlp model's MLPs: a block of the same weights adds
// a different residual branch with each GELU, by about the two GELUs' difference (far above
// fp32's rounding, far below a different function).
TEST(GeluMlpTest, GptAndMlpModelsTakeTheSpecsGelu) {
  for (const std::string kind : {"gpt", "mlp"}) {
    SCOPED_TRACE(kind);
    ModelConfig erf = SmallModel(kind, false);
    if (kind == "mlp") erf.d_hidden = 64;
    ModelConfig tanh = erf;
    tanh.gelu_tanh = true;
    auto a = BuildModel(erf, {}, 5), b = BuildModel(tanh, {}, 5);
    torch::NoGradGuard no_grad;
    // Weights large enough that the MLPs' pre-activations reach where the two GELUs part (GPT's
    // 0.02 initialization keeps them near 0, where they agree to fp32's precision); the same in
    // both models.
    torch::manual_seed(24);
    auto pb = b->named_parameters();
    for (const auto& item : a->named_parameters()) {
      torch::Tensor w = item.value();
      if (w.dim() == 2) w.copy_(torch::randn(w.sizes()) * (2.0 / std::sqrt(double(w.size(1)))));
      pb[item.key()].copy_(w);
    }
    const torch::Tensor x = torch::randn(a->HiddenShape(3));
    const torch::Tensor branch_a = a->BlockForward(0, x) - x, branch_b = b->BlockForward(0, x) - x;
    const double difference = RelativeError(branch_b, branch_a);
    // (fp32's own noise here is about 1e-7; the GELUs differ by up to about 5e-4 of a unit.)
    EXPECT_GT(difference, 1e-5);
    EXPECT_LT(difference, 1e-2);
  }
}

// GeluMlp's Function on the CPU (its epilogues are ATen's operations there): against the
// composition on the same operands in `dtype`, every gradient, a 3-D input, a frozen first
// weight, an input without a gradient.
TEST(GeluMlpTest, TheFunctionGivesTheCompositionsGradientsOnTheCpu) {
  struct Case {
    std::vector<int64_t> shape;
    int64_t hidden, out;
    bool x_grad, w1_grad, residual;
  };
  for (const auto dtype : {torch::kFloat, torch::kBFloat16})
    for (const Case& c :
         {Case{{9, 40}, 64, 24, true, true, false}, Case{{2, 5, 16}, 48, 16, true, true, false},
          Case{{7, 16}, 32, 8, true, false, false}, Case{{7, 16}, 32, 8, false, true, false},
          Case{{9, 40}, 64, 24, true, true, true}, Case{{2, 5, 16}, 48, 16, true, false, true}}) {
      SCOPED_TRACE(testing::Message()
                   << dtype << " in " << c.shape.back() << " hidden " << c.hidden << " out "
                   << c.out << (c.w1_grad ? "" : " frozen w1")
                   << (c.x_grad ? "" : " x without gradient") << (c.residual ? " residual" : ""));
      const std::vector<torch::Tensor> init =
          MlpInputs(c.shape, c.hidden, c.out, torch::kCPU, 72, c.residual);
      MlpLeaves f = Leaves(init, c.x_grad, c.w1_grad), p = Leaves(init, c.x_grad, c.w1_grad);
      f.y = GeluMlpThroughEpiloguesForTest(f.x, f.w1, f.b1, f.w2, f.b2, dtype, f.residual);
      p.y = torch::linear(
          torch::gelu(torch::linear(p.x.to(dtype), p.w1.to(dtype), p.b1.to(dtype)), "tanh"),
          p.w2.to(dtype), p.b2.to(dtype));
      if (c.residual) {
        p.y = p.residual + p.y;
        EXPECT_STREQ(GeluMlpResidualPath(), "composition");
      }
      EXPECT_EQ(f.y.scalar_type(), c.residual ? torch::kFloat : dtype);
      EXPECT_EQ(f.y.sizes(), p.y.sizes());
      EXPECT_LT(RelativeError(f.y, p.y), 1e-6);
      const torch::Tensor dy = torch::randn(p.y.sizes()).to(dtype);
      f.y.backward(dy);
      p.y.backward(dy);
      // (bf16: the biases' gradients are summed in fp32 here, in bf16 by autograd's composition.)
      const double bias_tolerance = dtype == torch::kFloat ? 1e-6 : 1e-2;
      EXPECT_EQ(f.x.grad().defined(), c.x_grad);
      if (c.x_grad) {
        EXPECT_EQ(f.x.grad().scalar_type(), torch::kFloat);
        EXPECT_LT(RelativeError(f.x.grad(), p.x.grad()), 1e-6);
      }
      EXPECT_EQ(f.w1.grad().defined(), c.w1_grad);
      if (c.w1_grad) {
        EXPECT_LT(RelativeError(f.w1.grad(), p.w1.grad()), 1e-6);
      }
      EXPECT_LT(RelativeError(f.b1.grad(), p.b1.grad()), bias_tolerance);
      EXPECT_EQ(f.w2.grad().scalar_type(), torch::kFloat);
      EXPECT_LT(RelativeError(f.w2.grad(), p.w2.grad()), 1e-6);
      EXPECT_LT(RelativeError(f.b2.grad(), p.b2.grad()), bias_tolerance);
      if (c.residual) {
        // The stream's gradient is the output's, handed on.
        EXPECT_EQ(f.residual.grad().scalar_type(), torch::kFloat);
        EXPECT_TRUE(f.residual.grad().equal(p.residual.grad()));
      }
    }
  EXPECT_STREQ(GeluMlpPath(), "composition");
  // Nothing below the GELU trains (x without a gradient, the first product frozen): only the
  // second product's weight and bias and the stream get gradients, the composition's.
  const std::vector<torch::Tensor> init = MlpInputs({6, 16}, 32, 8, torch::kCPU, 73, true);
  MlpLeaves f = Leaves(init, false, false), p = Leaves(init, false, false);
  f.b1.requires_grad_(false);
  p.b1.requires_grad_(false);
  f.y = GeluMlpThroughEpiloguesForTest(f.x, f.w1, f.b1, f.w2, f.b2, torch::kFloat, f.residual);
  p.y = p.residual + torch::linear(torch::gelu(torch::linear(p.x, p.w1, p.b1), "tanh"), p.w2, p.b2);
  const torch::Tensor dy = torch::randn(p.y.sizes());
  f.y.backward(dy);
  p.y.backward(dy);
  EXPECT_FALSE(f.b1.grad().defined());
  EXPECT_FALSE(f.w1.grad().defined());
  EXPECT_LT(RelativeError(f.w2.grad(), p.w2.grad()), 1e-6);
  EXPECT_LT(RelativeError(f.b2.grad(), p.b2.grad()), 1e-6);
  EXPECT_TRUE(f.residual.grad().equal(p.residual.grad()));
}

// On the GPU under autocast: GeluMlp's epilogues against autocast's composition, both measured
// against fp64 on the same rounded operands; the epilogue keeps the pre-activation unrounded
// before its GELU, so it may only be closer.
void CheckGeluMlp(Precision precision, const std::vector<int64_t>& shape, int64_t hidden,
                  int64_t out, bool w1_grad, uint64_t seed, bool residual = false) {
  SCOPED_TRACE(testing::Message() << "rows " << shape[0] << " in " << shape.back() << " hidden "
                                  << hidden << " out " << out << (w1_grad ? "" : " frozen w1")
                                  << (residual ? " residual" : ""));
  const torch::Device cuda(torch::kCUDA, 0);
  const std::vector<torch::Tensor> init = MlpInputs(shape, hidden, out, cuda, seed, residual);
  const torch::Dtype dtype = precision == Precision::kBf16 ? torch::kBFloat16 : torch::kHalf;
  MlpLeaves f = Leaves(init, true, w1_grad), p = Leaves(init, true, w1_grad);
  {
    AutocastScope autocast(cuda, precision);
    EXPECT_TRUE(UsesGeluEpilogue(f.x, f.w1, f.b1, f.w2, f.b2, true));
    EXPECT_FALSE(UsesGeluEpilogue(f.x, f.w1, f.b1, f.w2, f.b2, false));  // erf: no epilogue
    f.y = GeluMlp(f.x, f.w1, f.b1, f.w2, f.b2, true, f.residual);
    GpuLinearOff off;
    EXPECT_FALSE(UsesGeluEpilogue(p.x, p.w1, p.b1, p.w2, p.b2, true));
    p.y = GeluMlp(p.x, p.w1, p.b1, p.w2, p.b2, true, p.residual);
  }
  if (residual) {
    EXPECT_STREQ(GeluMlpResidualPath(), "cublaslt");
  }
  // (With the fp32 residual stream the sum is fp32, as eager's add promotes it.)
  EXPECT_EQ(f.y.scalar_type(), residual ? torch::kFloat : dtype);
  EXPECT_EQ(f.y.sizes(), p.y.sizes());
  const torch::Tensor dy = torch::randn(p.y.sizes(), p.y.options());
  f.y.backward(dy);
  p.y.backward(dy);
  EXPECT_STREQ(GeluMlpPath(), "cublaslt");
  const MlpLeaves ref = MlpReference(init, dtype, dy, true);
  auto no_worse = [&](const char* what, const torch::Tensor& fused, const torch::Tensor& plain,
                      const torch::Tensor& reference) {
    const double ef = RelativeError(fused, reference), ep = RelativeError(plain, reference);
    EXPECT_LT(ef, std::max(1.5 * ep, 2e-3)) << what << ": eager's error " << ep;
    EXPECT_EQ(fused.scalar_type(), plain.scalar_type()) << what;
  };
  no_worse("y", f.y, p.y, ref.y);
  no_worse("x's gradient", f.x.grad(), p.x.grad(), ref.x.grad());
  if (w1_grad) {
    no_worse("w1's gradient", f.w1.grad(), p.w1.grad(), ref.w1.grad());
  } else {
    EXPECT_FALSE(f.w1.grad().defined());
  }
  no_worse("b1's gradient", f.b1.grad(), p.b1.grad(), ref.b1.grad());
  no_worse("w2's gradient", f.w2.grad(), p.w2.grad(), ref.w2.grad());
  no_worse("b2's gradient", f.b2.grad(), p.b2.grad(), ref.b2.grad());
  if (residual) {
    EXPECT_TRUE(f.residual.grad().equal(p.residual.grad()));
    EXPECT_TRUE(f.residual.grad().equal(dy));
  }
}

TEST(GeluMlpTest, CudaEpiloguesMatchTheComposition) {
  SKIP_WITHOUT_CUDA();
  // GPT-2 small's MLP on 4096 tokens, an odd number of rows, a 3-D input, a frozen first
  // weight, fp16.
  CheckGeluMlp(Precision::kBf16, {4096, 768}, 3072, 768, true, 73);
  CheckGeluMlp(Precision::kBf16, {1001, 256}, 1024, 256, true, 74);
  CheckGeluMlp(Precision::kBf16, {2, 33, 64}, 256, 64, true, 75);
  CheckGeluMlp(Precision::kBf16, {37, 64}, 128, 64, false, 76);
  CheckGeluMlp(Precision::kFp16, {300, 128}, 512, 128, true, 77);
  // With the residual stream added in the second product's epilogue (fp32 out): GPT-2 small's
  // block, a 3-D input, fp16.
  CheckGeluMlp(Precision::kBf16, {4096, 768}, 3072, 768, true, 78, true);
  CheckGeluMlp(Precision::kBf16, {2, 33, 64}, 256, 64, true, 79, true);
  CheckGeluMlp(Precision::kFp16, {300, 128}, 512, 128, true, 80, true);
}

// AdamW's update in fp64 (torch.optim.AdamW's formula) of fp32 tensors, on the CPU.
struct AdamWState {
  torch::Tensor p, g, m, v;
};
constexpr double kLr = 1e-2, kBeta1 = 0.9, kBeta2 = 0.95, kDecay = 0.1, kEps = 1e-8, kDivisor = 2.5;
AdamWState ReferenceAdamW(const AdamWState& s, int64_t step) {
  const auto f64 = [](const torch::Tensor& t) {
    return t.detach().to(torch::kCPU, torch::kDouble);
  };
  const torch::Tensor g = f64(s.g) / kDivisor;
  torch::Tensor p = f64(s.p) * (1 - kLr * kDecay);
  const torch::Tensor m = kBeta1 * f64(s.m) + (1 - kBeta1) * g;
  const torch::Tensor v = kBeta2 * f64(s.v) + (1 - kBeta2) * g * g;
  const double bc1 = 1 - std::pow(kBeta1, step), bc2 = 1 - std::pow(kBeta2, step);
  p = p - kLr / bc1 * m / (v.sqrt() / std::sqrt(bc2) + kEps);
  return {p, s.g, m, v};
}

// Tensors of the sizes that test the kernel's edges: empty, shorter than a 4-value access, a
// chunk's 16384 values and one either side, several chunks with a tail; 80 in all, 72 of them not
// empty (two launches: 64, then 8); one not 16-byte aligned (a view one value into its storage,
// 100003 values: seven chunks on the one-value path).
constexpr int kUnaligned = 18;
std::vector<AdamWState> RandomAdamWStates(const torch::Device& device) {
  torch::manual_seed(31);
  const std::vector<int64_t> sizes = {0, 1, 3, 5, 4096, 16383, 16384, 16385, 100003, 70001};
  std::vector<AdamWState> states;
  for (int i = 0; i < 80; ++i) {
    const int64_t n = sizes[i % sizes.size()];
    const auto f32 = torch::TensorOptions().device(device).dtype(torch::kFloat);
    const auto make = [&](bool positive) {
      torch::Tensor t = torch::randn({n + (i == kUnaligned ? 1 : 0)}, f32);
      if (positive) t = t.abs() * 0.01;
      return i == kUnaligned ? t.narrow(0, 1, n) : t;
    };
    states.push_back({make(false), make(false), make(false) * 0.1, make(true)});
  }
  return states;
}

// Runs FusedAdamWOnDevice at `step` over copies of `states` and checks each tensor against the
// fp64 update: p's change, m and v. Returns the copies.
std::vector<AdamWState> CheckAdamWAgainstFp64(const std::vector<AdamWState>& states, int64_t step,
                                              const char* kernel) {
  std::vector<AdamWState> got;
  std::vector<torch::Tensor> ps, gs, ms, vs;
  for (const AdamWState& s : states) {
    got.push_back({s.p.clone(), s.g.clone(), s.m.clone(), s.v.clone()});
    if (s.p.data_ptr() != s.p.storage().data()) {  // the unaligned view: keep it one
      for (torch::Tensor* t : {&got.back().p, &got.back().g, &got.back().m, &got.back().v}) {
        torch::Tensor buffer = torch::empty({t->numel() + 1}, t->options());
        buffer.narrow(0, 1, t->numel()).copy_(*t);
        *t = buffer.narrow(0, 1, t->numel());
      }
    }
    ps.push_back(got.back().p);
    gs.push_back(got.back().g);
    ms.push_back(got.back().m);
    vs.push_back(got.back().v);
  }
  FusedAdamWOnDevice(ps, gs, ms, vs, step, kLr, kBeta1, kBeta2, kDecay, kEps, 1.0 / kDivisor);
  EXPECT_STREQ(DeviceAdamWKernel(), kernel);
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i].p.numel() == 0) continue;
    SCOPED_TRACE(std::string(kernel) + " tensor " + std::to_string(i) + " of " +
                 std::to_string(states[i].p.numel()));
    const AdamWState want = ReferenceAdamW(states[i], step);
    const torch::Tensor p0 = states[i].p.to(torch::kCPU, torch::kDouble);
    // (The change is about 1e-2 of p: fp32's rounding of p is 1e-5 of it.)
    EXPECT_LT(RelativeError(got[i].p.to(torch::kDouble).cpu() - p0, want.p - p0), 1e-4);
    EXPECT_LT(RelativeError(got[i].m, want.m), 1e-6);
    EXPECT_LT(RelativeError(got[i].v, want.v), 1e-6);
  }
  return got;
}

// The fp64 reference itself, against the CPU's AdamW (the parameter server's kernel, which
// cpu_adam_test checks against PyTorch): FusedAdamWStep from a state made by a first step.
TEST(AdamWTest, ReferenceMatchesTheCpuKernel) {
  torch::manual_seed(32);
  const torch::Tensor p = torch::randn({1001}), g1 = torch::randn({1001}),
                      g2 = torch::randn({1001});
  torch::Tensor param = p.clone().requires_grad_(true);
  torch::optim::AdamW adamw(
      {param},
      torch::optim::AdamWOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kDecay));
  param.mutable_grad() = g1.clone();
  FusedAdamWStep(adamw, kLr, 1.0 / kDivisor);
  auto& st = AdamWStateOf(adamw, param, "test");
  const AdamWState before = {param.detach().clone(), g2, st.exp_avg().clone(),
                             st.exp_avg_sq().clone()};
  param.mutable_grad() = g2.clone();
  FusedAdamWStep(adamw, kLr, 1.0 / kDivisor);
  const AdamWState want = ReferenceAdamW(before, 2);
  const torch::Tensor p0 = before.p.to(torch::kDouble);
  EXPECT_LT(RelativeError(param.detach().to(torch::kDouble) - p0, want.p - p0), 1e-4);
  EXPECT_LT(RelativeError(st.exp_avg(), want.m), 1e-6);
  EXPECT_LT(RelativeError(st.exp_avg_sq(), want.v), 1e-6);
}

// The project's multi-tensor kernel and LibTorch's fused one against the fp64 update, at step 1
// and at step 3 from the first's state; the project's kernel leaves the gradients as they are.
// Then each timed on Llama 3.2 1B's tensors (printed, for bench/RESULTS.md).
TEST(AdamWTest, CudaKernelsMatchTheUpdateInFp64) {
  SKIP_WITHOUT_CUDA();
  const torch::Device device(torch::kCUDA, 0);
  const std::vector<AdamWState> states = RandomAdamWStates(device);
  SetOwnAdamWKernel(true);
  const std::vector<AdamWState> own =
      CheckAdamWAgainstFp64(states, 1, HasCrossEntropyKernel() ? "trainyard" : "torch");
  // (LibTorch's kernel writes the gradients back divided.)
  for (size_t i = 0; i < states.size() && HasCrossEntropyKernel(); ++i) {
    EXPECT_TRUE(torch::equal(own[i].g, states[i].g)) << i;
  }
  CheckAdamWAgainstFp64(own, 3, HasCrossEntropyKernel() ? "trainyard" : "torch");
#if TRAINYARD_CUDA_KERNELS
  // Three blocks: each walks many chunks, across tensors (one wave of an H200 takes each chunk
  // in a block of its own).
  SetAdamWBlocksForTest(3);
  CheckAdamWAgainstFp64(states, 2, "trainyard");
  SetAdamWBlocksForTest(0);
#endif
  SetOwnAdamWKernel(false);
  CheckAdamWAgainstFp64(states, 1, "torch");
  SetOwnAdamWKernel(true);

  // Llama 3.2 1B's tensors a layer (q, k, v, o, gate, up, down, two norms) times 16, the
  // embedding and the final norm: 1.24e9 values, 28 bytes of traffic each.
  std::vector<int64_t> sizes = {128256LL * 2048, 2048};
  for (int layer = 0; layer < 16; ++layer) {
    for (const int64_t n : {2048LL * 2048, 512LL * 2048, 512LL * 2048, 2048LL * 2048, 8192LL * 2048,
                            8192LL * 2048, 8192LL * 2048, 2048LL, 2048LL}) {
      sizes.push_back(n);
    }
  }
  std::vector<torch::Tensor> ps, gs, ms, vs;
  double values = 0;
  // (About 20 GB: a card without them skips the timing.)
  try {
    for (const int64_t n : sizes) {
      const auto f32 = torch::TensorOptions().device(device).dtype(torch::kFloat);
      ps.push_back(torch::randn({n}, f32));
      gs.push_back(torch::randn({n}, f32) * 1e-3);
      ms.push_back(torch::zeros({n}, f32));
      vs.push_back(torch::zeros({n}, f32));
      values += static_cast<double>(n);
    }
  } catch (const c10::Error& e) {
    std::cout << "adamw: no timing, the tensors do not fit: " << e.what_without_backtrace()
              << std::endl;
    return;
  }
  std::string times;
  for (const bool own_kernel : {true, false}) {
    SetOwnAdamWKernel(own_kernel);
    FusedAdamWOnDevice(ps, gs, ms, vs, 1, kLr, kBeta1, kBeta2, kDecay, kEps, 1.0);
    constexpr int kCalls = 10;
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) {
      FusedAdamWOnDevice(ps, gs, ms, vs, 2 + i, kLr, kBeta1, kBeta2, kDecay, kEps, 1.0 / kDivisor);
    }
    torch::cuda::synchronize();
    const double ms_each =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count() /
        kCalls;
    times += std::string(" ") + DeviceAdamWKernel() + " " + std::to_string(ms_each) + " ms (" +
             std::to_string(static_cast<int>(values * 28 / ms_each / 1e6)) + " GB/s);";
  }
  SetOwnAdamWKernel(true);
  std::cout << "adamw, Llama 3.2 1B's " << sizes.size() << " tensors:" << times << std::endl;
}

}  // namespace
}  // namespace trainyard::trainer
