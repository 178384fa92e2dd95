// JobManager: attempts and the events of nodes and ranks (placement released, preemption done,
// failures, lost nodes, hellos, rank status, step and checkpoint reports) (see job_manager.h).
#include "server/coordinator/job_manager.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "absl/algorithm/container.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/check.h"
#include "common/log_text.h"
#include "common/placement.h"
#include "common/ps_layout.h"
#include "common/spec.h"
#include "common/status_macros.h"
#include "server/coordinator/job_manager_internal.h"
#include "server/coordinator/job_state.h"
#include "server/coordinator/scheduler.h"

namespace trainyard::coordinator {

absl::StatusOr<v1::Job*> JobManager::FindRunningAttempt(const std::string& job_id, int attempt) {
  v1::Job* job = Find(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
  if (!IsActive(job->state()) || job->attempt() != attempt) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " attempt ", attempt, " is not running"));
  }
  return job;
}

v1::TrainerCommands JobManager::CommandsFor(const v1::Job& job) const {
  v1::TrainerCommands commands;
  commands.set_checkpoint_requested(job.state() == v1::CHECKPOINTING);
  // Preempted (or its node drained): checkpoint, then stop (the trainer exits 0 after the
  // checkpoint), once the ask is durable. Asked before, a coordinator that restarted without it
  // found the job running and its ranks exited 0: SUCCEEDED, its steps unfinished.
  const auto asked = stop_asked_at_.find(job.id());
  commands.set_stop_requested(
      job.preempt_deadline_ms() != 0 &&
      (asked == stop_asked_at_.end() || watchers_.IsDurable(job.id(), asked->second)));
  return commands;
}

void JobManager::RequestCheckpoint(const std::string& job_id, JobCallback done) {
  auto not_running = [&](const v1::Job& job) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is ",
                                                      v1::JobState_Name(job.state()),
                                                      "; only a RUNNING job can checkpoint"));
  };
  absl::ReleasableMutexLock lock(&mu_);
  v1::Job* job = Find(job_id);
  if (job == nullptr) {
    lock.Release();
    absl::StatusOr<v1::Job> stored = ReadFromStore(job_id);
    done(stored.ok() ? not_running(*stored) : stored.status());
    return;
  }
  if (job->state() == v1::CHECKPOINTING) {
    done(*job);  // already asked; the ranks have not answered yet
    return;
  }
  if (job->state() != v1::RUNNING) {
    done(not_running(*job));
    return;
  }
  Transition(*job, v1::CHECKPOINTING, "checkpoint requested");
  Persist(*job, [job = *job, done = std::move(done)](absl::Status s) {
    if (s.ok()) {
      done(job);
    } else {
      done(s);
    }
  });
}

absl::StatusOr<v1::Job> JobManager::Signal(const std::string& job_id, const std::string& signal) {
  absl::ReleasableMutexLock lock(&mu_);
  const v1::Job* job = Find(job_id);
  if (job == nullptr) {
    lock.Release();
    ASSIGN_OR_RETURN(v1::Job stored, ReadFromStore(job_id));
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is ",
                                                      v1::JobState_Name(stored.state()),
                                                      "; only running ranks take signals"));
  }
  if (!IsActive(job->state()) || job->placement_size() == 0) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is ",
                                                      v1::JobState_Name(job->state()),
                                                      "; only running ranks take signals"));
  }
  v1::CoordinatorMessage message;
  v1::SignalRanks* s = message.mutable_signal();
  s->set_job_id(job->id());
  s->set_attempt(job->attempt());
  s->set_signal(signal);
  std::set<std::string> nodes;
  for (const auto& p : job->placement()) {
    if (nodes.insert(p.node_id()).second) nodes_.Send(p.node_id(), message);
  }
  return *job;
}

absl::Time JobManager::DrainDeadline(const std::string& node_id, const v1::Job* job,
                                     std::optional<absl::Duration> reported) const {
  if (reported.has_value()) return clock_.Now() + std::max(kDrainTimeout, *reported + kDrainMargin);
  const std::optional<int64_t> job_grace =
      job != nullptr ? std::optional<int64_t>(job->spec().stop_grace_seconds()) : std::nullopt;
  return clock_.Now() +
         std::max(kDrainTimeout, nodes_.StopGraceOf(node_id, job_grace) + kDrainMargin);
}

bool JobManager::InStopGrace(const v1::Job& job, int attempt, int rank) const {
  return job.attempt() == attempt && !IsActive(job.state()) &&
         devices_.IsDraining({job.id(), attempt, rank});
}

namespace {

v1::TrainerCommands StopCommands() {
  v1::TrainerCommands stop;
  stop.set_stop_requested(true);
  return stop;
}

}  // namespace

absl::StatusOr<v1::TrainerCommands> JobManager::OnStepReport(const v1::StepReport& report,
                                                             bool& record) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<v1::Job*> running = FindRunningAttempt(report.job_id(), report.attempt());
  if (!running.ok()) {
    const v1::Job* job = Find(report.job_id());
    if (job != nullptr && InStopGrace(*job, report.attempt(), report.rank())) {
      record = false;
      // Its release not yet durable: going on until it is (its stop comes then).
      if (!watchers_.IsDurable(job->id(), job->version())) return v1::TrainerCommands();
      return StopCommands();
    }
    return running.status();
  }
  v1::Job* job = *running;
  // Progress is kept in memory only: a write per step would cost more than it is worth. It is
  // stored with the next durable change of the job. Rank 0's is the job's.
  if (record) {
    job->set_step(report.step());
    job->set_loss(report.loss());
    job->set_device_peak_bytes(std::max<int64_t>(0, report.device_peak_bytes()));
    if (std::isfinite(report.cpu_seconds()) && report.cpu_seconds() >= 0) {
      job->set_cpu_seconds(report.cpu_seconds());
    }
    if (report.has_eval_loss() && std::isfinite(report.eval_loss())) {
      job->set_eval_loss(report.eval_loss());
    }
  }
  return CommandsFor(*job);
}

absl::StatusOr<v1::TrainerCommands> JobManager::OnCheckpointReport(
    const v1::CheckpointReport& report) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<v1::Job*> running = FindRunningAttempt(report.job_id(), report.attempt());
  if (!running.ok()) {
    // A program that saves in its SIGTERM handler after a cancel: recorded all the same (rank 0
    // reports checkpoints), so that describe shows it and a next attempt resumes from it.
    v1::Job* job = Find(report.job_id());
    if (job == nullptr || !InStopGrace(*job, report.attempt(), 0)) return running.status();
    const bool released = watchers_.IsDurable(job->id(), job->version());
    RecordCheckpoint(*job, report);
    job->set_version(job->version() + 1);
    Persist(*job);
    // (Its release not yet durable: going on until it is; its stop comes then.)
    return released ? StopCommands() : v1::TrainerCommands();
  }
  v1::Job* job = *running;
  RecordCheckpoint(*job, report);
  if (job->state() == v1::CHECKPOINTING) {
    Transition(*job, v1::RUNNING, "");
  } else {
    job->set_version(job->version() + 1);
  }
  Persist(*job);
  return CommandsFor(*job);
}

void JobManager::RecordCheckpoint(v1::Job& job, const v1::CheckpointReport& report) {
  v1::CheckpointInfo* info = job.mutable_last_checkpoint();
  info->set_step(report.step());
  info->set_path(report.path());
  info->set_bytes(report.bytes());
  info->set_time_ms(NowMs(clock_));
  info->set_attempt(report.attempt());
  if (report.has_eval_loss()) info->set_eval_loss(report.eval_loss());
  // What retention kept (at most kMaxKeptCheckpoints, checked by the service), for `yard
  // describe`; this one with its time.
  job.clear_kept_checkpoints();
  for (int i = 0; i < report.kept_size(); ++i) {
    v1::CheckpointInfo* kept = job.add_kept_checkpoints();
    kept->set_step(report.kept(i).step());
    kept->set_path(report.kept(i).path());
    if (report.kept(i).has_eval_loss()) kept->set_eval_loss(report.kept(i).eval_loss());
    if (report.kept(i).step() == report.step()) *kept = *info;
  }
  if (job.step() < report.step()) job.set_step(report.step());
}

void JobManager::ReleaseAttempt(v1::Job& job, const std::string& reason) {
  if (job.master_port() != 0 && job.placement_size() > 0) {
    devices_.ReleasePort(job.placement(0).node_id(), job.master_port());
    job.set_master_port(0);
  }
  v1::CoordinatorMessage cancel;
  cancel.mutable_cancel()->set_job_id(job.id());
  cancel.mutable_cancel()->set_attempt(job.attempt());
  cancel.mutable_cancel()->set_reason(reason);
  const std::set<int>& exited = devices_.Exited(job.id());
  for (const auto& p : job.placement()) {
    const absl::Time drain_deadline = DrainDeadline(p.node_id(), &job);
    // A rank still running keeps its device until it reports its exit (every rank sharing it).
    std::set<int> draining;
    for (int i = 0; i < RanksOf(p); ++i) {
      const int rank = p.first_rank() + i;
      const DeviceLedger::RankKey key{job.id(), job.attempt(), rank};
      const auto reported = reported_graces_.find(key);
      std::optional<absl::Duration> grace;
      if (reported != reported_graces_.end()) {
        grace = reported->second;
        reported_graces_.erase(reported);
      }
      if (reason.empty() || exited.count(rank) > 0) continue;
      const int device = DeviceOfRank(p, i);
      devices_.Drain(key, p.node_id(), device,
                     grace.has_value() ? DrainDeadline(p.node_id(), &job, grace) : drain_deadline);
      draining.insert(device);
    }
    for (const int device : p.device_indices()) {
      if (draining.count(device) == 0) devices_.Free(p.node_id(), device);
    }
    if (!reason.empty()) stops_after_write_[job.id()].emplace_back(p.node_id(), cancel);
  }
  // Parameter servers free the attempt's shards (their memory is free here at once).
  for (const v1::PsRange& r : job.ps_placement()) {
    stops_after_write_[job.id()].emplace_back(r.node_id(), cancel);
  }
  job.clear_ps_placement();
  rendezvous_.CloseScope({job.id(), job.attempt()});
  devices_.ForgetExited(job.id());
  // A preemption asked of this attempt ends with it (the next attempt is not asked to stop).
  job.set_preempt_deadline_ms(0);
  preempt_stopped_.erase(job.id());
  stop_asked_at_.erase(job.id());
}

void JobManager::Preempted(v1::Job& job) {
  preempt_stopped_.erase(job.id());
  job.clear_placement();
  job.set_preempt_deadline_ms(0);
  job.set_preemptions(job.preemptions() + 1);
  Transition(job, v1::PREEMPTED,
             absl::StrCat("preempted by ", job.preempted_by(), " at step ", job.step(),
                          job.last_checkpoint().step() > 0
                              ? absl::StrCat("; resumes from the checkpoint of step ",
                                             job.last_checkpoint().step())
                              : std::string("; no checkpoint yet: starts over")));
}

void JobManager::FailAttempt(v1::Job& job, const std::string& reason,
                             const std::set<std::string>& lost) {
  ReleaseAttempt(job, reason);
  if (auto stops = stops_after_write_.find(job.id());
      !lost.empty() && stops != stops_after_write_.end()) {
    auto& pending = stops->second;
    for (auto it = pending.begin(); it != pending.end();) {
      if (lost.count(it->first) == 0) {
        ++it;
        continue;
      }
      nodes_.Send(it->first, it->second);
      it = pending.erase(it);
    }
  }
  if (job.restarts() < job.spec().max_restarts()) {
    job.set_restarts(job.restarts() + 1);
    job.clear_placement();
    Transition(
        job, v1::RESTARTING,
        absl::StrCat(reason, " (restart ", job.restarts(), " of ", job.spec().max_restarts(), ")"));
  } else {
    Transition(job, v1::FAILED,
               job.spec().max_restarts() == 0 ? reason
                                              : absl::StrCat(reason, " (no restarts left of ",
                                                             job.spec().max_restarts(), ")"));
  }
  Persist(job);
  WakeScheduler();
}

int JobManager::EnforceRuntimeLimits() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  std::vector<std::string> expired;
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    const int64_t limit_s = job.spec().max_runtime_seconds();
    if (IsActive(job.state()) && limit_s > 0 &&
        now - absl::FromUnixMillis(job.start_time_ms()) > absl::Seconds(limit_s)) {
      expired.push_back(id);
    }
  }
  for (const std::string& id : expired) {
    v1::Job& job = jobs_.at(id);
    const std::string reason =
        absl::StrCat("exceeded max_runtime of ",
                     absl::FormatDuration(absl::Seconds(job.spec().max_runtime_seconds())));
    ReleaseAttempt(job, reason);
    Transition(job, v1::FAILED, reason);
    Persist(job);
  }
  // Preempted jobs past their grace: their ranks are stopped (SIGTERM, then SIGKILL); their
  // exits move them to PREEMPTED.
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (!IsActive(job.state()) || job.preempt_deadline_ms() == 0 ||
        absl::FromUnixMillis(job.preempt_deadline_ms()) > now || preempt_stopped_.count(id) > 0) {
      continue;
    }
    preempt_stopped_.insert(id);
    spdlog::warn("{} did not stop within its preemption grace: stopping its ranks", id);
    v1::CoordinatorMessage cancel;
    cancel.mutable_cancel()->set_job_id(id);
    cancel.mutable_cancel()->set_attempt(job.attempt());
    cancel.mutable_cancel()->set_reason(
        absl::StrCat("preempted by ", job.preempted_by(), ": grace period over"));
    for (const auto& p : job.placement()) nodes_.Send(p.node_id(), cancel);
  }
  if (!expired.empty()) WakeScheduler();
  return static_cast<int>(expired.size());
}

std::vector<std::string> JobManager::DrainNode(const std::string& node_id, const std::string& by) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  std::vector<std::string> asked;
  for (const std::string& id : unfinished_) {
    v1::Job& job = jobs_.at(id);
    if (!IsActive(job.state()) || job.preempt_deadline_ms() != 0) continue;
    const bool there =
        std::any_of(job.placement().begin(), job.placement().end(),
                    [&](const v1::RankPlacement& p) { return p.node_id() == node_id; });
    if (!there) continue;
    job.set_preempt_deadline_ms(absl::ToUnixMillis(now + GraceOf(job)));
    job.set_preempted_by(absl::StrCat("drain of node ", node_id));
    job.set_message(absl::StrCat("node ", node_id, " is drained by ", by,
                                 ": asked to checkpoint, stop and move"));
    job.set_version(job.version() + 1);
    stop_asked_at_[id] = job.version();
    Persist(job);
    asked.push_back(id);
    spdlog::info("draining node {} (by {}): {} asked to checkpoint and move; grace {}",
                 Quoted(node_id), Quoted(by), id, absl::FormatDuration(GraceOf(job)));
  }
  return asked;
}

void JobManager::OnNodesLost(const std::vector<std::string>& node_ids) {
  if (node_ids.empty()) return;
  absl::MutexLock lock(&mu_);
  const std::set<std::string> lost(node_ids.begin(), node_ids.end());
  std::vector<std::string> affected;
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (!IsActive(job.state())) continue;
    bool hit = false;
    for (const auto& p : job.placement()) hit = hit || lost.count(p.node_id()) > 0;
    for (const auto& r : job.ps_placement()) hit = hit || lost.count(r.node_id()) > 0;
    if (hit) affected.push_back(id);
  }
  for (const std::string& id : affected) {
    v1::Job& job = jobs_.at(id);
    std::string lost_names, lost_ps;
    for (const auto& p : job.placement()) {
      if (lost.count(p.node_id()) > 0)
        absl::StrAppend(&lost_names, lost_names.empty() ? "" : ", ", p.node_id());
    }
    for (const auto& r : job.ps_placement()) {
      if (lost.count(r.node_id()) > 0)
        absl::StrAppend(&lost_ps, lost_ps.empty() ? "" : ", ", r.node_id());
    }
    const std::string what =
        lost_names.empty() ? absl::StrCat("parameter server ", lost_ps)
                           : absl::StrCat("node ", lost_names,
                                          lost_ps.empty() ? "" : " and parameter server ", lost_ps);
    FailAttempt(job,
                absl::StrCat(what, " lost (no heartbeat for ",
                             absl::FormatDuration(nodes_.node_timeout()), ")"),
                lost);
  }
}

namespace {

// Whether rank `rank` of `job`'s current placement runs on `node_id`.
bool PlacedOn(const v1::Job& job, const std::string& node_id, int rank) {
  for (const v1::RankPlacement& p : job.placement()) {
    if (p.node_id() == node_id && rank >= p.first_rank() && rank < p.first_rank() + RanksOf(p)) {
      return true;
    }
  }
  return false;
}

}  // namespace

void JobManager::OnNodeHello(const std::string& node_id,
                             const google::protobuf::RepeatedPtrField<v1::RankStatus>& running) {
  {
    absl::MutexLock lock(&mu_);
    std::set<DeviceLedger::RankKey> alive;
    // The grace each one's shepherd gives it, where the node says (a worker restarted with a lower
    // --max-stop-grace still has ranks started with the old one).
    // (At most a day, as a node's own --stop-grace.)
    std::map<DeviceLedger::RankKey, absl::Duration> reported;
    for (const v1::RankStatus& r : running) {
      const DeviceLedger::RankKey key{r.job_id(), r.attempt(), r.rank()};
      alive.insert(key);
      if (!r.has_stop_grace_ms() || r.stop_grace_ms() <= 0) continue;
      reported[key] = std::min(absl::Milliseconds(r.stop_grace_ms()), kMaxReportedGrace);
      // A rank of a current attempt keeps it for when the attempt is stopped (ReleaseAttempt).
      const v1::Job* job = Find(r.job_id());
      if (job != nullptr && IsActive(job->state()) && r.attempt() == job->attempt() &&
          PlacedOn(*job, node_id, r.rank())) {
        reported_graces_[key] = reported[key];
      }
    }
    auto reported_of = [&](const DeviceLedger::RankKey& key) -> std::optional<absl::Duration> {
      const auto it = reported.find(key);
      if (it == reported.end()) return std::nullopt;
      return it->second;
    };
    // Those still running are told to stop (again) now: a new grace to report it, their
    // shepherd's as the node reports it, else their job's on the node as it is now.
    auto deadline_of = [&](const DeviceLedger::RankKey& key) {
      return DrainDeadline(node_id, Find(std::get<0>(key)), reported_of(key));
    };
    if (devices_.SettleNode(node_id, alive, deadline_of)) WakeScheduler();
    // Ranks of attempts that are no longer current and that this coordinator does not know to
    // be draining (it restarted since they were told to stop): their devices stay taken until
    // they report their exit, as for any draining rank, so no new rank shares them meanwhile.
    for (const v1::RankStatus& r : running) {
      const v1::Job* job = Find(r.job_id());
      const bool current =
          job != nullptr && IsActive(job->state()) && r.attempt() == job->attempt();
      const DeviceLedger::RankKey key{r.job_id(), r.attempt(), r.rank()};
      if (current || !r.has_device() || devices_.IsDraining(key)) continue;
      if (!devices_.Hold(node_id, r.device())) {
        spdlog::warn("node {} still runs rank {} of {} attempt {} on device {}, which is taken",
                     node_id, r.rank(), r.job_id(), r.attempt(), r.device());
        continue;
      }
      devices_.Drain(key, node_id, r.device(), DrainDeadline(node_id, job, reported_of(key)));
    }
  }
  for (const v1::RankStatus& r : running) OnRankStatus(node_id, r);
}

bool JobManager::RankRunsOn(const std::string& node_id, const std::string& job_id, int attempt,
                            int rank) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it != jobs_.end() && it->second.attempt() == attempt && PlacedOn(it->second, node_id, rank)) {
    return true;
  }
  return devices_.DrainsOn({job_id, attempt, rank}, node_id);
}

// What a rank that ended used, kept with its job (its latest kRankUsageKept ranks), persisted with
// the change its exit makes (OnRankStatus writes the job itself when the exit changes nothing:
// the job ended before it), and counted for Prometheus.
void JobManager::RecordRankUsage(v1::Job& job, const std::string& node_id,
                                 const v1::RankStatus& status) {
  constexpr int kRankUsageKept = 1024;
  v1::RankUsage usage = status.usage();
  usage.set_attempt(status.attempt());
  usage.set_rank(status.rank());
  usage.set_node_id(node_id);
  usage.set_exit_code(status.exit_code());
  if (!std::isfinite(usage.cpu_seconds()) || usage.cpu_seconds() < 0) usage.set_cpu_seconds(0);
  if (usage.peak_rss_bytes() < 0) usage.set_peak_rss_bytes(0);
  if (usage.memory_peak_bytes() < 0) usage.set_memory_peak_bytes(0);
  if (job.rank_usage_size() >= kRankUsageKept) {
    job.mutable_rank_usage()->DeleteSubrange(0, job.rank_usage_size() - kRankUsageKept + 1);
  }
  *job.add_rank_usage() = usage;
  if (metrics_ != nullptr) metrics_->ObserveRankUsage(AccountOf(job), usage);
}

bool JobManager::StopWaitsForWrite(const v1::Job* job, const std::string& node_id,
                                   const v1::RankStatus& status) const {
  // The release of the rank's attempt is not durable yet, and a stop of that attempt for this
  // node goes once it is (Persist).
  if (job == nullptr) return false;
  if (auto in_flight = stops_in_flight_.find(job->id());
      in_flight != stops_in_flight_.end() &&
      in_flight->second.count({node_id, status.attempt()}) > 0) {
    return true;
  }
  const auto pending = stops_after_write_.find(job->id());
  return pending != stops_after_write_.end() &&
         absl::c_any_of(pending->second, [&](const auto& stop) {
           return stop.first == node_id && stop.second.cancel().attempt() == status.attempt();
         });
}

void JobManager::OnRankStatus(const std::string& node_id, const v1::RankStatus& status) {
  absl::MutexLock lock(&mu_);
  v1::Job* job = Find(status.job_id());
  const bool current =
      job != nullptr && IsActive(job->state()) && status.attempt() == job->attempt();
  // A node's usage counts for the ranks it runs: the current attempt's placed there, or another
  // attempt's (or an ended job's) still stopping there.
  const bool placed = current && PlacedOn(*job, node_id, status.rank());
  const bool used =
      job != nullptr && status.phase() == v1::RANK_EXITED && status.has_usage() &&
      (current ? placed
               : devices_.DrainsOn({status.job_id(), status.attempt(), status.rank()}, node_id));
  if (used) RecordRankUsage(*job, node_id, status);
  if (current && !placed) {
    // A node speaks only for the ranks it runs.
    spdlog::warn("audit: node {} reported rank {} of {} attempt {}, which it does not run: ignored",
                 node_id, status.rank(), status.job_id(), status.attempt());
    return;
  }
  if (!current) {
    if (used) {
      // The rank of an ended job (cancelled: it exits after its stop grace) or of an earlier
      // attempt: no change of the job's is coming to carry its usage to the store and watchers.
      job->set_version(job->version() + 1);
      Persist(*job);
    }
    if (status.phase() == v1::RANK_EXITED) {
      if (devices_.EndDraining({status.job_id(), status.attempt(), status.rank()}, node_id)) {
        WakeScheduler();
      }
    } else if (!StopWaitsForWrite(job, node_id, status)) {
      v1::CoordinatorMessage cancel;
      cancel.mutable_cancel()->set_job_id(status.job_id());
      cancel.mutable_cancel()->set_attempt(status.attempt());
      cancel.mutable_cancel()->set_reason("attempt is no longer current");
      nodes_.Send(node_id, cancel);
    }
    return;
  }
  if (status.phase() != v1::RANK_EXITED) return;
  const bool preempting = job->preempt_deadline_ms() != 0;
  if (status.exit_code() == 0) {
    std::set<int>& done_ranks = devices_.Exited(job->id());
    done_ranks.insert(status.rank());
    if (static_cast<int>(done_ranks.size()) >= job->world_size()) {
      ReleaseAttempt(*job, "");
      // A preempted job that stopped before its last step waits to be placed again.
      // A command job's steps are its program's: asked to stop, it exits 0 after its checkpoint
      // and is placed again (its next attempt resumes, and ends at once if it had finished).
      if (preempting && (IsCommandJob(job->spec()) || job->step() < job->spec().train().steps())) {
        Preempted(*job);
      } else {
        job->set_preempt_deadline_ms(0);
        Transition(*job, v1::SUCCEEDED, "");
      }
      Persist(*job);
      WakeScheduler();
    }
    return;
  }
  if (preempting) {  // stopped after its grace (or failed while stopping): requeued all the same
    devices_.Exited(job->id()).insert(status.rank());
    ReleaseAttempt(*job, absl::StrCat("preempted by ", job->preempted_by()));
    Preempted(*job);
    Persist(*job);
    WakeScheduler();
    return;
  }
  devices_.Exited(job->id()).insert(status.rank());  // its device is free at once
  std::string reason = absl::StrCat("rank ", status.rank(), " on node ", node_id,
                                    " exited with code ", status.exit_code());
  if (!status.message().empty()) absl::StrAppend(&reason, ": ", status.message());
  FailAttempt(*job, reason);
}

}  // namespace trainyard::coordinator
