// RotaryCuda (see rotary.h): a grid-stride loop over the rows' pairs (i, i + hd / 2), 16 bytes a
// load where the rows are aligned (one pair a thread otherwise), fp32
// arithmetic with each product and sum rounded as eager's separate kernels round them (no fused
// multiply-add), one rounding per output. Built by nvcc in the CUDA flavour only; ATen's headers
// only.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

namespace trainyard::trainer {
namespace {

constexpr int kThreads = 256;

// Strides of a [b, n, t, hd] tensor's first three dimensions (the last is 1).
struct Strides {
  int64_t b, n, t;
};

// Forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (x * cos + rotate_half(x) * sin).
// Inverse (the backward of it): d1 = g1 c1 + g2 s2, d2 = g2 c2 - g1 s1.
template <typename T, bool kInverse>
__global__ void RotaryKernel(const T* __restrict__ in, Strides si, const float* __restrict__ cos,
                             const float* __restrict__ sin, T* __restrict__ out, Strides so,
                             int64_t heads, int64_t t_len, int64_t half, int64_t pairs) {
  const int64_t hd = 2 * half;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = p % half;
    int64_t row = p / half;
    const int64_t t = row % t_len;
    row /= t_len;
    const int64_t n = row % heads, b = row / heads;
    const T* x = in + b * si.b + n * si.n + t * si.t;
    T* y = out + b * so.b + n * so.n + t * so.t;
    const float* c = cos + t * hd;
    const float* s = sin + t * hd;
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const float c1 = c[i], c2 = c[i + half], s1 = s[i], s2 = s[i + half];
    if (kInverse) {
      y[i] = static_cast<T>(__fadd_rn(__fmul_rn(x1, c1), __fmul_rn(x2, s2)));
      y[i + half] = static_cast<T>(__fadd_rn(__fmul_rn(x2, c2), -__fmul_rn(x1, s1)));
    } else {
      y[i] = static_cast<T>(__fadd_rn(__fmul_rn(x1, c1), -__fmul_rn(x2, s1)));
      y[i + half] = static_cast<T>(__fadd_rn(__fmul_rn(x2, c2), __fmul_rn(x1, s2)));
    }
  }
}

// kVec consecutive values as one access.
template <typename T, int kVec>
struct alignas(kVec * sizeof(T)) Pack {
  T v[kVec];
};

// RotaryKernel's arithmetic, kVec pairs a thread: (i .. i + kVec) and (i + half .. + kVec), each
// half of x and of cos and sin read kVec values a load, and y written so (the scalar kernel's
// 2-byte loads ran at about a fifth of the card's bandwidth: 3.35 ms of a Llama 3.2 1B step on an
// H200, bench/RESULTS.md). The caller checks half % kVec == 0 and the alignment of every row.
template <typename T, int kVec, bool kInverse>
__global__ void VecRotaryKernel(const T* __restrict__ in, Strides si, const float* __restrict__ cos,
                                const float* __restrict__ sin, T* __restrict__ out, Strides so,
                                int64_t heads, int64_t t_len, int64_t half, int64_t groups) {
  const int64_t hd = 2 * half, per_row = half / kVec;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = g % per_row * kVec;
    int64_t row = g / per_row;
    const int64_t t = row % t_len;
    row /= t_len;
    const int64_t n = row % heads, b = row / heads;
    const T* x = in + b * si.b + n * si.n + t * si.t;
    T* y = out + b * so.b + n * so.n + t * so.t;
    const float* c = cos + t * hd;
    const float* s = sin + t * hd;
    const Pack<T, kVec> x1 = *reinterpret_cast<const Pack<T, kVec>*>(x + i);
    const Pack<T, kVec> x2 = *reinterpret_cast<const Pack<T, kVec>*>(x + i + half);
    Pack<T, kVec> y1, y2;
#pragma unroll
    for (int k0 = 0; k0 < kVec; k0 += 4) {
      const float4 c1 = *reinterpret_cast<const float4*>(c + i + k0);
      const float4 c2 = *reinterpret_cast<const float4*>(c + i + half + k0);
      const float4 s1 = *reinterpret_cast<const float4*>(s + i + k0);
      const float4 s2 = *reinterpret_cast<const float4*>(s + i + half + k0);
      const float cc1[4] = {c1.x, c1.y, c1.z, c1.w}, cc2[4] = {c2.x, c2.y, c2.z, c2.w};
      const float ss1[4] = {s1.x, s1.y, s1.z, s1.w}, ss2[4] = {s2.x, s2.y, s2.z, s2.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float a = static_cast<float>(x1.v[k0 + k]), b2 = static_cast<float>(x2.v[k0 + k]);
        if (kInverse) {
          y1.v[k0 + k] = static_cast<T>(__fadd_rn(__fmul_rn(a, cc1[k]), __fmul_rn(b2, ss2[k])));
          y2.v[k0 + k] = static_cast<T>(__fadd_rn(__fmul_rn(b2, cc2[k]), -__fmul_rn(a, ss1[k])));
        } else {
          y1.v[k0 + k] = static_cast<T>(__fadd_rn(__fmul_rn(a, cc1[k]), -__fmul_rn(b2, ss1[k])));
          y2.v[k0 + k] = static_cast<T>(__fadd_rn(__fmul_rn(b2, cc2[k]), __fmul_rn(a, ss2[k])));
        }
      }
    }
    *reinterpret_cast<Pack<T, kVec>*>(y + i) = y1;
    *reinterpret_cast<Pack<T, kVec>*>(y + i + half) = y2;
  }
}

Strides StridesOf(const at::Tensor& x) { return {x.stride(0), x.stride(1), x.stride(2)}; }

// Whether every row of x starts at a multiple of `values` values (its base address and strides).
bool RowsAligned(const at::Tensor& x, int64_t values) {
  const int64_t bytes = values * x.element_size();
  return reinterpret_cast<uintptr_t>(x.data_ptr()) % bytes == 0 && x.stride(0) % values == 0 &&
         x.stride(1) % values == 0 && x.stride(2) % values == 0;
}

// VecRotaryKernel on the stream where the rows and cos and sin allow 16 bytes of x a load (8 bf16
// or fp16, 4 fp32; not fp64); false, with nothing launched, elsewhere.
template <typename T>
bool LaunchVec(const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin,
               const at::Tensor& out, bool inverse, int64_t half, int64_t pairs,
               cudaStream_t stream) {
  if constexpr (sizeof(T) > 4) {
    return false;
  } else {
    constexpr int kVec = sizeof(T) == 2 ? 8 : 4;
    if (half % kVec != 0 || !RowsAligned(in, kVec) || !RowsAligned(out, kVec) ||
        reinterpret_cast<uintptr_t>(cos.data_ptr()) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(sin.data_ptr()) % 16 != 0) {
      return false;
    }
    const int64_t groups = pairs / kVec;
    const unsigned blocks =
        static_cast<unsigned>(std::min<int64_t>((groups + kThreads - 1) / kThreads, 65535));
    const auto kernel = inverse ? VecRotaryKernel<T, kVec, true> : VecRotaryKernel<T, kVec, false>;
    kernel<<<blocks, kThreads, 0, stream>>>(in.data_ptr<T>(), StridesOf(in), cos.data_ptr<float>(),
                                            sin.data_ptr<float>(), out.data_ptr<T>(),
                                            StridesOf(out), in.size(1), in.size(2), half, groups);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
}

}  // namespace

// Declared in rotary.h.
void RotaryCuda(const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& out, bool inverse) {
  const c10::cuda::CUDAGuard guard(in.device());
  const int64_t half = in.size(3) / 2;
  const int64_t pairs = in.size(0) * in.size(1) * in.size(2) * half;
  if (pairs == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((pairs + kThreads - 1) / kThreads, 65535));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "Rotary", [&] {
    if (LaunchVec<scalar_t>(in, cos, sin, out, inverse, half, pairs, stream)) return;
    auto launch = [&](auto kernel) {
      kernel<<<blocks, kThreads, 0, stream>>>(
          in.data_ptr<scalar_t>(), StridesOf(in), cos.data_ptr<float>(), sin.data_ptr<float>(),
          out.data_ptr<scalar_t>(), StridesOf(out), in.size(1), in.size(2), half, pairs);
    };
    if (inverse) {
      launch(RotaryKernel<scalar_t, true>);
    } else {
      launch(RotaryKernel<scalar_t, false>);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace trainyard::trainer
