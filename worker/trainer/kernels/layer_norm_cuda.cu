// LayerNormForwardCuda and LayerNormBackwardCuda (see fused_norm.h): one warp per row; with
// `rms`, RMSNorm's (no centring, no bias: x * rsqrt(mean(x^2) + eps) * gamma).
// Forward adds the branch to the residual (when there is one), writes the fp32 sum, and writes
// the normalized row straight in the dtype its next product reads (bf16 under autocast), with
// the row's mean and 1/std for backward: one pass to write what eager's add, LayerNorm and cast
// write in three. Backward takes the normalized output's gradient in any dtype, adds the
// residual's own gradient, writes the sum in fp32 and (for a branch in that dtype) rounded, and
// leaves per-block partial sums of dgamma and dbeta (summed after).
// Two-pass mean and variance in fp32 (the rows are re-read from L1). Built by nvcc in the CUDA
// flavour only; ATen's headers only.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace

// Declared in fused_norm.h.
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
      if (rms) {
        launch(ForwardKernel<TY, TO, true>);
      } else {
        launch(ForwardKernel<TY, TO, false>);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// Declared in fused_norm.h.
void LayerNormBackwardCuda(const at::Tensor& dn, const at::Tensor& s, const at::Tensor& mean,
                           const at::Tensor& rstd, const at::Tensor& gamma,
                           const at::Tensor& ds_extra, const at::Tensor& ds,
                           const at::Tensor& ds_cast, const at::Tensor& dgamma_part,
                           const at::Tensor& dbeta_part, bool rms) {
  const c10::cuda::CUDAGuard guard(s.device());
  const int64_t rows = s.size(0);
  const int d = static_cast<int>(s.size(1));
  const unsigned blocks = static_cast<unsigned>(dgamma_part.size(0));
  const size_t shared_bytes = 2 * static_cast<size_t>(d) * sizeof(float);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dn.scalar_type(), "LayerNormBack", [&] {
    auto launch = [&](auto kernel) {
      kernel<<<blocks, kThreads, shared_bytes, stream>>>(
          dn.data_ptr<scalar_t>(), s.data_ptr<float>(), mean.data_ptr<float>(),
          rstd.data_ptr<float>(), gamma.data_ptr<float>(),
          ds_extra.defined() ? ds_extra.data_ptr<float>() : nullptr, rows, d, ds.data_ptr<float>(),
          ds_cast.defined() ? ds_cast.data_ptr<scalar_t>() : nullptr, dgamma_part.data_ptr<float>(),
          dbeta_part.defined() ? dbeta_part.data_ptr<float>() : nullptr);
    };
    if (rms) {
      launch(BackwardKernel<scalar_t, true>);
    } else {
      launch(BackwardKernel<scalar_t, false>);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace trainyard::trainer
