#include "worker/daemon/shepherd.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/signal_names.h"
#include "common/units.h"
#include "worker/daemon/cgroups.h"
#include "worker/daemon/private_tmp.h"

namespace trainyard::worker {
namespace {

constexpr int kListenFd = 3;  // the socket RankSupervisor hands over
// Where a bare command[0] is looked for when the rank's environment has no PATH.
constexpr char kDefaultPath[] = "/usr/local/bin:/usr/bin:/bin";
// At most this much environment is read (RankSupervisor's is far smaller).
constexpr size_t kMaxEnvBytes = size_t{4} << 20;
constexpr size_t kMaxMessageBytes = 256;

// A new SOCK_SEQPACKET socket and the address of `path` for it, short enough for sun_path at
// any length of `path`: its folder opened (`dir_fd`, to close after bind or connect) and named
// through /proc/self/fd.
struct UnixSocket {
  int fd = -1;
  int dir_fd = -1;
  sockaddr_un addr{};
};
absl::StatusOr<UnixSocket> NewSocket(const std::string& path) {
  const std::filesystem::path p(path);
  UnixSocket s;
  s.dir_fd = open(p.parent_path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (s.dir_fd < 0) {
    return absl::NotFoundError(absl::StrCat(p.parent_path().string(), ": ", strerror(errno)));
  }
  s.addr.sun_family = AF_UNIX;
  const std::string name = absl::StrCat("/proc/self/fd/", s.dir_fd, "/", p.filename().string());
  if (name.size() >= sizeof(s.addr.sun_path)) {
    close(s.dir_fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": the socket's name is too long"));
  }
  memcpy(s.addr.sun_path, name.c_str(), name.size() + 1);
  s.fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s.fd < 0) {
    const int err = errno;
    close(s.dir_fd);
    return absl::InternalError(absl::StrCat("socket: ", strerror(err)));
  }
  return s;
}

// The all-reduce segment a trainer of rank 0 names /dev/shm/trainyard-allreduce-PID-... exists
// only until every rank has mapped it; if that rank died in between, its name would stay.
void RemoveSharedMemoryOf(pid_t pid) {
  const std::string prefix = absl::StrCat("trainyard-allreduce-", pid, "-");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) shm_unlink(("/" + name).c_str());
  }
}

// Sends `sig` to every process of account `uid` but this one (and those `skip` is true for)
// whose environment holds `mark` (a whole entry, as /proc shows it). A process that cleared its
// environment is not found. Only `uid`'s processes are read: reading another's environment can
// block for good (a process whose memory is a FUSE file its owner never answers for), and it
// would have stopped every user's ranks' stops on the node, not only that user's.
void SignalMarked(const std::string& mark, uid_t uid, int sig,
                  const std::function<bool(pid_t)>& skip) {
  if (mark.empty()) return;
  const pid_t self = getpid();
  const std::string nul(1, '\0');
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    pid_t pid = 0;
    if (!absl::SimpleAtoi(name, &pid) || pid <= 1 || pid == self) continue;
    if (!ProcessHasUid(pid, uid)) continue;
    const int fd = open(absl::StrCat("/proc/", name, "/environ").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    std::string text;
    char buf[4096];
    ssize_t n;
    while (text.size() < (1 << 20) && (n = read(fd, buf, sizeof(buf))) > 0) {
      text.append(buf, static_cast<size_t>(n));
    }
    close(fd);
    if ((absl::StartsWith(text, mark + nul) || absl::StrContains(text, nul + mark + nul)) &&
        !skip(pid)) {
      kill(pid, sig);
    }
  }
}

int ExitCodeOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

struct Settings {
  std::string prefix, cwd;
  int device = 0;
  absl::Duration grace = absl::Seconds(10), orphan = absl::Seconds(10);
  bool switch_account = false;
  std::string mark;      // the rank's TRAINYARD_RANK_MARK value
  int env_fd = -1;       // the rank's environment (RankSupervisor's memfd); -1: an empty one
  int64_t log_keep = 0;  // the log's last bytes kept once sent (0: all; RankSupervisor's)
  std::vector<std::string> cgroups;  // the rank's cgroup folders (cgroups.h); none: not confined
  // Its attempt's private /tmp, /dev/shm and IPC namespace (private_tmp.h); "": the host's.
  std::string mnt, ipc;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;
  std::vector<std::string> argv;
};

absl::StatusOr<Settings> ParseSettings(int argc, char** argv) {
  Settings s;
  int i = 0;
  for (; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    const std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2) return absl::InvalidArgumentError(absl::StrCat("bad setting ", argv[i]));
    const std::string& name = kv[0];
    const std::string& value = kv[1];
    int64_t number = 0;
    const bool numeric = absl::SimpleAtoi(value, &number) && number >= 0;
    if (name == "prefix") {
      s.prefix = value;
    } else if (name == "cwd") {
      s.cwd = value;
    } else if (name == "mark") {
      s.mark = value;
    } else if (name == "cgroup" && absl::StartsWith(value, "/")) {
      s.cgroups.push_back(value);
    } else if (name == "mnt" && absl::StartsWith(value, "/")) {
      s.mnt = value;
    } else if (name == "ipc" && absl::StartsWith(value, "/")) {
      s.ipc = value;
    } else if (name == "env_fd" && numeric && number > kListenFd && number < 1024) {
      s.env_fd = static_cast<int>(number);
    } else if (name == "device" && numeric) {
      s.device = static_cast<int>(number);
    } else if (name == "grace_ms" && numeric) {
      s.grace = absl::Milliseconds(number);
    } else if (name == "orphan_ms" && numeric) {
      s.orphan = absl::Milliseconds(number);
    } else if (name == "log_keep" && numeric) {
      s.log_keep = number;
    } else if (name == "uid" && numeric) {
      s.uid = static_cast<uid_t>(number);
      s.switch_account = true;
    } else if (name == "gid" && numeric) {
      s.gid = static_cast<gid_t>(number);
    } else if (name == "groups") {
      for (absl::string_view g : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        uint32_t gid = 0;
        if (!absl::SimpleAtoi(g, &gid)) return absl::InvalidArgumentError("bad groups");
        s.groups.push_back(gid);
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("bad setting ", argv[i]));
    }
  }
  for (++i; i < argc; ++i) s.argv.emplace_back(argv[i]);
  if (s.prefix.empty() || s.cwd.empty() || s.argv.empty()) {
    return absl::InvalidArgumentError("prefix, cwd and a program are required");
  }
  if (s.mnt.empty() != s.ipc.empty()) {
    return absl::InvalidArgumentError("mnt and ipc come together");
  }
  return s;
}

// Writes `text` to standard error, from a forked child (no allocation).
void ChildError(const char* text) { (void)!write(STDERR_FILENO, text, strlen(text)); }

// The rank's environment, NUL-separated NAME=VALUE entries read from `fd` (none for -1). Called
// in the forked child after it switched to the owner's account: no process running as root
// interprets what the job set. The shepherd is single-threaded, so allocating after fork is safe.
std::vector<std::string> ReadRankEnvironment(int fd) {
  std::string text;
  char buf[65536];
  off_t offset = 0;
  ssize_t n;
  while (fd >= 0 && text.size() < kMaxEnvBytes && (n = pread(fd, buf, sizeof(buf), offset)) > 0) {
    text.append(buf, static_cast<size_t>(n));
    offset += n;
  }
  std::vector<std::string> env;
  for (absl::string_view e : absl::StrSplit(text, '\0', absl::SkipEmpty())) env.emplace_back(e);
  return env;
}

// execve of `argv` with `env`; a bare argv[0] is looked for in the environment's PATH (as
// execvpe would, but in the PATH the rank gets, and by the owner's account). Returns only on
// failure, having said why on standard error (the rank's log).
void ExecRank(std::vector<std::string> argv, const std::vector<std::string>& env) {
  std::vector<char*> c_env;
  std::string path = kDefaultPath;
  for (const std::string& e : env) {
    c_env.push_back(const_cast<char*>(e.c_str()));
    if (absl::StartsWith(e, "PATH=")) path = e.substr(5);
  }
  c_env.push_back(nullptr);
  auto exec = [&](const std::string& program) {
    std::vector<char*> c_argv;
    c_argv.push_back(const_cast<char*>(program.c_str()));
    for (size_t i = 1; i < argv.size(); ++i) c_argv.push_back(const_cast<char*>(argv[i].c_str()));
    c_argv.push_back(nullptr);
    execve(program.c_str(), c_argv.data(), c_env.data());
    return errno;
  };
  if (argv[0].find('/') != std::string::npos) {
    const int err = exec(argv[0]);
    ChildError(absl::StrCat("trainyard-worker: cannot execute ", argv[0], ": ", strerror(err), "\n")
                   .c_str());
    return;
  }
  int denied = 0;  // as execvp: a program found but not executable is reported as such
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    const int err = exec(absl::StrCat(dir, "/", argv[0]));
    if (err == EACCES) denied = err;
  }
  ChildError(absl::StrCat("trainyard-worker: command[0]: '", argv[0], "' is not in the PATH (",
                          path, ")", denied != 0 ? " or not executable there" : "", "\n")
                 .c_str());
}

// Forks the rank: its own process group, killed when this shepherd dies, output to `log_fd`, as
// the settings' account, in their folder, with the environment RankSupervisor handed over on
// env_fd (read only after the switch of account). Returns its pid (or -1).
pid_t StartRank(const Settings& s, int log_fd) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) {
    if (pid > 0) setpgid(pid, pid);
    return pid;
  }
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
  // What the shepherd blocked or ignored stays so across exec: back to the defaults.
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  signal(SIGPIPE, SIG_DFL);
  signal(SIGHUP, SIG_DFL);
  dup2(log_fd, STDOUT_FILENO);
  dup2(log_fd, STDERR_FILENO);
  const int devnull = open("/dev/null", O_RDONLY);
  if (devnull >= 0) dup2(devnull, STDIN_FILENO);
  if (s.env_fd >= 0) {
    close_range(3, s.env_fd - 1, 0);
    close_range(s.env_fd + 1, ~0U, 0);
  } else {
    close_range(3, ~0U, 0);
  }
  // The OOM killer's view of the rank is the kernel's default, not the worker's: a daemon's unit
  // often protects it (OOMScoreAdjust=-1000 leaves a process unkillable, and a rank at its memory
  // limit would then hang its cgroup instead of being killed), as slurmstepd resets its tasks'.
  // (Lowering a positive score needs privilege: the worker without it leaves it so.)
  if (const int adj = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC); adj >= 0) {
    (void)!write(adj, "0", 1);
    close(adj);
  }
  // Into the rank's cgroups while still root (the folders are root's); its children follow.
  if (!s.cgroups.empty() && !JoinCgroups(s.cgroups, getpid())) {
    ChildError("cannot join the rank's cgroup\n");
    _exit(126);
  }
  // Its attempt's IPC namespace, private /tmp and /dev/shm, while still root (private_tmp.h).
  if (!s.mnt.empty()) {
    const char* step = "";
    if (const int err = EnterAttemptNamespaces(s.mnt.c_str(), s.ipc.c_str(), &step); err != 0) {
      ChildError("trainyard-worker: cannot give the rank its private /tmp: ");
      ChildError(step);
      ChildError(": ");
      ChildError(strerror(err));
      ChildError("\n");
      _exit(126);
    }
  }
  if (s.switch_account && (setgroups(s.groups.size(), s.groups.data()) != 0 || setgid(s.gid) != 0 ||
                           setuid(s.uid) != 0)) {
    ChildError("cannot switch to the job owner's Unix account\n");
    _exit(126);
  }
  // A change of credentials clears the parent-death signal: set it again.
  if (s.switch_account) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
  }
  if (chdir(s.cwd.c_str()) != 0) {
    ChildError("cannot enter the working directory (workdir)\n");
    _exit(127);
  }
  const std::vector<std::string> env = ReadRankEnvironment(s.env_fd);
  if (s.env_fd >= 0) close(s.env_fd);
  ExecRank(s.argv, env);
  _exit(127);
}

// A line of the shepherd's own in the rank's log (it shows in `yard logs` too).
void Note(int log_fd, const std::string& text) {
  const std::string line = absl::StrCat("trainyard-worker: ", text, "\n");
  (void)!write(log_fd, line.data(), line.size());
}

}  // namespace

absl::StatusOr<int> ListenShepherdSocket(const std::string& path) {
  auto s = NewSocket(path);
  if (!s.ok()) return s.status();
  unlink(path.c_str());
  // Mode 0600 at once (connecting needs write permission); the shepherd also takes connections
  // from its own account only.
  const bool bound =
      bind(s->fd, reinterpret_cast<const sockaddr*>(&s->addr), sizeof(s->addr)) == 0 &&
      chmod(path.c_str(), 0600) == 0 && listen(s->fd, 4) == 0;
  const int err = errno;
  close(s->dir_fd);
  if (!bound) {
    close(s->fd);
    return absl::UnavailableError(absl::StrCat("cannot listen at ", path, ": ", strerror(err)));
  }
  return s->fd;
}

absl::StatusOr<int> ConnectShepherdSocket(const std::string& path) {
  auto s = NewSocket(path);
  if (!s.ok()) return s.status();
  int rc;
  while ((rc = connect(s->fd, reinterpret_cast<const sockaddr*>(&s->addr), sizeof(s->addr))) != 0 &&
         errno == EINTR) {
  }
  const int err = errno;
  close(s->dir_fd);
  if (rc != 0) {
    close(s->fd);
    return absl::NotFoundError(absl::StrCat("no shepherd at ", path, ": ", strerror(err)));
  }
  return s->fd;
}

std::optional<ShepherdHello> ParseShepherdHello(const std::string& message) {
  const std::vector<std::string> words = absl::StrSplit(message, ' ');
  pid_t pid = 0;
  ShepherdHello hello;
  // (Words after the grace, from a newer shepherd, are left for its own worker.)
  if (words.size() < 4 || words[0] != "rank" || !absl::SimpleAtoi(words[1], &pid) ||
      !absl::SimpleAtoi(words[2], &hello.device) || !absl::SimpleAtoi(words[3], &hello.offset) ||
      hello.offset < 0 ||
      (words.size() >= 5 && (!absl::SimpleAtoi(words[4], &hello.grace_ms) || hello.grace_ms < 0))) {
    return std::nullopt;
  }
  return hello;
}

bool SendShepherdMessage(int fd, const std::string& message) {
  return send(fd, message.data(), std::min(message.size(), kMaxMessageBytes), MSG_NOSIGNAL) ==
         static_cast<ssize_t>(std::min(message.size(), kMaxMessageBytes));
}

bool ProcessHasUid(pid_t pid, uid_t uid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "Uid:")) continue;
    for (absl::string_view field :
         absl::StrSplit(rest, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
      uint32_t id = 0;
      if (absl::SimpleAtoi(field, &id) && id == uid) return true;
    }
    return false;
  }
  return false;
}

absl::StatusOr<std::string> ReceiveShepherdMessage(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    pollfd p{fd, POLLIN, 0};
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    const int ready = poll(&p, 1, static_cast<int>(ms));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) return std::string();
    char buf[kMaxMessageBytes];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError("the shepherd is gone");
    return std::string(buf, static_cast<size_t>(n));
  }
}

namespace {

// One started rank's shepherd: the loop over the rank's signals, the worker's connection and the
// timers of an orphaned or stopping rank, until a worker has collected the rank's exit.
class Shepherd {
 public:
  // `mark`: "TRAINYARD_RANK_MARK=..." (empty: none), as in the rank's environment.
  Shepherd(const Settings& s, int log_fd, int signals, pid_t rank, std::string mark)
      : s_(s),
        log_fd_(log_fd),
        signals_(signals),
        rank_(rank),
        mark_(std::move(mark)),
        orphan_at_(absl::Now() + s.orphan) {}  // no worker yet: the one that started us connects

  // Until a worker collects the exit, nobody comes for it, or polling fails.
  void Run() {
    while (!collected_ && Tick()) {
      absl::Time wake = std::min(kill_at_, absl::Now() + absl::Seconds(1));
      if (conn_ < 0) wake = std::min(wake, orphan_at_);
      pollfd fds[3] = {{signals_, POLLIN, 0}, {kListenFd, POLLIN, 0}, {conn_, POLLIN, 0}};
      const int ms = static_cast<int>(
          std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - absl::Now()), 0, 1000));
      if (poll(fds, conn_ >= 0 ? 3 : 2, ms) < 0 && errno != EINTR) return;
      if (fds[0].revents & POLLIN) OnSignal();
      if (fds[1].revents & POLLIN) {
        OnConnection();
        continue;  // fds[2] was the connection before
      }
      if (conn_ >= 0 && (fds[2].revents & (POLLIN | POLLHUP | POLLERR))) OnMessage();
    }
  }

  // The rank goes if it has not (Run left on an error), then whatever is left in its cgroups,
  // then the cgroups.
  void Finish() {
    if (!exit_code_.has_value()) {
      Stop(SIGKILL);
      waitpid(rank_, nullptr, 0);
    }
    KillAndRemoveCgroups(s_.cgroups, absl::Seconds(1));
  }

 private:
  // The timers: an orphan (no worker for s.orphan) is stopped, a stopping rank past its grace is
  // killed. False when nobody came for an exited rank: the loop ends.
  bool Tick() {
    const absl::Time now = absl::Now();
    if (conn_ < 0 && now >= orphan_at_) {
      if (exit_code_.has_value()) return false;
      if (!stopping_) {
        Note(log_fd_, absl::StrCat("no worker has held this rank for ",
                                   absl::FormatDuration(s_.orphan), ": stopping it"));
        BeginStop();
      }
    }
    if (!exit_code_.has_value() && now >= kill_at_) {
      Stop(SIGKILL);
      kill_at_ = absl::InfiniteFuture();
    }
    return true;
  }

  // One signal at a time (poll again for the next): SIGCHLD reaps the rank; SIGTERM and SIGINT
  // stop it gracefully.
  void OnSignal() {
    signalfd_siginfo info;
    if (read(signals_, &info, sizeof(info)) != sizeof(info)) return;
    if (info.ssi_signo != SIGCHLD) {
      if (!stopping_ && !exit_code_.has_value()) BeginStop();
      return;
    }
    int status = 0;
    rusage usage{};
    if (!exit_code_.has_value() && wait4(rank_, &status, WNOHANG, &usage) == rank_) {
      Reaped(status, usage);
    }
  }

  // What the rank used, as sacct's MaxRSS and TotalCPU: its largest process's peak resident set
  // (getrusage of it and the children it waited for), its cgroup's peak memory (page cache
  // included; 0 without cgroups) and CPU time (the cgroup's, else getrusage's).
  void Reaped(int status, const rusage& usage) {
    exit_code_ = ExitCodeOf(status);
    peak_rss_bytes_ = int64_t{usage.ru_maxrss} * 1024;
    const double rusage_cpu = usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
                              (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
    cpu_ms_ = std::llround(ReadCpuSeconds(s_.cgroups).value_or(rusage_cpu) * 1000);
    if (const auto memory = ReadMemory(s_.cgroups); memory.has_value()) {
      cgroup_peak_bytes_ = memory->peak_bytes;
    }
    Stop(SIGKILL);  // what it left behind, in its group or outside
    // Killed at its memory limit: said in its log, where its failure message comes from.
    if (const auto memory = ReadMemory(s_.cgroups); memory.has_value() && memory->oom_kills > 0) {
      Note(log_fd_, absl::StrCat("error: out of memory: the rank reached its memory limit (",
                                 memory->limit_bytes > 0 ? HumanBytes(memory->limit_bytes)
                                                         : std::string("none"),
                                 ", peak ", HumanBytes(memory->peak_bytes),
                                 ") and the kernel killed a process of it"));
    }
    RemoveSharedMemoryOf(rank_);
    SayExit();
  }

  // A worker connects: only the worker's account speaks for the rank; a new worker replaces the
  // one before.
  void OnConnection() {
    int next = accept4(kListenFd, nullptr, nullptr, SOCK_CLOEXEC);
    ucred peer{};
    socklen_t peer_len = sizeof(peer);
    if (next >= 0 && (getsockopt(next, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 ||
                      peer.uid != geteuid())) {
      close(next);
      next = -1;
    }
    if (next < 0) return;
    if (conn_ >= 0) close(conn_);
    conn_ = next;
    orphan_at_ = absl::InfiniteFuture();
    SendShepherdMessage(conn_, absl::StrCat("rank ", rank_, " ", s_.device, " ", sent_offset_, " ",
                                            absl::ToInt64Milliseconds(s_.grace)));
    SayExit();
  }

  // The worker's messages: "sent N" (its log offset), "stop", "done" (it has the exit), "signal
  // N" (a user's signal for the rank).
  void OnMessage() {
    char buf[kMaxMessageBytes + 1];
    const ssize_t n = recv(conn_, buf, kMaxMessageBytes, MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {  // the worker is gone (a restart, a crash): wait for the next one
      close(conn_);
      conn_ = -1;
      orphan_at_ = absl::Now() + s_.orphan;
      return;
    }
    const std::string message(buf, static_cast<size_t>(n));
    int64_t offset = 0;
    if (absl::StartsWith(message, "sent ") && absl::SimpleAtoi(message.substr(5), &offset)) {
      sent_offset_ = offset;
      FreeSentLog();
    } else if (message == "stop" && !stopping_ && !exit_code_.has_value()) {
      BeginStop();
    } else if (message == "done" && exit_code_.has_value()) {
      collected_ = true;
    } else if (int sig = 0; absl::StartsWith(message, "signal ") &&
                            absl::SimpleAtoi(message.substr(7), &sig) && IsUserSignal(sig) &&
                            !exit_code_.has_value()) {
      Stop(sig);  // `yard signal`: to the whole rank, as a stop's signals go
    }
  }

  // SIGTERM now, SIGKILL after the grace.
  void BeginStop() {
    stopping_ = true;
    kill_at_ = absl::Now() + s_.grace;
    Stop(SIGTERM);
  }

  // `sig` to the rank's process group, then to what left the group: those in its cgroups, which
  // no process of the rank can leave, or, unconfined, the rank's account's processes with its
  // mark (not what cleared its environment). Each process gets it once: to many programs a
  // second SIGTERM means "stop now, without saving" (the SDK's, torchrun's).
  void Stop(int sig) {
    kill(-rank_, sig);
    std::set<pid_t> sent;
    const auto skip = [&](pid_t pid) { return getpgid(pid) == rank_ || !sent.insert(pid).second; };
    if (s_.cgroups.empty()) {
      SignalMarked(mark_, s_.switch_account ? s_.uid : geteuid(), sig, skip);
    } else {
      SignalCgroups(s_.cgroups, sig, skip);
    }
  }

  // The log's blocks before both the worker's offset and its last s.log_keep bytes are freed
  // (punched out: the file keeps its size and offsets, reads there give zeros), so that a rank's
  // output holds at most about s.log_keep of the disk. A file system that cannot punch holes
  // keeps everything, said once in the log.
  void FreeSentLog() {
    struct stat st {};
    if (s_.log_keep <= 0 || cannot_free_ || fstat(log_fd_, &st) != 0) return;
    if (st.st_size < freed_) freed_ = 0;  // the rank cut its log (its stdout is its to truncate)
    // An offset past the end is of the log before the rank cut it: nothing is known sent yet.
    if (sent_offset_ > st.st_size) return;
    constexpr int64_t kBlock = 1 << 16;
    const int64_t end = std::min<int64_t>(sent_offset_, st.st_size - s_.log_keep) / kBlock * kBlock;
    if (end <= freed_) return;
    if (fallocate(log_fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, freed_, end - freed_) == 0) {
      freed_ = end;
    } else if (errno == EOPNOTSUPP || errno == ENOSYS) {
      Note(log_fd_,
           absl::StrCat("this file system cannot free the start of a log (", strerror(errno),
                        "): all of this rank's output stays on the worker's disk"));
      cannot_free_ = true;
    }
  }

  void SayExit() {
    if (conn_ >= 0 && exit_code_.has_value()) {
      SendShepherdMessage(conn_, absl::StrCat("exit ", *exit_code_, " ", peak_rss_bytes_, " ",
                                              cpu_ms_, " ", cgroup_peak_bytes_));
    }
  }

  const Settings& s_;
  const int log_fd_, signals_;
  const pid_t rank_;
  const std::string mark_;
  int conn_ = -1;  // the worker's connection
  int64_t sent_offset_ = 0;
  int64_t freed_ = 0;         // the log's bytes before this are punched out (FreeSentLog)
  bool cannot_free_ = false;  // the file system cannot punch holes (said once)
  std::optional<int> exit_code_;
  int64_t peak_rss_bytes_ = 0, cgroup_peak_bytes_ = 0, cpu_ms_ = 0;
  bool stopping_ = false, collected_ = false;
  absl::Time kill_at_ = absl::InfiniteFuture();
  absl::Time orphan_at_;
};

}  // namespace

int RunShepherd(int argc, char** argv) {
  auto settings = ParseSettings(argc, argv);
  if (!settings.ok()) {
    std::fprintf(stderr, "trainyard-worker --shepherd: %s\n",
                 std::string(settings.status().message()).c_str());
    return 2;
  }
  const Settings& s = *settings;
  setsid();  // out of the worker's session: a terminal's signals are not the rank's
  signal(SIGPIPE, SIG_IGN);
  signal(SIGHUP, SIG_IGN);
  sigset_t watched;
  sigemptyset(&watched);
  for (int sig : {SIGCHLD, SIGTERM, SIGINT}) sigaddset(&watched, sig);
  sigprocmask(SIG_BLOCK, &watched, nullptr);
  const int signals = signalfd(-1, &watched, SFD_CLOEXEC);
  fcntl(kListenFd, F_SETFD, FD_CLOEXEC);
  if (s.env_fd >= 0) fcntl(s.env_fd, F_SETFD, FD_CLOEXEC);

  const std::string log_path = s.prefix + ".log", socket_path = s.prefix + ".sock";
  const int log_fd =
      open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (log_fd < 0 || signals < 0) return 3;  // the worker then reports the rank as not started
  // The rank's mark (RankSupervisor puts it in the rank's environment too): its processes that
  // leave the group are found by it.
  const std::string mark = s.mark.empty() ? "" : absl::StrCat("TRAINYARD_RANK_MARK=", s.mark);

  const pid_t rank = StartRank(s, log_fd);
  if (s.env_fd >= 0) close(s.env_fd);  // the rank has it; the shepherd keeps none of it
  if (rank < 0) {
    Note(log_fd, absl::StrCat("fork: ", strerror(errno)));
    return 3;
  }
  Shepherd shepherd(s, log_fd, signals, rank, mark);
  shepherd.Run();
  unlink(socket_path.c_str());
  shepherd.Finish();
  return 0;
}

}  // namespace trainyard::worker
