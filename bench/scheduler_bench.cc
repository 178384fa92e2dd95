// Benchmark of the coordinator's Scheduler (server/coordinator/scheduler.h) at cluster scale:
// 10,000 nodes x 8 devices and 100,000 queued jobs by default. Measures (a) one full Schedule()
// pass on an empty cluster and (b) a steady state where ~5% of running jobs finish per cycle and
// Schedule() runs on the new snapshot. Compares, in the same run, with a naive first-fit scheduler
// (linear scan over nodes per job, no index) and prints the published Slurm anchor. Runs both
// again with sharing on (1,000 users in 50 accounts with quotas, borrow limits and fair shares,
// decayed usage charged every cycle, preemption on, its victims requeued), whose goal is 20,000
// placements/s in steady state.
//
// Run by hand (see bench/RESULTS.md): scheduler_bench [--nodes N] [--jobs N] [--reps N]
// [--cycles N] [--naive_jobs N]. Deterministic: fixed seeds, so every run sees the same snapshots.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/time/time.h"
#include "server/coordinator/scheduler.h"

namespace trainyard::coordinator {
namespace {

constexpr double kGoalPlacementsPerSecond = 5000.0;
constexpr double kSharingGoalPlacementsPerSecond = 20000.0;
constexpr int kUsers = 1000;
constexpr int kAccounts = 50;
constexpr int kDevicesPerNode = 8;

struct Flags {
  int nodes = 10000;
  int jobs = 100000;
  int reps = 5;
  int cycles = 20;
  int naive_jobs = 100000;  // cap on pending jobs given to the naive baseline
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    auto value = [&](const char* name, int* out) {
      const size_t len = std::strlen(name);
      if (std::strncmp(argv[i], name, len) != 0) return false;
      if (argv[i][len] == '=') {
        *out = std::atoi(argv[i] + len + 1);
      } else if (argv[i][len] == '\0' && i + 1 < argc) {
        *out = std::atoi(argv[++i]);
      } else {
        return false;
      }
      return true;
    };
    if (value("--nodes", &flags.nodes) || value("--jobs", &flags.jobs) ||
        value("--reps", &flags.reps) || value("--cycles", &flags.cycles) ||
        value("--naive_jobs", &flags.naive_jobs)) {
      continue;
    }
    std::fprintf(stderr,
                 "usage: %s [--nodes N] [--jobs N] [--reps N] [--cycles N] [--naive_jobs N]\n",
                 argv[0]);
    std::exit(2);
  }
  flags.reps = std::max(1, flags.reps);
  return flags;
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Job sizes weighted toward small: 1 (40%), 2 (20%), 4 (15%), 8 (15%), 16 (7%), 32 (3%).
class JobFactory {
 public:
  // `idle_accounts`: the last this many accounts submit nothing (their users' jobs go to the
  // accounts before them), so that they start below their quota.
  explicit JobFactory(uint32_t seed, int idle_accounts = 0)
      : rng_(seed), idle_accounts_(idle_accounts) {}

  PendingJobInfo Next() {
    static constexpr int kSizes[] = {1, 2, 4, 8, 16, 32};
    std::discrete_distribution<int> size({40, 20, 15, 15, 7, 3});
    PendingJobInfo job;
    job.user = std::uniform_int_distribution<int>(0, kUsers - 1)(rng_);
    if (job.user % kAccounts >= kAccounts - idle_accounts_) job.user -= idle_accounts_;
    job.id = "job-" + std::to_string(next_seq_);
    job.submit_seq = next_seq_++;
    job.priority = std::uniform_int_distribution<int>(1, 100)(rng_);
    job.devices = kSizes[size(rng_)];
    if (std::uniform_int_distribution<int>(0, 9)(rng_) < 6) {
      job.max_runtime = absl::Minutes(std::uniform_int_distribution<int>(10, 24 * 60)(rng_));
    }
    return job;
  }

 private:
  std::mt19937 rng_;
  int idle_accounts_;
  int64_t next_seq_ = 0;
};

// The naive baseline: same order, first fit by a linear scan over all nodes per job (gang across
// nodes in index order), no index, no reservation (a job that does not fit is skipped).
ScheduleResult NaiveSchedule(const ClusterSnapshot& snapshot) {
  ScheduleResult result;
  std::vector<int> free(snapshot.nodes.size());
  for (size_t n = 0; n < free.size(); ++n) {
    const SchedNode& node = snapshot.nodes[n];
    free[n] = node.schedulable ? std::clamp(node.free_devices, 0, node.total_devices) : 0;
  }
  std::vector<const PendingJobInfo*> order;
  for (const PendingJobInfo& job : snapshot.pending) order.push_back(&job);
  std::sort(order.begin(), order.end(), [](const PendingJobInfo* a, const PendingJobInfo* b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->submit_seq < b->submit_seq;
  });
  for (const PendingJobInfo* job : order) {
    int found = 0;
    size_t last = 0;
    for (size_t n = 0; n < free.size() && found < job->devices; ++n) {
      found += free[n];
      last = n;
    }
    if (found < job->devices) continue;
    Placement placement{job->id, {}, false};
    int remaining = job->devices;
    for (size_t n = 0; n <= last && remaining > 0; ++n) {
      const int take = std::min(free[n], remaining);
      if (take == 0) continue;
      placement.grants.push_back({static_cast<int>(n), take});
      free[n] -= take;
      remaining -= take;
    }
    result.placements.push_back(std::move(placement));
  }
  return result;
}

// The coordinator's view of the cluster between cycles.
struct ClusterState {
  absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  std::vector<SchedNode> nodes;
  std::vector<RunningJobInfo> running;
  std::vector<PendingJobInfo> pending;
  bool sharing = false;  // accounts, users, usage and preemption in the snapshot
  std::vector<SchedAccount> accounts;
  std::vector<SchedUser> users;
  std::unordered_map<std::string, PendingJobInfo> started;  // with sharing: to requeue victims
  // Nodes that count CPUs and memory (EnableHostResources): what each running job's ranks hold.
  bool host = false;
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> rank_charge;

  // Every node offers 64 CPUs and 512 GiB (8 CPUs and 64 GiB per device to ranks that ask for
  // none); 30% of the queued jobs ask 4-16 CPUs and 32-128 GiB a rank, so that CPUs and memory,
  // not devices, bound some nodes.
  void EnableHostResources(uint32_t seed) {
    std::mt19937 rng(seed);
    host = true;
    for (SchedNode& n : nodes) {
      n.total_cpu_millis = n.free_cpu_millis = 64'000;
      n.total_memory = n.free_memory = int64_t{512} << 30;
      n.cpu_millis_per_device = 8'000;
      n.memory_per_device = int64_t{64} << 30;
    }
    for (PendingJobInfo& job : pending) {
      if (std::uniform_int_distribution<int>(0, 9)(rng) >= 3) continue;
      job.cpu_millis = int64_t{4'000} << std::uniform_int_distribution<int>(0, 2)(rng);
      job.memory_bytes = int64_t{32} << (30 + std::uniform_int_distribution<int>(0, 2)(rng));
    }
  }
  std::pair<int64_t, int64_t> Charge(const SchedNode& n, const PendingJobInfo& job) const {
    return {job.cpu_millis > 0 ? job.cpu_millis : n.cpu_millis_per_device,
            job.memory_bytes > 0 ? job.memory_bytes : n.memory_per_device};
  }

  ClusterSnapshot Snapshot() const {
    ClusterSnapshot s{now, nodes, running, pending};
    if (sharing) {
      s.preemption = true;
      s.accounts = accounts;
      s.users = users;
    }
    return s;
  }

  // 50 accounts with quotas summing to half the devices, borrow limits of 1.5x shares 1..5 and some
  // usage; 1,000 users spread over them, a tenth with a cap on running devices.
  void EnableSharing(uint32_t seed) {
    std::mt19937 rng(seed);
    sharing = true;
    const int64_t devices = static_cast<int64_t>(nodes.size()) * kDevicesPerNode;
    for (int a = 0; a < kAccounts; ++a) {
      SchedAccount account;
      account.name = "account-" + std::to_string(a);
      account.quota = devices / 2 / kAccounts;
      account.borrow_limit = account.quota * 3 / 2;
      account.share = std::uniform_int_distribution<int>(1, 5)(rng);
      account.usage = std::uniform_real_distribution<double>(0, 1e7)(rng);
      accounts.push_back(std::move(account));
    }
    for (int u = 0; u < kUsers; ++u) {
      SchedUser user;
      user.name = "user-" + std::to_string(u);
      user.account = u % kAccounts;
      user.max_devices = u % 10 == 0 ? 64 : -1;
      user.usage = std::uniform_real_distribution<double>(0, 1e6)(rng);
      users.push_back(std::move(user));
    }
  }

  // Decays usage by a minute of a 7-day half-life and charges the running jobs' minute.
  void ChargeMinute() {
    if (!sharing) return;
    const double decay = std::exp2(-60.0 / (7 * 24 * 3600));
    for (SchedAccount& a : accounts) a.usage *= decay;
    for (SchedUser& u : users) u.usage *= decay;
    for (const RunningJobInfo& r : running) {
      double devices = 0;
      for (const DeviceGrant& g : r.grants) devices += g.devices;
      users[r.user].usage += devices * 60;
      accounts[users[r.user].account].usage += devices * 60;
    }
  }

  // Starts the placed jobs: takes their devices and moves them from pending to running.
  void Apply(const ScheduleResult& result) {
    std::unordered_map<std::string, const Placement*> placed;
    for (const Placement& p : result.placements) placed[p.job_id] = &p;
    std::vector<PendingJobInfo> still_pending;
    still_pending.reserve(pending.size());
    for (PendingJobInfo& job : pending) {
      const auto it = placed.find(job.id);
      if (it == placed.end()) {
        still_pending.push_back(std::move(job));
        continue;
      }
      for (const DeviceGrant& g : it->second->grants) {
        SchedNode& n = nodes[g.node];
        n.free_devices -= g.devices;
        if (host) {
          const auto [cpu, memory] = Charge(n, job);
          n.free_cpu_millis -= g.devices * cpu;
          n.free_memory -= g.devices * memory;
          rank_charge[job.id] = {job.cpu_millis, job.memory_bytes};
        }
      }
      std::optional<absl::Time> end;
      if (job.max_runtime.has_value()) end = now + *job.max_runtime;
      RunningJobInfo r{job.id, it->second->grants, end};
      r.priority = job.priority;
      r.start = now;
      r.user = job.user;
      running.push_back(std::move(r));
      if (sharing) started[job.id] = job;
    }
    pending = std::move(still_pending);
    if (result.preemption.has_value()) {
      std::unordered_map<std::string, bool> victims;
      for (const std::string& id : result.preemption->victims) victims[id] = true;
      for (RunningJobInfo& r : running) {
        if (victims.count(r.id) != 0) r.preempting = true;
      }
    }
  }

  // A random `fraction` of running jobs finish and release their devices; preempted ones stop
  // and go back to the queue.
  void FinishSome(double fraction, std::mt19937& rng) {
    std::bernoulli_distribution finishes(fraction);
    std::vector<RunningJobInfo> still_running;
    still_running.reserve(running.size());
    for (RunningJobInfo& job : running) {
      const bool preempted = job.preempting;
      if (preempted || finishes(rng)) {
        for (const DeviceGrant& g : job.grants) {
          SchedNode& n = nodes[g.node];
          n.free_devices += g.devices;
          if (host) {
            PendingJobInfo asked;
            std::tie(asked.cpu_millis, asked.memory_bytes) = rank_charge[job.id];
            const auto [cpu, memory] = Charge(n, asked);
            n.free_cpu_millis += g.devices * cpu;
            n.free_memory += g.devices * memory;
          }
        }
        rank_charge.erase(job.id);
        if (preempted) pending.push_back(started.at(job.id));
        started.erase(job.id);
      } else {
        still_running.push_back(std::move(job));
      }
    }
    running = std::move(still_running);
  }
};

ClusterState EmptyCluster(int num_nodes, int num_jobs, JobFactory& factory) {
  ClusterState state;
  for (int n = 0; n < num_nodes; ++n) {
    state.nodes.push_back({"node-" + std::to_string(n), kDevicesPerNode, kDevicesPerNode, true});
  }
  for (int j = 0; j < num_jobs; ++j) state.pending.push_back(factory.Next());
  return state;
}

struct Row {
  std::string name;
  int nodes = 0;
  int pending = 0;
  int64_t placements = 0;
  double median_s = 0;
};

void PrintRow(const Row& row) {
  const double rate = row.median_s > 0 ? row.placements / row.median_s : 0;
  std::printf("| %-58s | %6d | %7d | %10lld | %10.4f | %12.0f | %7.1fx |\n", row.name.c_str(),
              row.nodes, row.pending, static_cast<long long>(row.placements), row.median_s, rate,
              rate / kGoalPlacementsPerSecond);
}

// Steady state: from `start`, `cycles` times: advance 1 minute, finish ~5% of running jobs, top
// the queue back up to `queue_size`, build the snapshot and schedule. Returns total placements and
// fills the seconds spent in the scheduler and in building snapshots.
template <typename ScheduleFn>
int64_t SteadyState(const ClusterState& start, int cycles, int queue_size, uint32_t seed,
                    ScheduleFn schedule, double* schedule_s, double* snapshot_s) {
  ClusterState state = start;
  std::mt19937 rng(seed);
  JobFactory factory(seed + 1);
  int64_t placements = 0;
  *schedule_s = 0;
  *snapshot_s = 0;
  for (int c = 0; c < cycles; ++c) {
    state.now += absl::Minutes(1);
    state.ChargeMinute();
    state.FinishSome(0.05, rng);
    while (static_cast<int>(state.pending.size()) < queue_size) {
      PendingJobInfo job = factory.Next();
      job.id = "new-" + job.id;
      job.submit_seq += 1'000'000'000;
      state.pending.push_back(std::move(job));
    }
    const auto t0 = std::chrono::steady_clock::now();
    const ClusterSnapshot snapshot = state.Snapshot();
    const auto t1 = std::chrono::steady_clock::now();
    const ScheduleResult result = schedule(snapshot);
    const auto t2 = std::chrono::steady_clock::now();
    *snapshot_s += Seconds(t1 - t0);
    *schedule_s += Seconds(t2 - t1);
    placements += result.placements.size();
    state.Apply(result);
  }
  return placements;
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  // 10 of the 50 accounts submit only once the steady state starts: they reclaim their quota.
  JobFactory factory(2024, /*idle_accounts=*/10);
  const ClusterState empty = EmptyCluster(flags.nodes, flags.jobs, factory);
  const ClusterSnapshot empty_snapshot = empty.Snapshot();
  ClusterState naive_empty = empty;
  naive_empty.pending.resize(std::min<size_t>(empty.pending.size(), flags.naive_jobs));
  const ClusterSnapshot naive_snapshot = naive_empty.Snapshot();

  std::vector<Row> rows;
  auto time_pass = [&](const std::string& name, const ClusterSnapshot& s, auto schedule,
                       ScheduleResult* out) {
    std::vector<double> seconds;
    for (int r = 0; r < flags.reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      *out = schedule(s);
      seconds.push_back(Seconds(std::chrono::steady_clock::now() - t0));
    }
    rows.push_back({name, static_cast<int>(s.nodes.size()), static_cast<int>(s.pending.size()),
                    static_cast<int64_t>(out->placements.size()), Median(seconds)});
  };

  // (a) One full pass on an empty cluster.
  ScheduleResult first;
  time_pass("full pass, empty cluster: indexed (Schedule)", empty_snapshot, Schedule, &first);
  ScheduleResult naive_first;
  time_pass("full pass, empty cluster: naive first-fit", naive_snapshot, NaiveSchedule,
            &naive_first);
  ClusterState sharing_empty = empty;
  sharing_empty.EnableSharing(99);
  ScheduleResult sharing_first;
  time_pass("full pass, empty cluster: indexed + sharing", sharing_empty.Snapshot(), Schedule,
            &sharing_first);

  ClusterState host_empty = empty;
  host_empty.EnableHostResources(5);
  ScheduleResult host_first;
  time_pass("full pass, empty cluster: indexed + CPUs and memory", host_empty.Snapshot(), Schedule,
            &host_first);

  // (b) Steady state from the cluster as the first pass left it.
  ClusterState loaded = empty;
  loaded.Apply(first);
  ClusterState sharing_loaded = sharing_empty;
  sharing_loaded.Apply(sharing_first);
  int64_t preemptions = 0;
  auto count_preemptions = [&](const ClusterSnapshot& s) {
    ScheduleResult r = Schedule(s);
    if (r.preemption.has_value()) preemptions += r.preemption->victims.size();
    return r;
  };
  auto steady = [&](const std::string& name, const ClusterState& start, auto schedule,
                    bool with_snapshot_row) {
    std::vector<double> schedule_s, total_s;
    int64_t placements = 0;
    for (int r = 0; r < flags.reps; ++r) {
      double sched = 0, snap = 0;
      placements = SteadyState(start, flags.cycles, flags.jobs, 7, schedule, &sched, &snap);
      schedule_s.push_back(sched);
      total_s.push_back(sched + snap);
    }
    rows.push_back({name, flags.nodes, flags.jobs, placements, Median(schedule_s)});
    if (with_snapshot_row) {
      rows.push_back(
          {name + " + snapshot build", flags.nodes, flags.jobs, placements, Median(total_s)});
    }
  };
  const std::string cycles = std::to_string(flags.cycles);
  steady("steady, " + cycles + " cycles x 5% finish: indexed", loaded, Schedule, true);
  steady("steady, " + cycles + " cycles x 5% finish: naive first-fit", loaded, NaiveSchedule,
         false);
  ClusterState host_loaded = host_empty;
  host_loaded.Apply(host_first);
  steady("steady, " + cycles + " cycles x 5% finish: indexed + CPUs and memory", host_loaded,
         Schedule, false);
  steady("steady, " + cycles + " cycles x 5% finish: indexed + sharing", sharing_loaded,
         count_preemptions, true);

  std::printf("Scheduler benchmark: %d nodes x %d devices, %d pending jobs, %d reps (median)\n",
              flags.nodes, kDevicesPerNode, flags.jobs, flags.reps);
  std::printf("Full pass: %zu running after it, reservation %s, %zu backfilled.\n",
              first.placements.size(), first.reservation.has_value() ? "known" : "unknown",
              static_cast<size_t>(std::count_if(first.placements.begin(), first.placements.end(),
                                                [](const Placement& p) { return p.backfilled; })));
  std::printf("| %-58s | %6s | %7s | %10s | %10s | %12s | %8s |\n", "case", "nodes", "pending",
              "placements", "median s", "placements/s", "vs 5000/s");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|\n", std::string(60, '-').c_str(), std::string(8, '-').c_str(),
              std::string(9, '-').c_str(), std::string(12, '-').c_str(),
              std::string(12, '-').c_str(), std::string(14, '-').c_str(),
              std::string(10, '-').c_str());
  for (const Row& row : rows) PrintRow(row);
  std::printf("| %-58s | %6s | %7s | %10s | %10s | %12.0f | %7.1fx |\n",
              "anchor: Slurm: 500 jobs/s sustained (published)", "-", "-", "-", "-", 500.0,
              500.0 / kGoalPlacementsPerSecond);
  const Row& sharing_row = rows[rows.size() - 2];
  const double sharing_rate = sharing_row.placements / sharing_row.median_s;
  std::printf(
      "Sharing: %d users in %d accounts (quotas, borrow limits, fair share, user caps), "
      "preemption on: %lld victims over %d reps; steady state %.0f placements/s, %.1fx the "
      "%.0f/s goal.\n",
      kUsers, kAccounts, static_cast<long long>(preemptions), flags.reps, sharing_rate,
      sharing_rate / kSharingGoalPlacementsPerSecond, kSharingGoalPlacementsPerSecond);
  if (flags.naive_jobs < flags.jobs) {
    std::printf("Naive full pass capped at %d pending jobs.\n", flags.naive_jobs);
  }
  return 0;
}

}  // namespace
}  // namespace trainyard::coordinator

int main(int argc, char** argv) { return trainyard::coordinator::Main(argc, argv); }
