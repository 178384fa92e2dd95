// trainyard-worker: the node daemon of a GPU (or CPU) host. Parses flags, runs a WorkerDaemon until
// SIGTERM or SIGINT, then stops every rank it started (no orphans) and exits. On SIGUSR2 it exits
// leaving its ranks running, for the next worker on the same work directory to adopt (an
// upgrade). Run with --shepherd first, it is a rank's shepherd (shepherd.h) instead.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <thread>

#include <CLI/CLI.hpp>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/cli_checks.h"
#include "common/credentials.h"
#include "common/log_text.h"
#include "common/metrics_endpoint.h"
#include "common/server_main.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "common/units.h"
#include "common/version.h"
#include "worker/daemon/cuda_devices.h"
#include "worker/daemon/device_filter.h"
#include "worker/daemon/job_context.h"
#include "worker/daemon/nvml.h"
#include "worker/daemon/private_tmp.h"
#include "worker/daemon/shepherd.h"
#include "worker/daemon/worker_daemon.h"

extern char** environ;

namespace {

// The devices `trainer` can train on, from `trainyard-trainer --supported-devices` ("cpu", or
// "cpu cuda" for a trainer built with a CUDA path). An error when it cannot run, fails, or does
// not answer within a minute.
absl::StatusOr<std::vector<std::string>> TrainerDevices(const std::string& trainer) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t no_signals;
  sigemptyset(&no_signals);
  posix_spawnattr_setsigmask(&attr, &no_signals);  // not the worker's blocked SIGTERM
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  std::string path = trainer, flag = "--supported-devices";
  char* argv[] = {path.data(), flag.data(), nullptr};
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, path.c_str(), &actions, &attr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (spawned != 0) {
    close(fds[0]);
    return absl::FailedPreconditionError(absl::StrCat("cannot run it: ", std::strerror(spawned)));
  }
  std::string out;
  bool timed_out = false;
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (true) {
    pollfd p = {fds[0], POLLIN, 0};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (ms <= 0 || (poll(&p, 1, ms) == 0)) {
      timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    char buf[256];
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, n);
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) return absl::DeadlineExceededError("--supported-devices: no answer in a minute");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--supported-devices: ", WIFEXITED(status)
                                     ? absl::StrCat("exit code ", WEXITSTATUS(status))
                                     : absl::StrCat("killed by signal ", WTERMSIG(status))));
  }
  return std::vector<std::string>(absl::StrSplit(out, absl::ByAnyChar(" \n"), absl::SkipEmpty()));
}

// What main reads from its flags beyond WorkerOptions' own fields.
struct Flags {
  std::string work_dir, stop_grace = "10s", max_stop_grace, metrics_address, gpus = "auto",
                        cuda_library = "libcuda.so.1", nvml_library = "libnvidia-ml.so.1";
  int threads_per_slot = 0;
  std::string user_map, rank_env = absl::StrJoin(trainyard::worker::DefaultRankEnv(), ",");
  std::string cgroups_mode = "auto", memory_per_slot;
  bool require_cgroups = false, private_tmp = false;
  double cpus_per_slot = 0;
  int64_t pids_per_rank = 8192;
  std::string gpu_device_files = "/dev/nvidia%d";
  double host_cpus = 0;
  std::string reserved_memory = "1GiB";
  std::string rank_log_keep = "1GiB";
  std::string keep_ended_attempts = "24h";
  std::string metrics_token_file, token_file;
  bool metrics_tls = false, metrics_insecure = false;
};

// The worker's flags: a table of what each one sets.
void AddFlags(CLI::App& app, Flags& f, trainyard::worker::WorkerOptions& options) {
  app.set_version_flag("--version", std::string("trainyard-worker ") + trainyard::kVersion);
  app.add_option("--coordinator", options.coordinator,
                 "coordinator HOST:PORT, or every replica's HOST:PORT,HOST:PORT (env "
                 "TRAINYARD_COORDINATOR)")
      ->capture_default_str();
  app.add_option("--node-id", options.node_id, "stable name of this node")->capture_default_str();
  app.add_option("--address", options.address,
                 "where other nodes reach this node's ranks (their Gloo transport; command jobs' "
                 "MASTER_ADDR when rank 0 runs here); default: this host's address toward the "
                 "coordinator");
  app.add_option("--cpu-slots", options.cpu_slots, "CPU slots offered (one rank each)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--gpus", f.gpus,
                 "auto: this host's CUDA GPUs if the trainer can train on them, else --cpu-slots; "
                 "all: every GPU the CUDA driver shows (it applies CUDA_VISIBLE_DEVICES); none: "
                 "CPU slots only")
      ->check(CLI::IsMember({"auto", "all", "none"}))
      ->capture_default_str();
  app.add_option("--nvml-library", f.nvml_library,
                 "the NVML library to read each GPU's utilization, memory and temperature with "
                 "(\"\": none)")
      ->capture_default_str();
  app.add_option("--cuda-library", f.cuda_library, "the CUDA driver library to list GPUs with")
      ->capture_default_str();
  app.add_option("--threads-per-slot", f.threads_per_slot,
                 "threads of each rank (default: cores / devices)");
  app.add_option("--work-dir", f.work_dir,
                 "spec files and rank logs (default ~/.trainyard/worker-NODE_ID)");
  app.add_option("--trainer", options.supervisor.trainer_path, "the trainyard-trainer binary")
      ->capture_default_str();
  app.add_option("--stop-grace", f.stop_grace,
                 "SIGTERM to SIGKILL delay when stopping a rank of a job that sets no stop_grace "
                 "(at most a day; the coordinator holds a stopping rank's device that long)")
      ->capture_default_str();
  app.add_option("--max-stop-grace", f.max_stop_grace,
                 "the most a job's own stop_grace gets on this node (at least --stop-grace; "
                 "default: 10m, or --stop-grace when that is longer)");
  app.add_option("--metrics-address", f.metrics_address,
                 "HOST:PORT of the Prometheus /metrics endpoint (port 0: a free one, printed "
                 "on stdout)");
  app.add_option("--user-map", f.user_map,
                 "file of \"USER ACCOUNT\" lines: the Unix account that runs each trainyard "
                 "user's ranks (default: the account of the same name). As root the worker runs "
                 "every rank as its owner's account; otherwise it takes only the jobs of the "
                 "users mapped to its own account (and of the user of its name)");
  app.add_option("--rank-env", f.rank_env,
                 "this worker's environment variables that reach its ranks: comma-separated "
                 "names, or prefixes ending in '*' (never its node token). Ranks start from a "
                 "fixed base (PATH, LANG, TZ, HOME, USER, LOGNAME, SHELL of the owner), then "
                 "these, then trainyard's and torchrun's variables, then the spec's env; empty: "
                 "none of the worker's")
      ->capture_default_str();
  app.add_option("--cgroups", f.cgroups_mode,
                 "auto: each rank in a cgroup of its own under the worker's, held to the limits "
                 "below and ended whole (cgroup v2 with a delegated subtree, or v1), else ranks "
                 "run unconfined and the worker says why; require: refuse to start without "
                 "them; off: never")
      ->check(CLI::IsMember({"auto", "require", "off"}))
      ->capture_default_str();
  app.add_flag("--require-cgroups", f.require_cgroups, "the same as --cgroups require");
  app.add_flag("--private-tmp", f.private_tmp,
               "each attempt's ranks on this node get a /tmp, a /dev/shm and SysV IPC of their "
               "own, in mount and IPC namespaces of the attempt's, shared by its ranks here and "
               "gone when they end (Slurm's job_container/tmpfs); takes a worker running as "
               "root, and a work directory, trainer and TLS CA outside /tmp and /dev/shm");
  app.add_flag("--keep-work-folders", options.supervisor.keep_work_folders,
               "keep each attempt's folders whole (its work folder: its unpacked context, what "
               "its ranks wrote there) once its ranks here have ended; by default the work "
               "folder is emptied, as its owner, and removed, and the rest goes after "
               "--keep-ended-attempts");
  app.add_option("--keep-ended-attempts", f.keep_ended_attempts,
                 "how long an ended attempt's folder (its spec, its ranks' logs, which the "
                 "coordinator holds) stays on this node once unchanged (24h, 30m; inf: for good)")
      ->capture_default_str();
  app.add_option("--rank-log-keep", f.rank_log_keep,
                 "what of each rank's log stays on this node's disk once sent on to the "
                 "coordinator: its last so many bytes (1GiB, 256MiB; 0: all of it)")
      ->capture_default_str();
  app.add_option("--memory-per-slot", f.memory_per_slot,
                 "each rank's memory limit (16GiB, 512MiB; as Slurm's DefMemPerGPU): a rank "
                 "past it is OOM-killed and its job fails saying so; default each device's share "
                 "of the memory (with cgroups); none: no limit");
  app.add_option("--cpus-per-slot", f.cpus_per_slot,
                 "each rank's CPU quota, in CPUs (1.5: one and a half; as DefCpuPerGPU); "
                 "default none")
      ->check(trainyard::NonNegative());
  app.add_option("--gpu-device-files", f.gpu_device_files,
                 "each GPU's device file: a pattern with %d, the GPU's minor number by NVML (its "
                 "CUDA device number without NVML), or a comma list by CUDA device number; on "
                 "cgroup v1 a rank's devices cgroup denies those of the GPUs it was not given")
      ->capture_default_str();
  app.add_option("--cpus", f.host_cpus,
                 "CPUs the ranks may use together, as the scheduler counts them against jobs' "
                 "resources.cpus (default: the CPUs this worker may run on)")
      ->check(trainyard::Positive());
  app.add_option("--reserved-memory", f.reserved_memory,
                 "memory kept for the system and the worker: the ranks may use the rest, as the "
                 "scheduler counts it against jobs' resources.memory (as Slurm's MemSpecLimit)")
      ->capture_default_str();
  app.add_option("--pids-per-rank", f.pids_per_rank,
                 "processes and threads each rank may have (a fork bomb stops there; 0: none)")
      ->check(trainyard::NonNegative())
      ->capture_default_str();
  app.add_option("--tls-ca", options.tls.ca_file,
                 "CA (PEM) to verify the coordinator and parameter servers with; also given to "
                 "the ranks (env TRAINYARD_TLS_CA)")
      ->envname(trainyard::kTlsCaEnv);
  app.add_option("--tls-cert", options.tls.cert_file,
                 "client certificate (PEM) for a coordinator that asks for mutual TLS; its common "
                 "name must be --node-id");
  app.add_option("--tls-key", options.tls.key_file, "its private key (PEM)");
  app.add_option("--metrics-token-file", f.metrics_token_file,
                 "scrapes of /metrics need \"Authorization: Bearer <the file's token>\" (mode "
                 "0600)");
  app.add_flag("--metrics-tls", f.metrics_tls,
               "serve /metrics over TLS with --tls-cert/--tls-key (this node's certificate)");
  app.add_flag("--metrics-insecure", f.metrics_insecure,
               "serve /metrics on a non-loopback address without --metrics-token-file");
  app.add_option("--token-file", f.token_file,
                 "file holding this node's node token (yard admin token create --node NAME; "
                 "mode 0600); default: env TRAINYARD_TOKEN");
}

// The devices the worker offers, one rank each: its GPUs, else its CPU slots.
int DeviceCount(const trainyard::worker::WorkerOptions& options) {
  return options.gpus.empty() ? options.cpu_slots : static_cast<int>(options.gpus.size());
}

// The devices offered: the CUDA GPUs (--gpus all, or auto when the trainer trains on them), else
// CPU slots. An error only for --gpus all without GPUs.
absl::Status SettleDevices(const Flags& f, trainyard::worker::WorkerOptions& options) {
  if (f.gpus == "none") return absl::OkStatus();
  auto found = trainyard::worker::ListCudaDevices(f.cuda_library);
  if (f.gpus == "all" && (!found.ok() || found->empty())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--gpus all: ", found.ok() ? "the CUDA driver shows no GPU" : found.status().message()));
  }
  if (!found.ok()) {
    // No driver library is an ordinary CPU host; a driver that fails is worth a warning.
    const std::string why(found.status().message());
    if (absl::IsNotFound(found.status())) {
      spdlog::info("{}: offering CPU slots", why);
    } else {
      spdlog::warn("{}: offering CPU slots", why);
    }
  } else if (f.gpus == "all") {
    options.gpus = *std::move(found);
  } else if (!found->empty()) {
    auto trainer_devices = TrainerDevices(options.supervisor.trainer_path);
    if (trainer_devices.ok() && absl::c_linear_search(*trainer_devices, "cuda")) {
      options.gpus = *std::move(found);
    } else {
      spdlog::warn(
          "{} CUDA GPU(s) here, but {} {}: offering {} CPU slot(s) (--gpus all offers the GPUs "
          "anyway)",
          found->size(), options.supervisor.trainer_path,
          trainer_devices.ok()
              ? absl::StrCat("trains on [", absl::StrJoin(*trainer_devices, ", "), "] only")
              : absl::StrCat("did not say which devices it trains on (",
                             trainer_devices.status().message(), ")"),
          options.cpu_slots);
    }
  }
  return absl::OkStatus();
}

// Whose ranks this worker runs and as whom, its TLS and its node token.
absl::Status SettleIdentity(const Flags& f, trainyard::worker::WorkerOptions& options) {
  auto run_as = trainyard::worker::RunAs::Create(f.user_map, geteuid() == 0);
  if (!run_as.ok()) return run_as.status();
  options.supervisor.run_as = std::make_shared<const trainyard::worker::RunAs>(*std::move(run_as));
  if (options.supervisor.run_as->switches()) {
    spdlog::info("running as root: each rank runs as its job owner's Unix account");
  } else {
    spdlog::info("not running as root: taking the jobs of {} only",
                 absl::StrJoin(options.supervisor.run_as->Owners(), ", "));
  }
  // The node token, once the devices are settled (their errors come first).
  if (auto tls = trainyard::MakeChannelCredentials(options.tls); !tls.ok()) return tls.status();
  options.supervisor.tls_ca = options.tls.ca_file;
  options.supervisor.coordinators = options.coordinator;
  auto token = trainyard::FindNodeToken(f.token_file, !options.tls.cert_file.empty());
  if (!token.ok()) return token.status();
  options.token = *std::move(token);
  return absl::OkStatus();
}

// The devices controller's rule for a character device file: "c 195:0 rwm".
std::string DeviceRule(const struct stat& st) {
  return absl::StrCat("c ", major(st.st_rdev), ":", minor(st.st_rdev), " rwm");
}

// Each GPU's device file, for the devices controller (v1) or a device program (v2) to deny the
// others' to a rank.
void SettleGpuDeviceRules(const Flags& f, const trainyard::worker::CgroupHost& host,
                          trainyard::worker::WorkerOptions& options) {
  if (options.gpus.empty()) return;
  if (host.version == 2) {
    // No devices controller on v2: a BPF program on each rank's cgroup (device_filter.h).
    if (absl::Status s = trainyard::worker::CheckDeviceFilters(); !s.ok()) {
      spdlog::warn("GPUs are confined by CUDA_VISIBLE_DEVICES only: {}", std::string(s.message()));
      return;
    }
  } else if (host.parents.count("devices") == 0) {
    spdlog::warn("GPUs are confined by CUDA_VISIBLE_DEVICES only: no cgroup v1 devices controller");
    return;
  }
  const std::vector<std::string> listed = absl::StrSplit(f.gpu_device_files, ',');
  const bool pattern = absl::StrContains(f.gpu_device_files, "%d");
  if (pattern && options.nvml == nullptr &&
      (std::getenv("CUDA_VISIBLE_DEVICES") != nullptr ||
       std::getenv("CUDA_DEVICE_ORDER") != nullptr)) {
    spdlog::warn(
        "without NVML, GPU device files are numbered by CUDA's ordinals, which "
        "CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER renumber: a rank's devices cgroup may allow "
        "another GPU's file (list them with --gpu-device-files)");
  }
  // Each GPU's minor number by NVML, which names its device file whatever CUDA's numbering;
  // CUDA's ordinals for all where NVML cannot say for one (never the two mixed).
  std::vector<int> numbers;
  for (size_t i = 0; i < options.gpus.size(); ++i) numbers.push_back(static_cast<int>(i));
  if (pattern && options.nvml != nullptr) {
    std::vector<int> minors;
    for (size_t i = 0; i < options.gpus.size(); ++i) {
      auto minor = options.nvml->MinorNumber(options.gpus[i].uuid);
      if (!minor.ok()) {
        spdlog::warn("GPU {}: {}; the GPUs' device files taken by CUDA device number", i,
                     std::string(minor.status().message()));
        break;
      }
      minors.push_back(*minor);
    }
    if (minors.size() == numbers.size()) numbers = minors;
  }
  for (size_t i = 0; i < options.gpus.size(); ++i) {
    const std::string file =
        pattern ? absl::StrReplaceAll(f.gpu_device_files, {{"%d", absl::StrCat(numbers[i])}})
                : (i < listed.size() ? listed[i] : "");
    struct stat st;
    if (file.empty() || stat(file.c_str(), &st) != 0 || !S_ISCHR(st.st_mode)) {
      spdlog::warn("GPU {}: no device file {}: its ranks are confined by CUDA_VISIBLE_DEVICES only",
                   i, file.empty() ? "named" : file);
      options.supervisor.gpu_device_rules.clear();
      return;
    }
    options.supervisor.gpu_device_rules.push_back(DeviceRule(st));
  }
  // The host's other GPUs (another worker's, or none's): denied to every rank, after this
  // worker's own rules (a rank's device is one of those).
  int others = 0;
  for (int n = 0; pattern && n < 256; ++n) {
    if (std::find(numbers.begin(), numbers.end(), n) != numbers.end()) continue;
    const std::string file = absl::StrReplaceAll(f.gpu_device_files, {{"%d", absl::StrCat(n)}});
    struct stat st;
    if (stat(file.c_str(), &st) != 0 || !S_ISCHR(st.st_mode)) continue;
    options.supervisor.gpu_device_rules.push_back(DeviceRule(st));
    ++others;
  }
  spdlog::info(
      "each rank may open only its own GPU's device file ({}; {} other GPU(s) of the host "
      "denied to all)",
      f.gpu_device_files, others);
}

// The ranks' cgroups and limits: detected, and this worker's folder made in each hierarchy.
absl::Status SettleCgroups(const Flags& f, trainyard::worker::WorkerOptions& options) {
  auto& supervisor = options.supervisor;
  supervisor.rank_limits.cpus = f.cpus_per_slot;
  supervisor.rank_limits.pids = f.pids_per_rank;
  if (!f.memory_per_slot.empty() && f.memory_per_slot != "none") {
    const std::optional<int64_t> bytes = trainyard::ParseBytes(f.memory_per_slot);
    if (!bytes.has_value() || *bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--memory-per-slot: '", f.memory_per_slot,
                                                     "' is not a size (such as 16GiB, 512MiB) "
                                                     "or none"));
    }
    supervisor.rank_limits.memory_bytes = *bytes;
  }
  // The worker's folder: its node and its work directory, so that two workers on one host (tests
  // run several named alike) never share one, and a restarted worker keeps its own.
  uint32_t work_hash = 2166136261u;  // FNV-1a
  for (unsigned char c : supervisor.work_dir) work_hash = (work_hash ^ c) * 16777619u;
  supervisor.cgroup_prefix =
      absl::StrCat("trainyard-", absl::StrReplaceAll(options.node_id, {{"/", "_"}, {".", "_"}}),
                   "-", absl::Hex(work_hash, absl::kZeroPad8));
  const std::string mode = f.require_cgroups ? "require" : f.cgroups_mode;
  if (mode == "off") {
    if (supervisor.rank_limits.memory_bytes > 0 || f.cpus_per_slot > 0) {
      return absl::InvalidArgumentError(
          "--memory-per-slot and --cpus-per-slot need cgroups (--cgroups auto or require)");
    }
    return absl::OkStatus();
  }
  trainyard::worker::CgroupHost host = trainyard::worker::DetectCgroups();
  if (const int swept = trainyard::worker::SweepEmptyCgroups(host); swept > 0) {
    spdlog::info("removed {} empty cgroup folder(s) that stopped workers left", swept);
  }
  for (const auto& [controller, parent] : host.parents) {
    const std::string mine = parent + "/" + supervisor.cgroup_prefix;
    std::error_code ec;
    std::filesystem::create_directories(mine, ec);
    // Made, or there already (an earlier worker of this work directory, perhaps root's):
    // whether this process may make the ranks' folders in it.
    const std::string probe = absl::StrCat(mine, "/.probe-", getpid());
    if (!ec && mkdir(probe.c_str(), 0755) != 0) {
      ec = std::error_code(errno, std::generic_category());
    }
    rmdir(probe.c_str());
    if (ec) {
      host.why = "cannot make the ranks' cgroups in " + mine + ": " + ec.message();
      host.version = 0;
      break;
    }
  }
  if (host.version == 0) host.parents.clear();
  if (host.version == 0 && mode == "require") {
    return absl::FailedPreconditionError(absl::StrCat("--cgroups require: ", host.why));
  }
  if (host.version == 0) {
    spdlog::warn("ranks are not confined: {}", trainyard::worker::DescribeCgroups(host));
  }
  SettleGpuDeviceRules(f, host, options);
  supervisor.cgroups = std::make_shared<const trainyard::worker::CgroupHost>(std::move(host));
  return absl::OkStatus();
}

// The host as the scheduler counts it beside the devices.
absl::Status SettleHost(const Flags& f, int devices, trainyard::worker::WorkerOptions& options) {
  const std::optional<int64_t> reserved = trainyard::ParseBytes(f.reserved_memory);
  if (!reserved.has_value() || *reserved < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--reserved-memory: '", f.reserved_memory,
                                                   "' is not a size (such as 1GiB, 512MiB)"));
  }
  const int64_t physical = trainyard::worker::PhysicalMemoryBytes();
  if (*reserved >= physical) {
    return absl::InvalidArgumentError(
        absl::StrCat("--reserved-memory: ", trainyard::HumanBytes(*reserved),
                     " leaves nothing of this host's ", trainyard::HumanBytes(physical)));
  }
  const auto& cgroups = options.supervisor.cgroups;
  auto& l = options.supervisor.rank_limits;
  const bool confined = cgroups != nullptr && cgroups->version != 0;
  // A rank is held to the memory the scheduler charges it: without --memory-per-slot, each
  // device's share (a job that asked for no memory had none: it could take the host's, and the
  // kernel's OOM killer then chose among every user's ranks). CPUs need no such default: each
  // rank's cgroup weighs the same, so a rank of many threads gets no more than one of few.
  if (confined && f.memory_per_slot.empty()) {
    l.memory_bytes = (physical - *reserved) / std::max(1, devices);
  }
  options.host = trainyard::worker::HostResourcesOf(
      f.host_cpus > 0 ? f.host_cpus : trainyard::worker::AffinityCpus(), physical - *reserved,
      devices, l,
      cgroups != nullptr ? trainyard::worker::DescribeCgroups(*cgroups) : "none: --cgroups off");
  if (confined) {
    spdlog::info(
        "each rank in a cgroup of its own: {}; per rank: memory {}{}, CPUs {}, pids {}",
        trainyard::worker::DescribeCgroups(*cgroups),
        l.memory_bytes > 0 ? trainyard::HumanBytes(l.memory_bytes) : "no limit",
        f.memory_per_slot.empty() ? " (each device's share; --memory-per-slot to choose)" : "",
        l.cpus > 0 ? absl::StrCat(l.cpus) : "an equal share",
        l.pids > 0 ? absl::StrCat(l.pids) : "no limit");
  }
  return absl::OkStatus();
}

// --private-tmp: the worker can make mount namespaces, and nothing it hands its ranks is under
// the folders they get private ones of.
absl::Status SettlePrivateTmp(const trainyard::worker::WorkerOptions& options) {
  if (!options.supervisor.run_as->switches()) {
    return absl::FailedPreconditionError(
        "--private-tmp: takes a worker running as root (it mounts each rank's /tmp and "
        "/dev/shm, then runs the rank as its owner)");
  }
  const std::string& trainer = options.supervisor.trainer_path;
  for (const auto& [flag, path] :
       {std::pair<const char*, std::string>{"--work-dir", options.supervisor.work_dir},
        {"--trainer", trainer.find('/') != std::string::npos ? trainer : ""},
        {"--tls-ca", options.tls.ca_file}}) {
    if (const std::string over = trainyard::worker::PrivateFolderOver(path, /*resolve_links=*/true);
        !over.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--private-tmp: ", flag, " ", path, " is under ", over,
                       ", which ranks get a private one of and would not see it there"));
    }
  }
  for (auto check : std::initializer_list<std::function<absl::Status()>>{
           trainyard::worker::CheckMountNamespaces,
           [&] {
             return trainyard::worker::PrepareNamespaceFolder(
                 trainyard::worker::NamespaceFolder(options.supervisor.work_dir));
           },
           [&] { return trainyard::worker::TryAttemptNamespaces(options.supervisor.work_dir); }}) {
    if (absl::Status s = check(); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("--private-tmp: ", s.message()));
    }
  }
  spdlog::info(
      "each attempt's ranks get a /tmp, a /dev/shm and SysV IPC of their own (--private-tmp)");
  return absl::OkStatus();
}

// Where other nodes reach this one's ranks: --address, else its address toward the coordinator,
// else its host name; and the interface holding it (command jobs' GLOO_SOCKET_IFNAME).
void SettleAddress(trainyard::worker::WorkerOptions& options) {
  if (options.address.empty()) {
    auto local = trainyard::worker::LocalAddressToward(options.coordinator);
    if (local.ok()) {
      options.address = *std::move(local);
      spdlog::info("address {}: this host's toward the coordinator (--address to choose)",
                   options.address);
    } else {
      spdlog::warn(
          "no address toward the coordinator ({}): other nodes reach this one by its "
          "host name (--address to choose)",
          std::string(local.status().message()));
    }
  }
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  options.supervisor.node_address = trainyard::worker::NodeHost(options.address, host);
  options.supervisor.node_interface =
      trainyard::worker::InterfaceWith(options.supervisor.node_address);
}

// Everything the flags say, settled into `options` in order: paths, devices, identity, the work
// directory, cgroups and the host. The first error, for main to print.
absl::Status Settle(Flags& f, trainyard::worker::WorkerOptions& options) {
  options.supervisor.rank_env = absl::StrSplit(f.rank_env, ',', absl::SkipWhitespace());
  // Ranks run in folders of their own: every path handed to them (or used after a chdir) is made
  // absolute here, so that a relative --tls-ca given to the worker means the same file to them.
  for (std::string* path : {&options.tls.ca_file, &options.tls.cert_file, &options.tls.key_file,
                            &f.work_dir, &f.token_file, &f.user_map}) {
    if (!path->empty() && path->front() != '/') *path = std::filesystem::absolute(*path).string();
  }
  std::string& trainer = options.supervisor.trainer_path;
  if (trainer.find('/') != std::string::npos && trainer.front() != '/') {
    trainer = std::filesystem::absolute(trainer).string();
  }
  auto grace = trainyard::ParseFlagDuration("--stop-grace", f.stop_grace);
  if (!grace.ok()) return grace.status();
  if (*grace > absl::Hours(24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stop-grace: ", f.stop_grace, " is over a day, the most a rank is given"));
  }
  options.supervisor.stop_grace = *grace;
  absl::Duration max_grace = std::max(absl::Minutes(10), *grace);
  if (!f.max_stop_grace.empty()) {
    auto given = trainyard::ParseFlagDuration("--max-stop-grace", f.max_stop_grace);
    if (!given.ok()) return given.status();
    if (*given > absl::Hours(24) || *given < *grace) {
      return absl::InvalidArgumentError(absl::StrCat("--max-stop-grace: ", f.max_stop_grace,
                                                     " must be at least --stop-grace (",
                                                     f.stop_grace, ") and at most a day"));
    }
    max_grace = *given;
  }
  options.supervisor.max_stop_grace = max_grace;
  RETURN_IF_ERROR(SettleDevices(f, options));
  RETURN_IF_ERROR(SettleIdentity(f, options));
  SettleAddress(options);
  for (const auto& gpu : options.gpus) {
    spdlog::info("GPU {}: {}, {}, {} MiB", gpu.ordinal, gpu.name, gpu.uuid, gpu.memory_bytes >> 20);
    options.supervisor.gpu_uuids.push_back(gpu.uuid);
  }
  if (!options.gpus.empty() && !f.nvml_library.empty()) {
    // Without NVML the GPUs still train; only their samples are missing.
    auto nvml = trainyard::worker::Nvml::Open(f.nvml_library);
    if (nvml.ok()) {
      options.nvml = *std::move(nvml);
    } else {
      spdlog::warn("{}: no GPU utilization, memory or temperature samples",
                   std::string(nvml.status().message()));
    }
  }
  const int devices = DeviceCount(options);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  options.supervisor.threads_per_rank =
      f.threads_per_slot > 0 ? f.threads_per_slot : std::max(1, cores / devices);
  if (f.work_dir.empty()) {
    const char* home = std::getenv("HOME");
    f.work_dir =
        std::string(home != nullptr ? home : ".") + "/.trainyard/worker-" + options.node_id;
  }
  std::error_code ec;
  // Made here: others may pass (to their ranks' folders), not list the jobs of this node.
  if (std::filesystem::create_directories(f.work_dir, ec) && geteuid() == 0) {
    chmod(f.work_dir.c_str(), 0711);
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("--work-dir: cannot create ", f.work_dir, ": ", ec.message()));
  }
  options.supervisor.work_dir = f.work_dir;
  const std::optional<int64_t> keep = trainyard::ParseBytes(f.rank_log_keep);
  if (!keep.has_value() || *keep < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--rank-log-keep: '", f.rank_log_keep,
                                                   "' is not a size (such as 1GiB, 256MiB, 0)"));
  }
  options.supervisor.log_keep_bytes = *keep;
  auto keep_ended = trainyard::ParseFlagDuration("--keep-ended-attempts", f.keep_ended_attempts);
  if (!keep_ended.ok()) return keep_ended.status();
  options.supervisor.keep_ended_attempts = *keep_ended;
  if (f.private_tmp) {
    RETURN_IF_ERROR(SettlePrivateTmp(options));
    options.supervisor.private_tmp = true;
  }
  RETURN_IF_ERROR(SettleCgroups(f, options));
  return SettleHost(f, devices, options);
}

// The /metrics endpoint of --metrics-address, if given; its address printed on stdout (scripts
// and tests read it there, as the servers' bound address).
absl::StatusOr<std::unique_ptr<trainyard::MetricsEndpoint>> StartMetrics(
    const Flags& f, const trainyard::worker::WorkerOptions& options,
    trainyard::worker::WorkerDaemon& daemon) {
  if (f.metrics_address.empty()) return nullptr;
  trainyard::MetricsEndpointOptions metrics_options;
  metrics_options.address = f.metrics_address;
  metrics_options.token_file = f.metrics_token_file;
  metrics_options.insecure = f.metrics_insecure;
  if (f.metrics_tls) {
    metrics_options.tls_cert_file = options.tls.cert_file;
    metrics_options.tls_key_file = options.tls.key_file;
  }
  auto endpoint = trainyard::MetricsEndpoint::Start(metrics_options, daemon.registry());
  if (!endpoint.ok()) return endpoint.status();
  std::printf("metrics %s\n", (*endpoint)->bound_address().c_str());
  std::fflush(stdout);
  return endpoint;
}

// The worker's cgroup folders, once its ranks' are gone (their shepherds remove those as the
// ranks end; a worker that leaves its ranks running for the next one leaves its folders too).
void RemoveCgroupFolders(const trainyard::worker::WorkerOptions& options) {
  if (options.supervisor.cgroups == nullptr) return;
  for (int i = 0; i < 20; ++i) {
    bool all = true;
    for (const auto& [controller, parent] : options.supervisor.cgroups->parents) {
      const std::string mine = parent + "/" + options.supervisor.cgroup_prefix;
      if (rmdir(mine.c_str()) != 0 && errno != ENOENT) all = false;
    }
    if (all) return;
    usleep(50000);
  }
}

// The worker holds a few descriptors for each rank (its log, its shepherd's socket): its soft
// limit on open files goes up to the hard one (systemd's default soft 1024 ran out at about 500
// ranks, and every launch on the node then failed). Ranks inherit the worker's limits
// (deploy/systemd/trainyard-worker.service sets them).
void RaiseOpenFileLimit() {
  struct rlimit files {};
  if (getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur >= files.rlim_max) return;
  const rlim_t was = files.rlim_cur;
  files.rlim_cur = files.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &files) == 0) {
    spdlog::info("open files: {} at most (was {})", files.rlim_cur, was);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], trainyard::worker::kShepherdFlag) == 0) {
    return trainyard::worker::RunShepherd(argc - 2, argv + 2);
  }
  if (argc > 1 && std::strcmp(argv[1], trainyard::worker::kUnpackContextFlag) == 0) {
    return trainyard::worker::RunUnpackContext(argc - 2, argv + 2);
  }
  trainyard::BlockTerminationSignals();
  {
    sigset_t upgrade;
    sigemptyset(&upgrade);
    sigaddset(&upgrade, SIGUSR2);
    pthread_sigmask(SIG_BLOCK, &upgrade, nullptr);
  }
  trainyard::worker::WorkerOptions options;
  const char* env = std::getenv("TRAINYARD_COORDINATOR");
  if (env != nullptr && *env != '\0') options.coordinator = env;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  options.node_id = host;
  std::error_code ec;
  const auto self_dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
  options.supervisor.trainer_path = (self_dir / "trainyard-trainer").string();

  CLI::App app{"trainyard-worker: runs trainer ranks on this host for a trainyard coordinator"};
  Flags flags;
  AddFlags(app, flags, options);
  trainyard::DecimalIntegers(app);
  CLI11_PARSE(app, argc, argv);
  trainyard::InstallEscapingLogger("worker");
  if (absl::Status s = Settle(flags, options); !s.ok()) {
    std::cerr << "trainyard-worker: " << s.message() << "\n";
    return 2;
  }
  RaiseOpenFileLimit();
  trainyard::worker::WorkerDaemon daemon(options);
  auto metrics = StartMetrics(flags, options, daemon);
  if (!metrics.ok()) {
    std::cerr << "trainyard-worker: " << metrics.status().message() << "\n";
    return 2;
  }
  std::thread signals([&daemon] {
    sigset_t set;
    sigemptyset(&set);
    for (int s : {SIGTERM, SIGINT, SIGUSR2}) sigaddset(&set, s);
    int sig = 0;
    sigwait(&set, &sig);
    if (sig == SIGUSR2) {
      spdlog::info("signal {}: exiting, leaving the ranks running for the next worker", sig);
      daemon.Shutdown(trainyard::worker::WorkerDaemon::kLeaveRanks);
    } else {
      spdlog::info("signal {}: shutting down", sig);
      daemon.Shutdown();
    }
  });
  const int devices = DeviceCount(options);
  spdlog::info("worker {} for {} ({} {}, {} thread(s) each, trainer {})", options.node_id,
               options.coordinator, devices, options.gpus.empty() ? "CPU slot(s)" : "CUDA GPU(s)",
               options.supervisor.threads_per_rank, options.supervisor.trainer_path);
  daemon.Run();
  RemoveCgroupFolders(options);
  spdlog::info("stopped");
  // The signal thread waits in sigwait; nothing more to clean up.
  signals.detach();
  return 0;
}
