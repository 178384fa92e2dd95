// SwiGlu (see swiglu.h).
#include "worker/trainer/kernels/swiglu.h"

namespace trainyard::trainer {
namespace {

#if TRAINYARD_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class FusedSwiGlu : public torch::autograd::Function<FusedSwiGlu> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    const torch::Tensor g = gate.contiguous(), u = up.contiguous();
    torch::Tensor out = torch::empty_like(g);
    SwiGluForwardCuda(g, u, out);
    ctx->save_for_backward({g, u});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& g = saved[0];
    const torch::Tensor& u = saved[1];
    const torch::Tensor dout = grad[0].to(g.scalar_type()).contiguous();
    torch::Tensor dgate = torch::empty_like(g), dup = torch::empty_like(u);
    SwiGluBackwardCuda(dout, g, u, dgate, dup);
    return {dgate, dup};
  }
};
#endif

}  // namespace

bool UsesSwiGluKernel(const torch::Tensor& gate, const torch::Tensor& up) {
#if TRAINYARD_CUDA_KERNELS
  const c10::ScalarType t = gate.scalar_type();
  return gate.is_cuda() && up.is_cuda() && up.device() == gate.device() &&
         gate.sizes() == up.sizes() && up.scalar_type() == t &&
         (t == torch::kFloat || t == torch::kBFloat16 || t == torch::kHalf) && gate.numel() > 0;
#else
  (void)gate;
  (void)up;
  return false;
#endif
}

torch::Tensor SwiGlu(const torch::Tensor& gate, const torch::Tensor& up) {
#if TRAINYARD_CUDA_KERNELS
  if (UsesSwiGluKernel(gate, up)) return FusedSwiGlu::apply(gate, up);
#endif
  return torch::silu(gate) * up;
}

}  // namespace trainyard::trainer
