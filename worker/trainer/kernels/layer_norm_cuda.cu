// LayerNormForwardCuda and LayerNormBackwardCuda (see layer_norm_cuda.h): one warp per row; with
// `rms`, RMSNorm's (no centring, no bias: x * rsqrt(mean(x^2) + eps) * gamma).
// Forward adds the branch to the residual (when there is one), writes the fp32 sum, and writes
// the normalized row straight in the dtype its next product reads (bf16 under autocast), with
// the row's mean and 1/std for backward: one pass to write what eager's add, LayerNorm and cast
// write in three. Backward takes the normalized output's gradient in any dtype, adds the
// residual's own gradient, writes the sum in fp32 and (for a branch in that dtype) rounded, and
// leaves per-block partial sums of dgamma and dbeta (summed after, by SumPartialsKernel).
// Two-pass mean and variance in fp32. Built by nvcc in the CUDA flavour only; ATen's headers only.
// Each way has two kernels. For a width that is a multiple of 4 up to 2048, with aligned rows
// (GPT-2's 768, Llama's 2048): VecForwardKernel and VecBackwardKernel, 4 values a load or store,
// the row in registers between its passes (forward; backward up to 1024 wide, RMSNorm's up to
// 2048, when asked for), and in backward each lane's dgamma and dbeta summed in registers across
// the rows it takes, into shared memory once per block at the end. ForwardKernel and
// BackwardKernel (any width): one value a load, the row re-read from L1, and two shared-memory
// atomics an element backward, which held that kernel to about 40% of the card's bandwidth on
// GPT-2 small (bench/RESULTS.md).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "worker/trainer/kernels/layer_norm_cuda.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

namespace trainyard::trainer {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 32 * kWarpsPerBlock;

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// s = x (+ y) -> sum (when given); n = (s - mean) * rstd * gamma + beta (RMS: mean 0, no beta,
// rstd from the mean square).
template <typename TY, typename TO, bool kRms>
__global__ void __launch_bounds__(kThreads)
    ForwardKernel(const float* __restrict__ x, const TY* __restrict__ y,
                  const float* __restrict__ gamma, const float* __restrict__ beta, float eps,
                  int64_t rows, int d, float* __restrict__ sum, TO* __restrict__ out,
                  float* __restrict__ mean_out, float* __restrict__ rstd_out) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const float* xr = x + row * d;
  const TY* yr = y == nullptr ? nullptr : y + row * d;
  float* sr = sum == nullptr ? nullptr : sum + row * d;
  auto value = [&](int i) { return yr == nullptr ? xr[i] : xr[i] + static_cast<float>(yr[i]); };
  float acc = 0.f;
  for (int i = lane; i < d; i += 32) {
    const float v = value(i);
    if (sr != nullptr) sr[i] = v;
    acc += kRms ? v * v : v;
  }
  float mean = 0.f, rstd;
  if (kRms) {
    rstd = rsqrtf(WarpSum(acc) / d + eps);
  } else {
    mean = WarpSum(acc) / d;
    float sq = 0.f;
    for (int i = lane; i < d; i += 32) {
      const float c = (sr != nullptr ? sr[i] : value(i)) - mean;
      sq += c * c;
    }
    rstd = rsqrtf(WarpSum(sq) / d + eps);
  }
  TO* orow = out + row * d;
  for (int i = lane; i < d; i += 32) {
    const float v = sr != nullptr ? sr[i] : value(i);
    if (kRms) {
      orow[i] = static_cast<TO>(v * rstd * gamma[i]);
    } else {
      orow[i] = static_cast<TO>((v - mean) * rstd * gamma[i] + beta[i]);
    }
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ ds_extra), g = dn * gamma, and ds rounded
// to dn's dtype into ds_cast when given; per block, dgamma += dn * xhat and dbeta += dn over its
// rows, into row blockIdx.x of the partials. RMS: no mean(g) term (the mean was not subtracted),
// xhat = s * rstd, no dbeta.
template <typename TD, bool kRms>
__global__ void __launch_bounds__(kThreads)
    BackwardKernel(const TD* __restrict__ dn, const float* __restrict__ s,
                   const float* __restrict__ mean, const float* __restrict__ rstd,
                   const float* __restrict__ gamma, const float* __restrict__ ds_extra,
                   int64_t rows, int d, float* __restrict__ ds, TD* __restrict__ ds_cast,
                   float* __restrict__ dgamma_part, float* __restrict__ dbeta_part) {
  extern __shared__ float shared[];  // dgamma then dbeta, d each
  float* dgamma = shared;
  float* dbeta = shared + d;
  for (int i = threadIdx.x; i < 2 * d; i += kThreads) shared[i] = 0.f;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + warp; row < rows;
       row += int64_t{gridDim.x} * kWarpsPerBlock) {
    const TD* dnr = dn + row * d;
    const float* sr = s + row * d;
    const float mu = kRms ? 0.f : mean[row], r = rstd[row];
    float c1 = 0.f, c2 = 0.f;
    for (int i = lane; i < d; i += 32) {
      const float g = static_cast<float>(dnr[i]) * gamma[i];
      const float xhat = (sr[i] - mu) * r;
      c1 += g;
      c2 += g * xhat;
    }
    c1 = kRms ? 0.f : WarpSum(c1) / d;
    c2 = WarpSum(c2) / d;
    float* dsr = ds + row * d;
    TD* dcr = ds_cast == nullptr ? nullptr : ds_cast + row * d;
    const float* er = ds_extra == nullptr ? nullptr : ds_extra + row * d;
    for (int i = lane; i < d; i += 32) {
      const float dni = static_cast<float>(dnr[i]);
      const float xhat = (sr[i] - mu) * r;
      const float v = r * (dni * gamma[i] - c1 - xhat * c2);
      const float total = er == nullptr ? v : v + er[i];
      dsr[i] = total;
      if (dcr != nullptr) dcr[i] = static_cast<TD>(total);
      atomicAdd(&dgamma[i], dni * xhat);
      if (!kRms) atomicAdd(&dbeta[i], dni);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d; i += kThreads) {
    dgamma_part[int64_t{blockIdx.x} * d + i] = dgamma[i];
    if (!kRms) dbeta_part[int64_t{blockIdx.x} * d + i] = dbeta[i];
  }
}

// 4 consecutive values at p (aligned to 4 of them) as one access, in fp32.
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

template <typename T>
__device__ __forceinline__ void Load4(const T* p, float (&out)[4]) {
  const Pack4<T> pack = *reinterpret_cast<const Pack4<T>*>(p);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = static_cast<float>(pack.v[k]);
}

template <typename T>
__device__ __forceinline__ void Store4(T* p, const float (&in)[4]) {
  Pack4<T> pack;
#pragma unroll
  for (int k = 0; k < 4; ++k) pack.v[k] = static_cast<T>(in[k]);
  *reinterpret_cast<Pack4<T>*>(p) = pack;
}

// The widest row VecBackwardKernel takes is 32 lanes x 4 values x kMaxChunks.
constexpr int kMaxChunks = 16;

// BackwardKernel's arithmetic, 4 values a load: lane `lane` takes columns 4 * (32 * j + lane)
// .. +3 for j < kChunks (those below d). kHold: dn and xhat stay in registers between the row's
// two passes; otherwise the second pass reads them again (from L1), for fewer registers. Each
// lane sums dgamma and dbeta for its columns over all the rows its warp takes, in registers.
template <typename TD, bool kRms, int kChunks, bool kHold>
__global__ void __launch_bounds__(kThreads)
    VecBackwardKernel(const TD* __restrict__ dn, const float* __restrict__ s,
                      const float* __restrict__ mean, const float* __restrict__ rstd,
                      const float* __restrict__ gamma, const float* __restrict__ ds_extra,
                      int64_t rows, int d, float* __restrict__ ds, TD* __restrict__ ds_cast,
                      float* __restrict__ dgamma_part, float* __restrict__ dbeta_part) {
  constexpr int kHeld = kHold ? kChunks : 1;
  extern __shared__ float shared[];  // dgamma then dbeta, d each
  float* dgamma = shared;
  float* dbeta = shared + d;
  for (int i = threadIdx.x; i < 2 * d; i += kThreads) shared[i] = 0.f;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float acc_g[kChunks][4] = {}, acc_b[kChunks][4] = {};
  for (int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + warp; row < rows;
       row += int64_t{gridDim.x} * kWarpsPerBlock) {
    const TD* dnr = dn + row * d;
    const float* sr = s + row * d;
    const float mu = kRms ? 0.f : mean[row], r = rstd[row];
    float dn_held[kHeld][4], xhat_held[kHeld][4];
    float c1 = 0.f, c2 = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = 4 * (32 * j + lane);
      if (c >= d) continue;
      float dnv[4], sv[4], gv[4];
      Load4(dnr + c, dnv);
      Load4(sr + c, sv);
      Load4(gamma + c, gv);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float xhat = (sv[k] - mu) * r, g = dnv[k] * gv[k];
        c1 += g;
        c2 += g * xhat;
        if constexpr (kHold) {
          dn_held[j][k] = dnv[k];
          xhat_held[j][k] = xhat;
        }
      }
    }
    c1 = kRms ? 0.f : WarpSum(c1) / d;
    c2 = WarpSum(c2) / d;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = 4 * (32 * j + lane);
      if (c >= d) continue;
      float dnv[4], xhat[4], gv[4], extra[4] = {0.f, 0.f, 0.f, 0.f}, out[4];
      if constexpr (kHold) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          dnv[k] = dn_held[j][k];
          xhat[k] = xhat_held[j][k];
        }
      } else {
        float sv[4];
        Load4(dnr + c, dnv);
        Load4(sr + c, sv);
#pragma unroll
        for (int k = 0; k < 4; ++k) xhat[k] = (sv[k] - mu) * r;
      }
      Load4(gamma + c, gv);
      if (ds_extra != nullptr) Load4(ds_extra + row * d + c, extra);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        out[k] = r * (dnv[k] * gv[k] - c1 - xhat[k] * c2) + extra[k];
        acc_g[j][k] += dnv[k] * xhat[k];
        if (!kRms) acc_b[j][k] += dnv[k];
      }
      Store4(ds + row * d + c, out);
      if (ds_cast != nullptr) Store4(ds_cast + row * d + c, out);
    }
  }
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = 4 * (32 * j + lane);
    if (c >= d) continue;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      atomicAdd(&dgamma[c + k], acc_g[j][k]);
      if (!kRms) atomicAdd(&dbeta[c + k], acc_b[j][k]);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d; i += kThreads) {
    dgamma_part[int64_t{blockIdx.x} * d + i] = dgamma[i];
    if (!kRms) dbeta_part[int64_t{blockIdx.x} * d + i] = dbeta[i];
  }
}

// out_g[c] = sum over rows r of part_g[r][c] (and out_b from part_b, when given): the backward's
// per-block partial sums, in a fixed order. A block takes 32 columns; its 8 warps each sum every
// 8th row of them (a warp's loads one 128-byte line), then one warp adds the 8 sums.
constexpr int kSumColumns = 32, kSumGroups = kThreads / kSumColumns;

__global__ void __launch_bounds__(kThreads)
    SumPartialsKernel(const float* __restrict__ part_g, const float* __restrict__ part_b,
                      int64_t parts, int d, float* __restrict__ out_g, float* __restrict__ out_b) {
  __shared__ float sums[2][kSumGroups][kSumColumns];
  const int column = blockIdx.x * kSumColumns + threadIdx.x % kSumColumns;
  const int group = threadIdx.x / kSumColumns;
  float g = 0.f, b = 0.f;
  if (column < d) {
    for (int64_t r = group; r < parts; r += kSumGroups) {
      g += part_g[r * d + column];
      if (part_b != nullptr) b += part_b[r * d + column];
    }
  }
  sums[0][group][threadIdx.x % kSumColumns] = g;
  sums[1][group][threadIdx.x % kSumColumns] = b;
  __syncthreads();
  if (group != 0 || column >= d) return;
  float total_g = 0.f, total_b = 0.f;
#pragma unroll
  for (int k = 0; k < kSumGroups; ++k) {
    total_g += sums[0][k][threadIdx.x];
    total_b += sums[1][k][threadIdx.x];
  }
  out_g[column] = total_g;
  if (out_b != nullptr) out_b[column] = total_b;
}

// ForwardKernel's arithmetic, 4 values a load: lane `lane` takes columns 4 * (32 * j + lane) .. +3
// for j < kChunks (those below d), and keeps the row's sums in registers between the passes (one
// read of x and y where the other kernel reads them again from L1).
template <typename TY, typename TO, bool kRms, int kChunks>
__global__ void __launch_bounds__(kThreads)
    VecForwardKernel(const float* __restrict__ x, const TY* __restrict__ y,
                     const float* __restrict__ gamma, const float* __restrict__ beta, float eps,
                     int64_t rows, int d, float* __restrict__ sum, TO* __restrict__ out,
                     float* __restrict__ mean_out, float* __restrict__ rstd_out) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  float v[kChunks][4];
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = 4 * (32 * j + lane);
    if (c >= d) continue;
    Load4(x + row * d + c, v[j]);
    if (y != nullptr) {
      float yv[4];
      Load4(y + row * d + c, yv);
#pragma unroll
      for (int k = 0; k < 4; ++k) v[j][k] += yv[k];
    }
    if (sum != nullptr) Store4(sum + row * d + c, v[j]);
#pragma unroll
    for (int k = 0; k < 4; ++k) acc += kRms ? v[j][k] * v[j][k] : v[j][k];
  }
  float mean = 0.f, rstd;
  if (kRms) {
    rstd = rsqrtf(WarpSum(acc) / d + eps);
  } else {
    mean = WarpSum(acc) / d;
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if (4 * (32 * j + lane) >= d) continue;
#pragma unroll
      for (int k = 0; k < 4; ++k) sq += (v[j][k] - mean) * (v[j][k] - mean);
    }
    rstd = rsqrtf(WarpSum(sq) / d + eps);
  }
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = 4 * (32 * j + lane);
    if (c >= d) continue;
    float g[4], b[4] = {0.f, 0.f, 0.f, 0.f}, o[4];
    Load4(gamma + c, g);
    if (!kRms) Load4(beta + c, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[k] = kRms ? v[j][k] * rstd * g[k] : (v[j][k] - mean) * rstd * g[k] + b[k];
    }
    Store4(out + row * d + c, o);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename TD>
using BackwardFn = void (*)(const TD*, const float*, const float*, const float*, const float*,
                            const float*, int64_t, int, float*, TD*, float*, float*);

// The backward kernel `kernel` names (kAuto: the vectorised one wherever it applies, holding the
// row for up to 8 chunks a lane, re-reading it beyond), or null where the named one cannot take
// width d.
template <typename TD>
BackwardFn<TD> PickBackward(int64_t d, bool rms, LayerNormBackwardKernel kernel) {
  using K = LayerNormBackwardKernel;
  const int64_t chunks = (d + 127) / 128;
  const bool vectorisable =
      !std::is_same_v<TD, double> && d > 0 && d % 4 == 0 && chunks <= kMaxChunks;
  if (kernel == K::kAuto) kernel = !vectorisable ? K::kScalar : chunks <= 8 ? K::kHeld : K::kReread;
  if (kernel == K::kScalar) return rms ? BackwardKernel<TD, true> : BackwardKernel<TD, false>;
  if constexpr (std::is_same_v<TD, double>) {
    return nullptr;
  } else {
    if (!vectorisable) return nullptr;
    if (kernel == K::kHeld) {
      if (chunks <= 6) {
        return rms ? VecBackwardKernel<TD, true, 6, true> : VecBackwardKernel<TD, false, 6, true>;
      }
      if (chunks <= 8) {
        return rms ? VecBackwardKernel<TD, true, 8, true> : VecBackwardKernel<TD, false, 8, true>;
      }
      // (RMSNorm only up to 2048 wide: LayerNorm's dbeta sums would not fit the registers too.)
      return rms ? VecBackwardKernel<TD, true, kMaxChunks, true> : nullptr;
    }
    if (chunks <= 8) {
      return rms ? VecBackwardKernel<TD, true, 8, false> : VecBackwardKernel<TD, false, 8, false>;
    }
    return rms ? VecBackwardKernel<TD, true, kMaxChunks, false>
               : VecBackwardKernel<TD, false, kMaxChunks, false>;
  }
}

template <typename TD>
bool IsScalar(BackwardFn<TD> fn) {
  return fn == BackwardKernel<TD, true> || fn == BackwardKernel<TD, false>;
}

size_t BackwardSharedBytes(int64_t d) { return 2 * static_cast<size_t>(d) * sizeof(float); }

template <typename TY, typename TO>
using ForwardFn = void (*)(const float*, const TY*, const float*, const float*, float, int64_t, int,
                           float*, TO*, float*, float*);

// VecForwardKernel for these tensors (fp32, bf16 or fp16 branch and output; a width a multiple of
// 4 up to 2048; every row aligned to 4 values, which d and the allocator's addresses give), or
// null for ForwardKernel.
template <typename TY, typename TO>
ForwardFn<TY, TO> PickForward(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gamma,
                              const at::Tensor& beta, const at::Tensor& sum, const at::Tensor& out,
                              bool rms) {
  if constexpr (std::is_same_v<TY, double> || std::is_same_v<TO, double>) {
    return nullptr;
  } else {
    const int64_t d = x.size(1);
    if (d <= 0 || d % 4 != 0 || d > 32 * 4 * kMaxChunks) return nullptr;
    const bool aligned = Aligned(x.data_ptr(), 16) && Aligned(gamma.data_ptr(), 16) &&
                         (!beta.defined() || Aligned(beta.data_ptr(), 16)) &&
                         (!y.defined() || Aligned(y.data_ptr(), 4 * sizeof(TY))) &&
                         (!sum.defined() || Aligned(sum.data_ptr(), 16)) &&
                         Aligned(out.data_ptr(), 4 * sizeof(TO));
    if (!aligned) return nullptr;
    if (d <= 32 * 4 * 8) {
      return rms ? VecForwardKernel<TY, TO, true, 8> : VecForwardKernel<TY, TO, false, 8>;
    }
    return rms ? VecForwardKernel<TY, TO, true, kMaxChunks>
               : VecForwardKernel<TY, TO, false, kMaxChunks>;
  }
}

// The blocks of `fn` (a backward kernel for width d) that fit on the current device at once.
// Asked of the driver once per (device, kernel, width) and kept: eagerly the backward runs 25
// times a step, and the occupancy query is a host call of microseconds each time.
int64_t WaveBlocks(const void* fn, int64_t d) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int64_t>, int64_t> waves;
  const int device = at::cuda::current_device();
  const auto key = std::make_tuple(device, fn, d);
  const std::lock_guard<std::mutex> lock(mu);
  if (const auto it = waves.find(key); it != waves.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, BackwardSharedBytes(d)));
  const int sms = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  const int64_t wave = int64_t{std::max(per_sm, 1)} * sms;
  waves.emplace(key, wave);
  return wave;
}

}  // namespace

// Declared in layer_norm_cuda.h.
bool LayerNormBackwardIsVectorisedCuda(int64_t d, at::ScalarType dn_type) {
  bool vectorised = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dn_type, "LayerNormBackPick", [&] {
    const auto fn = PickBackward<scalar_t>(d, false, LayerNormBackwardKernel::kAuto);
    vectorised = !IsScalar<scalar_t>(fn);
  });
  return vectorised;
}

// Declared in layer_norm_cuda.h. The vectorised kernels: one wave of blocks, as many as fit on the
// card at once (each warp then takes several rows, and its lanes' sums in registers cover them
// all); the other: a block per 8 rows, up to 1024.
int64_t LayerNormBackwardBlocksCuda(int64_t rows, int64_t d, at::ScalarType dn_type, bool rms,
                                    LayerNormBackwardKernel kernel) {
  const int64_t needed = std::max<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 1);
  int64_t blocks = std::min<int64_t>(needed, 1024);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dn_type, "LayerNormBackBlocks", [&] {
    const auto fn = PickBackward<scalar_t>(d, rms, kernel);
    TORCH_CHECK(fn != nullptr,
                "LayerNormBackwardBlocksCuda: the kernel asked for cannot take width ", d);
    if (IsScalar<scalar_t>(fn)) return;
    blocks = std::min<int64_t>(needed, WaveBlocks(reinterpret_cast<const void*>(fn), d));
  });
  return blocks;
}

// Declared in layer_norm_cuda.h.
void LayerNormForwardCuda(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gamma,
                          const at::Tensor& beta, double eps, const at::Tensor& sum,
                          const at::Tensor& out, const at::Tensor& mean, const at::Tensor& rstd,
                          bool rms) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  const int d = static_cast<int>(x.size(1));
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::ScalarType y_type = y.defined() ? y.scalar_type() : at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "LayerNormOut", [&] {
    using TO = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y_type, "LayerNormY", [&] {
      using TY = scalar_t;
      auto launch = [&](auto kernel) {
        kernel<<<blocks, kThreads, 0, stream>>>(
            x.data_ptr<float>(), y.defined() ? y.data_ptr<TY>() : nullptr, gamma.data_ptr<float>(),
            beta.defined() ? beta.data_ptr<float>() : nullptr, static_cast<float>(eps), rows, d,
            sum.defined() ? sum.data_ptr<float>() : nullptr, out.data_ptr<TO>(),
            mean.data_ptr<float>(), rstd.data_ptr<float>());
      };
      const ForwardFn<TY, TO> vec = PickForward<TY, TO>(x, y, gamma, beta, sum, out, rms);
      if (vec != nullptr) {
        launch(vec);
      } else if (rms) {
        launch(ForwardKernel<TY, TO, true>);
      } else {
        launch(ForwardKernel<TY, TO, false>);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// Declared in layer_norm_cuda.h.
void LayerNormBackwardCuda(const at::Tensor& dn, const at::Tensor& s, const at::Tensor& mean,
                           const at::Tensor& rstd, const at::Tensor& gamma,
                           const at::Tensor& ds_extra, const at::Tensor& ds,
                           const at::Tensor& ds_cast, const at::Tensor& dgamma_part,
                           const at::Tensor& dbeta_part, bool rms, LayerNormBackwardKernel kernel) {
  const c10::cuda::CUDAGuard guard(s.device());
  const int64_t rows = s.size(0);
  const int d = static_cast<int>(s.size(1));
  const unsigned blocks = static_cast<unsigned>(dgamma_part.size(0));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dn.scalar_type(), "LayerNormBack", [&] {
    BackwardFn<scalar_t> fn = PickBackward<scalar_t>(d, rms, kernel);
    TORCH_CHECK(fn != nullptr, "LayerNormBackwardCuda: the kernel asked for cannot take width ", d);
    // The vectorised kernels read and write every row 4 values at a time, and every row starts at
    // a multiple of 4 values (d is one): the base addresses decide. (The allocator's are aligned;
    // a view's may not be.)
    const size_t pack = 4 * sizeof(scalar_t);
    const bool aligned = Aligned(dn.data_ptr(), pack) && Aligned(s.data_ptr(), 16) &&
                         Aligned(gamma.data_ptr(), 16) && Aligned(ds.data_ptr(), 16) &&
                         (!ds_extra.defined() || Aligned(ds_extra.data_ptr(), 16)) &&
                         (!ds_cast.defined() || Aligned(ds_cast.data_ptr(), pack));
    if (!aligned) fn = rms ? BackwardKernel<scalar_t, true> : BackwardKernel<scalar_t, false>;
    fn<<<blocks, kThreads, BackwardSharedBytes(d), stream>>>(
        dn.data_ptr<scalar_t>(), s.data_ptr<float>(), mean.data_ptr<float>(),
        rstd.data_ptr<float>(), gamma.data_ptr<float>(),
        ds_extra.defined() ? ds_extra.data_ptr<float>() : nullptr, rows, d, ds.data_ptr<float>(),
        ds_cast.defined() ? ds_cast.data_ptr<scalar_t>() : nullptr, dgamma_part.data_ptr<float>(),
        dbeta_part.defined() ? dbeta_part.data_ptr<float>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Declared in layer_norm_cuda.h.
void LayerNormSumPartialsCuda(const at::Tensor& dgamma_part, const at::Tensor& dbeta_part,
                              const at::Tensor& dgamma, const at::Tensor& dbeta) {
  const c10::cuda::CUDAGuard guard(dgamma_part.device());
  const int64_t parts = dgamma_part.size(0);
  const int d = static_cast<int>(dgamma_part.size(1));
  if (d == 0) return;
  const unsigned blocks = static_cast<unsigned>((d + kSumColumns - 1) / kSumColumns);
  SumPartialsKernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      dgamma_part.data_ptr<float>(), dbeta_part.defined() ? dbeta_part.data_ptr<float>() : nullptr,
      parts, d, dgamma.data_ptr<float>(), dbeta.defined() ? dbeta.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace trainyard::trainer
