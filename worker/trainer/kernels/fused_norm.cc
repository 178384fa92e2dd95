// LayerNormCast, LayerNormResidual, AddLayerNorm and their RMSNorm forms (see fused_norm.h).
#include "worker/trainer/kernels/fused_norm.h"

#include <atomic>

#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kMaxKernelWidth = 4096;  // the backward's partial sums live in shared memory

std::atomic<int> cpu_for_test{0};  // FusedNormsOnTheCpuForTest guards alive
std::atomic<int> cpu_out_type_for_test{static_cast<int>(torch::kFloat)};

// `bias` undefined: RMSNorm's (none).
bool UsesKernel(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                bool rms = false) {
  return UsesFusedNorms(x) && weight.defined() && (rms || bias.defined()) &&
         weight.scalar_type() == torch::kFloat && weight.device() == x.device() &&
         (rms || (bias.scalar_type() == torch::kFloat && bias.device() == x.device()));
}

// The branch the kernel adds to x: on x's device, floating point (the kernel reads its dtype).
bool BranchFits(const torch::Tensor& x, const torch::Tensor& y) {
  return y.device() == x.device() && y.is_floating_point() && y.numel() > 0;
}

// The kernels (layer_norm_cuda.cu) for CUDA tensors; on the CPU their arithmetic in ATen, fp32,
// for the tests of the autograd wiring (FusedNormsOnTheCpuForTest). Arguments as fused_norm.h's.
void NormForward(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& gamma,
                 const torch::Tensor& beta, double eps, const torch::Tensor& sum,
                 const torch::Tensor& out, const torch::Tensor& mean, const torch::Tensor& rstd,
                 bool rms) {
#if TRAINYARD_CUDA_KERNELS
  if (x.is_cuda()) {
    LayerNormForwardCuda(x, y, gamma, beta, eps, sum, out, mean, rstd, rms);
    return;
  }
#endif
  const torch::Tensor s = y.defined() ? x + y.to(torch::kFloat) : x;
  if (sum.defined()) sum.copy_(s);
  if (rms) {
    mean.zero_();
    rstd.copy_(torch::rsqrt(s.pow(2).mean(-1) + eps));
    out.copy_(s * rstd.unsqueeze(1) * gamma);
  } else {
    mean.copy_(s.mean(-1));
    const torch::Tensor centred = s - mean.unsqueeze(1);
    rstd.copy_(torch::rsqrt(centred.pow(2).mean(-1) + eps));
    out.copy_(centred * rstd.unsqueeze(1) * gamma + beta);
  }
}

void NormBackward(const torch::Tensor& dn, const torch::Tensor& s, const torch::Tensor& mean,
                  const torch::Tensor& rstd, const torch::Tensor& gamma,
                  const torch::Tensor& ds_extra, const torch::Tensor& ds,
                  const torch::Tensor& ds_cast, const torch::Tensor& dgamma_part,
                  const torch::Tensor& dbeta_part, bool rms) {
#if TRAINYARD_CUDA_KERNELS
  if (s.is_cuda()) {
    LayerNormBackwardCuda(dn, s, mean, rstd, gamma, ds_extra, ds, ds_cast, dgamma_part, dbeta_part,
                          rms);
    return;
  }
#endif
  const torch::Tensor dn32 = dn.to(torch::kFloat);
  const torch::Tensor xhat = (s - mean.unsqueeze(1)) * rstd.unsqueeze(1);
  const torch::Tensor g = dn32 * gamma;
  torch::Tensor v = g - xhat * (g * xhat).mean(-1, /*keepdim=*/true);
  if (!rms) v = v - g.mean(-1, /*keepdim=*/true);
  v = rstd.unsqueeze(1) * v;
  if (ds_extra.defined()) v = v + ds_extra;
  ds.copy_(v);
  if (ds_cast.defined()) ds_cast.copy_(v);
  dgamma_part.copy_((dn32 * xhat).sum(0, /*keepdim=*/true));
  if (!rms) dbeta_part.copy_(dn32.sum(0, /*keepdim=*/true));
}

// What the node's first output is: none (the norm alone), the sum h = x + y (AddLayerNorm), or x
// itself (LayerNormResidual).
enum class First : int64_t { kNone = 0, kSum = 1, kInput = 2 };

// y: an empty tensor when there is no branch to add (autograd's functions take defined tensors);
// bias an empty tensor under `rms` (RMSNorm: none). Outputs {first, norm}, or {norm} with kNone.
class FusedLayerNorm : public torch::autograd::Function<FusedLayerNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& y,
                               const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                               int64_t out_type, bool rms, int64_t first) {
    const int64_t d = x.size(-1);
    const bool has_y = static_cast<First>(first) == First::kSum;
    const torch::Tensor x2 = x.reshape({-1, d}).contiguous();
    const torch::Tensor y2 = has_y ? y.reshape({-1, d}).contiguous() : torch::Tensor();
    const int64_t rows = x2.size(0);
    const auto f32 = x.options().dtype(torch::kFloat);
    const torch::Tensor sum = has_y ? torch::empty({rows, d}, f32) : torch::Tensor();
    const torch::Tensor out =
        torch::empty({rows, d}, x.options().dtype(static_cast<c10::ScalarType>(out_type)));
    const torch::Tensor mean = torch::empty({rows}, f32), rstd = torch::empty({rows}, f32);
    const torch::Tensor w = weight.contiguous(), b = rms ? torch::Tensor() : bias.contiguous();
    NormForward(x2, y2, w, b, eps, sum, out, mean, rstd, rms);
    // An output nobody used brings no gradient (not a tensor of zeros to read and add).
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({has_y ? sum : x2, mean, rstd, w});
    ctx->saved_data["first"] = first;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["y_type"] = static_cast<int64_t>(has_y ? y.scalar_type() : torch::kFloat);
    ctx->saved_data["shape"] = x.sizes().vec();
    switch (static_cast<First>(first)) {
      case First::kSum:
        return {sum.view(x.sizes()), out.view(x.sizes())};
      case First::kInput:
        // An input returned as it is: autograd hands it on as a view whose gradient comes here.
        return {x, out.view(x.sizes())};
      case First::kNone:
        break;
    }
    return {out.view(x.sizes())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &s = saved[0], &mean = saved[1], &rstd = saved[2], &w = saved[3];
    const auto first = static_cast<First>(ctx->saved_data["first"].toInt());
    const bool has_y = first == First::kSum;
    const bool rms = ctx->saved_data["rms"].toBool();
    const auto y_type = static_cast<c10::ScalarType>(ctx->saved_data["y_type"].toInt());
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    const int64_t rows = s.size(0), d = s.size(1);
    const bool two_outputs = first != First::kNone;
    const torch::Tensor& dn = two_outputs ? grads[1] : grads[0];
    const torch::Tensor ds_extra = two_outputs && grads[0].defined()
                                       ? grads[0].reshape({-1, d}).to(torch::kFloat).contiguous()
                                       : torch::Tensor();
    const auto f32 = s.options();
    torch::Tensor ds, ds_cast, dgamma, dbeta;
    if (dn.defined()) {
      ds = torch::empty({rows, d}, f32);
      // A branch in dn's dtype (autocast's, bf16) takes its gradient rounded by the kernel.
      if (has_y && y_type != torch::kFloat && y_type == dn.scalar_type()) {
        ds_cast = torch::empty({rows, d}, f32.dtype(y_type));
      }
      int64_t blocks = 1;
#if TRAINYARD_CUDA_KERNELS
      if (s.is_cuda()) blocks = LayerNormBackwardBlocksCuda(rows, d, dn.scalar_type(), rms);
#endif
      const torch::Tensor dgamma_part = torch::empty({blocks, d}, f32);
      const torch::Tensor dbeta_part = rms ? torch::Tensor() : torch::empty({blocks, d}, f32);
      NormBackward(dn.reshape({-1, d}).contiguous(), s, mean, rstd, w, ds_extra, ds, ds_cast,
                   dgamma_part, dbeta_part, rms);
#if TRAINYARD_CUDA_KERNELS
      if (s.is_cuda()) {
        // (One launch for both sums: ATen's two reductions took 14 us a norm on an H200.)
        dgamma = torch::empty({d}, f32);
        if (!rms) dbeta = torch::empty({d}, f32);
        LayerNormSumPartialsCuda(dgamma_part, dbeta_part, dgamma, dbeta);
      }
#endif
      if (!dgamma.defined()) {
        dgamma = dgamma_part.sum(0);
        if (!rms) dbeta = dbeta_part.sum(0);
      }
    } else {
      ds = ds_extra.defined() ? ds_extra : torch::zeros({rows, d}, f32);
    }
    const torch::Tensor dx = ds.view(shape);
    torch::Tensor dy;
    if (has_y) {
      if (ds_cast.defined()) {
        dy = ds_cast.view(shape);
      } else {
        dy = y_type == torch::kFloat ? dx.clone() : dx.to(y_type);
      }
    }
    return {
        dx, dy, dgamma, dbeta, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The node's outputs for x (and y, a branch to add, or an empty tensor).
variable_list ApplyFused(const torch::Tensor& x, const torch::Tensor& y,
                         const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                         bool rms, First first) {
  const c10::ScalarType out_type = x.is_cuda()
                                       ? AutocastScope::ProductType(x)
                                       : static_cast<c10::ScalarType>(cpu_out_type_for_test.load());
  const torch::Tensor none = torch::empty({0}, x.options());
  return FusedLayerNorm::apply(x, y.defined() ? y : none, weight, rms ? none : bias, eps,
                               static_cast<int64_t>(out_type), rms, static_cast<int64_t>(first));
}

}  // namespace

bool HasLayerNormKernel(int64_t d) {
  return TRAINYARD_CUDA_KERNELS != 0 && d > 0 && d <= kMaxKernelWidth;
}

bool UsesFusedNorms(const torch::Tensor& x) {
  if (!x.defined() || x.dim() == 0 || x.scalar_type() != torch::kFloat) return false;
  if (x.is_cuda()) return HasLayerNormKernel(x.size(-1));
  return x.is_cpu() && cpu_for_test.load() > 0 && x.size(-1) > 0;
}

FusedNormsOnTheCpuForTest::FusedNormsOnTheCpuForTest(c10::ScalarType out_type) {
  cpu_out_type_for_test.store(static_cast<int>(out_type));
  cpu_for_test.fetch_add(1);
}
FusedNormsOnTheCpuForTest::~FusedNormsOnTheCpuForTest() {
  if (cpu_for_test.fetch_sub(1) == 1) cpu_out_type_for_test.store(static_cast<int>(torch::kFloat));
}

torch::Tensor LayerNormCast(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias, double eps) {
  if (UsesKernel(x, weight, bias)) {
    return ApplyFused(x, torch::Tensor(), weight, bias, eps, /*rms=*/false, First::kNone)[0];
  }
  return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps).to(AutocastScope::ProductType(x));
}

std::pair<torch::Tensor, torch::Tensor> LayerNormResidual(const torch::Tensor& x,
                                                          const torch::Tensor& weight,
                                                          const torch::Tensor& bias, double eps) {
  if (UsesKernel(x, weight, bias)) {
    const variable_list out =
        ApplyFused(x, torch::Tensor(), weight, bias, eps, /*rms=*/false, First::kInput);
    return {out[0], out[1]};
  }
  return {x, LayerNormCast(x, weight, bias, eps)};
}

std::pair<torch::Tensor, torch::Tensor> AddLayerNorm(const torch::Tensor& x, const torch::Tensor& y,
                                                     const torch::Tensor& weight,
                                                     const torch::Tensor& bias, double eps) {
  TORCH_CHECK(x.sizes() == y.sizes(), "AddLayerNorm: x and y must have one shape");
  if (UsesKernel(x, weight, bias) && BranchFits(x, y)) {
    const variable_list out = ApplyFused(x, y, weight, bias, eps, /*rms=*/false, First::kSum);
    return {out[0], out[1]};
  }
  const torch::Tensor h = x + y;
  return {h,
          torch::layer_norm(h, {h.size(-1)}, weight, bias, eps).to(AutocastScope::ProductType(x))};
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
  if (UsesKernel(x, weight, torch::Tensor(), /*rms=*/true)) {
    return ApplyFused(x, torch::Tensor(), weight, torch::Tensor(), eps, /*rms=*/true,
                      First::kNone)[0];
  }
  return RmsNormOf(x, weight, eps).to(AutocastScope::ProductType(x));
}

std::pair<torch::Tensor, torch::Tensor> RmsNormResidual(const torch::Tensor& x,
                                                        const torch::Tensor& weight, double eps) {
  if (UsesKernel(x, weight, torch::Tensor(), /*rms=*/true)) {
    const variable_list out =
        ApplyFused(x, torch::Tensor(), weight, torch::Tensor(), eps, /*rms=*/true, First::kInput);
    return {out[0], out[1]};
  }
  return {x, RmsNormCast(x, weight, eps)};
}

std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(const torch::Tensor& x, const torch::Tensor& y,
                                                   const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == y.sizes(), "AddRmsNorm: x and y must have one shape");
  if (UsesKernel(x, weight, torch::Tensor(), /*rms=*/true) && BranchFits(x, y)) {
    const variable_list out =
        ApplyFused(x, y, weight, torch::Tensor(), eps, /*rms=*/true, First::kSum);
    return {out[0], out[1]};
  }
  const torch::Tensor h = x + y;
  return {h, RmsNormOf(h, weight, eps).to(AutocastScope::ProductType(x))};
}

}  // namespace trainyard::trainer
