// What a rank's cgroup costs its start (issue 52): the worker makes the rank's folders with their
// limits (CreateRankCgroup), the rank's process joins them before it drops privileges
// (JoinCgroups), and its shepherd removes them at its end (RemoveCgroups). Each part timed on this
// host's real cgroups, 20 times after 2 warm-ups, medians in milliseconds; beside them, the start
// of a process that does nothing (fork, exec /bin/true, wait), which every rank start pays too.
//
// usage: cgroup_bench [--repeats N]   (root, on a host whose cgroups the worker can use)
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/daemon/cgroups.h"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

}  // namespace

int main(int argc, char** argv) {
  int repeats = 20;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--repeats") == 0) repeats = std::max(1, std::atoi(argv[i + 1]));
  }
  using namespace trainyard::worker;
  const CgroupHost host = DetectCgroups();
  if (geteuid() != 0 || host.version == 0) {
    std::fprintf(stderr, "cgroup_bench: needs root and usable cgroups: %s\n",
                 DescribeCgroups(host).c_str());
    return 2;
  }
  // A rank's limits as a worker with --memory-per-slot, --cpus-per-slot and GPUs sets them.
  CgroupLimits limits;
  limits.memory_bytes = int64_t{4} << 30;
  limits.cpus = 2;
  limits.pids = 8192;
  if (host.parents.count("devices") > 0) limits.denied_devices = {"c 195:1 rwm", "c 195:2 rwm"};
  const std::string top = absl::StrCat("trainyard-bench-", getpid());
  std::vector<double> create, join, remove, total, plain;
  for (int i = 0; i < repeats + 2; ++i) {
    const std::string name = absl::StrCat(top, "/job-", i, "/attempt-1/rank-0");
    const absl::Time t0 = absl::Now();
    auto dirs = CreateRankCgroup(host, name, limits);
    const absl::Time t1 = absl::Now();
    if (!dirs.ok()) {
      std::fprintf(stderr, "cgroup_bench: %s\n", std::string(dirs.status().message()).c_str());
      return 1;
    }
    // The rank's process joins (the shepherd's child does it before its exec); it reports the
    // time the join took through a pipe.
    int report[2];
    if (pipe(report) != 0) return 1;
    const pid_t child = fork();
    if (child == 0) {
      const absl::Time start = absl::Now();
      const bool joined = JoinCgroups(*dirs, getpid());
      const double ms = Ms(absl::Now() - start);
      (void)!write(report[1], &ms, sizeof(ms));
      _exit(joined ? 0 : 1);
    }
    close(report[1]);
    double join_ms = -1;
    (void)!read(report[0], &join_ms, sizeof(join_ms));
    close(report[0]);
    int status = 0;
    waitpid(child, &status, 0);
    const absl::Time t2 = absl::Now();
    const bool removed = RemoveCgroups(*dirs);
    const absl::Time t3 = absl::Now();
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !removed) {
      std::fprintf(stderr, "cgroup_bench: the join or the removal failed\n");
      return 1;
    }
    // The same process start without a cgroup: fork, exec /bin/true, wait.
    const absl::Time p0 = absl::Now();
    const pid_t bare = fork();
    if (bare == 0) {
      execl("/bin/true", "true", nullptr);
      _exit(127);
    }
    waitpid(bare, &status, 0);
    const absl::Time p1 = absl::Now();
    if (i < 2) continue;  // warm-ups
    create.push_back(Ms(t1 - t0));
    join.push_back(join_ms);
    remove.push_back(Ms(t3 - t2));
    total.push_back(Ms(t1 - t0) + join_ms + Ms(t3 - t2));
    plain.push_back(Ms(p1 - p0));
  }
  for (const auto& [controller, parent] : host.parents) {
    rmdir(absl::StrCat(parent, "/", top).c_str());
  }
  std::printf("%s\n", DescribeCgroups(host).c_str());
  std::printf(
      "cgroup set-up per rank start, median of %d (ms): create %.3f, join %.3f, "
      "remove %.3f, total %.3f; a bare process start (fork, exec /bin/true, wait) %.3f\n",
      repeats, Median(create), Median(join), Median(remove), Median(total), Median(plain));
  return 0;
}
