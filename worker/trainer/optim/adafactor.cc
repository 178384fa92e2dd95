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

// One Adafactor step over every slot of a buffer: where each slot's part of each parameter lies,
// then the passes SlotOptimizer::StepAdafactor runs between the group's sums.
class AdafactorStep {
 public:
  // `factors[i]`: slot i's factors (SlotState::factors); `grouped`: the slots are shards of a
  // group's buffer. Gradients are multiplied by `scale` as they are read.
  AdafactorStep(const std::vector<OptimizerSlot>& slots, std::vector<torch::Tensor> factors,
                float scale, bool grouped)
      : slots_(slots), factors_(std::move(factors)), scale_(scale), grouped_(grouped) {
    const int n = static_cast<int>(slots.size());
    parts_.resize(n);
    factor_base_.assign(n + 1, 0);
    param_base_.assign(n + 1, 0);
    grads_.resize(n);
    rsqrt_.resize(n);
    for (int i = 0; i < n; ++i) {
      const OptimizerSlot& s = slots[i];
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
        parts_[i].push_back(part);
      }
      factor_base_[i + 1] = factor_base_[i] + factors_[i].numel();
      param_base_[i + 1] = param_base_[i] + static_cast<int64_t>(s.params.size());
      const torch::Tensor& p = s.param;
      if (p.grad().defined() && p.numel() > 0) grads_[i] = p.grad().contiguous();
    }
  }

  // Pass 1: each slot's part of every parameter's squared-gradient sums (rows and columns of a
  // matrix, elements of a vector), to be summed over the group. Serial: a column gathers from
  // every row.
  torch::Tensor SquaredGradientSums() const {
    torch::Tensor sums = torch::zeros({factor_base_.back()}, torch::kDouble);
    for (size_t i = 0; i < parts_.size(); ++i) {
      if (!grads_[i].defined()) continue;
      const float* g = grads_[i].data_ptr<float>();
      double* out = sums.data_ptr<double>() + factor_base_[i];
      for (const Part& part : parts_[i]) {
        if (part.lo < part.hi) AddSquares(part, g + part.at, out + part.foff);
      }
    }
    return sums;
  }

  // The factors' moving averages from the group's `sums` (every parameter of the buffer, on every
  // rank of the group); then, for the parts this slot holds, their reciprocal square roots: of a
  // matrix's rows over their mean, then of its columns (transformers' _approx_sq_grad factors),
  // or of a vector's second moment.
  void UpdateFactors(const torch::Tensor& sums, float beta2t, float eps1) {
    for (size_t i = 0; i < parts_.size(); ++i) {
      rsqrt_[i].resize(parts_[i].size());
      if (Skipped(i)) continue;
      float* fac = factors_[i].data_ptr<float>();
      const double* sum = sums.data_ptr<double>() + factor_base_[i];
      for (size_t j = 0; j < parts_[i].size(); ++j) {
        const Part& part = parts_[i][j];
        float* mine = fac + part.foff;
        Average(part.f, sum + part.foff, beta2t, eps1, mine);
        if (!grads_[i].defined() || part.lo >= part.hi) continue;
        ReciprocalRoots(part.f, mine, &rsqrt_[i][j]);
      }
    }
  }

  // Pass 2: the updates' squares per parameter (for the RMS clip), summed chunk by chunk (the
  // same order whatever the threads), to be summed over the group.
  torch::Tensor UpdateSquares() const {
    torch::Tensor update_sq = torch::zeros({param_base_.back()}, torch::kDouble);
    for (size_t i = 0; i < parts_.size(); ++i) {
      if (!grads_[i].defined()) continue;
      for (size_t j = 0; j < parts_[i].size(); ++j) {
        const Part& part = parts_[i][j];
        if (part.lo >= part.hi) continue;
        std::vector<double> partial((part.hi - part.lo + kAdafactorChunk - 1) / kAdafactorChunk, 0);
        ForEachChunk(part.f, part.lo, part.hi,
                     [&](int64_t ch, int64_t first, int64_t end, int64_t l, int64_t r, int64_t c) {
                       double sq = 0;
                       ForEachUpdate(i, j, first, end, l, r, c,
                                     [&](int64_t, float u) { sq += static_cast<double>(u) * u; });
                       partial[ch] = sq;
                     });
        double total = 0;
        for (double x : partial) total += x;
        update_sq.data_ptr<double>()[param_base_[i] + j] = total;
      }
    }
    return update_sq;
  }

  // Pass 3: apply, as transformers: update / max(1, RMS / clip) * rate; p += decay * p; p -= it.
  // `update_sq`: the group's sums of pass 2.
  void Apply(const torch::Tensor& update_sq, float rate, float decay, double clip) const {
    for (size_t i = 0; i < parts_.size(); ++i) {
      if (!grads_[i].defined()) continue;
      float* p = slots_[i].param.data_ptr<float>();
      for (size_t j = 0; j < parts_[i].size(); ++j) {
        const Part& part = parts_[i][j];
        if (part.lo >= part.hi) continue;
        const double rms = std::sqrt(update_sq.data_ptr<double>()[param_base_[i] + j] /
                                     static_cast<double>(part.numel));
        const auto divisor = static_cast<float>(std::max(1.0, rms / clip));
        float* pp = p + part.at;  // pp[e - part.lo]: element e
        ForEachChunk(part.f, part.lo, part.hi,
                     [&](int64_t, int64_t first, int64_t end, int64_t l, int64_t r, int64_t c) {
                       ForEachUpdate(i, j, first, end, l, r, c, [&](int64_t e, float u) {
                         const float step = u / divisor * rate;
                         float& x = pp[e - part.lo];
                         if (decay != 0) x = x + x * decay;
                         x = x - step;
                       });
                     });
      }
    }
  }

 private:
  // What a slot holds of one parameter of its buffer: element range [lo, hi) of the parameter,
  // at `at` in the slot; its factors' offset in the slot's.
  struct Part {
    Factored f;
    int64_t numel = 0, foff = 0, lo = 0, hi = 0, at = 0;
  };

  // Whole parameters without a gradient are left alone, as transformers does; the parts of a
  // group's shards all take part (another rank may hold the gradient).
  bool Skipped(size_t i) const { return !grouped_ && !grads_[i].defined(); }

  // Pass 1 for one part: `gp` holds its elements [lo, hi) (element e at gp[e - lo]); `out` is
  // the parameter's factors' sums.
  void AddSquares(const Part& part, const float* gp, double* out) const {
    const Factored& f = part.f;
    if (!f.matrix) {
      for (int64_t e = part.lo; e < part.hi; ++e) {
        const double gv = gp[e - part.lo] * scale_;
        out[e] += gv * gv;
      }
      return;
    }
    double* row = out;
    double* col = out + f.lead * f.rows;
    for (int64_t e = part.lo; e < part.hi;) {  // a row (or what the slot holds of it) at a time
      const int64_t l = e / (f.rows * f.cols), r = (e / f.cols) % f.rows, c0 = e % f.cols;
      const int64_t end = std::min(part.hi, e + (f.cols - c0));
      const float* gr = gp + (e - part.lo);
      double* cl = col + l * f.cols + c0;
      double sum = 0;
      for (int64_t x = 0; x < end - e; ++x) {
        const double gv = gr[x] * scale_;
        sum += gv * gv;
        cl[x] += gv * gv;
      }
      row[l * f.rows + r] += sum;
      e = end;
    }
  }

  // A parameter's factors `mine` as moving averages of the means of its `summed` squares: rows
  // and vector elements are means over a row's columns (a vector's: itself), columns over a
  // column's rows.
  static void Average(const Factored& f, const double* summed, float beta2t, float eps1,
                      float* mine) {
    const int64_t rows = f.matrix ? f.lead * f.rows : f.cols;
    for (int64_t x = 0; x < f.numel(); ++x) {
      const int64_t count = !f.matrix ? 1 : x < rows ? f.cols : f.rows;
      const float mean = static_cast<float>(summed[x] / static_cast<double>(count)) + eps1;
      mine[x] = mine[x] * beta2t + mean * (1.0f - beta2t);
    }
  }

  static void ReciprocalRoots(const Factored& f, const float* mine, std::vector<float>* out) {
    out->resize(static_cast<size_t>(f.numel()));
    float* o = out->data();
    if (!f.matrix) {
      for (int64_t x = 0; x < f.numel(); ++x) o[x] = 1.0f / std::sqrt(mine[x]);
      return;
    }
    for (int64_t l = 0; l < f.lead; ++l) {
      double total = 0;
      for (int64_t r = 0; r < f.rows; ++r) total += mine[l * f.rows + r];
      const auto row_mean = static_cast<float>(total / static_cast<double>(f.rows));
      for (int64_t r = 0; r < f.rows; ++r) {
        o[l * f.rows + r] = 1.0f / std::sqrt(mine[l * f.rows + r] / row_mean);
      }
    }
    for (int64_t x = f.lead * f.rows; x < f.numel(); ++x) o[x] = 1.0f / std::sqrt(mine[x]);
  }

  // Calls u(e, update) for the unscaled updates of elements [first, end) of part j of slot i, the
  // first at (l, r, c).
  template <typename U>
  void ForEachUpdate(size_t i, size_t j, int64_t first, int64_t end, int64_t l, int64_t r,
                     int64_t c, U&& u) const {
    const Part& part = parts_[i][j];
    const Factored& f = part.f;
    const float* factor = rsqrt_[i][j].data();
    const float* gp = grads_[i].data_ptr<float>() + part.at;  // gp[e - part.lo]: element e
    if (!f.matrix) {
      for (int64_t e = first; e < end; ++e) u(e, factor[e] * (gp[e - part.lo] * scale_));
      return;
    }
    const float* row = factor;
    const float* col = factor + f.lead * f.rows;
    for (int64_t e = first; e < end; ++e) {
      u(e, row[l * f.rows + r] * col[l * f.cols + c] * (gp[e - part.lo] * scale_));
      if (++c == f.cols) {
        c = 0;
        if (++r == f.rows) {
          r = 0;
          ++l;
        }
      }
    }
  }

  const std::vector<OptimizerSlot>& slots_;
  std::vector<torch::Tensor> factors_;
  const float scale_;
  const bool grouped_;
  std::vector<std::vector<Part>> parts_;
  std::vector<int64_t> factor_base_, param_base_;       // slot i's first factor, first parameter
  std::vector<torch::Tensor> grads_;                    // contiguous; undefined: no gradient
  std::vector<std::vector<std::vector<float>>> rsqrt_;  // [slot][part]: UpdateFactors's roots
};

}  // namespace

void SlotOptimizer::StepAdafactor(double lr, double grad_scale) {
  std::vector<torch::Tensor> factors;
  for (const auto& state : state_) factors.push_back(state->factors);
  AdafactorStep step(slots_, std::move(factors), static_cast<float>(grad_scale), group_ != nullptr);
  const bool reduce = group_ != nullptr && group_->world_size() > 1;
  torch::Tensor sums = step.SquaredGradientSums();
  if (reduce) group_->AllReduceSum({sums})->Wait();
  const auto beta2t =
      static_cast<float>(1.0 - std::pow(static_cast<double>(step_), hyper_.adafactor_decay));
  step.UpdateFactors(sums, beta2t, static_cast<float>(hyper_.adafactor_eps1));
  torch::Tensor update_sq = step.UpdateSquares();
  if (reduce) group_->AllReduceSum({update_sq})->Wait();
  step.Apply(update_sq, static_cast<float>(lr), static_cast<float>(-hyper_.weight_decay * lr),
             hyper_.adafactor_clip);
}

}  // namespace trainyard::trainer
