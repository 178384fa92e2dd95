#include "server/coordinator/job_manager.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/check.h"
#include "common/memory_estimate.h"
#include "common/ps_layout.h"
#include "common/spec.h"
#include "common/status_macros.h"
#include "server/coordinator/job_state.h"
#include "server/coordinator/scheduler.h"

namespace trainyard::coordinator {
namespace {

int64_t NowMs(const Clock& clock) { return absl::ToUnixMillis(clock.Now()); }

// Keys of the usage ledger.
std::string AccountKey(const std::string& account) { return absl::StrCat("account:", account); }
std::string UserKey(const std::string& user) { return absl::StrCat("user:", user); }

// When the head of the queue is expected to start, for why_waiting.
std::string StartText(const std::optional<absl::Time>& start, absl::Time now) {
  if (!start.has_value()) {
    return "start unknown: the devices are held by jobs without max_runtime";
  }
  return absl::StrCat("expected to start in ",
                      absl::FormatDuration(absl::Trunc(std::max(absl::ZeroDuration(), *start - now),
                                                       absl::Seconds(1))));
}

// How long the devices of a stopped rank on a connected node stay allocated when its exit is never
// reported (a lost message): longer than a worker's SIGTERM → SIGKILL grace (10 s by default).
constexpr absl::Duration kDrainTimeout = absl::Seconds(60);
// Placements one pass applies; the rest wait for the next pass, which follows at once. Bounds how
// long a pass holds the job manager under a burst (rank reports and submits wait for it).
constexpr int kMaxPlacementsPerPass = 128;

// Whether `node` takes `owner`'s jobs: it names no owners, or `owner` among them (a worker or
// parameter server registered with a node token limited to some owners' jobs).
bool TakesJobsOf(const v1::Node& node, const std::string& owner) {
  return node.owners().empty() ||
         std::find(node.owners().begin(), node.owners().end(), owner) != node.owners().end();
}

StoredJob ToStored(const v1::Job& job) {
  return StoredJob{job.id(), job.seq(), job.owner(), v1::JobState_Name(job.state()),
                   job.SerializeAsString()};
}

}  // namespace

std::string JobIdForSeq(int64_t seq) { return absl::StrCat("job-", seq); }

const std::string& AccountOf(const v1::Job& job) {
  static const std::string* const kDefault = new std::string(kDefaultAccount);
  return job.account().empty() ? *kDefault : job.account();
}

JobManager::JobManager(JobStore& store, NodeRegistry& nodes, Rendezvous& rendezvous,
                       const Clock& clock)
    : store_(store), nodes_(nodes), rendezvous_(rendezvous), clock_(clock) {}

void JobManager::SetSchedulerWakeup(std::function<void()> wakeup) { wakeup_ = std::move(wakeup); }

void JobManager::SetPreemption(bool enabled, absl::Duration grace, absl::Duration min_run_time,
                               absl::Duration max_grace) {
  preemption_ = enabled;
  preemption_grace_ = grace;
  min_run_time_ = min_run_time;
  max_preemption_grace_ = max_grace;
}

void JobManager::SetSharing(std::function<std::shared_ptr<const SharingPolicy>()> policy,
                            absl::Duration half_life) {
  policy_ = std::move(policy);
  absl::MutexLock lock(&mu_);
  usage_ = UsageLedger(half_life);
}

absl::Duration JobManager::GraceOf(const v1::Job& job) const {
  const int64_t seconds = job.spec().preemption_grace_seconds();
  const absl::Duration grace = seconds > 0 ? absl::Seconds(seconds) : preemption_grace_;
  return std::min(grace, max_preemption_grace_);
}

void JobManager::SetJobCredentials(
    std::function<std::string(const std::string& job_id, int32_t attempt)> credential_for) {
  credential_for_ = std::move(credential_for);
}

void JobManager::SetCoordinatorAddress(std::string address) {
  coordinator_address_ = std::move(address);
}

void JobManager::SetCheckpointRoot(std::string root) { checkpoint_root_ = std::move(root); }

std::string JobManager::CheckpointDir(const std::string& job_id) const {
  return absl::StrCat(checkpoint_root_, "/", job_id);
}

void JobManager::WakeScheduler() {
  if (wakeup_) wakeup_();
}

absl::Status JobManager::Load(const std::vector<StoredJob>& stored) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  for (const StoredJob& s : stored) {
    v1::Job job;
    if (!job.ParseFromString(s.payload)) {
      return absl::DataLossError(absl::StrCat("job ", s.id, ": unreadable record"));
    }
    next_seq_ = std::max(next_seq_, job.seq() + 1);
    if (IsTerminal(job.state())) {
      // Finished jobs past their retention stay in the store.
      if (absl::FromUnixMillis(job.end_time_ms()) + retention_ <= now) {
        jobs_in_store_only_ = true;
        continue;
      }
      finished_by_end_.insert({job.end_time_ms(), job.id()});
    }
    ids_by_seq_[job.seq()] = job.id();
    durable_version_[job.id()] = job.version();
    if (!IsTerminal(job.state())) unfinished_.insert(job.id());
    if (job.state() == v1::QUEUED) ++queued_by_owner_[job.owner()];
    if (IsActive(job.state())) {
      for (const auto& p : job.placement()) {
        allocated_[p.node_id()].insert(p.device_indices().begin(), p.device_indices().end());
      }
      if (job.master_port() != 0 && job.placement_size() > 0) {
        master_ports_[job.placement(0).node_id()].insert(job.master_port());
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
  job.set_state(to);
  job.set_message(std::move(message));
  job.set_version(job.version() + 1);
  if (IsTerminal(to)) {
    job.set_end_time_ms(NowMs(clock_));
    unfinished_.erase(job.id());
    finished_ranks_.erase(job.id());
    finished_by_end_.insert({job.end_time_ms(), job.id()});
  }
}

void JobManager::Persist(const v1::Job& job, std::function<void(absl::Status)> after) {
  WriteBatch batch;
  batch.put_jobs.push_back(ToStored(job));
  store_.Commit(std::move(batch), [this, job, after = std::move(after)](absl::Status s) {
    if (!s.ok()) {
      spdlog::error("store: writing job {} failed: {}", job.id(), s.ToString());
    } else {
      NotifyWatchers(job);
    }
    if (after) after(s);
  });
}

void JobManager::NotifyWatchers(const v1::Job& job) {
  std::vector<std::shared_ptr<WatchCallback>> callbacks;
  {
    // Recording the durable version and collecting watchers under one lock: a concurrent Watch
    // either sees this version as durable or is among the watchers notified of it.
    absl::MutexLock lock(&mu_);
    int64_t& durable = durable_version_[job.id()];
    durable = std::max(durable, job.version());
    for (const auto& [handle, w] : watchers_) {
      if (w.job_id == job.id()) callbacks.push_back(w.callback);
    }
  }
  for (const auto& cb : callbacks) (*cb)(job);
}

absl::Status JobManager::CheckFitsSomeNode(const v1::JobSpec& spec) const {
  // The largest device any ready node offers (a node's smallest device counts for it), and the
  // most devices on one node (the HYBRID_SHARD group), from the registry's index: O(1) in the
  // cluster's size. Devices of unknown size are not judged.
  const ClusterCapacity capacity = nodes_.Capacity();
  const int64_t device_bytes = capacity.largest_device_bytes;
  const int ranks_per_node = std::max(1, capacity.max_devices_per_node);
  if (device_bytes <= 0) return absl::OkStatus();
  const int world = spec.resources().gpus();
  const MemoryEstimate e = EstimateMemory(spec, world, ranks_per_node);
  if (e.total() <= device_bytes) return absl::OkStatus();
  auto gib = [](int64_t b) { return absl::StrFormat("%.2f GiB", b / double(int64_t{1} << 30)); };
  std::string message = absl::StrCat(
      "parallel.strategy: ", e.Name(), " ", MixedPrecisionName(e.precision), " needs ",
      gib(e.total()), " per rank (parameters ", gib(e.parameters), ", gradients ", gib(e.gradients),
      ", optimizer ", gib(e.optimizer), ", activations ", gib(e.activations),
      ") but the largest device of any node has ", gib(device_bytes));
  // The smallest strategy that fits (the model whole on every rank or sharded), then the smallest
  // model-parallel layout (pipeline stages, tensor-parallel ranks).
  const MemoryEstimate* best = nullptr;
  const MemoryEstimate* best_layout = nullptr;
  const std::vector<MemoryEstimate> all = EstimateAllStrategies(spec, world, ranks_per_node);
  for (const MemoryEstimate& other : all) {
    if (other.precision != e.precision || other.total() > device_bytes) continue;
    const MemoryEstimate*& slot =
        other.pipeline_stages > 1 || other.tensor_parallel > 1 ? best_layout : best;
    if (slot == nullptr || other.total() < slot->total()) slot = &other;
  }
  if (best != nullptr) {
    absl::StrAppend(&message, "; ", best->Name(), " would fit (", gib(best->total()), " per rank)");
  }
  if (best_layout != nullptr) {
    absl::StrAppend(&message, best != nullptr ? "; so would " : "; ", best_layout->Name(),
                    best != nullptr ? "" : " would fit", " (", gib(best_layout->total()),
                    " per rank)");
  }
  if (best == nullptr && best_layout == nullptr) {
    absl::StrAppend(&message, "; no strategy or layout fits at this precision and world size");
  }
  return absl::InvalidArgumentError(message);
}

absl::Status JobManager::CheckFitsParameterServers(const std::string& owner,
                                                   const v1::JobSpec& spec) const {
  if (spec.parallel().strategy() != v1::OFFLOAD) return absl::OkStatus();
  int64_t capacity = 0;
  int servers = 0;
  for (const v1::Node& n : nodes_.ListParameterServers()) {
    if (n.role() != v1::PARAMETER_SERVER || n.state() != v1::NODE_READY) continue;
    if (!TakesJobsOf(n, owner)) continue;
    capacity += n.memory_bytes();
    ++servers;
  }
  const int64_t params = ModelParameterCount(spec.model());
  const int64_t need = params * kPsBytesPerParam;
  if (need <= capacity) return absl::OkStatus();
  auto gib = [](int64_t b) { return absl::StrFormat("%.2f GiB", b / double(int64_t{1} << 30)); };
  if (servers == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "parallel.strategy: offload needs parameter servers (", gib(need), " for ", params,
        " parameters) but none that takes ", owner, "'s jobs is registered; start trainyard-ps"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("parallel.strategy: offload needs ", gib(need), " on parameter servers (",
                   params, " parameters x ", kPsBytesPerParam, " bytes) but the ", servers,
                   " registered parameter server(s) that take ", owner, "'s jobs offer ",
                   gib(capacity), " in all"));
}

std::map<std::string, int64_t> JobManager::ReservedPsBytes() const {
  std::map<std::string, int64_t> reserved;
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (!IsActive(job.state())) continue;
    for (const v1::PsRange& r : job.ps_placement()) {
      reserved[r.node_id()] += (r.end() - r.begin()) * kPsBytesPerParam;
    }
  }
  return reserved;
}

std::vector<PsCapacity> JobManager::ParameterServerCapacity(const std::string& owner) const {
  std::map<std::string, int64_t> reserved = ReservedPsBytes();
  std::vector<PsCapacity> out;
  for (const v1::Node& n : nodes_.ListParameterServers()) {
    if (n.role() != v1::PARAMETER_SERVER || n.state() != v1::NODE_READY || !n.connected() ||
        !TakesJobsOf(n, owner)) {
      continue;
    }
    out.push_back({n.id(), n.address(), n.memory_bytes() - reserved[n.id()]});
  }
  return out;
}

void JobManager::Submit(const std::string& owner, v1::JobSpec spec, JobCallback done) {
  ApplyJobSpecDefaults(spec);
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
    done(s);
    return;
  }
  // A command job's memory is its program's business.
  if (absl::Status s = IsCommandJob(spec) ? absl::OkStatus() : CheckFitsSomeNode(spec); !s.ok()) {
    done(s);
    return;
  }
  if (absl::Status s = CheckFitsParameterServers(owner, spec); !s.ok()) {
    done(s);
    return;
  }
  const std::shared_ptr<const SharingPolicy> current = CurrentPolicy();
  const SharingPolicy& policy = *current;
  v1::Job job;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckSharingLimits(policy, owner, spec); !s.ok()) {
      done(s);
      return;
    }
    if (max_pending_submits_ >= 0 && pending_submits_ >= max_pending_submits_) {
      // Back-pressure: accepted at the rate the store commits, not queued without bound.
      done(absl::ResourceExhaustedError(absl::StrCat(
          "the coordinator has ", pending_submits_,
          " submissions waiting for its store (--max-pending-submits); retry in a second, "
          "with backoff")));
      return;
    }
    ++pending_submits_;
    ++submitting_[owner];
    const int64_t seq = next_seq_++;
    job.set_id(JobIdForSeq(seq));
    job.set_seq(seq);
    job.set_owner(owner);
    job.set_account(policy.UserOf(owner).account);
    *job.mutable_spec() = std::move(spec);
    job.set_state(v1::QUEUED);
    job.set_submit_time_ms(NowMs(clock_));
    job.set_world_size(job.spec().resources().gpus());
    job.set_version(1);
    WriteBatch batch;
    batch.put_jobs.push_back(ToStored(job));
    // The job becomes visible only once durable: a crash before that loses nothing acknowledged.
    store_.Commit(std::move(batch), [this, job, done = std::move(done)](absl::Status s) {
      {
        absl::MutexLock lock(&mu_);
        --pending_submits_;
        if (--submitting_[job.owner()] == 0) submitting_.erase(job.owner());
      }
      if (!s.ok()) {
        done(absl::Status(s.code(), absl::StrCat("storing the job failed: ", s.message())));
        return;
      }
      {
        absl::MutexLock lock(&mu_);
        jobs_[job.id()] = job;
        ids_by_seq_[job.seq()] = job.id();
        unfinished_.insert(job.id());
        ++queued_by_owner_[job.owner()];
        durable_version_[job.id()] = job.version();
      }
      done(job);
      WakeScheduler();
    });
  }
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
    auto durable = durable_version_.find(id);
    if (durable == durable_version_.end() || durable->second < job.version()) continue;
    // Ranks still stopping may send lines; the job stays until they exit (or the drain ends).
    auto draining = draining_.lower_bound(
        {id, std::numeric_limits<int>::min(), std::numeric_limits<int>::min()});
    if (draining != draining_.end() && std::get<0>(draining->first) == id) continue;
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
    durable_version_.erase(id);
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
  // Preempted: checkpoint, then stop (the trainer exits 0 after the checkpoint).
  commands.set_stop_requested(job.preempt_deadline_ms() != 0);
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

absl::StatusOr<v1::TrainerCommands> JobManager::OnStepReport(const v1::StepReport& report) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job * job, FindRunningAttempt(report.job_id(), report.attempt()));
  // Progress is kept in memory only: a write per step would cost more than it is worth. It is
  // stored with the next durable change of the job. Rank 0's is the job's.
  if (report.rank() == 0) {
    job->set_step(report.step());
    job->set_loss(report.loss());
  }
  return CommandsFor(*job);
}

absl::StatusOr<v1::TrainerCommands> JobManager::OnCheckpointReport(
    const v1::CheckpointReport& report) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(v1::Job * job, FindRunningAttempt(report.job_id(), report.attempt()));
  v1::CheckpointInfo* info = job->mutable_last_checkpoint();
  info->set_step(report.step());
  info->set_path(report.path());
  info->set_bytes(report.bytes());
  info->set_time_ms(NowMs(clock_));
  info->set_attempt(report.attempt());
  if (job->step() < report.step()) job->set_step(report.step());
  if (job->state() == v1::CHECKPOINTING) {
    Transition(*job, v1::RUNNING, "");
  } else {
    job->set_version(job->version() + 1);
  }
  Persist(*job);
  return CommandsFor(*job);
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
      *current_durable = job->version() <= durable_version_[job_id];
    } else if (stored.has_value()) {
      if (!stored->ok()) return stored->status();
      *current = **stored;
      *current_durable = true;
    } else {
      continue;
    }
    const int64_t handle = next_watch_handle_++;
    watchers_[handle] = Watcher{job_id, std::make_shared<WatchCallback>(std::move(on_change))};
    return handle;
  }
  return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
}

void JobManager::Unwatch(int64_t handle) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(handle);
}

int JobManager::ReserveMasterPort(const std::string& node_id) {
  std::set<int>& used = master_ports_[node_id];
  for (int port = kFirstMasterPort; port < kFirstMasterPort + kMasterPorts; ++port) {
    if (used.insert(port).second) return port;
  }
  return 0;  // all in use: the rank 0 node's worker picks a free port itself
}

void JobManager::ReleaseAttempt(v1::Job& job, const std::string& reason) {
  if (job.master_port() != 0 && job.placement_size() > 0) {
    auto ports = master_ports_.find(job.placement(0).node_id());
    if (ports != master_ports_.end()) {
      ports->second.erase(job.master_port());
      if (ports->second.empty()) master_ports_.erase(ports);
    }
    job.set_master_port(0);
  }
  v1::CoordinatorMessage cancel;
  cancel.mutable_cancel()->set_job_id(job.id());
  cancel.mutable_cancel()->set_attempt(job.attempt());
  cancel.mutable_cancel()->set_reason(reason);
  const std::set<int>& exited = finished_ranks_[job.id()];
  const absl::Time drain_deadline = clock_.Now() + kDrainTimeout;
  for (const auto& p : job.placement()) {
    for (int i = 0; i < p.device_indices_size(); ++i) {
      const int rank = p.first_rank() + i;
      if (reason.empty() || exited.count(rank) > 0) {
        FreeDevice(p.node_id(), p.device_indices(i));
      } else {  // still running: the device is free once the rank reports its exit
        draining_[{job.id(), job.attempt(), rank}] =
            DrainingRank{p.node_id(), p.device_indices(i), drain_deadline};
      }
    }
    if (!reason.empty()) nodes_.Send(p.node_id(), cancel);
  }
  // Parameter servers free the attempt's shards (their memory is free here at once).
  for (const v1::PsRange& r : job.ps_placement()) nodes_.Send(r.node_id(), cancel);
  job.clear_ps_placement();
  rendezvous_.CloseScope({job.id(), job.attempt()});
  finished_ranks_.erase(job.id());
  // A preemption asked of this attempt ends with it (the next attempt is not asked to stop).
  job.set_preempt_deadline_ms(0);
  preempt_stopped_.erase(job.id());
}

void JobManager::FreeDevice(const std::string& node_id, int device) {
  auto held = allocated_.find(node_id);
  if (held == allocated_.end()) return;
  held->second.erase(device);
  if (held->second.empty()) allocated_.erase(held);
}

JobManager::DrainingMap::iterator JobManager::EndDraining(DrainingMap::iterator it) {
  FreeDevice(it->second.node_id, it->second.device);
  return draining_.erase(it);
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

void JobManager::FailAttempt(v1::Job& job, const std::string& reason) {
  ReleaseAttempt(job, reason);
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

namespace {

// Nodes are ordered by id: looked up by binary search.
const SchedulingNode* FindNode(const std::vector<SchedulingNode>& nodes, const std::string& id) {
  auto it =
      std::lower_bound(nodes.begin(), nodes.end(), id,
                       [](const SchedulingNode& n, const std::string& k) { return n.id < k; });
  return it != nodes.end() && it->id == id ? &*it : nullptr;
}

}  // namespace

int JobManager::SchedulePass() {
  const std::shared_ptr<const SharingPolicy> current = CurrentPolicy();
  // Copied before taking the lock: submits and rank reports do not wait for the copy.
  const std::vector<SchedulingNode> nodes = nodes_.SchedulingView();
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  ExpireDraining(nodes, now);
  const ClusterSnapshot snapshot = BuildSnapshot(*current, nodes, now);
  if (snapshot.pending.empty()) {
    last_pass_.reset();
    return 0;
  }
  const ScheduleResult result = Schedule(snapshot);
  RecordPass(snapshot, result);
  if (result.preemption.has_value()) StartPreemption(*result.preemption, now);
  int placed = 0;
  for (const Placement& placement : result.placements) {
    if (placed == kMaxPlacementsPerPass) {
      WakeScheduler();
      break;
    }
    if (StartPlacement(placement, nodes, now)) ++placed;
  }
  return placed;
}

// Ranks that never reported their exit. Not on a node without a session: its ranks may still run
// (cut off, not dead), and its hello settles them when it is back.
void JobManager::ExpireDraining(const std::vector<SchedulingNode>& nodes, absl::Time now) {
  for (auto it = draining_.begin(); it != draining_.end();) {
    const SchedulingNode* on = FindNode(nodes, it->second.node_id);
    if (it->second.deadline > now || on == nullptr || !on->connected) {
      ++it;
      continue;
    }
    const auto& [job_id, attempt, rank] = it->first;
    spdlog::warn("rank {} of {} attempt {} on node {} never reported its exit; device {} freed",
                 rank, job_id, attempt, it->second.node_id, it->second.device);
    it = EndDraining(it);
  }
}

// What the scheduler sees: the nodes with their free devices, the waiting and running jobs, and
// the accounts and users of those jobs with their decayed usage.
ClusterSnapshot JobManager::BuildSnapshot(const SharingPolicy& policy,
                                          const std::vector<SchedulingNode>& nodes,
                                          absl::Time now) {
  ClusterSnapshot snapshot;
  snapshot.now = now;
  snapshot.preemption = preemption_;
  snapshot.min_run_time = min_run_time_;
  std::map<std::string, int> account_index;
  std::map<std::string, int> user_index;
  auto account_of = [&](const std::string& name) {
    auto [it, added] = account_index.try_emplace(name, static_cast<int>(snapshot.accounts.size()));
    if (added) {
      const SharingPolicy::Account a = policy.AccountOf(name);
      snapshot.accounts.push_back(
          {name, a.quota, a.borrow_limit, a.share, usage_.At(AccountKey(name), now)});
    }
    return it->second;
  };
  for (const auto& [name, account] : policy.accounts) account_of(name);
  // One scheduler user per (owner, account): a job counts in the account of its submission, so
  // an owner moved to another account has jobs in both until the old ones end (its cap then
  // applies to each part).
  auto user_of = [&](const v1::Job& job) {
    const std::string& account = AccountOf(job);
    auto [it, added] = user_index.try_emplace(absl::StrCat(job.owner(), "\n", account),
                                              static_cast<int>(snapshot.users.size()));
    if (added) {
      const SharingPolicy::User u = policy.UserOf(job.owner());
      snapshot.users.push_back({job.owner(), account_of(account), u.max_running_devices,
                                usage_.At(UserKey(job.owner()), now)});
    }
    return it->second;
  };
  snapshot.nodes.reserve(nodes.size());
  for (const SchedulingNode& n : nodes) {
    auto held = allocated_.find(n.id);
    const int used = held == allocated_.end() ? 0 : static_cast<int>(held->second.size());
    const int total = static_cast<int>(n.device_indices.size());
    SchedNode sn;
    sn.id = n.id;
    sn.total_devices = total;
    sn.free_devices = std::max(0, total - used);
    // A node loaded after a coordinator restart keeps its running jobs but gets no new ranks
    // until its worker is back on a session.
    sn.schedulable = n.state == v1::NODE_READY && n.connected;
    sn.owners = n.owners;
    snapshot.nodes.push_back(std::move(sn));
  }
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    const int64_t max_runtime_s = job.spec().max_runtime_seconds();
    if (IsPending(job.state())) {
      PendingJobInfo p;
      p.id = id;
      p.priority = job.spec().priority();
      p.submit_seq = job.seq();
      p.devices = job.spec().resources().gpus();
      p.owner = job.owner();
      if (max_runtime_s > 0) p.max_runtime = absl::Seconds(max_runtime_s);
      p.user = user_of(job);
      p.preemptible = !job.spec().has_preemptible() || job.spec().preemptible();
      // A tensor-parallel group's ranks (or HYBRID_SHARD's replica) stay on one node.
      p.rank_block = RankBlockOf(job.spec());
      snapshot.pending.push_back(std::move(p));
    } else if (IsActive(job.state())) {
      RunningJobInfo r;
      r.id = id;
      for (const auto& pl : job.placement()) {
        if (const SchedulingNode* on = FindNode(nodes, pl.node_id()); on != nullptr) {
          r.grants.push_back({static_cast<int>(on - nodes.data()), pl.device_indices_size()});
        }
      }
      if (max_runtime_s > 0) {
        r.expected_end = absl::FromUnixMillis(job.start_time_ms()) + absl::Seconds(max_runtime_s);
      }
      r.priority = job.spec().priority();
      r.start = absl::FromUnixMillis(job.start_time_ms());
      if (job.last_checkpoint().time_ms() > 0) {
        r.last_checkpoint = absl::FromUnixMillis(job.last_checkpoint().time_ms());
      }
      r.preempting = job.preempt_deadline_ms() != 0;
      r.user = user_of(job);
      r.preemptible = !job.spec().has_preemptible() || job.spec().preemptible();
      snapshot.running.push_back(std::move(r));
    }
  }
  return snapshot;
}

// Why each job waits (WhyWaiting), the head and its expected start.
void JobManager::RecordPass(const ClusterSnapshot& snapshot, const ScheduleResult& result) {
  LastPass& last = last_pass_.emplace();
  last.at = snapshot.now;
  last.waits.reserve(snapshot.pending.size());
  for (size_t i = 0; i < snapshot.pending.size(); ++i) {
    last.waits[snapshot.pending[i].id] = result.waits[i];
    if (result.waits[i].reason == WaitReason::kDevices) last.head = snapshot.pending[i].id;
  }
  if (result.reservation.has_value()) last.head_start = result.reservation->start;
}

// Asks the victims to checkpoint and stop within their grace.
void JobManager::StartPreemption(const ScheduleResult::Preemption& preemption, absl::Time now) {
  const v1::Job& head = jobs_.at(preemption.job_id);
  for (const std::string& id : preemption.victims) {
    v1::Job& victim = jobs_.at(id);
    victim.set_preempt_deadline_ms(absl::ToUnixMillis(now + GraceOf(victim)));
    victim.set_preempted_by(head.id());
    victim.set_message(absl::StrCat("preempted by ", head.id(), " (priority ",
                                    head.spec().priority(), ", account ", head.account(),
                                    "): asked to checkpoint and stop"));
    victim.set_version(victim.version() + 1);
    Persist(victim);
    if (metrics_ != nullptr) metrics_->ObservePreemption();
    spdlog::info(
        "preempting {} (priority {}, account {}) for {} (priority {}, account {}); "
        "grace {}",
        id, victim.spec().priority(), victim.account(), head.id(), head.spec().priority(),
        head.account(), absl::FormatDuration(GraceOf(victim)));
  }
}

// Starts a placed job's next attempt: its devices (and parameter-server ranges), RUNNING, its
// rendezvous scope, and once durable its assignments to the nodes. False when an offload job
// keeps waiting for parameter-server memory.
bool JobManager::StartPlacement(const Placement& placement,
                                const std::vector<SchedulingNode>& nodes, absl::Time now) {
  v1::Job& job = jobs_.at(placement.job_id);
  // Offload jobs also need room on the parameter servers; without it they keep waiting (the
  // devices the scheduler picked stay free for others).
  std::vector<v1::PsRange> ps_ranges;
  if (job.spec().parallel().strategy() == v1::OFFLOAD) {
    auto ranges = PlaceOnParameterServers(ModelParameterCount(job.spec().model()), kPsBytesPerParam,
                                          ParameterServerCapacity(job.owner()));
    if (!ranges.ok()) {
      const std::string why =
          absl::StrCat("waiting for parameter-server memory: ", ranges.status().message());
      if (job.message() != why) {
        job.set_message(why);
        job.set_version(job.version() + 1);
        Persist(job);
      }
      return false;
    }
    ps_ranges = *std::move(ranges);
  }
  job.clear_placement();
  job.clear_ps_placement();
  for (v1::PsRange& r : ps_ranges) *job.add_ps_placement() = std::move(r);
  int rank = 0;
  for (const DeviceGrant& g : placement.grants) {
    const SchedulingNode& node = nodes[g.node];
    std::set<int>& held = allocated_[node.id];
    v1::RankPlacement* rp = job.add_placement();
    rp->set_node_id(node.id);
    rp->set_first_rank(rank);
    for (const int index : node.device_indices) {
      if (rp->device_indices_size() == g.devices) break;
      if (held.insert(index).second) rp->add_device_indices(index);
    }
    TY_CHECK(rp->device_indices_size() == g.devices,
             absl::StrCat("scheduler over-allocated node ", node.id));
    rank += g.devices;
  }
  job.set_attempt(job.attempt() + 1);
  job.set_world_size(rank);
  if (metrics_ != nullptr) {
    metrics_->ObservePlacement(
        placement.backfilled,
        absl::ToDoubleSeconds(now - absl::FromUnixMillis(job.submit_time_ms())),
        /*first_start=*/job.attempt() == 1);
  }
  job.set_start_time_ms(absl::ToUnixMillis(now));
  job.set_backfilled(placement.backfilled);
  if (IsCommandJob(job.spec())) job.set_master_port(ReserveMasterPort(job.placement(0).node_id()));
  // After a restart, `yard describe` still says why the previous attempt ended.
  Transition(job, v1::RUNNING,
             job.state() == v1::RESTARTING  ? absl::StrCat("restarted: ", job.message())
             : job.state() == v1::PREEMPTED ? absl::StrCat("resumed after: ", job.message())
                                            : "");
  rendezvous_.OpenScope({job.id(), job.attempt()});
  // Assignments go out once the placement is durable, so a restarted coordinator never forgets
  // ranks it started.
  Persist(job, [this, assignments = AssignmentsOf(job)](absl::Status s) {
    if (!s.ok()) return;
    for (const auto& [node_id, a] : assignments) {
      v1::CoordinatorMessage m;
      *m.mutable_assignment() = a;
      // A node without a session gets it again through AssignmentsFor when it reconnects.
      nodes_.Send(node_id, m);
    }
  });
  return true;
}

std::vector<std::pair<std::string, v1::Assignment>> JobManager::AssignmentsOf(
    const v1::Job& job) const {
  std::vector<std::pair<std::string, v1::Assignment>> out;
  const std::string spec = job.spec().SerializeAsString();
  // Command jobs: where rank 0 listens, for torchrun's MASTER_ADDR and MASTER_PORT.
  const std::string master_addr = IsCommandJob(job.spec()) && job.placement_size() > 0
                                      ? nodes_.HostOf(job.placement(0).node_id())
                                      : std::string();
  int group_rank = 0;
  for (const auto& p : job.placement()) {
    v1::Assignment a;
    a.set_group_rank(group_rank++);
    a.set_master_addr(master_addr);
    a.set_master_port(job.master_port());
    a.set_job_id(job.id());
    a.set_attempt(job.attempt());
    a.set_world_size(job.world_size());
    a.set_first_rank(p.first_rank());
    *a.mutable_device_indices() = p.device_indices();
    a.set_spec(spec);
    a.set_coordinator_address(coordinator_address_);
    a.set_owner(job.owner());
    if (credential_for_) a.set_job_credential(credential_for_(job.id(), job.attempt()));
    if (!checkpoint_root_.empty())
      a.set_checkpoint_dir(absl::StrCat(checkpoint_root_, "/", job.id()));
    *a.mutable_ps_ranges() = job.ps_placement();
    out.emplace_back(p.node_id(), std::move(a));
  }
  return out;
}

std::vector<v1::Assignment> JobManager::AssignmentsFor(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Assignment> out;
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (!IsActive(job.state())) continue;
    for (auto& [placed_on, a] : AssignmentsOf(job)) {
      if (placed_on == node_id) out.push_back(std::move(a));
    }
  }
  return out;
}

std::vector<v1::Node> JobManager::NodesWithAllocations() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Node> nodes = nodes_.List();
  for (v1::Node& node : nodes) {
    auto it = allocated_.find(node.id());
    if (it != allocated_.end()) {
      node.mutable_allocated_devices()->Add(it->second.begin(), it->second.end());
    }
  }
  std::map<std::string, int64_t> reserved = ReservedPsBytes();
  for (v1::Node& node : nodes) {
    if (node.role() == v1::PARAMETER_SERVER) node.set_reserved_bytes(reserved[node.id()]);
  }
  return nodes;
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
    FailAttempt(job, absl::StrCat(what, " lost (no heartbeat for ",
                                  absl::FormatDuration(nodes_.node_timeout()), ")"));
  }
}

void JobManager::OnNodeHello(const std::string& node_id,
                             const google::protobuf::RepeatedPtrField<v1::RankStatus>& running) {
  {
    absl::MutexLock lock(&mu_);
    std::set<std::tuple<std::string, int, int>> alive;
    for (const v1::RankStatus& r : running) alive.insert({r.job_id(), r.attempt(), r.rank()});
    bool freed = false;
    for (auto it = draining_.begin(); it != draining_.end();) {
      if (it->second.node_id != node_id) {
        ++it;
        continue;
      }
      if (alive.count(it->first) > 0) {  // told to stop (again) now: a new grace to report it
        it->second.deadline = clock_.Now() + kDrainTimeout;
        ++it;
        continue;
      }
      it = EndDraining(it);
      freed = true;
    }
    if (freed) WakeScheduler();
    // Ranks of attempts that are no longer current and that this coordinator does not know to
    // be draining (it restarted since they were told to stop): their devices stay taken until
    // they report their exit, as for any draining rank, so no new rank shares them meanwhile.
    for (const v1::RankStatus& r : running) {
      const v1::Job* job = Find(r.job_id());
      const bool current =
          job != nullptr && IsActive(job->state()) && r.attempt() == job->attempt();
      const std::tuple<std::string, int, int> key{r.job_id(), r.attempt(), r.rank()};
      if (current || !r.has_device() || draining_.count(key) > 0) continue;
      std::set<int>& held = allocated_[node_id];
      if (!held.insert(r.device()).second) {
        spdlog::warn("node {} still runs rank {} of {} attempt {} on device {}, which is taken",
                     node_id, r.rank(), r.job_id(), r.attempt(), r.device());
        continue;
      }
      draining_[key] = DrainingRank{node_id, r.device(), clock_.Now() + kDrainTimeout};
    }
  }
  for (const v1::RankStatus& r : running) OnRankStatus(node_id, r);
}

namespace {

// Whether rank `rank` of `job`'s current placement runs on `node_id`.
bool PlacedOn(const v1::Job& job, const std::string& node_id, int rank) {
  for (const v1::RankPlacement& p : job.placement()) {
    if (p.node_id() == node_id && rank >= p.first_rank() &&
        rank < p.first_rank() + p.device_indices_size()) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool JobManager::RankRunsOn(const std::string& node_id, const std::string& job_id, int attempt,
                            int rank) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it != jobs_.end() && it->second.attempt() == attempt && PlacedOn(it->second, node_id, rank)) {
    return true;
  }
  auto draining = draining_.find({job_id, attempt, rank});
  return draining != draining_.end() && draining->second.node_id == node_id;
}

void JobManager::OnRankStatus(const std::string& node_id, const v1::RankStatus& status) {
  absl::MutexLock lock(&mu_);
  v1::Job* job = Find(status.job_id());
  const bool current =
      job != nullptr && IsActive(job->state()) && status.attempt() == job->attempt();
  if (current && !PlacedOn(*job, node_id, status.rank())) {
    // A node speaks only for the ranks it runs.
    spdlog::warn("audit: node {} reported rank {} of {} attempt {}, which it does not run: ignored",
                 node_id, status.rank(), status.job_id(), status.attempt());
    return;
  }
  if (!current) {
    if (status.phase() == v1::RANK_EXITED) {
      auto draining = draining_.find({status.job_id(), status.attempt(), status.rank()});
      if (draining != draining_.end() && draining->second.node_id == node_id) {
        EndDraining(draining);
        WakeScheduler();
      }
    } else {
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
    std::set<int>& done_ranks = finished_ranks_[job->id()];
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
    finished_ranks_[job->id()].insert(status.rank());
    ReleaseAttempt(*job, absl::StrCat("preempted by ", job->preempted_by()));
    Preempted(*job);
    Persist(*job);
    WakeScheduler();
    return;
  }
  finished_ranks_[job->id()].insert(status.rank());  // its device is free at once
  std::string reason = absl::StrCat("rank ", status.rank(), " on node ", node_id,
                                    " exited with code ", status.exit_code());
  if (!status.message().empty()) absl::StrAppend(&reason, ": ", status.message());
  FailAttempt(*job, reason);
}

absl::Status JobManager::CheckSharingLimits(const SharingPolicy& policy, const std::string& owner,
                                            const v1::JobSpec& spec) const {
  const SharingPolicy::User user = policy.UserOf(owner);
  const SharingPolicy::Account account = policy.AccountOf(user.account);
  const int64_t devices = spec.resources().gpus();
  if (user.max_running_devices >= 0 && devices > user.max_running_devices) {
    return absl::InvalidArgumentError(
        absl::StrCat("resources.gpus: ", devices, " devices exceed user ", owner, "'s cap of ",
                     user.max_running_devices, " running devices (max_running_devices)"));
  }
  if (account.quota >= 0 && account.borrow_limit >= 0 &&
      devices > account.quota + account.borrow_limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resources.gpus: ", devices, " devices exceed account ", user.account, "'s quota of ",
        account.quota, " plus its borrow limit of ", account.borrow_limit));
  }
  if (spec.has_preemptible() && !spec.preemptible()) {
    if (account.quota < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("preemptible: false needs a quota, and account ", user.account,
                       " has none (only jobs within a quota may not be preempted)"));
    }
    if (devices > account.quota) {
      return absl::InvalidArgumentError(absl::StrCat(
          "preemptible: false is only for jobs within their account's quota: ", devices,
          " devices exceed account ", user.account, "'s quota of ", account.quota));
    }
  }
  const int64_t max_queued =
      user.max_queued_jobs >= 0 ? user.max_queued_jobs : default_max_queued_jobs_;
  if (max_queued >= 0) {
    int64_t queued = 0;
    if (auto it = submitting_.find(owner); it != submitting_.end()) queued += it->second;
    if (auto it = queued_by_owner_.find(owner); it != queued_by_owner_.end()) queued += it->second;
    if (queued >= max_queued) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "max_queued_jobs: user ", owner, " has ", queued, " jobs queued, its cap of ", max_queued,
          user.max_queued_jobs >= 0 ? "" : " (the coordinator's --max-queued-jobs-per-user)",
          "; wait for some to start or cancel some"));
    }
  }
  return absl::OkStatus();
}

void JobManager::CountUse(std::map<std::string, Use>* by_account,
                          std::map<std::string, Use>* by_owner) const {
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    const std::string& account = AccountOf(job);
    const int64_t devices = job.spec().resources().gpus();
    for (Use* use : {&(*by_account)[account], by_owner ? &(*by_owner)[job.owner()] : nullptr}) {
      if (use == nullptr) continue;
      if (IsActive(job.state())) use->running_devices += devices;
      if (IsPending(job.state())) {
        use->queued_devices += devices;
        ++use->queued_jobs;
      }
    }
  }
}

std::shared_ptr<const SharingPolicy> JobManager::CurrentPolicy() const {
  if (policy_) return policy_();
  static const std::shared_ptr<const SharingPolicy> kNone = [] {
    auto policy = std::make_shared<SharingPolicy>();
    policy->accounts[kDefaultAccount] = {};
    return policy;
  }();
  return kNone;
}

bool JobManager::HasDemand(const std::string& account, const std::map<std::string, Use>& use,
                           absl::Time now) const {
  if (auto it = use.find(account); it != use.end()) {
    if (it->second.running_devices > 0 || it->second.queued_jobs > 0) return true;
  }
  return usage_.At(AccountKey(account), now) > 0;
}

JobManager::ShareTotals JobManager::TotalsOf(const SharingPolicy& policy,
                                             const std::map<std::string, Use>& use,
                                             absl::Time now) const {
  ShareTotals totals;
  for (const auto& [name, a] : policy.accounts) {
    // Shares count among the accounts that want devices (an empty account, such as an unused
    // `default`, would otherwise take a part of every percentage).
    if (HasDemand(name, use, now)) totals.shares += a.share;
    totals.usage += usage_.At(AccountKey(name), now);
  }
  return totals;
}

v1::AccountUsage JobManager::AccountUsageOf(const std::string& name, const SharingPolicy& policy,
                                            const ShareTotals& totals,
                                            const std::map<std::string, Use>& use,
                                            absl::Time now) const {
  const SharingPolicy::Account account = policy.AccountOf(name);
  // An account without demand: its part if it had some.
  const double shares = totals.shares + (HasDemand(name, use, now) ? 0 : account.share);
  const double usage = totals.usage;
  v1::AccountUsage out;
  out.set_name(name);
  if (account.quota >= 0) out.set_quota_devices(account.quota);
  if (account.borrow_limit >= 0) out.set_borrow_limit_devices(account.borrow_limit);
  out.set_share(account.share);
  out.set_share_fraction(shares > 0 ? account.share / shares : 0);
  const double mine = usage_.At(AccountKey(name), now);
  out.set_usage_device_hours(mine / 3600);
  out.set_usage_fraction(usage > 0 ? mine / usage : 0);
  if (auto it = use.find(name); it != use.end()) {
    out.set_running_devices(it->second.running_devices);
    out.set_queued_devices(it->second.queued_devices);
    out.set_queued_jobs(it->second.queued_jobs);
  }
  return out;
}

v1::QuotaReport JobManager::Quota(const std::string& user, bool all_accounts) const {
  const std::shared_ptr<const SharingPolicy> current = CurrentPolicy();
  const SharingPolicy& policy = *current;
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  std::map<std::string, Use> by_account, by_owner;
  CountUse(&by_account, &by_owner);
  const SharingPolicy::User limits = policy.UserOf(user);
  v1::QuotaReport report;
  report.set_user(user);
  report.set_account(limits.account);
  if (limits.max_running_devices >= 0) report.set_max_running_devices(limits.max_running_devices);
  if (limits.max_queued_jobs >= 0) {
    report.set_max_queued_jobs(limits.max_queued_jobs);
  } else if (default_max_queued_jobs_ >= 0) {
    report.set_max_queued_jobs(default_max_queued_jobs_);
  }
  if (auto it = by_owner.find(user); it != by_owner.end()) {
    report.set_running_devices(it->second.running_devices);
    report.set_queued_jobs(it->second.queued_jobs);
  }
  report.set_usage_device_hours(usage_.At(UserKey(user), now) / 3600);
  report.set_half_life_hours(absl::ToDoubleHours(usage_.half_life()));
  const ShareTotals totals = TotalsOf(policy, by_account, now);
  *report.add_accounts() = AccountUsageOf(limits.account, policy, totals, by_account, now);
  if (all_accounts) {
    for (const auto& [name, a] : policy.accounts) {
      if (name != limits.account)
        *report.add_accounts() = AccountUsageOf(name, policy, totals, by_account, now);
    }
  }
  return report;
}

std::string JobManager::UnfinishedJobOf(const std::string& account) const {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : unfinished_) {
    if (AccountOf(jobs_.at(id)) == account) return id;
  }
  return "";
}

std::vector<v1::AccountUsage> JobManager::AccountUsages() const {
  const std::shared_ptr<const SharingPolicy> current = CurrentPolicy();
  const SharingPolicy& policy = *current;
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  std::map<std::string, Use> by_account;
  CountUse(&by_account, nullptr);
  const ShareTotals totals = TotalsOf(policy, by_account, now);
  std::vector<v1::AccountUsage> out;
  for (const auto& [name, a] : policy.accounts) {
    out.push_back(AccountUsageOf(name, policy, totals, by_account, now));
  }
  return out;
}

std::string JobManager::WhyWaiting(const std::string& job_id, const std::string& viewer,
                                   bool viewer_is_admin) const {
  const std::shared_ptr<const SharingPolicy> current = CurrentPolicy();
  const SharingPolicy& policy = *current;
  absl::MutexLock lock(&mu_);
  const auto found = jobs_.find(job_id);
  if (found == jobs_.end() || !IsPending(found->second.state())) return "";
  const v1::Job& job = found->second;
  if (!last_pass_.has_value()) return "waiting for the next scheduling pass";
  const auto it = last_pass_->waits.find(job.id());
  if (it == last_pass_->waits.end()) return "waiting for the next scheduling pass";
  const JobWait& wait = it->second;
  const int64_t devices = job.spec().resources().gpus();
  const std::string& account = AccountOf(job);
  const SharingPolicy::Account limits = policy.AccountOf(account);
  std::map<std::string, Use> by_account, by_owner;
  CountUse(&by_account, &by_owner);
  const absl::Time now = clock_.Now();
  std::string why;
  auto head_text = [&] {
    std::string text = last_pass_->head;
    if (auto h = jobs_.find(last_pass_->head); h != jobs_.end()) {
      // Another user's job is not named to users who may not see it.
      if (!viewer_is_admin && h->second.owner() != viewer) text = "another user's job";
      absl::StrAppend(&text, " (priority ", h->second.spec().priority(), ", ",
                      h->second.spec().resources().gpus(), " devices, ",
                      StartText(last_pass_->head_start, now), ")");
    }
    return text;
  };
  switch (wait.reason) {
    case WaitReason::kPlaced:
      why = "placed in the latest pass; waiting for parameter-server memory or its start";
      if (!job.message().empty()) why = job.message();
      break;
    case WaitReason::kDevices:
      why = absl::StrCat("first in line, waiting for ", devices, " free devices; ",
                         StartText(last_pass_->head_start, now));
      break;
    case WaitReason::kBehindHead:
    case WaitReason::kHeadStartUnknown:
      why = absl::StrCat("waiting for ", devices, " devices behind ", wait.position,
                         " jobs ahead in line, first ", head_text());
      if (wait.reason == WaitReason::kBehindHead) {
        absl::StrAppend(&why, "; starting it now would delay that job (no backfill)");
      }
      break;
    case WaitReason::kAccountLimit:
      why = absl::StrCat("account ", account, " holds ", by_account[account].running_devices,
                         " devices: its quota of ", limits.quota, " plus its borrow limit of ",
                         limits.borrow_limit, " leave no room for ", devices, " more");
      break;
    case WaitReason::kUserLimit:
      why = absl::StrCat("user ", job.owner(), " holds ", by_owner[job.owner()].running_devices,
                         " devices of its cap of ", policy.UserOf(job.owner()).max_running_devices,
                         " (max_running_devices)");
      break;
    case WaitReason::kNotPreemptibleBeyondQuota:
      why = absl::StrCat("not preemptible, so it runs only within account ", account,
                         "'s quota of ", limits.quota, " devices; ",
                         by_account[account].running_devices, " are in use");
      break;
    case WaitReason::kUnplaceable:
      why = absl::StrCat("needs ", devices,
                         " devices, more than the ready nodes that take its owner's jobs have");
      break;
  }
  const v1::AccountUsage usage =
      AccountUsageOf(account, policy, TotalsOf(policy, by_account, now), by_account, now);
  absl::StrAppend(
      &why, absl::StrFormat(". Account %s: share %.0f%%, usage %.0f%% (%.1f device-hours, decayed)",
                            account, 100 * usage.share_fraction(), 100 * usage.usage_fraction(),
                            usage.usage_device_hours()));
  if (usage.has_quota_devices()) {
    absl::StrAppend(&why, absl::StrFormat(", quota %d devices, %d in use", usage.quota_devices(),
                                          usage.running_devices()));
  }
  return why;
}

void JobManager::ChargeUsage() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  const absl::Duration since = last_charge_.has_value()
                                   ? std::min(now - *last_charge_, absl::Minutes(5))
                                   : absl::ZeroDuration();
  last_charge_ = now;
  if (since <= absl::ZeroDuration()) return;
  const double seconds = absl::ToDoubleSeconds(since);
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (!IsActive(job.state())) continue;
    int64_t devices = 0;
    for (const auto& p : job.placement()) devices += p.device_indices_size();
    const std::string& account = AccountOf(job);
    usage_.Charge(AccountKey(account), devices * seconds, now);
    usage_.Charge(UserKey(job.owner()), devices * seconds, now);
  }
}

namespace {
constexpr char kUsageKind[] = "usage";
}  // namespace

absl::Status JobManager::SaveUsage() {
  WriteBatch batch;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, entry] : usage_.entries()) {
      batch.put_records.push_back({kUsageKind, key,
                                   absl::StrCat(absl::StrFormat("%.17g", entry.value), " ",
                                                absl::ToUnixMillis(entry.as_of))});
    }
  }
  if (batch.put_records.empty()) return absl::OkStatus();
  return store_.CommitSync(std::move(batch));
}

absl::Status JobManager::LoadUsage() {
  ASSIGN_OR_RETURN(std::vector<StoredRecord> records, store_.LoadRecords(kUsageKind));
  absl::MutexLock lock(&mu_);
  for (const StoredRecord& r : records) {
    const std::vector<std::string> parts = absl::StrSplit(r.payload, ' ');
    double value = 0;
    int64_t ms = 0;
    if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &value) ||
        !absl::SimpleAtoi(parts[1], &ms)) {
      // Usage is an estimate that decays anyway: a bad record restarts that key from zero.
      spdlog::warn("usage record {} is unreadable; its usage starts from zero", r.id);
      continue;
    }
    usage_.Restore(r.id, {value, absl::FromUnixMillis(ms)});
  }
  return absl::OkStatus();
}

}  // namespace trainyard::coordinator
