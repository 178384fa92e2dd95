// Linear on oneDNN's matmul (see onednn_linear.h).
#include "worker/trainer/onednn_linear.h"

#include <ATen/autocast_mode.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace trainyard::trainer {
namespace {

using dnnl::memory;

// C[m, n] = A[m, k] B[k, n] (+ bias[n]), A and B given by their strides, C dense row-major.
struct GemmShape {
  int64_t m, k, n;
  std::array<int64_t, 2> a_strides, b_strides;
  bool bias;
};

class OneDnn {
 public:
  static OneDnn& Get() {
    static OneDnn* instance = new OneDnn();  // never destroyed: ranks may exit from any thread
    return *instance;
  }

  void Gemm(const GemmShape& s, const float* a, const float* b, const float* bias, float* c) {
    dnnl::matmul* primitive = Primitive(s);
    memory::desc a_md({s.m, s.k}, memory::data_type::f32, {s.a_strides[0], s.a_strides[1]});
    memory::desc b_md({s.k, s.n}, memory::data_type::f32, {s.b_strides[0], s.b_strides[1]});
    memory::desc c_md({s.m, s.n}, memory::data_type::f32, {s.n, 1});
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(a_md, engine_, const_cast<float*>(a))},
        {DNNL_ARG_WEIGHTS, memory(b_md, engine_, const_cast<float*>(b))},
        {DNNL_ARG_DST, memory(c_md, engine_, c)}};
    if (s.bias) {
      memory::desc bias_md({1, s.n}, memory::data_type::f32, {s.n, 1});
      args.emplace(DNNL_ARG_BIAS, memory(bias_md, engine_, const_cast<float*>(bias)));
    }
    dnnl::stream stream(engine_);
    primitive->execute(stream, args);
    stream.wait();
  }

  // The implementation oneDNN picks for a shape, e.g. "brg:avx512_core".
  std::string Implementation(const GemmShape& s) { return Desc(s).impl_info_str(); }

 private:
  OneDnn() : engine_(dnnl::engine::kind::cpu, 0) {}

  using Key = std::array<int64_t, 9>;

  static Key KeyOf(const GemmShape& s) {
    return {s.m,
            s.k,
            s.n,
            s.a_strides[0],
            s.a_strides[1],
            s.b_strides[0],
            s.b_strides[1],
            s.bias ? 1 : 0,
            at::get_num_threads()};
  }

  dnnl::matmul::primitive_desc Desc(const GemmShape& s) {
    memory::desc a_md({s.m, s.k}, memory::data_type::f32, {s.a_strides[0], s.a_strides[1]});
    memory::desc b_md({s.k, s.n}, memory::data_type::f32, {s.b_strides[0], s.b_strides[1]});
    memory::desc c_md({s.m, s.n}, memory::data_type::f32, {s.n, 1});
    if (s.bias) {
      memory::desc bias_md({1, s.n}, memory::data_type::f32, {s.n, 1});
      return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), engine_);
    }
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), engine_);
  }

  dnnl::matmul* Primitive(const GemmShape& s) {
    const Key key = KeyOf(s);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it == cache_.end()) it = cache_.emplace(key, dnnl::matmul(Desc(s))).first;
    return &it->second;
  }

  dnnl::engine engine_;
  std::mutex mu_;
  std::map<Key, dnnl::matmul> cache_;  // node-based: pointers stay valid
};

// out[m, n] = a[m, k] b[k, n] (+ bias), a and b 2-D fp32 tensors of any strides oneDNN takes.
void Gemm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias,
          torch::Tensor& out) {
  const GemmShape shape{
      a.size(0),     a.size(1), b.size(1), {a.stride(0), a.stride(1)}, {b.stride(0), b.stride(1)},
      bias.defined()};
  OneDnn::Get().Gemm(shape, a.data_ptr<float>(), b.data_ptr<float>(),
                     bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>());
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
    Gemm(x2, w.t(), bias.defined() ? bias.contiguous() : bias,
         y);  // W^T: [in, out], strides (1, in)
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
      Gemm(dy, w, torch::Tensor(), dx);  // [m, out] [out, in]
      dx = dx.view(ctx->saved_data["x_sizes"].toIntVector());
    }
    if (ctx->needs_input_grad(1)) {
      dw = torch::empty({out, in}, dy.options());
      Gemm(dy.t(), x2, torch::Tensor(), dw);  // [out, m] [m, in]
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) db = dy.sum(0);
    return {dx, dw, db};
  }
};

bool ReadEnabled() {
  const char* env = std::getenv("TRAINYARD_MATMUL");
  return env == nullptr || std::strcmp(env, "blas") != 0;
}

std::string IsaName(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "isa " + std::to_string(static_cast<int>(isa));
  }
}

}  // namespace

bool OneDnnLinearEnabled() {
  static const bool enabled = ReadEnabled();
  return enabled;
}

torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias) {
  const bool fp32 = x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat &&
                    (!bias.defined() || bias.scalar_type() == torch::kFloat);
  if (!OneDnnLinearEnabled() || !fp32 || !x.device().is_cpu() || at::autocast::is_cpu_enabled() ||
      x.dim() < 1 || x.numel() == 0 || weight.dim() != 2 || x.size(-1) != weight.size(1)) {
    return torch::linear(x, weight, bias);  // also gives torch's errors for wrong shapes
  }
  return LinearFunction::apply(x, weight,
                               bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt);
}

std::string LinearImplementations(int64_t rows, int64_t in, int64_t out, bool bias) {
  OneDnn& dnnl = OneDnn::Get();
  // The strides LinearFunction passes: x [rows, in], W [out, in] and dy [rows, out] contiguous.
  return absl::StrCat(dnnl.Implementation({rows, in, out, {in, 1}, {1, in}, bias}), " ",
                      dnnl.Implementation({rows, out, in, {out, 1}, {in, 1}, false}), " ",
                      dnnl.Implementation({out, rows, in, {1, out}, {in, 1}, false}));
}

std::string DescribeLinearMatmuls() {
  if (!OneDnnLinearEnabled()) return "Linear matmuls: BLAS (TRAINYARD_MATMUL=blas)";
  const dnnl_version_t* v = dnnl::version();
  return absl::StrCat("Linear matmuls: oneDNN ", v->major, ".", v->minor, ".", v->patch, " (",
                      IsaName(dnnl::get_effective_cpu_isa()), ")");
}

}  // namespace trainyard::trainer
