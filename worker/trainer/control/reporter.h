// Reporter: rank 0's link to the coordinator's TrainerService (step and checkpoint reports, and
// the commands that come back in the replies). The trainer's gRPC side: its header names no gRPC
// or protobuf type, so the training loop (LibTorch side) can use it.
//
// Step reports go through a queue to a thread of the reporter's own, so that a slow or missing
// coordinator never stalls training; failures are logged once. A report that found no coordinator
// (a failover, a restart) is sent again until one answers, and the recent ones are sent again to a
// coordinator of a new incarnation (StepReport.seq and .incarnation), so that `yard metrics` has
// every step across a failover. Thread-safe: the training thread enqueues and takes commands; the
// reporter's thread sends.
#ifndef TRAINYARD_WORKER_TRAINER_CONTROL_REPORTER_H_
#define TRAINYARD_WORKER_TRAINER_CONTROL_REPORTER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace trainyard::trainer {

// One optimizer step as rank 0 saw it (trainyard.v1.StepReport).
struct StepReport {
  int64_t step = 0;  // optimizer steps completed, 1-based
  int64_t total_steps = 0;
  double loss = 0;
  double lr = 0;
  double tokens_per_second = 0;  // global
  double step_seconds = 0;
  double grad_norm = 0;
  int64_t resident_bytes = 0;
  int64_t device_peak_bytes = 0;  // peak GPU memory allocated so far; 0 on CPU
  double cpu_seconds = 0;         // this process's CPU time so far
  int64_t model_state_peak_bytes = 0;
  int64_t comm_bytes = 0;
  int64_t time_ms = 0;                      // Unix ms when the step ended
  std::vector<double> pipeline_stage_idle;  // per stage; empty without a pipeline
  double pipeline_bubble_theory = 0;
  std::optional<double> eval_loss;  // train.eval_every: on the steps an evaluation ran
  double mfu = 0;                   // 0 to 1; 0: unknown (StepRecord::mfu)
};

struct CheckpointReport {
  int64_t step = 0;
  std::string path;
  int64_t bytes = 0;
  std::optional<double> eval_loss;  // the evaluation's at this step, when one ran
  // What retention keeps after it (each step, path and eval_loss), oldest first.
  struct Kept {
    int64_t step = 0;
    std::string path;
    std::optional<double> eval_loss;
  };
  std::vector<Kept> kept;
};

// Which of `report.kept` a checkpoint report carries: the newest that fit, at most
// kMaxKeptCheckpoints of them and their paths at most `path_budget_bytes` together (the
// coordinator refuses a report over its size cap whole), oldest first, as indices.
std::vector<size_t> KeptToReport(const CheckpointReport& report, size_t path_budget_bytes);

// What the coordinator asked for since the last TakeCommands.
struct TrainerCommands {
  bool checkpoint_requested = false;  // write a checkpoint after the current step
  bool stop_requested = false;        // checkpoint, then exit 0
};

class Reporter {
 public:
  // `log`: where the one warning about a failing coordinator goes (a line, flushed).
  Reporter(const std::string& coordinator, std::string job_id, int attempt, int rank,
           void (*log)(const std::string& line));
  // Sends the queued reports while the coordinator answers (up to a minute), giving up 5 s after
  // its last answer save for the latest report (so a coordinator that is gone costs the exit about
  // 7 s), then joins the thread and logs how many reports were not sent.
  ~Reporter();

  void ReportStep(const StepReport& report);
  // Synchronous (checkpoints are rare and the coordinator should know before a stop). The
  // coordinator repeats checkpoint_requested in every reply until it has this report, so a
  // request seen in the reply to a step report sent before it is already served: it is dropped.
  void ReportCheckpoint(const CheckpointReport& report);
  // Commands received since the last call. A coordinator that says this is no longer the job's
  // running attempt (FAILED_PRECONDITION) asks for a stop.
  TrainerCommands TakeCommands();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CONTROL_REPORTER_H_
