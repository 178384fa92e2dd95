// JobManager: the scheduling pass (the snapshot for the pure Scheduler, preemption, placements,
// assignments) (see job_manager.h).
#include "server/coordinator/job_manager.h"
#include "server/coordinator/job_manager_internal.h"
#include "server/coordinator/job_state.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/check.h"
#include "common/placement.h"
#include "common/ps_layout.h"
#include "common/spec.h"
#include "common/status_macros.h"
#include "server/coordinator/scheduler.h"

namespace trainyard::coordinator {
namespace {

// What a job's ranks on one node of its placement hold: each rank's request, or (none given) the
// node's charge per device, which ranks sharing a device share.
int64_t PlacementCpuMillis(const v1::Resources& r, const v1::RankPlacement& pl,
                           const v1::HostResources& host) {
  return (r.cpus() > 0 ? RanksOf(pl) : pl.device_indices_size()) * RankCpuMillis(r, host);
}
int64_t PlacementMemoryBytes(const v1::Resources& r, const v1::RankPlacement& pl,
                             const v1::HostResources& host) {
  return (r.memory_bytes() > 0 ? RanksOf(pl) : pl.device_indices_size()) * RankMemoryBytes(r, host);
}

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
  FailJobsWithFailedDependencies();
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
  auto reachable = [&nodes](const std::string& node_id) {
    const SchedulingNode* on = FindNode(nodes, node_id);
    return on != nullptr && on->connected;
  };
  // (A rank whose stop waits for its release's write has not been told to stop yet.)
  auto held = [this](const DeviceLedger::RankKey& key) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const std::string& job_id = std::get<0>(key);
    return stops_after_write_.count(job_id) > 0 || stops_in_flight_.count(job_id) > 0;
  };
  for (const auto& [key, rank] : devices_.Expire(now, reachable, held)) {
    spdlog::warn("rank {} of {} attempt {} on node {} never reported its exit; device {} freed",
                 std::get<2>(key), std::get<0>(key), std::get<1>(key), rank.node_id, rank.device);
  }
}

// What the scheduler sees: the nodes with their free devices, the waiting and running jobs, and
// the accounts and users of those jobs with their decayed usage.
ClusterSnapshot JobManager::BuildSnapshot(const SharingPolicy& policy,
                                          const std::vector<SchedulingNode>& nodes,
                                          absl::Time now) {
  ClusterSnapshot snapshot;
  const std::set<std::string> array_tasks = ArrayTasksToConsider();
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
    const int used = devices_.HeldCount(n.id);
    const int total = static_cast<int>(n.device_indices.size());
    SchedNode sn;
    sn.id = n.id;
    sn.total_devices = total;
    sn.free_devices = std::max(0, total - used);
    // A node loaded after a coordinator restart keeps its running jobs but gets no new ranks
    // until its worker is back on a session.
    // A cordoned node (an admin's hold, or draining) gets none either.
    sn.schedulable = n.state == v1::NODE_READY && n.connected && !n.cordoned;
    sn.owners = n.owners;
    // CPUs and memory where the node counts them; running ranks' are taken off below.
    if (n.host.cpus() > 0) {
      sn.total_cpu_millis = sn.free_cpu_millis = CpuMillis(n.host.cpus());
      sn.cpu_millis_per_device = CpuMillis(n.host.cpus_per_device());
    }
    if (n.host.memory_bytes() > 0) {
      sn.total_memory = sn.free_memory = n.host.memory_bytes();
      sn.memory_per_device = n.host.memory_per_device();
    }
    snapshot.nodes.push_back(std::move(sn));
  }
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    const int64_t max_runtime_s = job.spec().max_runtime_seconds();
    if (IsPending(job.state())) {
      if (job.spec().after_size() > 0 && UnmetDependency(job).has_value()) continue;
      if (job.spec().array().max_running() > 0 && array_tasks.count(id) == 0) continue;
      PendingJobInfo p;
      p.id = id;
      p.priority = job.spec().priority();
      p.submit_seq = job.seq();
      p.devices = job.spec().resources().slots();
      p.owner = job.owner();
      if (max_runtime_s > 0) p.max_runtime = absl::Seconds(max_runtime_s);
      p.user = user_of(job);
      p.preemptible = !job.spec().has_preemptible() || job.spec().preemptible();
      // A tensor-parallel group's ranks (or HYBRID_SHARD's replica) stay on one node.
      p.rank_block = RankBlockOf(job.spec());
      // resources.nodes: slots / nodes devices on each of that many nodes.
      const v1::Resources& asks = job.spec().resources();
      if (asks.nodes() > 0) {
        p.rank_block = std::max(1, asks.slots() / asks.nodes());
        p.one_block_per_node = true;
      }
      // Per device: ranks sharing one ask for theirs together.
      p.cpu_millis = CpuMillis(asks.cpus()) * RanksPerDevice(job.spec());
      p.memory_bytes = asks.memory_bytes() * RanksPerDevice(job.spec());
      snapshot.pending.push_back(std::move(p));
    } else if (IsActive(job.state())) {
      RunningJobInfo r;
      r.id = id;
      for (const auto& pl : job.placement()) {
        if (const SchedulingNode* on = FindNode(nodes, pl.node_id()); on != nullptr) {
          const int index = static_cast<int>(on - nodes.data());
          r.grants.push_back({index, pl.device_indices_size()});
          SchedNode& sn = snapshot.nodes[index];
          if (sn.total_cpu_millis >= 0) {
            sn.free_cpu_millis -= PlacementCpuMillis(job.spec().resources(), pl, on->host);
          }
          if (sn.total_memory >= 0) {
            sn.free_memory -= PlacementMemoryBytes(job.spec().resources(), pl, on->host);
          }
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
  // The ranks still stopping: a job leaving (never a victim; its devices come free by their
  // deadline, which backfill counts on), whose devices count for its owner and account, and
  // whose CPUs and memory stay taken on its nodes.
  for (const auto& [id, stopping] : Stopping(now)) {
    const v1::Job& job = jobs_.at(id);
    const v1::Resources& asks = job.spec().resources();
    RunningJobInfo r;
    r.id = id;
    for (const auto& [node_id, devices] : stopping.devices) {
      const SchedulingNode* on = FindNode(nodes, node_id);
      if (on == nullptr) continue;
      const int index = static_cast<int>(on - nodes.data());
      r.grants.push_back({index, static_cast<int>(devices.size())});
      SchedNode& sn = snapshot.nodes[index];
      if (sn.total_cpu_millis >= 0) {
        sn.free_cpu_millis -= stopping.CpuMillisOn(node_id, asks, on->host);
      }
      if (sn.total_memory >= 0) {
        sn.free_memory -= stopping.MemoryBytesOn(node_id, asks, on->host);
      }
    }
    r.expected_end = stopping.until;
    r.priority = job.spec().priority();
    r.preempting = true;
    r.preemptible = false;
    r.user = user_of(job);
    snapshot.running.push_back(std::move(r));
  }
  return snapshot;
}

int64_t JobManager::StoppingRanks::DeviceCount() const {
  int64_t count = 0;
  for (const auto& [node_id, held] : devices) count += static_cast<int64_t>(held.size());
  return count;
}

int64_t JobManager::StoppingRanks::CpuMillisOn(const std::string& node_id,
                                               const v1::Resources& asks,
                                               const v1::HostResources& host) const {
  const auto ranks = this->ranks.find(node_id);
  if (ranks == this->ranks.end()) return 0;
  const int64_t held = static_cast<int64_t>(devices.at(node_id).size());
  return (asks.cpus() > 0 ? ranks->second : held) * RankCpuMillis(asks, host);
}

int64_t JobManager::StoppingRanks::MemoryBytesOn(const std::string& node_id,
                                                 const v1::Resources& asks,
                                                 const v1::HostResources& host) const {
  const auto ranks = this->ranks.find(node_id);
  if (ranks == this->ranks.end()) return 0;
  const int64_t held = static_cast<int64_t>(devices.at(node_id).size());
  return (asks.memory_bytes() > 0 ? ranks->second : held) * RankMemoryBytes(asks, host);
}

std::map<std::string, JobManager::StoppingRanks> JobManager::Stopping(absl::Time now) const {
  std::map<std::string, StoppingRanks> out;
  for (const auto& [key, rank] : devices_.Draining(now)) {
    const auto& [job_id, attempt, index] = key;
    // (A rank of a job this coordinator does not know, adopted at its node's hello, holds its
    // device but counts for no account.)
    const auto it = jobs_.find(job_id);
    if (it == jobs_.end()) continue;
    // (The running attempt's ranks count as running; a draining rank of it would be a slip.)
    if (IsActive(it->second.state()) && attempt == it->second.attempt()) continue;
    StoppingRanks& stopping = out[job_id];
    stopping.devices[rank.node_id].insert(rank.device);
    ++stopping.ranks[rank.node_id];
    stopping.until = std::max(stopping.until, rank.deadline);
  }
  return out;
}

namespace {

std::pair<std::string, std::string> ArrayKey(const v1::Job& job) {
  return {job.owner(), job.spec().array().id()};
}

}  // namespace

std::vector<const v1::Job*> JobManager::RunningLimitedArrayTasks() const {
  std::vector<const v1::Job*> out;
  const std::set<std::string> draining = devices_.DrainingJobs(clock_.Now());
  auto add = [&](const v1::Job& job) {
    if (job.spec().array().max_running() > 0) out.push_back(&job);
  };
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (IsActive(job.state()) || draining.count(id) > 0) add(job);
  }
  // (Ended tasks: cancelled, or failed, their ranks told to stop.)
  for (const std::string& id : draining) {
    const auto it = jobs_.find(id);
    if (it != jobs_.end() && IsTerminal(it->second.state())) add(it->second);
  }
  return out;
}

std::set<std::string> JobManager::ArrayTasksToConsider() const {
  if (unfinished_array_tasks_ == 0) return {};
  std::map<std::pair<std::string, std::string>, int> room;
  std::set<std::string> counted;
  for (const v1::Job* job : RunningLimitedArrayTasks()) {
    auto [it, added] = room.try_emplace(ArrayKey(*job), job->spec().array().max_running());
    --it->second;
    counted.insert(job->id());
  }
  std::vector<const v1::Job*> waiting;
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (job.spec().array().max_running() > 0 && IsPending(job.state())) waiting.push_back(&job);
  }
  std::sort(waiting.begin(), waiting.end(),
            [](const v1::Job* a, const v1::Job* b) { return a->seq() < b->seq(); });
  std::set<std::string> out;
  for (const v1::Job* job : waiting) {
    // A restarting task whose last attempt still stops holds its own place already: it is one
    // task, however many of its attempts are on the nodes.
    if (counted.count(job->id()) > 0) {
      out.insert(job->id());
      continue;
    }
    auto [it, added] = room.try_emplace(ArrayKey(*job), job->spec().array().max_running());
    if (it->second-- > 0) out.insert(job->id());
  }
  return out;
}

int JobManager::RunningArrayTasks(const v1::Job& job, int* stopping) const {
  int running = 0;
  if (stopping != nullptr) *stopping = 0;
  for (const v1::Job* other : RunningLimitedArrayTasks()) {
    if (ArrayKey(*other) != ArrayKey(job)) continue;
    ++running;
    if (stopping != nullptr && !IsActive(other->state())) ++*stopping;
  }
  return running;
}

std::optional<JobManager::Dependency> JobManager::UnmetDependency(const v1::Job& job) const {
  for (const std::string& id : job.spec().after()) {
    const auto it = jobs_.find(id);
    if (it == jobs_.end() || it->second.state() == v1::SUCCEEDED) continue;
    const v1::JobState state = it->second.state();
    return Dependency{id, state, IsTerminal(state)};
  }
  return std::nullopt;
}

void JobManager::FailJobsWithFailedDependencies() {
  if (unfinished_with_after_ == 0) return;
  std::vector<std::pair<std::string, Dependency>> failing;
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (!IsPending(job.state()) || job.spec().after_size() == 0) continue;
    if (auto unmet = UnmetDependency(job); unmet.has_value() && unmet->failed) {
      failing.emplace_back(id, *unmet);
    }
  }
  for (const auto& [id, dependency] : failing) {
    v1::Job& job = jobs_.at(id);
    Transition(job, v1::FAILED,
               absl::StrCat("after: job ", dependency.job_id, " ended ",
                            v1::JobState_Name(dependency.state), "; this job cannot start"));
    Persist(job);
  }
  // Their own dependents fail in the next pass, which their end asks for.
  if (!failing.empty()) WakeScheduler();
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
    stop_asked_at_[id] = victim.version();
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
    v1::RankPlacement* rp = job.add_placement();
    rp->set_node_id(node.id);
    rp->set_first_rank(rank);
    for (const int index : node.device_indices) {
      if (rp->device_indices_size() == g.devices) break;
      if (devices_.Hold(node.id, index)) rp->add_device_indices(index);
    }
    TY_CHECK(rp->device_indices_size() == g.devices,
             absl::StrCat("scheduler over-allocated node ", node.id));
    // resources.ranks_per_node: the node's ranks share its devices.
    if (const int per_device = RanksPerDevice(job.spec()); per_device > 1) {
      rp->set_ranks(g.devices * per_device);
    }
    rank += RanksOf(*rp);
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
  if (IsCommandJob(job.spec()))
    job.set_master_port(devices_.ReservePort(job.placement(0).node_id()));
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
    a.set_group_world_size(job.placement_size());
    a.set_master_addr(master_addr);
    a.set_master_port(job.master_port());
    a.set_job_id(job.id());
    a.set_attempt(job.attempt());
    a.set_world_size(job.world_size());
    a.set_first_rank(p.first_rank());
    *a.mutable_device_indices() = p.device_indices();
    a.set_ranks(p.ranks());
    a.set_spec(spec);
    if (rank_coordinators_) a.set_coordinator_address(rank_coordinators_());
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
  std::map<std::string, v1::Node*> by_id;
  for (v1::Node& node : nodes) {
    by_id[node.id()] = &node;
    const std::vector<int> held = devices_.HeldOn(node.id());
    node.mutable_allocated_devices()->Add(held.begin(), held.end());
  }
  // The CPUs and memory running ranks hold (their requests, or the node's per-device charge).
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (!IsActive(job.state())) continue;
    for (const auto& pl : job.placement()) {
      auto on = by_id.find(pl.node_id());
      if (on == by_id.end()) continue;
      v1::Node& node = *on->second;
      node.set_allocated_cpus(node.allocated_cpus() +
                              PlacementCpuMillis(job.spec().resources(), pl, node.host()) / 1000.0);
      node.set_allocated_memory_bytes(
          node.allocated_memory_bytes() +
          PlacementMemoryBytes(job.spec().resources(), pl, node.host()));
    }
  }
  // And what stopping ranks still hold (their devices are among the held ones above).
  for (const auto& [id, stopping] : Stopping(clock_.Now())) {
    const v1::Resources& asks = jobs_.at(id).spec().resources();
    for (const auto& [node_id, ranks] : stopping.ranks) {
      auto on = by_id.find(node_id);
      if (on == by_id.end()) continue;
      v1::Node& node = *on->second;
      node.set_allocated_cpus(node.allocated_cpus() +
                              stopping.CpuMillisOn(node_id, asks, node.host()) / 1000.0);
      node.set_allocated_memory_bytes(node.allocated_memory_bytes() +
                                      stopping.MemoryBytesOn(node_id, asks, node.host()));
    }
  }
  std::map<std::string, int64_t> reserved = ReservedPsBytes();
  for (v1::Node& node : nodes) {
    if (node.role() == v1::PARAMETER_SERVER) node.set_reserved_bytes(reserved[node.id()]);
  }
  return nodes;
}

}  // namespace trainyard::coordinator
