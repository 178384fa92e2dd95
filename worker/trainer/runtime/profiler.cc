#include "worker/trainer/runtime/profiler.h"

#include <set>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "worker/trainer/runtime/torch_compat.h"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

namespace trainyard::trainer {

absl::StatusOr<StepProfiler> StepProfiler::Make(const std::string& steps, const std::string& out,
                                                bool cuda) {
  StepProfiler p;
  if (steps.empty()) return p;
  const std::vector<std::string> parts = absl::StrSplit(steps, ':');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &p.first_) ||
      !absl::SimpleAtoi(parts[1], &p.count_) || p.first_ < 1 || p.count_ < 1 || p.count_ > 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--profile-steps: want FIRST:COUNT (a step from 1, 1 to 100 steps), got \"", steps, "\""));
  }
  if (out.empty())
    return absl::InvalidArgumentError("--profile-out: required with --profile-steps");
  p.out_ = out;
  p.cuda_ = cuda;
  return p;
}

void StepProfiler::Before(int64_t step) {
  if (count_ == 0 || step != first_) return;
  namespace impl = torch::profiler::impl;
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (cuda_) activities.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  try {
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    on_ = true;
  } catch (const c10::Error& e) {
    start_error_ = e.what_without_backtrace();
  }
}

absl::Status StepProfiler::After(int64_t step) {
  if (count_ == 0 || step != last_step()) return absl::OkStatus();
  if (!on_) return absl::UnavailableError(start_error_);
  on_ = false;
  try {
    if (cuda_) torch::cuda::synchronize();  // the steps' kernels end before the trace does
    std::unique_ptr<torch::autograd::profiler::ProfilerResult> result =
        torch::autograd::profiler::disableProfiler();
    if (result == nullptr) return absl::InternalError("the profiler gave no trace");
    // (A LibTorch built without Kineto, as Debian's 1.13, records but cannot save.)
    result->save(out_);
  } catch (const c10::Error& e) {
    return absl::UnavailableError(e.what_without_backtrace());
  }
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
