// The model's matmuls on oneDNN (see onednn_matmul.h).
#include "worker/trainer/kernels/onednn_matmul.h"

#include <ATen/autocast_mode.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace trainyard::trainer {
namespace {

using dnnl::memory;

// C[i] = alpha A[i] B[i] (+ bias) (+ C[i] when accumulate) for i < batch: A [batch, m, k] and
// B [batch, k, n] given by their strides, C [batch, m, n] dense, bias [n].
struct GemmShape {
  int64_t batch, m, k, n;
  std::array<int64_t, 3> a_strides, b_strides;
  bool bias = false;
  float alpha = 1;
  bool accumulate = false;
};

class OneDnn {
 public:
  static OneDnn& Get() {
    static OneDnn* instance = new OneDnn();  // never destroyed: ranks may exit from any thread
    return *instance;
  }

  // False (nothing written) when oneDNN has only its reference loops for the shape.
  bool Gemm(const GemmShape& s, const float* a, const float* b, const float* bias, float* c) {
    const Cached* cached = Lookup(s);
    if (cached == nullptr) return false;
    const Descs& d = cached->descs;
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(d.a, engine_, const_cast<float*>(a))},
        {DNNL_ARG_WEIGHTS, memory(d.b, engine_, const_cast<float*>(b))},
        {DNNL_ARG_DST, memory(d.c, engine_, c)}};
    if (s.bias) args.emplace(DNNL_ARG_BIAS, memory(d.bias, engine_, const_cast<float*>(bias)));
    thread_local dnnl::stream stream(engine_);  // in-order, for this thread's calls
    cached->primitive.execute(stream, args);
    stream.wait();
    return true;
  }

  // The implementation oneDNN picks for a shape, e.g. "brg:avx512_core".
  std::string Implementation(const GemmShape& s) {
    return PrimitiveDesc(s, DescsOf(s)).impl_info_str();
  }

 private:
  OneDnn() : engine_(dnnl::engine::kind::cpu, 0) {}

  struct Descs {
    memory::desc a, b, c, bias;
  };

  static Descs DescsOf(const GemmShape& s) {
    const auto f32 = memory::data_type::f32;
    return {
        memory::desc({s.batch, s.m, s.k}, f32, {s.a_strides[0], s.a_strides[1], s.a_strides[2]}),
        memory::desc({s.batch, s.k, s.n}, f32, {s.b_strides[0], s.b_strides[1], s.b_strides[2]}),
        memory::desc({s.batch, s.m, s.n}, f32, {s.m * s.n, s.n, 1}),
        memory::desc({1, 1, s.n}, f32, {s.n, s.n, 1})};
  }

  // A shape's primitive and the memory descriptors its calls use.
  struct Cached {
    dnnl::matmul primitive;
    Descs descs;
  };

  dnnl::matmul::primitive_desc PrimitiveDesc(const GemmShape& s, const Descs& d) {
    dnnl::primitive_attr attr;
    if (s.alpha != 1) attr.set_output_scales(0, {s.alpha});
    if (s.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    return s.bias ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(d.a, d.b, d.bias, d.c), attr,
                                                 engine_)
                  : dnnl::matmul::primitive_desc(dnnl::matmul::desc(d.a, d.b, d.c), attr, engine_);
  }

  using Key = std::array<int64_t, 14>;

  static Key KeyOf(const GemmShape& s) {
    int32_t alpha_bits;
    std::memcpy(&alpha_bits, &s.alpha, sizeof alpha_bits);
    return {s.batch,
            s.m,
            s.k,
            s.n,
            s.a_strides[0],
            s.a_strides[1],
            s.a_strides[2],
            s.b_strides[0],
            s.b_strides[1],
            s.b_strides[2],
            s.bias,
            alpha_bits,
            s.accumulate,
            at::get_num_threads()};
  }

  // The cached primitive for a shape, or nullptr when oneDNN would run its reference loops.
  const Cached* Lookup(const GemmShape& s) {
    const Key key = KeyOf(s);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      Descs d = DescsOf(s);
      dnnl::matmul::primitive_desc pd = PrimitiveDesc(s, d);
      const bool reference = std::string(pd.impl_info_str()).rfind("ref", 0) == 0;
      it = cache_
               .emplace(key, reference ? std::nullopt
                                       : std::optional<Cached>(Cached{dnnl::matmul(pd), d}))
               .first;
    }
    return it->second.has_value() ? &*it->second : nullptr;
  }

  dnnl::engine engine_;
  std::mutex mu_;
  std::map<Key, std::optional<Cached>> cache_;  // node-based: pointers stay valid
};

// The GemmShape of out = alpha a b (+ bias) (+ out): a [batch, m, k], b [batch, k, n] of any
// strides (2-D tensors: a batch of one).
GemmShape ShapeOf(const torch::Tensor& a, const torch::Tensor& b, bool bias, float alpha,
                  bool accumulate) {
  // A batch of one: its batch stride means nothing; the element count keeps oneDNN's checks happy.
  const int64_t i = a.dim() - 2;  // the first matrix dimension: 1 batched, 0 not
  const int64_t m = a.size(i), k = a.size(i + 1), n = b.size(i + 1);
  return {i == 1 ? a.size(0) : 1,
          m,
          k,
          n,
          {i == 1 ? a.stride(0) : m * k, a.stride(i), a.stride(i + 1)},
          {i == 1 ? b.stride(0) : k * n, b.stride(i), b.stride(i + 1)},
          bias,
          alpha,
          accumulate};
}

// out[i] = alpha a[i] b[i] (+ bias) (+ out[i] when accumulate): a [batch, m, k], b [batch, k, n]
// fp32 of any strides, out dense [batch, m, n] (2-D tensors: batch 1). oneDNN when it has a JIT
// kernel for the shape, LibTorch otherwise.
void Gemm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias, float alpha,
          bool accumulate, torch::Tensor& out) {
  if (OneDnn::Get().Gemm(ShapeOf(a, b, bias.defined(), alpha, accumulate), a.data_ptr<float>(),
                         b.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
                         out.data_ptr<float>())) {
    return;
  }
  torch::Tensor product = torch::matmul(a, b);
  if (alpha != 1) product.mul_(alpha);
  if (bias.defined()) product.add_(bias);
  if (accumulate) {
    out.add_(product);
  } else {
    out.copy_(product);
  }
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight,
                               const c10::optional<torch::Tensor>& maybe_bias) {
    // optional: apply() takes an undefined Tensor argument for a variable and fails.
    const torch::Tensor bias = maybe_bias.value_or(torch::Tensor());
    const int64_t in = weight.size(1), out = weight.size(0);
    const torch::Tensor x2 = x.reshape({-1, in}).contiguous();
    const torch::Tensor w = weight.contiguous();
    torch::Tensor y = torch::empty({x2.size(0), out}, x.options());
    // W^T: [in, out], strides (1, in)
    Gemm(x2, w.t(), bias.defined() ? bias.contiguous() : bias, 1, false, y);
    ctx->save_for_backward({x2, w});
    ctx->saved_data["bias"] = bias.defined();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return y.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x2 = saved[0];
    const torch::Tensor& w = saved[1];
    const int64_t in = w.size(1), out = w.size(0);
    const torch::Tensor dy = grad_outputs[0].reshape({-1, out}).contiguous();
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      dx = torch::empty({dy.size(0), in}, dy.options());
      Gemm(dy, w, torch::Tensor(), 1, false, dx);  // [m, out] [out, in]
      dx = dx.view(ctx->saved_data["x_sizes"].toIntVector());
    }
    if (ctx->needs_input_grad(1)) {
      dw = torch::empty({out, in}, dy.options());
      Gemm(dy.t(), x2, torch::Tensor(), 1, false, dw);  // [out, m] [m, in]
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) db = dy.sum(0);
    return {dx, dw, db};
  }
};

// alpha a b (+ addend): a [batch, m, k], b [batch, k, n], addend [m, n] (a constant: no gradient).
class BatchedMatmulFunction : public torch::autograd::Function<BatchedMatmulFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& a,
                               const torch::Tensor& b, double alpha,
                               const c10::optional<torch::Tensor>& addend) {
    torch::Tensor c;
    if (addend.has_value()) {
      c = addend->expand({a.size(0), a.size(1), b.size(2)}).contiguous();
    } else {
      c = torch::empty({a.size(0), a.size(1), b.size(2)}, a.options());
    }
    Gemm(a, b, torch::Tensor(), static_cast<float>(alpha), addend.has_value(), c);
    ctx->save_for_backward({a, b});
    ctx->saved_data["alpha"] = alpha;
    return c;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &a = saved[0], &b = saved[1];
    const float alpha = static_cast<float>(ctx->saved_data["alpha"].toDouble());
    const torch::Tensor dc = grad_outputs[0].contiguous();
    torch::Tensor da, db;
    if (ctx->needs_input_grad(0)) {
      da = torch::empty(a.sizes(), dc.options());
      Gemm(dc, b.transpose(1, 2), torch::Tensor(), alpha, false, da);  // [m, n] [n, k]
    }
    if (ctx->needs_input_grad(1)) {
      db = torch::empty(b.sizes(), dc.options());
      Gemm(a.transpose(1, 2), dc, torch::Tensor(), alpha, false, db);  // [k, m] [m, n]
    }
    return {da, db, torch::Tensor(), torch::Tensor()};
  }
};

// Whether these tensors take the oneDNN path (fp32 on the CPU, autocast off, enabled).
bool OneDnnApplies(std::initializer_list<torch::Tensor> tensors) {
  if (!OneDnnMatmulsEnabled() || at::autocast::is_cpu_enabled()) return false;
  for (const torch::Tensor& t : tensors) {
    if (t.defined() && (t.scalar_type() != torch::kFloat || !t.device().is_cpu())) return false;
  }
  return true;
}

std::string Implementations(const std::vector<GemmShape>& shapes) {
  std::string out;
  for (const GemmShape& s : shapes) {
    absl::StrAppend(&out, out.empty() ? "" : " ", OneDnn::Get().Implementation(s));
  }
  return out;
}

constexpr int kUnset = -1;
std::atomic<int> g_path{kUnset};  // a MatmulPath once read or set

MatmulPath InitialPath() {
  absl::StatusOr<std::optional<MatmulPath>> pinned = MatmulPathFromEnvironment();
  return pinned.ok() && pinned->has_value() ? **pinned : MatmulPath::kOneDnn;
}

std::string IsaName(dnnl::cpu_isa isa) {
  static const std::map<dnnl::cpu_isa, std::string> kNames = {
      {dnnl::cpu_isa::sse41, "sse41"},
      {dnnl::cpu_isa::avx, "avx"},
      {dnnl::cpu_isa::avx2, "avx2"},
      {dnnl::cpu_isa::avx2_vnni, "avx2_vnni"},
      {dnnl::cpu_isa::avx512_core, "avx512_core"},
      {dnnl::cpu_isa::avx512_core_vnni, "avx512_core_vnni"},
      {dnnl::cpu_isa::avx512_core_bf16, "avx512_core_bf16"},
      {dnnl::cpu_isa::avx512_core_amx, "avx512_core_amx"}};
  auto it = kNames.find(isa);
  return it != kNames.end() ? it->second : absl::StrCat("isa ", static_cast<int>(isa));
}

}  // namespace

absl::StatusOr<std::optional<MatmulPath>> MatmulPathFromEnvironment() {
  const char* env = std::getenv("TRAINYARD_MATMUL");
  const std::string value = env == nullptr ? "" : env;
  if (value.empty() || value == "auto") return std::nullopt;
  if (value == "onednn") return MatmulPath::kOneDnn;
  if (value == "blas") return MatmulPath::kBlas;
  return absl::InvalidArgumentError(absl::StrCat("TRAINYARD_MATMUL: \"",
                                                 absl::CHexEscape(value.substr(0, 64)),
                                                 "\" is none of auto, onednn, blas"));
}

void SetMatmulPath(MatmulPath path) { g_path.store(static_cast<int>(path)); }

bool OneDnnMatmulsAvailable() { return true; }

bool OneDnnMatmulsEnabled() {
  int path = g_path.load(std::memory_order_relaxed);
  if (path == kUnset) {
    int initial = static_cast<int>(InitialPath());
    // The first reader's value wins (a SetMatmulPath in between keeps its own).
    g_path.compare_exchange_strong(path, initial);
    path = g_path.load();
  }
  return path == static_cast<int>(MatmulPath::kOneDnn);
}

torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias) {
  if (!OneDnnApplies({x, weight, bias}) || x.dim() < 1 || x.numel() == 0 || weight.dim() != 2 ||
      x.size(-1) != weight.size(1)) {
    return torch::linear(x, weight, bias);  // also gives torch's errors for wrong shapes
  }
  return LinearFunction::apply(x, weight,
                               bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt);
}

torch::Tensor BatchedMatmul(const torch::Tensor& a, const torch::Tensor& b, double alpha,
                            const torch::Tensor& addend) {
  if (!OneDnnApplies({a, b, addend}) || a.dim() != 3 || b.dim() != 3 || a.size(0) != b.size(0) ||
      a.size(2) != b.size(1) || a.numel() == 0 || b.numel() == 0 ||
      (addend.defined() &&
       (addend.dim() != 2 || addend.size(0) != a.size(1) || addend.size(1) != b.size(2)))) {
    // torch's own results, and its errors for wrong shapes.
    if (addend.defined()) return torch::baddbmm(addend, a, b, /*beta=*/1, alpha);
    return alpha == 1 ? torch::bmm(a, b) : torch::bmm(a, b).mul(alpha);
  }
  return BatchedMatmulFunction::apply(
      a, b, alpha, addend.defined() ? c10::optional<torch::Tensor>(addend) : c10::nullopt);
}

std::string LinearImplementations(int64_t rows, int64_t in, int64_t out, bool bias) {
  // The GEMMs LinearFunction runs: x [rows, in], W [out, in] and dy [rows, out] contiguous.
  const torch::Tensor x = torch::empty({rows, in}), w = torch::empty({out, in}),
                      dy = torch::empty({rows, out});
  return Implementations({ShapeOf(x, w.t(), bias, 1, false), ShapeOf(dy, w, false, 1, false),
                          ShapeOf(dy.t(), x, false, 1, false)});
}

std::string AttentionImplementations(int64_t batch_heads, int64_t seq_len, int64_t head_dim,
                                     int64_t row, int64_t rows) {
  // The GEMMs of one query block (see GptModel): q, k, v [batch_heads, seq_len, head_dim].
  const torch::Tensor qkv = torch::empty({batch_heads, seq_len, head_dim});
  const int64_t keys = row + rows;
  const torch::Tensor q = qkv.narrow(1, row, rows), k = qkv.narrow(1, 0, keys),
                      v = qkv.narrow(1, 0, keys);
  const torch::Tensor scores = torch::empty({batch_heads, rows, keys});
  const torch::Tensor y = torch::empty({batch_heads, rows, head_dim});
  const torch::Tensor k_t = k.transpose(1, 2);
  // As BatchedMatmulFunction runs them, for scores = q k^T / sqrt(d) + mask and y = p v.
  return Implementations({
      ShapeOf(q, k_t, false, 0.125f, true),                        // scores
      ShapeOf(scores, k_t.transpose(1, 2), false, 0.125f, false),  // d q = d scores k
      ShapeOf(q.transpose(1, 2), scores, false, 0.125f, false),    // d k^T = q^T d scores
      ShapeOf(scores, v, false, 1, false),                         // y (scores stands for p)
      ShapeOf(y, v.transpose(1, 2), false, 1, false),              // d p = d y v^T
      ShapeOf(scores.transpose(1, 2), y, false, 1, false),         // d v = p^T d y
  });
}

std::string DescribeMatmuls() {
  const dnnl_version_t* v = dnnl::version();
  const std::string onednn = absl::StrCat("oneDNN ", v->major, ".", v->minor, ".", v->patch, " (",
                                          IsaName(dnnl::get_effective_cpu_isa()), ")");
  absl::StatusOr<std::optional<MatmulPath>> pinned = MatmulPathFromEnvironment();
  if (!pinned.ok()) return absl::StrCat("Matmuls: ", pinned.status().message());
  if (!pinned->has_value()) {
    return absl::StrCat("Matmuls: ", onednn,
                        " or the BLAS, the faster on the model's GEMMs (timed at start)");
  }
  return absl::StrCat("Matmuls: ", **pinned == MatmulPath::kOneDnn ? onednn : "BLAS",
                      " (TRAINYARD_MATMUL=", **pinned == MatmulPath::kOneDnn ? "onednn" : "blas",
                      ")");
}

}  // namespace trainyard::trainer
