// GpuLinear (see dense.h).
#include "worker/trainer/kernels/dense.h"

#include <ATen/autocast_mode.h>

#include <atomic>

#include "worker/trainer/runtime/device.h"

namespace trainyard::trainer {
namespace {

std::atomic<bool> g_enabled{true};
// 0: no fused backward yet; 1: cuBLASLt; 2: the composition.
std::atomic<int> g_backward_path{0};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#if !TRAINYARD_CUDA_KERNELS
// (Without the CUDA build there is no cuBLASLt: the Function's weight gradient is the
// composition, which the CPU tests of its wiring run.)
bool WeightGradientCublasLt(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&) {
  return false;
}
#endif

// Forward as autocast's linear: x and the bias cast to `dtype`, the weight's cast given
// (`weight_cast`: autocast's cached copy on a GPU, detached, so one copy serves every micro-batch
// of a scope, as eager's, and a pipeline keeps one per weight, not one per micro-batch in flight;
// the gradient reaches `weight` through this Function alone), one product (cuBLAS's bias epilogue
// on a GPU). The bias is an optional: apply() takes an undefined tensor for a variable and fails
// on it. (Edges: x 0, weight 1, bias 2 when given, weight_cast after it.)
class FusedDense : public torch::autograd::Function<FusedDense> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight,
                               const c10::optional<torch::Tensor>& bias,
                               const torch::Tensor& weight_cast, int64_t dtype_code) {
    const auto dtype = static_cast<c10::ScalarType>(dtype_code);
    TORCH_CHECK(weight_cast.scalar_type() == dtype && weight_cast.sizes() == weight.sizes(),
                "FusedDense: the weight's cast must be the weight in the product's dtype");
    const torch::Tensor xh = x.to(dtype).contiguous(), wh = weight_cast;
    const bool has_bias = bias.has_value() && bias->defined();
    const torch::Tensor bh = has_bias ? bias->to(dtype) : torch::Tensor();
    ctx->save_for_backward({xh, wh});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["bias"] = has_bias;
    // Below autocast: the operands are in its dtype already.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return torch::linear(xh, wh, bh);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& xh = saved[0];
    const torch::Tensor& wh = saved[1];
    const auto x_dtype = static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const bool has_bias = ctx->saved_data["bias"].toBool();
    const int64_t out = wh.size(0), in = wh.size(1);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const torch::Tensor dy = grad[0].to(xh.scalar_type()).contiguous().view({-1, out});
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      // dy W in autocast's dtype, then x's own (autocast's cast backward).
      dx = torch::mm(dy, wh).view(xh.sizes()).to(x_dtype);
    }
    // (No bias: no edge at index 2 to ask about.)
    const bool want_w = ctx->needs_input_grad(1), want_b = has_bias && ctx->needs_input_grad(2);
    if (want_w) {
      const torch::Tensor x2 = xh.view({-1, in});
      const auto f32 = dy.options().dtype(torch::kFloat);
      torch::Tensor w = torch::empty({out, in}, f32);
      torch::Tensor b = want_b ? torch::empty({out}, f32) : torch::Tensor();
      if (dy.is_cuda() && WeightGradientCublasLt(dy, x2, w, b)) {
        g_backward_path.store(1, std::memory_order_relaxed);
        dw = w;
        db = b;
      } else {
        g_backward_path.store(2, std::memory_order_relaxed);
        dw = torch::mm(dy.t(), x2).to(torch::kFloat);
      }
    }
    // (A frozen weight with a trained bias, or no algorithm: the reduction eager runs.)
    if (want_b && !db.defined()) db = dy.sum(0).to(torch::kFloat);
    return {dx, dw, db, torch::Tensor(), torch::Tensor()};
  }
};

torch::Tensor ApplyFusedDense(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, const torch::Tensor& weight_cast,
                              c10::ScalarType dtype) {
  return FusedDense::apply(x, weight,
                           bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt,
                           weight_cast.detach(), static_cast<int64_t>(dtype));
}

}  // namespace

void SetGpuLinearEnabled(bool enabled) { g_enabled.store(enabled); }

bool GpuLinearEnabled() { return g_enabled.load(); }

const char* GpuLinearBackwardPath() {
  switch (g_backward_path.load(std::memory_order_relaxed)) {
    case 1:
      return "cublaslt";
    case 2:
      return "composition";
    default:
      return "none";
  }
}

bool UsesGpuLinear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
#if TRAINYARD_CUDA_KERNELS
  if (!GpuLinearEnabled() || !x.defined() || !x.is_cuda() || x.dim() < 1 || x.numel() == 0) {
    return false;
  }
  // Autocast on in bf16 or fp16; training (under no_grad autocast's cached casts serve better).
  if (AutocastScope::ActivePrecision() == Precision::kFp32 || !torch::GradMode::is_enabled()) {
    return false;
  }
  const c10::ScalarType dtype = AutocastScope::ProductType(x);
  if (dtype != torch::kBFloat16 && dtype != torch::kHalf) return false;
  if (x.scalar_type() != torch::kFloat && x.scalar_type() != dtype) return false;
  if (!weight.defined() || !weight.is_cuda() || weight.device() != x.device() ||
      weight.scalar_type() != torch::kFloat || weight.dim() != 2 || weight.size(1) != x.size(-1) ||
      weight.size(0) == 0) {
    return false;
  }
  if (bias.defined() &&
      (!bias.is_cuda() || bias.device() != x.device() || bias.scalar_type() != torch::kFloat ||
       bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    return false;
  }
  return true;
#else
  (void)x, (void)weight, (void)bias;
  return false;
#endif
}

torch::Tensor LinearThroughOneProductForTest(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias, c10::ScalarType dtype) {
  return ApplyFusedDense(x, weight, bias, weight.to(dtype), dtype);
}

torch::Tensor GpuLinear(const torch::Tensor& x, const torch::Tensor& weight,
                        const torch::Tensor& bias) {
  if (UsesGpuLinear(x, weight, bias)) {
    const c10::ScalarType dtype = AutocastScope::ProductType(x);
    // (autocast's cache: a leaf weight is cast once per scope, as eager's linear casts it.)
    return ApplyFusedDense(x, weight, bias,
                           at::autocast::cached_cast(dtype, weight, c10::DeviceType::CUDA), dtype);
  }
  return torch::linear(x, weight, bias);
}

}  // namespace trainyard::trainer
