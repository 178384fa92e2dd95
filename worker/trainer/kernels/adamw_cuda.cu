// AdamWMultiTensorCuda (see adamw_cuda.h). Each launch takes up to kAdamWTensorsPerLaunch
// tensors, their pointers and sizes in the kernel's parameters; the tensors are cut into chunks of
// kChunk values, numbered across the launch's tensors, and each block of one wave (as many as fit
// on the card at once) takes every gridDim.x-th chunk. A chunk's threads read and write 4 values
// an access where the tensor's four pointers are 16-byte aligned (the allocator's are), else one.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "worker/trainer/kernels/adamw_cuda.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>

namespace trainyard::trainer {
namespace {

constexpr int kThreads = 512;
// Values a block takes at a time: 8 float4 accesses a thread of each of the four tensors.
constexpr int64_t kChunk = 16384;
constexpr int kMax = kAdamWTensorsPerLaunch;

// One launch's tensors (passed by value: 3.2 KB of the 4 KB a kernel's parameters may take).
struct TensorList {
  float* p[kMax];
  const float* g[kMax];
  float* m[kMax];
  float* v[kMax];
  int64_t numel[kMax];
  int64_t first_chunk[kMax + 1];  // tensor i's chunks are [first_chunk[i], first_chunk[i + 1])
  bool vec[kMax];                 // 4 values an access
  int count;
};

static_assert(sizeof(TensorList) <= 3400, "a kernel's parameters take at most 4 KB");

struct Hyper {
  float lr, step;       // where lr_ptr and step_ptr are null
  const float* lr_ptr;  // a graph's: read when the kernel runs
  const float* step_ptr;
  const float* divisor;  // null: 1
  float beta1, beta2, weight_decay, eps;
};

// torch.optim.AdamW's update of one value (as its fused CUDA kernel orders it), in fp32.
struct Update {
  float divisor, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps;

  __device__ __forceinline__ void operator()(float& p, float g, float& m, float& v) const {
    g = g / divisor;  // divided, as PyTorch's kernel does
    p = p * decay;    // p -= lr * weight_decay * p
    m = beta1 * m + one_minus_beta1 * g;
    v = beta2 * v + one_minus_beta2 * g * g;
    const float denom = sqrtf(v) / bc2_sqrt + eps;
    p = p - step_size * m / denom;
  }
};

__device__ __forceinline__ float4 LoadStreaming(const float* p, int64_t pack) {
  return __ldcs(reinterpret_cast<const float4*>(p) + pack);
}

__device__ __forceinline__ void StoreStreaming(float* p, int64_t pack, float4 x) {
  __stcs(reinterpret_cast<float4*>(p) + pack, x);
}

__global__ void __launch_bounds__(kThreads) AdamWKernel(TensorList list, Hyper h) {
  Update u;
  {
    const float lr = h.lr_ptr != nullptr ? *h.lr_ptr : h.lr;
    const double step = h.step_ptr != nullptr ? *h.step_ptr : h.step;
    const double bc1 = 1.0 - pow(static_cast<double>(h.beta1), step);
    const double bc2 = 1.0 - pow(static_cast<double>(h.beta2), step);
    u.divisor = h.divisor != nullptr ? *h.divisor : 1.0f;
    u.decay = 1.0f - lr * h.weight_decay;
    u.beta1 = h.beta1;
    u.one_minus_beta1 = 1.0f - h.beta1;
    u.beta2 = h.beta2;
    u.one_minus_beta2 = 1.0f - h.beta2;
    u.step_size = static_cast<float>(lr / bc1);
    u.bc2_sqrt = static_cast<float>(sqrt(bc2));
    u.eps = h.eps;
  }
  const int64_t total = list.first_chunk[list.count];
  int t = 0;
  for (int64_t chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
    while (list.first_chunk[t + 1] <= chunk) ++t;  // chunks rise: t only moves forward
    const int64_t begin = (chunk - list.first_chunk[t]) * kChunk;
    const int64_t end = begin + kChunk < list.numel[t] ? begin + kChunk : list.numel[t];
    float* const p = list.p[t];
    const float* const g = list.g[t];
    float* const m = list.m[t];
    float* const v = list.v[t];
    int64_t scalar_from = begin;
    if (list.vec[t]) {
      // begin is a multiple of kChunk, so of 4: packs begin / 4 up to the last whole one.
      const int64_t first_pack = begin / 4, packs = (end - begin) / 4;
      for (int64_t i = threadIdx.x; i < packs; i += kThreads) {
        const int64_t pack = first_pack + i;
        float4 pp = LoadStreaming(p, pack), mm = LoadStreaming(m, pack),
               vv = LoadStreaming(v, pack);
        const float4 gg = LoadStreaming(g, pack);
        u(pp.x, gg.x, mm.x, vv.x);
        u(pp.y, gg.y, mm.y, vv.y);
        u(pp.z, gg.z, mm.z, vv.z);
        u(pp.w, gg.w, mm.w, vv.w);
        StoreStreaming(p, pack, pp);
        StoreStreaming(m, pack, mm);
        StoreStreaming(v, pack, vv);
      }
      scalar_from = begin + packs * 4;
    }
    for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads) {
      float pi = p[i], mi = m[i], vi = v[i];
      u(pi, g[i], mi, vi);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
    }
  }
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The blocks of AdamWKernel that fit on `device` at once (asked of the driver once per device).
int64_t WaveBlocks(int device) {
  static std::mutex mu;
  static std::map<int, int64_t> waves;
  const std::lock_guard<std::mutex> lock(mu);
  if (const auto it = waves.find(device); it != waves.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, AdamWKernel, kThreads, 0));
  const int sms = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  const int64_t wave = int64_t{std::max(per_sm, 1)} * sms;
  waves.emplace(device, wave);
  return wave;
}

std::atomic<int64_t> g_blocks_for_test{0};

const float* DataOrNull(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

}  // namespace

// Declared in adamw_cuda.h.
void SetAdamWBlocksForTest(int64_t blocks) { g_blocks_for_test = blocks; }

// Declared in adamw_cuda.h.
bool AdamWMultiTensorCudaTakes(const std::vector<at::Tensor>& params,
                               const std::vector<at::Tensor>& grads,
                               const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v) {
  if (params.empty() || grads.size() != params.size() || m.size() != params.size() ||
      v.size() != params.size()) {
    return false;
  }
  const at::Device device = params[0].device();
  if (!device.is_cuda()) return false;
  for (size_t i = 0; i < params.size(); ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &m[i], &v[i]}) {
      if (!t->defined() || t->device() != device || t->scalar_type() != at::kFloat ||
          !t->is_contiguous() || t->numel() != params[i].numel()) {
        return false;
      }
    }
  }
  return true;
}

// Declared in adamw_cuda.h.
void AdamWMultiTensorCuda(const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& m,
                          const std::vector<at::Tensor>& v, double lr, int64_t step,
                          const at::Tensor& lr_tensor, const at::Tensor& step_tensor, double beta1,
                          double beta2, double weight_decay, double eps,
                          const at::Tensor& grad_divisor) {
  TORCH_CHECK(AdamWMultiTensorCudaTakes(params, grads, m, v),
              "AdamWMultiTensorCuda: the tensors must be contiguous fp32 on one CUDA device, "
              "four lists of one length");
  const at::Device device = params[0].device();
  for (const at::Tensor* t : {&lr_tensor, &step_tensor, &grad_divisor}) {
    TORCH_CHECK(!t->defined() ||
                    (t->device() == device && t->scalar_type() == at::kFloat && t->numel() == 1),
                "AdamWMultiTensorCuda: lr, step and the divisor must be one fp32 value on the "
                "parameters' device");
  }
  TORCH_CHECK(lr_tensor.defined() == step_tensor.defined(),
              "AdamWMultiTensorCuda: lr and step come both from the device or neither");
  const c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  Hyper h;
  h.lr = static_cast<float>(lr);
  h.step = static_cast<float>(step);
  h.lr_ptr = DataOrNull(lr_tensor);
  h.step_ptr = DataOrNull(step_tensor);
  h.divisor = DataOrNull(grad_divisor);
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.weight_decay = static_cast<float>(weight_decay);
  h.eps = static_cast<float>(eps);
  const int64_t cap = g_blocks_for_test.load();
  const int64_t wave = cap > 0 ? cap : WaveBlocks(device.index());
  TensorList list;
  list.count = 0;
  list.first_chunk[0] = 0;
  const auto launch = [&] {
    const int64_t chunks = list.first_chunk[list.count];
    if (chunks > 0) {
      const auto blocks = static_cast<unsigned>(std::min(chunks, wave));
      AdamWKernel<<<blocks, kThreads, 0, stream>>>(list, h);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    list.count = 0;
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    const int k = list.count;
    list.p[k] = params[i].data_ptr<float>();
    list.g[k] = grads[i].data_ptr<float>();
    list.m[k] = m[i].data_ptr<float>();
    list.v[k] = v[i].data_ptr<float>();
    list.numel[k] = n;
    list.vec[k] =
        Aligned(list.p[k]) && Aligned(list.g[k]) && Aligned(list.m[k]) && Aligned(list.v[k]);
    list.first_chunk[k + 1] = list.first_chunk[k] + (n + kChunk - 1) / kChunk;
    list.count = k + 1;
    if (list.count == kMax) launch();
  }
  if (list.count > 0) launch();
}

}  // namespace trainyard::trainer
