// Reporter (see reporter.h).
#include "worker/trainer/control/reporter.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/coordinator_channel.h"
#include "common/coordinator_endpoints.h"
#include "common/credentials.h"
#include "common/field_limits.h"
#include "common/tls.h"
#include "trainyard/v1/trainer.grpc.pb.h"

namespace trainyard::trainer {

std::vector<size_t> KeptToReport(const CheckpointReport& report, size_t path_budget_bytes) {
  std::vector<size_t> out;
  size_t bytes = 0;
  for (size_t i = report.kept.size(); i-- > 0;) {
    if (out.size() == static_cast<size_t>(kMaxKeptCheckpoints)) break;
    bytes += report.kept[i].path.size();
    if (bytes > path_budget_bytes) break;
    out.push_back(i);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

class Reporter::Impl {
 public:
  // At exit the queue is sent for as long as the coordinator answers: the drain gives up
  // kDrainTime after the stop or the last answer, and kDrainLimit after the stop in all (the
  // queue holds at most kMaxQueued reports).
  static constexpr absl::Duration kDrainTime = absl::Seconds(5);
  static constexpr absl::Duration kDrainLimit = absl::Seconds(60);

  Impl(const std::string& coordinator, std::string job_id, int attempt, int rank,
       void (*log)(const std::string&))
      : endpoints_(coordinator),
        stub_(NewStub(endpoints_.current())),
        bearer_(BearerFromEnv(kJobCredentialEnv)),
        job_id_(std::move(job_id)),
        attempt_(attempt),
        rank_(rank),
        log_(log),
        thread_([this] { Loop(); }) {}

  // Sends what is queued (every step: `yard metrics` lists them all) while the coordinator
  // answers, then only the latest, so that a coordinator out of reach does not hold the trainer's
  // exit long (and a slow one, on a busy machine, does not lose the last steps). Says how many
  // reports were not sent.
  ~Impl() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      stopped_at_ = absl::Now();
      drain_until_ = stopped_at_ + kDrainTime;
    }
    thread_.join();
    int64_t unsent = 0;
    {
      absl::MutexLock lock(&mu_);
      unsent = unsent_;
    }
    if (unsent > 0) {
      log_(absl::StrCat("warning: ", unsent, " step report", unsent == 1 ? " was" : "s were",
                        " not sent at exit (a rank waits ", absl::FormatDuration(kDrainTime),
                        " for the coordinator's answer, ", absl::FormatDuration(kDrainLimit),
                        " in all); yard metrics lacks those steps"));
    }
  }

  void ReportStep(const StepReport& s) {
    v1::StepReport r;
    r.set_job_id(job_id_);
    r.set_attempt(attempt_);
    r.set_rank(rank_);
    r.set_step(s.step);
    r.set_total_steps(s.total_steps);
    r.set_loss(s.loss);
    r.set_lr(s.lr);
    r.set_tokens_per_second(s.tokens_per_second);
    r.set_mfu(s.mfu);
    r.set_step_seconds(s.step_seconds);
    r.set_grad_norm(s.grad_norm);
    r.set_resident_bytes(s.resident_bytes);
    r.set_device_peak_bytes(s.device_peak_bytes);
    r.set_cpu_seconds(s.cpu_seconds);
    r.set_model_state_peak_bytes(s.model_state_peak_bytes);
    r.set_comm_bytes(s.comm_bytes);
    r.set_time_ms(s.time_ms);
    for (double idle : s.pipeline_stage_idle) r.add_pipeline_stage_idle(idle);
    r.set_pipeline_bubble_theory(s.pipeline_bubble_theory);
    if (s.eval_loss.has_value()) r.set_eval_loss(*s.eval_loss);
    absl::MutexLock lock(&mu_);
    r.set_seq(++last_seq_);
    if (queue_.size() >= kMaxQueued) queue_.pop_front();  // never grow without bound
    queue_.push_back(std::move(r));
  }

  void ReportCheckpoint(const CheckpointReport& c) {
    {
      absl::MutexLock lock(&mu_);
      checkpointed_step_ = c.step;
      pending_.checkpoint_requested = false;
    }
    v1::CheckpointReport r;
    r.set_job_id(job_id_);
    r.set_attempt(attempt_);
    r.set_step(c.step);
    r.set_path(c.path);
    r.set_bytes(c.bytes);
    // A non-finite eval loss (a diverged run) is left out: the coordinator takes finite ones only.
    auto finite = [](const std::optional<double>& x) { return x.has_value() && std::isfinite(*x); };
    if (finite(c.eval_loss)) r.set_eval_loss(*c.eval_loss);
    // The newest kept checkpoints whose paths fit in half the coordinator's report cap beside
    // this one's path (a step, an eval loss and framing add under 30 bytes an entry).
    const size_t budget = kMaxReportBytes / 2 - std::min(kMaxReportBytes / 2, c.path.size());
    for (size_t i : KeptToReport(c, budget)) {
      v1::KeptCheckpoint* kept = r.add_kept();
      kept->set_step(c.kept[i].step);
      kept->set_path(c.kept[i].path);
      if (finite(c.kept[i].eval_loss)) kept->set_eval_loss(*c.kept[i].eval_loss);
    }
    grpc::ClientContext ctx;
    Authorize(ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::TrainerCommands commands;
    const grpc::Status s = CurrentStub()->ReportCheckpoint(&ctx, r, &commands);
    Follow(s, ctx);
    Handle(s, commands, "ReportCheckpoint", c.step + 1);
  }

  TrainerCommands TakeCommands() {
    absl::MutexLock lock(&mu_);
    TrainerCommands out = pending_;
    pending_ = TrainerCommands();
    return out;
  }

 private:
  static std::shared_ptr<v1::TrainerService::Stub> NewStub(const std::string& address) {
    return v1::TrainerService::NewStub(grpc::CreateCustomChannel(
        address, ChannelCredentialsFromEnv(), CoordinatorChannelArguments()));
  }

  std::shared_ptr<v1::TrainerService::Stub> CurrentStub() {
    absl::MutexLock lock(&mu_);
    return stub_;
  }

  // After a failed call: the next goes to the leader a standby named, or to the next replica
  // (a failover while the rank trains).
  void Follow(const grpc::Status& s, const grpc::ClientContext& ctx) {
    if (s.ok() || !endpoints_.Follow(s, ctx)) return;
    auto next = NewStub(endpoints_.current());
    absl::MutexLock lock(&mu_);
    stub_ = std::move(next);
  }

  // The attempt's job credential, which the worker put in the environment.
  void Authorize(grpc::ClientContext& ctx) const {
    if (!bearer_.empty()) ctx.AddMetadata(kAuthorizationMetadata, bearer_);
  }

  // Sends the queue's reports in order. A report stays queued until the coordinator answered it:
  // one that failed for want of a coordinator (a failover, a restart) is tried again after a
  // pause, until the drain at exit runs out. Each answered report is kept (the newest
  // kRecentReports): an answer from a coordinator of another incarnation than the last means that
  // it recorded nothing of this report and may lack what its predecessor had not stored, so the
  // kept reports and this one are sent again, oldest first (it keeps each seq once).
  void Loop() {
    absl::Duration pause = absl::Milliseconds(100);
    while (true) {
      v1::StepReport report;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !queue_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;
        if (stopping_ && absl::Now() >= drain_until_) {
          while (queue_.size() > 1) {
            queue_.pop_front();
            ++unsent_;
          }
        }
        report = queue_.front();
        report.set_incarnation(incarnation_);
      }
      grpc::ClientContext ctx;
      Authorize(ctx);
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      v1::TrainerCommands commands;
      const grpc::Status s = CurrentStub()->ReportStep(&ctx, report, &commands);
      Follow(s, ctx);
      Handle(s, commands, "ReportStep", report.step());
      absl::MutexLock lock(&mu_);
      const bool retry =
          !s.ok() && Retryable(s.error_code()) && !(stopping_ && absl::Now() >= drain_until_);
      if (retry) {
        mu_.Unlock();
        absl::SleepFor(pause);
        mu_.Lock();
        pause = std::min(2 * pause, absl::Seconds(1));
        continue;
      }
      pause = absl::Milliseconds(100);
      // (The report may have been dropped from a full queue meanwhile.)
      if (!queue_.empty() && queue_.front().seq() == report.seq()) queue_.pop_front();
      if (!s.ok()) {
        if (stopping_ && Retryable(s.error_code())) ++unsent_;
        continue;
      }
      if (stopping_) drain_until_ = std::min(stopped_at_ + kDrainLimit, absl::Now() + kDrainTime);
      const bool moved = !incarnation_.empty() && commands.incarnation() != incarnation_;
      incarnation_ = commands.incarnation();
      if (moved && rank_ == 0) {
        queue_.push_front(std::move(report));
        while (!recent_.empty()) {
          queue_.push_front(std::move(recent_.back()));
          recent_.pop_back();
        }
        continue;
      }
      recent_.push_back(std::move(report));
      if (recent_.size() > kRecentReports) recent_.pop_front();
    }
  }

  // A call that failed for want of a coordinator (not for what it said).
  static bool Retryable(grpc::StatusCode code) {
    return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED ||
           code == grpc::StatusCode::CANCELLED || code == grpc::StatusCode::UNKNOWN ||
           code == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }

  // `step`: the last step the coordinator knew of when it replied.
  void Handle(const grpc::Status& s, const v1::TrainerCommands& commands, const char* call,
              int64_t step) {
    absl::MutexLock lock(&mu_);
    if (s.ok()) {
      if (commands.checkpoint_requested() && step > checkpointed_step_) {
        pending_.checkpoint_requested = true;
      }
      if (commands.stop_requested()) pending_.stop_requested = true;
      return;
    }
    if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      // Not the job's running attempt any more: stop gracefully.
      pending_.stop_requested = true;
    }
    if (!warned_) {
      warned_ = true;
      log_(absl::StrCat("warning: ", call, " to the coordinator failed (", s.error_code(), ": ",
                        s.error_message(), "); training goes on, further failures are not logged"));
    }
  }

  CoordinatorEndpoints endpoints_;
  std::shared_ptr<v1::TrainerService::Stub> stub_ ABSL_GUARDED_BY(mu_);
  const std::string bearer_;
  const std::string job_id_;
  const int attempt_;
  const int rank_;
  void (*const log_)(const std::string&);
  absl::Mutex mu_;
  static constexpr size_t kMaxQueued = 1024;
  static constexpr size_t kRecentReports = 1024;
  std::deque<v1::StepReport> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::StepReport> recent_ ABSL_GUARDED_BY(mu_);  // answered, newest last
  std::string incarnation_ ABSL_GUARDED_BY(mu_);            // of the last answer
  int64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  TrainerCommands pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time stopped_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time drain_until_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  int64_t unsent_ ABSL_GUARDED_BY(mu_) = 0;  // reports dropped at exit
  bool warned_ ABSL_GUARDED_BY(mu_) = false;
  int64_t checkpointed_step_ ABSL_GUARDED_BY(mu_) = -1;  // last checkpoint reported
  std::thread thread_;                                   // last: starts once the rest is built
};

Reporter::Reporter(const std::string& coordinator, std::string job_id, int attempt, int rank,
                   void (*log)(const std::string& line))
    : impl_(std::make_unique<Impl>(coordinator, std::move(job_id), attempt, rank, log)) {}

Reporter::~Reporter() = default;

void Reporter::ReportStep(const StepReport& report) { impl_->ReportStep(report); }

void Reporter::ReportCheckpoint(const CheckpointReport& report) { impl_->ReportCheckpoint(report); }

TrainerCommands Reporter::TakeCommands() { return impl_->TakeCommands(); }

}  // namespace trainyard::trainer
