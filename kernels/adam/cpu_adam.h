// Vectorized CPU AdamW for the parameter server (trainyard-ps): one fused, element-wise pass over
// fp32 master weights, m and v, with fp32 or bfloat16 gradients and an optional bfloat16 copy of
// the updated weights. Computes what torch.optim.AdamW (PyTorch 1.13, amsgrad=False,
// maximize=False) computes, in the same order of fp32 operations (see cpu_adam.cc), so results
// agree with PyTorch to fp32 rounding.
//
// Built with Google Highway for several x86 targets (AVX3 = AVX-512, AVX2, SSE4, SSSE3, SCALAR)
// and dispatched at run time to the best one this CPU supports.
//
// Thread-safe: the kernels touch only their arguments, so disjoint ranges may be updated from
// several threads at once. ForceTarget changes process-wide dispatch (tests and benchmarks only).
#ifndef TRAINYARD_KERNELS_ADAM_CPU_ADAM_H_
#define TRAINYARD_KERNELS_ADAM_CPU_ADAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/adam/thread_pool.h"

namespace trainyard::adam {

struct AdamWConfig {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  int64_t step = 1;  // 1-based number of this update (bias corrections use it)
  // Multiplies every gradient before use (a gradient-clipping coefficient); 1 = none.
  float grad_scale = 1.0f;
};

// One AdamW update, in place, of `n` elements:
//   g = grad * grad_scale
//   param = param * (1 - lr * weight_decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   param = param - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// `param_bf16` may be nullptr; otherwise the updated params are also written there as bfloat16
// (round to nearest even), in the same pass. No alignment is required, not even of `grad` to its
// element size (trainyard-ps reads pushed gradients where gRPC received them); ranges must not
// overlap.
void AdamWStep(const AdamWConfig& c, float* param, float* m, float* v, const float* grad,
               uint16_t* param_bf16, int64_t n);

// Same with bfloat16 gradients (bit patterns, converted to fp32 in the pass).
void AdamWStepBf16Grad(const AdamWConfig& c, float* param, float* m, float* v,
                       const uint16_t* grad_bf16, uint16_t* param_bf16, int64_t n);

// The same updates split over `pool` in chunks of kParallelChunk elements (every thread streams
// its own chunks). Results are bit for bit those of AdamWStep / AdamWStepBf16Grad.
inline constexpr int64_t kParallelChunk = int64_t{64} * 1024;
void AdamWStepParallel(ThreadPool& pool, const AdamWConfig& c, float* param, float* m, float* v,
                       const float* grad, uint16_t* param_bf16, int64_t n);
void AdamWStepBf16GradParallel(ThreadPool& pool, const AdamWConfig& c, float* param, float* m,
                               float* v, const uint16_t* grad_bf16, uint16_t* param_bf16,
                               int64_t n);

// fp32 -> bfloat16, round to nearest even like PyTorch's .to(torch.bfloat16) (subnormals kept,
// overflow rounds to infinity); every NaN becomes the quiet NaN 0x7FC0.
void FloatToBf16(const float* in, uint16_t* out, int64_t n);
// bfloat16 -> fp32 (exact).
void Bf16ToFloat(const uint16_t* in, float* out, int64_t n);

// The Highway target the dispatcher uses now, e.g. "AVX3".
std::string ActiveTarget();
// Targets compiled in and supported by this CPU, best first, e.g. {"AVX3", "AVX2", "SSE4",
// "SSSE3", "SCALAR"}. Not affected by ForceTarget.
std::vector<std::string> SupportedTargets();
// Restricts dispatch to one target of SupportedTargets(); "" restores the best one.
// InvalidArgument for any other name. For tests and benchmarks: must not race with updates.
absl::Status ForceTarget(const std::string& name);

}  // namespace trainyard::adam

#endif  // TRAINYARD_KERNELS_ADAM_CPU_ADAM_H_
