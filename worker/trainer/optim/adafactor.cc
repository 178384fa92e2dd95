// Adafactor as transformers implements it, on CPU slots: factored second moments (see
// optimizers.h).
#include "worker/trainer/optim/slot_internal.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/adam/cpu_adam.h"

namespace trainyard::trainer {

namespace {

// Elements [lo, hi) of a parameter in chunks of kAdafactorChunk, each told its first element's
// (lead, row, column): f(chunk index, first, end, l, r, c).
constexpr int64_t kAdafactorChunk = int64_t{1} << 15;

template <typename F>
void ForEachChunk(const Factored& f, int64_t lo, int64_t hi, F&& fn) {
  const int64_t chunks = (hi - lo + kAdafactorChunk - 1) / kAdafactorChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t ch = cb; ch < ce; ++ch) {
      const int64_t first = lo + ch * kAdafactorChunk;
      const int64_t end = std::min(hi, first + kAdafactorChunk);
      const int64_t per_lead = f.rows * f.cols;
      fn(ch, first, end, f.matrix ? first / per_lead : 0, f.matrix ? (first / f.cols) % f.rows : 0,
         f.matrix ? first % f.cols : first);
    }
  });
}

}  // namespace

void SlotOptimizer::StepAdafactor(double lr, double grad_scale) {
  const auto scale = static_cast<float>(grad_scale);
  // What each slot holds of each parameter of its buffer: element range [lo, hi) of the
  // parameter, at `at` in the slot; its factors' offset.
  struct Part {
    Factored f;
    int64_t numel = 0, foff = 0, lo = 0, hi = 0, at = 0;
  };
  std::vector<std::vector<Part>> parts(num_slots());
  std::vector<int64_t> factor_base(num_slots() + 1, 0), param_base(num_slots() + 1, 0);
  for (int i = 0; i < num_slots(); ++i) {
    const OptimizerSlot& s = slots_[i];
    int64_t foff = 0;
    for (const auto& prm : s.params) {
      Part part;
      part.f = FactorsOf(prm.shape);
      part.numel = Numel(prm.shape);
      part.foff = foff;
      part.lo = std::max<int64_t>(0, s.begin - prm.offset);
      part.hi = std::min(part.numel, s.begin + s.param.numel() - prm.offset);
      part.at = prm.offset + part.lo - s.begin;
      foff += part.f.numel();
      parts[i].push_back(part);
    }
    factor_base[i + 1] = factor_base[i] + state_[i]->factors.numel();
    param_base[i + 1] = param_base[i] + static_cast<int64_t>(s.params.size());
  }
  std::vector<torch::Tensor> grads(num_slots());
  for (int i = 0; i < num_slots(); ++i) {
    const torch::Tensor& p = slots_[i].param;
    if (p.grad().defined() && p.numel() > 0) grads[i] = p.grad().contiguous();
  }
  // Whole parameters without a gradient are left alone, as transformers does; the parts of a
  // group's shards all take part (another rank may hold the gradient).
  auto skipped = [&](int i) { return group_ == nullptr && !grads[i].defined(); };

  // Pass 1: each slot's part of every parameter's squared-gradient sums (rows and columns of a
  // matrix, elements of a vector), summed over the group. Serial: a column gathers from every
  // row.
  torch::Tensor sums = torch::zeros({factor_base.back()}, torch::kDouble);
  for (int i = 0; i < num_slots(); ++i) {
    if (!grads[i].defined()) continue;
    const float* g = grads[i].data_ptr<float>();
    double* out = sums.data_ptr<double>() + factor_base[i];
    for (const Part& part : parts[i]) {
      if (part.lo >= part.hi) continue;
      const Factored& f = part.f;
      // Element e of the parameter is the slot's part.at + (e - part.lo).
      const float* gp = g + part.at;
      if (!f.matrix) {
        for (int64_t e = part.lo; e < part.hi; ++e) {
          const double gv = gp[e - part.lo] * scale;
          out[part.foff + e] += gv * gv;
        }
        continue;
      }
      double* row = out + part.foff;
      double* col = out + part.foff + f.lead * f.rows;
      for (int64_t e = part.lo; e < part.hi;) {  // a row (or what the slot holds of it) at a time
        const int64_t l = e / (f.rows * f.cols), r = (e / f.cols) % f.rows, c0 = e % f.cols;
        const int64_t end = std::min(part.hi, e + (f.cols - c0));
        const float* gr = gp + (e - part.lo);
        double* cl = col + l * f.cols + c0;
        double sum = 0;
        for (int64_t x = 0; x < end - e; ++x) {
          const double gv = gr[x] * scale;
          sum += gv * gv;
          cl[x] += gv * gv;
        }
        row[l * f.rows + r] += sum;
        e = end;
      }
    }
  }
  if (group_ != nullptr && group_->world_size() > 1) group_->AllReduceSum({sums})->Wait();

  // The factors' moving averages (every parameter of the buffer, on every rank of the group);
  // then, for the parts this slot holds, their reciprocal square roots: of a matrix's rows over
  // their mean, then of its columns (transformers' _approx_sq_grad factors), or of a vector's
  // second moment.
  const auto beta2t =
      static_cast<float>(1.0 - std::pow(static_cast<double>(step_), hyper_.adafactor_decay));
  const auto eps1 = static_cast<float>(hyper_.adafactor_eps1);
  std::vector<std::vector<std::vector<float>>> rsqrt(num_slots());
  for (int i = 0; i < num_slots(); ++i) {
    rsqrt[i].resize(parts[i].size());
    if (skipped(i)) continue;
    float* fac = state_[i]->factors.data_ptr<float>();
    const double* sum = sums.data_ptr<double>() + factor_base[i];
    for (size_t j = 0; j < parts[i].size(); ++j) {
      const Part& part = parts[i][j];
      const Factored& f = part.f;
      float* mine = fac + part.foff;
      const double* summed = sum + part.foff;
      // Rows and vector elements are means over a row's columns (a vector's: itself), columns
      // over a column's rows.
      const int64_t rows = f.matrix ? f.lead * f.rows : f.cols;
      for (int64_t x = 0; x < f.numel(); ++x) {
        const int64_t count = !f.matrix ? 1 : x < rows ? f.cols : f.rows;
        const float mean = static_cast<float>(summed[x] / static_cast<double>(count)) + eps1;
        mine[x] = mine[x] * beta2t + mean * (1.0f - beta2t);
      }
      if (!grads[i].defined() || part.lo >= part.hi) continue;
      std::vector<float>& out = rsqrt[i][j];
      out.resize(static_cast<size_t>(f.numel()));
      if (!f.matrix) {
        for (int64_t x = 0; x < f.numel(); ++x) out[x] = 1.0f / std::sqrt(mine[x]);
        continue;
      }
      for (int64_t l = 0; l < f.lead; ++l) {
        double total = 0;
        for (int64_t r = 0; r < f.rows; ++r) total += mine[l * f.rows + r];
        const auto row_mean = static_cast<float>(total / static_cast<double>(f.rows));
        for (int64_t r = 0; r < f.rows; ++r) {
          out[l * f.rows + r] = 1.0f / std::sqrt(mine[l * f.rows + r] / row_mean);
        }
      }
      for (int64_t x = rows; x < f.numel(); ++x) out[x] = 1.0f / std::sqrt(mine[x]);
    }
  }
  // Calls u(e, update) for the unscaled updates of elements [first, end) of a part, the first at
  // (l, r, c).
  auto updates = [&](int i, size_t j, int64_t first, int64_t end, int64_t l, int64_t r, int64_t c,
                     auto&& u) {
    const Part& part = parts[i][j];
    const Factored& f = part.f;
    const float* factor = rsqrt[i][j].data();
    const float* gp = grads[i].data_ptr<float>() + part.at;  // gp[e - part.lo]: element e
    if (!f.matrix) {
      for (int64_t e = first; e < end; ++e) u(e, factor[e] * (gp[e - part.lo] * scale));
      return;
    }
    const float* row = factor;
    const float* col = factor + f.lead * f.rows;
    for (int64_t e = first; e < end; ++e) {
      u(e, row[l * f.rows + r] * col[l * f.cols + c] * (gp[e - part.lo] * scale));
      if (++c == f.cols) {
        c = 0;
        if (++r == f.rows) {
          r = 0;
          ++l;
        }
      }
    }
  };

  // Pass 2: the updates' squares per parameter (for the RMS clip), summed chunk by chunk (the
  // same order whatever the threads), then over the group.
  torch::Tensor update_sq = torch::zeros({param_base.back()}, torch::kDouble);
  for (int i = 0; i < num_slots(); ++i) {
    if (!grads[i].defined()) continue;
    for (size_t j = 0; j < parts[i].size(); ++j) {
      const Part& part = parts[i][j];
      if (part.lo >= part.hi) continue;
      std::vector<double> partial((part.hi - part.lo + kAdafactorChunk - 1) / kAdafactorChunk, 0);
      ForEachChunk(part.f, part.lo, part.hi,
                   [&](int64_t ch, int64_t first, int64_t end, int64_t l, int64_t r, int64_t c) {
                     double sq = 0;
                     updates(i, j, first, end, l, r, c,
                             [&](int64_t, float u) { sq += static_cast<double>(u) * u; });
                     partial[ch] = sq;
                   });
      double total = 0;
      for (double x : partial) total += x;
      update_sq.data_ptr<double>()[param_base[i] + j] = total;
    }
  }
  if (group_ != nullptr && group_->world_size() > 1) group_->AllReduceSum({update_sq})->Wait();

  // Pass 3: apply, as transformers: update / max(1, RMS / clip) * lr; p += -wd*lr * p; p -= it.
  const auto rate = static_cast<float>(lr);
  const auto decay = static_cast<float>(-hyper_.weight_decay * lr);
  for (int i = 0; i < num_slots(); ++i) {
    if (!grads[i].defined()) continue;
    float* p = slots_[i].param.data_ptr<float>();
    for (size_t j = 0; j < parts[i].size(); ++j) {
      const Part& part = parts[i][j];
      if (part.lo >= part.hi) continue;
      const double rms = std::sqrt(update_sq.data_ptr<double>()[param_base[i] + j] /
                                   static_cast<double>(part.numel));
      const auto divisor = static_cast<float>(std::max(1.0, rms / hyper_.adafactor_clip));
      float* pp = p + part.at;  // pp[e - part.lo]: element e
      ForEachChunk(part.f, part.lo, part.hi,
                   [&](int64_t, int64_t first, int64_t end, int64_t l, int64_t r, int64_t c) {
                     updates(i, j, first, end, l, r, c, [&](int64_t e, float u) {
                       const float step = u / divisor * rate;
                       float& x = pp[e - part.lo];
                       if (decay != 0) x = x + x * decay;
                       x = x - step;
                     });
                   });
    }
  }
}

}  // namespace trainyard::trainer
