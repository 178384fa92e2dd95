// RankSupervisor with real rank processes (tests/test_rank.cc): what it reports for assignments
// that arrive more than once, as they do when a session opens while a placement is being sent.
#include "worker/daemon/rank_supervisor.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/context_archive.h"
#include "common/host_port.h"
#include "common/tls.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"
#include "worker/daemon/shepherd.h"

namespace trainyard::worker {
namespace {

// How a connection to a shepherd's socket from another account went, seen from that account:
// what its first receive got. Forked, then only system calls (no allocation after the fork).
enum class PeerOutcome { kNotPermitted, kClosedWithoutHello, kGotHello, kOther };
PeerOutcome ConnectAs(uid_t uid, gid_t gid, const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return PeerOutcome::kOther;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const pid_t child = fork();
  if (child == 0) {
    if (setgroups(0, nullptr) != 0 || setgid(gid) != 0 || setuid(uid) != 0) _exit(10);
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) _exit(10);
    if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
      _exit(errno == EACCES ? 11 : 10);
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10000) != 1) _exit(10);  // the shepherd answers at once either way
    char buf[256];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    _exit(n == 0 ? 12 : n > 0 ? 13 : 10);
  }
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status)) {
    return PeerOutcome::kOther;
  }
  switch (WEXITSTATUS(status)) {
    case 11:
      return PeerOutcome::kNotPermitted;
    case 12:
      return PeerOutcome::kClosedWithoutHello;
    case 13:
      return PeerOutcome::kGotHello;
    default:
      return PeerOutcome::kOther;
  }
}

// A rank's shepherd listens on a socket of mode 0600, which another account cannot connect to;
// and were the mode wider, it still takes connections from its own account only: another's is
// closed before the hello, and the worker's connection stays and still stops the rank.
TEST(ShepherdTest, TakesConnectionsFromItsOwnAccountOnly) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root, to connect as another account";
  const uid_t nobody = 65534;
  testing::TempDir dir;
  ASSERT_EQ(chmod(dir.path().c_str(), 0711), 0);  // the socket's mode decides, not the folder's
  const std::string prefix = dir.path() + "/rank-0", path = prefix + ".sock";
  auto listener = ListenShepherdSocket(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600);

  const std::vector<std::string> args = {testing::BinPath("trainyard-worker"),
                                         kShepherdFlag,
                                         "prefix=" + prefix,
                                         "cwd=" + dir.path(),
                                         "device=0",
                                         "grace_ms=5000",
                                         "orphan_ms=60000",
                                         "--",
                                         "/bin/sleep",
                                         "60"};
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t shepherd = fork();
  ASSERT_GE(shepherd, 0);
  if (shepherd == 0) {
    if (dup2(*listener, 3) != 3) _exit(127);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(*listener);
  // Whatever fails below, the shepherd (and its rank, which dies with it) does not outlive the
  // test.
  bool reaped = false;
  absl::Cleanup kill_shepherd = [&] {
    if (reaped) return;
    kill(shepherd, SIGKILL);
    waitpid(shepherd, nullptr, 0);
  };
  auto worker = ConnectShepherdSocket(path);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto hello = ReceiveShepherdMessage(*worker, absl::Seconds(10));
  ASSERT_TRUE(hello.ok()) << hello.status();
  // Its hello names its grace (a restarted worker reports it: the coordinator's hold counts on it).
  const std::optional<ShepherdHello> parsed = ParseShepherdHello(*hello);
  ASSERT_TRUE(parsed.has_value()) << *hello;
  EXPECT_EQ(parsed->grace_ms, 5000) << *hello;

  EXPECT_EQ(ConnectAs(nobody, nobody, path), PeerOutcome::kNotPermitted);
  ASSERT_EQ(chmod(path.c_str(), 0666), 0);
  EXPECT_EQ(ConnectAs(nobody, nobody, path), PeerOutcome::kClosedWithoutHello);
  // Its own account is taken: a connection from it gets the hello and replaces the one before,
  // as a restarted worker's does.
  EXPECT_EQ(ConnectAs(0, 0, path), PeerOutcome::kGotHello);

  auto again = ConnectShepherdSocket(path);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(ReceiveShepherdMessage(*again, absl::Seconds(10)).ok());
  ASSERT_TRUE(SendShepherdMessage(*again, "stop"));
  auto exit = ReceiveShepherdMessage(*again, absl::Seconds(10));
  ASSERT_TRUE(exit.ok()) << exit.status();
  // "exit CODE PEAK_RSS CPU_MS CGROUP_PEAK": the code, then what the rank used.
  EXPECT_TRUE(absl::StartsWith(*exit, absl::StrCat("exit ", 128 + SIGTERM, " "))) << *exit;
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(*exit, ' ')).size(), 5u) << *exit;
  ASSERT_TRUE(SendShepherdMessage(*again, "done"));
  int status = 0;
  ASSERT_EQ(waitpid(shepherd, &status, 0), shepherd);
  reaped = true;
  EXPECT_TRUE(WIFEXITED(status)) << status;
  close(*worker);
  close(*again);
}

// A rank's environment: the documented base (the worker's PATH, LANG and TZ; the owner's HOME,
// USER, LOGNAME, SHELL), then the worker's variables that --rank-env names (never its token), then
// trainyard's and the spec's, each replacing what came before.
// What a job asks for (resources.cpus, resources.memory) replaces the worker's per-slot limits;
// what it leaves unset keeps them, and the pids limit is the worker's alone.
TEST(RankLimitsTest, AJobsCpusAndMemoryReplaceTheSlotsDefaults) {
  const CgroupLimits slot{96 << 20, 0.5, 48, {}};
  v1::Resources asked;
  CgroupLimits limits = RankLimits(slot, asked);
  EXPECT_EQ(limits.memory_bytes, 96 << 20);
  EXPECT_DOUBLE_EQ(limits.cpus, 0.5);
  asked.set_memory_bytes(int64_t{16} << 30);
  asked.set_cpus(2);
  limits = RankLimits(slot, asked);
  EXPECT_EQ(limits.memory_bytes, int64_t{16} << 30);
  EXPECT_DOUBLE_EQ(limits.cpus, 2);
  EXPECT_EQ(limits.pids, 48);
  // A worker without per-slot limits still holds a rank to what its job asks for.
  EXPECT_EQ(RankLimits(CgroupLimits{}, asked).memory_bytes, int64_t{16} << 30);
}

TEST(RankLimitsTest, RanksSharingASlotShareItsDefaultsButGetWhatTheyAskFor) {
  CgroupLimits slot;
  slot.memory_bytes = int64_t{8} << 30;
  slot.cpus = 2;
  slot.pids = 400;
  v1::Resources shared;
  shared.set_nodes(2);
  shared.set_slots(2);
  shared.set_ranks_per_node(4);  // four ranks on each node's one slot
  CgroupLimits limits = RankLimits(slot, shared);
  EXPECT_EQ(limits.memory_bytes, int64_t{2} << 30);
  EXPECT_DOUBLE_EQ(limits.cpus, 0.5);
  EXPECT_EQ(limits.pids, 100);
  shared.set_memory_bytes(int64_t{3} << 30);
  shared.set_cpus(1);
  limits = RankLimits(slot, shared);
  EXPECT_EQ(limits.memory_bytes, int64_t{3} << 30);
  EXPECT_DOUBLE_EQ(limits.cpus, 1);
}

TEST(RankLimitsTest, ARankOnAGpuIsDeniedEveryOtherGpusDeviceFile) {
  const std::vector<std::string> rules = {"c 195:0 rwm", "c 195:1 rwm", "c 195:2 rwm"};
  EXPECT_EQ(DeniedDevices(rules, 1), (std::vector<std::string>{"c 195:0 rwm", "c 195:2 rwm"}));
  EXPECT_TRUE(DeniedDevices({}, 0).empty());  // CPU slots, or GPUs without device files
}

TEST(RankEnvironmentTest, BaseThenTheNamedWorkerVariablesThenTheRanksOwn) {
  UnixAccount alice;
  alice.name = "alice";
  alice.home = "/home/alice";
  alice.shell = "/bin/bash";
  const std::vector<std::string> worker = {"PATH=/opt/worker/bin",
                                           "LANG=de_DE.UTF-8",
                                           "HOME=/root",
                                           "SSH_AUTH_SOCK=/tmp/agent",
                                           "LD_LIBRARY_PATH=/opt/cuda",
                                           "NCCL_SOCKET_IFNAME=eth1",
                                           "ONEDNN_MAX_CPU_ISA=AVX2",
                                           "TRAINYARD_TOKEN=tyn.secret",
                                           "TRAINYARD_TOKEN_FILE=/etc/trainyard/token",
                                           "TRAINYARD_COLLECTIVES=gloo",
                                           "OMP_NUM_THREADS=64",
                                           "NOVALUE"};
  const std::vector<std::string> own = {"OMP_NUM_THREADS=4", "RANK=1", "PATH=/home/alice/bin",
                                        "LD_PRELOAD=/home/alice/lib.so"};
  const std::vector<std::string> env = RankEnvironment(alice, worker, DefaultRankEnv(), own);
  EXPECT_EQ(env,
            (std::vector<std::string>{
                "PATH=/home/alice/bin", "LANG=de_DE.UTF-8", "HOME=/home/alice", "USER=alice",
                "LOGNAME=alice", "SHELL=/bin/bash", "LD_LIBRARY_PATH=/opt/cuda",
                "NCCL_SOCKET_IFNAME=eth1", "ONEDNN_MAX_CPU_ISA=AVX2", "TRAINYARD_COLLECTIVES=gloo",
                "OMP_NUM_THREADS=4", "RANK=1", "LD_PRELOAD=/home/alice/lib.so"}));
  // Nothing named: only the base and the rank's own; no LANG in the worker's: C.UTF-8; TZ passed.
  const std::vector<std::string> bare =
      RankEnvironment(alice, {"TZ=Europe/Berlin", "NCCL_DEBUG=INFO"}, {}, {"RANK=0"});
  EXPECT_EQ(bare, (std::vector<std::string>{"PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8",
                                            "TZ=Europe/Berlin", "HOME=/home/alice", "USER=alice",
                                            "LOGNAME=alice", "SHELL=/bin/bash", "RANK=0"}));
  // Exact names and prefixes; the token never, even when named.
  const std::vector<std::string> named =
      RankEnvironment(alice, worker, {"SSH_AUTH_SOCK", "TRAINYARD_TOKEN", "TRAINYARD_T*"}, {});
  EXPECT_EQ(std::vector<std::string>(named.begin() + 6, named.end()),
            std::vector<std::string>{"SSH_AUTH_SOCK=/tmp/agent"});
  // The worker's PATH is the base's when the rank sets none (where the operator put python3).
  EXPECT_EQ(named[0], "PATH=/opt/worker/bin");
}

// A shepherd's hello, an older shepherd's without its grace (not known: 0), a newer one's with
// more words; anything else is not a hello.
TEST(ShepherdTest, HelloGivesTheDeviceTheOffsetAndTheGrace) {
  const std::optional<ShepherdHello> hello = ParseShepherdHello("rank 1234 3 4096 600000");
  ASSERT_TRUE(hello.has_value());
  EXPECT_EQ(hello->device, 3);
  EXPECT_EQ(hello->offset, 4096);
  EXPECT_EQ(hello->grace_ms, 600000);
  const std::optional<ShepherdHello> old = ParseShepherdHello("rank 1234 3 4096");
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->grace_ms, 0);
  EXPECT_FALSE(ParseShepherdHello("rank 1234 3 4096 -5").has_value());
  // (A newer shepherd's words after the grace are not this worker's to read.)
  const std::optional<ShepherdHello> newer = ParseShepherdHello("rank 1234 3 4096 5 more");
  ASSERT_TRUE(newer.has_value());
  EXPECT_EQ(newer->grace_ms, 5);
  EXPECT_FALSE(ParseShepherdHello("rank 1234 3").has_value());
  EXPECT_FALSE(ParseShepherdHello("rank 1234 3 -1 5").has_value());
}

// The shepherd (trainyard-worker itself) finds its libraries where the worker did, and holds
// nothing else of the worker's environment. (The GPU hosts' kit is under LD_LIBRARY_PATH: without
// it, no shepherd started there and every rank failed "the rank's shepherd did not start".)
TEST(ShepherdEnvironmentTest, AFixedPathAndTheWorkersLibraryPathOnly) {
  EXPECT_THAT(ShepherdEnvironment({"HOME=/root", "LD_LIBRARY_PATH=/opt/kit/lib:/opt/torch/lib",
                                   "LD_PRELOAD=/x.so", "PATH=/opt/bin", "SECRET=1"}),
              ::testing::ElementsAre("PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                                     "LD_LIBRARY_PATH=/opt/kit/lib:/opt/torch/lib"));
  EXPECT_THAT(ShepherdEnvironment({"HOME=/root", "XLD_LIBRARY_PATH=/x"}),
              ::testing::ElementsAre("PATH=/usr/sbin:/usr/bin:/sbin:/bin"));
}

// A rank's stop grace on this worker: the job's own up to --max-stop-grace, else --stop-grace.
TEST(StopGraceTest, TheJobsOwnUpToTheWorkersMaximumElseTheWorkers) {
  SupervisorOptions o;
  o.stop_grace = absl::Seconds(10);
  o.max_stop_grace = absl::Minutes(5);
  v1::JobSpec spec;
  EXPECT_EQ(StopGrace(spec, o), absl::Seconds(10));
  spec.set_stop_grace_seconds(120);
  EXPECT_EQ(StopGrace(spec, o), absl::Minutes(2));
  spec.set_stop_grace_seconds(3600);
  EXPECT_EQ(StopGrace(spec, o), absl::Minutes(5));
  spec.set_stop_grace_seconds(2);
  EXPECT_EQ(StopGrace(spec, o), absl::Seconds(2));  // shorter than the worker's: the job's
}

TEST(NodeHostTest, TheHostOfTheWorkersAddressElseItsName) {
  EXPECT_EQ(NodeHost("10.1.2.3", "vm"), "10.1.2.3");
  EXPECT_EQ(NodeHost("10.1.2.3:7000", "vm"), "10.1.2.3");
  EXPECT_EQ(NodeHost(" gpu-7.example ", "vm"), "gpu-7.example");
  EXPECT_EQ(NodeHost("[fd00::7]:7000", "vm"), "fd00::7");
  EXPECT_EQ(NodeHost("fd00::7", "vm"), "fd00::7");
  EXPECT_EQ(NodeHost("", "vm"), "vm");
}

// The one reading of an address's host (common/host_port.h) that the worker, the coordinator and
// the TLS checks share: IsLoopback knows a bare IPv6 loopback too (its own copy had read "::1"
// as the host "::" of port 1).
TEST(NodeHostTest, LoopbackIsTheHostsNotTheAddresss) {
  EXPECT_EQ(HostOfAddress("[::1]:7070"), "::1");
  EXPECT_EQ(HostOfAddress("[::1"), "[::1");  // malformed: as it is
  EXPECT_EQ(HostOfAddress(""), "");
  for (const char* loopback :
       {"127.0.0.1:7070", "127.9.9.9", "localhost:8080", "[::1]:7070", "::1"}) {
    EXPECT_TRUE(IsLoopback(loopback)) << loopback;
  }
  for (const char* other : {"10.0.0.1:7070", "gpu-7:7070", "[fd00::7]:7070", "::2", ""}) {
    EXPECT_FALSE(IsLoopback(other)) << other;
  }
}

TEST(LocalAddressTowardTest, TheSourceAddressOfTheRouteThere) {
  // Loopback is reached from loopback; the list's first address counts.
  EXPECT_EQ(LocalAddressToward("127.0.0.1:7070").value_or(""), "127.0.0.1");
  EXPECT_EQ(LocalAddressToward("127.0.0.1:7070,10.9.9.9:7070").value_or(""), "127.0.0.1");
  for (const char* bad : {"", "7070", "host", "[::1]", "no-such-host.invalid:7070"}) {
    EXPECT_FALSE(LocalAddressToward(bad).ok()) << bad;
  }
}

TEST(InterfaceWithTest, TheInterfaceThatHoldsTheAddress) {
  EXPECT_EQ(InterfaceWith("127.0.0.1"), "lo");
  EXPECT_EQ(InterfaceWith("localhost"), "lo");
  EXPECT_EQ(InterfaceWith("192.0.2.77"), "");  // TEST-NET-1: on no interface
  EXPECT_EQ(InterfaceWith(""), "");
  EXPECT_EQ(InterfaceWith("no-such-host.invalid"), "");
}

TEST(RankCoordinatorListTest, TheLeadersListThenTheWorkersAddressesItLacks) {
  EXPECT_EQ(RankCoordinatorList("a:1", "b:2,a:1"), "a:1,b:2");
  EXPECT_EQ(RankCoordinatorList("a:1,c:3", " b:2 , a:1,"), "a:1,c:3,b:2");
  EXPECT_EQ(RankCoordinatorList("a:1", ""), "a:1");
  EXPECT_EQ(RankCoordinatorList("", "b:2"), "b:2");
}

TEST(FailureMessageTest, LeadsWithTheLastErrorLine) {
  EXPECT_EQ(FailureMessage({"LibTorch 1.13.0", "BLAS: OpenBLAS",
                            "trainyard-trainer: error: data.path: cannot open '/nope'"}),
            "trainyard-trainer: error: data.path: cannot open '/nope'\nLibTorch 1.13.0\n"
            "BLAS: OpenBLAS\ntrainyard-trainer: error: data.path: cannot open '/nope'");
  // Python: the exception, Traceback's last line, even with output after it.
  const std::string m = FailureMessage(
      {"Traceback (most recent call last):", "  File \"train.py\", line 3, in <module>",
       "ValueError: bad learning rate", "cleaning up"});
  EXPECT_EQ(m.substr(0, m.find('\n')), "ValueError: bad learning rate");
  // No error word: the last non-empty line.
  const std::string quiet = FailureMessage({"step 1", "step 2", ""});
  EXPECT_EQ(quiet.substr(0, quiet.find('\n')), "step 2");
  EXPECT_EQ(FailureMessage({}), "");
  EXPECT_EQ(FailureMessage({"only line: Error"}), "only line: Error");
}

// What torch's @record writes (torch/distributed/elastic/multiprocessing/errors/error_handler.py),
// `callstack` JSON-escaped already.
std::string RecordedError(const std::string& message, const std::string& callstack) {
  return absl::StrCat("{\"message\": {\"message\": \"", message,
                      "\", \"extraInfo\": {\"py_callstack\": \"", callstack,
                      "\", \"timestamp\": \"1700000000\"}}}");
}

std::string WriteFileIn(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = absl::StrCat(dir, "/", name);
  FILE* f = fopen(path.c_str(), "w");
  fwrite(text.data(), 1, text.size(), f);
  fclose(f);
  return path;
}

TEST(ErrorFileMessageTest, TheRecordedExceptionThenWhereItWasRaised) {
  const std::string dir = ::testing::TempDir();
  const std::string path = WriteFileIn(
      dir, "recorded.json",
      RecordedError("RuntimeError: boom on rank 1",
                    "Traceback (most recent call last):\\n  File \\\"train.py\\\", line 9, in "
                    "main\\n    raise RuntimeError(\\\"boom on rank 1\\\")\\nRuntimeError: boom "
                    "on rank 1\\n"));
  EXPECT_EQ(ErrorFileMessage(path),
            "RuntimeError: boom on rank 1\nTraceback (most recent call last):\n"
            "  File \"train.py\", line 9, in main\n    raise RuntimeError(\"boom on rank 1\")\n"
            "RuntimeError: boom on rank 1");
  // A message as a plain string (a C++ program's own), no callstack.
  EXPECT_EQ(ErrorFileMessage(WriteFileIn(dir, "plain.json", "{\"message\": \"out of shards\"}")),
            "out of shards");
}

TEST(ErrorFileMessageTest, NothingReadableIsNoMessage) {
  const std::string dir = ::testing::TempDir();
  EXPECT_EQ(ErrorFileMessage(dir + "/absent.json"), "");
  EXPECT_EQ(ErrorFileMessage(WriteFileIn(dir, "text.json", "Traceback, not JSON")), "");
  EXPECT_EQ(ErrorFileMessage(WriteFileIn(dir, "other.json", "{\"error\": \"x\"}")), "");
  EXPECT_EQ(ErrorFileMessage(WriteFileIn(dir, "blank.json", "{\"message\": {\"message\": \" \"}}")),
            "");
  // The owner wrote the file: a link to another file is not followed, a FIFO not waited on.
  const std::string secret = WriteFileIn(dir, "secret", "{\"message\": \"the worker's secret\"}");
  unlink((dir + "/link.json").c_str());
  ASSERT_EQ(symlink(secret.c_str(), (dir + "/link.json").c_str()), 0);
  EXPECT_EQ(ErrorFileMessage(dir + "/link.json"), "");
  unlink((dir + "/fifo.json").c_str());
  ASSERT_EQ(mkfifo((dir + "/fifo.json").c_str(), 0600), 0);
  EXPECT_EQ(ErrorFileMessage(dir + "/fifo.json"), "");
  // Nor a hard link (where fs.protected_hardlinks is off, one to a file the owner cannot read).
  unlink((dir + "/hard.json").c_str());
  ASSERT_EQ(link(secret.c_str(), (dir + "/hard.json").c_str()), 0);
  EXPECT_EQ(ErrorFileMessage(dir + "/hard.json"), "");
}

TEST(ErrorFileMessageTest, ALongCallstackKeepsItsLastLinesWithinTheLimit) {
  std::string callstack = "Traceback (most recent call last):";
  for (int i = 0; i < 500; ++i) absl::StrAppend(&callstack, "\\n  File \\\"f.py\\\", line ", i);
  absl::StrAppend(&callstack, "\\nValueError: the cause");
  const std::string m =
      ErrorFileMessage(WriteFileIn(::testing::TempDir(), "long.json",
                                   RecordedError("ValueError: the cause", callstack)),
                       512);
  EXPECT_LE(m.size(), 512u);
  EXPECT_TRUE(absl::StartsWith(m, "ValueError: the cause\n  File")) << m;
  EXPECT_TRUE(absl::EndsWith(m, "line 499\nValueError: the cause")) << m;
}

using testing::TempDir;

// The rank status messages a supervisor sent, in order.
class Reports {
 public:
  void Add(const v1::NodeMessage& m) {
    absl::MutexLock lock(&mu_);
    if (m.has_logs()) {
      largest_logs_ = std::max(largest_logs_, m.ByteSizeLong());
      for (const std::string& line : m.logs().lines()) lines_.push_back(line);
    }
    if (m.has_rank_status()) statuses_.push_back(m.rank_status());
  }
  // The log lines sent, in order, and the largest log message's size.
  std::vector<std::string> Lines() {
    absl::MutexLock lock(&mu_);
    return lines_;
  }
  size_t LargestLogs() {
    absl::MutexLock lock(&mu_);
    return largest_logs_;
  }
  // Waits until `job_id` rank `rank` has exited; false after 30 s.
  bool AwaitExit(const std::string& job_id, int rank) {
    absl::MutexLock lock(&mu_);
    auto exited = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const v1::RankStatus& s : statuses_) {
        if (s.job_id() == job_id && s.rank() == rank && s.phase() == v1::RANK_EXITED) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&exited), absl::Seconds(30));
  }
  // The exit code of `job_id` rank `rank`'s first exit; -1 when none.
  int ExitCode(const std::string& job_id, int rank) {
    absl::MutexLock lock(&mu_);
    for (const v1::RankStatus& s : statuses_) {
      if (s.job_id() == job_id && s.rank() == rank && s.phase() == v1::RANK_EXITED) {
        return s.exit_code();
      }
    }
    return -1;
  }
  // The message of `job_id` rank `rank`'s first exit.
  std::string ExitMessage(const std::string& job_id, int rank) {
    absl::MutexLock lock(&mu_);
    for (const v1::RankStatus& s : statuses_) {
      if (s.job_id() == job_id && s.rank() == rank && s.phase() == v1::RANK_EXITED) {
        return s.message();
      }
    }
    return "";
  }
  // How many times `job_id` rank `rank` was reported in `phase`.
  int Count(const std::string& job_id, int rank, v1::RankPhase phase) {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const v1::RankStatus& s : statuses_) {
      n += s.job_id() == job_id && s.rank() == rank && s.phase() == phase;
    }
    return n;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::RankStatus> statuses_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
  size_t largest_logs_ ABSL_GUARDED_BY(mu_) = 0;
};

v1::Assignment AssignmentOf(const std::string& job_id, int ranks,
                            const std::string& mode = "succeed") {
  v1::Assignment a;
  a.set_job_id(job_id);
  a.set_attempt(1);
  a.set_world_size(ranks);
  a.set_first_rank(0);
  for (int i = 0; i < ranks; ++i) a.add_device_indices(i);
  a.set_spec(testing::TinySpec(mode, ranks).SerializeAsString());
  a.set_owner("alice");
  return a;
}

class RankSupervisorTest : public ::testing::Test {
 protected:
  RankSupervisorTest() { Restart(Options()); }

  SupervisorOptions Options() {
    SupervisorOptions options;
    options.trainer_path = testing::TestBinPath("test_rank");
    options.work_dir = dir_.path() + "/work";
    options.shepherd_path = testing::BinPath("trainyard-worker");  // not this test's binary
    return options;
  }
  // A supervisor of `options` in place of the one running.
  void Restart(const SupervisorOptions& options) {
    supervisor_.reset();
    supervisor_ =
        std::make_unique<RankSupervisor>(options, [this](v1::NodeMessage m) { reports_.Add(m); });
  }
  // One whose jobs' contexts come from `fetch` (a ContextCache under the test's folder).
  void RestartWithContexts(ContextCache::Fetch fetch) {
    SupervisorOptions options = Options();
    options.contexts = std::make_shared<ContextCache>(dir_.path() + "/contexts", std::move(fetch));
    Restart(options);
  }

  TempDir dir_;
  Reports reports_;
  std::unique_ptr<RankSupervisor> supervisor_;
};

TEST_F(RankSupervisorTest, AnAssignmentSentTwiceStartsEachRankOnce) {
  const v1::Assignment a = AssignmentOf("job-1", 2);
  supervisor_->Launch(a);
  supervisor_->Launch(a);  // crossed the first on its way: both queued
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  ASSERT_TRUE(reports_.AwaitExit("job-1", 1));
  // Launches are started in order: once job-2 has run, a third copy of job-1's would have too.
  supervisor_->Launch(a);  // after its ranks ended
  supervisor_->Launch(AssignmentOf("job-2", 1));
  ASSERT_TRUE(reports_.AwaitExit("job-2", 0));
  EXPECT_EQ(reports_.ExitCode("job-2", 0), 0);
  for (int rank : {0, 1}) {
    EXPECT_EQ(reports_.ExitCode("job-1", rank), 0) << "rank " << rank;
    EXPECT_EQ(reports_.Count("job-1", rank, v1::RANK_RUNNING), 1) << "rank " << rank;
    EXPECT_EQ(reports_.Count("job-1", rank, v1::RANK_EXITED), 1) << "rank " << rank;
  }
}

TEST_F(RankSupervisorTest, AnAssignmentStoppedBeforeItStartedIsNotStartedByAResend) {
  const v1::Assignment a = AssignmentOf("job-1", 1);
  supervisor_->Stop("job-1", 1);  // nothing of it yet: a no-op
  supervisor_->Launch(a);
  supervisor_->Stop("job-1", 1);  // may catch it queued, or stop it running
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  supervisor_->Launch(a);
  supervisor_->Launch(AssignmentOf("job-2", 1));
  ASSERT_TRUE(reports_.AwaitExit("job-2", 0));
  EXPECT_EQ(reports_.Count("job-1", 0, v1::RANK_EXITED), 1);
  EXPECT_LE(reports_.Count("job-1", 0, v1::RANK_RUNNING), 1);
}

// An ended attempt's ranks are remembered as started for forget_started_after (24 h), then
// forgotten (one entry per rank stayed for the worker's lifetime): here at once, so that the same
// assignment sent again once its work folder is gone starts its rank again.
TEST_F(RankSupervisorTest, AnEndedAttemptsRanksAreForgottenAfterTheirTime) {
  SupervisorOptions options = Options();
  options.forget_started_after = absl::ZeroDuration();
  Restart(options);
  const v1::Assignment a = AssignmentOf("job-1", 1);
  supervisor_->Launch(a);
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  const std::string work = dir_.path() + "/work/job-1/attempt-1/work";
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       std::filesystem::exists(work);) {
    ASSERT_LT(absl::Now(), deadline) << "the attempt never ended here";
    absl::SleepFor(absl::Milliseconds(20));
  }
  supervisor_->Launch(a);
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       reports_.Count("job-1", 0, v1::RANK_EXITED) < 2;) {
    ASSERT_LT(absl::Now(), deadline) << "the forgotten rank did not start again";
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(reports_.Count("job-1", 0, v1::RANK_RUNNING), 2);
}

// A rank's output reaches the coordinator in messages it takes (at most 4 MiB): a 6 MB line in
// pieces cut between characters, many long lines in batches of about 1 MiB (512 lines of 9 KB
// made one 4.6 MB message, and the coordinator ended the node's session on it).
TEST_F(RankSupervisorTest, LongOutputIsSentInMessagesTheCoordinatorTakes) {
  supervisor_->Launch(AssignmentOf("job-1", 1, "print-long-lines"));
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  EXPECT_EQ(reports_.ExitCode("job-1", 0), 0);
  EXPECT_LE(reports_.LargestLogs(), size_t{5} << 19);  // 2.5 MiB
  std::string long_line, expected = "<";
  for (int i = 0; i < 3'000'000; ++i) expected += "\xc3\xa9";
  int nines = 0, pieces = 0;
  bool end = false;
  for (const std::string& line : reports_.Lines()) {
    if (line.size() == 9000) {
      ++nines;
    } else if (line == "end") {
      end = true;
    } else if (absl::StartsWith(line, "<") || absl::StrContains(line, "\xc3\xa9")) {
      ++pieces;
      long_line += line;
    }
  }
  EXPECT_GE(pieces, 6);
  // Every piece whole: a character cut in two would have come as two U+FFFD.
  EXPECT_TRUE(long_line == expected)
      << long_line.size() << " bytes, U+FFFD at " << long_line.find("\xef\xbf\xbd");
  EXPECT_EQ(nines, 600);
  EXPECT_TRUE(end);
}

// Once an attempt's ranks here have ended, its work folder (what they wrote there: test_rank's
// pids files) goes, emptied as its owner; its spec and logs stay. (Each attempt's folder stayed
// for good, with up to 64 MiB of unpacked context in it.)
TEST_F(RankSupervisorTest, AnEndedAttemptsWorkFolderGoesItsSpecAndLogsStay) {
  supervisor_->Launch(AssignmentOf("job-1", 2));
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  ASSERT_TRUE(reports_.AwaitExit("job-1", 1));
  const std::string attempt = dir_.path() + "/work/job-1/attempt-1";
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       std::filesystem::exists(attempt + "/work");) {
    ASSERT_LT(absl::Now(), deadline) << "the work folder stays";
    absl::SleepFor(absl::Milliseconds(20));
  }
  for (const char* kept : {"spec.pb", "rank-0.log", "rank-1.log"}) {
    EXPECT_TRUE(std::filesystem::exists(absl::StrCat(attempt, "/", kept))) << kept;
  }
  EXPECT_EQ(reports_.ExitCode("job-1", 0), 0);
}

// A worker that detaches (an upgrade) leaves its running ranks' work folders as they are: the next
// worker adopts the ranks, which still work there, and removes the folder once they end.
// (Detaching ends every follower, and the clean-up of ended attempts emptied the running ranks'
// folders; an adopted attempt's folder stayed for good.)
TEST_F(RankSupervisorTest, DetachingLeavesTheRunningRanksWorkFolders) {
  v1::Assignment a = AssignmentOf("job-1", 1, "until-data-exists");
  v1::JobSpec spec;
  ASSERT_TRUE(spec.ParseFromString(a.spec()));
  const std::string release = dir_.path() + "/release";
  spec.mutable_data()->set_path(release);
  a.set_spec(spec.SerializeAsString());
  supervisor_->Launch(a);
  const std::string pids = dir_.path() + "/work/job-1/attempt-1/work/pids-rank-0";
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       !std::filesystem::exists(pids);) {
    ASSERT_LT(absl::Now(), deadline) << "the rank never started";
    absl::SleepFor(absl::Milliseconds(20));
  }
  supervisor_->Detach();
  supervisor_.reset();
  EXPECT_TRUE(std::filesystem::exists(pids)) << "a running rank's folder was emptied";
  // The next supervisor on the work directory adopts the rank; released, it ends.
  SupervisorOptions options;
  options.trainer_path = testing::TestBinPath("test_rank");
  options.work_dir = dir_.path() + "/work";
  options.shepherd_path = testing::BinPath("trainyard-worker");
  supervisor_ =
      std::make_unique<RankSupervisor>(options, [this](v1::NodeMessage m) { reports_.Add(m); });
  EXPECT_EQ(supervisor_->Adopt().size(), 1u);
  std::ofstream(release) << "go";
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  EXPECT_EQ(reports_.ExitCode("job-1", 0), 0);
  // Once the adopted rank has ended, its folder goes too (emptied as the folder's owner).
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       std::filesystem::exists(dir_.path() + "/work/job-1/attempt-1/work");) {
    ASSERT_LT(absl::Now(), deadline) << "the adopted attempt's work folder stays";
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// A shepherd killed under its worker leaves its socket: the worker removes it with the rank's end
// (a socket in an attempt's folder keeps the folder, as a shepherd's whose rank runs).
TEST_F(RankSupervisorTest, AKilledShepherdsSocketGoesWithItsRank) {
  supervisor_->Launch(AssignmentOf("job-1", 1, "hang"));
  const std::string attempt = dir_.path() + "/work/job-1/attempt-1";
  pid_t rank = 0;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       !(std::ifstream(attempt + "/work/pids-rank-0") >> rank);) {
    ASSERT_LT(absl::Now(), deadline) << "the rank never started";
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::string stat;
  ASSERT_TRUE(std::getline(std::ifstream(absl::StrCat("/proc/", rank, "/stat")), stat));
  const std::vector<std::string> fields = absl::StrSplit(stat.substr(stat.rfind(')') + 2), ' ');
  pid_t shepherd = 0;
  ASSERT_TRUE(absl::SimpleAtoi(fields.at(1), &shepherd));  // (state, ppid, ...)
  ASSERT_GT(shepherd, 1);
  ASSERT_TRUE(std::filesystem::exists(attempt + "/rank-0.sock"));
  ASSERT_EQ(kill(shepherd, SIGKILL), 0);
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  EXPECT_THAT(reports_.ExitMessage("job-1", 0), ::testing::HasSubstr("shepherd ended"));
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       std::filesystem::exists(attempt + "/rank-0.sock");) {
    ASSERT_LT(absl::Now(), deadline) << "the dead shepherd's socket stays";
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// An ended attempt's whole folder (spec, logs) goes once unchanged for --keep-ended-attempts:
// every attempt stayed on the worker's disk for good, each rank's log up to --rank-log-keep. The
// job's folder stays while its checkpoints are there.
TEST_F(RankSupervisorTest, AnEndedAttemptsFolderGoesOnceUnchangedForTheKeep) {
  supervisor_.reset();
  SupervisorOptions options;
  options.trainer_path = testing::TestBinPath("test_rank");
  options.work_dir = dir_.path() + "/work";
  options.shepherd_path = testing::BinPath("trainyard-worker");
  options.keep_ended_attempts = absl::Seconds(1);
  supervisor_ =
      std::make_unique<RankSupervisor>(options, [this](v1::NodeMessage m) { reports_.Add(m); });
  supervisor_->Launch(AssignmentOf("job-1", 2));
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  ASSERT_TRUE(reports_.AwaitExit("job-1", 1));
  EXPECT_EQ(reports_.ExitCode("job-1", 0), 0);
  const std::string attempt = dir_.path() + "/work/job-1/attempt-1";
  for (const absl::Time deadline = absl::Now() + absl::Seconds(60);
       std::filesystem::exists(attempt);) {
    ASSERT_LT(absl::Now(), deadline) << "the ended attempt's folder stays";
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/work/job-1/checkpoints"));
}

// A launch stopped while its context was being fetched is dropped, and the copy unpacked for it
// goes as an ended attempt's would (it stayed for good: no rank of it ever ended).
TEST_F(RankSupervisorTest, ALaunchStoppedWhileItsContextCameLeavesNoCopy) {
  testing::TempDir source;
  std::ofstream(source.path() + "/train.py") << "print('hi')";
  auto packed = PackContext(source.path());
  ASSERT_TRUE(packed.ok()) << packed.status();
  absl::Mutex mu;
  bool fetching = false, release = false;
  RestartWithContexts([&](const std::string&) -> absl::StatusOr<std::string> {
    absl::MutexLock lock(&mu);
    fetching = true;
    mu.Await(absl::Condition(&release));
    return packed->archive;
  });
  absl::Cleanup released = [&] {
    absl::MutexLock lock(&mu);
    release = true;
  };
  v1::Assignment a = AssignmentOf("job-1", 1);
  v1::JobSpec spec;
  ASSERT_TRUE(spec.ParseFromString(a.spec()));
  spec.set_context(packed->digest);
  a.set_spec(spec.SerializeAsString());
  supervisor_->Launch(a);
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&fetching), absl::Seconds(30)));
  }
  supervisor_->Stop("job-1", 1);
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  EXPECT_EQ(reports_.ExitMessage("job-1", 0), "stopped before it started");
  {
    absl::MutexLock lock(&mu);
    release = true;
  }
  const std::string work = dir_.path() + "/work/job-1/attempt-1/work";
  for (const absl::Time deadline = absl::Now() + absl::Seconds(60);
       std::filesystem::exists(work);) {
    ASSERT_LT(absl::Now(), deadline) << "the dropped launch's unpacked context stays";
    absl::SleepFor(absl::Milliseconds(50));
  }
}

// A context that is slow to come (a large one, a slow coordinator, an unpacker its owner stopped)
// holds up its own launch only: another job's launch on the node, with a context of its own,
// starts meanwhile (every launch waited behind it, up to the unpacker's 5-minute timeout).
TEST_F(RankSupervisorTest, AContextSlowToComeHoldsUpNoOtherLaunch) {
  testing::TempDir source, other_source;
  std::ofstream(source.path() + "/train.py") << "print('hi')";
  std::ofstream(other_source.path() + "/train.py") << "print('other')";
  auto packed = PackContext(source.path());
  ASSERT_TRUE(packed.ok()) << packed.status();
  auto other = PackContext(other_source.path());
  ASSERT_TRUE(other.ok()) << other.status();
  absl::Mutex mu;
  bool fetching = false, release = false;
  RestartWithContexts([&](const std::string& job) -> absl::StatusOr<std::string> {
    if (job == "job-2") return other->archive;
    absl::MutexLock lock(&mu);
    fetching = true;
    mu.Await(absl::Condition(&release));
    return packed->archive;
  });
  absl::Cleanup released = [&] {
    absl::MutexLock lock(&mu);
    release = true;
  };
  v1::Assignment slow = AssignmentOf("job-1", 1);
  v1::JobSpec spec;
  ASSERT_TRUE(spec.ParseFromString(slow.spec()));
  spec.set_context(packed->digest);
  slow.set_spec(spec.SerializeAsString());
  supervisor_->Launch(slow);
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&fetching), absl::Seconds(30)));
  }
  v1::Assignment quick = AssignmentOf("job-2", 1);
  spec.set_context(other->digest);
  quick.set_spec(spec.SerializeAsString());
  supervisor_->Launch(quick);
  ASSERT_TRUE(reports_.AwaitExit("job-2", 0));
  EXPECT_EQ(reports_.ExitCode("job-2", 0), 0) << reports_.ExitMessage("job-2", 0);
  EXPECT_EQ(reports_.ExitCode("job-1", 0), -1) << "job-1's context has not come";
  {
    absl::MutexLock lock(&mu);
    release = true;
  }
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  EXPECT_EQ(reports_.ExitCode("job-1", 0), 0) << reports_.ExitMessage("job-1", 0);
}

// A rank starts with the kernel's OOM score adjustment, 0, not the worker's: a worker protected
// from the OOM killer (a unit's OOMScoreAdjust=-1000) made its ranks unkillable too, and a rank at
// its memory limit hung its cgroup instead of being killed. (Here the worker's is +500: a negative
// one needs CAP_SYS_RESOURCE, which root in this test's containers lacks; the rank's reset is the
// same write either way.)
TEST_F(RankSupervisorTest, ARankDoesNotInheritTheWorkersOomScoreAdjustment) {
  std::string before;
  std::ifstream("/proc/self/oom_score_adj") >> before;
  ASSERT_FALSE(before.empty());
  // (A runner with a score of its own, a pod's or a unit's, may not go back to 0 unprivileged.)
  if (before != "0") GTEST_SKIP() << "this test's own oom_score_adj is " << before << ", not 0";
  auto write_adj = [](const std::string& value) {
    std::ofstream adj("/proc/self/oom_score_adj");
    adj << value;
    adj.flush();
    return adj.good();
  };
  ASSERT_TRUE(write_adj("500"));
  absl::Cleanup restore = [&] { write_adj(before); };
  supervisor_->Launch(AssignmentOf("job-1", 1, "print-oom-score-adj"));
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  EXPECT_THAT(reports_.Lines(), ::testing::Contains("oom_score_adj 0"));
}

// A job's checkpoint folder that another account made first (the checkpoint root may be writable
// by all users) is refused, its contents never handed to the job: another user could plant a
// checkpoint for it to resume from. One the owner made (an earlier attempt's) is theirs to keep.
TEST(CheckpointFolderTest, AnotherAccountsFolderIsRefusedTheOwnersKept) {
  if (geteuid() != 0) GTEST_SKIP() << "switching ranks to another account needs root";
  TempDir dir;
  ASSERT_EQ(chmod(dir.path().c_str(), 0755), 0);
  std::ofstream(dir.path() + "/user-map") << "alice nobody\n";
  auto run_as = RunAs::Create(dir.path() + "/user-map", /*as_root=*/true);
  ASSERT_TRUE(run_as.ok()) << run_as.status();
  Reports reports;
  SupervisorOptions options;
  options.trainer_path = testing::TestBinPath("test_rank");
  options.work_dir = dir.path() + "/work";
  options.shepherd_path = testing::BinPath("trainyard-worker");
  options.run_as = std::make_shared<const RunAs>(*std::move(run_as));
  RankSupervisor supervisor(options, [&](v1::NodeMessage m) { reports.Add(m); });
  const std::string root = dir.path() + "/checkpoints";
  for (const auto& [job, uid] : {std::pair<std::string, uid_t>{"job-1", 12345}, {"job-2", 65534}}) {
    const std::string folder = root + "/" + job;
    std::filesystem::create_directories(folder);
    std::ofstream(folder + "/step-100.pt") << "planted";
    ASSERT_EQ(chown(folder.c_str(), uid, uid), 0);
    v1::Assignment a = AssignmentOf(job, 1);
    a.set_checkpoint_dir(folder);
    supervisor.Launch(a);
    ASSERT_TRUE(reports.AwaitExit(job, 0));
  }
  EXPECT_EQ(reports.ExitCode("job-1", 0), 126);
  EXPECT_THAT(reports.ExitMessage("job-1", 0), ::testing::HasSubstr("belongs to uid 12345"));
  struct stat st {};
  ASSERT_EQ(stat((root + "/job-1").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 12345u) << "left as it was";
  EXPECT_EQ(reports.ExitCode("job-2", 0), 0) << reports.ExitMessage("job-2", 0);
}

// What a user's ranks left in shared memory (a /dev/shm file, a SysV segment no process holds)
// goes once none of that user's processes is left on the host: memory no cgroup holds any more,
// which filled the host's /dev/shm (NCCL's segments of killed jobs). Another account's stays.
// (As "games": an account no other test runs ranks as, whose processes would keep it.)
TEST(SharedMemoryScrubTest, AUsersLeftoversGoOnceNoneOfTheirRanksRuns) {
  if (geteuid() != 0) GTEST_SKIP() << "switching ranks to another account needs root";
  if (getpwnam("games") == nullptr) GTEST_SKIP() << "no account 'games' here";
  TempDir dir;
  ASSERT_EQ(chmod(dir.path().c_str(), 0755), 0);
  std::ofstream(dir.path() + "/user-map") << "alice games\n";
  auto run_as = RunAs::Create(dir.path() + "/user-map", /*as_root=*/true);
  ASSERT_TRUE(run_as.ok()) << run_as.status();
  const std::string others = absl::StrCat("/dev/shm/trainyard-test-other-", getpid());
  std::ofstream(others) << "not alice's";
  ASSERT_EQ(chown(others.c_str(), 12345, 12345), 0);
  absl::Cleanup remove_others = [&] { unlink(others.c_str()); };
  Reports reports;
  SupervisorOptions options;
  options.trainer_path = testing::TestBinPath("test_rank");
  options.work_dir = dir.path() + "/work";
  options.shepherd_path = testing::BinPath("trainyard-worker");
  options.run_as = std::make_shared<const RunAs>(*std::move(run_as));
  RankSupervisor supervisor(options, [&](v1::NodeMessage m) { reports.Add(m); });
  supervisor.Launch(AssignmentOf("job-1", 1, "leave-user-shm"));
  ASSERT_TRUE(reports.AwaitExit("job-1", 0));
  ASSERT_EQ(reports.ExitCode("job-1", 0), 0) << reports.ExitMessage("job-1", 0);
  std::string left;
  int segment = -1;
  for (const std::string& line : reports.Lines()) {
    std::vector<std::string> words = absl::StrSplit(line, ' ');
    if (words.size() == 5 && words[0] == "left" && words[2] == "1") {
      left = words[1];
      ASSERT_TRUE(absl::SimpleAtoi(words[4], &segment)) << line;
    }
  }
  ASSERT_FALSE(left.empty()) << "the rank made no file in /dev/shm";
  ASSERT_GE(segment, 0) << "the rank made no SysV segment";
  absl::Cleanup remove_left = [&] {
    unlink(left.c_str());
    shmctl(segment, IPC_RMID, nullptr);
  };
  struct shmid_ds ds {};
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       std::filesystem::exists(left) || shmctl(segment, IPC_STAT, &ds) == 0;) {
    ASSERT_LT(absl::Now(), deadline) << "what the rank left in shared memory stays";
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(std::filesystem::exists(others)) << "another account's file went too";
}

// What a rank printed holds at most about --rank-log-keep of the worker's disk once sent on: the
// log's older blocks are freed (its size and offsets unchanged), its last lines stay readable, and
// every line reached the coordinator. (Without it a rank printing at GB/s filled the disk.)
TEST(RankLogKeepTest, ASentLogKeepsItsLastBytesOnDiskOnly) {
  TempDir dir;
  {  // (A file system that cannot punch holes keeps the whole log, and says so in it.)
    const std::string probe = dir.path() + "/probe";
    const int fd = open(probe.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    const std::string block(1 << 16, 'p');
    ASSERT_EQ(write(fd, block.data(), block.size()), static_cast<ssize_t>(block.size()));
    const int punched = fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                                  static_cast<off_t>(block.size()));
    const int err = errno;
    close(fd);
    if (punched != 0) GTEST_SKIP() << "this file system cannot punch holes: " << strerror(err);
  }
  Reports reports;
  SupervisorOptions options;
  options.trainer_path = testing::TestBinPath("test_rank");
  options.work_dir = dir.path() + "/work";
  options.shepherd_path = testing::BinPath("trainyard-worker");
  options.log_keep_bytes = int64_t{2} << 20;
  {
    RankSupervisor supervisor(options, [&](v1::NodeMessage m) { reports.Add(m); });
    supervisor.Launch(AssignmentOf("job-1", 1, "print-24-mib"));
    ASSERT_TRUE(reports.AwaitExit("job-1", 0));
    EXPECT_EQ(reports.ExitCode("job-1", 0), 0);
  }  // (its end waits for the shepherd, which frees the log before it ends)
  const std::vector<std::string> lines = reports.Lines();  // test_rank's hello, then 24 Mi
  ASSERT_EQ(lines.size(), 24u * 1024 + 1);
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    ASSERT_TRUE(absl::StartsWith(lines[i + 1], absl::StrCat(i, " ")) && lines[i + 1].size() == 1023)
        << "line " << i << ": " << lines[i + 1].substr(0, 20);
  }
  const std::string log = dir.path() + "/work/job-1/attempt-1/rank-0.log";
  struct stat st {};
  ASSERT_EQ(stat(log.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, (24 << 20) + lines[0].size() + 1);
  EXPECT_LE(int64_t{st.st_blocks} * 512, (int64_t{2} << 20) + (256 << 10)) << "on disk";
  std::ifstream in(log);
  in.seekg(-1024, std::ios::end);
  std::string last;
  std::getline(in, last);
  EXPECT_TRUE(absl::StartsWith(last, absl::StrCat(24 * 1024 - 1, " "))) << last.substr(0, 20);
}

// A job's spec.pb, written again at each of its ranks' starts, may be its owner's file: a read
// lease on it (the owner's, here this test's) stalled the truncating open of the next rank's start
// for the kernel's lease-break time (45 s), holding the worker's one launch thread. A new file
// renamed over it breaks no lease.
TEST_F(RankSupervisorTest, ALeaseOnTheSpecDoesNotStallTheNextRanksStart) {
  v1::Assignment first = AssignmentOf("job-1", 2);
  first.clear_device_indices();
  first.add_device_indices(0);
  supervisor_->Launch(first);
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  const std::string spec = dir_.path() + "/work/job-1/attempt-1/spec.pb";
  signal(SIGIO, SIG_IGN);  // the lease's break notice
  const int fd = open(spec.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << strerror(errno);
  absl::Cleanup closed = [fd] { close(fd); };
  ASSERT_EQ(fcntl(fd, F_SETLEASE, F_RDLCK), 0) << strerror(errno);
  v1::Assignment second = AssignmentOf("job-1", 2);
  second.set_first_rank(1);
  second.clear_device_indices();
  second.add_device_indices(1);
  const absl::Time start = absl::Now();
  supervisor_->Launch(second);
  ASSERT_TRUE(reports_.AwaitExit("job-1", 1));
  EXPECT_EQ(reports_.ExitCode("job-1", 1), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

}  // namespace
}  // namespace trainyard::worker
