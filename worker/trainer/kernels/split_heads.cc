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

// q, k and v of x [b, t, (heads + 2 kv_heads) hd] as [b, n, t, hd] views; backward: one cat of
// the three gradients in [b, t, n, hd] order (each copied there first only if it is not so laid
// out already), where autograd's three narrows would each fill a zero tensor of x's size, copy
// their slice in, and add the three up.
class SplitQkvFunction : public torch::autograd::Function<SplitQkvFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, int64_t heads,
                               int64_t kv_heads) {
    ctx->set_materialize_grads(false);  // an unused output's gradient: zeros written here, once
    const int64_t b = x.size(0), t = x.size(1), hd = x.size(2) / (heads + 2 * kv_heads);
    ctx->saved_data["shape"] = x.sizes().vec();
    ctx->saved_data["widths"] = std::vector<int64_t>{heads * hd, kv_heads * hd, kv_heads * hd};
    auto part = [&](int64_t first, int64_t n) {
      return x.narrow(2, first * hd, n * hd).view({b, t, n, hd}).transpose(1, 2);
    };
    return {part(0, heads), part(heads, kv_heads), part(heads + kv_heads, kv_heads)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    const std::vector<int64_t> widths = ctx->saved_data["widths"].toIntVector();
    const torch::Tensor* like = nullptr;
    for (const torch::Tensor& g : grads) {
      if (g.defined()) like = &g;
    }
    if (like == nullptr) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const int64_t b = shape[0], t = shape[1];
    std::vector<torch::Tensor> parts;
    for (int i = 0; i < 3; ++i) {
      parts.push_back(grads[i].defined()
                          ? grads[i].to(like->scalar_type()).transpose(1, 2).reshape({b, t, -1})
                          : torch::zeros({b, t, widths[i]}, like->options()));
    }
    return {torch::cat(parts, 2), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

std::array<torch::Tensor, 3> SplitQkv(const torch::Tensor& x, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(x.dim() == 3 && heads > 0 && kv_heads > 0 && x.size(2) % (heads + 2 * kv_heads) == 0,
              "SplitQkv: x must be [b, t, (heads + 2 kv_heads) hd]");
  const variable_list qkv = SplitQkvFunction::apply(x, heads, kv_heads);
  return {qkv[0], qkv[1], qkv[2]};
}

std::array<torch::Tensor, 3> SplitHeads(const torch::Tensor& x, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && heads > 0 && x.size(2) % (3 * heads) == 0,
              "SplitHeads: x must be [b, t, 3 * heads * hd]");
  const variable_list qkv = SplitHeadsFunction::apply(x, heads);
  return {qkv[0], qkv[1], qkv[2]};
}

}  // namespace trainyard::trainer
