// The CPU AdamW kernel (kernels/adam/cpu_adam.h) on every Highway target this machine supports,
// against a double-precision reference written here and against PyTorch's torch.optim.AdamW
// itself (tests/adam_torch_reference.py, Debian's python3-torch); and its thread pool.
//
// Error metric for fp32 results (params, m, v), per element: |a_i - r_i| / S_i <= 1e-6, where r
// is the double reference and S_i the size of what was summed into element i: the same
// recurrence run in double on absolute values (S_m = beta1 S_m + (1 - beta1) |g|; S_v = v; S_p =
// (1 - lr wd) S_p + step_size S_m / denom). Where nothing cancels S_i = |r_i| and this is the
// plain per-element relative error; where m (and so the update) cancels towards zero, fp32
// rounding is relative to the terms, not to the small result, and so is the bound.
#include "kernels/adam/cpu_adam.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kernels/adam/thread_pool.h"
#include "tests/testing/subprocess.h"

namespace trainyard::adam {
namespace {

using ::testing::Contains;

constexpr double kTolerance = 1e-6;
constexpr int kSteps = 10;

// What the parameter server uses, with a larger lr and weight decay so that every term matters,
// and a clipping coefficient.
AdamWConfig TestConfig(int64_t step) {
  AdamWConfig c;
  c.lr = 1e-2f;
  c.beta1 = 0.9f;
  c.beta2 = 0.999f;
  c.eps = 1e-8f;
  c.weight_decay = 0.1f;
  c.grad_scale = 0.37f;
  c.step = step;
  return c;
}

// fp32 -> bf16 bits, round to nearest even (c10::BFloat16's scalar rule; NaN -> 0x7FC0).
uint16_t RoundToBf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16);
}

float Bf16Value(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &widened, sizeof(x));
  return x;
}

// max_i |a_i - r_i| / magnitude_i (see the top of the file).
template <typename A, typename R>
double ComponentwiseError(const std::vector<A>& a, const std::vector<R>& r,
                          const std::vector<double>& magnitude) {
  double worst = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    const double diff = std::abs(static_cast<double>(a[i]) - static_cast<double>(r[i]));
    if (diff == 0) continue;
    worst = std::max(worst, magnitude[i] > 0 ? diff / magnitude[i] : INFINITY);
  }
  return worst;
}

// Gradients of varied magnitude (1e-4 .. 1 per element, some exactly zero).
std::vector<float> RandomGrads(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> exponent(-4.0f, 0.0f);
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i)
    g[i] = i % 97 == 3 ? 0.0f : normal(rng) * std::pow(10.0f, exponent(rng));
  return g;
}

// AdamW in double from the same fp32 inputs, as the formula states it, with the magnitudes of the
// error metric.
struct ReferenceState {
  ReferenceState(const std::vector<float>& p, const std::vector<float>& m0,
                 const std::vector<float>& v0)
      : param(p.begin(), p.end()), m(m0.begin(), m0.end()), v(v0.begin(), v0.end()) {
    for (double x : param) param_magnitude.push_back(std::abs(x));
    for (double x : m) m_magnitude.push_back(std::abs(x));
  }
  std::vector<double> param, m, v, param_magnitude, m_magnitude;
};

void ReferenceStep(const AdamWConfig& c, ReferenceState& s, const std::vector<float>& grad) {
  const double lr = c.lr, beta1 = c.beta1, beta2 = c.beta2, eps = c.eps, wd = c.weight_decay;
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(c.step));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(c.step));
  const double step_size = lr / bias_correction1;
  for (size_t i = 0; i < grad.size(); ++i) {
    const double g = static_cast<double>(grad[i]) * c.grad_scale;
    s.param[i] *= 1 - lr * wd;
    s.m[i] = beta1 * s.m[i] + (1 - beta1) * g;
    s.v[i] = beta2 * s.v[i] + (1 - beta2) * g * g;
    const double denom = std::sqrt(s.v[i]) / std::sqrt(bias_correction2) + eps;
    s.param[i] -= step_size * s.m[i] / denom;
    s.m_magnitude[i] = beta1 * s.m_magnitude[i] + (1 - beta1) * std::abs(g);
    s.param_magnitude[i] =
        (1 - lr * wd) * s.param_magnitude[i] + step_size * s.m_magnitude[i] / denom;
  }
}

struct Errors {
  double param, m, v;
};

// Errors of (param, m, v) against (param_ref, m_ref, v_ref), with the magnitudes of `s`.
template <typename R>
Errors ErrorsAgainst(const ReferenceState& s, const std::vector<float>& param,
                     const std::vector<float>& m, const std::vector<float>& v,
                     const std::vector<R>& param_ref, const std::vector<R>& m_ref,
                     const std::vector<R>& v_ref) {
  return {ComponentwiseError(param, param_ref, s.param_magnitude),
          ComponentwiseError(m, m_ref, s.m_magnitude), ComponentwiseError(v, v_ref, s.v)};
}

// ---------------------------------------------------------------------------------------------
// Targets and conversions.

TEST(CpuAdamTest, CompilesInAndDetectsTheX86Targets) {
  const std::vector<std::string> targets = SupportedTargets();
  ASSERT_FALSE(targets.empty());
  EXPECT_EQ(targets.back(), "SCALAR");
  EXPECT_THAT(targets, Contains("SSE4"));  // every x86-64 CPU this project runs on has SSE4.2
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_THAT(targets, Contains("AVX2"));
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    EXPECT_THAT(targets, Contains("AVX3"));
  }
  // Without ForceTarget the dispatcher picks the best one.
  EXPECT_EQ(ActiveTarget(), targets.front());
}

TEST(CpuAdamTest, ForceTargetRejectsUnknownNamesAndRestoresTheBest) {
  EXPECT_EQ(ForceTarget("NEON").code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(ForceTarget("SCALAR").ok());
  EXPECT_EQ(ActiveTarget(), "SCALAR");
  ASSERT_TRUE(ForceTarget("").ok());
  EXPECT_EQ(ActiveTarget(), SupportedTargets().front());
}

class CpuAdamTargetTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(ForceTarget(GetParam()).ok());
    ASSERT_EQ(ActiveTarget(), GetParam());
  }
  void TearDown() override { EXPECT_TRUE(ForceTarget("").ok()); }
};

TEST_P(CpuAdamTargetTest, FloatToBf16RoundsToNearestEvenLikeTorch) {
  // Expected bits from torch 1.13: torch.tensor([...]).to(torch.bfloat16).
  const std::vector<std::pair<float, uint16_t>> cases = {
      {1.0f, 0x3F80},         {-0.0f, 0x8000},       {INFINITY, 0x7F80},
      {-INFINITY, 0xFF80},    {1e-40f, 0x0001},      {3.0e38f, 0x7F62},
      {3.4e38f, 0x7F80},      {1.00390625f, 0x3F80},  // tie, rounds down to even
      {1.01171875f, 0x3F82},                          // tie, rounds up to even
      {1.005859375f, 0x3F81}, {-2.5f, 0xC020},
  };
  for (size_t n : {size_t{1}, size_t{3}, cases.size()}) {
    std::vector<float> in;
    std::vector<uint16_t> want;
    for (size_t i = 0; i < n; ++i) {
      in.push_back(cases[i].first);
      want.push_back(cases[i].second);
    }
    std::vector<uint16_t> out(n, 0xDEAD);
    FloatToBf16(in.data(), out.data(), static_cast<int64_t>(n));
    EXPECT_EQ(out, want) << "n=" << n;
  }
  const float nans[] = {NAN, -NAN};
  uint16_t nan_out[2];
  FloatToBf16(nans, nan_out, 2);
  EXPECT_EQ(nan_out[0], 0x7FC0);
  EXPECT_EQ(nan_out[1], 0x7FC0);
}

TEST_P(CpuAdamTargetTest, Bf16RoundTripsEveryBitPattern) {
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> widened(all.size());
  Bf16ToFloat(all.data(), widened.data(), static_cast<int64_t>(all.size()));
  std::vector<uint16_t> back(all.size());
  FloatToBf16(widened.data(), back.data(), static_cast<int64_t>(all.size()));
  for (int i = 0; i < 65536; ++i) {
    const uint16_t bits = all[i];
    uint32_t f;
    std::memcpy(&f, &widened[i], sizeof(f));
    ASSERT_EQ(f, static_cast<uint32_t>(bits) << 16) << i;
    const bool nan = (bits & 0x7F80) == 0x7F80 && (bits & 0x7F) != 0;
    ASSERT_EQ(back[i], nan ? 0x7FC0 : bits) << i;
  }
  // Random floats, odd lengths: the same bits as the scalar rule.
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int64_t n : {1, 7, 1001}) {
    std::vector<float> in(n);
    for (float& x : in) {
      const uint32_t b = any_bits(rng);
      std::memcpy(&x, &b, sizeof(x));
    }
    std::vector<uint16_t> out(n);
    FloatToBf16(in.data(), out.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], RoundToBf16(in[i])) << in[i];
  }
}

// ---------------------------------------------------------------------------------------------
// AdamW against the double reference: kSteps steps from a non-zero state (steps 5 .. 14).

struct AdamRun {
  std::vector<float> param, m, v;
  std::optional<ReferenceState> reference;
};

AdamRun StartRun(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  AdamRun r;
  r.param.resize(n);
  r.m.resize(n);
  r.v.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    r.param[i] = normal(rng);
    r.m[i] = 0.01f * normal(rng);
    r.v[i] = 1e-4f * std::abs(normal(rng));
  }
  r.reference.emplace(r.param, r.m, r.v);
  return r;
}

void ExpectCloseToReference(const AdamRun& r, const std::string& what) {
  const ReferenceState& s = *r.reference;
  const Errors e = ErrorsAgainst(s, r.param, r.m, r.v, s.param, s.m, s.v);
  EXPECT_LE(e.param, kTolerance) << what << ": params";
  EXPECT_LE(e.m, kTolerance) << what << ": m";
  EXPECT_LE(e.v, kTolerance) << what << ": v";
  std::printf("%-6s %-10s error vs double: params %.2e  m %.2e  v %.2e\n", ActiveTarget().c_str(),
              what.c_str(), e.param, e.m, e.v);
}

TEST_P(CpuAdamTargetTest, MatchesDoubleReferenceOverTenStepsWithBf16Copy) {
  for (int64_t n : {1, 7, 64, 1000003}) {
    AdamRun r = StartRun(n, 42 + n);
    std::mt19937_64 rng(1000 + n);
    std::vector<uint16_t> param_bf16(n, 0xDEAD);
    for (int64_t step = 5; step < 5 + kSteps; ++step) {
      const AdamWConfig c = TestConfig(step);
      const std::vector<float> grad = RandomGrads(rng, n);
      AdamWStep(c, r.param.data(), r.m.data(), r.v.data(), grad.data(), param_bf16.data(), n);
      ReferenceStep(c, *r.reference, grad);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(param_bf16[i], RoundToBf16(r.param[i])) << "n=" << n << " i=" << i;
      }
    }
    ExpectCloseToReference(r, "n=" + std::to_string(n));
  }
}

TEST_P(CpuAdamTargetTest, MatchesDoubleReferenceWithBf16Grads) {
  for (int64_t n : {1, 7, 64, 1000003}) {
    AdamRun r = StartRun(n, 77 + n);
    AdamRun without_copy = r;
    std::mt19937_64 rng(2000 + n);
    std::vector<uint16_t> param_bf16(n);
    for (int64_t step = 5; step < 5 + kSteps; ++step) {
      const AdamWConfig c = TestConfig(step);
      std::vector<float> grad = RandomGrads(rng, n);
      std::vector<uint16_t> grad_bf16(n);
      for (int64_t i = 0; i < n; ++i) {
        grad_bf16[i] = RoundToBf16(grad[i]);
        grad[i] = Bf16Value(grad_bf16[i]);  // what the reference sees
      }
      AdamWStepBf16Grad(c, r.param.data(), r.m.data(), r.v.data(), grad_bf16.data(),
                        param_bf16.data(), n);
      AdamWStepBf16Grad(c, without_copy.param.data(), without_copy.m.data(), without_copy.v.data(),
                        grad_bf16.data(), nullptr, n);
      ReferenceStep(c, *r.reference, grad);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(param_bf16[i], RoundToBf16(r.param[i])) << "n=" << n << " i=" << i;
      }
    }
    ExpectCloseToReference(r, "n=" + std::to_string(n));
    // Writing the bf16 copy changes nothing else.
    EXPECT_EQ(r.param, without_copy.param);
    EXPECT_EQ(r.m, without_copy.m);
    EXPECT_EQ(r.v, without_copy.v);
  }
}

TEST_P(CpuAdamTargetTest, Bf16GradsGiveTheSameBitsAsTheirFp32Values) {
  const int64_t n = 4099;
  AdamRun a = StartRun(n, 5);
  AdamRun b = a;
  std::mt19937_64 rng(6);
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<float> grad = RandomGrads(rng, n);
    std::vector<uint16_t> grad_bf16(n);
    FloatToBf16(grad.data(), grad_bf16.data(), n);
    Bf16ToFloat(grad_bf16.data(), grad.data(), n);
    AdamWStep(TestConfig(step), a.param.data(), a.m.data(), a.v.data(), grad.data(), nullptr, n);
    AdamWStepBf16Grad(TestConfig(step), b.param.data(), b.m.data(), b.v.data(), grad_bf16.data(),
                      nullptr, n);
  }
  EXPECT_EQ(a.param, b.param);
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.v, b.v);
}

INSTANTIATE_TEST_SUITE_P(Targets, CpuAdamTargetTest, ::testing::ValuesIn(SupportedTargets()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// ---------------------------------------------------------------------------------------------
// Against torch.optim.AdamW itself, every target, foreach=False and foreach=True.

constexpr char kPython[] = "/usr/bin/python3";

template <typename T>
void Append(std::string& out, const T* data, size_t count) {
  out.append(reinterpret_cast<const char*>(data), count * sizeof(T));
}

TEST(CpuAdamTorchTest, MatchesTorchAdamWOnEveryTarget) {
  ASSERT_EQ(access(kPython, X_OK), 0)
      << kPython << " not found: this test needs Python 3 with PyTorch (apt-get install "
      << "python3-torch)";
  const int64_t n = 100003;
  std::mt19937_64 rng(2024);
  std::normal_distribution<float> normal;
  std::vector<float> params0(n);
  for (float& p : params0) p = normal(rng);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < kSteps; ++s) grads.push_back(RandomGrads(rng, n));
  // Values for the bf16 conversion: ties, subnormals, overflow, random (no NaN: torch's own
  // vectorized and scalar conversions disagree on it).
  std::vector<float> probe = {0.0f,    -0.0f,    1.0f,    1.00390625f, 1.01171875f, 1e-40f,
                              -1e-40f, 3.39e38f, 3.4e38f, INFINITY,    -INFINITY,   -2.5f};
  std::uniform_int_distribution<uint32_t> any_bits;
  while (probe.size() < 4099) {
    const uint32_t b = any_bits(rng);
    float x;
    std::memcpy(&x, &b, sizeof(x));
    if (!std::isnan(x)) probe.push_back(x);
  }
  const AdamWConfig c0 = TestConfig(1);
  ReferenceState reference(params0, std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f));
  for (int s = 0; s < kSteps; ++s) ReferenceStep(TestConfig(s + 1), reference, grads[s]);

  std::string input = "TYAD";
  const int64_t header_ints[] = {n, kSteps, static_cast<int64_t>(probe.size())};
  const double header_doubles[] = {c0.lr,  c0.beta1,        c0.beta2,
                                   c0.eps, c0.weight_decay, c0.grad_scale};
  Append(input, header_ints, 3);
  Append(input, header_doubles, 6);
  Append(input, params0.data(), params0.size());
  for (const auto& g : grads) Append(input, g.data(), g.size());
  Append(input, probe.data(), probe.size());

  testing::TempDir dir;
  const std::string in_path = dir.path() + "/in.bin", out_path = dir.path() + "/out.bin";
  std::ofstream(in_path, std::ios::binary) << input;
  const std::string script = std::string(TRAINYARD_SOURCE_DIR) + "/tests/adam_torch_reference.py";
  const testing::CommandResult result =
      testing::RunCommand({kPython, script, in_path, out_path}, {}, absl::Seconds(180));
  ASSERT_EQ(result.exit_code, 0) << "PyTorch reference failed (this test needs python3-torch):\n"
                                 << result.out << result.err;
  std::ifstream out_file(out_path, std::ios::binary);
  const std::string output((std::istreambuf_iterator<char>(out_file)),
                           std::istreambuf_iterator<char>());
  ASSERT_EQ(output.size(), 2 * 3 * n * sizeof(float) + probe.size() * sizeof(uint16_t));
  auto torch_floats = [&](int which) {  // 0..5: p, m, v with foreach=False, then foreach=True
    std::vector<float> t(n);
    std::memcpy(t.data(), output.data() + which * n * sizeof(float), n * sizeof(float));
    return t;
  };
  std::vector<uint16_t> torch_bf16(probe.size());
  std::memcpy(torch_bf16.data(), output.data() + 6 * n * sizeof(float),
              probe.size() * sizeof(uint16_t));

  for (const std::string& target : SupportedTargets()) {
    SCOPED_TRACE("target " + target);
    ASSERT_TRUE(ForceTarget(target).ok());
    std::vector<uint16_t> ours_bf16(probe.size());
    FloatToBf16(probe.data(), ours_bf16.data(), static_cast<int64_t>(probe.size()));
    EXPECT_EQ(ours_bf16, torch_bf16);

    std::vector<float> p = params0, m(n, 0.0f), v(n, 0.0f);
    for (int s = 0; s < kSteps; ++s) {
      AdamWStep(TestConfig(s + 1), p.data(), m.data(), v.data(), grads[s].data(), nullptr, n);
    }
    for (int foreach = 0; foreach < 2; ++foreach) {
      SCOPED_TRACE(foreach ? "foreach=True" : "foreach=False");
      const std::vector<float> torch_p = torch_floats(3 * foreach);
      const std::vector<float> torch_m = torch_floats(3 * foreach + 1);
      const std::vector<float> torch_v = torch_floats(3 * foreach + 2);
      const Errors e = ErrorsAgainst(reference, p, m, v, torch_p, torch_m, torch_v);
      EXPECT_LE(e.param, kTolerance) << "params";
      EXPECT_LE(e.m, kTolerance) << "m";
      EXPECT_LE(e.v, kTolerance) << "v";
      int64_t identical = 0;
      for (int64_t i = 0; i < n; ++i) {
        identical += p[i] == torch_p[i] && m[i] == torch_m[i] && v[i] == torch_v[i];
      }
      const Errors torch_vs_double = ErrorsAgainst(reference, torch_p, torch_m, torch_v,
                                                   reference.param, reference.m, reference.v);
      std::printf(
          "%-6s foreach=%d error vs torch: params %.2e m %.2e v %.2e; bit-identical %.4f%%; "
          "torch vs double: params %.2e m %.2e v %.2e\n",
          target.c_str(), foreach, e.param, e.m, e.v, 100.0 * identical / n, torch_vs_double.param,
          torch_vs_double.m, torch_vs_double.v);
    }
  }
  ASSERT_TRUE(ForceTarget("").ok());
}

// ---------------------------------------------------------------------------------------------
// Thread pool.

TEST(CpuAdamThreadPoolTest, ParallelForCoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (int64_t n : {0, 1, 7, 64, 1000, 100003}) {
      for (int64_t grain : {0, 1, 3, 64, 1000, 1 << 20}) {
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int64_t> calls{0};
        std::atomic<bool> bad_chunk{false};
        pool.ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
          const int64_t g = std::max<int64_t>(grain, 1);
          if (begin % g != 0 || end <= begin || end > n || (end - begin != g && end != n)) {
            bad_chunk = true;
          }
          for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
          calls.fetch_add(1);
        });
        const std::string what = "threads=" + std::to_string(threads) + " n=" + std::to_string(n) +
                                 " grain=" + std::to_string(grain);
        EXPECT_FALSE(bad_chunk) << what;
        const int64_t g = std::max<int64_t>(grain, 1);
        EXPECT_EQ(calls.load(), (n + g - 1) / g) << what;
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << what << " i=" << i;
      }
    }
  }
}

TEST(CpuAdamThreadPoolTest, OneThreadRunsInlineOnTheCaller) {
  ThreadPool pool(1);
  std::set<std::thread::id> ids;
  pool.ParallelFor(100, 1, [&](int64_t, int64_t) { ids.insert(std::this_thread::get_id()); });
  EXPECT_EQ(ids, std::set<std::thread::id>{std::this_thread::get_id()});
}

TEST(CpuAdamThreadPoolTest, ZeroThreadsMeansEveryCore) {
  ThreadPool pool(0);
  EXPECT_EQ(pool.threads(), std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
}

TEST(CpuAdamThreadPoolTest, ConcurrentCallersEachGetTheirWholeLoop) {
  ThreadPool pool(3);
  constexpr int kCallers = 4;
  constexpr int64_t kN = 20000;
  std::vector<std::vector<std::atomic<int>>> hits(kCallers);
  for (auto& h : hits) h = std::vector<std::atomic<int>>(kN);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 20; ++rep) {
        pool.ParallelFor(kN, 100, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) hits[c][i].fetch_add(1);
        });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(hits[c][i].load(), 20) << c << " " << i;
  }
}

TEST(CpuAdamThreadPoolTest, ParallelStepEqualsSerialStepBitForBit) {
  const int64_t n = 3 * kParallelChunk + 5;
  for (int threads : {2, 3}) {
    ThreadPool pool(threads);
    AdamRun serial = StartRun(n, 9);
    AdamRun parallel = serial;
    std::vector<uint16_t> serial_bf16(n), parallel_bf16(n);
    std::mt19937_64 rng(10);
    for (int64_t step = 1; step <= 3; ++step) {
      const std::vector<float> grad = RandomGrads(rng, n);
      std::vector<uint16_t> grad_bf16(n);
      FloatToBf16(grad.data(), grad_bf16.data(), n);
      const AdamWConfig c = TestConfig(step);
      AdamWStep(c, serial.param.data(), serial.m.data(), serial.v.data(), grad.data(),
                serial_bf16.data(), n);
      AdamWStepParallel(pool, c, parallel.param.data(), parallel.m.data(), parallel.v.data(),
                        grad.data(), parallel_bf16.data(), n);
      AdamWStepBf16Grad(c, serial.param.data(), serial.m.data(), serial.v.data(), grad_bf16.data(),
                        serial_bf16.data(), n);
      AdamWStepBf16GradParallel(pool, c, parallel.param.data(), parallel.m.data(),
                                parallel.v.data(), grad_bf16.data(), parallel_bf16.data(), n);
      // Unaligned start and an odd length: the same per-element bits as well.
      AdamWStep(c, serial.param.data() + 3, serial.m.data() + 3, serial.v.data() + 3,
                grad.data() + 3, nullptr, n - 3);
      AdamWStepParallel(pool, c, parallel.param.data() + 3, parallel.m.data() + 3,
                        parallel.v.data() + 3, grad.data() + 3, nullptr, n - 3);
    }
    EXPECT_EQ(std::memcmp(serial.param.data(), parallel.param.data(), n * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(serial.m.data(), parallel.m.data(), n * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(serial.v.data(), parallel.v.data(), n * sizeof(float)), 0);
    EXPECT_EQ(serial_bf16, parallel_bf16);
  }
}

}  // namespace
}  // namespace trainyard::adam
