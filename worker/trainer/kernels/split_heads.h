// q, k and v of a fused qkv product, for the GPT block's attention. LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_SPLIT_HEADS_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_SPLIT_HEADS_H_

#include <torch/torch.h>

#include <array>

namespace trainyard::trainer {

// q, k and v of x = [b, t, 3 * heads * hd] (the qkv product: q's heads, then k's, then v's) as
// [b, heads, t, hd] views each (SDPA's layout), as x.view({b, t, 3, heads, hd}).permute({2, 0, 3,
// 1, 4}).unbind(0) (the same strides): SplitQkv(x, heads, heads). Its backward writes each
// gradient once into its place in one buffer of x's layout, where autograd's unbind stacks the
// three as [3, b, heads, t, hd] and the permute's backward copies that again into x's layout: one
// pass over the gradient instead of two (3.2 ms of a GPT-2-small step on an H200,
// bench/RESULTS.md).
std::array<torch::Tensor, 3> SplitHeads(const torch::Tensor& x, int64_t heads);

// q [b, heads, t, hd], k and v [b, kv_heads, t, hd] of x = [b, t, (heads + 2 kv_heads) hd] (one
// product of the Llama layer's three projections stacked: q's heads, then k's, then v's), as
// views. Its backward is one cat of the three gradients when they come in [b, t, n, hd] order (as
// a GPU's attention backward hands them), or else one copy of each into its slot of the gradient,
// where autograd's three narrows of x would each fill a zero tensor of x's size, copy their slice
// in, and add the three up.
std::array<torch::Tensor, 3> SplitQkv(const torch::Tensor& x, int64_t heads, int64_t kv_heads);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_SPLIT_HEADS_H_
