// The few places where LibTorch's C++ API differs between Debian's CPU LibTorch 1.13 (the
// default build) and the CUDA LibTorch 2.x of the torch Python package (GPU hosts). Every
// trainer file that meets such a difference goes through this header instead of testing versions
// itself. LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_RUNTIME_TORCH_COMPAT_H_
#define TRAINYARD_WORKER_TRAINER_RUNTIME_TORCH_COMPAT_H_

#include <torch/torch.h>
#include <torch/version.h>

#include <string>

#if TORCH_VERSION_MAJOR >= 2
#define TRAINYARD_TORCH2 1
#else
#define TRAINYARD_TORCH2 0
#endif

namespace trainyard::trainer {

// The key of a parameter in torch::optim::Optimizer::state(): its TensorImpl's address, as a
// string in 1.13 and as a void* in 2.x.
#if TRAINYARD_TORCH2
inline void* OptimizerStateKey(const torch::Tensor& p) { return p.unsafeGetTensorImpl(); }
#else
inline std::string OptimizerStateKey(const torch::Tensor& p) {
  return c10::guts::to_string(p.unsafeGetTensorImpl());
}
#endif

// "1.13.0+cpu"-like: the LibTorch the trainer was built with, for --version and the rank's log.
inline std::string TorchVersionString() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_RUNTIME_TORCH_COMPAT_H_
