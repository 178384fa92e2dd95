// The BLAS line of the trainer's log (see blas.h).
#include "worker/trainer/kernels/blas.h"

#include <dlfcn.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace trainyard::trainer {
namespace {

// OpenBLAS's own description of itself, or "" when the process's BLAS is not OpenBLAS.
std::string OpenBlasCall(const char* symbol) {
  using Fn = char* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, symbol));
  if (fn == nullptr) return "";
  const char* s = fn();
  return s == nullptr ? "" : std::string(s);
}

}  // namespace

std::string DescribeBlas() {
  const std::string core = OpenBlasCall("openblas_get_corename");
  if (core.empty()) return "BLAS: not OpenBLAS";
  return absl::StrCat(
      "BLAS: ", OpenBlasCall("openblas_get_config"), "; kernels ", core,
      std::getenv("OPENBLAS_CORETYPE") != nullptr ? " (set by OPENBLAS_CORETYPE)" : "");
}

void SetBlasThreads(int threads) {
  using Fn = void (*)(int);
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (fn != nullptr && threads > 0) fn(threads);
}

}  // namespace trainyard::trainer
