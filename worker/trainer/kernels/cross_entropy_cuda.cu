// CrossEntropyRowsCuda (see fused_loss.h): one thread block per row of logits. The first pass
// reads the row once, keeping a running maximum and the sum of exp(x - maximum) per thread
// (16-byte loads where the row allows), merges them over the block, and gives the row's
// log-sum-exp; the second pass reads the row again (from L2: a block's row was just read) and
// writes the gradient of its loss over itself, (softmax - one_hot(target)) * weight, in the
// logits' own dtype. llm.c's fused classifier does the same; eager PyTorch makes an fp32 copy of
// the logits, a log-softmax of it, and three more passes of that size in backward.
// Built by nvcc for sm_80 and sm_90 in the CUDA flavour only (worker/CMakeLists.txt). ATen's
// headers only: fused_loss.h (which declares the entry point) pulls in the whole of LibTorch.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>

namespace trainyard::trainer {
namespace {

constexpr int kThreads = 512;

// exp: the fast intrinsic for 16-bit logits (its error is far below their rounding), the
// accurate one for fp32 and fp64, whose losses are compared with the CPU's to 1e-5.
template <typename T>
__device__ __forceinline__ float Exp(float x) {
  if constexpr (sizeof(T) <= 2) {
    return __expf(x);
  } else {
    return expf(x);
  }
}

// (max, sum of exp(x - max)) merged with another such pair.
__device__ __forceinline__ void Merge(float& m, float& s, float m2, float s2) {
  const float top = fmaxf(m, m2);
  if (top == -INFINITY) return;  // both empty
  s = s * __expf(m - top) + s2 * __expf(m2 - top);
  m = top;
}

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// One block per row. logits: rows x vocab with row stride `ld`; loss[row] = weight * (lse -
// x[target]); with `write_grad`, the row becomes (softmax - one_hot) * weight.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyRowsKernel(T* __restrict__ logits, int64_t ld, int64_t vocab,
                           const int64_t* __restrict__ targets, const float* __restrict__ weights,
                           float* __restrict__ loss, bool write_grad) {
  const int64_t row = blockIdx.x;
  T* x = logits + row * ld;
  const int64_t packs = vocab / kVec;
  const auto* in = reinterpret_cast<const Pack<T, kVec>*>(x);

  float m = -INFINITY, s = 0.f;
  for (int64_t i = threadIdx.x; i < packs; i += kThreads) {
    const Pack<T, kVec> p = in[i];
    float f[kVec];
    float top = m;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      f[k] = static_cast<float>(p.v[k]);
      top = fmaxf(top, f[k]);
    }
    float add = 0.f;
#pragma unroll
    for (int k = 0; k < kVec; ++k) add += Exp<T>(f[k] - top);
    s = (m == -INFINITY ? 0.f : s * __expf(m - top)) + add;
    m = top;
  }
  // Over the warp, then over the block's warps.
  for (int offset = 16; offset > 0; offset /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    Merge(m, s, m2, s2);
  }
  __shared__ float warp_m[kThreads / 32], warp_s[kThreads / 32];
  __shared__ float row_lse, target_logit;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  const int64_t target = targets[row];
  CUDA_KERNEL_ASSERT(target >= 0 && target < vocab);
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = warp_m[0], bs = warp_s[0];
    for (int w = 1; w < kThreads / 32; ++w) Merge(bm, bs, warp_m[w], warp_s[w]);
    row_lse = bm + logf(bs);
    target_logit = static_cast<float>(x[target]);
    const float w = weights == nullptr ? 1.f : weights[row];
    loss[row] = w == 0.f ? 0.f : w * (row_lse - target_logit);
  }
  __syncthreads();  // x[target] is read before the gradient overwrites it
  if (!write_grad) return;
  const float lse = row_lse;
  const float w = weights == nullptr ? 1.f : weights[row];
  auto* out = reinterpret_cast<Pack<T, kVec>*>(x);
  for (int64_t i = threadIdx.x; i < packs; i += kThreads) {
    Pack<T, kVec> p = in[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t j = i * kVec + k;
      const float prob = Exp<T>(static_cast<float>(p.v[k]) - lse);
      p.v[k] = static_cast<T>(w * (prob - (j == target ? 1.f : 0.f)));
    }
    out[i] = p;
  }
}

template <typename T, int kVec>
void Launch(const at::Tensor& logits, const at::Tensor& targets, const float* weights,
            const at::Tensor& loss, bool write_grad) {
  const int64_t rows = logits.size(0);
  if (rows == 0) return;
  CrossEntropyRowsKernel<T, kVec>
      <<<static_cast<unsigned>(rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          logits.data_ptr<T>(), logits.stride(0), logits.size(1), targets.data_ptr<int64_t>(),
          weights, loss.data_ptr<float>(), write_grad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// Declared in fused_loss.h.
void CrossEntropyRowsCuda(const at::Tensor& logits, const at::Tensor& targets,
                          const at::Tensor& weights, const at::Tensor& loss, bool write_grad) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1,
              "CrossEntropyRowsCuda: logits must be 2-D CUDA rows with unit column stride");
  TORCH_CHECK(logits.size(0) <= std::numeric_limits<int32_t>::max(),
              "CrossEntropyRowsCuda: too many rows for one launch");
  const c10::cuda::CUDAGuard guard(logits.device());
  const float* w = weights.defined() ? weights.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "CrossEntropyRowsCuda", [&] {
        constexpr int kVec = 16 / sizeof(scalar_t);
        const bool aligned = logits.size(1) % kVec == 0 && logits.stride(0) % kVec == 0 &&
                             reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
        if (aligned) {
          Launch<scalar_t, kVec>(logits, targets, w, loss, write_grad);
        } else {
          Launch<scalar_t, 1>(logits, targets, w, loss, write_grad);
        }
      });
}

}  // namespace trainyard::trainer
