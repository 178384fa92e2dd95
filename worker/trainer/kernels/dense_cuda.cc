// WeightGradientCublasLt (see dense.h): the CUDA build's only direct cuBLASLt call.
//
// cuBLASLt is column-major. Row-major dW [out, in] is column-major dW^T [in, out], and
//   dW^T = x^T dy:  A = x, stored row-major [rows, in] = column-major [in, rows] (ld in), not
//   transposed: m = in, k = rows; B = dy, row-major [rows, out] = column-major [out, rows] (ld
//   out), transposed: [rows, out], n = out; D = dW^T [in, out] (ld in).
// BGRADB sums B over k, one value per column of D: db[o] = sum over rows of dy[r, o]. (Apex's
// fused dense and Transformer Engine's weight-gradient GEMMs take this layout and epilogue.)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <cublasLt.h>

#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>

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

// The heuristic's answer per problem: its query costs more host time than the product's launch.
// (device, in, out, rows, dtype, bias, the four alignments, workspace) -> the algorithm, or none.
// (Bounded: a run's shapes are few; an evaluation's other batch sizes add a handful.)
using Key = std::tuple<int, int64_t, int64_t, int64_t, int, bool, uint32_t, uint32_t, uint32_t,
                       uint32_t, size_t>;
constexpr size_t kMaxChoices = 4096;
struct Choice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};
std::mutex g_mu;
std::map<Key, Choice> g_choices;
bool g_said_none = false;  // (under g_mu)

}  // namespace

bool WeightGradientCublasLt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dw,
                            const at::Tensor& db) {
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
  cudaDataType_t operand;
  if (dy.scalar_type() == at::kBFloat16) {
    operand = CUDA_R_16BF;
  } else if (dy.scalar_type() == at::kHalf) {
    operand = CUDA_R_16F;
  } else {
    return false;
  }

  cublasLtMatmulDesc_t raw_desc = nullptr;
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const MatmulDesc desc(raw_desc);
  Set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_N);
  Set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_T);
  if (db.defined()) {
    // (The bias gradient's type is D's, fp32, by default.)
    Set(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BGRADB);
    Set(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, db.data_ptr());
    Set(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(CUDA_R_32F));
  }
  const MatrixLayout a = Layout(operand, in, rows, in);
  const MatrixLayout b = Layout(operand, out, rows, out);
  const MatrixLayout d = Layout(CUDA_R_32F, in, out, in);

  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const uint32_t align_a = Alignment(x.data_ptr()), align_b = Alignment(dy.data_ptr()),
                 align_d = Alignment(dw.data_ptr()),
                 align_bias = db.defined() ? Alignment(db.data_ptr()) : 0;
  const Key key{dy.get_device(), in,      out,     rows,    static_cast<int>(operand),
                db.defined(),    align_a, align_b, align_d, align_bias,
                workspace_size};
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
      Set(raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d);
      Set(raw_preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
      cublasLtMatmulHeuristicResult_t result{};
      int returned = 0;
      const cublasStatus_t status =
          cublasLtMatmulAlgoGetHeuristic(handle, raw_desc, a.get(), b.get(), d.get(), d.get(),
                                         raw_preference, 1, &result, &returned);
      // No algorithm for this problem: the caller computes it otherwise. Anything else is a
      // mistake in the problem's description, not to be hidden behind the fallback.
      if (status != CUBLAS_STATUS_NOT_SUPPORTED) TORCH_CUDABLAS_CHECK(status);
      choice.found = status == CUBLAS_STATUS_SUCCESS && returned > 0;
      if (choice.found) {
        choice.algo = result.algo;
      } else if (!g_said_none) {
        g_said_none = true;
        std::fprintf(stderr,
                     "dense: cuBLASLt has no algorithm for the weight gradient of [%lld, %lld] x "
                     "[%lld, %lld]%s; eager's product and sum instead\n",
                     static_cast<long long>(rows), static_cast<long long>(out),
                     static_cast<long long>(rows), static_cast<long long>(in),
                     db.defined() ? " with its bias gradient" : "");
      }
      if (g_choices.size() >= kMaxChoices) g_choices.clear();
      g_choices.emplace(key, choice);
    }
  }
  if (!choice.found) return false;
  const float alpha = 1.0f, beta = 0.0f;
  TORCH_CUDABLAS_CHECK(cublasLtMatmul(handle, raw_desc, &alpha, x.data_ptr(), a.get(),
                                      dy.data_ptr(), b.get(), &beta, dw.data_ptr(), d.get(),
                                      dw.data_ptr(), d.get(), &choice.algo, workspace,
                                      workspace_size, at::cuda::getCurrentCUDAStream()));
  return true;
}

}  // namespace trainyard::trainer
