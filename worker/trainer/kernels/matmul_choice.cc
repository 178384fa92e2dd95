// Timing the matmul paths on the model's shapes (see matmul_choice.h).
#include "worker/trainer/kernels/matmul_choice.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "absl/strings/str_format.h"

namespace trainyard::trainer {
namespace {

using Clock = std::chrono::steady_clock;

// Forward plus backward of one timed shape does about this many FLOPs at most (tens of ms on one
// core): a GPT-2 head (768 x 50257 on thousands of rows) is timed on fewer rows and scaled.
constexpr double kFlopsPerShape = 4e8;

// One shape, ready to run forward and backward; `scale` turns its time into the work's.
struct Timed {
  torch::Tensor a, b, bias_or_mask, grad;
  bool attention = false;
  double alpha = 1;
  double scale = 1;
};

int64_t TimedCount(int64_t full, double flops_each) {
  const auto fits = static_cast<int64_t>(kFlopsPerShape / std::max(flops_each, 1.0));
  return std::clamp<int64_t>(fits, std::min<int64_t>(full, 16), full);
}

std::vector<Timed> Prepare(const MatmulWork& work) {
  // The numbers do not matter, only that they are finite; drawn from a generator of their own, so
  // that rank 0's global one stays where the other ranks' are.
  at::Generator generator = at::detail::createCPUGenerator(0);
  const auto randn = [&](at::IntArrayRef size) { return torch::randn(size, generator); };
  std::vector<Timed> out;
  for (const LinearWork& l : work.linear) {
    if (l.rows <= 0 || l.in <= 0 || l.out <= 0 || l.count <= 0) continue;
    const int64_t rows = TimedCount(l.rows, 6.0 * static_cast<double>(l.in * l.out));
    Timed t;
    t.a = randn({rows, l.in}).requires_grad_(true);
    t.b = randn({l.out, l.in}).requires_grad_(true);
    if (l.bias) t.bias_or_mask = randn({l.out}).requires_grad_(true);
    t.grad = randn({rows, l.out});
    t.scale = static_cast<double>(l.count) * static_cast<double>(l.rows) / rows;
    out.push_back(std::move(t));
  }
  for (const AttentionWork& w : work.attention) {
    if (w.batch_heads <= 0 || w.seq_len <= 0 || w.head_dim <= 0 || w.count <= 0) continue;
    const double per_head = 12.0 * static_cast<double>(w.seq_len * w.seq_len * w.head_dim);
    const int64_t heads = TimedCount(w.batch_heads, per_head);
    Timed t;
    t.attention = true;
    t.a = randn({heads, w.seq_len, w.head_dim}).requires_grad_(true);  // q (and k, v)
    t.b = randn({heads, w.seq_len, w.head_dim}).requires_grad_(true);
    t.bias_or_mask =
        torch::full({w.seq_len, w.seq_len}, -std::numeric_limits<float>::infinity()).triu(1);
    t.alpha = 1.0 / std::sqrt(static_cast<double>(w.head_dim));
    t.grad = randn({heads, w.seq_len, w.head_dim});
    t.scale = static_cast<double>(w.count) * static_cast<double>(w.batch_heads) / heads;
    out.push_back(std::move(t));
  }
  return out;
}

// Forward and backward of every shape on the process's current path: the work's estimated ms.
double RunOnce(std::vector<Timed>& shapes) {
  torch::AutoGradMode grad_mode(true);
  double total = 0;
  for (Timed& t : shapes) {
    for (torch::Tensor* p : {&t.a, &t.b, &t.bias_or_mask}) {
      if (p->defined() && p->requires_grad()) p->mutable_grad() = torch::Tensor();
    }
    const Clock::time_point start = Clock::now();
    torch::Tensor y;
    if (t.attention) {
      const torch::Tensor scores = BatchedMatmul(t.a, t.b.transpose(1, 2), t.alpha, t.bias_or_mask);
      y = BatchedMatmul(torch::softmax(scores, -1), t.b, 1.0, torch::Tensor());
    } else {
      y = Linear(t.a, t.b, t.bias_or_mask);
    }
    y.backward(t.grad);
    total += std::chrono::duration<double, std::milli>(Clock::now() - start).count() * t.scale;
  }
  return total;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

const char* MatmulPathName(MatmulPath path) {
  return path == MatmulPath::kOneDnn ? "oneDNN" : "BLAS";
}

MatmulPath FasterPath(double onednn_ms, double blas_ms, double margin) {
  return blas_ms < onednn_ms * (1 - margin) ? MatmulPath::kBlas : MatmulPath::kOneDnn;
}

std::string MatmulTiming::Describe() const {
  const bool onednn = path == MatmulPath::kOneDnn;
  return absl::StrFormat(
      "%s: %.1f ms a micro-batch's GEMMs (forward and backward), %s %.1f ms (timed at start%s)",
      onednn ? "oneDNN" : "the BLAS", onednn ? onednn_ms : blas_ms, onednn ? "the BLAS" : "oneDNN",
      onednn ? blas_ms : onednn_ms,
      onednn && blas_ms < onednn_ms
          ? absl::StrFormat("; within the %.0f%% that keeps oneDNN", 100 * kKeepOneDnnMargin)
          : "");
}

MatmulTiming TimeMatmulPaths(const MatmulWork& work, int reps) {
  const MatmulPath before = OneDnnMatmulsEnabled() ? MatmulPath::kOneDnn : MatmulPath::kBlas;
  std::vector<Timed> shapes = Prepare(work);
  std::vector<double> onednn, blas;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up (oneDNN builds its primitives)
    for (int i = 0; i < 2; ++i) {
      // Alternating which goes first: neither always runs on a warmer cache or a quieter core.
      const bool first_onednn = rep % 2 == 0;
      const MatmulPath path = (i == 0) == first_onednn ? MatmulPath::kOneDnn : MatmulPath::kBlas;
      SetMatmulPath(path);
      const double ms = RunOnce(shapes);
      if (rep > 0) (path == MatmulPath::kOneDnn ? onednn : blas).push_back(ms);
    }
  }
  SetMatmulPath(before);
  MatmulTiming timing;
  timing.onednn_ms = Median(onednn);
  timing.blas_ms = Median(blas);
  timing.path = FasterPath(timing.onednn_ms, timing.blas_ms);
  return timing;
}

}  // namespace trainyard::trainer
