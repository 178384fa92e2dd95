// JobManager: Submit, and what a job may ask for at submit (fits some node, fits the parameter
// servers, the owner's caps and quota) (see job_manager.h).
#include "server/coordinator/job_manager.h"
#include "server/coordinator/job_manager_internal.h"
#include "server/coordinator/job_state.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/check.h"
#include "common/failpoint.h"
#include "common/memory_estimate.h"
#include "common/ps_layout.h"
#include "common/spec.h"
#include "common/status_macros.h"
#include "common/units.h"

namespace trainyard::coordinator {

namespace {

// A submit of `request_id` arrived while its first copy is still being stored.
absl::Status StillStoring(const std::string& request_id) {
  return absl::UnavailableError(
      absl::StrCat("request_id: the submit of request ", request_id, " is being stored; retry"));
}

absl::Status CheckRequestId(const std::string& id) {
  const bool ok = id.size() <= 64 && std::all_of(id.begin(), id.end(), [](char c) {
                    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
                           c == '_' || c == '-';
                  });
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "request_id: at most 64 letters, digits, '.', '_' or '-' (one per logical submit)");
}

}  // namespace

absl::Status JobManager::LoadRequestIds() {
  ASSIGN_OR_RETURN(std::vector<StoredRecord> records,
                   store_.LoadRecords(SubmitRequests::kRecordKind));
  absl::MutexLock lock(&mu_);
  const int64_t now_ms = NowMs(clock_);
  for (StoredRecord& r : records) {
    if (r.expires_ms != 0 && r.expires_ms <= now_ms) continue;
    requests_.Load(r.id, std::move(r.payload), r.expires_ms);
  }
  return absl::OkStatus();
}

void JobManager::Submit(const std::string& owner, v1::JobSpec spec, const std::string& request_id,
                        JobCallback done) {
  // A submit retried with its request id answers with the job the first one stored, before
  // anything else is checked (that job counts against the owner's queue now).
  const std::string request_key = SubmitRequests::Key(owner, request_id);
  if (!request_id.empty()) {
    if (absl::Status s = CheckRequestId(request_id); !s.ok()) {
      done(s);
      return;
    }
    std::string earlier;
    bool storing = false;
    {
      absl::MutexLock lock(&mu_);
      if (auto known = requests_.Find(request_key, NowMs(clock_)); known.has_value()) {
        earlier = known->job_id;
        storing = !known->durable;
      }
    }
    if (storing) {
      done(StillStoring(request_id));
      return;
    }
    if (!earlier.empty()) {
      done(Get(earlier));
      return;
    }
  }
  ApplyJobSpecDefaults(spec);
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
    done(s);
    return;
  }
  const int64_t keep = spec.checkpoint().keep_last();
  if (max_kept_checkpoints_ > 0 && !IsCommandJob(spec) &&
      (keep == 0 || keep > max_kept_checkpoints_)) {
    done(absl::InvalidArgumentError(
        absl::StrCat("checkpoint.keep_last: this cluster keeps at most ", max_kept_checkpoints_,
                     " checkpoints per job; got ", keep, keep == 0 ? " (every one)" : "")));
    return;
  }
  // A command job's memory is its program's business.
  if (absl::Status s = IsCommandJob(spec) ? absl::OkStatus() : CheckFitsSomeNode(spec); !s.ok()) {
    done(s);
    return;
  }
  if (absl::Status s = CheckFitsHosts(owner, spec); !s.ok()) {
    done(s);
    return;
  }
  if (absl::Status s = CheckFitsParameterServers(owner, spec); !s.ok()) {
    done(s);
    return;
  }
  if (absl::Status s = CheckDependencies(owner, spec); !s.ok()) {
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
    if (!request_id.empty() && requests_.Contains(request_key)) {  // a concurrent submit of it
      done(StillStoring(request_id));
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
    job.set_world_size(WorldSizeOf(job.spec()));
    job.set_version(1);
    WriteBatch batch;
    if (!request_id.empty()) {
      // Stored in the job's own transaction.
      const int64_t now_ms = NowMs(clock_);
      const int64_t expires_ms = requests_.Start(request_key, job.id(), now_ms);
      job.set_request_id(request_id);
      batch.put_records.push_back({SubmitRequests::kRecordKind, request_key, job.id(), expires_ms});
      if (requests_.PruneStoreDue(now_ms)) batch.delete_records_expired_at_ms = now_ms;
    }
    batch.put_jobs.push_back(ToStored(job));
    // The job becomes visible only once durable: a crash before that loses nothing acknowledged.
    store_.Commit(std::move(batch), [this, job, done = std::move(done)](absl::Status s) {
      {
        absl::MutexLock lock(&mu_);
        --pending_submits_;
        if (--submitting_[job.owner()] == 0) submitting_.erase(job.owner());
        if (!job.request_id().empty()) {
          // Not stored: a retry submits afresh.
          requests_.Stored(SubmitRequests::Key(job.owner(), job.request_id()), job.id(), s.ok());
        }
      }
      if (!s.ok()) {
        done(absl::Status(s.code(), absl::StrCat("storing the job failed: ", s.message())));
        return;
      }
      Failpoint("submit-after-commit");  // (tests: a crash between the commit and the answer)
      {
        absl::MutexLock lock(&mu_);
        jobs_[job.id()] = job;
        ids_by_seq_[job.seq()] = job.id();
        AddUnfinished(job);
        ++queued_by_owner_[job.owner()];
        watchers_.SetDurable(job.id(), job.version());
      }
      done(job);
      WakeScheduler();
    });
  }
}

absl::Status JobManager::CheckDependencies(const std::string& owner,
                                           const v1::JobSpec& spec) const {
  for (int i = 0; i < spec.after_size(); ++i) {
    const std::string& id = spec.after(i);
    const absl::StatusOr<v1::Job> dependency = Get(id);
    if (!dependency.ok() || dependency->owner() != owner) {
      return absl::NotFoundError(absl::StrCat("after[", i, "]: job ", id, " not found"));
    }
    if (IsTerminal(dependency->state()) && dependency->state() != v1::SUCCEEDED) {
      return absl::FailedPreconditionError(absl::StrCat("after[", i, "]: job ", id, " ended ",
                                                        v1::JobState_Name(dependency->state()),
                                                        ": this job could never start"));
    }
  }
  return absl::OkStatus();
}

absl::Status JobManager::CheckFitsSomeNode(const v1::JobSpec& spec) const {
  // The largest device any ready node offers (a node's smallest device counts for it), and the
  // most devices on one node (the HYBRID_SHARD group), from the registry's index: O(1) in the
  // cluster's size. Devices of unknown size are not judged.
  const ClusterCapacity capacity = nodes_.Capacity();
  const int64_t device_bytes = capacity.largest_device_bytes;
  const int ranks_per_node = std::max(1, capacity.max_devices_per_node);
  if (device_bytes <= 0) return absl::OkStatus();
  const int world = spec.resources().slots();
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

absl::Status JobManager::CheckFitsHosts(const std::string& owner, const v1::JobSpec& spec) const {
  const v1::Resources& asked = spec.resources();
  if (asked.cpus() <= 0 && asked.memory_bytes() <= 0) return absl::OkStatus();
  const int64_t cpu = CpuMillis(asked.cpus());
  const int block = std::max(1, RankBlockOf(spec));
  // Ranks the nodes hold: with both limits, with CPUs only, with memory only; and the most CPUs
  // and memory one node offers.
  int64_t both = 0, by_cpus = 0, by_memory = 0;
  double most_cpus = 0;
  int64_t most_memory = 0;
  int workers = 0;
  for (const SchedulingNode& n : nodes_.SchedulingView()) {
    if (n.state != v1::NODE_READY || n.device_indices.empty()) continue;
    if (!n.owners.empty() && std::find(n.owners.begin(), n.owners.end(), owner) == n.owners.end()) {
      continue;
    }
    ++workers;
    const int64_t devices = static_cast<int64_t>(n.device_indices.size());
    int64_t cpu_fit = devices, memory_fit = devices;
    if (n.host.cpus() > 0 && cpu > 0) {
      cpu_fit = std::min(devices, CpuMillis(n.host.cpus()) / cpu);
      most_cpus = std::max(most_cpus, n.host.cpus());
    }
    if (n.host.memory_bytes() > 0 && asked.memory_bytes() > 0) {
      memory_fit = std::min(devices, n.host.memory_bytes() / asked.memory_bytes());
      most_memory = std::max(most_memory, n.host.memory_bytes());
    }
    both += std::min(cpu_fit, memory_fit) / block * block;
    by_cpus += cpu_fit / block * block;
    by_memory += memory_fit / block * block;
  }
  const int64_t ranks = asked.slots();
  if (workers == 0 || both >= ranks) return absl::OkStatus();
  const std::string whose = absl::StrCat("the ready workers that take ", owner, "'s jobs");
  if (by_memory < ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resources.memory: ", ranks, " ranks of ", HumanBytes(asked.memory_bytes()),
        " each fit on no set of nodes: ", whose, " hold ", by_memory,
        " such ranks (the most memory one node offers ranks is ", HumanBytes(most_memory), ")"));
  }
  if (by_cpus < ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("resources.cpus: ", ranks, " ranks of ", asked.cpus(),
                     " CPUs each fit on no set of nodes: ", whose, " hold ", by_cpus,
                     " such ranks (the most CPUs one node offers ranks is ", most_cpus, ")"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("resources.cpus and resources.memory: ", ranks, " ranks of ", asked.cpus(),
                   " CPUs and ", HumanBytes(asked.memory_bytes()),
                   " each fit on no set of nodes: ", whose, " hold ", both, " such ranks"));
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

absl::Status JobManager::CheckSharingLimits(const SharingPolicy& policy, const std::string& owner,
                                            const v1::JobSpec& spec) const {
  const SharingPolicy::User user = policy.UserOf(owner);
  const SharingPolicy::Account account = policy.AccountOf(user.account);
  const int64_t devices = spec.resources().slots();
  if (user.max_running_devices >= 0 && devices > user.max_running_devices) {
    return absl::InvalidArgumentError(
        absl::StrCat("resources.slots: ", devices, " devices exceed user ", owner, "'s cap of ",
                     user.max_running_devices, " running devices (max_running_devices)"));
  }
  if (account.quota >= 0 && account.borrow_limit >= 0 &&
      devices > account.quota + account.borrow_limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resources.slots: ", devices, " devices exceed account ", user.account, "'s quota of ",
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

}  // namespace trainyard::coordinator
