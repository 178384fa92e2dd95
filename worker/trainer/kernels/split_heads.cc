// SplitHeads and SplitQkv (see split_heads.h).
#include "worker/trainer/kernels/split_heads.h"

#include <vector>

namespace trainyard::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// q, k and v of x [b, t, (heads + 2 kv_heads) hd] as [b, n, t, hd] views: q's heads, then k's, then
// v's. With kv_heads == heads these are x.view({b, t, 3, heads, hd}).permute({2, 0, 3, 1,
// 4}).unbind(0), with the same strides.
class SplitQkvFunction : public torch::autograd::Function<SplitQkvFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, int64_t heads,
                               int64_t kv_heads) {
    ctx->set_materialize_grads(false);  // an unused output's gradient: zeros written here, once
    ctx->saved_data["shape"] = x.sizes().vec();
    ctx->saved_data["heads"] = std::vector<int64_t>{heads, kv_heads, kv_heads};
    const std::array<torch::Tensor, 3> parts = Parts(x, heads, kv_heads);
    return {parts[0], parts[1], parts[2]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    const std::vector<int64_t> heads = ctx->saved_data["heads"].toIntVector();
    const torch::Tensor* like = nullptr;
    for (const torch::Tensor& g : grads) {
      if (g.defined()) like = &g;
    }
    if (like == nullptr) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    // Attention's backward on a GPU (cuDNN's, flash's) hands dq, dk and dv in [b, t, n, hd]
    // order: then dx is their concatenation along the last axis, one cat (16 bytes a load) where
    // three copies into strided slots go a value at a time (1.14 ms of a GPT-2-small step on an
    // H200, bench/RESULTS.md).
    bool bshd = true;
    for (const torch::Tensor& g : grads) {
      bshd = bshd && g.defined() && g.scalar_type() == like->scalar_type() &&
             g.transpose(1, 2).is_contiguous();
    }
    const int64_t b = shape[0], t = shape[1];
    if (bshd) {
      std::vector<torch::Tensor> parts;
      for (const torch::Tensor& g : grads) parts.push_back(g.transpose(1, 2).view({b, t, -1}));
      return {torch::cat(parts, 2), torch::Tensor(), torch::Tensor()};
    }
    // Otherwise each gradient is written once into its slot of dx (an unused one's slot zeroed),
    // where autograd's views would each fill a zero tensor of x's size and add the three up.
    const torch::Tensor dx = torch::empty(shape, like->options());
    const std::array<torch::Tensor, 3> slots = Parts(dx, heads[0], heads[1]);
    for (int i = 0; i < 3; ++i) {
      if (grads[i].defined()) {
        slots[i].copy_(grads[i]);
      } else {
        slots[i].zero_();
      }
    }
    return {dx, torch::Tensor(), torch::Tensor()};
  }

 private:
  static std::array<torch::Tensor, 3> Parts(const torch::Tensor& x, int64_t heads,
                                            int64_t kv_heads) {
    const int64_t b = x.size(0), t = x.size(1), hd = x.size(2) / (heads + 2 * kv_heads);
    auto part = [&](int64_t first, int64_t n) {
      return x.narrow(2, first * hd, n * hd).view({b, t, n, hd}).transpose(1, 2);
    };
    return {part(0, heads), part(heads, kv_heads), part(heads + kv_heads, kv_heads)};
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
  return SplitQkv(x, heads, heads);
}

}  // namespace trainyard::trainer
