// The worker's cgroups (worker/daemon/cgroups.h): detection from /proc's texts for v1, a delegated
// v2, a container's mounts and hosts with neither (pure); sizes; and, as root on a host with
// usable cgroups (this development machine mounts v1 writable), a rank's cgroup made for real:
// its limits written, a process joined, signalled whole, its OOM kill counted, the folder removed.
#include "worker/daemon/cgroups.h"

#include <errno.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "worker/daemon/device_filter.h"

namespace trainyard::worker {
namespace {

using ::testing::HasSubstr;

constexpr char kV1Mounts[] =
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer\n"
    "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
    "40 31 0:37 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
constexpr char kV1Self[] =
    "8:pids:/\n6:freezer:/\n5:devices:/\n4:memory:/process_api/50e1\n2:cpuacct:/\n1:cpu:/\n"
    "0::/\n";

std::string NoControllers(const std::string&) { return ""; }

TEST(DetectCgroupsTest, V1WithAnUndelegatedUnifiedHierarchyBesideIt) {
  const CgroupHost host = DetectCgroupsFrom(kV1Mounts, kV1Self, NoControllers);
  EXPECT_EQ(host.version, 1) << host.why;
  EXPECT_EQ(host.parents.at("memory"), "/sys/fs/cgroup/memory/process_api/50e1");
  EXPECT_EQ(host.parents.at("cpu"), "/sys/fs/cgroup/cpu");
  EXPECT_EQ(host.parents.at("pids"), "/sys/fs/cgroup/pids");
  EXPECT_EQ(host.parents.at("freezer"), "/sys/fs/cgroup/freezer");
  EXPECT_EQ(host.parents.at("cpuacct"), "/sys/fs/cgroup/cpuacct");
  EXPECT_EQ(host.parents.at("devices"), "/sys/fs/cgroup/devices");
  EXPECT_THAT(DescribeCgroups(host), HasSubstr("cgroup v1 ("));
}

TEST(DetectCgroupsTest, V2WhereTheServiceWasDelegatedItsSubtree) {
  const std::string mounts = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n";
  const std::string self = "0::/system.slice/trainyard-worker.service\n";
  std::string asked;
  const CgroupHost host = DetectCgroupsFrom(mounts, self, [&](const std::string& dir) {
    asked = dir;
    return std::string("cpuset cpu io memory pids\n");
  });
  EXPECT_EQ(asked, "/sys/fs/cgroup/system.slice/trainyard-worker.service");
  EXPECT_EQ(host.version, 2) << host.why;
  EXPECT_EQ(host.parents.at(""), "/sys/fs/cgroup/system.slice/trainyard-worker.service");
}

TEST(DetectCgroupsTest, AContainersMountsShowOnlyItsOwnSubtree) {
  // The hierarchy's root is the container's cgroup: the worker's path is relative to it.
  const std::string mounts =
      "50 40 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
      "51 40 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n"
      "52 40 0:36 /docker/abc /sys/fs/cgroup/pids ro - cgroup cgroup rw,pids\n"
      "53 40 0:34 /docker/abc /sys/fs/cgroup/freezer ro - cgroup cgroup rw,freezer\n";
  const std::string self =
      "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc/worker\n2:pids:/docker/abc\n"
      "1:freezer:/docker/abc\n";
  const CgroupHost host = DetectCgroupsFrom(mounts, self, NoControllers);
  EXPECT_EQ(host.version, 1) << host.why;
  EXPECT_EQ(host.parents.at("memory"), "/sys/fs/cgroup/memory");
  EXPECT_EQ(host.parents.at("cpu"), "/sys/fs/cgroup/cpu,cpuacct/worker");
  EXPECT_EQ(host.parents.at("cpuacct"), "/sys/fs/cgroup/cpu,cpuacct/worker");
}

TEST(DetectCgroupsTest, NeitherSaysWhy) {
  const std::string mounts =
      "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
      "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
  const CgroupHost host =
      DetectCgroupsFrom(mounts, "4:memory:/\n0::/user.slice\n",
                        [](const std::string&) { return std::string("memory io\n"); });
  EXPECT_EQ(host.version, 0);
  EXPECT_TRUE(host.parents.empty());
  EXPECT_THAT(host.why, HasSubstr("/sys/fs/cgroup/user.slice does not offer cpu, pids"));
  EXPECT_THAT(host.why, HasSubstr("cgroup v1 lacks cpu, pids, freezer"));
  EXPECT_THAT(DescribeCgroups(host), HasSubstr("no usable cgroups: "));
}

// Processes in the cgroup (its first folder's cgroup.procs).
int Count(const std::vector<std::string>& dirs) {
  std::ifstream in(dirs[0] + "/cgroup.procs");
  int n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

// As root where this host's cgroups are usable: a rank's cgroup for real.
TEST(RankCgroupTest, LimitsAreWrittenAProcessJoinsAndIsKilledWholeAndAnOomIsCounted) {
  if (geteuid() != 0) GTEST_SKIP() << "making cgroups needs root";
  const CgroupHost host = DetectCgroups();
  if (host.version == 0) GTEST_SKIP() << DescribeCgroups(host);
  const std::string name = absl::StrCat("trainyard-test-", getpid(), "/job/attempt-1/rank-0");
  CgroupLimits limits;
  limits.memory_bytes = int64_t{32} << 20;
  limits.cpus = 0.5;
  limits.pids = 16;
  auto dirs = CreateRankCgroup(host, name, limits);
  ASSERT_TRUE(dirs.ok()) << dirs.status();
  auto file = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  if (host.version == 1) {
    EXPECT_EQ(file(host.parents.at("memory") + "/" + name + "/memory.limit_in_bytes"),
              absl::StrCat(int64_t{32} << 20, "\n"));
    EXPECT_EQ(file(host.parents.at("cpu") + "/" + name + "/cpu.cfs_quota_us"), "50000\n");
    EXPECT_EQ(file(host.parents.at("pids") + "/" + name + "/pids.max"), "16\n");
  } else {
    EXPECT_EQ(file(host.parents.at("") + "/" + name + "/memory.max"),
              absl::StrCat(int64_t{32} << 20, "\n"));
    EXPECT_EQ(file(host.parents.at("") + "/" + name + "/cpu.max"), "50000 100000\n");
  }
  EXPECT_TRUE(CgroupsEmpty(*dirs));

  // A process that joins, then one it starts in a session of its own: both end with the cgroup.
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (!JoinCgroups(*dirs, getpid())) _exit(3);
    if (fork() == 0) {
      setsid();
      execl("/bin/sleep", "sleep", "60", nullptr);
      _exit(4);
    }
    (void)!write(ready[1], "x", 1);
    execl("/bin/sleep", "sleep", "60", nullptr);
    _exit(4);
  }
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline && Count(*dirs) < 2) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_FALSE(CgroupsEmpty(*dirs));
  // A signal skips what `skip` names (the shepherd's processes already signalled): the one in a
  // session of its own ends, the child lives on.
  SignalCgroups(*dirs, SIGTERM, [child](pid_t pid) { return pid == child; });
  while (absl::Now() < deadline && Count(*dirs) > 1) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(Count(*dirs), 1);
  int status = 0;
  EXPECT_EQ(waitpid(child, &status, WNOHANG), 0) << "the skipped process got the signal";
  SignalCgroups(*dirs, SIGKILL);
  while (absl::Now() < deadline && !CgroupsEmpty(*dirs)) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(CgroupsEmpty(*dirs)) << "a process of the cgroup outlived SIGKILL to it";
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

  // A process past the memory limit is OOM-killed, and the cgroup says so.
  const pid_t hog = fork();
  ASSERT_GE(hog, 0);
  if (hog == 0) {
    if (!JoinCgroups(*dirs, getpid())) _exit(3);
    for (int i = 0; i < 256; ++i) {
      char* block = new char[1 << 20];
      for (int j = 0; j < (1 << 20); j += 4096) block[j] = static_cast<char>(j);
    }
    _exit(0);
  }
  ASSERT_EQ(waitpid(hog, &status, 0), hog);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  const auto memory = ReadMemory(*dirs);
  ASSERT_TRUE(memory.has_value());
  EXPECT_EQ(memory->limit_bytes, int64_t{32} << 20);
  EXPECT_GE(memory->oom_kills, 1);
  EXPECT_GT(memory->peak_bytes, int64_t{16} << 20);
  EXPECT_TRUE(RemoveCgroups(*dirs));
  for (const std::string& d : *dirs) EXPECT_NE(access(d.c_str(), F_OK), 0) << d;
  // The test's own top folders.
  for (const auto& [controller, parent] : host.parents) {
    rmdir(absl::StrCat(parent, "/trainyard-test-", getpid()).c_str());
  }
}

// What killed workers left (empty trees a minute old) goes; a tree with a process in it, and one
// made a moment ago (a worker may be starting a rank in it), stay.
// The v1 devices controller (issue 52): a device the rank's limits deny cannot be opened from its
// cgroup, others can; a folder made again for a rank without denials (reused) lets it be opened.
TEST(RankCgroupTest, OnV1ADeniedDeviceCannotBeOpenedFromTheCgroup) {
  if (geteuid() != 0) GTEST_SKIP() << "making cgroups needs root";
  const CgroupHost host = DetectCgroups();
  if (host.version != 1 || host.parents.count("devices") == 0) {
    GTEST_SKIP() << "needs the cgroup v1 devices controller: " << DescribeCgroups(host);
  }
  const std::string name = absl::StrCat("trainyard-test-", getpid(), "/job/attempt-1/rank-0");
  // 0: both opened; 1: /dev/full opened; 2: /dev/full refused with EPERM and /dev/zero opened.
  auto try_open = [](const std::vector<std::string>& dirs) {
    const pid_t child = fork();
    if (child == 0) {
      if (!JoinCgroups(dirs, getpid())) _exit(3);
      const int full = open("/dev/full", O_RDONLY);
      const int full_errno = errno;
      const int zero = open("/dev/zero", O_RDONLY);
      if (zero < 0) _exit(4);
      _exit(full >= 0 ? 1 : (full_errno == EPERM ? 2 : 5));
    }
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  CgroupLimits limits;
  limits.denied_devices = {"c 1:7 rwm"};  // /dev/full
  auto dirs = CreateRankCgroup(host, name, limits);
  ASSERT_TRUE(dirs.ok()) << dirs.status();
  EXPECT_EQ(try_open(*dirs), 2);
  dirs = CreateRankCgroup(host, name, CgroupLimits{});
  ASSERT_TRUE(dirs.ok()) << dirs.status();
  EXPECT_EQ(try_open(*dirs), 1);
  EXPECT_TRUE(RemoveCgroups(*dirs));
  for (const auto& [controller, parent] : host.parents) {
    rmdir(absl::StrCat(parent, "/trainyard-test-", getpid()).c_str());
  }
}

// cgroup v2 has no devices controller: a BPF device program on the rank's folder (device_filter.h)
// refuses the devices of its limits with EPERM and lets others be opened; set again (a reused
// folder), it drops the earlier denials. Run on this host's unified tree (beside v1's controllers
// here, where a v2 program applies as well; on a v2 host, CreateRankCgroup sets it).
TEST(DeviceFilterTest, OnV2ADeniedDeviceCannotBeOpenedFromTheCgroupAndSetAgainItCan) {
  if (geteuid() != 0) GTEST_SKIP() << "making cgroups and loading BPF programs needs root";
  std::string unified;
  {
    std::ifstream mountinfo("/proc/self/mountinfo");
    for (std::string line; std::getline(mountinfo, line);) {
      const std::vector<std::string> f = absl::StrSplit(line, ' ');
      if (f.size() > 8 && absl::StrContains(line, " - cgroup2 ")) unified = f[4];
    }
  }
  std::string own;  // this process's v2 cgroup ("0::/PATH")
  {
    std::ifstream self("/proc/self/cgroup");
    for (std::string line; std::getline(self, line);) {
      if (line.rfind("0::", 0) == 0) own = line.substr(3);
    }
  }
  if (unified.empty()) GTEST_SKIP() << "no cgroup v2 tree is mounted";
  const std::string dir =
      absl::StrCat(unified, own == "/" ? "" : own, "/trainyard-test-dev-", getpid());
  if (mkdir(dir.c_str(), 0755) != 0)
    GTEST_SKIP() << "cannot make " << dir << ": " << strerror(errno);
  absl::Cleanup remove = [&dir] { rmdir(dir.c_str()); };
  if (absl::Status s = CheckDeviceFilters(); !s.ok()) GTEST_SKIP() << s;
  // Bit 0: /dev/full opened, bit 1: /dev/zero opened; 8: cannot join; 16: refused, not with EPERM.
  auto try_open = [&dir] {
    const pid_t child = fork();
    if (child == 0) {
      if (!JoinCgroups({dir}, getpid())) _exit(8);
      int opened = 0;
      for (const auto& [path, bit] : {std::pair{"/dev/full", 1}, std::pair{"/dev/zero", 2}}) {
        const int fd = open(path, O_RDONLY);
        if (fd >= 0) opened |= bit;
        if (fd < 0 && errno != EPERM) opened |= 16;
      }
      _exit(opened);
    }
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  ASSERT_EQ(try_open(), 3) << "nothing denied yet";
  ASSERT_TRUE(SetDeviceFilter(dir, {"c 1:7 rwm"}).ok());  // /dev/full
  EXPECT_EQ(try_open(), 2);
  ASSERT_TRUE(SetDeviceFilter(dir, {"c 1:5 rwm", "c 1:7 rwm"}).ok());
  EXPECT_EQ(try_open(), 0);
  // A node of many GPUs: a rank is denied all the others (the verifier's log of a program this
  // long would overflow a small buffer, which fails the load).
  std::vector<std::string> many = {"c 1:7 rwm"};
  for (int minor = 0; minor < 31; ++minor) many.push_back(absl::StrCat("c 195:", minor, " rwm"));
  const absl::Status loaded = SetDeviceFilter(dir, many);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(try_open(), 2);
  ASSERT_TRUE(SetDeviceFilter(dir, {}).ok());
  EXPECT_EQ(try_open(), 3) << "the earlier denials stay";
  const absl::Status bad = SetDeviceFilter(dir, {"c 195"});
  EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
  EXPECT_THAT(std::string(bad.message()), ::testing::HasSubstr("'c 195'"));
}

TEST(RankCgroupTest, TheSweepRemovesEmptyTreesAMinuteOldOnly) {
  if (geteuid() != 0) GTEST_SKIP() << "making cgroups needs root";
  const CgroupHost host = DetectCgroups();
  if (host.version == 0) GTEST_SKIP() << DescribeCgroups(host);
  const std::string empty = absl::StrCat("trainyard-sweep-", getpid(), "/job-1/attempt-1/rank-0");
  const std::string busy = absl::StrCat("trainyard-busy-", getpid(), "/job-1/attempt-1/rank-0");
  auto empty_dirs = CreateRankCgroup(host, empty, {});
  auto busy_dirs = CreateRankCgroup(host, busy, {});
  ASSERT_TRUE(empty_dirs.ok() && busy_dirs.ok());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (!JoinCgroups(*busy_dirs, getpid())) _exit(3);
    execl("/bin/sleep", "sleep", "60", nullptr);
    _exit(4);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline && Count(*busy_dirs) < 1) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  SweepEmptyCgroups(host);
  for (const std::string& d : *empty_dirs) EXPECT_EQ(access(d.c_str(), F_OK), 0) << d;
  // Two minutes old, every folder of both trees.
  const timespec old_times[2] = {{time(nullptr) - 120, 0}, {time(nullptr) - 120, 0}};
  for (const auto& [controller, parent] : host.parents) {
    for (const std::string& tree : {empty, busy}) {
      std::string path = parent;
      for (absl::string_view part : absl::StrSplit(tree, '/')) {
        absl::StrAppend(&path, "/", part);
        utimensat(AT_FDCWD, path.c_str(), old_times, 0);
      }
    }
  }
  EXPECT_GE(SweepEmptyCgroups(host), 4);  // rank, attempt, job and the top, at least
  for (const std::string& d : *empty_dirs) EXPECT_NE(access(d.c_str(), F_OK), 0) << d;
  for (const std::string& d : *busy_dirs) EXPECT_EQ(access(d.c_str(), F_OK), 0) << d;
  SignalCgroups(*busy_dirs, SIGKILL);
  waitpid(child, nullptr, 0);
  while (absl::Now() < deadline && !CgroupsEmpty(*busy_dirs)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(RemoveCgroups(*busy_dirs));
  for (const auto& [controller, parent] : host.parents) {
    rmdir(absl::StrCat(parent, "/trainyard-busy-", getpid()).c_str());
  }
}

}  // namespace
}  // namespace trainyard::worker
