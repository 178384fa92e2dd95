// Per-rank cgroups, as Slurm's task/cgroup and proctrack/cgroup: each rank runs in a cgroup of its
// own under the worker's, held to a memory limit (ConstrainRAMSpace), a CPU quota and a number of
// processes, and ending the rank ends every process in it, also one that left its session and
// cleared its environment.
//
// Both hierarchies are supported, detected at the worker's start (DetectCgroups):
//  - v1: the memory, cpu, pids and freezer controllers each mounted (cpuacct too, where mounted:
//    CPU time); the rank's folder is made in each, under the worker's own cgroup there, and a
//    stop freezes the rank's cgroup, signals every process in it and thaws it.
//  - v2: a unified hierarchy whose subtree the worker may manage (systemd's Delegate=yes): the
//    worker's cgroup offers memory, cpu and pids; the worker moves itself into a leaf ("worker")
//    so that its cgroup may enable them for the ranks' folders; a stop writes cgroup.kill.
// Device access is limited by CUDA_VISIBLE_DEVICES only (a rank could open another GPU's device
// node; v1's devices controller and v2's BPF device filter are not used yet).
//
// The worker makes a rank's cgroup (CreateRankCgroup) and hands its folders to the rank's shepherd
// (shepherd.h), which puts the rank's process into them before it drops privileges, signals them
// when it stops the rank, reads the OOM count and peak memory when the rank ends, and removes
// them. Plain functions over paths: the shepherd is single-threaded and needs no object.
#ifndef TRAINYARD_WORKER_DAEMON_CGROUPS_H_
#define TRAINYARD_WORKER_DAEMON_CGROUPS_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainyard::worker {

// What a rank is held to; 0: no limit of that kind.
struct CgroupLimits {
  int64_t memory_bytes = 0;  // resident memory (and swap, where the kernel counts it)
  double cpus = 0;           // CPU time per wall-clock second
  int64_t pids = 0;          // processes and threads
  // Devices the rank may not open, as the v1 devices controller writes them ("c 195:1 rwm"):
  // the GPUs it was not given. On v2, a BPF device program denies them (device_filter.h).
  std::vector<std::string> denied_devices;
};

// Where ranks' cgroups go on this host.
struct CgroupHost {
  int version = 0;  // 1, 2; 0: none usable
  std::string why;  // when none: why not
  // v1: controller -> the worker's own cgroup folder in that controller's hierarchy; v2: "" ->
  // the folder under which the ranks' cgroups are made (the worker's cgroup).
  std::map<std::string, std::string> parents;
};

// Detection from the texts of /proc/self/mountinfo and /proc/self/cgroup (pure: unit-tested).
// v2 when the unified hierarchy holds the worker's cgroup and `controllers_of` (the text of that
// cgroup's cgroup.controllers; empty when unreadable) names memory, cpu and pids; else v1 when
// memory, cpu, pids and freezer are mounted (with cpuacct and devices where they are); else none,
// saying why.
CgroupHost DetectCgroupsFrom(const std::string& mountinfo, const std::string& self_cgroup,
                             const std::function<std::string(const std::string&)>& controllers_of);

// The host's, read from /proc; on v2 it also moves this process into a leaf "worker" of its
// cgroup and enables the controllers for the ranks' folders (a failure makes it none, saying why).
CgroupHost DetectCgroups();

// One line for the log: "cgroup v1 (memory, cpu, cpuacct, pids, freezer)" or "no usable cgroups:
// WHY".
std::string DescribeCgroups(const CgroupHost& host);

// Makes the cgroup folders of a rank, `name` a relative path ("trainyard-w1/JOB/attempt-1/rank-0"),
// under each parent, with `limits`; returns the folders to join (one per v1 hierarchy, one on
// v2). A folder of that name already there (a rank that ended without cleaning up) is reused.
absl::StatusOr<std::vector<std::string>> CreateRankCgroup(const CgroupHost& host,
                                                          const std::string& name,
                                                          const CgroupLimits& limits);

// The shepherd's side. Puts `pid` into each of `dirs` (before it drops privileges).
bool JoinCgroups(const std::vector<std::string>& dirs, pid_t pid);
// Sends `sig` to every process in the cgroups but those `skip` is true for (v2: cgroup.kill for
// SIGKILL, skipping none; v1: frozen while signalled, so that none forks past it).
void SignalCgroups(const std::vector<std::string>& dirs, int sig,
                   const std::function<bool(pid_t)>& skip = nullptr);
// Whether any process is left in them.
bool CgroupsEmpty(const std::vector<std::string>& dirs);
// The memory cgroup's limit, peak and OOM kills, when `dirs` has one.
struct MemoryReport {
  int64_t limit_bytes = 0;  // 0: none
  int64_t peak_bytes = 0;
  int64_t oom_kills = 0;
};
std::optional<MemoryReport> ReadMemory(const std::vector<std::string>& dirs);
// CPU time every process of the cgroups used (v1 cpuacct.usage, v2 cpu.stat's usage_usec), in
// seconds; nullopt without a CPU accounting folder among `dirs`.
std::optional<double> ReadCpuSeconds(const std::vector<std::string>& dirs);
// Removes the (empty) folders; false if one stays.
bool RemoveCgroups(const std::vector<std::string>& dirs);
// Kills every process in the cgroups (SIGKILL, again until they are empty or `timeout` has
// passed) and removes them; false if one stays.
bool KillAndRemoveCgroups(const std::vector<std::string>& dirs, absl::Duration timeout);
// The folders of the rank cgroup `name` under the host's parents, as CreateRankCgroup makes them
// (a hierarchy mounted with several controllers once), whether or not they exist.
std::vector<std::string> RankCgroupDirs(const CgroupHost& host, const std::string& name);
// Removes every empty "trainyard-*" cgroup folder under the host's parents that is a minute old,
// deepest first: what workers killed without their clean-up left (a tree with a process in it
// stays; a live worker makes a removed folder again when it next starts a rank). Returns how many
// folders went.
int SweepEmptyCgroups(const CgroupHost& host);

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_CGROUPS_H_
