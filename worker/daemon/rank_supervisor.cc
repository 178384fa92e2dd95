#include "worker/daemon/rank_supervisor.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/host_port.h"
#include "common/log_text.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "worker/daemon/private_tmp.h"
#include "worker/daemon/shepherd.h"

extern char** environ;

namespace trainyard::worker {
namespace {

// Writes `content` to `path` (a file of the worker's folder) with mode 0600 and gives it to
// `owner` (null: keeps it): a new file renamed over `path`. The file there may be the owner's
// (an earlier rank's spec.pb), who could hold a lease on it that stalls an open for truncation
// (the kernel's lease-break time, 45 s) while the worker's one launch thread waits.
absl::Status WriteOwnedFile(const std::string& path, const std::string& content,
                            const UnixAccount* owner) {
  static std::atomic<uint64_t> written{0};
  const std::string fresh = absl::StrCat(path, ".new-", getpid(), "-", written++);
  const int fd = open(fresh.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", strerror(errno)));
  bool ok = write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size());
  if (ok && owner != nullptr) ok = fchown(fd, owner->uid, owner->gid) == 0;
  int err = errno;
  close(fd);
  if (ok) {
    ok = rename(fresh.c_str(), path.c_str()) == 0;
    err = errno;
  }
  if (!ok) {
    unlink(fresh.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", strerror(err)));
  }
  return absl::OkStatus();
}

// Gives the folder `path` to `owner` with mode 0700 (null: leaves it), refusing a symbolic link
// in its place and a folder of a third account's (a job's checkpoint folder may sit where users
// can write: another user could have made it first, with a checkpoint of theirs in it).
absl::Status GiveFolder(const std::string& path, const UnixAccount* owner) {
  if (owner == nullptr) return absl::OkStatus();
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot give ", path, " to ", owner->name, ": ", strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) == 0 && st.st_uid != geteuid() && st.st_uid != owner->uid) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot give ", path, " to ", owner->name, ": it belongs to uid ", st.st_uid,
                     ", made by another account before this job's ranks; remove it"));
  }
  const bool ok = fchown(fd, owner->uid, owner->gid) == 0 && fchmod(fd, 0700) == 0;
  const int err = errno;
  close(fd);
  if (!ok) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot give ", path, " to ", owner->name, ": ", strerror(err)));
  }
  return absl::OkStatus();
}

bool SaysFailure(const std::string& line) {
  const std::string lower = absl::AsciiStrToLower(line);
  for (const char* word : {"error", "exception", "fatal", "failed", "abort", "killed"}) {
    if (absl::StrContains(lower, word)) return true;
  }
  return false;
}

// A TCP port free on this host now (the kernel's pick), for a command job's MASTER_PORT when the
// coordinator reserved none; 29500 (torchrun's default) if none can be had.
int FreeLocalPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 29500;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 29500;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// This process's own account, for the ranks of a worker that does not switch accounts.
UnixAccount OwnAccount() {
  const passwd* pw = getpwuid(geteuid());
  if (pw != nullptr) {
    auto found = LookUpAccount(pw->pw_name);
    if (found.ok()) return *found;
  }
  UnixAccount a;
  a.uid = geteuid();
  a.gid = getegid();
  a.name = absl::StrCat(a.uid);
  a.home = "/";
  a.shell = "/bin/sh";
  return a;
}

// NAME of a NAME=VALUE entry.
absl::string_view NameOf(absl::string_view entry) { return entry.substr(0, entry.find('=')); }

// A rank's log as the worker follows it: the bytes after `offset` as whole lines, each with its
// seq (LogLines.seqs): where it starts in the log, plus one, plus the bytes of the log before
// each time the rank cut it (so that seqs keep growing). Stable across a restart of this worker,
// which adopts the rank at its offset (but forgets the cuts before it). Keeps the last `keep`
// lines for a failure message.
class RankLogFollower {
 public:
  using Batch = std::vector<std::pair<int64_t, std::string>>;  // (seq, line)

  // `emit` takes each batch of lines (at most 512, about 1 MiB at most) as they are read.
  RankLogFollower(const std::string& path, int64_t offset, int keep,
                  std::function<void(Batch&)> emit)
      : fd_(open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC)),
        offset_(offset),
        partial_start_(offset),
        keep_(keep),
        emit_(std::move(emit)) {}
  ~RankLogFollower() {
    if (fd_ >= 0) close(fd_);
  }
  RankLogFollower(const RankLogFollower&) = delete;
  RankLogFollower& operator=(const RankLogFollower&) = delete;

  static constexpr int64_t kReadBytes = 8 << 20;  // a ReadNew's share

  // The log's new bytes since the last read, as lines (a rank that cut its own log starts over);
  // returns how many were read. At most kReadBytes a call: a rank printing fast is read a share
  // at a time (and again at once), and its thread hears a stop or a detach between. A hole (a rank
  // that extended its log, or wrote past its end: bytes it never wrote) is skipped, not read: a
  // rank that made its log 16 TiB long kept the worker reading zeros for hours. The NULs on either
  // side of a hole, in the blocks it ends and starts in, are taken as the hole's.
  int64_t ReadNew() {
    if (fd_ < 0) return 0;
    struct stat st {};
    if (fstat(fd_, &st) == 0 && st.st_size < offset_) {
      cut_bytes_ += offset_;
      offset_ = st.st_size;
      partial_.clear();
      partial_start_ = offset_;
    }
    char buf[65536];
    Batch batch;
    ssize_t n = 0;
    int64_t read = 0;
    while (read < kReadBytes) {
      // (The size first: no data from offset_ to the end then means none before that size.)
      if (fstat(fd_, &st) != 0 || st.st_size <= offset_) break;
      const off_t data = lseek(fd_, offset_, SEEK_DATA);
      if (data < 0 && errno == ENXIO) {
        SkipTo(st.st_size, batch);
        break;
      }
      if (data > offset_) SkipTo(data, batch);
      if ((n = pread(fd_, buf, sizeof(buf), offset_)) <= 0) break;
      read += n;
      offset_ += n;
      size_t skip = 0;
      if (after_hole_) {
        // The NULs that begin the first block past a hole: bytes never written, as the hole's
        // (SEEK_DATA finds a block's start; the hole may end anywhere in it).
        while (skip < static_cast<size_t>(n) && buf[skip] == '\0') ++skip;
        after_hole_ = skip == static_cast<size_t>(n);
        partial_start_ += static_cast<int64_t>(skip);  // (partial_ is empty past a hole)
      }
      partial_.append(buf + skip, static_cast<size_t>(n) - skip);
      size_t start = 0, nl;
      while ((nl = partial_.find('\n', start)) != std::string::npos) {
        Take(partial_.substr(start, nl - start), partial_start_ + static_cast<int64_t>(start),
             batch);
        start = nl + 1;
      }
      partial_.erase(0, start);
      partial_start_ += static_cast<int64_t>(start);
      // A line longer than the coordinator keeps is sent in pieces rather than held forever,
      // cut between characters (a character cut in two would reach its owner as two U+FFFD).
      while (partial_.size() > kPieceBytes) {
        size_t cut = Utf8Prefix(partial_, kPieceBytes).size();
        if (cut + 4 <= kPieceBytes) cut = kPieceBytes;  // not UTF-8 there: any cut will do
        Take(partial_.substr(0, cut), partial_start_, batch);
        partial_.erase(0, cut);
        partial_start_ += static_cast<int64_t>(cut);
      }
      // A message the coordinator takes (at most 4 MiB): at most 512 lines, 1 MiB (Take).
      if (batch.size() >= 512) Emit(batch);
    }
    Emit(batch);
    return read;
  }

  // The rank has ended: what is new, and a last line without its newline.
  void ReadToEnd() {
    // Up to the log's size now: a leftover process still writing to it (an unconfined rank's
    // child) would keep this reading, and the rank's exit unreported, for good.
    struct stat st {};
    const int64_t end = fd_ >= 0 && fstat(fd_, &st) == 0 ? st.st_size : 0;
    while (offset_ < end && ReadNew() > 0) {
    }
    Batch batch;
    TrimNuls();  // (a log extended past its last line, and not written after)
    if (!partial_.empty()) Take(std::exchange(partial_, ""), partial_start_, batch);
    Emit(batch);
  }

  // Bytes of the log in whole lines read: what the shepherd is told the worker has sent.
  int64_t complete_bytes() const { return offset_ - static_cast<int64_t>(partial_.size()); }
  const std::deque<std::string>& last_lines() const { return last_; }

 private:
  void Take(std::string line, int64_t start, Batch& batch) {
    // The coordinator's messages carry text: a rank may print any bytes (a byte-level model's
    // sample), and one invalid UTF-8 line would fail the whole session's stream.
    line = ValidUtf8(std::move(line));  // (up to 3 times as long: each bad byte is U+FFFD)
    last_.push_back(line);
    if (static_cast<int>(last_.size()) > keep_) last_.pop_front();
    // A message holds at most kBatchBytes, or one line alone (a piece of at most 3 MiB).
    if (!batch.empty() && batch_bytes_ + line.size() > kBatchBytes) Emit(batch);
    batch_bytes_ += line.size();
    batch.emplace_back(cut_bytes_ + start + 1, std::move(line));
  }

  // Past a hole, from `to`: the line it cut goes as it is (lines keep their offsets as seqs), less
  // the NULs before the hole (the rest of the last block before it: bytes never written, as the
  // hole's; they went on as a line of up to a block of NULs).
  void SkipTo(int64_t to, Batch& batch) {
    TrimNuls();
    if (!partial_.empty()) Take(std::exchange(partial_, ""), partial_start_, batch);
    offset_ = partial_start_ = to;
    after_hole_ = true;
  }

  void TrimNuls() {
    const size_t last = partial_.find_last_not_of('\0');
    partial_.resize(last == std::string::npos ? 0 : last + 1);
  }

  void Emit(Batch& batch) {
    if (!batch.empty()) emit_(batch);
    batch.clear();
    batch_bytes_ = 0;
  }

  static constexpr size_t kPieceBytes = 1 << 20;
  static constexpr size_t kBatchBytes = 1 << 20;

  const int fd_;
  size_t batch_bytes_ = 0;  // of the batch being filled
  int64_t offset_;
  int64_t partial_start_;  // where partial_ begins in the log
  int64_t cut_bytes_ = 0;
  std::string partial_;      // the last line, until its newline comes
  bool after_hole_ = false;  // nothing but NULs read since the last hole
  std::deque<std::string> last_;
  const int keep_;
  const std::function<void(Batch&)> emit_;
};

// The shepherd's "exit CODE PEAK_RSS CPU_MS CGROUP_PEAK" (a shepherd of an older worker: "exit
// CODE"), after "exit ": the code (-1 when unreadable); `usage` filled when given.
int ParseShepherdExit(const std::string& fields, v1::RankUsage* usage) {
  const std::vector<std::string> f = absl::StrSplit(fields, ' ');
  int code = 0;
  if (!absl::SimpleAtoi(f[0], &code)) code = -1;
  int64_t rss = 0, cpu_ms = 0, cgroup_peak = 0;
  if (f.size() >= 4 && absl::SimpleAtoi(f[1], &rss) && absl::SimpleAtoi(f[2], &cpu_ms) &&
      absl::SimpleAtoi(f[3], &cgroup_peak)) {
    usage->set_peak_rss_bytes(rss);
    usage->set_cpu_seconds(cpu_ms / 1000.0);
    usage->set_memory_peak_bytes(cgroup_peak);
  }
  return code;
}

// Whether a process of account `uid` runs on the host (another worker's rank, a login), by any
// of its uids (ProcessHasUid).
bool AccountHasProcesses(uid_t uid) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    pid_t pid = 0;
    if (absl::SimpleAtoi(entry.path().filename().string(), &pid) && pid > 0 &&
        ProcessHasUid(pid, uid)) {
      return true;
    }
  }
  return false;
}

// What account `uid`'s ranks left in shared memory once no process of theirs is left on the
// host: its entries in /dev/shm (named shared memory: NCCL's segments of a killed job, a
// program's own; memory no live cgroup holds, and the host's /dev/shm fills) and its SysV
// segments that no process has attached. Only what `uid` owns; a link is removed, never
// followed; folders stay; at most kScrubEntries entries are looked at. False, with nothing done,
// while a process of `uid` is left (one just killed may take seconds to go).
bool ScrubSharedMemory(uid_t uid) {
  constexpr int kScrubEntries = 100000;
  if (AccountHasProcesses(uid)) return false;
  int removed = 0, looked = 0;
  if (DIR* dir = opendir("/dev/shm"); dir != nullptr) {
    const int fd = dirfd(dir);
    while (const dirent* entry = readdir(dir)) {
      if (++looked > kScrubEntries) break;
      struct stat st {};
      if (fstatat(fd, entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != uid ||
          S_ISDIR(st.st_mode)) {
        continue;
      }
      if (unlinkat(fd, entry->d_name, 0) == 0) ++removed;
    }
    closedir(dir);
  }
  // key shmid perms size cpid lpid nattch uid ... (/proc/sysvipc/shm, after its header)
  std::ifstream segments("/proc/sysvipc/shm");
  std::string line;
  std::getline(segments, line);
  while (std::getline(segments, line)) {
    const std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int shmid = 0;
    int64_t attached = 0, owner = 0;
    if (fields.size() > 7 && absl::SimpleAtoi(fields[1], &shmid) &&
        absl::SimpleAtoi(fields[6], &attached) && absl::SimpleAtoi(fields[7], &owner) &&
        attached == 0 && owner == static_cast<int64_t>(uid) &&
        shmctl(shmid, IPC_RMID, nullptr) == 0) {
      ++removed;
    }
  }
  if (removed > 0) {
    spdlog::info("removed {} shared memory object(s) of uid {}, none of whose ranks runs here",
                 removed, uid);
  }
  return true;
}

}  // namespace

std::vector<std::string> ShepherdEnvironment(const std::vector<std::string>& worker_env) {
  std::vector<std::string> out = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin"};
  for (const std::string& e : worker_env) {
    if (absl::StartsWith(e, "LD_LIBRARY_PATH=")) out.push_back(e);
  }
  return out;
}

std::vector<std::string> WorkerEnvironment() {
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) out.emplace_back(*e);
  return out;
}

std::vector<std::string> DefaultRankEnv() {
  return {"LD_LIBRARY_PATH", "NCCL_*",   "GLOO_*", "OMP_*",      "OPENBLAS_*",
          "MKL_*",           "ONEDNN_*", "DNNL_*", "TRAINYARD_*"};
}

std::vector<std::string> RankEnvironment(const UnixAccount& account,
                                         const std::vector<std::string>& worker_env,
                                         const std::vector<std::string>& rank_env,
                                         const std::vector<std::string>& own) {
  std::vector<std::string> out;
  std::map<std::string, size_t, std::less<>> at;  // name -> index in out
  auto set = [&](const std::string& entry) {
    const std::string name(NameOf(entry));
    auto it = at.find(name);
    if (it != at.end()) {
      out[it->second] = entry;
    } else {
      at[name] = out.size();
      out.push_back(entry);
    }
  };
  auto worker_value = [&](absl::string_view name) -> const std::string* {
    for (const std::string& e : worker_env) {
      if (NameOf(e) == name && e.size() > name.size()) return &e;
    }
    return nullptr;
  };
  // The operator's PATH (where they put the programs and interpreters jobs use), else a plain
  // one; a job's env may set its own.
  const std::string* path = worker_value("PATH");
  set(path != nullptr ? *path : "PATH=/usr/local/bin:/usr/bin:/bin");
  const std::string* lang = worker_value("LANG");
  set(lang != nullptr ? *lang : "LANG=C.UTF-8");
  if (const std::string* tz = worker_value("TZ"); tz != nullptr) set(*tz);
  set("HOME=" + account.home);
  set("USER=" + account.name);
  set("LOGNAME=" + account.name);
  set("SHELL=" + (account.shell.empty() ? std::string("/bin/sh") : account.shell));
  for (const std::string& e : worker_env) {
    const absl::string_view name = NameOf(e);
    if (name.size() == e.size() || name == kTokenEnv || name == "TRAINYARD_TOKEN_FILE") continue;
    const bool passed = std::any_of(rank_env.begin(), rank_env.end(), [&](const std::string& p) {
      return absl::EndsWith(p, "*") ? absl::StartsWith(name, p.substr(0, p.size() - 1)) : name == p;
    });
    if (passed) set(e);
  }
  for (const std::string& e : own) set(e);
  return out;
}

std::vector<std::string> DeniedDevices(const std::vector<std::string>& rules, int device) {
  std::vector<std::string> denied;
  for (size_t i = 0; i < rules.size(); ++i) {
    if (static_cast<int>(i) != device && !rules[i].empty()) denied.push_back(rules[i]);
  }
  return denied;
}

CgroupLimits RankLimits(const CgroupLimits& node, const v1::Resources& resources) {
  CgroupLimits limits = node;
  // Ranks sharing each device (RanksPerDevice's rule, from the resources alone).
  int share = 1;
  if (resources.nodes() > 0 && resources.ranks_per_node() > 0 &&
      resources.slots() >= resources.nodes()) {
    share = std::max(1, resources.ranks_per_node() / (resources.slots() / resources.nodes()));
  }
  limits.memory_bytes /= share;
  limits.cpus /= share;
  limits.pids = limits.pids > 0 ? std::max<int64_t>(1, limits.pids / share) : 0;
  if (resources.memory_bytes() > 0) limits.memory_bytes = resources.memory_bytes();
  if (resources.cpus() > 0) limits.cpus = resources.cpus();
  return limits;
}

std::string FailureMessage(const std::vector<std::string>& last_lines) {
  int cause = -1;
  for (int i = static_cast<int>(last_lines.size()) - 1; i >= 0; --i) {
    if (cause < 0 && !absl::StripAsciiWhitespace(last_lines[i]).empty()) cause = i;
    if (SaysFailure(last_lines[i])) {
      cause = i;
      break;
    }
  }
  if (cause < 0) return "";
  std::string out(absl::StripAsciiWhitespace(last_lines[cause]));
  // Then the lines for context, unless the cause is the only one.
  if (last_lines.size() > 1) {
    absl::StrAppend(&out, "\n", absl::StrJoin(last_lines.begin(), last_lines.end(), "\n"));
  }
  return out;
}

std::string ErrorFileMessage(const std::string& path, size_t max_bytes) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  struct stat st {};
  std::string text;
  // A regular file with one name: not a hard link to a file the owner could not read.
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1) {
    text.resize(64 * 1024);
    const ssize_t n = pread(fd, text.data(), text.size(), 0);
    text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  }
  close(fd);
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("message")) return "";
  std::string message, callstack;
  const nlohmann::json& m = j["message"];
  if (m.is_string()) {
    message = m.get<std::string>();
  } else if (m.is_object() && m.contains("message") && m["message"].is_string()) {
    message = m["message"].get<std::string>();
    const nlohmann::json& extra = m.value("extraInfo", nlohmann::json::object());
    if (extra.is_object() && extra.contains("py_callstack") && extra["py_callstack"].is_string()) {
      callstack = extra["py_callstack"].get<std::string>();
    }
  }
  message = ValidUtf8(std::string(absl::StripAsciiWhitespace(message)));
  if (message.empty()) return "";
  if (message.size() > max_bytes / 2) message = ValidUtf8(message.substr(0, max_bytes / 2));
  // The callstack's last lines (where it failed) that fit in what is left.
  const std::vector<std::string> lines =
      absl::StrSplit(ValidUtf8(std::string(absl::StripAsciiWhitespace(callstack))), '\n');
  size_t room = max_bytes - message.size();
  int first = static_cast<int>(lines.size());
  while (first > 0 && !callstack.empty() && lines[first - 1].size() + 1 <= room) {
    room -= lines[--first].size() + 1;
  }
  std::string out = message;
  for (size_t i = first; i < lines.size(); ++i) absl::StrAppend(&out, "\n", lines[i]);
  return out;
}

absl::Duration StopGrace(const v1::JobSpec& spec, const SupervisorOptions& options) {
  if (spec.stop_grace_seconds() <= 0) return options.stop_grace;
  return std::min(absl::Seconds(spec.stop_grace_seconds()), options.max_stop_grace);
}

std::string NodeHost(const std::string& address, const std::string& host_name) {
  const std::string host = HostOfAddress(address);
  return host.empty() ? host_name : host;
}

absl::StatusOr<std::string> LocalAddressToward(const std::string& host_port) {
  const std::string first(
      absl::StripAsciiWhitespace(absl::string_view(host_port).substr(0, host_port.find(','))));
  std::string host, port;
  if (!first.empty() && first.front() == '[') {
    const size_t close = first.find("]:");
    if (close != std::string::npos) {
      host = first.substr(1, close - 1);
      port = first.substr(close + 2);
    }
  } else if (const size_t colon = first.rfind(':');
             colon != std::string::npos && first.find(':') == colon) {
    host = first.substr(0, colon);
    port = first.substr(colon + 1);
  }
  if (host.empty() || port.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", first, "' is not HOST:PORT"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (const int r = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); r != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", gai_strerror(r)));
  }
  std::string local;
  for (const addrinfo* a = found; a != nullptr && local.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage self{};
    socklen_t len = sizeof(self);
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) == 0) {
      char text[INET6_ADDRSTRLEN] = {0};
      const void* in =
          self.ss_family == AF_INET6
              ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&self)->sin6_addr)
              : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&self)->sin_addr);
      if (inet_ntop(self.ss_family, in, text, sizeof(text)) != nullptr) local = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (local.empty()) return absl::UnavailableError(absl::StrCat("no route to ", first));
  return local;
}

std::string InterfaceWith(const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (address.empty() || getaddrinfo(address.c_str(), nullptr, &hints, &found) != 0) return "";
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) {
    freeaddrinfo(found);
    return "";
  }
  // The same address: its family's bytes (IPv4's 4, IPv6's 16).
  auto same = [](const sockaddr* a, const sockaddr* b) {
    if (a == nullptr || b == nullptr || a->sa_family != b->sa_family) return false;
    if (a->sa_family == AF_INET) {
      return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
             reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
    }
    if (a->sa_family == AF_INET6) {
      return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                         &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr,
                         sizeof(in6_addr)) == 0;
    }
    return false;
  };
  std::string name;
  for (const addrinfo* a = found; a != nullptr && name.empty(); a = a->ai_next) {
    for (const ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
      if (same(i->ifa_addr, a->ai_addr)) {
        name = i->ifa_name;
        break;
      }
    }
  }
  freeifaddrs(interfaces);
  freeaddrinfo(found);
  return name;
}

std::string RankCoordinatorList(const std::string& leader_list, const std::string& worker_list) {
  std::vector<std::string> out;
  for (const std::string& list : {leader_list, worker_list}) {
    for (absl::string_view part : absl::StrSplit(list, ',')) {
      std::string address(absl::StripAsciiWhitespace(part));
      if (!address.empty() && std::find(out.begin(), out.end(), address) == out.end()) {
        out.push_back(std::move(address));
      }
    }
  }
  return absl::StrJoin(out, ",");
}

RankSupervisor::RankSupervisor(SupervisorOptions options, std::function<void(v1::NodeMessage)> send)
    : options_(std::move(options)),
      send_(std::move(send)),
      folders_(std::make_unique<AttemptFolders>(
          AttemptFolderOptions{.work_dir = options_.work_dir,
                               .unpacker = options_.shepherd_path,
                               .unpacker_env = ShepherdEnvironment(WorkerEnvironment()),
                               .keep = options_.keep_work_folders,
                               .namespaces = options_.private_tmp
                                                 ? NamespaceFolder(options_.work_dir)
                                                 : std::string(),
                               .keep_ended_for = options_.keep_ended_attempts},
          [this](const std::string& job_id, int attempt, const std::function<void()>& then) {
            absl::MutexLock lock(&mu_);
            if (Live(job_id, attempt)) return false;
            if (then) then();
            return true;
          })),
      supervisor_([this] { SupervisorLoop(); }) {}

RankSupervisor::~RankSupervisor() {
  StopAll();
  supervisor_.join();
  {
    absl::MutexLock lock(&mu_);
    for (auto& t : finished_readers_) t.join();
  }
  // The last attempts' folders are emptied before the worker goes; a detached one leaves them.
  folders_->Drain();
  folders_->Stop();
}

void RankSupervisor::Launch(const v1::Assignment& assignment) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  launches_.push_back(assignment);
  ++launch_events_;
}

void RankSupervisor::Stop(const std::string& job_id, int attempt) {
  std::vector<RankKey> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, rank] : ranks_) {
      if (std::get<0>(key) != job_id || (attempt != 0 && std::get<1>(key) != attempt)) continue;
      AskToStop(rank);
    }
    // A launch still queued for that attempt is dropped.
    for (auto it = launches_.begin(); it != launches_.end();) {
      const v1::Assignment& a = *it;
      if (a.job_id() == job_id && (attempt == 0 || a.attempt() == attempt)) {
        for (int i = 0; i < RanksOf(a); ++i) {
          // Reported as ended, so a resend does not start it; a copy of an assignment whose
          // ranks already run is not reported (they report their own exit).
          const RankKey key{a.job_id(), a.attempt(), a.first_rank() + i};
          if (started_.insert(key).second) dropped.push_back(key);
        }
        // Its context may have been unpacked already: that copy goes like an ended attempt's.
        ended_attempts_.emplace(a.job_id(), a.attempt());
        it = launches_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Reported like any rank's end: the coordinator holds their devices until it hears of it.
  for (const RankKey& key : dropped) ReportExit(key, 128 + SIGTERM, "stopped before it started");
}

void RankSupervisor::AskToStop(Rank& rank) {
  if (rank.stop_sent) return;
  rank.stop_sent = true;
  // The shepherd sends SIGTERM to the rank's processes and SIGKILL after the grace. One it
  // cannot hear has ended, and its rank with it (the death signal).
  SendShepherdMessage(rank.conn, "stop");
}

std::string RankSupervisor::ErrorFilePath(const RankKey& key) const {
  const auto& [job_id, attempt, rank] = key;
  return absl::StrCat(options_.work_dir, "/", job_id, "/attempt-", attempt, "/errors/rank-", rank,
                      ".json");
}

int RankSupervisor::Signal(const std::string& job_id, int attempt, int signal) {
  absl::MutexLock lock(&mu_);
  int sent = 0;
  for (auto& [key, rank] : ranks_) {
    if (std::get<0>(key) != job_id || std::get<1>(key) != attempt) continue;
    if (SendShepherdMessage(rank.conn, absl::StrCat("signal ", signal))) ++sent;
  }
  return sent;
}

void RankSupervisor::StopAll() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  launches_.clear();
  for (auto& [key, rank] : ranks_) AskToStop(rank);
  auto all_exited = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ranks_.empty(); };
  mu_.Await(absl::Condition(&all_exited));
}

void RankSupervisor::Detach() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    detaching_ = true;
    launches_.clear();
    auto all_detached = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ranks_.empty(); };
    mu_.Await(absl::Condition(&all_detached));
  }
  folders_->Stop();  // (without the lock: its thread may wait for it)
}

void RankSupervisor::set_orphan_timeout(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  orphan_timeout_ = timeout;
}

std::vector<v1::RankStatus> RankSupervisor::Adopt() {
  namespace fs = std::filesystem;
  std::vector<v1::RankStatus> adopted;
  std::error_code ec;
  // WORK_DIR/JOB/attempt-N/rank-R.sock: the shepherds of the ranks a worker before this one left.
  for (const auto& job : fs::directory_iterator(options_.work_dir, ec)) {
    if (!job.is_directory(ec) || job.is_symlink(ec)) continue;
    std::error_code ec2;
    for (const auto& attempt_dir : fs::directory_iterator(job.path(), ec2)) {
      int attempt = 0;
      const std::string attempt_name = attempt_dir.path().filename().string();
      if (!absl::StartsWith(attempt_name, "attempt-") ||
          !absl::SimpleAtoi(attempt_name.substr(8), &attempt) || attempt_dir.is_symlink(ec2)) {
        continue;
      }
      std::error_code ec3;
      for (const auto& entry : fs::directory_iterator(attempt_dir.path(), ec3)) {
        const std::string name = entry.path().filename().string();
        int rank = 0;
        if (!absl::StartsWith(name, "rank-") || !absl::EndsWith(name, ".sock") ||
            !absl::SimpleAtoi(name.substr(5, name.size() - 10), &rank)) {
          continue;
        }
        const RankKey key{job.path().filename().string(), attempt, rank};
        auto conn = ConnectShepherdSocket(entry.path().string());
        auto message = conn.ok() ? ReceiveShepherdMessage(*conn, absl::Seconds(5))
                                 : absl::StatusOr<std::string>(conn.status());
        const std::optional<ShepherdHello> hello =
            message.ok() ? ParseShepherdHello(*message) : std::nullopt;
        if (!hello.has_value()) {
          // Its shepherd ended without a worker to tell (it was killed; its rank died with it):
          // the rank is reported gone, so its attempt fails and the job restarts from its
          // checkpoint, rather than being started again into an attempt that has moved on.
          if (conn.ok()) close(*conn);
          unlink(entry.path().c_str());
          KillWhatIsLeft(key);
          const std::string why =
              "its shepherd ended while no worker held it (the rank died with it)";
          {
            absl::MutexLock lock(&mu_);
            started_.insert(key);
          }
          ReportExit(key, 128 + SIGKILL, why);
          v1::RankStatus& s = adopted.emplace_back();
          s.set_job_id(std::get<0>(key));
          s.set_attempt(attempt);
          s.set_rank(rank);
          s.set_phase(v1::RANK_EXITED);
          s.set_exit_code(128 + SIGKILL);
          s.set_message(why);
          continue;
        }
        absl::MutexLock lock(&mu_);
        started_.insert(key);
        Rank& r = ranks_[key];
        r.device = hello->device;
        r.grace_ms = hello->grace_ms;
        r.conn = *conn;
        r.reader = std::thread(
            [this, key, conn = *conn, offset = hello->offset] { Follow(key, conn, 0, offset); });
        v1::RankStatus& s = adopted.emplace_back();
        s.set_job_id(std::get<0>(key));
        s.set_attempt(attempt);
        s.set_rank(rank);
        s.set_device(hello->device);
        s.set_phase(v1::RANK_RUNNING);
        if (hello->grace_ms > 0) s.set_stop_grace_ms(hello->grace_ms);
      }
    }
  }
  return adopted;
}

std::vector<v1::RankStatus> RankSupervisor::Running() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::RankStatus> out;
  auto add = [&out](const std::string& job_id, int attempt, int rank, int device,
                    v1::RankPhase phase) -> v1::RankStatus& {
    v1::RankStatus& s = out.emplace_back();
    s.set_job_id(job_id);
    s.set_attempt(attempt);
    s.set_rank(rank);
    s.set_device(device);
    s.set_phase(phase);
    return s;
  };
  for (const auto& [key, rank] : ranks_) {
    v1::RankStatus& s =
        add(std::get<0>(key), std::get<1>(key), std::get<2>(key), rank.device, v1::RANK_RUNNING);
    if (rank.grace_ms > 0) s.set_stop_grace_ms(rank.grace_ms);
  }
  for (const v1::Assignment& a : launches_) {  // not started yet
    for (int i = 0; i < RanksOf(a); ++i) {
      add(a.job_id(), a.attempt(), a.first_rank() + i, DeviceOfRank(a, i), v1::RANK_STARTING);
    }
  }
  return out;
}

int RankSupervisor::running_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(ranks_.size());
}

void RankSupervisor::SupervisorLoop() {
  absl::MutexLock lock(&mu_);
  uint64_t seen = 0;  // launch_events_ as StartLaunches last saw it
  while (true) {
    auto has_work = [this, &seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return launch_events_ != seen || !finished_readers_.empty() ||
             (stopping_ && ranks_.empty() && preparing_.empty());
    };
    if (scrubs_.empty()) {
      mu_.Await(absl::Condition(&has_work));
    } else {
      mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Seconds(2));  // (RemoveEndedWork)
    }
    seen = launch_events_;
    StartLaunches();
    std::vector<std::thread> done;
    done.swap(finished_readers_);
    if (!done.empty()) {
      mu_.Unlock();
      for (auto& t : done) t.join();
      mu_.Lock();
    }
    RemoveEndedWork();
    if (stopping_ && ranks_.empty() && launches_.empty() && preparing_.empty() &&
        finished_readers_.empty()) {
      break;
    }
  }
}

void RankSupervisor::StartLaunches() {
  for (auto it = launches_.begin(); it != launches_.end();) {
    const v1::Assignment a = *it;
    const std::pair<std::string, int> attempt{a.job_id(), a.attempt()};
    if (preparing_.count(attempt) > 0) {
      ++it;
      continue;
    }
    // Prepared before the first rank here starts; never under ranks already running (ranks a
    // restarted worker adopted: their folder is as it was).
    bool none_started = true;
    for (int i = 0; i < RanksOf(a); ++i) {
      none_started =
          none_started && started_.count({a.job_id(), a.attempt(), a.first_rank() + i}) == 0;
    }
    if (none_started && contexts_.count(attempt) == 0) {
      v1::JobSpec spec;
      if (spec.ParseFromString(a.spec()) && !spec.context().empty()) {
        // (Each holds an archive, up to 80 MiB, and an unpacker: a few at once.)
        if (preparing_.size() < kMaxPreparing) Prepare(a, spec.context());
        ++it;
        continue;
      }
    }
    it = launches_.erase(it);
    auto context = contexts_.find(attempt);
    const absl::Status prepared = context == contexts_.end() ? absl::OkStatus() : context->second;
    for (int i = 0; i < RanksOf(a); ++i) {
      Start(a, a.first_rank() + i, DeviceOfRank(a, i), prepared);
    }
    ended_attempts_.insert(attempt);  // (perhaps: a rank that failed to start has ended)
  }
}

void RankSupervisor::Prepare(const v1::Assignment& a, const std::string& digest) {
  const std::pair<std::string, int> attempt{a.job_id(), a.attempt()};
  // (Made under the lock: the thread's last step, which takes it, finds its entry.)
  preparing_[attempt] = std::thread([this, a, digest, attempt] {
    // Fetched and unpacked without the lock (a Stop meanwhile drops the launch as ever; the
    // attempt is Live until this ends, so that its folder is not emptied under the unpacking).
    absl::Status prepared = PrepareContext(a, digest);
    absl::MutexLock lock(&mu_);
    // (Kept for the launch; a launch dropped meanwhile has none to keep it for.)
    for (const v1::Assignment& waiting : launches_) {
      if (waiting.job_id() == a.job_id() && waiting.attempt() == a.attempt()) {
        contexts_[attempt] = std::move(prepared);
        break;
      }
    }
    auto self = preparing_.find(attempt);
    finished_readers_.push_back(std::move(self->second));
    preparing_.erase(self);
    ++launch_events_;
  });
}

absl::StatusOr<std::optional<UnixAccount>> RankSupervisor::AccountOf(
    const std::string& owner) const {
  if (options_.run_as == nullptr) return std::nullopt;
  auto found = options_.run_as->AccountFor(owner);
  if (!found.ok()) return found.status();
  if (!options_.run_as->switches()) return std::nullopt;
  return std::optional<UnixAccount>(*std::move(found));
}

absl::Status RankSupervisor::PrepareContext(const v1::Assignment& a, const std::string& digest) {
  if (options_.contexts == nullptr) {
    return absl::FailedPreconditionError("this worker cannot fetch a job's context");
  }
  ASSIGN_OR_RETURN(const std::optional<UnixAccount> account, AccountOf(a.owner()));
  const UnixAccount* owner = account.has_value() ? &*account : nullptr;
  // The attempt's folder as Start makes it; its "work" folder the owner's, empty.
  const std::string dir =
      absl::StrCat(options_.work_dir, "/", a.job_id(), "/attempt-", a.attempt());
  const std::string work = dir + "/work";
  std::error_code ec;
  std::filesystem::create_directories(work, ec);
  if (owner != nullptr) {
    chmod(std::filesystem::path(dir).parent_path().c_str(), 0711);
    chmod(dir.c_str(), 0711);
  }
  RETURN_IF_ERROR(GiveFolder(work, owner));
  ASSIGN_OR_RETURN(const std::string archive, options_.contexts->Get(a.job_id(), digest));
  return UnpackContextAs(options_.shepherd_path, ShepherdEnvironment(WorkerEnvironment()), archive,
                         work, owner);
}

void RankSupervisor::Start(const v1::Assignment& a, int rank, int device,
                           const absl::Status& prepared) {
  const RankKey key{a.job_id(), a.attempt(), rank};
  // Assignments arrive at least once: the coordinator resends them when a session opens, which
  // can cross the first send. A rank of an attempt runs once, even when it has already ended.
  if (!started_.insert(key).second) return;
  // The account that runs the rank: the owner's, when this worker runs as root.
  absl::StatusOr<std::optional<UnixAccount>> found = AccountOf(a.owner());
  if (!found.ok()) {
    ReportExit(key, 126, std::string(found.status().message()));
    return;
  }
  const std::optional<UnixAccount> account = *std::move(found);
  attempt_accounts_.emplace(std::pair(a.job_id(), a.attempt()), account);
  if (!prepared.ok()) {
    ReportExit(key, 126, std::string(prepared.message()));
    return;
  }
  if (!options_.gpu_uuids.empty() &&
      (device < 0 || device >= static_cast<int>(options_.gpu_uuids.size()))) {
    ReportExit(key, 127, absl::StrCat("no GPU with index ", device, " on this worker"));
    return;
  }
  v1::JobSpec spec;
  if (!spec.ParseFromString(a.spec())) {
    ReportExit(key, 126, "the assignment's spec is unreadable");
    return;
  }
  const std::string checkpoint_dir =
      a.checkpoint_dir().empty() ? absl::StrCat(options_.work_dir, "/", a.job_id(), "/checkpoints")
                                 : a.checkpoint_dir();
  // Under --private-tmp, before anything is made there: what the ranks are handed must stay in
  // sight in their namespace.
  for (const auto& [field, path] :
       {std::pair<const char*, std::string>{"workdir", spec.workdir()},
        {"the job's checkpoint folder (the coordinator's --checkpoint-root)", checkpoint_dir}}) {
    if (const std::string over =
            options_.private_tmp ? PrivateFolderOver(path, /*resolve_links=*/false) : "";
        !over.empty()) {
      ReportExit(key, 126,
                 absl::StrCat(field, ": ", Quoted(path), " is under ", over,
                              ", which this node gives each job a private one of (its worker's "
                              "--private-tmp): the job's ranks would not see it; choose a folder "
                              "elsewhere"));
      return;
    }
  }

  // The attempt's folder stays the worker's (the spec and the ranks' logs, which the worker
  // writes, live there, where a rank cannot plant a link); the rank works in its "work" folder
  // and writes checkpoints into the job's checkpoint folder, both its owner's (mode 0700).
  namespace fs = std::filesystem;
  const std::string dir =
      absl::StrCat(options_.work_dir, "/", a.job_id(), "/attempt-", a.attempt());
  const std::string work = dir + "/work";
  std::error_code ec;
  fs::create_directories(work, ec);
  if (account.has_value()) {  // others may pass, not list (the job's attempts, its checkpoints)
    chmod(fs::path(dir).parent_path().c_str(), 0711);
    chmod(dir.c_str(), 0711);
  }
  const std::string spec_path = dir + "/spec.pb";
  fs::create_directories(checkpoint_dir, ec);
  const UnixAccount* owner = account.has_value() ? &*account : nullptr;
  for (absl::Status s : {WriteOwnedFile(spec_path, a.spec(), owner), GiveFolder(work, owner),
                         GiveFolder(checkpoint_dir, owner)}) {
    if (!s.ok()) {
      ReportExit(key, 126, std::string(s.message()));
      return;
    }
  }

  if (options_.private_tmp) {
    if (absl::Status s = PrepareOwnTmp(a, spec, dir, owner); !s.ok()) {
      ReportExit(key, 126, std::string(s.message()));
      return;
    }
  }
  if (spec.command_size() > 0) {
    StartCommand(a, spec, key, rank, device, account, work, checkpoint_dir);
    return;
  }
  // The rank's context, one message (job_id, attempt, rank, world, devices, servers, the spec),
  // in a file only the owner can read; the credential stays in the environment.
  v1::RankContext context;
  *context.mutable_spec() = std::move(spec);
  context.set_job_id(a.job_id());
  context.set_attempt(a.attempt());
  context.set_rank(rank);
  context.set_world_size(a.world_size());
  context.set_local_world_size(RanksOf(a));
  context.set_device(options_.gpu_uuids.empty() ? "cpu" : "cuda");
  context.set_coordinator_address(
      RankCoordinatorList(a.coordinator_address(), options_.coordinators));
  context.set_checkpoint_dir(checkpoint_dir);
  context.set_threads(options_.threads_per_rank);
  *context.mutable_ps_ranges() = a.ps_ranges();
  context.set_node_address(options_.node_address);
  const std::string context_path = absl::StrCat(dir, "/rank-", rank, ".pb");
  if (absl::Status s = WriteOwnedFile(context_path, context.SerializeAsString(), owner); !s.ok()) {
    ReportExit(key, 126, std::string(s.message()));
    return;
  }
  std::vector<std::string> argv = {options_.trainer_path, "--context", context_path};
  // The rank's own settings, then the worker's environment without the names they set (getenv
  // finds the first of duplicates, so an inherited OMP_NUM_THREADS would otherwise win).
  std::vector<std::string> env = {
      absl::StrCat("OMP_NUM_THREADS=", options_.threads_per_rank),
      absl::StrCat("TRAINYARD_JOB_ID=", a.job_id()), absl::StrCat("TRAINYARD_DEVICE=", device),
      // Its own GPU only, named by UUID: numbering then does not depend on the order CUDA
      // enumerates in (CUDA_DEVICE_ORDER), and the rank finds it as cuda:0. No GPU for CPU slots.
      absl::StrCat("CUDA_VISIBLE_DEVICES=",
                   options_.gpu_uuids.empty() ? "" : options_.gpu_uuids[device]),
      // torchrun's names, for code that looks for them.
      absl::StrCat("LOCAL_RANK=", rank - a.first_rank()),
      absl::StrCat("LOCAL_WORLD_SIZE=", RanksOf(a)),
      // The attempt's credential for the rendezvous and reports: environment only, never argv.
      absl::StrCat(kJobCredentialEnv, "=", a.job_credential()),
      absl::StrCat(kTlsCaEnv, "=", options_.tls_ca)};
  Exec(a, key, device, account, std::move(argv), std::move(env), work, spec);
}

absl::Status RankSupervisor::PrepareOwnTmp(const v1::Assignment& a, const v1::JobSpec& spec,
                                           const std::string& dir, const UnixAccount* owner) {
  const std::string tmp = dir + "/tmp";
  std::error_code ec;
  std::filesystem::create_directories(tmp, ec);
  RETURN_IF_ERROR(GiveFolder(tmp, owner));
  // /dev/shm holds at most the memory of the attempt's ranks here, and never more than the
  // host's own /dev/shm would (its pages count against the cgroup of the rank that writes them
  // too).
  const int64_t rank_bytes = RankLimits(options_.rank_limits, spec.resources()).memory_bytes;
  const int64_t host_bytes = int64_t{sysconf(_SC_PHYS_PAGES)} * sysconf(_SC_PAGESIZE);
  return MakeAttemptNamespaces(
      NamespacesOf(NamespaceFolder(options_.work_dir), a.job_id(), a.attempt()),
      NamespaceFolder(options_.work_dir), tmp, owner != nullptr ? owner->uid : geteuid(),
      owner != nullptr ? owner->gid : getegid(),
      AttemptShmBytes(rank_bytes, RanksOf(a), host_bytes));
}

void RankSupervisor::StartCommand(const v1::Assignment& a, const v1::JobSpec& spec,
                                  const RankKey& key, int rank, int device,
                                  const std::optional<UnixAccount>& account,
                                  const std::string& work, const std::string& checkpoint_dir) {
  // torchrun's environment (torch.distributed's env:// init reads it), then trainyard's, then
  // the spec's own names (validated not to be any of these), before the worker's environment.
  // MASTER_PORT: reserved by the coordinator on rank 0's node for this attempt; without one (all
  // taken), rank 0's node picks a free port, which is right when the job has one node.
  // When every rank is on this node, the port only has to be free here: the kernel picks one,
  // the same for all the attempt's ranks. Across nodes, it is the coordinator's reservation.
  std::string master_addr = a.master_addr().empty() ? "127.0.0.1" : a.master_addr();
  int& master_port = attempt_ports_[{a.job_id(), a.attempt()}];
  if (master_port == 0) {
    const bool single_node = a.world_size() == RanksOf(a);
    master_port = single_node || a.master_port() == 0 ? FreeLocalPort() : a.master_port();
  }
  if (a.world_size() == RanksOf(a)) master_addr = "127.0.0.1";
  const std::string error_file = ErrorFilePath(key);
  const std::string errors = std::filesystem::path(error_file).parent_path().string();
  std::error_code ec;
  std::filesystem::create_directories(errors, ec);
  if (absl::Status s = GiveFolder(errors, account.has_value() ? &*account : nullptr); !s.ok()) {
    ReportExit(key, 126, std::string(s.message()));
    return;
  }
  // Every name torchrun's agent gives its workers (torch.distributed.elastic's
  // LocalElasticAgent; one role, "default", as torchrun's): ranks own the rendezvous store
  // (MASTER_PORT), so there is no agent store. TORCHELASTIC_ERROR_FILE is where @record writes
  // the rank's exception, which becomes its failure message (ErrorFileMessage).
  std::vector<std::string> env = {
      absl::StrCat("RANK=", rank),
      absl::StrCat("LOCAL_RANK=", rank - a.first_rank()),
      absl::StrCat("WORLD_SIZE=", a.world_size()),
      absl::StrCat("LOCAL_WORLD_SIZE=", RanksOf(a)),
      absl::StrCat("GROUP_RANK=", a.group_rank()),
      absl::StrCat("GROUP_WORLD_SIZE=", std::max(1, a.group_world_size())),
      absl::StrCat("ROLE_RANK=", rank),
      absl::StrCat("ROLE_WORLD_SIZE=", a.world_size()),
      "ROLE_NAME=default",
      absl::StrCat("MASTER_ADDR=", master_addr),
      absl::StrCat("MASTER_PORT=", master_port),
      absl::StrCat("TORCHELASTIC_RESTART_COUNT=", a.attempt() - 1),
      absl::StrCat("TORCHELASTIC_MAX_RESTARTS=", spec.max_restarts()),
      absl::StrCat("TORCHELASTIC_RUN_ID=", a.job_id()),
      "TORCHELASTIC_USE_AGENT_STORE=False",
      absl::StrCat("TORCHELASTIC_ERROR_FILE=", error_file),
      absl::StrCat("CUDA_VISIBLE_DEVICES=",
                   options_.gpu_uuids.empty() ? "" : options_.gpu_uuids[device]),
      absl::StrCat("TRAINYARD_JOB_ID=", a.job_id()),
      absl::StrCat("TRAINYARD_ATTEMPT=", a.attempt()),
      absl::StrCat("TRAINYARD_RANK=", rank),
      absl::StrCat("TRAINYARD_WORLD_SIZE=", a.world_size()),
      absl::StrCat("TRAINYARD_DEVICE=", device),
      absl::StrCat("TRAINYARD_CHECKPOINT_DIR=", checkpoint_dir),
      absl::StrCat("TRAINYARD_COORDINATOR=",
                   RankCoordinatorList(a.coordinator_address(), options_.coordinators)),
      absl::StrCat(kJobCredentialEnv, "=", a.job_credential()),
      absl::StrCat(kTlsCaEnv, "=", options_.tls_ca)};
  if (spec.has_array()) {  // a task of a job array (sbatch's SLURM_ARRAY_TASK_ID and kin)
    env.push_back(absl::StrCat("TRAINYARD_ARRAY_ID=", spec.array().id()));
    env.push_back(absl::StrCat("TRAINYARD_ARRAY_INDEX=", spec.array().index()));
    env.push_back(absl::StrCat("TRAINYARD_ARRAY_COUNT=", spec.array().count()));
  }
  // The SDK's save_checkpoint keeps this many of the program's checkpoints (0: all).
  if (spec.checkpoint().keep_last() > 0) {
    env.push_back(absl::StrCat("TRAINYARD_CHECKPOINT_KEEP_LAST=", spec.checkpoint().keep_last()));
  }
  for (const auto& [name, value] : spec.env()) env.push_back(absl::StrCat(name, "=", value));
  // Defaults the spec may override: torchrun's one thread per rank and its asynchronous NCCL
  // error handling; Python's output unbuffered, so that `yard logs -f` shows a print as it
  // happens (srun --unbuffered; Ray and Determined set it too).
  for (const auto& [name, value] : {std::pair<std::string, std::string>{
                                        "OMP_NUM_THREADS", absl::StrCat(options_.threads_per_rank)},
                                    {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
                                    {"PYTHONUNBUFFERED", "1"}}) {
    if (spec.env().count(name) == 0) env.push_back(absl::StrCat(name, "=", value));
  }
  // Across nodes, torch.distributed's Gloo listens on the interface of this node's address: by
  // default it takes the host name's, loopback where /etc/hosts says so, and its peers on other
  // nodes cannot reach it (torchrun leaves that to the user). The spec's, or the worker's own
  // (an operator's choice its ranks inherit), wins.
  if (a.world_size() != RanksOf(a) && !options_.node_interface.empty() &&
      spec.env().count("GLOO_SOCKET_IFNAME") == 0 && std::getenv("GLOO_SOCKET_IFNAME") == nullptr) {
    env.push_back(absl::StrCat("GLOO_SOCKET_IFNAME=", options_.node_interface));
  }
  // The program as the spec names it: its shepherd's child looks a bare name up in the PATH the
  // rank gets, as the owner's account (shepherd.h), never this worker.
  std::vector<std::string> argv(spec.command().begin(), spec.command().end());
  Exec(a, key, device, account, std::move(argv), std::move(env),
       spec.workdir().empty() ? work : spec.workdir(), spec);
}

std::string RankSupervisor::RankCgroupName(const RankKey& key) const {
  return absl::StrCat(options_.cgroup_prefix, "/", std::get<0>(key), "/attempt-", std::get<1>(key),
                      "/rank-", std::get<2>(key));
}

void RankSupervisor::KillWhatIsLeft(const RankKey& key) {
  if (options_.cgroups == nullptr || options_.cgroups->version == 0) return;
  std::vector<std::string> dirs;
  for (const std::string& dir : RankCgroupDirs(*options_.cgroups, RankCgroupName(key))) {
    std::error_code ec;
    if (std::filesystem::is_directory(dir, ec)) dirs.push_back(dir);
  }
  if (!dirs.empty() && !KillAndRemoveCgroups(dirs, absl::Seconds(10))) {
    spdlog::warn("rank {} of {} attempt {}: its cgroup {} still holds processes", std::get<2>(key),
                 std::get<0>(key), std::get<1>(key), dirs[0]);
  }
}

CgroupLimits RankSupervisor::RankCgroupLimits(const v1::Resources& resources, int device) const {
  CgroupLimits limits = RankLimits(options_.rank_limits, resources);
  limits.denied_devices = DeniedDevices(options_.gpu_device_rules, device);
  return limits;
}

void RankSupervisor::Exec(const v1::Assignment& a, const RankKey& key, int device,
                          const std::optional<UnixAccount>& account, std::vector<std::string> argv,
                          std::vector<std::string> env, const std::string& cwd,
                          const v1::JobSpec& spec) {
  // Marks every process of the rank (inherited by its children, also those that leave its
  // process group or session), so that its shepherd finds them all when it stops the rank.
  const std::string mark = absl::StrCat(absl::Hex(mark_random_()), "/", std::get<0>(key), "/",
                                        std::get<1>(key), "/", std::get<2>(key));
  env.push_back("TRAINYARD_RANK_MARK=" + mark);
  const std::vector<std::string> worker_env = WorkerEnvironment();
  const UnixAccount identity = account.has_value() ? *account : OwnAccount();
  const std::vector<std::string> rank_env =
      RankEnvironment(identity, worker_env, options_.rank_env, env);
  // The rank's environment travels in a memfd that its shepherd's child reads once it runs as
  // the owner: no file on disk (it holds the job's credential), nothing in argv.
  const int env_fd = memfd_create("trainyard-rank-env", MFD_CLOEXEC);
  std::string env_text;
  for (const std::string& e : rank_env) absl::StrAppend(&env_text, e, std::string(1, '\0'));
  if (env_fd < 0 || !WriteAll(env_fd, env_text)) {
    const int err = errno;
    if (env_fd >= 0) close(env_fd);
    ReportExit(key, 127, absl::StrCat("the rank's environment: ", strerror(err)));
    return;
  }
  // The rank runs under a shepherd (shepherd.h) that outlives this worker: a restarted worker
  // adopts it.
  const std::string prefix = absl::StrCat(options_.work_dir, "/", std::get<0>(key), "/attempt-",
                                          std::get<1>(key), "/rank-", std::get<2>(key));
  std::vector<std::string> shepherd = {
      options_.shepherd_path,
      kShepherdFlag,
      "prefix=" + prefix,
      "cwd=" + cwd,
      "mark=" + mark,
      "env_fd=4",
      absl::StrCat("device=", device),
      absl::StrCat("grace_ms=", absl::ToInt64Milliseconds(StopGrace(spec, options_))),
      absl::StrCat("orphan_ms=", absl::ToInt64Milliseconds(orphan_timeout_)),
      absl::StrCat("log_keep=", options_.log_keep_bytes)};
  if (options_.private_tmp) {  // (made by Start: PrepareOwnTmp)
    const AttemptNamespaces ns =
        NamespacesOf(NamespaceFolder(options_.work_dir), std::get<0>(key), std::get<1>(key));
    shepherd.push_back("mnt=" + ns.mnt);
    shepherd.push_back("ipc=" + ns.ipc);
  }
  // Its cgroup, held to the rank's limits (cgroups.h).
  if (options_.cgroups != nullptr && options_.cgroups->version != 0) {
    auto dirs = CreateRankCgroup(*options_.cgroups, RankCgroupName(key),
                                 RankCgroupLimits(spec.resources(), device));
    if (!dirs.ok()) {
      close(env_fd);
      ReportExit(key, 127, std::string(dirs.status().message()));
      return;
    }
    for (const std::string& d : *dirs) shepherd.push_back("cgroup=" + d);
  }
  if (account.has_value()) {
    shepherd.push_back(absl::StrCat("uid=", account->uid));
    shepherd.push_back(absl::StrCat("gid=", account->gid));
    shepherd.push_back(absl::StrCat("groups=", absl::StrJoin(account->groups, ",")));
  }
  shepherd.push_back("--");
  shepherd.insert(shepherd.end(), argv.begin(), argv.end());
  std::vector<char*> c_argv, c_env;
  for (auto& s : shepherd) c_argv.push_back(s.data());
  c_argv.push_back(nullptr);
  // The shepherd's own environment: nothing of the job's, of this worker's only its libraries.
  std::vector<std::string> shepherd_env = ShepherdEnvironment(worker_env);
  for (auto& e : shepherd_env) c_env.push_back(e.data());
  c_env.push_back(nullptr);

  // The log starts empty and is the worker's (the shepherd appends the rank's output to it).
  if (absl::Status s = WriteOwnedFile(prefix + ".log", "", nullptr); !s.ok()) {
    close(env_fd);
    ReportExit(key, 127, std::string(s.message()));
    return;
  }
  auto listener = ListenShepherdSocket(prefix + ".sock");
  if (!listener.ok()) {
    close(env_fd);
    ReportExit(key, 127, std::string(listener.status().message()));
    return;
  }
  sigset_t no_signals;
  sigemptyset(&no_signals);
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec. No death signal: the shepherd outlives the worker.
    // The worker blocks SIGTERM and SIGINT (a thread waits for them), and exec keeps a blocked
    // mask: unblocked, or a graceful stop would never run.
    sigprocmask(SIG_SETMASK, &no_signals, nullptr);
    const int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      dup2(devnull, STDIN_FILENO);
      dup2(devnull, STDOUT_FILENO);
      dup2(devnull, STDERR_FILENO);
    }
    // The listening socket as 3, the rank's environment as 4, whatever numbers they have here
    // (either may be 3 or 4 already, and dup2 onto itself would keep close-on-exec): both
    // moved above first.
    const int listen_high = fcntl(*listener, F_DUPFD_CLOEXEC, 10);
    const int env_high = fcntl(env_fd, F_DUPFD_CLOEXEC, 10);
    if (listen_high < 0 || env_high < 0 || dup2(listen_high, 3) != 3 || dup2(env_high, 4) != 4) {
      _exit(127);
    }
    close_range(5, ~0U, 0);  // nothing else of the worker's (sockets, driver files) leaks in
    execve(c_argv[0], c_argv.data(), c_env.data());
    _exit(127);
  }
  const int fork_errno = errno;
  close(*listener);
  close(env_fd);
  if (pid < 0) {
    unlink((prefix + ".sock").c_str());  // (a socket left there keeps the attempt's folder)
    ReportExit(key, 127, absl::StrCat("fork: ", strerror(fork_errno)));
    return;
  }
  // Queued in the listener's backlog until the shepherd accepts; refused once it has ended.
  auto conn = ConnectShepherdSocket(prefix + ".sock");
  if (!conn.ok()) {
    waitpid(pid, nullptr, 0);
    unlink((prefix + ".sock").c_str());
    ReportExit(key, 127,
               absl::StrCat("the rank's shepherd did not start: ", conn.status().message()));
    return;
  }
  Rank& r = ranks_[key];
  r.device = device;
  r.grace_ms = absl::ToInt64Milliseconds(StopGrace(spec, options_));
  r.conn = *conn;
  r.reader = std::thread([this, key, conn = *conn, pid] { Follow(key, conn, pid, -1); });

  v1::NodeMessage m;
  auto* s = m.mutable_rank_status();
  s->set_job_id(a.job_id());
  s->set_attempt(a.attempt());
  s->set_rank(std::get<2>(key));
  s->set_phase(v1::RANK_RUNNING);
  send_(m);
}

void RankSupervisor::Follow(RankKey key, int conn, pid_t shepherd, int64_t offset) {
  const auto& [job_id, attempt, rank] = key;
  std::optional<int> exit_code;
  v1::RankUsage usage;
  std::string gone;  // why the shepherd cannot say how the rank ended
  if (offset < 0) {  // a shepherd this worker started: its hello first
    auto message = ReceiveShepherdMessage(conn, absl::Seconds(30));
    if (!message.ok() || !ParseShepherdHello(*message).has_value()) {
      gone = "the rank's shepherd did not start";
    }
    offset = 0;
  }
  RankLogFollower log(
      absl::StrCat(options_.work_dir, "/", job_id, "/attempt-", attempt, "/rank-", rank, ".log"),
      offset, options_.failure_log_lines, [&](RankLogFollower::Batch& lines) {
        v1::NodeMessage m;
        auto* l = m.mutable_logs();
        l->set_job_id(job_id);
        l->set_attempt(attempt);
        l->set_rank(rank);
        for (auto& [seq, line] : lines) {
          Remember(key, seq, line);
          l->add_seqs(seq);
          l->add_lines(std::move(line));
        }
        send_(m);
      });
  // Offsets are told to the shepherd at most once a second: a worker that crashes and comes back
  // sends at most that much of the log twice.
  int64_t told = offset;
  absl::Time tell_at = absl::Now() + absl::Seconds(1);
  auto tell_offset = [&] {
    const int64_t complete = log.complete_bytes();
    if (complete != told && SendShepherdMessage(conn, absl::StrCat("sent ", complete))) {
      told = complete;
    }
  };
  bool detached = false;
  bool behind = false;  // the last read took its whole share: read again at once
  while (gone.empty() && !exit_code.has_value()) {
    auto message =
        ReceiveShepherdMessage(conn, behind ? absl::ZeroDuration() : absl::Milliseconds(200));
    behind = log.ReadNew() >= RankLogFollower::kReadBytes;
    if (!message.ok()) {
      gone = "the rank's shepherd ended without saying how the rank did";
    } else if (absl::StartsWith(*message, "exit ")) {
      exit_code = ParseShepherdExit(message->substr(5), &usage);
    }
    if (absl::Now() >= tell_at) {
      tell_offset();
      tell_at = absl::Now() + absl::Seconds(1);
    }
    absl::MutexLock lock(&mu_);
    if (detaching_) {
      detached = true;
      break;
    }
  }
  if (detached) {
    // This worker goes (an upgrade): the shepherd keeps the rank for the next one.
    tell_offset();
  } else {
    log.ReadToEnd();
    const int code = exit_code.value_or(128 + SIGKILL);
    const std::deque<std::string>& last = log.last_lines();
    // The exception a torchelastic-aware program recorded leads; else the cause in its output.
    std::string message;
    if (code != 0) message = ErrorFileMessage(ErrorFilePath(key));
    if (code != 0 && message.empty()) message = FailureMessage({last.begin(), last.end()});
    if (!exit_code.has_value())
      message = message.empty() ? gone : absl::StrCat(gone, ": ", message);
    ReportExit(key, code, message, usage);
    tell_offset();  // (the shepherd frees what was sent of the log beyond what it keeps)
    SendShepherdMessage(conn, "done");
  }
  {
    // Its last lines stay for a while: the rank may have ended while no coordinator could be
    // reached, and the next session sends them again too.
    absl::MutexLock lock(&recent_mu_);
    if (auto it = recent_.find(key); it != recent_.end()) it->second.ended = absl::Now();
  }
  if (shepherd > 0) {  // this worker's child: it ends once the exit is collected
    while (!detached && waitpid(shepherd, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  if (!detached && (exit_code.has_value() || shepherd > 0)) {
    // Its shepherd removes its socket as it ends; one that was killed (or did not start) leaves
    // it, and a socket keeps the attempt's folder (attempt_folders.h). (Not one that is alive
    // but was taken by another worker on this folder: that one may adopt it.)
    unlink(
        absl::StrCat(options_.work_dir, "/", job_id, "/attempt-", attempt, "/rank-", rank, ".sock")
            .c_str());
  }
  absl::MutexLock lock(&mu_);
  if (!detached) ended_attempts_.emplace(job_id, attempt);
  auto it = ranks_.find(key);
  if (it != ranks_.end()) {
    close(it->second.conn);
    finished_readers_.push_back(std::move(it->second.reader));
    ranks_.erase(it);
  }
}

bool RankSupervisor::Live(const std::string& job_id, int attempt) const {
  for (const auto& [key, rank] : ranks_) {
    if (std::get<0>(key) == job_id && (attempt == 0 || std::get<1>(key) == attempt)) return true;
  }
  for (const auto& [key, thread] : preparing_) {
    if (key.first == job_id && (attempt == 0 || key.second == attempt)) return true;
  }
  for (const v1::Assignment& a : launches_) {
    if (a.job_id() == job_id && (attempt == 0 || a.attempt() == attempt)) return true;
  }
  return false;
}

void RankSupervisor::RemoveEndedWork() {
  // Detached ranks run on under their shepherds (an upgrade): their folders are theirs still.
  if (detaching_) return;
  std::set<uid_t> ended_accounts;  // whose ranks ran the attempts handed on here
  for (auto it = ended_attempts_.begin(); it != ended_attempts_.end();) {
    const auto& [job_id, attempt] = *it;
    if (Live(job_id, attempt)) {
      ++it;
      continue;
    }
    const std::string dir = absl::StrCat(options_.work_dir, "/", job_id, "/attempt-", attempt);
    std::optional<UnixAccount> owner;
    if (auto account = attempt_accounts_.find(*it); account != attempt_accounts_.end()) {
      owner = account->second;
      attempt_accounts_.erase(account);
    } else if (struct stat st{}; lstat((dir + "/work").c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      owner = FolderOwner(st);  // adopted from an earlier worker: whom the folder was given to
    }
    if (owner.has_value()) ended_accounts.insert(owner->uid);
    contexts_.erase(*it);  // (an assignment of it sent again starts no rank: started_)
    attempt_ports_.erase(*it);
    started_expiry_.emplace_back(absl::Now() + options_.forget_started_after, *it);
    folders_->Ended(job_id, attempt, std::move(owner));
    it = ended_attempts_.erase(it);
  }
  // An attempt ended long ago: its ranks' records go.
  while (!started_expiry_.empty() && started_expiry_.front().first <= absl::Now()) {
    const auto& [job_id, attempt] = started_expiry_.front().second;
    started_.erase(started_.lower_bound({job_id, attempt, std::numeric_limits<int>::min()}),
                   started_.upper_bound({job_id, attempt, std::numeric_limits<int>::max()}));
    started_expiry_.pop_front();
  }
  // Scrubbed once none of the account's processes is left, looked at again each pass (every few
  // seconds while one waits) for up to kScrubFor. (Under the lock: no launch of theirs starts
  // meanwhile. Root's and this worker's own account are never scrubbed: their files are not a
  // job's.)
  const absl::Time now = absl::Now();
  for (uid_t uid : ended_accounts) {
    if (uid != 0 && uid != geteuid()) scrubs_.emplace(uid, now + kScrubFor);
  }
  for (auto it = scrubs_.begin(); it != scrubs_.end();) {
    // (A rank of theirs runs or waits: its own end queues them again. A context being prepared,
    // whoever's: wait for it.)
    const bool done = AccountLive(it->first) ? preparing_.empty() : ScrubSharedMemory(it->first);
    it = done || now >= it->second ? scrubs_.erase(it) : std::next(it);
  }
}

bool RankSupervisor::AccountLive(uid_t uid) const {
  if (!preparing_.empty()) return true;
  for (const auto& [key, rank] : ranks_) {
    auto account = attempt_accounts_.find({std::get<0>(key), std::get<1>(key)});
    if (account == attempt_accounts_.end() || !account->second.has_value() ||
        account->second->uid == uid) {
      return true;
    }
  }
  for (const v1::Assignment& a : launches_) {
    absl::StatusOr<std::optional<UnixAccount>> account = AccountOf(a.owner());
    if (!account.ok() || !account->has_value() || (*account)->uid == uid) return true;
  }
  return false;
}

void RankSupervisor::Remember(const RankKey& key, int64_t seq, const std::string& line) {
  absl::MutexLock lock(&recent_mu_);
  if (recent_.count(key) == 0) {
    // A new rank: the ended ones' lines go once past kEndedRecentLogs or kEndedRecentLogsFor.
    std::vector<std::pair<absl::Time, RankKey>> ended;
    for (const auto& [k, r] : recent_) {
      if (r.ended != absl::InfiniteFuture()) ended.emplace_back(r.ended, k);
    }
    std::sort(ended.begin(), ended.end());
    for (size_t i = 0; i < ended.size(); ++i) {
      if (ended.size() - i > kEndedRecentLogs ||
          absl::Now() - ended[i].first > kEndedRecentLogsFor) {
        recent_.erase(ended[i].second);
      }
    }
  }
  RecentLines& recent = recent_[key];
  recent.lines.emplace_back(seq, line);
  recent.bytes += line.size();
  while (recent.lines.size() > kRecentLogLines || recent.bytes > kRecentLogBytes) {
    recent.bytes -= recent.lines.front().second.size();
    recent.lines.pop_front();
  }
}

std::vector<v1::NodeMessage> RankSupervisor::RecentLogs() const {
  std::vector<v1::NodeMessage> out;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&recent_mu_);
  for (const auto& [key, recent] : recent_) {
    if (recent.ended != absl::InfiniteFuture() && now - recent.ended > kEndedRecentLogsFor) {
      continue;  // (dropped when the next rank starts)
    }
    for (size_t i = 0; i < recent.lines.size(); i += 512) {
      v1::NodeMessage m;
      auto* l = m.mutable_logs();
      l->set_job_id(std::get<0>(key));
      l->set_attempt(std::get<1>(key));
      l->set_rank(std::get<2>(key));
      l->set_again(true);
      for (size_t j = i; j < std::min(recent.lines.size(), i + 512); ++j) {
        l->add_seqs(recent.lines[j].first);
        l->add_lines(recent.lines[j].second);
      }
      out.push_back(std::move(m));
    }
  }
  return out;
}

void RankSupervisor::ReportExit(const RankKey& key, int exit_code, const std::string& message,
                                const v1::RankUsage& usage) {
  v1::NodeMessage m;
  auto* s = m.mutable_rank_status();
  s->set_job_id(std::get<0>(key));
  s->set_attempt(std::get<1>(key));
  s->set_rank(std::get<2>(key));
  s->set_phase(v1::RANK_EXITED);
  s->set_exit_code(exit_code);
  s->set_message(message);
  *s->mutable_usage() = usage;
  send_(m);
}

}  // namespace trainyard::worker
