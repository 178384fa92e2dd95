#include "worker/daemon/job_context.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/context_archive.h"

namespace trainyard::worker {
namespace {

namespace fs = std::filesystem;

std::string ReadAllFd(int fd, size_t max) {
  std::string out;
  char buf[65536];
  while (out.size() <= max) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

}  // namespace

bool WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

int RunUnpackContext(int argc, char** argv) {
  std::string dest;
  bool switch_account = false;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;
  bool empty_only = false;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq),
                      value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    unsigned number = 0;
    if (name == "dest") {
      dest = value;
    } else if (name == "empty_only" && value == "1") {
      empty_only = true;
    } else if (name == "uid" && absl::SimpleAtoi(value, &number)) {
      uid = number;
      switch_account = true;
    } else if (name == "gid" && absl::SimpleAtoi(value, &number)) {
      gid = number;
    } else if (name == "groups") {
      for (absl::string_view g : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        if (absl::SimpleAtoi(g, &number)) groups.push_back(number);
      }
    } else {
      std::cerr << "unpack-context: unknown setting " << name << "\n";
      return 2;
    }
  }
  if (dest.empty()) {
    std::cerr << "unpack-context: no dest\n";
    return 2;
  }
  if (switch_account &&
      (setgroups(groups.size(), groups.data()) != 0 || setgid(gid) != 0 || setuid(uid) != 0)) {
    std::cerr << "cannot switch to the job owner's Unix account: " << strerror(errno) << "\n";
    return 1;
  }
  // What an earlier unpack left there (a worker that restarted before the ranks started) goes
  // first, removed with the owner's rights.
  std::error_code ec;
  for (fs::directory_iterator it(dest, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code e;
    fs::remove_all(it->path(), e);
  }
  if (empty_only) {
    if (!fs::is_empty(dest, ec)) {
      std::cerr << "cannot empty " << dest << (ec ? ": " + ec.message() : "") << "\n";
      return 1;
    }
    return 0;
  }
  const std::string archive = ReadAllFd(STDIN_FILENO, static_cast<size_t>(kMaxContextArchiveBytes));
  if (absl::Status s = UnpackContext(archive, dest); !s.ok()) {
    std::cerr << s.message() << "\n";
    return 1;
  }
  return 0;
}

ContextCache::ContextCache(std::string dir, Fetch fetch, absl::Duration keep)
    : dir_(std::move(dir)), fetch_(std::move(fetch)), keep_(keep) {}

absl::StatusOr<std::string> ContextCache::Get(const std::string& job_id,
                                              const std::string& digest) {
  if (!IsContextDigest(digest)) {
    return absl::InvalidArgumentError(absl::StrCat("context: not a digest: ", digest));
  }
  std::error_code ec;
  const std::string path = absl::StrCat(dir_, "/", digest.substr(7), ".tar.gz");
  {
    absl::MutexLock lock(&mu_);
    fs::create_directories(dir_, ec);
    chmod(dir_.c_str(), 0700);  // the worker's: others may not read users' code
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::string cached(std::istreambuf_iterator<char>(in), {});
      if (ContextDigest(cached) == digest) {
        fs::last_write_time(path, fs::file_time_type::clock::now(), ec);  // used now
        return cached;
      }
      fs::remove(path, ec);  // damaged: fetched again
    }
    RemoveUnused();
  }
  // Fetched without the lock: one job's context slow to come (a large one, a slow coordinator)
  // holds up no other job's. (Two attempts of one context at once may both fetch it.)
  absl::StatusOr<std::string> archive = fetch_(job_id);
  if (!archive.ok()) return archive.status();
  if (ContextDigest(*archive) != digest) {
    return absl::FailedPreconditionError(absl::StrCat("the context fetched for ", job_id,
                                                      " is not ", digest, " (",
                                                      ContextDigest(*archive), ")"));
  }
  absl::MutexLock lock(&mu_);
  const std::string temp = absl::StrCat(path, ".part");
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  const bool written = fd >= 0 && WriteAll(fd, *archive) && fsync(fd) == 0;
  if (fd >= 0) close(fd);
  if (!written || rename(temp.c_str(), path.c_str()) != 0) {
    fs::remove(temp, ec);  // not cached: this attempt still has it
  }
  return archive;
}

void ContextCache::RemoveUnused() {
  std::error_code ec;
  const auto cutoff =
      fs::file_time_type::clock::now() -
      std::chrono::duration_cast<fs::file_time_type::duration>(absl::ToChronoSeconds(keep_));
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code e;
    if (it->is_regular_file(e) && it->last_write_time(e) < cutoff) fs::remove(it->path(), e);
  }
}

namespace {

// Runs the unpacker on `dest` as `account` with `archive` on its standard input (nullptr: empty
// the folder only); `what` names the task in errors ("unpack the job's context").
absl::Status RunUnpacker(const std::string& unpacker, const std::vector<std::string>& env,
                         const std::string* archive, const std::string& dest,
                         const UnixAccount* account, absl::Duration timeout,
                         const std::string& what) {
  // The archive reaches the unpacker as a memfd on its standard input: no file of the worker's
  // to open after it dropped the worker's rights, no pipe to stall on.
  const int in = memfd_create("trainyard-context", MFD_CLOEXEC);
  if (in < 0 || (archive != nullptr && !WriteAll(in, *archive)) || lseek(in, 0, SEEK_SET) != 0) {
    const int err = errno;
    if (in >= 0) close(in);
    return absl::InternalError(absl::StrCat("the context's memfd: ", strerror(err)));
  }
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(in);
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  }
  std::vector<std::string> args = {unpacker, kUnpackContextFlag, "dest=" + dest};
  if (archive == nullptr) args.push_back("empty_only=1");
  if (account != nullptr) {
    args.push_back(absl::StrCat("uid=", account->uid));
    args.push_back(absl::StrCat("gid=", account->gid));
    args.push_back(absl::StrCat("groups=", absl::StrJoin(account->groups, ",")));
  }
  std::vector<char*> c_argv, c_env;
  for (auto& a : args) c_argv.push_back(a.data());
  c_argv.push_back(nullptr);
  std::vector<std::string> env_copy = env;
  for (auto& e : env_copy) c_env.push_back(e.data());
  c_env.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in, STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc =
      posix_spawn(&pid, unpacker.c_str(), &actions, nullptr, c_argv.data(), c_env.data());
  posix_spawn_file_actions_destroy(&actions);
  close(in);
  close(err_pipe[1]);
  if (rc != 0) {
    close(err_pipe[0]);
    return absl::InternalError(absl::StrCat("cannot start ", unpacker, ": ", strerror(rc)));
  }
  // Waited for within `timeout`: the unpacker runs as the owner, who may stop it (SIGSTOP), and
  // the worker's one launch thread waits here.
  const absl::Time deadline = absl::Now() + timeout;
  std::string error;
  for (bool open = true; open;) {
    pollfd p = {err_pipe[0], POLLIN, 0};
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) break;
    const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000)));
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) continue;
    char buf[4096];
    const ssize_t n = read(err_pipe[0], buf, sizeof(buf));
    if (n > 0 && error.size() < 4096) error.append(buf, static_cast<size_t>(n));
    open = n > 0 || (n < 0 && errno == EINTR);
  }
  close(err_pipe[0]);
  int status = 0;
  pid_t waited = 0;
  while ((waited = waitpid(pid, &status, WNOHANG)) == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (waited == 0) {
    kill(pid, SIGKILL);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return absl::DeadlineExceededError(
        absl::StrCat("cannot ", what, ": the unpacker did not finish within ",
                     absl::FormatDuration(timeout), " (stopped?), and was killed"));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  while (!error.empty() && error.back() == '\n') error.pop_back();
  return absl::FailedPreconditionError(
      absl::StrCat("cannot ", what, ": ", error.empty() ? "the unpacker failed" : error));
}

}  // namespace

absl::Status UnpackContextAs(const std::string& unpacker, const std::vector<std::string>& env,
                             const std::string& archive, const std::string& dest,
                             const UnixAccount* account, absl::Duration timeout) {
  return RunUnpacker(unpacker, env, &archive, dest, account, timeout, "unpack the job's context");
}

absl::Status EmptyFolderAs(const std::string& unpacker, const std::vector<std::string>& env,
                           const std::string& dest, const UnixAccount* account,
                           absl::Duration timeout) {
  return RunUnpacker(unpacker, env, nullptr, dest, account, timeout, "empty " + dest);
}

}  // namespace trainyard::worker
