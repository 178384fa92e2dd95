// LayerNormCast, AddLayerNorm, RmsNormCast and AddRmsNorm (see fused_norm.h).
#include "worker/trainer/kernels/fused_norm.h"

#include <algorithm>

#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kMaxKernelWidth = 4096;  // the backward's partial sums live in shared memory

#if TRAINYARD_CUDA_KERNELS
constexpr int64_t kRowsPerBlock = 8;  // layer_norm_cuda.cu's warps per block
constexpr int64_t kMaxBackwardBlocks = 1024;

// `bias` undefined: RMSNorm's (none).
bool UsesKernel(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                bool rms = false) {
  return x.is_cuda() && x.scalar_type() == torch::kFloat && weight.defined() &&
         (rms || bias.defined()) && weight.scalar_type() == torch::kFloat &&
         (rms || bias.scalar_type() == torch::kFloat) && HasLayerNormKernel(x.size(-1));
}

// The branch the kernel adds to x: on x's GPU, floating point (the kernel reads its dtype).
bool BranchFits(const torch::Tensor& x, const torch::Tensor& y) {
  return y.is_cuda() && y.device() == x.device() && y.is_floating_point() && y.numel() > 0;
}

// y: an empty tensor when there is no branch to add (autograd's functions take defined tensors);
// bias an empty tensor under `rms` (RMSNorm: none). Outputs {h, norm} with a branch, {norm}
// without.
class FusedLayerNorm : public torch::autograd::Function<FusedLayerNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& y,
                               const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                               int64_t out_type, bool rms) {
    const int64_t d = x.size(-1);
    const bool has_y = y.numel() > 0;
    const torch::Tensor x2 = x.reshape({-1, d}).contiguous();
    const torch::Tensor y2 = has_y ? y.reshape({-1, d}).contiguous() : torch::Tensor();
    const int64_t rows = x2.size(0);
    const auto f32 = x.options().dtype(torch::kFloat);
    const torch::Tensor sum = has_y ? torch::empty({rows, d}, f32) : torch::Tensor();
    const torch::Tensor out =
        torch::empty({rows, d}, x.options().dtype(static_cast<c10::ScalarType>(out_type)));
    const torch::Tensor mean = torch::empty({rows}, f32), rstd = torch::empty({rows}, f32);
    const torch::Tensor w = weight.contiguous(), b = rms ? torch::Tensor() : bias.contiguous();
    LayerNormForwardCuda(x2, y2, w, b, eps, sum, out, mean, rstd, rms);
    ctx->save_for_backward({has_y ? sum : x2, mean, rstd, w});
    ctx->saved_data["has_y"] = has_y;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["y_type"] = static_cast<int64_t>(has_y ? y.scalar_type() : torch::kFloat);
    ctx->saved_data["shape"] = x.sizes().vec();
    if (has_y) return {sum.view(x.sizes()), out.view(x.sizes())};
    return {out.view(x.sizes())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &s = saved[0], &mean = saved[1], &rstd = saved[2], &w = saved[3];
    const bool has_y = ctx->saved_data["has_y"].toBool();
    const bool rms = ctx->saved_data["rms"].toBool();
    const auto y_type = static_cast<c10::ScalarType>(ctx->saved_data["y_type"].toInt());
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    const int64_t rows = s.size(0), d = s.size(1);
    const torch::Tensor& dn = has_y ? grads[1] : grads[0];
    const torch::Tensor ds_extra = has_y && grads[0].defined()
                                       ? grads[0].reshape({-1, d}).to(torch::kFloat).contiguous()
                                       : torch::Tensor();
    const auto f32 = s.options();
    torch::Tensor ds, dgamma, dbeta;
    if (dn.defined()) {
      ds = torch::empty({rows, d}, f32);
      const int64_t blocks =
          std::clamp<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1, kMaxBackwardBlocks);
      const torch::Tensor dgamma_part = torch::empty({blocks, d}, f32);
      const torch::Tensor dbeta_part = rms ? torch::Tensor() : torch::empty({blocks, d}, f32);
      LayerNormBackwardCuda(dn.reshape({-1, d}).contiguous(), s, mean, rstd, w, ds_extra, ds,
                            dgamma_part, dbeta_part, rms);
      dgamma = dgamma_part.sum(0);
      if (!rms) dbeta = dbeta_part.sum(0);
    } else {
      ds = ds_extra.defined() ? ds_extra : torch::zeros({rows, d}, f32);
    }
    const torch::Tensor dx = ds.view(shape);
    torch::Tensor dy;
    if (has_y) dy = y_type == torch::kFloat ? dx.clone() : dx.to(y_type);
    return {dx, dy, dgamma, dbeta, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

bool HasLayerNormKernel(int64_t d) {
  return TRAINYARD_CUDA_KERNELS != 0 && d > 0 && d <= kMaxKernelWidth;
}

torch::Tensor LayerNormCast(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias, double eps) {
  const c10::ScalarType out_type = AutocastScope::ProductType(x);
#if TRAINYARD_CUDA_KERNELS
  if (UsesKernel(x, weight, bias)) {
    return FusedLayerNorm::apply(x, torch::empty({0}, x.options()), weight, bias, eps,
                                 static_cast<int64_t>(out_type), /*rms=*/false)[0];
  }
#endif
  return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps).to(out_type);
}

std::pair<torch::Tensor, torch::Tensor> AddLayerNorm(const torch::Tensor& x, const torch::Tensor& y,
                                                     const torch::Tensor& weight,
                                                     const torch::Tensor& bias, double eps) {
  TORCH_CHECK(x.sizes() == y.sizes(), "AddLayerNorm: x and y must have one shape");
  const c10::ScalarType out_type = AutocastScope::ProductType(x);
#if TRAINYARD_CUDA_KERNELS
  if (UsesKernel(x, weight, bias) && BranchFits(x, y)) {
    const variable_list out =
        FusedLayerNorm::apply(x, y, weight, bias, eps, static_cast<int64_t>(out_type), false);
    return {out[0], out[1]};
  }
#endif
  const torch::Tensor h = x + y;
  return {h, torch::layer_norm(h, {h.size(-1)}, weight, bias, eps).to(out_type)};
}

torch::Tensor RmsNormOf(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
#if TRAINYARD_TORCH2
  // LibTorch's fused RMSNorm (one kernel forward, one backward), the same arithmetic in fp32.
  if (x.is_cuda() && x.scalar_type() == torch::kFloat) {
    return at::rms_norm(x, {x.size(-1)}, weight, eps);
  }
#endif
  return weight * (x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

torch::Tensor RmsNormCast(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const c10::ScalarType out_type = AutocastScope::ProductType(x);
#if TRAINYARD_CUDA_KERNELS
  if (UsesKernel(x, weight, torch::Tensor(), /*rms=*/true)) {
    return FusedLayerNorm::apply(x, torch::empty({0}, x.options()), weight,
                                 torch::empty({0}, x.options()), eps,
                                 static_cast<int64_t>(out_type), /*rms=*/true)[0];
  }
#endif
  return RmsNormOf(x, weight, eps).to(out_type);
}

std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(const torch::Tensor& x, const torch::Tensor& y,
                                                   const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == y.sizes(), "AddRmsNorm: x and y must have one shape");
  const c10::ScalarType out_type = AutocastScope::ProductType(x);
#if TRAINYARD_CUDA_KERNELS
  if (UsesKernel(x, weight, torch::Tensor(), /*rms=*/true) && BranchFits(x, y)) {
    const variable_list out =
        FusedLayerNorm::apply(x, y, weight, torch::empty({0}, x.options()), eps,
                              static_cast<int64_t>(out_type), /*rms=*/true);
    return {out[0], out[1]};
  }
#endif
  const torch::Tensor h = x + y;
  return {h, RmsNormOf(h, weight, eps).to(out_type)};
}

}  // namespace trainyard::trainer
