// The CUDA build's direct cuBLASLt calls (see dense.h): the weight gradient with its bias
// gradient, and a GPT MLP's GELU in the epilogues of its products.
//
// cuBLASLt is column-major: a row-major [r, c] matrix is a column-major [c, r] one.
// - The weight gradient: row-major dW [out, in] is column-major dW^T [in, out], and
//   dW^T = x^T dy:  A = x, stored row-major [rows, in] = column-major [in, rows] (ld in), not
//   transposed: m = in, k = rows; B = dy, row-major [rows, out] = column-major [out, rows] (ld
//   out), transposed: [rows, out], n = out; D = dW^T [in, out] (ld in). BGRADB sums B over k, one
//   value per column of D: db[o] = sum over rows of dy[r, o]. (Apex's fused dense and Transformer
//   Engine's weight-gradient GEMMs take this layout and epilogue.)
// - The forward with GELU (torch::linear's own layout): out^T [hidden, rows] = W1 x^T: A = W1,
//   row-major [hidden, in] = column-major [in, hidden] (ld in), transposed: m = hidden, k = in;
//   B = x, column-major [in, rows] (ld in), not transposed: n = rows; D = out^T [hidden, rows] (ld
//   hidden). The bias has m = hidden values, one a row of D; the auxiliary matrix (the
//   pre-activation) is D's shape and leading dimension.
// - The hidden gradient with GELU's derivative: dh^T [hidden, rows] = W2^T dy^T: A = W2, row-major
//   [out, hidden] = column-major [hidden, out] (ld hidden), not transposed: m = hidden, k = out;
//   B = dy, column-major [out, rows] (ld out), not transposed: n = rows; D = dpre^T (ld hidden),
//   the auxiliary matrix the forward's pre-activation. (Transformer Engine's fc1 data gradient.)
// - The forward product (LinearCublasLt): the GELU forward's layout without the GELU, the bias
//   (where given) in D's type; m = out, n = rows, k = in.
// - The input gradient (LinearCublasLt's backward, DataGradientCublasLt): dx^T [in, rows] = W^T
//   dy^T, the GELU backward's layout without the derivative; m = in, n = rows, k = out.
// - The second product with the residual added: y^T [out, rows] = W2 h^T + b2 + residual^T: A =
//   W2, column-major [hidden, out] (ld hidden), transposed: m = out, k = hidden; B = h,
//   column-major [hidden, rows] (ld hidden): n = rows; C = the residual and D = y, fp32 [out,
//   rows] (ld out), beta 1; the bias in D's type, fp32.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAException.h>
#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "worker/trainer/kernels/dense.h"

namespace trainyard::trainer {
namespace {

template <typename T, cublasStatus_t (*destroy)(T)>
struct Destroyer {
  void operator()(std::remove_pointer_t<T>* p) const {
    if (p != nullptr) destroy(p);
  }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t,
                                   Destroyer<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using MatrixLayout =
    std::unique_ptr<cublasLtMatrixLayoutOpaque_t,
                    Destroyer<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using Preference =
    std::unique_ptr<cublasLtMatmulPreferenceOpaque_t,
                    Destroyer<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

MatrixLayout Layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
  return MatrixLayout(layout);
}

template <typename T>
void Set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

template <typename T>
void Set(cublasLtMatmulPreference_t preference, cublasLtMatmulPreferenceAttributes_t attribute,
         const T& value) {
  TORCH_CUDABLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)));
}

// The largest power of two (up to 256) that divides the address, as ATen's cuBLASLt calls ask.
uint32_t Alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// The products this file runs; part of the cache's key.
enum class Product {
  kWeightGradient,
  kWeightAndBiasGradient,
  kGeluForward,
  kGeluBackward,
  kResidualForward,
  kWeightGradientAdded,
  kForward,
  kDataGradient,
  kCount
};
const char* NameOf(Product p) {
  switch (p) {
    case Product::kWeightGradient:
      return "the weight gradient";
    case Product::kWeightAndBiasGradient:
      return "the weight gradient with its bias gradient";
    case Product::kGeluForward:
      return "the product with its bias and GELU";
    case Product::kGeluBackward:
      return "the hidden gradient with GELU's derivative";
    case Product::kResidualForward:
      return "the product with its bias and the residual added";
    case Product::kWeightGradientAdded:
      return "the weight gradient added to the one so far";
    case Product::kForward:
      return "the product";
    case Product::kDataGradient:
      return "the input gradient";
    case Product::kCount:
      break;
  }
  return "?";
}

// The algorithm per problem: the heuristic's first, or, where tuning is on (SetGemmTuning), the
// fastest of its first kCandidates timed on the problem itself (see dense.h); the query and the
// timing cost more host time than the product's launch, so both are made once a problem.
// (device, product, m, n, k, dtype, the alignments of A, B, C, D and the bias and auxiliary
// matrix, workspace) -> the algorithm, or none. (Bounded: a run's shapes are few; an evaluation's
// other batch sizes add a handful.)
using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int, uint32_t, uint32_t, uint32_t,
                       uint32_t, uint32_t, size_t>;
constexpr size_t kMaxChoices = 4096;
// Candidates timed a problem, and timed launches each (after one untimed): cuBLASLt's own
// autotuning sample (LtSgemmSimpleAutoTuning) times its heuristic's first few the same way.
constexpr int kCandidates = 8;
constexpr int kTimedLaunches = 3;
struct Choice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};
std::mutex g_mu;
std::map<Key, Choice> g_choices;
bool g_said_none[static_cast<int>(Product::kCount)] = {};  // per Product (under g_mu)
GemmTuningStats g_stats;                                   // under g_mu

template <typename T>
T LayoutAttribute(const MatrixLayout& layout, cublasLtMatrixLayoutAttribute_t attribute) {
  T value{};
  size_t written = 0;
  TORCH_CUDABLAS_CHECK(
      cublasLtMatrixLayoutGetAttribute(layout.get(), attribute, &value, sizeof(value), &written));
  return value;
}

struct EventDestroyer {
  void operator()(std::remove_pointer_t<cudaEvent_t>* e) const {
    if (e != nullptr) C10_CUDA_CHECK_WARN(cudaEventDestroy(e));
  }
};
using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDestroyer>;
Event NewEvent() {
  cudaEvent_t e = nullptr;
  C10_CUDA_CHECK(cudaEventCreate(&e));
  return Event(e);
}

// One product's launch with `algo`: the status, not thrown (a candidate that fails is skipped).
struct Launch {
  cublasLtHandle_t handle;
  cublasLtMatmulDesc_t desc;
  const MatrixLayout* a;
  const MatrixLayout* b;
  const MatrixLayout* d;
  const void* pa;
  const void* pb;
  const void* pc;
  void* pd;
  float beta;
  void* workspace;
  size_t workspace_size;
  cudaStream_t stream;

  cublasStatus_t operator()(const cublasLtMatmulAlgo_t& algo) const {
    const float alpha = 1.0f;
    return cublasLtMatmul(handle, desc, &alpha, pa, a->get(), pb, b->get(), &beta, pc, d->get(), pd,
                          d->get(), &algo, workspace, workspace_size, stream);
  }
};

// The index of the fastest of `algos` for `launch` (kTimedLaunches each after one untimed, on
// its stream, which this waits for), with each one's milliseconds a launch in `ms` (negative:
// it failed); -1 when none ran. Each candidate starts on an idle stream (the first, too: not
// behind the step's queued work).
int Fastest(const Launch& launch, const std::vector<cublasLtMatmulAlgo_t>& algos,
            std::vector<float>* ms) {
  const Event start = NewEvent(), stop = NewEvent();
  int best = -1;
  ms->assign(algos.size(), -1.0f);
  for (size_t i = 0; i < algos.size(); ++i) {
    C10_CUDA_CHECK(cudaStreamSynchronize(launch.stream));
    if (launch(algos[i]) != CUBLAS_STATUS_SUCCESS) continue;
    C10_CUDA_CHECK(cudaEventRecord(start.get(), launch.stream));
    bool ran = true;
    for (int r = 0; r < kTimedLaunches && ran; ++r) ran = launch(algos[i]) == CUBLAS_STATUS_SUCCESS;
    C10_CUDA_CHECK(cudaEventRecord(stop.get(), launch.stream));
    C10_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    if (!ran) continue;
    float elapsed = 0.0f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start.get(), stop.get()));
    (*ms)[i] = elapsed / kTimedLaunches;
    if (best < 0 || (*ms)[i] < (*ms)[best]) best = static_cast<int>(i);
  }
  return best;
}

// One product D = op(A) op(B) (alpha 1, beta 0; C is D), or with `pc`, D = op(A) op(B) + C (beta
// 1; C in D's layout), described by `desc` and the layouts of m x n D, on the current stream,
// with the algorithm chosen for the problem (cached per problem). False, with nothing run, when
// the heuristic offers none (said once per kind of product); an error of the product itself
// throws. `extra`: the addresses of the bias and the auxiliary matrix, where the product has them
// (their alignment is part of the problem: the heuristic's answer depends on it).
// The tuning runs the candidates on the call's own operands and outputs (each overwrites what the
// others wrote; the chosen one runs last). An add in place (C is D: the fused head's weight
// gradient after its first chunk) is not timed, which would add the product once a launch: it
// takes the choice of the same product without the add (the first chunk's, `twin`) where that
// problem has been met, else the heuristic's first. The tuning is skipped while the stream is
// being captured (a CUDA graph: waiting on it is not allowed), taking the heuristic's first.
bool Run(Product product, cublasLtMatmulDesc_t desc, const MatrixLayout& a, const MatrixLayout& b,
         const MatrixLayout& d, const void* pa, const void* pb, void* pd,
         std::initializer_list<const void*> extra, int64_t m, int64_t n, int64_t k,
         cudaDataType_t operand, int device, const void* pc = nullptr,
         std::optional<Product> twin = std::nullopt) {
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const uint32_t align_a = Alignment(pa), align_b = Alignment(pb), align_d = Alignment(pd);
  uint32_t align_extra = 0;
  for (const void* p : extra) {
    align_extra = align_extra == 0 ? Alignment(p) : std::min(align_extra, Alignment(p));
  }
  // (C's alignment, where C is not D, is asked for as C's and is part of the key.)
  const uint32_t align_c = pc != nullptr ? std::min(align_d, Alignment(pc)) : align_d;
  const Key key{device,      static_cast<int>(product),
                m,           n,
                k,           static_cast<int>(operand),
                align_a,     align_b,
                align_c,     align_d,
                align_extra, workspace_size};
  Launch launch{handle,    desc,
                &a,        &b,
                &d,        pa,
                pb,        pc != nullptr ? pc : pd,
                pd,        pc != nullptr ? 1.0f : 0.0f,
                workspace, workspace_size,
                stream};
  Choice choice;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_choices.find(key);
    if (it != g_choices.end()) {
      choice = it->second;
    } else {
      cublasLtMatmulPreference_t raw_preference = nullptr;
      TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_preference));
      const Preference preference(raw_preference);
      Set(raw_preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_size);
      Set(raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
      Set(raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
      Set(raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
      Set(raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
      // A split-K algorithm adds its parts up in fp32 (in a workspace of the compute type), never
      // in a 16-bit output's own type (in place, or in a workspace of that type), which would
      // round each part: the product keeps one GEMM's precision whichever algorithm it takes.
      if (LayoutAttribute<uint32_t>(d, CUBLASLT_MATRIX_LAYOUT_TYPE) != CUDA_R_32F) {
        Set(raw_preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
            static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE |
                                  CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
      }
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
      const bool tune = GemmTuning() && capture == cudaStreamCaptureStatusNone;
      cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
      int returned = 0;
      const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
          handle, desc, a.get(), b.get(), d.get(), d.get(), raw_preference, tune ? kCandidates : 1,
          results, &returned);
      std::vector<cublasLtMatmulAlgo_t> algos;
      for (int i = 0; status == CUBLAS_STATUS_SUCCESS && i < returned; ++i) {
        if (results[i].state == CUBLAS_STATUS_SUCCESS) algos.push_back(results[i].algo);
      }
      // No algorithm for this problem (or a description this cuBLASLt refuses: a status other
      // than NOT_SUPPORTED): the caller computes it otherwise, and the rank's log says why,
      // once per kind of product. A training run goes on at eager's speed; the GPU tests, which
      // check that the products took this path (GpuLinearBackwardPath, GeluMlpPath), fail.
      choice.found = !algos.empty();
      if (choice.found) {
        choice.algo = algos[0];
      } else if (!g_said_none[static_cast<int>(product)]) {
        g_said_none[static_cast<int>(product)] = true;
        std::fprintf(
            stderr,
            "dense: cuBLASLt has no algorithm for %s (m %lld, n %lld, k %lld: %s); "
            "eager's operations instead\n",
            NameOf(product), static_cast<long long>(m), static_cast<long long>(n),
            static_cast<long long>(k),
            status == CUBLAS_STATUS_SUCCESS ? "none returned" : cublasLtGetStatusString(status));
      }
      const bool in_place = pc == pd;
      if (in_place && twin.has_value()) {
        Key twin_key = key;
        std::get<1>(twin_key) = static_cast<int>(*twin);
        const auto twin_choice = g_choices.find(twin_key);
        if (choice.found && twin_choice != g_choices.end() && twin_choice->second.found) {
          choice.algo = twin_choice->second.algo;
          ++g_stats.twinned;
        }
      } else if (tune && algos.size() == 1) {
        ++g_stats.single;
      } else if (tune && algos.size() > 1 && !in_place) {
        std::vector<float> ms;
        const int best = Fastest(launch, algos, &ms);
        if (best >= 0) choice.algo = algos[best];
        ++g_stats.tuned;
        if (best > 0) ++g_stats.not_first;
        if (best >= 0 && ms[0] > 0) {
          std::fprintf(stderr,
                       "dense: cuBLASLt tuned %s (m %lld, n %lld, k %lld): candidate %d of %zu, "
                       "%.3f ms against the heuristic's first %.3f ms\n",
                       NameOf(product), static_cast<long long>(m), static_cast<long long>(n),
                       static_cast<long long>(k), best + 1, algos.size(), ms[best], ms[0]);
        }
      }
      if (g_choices.size() >= kMaxChoices) g_choices.clear();
      g_choices.emplace(key, choice);
    }
  }
  if (!choice.found) return false;
  TORCH_CUDABLAS_CHECK(launch(choice.algo));
  return true;
}

// bf16 or fp16's cuBLAS type; false for any other dtype.
bool OperandType(at::ScalarType dtype, cudaDataType_t* type) {
  if (dtype == at::kBFloat16) {
    *type = CUDA_R_16BF;
  } else if (dtype == at::kHalf) {
    *type = CUDA_R_16F;
  } else {
    return false;
  }
  return true;
}

MatmulDesc NewDesc(cublasOperation_t transa, cublasOperation_t transb) {
  cublasLtMatmulDesc_t raw_desc = nullptr;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MatmulDesc desc(raw_desc);
  Set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, transa);
  Set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, transb);
  return desc;
}

}  // namespace

GemmTuningStats GemmTuningStatsForTest() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_stats;
}

bool WeightGradientCublasLt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dw,
                            const at::Tensor& db, bool add) {
  TORCH_CHECK(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0) &&
                  dy.scalar_type() == x.scalar_type() && dy.is_contiguous() && x.is_contiguous(),
              "WeightGradientCublasLt: dy [rows, out] and x [rows, in], contiguous, one dtype");
  const int64_t rows = dy.size(0), out = dy.size(1), in = x.size(1);
  TORCH_CHECK(
      dw.scalar_type() == at::kFloat && dw.is_contiguous() && dw.size(0) == out && dw.size(1) == in,
      "WeightGradientCublasLt: dw fp32 [out, in], contiguous");
  TORCH_CHECK(!db.defined() || (db.scalar_type() == at::kFloat && db.is_contiguous() &&
                                db.dim() == 1 && db.size(0) == out),
              "WeightGradientCublasLt: db fp32 [out]");
  TORCH_CHECK(!add || !db.defined(), "WeightGradientCublasLt: adds dw only, without db");
  cudaDataType_t operand;
  if (!OperandType(dy.scalar_type(), &operand)) return false;
  const MatmulDesc desc = NewDesc(CUBLAS_OP_N, CUBLAS_OP_T);
  if (db.defined()) {
    // (The bias gradient's type is D's, fp32, by default.)
    Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BGRADB);
    Set(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, db.data_ptr());
    Set(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(CUDA_R_32F));
  }
  const MatrixLayout a = Layout(operand, in, rows, in);
  const MatrixLayout b = Layout(operand, out, rows, out);
  const MatrixLayout d = Layout(CUDA_R_32F, in, out, in);
  const Product product = add            ? Product::kWeightGradientAdded
                          : db.defined() ? Product::kWeightAndBiasGradient
                                         : Product::kWeightGradient;
  // (Adding: dw is C as well as D, beta 1, in place.)
  return Run(product, desc.get(), a, b, d, x.data_ptr(), dy.data_ptr(), dw.data_ptr(),
             db.defined() ? std::initializer_list<const void*>{db.data_ptr()}
                          : std::initializer_list<const void*>{},
             in, out, rows, operand, dy.get_device(), add ? dw.data_ptr() : nullptr,
             add ? std::optional<Product>(Product::kWeightGradient) : std::nullopt);
}

bool GeluForwardCublasLt(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                         const at::Tensor& out, const at::Tensor& pre) {
  TORCH_CHECK(
      x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && b.dim() == 1 &&
          b.size(0) == w.size(0) && x.is_contiguous() && w.is_contiguous() && b.is_contiguous() &&
          x.scalar_type() == w.scalar_type() && b.scalar_type() == x.scalar_type(),
      "GeluForwardCublasLt: x [rows, in], w [hidden, in], b [hidden], contiguous, one dtype");
  const int64_t rows = x.size(0), in = x.size(1), hidden = w.size(0);
  for (const at::Tensor* t : {&out, &pre}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == hidden && t->is_contiguous() &&
                    t->scalar_type() == x.scalar_type(),
                "GeluForwardCublasLt: out and pre [rows, hidden] in x's dtype, contiguous");
  }
  TORCH_CHECK(hidden % 8 == 0, "GeluForwardCublasLt: the hidden width must be a multiple of 8");
  cudaDataType_t operand;
  if (!OperandType(x.scalar_type(), &operand)) return false;
  const MatmulDesc desc = NewDesc(CUBLAS_OP_T, CUBLAS_OP_N);
  // (The bias and the auxiliary matrix are in D's type by default.)
  Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
  Set(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, b.data_ptr());
  Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
  Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(hidden));
  const MatrixLayout a = Layout(operand, in, hidden, in);
  const MatrixLayout bl = Layout(operand, in, rows, in);
  const MatrixLayout d = Layout(operand, hidden, rows, hidden);
  return Run(Product::kGeluForward, desc.get(), a, bl, d, w.data_ptr(), x.data_ptr(),
             out.data_ptr(), {b.data_ptr(), pre.data_ptr()}, hidden, rows, in, operand,
             x.get_device());
}

bool GeluBackwardCublasLt(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& pre,
                          const at::Tensor& dpre) {
  TORCH_CHECK(dy.dim() == 2 && w.dim() == 2 && dy.size(1) == w.size(0) && dy.is_contiguous() &&
                  w.is_contiguous() && dy.scalar_type() == w.scalar_type(),
              "GeluBackwardCublasLt: dy [rows, out] and w [out, hidden], contiguous, one dtype");
  const int64_t rows = dy.size(0), out = dy.size(1), hidden = w.size(1);
  for (const at::Tensor* t : {&pre, &dpre}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == hidden && t->is_contiguous() &&
                    t->scalar_type() == dy.scalar_type(),
                "GeluBackwardCublasLt: pre and dpre [rows, hidden] in dy's dtype, contiguous");
  }
  TORCH_CHECK(hidden % 8 == 0, "GeluBackwardCublasLt: the hidden width must be a multiple of 8");
  cudaDataType_t operand;
  if (!OperandType(dy.scalar_type(), &operand)) return false;
  const MatmulDesc desc = NewDesc(CUBLAS_OP_N, CUBLAS_OP_N);
  Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_DGELU);
  Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
  Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(hidden));
  const MatrixLayout a = Layout(operand, hidden, out, hidden);
  const MatrixLayout b = Layout(operand, out, rows, out);
  const MatrixLayout d = Layout(operand, hidden, rows, hidden);
  return Run(Product::kGeluBackward, desc.get(), a, b, d, w.data_ptr(), dy.data_ptr(),
             dpre.data_ptr(), {pre.data_ptr()}, hidden, rows, out, operand, dy.get_device());
}

bool ResidualForwardCublasLt(const at::Tensor& h, const at::Tensor& w, const at::Tensor& b,
                             const at::Tensor& residual, const at::Tensor& y) {
  TORCH_CHECK(
      h.dim() == 2 && w.dim() == 2 && h.size(1) == w.size(1) && h.is_contiguous() &&
          w.is_contiguous() && h.scalar_type() == w.scalar_type(),
      "ResidualForwardCublasLt: h [rows, hidden] and w [out, hidden], contiguous, one dtype");
  const int64_t rows = h.size(0), hidden = h.size(1), out = w.size(0);
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == out && b.is_contiguous() &&
                               b.scalar_type() == at::kFloat),
              "ResidualForwardCublasLt: b fp32 [out], contiguous, or undefined");
  for (const at::Tensor* t : {&residual, &y}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == out && t->is_contiguous() &&
                    t->scalar_type() == at::kFloat,
                "ResidualForwardCublasLt: residual and y fp32 [rows, out], contiguous");
  }
  TORCH_CHECK(residual.data_ptr() != y.data_ptr(), "ResidualForwardCublasLt: y is a new tensor");
  cudaDataType_t operand;
  if (!OperandType(h.scalar_type(), &operand)) return false;
  const MatmulDesc desc = NewDesc(CUBLAS_OP_T, CUBLAS_OP_N);
  // (The bias in D's type: fp32, the master bias itself. Without one, no epilogue: C's add is
  // the GEMM's own.)
  if (b.defined()) {
    Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    Set(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, b.data_ptr());
  }
  const MatrixLayout a = Layout(operand, hidden, out, hidden);
  const MatrixLayout bl = Layout(operand, hidden, rows, hidden);
  const MatrixLayout d = Layout(CUDA_R_32F, out, rows, out);
  return Run(Product::kResidualForward, desc.get(), a, bl, d, w.data_ptr(), h.data_ptr(),
             y.data_ptr(),
             b.defined() ? std::initializer_list<const void*>{b.data_ptr()}
                         : std::initializer_list<const void*>{},
             out, rows, hidden, operand, h.get_device(), residual.data_ptr());
}

bool LinearCublasLt(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                    const at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() &&
                  w.is_contiguous() && x.scalar_type() == w.scalar_type(),
              "LinearCublasLt: x [rows, in] and w [out, in], contiguous, one dtype");
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == out && b.is_contiguous() &&
                               b.scalar_type() == x.scalar_type()),
              "LinearCublasLt: b [out] in x's dtype, contiguous, or undefined");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == rows && y.size(1) == out && y.is_contiguous() &&
                  y.scalar_type() == x.scalar_type(),
              "LinearCublasLt: y [rows, out] in x's dtype, contiguous");
  cudaDataType_t operand;
  if (!OperandType(x.scalar_type(), &operand)) return false;
  // (GeluForwardCublasLt's layout without the GELU: y^T [out, rows] = W x^T.)
  const MatmulDesc desc = NewDesc(CUBLAS_OP_T, CUBLAS_OP_N);
  if (b.defined()) {
    Set(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    Set(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, b.data_ptr());
  }
  const MatrixLayout a = Layout(operand, in, out, in);
  const MatrixLayout bl = Layout(operand, in, rows, in);
  const MatrixLayout d = Layout(operand, out, rows, out);
  return Run(Product::kForward, desc.get(), a, bl, d, w.data_ptr(), x.data_ptr(), y.data_ptr(),
             b.defined() ? std::initializer_list<const void*>{b.data_ptr()}
                         : std::initializer_list<const void*>{},
             out, rows, in, operand, x.get_device());
}

bool DataGradientCublasLt(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& dx) {
  TORCH_CHECK(dy.dim() == 2 && w.dim() == 2 && dy.size(1) == w.size(0) && dy.is_contiguous() &&
                  w.is_contiguous() && dy.scalar_type() == w.scalar_type(),
              "DataGradientCublasLt: dy [rows, out] and w [out, in], contiguous, one dtype");
  const int64_t rows = dy.size(0), out = dy.size(1), in = w.size(1);
  TORCH_CHECK(dx.dim() == 2 && dx.size(0) == rows && dx.size(1) == in && dx.is_contiguous() &&
                  dx.scalar_type() == dy.scalar_type(),
              "DataGradientCublasLt: dx [rows, in] in dy's dtype, contiguous");
  cudaDataType_t operand;
  if (!OperandType(dy.scalar_type(), &operand)) return false;
  // (GeluBackwardCublasLt's layout without GELU's derivative: dx^T [in, rows] = W^T dy^T.)
  const MatmulDesc desc = NewDesc(CUBLAS_OP_N, CUBLAS_OP_N);
  const MatrixLayout a = Layout(operand, in, out, in);
  const MatrixLayout b = Layout(operand, out, rows, out);
  const MatrixLayout d = Layout(operand, in, rows, in);
  return Run(Product::kDataGradient, desc.get(), a, b, d, w.data_ptr(), dy.data_ptr(),
             dx.data_ptr(), {}, in, rows, out, operand, dy.get_device());
}

}  // namespace trainyard::trainer
