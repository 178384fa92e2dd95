// ApplyRotary (see rotary.h).
#include "worker/trainer/kernels/rotary.h"

namespace trainyard::trainer {
namespace {

#if TRAINYARD_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class FusedRotary : public torch::autograd::Function<FusedRotary> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    // x's strides where it is dense; a view of a wider product (the Llama layer's q and k of its
    // stacked q, k and v: SplitQkv) gets the [b, t, n, hd] order its product had.
    const torch::Tensor out =
        x.is_non_overlapping_and_dense()
            ? torch::empty_like(x)
            : torch::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options())
                  .transpose(1, 2);
    RotaryCuda(x, cos, sin, out, /*inverse=*/false);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    torch::Tensor dy = grad[0].to(dtype);
    if (dy.stride(-1) != 1 || !dy.is_non_overlapping_and_dense()) dy = dy.contiguous();
    torch::Tensor dx = torch::empty_like(dy);
    RotaryCuda(dy, saved[0], saved[1], dx, /*inverse=*/true);
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

bool UsesRotaryKernel(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
#if TRAINYARD_CUDA_KERNELS
  const c10::ScalarType t = x.scalar_type();
  if (!x.is_cuda() || x.dim() != 4 || x.numel() == 0 || x.size(3) % 2 != 0 || x.stride(3) != 1) {
    return false;
  }
  if (t != torch::kFloat && t != torch::kBFloat16 && t != torch::kHalf) return false;
  // (Any strides but the last's: the kernel takes each tensor's own.) cos and sin fp32 [t, hd].
  for (const torch::Tensor& c : {cos, sin}) {
    if (!c.is_cuda() || c.device() != x.device() || c.scalar_type() != torch::kFloat ||
        !c.is_contiguous() || c.dim() != 2 || c.size(0) != x.size(2) || c.size(1) != x.size(3)) {
      return false;
    }
  }
  return true;
#else
  (void)x, (void)cos, (void)sin;
  return false;
#endif
}

torch::Tensor ApplyRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin) {
#if TRAINYARD_CUDA_KERNELS
  if (UsesRotaryKernel(x, cos, sin)) return FusedRotary::apply(x, cos, sin);
#endif
  return x * cos + RotateHalf(x) * sin;
}

}  // namespace trainyard::trainer
