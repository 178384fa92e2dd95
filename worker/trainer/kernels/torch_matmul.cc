// onednn_matmul.h's functions for a LibTorch without a callable oneDNN (the torch package's
// CUDA LibTorch carries oneDNN inside libtorch_cpu, not exported): every matmul is LibTorch's own
// (cuBLAS on the GPU, its BLAS on the CPU). Built instead of onednn_matmul.cc; see
// worker/CMakeLists.txt.
#include "worker/trainer/kernels/onednn_matmul.h"

namespace trainyard::trainer {

absl::StatusOr<std::optional<MatmulPath>> MatmulPathFromEnvironment() { return std::nullopt; }

void SetMatmulPath(MatmulPath) {}

bool OneDnnMatmulsAvailable() { return false; }

bool OneDnnMatmulsEnabled() { return false; }

torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias) {
  return torch::linear(x, weight, bias);
}

torch::Tensor BatchedMatmul(const torch::Tensor& a, const torch::Tensor& b, double alpha,
                            const torch::Tensor& addend) {
  if (addend.defined()) return torch::baddbmm(addend, a, b, /*beta=*/1, alpha);
  return alpha == 1 ? torch::bmm(a, b) : torch::bmm(a, b).mul(alpha);
}

std::string LinearImplementations(int64_t, int64_t, int64_t, bool) { return "libtorch"; }

std::string AttentionImplementations(int64_t, int64_t, int64_t, int64_t, int64_t) {
  return "libtorch";
}

std::string DescribeMatmuls() { return "Matmuls: LibTorch (this build has no oneDNN GEMMs)"; }

}  // namespace trainyard::trainer
