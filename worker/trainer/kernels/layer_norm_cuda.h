// The LayerNorm and RMSNorm kernels of layer_norm_cuda.cu (the CUDA flavour's), for fused_norm.cc
// and the tests; ATen's headers only, as nvcc compiles them.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_LAYER_NORM_CUDA_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_LAYER_NORM_CUDA_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace trainyard::trainer {

// layer_norm_cuda.cu: x [rows, d] fp32; y undefined or [rows, d]; sum undefined (no y) or [rows,
// d] fp32; out [rows, d]; mean and rstd [rows] fp32. `rms`: RMSNorm (beta undefined; mean
// written as 0).
void LayerNormForwardCuda(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gamma,
                          const at::Tensor& beta, double eps, const at::Tensor& sum,
                          const at::Tensor& out, const at::Tensor& mean, const at::Tensor& rstd,
                          bool rms);
// Which backward kernel runs: kAuto picks. kScalar: one value a load, dgamma and dbeta summed by
// shared-memory atomics (any width). kHeld and kReread: 4 values a load and the lanes' sums of
// dgamma and dbeta in registers (widths a multiple of 4 up to 2048), the row held in registers
// between its two passes (up to 1024 wide; RMSNorm's up to 2048) or read again. The others are
// for timing them.
enum class LayerNormBackwardKernel { kAuto, kScalar, kHeld, kReread };
// dn [rows, d]; s [rows, d] fp32 (the norm's input); ds_extra undefined or [rows, d] fp32; ds
// [rows, d] fp32; ds_cast undefined or [rows, d] in dn's dtype (ds again, rounded: the gradient
// of a branch in that dtype); the partials [blocks, d] fp32, one row per thread block of the
// launch (LayerNormBackwardBlocksCuda's count). `rms`: RMSNorm's (dbeta_part undefined).
void LayerNormBackwardCuda(const at::Tensor& dn, const at::Tensor& s, const at::Tensor& mean,
                           const at::Tensor& rstd, const at::Tensor& gamma,
                           const at::Tensor& ds_extra, const at::Tensor& ds,
                           const at::Tensor& ds_cast, const at::Tensor& dgamma_part,
                           const at::Tensor& dbeta_part, bool rms,
                           LayerNormBackwardKernel kernel = LayerNormBackwardKernel::kAuto);
// The thread blocks LayerNormBackwardCuda wants for rows of width d (its partials' first size).
int64_t LayerNormBackwardBlocksCuda(
    int64_t rows, int64_t d, at::ScalarType dn_type, bool rms,
    LayerNormBackwardKernel kernel = LayerNormBackwardKernel::kAuto);
// dgamma = dgamma_part.sum(0) and dbeta = dbeta_part.sum(0) (both undefined, or neither) in one
// launch: the partials [blocks, d] fp32, the sums [d] fp32, contiguous.
void LayerNormSumPartialsCuda(const at::Tensor& dgamma_part, const at::Tensor& dbeta_part,
                              const at::Tensor& dgamma, const at::Tensor& dbeta);
// Whether kAuto takes a vectorised kernel for rows of width d with a gradient in dn_type (given
// aligned tensors, as the allocator's are).
bool LayerNormBackwardIsVectorisedCuda(int64_t d, at::ScalarType dn_type);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_LAYER_NORM_CUDA_H_
