// SwiGluForwardCuda and SwiGluBackwardCuda (see swiglu.h): elementwise, a grid-stride loop over
// the flat tensors, fp32 arithmetic, one rounding per output. Built by nvcc in the CUDA flavour
// only; ATen's headers only.
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

unsigned BlocksFor(int64_t n) {
  // Enough blocks to fill any current GPU several times over; the loop strides over the rest.
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out = silu(gate) * up = gate * sigmoid(gate) * up.
template <typename T>
__global__ void ForwardKernel(const T* __restrict__ gate, const T* __restrict__ up,
                              T* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(g * Sigmoid(g) * static_cast<float>(up[i]));
  }
}

// dup = dout * silu(gate); dgate = dout * up * silu'(gate), silu'(g) = s (1 + g (1 - s)).
template <typename T>
__global__ void BackwardKernel(const T* __restrict__ dout, const T* __restrict__ gate,
                               const T* __restrict__ up, T* __restrict__ dgate, T* __restrict__ dup,
                               int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float d = static_cast<float>(dout[i]), g = static_cast<float>(gate[i]);
    const float s = Sigmoid(g);
    dup[i] = static_cast<T>(d * g * s);
    dgate[i] = static_cast<T>(d * static_cast<float>(up[i]) * s * (1.0f + g * (1.0f - s)));
  }
}

}  // namespace

// Declared in swiglu.h.
void SwiGluForwardCuda(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t n = gate.numel();
  if (n == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "SwiGlu", [&] {
    ForwardKernel<scalar_t><<<BlocksFor(n), kThreads, 0, stream>>>(
        gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Declared in swiglu.h.
void SwiGluBackwardCuda(const at::Tensor& dout, const at::Tensor& gate, const at::Tensor& up,
                        const at::Tensor& dgate, const at::Tensor& dup) {
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t n = gate.numel();
  if (n == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "SwiGluBack", [&] {
    BackwardKernel<scalar_t><<<BlocksFor(n), kThreads, 0, stream>>>(
        dout.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(),
        dgate.data_ptr<scalar_t>(), dup.data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace trainyard::trainer
