// FusedLinearCrossEntropySum and CrossEntropyRows (see fused_loss.h).
#include "worker/trainer/kernels/fused_loss.h"

#include <algorithm>
#include <atomic>

#include "worker/trainer/kernels/dense.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// FusedLinearCrossEntropyWeightPath's answer: 0 none yet, 1 cublaslt, 2 composition.
std::atomic<int> weight_path{0};

// gw (fp32) = (first chunk) or += (the others) dlogits^T xs: on a GPU in one cuBLASLt product with
// fp32 output (beta 1 after the first chunk) where it applies; otherwise a product in the
// operands' dtype, then a copy or an fp32 add (an unvectorised mixed-dtype pass over the whole
// head's gradient a chunk: 8 ms of a Llama 3.2 1B step on an H200, bench/RESULTS.md).
void AddWeightGradient(const torch::Tensor& dlogits, const torch::Tensor& xs,
                       const torch::Tensor& gw, bool first) {
#if TRAINYARD_CUDA_KERNELS
  if (dlogits.is_cuda() && WeightGradientCublasLt(dlogits, xs, gw, {}, /*add=*/!first)) {
    weight_path = 1;
    return;
  }
#endif
  weight_path = 2;
  const torch::Tensor product = torch::mm(dlogits.t(), xs);
  if (first) {
    gw.copy_(product);
  } else {
    gw.add_(product);
  }
}

// A chunk's logits, xs wc^T, and its input gradient, dlogits wc into `out`: the tuned cuBLASLt
// products on a GPU while the tuning is on (dense.h's SetGemmTuning), else ATen's.
torch::Tensor ChunkLogits(const torch::Tensor& xs, const torch::Tensor& wc) {
#if TRAINYARD_CUDA_KERNELS
  if (TakesTunedProduct(xs, wc)) {
    torch::Tensor logits = torch::empty({xs.size(0), wc.size(0)}, xs.options());
    if (LinearCublasLt(xs, wc, torch::Tensor(), logits)) return logits;
  }
#endif
  return torch::mm(xs, wc.t());
}
void ChunkInputGradient(const torch::Tensor& dlogits, const torch::Tensor& wc, torch::Tensor out) {
#if TRAINYARD_CUDA_KERNELS
  if (TakesTunedProduct(dlogits, wc) && out.is_contiguous() &&
      DataGradientCublasLt(dlogits, wc, out)) {
    return;
  }
#endif
  torch::mm_out(out, dlogits, wc);
}

constexpr int64_t kDefaultChunkBytes = int64_t{256} << 20;
std::atomic<int64_t> chunk_bytes{kDefaultChunkBytes};

int64_t ChunkRows(int64_t rows, int64_t vocab, int64_t element_bytes, int64_t asked) {
  if (asked > 0) return std::min(asked, std::max<int64_t>(rows, 1));
  return std::clamp<int64_t>(chunk_bytes.load() / std::max<int64_t>(1, vocab * element_bytes), 1,
                             std::max<int64_t>(rows, 1));
}

// t (a gradient for a loss gradient of 1, the node's own: scaled in place when its dtype is
// `dtype`) in `dtype`, times the loss's actual gradient g (a 0-dim tensor). On a GPU by a
// multi-tensor kernel that reads g from the device: the broadcast of a 0-dim CUDA tensor takes
// ATen's unvectorised kernel (0.85 ms over a Llama 3.2 1B head's gradient on an H200,
// bench/RESULTS.md).
torch::Tensor Scaled(const torch::Tensor& t, c10::ScalarType dtype, const torch::Tensor& g) {
#if TRAINYARD_TORCH2 && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 1)
  if (t.is_cuda() && g.is_cuda() && g.dim() == 0 && g.scalar_type() == torch::kFloat &&
      dtype == torch::kFloat) {
    torch::Tensor out = t.to(dtype);
    at::_foreach_mul_(torch::TensorList{out}, g);
    return out;
  }
#endif
  return t.to(dtype) * g;
}

// Forward computes the loss and, when asked, both gradients (for a loss gradient of 1); backward
// scales them by the loss's actual gradient. `weights` is empty (not undefined: autograd's
// functions take defined tensors) when every row counts once.
class FusedLinearCrossEntropy : public torch::autograd::Function<FusedLinearCrossEntropy> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& targets,
                               const torch::Tensor& weights, int64_t chunk_rows, bool grad_x,
                               bool grad_weight) {
    const c10::ScalarType type = AutocastScope::ProductType(x);
    const torch::Tensor xc = x.to(type).contiguous();
    const torch::Tensor wc = weight.to(type).contiguous();
    const int64_t rows = xc.size(0), vocab = wc.size(0);
    const torch::Tensor loss = torch::empty({rows}, x.options().dtype(torch::kFloat));
    torch::Tensor gx, gw;
    if (grad_x) gx = torch::empty_like(xc);
    if (grad_weight) gw = torch::empty(wc.sizes(), weight.options().dtype(torch::kFloat));
    const int64_t chunk = ChunkRows(rows, vocab, xc.element_size(), chunk_rows);
    for (int64_t r = 0; r < rows; r += chunk) {
      const int64_t n = std::min(chunk, rows - r);
      const torch::Tensor xs = xc.narrow(0, r, n);
      torch::Tensor logits = ChunkLogits(xs, wc);
      CrossEntropyRows(logits, targets.narrow(0, r, n),
                       weights.numel() > 0 ? weights.narrow(0, r, n) : torch::Tensor(),
                       loss.narrow(0, r, n), grad_x || grad_weight);
      // `logits` now holds the chunk's gradient of the loss.
      if (grad_x) ChunkInputGradient(logits, wc, gx.narrow(0, r, n));
      if (grad_weight) AddWeightGradient(logits, xs, gw, r == 0);
    }
    if (grad_weight && rows == 0) gw.zero_();  // (no chunk wrote it)
    ctx->saved_data["grad_x"] = gx;
    ctx->saved_data["grad_weight"] = gw;
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["weight_type"] = static_cast<int64_t>(weight.scalar_type());
    return loss.sum();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const torch::Tensor& g = grad_outputs[0];
    // (Scaled in place: a second backward through the node would scale them again.)
    TORCH_CHECK(!ctx->saved_data.count("used"),
                "FusedLinearCrossEntropy: backward runs once (no retain_graph)");
    ctx->saved_data["used"] = true;
    // Taken out of the node, so that the returned gradients are the only references to them:
    // AccumulateGrad then keeps them as the parameters' gradients instead of copying them (1 GB
    // for a Llama 3.2 1B head).
    const torch::Tensor gx = ctx->saved_data["grad_x"].toTensor();
    const torch::Tensor gw = ctx->saved_data["grad_weight"].toTensor();
    ctx->saved_data["grad_x"] = torch::Tensor();
    ctx->saved_data["grad_weight"] = torch::Tensor();
    const auto x_type = static_cast<c10::ScalarType>(ctx->saved_data["x_type"].toInt());
    const auto w_type = static_cast<c10::ScalarType>(ctx->saved_data["weight_type"].toInt());
    return {gx.defined() ? Scaled(gx, x_type, g) : torch::Tensor(),
            gw.defined() ? Scaled(gw, w_type, g) : torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

bool HasCrossEntropyKernel() { return TRAINYARD_CUDA_KERNELS != 0; }

void SetFusedLossChunkBytes(int64_t bytes) { chunk_bytes = bytes > 0 ? bytes : kDefaultChunkBytes; }

const char* FusedLinearCrossEntropyWeightPath() { return KernelPathName(weight_path.load()); }

void CrossEntropyRows(const torch::Tensor& logits, const torch::Tensor& targets,
                      const torch::Tensor& weights, const torch::Tensor& loss, bool write_grad) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0) &&
                  loss.size(0) == logits.size(0) && loss.scalar_type() == torch::kFloat,
              "CrossEntropyRows: logits [rows, vocab], targets and loss [rows] (loss fp32)");
  TORCH_CHECK(
      !weights.defined() || (weights.dim() == 1 && weights.size(0) == logits.size(0) &&
                             weights.scalar_type() == torch::kFloat && weights.is_contiguous()),
      "CrossEntropyRows: weights must be [rows] contiguous fp32");
  torch::NoGradGuard no_grad;
#if TRAINYARD_CUDA_KERNELS
  if (logits.is_cuda()) {
    TORCH_CHECK(
        targets.scalar_type() == torch::kLong && targets.is_contiguous() && loss.is_contiguous(),
        "CrossEntropyRows: targets must be contiguous int64, loss contiguous");
    CrossEntropyRowsCuda(logits, targets, weights, loss, write_grad);
    return;
  }
#endif
  const torch::Tensor f =
      logits.scalar_type() == torch::kDouble ? logits : logits.to(torch::kFloat);
  const torch::Tensor lse = f.logsumexp(1);
  const torch::Tensor index = targets.to(torch::kLong).unsqueeze(1);
  torch::Tensor row_loss = lse - f.gather(1, index).squeeze(1);
  if (weights.defined()) row_loss = row_loss * weights;
  // (The losses first: the gradient may overwrite the logits they read.)
  loss.copy_(row_loss);
  if (!write_grad) return;
  torch::Tensor grad = (f - lse.unsqueeze(1)).exp_();
  grad.scatter_add_(1, index, torch::full({f.size(0), 1}, -1.0, f.options()));
  if (weights.defined()) grad.mul_(weights.unsqueeze(1).to(f.scalar_type()));
  logits.copy_(grad);
}

torch::Tensor FusedLinearCrossEntropySum(const torch::Tensor& x, const torch::Tensor& weight,
                                         const torch::Tensor& targets, const torch::Tensor& weights,
                                         int64_t chunk_rows) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "FusedLinearCrossEntropySum: x [rows, d] and weight [vocab, d]");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == x.size(0),
              "FusedLinearCrossEntropySum: targets must be [rows]");
  const bool grad = torch::GradMode::is_enabled();
  const torch::Tensor w = weights.defined() ? weights.to(torch::kFloat).contiguous()
                                            : torch::empty({0}, x.options().dtype(torch::kFloat));
  return FusedLinearCrossEntropy::apply(x, weight, targets.to(torch::kLong).contiguous(), w,
                                        chunk_rows, grad && x.requires_grad(),
                                        grad && weight.requires_grad());
}

}  // namespace trainyard::trainer
