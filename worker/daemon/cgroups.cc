// Per-rank cgroups (see cgroups.h).
#include "worker/daemon/cgroups.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "worker/daemon/device_filter.h"

namespace trainyard::worker {
namespace {

// What v1 needs; cpuacct only adds CPU time.
constexpr const char* kV1Controllers[] = {"memory", "cpu", "pids", "freezer"};
constexpr const char* kV2Controllers[] = {"memory", "cpu", "pids"};
constexpr int64_t kCpuPeriodUs = 100000;

std::string ReadSmallFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string text;
  char buf[4096];
  ssize_t n;
  while (text.size() < (1 << 20) && (n = read(fd, buf, sizeof(buf))) > 0) {
    text.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return text;
}

bool WriteSmallFile(const std::string& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  return ok;
}

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// `path` (a cgroup path from /proc/self/cgroup) inside a hierarchy mounted at `mount` whose root
// is `root`.
std::string FolderOf(const std::string& mount, const std::string& root, const std::string& path) {
  absl::string_view rel = path;
  if (root != "/" && !absl::ConsumePrefix(&rel, root)) rel = path;
  std::string out = mount;
  if (!rel.empty() && rel != "/") absl::StrAppend(&out, rel);
  return out;
}

// The memory folder among `dirs` (v1: the one in the memory hierarchy; v2: the only one).
std::optional<std::string> MemoryFolder(const std::vector<std::string>& dirs) {
  for (const std::string& d : dirs) {
    if (Exists(d + "/memory.limit_in_bytes") || Exists(d + "/memory.max")) return d;
  }
  return std::nullopt;
}

std::vector<pid_t> Members(const std::vector<std::string>& dirs) {
  std::set<pid_t> pids;
  for (const std::string& d : dirs) {
    for (absl::string_view line :
         absl::StrSplit(ReadSmallFile(d + "/cgroup.procs"), '\n', absl::SkipEmpty())) {
      pid_t pid = 0;
      if (absl::SimpleAtoi(line, &pid) && pid > 0) pids.insert(pid);
    }
  }
  return {pids.begin(), pids.end()};
}

int64_t ReadNumber(const std::string& path) {
  int64_t v = 0;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadSmallFile(path)), &v) ? v : 0;
}

// "KEY N" lines (memory.events, memory.oom_control): N of `key`.
int64_t ReadKey(const std::string& path, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(ReadSmallFile(path), '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> kv = absl::StrSplit(line, ' ');
    int64_t v = 0;
    if (kv.size() == 2 && kv[0] == key && absl::SimpleAtoi(kv[1], &v)) return v;
  }
  return 0;
}

}  // namespace

CgroupHost DetectCgroupsFrom(const std::string& mountinfo, const std::string& self_cgroup,
                             const std::function<std::string(const std::string&)>& controllers_of) {
  // The worker's cgroup per v1 controller, and in the unified hierarchy.
  std::map<std::string, std::string> path_of;
  std::optional<std::string> unified_path;
  for (absl::string_view line : absl::StrSplit(self_cgroup, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) {
      unified_path = std::string(f[2]);
      continue;
    }
    for (absl::string_view c : absl::StrSplit(f[1], ',', absl::SkipEmpty())) {
      path_of[std::string(c)] = std::string(f[2]);
    }
  }
  // Mounts: v1 hierarchies by controller, the unified one.
  struct Mount {
    std::string root, point;
  };
  std::map<std::string, Mount> v1;
  std::optional<Mount> v2;
  for (absl::string_view line : absl::StrSplit(mountinfo, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> halves = absl::StrSplit(line, absl::MaxSplits(" - ", 1));
    if (halves.size() != 2) continue;
    std::vector<absl::string_view> pre = absl::StrSplit(halves[0], ' ');
    std::vector<absl::string_view> post = absl::StrSplit(halves[1], ' ');
    if (pre.size() < 5 || post.size() < 3) continue;
    const Mount m{std::string(pre[3]), std::string(pre[4])};
    if (post[0] == "cgroup2") {
      v2 = m;
    } else if (post[0] == "cgroup") {
      for (absl::string_view opt : absl::StrSplit(post[2], ',')) v1[std::string(opt)] = m;
    }
  }
  CgroupHost host;
  std::vector<std::string> reasons;
  if (v2.has_value() && unified_path.has_value()) {
    const std::string dir = FolderOf(v2->point, v2->root, *unified_path);
    const std::set<std::string> offered =
        absl::StrSplit(absl::StripAsciiWhitespace(controllers_of(dir)), ' ', absl::SkipEmpty());
    std::vector<std::string> missing;
    for (const char* c : kV2Controllers) {
      if (offered.count(c) == 0) missing.push_back(c);
    }
    if (missing.empty()) {
      host.version = 2;
      host.parents[""] = dir;
      return host;
    }
    reasons.push_back(absl::StrCat("cgroup v2 at ", dir, " does not offer ",
                                   absl::StrJoin(missing, ", "),
                                   " (not delegated to this worker: systemd's Delegate=yes)"));
  } else {
    reasons.push_back("no cgroup v2 hierarchy holds this process");
  }
  std::vector<std::string> missing;
  for (const char* c : kV1Controllers) {
    auto m = v1.find(c);
    auto p = path_of.find(c);
    if (m == v1.end() || p == path_of.end()) {
      missing.push_back(c);
      continue;
    }
    host.parents[c] = FolderOf(m->second.point, m->second.root, p->second);
  }
  if (missing.empty()) {
    for (const char* optional : {"cpuacct", "devices"}) {
      if (auto m = v1.find(optional); m != v1.end() && path_of.count(optional) > 0) {
        host.parents[optional] = FolderOf(m->second.point, m->second.root, path_of[optional]);
      }
    }
    host.version = 1;
    return host;
  }
  host.parents.clear();
  reasons.push_back(absl::StrCat("cgroup v1 lacks ", absl::StrJoin(missing, ", ")));
  host.why = absl::StrJoin(reasons, "; ");
  return host;
}

CgroupHost DetectCgroups() {
  CgroupHost host = DetectCgroupsFrom(
      ReadSmallFile("/proc/self/mountinfo"), ReadSmallFile("/proc/self/cgroup"),
      [](const std::string& dir) { return ReadSmallFile(dir + "/cgroup.controllers"); });
  if (host.version != 2) return host;
  // v2's no-internal-process rule: the worker's cgroup may hand controllers to the ranks' folders
  // only once no process is in it, so the worker moves into a leaf of its own.
  const std::string dir = host.parents[""];
  const std::string leaf = dir + "/worker";
  mkdir(leaf.c_str(), 0755);
  if (!WriteSmallFile(leaf + "/cgroup.procs", absl::StrCat(getpid())) ||
      !WriteSmallFile(dir + "/cgroup.subtree_control", "+memory +cpu +pids")) {
    CgroupHost none;
    none.why = absl::StrCat("cgroup v2 at ", dir, ": cannot move into ", leaf,
                            " and enable memory, cpu and pids: ", strerror(errno));
    return none;
  }
  return host;
}

std::string DescribeCgroups(const CgroupHost& host) {
  if (host.version == 0) return absl::StrCat("no usable cgroups: ", host.why);
  std::vector<std::string> parts;
  for (const auto& [controller, dir] : host.parents) {
    parts.push_back(controller.empty() ? dir : absl::StrCat(controller, " ", dir));
  }
  return absl::StrCat("cgroup v", host.version, " (", absl::StrJoin(parts, ", "), ")");
}

std::vector<std::string> RankCgroupDirs(const CgroupHost& host, const std::string& name) {
  std::vector<std::string> dirs;
  for (const auto& [controller, parent] : host.parents) {
    const std::string dir = absl::StrCat(parent, "/", name);
    if (std::find(dirs.begin(), dirs.end(), dir) == dirs.end()) dirs.push_back(dir);  // shared
  }
  return dirs;
}

namespace {

absl::StatusOr<std::vector<std::string>> TryCreateRankCgroup(const CgroupHost& host,
                                                             const std::string& name,
                                                             const CgroupLimits& limits) {
  const std::vector<std::string> dirs = RankCgroupDirs(host, name);
  for (const std::string& dir : dirs) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("cgroup ", dir, ": ", ec.message()));
  }
  std::map<std::string, std::string> by_controller;
  for (const auto& [controller, parent] : host.parents) {
    by_controller[controller] = absl::StrCat(parent, "/", name);
  }
  auto set = [](const std::string& file, const std::string& value) -> absl::Status {
    if (WriteSmallFile(file, value)) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat("cgroup: cannot write ", value, " to ", file, ": ", strerror(errno)));
  };
  const int64_t quota_us =
      limits.cpus > 0 ? std::max<int64_t>(1000, std::llround(limits.cpus * kCpuPeriodUs)) : -1;
  if (host.version == 2) {
    const std::string& d = dirs[0];
    absl::Status s =
        set(d + "/memory.max",
            limits.memory_bytes > 0 ? absl::StrCat(limits.memory_bytes) : std::string("max"));
    if (s.ok() && limits.memory_bytes > 0 && Exists(d + "/memory.swap.max")) {
      s = set(d + "/memory.swap.max", "0");  // the limit is the rank's memory, not memory + swap
    }
    if (s.ok()) {
      s = set(d + "/cpu.max", quota_us > 0 ? absl::StrCat(quota_us, " ", kCpuPeriodUs)
                                           : absl::StrCat("max ", kCpuPeriodUs));
    }
    if (s.ok()) {
      s = set(d + "/pids.max", limits.pids > 0 ? absl::StrCat(limits.pids) : std::string("max"));
    }
    // Devices: no controller on v2, a BPF program on the folder (device_filter.h); set also
    // with nothing to deny, so that a reused folder loses an earlier rank's denials.
    if (s.ok()) s = SetDeviceFilter(d, limits.denied_devices);
    if (!s.ok()) return s;
    return dirs;
  }
  const std::string mem = by_controller["memory"], cpu = by_controller["cpu"],
                    pids = by_controller["pids"];
  // (-1: no limit, for a folder reused from an earlier rank of another size.)
  absl::Status s = set(mem + "/memory.limit_in_bytes",
                       limits.memory_bytes > 0 ? absl::StrCat(limits.memory_bytes) : "-1");
  if (s.ok() && Exists(mem + "/memory.memsw.limit_in_bytes")) {
    // Memory + swap at the same limit: swap does not stretch it.
    set(mem + "/memory.memsw.limit_in_bytes",
        limits.memory_bytes > 0 ? absl::StrCat(limits.memory_bytes) : "-1")
        .IgnoreError();
  }
  if (s.ok()) s = set(cpu + "/cpu.cfs_period_us", absl::StrCat(kCpuPeriodUs));
  if (s.ok()) s = set(cpu + "/cpu.cfs_quota_us", absl::StrCat(quota_us));
  if (s.ok()) {
    s = set(pids + "/pids.max", limits.pids > 0 ? absl::StrCat(limits.pids) : std::string("max"));
  }
  // Devices: all that the worker's own cgroup allows (a reused folder may hold an earlier rank's
  // denials), less the GPUs that are not this rank's.
  if (auto devices = by_controller.find("devices"); s.ok() && devices != by_controller.end()) {
    s = set(devices->second + "/devices.allow", "a");
    for (const std::string& rule : limits.denied_devices) {
      if (s.ok()) s = set(devices->second + "/devices.deny", rule);
    }
  } else if (s.ok() && !limits.denied_devices.empty()) {
    s = absl::FailedPreconditionError(
        "cgroup v1 has no devices controller: the rank's GPUs cannot be confined");
  }
  if (!s.ok()) return s;
  return dirs;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> CreateRankCgroup(const CgroupHost& host,
                                                          const std::string& name,
                                                          const CgroupLimits& limits) {
  if (host.version == 0) return absl::FailedPreconditionError("no usable cgroups");
  // Another rank's shepherd may remove the attempt's folder (its last rank ended) while this one
  // is being made: made again then.
  absl::StatusOr<std::vector<std::string>> dirs;
  for (int attempt = 0; attempt < 5; ++attempt) {
    dirs = TryCreateRankCgroup(host, name, limits);
    if (dirs.ok()) break;
  }
  return dirs;
}

bool JoinCgroups(const std::vector<std::string>& dirs, pid_t pid) {
  const std::string text = absl::StrCat(pid);
  for (const std::string& d : dirs) {
    if (!WriteSmallFile(d + "/cgroup.procs", text)) return false;
  }
  return true;
}

void SignalCgroups(const std::vector<std::string>& dirs, int sig,
                   const std::function<bool(pid_t)>& skip) {
  if (dirs.empty()) return;
  for (const std::string& d : dirs) {
    if (sig == SIGKILL && Exists(d + "/cgroup.kill")) {  // v2 (Linux 5.14 and later)
      WriteSmallFile(d + "/cgroup.kill", "1");
      return;
    }
  }
  // v1: frozen while signalled, so that no process forks a child the signal would miss.
  std::optional<std::string> freezer;
  for (const std::string& d : dirs) {
    if (Exists(d + "/freezer.state")) freezer = d;
  }
  if (freezer.has_value()) {
    WriteSmallFile(*freezer + "/freezer.state", "FROZEN");
    const absl::Time deadline = absl::Now() + absl::Milliseconds(500);
    while (!absl::StartsWith(ReadSmallFile(*freezer + "/freezer.state"), "FROZEN") &&
           absl::Now() < deadline) {
      usleep(1000);
    }
  }
  for (pid_t pid : Members(dirs)) {
    if (!skip || !skip(pid)) kill(pid, sig);
  }
  if (freezer.has_value()) WriteSmallFile(*freezer + "/freezer.state", "THAWED");
}

bool CgroupsEmpty(const std::vector<std::string>& dirs) { return Members(dirs).empty(); }

std::optional<MemoryReport> ReadMemory(const std::vector<std::string>& dirs) {
  const std::optional<std::string> d = MemoryFolder(dirs);
  if (!d.has_value()) return std::nullopt;
  MemoryReport r;
  if (Exists(*d + "/memory.limit_in_bytes")) {  // v1
    r.limit_bytes = ReadNumber(*d + "/memory.limit_in_bytes");
    if (r.limit_bytes >= (int64_t{1} << 62)) r.limit_bytes = 0;
    r.peak_bytes = ReadNumber(*d + "/memory.max_usage_in_bytes");
    r.oom_kills = ReadKey(*d + "/memory.oom_control", "oom_kill");
    return r;
  }
  r.limit_bytes = ReadNumber(*d + "/memory.max");  // "max" reads as 0
  r.peak_bytes = Exists(*d + "/memory.peak") ? ReadNumber(*d + "/memory.peak")
                                             : ReadNumber(*d + "/memory.current");
  r.oom_kills = ReadKey(*d + "/memory.events", "oom_kill");
  return r;
}

std::optional<double> ReadCpuSeconds(const std::vector<std::string>& dirs) {
  for (const std::string& d : dirs) {
    if (Exists(d + "/cpuacct.usage")) return ReadNumber(d + "/cpuacct.usage") / 1e9;  // v1: ns
    if (Exists(d + "/cpu.stat") && !Exists(d + "/cpu.cfs_quota_us")) {                // v2
      return ReadKey(d + "/cpu.stat", "usage_usec") / 1e6;
    }
  }
  return std::nullopt;
}

bool KillAndRemoveCgroups(const std::vector<std::string>& dirs, absl::Duration timeout) {
  // Again each round: a process may have forked past the last signal (v1 freezes around it).
  const absl::Time deadline = absl::Now() + timeout;
  while (!dirs.empty() && !CgroupsEmpty(dirs) && absl::Now() < deadline) {
    SignalCgroups(dirs, SIGKILL);
    absl::SleepFor(absl::Milliseconds(20));
  }
  return RemoveCgroups(dirs);
}

bool RemoveCgroups(const std::vector<std::string>& dirs) {
  bool all = true;
  for (const std::string& d : dirs) {
    if (rmdir(d.c_str()) != 0 && errno != ENOENT) all = false;
    // The attempt's and the job's folders too, once their last rank's is gone (else EBUSY).
    std::filesystem::path p(d);
    for (int up = 0; up < 2; ++up) {
      p = p.parent_path();
      if (rmdir(p.c_str()) != 0) break;
    }
  }
  return all;
}

int SweepEmptyCgroups(const CgroupHost& host) {
  int removed = 0;
  std::set<std::string> seen;
  for (const auto& [controller, parent] : host.parents) {
    if (!seen.insert(parent).second) continue;
    std::error_code ec;
    for (const auto& top : std::filesystem::directory_iterator(parent, ec)) {
      if (!top.is_directory() || !absl::StartsWith(top.path().filename().string(), "trainyard-")) {
        continue;
      }
      // Deepest first: a folder's subfolders before it.
      std::vector<std::string> folders;
      std::error_code walk;
      for (auto it = std::filesystem::recursive_directory_iterator(top.path(), walk);
           !walk && it != std::filesystem::recursive_directory_iterator(); it.increment(walk)) {
        if (it->is_directory()) folders.push_back(it->path().string());
      }
      std::sort(folders.begin(), folders.end(),
                [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
      folders.push_back(top.path().string());
      // Only folders a minute old: a rank's folder is made a few milliseconds before its
      // process joins it, and another worker may be starting that rank right now.
      const time_t minute_ago = time(nullptr) - 60;
      for (const std::string& f : folders) {
        struct stat st {};
        if (stat(f.c_str(), &st) == 0 && st.st_mtime <= minute_ago)
          removed += rmdir(f.c_str()) == 0;
      }
    }
  }
  return removed;
}

}  // namespace trainyard::worker
