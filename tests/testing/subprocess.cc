#include "tests/testing/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace trainyard::testing {
namespace {

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

std::vector<std::string> MergedEnv(const std::vector<std::string>& extra_env) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  for (const auto& kv : extra_env) {
    const std::string key = kv.substr(0, kv.find('=') + 1);
    env.erase(std::remove_if(env.begin(), env.end(),
                             [&](const std::string& e) { return e.rfind(key, 0) == 0; }),
              env.end());
    env.push_back(kv);
  }
  return env;
}

// Forks a child in its own process group that dies with its parent; stdout/stderr to the given
// fds (-1: inherit). Returns the pid, or -1.
pid_t Spawn(const std::vector<std::string>& argv_in, const std::vector<std::string>& extra_env,
            int out_fd, int err_fd, int close_fd_a, int close_fd_b) {
  std::vector<std::string> argv = argv_in;
  std::vector<std::string> env = MergedEnv(extra_env);
  std::vector<char*> c_argv = CStrings(argv);
  std::vector<char*> c_env = CStrings(env);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid != 0) return pid;
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
  if (out_fd >= 0) dup2(out_fd, STDOUT_FILENO);
  if (err_fd >= 0) dup2(err_fd, STDERR_FILENO);
  if (close_fd_a >= 0) close(close_fd_a);
  if (close_fd_b >= 0) close(close_fd_b);
  int devnull = open("/dev/null", O_RDONLY);
  if (devnull >= 0) dup2(devnull, STDIN_FILENO);
  execve(c_argv[0], c_argv.data(), c_env.data());
  fprintf(stderr, "execve %s: %s\n", c_argv[0], strerror(errno));
  _exit(127);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(
    const std::vector<std::string>& argv, const std::vector<std::string>& extra_env) {
  if (argv.empty()) return absl::InvalidArgumentError("argv is empty");
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError(strerror(errno));
  pid_t pid = Spawn(argv, extra_env, fds[1], -1, fds[0], -1);
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  }
  setpgid(pid, pid);  // also from the parent, so Signal works before the child runs
  return std::unique_ptr<Subprocess>(new Subprocess(pid, fds[0]));
}

Subprocess::~Subprocess() {
  if (!reaped_) {
    kill(-pid_, SIGKILL);
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  } else {
    kill(-pid_, SIGKILL);  // stragglers left in the group
  }
  close(stdout_fd_);
}

std::optional<std::string> Subprocess::ReadLine(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) return std::nullopt;
    pollfd pfd{stdout_fd_, POLLIN, 0};
    int r = poll(&pfd, 1, static_cast<int>(left_ms));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    char buf[4096];
    ssize_t n = read(stdout_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (buffer_.empty()) return std::nullopt;
      std::string rest;
      rest.swap(buffer_);
      return rest;
    }
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

void Subprocess::Signal(int signal) {
  if (!reaped_) kill(-pid_, signal);
}

std::optional<int> Subprocess::Wait(absl::Duration timeout) {
  if (reaped_) return wait_status_;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      wait_status_ = status;
      return status;
    }
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(5));  // polling a child's exit; no event to wait on
  }
}

CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::vector<std::string>& extra_env, absl::Duration timeout) {
  CommandResult result;
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) return result;
  pid_t pid = Spawn(argv, extra_env, out[1], err[1], out[0], err[0]);
  close(out[1]);
  close(err[1]);
  const absl::Time deadline = absl::Now() + timeout;
  bool out_open = true, err_open = true;
  while (out_open || err_open) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) break;
    pollfd pfds[2] = {{out_open ? out[0] : -1, POLLIN, 0}, {err_open ? err[0] : -1, POLLIN, 0}};
    int r = poll(pfds, 2, static_cast<int>(left_ms));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    char buf[4096];
    for (int i = 0; i < 2; ++i) {
      if (pfds[i].fd < 0 || pfds[i].revents == 0) continue;
      ssize_t n = read(pfds[i].fd, buf, sizeof(buf));
      if (n <= 0) {
        (i == 0 ? out_open : err_open) = false;
      } else {
        (i == 0 ? result.out : result.err).append(buf, static_cast<size_t>(n));
      }
    }
  }
  close(out[0]);
  close(err[0]);
  if (out_open || err_open) kill(-pid, SIGKILL);  // timed out
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && !(out_open || err_open)) result.exit_code = WEXITSTATUS(status);
  return result;
}

TempDir::TempDir() {
  const char* base = getenv("TMPDIR");
  std::string templ = absl::StrCat(base != nullptr ? base : "/tmp", "/trainyard-test-XXXXXX");
  char* made = mkdtemp(templ.data());
  path_ = made != nullptr ? std::string(made) : std::string();
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

namespace {

// The directory of the running test binary (build/tests).
std::string SelfDir() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("build/tests") : self.parent_path().string();
}

}  // namespace

std::string BinPath(const std::string& name) {
  const char* dir = getenv("TRAINYARD_BIN_DIR");
  return absl::StrCat(dir != nullptr ? std::string(dir) : SelfDir() + "/../bin", "/", name);
}

std::string TestBinPath(const std::string& name) {
  const char* dir = getenv("TRAINYARD_TEST_BIN_DIR");
  return absl::StrCat(dir != nullptr ? std::string(dir) : SelfDir(), "/", name);
}

}  // namespace trainyard::testing
