// JobManager: set-up, loading, and the lifecycle of jobs (submit, get, list, cancel, watch, the
// durable transitions, eviction of finished jobs) (see job_manager.h).
#include "server/coordinator/job_manager.h"
#include "server/coordinator/job_manager_internal.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/check.h"
#include "common/memory_estimate.h"
#include "common/ps_layout.h"
#include "common/spec.h"
#include "common/status_macros.h"
#include "server/coordinator/job_state.h"
#include "server/coordinator/scheduler.h"

namespace trainyard::coordinator {

std::string JobIdForSeq(int64_t seq) { return absl::StrCat("job-", seq); }

const std::string& AccountOf(const v1::Job& job) {
  static const std::string* const kDefault = new std::string(kDefaultAccount);
  return job.account().empty() ? *kDefault : job.account();
}

JobManager::JobManager(JobStore& store, NodeRegistry& nodes, Rendezvous& rendezvous,
                       const Clock& clock, JobManagerOptions options)
    : store_(store),
      nodes_(nodes),
      rendezvous_(rendezvous),
      clock_(clock),
      wakeup_(std::move(options.scheduler_wakeup)),
      rank_coordinators_(std::move(options.rank_coordinators)),
      preemption_(options.preemption),
      max_kept_checkpoints_(options.max_kept_checkpoints),
      preemption_grace_(options.preemption_grace),
      min_run_time_(options.min_run_time),
      max_preemption_grace_(options.max_preemption_grace),
      policy_(std::move(options.sharing)),
      credential_for_(std::move(options.job_credential)),
      checkpoint_root_(std::move(options.checkpoint_root)),
      metrics_(options.metrics),
      retention_(options.finished_job_retention),
      default_max_queued_jobs_(options.default_max_queued_jobs),
      max_pending_submits_(options.max_pending_submits),
      max_list_bytes_(options.max_list_bytes),
      end_records_(std::move(options.end_records)),
      usage_(options.fair_share_half_life, options.usage_reset) {}

absl::Duration JobManager::GraceOf(const v1::Job& job) const {
  const int64_t seconds = job.spec().preemption_grace_seconds();
  const absl::Duration grace = seconds > 0 ? absl::Seconds(seconds) : preemption_grace_;
  return std::min(grace, max_preemption_grace_);
}

std::string JobManager::CheckpointDir(const std::string& job_id) const {
  return absl::StrCat(checkpoint_root_, "/", job_id);
}

void JobManager::WakeScheduler() {
  if (wakeup_) wakeup_();
}

absl::Status JobManager::Load(const std::vector<StoredJob>& stored) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  std::vector<v1::Job> jobs(stored.size());
  std::set<std::string> awaited;  // named in an unfinished job's `after`
  for (size_t i = 0; i < stored.size(); ++i) {
    if (!jobs[i].ParseFromString(stored[i].payload)) {
      return absl::DataLossError(absl::StrCat("job ", stored[i].id, ": unreadable record"));
    }
    if (!IsTerminal(jobs[i].state())) {
      awaited.insert(jobs[i].spec().after().begin(), jobs[i].spec().after().end());
    }
  }
  for (v1::Job& job : jobs) {
    next_seq_ = std::max(next_seq_, job.seq() + 1);
    if (IsTerminal(job.state())) {
      // Finished jobs past their retention stay in the store; one that did not succeed stays in
      // memory while a waiting job is after it, until the first pass fails that one.
      const bool awaited_failure = job.state() != v1::SUCCEEDED && awaited.count(job.id()) > 0;
      if (absl::FromUnixMillis(job.end_time_ms()) + retention_ <= now && !awaited_failure) {
        jobs_in_store_only_ = true;
        continue;
      }
      finished_by_end_.insert({job.end_time_ms(), job.id()});
    }
    ids_by_seq_[job.seq()] = job.id();
    watchers_.SetDurable(job.id(), job.version());
    if (!IsTerminal(job.state())) AddUnfinished(job);
    if (job.state() == v1::QUEUED) ++queued_by_owner_[job.owner()];
    if (IsActive(job.state())) {
      for (const auto& p : job.placement()) {
        for (int device : p.device_indices()) devices_.Hold(p.node_id(), device);
      }
      if (job.master_port() != 0 && job.placement_size() > 0) {
        devices_.HoldPort(job.placement(0).node_id(), job.master_port());
      }
      rendezvous_.OpenScope({job.id(), job.attempt()});
    }
    jobs_[job.id()] = std::move(job);
  }
  return absl::OkStatus();
}

v1::Job* JobManager::Find(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

void JobManager::Transition(v1::Job& job, v1::JobState to, std::string message) {
  TY_CHECK(IsValidTransition(job.state(), to),
           absl::StrCat("job ", job.id(), ": ", v1::JobState_Name(job.state()), " -> ",
                        v1::JobState_Name(to)));
  if (job.state() == v1::QUEUED && --queued_by_owner_[job.owner()] == 0) {
    queued_by_owner_.erase(job.owner());
  }
  if (to == v1::QUEUED) ++queued_by_owner_[job.owner()];
  if (IsTerminal(to)) ends_to_store_.insert(job.id());
  job.set_state(to);
  job.set_message(std::move(message));
  job.set_version(job.version() + 1);
  if (IsTerminal(to)) {
    job.set_end_time_ms(NowMs(clock_));
    RemoveUnfinished(job);
    devices_.ForgetExited(job.id());
    finished_by_end_.insert({job.end_time_ms(), job.id()});
  }
}

bool JobManager::IsAwaited(const std::string& job_id) const {
  if (unfinished_with_after_ == 0) return false;
  for (const std::string& id : unfinished_) {
    const auto& after = jobs_.at(id).spec().after();
    if (std::find(after.begin(), after.end(), job_id) != after.end()) return true;
  }
  return false;
}

void JobManager::AddUnfinished(const v1::Job& job) {
  if (!unfinished_.insert(job.id()).second) return;
  if (job.spec().after_size() > 0) ++unfinished_with_after_;
  if (job.spec().array().max_running() > 0) ++unfinished_array_tasks_;
}

void JobManager::RemoveUnfinished(const v1::Job& job) {
  if (unfinished_.erase(job.id()) == 0) return;
  if (job.spec().after_size() > 0) --unfinished_with_after_;
  if (job.spec().array().max_running() > 0) --unfinished_array_tasks_;
}

void JobManager::Persist(const v1::Job& job, std::function<void(absl::Status)> after) {
  WriteBatch batch;
  batch.put_jobs.push_back(ToStored(job));
  // The end's own write carries the job's logs and metrics; later writes of the ended job (its
  // other ranks' exits) do not encode them again.
  const bool ends = ends_to_store_.erase(job.id()) > 0;
  if (ends && end_records_) batch.put_records = end_records_(job);
  std::vector<std::pair<std::string, v1::CoordinatorMessage>> stops;
  if (auto it = stops_after_write_.find(job.id()); it != stops_after_write_.end()) {
    stops = std::move(it->second);
    stops_after_write_.erase(it);
    auto& in_flight = stops_in_flight_[job.id()];
    for (const auto& [node_id, stop] : stops) in_flight.emplace(node_id, stop.cancel().attempt());
  }
  store_.Commit(std::move(batch), [this, job, ends, stops = std::move(stops),
                                   after = std::move(after)](absl::Status s) {
    std::vector<std::pair<std::string, v1::CoordinatorMessage>> send;
    {
      absl::MutexLock lock(&mu_);
      if (!stops.empty()) {
        if (auto in_flight = stops_in_flight_.find(job.id()); in_flight != stops_in_flight_.end()) {
          for (const auto& [node_id, stop] : stops) {
            auto one = in_flight->second.find({node_id, stop.cancel().attempt()});
            if (one != in_flight->second.end()) in_flight->second.erase(one);
          }
          if (in_flight->second.empty()) stops_in_flight_.erase(in_flight);
        }
      }
      if (!s.ok()) {
        spdlog::error("store: writing job {} failed (written again shortly): {}", job.id(),
                      s.ToString());
        unsaved_.insert(job.id());
        if (ends) ends_to_store_.insert(job.id());  // (its logs and metrics go with the retry)
        // (Its stops go with the retry too, before any released after them.)
        auto& later = stops_after_write_[job.id()];
        later.insert(later.begin(), stops.begin(), stops.end());
      } else {
        send = stops;
        // Those an earlier write of the job left when it failed: this later one holds their
        // release too (a job's writes are durable in order).
        if (auto left = stops_after_write_.find(job.id()); left != stops_after_write_.end()) {
          send.insert(send.begin(), left->second.begin(), left->second.end());
          stops_after_write_.erase(left);
        }
      }
    }
    if (s.ok()) {
      // Durable now: said first, so that a rank that hears its stop and reports meanwhile is told
      // to stop too (the report asks whether the release is durable; it raced the stop).
      NotifyWatchers(job);
      // Its ranks are stopped once the job's state that no longer runs them is durable.
      for (const auto& [node_id, stop] : send) nodes_.Send(node_id, stop);
    }
    if (after) after(s);
  });
}

int JobManager::RetryUnsaved() {
  absl::MutexLock lock(&mu_);
  std::set<std::string> ids;
  ids.swap(unsaved_);
  int written = 0;
  for (const std::string& id : ids) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;
    const v1::Job& job = it->second;
    std::vector<std::pair<std::string, v1::Assignment>> assignments;
    if (IsActive(job.state())) assignments = AssignmentsOf(job);
    Persist(job, [this, assignments = std::move(assignments)](absl::Status s) {
      if (!s.ok()) return;
      for (const auto& [node_id, a] : assignments) {
        v1::CoordinatorMessage m;
        *m.mutable_assignment() = a;
        nodes_.Send(node_id, m);
      }
    });
    ++written;
  }
  return written;
}

void JobManager::NotifyWatchers(const v1::Job& job) {
  std::vector<std::shared_ptr<WatchCallback>> callbacks;
  {
    // Recording the durable version and collecting watchers under one lock: a concurrent Watch
    // either sees this version as durable or is among the watchers notified of it.
    absl::MutexLock lock(&mu_);
    callbacks = watchers_.Durable(job.id(), job.version());
  }
  for (const auto& cb : callbacks) (*cb)(job);
}

absl::StatusOr<v1::Job> JobManager::Get(const std::string& job_id) const {
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) return it->second;
  }
  return ReadFromStore(job_id);
}

absl::StatusOr<v1::Job> JobManager::ReadFromStore(const std::string& job_id) const {
  absl::StatusOr<StoredJob> stored = store_.GetJob(job_id);
  if (absl::IsNotFound(stored.status())) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
  }
  if (!stored.ok()) return stored.status();
  v1::Job job;
  if (!job.ParseFromString(stored->payload)) {
    return absl::DataLossError(absl::StrCat("job ", job_id, ": unreadable record in the store"));
  }
  return job;
}

std::vector<std::string> JobManager::UnfinishedJobIds() const {
  absl::MutexLock lock(&mu_);
  return std::vector<std::string>(unfinished_.begin(), unfinished_.end());
}

std::vector<std::pair<std::string, int64_t>> JobManager::ResidentJobEnds() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, int64_t>> out;
  out.reserve(jobs_.size());
  for (const auto& [id, job] : jobs_) {
    out.emplace_back(id, IsTerminal(job.state()) ? job.end_time_ms() : 0);
  }
  return out;
}

std::vector<v1::Job> JobManager::TakeEvictionCandidates(size_t max) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> out;
  if (retention_ == absl::InfiniteDuration()) return out;
  const int64_t cutoff_ms = absl::ToUnixMillis(clock_.Now() - retention_);
  for (auto it = finished_by_end_.begin();
       it != finished_by_end_.end() && it->first <= cutoff_ms && out.size() < max; ++it) {
    const std::string& id = it->second;
    if (evicting_.count(id) > 0) continue;
    const v1::Job& job = jobs_.at(id);
    if (!watchers_.IsDurable(id, job.version())) continue;
    // Ranks still stopping may send lines; the job stays until they exit (or the drain ends).
    if (devices_.AnyDraining(id)) continue;
    // A job that did not succeed stays while a waiting job is `after` it, until the next pass
    // fails that one (a job no longer held is taken to have succeeded: UnmetDependency).
    if (job.state() != v1::SUCCEEDED && IsAwaited(id)) continue;
    evicting_.insert(id);
    out.push_back(job);
  }
  return out;
}

void JobManager::Evict(const std::vector<std::string>& job_ids) {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : job_ids) {
    if (evicting_.erase(id) == 0) continue;
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;
    finished_by_end_.erase({it->second.end_time_ms(), id});
    ids_by_seq_.erase(it->second.seq());
    watchers_.Forget(id);
    preempt_stopped_.erase(id);
    if (last_pass_.has_value()) last_pass_->waits.erase(id);
    jobs_.erase(it);
    jobs_in_store_only_ = true;
  }
}

void JobManager::EvictionFailed(const std::vector<std::string>& job_ids) {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : job_ids) evicting_.erase(id);
}

bool JobManager::IsResident(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  return jobs_.count(job_id) > 0;
}

size_t JobManager::ResidentJobs() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

bool JobManager::Matches(const v1::Job& job, const std::set<int>& states,
                         const std::string& owner) {
  return (states.empty() || states.count(job.state()) > 0) &&
         (owner.empty() || job.owner() == owner);
}

absl::StatusOr<JobManager::ListResult> JobManager::List(const v1::ListJobsRequest& r) const {
  if (r.page_size() < 0 || r.page_size() > 1000) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: must be in 0..1000, got ", r.page_size()));
  }
  int64_t before_seq = std::numeric_limits<int64_t>::max();
  if (!r.page_token().empty() &&
      (!absl::SimpleAtoi(r.page_token(), &before_seq) || before_seq < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("page_token: malformed '", r.page_token(), "'"));
  }
  std::set<int> states;
  for (int i = 0; i < r.states_size(); ++i) {
    if (!v1::JobState_IsValid(r.states(i)) || r.states(i) == v1::JOB_STATE_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("states[", i, "]: unknown job state ", r.states(i)));
    }
    states.insert(r.states(i));
  }
  const size_t limit = r.page_size() == 0 ? 100 : static_cast<size_t>(r.page_size());
  return ListPage(r, before_seq, states, limit);
}

absl::StatusOr<JobManager::ListResult> JobManager::ListPage(const v1::ListJobsRequest& r,
                                                            int64_t before_seq,
                                                            const std::set<int>& states,
                                                            size_t limit) const {
  // The store's page first (one more row than needed, to know whether more follow), read without
  // the lock; then memory's, under it. Memory is the truth for a job it holds (the store's row may
  // be a few ms behind); a store row is taken only for a job that memory no longer holds, which
  // ended (so the row is final) unless it was evicted after the read.
  // While every job is in memory (nothing evicted yet), the store is not read.
  bool read_store = false;
  {
    absl::MutexLock lock(&mu_);
    read_store = jobs_in_store_only_;
  }
  std::vector<StoredJob> rows;
  if (read_store) {
    JobQuery query;
    query.before_seq = before_seq;
    query.owner = r.owner();
    for (int state : states) query.states.push_back(v1::JobState_Name(state));
    query.limit = limit + 1;
    ASSIGN_OR_RETURN(rows, store_.ListJobs(query));
  }
  const bool store_has_more = rows.size() > limit;
  if (store_has_more) rows.pop_back();
  std::map<int64_t, v1::Job, std::greater<>> page;  // newest first
  std::vector<std::string> reread;  // rows read while their job still ran; evicted since
  {
    absl::MutexLock lock(&mu_);
    for (auto it = std::make_reverse_iterator(ids_by_seq_.lower_bound(before_seq));
         it != ids_by_seq_.rend() && page.size() <= limit; ++it) {
      const v1::Job& job = jobs_.at(it->second);
      if (Matches(job, states, r.owner())) page.emplace(job.seq(), job);
    }
    for (const StoredJob& row : rows) {
      if (jobs_.count(row.id) > 0) continue;
      v1::Job job;
      if (!job.ParseFromString(row.payload)) {
        return absl::DataLossError(
            absl::StrCat("job ", row.id, ": unreadable record in the store"));
      }
      if (IsTerminal(job.state())) {
        page.emplace(job.seq(), std::move(job));
      } else {
        reread.push_back(row.id);
      }
    }
  }
  for (const std::string& id : reread) {
    absl::StatusOr<v1::Job> job = Get(id);
    if (job.ok() && Matches(*job, states, r.owner())) page.emplace(job->seq(), *std::move(job));
  }
  ListResult result;
  size_t bytes = 0;
  bool more = store_has_more;
  for (auto& [seq, job] : page) {
    const size_t job_bytes = job.ByteSizeLong() + 8;
    if (result.jobs.size() == limit ||
        (!result.jobs.empty() && bytes + job_bytes > max_list_bytes_)) {
      more = true;
      break;
    }
    bytes += job_bytes;
    result.jobs.push_back(std::move(job));
  }
  if (more && !result.jobs.empty()) {
    result.next_page_token = absl::StrCat(result.jobs.back().seq());
  }
  return result;
}

void JobManager::Cancel(const std::string& job_id, const std::string& reason, JobCallback done) {
  auto ended = [&](const v1::Job& job) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " already ended in state ", v1::JobState_Name(job.state())));
  };
  absl::ReleasableMutexLock lock(&mu_);
  v1::Job* job = Find(job_id);
  if (job == nullptr) {
    lock.Release();
    absl::StatusOr<v1::Job> stored = ReadFromStore(job_id);
    done(stored.ok() ? ended(*stored) : stored.status());
    return;
  }
  if (IsTerminal(job->state())) {
    done(ended(*job));
    return;
  }
  const std::string message = reason.empty() ? "cancelled by user" : reason;
  if (IsActive(job->state())) ReleaseAttempt(*job, message);
  Transition(*job, v1::CANCELLED, message);
  Persist(*job, [job = *job, done = std::move(done)](absl::Status s) {
    if (s.ok()) {
      done(job);
    } else {
      done(s);
    }
  });
  WakeScheduler();
}

absl::StatusOr<int64_t> JobManager::Watch(const std::string& job_id, WatchCallback on_change,
                                          v1::Job* current, bool* current_durable) {
  // A job not in memory is read from the store first, without the lock; a job evicted between
  // the check and the lock is read on the second round.
  for (int round = 0; round < 2; ++round) {
    std::optional<absl::StatusOr<v1::Job>> stored;
    if (round > 0 || !IsResident(job_id)) stored = ReadFromStore(job_id);
    absl::MutexLock lock(&mu_);
    if (v1::Job* job = Find(job_id); job != nullptr) {
      *current = *job;
      *current_durable = watchers_.IsDurable(job_id, job->version());
    } else if (stored.has_value()) {
      if (!stored->ok()) return stored->status();
      *current = **stored;
      *current_durable = true;
    } else {
      continue;
    }
    return watchers_.Add(job_id, std::move(on_change));
  }
  return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
}

void JobManager::Unwatch(int64_t handle) {
  absl::MutexLock lock(&mu_);
  watchers_.Remove(handle);
}

std::map<v1::JobState, int> JobManager::CountByState() const {
  absl::MutexLock lock(&mu_);
  std::map<v1::JobState, int> counts;
  for (const auto& [id, job] : jobs_) ++counts[job.state()];
  return counts;
}

std::vector<std::string> JobManager::RunningJobs() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const std::string& id : unfinished_) {
    if (IsActive(jobs_.at(id).state())) out.push_back(id);
  }
  return out;
}

}  // namespace trainyard::coordinator
