#include "worker/daemon/rank_supervisor.h"

#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/tls.h"

extern char** environ;

namespace trainyard::worker {
namespace {

// `text` with every byte that does not belong to a valid UTF-8 sequence replaced by U+FFFD.
std::string ValidUtf8(std::string text) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  std::string out;
  size_t i = 0;
  bool changed = false;
  while (i < text.size()) {
    const unsigned char c = byte(i);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xe  ? 3
                 : (c >> 3) == 0x1e ? 4
                                    : 0;
    bool ok = len > 0 && i + len <= text.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (byte(i + k) & 0xc0) == 0x80;
    if (ok && len > 1) {  // no overlong forms, surrogates, or code points past U+10FFFF
      uint32_t cp = c & (0x7f >> len);
      for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (byte(i + k) & 0x3f);
      static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
      ok = cp >= kMin[len] && cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
    }
    if (ok) {
      out.append(text, i, len);
      i += len;
    } else {
      out += "\xef\xbf\xbd";
      ++i;
      changed = true;
    }
  }
  return changed ? out : text;
}

// Writes `content` to `path` (a file of the worker's folder) with mode 0600, refusing a symbolic
// link, and gives it to `owner` (null: keeps it).
absl::Status WriteOwnedFile(const std::string& path, const std::string& content,
                            const UnixAccount* owner) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", strerror(errno)));
  bool ok = write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size());
  if (ok && owner != nullptr) ok = fchown(fd, owner->uid, owner->gid) == 0;
  const int err = errno;
  close(fd);
  if (!ok) return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", strerror(err)));
  return absl::OkStatus();
}

// Gives the folder `path` to `owner` with mode 0700 (null: leaves it), refusing a symbolic link
// in its place (a job's checkpoint folder may sit where users can write).
absl::Status GiveFolder(const std::string& path, const UnixAccount* owner) {
  if (owner == nullptr) return absl::OkStatus();
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot give ", path, " to ", owner->name, ": ", strerror(errno)));
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

int ExitCodeOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

bool SaysFailure(const std::string& line) {
  const std::string lower = absl::AsciiStrToLower(line);
  for (const char* word : {"error", "exception", "fatal", "failed", "abort", "killed"}) {
    if (absl::StrContains(lower, word)) return true;
  }
  return false;
}

// The environment entry that marks every process of one rank (inherited by its children, also
// those that leave its process group or session):
// "TRAINYARD_RANK_MARK=WORKER_PID/JOB/ATTEMPT/RANK".
std::string RankMark(const std::string& job_id, int attempt, int rank) {
  return absl::StrCat("TRAINYARD_RANK_MARK=", getpid(), "/", job_id, "/", attempt, "/", rank);
}

// Sends `sig` to every process whose environment holds `mark` (as /proc shows it: to this
// worker's account, or any with root). Returns how many it signalled. A process that cleared its
// environment is not found.
int SignalMarked(const std::string& mark, int sig) {
  int signalled = 0;
  const pid_t self = getpid();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    pid_t pid = 0;
    if (!absl::SimpleAtoi(name, &pid) || pid <= 1 || pid == self) continue;
    const int fd = open(absl::StrCat("/proc/", name, "/environ").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    std::string environ_text;
    char buf[4096];
    ssize_t n;
    while (environ_text.size() < (1 << 20) && (n = read(fd, buf, sizeof(buf))) > 0) {
      environ_text.append(buf, static_cast<size_t>(n));
    }
    close(fd);
    // Entries are NUL-separated: match a whole one.
    const std::string whole = absl::StrCat(std::string(1, '\0'), mark, std::string(1, '\0'));
    if ((absl::StartsWith(environ_text, mark + std::string(1, '\0')) ||
         environ_text.find(whole) != std::string::npos) &&
        kill(pid, sig) == 0) {
      ++signalled;
    }
  }
  return signalled;
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

}  // namespace

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

RankSupervisor::RankSupervisor(SupervisorOptions options, std::function<void(v1::NodeMessage)> send)
    : options_(std::move(options)),
      send_(std::move(send)),
      supervisor_([this] { SupervisorLoop(); }) {}

RankSupervisor::~RankSupervisor() {
  StopAll();
  supervisor_.join();
  absl::MutexLock lock(&mu_);
  for (auto& t : finished_readers_) t.join();
}

void RankSupervisor::Launch(const v1::Assignment& assignment) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  launches_.push_back(assignment);
}

void RankSupervisor::Stop(const std::string& job_id, int attempt) {
  std::vector<RankKey> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, rank] : ranks_) {
      if (std::get<0>(key) != job_id || (attempt != 0 && std::get<1>(key) != attempt)) continue;
      if (rank.stopping) continue;
      rank.stopping = true;
      rank.kill_at = absl::Now() + options_.stop_grace;
      kill(-rank.pid, SIGTERM);
      SignalMarked(RankMark(std::get<0>(key), std::get<1>(key), std::get<2>(key)), SIGTERM);
    }
    // A launch still queued for that attempt is dropped.
    for (auto it = launches_.begin(); it != launches_.end();) {
      const v1::Assignment& a = *it;
      if (a.job_id() == job_id && (attempt == 0 || a.attempt() == attempt)) {
        for (int i = 0; i < a.device_indices_size(); ++i) {
          // Reported as ended, so a resend does not start it; a copy of an assignment whose
          // ranks already run is not reported (they report their own exit).
          const RankKey key{a.job_id(), a.attempt(), a.first_rank() + i};
          if (started_.insert(key).second) dropped.push_back(key);
        }
        it = launches_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Reported like any rank's end: the coordinator holds their devices until it hears of it.
  for (const RankKey& key : dropped) ReportExit(key, 128 + SIGTERM, "stopped before it started");
}

void RankSupervisor::StopAll() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  launches_.clear();
  for (auto& [key, rank] : ranks_) {
    if (rank.stopping) continue;
    rank.stopping = true;
    rank.kill_at = absl::Now() + options_.stop_grace;
    kill(-rank.pid, SIGTERM);
    SignalMarked(RankMark(std::get<0>(key), std::get<1>(key), std::get<2>(key)), SIGTERM);
  }
  auto all_exited = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ranks_.empty(); };
  mu_.Await(absl::Condition(&all_exited));
}

std::vector<v1::RankStatus> RankSupervisor::Running() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::RankStatus> out;
  auto add = [&out](const std::string& job_id, int attempt, int rank, int device,
                    v1::RankPhase phase) {
    v1::RankStatus& s = out.emplace_back();
    s.set_job_id(job_id);
    s.set_attempt(attempt);
    s.set_rank(rank);
    s.set_device(device);
    s.set_phase(phase);
  };
  for (const auto& [key, rank] : ranks_) {
    add(std::get<0>(key), std::get<1>(key), std::get<2>(key), rank.device, v1::RANK_RUNNING);
  }
  for (const v1::Assignment& a : launches_) {  // not started yet
    for (int i = 0; i < a.device_indices_size(); ++i) {
      add(a.job_id(), a.attempt(), a.first_rank() + i, a.device_indices(i), v1::RANK_STARTING);
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
  while (true) {
    absl::Time wake = absl::Now() + absl::Seconds(1);
    for (const auto& [key, rank] : ranks_) wake = std::min(wake, rank.kill_at);
    auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !launches_.empty() || !finished_readers_.empty() || (stopping_ && ranks_.empty());
    };
    mu_.AwaitWithDeadline(absl::Condition(&has_work), wake);

    while (!launches_.empty()) {
      const v1::Assignment a = launches_.front();
      launches_.pop_front();
      for (int i = 0; i < a.device_indices_size(); ++i) {
        Start(a, a.first_rank() + i, a.device_indices(i));
      }
    }
    const absl::Time now = absl::Now();
    for (auto& [key, rank] : ranks_) {
      if (rank.kill_at <= now) {
        kill(-rank.pid, SIGKILL);
        SignalMarked(RankMark(std::get<0>(key), std::get<1>(key), std::get<2>(key)), SIGKILL);
        rank.kill_at = absl::InfiniteFuture();
      }
    }
    std::vector<std::thread> done;
    done.swap(finished_readers_);
    if (!done.empty()) {
      mu_.Unlock();
      for (auto& t : done) t.join();
      mu_.Lock();
    }
    if (stopping_ && ranks_.empty() && launches_.empty()) break;
  }
}

void RankSupervisor::Start(const v1::Assignment& a, int rank, int device) {
  const RankKey key{a.job_id(), a.attempt(), rank};
  // Assignments arrive at least once: the coordinator resends them when a session opens, which
  // can cross the first send. A rank of an attempt runs once, even when it has already ended.
  if (!started_.insert(key).second) return;
  if (!options_.gpu_uuids.empty() &&
      (device < 0 || device >= static_cast<int>(options_.gpu_uuids.size()))) {
    ReportExit(key, 127, absl::StrCat("no GPU with index ", device, " on this worker"));
    return;
  }

  // The account that runs the rank: the owner's, when this worker runs as root.
  std::optional<UnixAccount> account;
  if (options_.run_as != nullptr) {
    auto found = options_.run_as->AccountFor(a.owner());
    if (!found.ok()) {
      ReportExit(key, 126, std::string(found.status().message()));
      return;
    }
    if (options_.run_as->switches()) account = *std::move(found);
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
  if (account.has_value()) chmod(dir.c_str(), 0711);  // others may pass, not list
  const std::string spec_path = dir + "/spec.pb";
  const std::string checkpoint_dir =
      a.checkpoint_dir().empty() ? absl::StrCat(options_.work_dir, "/", a.job_id(), "/checkpoints")
                                 : a.checkpoint_dir();
  fs::create_directories(checkpoint_dir, ec);
  const UnixAccount* owner = account.has_value() ? &*account : nullptr;
  for (absl::Status s : {WriteOwnedFile(spec_path, a.spec(), owner), GiveFolder(work, owner),
                         GiveFolder(checkpoint_dir, owner)}) {
    if (!s.ok()) {
      ReportExit(key, 126, std::string(s.message()));
      return;
    }
  }

  v1::JobSpec spec;
  if (!spec.ParseFromString(a.spec())) {
    ReportExit(key, 126, "the assignment's spec is unreadable");
    return;
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
  context.set_local_world_size(a.device_indices_size());
  context.set_device(options_.gpu_uuids.empty() ? "cpu" : "cuda");
  context.set_coordinator_address(a.coordinator_address());
  context.set_checkpoint_dir(checkpoint_dir);
  context.set_threads(options_.threads_per_rank);
  *context.mutable_ps_ranges() = a.ps_ranges();
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
      absl::StrCat("LOCAL_WORLD_SIZE=", a.device_indices_size()),
      // The attempt's credential for the rendezvous and reports: environment only, never argv.
      absl::StrCat(kJobCredentialEnv, "=", a.job_credential()),
      absl::StrCat(kTlsCaEnv, "=", options_.tls_ca)};
  Exec(a, key, device, account, std::move(argv), std::move(env), work);
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
    const bool single_node = a.world_size() == a.device_indices_size();
    master_port = single_node || a.master_port() == 0 ? FreeLocalPort() : a.master_port();
  }
  if (a.world_size() == a.device_indices_size()) master_addr = "127.0.0.1";
  std::vector<std::string> env = {
      absl::StrCat("RANK=", rank),
      absl::StrCat("LOCAL_RANK=", rank - a.first_rank()),
      absl::StrCat("WORLD_SIZE=", a.world_size()),
      absl::StrCat("LOCAL_WORLD_SIZE=", a.device_indices_size()),
      absl::StrCat("GROUP_RANK=", a.group_rank()),
      absl::StrCat("MASTER_ADDR=", master_addr),
      absl::StrCat("MASTER_PORT=", master_port),
      absl::StrCat("TORCHELASTIC_RESTART_COUNT=", a.attempt() - 1),
      absl::StrCat("TORCHELASTIC_RUN_ID=", a.job_id()),
      absl::StrCat("CUDA_VISIBLE_DEVICES=",
                   options_.gpu_uuids.empty() ? "" : options_.gpu_uuids[device]),
      absl::StrCat("TRAINYARD_JOB_ID=", a.job_id()),
      absl::StrCat("TRAINYARD_ATTEMPT=", a.attempt()),
      absl::StrCat("TRAINYARD_RANK=", rank),
      absl::StrCat("TRAINYARD_WORLD_SIZE=", a.world_size()),
      absl::StrCat("TRAINYARD_DEVICE=", device),
      absl::StrCat("TRAINYARD_CHECKPOINT_DIR=", checkpoint_dir),
      absl::StrCat("TRAINYARD_COORDINATOR=", a.coordinator_address()),
      absl::StrCat(kJobCredentialEnv, "=", a.job_credential()),
      absl::StrCat(kTlsCaEnv, "=", options_.tls_ca)};
  for (const auto& [name, value] : spec.env()) env.push_back(absl::StrCat(name, "=", value));
  // torchrun's default: one thread per rank unless the program or the spec says otherwise.
  if (spec.env().count("OMP_NUM_THREADS") == 0) {
    env.push_back(absl::StrCat("OMP_NUM_THREADS=", options_.threads_per_rank));
  }
  // The program as the spec names it; a bare name is looked up in the PATH the rank gets.
  std::vector<std::string> argv(spec.command().begin(), spec.command().end());
  if (argv[0].find('/') == std::string::npos) {
    std::string path = "/usr/local/bin:/usr/bin:/bin";
    auto in_env = [&](const std::vector<std::string>& entries) {
      for (const std::string& e : entries) {
        if (absl::StartsWith(e, "PATH=")) return std::optional<std::string>(e.substr(5));
      }
      return std::optional<std::string>();
    };
    if (auto p = in_env(env); p.has_value()) {
      path = *p;
    } else if (const char* own = getenv("PATH"); own != nullptr) {
      path = own;
    }
    std::string found;
    for (absl::string_view d : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      const std::string candidate = absl::StrCat(d, "/", argv[0]);
      if (access(candidate.c_str(), X_OK) == 0) {
        found = candidate;
        break;
      }
    }
    if (found.empty()) {
      ReportExit(key, 127,
                 absl::StrCat("command[0]: '", argv[0], "' is not in the PATH (", path, ")"));
      return;
    }
    argv[0] = found;
  }
  Exec(a, key, device, account, std::move(argv), std::move(env),
       spec.workdir().empty() ? work : spec.workdir());
}

void RankSupervisor::Exec(const v1::Assignment& a, const RankKey& key, int device,
                          const std::optional<UnixAccount>& account, std::vector<std::string> argv,
                          std::vector<std::string> env, const std::string& cwd) {
  if (account.has_value()) {
    env.push_back("USER=" + account->name);
    env.push_back("LOGNAME=" + account->name);
    env.push_back("HOME=" + account->home);
  }
  env.push_back(RankMark(std::get<0>(key), std::get<1>(key), std::get<2>(key)));
  const size_t own = env.size();
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    // The worker's own node token stays with the worker.
    if (entry.substr(0, entry.find('=')) == kTokenEnv) continue;
    const bool overridden = std::any_of(env.begin(), env.begin() + own, [&](const std::string& o) {
      return entry.substr(0, entry.find('=') + 1) == o.substr(0, o.find('=') + 1);
    });
    if (!overridden) env.emplace_back(entry);
  }
  std::vector<char*> c_argv, c_env;
  for (auto& s : argv) c_argv.push_back(s.data());
  c_argv.push_back(nullptr);
  for (auto& s : env) c_env.push_back(s.data());
  c_env.push_back(nullptr);

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    ReportExit(key, 127, absl::StrCat("cannot create a pipe: ", strerror(errno)));
    return;
  }
  sigset_t no_signals;
  sigemptyset(&no_signals);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    // The worker blocks SIGTERM and SIGINT (a thread waits for them) and exec keeps a blocked
    // mask: unblocked, or the rank's graceful stop on SIGTERM would never run.
    sigprocmask(SIG_SETMASK, &no_signals, nullptr);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    close_range(3, ~0U, 0);  // nothing else of the worker's (sockets, driver files) leaks in
    if (account.has_value() && (setgroups(account->groups.size(), account->groups.data()) != 0 ||
                                setgid(account->gid) != 0 || setuid(account->uid) != 0)) {
      const char msg[] = "cannot switch to the job owner's Unix account\n";
      (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
      _exit(126);
    }
    // A change of credentials clears the parent-death signal: set it again.
    if (account.has_value()) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
    }
    if (chdir(cwd.c_str()) != 0) {
      const char msg[] = "cannot enter the working directory (workdir)\n";
      (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
      _exit(127);
    }
    execve(c_argv[0], c_argv.data(), c_env.data());
    const char msg[] = "cannot execute the program\n";
    (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
    _exit(127);
  }
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    ReportExit(key, 127, absl::StrCat("fork: ", strerror(errno)));
    return;
  }
  setpgid(pid, pid);
  Rank& r = ranks_[key];
  r.pid = pid;
  r.device = device;
  r.reader = std::thread([this, key, fd = fds[0], pid] { ReadOutput(key, fd, pid); });

  v1::NodeMessage m;
  auto* s = m.mutable_rank_status();
  s->set_job_id(a.job_id());
  s->set_attempt(a.attempt());
  s->set_rank(std::get<2>(key));
  s->set_phase(v1::RANK_RUNNING);
  send_(m);
}

void RankSupervisor::ReadOutput(RankKey key, int fd, pid_t pid) {
  const auto& [job_id, attempt, rank] = key;
  // Readable by the worker's account only (a rank's output may hold its owner's data).
  const std::string log_path =
      absl::StrCat(options_.work_dir, "/", job_id, "/attempt-", attempt, "/rank-", rank, ".log");
  if (const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
      fd >= 0) {
    close(fd);
  }
  std::ofstream log(log_path, std::ios::app);
  std::deque<std::string> last;
  std::string partial;
  char buf[8192];
  auto flush = [&](std::vector<std::string>& lines) {
    if (lines.empty()) return;
    v1::NodeMessage m;
    auto* l = m.mutable_logs();
    l->set_job_id(job_id);
    l->set_attempt(attempt);
    l->set_rank(rank);
    for (auto& line : lines) l->add_lines(std::move(line));
    lines.clear();
    send_(m);
  };
  auto take = [&](std::string line, std::vector<std::string>& batch) {
    log << line << "\n";  // the rank's bytes as they came
    // The coordinator's messages carry text: a rank may print any bytes (a byte-level model's
    // sample), and one invalid UTF-8 line would fail the whole session's stream.
    line = ValidUtf8(std::move(line));
    last.push_back(line);
    if (static_cast<int>(last.size()) > options_.failure_log_lines) last.pop_front();
    batch.push_back(std::move(line));
  };
  // Until the pipe's end: when the rank itself has exited but something it left behind (a child
  // in another process group or session) still holds the pipe, that is stopped, so that the
  // rank's end is reported.
  // A holder that cannot be found (it cleared its environment) is left the pipe: what it writes
  // after the rank's end is not read beyond a few seconds.
  const std::string mark = RankMark(job_id, attempt, rank);
  bool exited = false;
  absl::Time stop_reading = absl::InfiniteFuture();
  int wait_status = 0;
  while (absl::Now() < stop_reading) {
    pollfd pfd{fd, POLLIN, 0};
    const int ready = poll(&pfd, 1, 250);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      if (!exited && waitpid(pid, &wait_status, WNOHANG) == pid) {
        exited = true;
        stop_reading = absl::Now() + absl::Seconds(5);
        kill(-pid, SIGKILL);
        SignalMarked(mark, SIGKILL);
      }
      continue;
    }
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    partial.append(buf, static_cast<size_t>(n));
    std::vector<std::string> batch;
    size_t start = 0, nl;
    while ((nl = partial.find('\n', start)) != std::string::npos) {
      take(partial.substr(start, nl - start), batch);
      start = nl + 1;
    }
    partial.erase(0, start);
    flush(batch);
    log.flush();
  }
  std::vector<std::string> batch;
  if (!partial.empty()) take(partial, batch);
  flush(batch);
  close(fd);

  while (!exited && waitpid(pid, &wait_status, 0) < 0 && errno == EINTR) {
  }
  kill(-pid, SIGKILL);          // anything the rank left behind in its group
  SignalMarked(mark, SIGKILL);  // or outside it (a daemon that closed its output)
  RemoveSharedMemoryOf(pid);
  const int code = ExitCodeOf(wait_status);
  ReportExit(key, code,
             code == 0 ? "" : FailureMessage(std::vector<std::string>(last.begin(), last.end())));
  absl::MutexLock lock(&mu_);
  auto it = ranks_.find(key);
  if (it != ranks_.end()) {
    finished_readers_.push_back(std::move(it->second.reader));
    ranks_.erase(it);
  }
}

void RankSupervisor::ReportExit(const RankKey& key, int exit_code, const std::string& message) {
  v1::NodeMessage m;
  auto* s = m.mutable_rank_status();
  s->set_job_id(std::get<0>(key));
  s->set_attempt(std::get<1>(key));
  s->set_rank(std::get<2>(key));
  s->set_phase(v1::RANK_EXITED);
  s->set_exit_code(exit_code);
  s->set_message(message);
  send_(m);
}

}  // namespace trainyard::worker
