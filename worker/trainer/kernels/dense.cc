// GpuLinear (see dense.h).
#include "worker/trainer/kernels/dense.h"

#include <ATen/autocast_mode.h>

#include <atomic>
#include <vector>

#include "worker/trainer/runtime/device.h"

namespace trainyard::trainer {
namespace {

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_gemm_tuning{true};
// 0: no fused backward yet; 1: cuBLASLt; 2: the composition.
std::atomic<int> g_backward_path{0};
// GeluMlp's GELU, and its residual: 0 none yet; 1 in the epilogues; 2 the composition.
std::atomic<int> g_gelu_path{0};
std::atomic<int> g_residual_path{0};
std::atomic<int> g_linear_residual_path{0};  // GpuLinearResidual's

c10::optional<torch::Tensor> Optional(const torch::Tensor& t) {
  return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#if !TRAINYARD_CUDA_KERNELS
// (Without the CUDA build there is no cuBLASLt: the Function's weight gradient is the
// composition, which the CPU tests of its wiring run.)
bool WeightGradientCublasLt(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&) {
  return false;
}
bool GeluForwardCublasLt(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&) {
  return false;
}
bool GeluBackwardCublasLt(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&) {
  return false;
}
bool ResidualForwardCublasLt(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&) {
  return false;
}
bool LinearCublasLt(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return false;
}
bool DataGradientCublasLt(const at::Tensor&, const at::Tensor&, const at::Tensor&) { return false; }
#endif

// x [..., in] W^T (+ b) in x's dtype (x contiguous), w [out, in] and b [out] (or undefined) in it
// too: the tuned cuBLASLt product where TakesTunedProduct, else torch::linear's, whose own cuBLAS
// call takes the heuristic's first algorithm. The output is a tensor of its own, not a view (a
// Function's output that is a view refuses in-place operations).
torch::Tensor Product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  const torch::Tensor rows = x.view({-1, x.size(-1)});
  if (TakesTunedProduct(rows, w) && (!b.defined() || b.is_contiguous())) {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    torch::Tensor y = torch::empty(sizes, x.options());
    if (LinearCublasLt(rows, w, b, y.view({-1, w.size(0)}))) return y;
  }
  return torch::linear(x, w, b);
}

// dy [rows, out] w for w [out, in], both in one dtype: as Product, else torch::mm.
torch::Tensor InputGradient(const torch::Tensor& dy, const torch::Tensor& w) {
  if (TakesTunedProduct(dy, w)) {
    torch::Tensor dx = torch::empty({dy.size(0), w.size(1)}, dy.options());
    if (DataGradientCublasLt(dy, w, dx)) return dx;
  }
  return torch::mm(dy, w);
}

// The gradients of a product's weight (dy^T x, fp32) and, with `want_b`, of its bias (dy's column
// sums, fp32) for dy [rows, out] and x [rows, in] in one dtype, contiguous: one cuBLASLt GEMM on
// a GPU (the bias's in its epilogue), else ATen's product and sum. Records which in
// g_backward_path.
void WeightAndBiasGradients(const torch::Tensor& dy, const torch::Tensor& x, bool want_w,
                            bool want_b, torch::Tensor* dw, torch::Tensor* db) {
  if (want_w) {
    const auto f32 = dy.options().dtype(torch::kFloat);
    torch::Tensor w = torch::empty({dy.size(1), x.size(1)}, f32);
    torch::Tensor b = want_b ? torch::empty({dy.size(1)}, f32) : torch::Tensor();
    if (dy.is_cuda() && WeightGradientCublasLt(dy, x, w, b)) {
      g_backward_path.store(1, std::memory_order_relaxed);
      *dw = w;
      *db = b;
    } else {
      g_backward_path.store(2, std::memory_order_relaxed);
      *dw = torch::mm(dy.t(), x).to(torch::kFloat);
    }
  }
  // (A frozen weight with a trained bias, or no algorithm: the reduction eager runs.)
  if (want_b && !db->defined()) *db = dy.sum(0).to(torch::kFloat);
}

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
    return Product(xh, wh, bh);
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
      dx = InputGradient(dy, wh).view(xh.sizes()).to(x_dtype);
    }
    // (No bias: no edge at index 2 to ask about.)
    WeightAndBiasGradients(dy, xh.view({-1, in}), ctx->needs_input_grad(1),
                           has_bias && ctx->needs_input_grad(2), &dw, &db);
    return {dx, dw, db, torch::Tensor(), torch::Tensor()};
  }
};

// FusedDense without a bias and with the residual added to its product: residual + x W^T, the
// sum in the residual's dtype (fp32: one cuBLASLt product with the residual as its C where it
// applies). Edges: x 0, weight 1, weight_cast 2 (detached), residual 3.
class FusedDenseResidual : public torch::autograd::Function<FusedDenseResidual> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& weight_cast,
                               const torch::Tensor& residual, int64_t dtype_code) {
    const auto dtype = static_cast<c10::ScalarType>(dtype_code);
    TORCH_CHECK(weight_cast.scalar_type() == dtype && weight_cast.sizes() == weight.sizes(),
                "FusedDenseResidual: the weight's cast must be the weight in the product's dtype");
    const int64_t out = weight.size(0), in = weight.size(1);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out;
    TORCH_CHECK(residual.sizes() == c10::IntArrayRef(sizes),
                "FusedDenseResidual: the residual must have the output's shape");
    const torch::Tensor xh = x.to(dtype).contiguous();
    ctx->save_for_backward({xh, weight_cast});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["residual_dtype"] = static_cast<int64_t>(residual.scalar_type());
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    if (xh.is_cuda() && residual.scalar_type() == torch::kFloat && residual.is_contiguous()) {
      torch::Tensor y = torch::empty(sizes, residual.options());
      if (ResidualForwardCublasLt(xh.view({-1, in}), weight_cast, torch::Tensor(),
                                  residual.view({-1, out}), y.view({-1, out}))) {
        g_linear_residual_path.store(1, std::memory_order_relaxed);
        return y;
      }
    }
    g_linear_residual_path.store(2, std::memory_order_relaxed);
    return residual + torch::linear(xh, weight_cast);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& xh = saved[0];
    const torch::Tensor& wh = saved[1];
    const auto x_dtype = static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto r_dtype = static_cast<c10::ScalarType>(ctx->saved_data["residual_dtype"].toInt());
    const int64_t out = wh.size(0), in = wh.size(1);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const torch::Tensor dy = grad[0].to(xh.scalar_type()).contiguous().view({-1, out});
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = InputGradient(dy, wh).view(xh.sizes()).to(x_dtype);
    WeightAndBiasGradients(dy, xh.view({-1, in}), ctx->needs_input_grad(1), false, &dw, &db);
    const torch::Tensor dresidual =
        ctx->needs_input_grad(3) ? grad[0].to(r_dtype) : torch::Tensor();
    return {dx, dw, torch::Tensor(), dresidual, torch::Tensor()};
  }
};

torch::Tensor ApplyFusedDense(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, const torch::Tensor& weight_cast,
                              c10::ScalarType dtype) {
  return FusedDense::apply(x, weight, Optional(bias), weight_cast.detach(),
                           static_cast<int64_t>(dtype));
}

// GeluMlp's Function: [residual +] fc_out(gelu_tanh(fc(x))) with the GELU (and the residual) in
// the products' epilogues (see dense.h). As FusedDense: the weights' casts given (autocast's
// cached copies, detached), both biases required and the residual an optional after the casts
// (so that the edges are fixed: x 0, w1 1, b1 2, w2 3, b2 4, the casts, the residual 7 when
// given). Saved: x, the pre-activation and the activation in `dtype` (eager keeps the same three:
// the linear's input, GELU's input, the second linear's input), and the casts.
class GeluMlpFunction : public torch::autograd::Function<GeluMlpFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w1, const torch::Tensor& b1,
                               const torch::Tensor& w2, const torch::Tensor& b2,
                               const torch::Tensor& w1_cast, const torch::Tensor& w2_cast,
                               const c10::optional<torch::Tensor>& residual_arg,
                               int64_t dtype_code) {
    const auto dtype = static_cast<c10::ScalarType>(dtype_code);
    TORCH_CHECK(w1_cast.scalar_type() == dtype && w1_cast.sizes() == w1.sizes() &&
                    w2_cast.scalar_type() == dtype && w2_cast.sizes() == w2.sizes(),
                "GeluMlp: the weights' casts must be the weights in the products' dtype");
    const int64_t hidden = w1.size(0), out = w2.size(0);
    const torch::Tensor xh = x.to(dtype).contiguous().view({-1, x.size(-1)});
    const torch::Tensor b1h = b1.to(dtype);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    torch::Tensor pre, h;
    bool epilogue = false;
    if (xh.is_cuda()) {
      pre = torch::empty({xh.size(0), hidden}, xh.options());
      h = torch::empty_like(pre);
      epilogue = GeluForwardCublasLt(xh, w1_cast, b1h, h, pre);
    }
    if (!epilogue) {
      pre = torch::linear(xh, w1_cast, b1h);
      h = torch::gelu(pre, "tanh");
    }
    ctx->save_for_backward({xh, pre, h, w1_cast, w2_cast});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["epilogue"] = epilogue;
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out;
    const bool has_residual = residual_arg.has_value() && residual_arg->defined();
    ctx->saved_data["residual"] = has_residual;
    if (!has_residual) return Product(h, w2_cast, b2.to(dtype)).view(sizes);
    const torch::Tensor& residual = *residual_arg;
    TORCH_CHECK(residual.sizes() == c10::IntArrayRef(sizes),
                "GeluMlp: the residual must have the output's shape");
    ctx->saved_data["residual_dtype"] = static_cast<int64_t>(residual.scalar_type());
    // The fp32 residual stream added in the second product's epilogue, with the fp32 bias.
    if (epilogue && residual.scalar_type() == torch::kFloat && residual.is_contiguous() &&
        b2.is_contiguous()) {
      torch::Tensor y = torch::empty(sizes, residual.options());
      if (ResidualForwardCublasLt(h, w2_cast, b2, residual.view({-1, out}), y.view({-1, out}))) {
        g_residual_path.store(1, std::memory_order_relaxed);
        return y;
      }
    }
    g_residual_path.store(2, std::memory_order_relaxed);
    return residual + torch::linear(h, w2_cast, b2.to(dtype)).view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &xh = saved[0], &pre = saved[1], &h = saved[2], &w1h = saved[3],
                        &w2h = saved[4];
    const auto x_dtype = static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const torch::Tensor dy = grad[0].to(xh.scalar_type()).contiguous().view({-1, w2h.size(0)});
    torch::Tensor dx, dw1, db1, dw2, db2;
    WeightAndBiasGradients(dy, h, ctx->needs_input_grad(3), ctx->needs_input_grad(4), &dw2, &db2);
    // The hidden gradient with GELU's derivative applied: one product where the forward's
    // epilogue ran (and so on the GPU), else eager's product and gelu_backward.
    // (Nothing below the GELU to train and x without a gradient: no hidden gradient at all.)
    const bool below =
        ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
    torch::Tensor dpre;
    bool epilogue = false;
    if (below && ctx->saved_data["epilogue"].toBool()) {
      dpre = torch::empty_like(pre);
      epilogue = GeluBackwardCublasLt(dy, w2h, pre, dpre);
    }
    if (below && !epilogue) dpre = at::gelu_backward(torch::mm(dy, w2h), pre, "tanh");
    if (below) g_gelu_path.store(epilogue ? 1 : 2, std::memory_order_relaxed);
    if (below) {
      WeightAndBiasGradients(dpre, xh, ctx->needs_input_grad(1), ctx->needs_input_grad(2), &dw1,
                             &db1);
    }
    if (ctx->needs_input_grad(0)) {
      std::vector<int64_t> sizes = grad[0].sizes().vec();
      sizes.back() = w1h.size(1);
      dx = InputGradient(dpre, w1h).view(sizes).to(x_dtype);
    }
    // The residual's gradient is the output's (the stream's own, handed on).
    torch::Tensor dresidual;
    if (ctx->saved_data["residual"].toBool() && ctx->needs_input_grad(7)) {
      dresidual =
          grad[0].to(static_cast<c10::ScalarType>(ctx->saved_data["residual_dtype"].toInt()));
    }
    return {dx, dw1, db1, dw2, db2, torch::Tensor(), torch::Tensor(), dresidual, torch::Tensor()};
  }
};

}  // namespace

const char* KernelPathName(int path) {
  switch (path) {
    case 1:
      return "cublaslt";
    case 2:
      return "composition";
    default:
      return "none";
  }
}

void SetGpuLinearEnabled(bool enabled) { g_enabled.store(enabled); }

bool GpuLinearEnabled() { return g_enabled.load(); }

void SetGemmTuning(bool enabled) { g_gemm_tuning.store(enabled, std::memory_order_relaxed); }

bool GemmTuning() { return g_gemm_tuning.load(std::memory_order_relaxed); }

bool TakesTunedProduct(const torch::Tensor& x, const torch::Tensor& w) {
  return TRAINYARD_CUDA_KERNELS && x.is_cuda() && GemmTuning() && x.dim() == 2 && w.dim() == 2 &&
         (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf) &&
         w.scalar_type() == x.scalar_type() && x.size(0) > 0 && w.size(0) > 0 && w.size(1) > 0 &&
         w.size(0) % 8 == 0 && w.size(1) % 8 == 0 && x.is_contiguous() && w.is_contiguous();
}

#if !TRAINYARD_CUDA_KERNELS
GemmTuningStats GemmTuningStatsForTest() { return {}; }
#endif

const char* GpuLinearBackwardPath() {
  return KernelPathName(g_backward_path.load(std::memory_order_relaxed));
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

torch::Tensor GpuLinearResidual(const torch::Tensor& x, const torch::Tensor& weight,
                                const torch::Tensor& residual) {
  std::vector<int64_t> sizes = x.sizes().vec();
  if (!sizes.empty()) sizes.back() = weight.size(0);
  // (A residual that would broadcast: the composition's add.)
  if (UsesGpuLinear(x, weight, torch::Tensor()) && residual.defined() &&
      residual.device() == x.device() && residual.sizes() == c10::IntArrayRef(sizes)) {
    const c10::ScalarType dtype = AutocastScope::ProductType(x);
    return FusedDenseResidual::apply(
        x, weight, at::autocast::cached_cast(dtype, weight, c10::DeviceType::CUDA).detach(),
        residual, static_cast<int64_t>(dtype));
  }
  return residual + GpuLinear(x, weight, torch::Tensor());
}

const char* GpuLinearResidualPath() {
  return KernelPathName(g_linear_residual_path.load(std::memory_order_relaxed));
}

const char* GeluMlpPath() { return KernelPathName(g_gelu_path.load(std::memory_order_relaxed)); }

const char* GeluMlpResidualPath() {
  return KernelPathName(g_residual_path.load(std::memory_order_relaxed));
}

void ResetKernelPathsForTest() {
  for (std::atomic<int>* path :
       {&g_backward_path, &g_gelu_path, &g_residual_path, &g_linear_residual_path}) {
    path->store(0, std::memory_order_relaxed);
  }
}

bool UsesGeluEpilogue(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                      const torch::Tensor& w2, const torch::Tensor& b2, bool gelu_tanh) {
  if (!gelu_tanh || !b1.defined() || !b2.defined() || !UsesGpuLinear(x, w1, b1)) return false;
  // The second product, whose input is the hidden activation: GpuLinear's checks of its weight
  // and bias.
  // (cuBLASLt reads the weights as laid out: contiguous ones, as the modules' are.)
  const int64_t hidden = w1.size(0);
  return hidden % 8 == 0 && w1.is_contiguous() && w2.defined() && w2.is_contiguous() &&
         w2.device() == x.device() && w2.scalar_type() == torch::kFloat && w2.dim() == 2 &&
         w2.size(1) == hidden && w2.size(0) > 0 && b2.device() == x.device() &&
         b2.scalar_type() == torch::kFloat && b2.dim() == 1 && b2.size(0) == w2.size(0);
}

torch::Tensor GeluMlpThroughEpiloguesForTest(const torch::Tensor& x, const torch::Tensor& w1,
                                             const torch::Tensor& b1, const torch::Tensor& w2,
                                             const torch::Tensor& b2, c10::ScalarType dtype,
                                             const torch::Tensor& residual) {
  return GeluMlpFunction::apply(x, w1, b1, w2, b2, w1.to(dtype).detach(), w2.to(dtype).detach(),
                                Optional(residual), static_cast<int64_t>(dtype));
}

torch::Tensor GeluMlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                      const torch::Tensor& w2, const torch::Tensor& b2, bool gelu_tanh,
                      const torch::Tensor& residual) {
  if (UsesGeluEpilogue(x, w1, b1, w2, b2, gelu_tanh)) {
    const c10::ScalarType dtype = AutocastScope::ProductType(x);
    return GeluMlpFunction::apply(
        x, w1, b1, w2, b2, at::autocast::cached_cast(dtype, w1, c10::DeviceType::CUDA).detach(),
        at::autocast::cached_cast(dtype, w2, c10::DeviceType::CUDA).detach(), Optional(residual),
        static_cast<int64_t>(dtype));
  }
  const torch::Tensor y =
      GpuLinear(torch::gelu(GpuLinear(x, w1, b1), gelu_tanh ? "tanh" : "none"), w2, b2);
  return residual.defined() ? residual + y : y;
}

}  // namespace trainyard::trainer
