// SplitHeads (see split_heads.h).
#include "worker/trainer/kernels/split_heads.h"

#include <vector>

namespace trainyard::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// x [b, t, 3 * heads * hd] as x.view({b, t, 3, heads, hd}).permute({2, 0, 3, 1, 4}): [3, b, heads,
// t, hd], a view.
torch::Tensor HeadsView(const torch::Tensor& x, int64_t heads) {
  const int64_t b = x.size(0), t = x.size(1), hd = x.size(2) / (3 * heads);
  return x.view({b, t, 3, heads, hd}).permute({2, 0, 3, 1, 4});
}

class SplitHeadsFunction : public torch::autograd::Function<SplitHeadsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, int64_t heads) {
    ctx->set_materialize_grads(false);  // an unused head's gradient: zeros written here, once
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["shape"] = x.sizes().vec();
    const torch::Tensor v = HeadsView(x, heads);
    return {v.select(0, 0), v.select(0, 1), v.select(0, 2)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t heads = ctx->saved_data["heads"].toInt();
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    const torch::Tensor* like = nullptr;
    for (const torch::Tensor& g : grads) {
      if (g.defined()) like = &g;
    }
    if (like == nullptr) return {torch::Tensor(), torch::Tensor()};
    // Attention's backward on a GPU (cuDNN's, flash's) hands dq, dk and dv in [b, t, heads, hd]
    // order: then dx is their concatenation along a new axis after t, one cat (16 bytes a load)
    // where three copies into strided slots go a value at a time (1.14 ms of a GPT-2-small step on
    // an H200, bench/RESULTS.md).
    bool bshd = true;
    for (const torch::Tensor& g : grads) {
      bshd = bshd && g.defined() && g.scalar_type() == like->scalar_type() &&
             g.transpose(1, 2).is_contiguous();
    }
    if (bshd) {
      const int64_t b = shape[0], t = shape[1];
      std::vector<torch::Tensor> parts;
      for (const torch::Tensor& g : grads) parts.push_back(g.transpose(1, 2).view({b, t, 1, -1}));
      return {torch::cat(parts, 2).view(shape), torch::Tensor()};
    }
    const torch::Tensor dx = torch::empty(shape, like->options());
    const torch::Tensor slots = HeadsView(dx, heads);
    for (int i = 0; i < 3; ++i) {
      if (grads[i].defined()) {
        slots.select(0, i).copy_(grads[i]);
      } else {
        slots.select(0, i).zero_();
      }
    }
    return {dx, torch::Tensor()};
  }
};

}  // namespace

std::array<torch::Tensor, 3> SplitHeads(const torch::Tensor& x, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && heads > 0 && x.size(2) % (3 * heads) == 0,
              "SplitHeads: x must be [b, t, 3 * heads * hd]");
  const variable_list qkv = SplitHeadsFunction::apply(x, heads);
  return {qkv[0], qkv[1], qkv[2]};
}

}  // namespace trainyard::trainer
