// SlotOptimizer, ParameterOptimizer and the 8-bit quantization (see optimizers.h).
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/runtime/torch_compat.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/adam/cpu_adam.h"
#include "worker/trainer/optim/fused_adamw.h"

namespace trainyard::trainer {
namespace {

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Adafactor's factors of one parameter: [lead, rows] then [lead, cols] for a matrix (lead: the
// product of the leading dimensions), its own size for a vector.
struct Factored {
  bool matrix = false;
  int64_t lead = 1, rows = 1, cols = 1;
  int64_t numel() const { return matrix ? lead * (rows + cols) : cols; }
};

Factored FactorsOf(const std::vector<int64_t>& shape) {
  Factored f;
  if (shape.size() >= 2) {
    f.matrix = true;
    f.rows = shape[shape.size() - 2];
    f.cols = shape.back();
    f.lead = Numel(shape) / std::max<int64_t>(1, f.rows * f.cols);
  } else {
    f.cols = Numel(shape);
  }
  return f;
}

std::array<float, 256> BuildDynamicMap(bool is_signed) {
  // bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), with
  // the same fp32 tensor arithmetic, so the values are the same bits.
  constexpr int kMaxExponentBits = 7, kNonSignBits = 7;
  std::vector<float> data;
  for (int i = 0; i < kMaxExponentBits; ++i) {
    const int64_t fraction_items =
        is_signed ? (int64_t{1} << (i + kNonSignBits - kMaxExponentBits)) + 1
                  : (int64_t{1} << (i + kNonSignBits - kMaxExponentBits + 1)) + 1;
    const torch::Tensor boundaries = torch::linspace(0.1, 1, fraction_items);
    const torch::Tensor means =
        (boundaries.slice(0, 0, fraction_items - 1) + boundaries.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, -(kMaxExponentBits - 1) + i);
    const torch::Tensor pos = (scale * means).contiguous();
    for (int64_t k = 0; k < pos.numel(); ++k) data.push_back(pos.data_ptr<float>()[k]);
    if (is_signed) {
      const torch::Tensor neg = (-scale * means).contiguous();
      for (int64_t k = 0; k < neg.numel(); ++k) data.push_back(neg.data_ptr<float>()[k]);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  while (data.size() < 256) data.push_back(0.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> map{};
  std::copy_n(data.begin(), 256, map.begin());
  return map;
}

// The index of a sorted 256-value map's value nearest v (the lower one of two as near, as
// argmin). A binary search per value was most of 8-bit AdamW's time, so a table narrows it: every
// float whose top 15 bits (sign, exponent, 6 mantissa bits) are `key` has its lower bound in the
// map at most `steps_` codes (one or two, for these maps) above lo_[key].
class CodeIndex {
 public:
  explicit CodeIndex(const std::array<float, 256>& map) : map_(map) {
    // ext_[1 + c] is code c's value; the infinities at either end make the search branch-free.
    ext_[0] = -std::numeric_limits<float>::infinity();
    std::copy(map.begin(), map.end(), ext_.begin() + 1);
    ext_[257] = std::numeric_limits<float>::infinity();
    for (int c = 1; c < 256; ++c)
      TORCH_CHECK(map[c - 1] < map[c], "CodeIndex: a map of distinct values");
    for (uint32_t key = 0; key < kKeys; ++key) {
      const float a = FromBits(key << kShift), b = FromBits((key << kShift) | kLowBits);
      if (!std::isfinite(a) || !std::isfinite(b)) {  // never asked: values are finite
        lo_[key] = 1;
        continue;
      }
      lo_[key] = LowerBound(std::min(a, b));
      steps_ = std::max(steps_, LowerBound(std::max(a, b)) - lo_[key]);
    }
  }

  uint8_t Nearest(float v) const {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    int i = lo_[bits >> kShift];
    for (int s = 0; s < steps_; ++s) i += ext_[i] < v;  // now the lower bound of v
    i -= (v - ext_[i - 1]) <= (ext_[i] - v);            // the nearer (the lower of two as near)
    return static_cast<uint8_t>(i - 1);
  }

  const std::array<float, 256>& map() const { return map_; }

 private:
  static constexpr int kShift = 17;
  static constexpr uint32_t kKeys = uint32_t{1} << (32 - kShift);
  static constexpr uint32_t kLowBits = (uint32_t{1} << kShift) - 1;

  static float FromBits(uint32_t bits) {
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  // In ext_'s indices.
  int LowerBound(float v) const {
    return static_cast<int>(std::lower_bound(ext_.begin() + 1, ext_.begin() + 257, v) -
                            ext_.begin());
  }

  std::array<float, 256> map_;
  std::array<float, 258> ext_{};
  std::array<uint16_t, kKeys> lo_{};
  int steps_ = 0;  // the most codes a key's range spans
};

const CodeIndex& Codes(bool is_signed) {
  static const auto* const kSigned = new CodeIndex(BuildDynamicMap(true));
  static const auto* const kUnsigned = new CodeIndex(BuildDynamicMap(false));
  return is_signed ? *kSigned : *kUnsigned;
}

// 8-bit AdamW's view of a slot: each parameter's part, [lo, hi) of the slot from element e0 of
// the parameter. A parameter under min_8bit_size keeps fp32 moments (at `packed` in the slot's
// fp32 arrays); a larger one's codes are the slot's [lo, hi) and its blocks, 256 of its elements
// each from its first (so a slot that holds it whole has bitsandbytes' blocks), `blocks` of them
// from `packed` in the absmax arrays.
struct Piece {
  int64_t lo = 0, hi = 0, e0 = 0;
  bool quantized = false;
  int64_t packed = 0, first_block = 0, blocks = 0;
};
struct Pieces {
  std::vector<Piece> pieces;
  int64_t fp32 = 0, blocks = 0;  // sizes of the fp32 and absmax arrays
};

Pieces EightBitPieces(const std::vector<OptimizerSlot::Param>& params, int64_t begin, int64_t n) {
  Pieces out;
  for (const auto& prm : params) {
    const int64_t pn = Numel(prm.shape);
    const int64_t lo = std::max(prm.offset, begin), hi = std::min(prm.offset + pn, begin + n);
    if (lo >= hi) continue;
    Piece piece;
    piece.lo = lo - begin;
    piece.hi = hi - begin;
    piece.e0 = lo - prm.offset;
    piece.quantized = pn >= k8bitMinSize;
    if (piece.quantized) {
      piece.first_block = piece.e0 / k8bitBlock;
      piece.blocks = (hi - prm.offset - 1) / k8bitBlock - piece.first_block + 1;
      piece.packed = out.blocks;
      out.blocks += piece.blocks;
    } else {
      piece.packed = out.fp32;
      out.fp32 += hi - lo;
    }
    out.pieces.push_back(piece);
  }
  return out;
}

// Calls f(block's index in the absmax arrays, its first and end slot positions) for every block
// of a quantized piece.
template <typename F>
void ForEachBlock(const Piece& piece, F&& f) {
  for (int64_t b = 0; b < piece.blocks; ++b) {
    const int64_t first = std::max(piece.e0, (piece.first_block + b) * k8bitBlock);
    const int64_t end =
        std::min(piece.e0 + (piece.hi - piece.lo), (piece.first_block + b + 1) * k8bitBlock);
    f(piece.packed + b, piece.lo + first - piece.e0, piece.lo + end - piece.e0);
  }
}

// Quantizes x[0, len), one block, with the signed or the unsigned dynamic map: returns its
// absmax.
float QuantizeBlock(const float* x, int64_t len, bool is_signed, uint8_t* codes) {
  const CodeIndex& index = Codes(is_signed);
  float m = 0;
  for (int64_t i = 0; i < len; ++i) m = std::max(m, std::abs(x[i]));
  for (int64_t i = 0; i < len; ++i) codes[i] = index.Nearest(m > 0 ? x[i] / m : 0.0f);
  return m;
}

}  // namespace

OptimizerHyper HyperFor(OptimizerKind kind, double weight_decay) {
  OptimizerHyper h;
  h.kind = kind;
  h.weight_decay = weight_decay;
  if (kind == OptimizerKind::kLion) {
    h.beta1 = 0.9;
    h.beta2 = 0.99;
  }
  return h;
}

uint8_t NearestCode(float v, bool is_signed) { return Codes(is_signed).Nearest(v); }

const std::array<float, 256>& DynamicMap(bool is_signed) { return Codes(is_signed).map(); }

struct SlotOptimizer::SlotState {
  torch::Tensor m, v;  // fp32: [n] adamw, lion (m); 8-bit: [Pieces::fp32] (small parameters)
  torch::Tensor m_codes, v_codes;    // uint8 [n]: 8-bit, when a piece is quantized
  torch::Tensor m_absmax, v_absmax;  // fp32 [Pieces::blocks]: 8-bit
  torch::Tensor factors;             // fp32 [FactorNumel]: adafactor
};

SlotOptimizer::SlotOptimizer(const OptimizerHyper& hyper, std::vector<OptimizerSlot> slots,
                             Communicator* group)
    : hyper_(hyper), slots_(std::move(slots)), group_(group) {
  for (const OptimizerSlot& s : slots_) {
    TORCH_CHECK(s.param.scalar_type() == torch::kFloat && s.param.is_contiguous(),
                "SlotOptimizer: slots must be contiguous fp32");
    TORCH_CHECK(s.param.device() == slots_[0].param.device(),
                "SlotOptimizer: slots on different devices");
  }
  on_device_ = !slots_.empty() && !slots_[0].param.device().is_cpu();
  TORCH_CHECK(
      !on_device_ || hyper_.kind == OptimizerKind::kAdamW || hyper_.kind == OptimizerKind::kLion,
      "train.optimizer: ", Name(hyper_.kind), " runs on CPU slots only; on GPUs use adamw or lion");
}

SlotOptimizer::~SlotOptimizer() = default;

int64_t SlotOptimizer::FactorNumel(const std::vector<OptimizerSlot::Param>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += FactorsOf(p.shape).numel();
  return n;
}

void SlotOptimizer::Initialize() {
  initialized_ = true;
  state_.clear();
  for (const OptimizerSlot& s : slots_) {
    auto st = std::make_unique<SlotState>();
    const int64_t n = s.param.numel();
    switch (hyper_.kind) {
      case OptimizerKind::kAdamW:
        st->m = torch::zeros({n}, s.param.options());
        st->v = torch::zeros({n}, s.param.options());
        break;
      case OptimizerKind::kLion:
        st->m = torch::zeros({n}, s.param.options());
        break;
      case OptimizerKind::kAdamW8bit: {
        const Pieces pieces = EightBitPieces(s.params, s.begin, n);
        st->m = torch::zeros({pieces.fp32});
        st->v = torch::zeros({pieces.fp32});
        if (pieces.blocks > 0) {
          st->m_codes = torch::zeros({n}, torch::kUInt8);
          st->v_codes = torch::zeros({n}, torch::kUInt8);
          st->m_absmax = torch::zeros({pieces.blocks});
          st->v_absmax = torch::zeros({pieces.blocks});
        }
        break;
      }
      case OptimizerKind::kAdafactor:
        st->factors = torch::zeros({FactorNumel(s.params)});
        break;
    }
    state_.push_back(std::move(st));
  }
}

void SlotOptimizer::Step(double lr, double grad_scale) {
  torch::NoGradGuard no_grad;
  if (!initialized_) Initialize();
  ++step_;
  if (on_device_ || tensor_ops_) {
    StepOnDevice(lr, grad_scale);
    return;
  }
  if (hyper_.kind == OptimizerKind::kAdafactor) {
    StepAdafactor(lr, grad_scale);
    return;
  }
  for (int i = 0; i < num_slots(); ++i) {
    const torch::Tensor& p = slots_[i].param;
    if (!p.grad().defined() || p.numel() == 0) continue;  // as PyTorch's optimizers skip it
    const torch::Tensor g = p.grad().contiguous();
    const auto scale = static_cast<float>(grad_scale);
    switch (hyper_.kind) {
      case OptimizerKind::kAdamW:
        StepAdamW(i, g.data_ptr<float>(), scale, lr);
        break;
      case OptimizerKind::kLion:
        StepLion(i, g.data_ptr<float>(), scale, lr);
        break;
      case OptimizerKind::kAdamW8bit:
        StepAdamW8bit(i, g.data_ptr<float>(), scale, lr);
        break;
      case OptimizerKind::kAdafactor:
        break;
    }
  }
}

void SlotOptimizer::StepOnDevice(double lr, double grad_scale) {
  std::vector<torch::Tensor> params, grads, m, v;
  const double b1 = hyper_.beta1, b2 = hyper_.beta2;
  for (int i = 0; i < num_slots(); ++i) {
    const torch::Tensor& p = slots_[i].param;
    if (!p.grad().defined() || p.numel() == 0) continue;
    // Flat, as the state is (a slot may be a whole parameter of any shape).
    torch::Tensor param = p.detach().view({-1});
    const torch::Tensor grad = p.grad().reshape({-1});
    if (hyper_.kind == OptimizerKind::kAdamW) {
      params.push_back(param);
      grads.push_back(grad);
      m.push_back(state_[i]->m);
      v.push_back(state_[i]->v);
      continue;
    }
    // Lion, as StepLion computes it, in tensor operations.
    torch::Tensor mom = state_[i]->m;
    const torch::Tensor g = grad_scale == 1.0 ? grad : grad * grad_scale;
    const torch::Tensor update = torch::sign(mom * b1 + g * (1 - b1));
    param.mul_(1.0 - lr * hyper_.weight_decay);
    param.sub_(update, lr);
    mom.mul_(b2).add_(g, 1 - b2);
  }
  FusedAdamWOnDevice(params, grads, m, v, step_, lr, b1, b2, hyper_.weight_decay, hyper_.eps,
                     grad_scale);
}

void SlotOptimizer::StepAdamW(int i, const float* g, float scale, double lr) {
  SlotState& st = *state_[i];
  adam::AdamWConfig c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(hyper_.beta1);
  c.beta2 = static_cast<float>(hyper_.beta2);
  c.eps = static_cast<float>(hyper_.eps);
  c.weight_decay = static_cast<float>(hyper_.weight_decay);
  c.step = step_;
  c.grad_scale = scale;
  float* param = slots_[i].param.data_ptr<float>();
  float* m = st.m.data_ptr<float>();
  float* v = st.v.data_ptr<float>();
  at::parallel_for(0, slots_[i].param.numel(), adam::kParallelChunk, [&](int64_t b, int64_t e) {
    adam::AdamWStep(c, param + b, m + b, v + b, g + b, nullptr, e - b);
  });
}

void SlotOptimizer::StepLion(int i, const float* grad, float scale, double lr) {
  float* p = slots_[i].param.data_ptr<float>();
  float* m = state_[i]->m.data_ptr<float>();
  const auto b1 = static_cast<float>(hyper_.beta1), b2 = static_cast<float>(hyper_.beta2);
  const auto decay = static_cast<float>(1.0 - lr * hyper_.weight_decay);
  const auto rate = static_cast<float>(lr);
  at::parallel_for(0, slots_[i].param.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const float g = grad[k] * scale;
      const float c = m[k] * b1 + g * (1 - b1);
      const float update = static_cast<float>((c > 0) - (c < 0));
      p[k] = p[k] * decay;
      p[k] = p[k] - rate * update;
      m[k] = m[k] * b2 + g * (1 - b2);
    }
  });
}

void SlotOptimizer::StepAdamW8bit(int i, const float* grad, float scale, double lr) {
  SlotState& st = *state_[i];
  const int64_t n = slots_[i].param.numel();
  float* p = slots_[i].param.data_ptr<float>();
  const auto b1 = static_cast<float>(hyper_.beta1), b2 = static_cast<float>(hyper_.beta2);
  const auto eps = static_cast<float>(hyper_.eps), rate = static_cast<float>(lr);
  const auto decay = static_cast<float>(hyper_.weight_decay);
  // bitsandbytes' 2-state Adam kernels: the bias corrections folded into the step size.
  const float correction1 = 1.0f - std::pow(b1, static_cast<float>(step_));
  const float correction2 = std::sqrt(1.0f - std::pow(b2, static_cast<float>(step_)));
  const float step_size = -rate * correction2 / correction1;
  auto update = [&](int64_t k, float s1, float s2) {
    p[k] = p[k] + step_size * (s1 / (std::sqrt(s2) + eps * correction2));
    if (decay > 0) p[k] = p[k] * (1.0f - rate * decay);
  };
  const Pieces pieces = EightBitPieces(slots_[i].params, slots_[i].begin, n);
  const auto& smap = DynamicMap(true);
  const auto& umap = DynamicMap(false);
  for (const Piece& piece : pieces.pieces) {
    if (!piece.quantized) {  // under min_8bit_size: fp32 moments
      float* m = st.m.data_ptr<float>() + piece.packed;
      float* v = st.v.data_ptr<float>() + piece.packed;
      for (int64_t k = piece.lo; k < piece.hi; ++k) {
        const float g = grad[k] * scale;
        float& mk = m[k - piece.lo];
        float& vk = v[k - piece.lo];
        mk = mk * b1 + (1.0f - b1) * g;
        vk = vk * b2 + (1.0f - b2) * g * g;
        update(k, mk, vk);
      }
      continue;
    }
    uint8_t* c1 = st.m_codes.data_ptr<uint8_t>();
    uint8_t* c2 = st.v_codes.data_ptr<uint8_t>();
    float* a1 = st.m_absmax.data_ptr<float>();
    float* a2 = st.v_absmax.data_ptr<float>();
    std::vector<std::array<int64_t, 3>> blocks;
    ForEachBlock(piece, [&](int64_t b, int64_t lo, int64_t hi) { blocks.push_back({b, lo, hi}); });
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 64, [&](int64_t bb, int64_t be) {
      float s1[k8bitBlock], s2[k8bitBlock];
      for (int64_t x = bb; x < be; ++x) {
        const auto [b, lo, hi] = blocks[x];
        const int64_t len = hi - lo;
        for (int64_t j = 0; j < len; ++j) {
          const int64_t k = lo + j;
          const float g = grad[k] * scale;
          if (!std::isfinite(g)) {  // as the kernel: p kept, the moments reset
            s1[j] = s2[j] = 0;
            continue;
          }
          s1[j] = smap[c1[k]] * a1[b] * b1 + (1.0f - b1) * g;
          s2[j] = umap[c2[k]] * a2[b] * b2 + (1.0f - b2) * g * g;
          update(k, s1[j], s2[j]);
        }
        a1[b] = QuantizeBlock(s1, len, /*is_signed=*/true, c1 + lo);
        a2[b] = QuantizeBlock(s2, len, /*is_signed=*/false, c2 + lo);
        // The kernel keeps m's sign: a code of the other sign moves one towards it.
        for (int64_t j = 0; j < len; ++j) {
          uint8_t& c = c1[lo + j];
          if (std::signbit(smap[c]) != std::signbit(s1[j])) c = s1[j] > 0 ? c + 1 : c - 1;
        }
      }
    });
  }
}

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
      static_cast<float>(1.0 - std::pow(static_cast<double>(step_), kAdafactorDecay));
  const auto eps1 = static_cast<float>(kAdafactorEps1);
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
      const auto divisor = static_cast<float>(std::max(1.0, rms / kAdafactorClip));
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

void SlotOptimizer::SetStep(int64_t step) {
  if (!initialized_) Initialize();
  step_ = step;
}

const std::vector<std::string>& SlotOptimizer::StateNames() {
  static const auto* const kNames = new std::vector<std::string>{
      "exp_avg",          "exp_avg_sq",        "exp_avg.codes", "exp_avg.absmax",
      "exp_avg_sq.codes", "exp_avg_sq.absmax", "factors"};
  return *kNames;
}

std::map<std::string, torch::Tensor> SlotOptimizer::State(int i) const {
  std::map<std::string, torch::Tensor> out = LiveState(i);
  if (on_device_) {
    for (auto& [name, t] : out) t = t.to(torch::kCPU);
  }
  return out;
}

std::map<std::string, torch::Tensor> SlotOptimizer::LiveState(int i) const {
  std::map<std::string, torch::Tensor> out;
  if (!initialized_) return out;
  const SlotState& st = *state_[i];
  // (An 8-bit slot without small parameters has no fp32 moments.)
  if (st.m.defined() && (st.m.numel() > 0 || hyper_.kind != OptimizerKind::kAdamW8bit)) {
    out["exp_avg"] = st.m;
  }
  if (st.v.defined() && (st.v.numel() > 0 || hyper_.kind != OptimizerKind::kAdamW8bit)) {
    out["exp_avg_sq"] = st.v;
  }
  if (st.m_codes.defined()) {
    out["exp_avg.codes"] = st.m_codes;
    out["exp_avg.absmax"] = st.m_absmax;
    out["exp_avg_sq.codes"] = st.v_codes;
    out["exp_avg_sq.absmax"] = st.v_absmax;
  }
  if (st.factors.defined()) out["factors"] = st.factors;
  return out;
}

absl::Status SlotOptimizer::SetState(int i, const std::map<std::string, torch::Tensor>& state,
                                     int64_t step) {
  if (!initialized_) Initialize();
  step_ = step;
  SlotState& st = *state_[i];
  const int64_t n = slots_[i].param.numel();
  std::map<std::string, torch::Tensor> given = state;
  // 8-bit slots take elementwise fp32 moments too (resharded or consolidated checkpoints): given
  // without codes, and [n] long.
  if (hyper_.kind == OptimizerKind::kAdamW8bit && given.count("exp_avg.codes") == 0 &&
      given.count("exp_avg") != 0 && given.count("exp_avg_sq") != 0 &&
      given.at("exp_avg").numel() == n && given.at("exp_avg_sq").numel() == n) {
    const Pieces pieces = EightBitPieces(slots_[i].params, slots_[i].begin, n);
    for (auto [name, fp32, codes, absmax, is_signed] :
         {std::make_tuple("exp_avg", st.m, st.m_codes, st.m_absmax, true),
          std::make_tuple("exp_avg_sq", st.v, st.v_codes, st.v_absmax, false)}) {
      const torch::Tensor x = given.at(name).to(torch::kFloat).contiguous().reshape({-1});
      const float* xs = x.data_ptr<float>();
      for (const Piece& piece : pieces.pieces) {
        if (!piece.quantized) {
          std::copy(xs + piece.lo, xs + piece.hi, fp32.data_ptr<float>() + piece.packed);
          continue;
        }
        ForEachBlock(piece, [&](int64_t b, int64_t lo, int64_t hi) {
          absmax.data_ptr<float>()[b] =
              QuantizeBlock(xs + lo, hi - lo, is_signed, codes.data_ptr<uint8_t>() + lo);
        });
      }
      given.erase(name);
    }
    if (!given.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected optimizer state ", given.begin()->first));
    }
    return absl::OkStatus();
  }
  std::map<std::string, torch::Tensor> mine = LiveState(i);
  for (const auto& [name, t] : given) {
    auto it = mine.find(name);
    if (it == mine.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected optimizer state ", name, " for ", Name(hyper_.kind)));
    }
    if (it->second.numel() != t.numel() || it->second.scalar_type() != t.scalar_type()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state ", name, " has ", t.numel(),
                                                     " elements, want ", it->second.numel()));
    }
  }
  for (const auto& [name, t] : mine) {
    auto it = given.find(name);
    if (it == given.end()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state ", name, " is missing"));
    }
    t.copy_(it->second.reshape({-1}));
  }
  return absl::OkStatus();
}

int64_t SlotOptimizer::StateBytes() const {
  int64_t bytes = 0;
  for (const auto& st : state_) {
    for (const torch::Tensor* t :
         {&st->m, &st->v, &st->m_codes, &st->v_codes, &st->m_absmax, &st->v_absmax, &st->factors}) {
      if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
    }
  }
  return bytes;
}

absl::StatusOr<std::map<std::string, torch::Tensor>> SlotOptimizer::Elementwise(
    OptimizerKind kind, const std::vector<OptimizerSlot::Param>& params, int64_t begin, int64_t n,
    const std::map<std::string, torch::Tensor>& state) {
  if (kind != OptimizerKind::kAdamW8bit) return state;
  std::map<std::string, torch::Tensor> out;
  const Pieces pieces = EightBitPieces(params, begin, n);
  // No state: none yet (before the first step), unless the slot is padding alone, whose state is
  // no tensor at all and whose moments are zeros.
  if (state.empty() && !pieces.pieces.empty()) return out;
  // A tensor of the state, checked to have `numel` elements of `type`.
  auto get = [&](const std::string& name, int64_t numel,
                 torch::ScalarType type) -> absl::StatusOr<torch::Tensor> {
    auto it = state.find(name);
    if (numel == 0) return torch::zeros({0}, type);
    if (it == state.end()) return absl::DataLossError(absl::StrCat("no optimizer state ", name));
    if (it->second.numel() != numel || it->second.scalar_type() != type) {
      return absl::DataLossError(absl::StrCat("optimizer state ", name, " has ", it->second.numel(),
                                              " elements, want ", numel));
    }
    return it->second.contiguous();
  };
  for (auto [name, is_signed] :
       {std::make_pair("exp_avg", true), std::make_pair("exp_avg_sq", false)}) {
    ASSIGN_OR_RETURN(const torch::Tensor fp32, get(name, pieces.fp32, torch::kFloat));
    const bool quantized = pieces.blocks > 0;
    ASSIGN_OR_RETURN(const torch::Tensor codes,
                     get(absl::StrCat(name, ".codes"), quantized ? n : 0, torch::kUInt8));
    ASSIGN_OR_RETURN(const torch::Tensor absmax,
                     get(absl::StrCat(name, ".absmax"), pieces.blocks, torch::kFloat));
    torch::Tensor x = torch::zeros({n});
    float* xs = x.data_ptr<float>();
    const auto& map = DynamicMap(is_signed);
    for (const Piece& piece : pieces.pieces) {
      if (!piece.quantized) {
        std::copy_n(fp32.data_ptr<float>() + piece.packed, piece.hi - piece.lo, xs + piece.lo);
        continue;
      }
      ForEachBlock(piece, [&](int64_t b, int64_t lo, int64_t hi) {
        for (int64_t k = lo; k < hi; ++k) {
          xs[k] = map[codes.data_ptr<uint8_t>()[k]] * absmax.data_ptr<float>()[b];
        }
      });
    }
    out[name] = x;
  }
  return out;
}

namespace {

std::vector<OptimizerSlot> WholeParameters(const std::vector<torch::Tensor>& params) {
  std::vector<OptimizerSlot> slots;
  for (const torch::Tensor& p : params) {
    OptimizerSlot s;
    s.param = p;
    s.params.push_back({p.sizes().vec(), 0});
    slots.push_back(std::move(s));
  }
  return slots;
}

// Optimizer options that only carry the learning rate (the base class needs some).
std::unique_ptr<torch::optim::OptimizerOptions> LrOptions() {
  return std::make_unique<torch::optim::AdamWOptions>(1e-3);
}

}  // namespace

ParameterOptimizer::ParameterOptimizer(const std::vector<torch::Tensor>& params,
                                       const OptimizerHyper& hyper)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(params)}, LrOptions()),
      core_(hyper, WholeParameters(params), nullptr) {}

torch::Tensor ParameterOptimizer::step(LossClosure /*closure*/) {
  TORCH_CHECK(false, "ParameterOptimizer: call Update(lr, grad_scale)");
}

void ParameterOptimizer::save(torch::serialize::OutputArchive& archive) const {
  // train.optimizer's name, as bytes.
  const std::string name = Name(core_.kind());
  archive.write("kind", torch::tensor(std::vector<int64_t>(name.begin(), name.end()), torch::kLong)
                            .to(torch::kUInt8));
  archive.write("step", torch::tensor({core_.step()}, torch::kLong));
  for (int i = 0; i < core_.num_slots(); ++i) {
    for (const auto& [name, t] : core_.State(i)) archive.write(absl::StrCat(i, ".", name), t);
  }
}

void ParameterOptimizer::load(torch::serialize::InputArchive& archive) {
  torch::Tensor kind, step;
  TORCH_CHECK(archive.try_read("kind", kind),
              "the optimizer state was written by train.optimizer adamw; this job's is ",
              Name(core_.kind()));
  const torch::Tensor bytes = kind.to(torch::kUInt8).contiguous();
  const std::string written(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                            static_cast<size_t>(bytes.numel()));
  TORCH_CHECK(written == Name(core_.kind()), "the optimizer state was written by train.optimizer ",
              written, "; this job's is ", Name(core_.kind()));
  archive.read("step", step);
  if (step.item<int64_t>() == 0) return;
  for (int i = 0; i < core_.num_slots(); ++i) {
    std::map<std::string, torch::Tensor> state;
    for (const std::string& name : SlotOptimizer::StateNames()) {
      torch::Tensor t;
      if (archive.try_read(absl::StrCat(i, ".", name), t)) state[name] = t;
    }
    const absl::Status s = core_.SetState(i, state, step.item<int64_t>());
    TORCH_CHECK(s.ok(), "parameter ", i, ": ", s.message());
  }
}

const char* OptimizerName(const torch::optim::Optimizer& optimizer) {
  if (const auto* o = dynamic_cast<const ParameterOptimizer*>(&optimizer)) {
    return Name(o->core().kind());
  }
  return Name(OptimizerKind::kAdamW);
}

void OptimizerStep(torch::optim::Optimizer& optimizer, double lr, double grad_scale) {
  if (auto* o = dynamic_cast<ParameterOptimizer*>(&optimizer)) {
    o->Update(lr, grad_scale);
    return;
  }
  FusedAdamWStep(dynamic_cast<torch::optim::AdamW&>(optimizer), lr, grad_scale);
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const std::vector<torch::Tensor>& params,
                                                       const OptimizerHyper& hyper, double lr) {
  if (hyper.kind == OptimizerKind::kAdamW) {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr)
                                                             .betas({hyper.beta1, hyper.beta2})
                                                             .eps(hyper.eps)
                                                             .weight_decay(hyper.weight_decay));
  }
  return std::make_unique<ParameterOptimizer>(params, hyper);
}

void OptimizerStateTo(torch::optim::Optimizer& optimizer, const torch::Device& device) {
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(&optimizer);
  if (adamw == nullptr) return;
  for (auto& [key, state] : adamw->state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*state);
    if (st.exp_avg().defined()) st.exp_avg(st.exp_avg().to(device));
    if (st.exp_avg_sq().defined()) st.exp_avg_sq(st.exp_avg_sq().to(device));
    if (st.max_exp_avg_sq().defined()) st.max_exp_avg_sq(st.max_exp_avg_sq().to(device));
  }
}

std::map<std::string, torch::Tensor> ParameterState(torch::optim::Optimizer& optimizer, size_t i,
                                                    int64_t* step) {
  if (auto* parameters = dynamic_cast<ParameterOptimizer*>(&optimizer)) {
    *step = parameters->core().step();
    return parameters->core().State(static_cast<int>(i));
  }
  const torch::Tensor& p = optimizer.param_groups().at(0).params().at(i);
  *step = 0;
  auto it = optimizer.state().find(OptimizerStateKey(p));
  if (it == optimizer.state().end()) return {};
  const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
  *step = st.step();
  return {{"exp_avg", st.exp_avg()}, {"exp_avg_sq", st.exp_avg_sq()}};
}

absl::Status SetParameterState(torch::optim::Optimizer& optimizer, size_t i,
                               const std::map<std::string, torch::Tensor>& state, int64_t step) {
  if (state.empty()) return absl::OkStatus();  // no step yet
  if (auto* parameters = dynamic_cast<ParameterOptimizer*>(&optimizer)) {
    return parameters->core().SetState(static_cast<int>(i), state, step);
  }
  const torch::Tensor& p = optimizer.param_groups().at(0).params().at(i);
  auto st = std::make_unique<torch::optim::AdamWParamState>();
  st->step(step);
  for (const char* name : {"exp_avg", "exp_avg_sq"}) {
    auto it = state.find(name);
    if (it == state.end() || !it->second.sizes().equals(p.sizes())) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW state '", name, "' is missing or of another shape"));
    }
    torch::Tensor t = it->second.to(torch::kFloat).contiguous().clone();
    if (std::string(name) == "exp_avg") {
      st->exp_avg(t);
    } else {
      st->exp_avg_sq(t);
    }
  }
  optimizer.state()[OptimizerStateKey(p)] = std::move(st);
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
