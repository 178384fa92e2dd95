// SwiGluForwardCuda and SwiGluBackwardCuda (see swiglu.h): elementwise, a grid-stride loop over
// the flat tensors 16 bytes a load (one value a load, 3x slower, held Llama 3.2 1B's SwiGLU to
// 9.5 ms a step on an H200: bench/RESULTS.md), fp32 arithmetic, one rounding per output. Built by
// nvcc in the CUDA flavour only; ATen's headers only.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace trainyard::trainer {
namespace {

constexpr int kThreads = 256;

unsigned BlocksFor(int64_t n) {
  // Enough blocks to fill any current GPU several times over; the loop strides over the rest.
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// kVec consecutive values as one access (16 bytes: 8 bf16 or fp16, 4 fp32).
template <typename T, int kVec>
struct alignas(kVec * sizeof(T)) Pack {
  T v[kVec];
};

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> Load(const T* p, int64_t i) {
  return reinterpret_cast<const Pack<T, kVec>*>(p)[i];
}

// Each thread takes kVec values a load, over the n / kVec whole packs (grid-stride), then the
// tail of n % kVec one at a time. kVec 1: one value a load throughout (unaligned tensors).
// out = silu(gate) * up = gate * sigmoid(gate) * up.
template <typename T, int kVec>
__global__ void ForwardKernel(const T* __restrict__ gate, const T* __restrict__ up,
                              T* __restrict__ out, int64_t n) {
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const auto value = [](float g, float u) { return g * Sigmoid(g) * u; };
  for (int64_t p = first; p < n / kVec; p += stride) {
    const Pack<T, kVec> g = Load<T, kVec>(gate, p), u = Load<T, kVec>(up, p);
    Pack<T, kVec> o;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      o.v[k] = static_cast<T>(value(static_cast<float>(g.v[k]), static_cast<float>(u.v[k])));
    }
    reinterpret_cast<Pack<T, kVec>*>(out)[p] = o;
  }
  for (int64_t i = n / kVec * kVec + first; i < n; i += stride) {
    out[i] = static_cast<T>(value(static_cast<float>(gate[i]), static_cast<float>(up[i])));
  }
}

// dup = dout * silu(gate); dgate = dout * up * silu'(gate), silu'(g) = s (1 + g (1 - s)).
__device__ __forceinline__ void Gradients(float d, float g, float u, float* dg, float* du) {
  const float s = Sigmoid(g);
  *du = d * g * s;
  *dg = d * u * s * (1.0f + g * (1.0f - s));
}

template <typename T, int kVec>
__global__ void BackwardKernel(const T* __restrict__ dout, const T* __restrict__ gate,
                               const T* __restrict__ up, T* __restrict__ dgate, T* __restrict__ dup,
                               int64_t n) {
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = first; p < n / kVec; p += stride) {
    const Pack<T, kVec> d = Load<T, kVec>(dout, p), g = Load<T, kVec>(gate, p),
                        u = Load<T, kVec>(up, p);
    Pack<T, kVec> dg, du;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float a, b;
      Gradients(static_cast<float>(d.v[k]), static_cast<float>(g.v[k]), static_cast<float>(u.v[k]),
                &a, &b);
      dg.v[k] = static_cast<T>(a);
      du.v[k] = static_cast<T>(b);
    }
    reinterpret_cast<Pack<T, kVec>*>(dgate)[p] = dg;
    reinterpret_cast<Pack<T, kVec>*>(dup)[p] = du;
  }
  for (int64_t i = n / kVec * kVec + first; i < n; i += stride) {
    float a, b;
    Gradients(static_cast<float>(dout[i]), static_cast<float>(gate[i]), static_cast<float>(up[i]),
              &a, &b);
    dgate[i] = static_cast<T>(a);
    dup[i] = static_cast<T>(b);
  }
}

// 16 bytes a load where every tensor's address allows it (the allocator's do); else one value.
template <typename T>
constexpr int kVecOf = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;

bool AllAligned(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
  }
  return true;
}

}  // namespace

// Declared in swiglu.h.
void SwiGluForwardCuda(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t n = gate.numel();
  if (n == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "SwiGlu", [&] {
    constexpr int kVec = kVecOf<scalar_t>;
    if (AllAligned({&gate, &up, &out})) {
      ForwardKernel<scalar_t, kVec><<<BlocksFor(n / kVec + 1), kThreads, 0, stream>>>(
          gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n);
    } else {
      ForwardKernel<scalar_t, 1><<<BlocksFor(n), kThreads, 0, stream>>>(
          gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n);
    }
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
    constexpr int kVec = kVecOf<scalar_t>;
    const bool aligned = AllAligned({&dout, &gate, &up, &dgate, &dup});
    const auto kernel = aligned ? BackwardKernel<scalar_t, kVec> : BackwardKernel<scalar_t, 1>;
    kernel<<<BlocksFor(aligned ? n / kVec + 1 : n), kThreads, 0, stream>>>(
        dout.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(),
        dgate.data_ptr<scalar_t>(), dup.data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace trainyard::trainer
