// Implementation of Schedule(): gang placement with packing and EASY backfill (see scheduler.h).
//
// Nodes are indexed by free-device count (one ordered bucket per count), so that finding the
// best-fit node or the node with the most free devices costs O(D + log N) instead of a scan over
// all N nodes. Everything here is local to one call: no state survives between calls.
#include "server/coordinator/scheduler.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace trainyard::coordinator {
namespace {

// Free devices of the schedulable nodes, indexed by count. Nodes outside the index (not
// schedulable) have 0 free devices as far as placement is concerned.
class FreeIndex {
 public:
  // `free_devices[n]` must be in [0, max_free_devices]; nodes with `indexed[n] == false` are left
  // out of the index.
  FreeIndex(const std::vector<int>& free_devices, const std::vector<bool>& indexed,
            int max_free_devices)
      : free_(free_devices.size(), 0), buckets_(max_free_devices + 1) {
    for (size_t n = 0; n < free_devices.size(); ++n) {
      if (indexed[n]) Set(static_cast<int>(n), free_devices[n]);
    }
  }

  int64_t total() const { return total_; }
  int free(int node) const { return free_[node]; }
  // The devices a job can take in whole blocks of `block` (each node's free devices rounded down
  // to a multiple of it; with `spread`, one block a node at most).
  int64_t BlockTotal(int block, bool spread = false) const {
    if (spread) {
      int64_t nodes = 0;
      for (size_t f = static_cast<size_t>(std::max(block, 1)); f < buckets_.size(); ++f) {
        nodes += static_cast<int64_t>(buckets_[f].size());
      }
      return nodes * std::max(block, 1);
    }
    if (block <= 1) return total_;
    int64_t sum = 0;
    for (size_t f = static_cast<size_t>(block); f < buckets_.size(); ++f) {
      sum += static_cast<int64_t>(buckets_[f].size()) * (static_cast<int>(f) / block * block);
    }
    return sum;
  }

  // Sets the free-device count of an indexed node; `value` in [0, max_free_devices].
  void Set(int node, int value) {
    const int old = free_[node];
    if (old == value) return;
    if (old > 0) buckets_[old].erase(node);
    if (value > 0) buckets_[value].insert(node);
    free_[node] = value;
    total_ += value - old;
  }

  // Picks `devices` devices by the packing rule, every node's share a multiple of `block` (a
  // multiple of which `devices` is), takes them out of the index and returns the grants in rank
  // order. Requires 0 < devices <= BlockTotal(block, spread). With `spread`, one block on each of
  // devices / block nodes, the best-fitting ones (resources.nodes).
  std::vector<DeviceGrant> Take(int devices, int block = 1, bool spread = false) {
    std::vector<DeviceGrant> grants;
    int remaining = devices;
    if (spread) {
      block = std::max(block, 1);
      std::vector<std::pair<int, int>> left;  // (node, free after its block): out of the way
      while (remaining > 0) {
        int fit = block;
        while (fit < static_cast<int>(buckets_.size()) && buckets_[fit].empty()) ++fit;
        if (fit >= static_cast<int>(buckets_.size())) break;  // unreachable within BlockTotal
        const int node = *buckets_[fit].begin();
        grants.push_back({node, block});
        left.push_back({node, fit - block});
        Set(node, 0);
        remaining -= block;
      }
      for (const auto& [node, free] : left) Set(node, free);
      return grants;
    }
    while (remaining > 0) {
      // Best fit: the smallest free count that still holds the remainder.
      int fit = remaining < static_cast<int>(buckets_.size()) ? remaining : -1;
      while (fit >= 0 && fit < static_cast<int>(buckets_.size()) && buckets_[fit].empty()) ++fit;
      if (fit >= 0 && fit < static_cast<int>(buckets_.size())) {
        const int node = *buckets_[fit].begin();
        grants.push_back({node, remaining});
        Set(node, fit - remaining);
        break;
      }
      // No single node holds the remainder: take the node with the most free devices whole (its
      // whole blocks; what is left on it is less than a block, so it is not picked again).
      int most = static_cast<int>(buckets_.size()) - 1;
      while (most > 0 && buckets_[most].empty()) --most;
      const int take = std::max(block, 1) > 1 ? most / block * block : most;
      if (take == 0) break;  // unreachable when devices <= BlockTotal(block)
      const int node = *buckets_[most].begin();
      grants.push_back({node, take});
      Set(node, most - take);
      remaining -= take;
    }
    return grants;
  }

 private:
  std::vector<int> free_;               // per node
  std::vector<std::set<int>> buckets_;  // buckets_[f]: indexed nodes with f > 0 free devices
  int64_t total_ = 0;
};

// The blocked head job's reservation and what backfill must leave it.
struct HeadReservation {
  absl::Time start;
  std::vector<DeviceGrant> grants;
  // Per node of `grants`: projected free devices at `start`, minus what backfill of kind (b) took.
  std::vector<int> projected_free_at_start;
};

struct Release {
  absl::Time at;
  int node;
  int devices;
};

// Earliest start of a `devices`-sized job given the current free devices and the releases of
// running jobs and of jobs placed in this pass; nullopt when it never fits on known releases.
std::optional<HeadReservation> ComputeReservation(
    const ClusterSnapshot& snapshot, const std::vector<bool>& usable,
    const std::vector<int>& total_devices, int max_devices_per_node, const FreeIndex& index,
    const std::vector<Placement>& placements,
    const std::vector<std::optional<absl::Time>>& placement_ends, int devices, int block,
    bool spread) {
  const int num_nodes = static_cast<int>(snapshot.nodes.size());
  std::vector<Release> releases;
  auto add_releases = [&](const std::vector<DeviceGrant>& grants, absl::Time end) {
    const absl::Time at = std::max(end, snapshot.now);
    for (const DeviceGrant& g : grants) {
      if (g.node < 0 || g.node >= num_nodes || !usable[g.node] || g.devices <= 0) continue;
      releases.push_back({at, g.node, g.devices});
    }
  };
  for (const RunningJobInfo& job : snapshot.running) {
    if (job.expected_end.has_value()) add_releases(job.grants, *job.expected_end);
  }
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placement_ends[i].has_value()) add_releases(placements[i].grants, *placement_ends[i]);
  }
  std::sort(releases.begin(), releases.end(), [](const Release& a, const Release& b) {
    return std::tie(a.at, a.node) < std::tie(b.at, b.node);
  });

  std::vector<int> projected(num_nodes);
  for (int n = 0; n < num_nodes; ++n) projected[n] = index.free(n);
  int64_t projected_total = index.total();
  size_t e = 0;
  std::optional<absl::Time> start;
  while (e < releases.size()) {
    const absl::Time t = releases[e].at;
    for (; e < releases.size() && releases[e].at == t; ++e) {
      const Release& r = releases[e];
      // Clamp: a snapshot whose grants exceed a node's size must not conjure devices.
      const int added = std::min(r.devices, total_devices[r.node] - projected[r.node]);
      projected[r.node] += added;
      projected_total += added;
    }
    if (projected_total >= devices) {
      int64_t in_blocks = 0;
      for (int n = 0; n < num_nodes; ++n) {
        in_blocks += spread ? (projected[n] >= block ? block : 0) : projected[n] / block * block;
      }
      if (in_blocks >= devices) {
        start = t;
        break;
      }
    }
  }
  if (!start.has_value()) return std::nullopt;

  HeadReservation reservation;
  reservation.start = *start;
  FreeIndex at_start(projected, usable, max_devices_per_node);
  reservation.grants = at_start.Take(devices, block, spread);
  for (const DeviceGrant& g : reservation.grants) {
    reservation.projected_free_at_start.push_back(projected[g.node]);
  }
  return reservation;
}

// Who a running job is for the sharing rules: its account, and whether it runs within its
// account's quota (protected from other accounts' jobs).
struct RunningShare {
  int account = -1;
  bool protected_by_quota = false;
};

// The running jobs `head` should preempt, or none (see Schedule): `eligible[n]` says whether
// node n may take the head's ranks, `free_now` how many of their devices are free and
// `node_free[n]` how many of node n's; `head_account` is the head's account (-1: none) and
// `head_within_quota` whether it fits in that account's quota. A head placed in blocks
// (rank_block) counts only each node's whole blocks as room.
std::vector<std::string> ChooseVictims(const ClusterSnapshot& snapshot, const PendingJobInfo& head,
                                       const std::vector<bool>& eligible, int64_t free_now,
                                       const std::vector<int>& node_free,
                                       const std::vector<RunningShare>& shares, int head_account,
                                       bool head_within_quota,
                                       const std::vector<int64_t>& account_used) {
  struct Candidate {
    const RunningJobInfo* job;
    int64_t freed;  // devices on eligible nodes
    double lost;    // device-seconds since the last checkpoint (all its devices)
    int64_t all;    // all its devices
    int account;
  };
  // Devices each account may still lose to other accounts' heads without going below its quota:
  // of what it holds, not what its jobs already stopping give back anyway, wherever they are (the
  // account holds that much less once they have exited).
  std::vector<int64_t> leaving(account_used.size(), 0);
  for (size_t i = 0; i < snapshot.running.size(); ++i) {
    const int a = shares[i].account;
    if (!snapshot.running[i].preempting || a < 0) continue;
    for (const DeviceGrant& g : snapshot.running[i].grants) leaving[a] += std::max(0, g.devices);
  }
  std::vector<int64_t> spare(account_used.size(), 0);
  for (size_t a = 0; a < account_used.size(); ++a) {
    const int64_t quota = snapshot.accounts[a].quota;
    spare[a] = quota < 0 ? INT64_MAX : std::max<int64_t>(0, account_used[a] - leaving[a] - quota);
  }
  const int num_nodes = static_cast<int>(snapshot.nodes.size());
  auto devices_on_eligible = [&](const RunningJobInfo& r, int64_t* all) {
    int64_t freed = 0;
    *all = 0;
    for (const DeviceGrant& g : r.grants) {
      if (g.devices <= 0) continue;
      *all += g.devices;
      if (g.node >= 0 && g.node < num_nodes && eligible[g.node]) freed += g.devices;
    }
    return freed;
  };
  auto may_preempt = [&](const RunningJobInfo& r, const RunningShare& share) {
    if (!r.preemptible || snapshot.now - r.start < snapshot.min_run_time) return false;
    if (head_account >= 0 && share.account == head_account) return r.priority < head.priority;
    if (share.protected_by_quota) return false;
    return r.priority < head.priority || head_within_quota;
  };
  int64_t available = free_now;
  // In blocks: each eligible node's free devices as the chosen jobs stop, and the room in whole
  // blocks they make.
  const int block = std::max(1, head.rank_block);
  std::vector<int64_t> on_node(num_nodes, 0);
  for (int n = 0; n < num_nodes; ++n) on_node[n] = eligible[n] ? node_free[n] : 0;
  auto stops = [&](const RunningJobInfo& r, int sign) {
    for (const DeviceGrant& g : r.grants) {
      if (g.devices > 0 && g.node >= 0 && g.node < num_nodes && eligible[g.node]) {
        on_node[g.node] += sign * g.devices;
      }
    }
  };
  auto room = [&] {
    if (block == 1 && !head.one_block_per_node) return available;
    int64_t in_blocks = 0;
    for (int64_t f : on_node) {
      in_blocks += head.one_block_per_node ? (f >= block ? block : 0) : f / block * block;
    }
    return in_blocks;
  };
  std::vector<Candidate> candidates;
  for (size_t i = 0; i < snapshot.running.size(); ++i) {
    const RunningJobInfo& r = snapshot.running[i];
    int64_t all = 0;
    const int64_t freed = devices_on_eligible(r, &all);
    if (r.preempting) {
      available += freed;
      stops(r, +1);
      continue;
    }
    if (freed == 0 || !may_preempt(r, shares[i])) continue;
    const absl::Time since = std::max(r.start, r.last_checkpoint.value_or(absl::InfinitePast()));
    candidates.push_back({&r, freed,
                          static_cast<double>(all) * absl::ToDoubleSeconds(snapshot.now - since),
                          all, shares[i].account});
  }
  if (room() >= head.devices) return {};  // stopping jobs will make room: wait for them
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    const double x = a.lost / a.freed, y = b.lost / b.freed;
    if (x != y) return x < y;
    if (a.job->priority != b.job->priority) return a.job->priority < b.job->priority;
    return a.job->id < b.job->id;
  });
  std::vector<Candidate> chosen;
  for (const Candidate& c : candidates) {
    if (room() >= head.devices) break;
    const bool other = c.account >= 0 && c.account != head_account;
    if (other && spare[c.account] < c.all) continue;  // it would leave its account below quota
    if (other) spare[c.account] -= c.all;
    chosen.push_back(c);
    available += c.freed;
    stops(*c.job, +1);
  }
  if (room() < head.devices) return {};  // even all of them would not make room
  // Drop the costliest victims the head does not need after all.
  std::vector<size_t> by_cost(chosen.size());
  std::iota(by_cost.begin(), by_cost.end(), 0);
  std::sort(by_cost.begin(), by_cost.end(),
            [&](size_t a, size_t b) { return chosen[a].lost > chosen[b].lost; });
  std::vector<bool> keep(chosen.size(), true);
  for (size_t i : by_cost) {
    available -= chosen[i].freed;
    stops(*chosen[i].job, -1);
    if (room() >= head.devices) {
      keep[i] = false;
    } else {
      available += chosen[i].freed;
      stops(*chosen[i].job, +1);
    }
  }
  std::vector<std::string> victims;
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (keep[i]) victims.push_back(chosen[i].job->id);
  }
  return victims;
}

// One scheduling pass over a snapshot: the nodes' free devices (FreeIndex), the accounts' and
// users' use, the queue in order, then each job placed, made the head (with a reservation and
// maybe a preemption), backfilled behind it, or left waiting with its reason.
class SchedulePass {
 public:
  explicit SchedulePass(const ClusterSnapshot& snapshot)
      : s_(snapshot),
        num_nodes_(static_cast<int>(snapshot.nodes.size())),
        num_accounts_(static_cast<int>(snapshot.accounts.size())),
        num_users_(static_cast<int>(snapshot.users.size())) {}

  ScheduleResult Run() {
    IndexNodes();
    CountShares();
    RankFairShare();
    const std::vector<int> order = Order();
    result_.waits.resize(s_.pending.size());
    for (size_t position = 0; position < order.size(); ++position) {
      Consider(order[position], static_cast<int>(position));
    }
    return std::move(result_);
  }

 private:
  enum class Phase { kInOrder, kBackfill, kStopped };
  struct Hidden {
    int node;
    int free;
  };

  int user_of(int u) const { return u >= 0 && u < num_users_ ? u : -1; }
  int account_of(int u) const {
    if (user_of(u) < 0) return -1;
    const int a = s_.users[u].account;
    return a >= 0 && a < num_accounts_ ? a : -1;
  }
  // How many ranks of `job` `cpu_millis` and `memory` of node n hold (INT_MAX: no limit there).
  int RanksFit(int n, const PendingJobInfo& job, int64_t cpu_millis, int64_t memory) const {
    const SchedNode& node = s_.nodes[n];
    int64_t fit = INT_MAX;
    if (const int64_t c = CpuCharge(node, job); node.total_cpu_millis >= 0 && c > 0) {
      fit = std::min(fit, std::max<int64_t>(0, cpu_millis) / c);
    }
    if (const int64_t m = MemoryCharge(node, job); node.total_memory >= 0 && m > 0) {
      fit = std::min(fit, std::max<int64_t>(0, memory) / m);
    }
    return static_cast<int>(fit);
  }
  static int64_t CpuCharge(const SchedNode& node, const PendingJobInfo& job) {
    return job.cpu_millis > 0 ? job.cpu_millis : std::max<int64_t>(0, node.cpu_millis_per_device);
  }
  static int64_t MemoryCharge(const SchedNode& node, const PendingJobInfo& job) {
    return job.memory_bytes > 0 ? job.memory_bytes : std::max<int64_t>(0, node.memory_per_device);
  }
  // The devices of node n that `job` could ever hold: its CPUs and memory counted.
  int JobTotalOn(int n, const PendingJobInfo& job) const {
    return std::min(total_devices_[n],
                    RanksFit(n, job, s_.nodes[n].total_cpu_millis, s_.nodes[n].total_memory));
  }
  bool FitsQuota(const PendingJobInfo& job) const {
    const int a = account_of(job.user);
    return a >= 0 && s_.accounts[a].quota >= 0 &&
           account_used_[a] + job.devices <= s_.accounts[a].quota;
  }

  void IndexNodes();
  void CountShares();
  void RankFairShare();
  std::vector<int> Order() const;
  WaitReason HeldByLimits(const PendingJobInfo& job) const;
  void Place(const PendingJobInfo& job, std::vector<DeviceGrant> grants, bool backfilled);
  int SpareOn(size_t h) const;
  void Consider(int i, int position);
  WaitReason Decide(const PendingJobInfo& job);
  WaitReason MakeHead(const PendingJobInfo& job, int block);
  WaitReason Backfill(const PendingJobInfo& job, int block);

  const ClusterSnapshot& s_;
  const int num_nodes_, num_accounts_, num_users_;
  ScheduleResult result_;
  // Sanitized node state: counts clamped to [0, total]; non-schedulable nodes left out.
  std::vector<int> total_devices_, free_devices_;
  std::vector<bool> usable_;
  int max_devices_per_node_ = 0;
  int64_t schedulable_capacity_ = 0;
  std::optional<FreeIndex> index_;
  // Nodes that take only some owners' jobs (usually none or a few): for each job, those that do
  // not take it are hidden from the index while its placement is decided.
  std::vector<int> restricted_;
  std::vector<Hidden> hidden_for_job_;
  // CPUs and memory free on the nodes that count them (`counted_`), as placements take them; for
  // the job being decided, the nodes whose free devices its ranks' CPUs or memory cut down.
  std::vector<int64_t> free_cpu_, free_memory_;
  std::vector<int> counted_;
  std::vector<Hidden> capped_for_job_;
  // The counted nodes whose free CPUs or memory hold fewer ranks at their per-device charge than
  // they have free devices (ranks that asked for more than a device's share took them): the only
  // nodes that cut down a "small" job, one asking at most the smallest per-device charge, which
  // then costs O(|deficit_|) rather than O(|counted_|). Kept for the real free devices.
  std::set<int> deficit_;
  std::vector<char> in_deficit_;
  int64_t min_cpu_per_device_ = INT64_MAX, min_memory_per_device_ = INT64_MAX;
  // Devices that ranks asking for nothing can never use on the counted nodes (per-device charges
  // beyond a node's CPUs or memory); small jobs are judged quickly only when it is 0.
  int64_t default_capacity_loss_ = 0;
  // Per (cpu_millis, memory_bytes) asked: the devices the counted nodes can never give such a
  // job (totals only: the same all pass).
  std::map<std::pair<int64_t, int64_t>, int64_t> capacity_loss_;

  void UpdateDeficit(int n) {
    const SchedNode& node = s_.nodes[n];
    const int64_t free = index_->free(n);
    const bool short_cpu = node.total_cpu_millis >= 0 &&
                           free_cpu_[n] < free * std::max<int64_t>(0, node.cpu_millis_per_device);
    const bool short_memory = node.total_memory >= 0 &&
                              free_memory_[n] < free * std::max<int64_t>(0, node.memory_per_device);
    const bool deficit = short_cpu || short_memory;
    if (deficit == static_cast<bool>(in_deficit_[n])) return;
    in_deficit_[n] = deficit;
    if (deficit) {
      deficit_.insert(n);
    } else {
      deficit_.erase(n);
    }
  }
  bool Small(const PendingJobInfo& job) const {
    return default_capacity_loss_ == 0 &&
           (job.cpu_millis <= 0 || job.cpu_millis <= min_cpu_per_device_) &&
           (job.memory_bytes <= 0 || job.memory_bytes <= min_memory_per_device_);
  }
  std::vector<bool> usable_for_job_;
  // Sharing: the devices accounts and users hold, and which running jobs their account's quota
  // protects (of an account's running jobs, the earliest started that fit in its quota).
  std::vector<int64_t> account_used_, user_used_;
  std::vector<RunningShare> running_shares_;
  // Fair-share order of users as a dense rank; the last entry is for jobs of no user.
  std::vector<uint32_t> fair_rank_;
  // Expected end of each placement of this pass (parallel to result_.placements).
  std::vector<std::optional<absl::Time>> placement_ends_;
  Phase phase_ = Phase::kInOrder;
  std::optional<HeadReservation> head_;
  std::vector<int> head_slot_;  // per node: index into head_->grants, or -1
  // Devices of the head's nodes that backfill of kind (b) may not use; recomputed when stale.
  int64_t head_protected_ = 0;
  bool head_protected_stale_ = true;
};

void SchedulePass::IndexNodes() {
  total_devices_.assign(num_nodes_, 0);
  free_devices_.assign(num_nodes_, 0);
  usable_.assign(num_nodes_, false);
  for (int n = 0; n < num_nodes_; ++n) {
    const SchedNode& node = s_.nodes[n];
    total_devices_[n] = std::max(0, node.total_devices);
    if (!node.schedulable) continue;
    usable_[n] = true;
    free_devices_[n] = std::clamp(node.free_devices, 0, total_devices_[n]);
    max_devices_per_node_ = std::max(max_devices_per_node_, total_devices_[n]);
    schedulable_capacity_ += total_devices_[n];
  }
  index_.emplace(free_devices_, usable_, max_devices_per_node_);
  for (int n = 0; n < num_nodes_; ++n) {
    if (usable_[n] && !s_.nodes[n].owners.empty()) restricted_.push_back(n);
  }
  free_cpu_.assign(num_nodes_, 0);
  free_memory_.assign(num_nodes_, 0);
  for (int n = 0; n < num_nodes_; ++n) {
    const SchedNode& node = s_.nodes[n];
    if (!usable_[n] || (node.total_cpu_millis < 0 && node.total_memory < 0)) continue;
    counted_.push_back(n);
    if (node.total_cpu_millis >= 0) {
      free_cpu_[n] = std::clamp<int64_t>(node.free_cpu_millis, 0, node.total_cpu_millis);
    }
    if (node.total_memory >= 0) {
      free_memory_[n] = std::clamp<int64_t>(node.free_memory, 0, node.total_memory);
    }
    if (node.total_cpu_millis >= 0) {
      min_cpu_per_device_ = std::min(min_cpu_per_device_, node.cpu_millis_per_device);
    }
    if (node.total_memory >= 0) {
      min_memory_per_device_ = std::min(min_memory_per_device_, node.memory_per_device);
    }
    default_capacity_loss_ += total_devices_[n] - JobTotalOn(n, PendingJobInfo{});
  }
  in_deficit_.assign(num_nodes_, 0);
  for (int n : counted_) UpdateDeficit(n);
}

void SchedulePass::CountShares() {
  account_used_.assign(num_accounts_, 0);
  user_used_.assign(num_users_, 0);
  running_shares_.assign(s_.running.size(), RunningShare{});
  std::vector<int64_t> running_devices(s_.running.size(), 0);
  std::vector<std::vector<int>> within_quota(num_accounts_);
  for (size_t i = 0; i < s_.running.size(); ++i) {
    const RunningJobInfo& r = s_.running[i];
    for (const DeviceGrant& g : r.grants) running_devices[i] += std::max(0, g.devices);
    const int u = user_of(r.user);
    const int a = account_of(r.user);
    running_shares_[i].account = a;
    if (u >= 0) user_used_[u] += running_devices[i];
    if (a < 0) continue;
    account_used_[a] += running_devices[i];
    // Jobs already stopping are leaving: the quota protects those that stay.
    if (s_.accounts[a].quota >= 0 && !r.preempting) {
      within_quota[a].push_back(static_cast<int>(i));
    }
  }
  for (int a = 0; a < num_accounts_; ++a) {
    std::vector<int>& jobs = within_quota[a];
    std::sort(jobs.begin(), jobs.end(), [&](int x, int y) {
      const RunningJobInfo& p = s_.running[x];
      const RunningJobInfo& q = s_.running[y];
      return std::tie(p.start, p.id, x) < std::tie(q.start, q.id, y);
    });
    int64_t sum = 0;
    for (int i : jobs) {
      sum += running_devices[i];
      running_shares_[i].protected_by_quota = sum <= s_.accounts[a].quota;
    }
  }
}

// Fair-share order of users as a dense rank (equal, equal rank): by their account's usage /
// share, then their own usage.
void SchedulePass::RankFairShare() {
  auto usage_of = [](double usage) { return std::isfinite(usage) ? std::max(0.0, usage) : 0.0; };
  std::vector<double> account_key(num_accounts_);  // usage / share: lower goes first
  for (int a = 0; a < num_accounts_; ++a) {
    const SchedAccount& account = s_.accounts[a];
    const double share = account.share > 0 && std::isfinite(account.share) ? account.share : 1;
    account_key[a] = usage_of(account.usage) / share;
  }
  std::vector<std::pair<double, double>> fair(num_users_ + 1, {0.0, 0.0});
  for (int u = 0; u < num_users_; ++u) {
    const int a = account_of(u);
    fair[u] = {a >= 0 ? account_key[a] : 0.0, usage_of(s_.users[u].usage)};
  }
  fair_rank_.resize(num_users_ + 1);
  std::vector<std::pair<double, double>> sorted = fair;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  for (int u = 0; u <= num_users_; ++u) {
    fair_rank_[u] = static_cast<uint32_t>(std::lower_bound(sorted.begin(), sorted.end(), fair[u]) -
                                          sorted.begin());
  }
}

// The queue's order, as compact keys (the queue is large; its entries are not): within quota
// first, then priority descending, then fair share, in one word; then submission, then id and
// position, which only equal keys need to look up.
std::vector<int> SchedulePass::Order() const {
  struct OrderKey {
    uint64_t major;  // bit 63: beyond quota; bits 31..62: priority, descending; 0..30: fair rank
    int64_t submit_seq;
    int index;
  };
  std::vector<OrderKey> keys(s_.pending.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const PendingJobInfo& job = s_.pending[i];
    const int u = user_of(job.user);
    // Higher priority, smaller word: flipping the sign bit orders signed values as unsigned.
    const uint32_t priority = ~(static_cast<uint32_t>(job.priority) ^ 0x80000000u);
    const uint64_t beyond = FitsQuota(job) ? 0 : uint64_t{1} << 63;
    keys[i] = {beyond | (static_cast<uint64_t>(priority) << 31) |
                   (fair_rank_[u >= 0 ? u : num_users_] & 0x7fffffffu),
               job.submit_seq, static_cast<int>(i)};
  }
  std::sort(keys.begin(), keys.end(), [&](const OrderKey& a, const OrderKey& b) {
    if (a.major != b.major) return a.major < b.major;
    if (a.submit_seq != b.submit_seq) return a.submit_seq < b.submit_seq;
    const std::string& x = s_.pending[a.index].id;
    const std::string& y = s_.pending[b.index].id;
    if (x != y) return x < y;
    return a.index < b.index;
  });
  std::vector<int> order(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) order[i] = keys[i].index;
  return order;
}

// Why the account's or user's limits hold `job` back now, or kPlaced when they do not.
WaitReason SchedulePass::HeldByLimits(const PendingJobInfo& job) const {
  const int a = account_of(job.user);
  if (!job.preemptible && !FitsQuota(job)) return WaitReason::kNotPreemptibleBeyondQuota;
  if (a >= 0) {
    const SchedAccount& account = s_.accounts[a];
    if (account.quota >= 0 && account.borrow_limit >= 0 &&
        account_used_[a] + job.devices > account.quota + account.borrow_limit) {
      return WaitReason::kAccountLimit;
    }
  }
  const int u = user_of(job.user);
  if (u >= 0 && s_.users[u].max_devices >= 0 &&
      user_used_[u] + job.devices > s_.users[u].max_devices) {
    return WaitReason::kUserLimit;
  }
  return WaitReason::kPlaced;
}

void SchedulePass::Place(const PendingJobInfo& job, std::vector<DeviceGrant> grants,
                         bool backfilled) {
  for (const DeviceGrant& g : grants) {
    const SchedNode& node = s_.nodes[g.node];
    if (node.total_cpu_millis >= 0) free_cpu_[g.node] -= g.devices * CpuCharge(node, job);
    if (node.total_memory >= 0) free_memory_[g.node] -= g.devices * MemoryCharge(node, job);
  }
  if (const int a = account_of(job.user); a >= 0) account_used_[a] += job.devices;
  if (const int u = user_of(job.user); u >= 0) user_used_[u] += job.devices;
  result_.placements.push_back({job.id, std::move(grants), backfilled});
  placement_ends_.push_back(job.max_runtime.has_value()
                                ? std::optional<absl::Time>(s_.now + *job.max_runtime)
                                : std::nullopt);
}

int SchedulePass::SpareOn(size_t h) const {
  const DeviceGrant& g = head_->grants[h];
  return std::max(0, std::min(index_->free(g.node), head_->projected_free_at_start[h] - g.devices));
}

// Queue position `position`, pending job `i`: unplaceable, held by its limits, or decided with
// the nodes its owner may not use hidden from the index.
void SchedulePass::Consider(int i, int position) {
  const PendingJobInfo& job = s_.pending[i];
  JobWait& wait = result_.waits[i];
  wait.position = position;
  hidden_for_job_.clear();
  FreeIndex& index = *index_;
  auto takes = [&](int n) {
    const auto& owners = s_.nodes[n].owners;
    return owners.empty() || std::find(owners.begin(), owners.end(), job.owner) != owners.end();
  };
  int64_t capacity = schedulable_capacity_;
  for (int n : restricted_) {
    if (takes(n)) continue;
    hidden_for_job_.push_back({n, index.free(n)});
    capacity -= total_devices_[n];
  }
  // Nodes that count CPUs and memory hold only as many of its ranks as those fit (a small job
  // all of their devices: Small).
  const bool small = Small(job);
  if (!small) {
    // (The same for every job of the same asks when no node is owners-only: computed once.)
    const std::pair<int64_t, int64_t> asks = {job.cpu_millis, job.memory_bytes};
    auto cached = restricted_.empty() ? capacity_loss_.find(asks) : capacity_loss_.end();
    int64_t loss = 0;
    if (cached != capacity_loss_.end()) {
      loss = cached->second;
    } else {
      for (int n : counted_) {
        if (takes(n)) loss += total_devices_[n] - JobTotalOn(n, job);
      }
      if (restricted_.empty()) capacity_loss_[asks] = loss;
    }
    capacity -= loss;
  }
  // In blocks: the nodes' whole blocks.
  const int block = std::max(1, job.rank_block);
  if (block > 1 || job.one_block_per_node) {
    capacity = 0;
    for (int n = 0; n < num_nodes_; ++n) {
      if (!usable_[n] || !takes(n)) continue;
      const int total = JobTotalOn(n, job);
      capacity += job.one_block_per_node ? (total >= block ? block : 0) : total / block * block;
    }
  }
  if (job.devices <= 0 || job.devices > capacity || job.devices % block != 0) {
    result_.unplaceable.push_back(job.id);
    wait.reason = WaitReason::kUnplaceable;
    return;
  }
  // Jobs outside accounts and caps (user -1) skip the limits: the plain scheduler's fast path.
  if (job.user >= 0 || !job.preemptible) {
    if (wait.reason = HeldByLimits(job); wait.reason != WaitReason::kPlaced) return;
  }
  if (phase_ == Phase::kStopped) {
    wait.reason = WaitReason::kHeadStartUnknown;
    return;
  }
  for (const Hidden& h : hidden_for_job_) index.Set(h.node, 0);
  // Its view of the nodes that count CPUs and memory: as many free devices as its ranks fit.
  capped_for_job_.clear();
  auto cap = [&](int n) {
    const int free = index.free(n);
    if (free == 0) return;  // full, or hidden from it
    if (const int fit = RanksFit(n, job, free_cpu_[n], free_memory_[n]); fit < free) {
      capped_for_job_.push_back({n, free});
      index.Set(n, fit);
    }
  };
  if (small) {
    for (int n : deficit_) cap(n);
  } else {
    for (int n : counted_) cap(n);
  }
  const bool changed = !hidden_for_job_.empty() || !capped_for_job_.empty();
  if (changed) head_protected_stale_ = true;  // computed with them whole
  const size_t placed_before = result_.placements.size();
  wait.reason = Decide(job);
  for (const Hidden& h : hidden_for_job_) index.Set(h.node, h.free);  // it took nothing there
  for (const Hidden& h : capped_for_job_) {
    int taken = 0;
    if (result_.placements.size() > placed_before) {
      for (const DeviceGrant& g : result_.placements.back().grants) {
        if (g.node == h.node) taken += g.devices;
      }
    }
    index.Set(h.node, h.free - taken);
  }
  if (changed) head_protected_stale_ = true;
  if (result_.placements.size() > placed_before && !counted_.empty()) {
    for (const DeviceGrant& g : result_.placements.back().grants) {
      if (s_.nodes[g.node].total_cpu_millis >= 0 || s_.nodes[g.node].total_memory >= 0) {
        UpdateDeficit(g.node);
      }
    }
  }
}

// Places `job` (its nodes' view in the index), makes it the head, or backfills it; returns why
// it waits (kPlaced: it does not).
WaitReason SchedulePass::Decide(const PendingJobInfo& job) {
  const int block = std::max(1, job.rank_block);
  const bool fits_now = job.devices <= index_->BlockTotal(block, job.one_block_per_node);
  if (phase_ == Phase::kInOrder) {
    if (fits_now) {
      Place(job, index_->Take(job.devices, block, job.one_block_per_node), /*backfilled=*/false);
      return WaitReason::kPlaced;
    }
    return MakeHead(job, block);
  }
  if (!fits_now) return WaitReason::kBehindHead;
  return Backfill(job, block);
}

// The first job in order that does not fit: its reservation (when its start can be known), and
// under preemption the running jobs it may displace.
WaitReason SchedulePass::MakeHead(const PendingJobInfo& job, int block) {
  FreeIndex& index = *index_;
  usable_for_job_ = usable_;
  for (const Hidden& h : hidden_for_job_) usable_for_job_[h.node] = false;
  if (s_.preemption) {
    std::vector<int> node_free(s_.nodes.size());
    for (size_t n = 0; n < node_free.size(); ++n) node_free[n] = index.free(static_cast<int>(n));
    std::vector<std::string> victims =
        ChooseVictims(s_, job, usable_for_job_, index.total(), node_free, running_shares_,
                      account_of(job.user), FitsQuota(job), account_used_);
    if (!victims.empty()) {
      result_.preemption = ScheduleResult::Preemption{job.id, std::move(victims)};
    }
  }
  // Projected releases fill a node up to what it could hold of this job.
  std::vector<int> job_total = total_devices_;
  for (int n : counted_) job_total[n] = JobTotalOn(n, job);
  head_ = ComputeReservation(s_, usable_for_job_, job_total, max_devices_per_node_, index,
                             result_.placements, placement_ends_, job.devices, block,
                             job.one_block_per_node);
  if (!head_.has_value()) {
    phase_ = Phase::kStopped;  // unknown start: backfill could delay the head forever
    return WaitReason::kDevices;
  }
  result_.reservation = Reservation{job.id, head_->start, head_->grants};
  head_slot_.assign(num_nodes_, -1);
  for (size_t h = 0; h < head_->grants.size(); ++h) {
    head_slot_[head_->grants[h].node] = static_cast<int>(h);
  }
  phase_ = Phase::kBackfill;
  return WaitReason::kDevices;
}

// A job behind the head that fits now: (a) done before the head starts, or (b) only on devices
// the head's reservation leaves spare.
WaitReason SchedulePass::Backfill(const PendingJobInfo& job, int block) {
  FreeIndex& index = *index_;
  if (job.max_runtime.has_value() && s_.now + *job.max_runtime <= head_->start) {
    // (a) Done before the head starts: its devices are back by then.
    Place(job, index.Take(job.devices, block, job.one_block_per_node), /*backfilled=*/true);
    head_protected_stale_ = true;
    return WaitReason::kPlaced;
  }
  // (b) Pack only on devices the head's reservation leaves spare (jobs placed in blocks do not:
  // the spare devices are counted one by one).
  if (block > 1 || job.one_block_per_node) return WaitReason::kBehindHead;
  if (head_protected_stale_) {
    head_protected_ = 0;
    for (size_t h = 0; h < head_->grants.size(); ++h) {
      head_protected_ += index.free(head_->grants[h].node) - SpareOn(h);
    }
    head_protected_stale_ = false;
  }
  if (job.devices > index.total() - head_protected_) return WaitReason::kBehindHead;
  std::vector<int> hidden(head_->grants.size());
  for (size_t h = 0; h < head_->grants.size(); ++h) {
    const int node = head_->grants[h].node;
    hidden[h] = index.free(node) - SpareOn(h);
    index.Set(node, index.free(node) - hidden[h]);
  }
  std::vector<DeviceGrant> grants = index.Take(job.devices);
  for (size_t h = 0; h < head_->grants.size(); ++h) {
    const int node = head_->grants[h].node;
    index.Set(node, index.free(node) + hidden[h]);
  }
  for (const DeviceGrant& g : grants) {
    const int h = head_slot_[g.node];
    if (h >= 0) head_->projected_free_at_start[h] -= g.devices;
  }
  Place(job, std::move(grants), /*backfilled=*/true);
  head_protected_stale_ = true;
  return WaitReason::kPlaced;
}

}  // namespace

ScheduleResult Schedule(const ClusterSnapshot& snapshot) { return SchedulePass(snapshot).Run(); }

}  // namespace trainyard::coordinator
