// Devices, autocast, gradient norms and loss scaling (see device.h).
#include "worker/trainer/runtime/device.h"

#include <ATen/autocast_mode.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/trainer/comm/cuda_support.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

// The precision of the autocast this thread runs under (AutocastScope), for recomputes.
thread_local Precision autocast_precision = Precision::kFp32;

}  // namespace

bool CudaUsable() { return CudaBuild() && torch::cuda::is_available(); }

absl::StatusOr<torch::Device> ResolveDevice(const std::string& name) {
  if (name == "cpu") return torch::Device(torch::kCPU);
  if (name != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--device: unknown device '", name, "'"));
  }
  if (!CudaBuild()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device cuda: this trainer was built with LibTorch ", TorchVersionString(),
                     " without CUDA (trainyard-trainer --supported-devices); start the worker "
                     "with --gpus none or --gpus auto to offer CPU slots"));
  }
  if (!torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        "--device cuda: LibTorch sees no CUDA device (check CUDA_VISIBLE_DEVICES and the "
        "driver: nvidia-smi)");
  }
  return torch::Device(torch::kCUDA, 0);
}

std::string DescribeDevice(const torch::Device& device) {
  if (!device.is_cuda()) return "cpu";
  return absl::StrCat(device.str(), " (", CudaDeviceSummary(device.index()), ")");
}

torch::Tensor ToDevice(const torch::Tensor& host, const torch::Device& device) {
  if (!device.is_cuda()) return host;
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

void SynchronizeDevice(const torch::Device& device) {
  if (device.is_cuda()) CudaSynchronize();
}

AutocastScope::AutocastScope(const torch::Device& device, Precision precision) {
#if TRAINYARD_TORCH2
  if (!device.is_cuda() || precision == Precision::kFp32) return;
  on_ = true;
  was_on_ = at::autocast::is_autocast_enabled(at::kCUDA);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCUDA,
                                   precision == Precision::kFp16 ? at::kHalf : at::kBFloat16);
  at::autocast::increment_nesting();
  autocast_precision = precision;
#else
  (void)device;
  (void)precision;
#endif
}

AutocastScope::~AutocastScope() {
#if TRAINYARD_TORCH2
  if (!on_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCUDA, was_on_);
  if (!was_on_) autocast_precision = Precision::kFp32;
#endif
}

bool AutocastScope::Active() {
#if TRAINYARD_TORCH2
  return at::autocast::is_autocast_enabled(at::kCUDA);
#else
  return false;
#endif
}

Precision AutocastScope::ActivePrecision() {
  return Active() ? autocast_precision : Precision::kFp32;
}

c10::ScalarType AutocastScope::ProductType(const torch::Tensor& x) {
  if (x.is_cuda()) {
    switch (ActivePrecision()) {
      case Precision::kBf16:
        return torch::kBFloat16;
      case Precision::kFp16:
        return torch::kHalf;
      default:
        break;
    }
  }
  return x.scalar_type();
}

double GradNorm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return 0;
  if (!grads[0].is_cuda()) {
    double sq = 0;
    for (const auto& g : grads) {
      const double n = g.norm().item<double>();  // one pass, no temporary
      sq += n * n;
    }
    return std::sqrt(sq);
  }
  return GradNormTensor(params).item<double>();
}

torch::Tensor GradNormTensor(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return torch::Tensor();
#if TRAINYARD_TORCH2
  if (grads[0].is_cuda()) {
    const std::vector<torch::Tensor> norms = at::_foreach_norm(grads, 2, torch::kFloat);
    return torch::stack(norms).to(torch::kDouble).norm();
  }
#endif
  std::vector<torch::Tensor> norms;
  for (const auto& g : grads) norms.push_back(g.norm().to(torch::kDouble));
  return torch::stack(norms).norm();
}

torch::Tensor ClipDivisor(const torch::Tensor& norm, double max_norm) {
  torch::NoGradGuard no_grad;
  const torch::Tensor n = norm.to(torch::kFloat).reshape({});
  return torch::where(n > max_norm, (n + 1e-6) / max_norm, torch::ones_like(n));
}

LossScaler::LossScaler(const Options& options) : options_(options), scale_(options.init_scale) {}

bool LossScaler::Unscale(const std::vector<torch::Tensor>& params) const {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return false;
  const double inv = 1.0 / scale_;
#if TRAINYARD_TORCH2
  if (grads[0].is_cuda()) {
    // One kernel over every gradient, as GradScaler.unscale_: multiplies and flags non-finite
    // values in found_inf on the device.
    const auto opts = grads[0].options().dtype(torch::kFloat);
    torch::Tensor found = torch::zeros({1}, opts);
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found, torch::full({1}, inv, opts));
    return found.item<float>() > 0;
  }
#endif
  bool bad = false;
  for (auto& g : grads) {
    g.mul_(inv);
    if (!bad && !torch::isfinite(g).all().item<bool>()) bad = true;
  }
  return bad;
}

void LossScaler::Update(bool found_inf) {
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
    ++skipped_;
    return;
  }
  if (++growth_tracker_ >= options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;  // as GradScaler: never to inf
    growth_tracker_ = 0;
  }
}

std::vector<std::pair<std::string, torch::Tensor>> LossScaler::State() const {
  return {{"loss_scale", torch::tensor({scale_}, torch::kDouble)},
          {"loss_scale_growth_tracker", torch::tensor({growth_tracker_}, torch::kLong)}};
}

absl::Status LossScaler::SetState(const std::vector<std::pair<std::string, torch::Tensor>>& state) {
  const torch::Tensor* scale = nullptr;
  const torch::Tensor* tracker = nullptr;
  for (const auto& [name, t] : state) {
    if (name == "loss_scale") scale = &t;
    if (name == "loss_scale_growth_tracker") tracker = &t;
  }
  if (scale == nullptr || tracker == nullptr || scale->numel() != 1 || tracker->numel() != 1) {
    return absl::InvalidArgumentError(
        "checkpoint: train.mixed_precision fp16 needs loss_scale and loss_scale_growth_tracker "
        "(one value each) in amp.pt");
  }
  const double s = scale->to(torch::kDouble).item<double>();
  if (!std::isfinite(s) || s <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: loss_scale ", s, " is not a positive finite number"));
  }
  scale_ = s;
  growth_tracker_ = tracker->to(torch::kLong).item<int64_t>();
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
