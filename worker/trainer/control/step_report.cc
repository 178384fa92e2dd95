#include "worker/trainer/control/step_report.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace trainyard::trainer {
namespace {

int64_t ResidentBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// This process's CPU time so far, user and system.
double CpuSeconds() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepReporter>> StepReporter::Open(
    const std::string& metrics_file, Reporter* reporter, void (*log)(const std::string& line)) {
  std::unique_ptr<StepReporter> out(new StepReporter(reporter, log));
  if (!metrics_file.empty()) {
    out->metrics_.open(metrics_file, std::ios::app);
    if (!out->metrics_) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics-file: cannot open '", metrics_file, "'"));
    }
  }
  return out;
}

void StepReporter::Report(const StepRecord& r) {
  const LayoutStepStats& l = r.layout;
  // The measured bubble: the stages' mean idle share.
  double bubble = 0;
  for (double idle : r.stage_idle) bubble += idle / static_cast<double>(r.stage_idle.size());
  const std::string pipeline_fields =
      !l.pipeline_fields
          ? ""
          : absl::StrFormat(
                " pipeline_bubble %.3f (theory %.3f) in_flight_peak %d activation_peak_bytes %d",
                bubble, l.pipeline_bubble_theory, l.pipeline_in_flight_peak,
                l.pipeline_activation_peak_bytes);
  log_(absl::StrFormat(
      "step %d/%d loss %.4f lr %.2e grad_norm %.2f tok/s %.0f step_ms %.0f%s "
      "comm_wait_ms %.1f allreduce_bytes %d comm_bytes %d model_state_peak_bytes %d%s%s%s%s%s",
      r.step, r.total_steps, r.loss, r.lr, r.grad_norm, r.tokens_per_second, r.step_seconds * 1e3,
      r.backward_seconds ? absl::StrFormat(" backward_ms %.0f", *r.backward_seconds * 1e3) : "",
      r.comm_wait_seconds * 1e3, l.allreduce_bytes, r.comm_bytes, l.model_state_peak_bytes,
      l.log_fields, pipeline_fields,
      r.loss_scale ? absl::StrFormat(" loss_scale %g skipped_steps %d", r.loss_scale->scale,
                                     r.loss_scale->skipped_steps)
                   : "",
      r.device_peak_bytes ? absl::StrCat(" device_peak_bytes ", *r.device_peak_bytes) : "",
      r.mfu ? absl::StrFormat(" mfu %.1f%%", 100 * *r.mfu) : ""));
  if (r.eval_loss.has_value()) {
    log_(absl::StrFormat("eval step %d eval_loss %.4f perplexity %.3f (%d held-out windows)",
                         r.step, *r.eval_loss, std::exp(*r.eval_loss), r.eval_windows));
  }
  if (metrics_.is_open()) {
    nlohmann::json line = {{"step", r.step},
                           {"loss", r.loss},
                           {"lr", r.lr},
                           {"grad_norm", r.grad_norm},
                           {"tokens_per_second", r.tokens_per_second},
                           {"step_seconds", r.step_seconds},
                           {"comm_wait_seconds", r.comm_wait_seconds},
                           {"allreduce_bytes", l.allreduce_bytes},
                           {"comm_bytes", r.comm_bytes},
                           {"pipeline_bubble", bubble},
                           {"pipeline_bubble_theory", l.pipeline_bubble_theory},
                           {"pipeline_in_flight_peak", l.pipeline_in_flight_peak},
                           {"pipeline_activation_peak_bytes", l.pipeline_activation_peak_bytes},
                           {"model_state_peak_bytes", l.model_state_peak_bytes}};
    if (r.loss_scale) {
      line["loss_scale"] = r.loss_scale->scale;
      line["skipped"] = r.loss_scale->skipped;
      line["skipped_steps"] = r.loss_scale->skipped_steps;
    }
    if (r.backward_seconds) line["backward_seconds"] = *r.backward_seconds;
    if (r.device_peak_bytes) line["device_peak_bytes"] = *r.device_peak_bytes;
    if (r.mfu) line["mfu"] = *r.mfu;
    if (r.eval_loss.has_value()) {
      line["eval_loss"] = *r.eval_loss;
      line["eval_perplexity"] = std::exp(*r.eval_loss);
    }
    metrics_ << line.dump() << std::endl;
  }
  if (reporter_ != nullptr) {
    StepReport report;
    report.step = r.step;
    report.total_steps = r.total_steps;
    report.loss = r.loss;
    report.lr = r.lr;
    report.tokens_per_second = r.tokens_per_second;
    report.mfu = r.mfu.value_or(0);
    report.step_seconds = r.step_seconds;
    report.grad_norm = r.grad_norm;
    report.resident_bytes = ResidentBytes();
    report.device_peak_bytes = r.device_peak_bytes.value_or(0);
    report.cpu_seconds = CpuSeconds();
    report.model_state_peak_bytes = l.model_state_peak_bytes;
    report.comm_bytes = r.comm_bytes;
    report.time_ms = UnixMillis();
    report.pipeline_stage_idle = r.stage_idle;
    report.pipeline_bubble_theory = l.pipeline_bubble_theory;
    report.eval_loss = r.eval_loss;
    reporter_->ReportStep(report);
  }
}

}  // namespace trainyard::trainer
