// RotaryCuda (see rotary.h): a grid-stride loop over the rows' pairs (i, i + hd / 2), fp32
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

Strides StridesOf(const at::Tensor& x) { return {x.stride(0), x.stride(1), x.stride(2)}; }

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
