// AdamW kernels, compiled once per Highway target (this file includes itself through
// hwy/foreach_target.h) and dispatched at run time.
//
// Order of fp32 operations, as PyTorch 1.13's _single_tensor_adamw / _multi_tensor_adamw run them
// on CPU with ATen's AVX2 kernels (what it uses on this project's machines; the foreach path
// loops the same per-tensor kernels). Python scalars are doubles, cast to fp32 by each kernel:
//   p.mul_(1 - lr*wd)                    p = p * f(1 - lr*wd)
//   m.mul_(b1).add_(g, alpha=1-b1)       m = fma(g, f(1-b1), m * f(b1))
//   v.mul_(b2).addcmul_(g, g, 1-b2)      v = fma(f(1-b2) * g, g, v * f(b2))
//   (v.sqrt() / bc2_sqrt).add_(eps)      denom = sqrt(v) / f(sqrt(1 - b2^step)) + f(eps)
//   p.addcdiv_(m, denom, -step_size)     p = p + (f(-lr / (1 - b1^step)) * m) / denom
// (PyTorch 2.x writes the m update as m.lerp_(g, 1-b1); 1.13 does not.) On AVX3 and AVX2 the
// results are bit for bit PyTorch 1.13's (tests/cpu_adam_test.cc checks 100003 elements over 10
// steps). Targets without FMA (SSE4, SSSE3, SCALAR) round the two fma()s twice; their results
// then differ from PyTorch's by an ulp here and there.
//
// The bias corrections are computed once per call, in double. Tails shorter than a vector go
// through the same vector code on padded copies, so an element's result never depends on where a
// range starts or ends (AdamWStepParallel relies on it).
#include "kernels/adam/cpu_adam.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#ifndef TRAINYARD_SERVER_ADAM_CPU_ADAM_CC_SHARED_
#define TRAINYARD_SERVER_ADAM_CPU_ADAM_CC_SHARED_
namespace trainyard::adam {

// The per-call scalars of the update, already cast to fp32 where PyTorch casts them.
struct Coefficients {
  float grad_scale;
  float decay;  // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

}  // namespace trainyard::adam
#endif  // TRAINYARD_SERVER_ADAM_CPU_ADAM_CC_SHARED_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/adam/cpu_adam.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace trainyard::adam {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU32 = hn::RebindToUnsigned<DF>;
using DI32 = hn::RebindToSigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;  // as many lanes as DF, half as wide
using VF = hn::Vec<DF>;

constexpr size_t kMaxLanes = HWY_LANES(float);

// Round to nearest even on the bit pattern, like c10::BFloat16; NaN -> 0x7FC0.
HWY_INLINE hn::Vec<DU16> ToBf16(VF x) {
  const DF df;
  const DU32 du;
  const DI32 di;
  const DU16 d16;
  const auto bits = hn::BitCast(du, x);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(lsb, hn::Set(du, 0x7FFFu))));
  const VF with_nan =
      hn::IfThenElse(hn::IsNaN(x), hn::BitCast(df, hn::Set(du, 0x7FC0u)), hn::BitCast(df, rounded));
  // Every lane is below 0x10000, so the saturating demotion only narrows.
  return hn::DemoteTo(d16, hn::BitCast(di, with_nan));
}

HWY_INLINE VF FromBf16(hn::Vec<DU16> x) {
  const DF df;
  const DU32 du;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, x)));
}

HWY_INLINE VF LoadGrad(const float* HWY_RESTRICT g) { return hn::LoadU(DF(), g); }
HWY_INLINE VF LoadGrad(const uint16_t* HWY_RESTRICT g) { return FromBf16(hn::LoadU(DU16(), g)); }

// The coefficients broadcast to vectors once per call.
struct VecCoefficients {
  explicit VecCoefficients(const Coefficients& k)
      : grad_scale(hn::Set(DF(), k.grad_scale)),
        decay(hn::Set(DF(), k.decay)),
        beta1(hn::Set(DF(), k.beta1)),
        one_minus_beta1(hn::Set(DF(), k.one_minus_beta1)),
        beta2(hn::Set(DF(), k.beta2)),
        one_minus_beta2(hn::Set(DF(), k.one_minus_beta2)),
        bias_correction2_sqrt(hn::Set(DF(), k.bias_correction2_sqrt)),
        eps(hn::Set(DF(), k.eps)),
        neg_step_size(hn::Set(DF(), k.neg_step_size)) {}
  VF grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      neg_step_size;
};

// One vector of elements at p, m, v, g (and p16 when kWriteBf16).
template <bool kWriteBf16, typename GradT>
HWY_INLINE void UpdateVector(const VecCoefficients& k, float* HWY_RESTRICT p, float* HWY_RESTRICT m,
                             float* HWY_RESTRICT v, const GradT* HWY_RESTRICT g,
                             uint16_t* HWY_RESTRICT p16) {
  const DF df;
  const VF grad = hn::Mul(LoadGrad(g), k.grad_scale);
  const VF param = hn::Mul(hn::LoadU(df, p), k.decay);
  const VF m_new = hn::MulAdd(grad, k.one_minus_beta1, hn::Mul(hn::LoadU(df, m), k.beta1));
  const VF v_new =
      hn::MulAdd(hn::Mul(k.one_minus_beta2, grad), grad, hn::Mul(hn::LoadU(df, v), k.beta2));
  const VF denom = hn::Add(hn::Div(hn::Sqrt(v_new), k.bias_correction2_sqrt), k.eps);
  const VF p_new = hn::Add(param, hn::Div(hn::Mul(k.neg_step_size, m_new), denom));
  hn::StoreU(p_new, df, p);
  hn::StoreU(m_new, df, m);
  hn::StoreU(v_new, df, v);
  if (kWriteBf16) hn::StoreU(ToBf16(p_new), DU16(), p16);
}

template <bool kWriteBf16, typename GradT>
HWY_INLINE void UpdateRange(const Coefficients& coefficients, float* HWY_RESTRICT p,
                            float* HWY_RESTRICT m, float* HWY_RESTRICT v,
                            const GradT* HWY_RESTRICT g, uint16_t* HWY_RESTRICT p16, int64_t n) {
  const VecCoefficients k(coefficients);
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(DF()));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    UpdateVector<kWriteBf16>(k, p + i, m + i, v + i, g + i, kWriteBf16 ? p16 + i : nullptr);
  }
  const size_t rest = static_cast<size_t>(n - i);
  if (rest == 0) return;
  // Padding is zeros: denom = eps there, no NaN or infinity is computed.
  HWY_ALIGN float tp[kMaxLanes] = {}, tm[kMaxLanes] = {}, tv[kMaxLanes] = {};
  HWY_ALIGN GradT tg[kMaxLanes] = {};
  HWY_ALIGN uint16_t t16[kMaxLanes] = {};
  std::memcpy(tp, p + i, rest * sizeof(float));
  std::memcpy(tm, m + i, rest * sizeof(float));
  std::memcpy(tv, v + i, rest * sizeof(float));
  std::memcpy(tg, g + i, rest * sizeof(GradT));
  UpdateVector<kWriteBf16>(k, tp, tm, tv, tg, t16);
  std::memcpy(p + i, tp, rest * sizeof(float));
  std::memcpy(m + i, tm, rest * sizeof(float));
  std::memcpy(v + i, tv, rest * sizeof(float));
  if (kWriteBf16) std::memcpy(p16 + i, t16, rest * sizeof(uint16_t));
}

void AdamWF32Grad(const Coefficients& k, float* HWY_RESTRICT p, float* HWY_RESTRICT m,
                  float* HWY_RESTRICT v, const float* HWY_RESTRICT g, uint16_t* HWY_RESTRICT p16,
                  int64_t n) {
  if (p16 != nullptr) {
    UpdateRange<true>(k, p, m, v, g, p16, n);
  } else {
    UpdateRange<false>(k, p, m, v, g, p16, n);
  }
}

void AdamWBf16Grad(const Coefficients& k, float* HWY_RESTRICT p, float* HWY_RESTRICT m,
                   float* HWY_RESTRICT v, const uint16_t* HWY_RESTRICT g,
                   uint16_t* HWY_RESTRICT p16, int64_t n) {
  if (p16 != nullptr) {
    UpdateRange<true>(k, p, m, v, g, p16, n);
  } else {
    UpdateRange<false>(k, p, m, v, g, p16, n);
  }
}

void FloatToBf16Range(const float* HWY_RESTRICT in, uint16_t* HWY_RESTRICT out, int64_t n) {
  const DF df;
  const DU16 d16;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(ToBf16(hn::LoadU(df, in + i)), d16, out + i);
  const size_t rest = static_cast<size_t>(n - i);
  if (rest == 0) return;
  HWY_ALIGN float tin[kMaxLanes] = {};
  HWY_ALIGN uint16_t tout[kMaxLanes] = {};
  std::memcpy(tin, in + i, rest * sizeof(float));
  hn::Store(ToBf16(hn::Load(df, tin)), d16, tout);
  std::memcpy(out + i, tout, rest * sizeof(uint16_t));
}

void Bf16ToFloatRange(const uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT out, int64_t n) {
  const DF df;
  const DU16 d16;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(FromBf16(hn::LoadU(d16, in + i)), df, out + i);
  const size_t rest = static_cast<size_t>(n - i);
  if (rest == 0) return;
  HWY_ALIGN uint16_t tin[kMaxLanes] = {};
  HWY_ALIGN float tout[kMaxLanes] = {};
  std::memcpy(tin, in + i, rest * sizeof(uint16_t));
  hn::Store(FromBf16(hn::Load(d16, tin)), df, tout);
  std::memcpy(out + i, tout, rest * sizeof(float));
}

const char* TargetNameOfThisTarget() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace trainyard::adam
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "absl/base/attributes.h"
#include "absl/base/const_init.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/check.h"

namespace trainyard::adam {

HWY_EXPORT(AdamWF32Grad);
HWY_EXPORT(AdamWBf16Grad);
HWY_EXPORT(FloatToBf16Range);
HWY_EXPORT(Bf16ToFloatRange);
HWY_EXPORT(TargetNameOfThisTarget);

namespace {

// Computed like torch.optim.AdamW: Python floats (doubles), cast to fp32 by the kernels.
Coefficients MakeCoefficients(const AdamWConfig& c) {
  TY_CHECK(c.step >= 1, absl::StrCat("AdamW step is 1-based, got ", c.step));
  const double lr = c.lr;
  const double beta1 = c.beta1;
  const double beta2 = c.beta2;
  const double step = static_cast<double>(c.step);
  const double bias_correction1 = 1.0 - std::pow(beta1, step);
  const double bias_correction2 = 1.0 - std::pow(beta2, step);
  Coefficients k;
  k.grad_scale = c.grad_scale;
  k.decay = static_cast<float>(1.0 - lr * static_cast<double>(c.weight_decay));
  k.beta1 = c.beta1;
  k.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  k.beta2 = c.beta2;
  k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  k.eps = c.eps;
  k.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  return k;
}

// Targets compiled in and supported by the CPU, detected once before any ForceTarget.
int64_t DetectedTargets() {
  static const int64_t detected = hwy::SupportedTargets() & HWY_TARGETS;
  return detected;
}

ABSL_CONST_INIT absl::Mutex force_mu(absl::kConstInit);  // serializes ForceTarget

}  // namespace

void AdamWStep(const AdamWConfig& c, float* param, float* m, float* v, const float* grad,
               uint16_t* param_bf16, int64_t n) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(AdamWF32Grad)(MakeCoefficients(c), param, m, v, grad, param_bf16, n);
}

void AdamWStepBf16Grad(const AdamWConfig& c, float* param, float* m, float* v,
                       const uint16_t* grad_bf16, uint16_t* param_bf16, int64_t n) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(AdamWBf16Grad)(MakeCoefficients(c), param, m, v, grad_bf16, param_bf16, n);
}

void AdamWStepParallel(ThreadPool& pool, const AdamWConfig& c, float* param, float* m, float* v,
                       const float* grad, uint16_t* param_bf16, int64_t n) {
  if (n <= 0) return;
  const Coefficients k = MakeCoefficients(c);
  auto* const kernel = &HWY_DYNAMIC_DISPATCH(AdamWF32Grad);
  pool.ParallelFor(n, kParallelChunk, [&](int64_t begin, int64_t end) {
    uint16_t* const copy = param_bf16 == nullptr ? nullptr : param_bf16 + begin;
    kernel(k, param + begin, m + begin, v + begin, grad + begin, copy, end - begin);
  });
}

void AdamWStepBf16GradParallel(ThreadPool& pool, const AdamWConfig& c, float* param, float* m,
                               float* v, const uint16_t* grad_bf16, uint16_t* param_bf16,
                               int64_t n) {
  if (n <= 0) return;
  const Coefficients k = MakeCoefficients(c);
  auto* const kernel = &HWY_DYNAMIC_DISPATCH(AdamWBf16Grad);
  pool.ParallelFor(n, kParallelChunk, [&](int64_t begin, int64_t end) {
    uint16_t* const copy = param_bf16 == nullptr ? nullptr : param_bf16 + begin;
    kernel(k, param + begin, m + begin, v + begin, grad_bf16 + begin, copy, end - begin);
  });
}

void FloatToBf16(const float* in, uint16_t* out, int64_t n) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(FloatToBf16Range)(in, out, n);
}

void Bf16ToFloat(const uint16_t* in, float* out, int64_t n) {
  if (n <= 0) return;
  HWY_DYNAMIC_DISPATCH(Bf16ToFloatRange)(in, out, n);
}

std::string ActiveTarget() { return HWY_DYNAMIC_DISPATCH(TargetNameOfThisTarget)(); }

std::vector<std::string> SupportedTargets() {
  std::vector<std::string> names;
  // Lower bits are better targets.
  for (int64_t bits = DetectedTargets(); bits != 0; bits &= bits - 1) {
    names.emplace_back(hwy::TargetName(bits & -bits));
  }
  return names;
}

absl::Status ForceTarget(const std::string& name) {
  absl::MutexLock lock(&force_mu);
  const int64_t detected = DetectedTargets();
  if (name.empty()) {
    hwy::SetSupportedTargetsForTest(0);
    hwy::GetChosenTarget().Update(hwy::SupportedTargets());
    return absl::OkStatus();
  }
  for (int64_t bits = detected; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    if (name == hwy::TargetName(target)) {
      hwy::SetSupportedTargetsForTest(target);
      hwy::GetChosenTarget().Update(hwy::SupportedTargets());
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("target ", name, ": not one of ", absl::StrJoin(SupportedTargets(), ", ")));
}

}  // namespace trainyard::adam
#endif  // HWY_ONCE
