// A trace of some of a rank's steps, for finding where a step's time goes: LibTorch's profiler
// (Kineto: the operators on the CPU, and on a GPU every kernel and copy with its time) saved as a
// Chrome trace (chrome://tracing, ui.perfetto.dev; bench/trace_summary.py sums its kernels).
// `trainyard-trainer --profile-steps FIRST:COUNT --profile-out PATH`, for benchmarks and
// developers: the trace is large and the profiler slows the steps it records.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace trainyard::trainer {

class StepProfiler {
 public:
  // "FIRST:COUNT" (1-based steps, COUNT >= 1, at most 100) and where the trace goes; an empty
  // `steps` profiles nothing. INVALID_ARGUMENT naming --profile-steps or --profile-out.
  static absl::StatusOr<StepProfiler> Make(const std::string& steps, const std::string& out,
                                           bool cuda);

  // Around step `step` (1-based): the profiler starts before FIRST and stops after the last,
  // when the trace is written. After's error (no trace: a LibTorch without Kineto, a path that
  // cannot be written) leaves the training as it was.
  void Before(int64_t step);
  absl::Status After(int64_t step);
  // The last step traced; 0 when none is.
  int64_t last_step() const { return count_ == 0 ? 0 : first_ + count_ - 1; }

 private:
  int64_t first_ = 0, count_ = 0;
  std::string out_;
  bool cuda_ = false;
  bool on_ = false;
  std::string start_error_;  // why the profiler did not start
};

}  // namespace trainyard::trainer
