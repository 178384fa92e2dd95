// StepReporter: rank 0's account of each optimizer step: its line in the rank's log, its JSON line
// in --metrics-file, and its report to the coordinator (Reporter). A component of its own, fed a
// StepRecord by the training loop and its strategy (strategy/strategy.h), with no LibTorch, so
// that what a step reports is one struct and one place.
#ifndef TRAINYARD_WORKER_TRAINER_CONTROL_STEP_REPORT_H_
#define TRAINYARD_WORKER_TRAINER_CONTROL_STEP_REPORT_H_

#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/trainer/control/reporter.h"

namespace trainyard::trainer {

// What a parallel layout adds to a step's report (ParallelStrategy::LayoutStats).
struct LayoutStepStats {
  int64_t allreduce_bytes = 0;         // the gradient all-reduce's bytes per step (DDP buckets)
  int64_t model_state_peak_bytes = 0;  // weights, gradients and optimizer state this rank held
  // Model parallelism: the pipeline's fields in the log line, the schedule's theory of the bubble,
  // (P - 1) / (m + P - 1) (0 without stages), and the step's peaks.
  bool pipeline_fields = false;
  double pipeline_bubble_theory = 0;
  int pipeline_in_flight_peak = 0;
  int64_t pipeline_activation_peak_bytes = 0;
  std::string
      log_fields;  // the layout's own fields of the log line (" ps_push_bytes N ..."), or ""
};

// One step as rank 0 reports it.
struct StepRecord {
  int64_t step = 0;  // optimizer steps completed, 1-based
  int64_t total_steps = 0;
  double loss = 0;  // the global mean, as the ranks agreed it
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_second = 0;
  // Model FLOPs utilisation, 0 to 1 (common/mfu.h), on a GPU the peak table knows; else none.
  std::optional<double> mfu;
  double step_seconds = 0;  // of training, without an evaluation after it
  // The host's time in backward: the backward's own on the CPU. None on a GPU, where the host only
  // queues the backward's kernels (and a replayed CUDA graph queues none): the log and the metrics
  // file leave it out rather than give that as the backward's time.
  std::optional<double> backward_seconds;
  double comm_wait_seconds = 0;
  int64_t comm_bytes = 0;
  // Pipeline: each stage's idle share of the schedule (the measured bubble is their mean); empty
  // without a pipeline.
  std::vector<double> stage_idle;
  LayoutStepStats layout;
  struct LossScale {  // fp16's dynamic loss scaling
    double scale = 1;
    bool skipped = false;  // this step's update was skipped (inf or NaN gradients)
    int64_t skipped_steps = 0;
  };
  std::optional<LossScale> loss_scale;
  std::optional<int64_t> device_peak_bytes;  // on a GPU
  std::optional<double> eval_loss;           // train.eval_every: when an evaluation ran after it
  int64_t eval_windows = 0;                  // the held-out windows it read
};

class StepReporter {
 public:
  // `metrics_file`: one JSON line a step appended to it ("": none; INVALID_ARGUMENT naming
  // --metrics-file when it cannot be opened). `reporter`: the coordinator's (nullable: none), not
  // owned. `log`: the rank's log, a line a call.
  static absl::StatusOr<std::unique_ptr<StepReporter>> Open(const std::string& metrics_file,
                                                            Reporter* reporter,
                                                            void (*log)(const std::string& line));

  void Report(const StepRecord& r);

 private:
  StepReporter(Reporter* reporter, void (*log)(const std::string&))
      : reporter_(reporter), log_(log) {}

  Reporter* reporter_;
  void (*log_)(const std::string&);
  std::ofstream metrics_;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CONTROL_STEP_REPORT_H_
