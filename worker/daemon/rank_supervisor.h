// RankSupervisor: starts one process per assigned rank (trainyard-trainer, or a command job's
// program) under a shepherd of its own (shepherd.h), relays its output from its log line by line,
// reports its exit, and stops it on request (its shepherd: SIGTERM to its processes, SIGKILL after
// the grace). Ranks outlive the worker: Detach() leaves them to their shepherds, and the next
// supervisor on the same work directory adopts them (Adopt()).
//
// Thread-safe. Ranks start from the supervisor's own thread; one thread per rank follows its
// shepherd and its log.
#ifndef TRAINYARD_WORKER_DAEMON_RANK_SUPERVISOR_H_
#define TRAINYARD_WORKER_DAEMON_RANK_SUPERVISOR_H_

#include <sys/types.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "trainyard/v1/job.pb.h"
#include "trainyard/v1/node.pb.h"
#include "worker/daemon/attempt_folders.h"
#include "worker/daemon/cgroups.h"
#include "worker/daemon/job_context.h"
#include "worker/daemon/run_as.h"

namespace trainyard::worker {

// The worker's variables that reach ranks unless --rank-env says otherwise: how the operator set
// up libraries, collectives, threads and trainyard itself on this host (LD_LIBRARY_PATH, NCCL_*,
// GLOO_*, OMP_*, OPENBLAS_*, MKL_*, ONEDNN_*, DNNL_*, TRAINYARD_*), nothing else of its
// environment.
std::vector<std::string> DefaultRankEnv();

// The shepherd's own environment (it holds nothing of the job's): a fixed PATH, and the worker's
// LD_LIBRARY_PATH when it has one: the shepherd is trainyard-worker itself and finds its libraries
// as the worker did (a host whose gRPC or Abseil live outside the loader's default folders, as the
// GPU hosts' kit under /opt/kit). The operator's setting, not a job's.
std::vector<std::string> ShepherdEnvironment(const std::vector<std::string>& worker_env);
// This process's environment (environ), as NAME=VALUE entries.
std::vector<std::string> WorkerEnvironment();

// The coordinators a rank is given (TRAINYARD_COORDINATOR, RankContext.coordinator_address): the
// leader's list, then the addresses of `worker_list` it lacks. Both are comma-separated.
std::string RankCoordinatorList(const std::string& leader_list, const std::string& worker_list);

// The host where this node's ranks listen for ranks on other nodes (RankContext.node_address),
// from the worker's --address as the coordinator reads it for MASTER_ADDR (NodeRegistry::HostOf:
// both are common/host_port.h's HostOfAddress); without one, `host_name`.
std::string NodeHost(const std::string& address, const std::string& host_name);

// This host's address on the route toward `host_port` (HOST:PORT or [IPv6]:PORT; the first of a
// comma-separated list): the source address the kernel picks for it (a UDP socket connected there,
// nothing sent), as Ray finds a node's address. The worker's default --address, toward the
// coordinator: the address other nodes on that network reach this one at, where the host name
// may resolve to loopback (Debian's /etc/hosts). An error when the host does not resolve.
absl::StatusOr<std::string> LocalAddressToward(const std::string& host_port);

// The name of this host's network interface that holds `address` (a host name is resolved
// first), or "" when none does: a command job's GLOO_SOCKET_IFNAME across nodes.
std::string InterfaceWith(const std::string& address);

struct SupervisorOptions {
  std::string trainer_path;  // the trainyard-trainer binary
  std::string work_dir;      // per-attempt folders with the spec and each rank's log
  // What of each rank's log stays on this node's disk: its last log_keep_bytes once sent on to
  // the coordinator (the older bytes' blocks freed, the file's size kept); 0: all of it. So a
  // rank printing at GB/s holds about this much of the worker's disk, not what it printed.
  int64_t log_keep_bytes = int64_t{1} << 30;
  // Once every rank of an attempt on this worker has ended, the attempt's "work" and "errors"
  // folders (the unpacked context, what the ranks wrote there) are emptied as their owner and
  // removed, and its whole folder (spec, logs) goes once unchanged for keep_ended_attempts
  // (attempt_folders.h; InfiniteDuration: its spec and logs stay). keep_work_folders keeps all
  // of it (debugging, tests that read what a rank left).
  bool keep_work_folders = false;
  absl::Duration keep_ended_attempts = absl::Hours(24);
  // How long after an attempt ended here its ranks are remembered as started (an assignment of it
  // sent again starts none of them). A coordinator sends an ended attempt's assignment again only
  // while it has not heard of the end: within the node's lost timeout, minutes at most.
  absl::Duration forget_started_after = absl::Hours(24);
  // The worker's own coordinator list (--coordinator): ranks get the leader's list (its
  // --coordinators) and then these addresses it lacks, so that they follow a failover also where
  // the replicas were not given --coordinators.
  std::string coordinators;
  // Where this node's ranks listen for ranks on other nodes (RankContext.node_address): the host
  // of the worker's --address, else its host name.
  std::string node_address;
  // The network interface holding node_address (InterfaceWith), or "": a command job's
  // GLOO_SOCKET_IFNAME across nodes.
  std::string node_interface;
  int threads_per_rank = 1;  // torch / OpenMP threads of each rank
  // SIGTERM → SIGKILL for a job that sets no stop_grace_seconds, and the most one that does gets.
  absl::Duration stop_grace = absl::Seconds(10);
  absl::Duration max_stop_grace = absl::Minutes(10);
  int failure_log_lines = 8;  // last output lines sent with a failed rank's exit
  // UUIDs of the CUDA GPUs offered, by device index; empty: the devices are CPU slots. A rank on
  // a GPU sees only its own (CUDA_VISIBLE_DEVICES) and gets `--device cuda`; one on a CPU slot
  // sees none.
  std::vector<std::string> gpu_uuids;
  // The v1 devices-controller rule of each GPU's device file ("c 195:0 rwm"), by device index,
  // then those of the host's GPUs this worker does not have: a rank's cgroup denies all but its
  // own. Empty: not confined beyond CUDA_VISIBLE_DEVICES.
  std::vector<std::string> gpu_device_rules;
  // The program run as each rank's shepherd with kShepherdFlag: this worker's own binary.
  std::string shepherd_path = "/proc/self/exe";
  // Which account runs each rank (run_as.h); null: this process's own, for any owner.
  std::shared_ptr<const RunAs> run_as;
  // The CA ranks verify the coordinator and parameter servers with (TRAINYARD_TLS_CA); empty:
  // plaintext.
  std::string tls_ca;
  // Which of this worker's own environment variables reach its ranks: names, or prefixes ending
  // in '*' (the worker's --rank-env). Never its node token. See RankEnvironment.
  std::vector<std::string> rank_env = DefaultRankEnv();
  // Where each rank's cgroup is made (cgroups.h); null or version 0: ranks are not confined.
  std::shared_ptr<const CgroupHost> cgroups;
  // Each rank's (one device or CPU slot), unless its job asks for CPUs or memory
  // (RankLimits).
  CgroupLimits rank_limits;
  std::string cgroup_prefix = "trainyard";  // the ranks' folders: PREFIX/JOB/attempt-N/rank-R
  // Each attempt's ranks get a private /tmp, /dev/shm and IPC (private_tmp.h; the worker's
  // --private-tmp, which checks that it can).
  bool private_tmp = false;
  // Where jobs' contexts come from (job_context.h); null: a job with one fails to start here. They
  // are unpacked by shepherd_path run with kUnpackContextFlag.
  std::shared_ptr<ContextCache> contexts;
};

// How long a rank of `spec` gets between SIGTERM and SIGKILL on this worker: the spec's
// stop_grace_seconds, up to max_stop_grace, else stop_grace.
absl::Duration StopGrace(const v1::JobSpec& spec, const SupervisorOptions& options);

// A rank's environment, in this order, a later entry replacing an earlier one of the same name:
//  1. the documented base: PATH (the worker's, else /usr/local/bin:/usr/bin:/bin), LANG (the
//     worker's, else C.UTF-8), TZ (the worker's, if set), and HOME, USER, LOGNAME and SHELL of
//     `account`;
//  2. the variables of `worker_env` (NAME=VALUE entries, the worker's environment) that
//     `rank_env` names (names or prefixes ending in '*'), never TRAINYARD_TOKEN or
//     TRAINYARD_TOKEN_FILE;
//  3. `own`: trainyard's and torchrun's variables, then the spec's env (whose names the spec's
//     validation keeps apart from trainyard's).
std::vector<std::string> RankEnvironment(const UnixAccount& account,
                                         const std::vector<std::string>& worker_env,
                                         const std::vector<std::string>& rank_env,
                                         const std::vector<std::string>& own);

// A rank's cgroup limits: `node` (the worker's per-slot ones), with the CPUs and memory its job
// asks for in `resources` in their place; ranks that share a slot (resources.ranks_per_node)
// share its defaults evenly.
CgroupLimits RankLimits(const CgroupLimits& node, const v1::Resources& resources);

// The rules of `rules` (by device index) but the one of `device`: the GPUs a rank on `device` may
// not open.
std::vector<std::string> DeniedDevices(const std::vector<std::string>& rules, int device);

// The message a failed rank's exit carries, from its last output lines: its cause first (the last
// line that says error, exception, fatal, failed or Traceback's last line, else the last non-empty
// line), so that `yard describe` and `yard wait` lead with it rather than with whatever the rank
// printed first (a start-up banner); then the lines themselves, for context.
std::string FailureMessage(const std::vector<std::string>& last_lines);

// The failure a rank wrote to its TORCHELASTIC_ERROR_FILE (torch.distributed.elastic's @record:
// {"message": {"message": "RuntimeError: ...", "extraInfo": {"py_callstack": "Traceback ...",
// ...}}}, or a plain string as "message"): the exception's line, then the callstack's last lines,
// at most `max_bytes` in all (valid UTF-8); empty when there is no such file or it says nothing
// readable. The rank's owner wrote it: opened without following a link, a regular file with one
// name only (no hard link to another's file), at most 64 KiB read.
std::string ErrorFileMessage(const std::string& path, size_t max_bytes = 2048);

class RankSupervisor {
 public:
  // `send` receives log lines and rank status for the coordinator; it must not block long.
  RankSupervisor(SupervisorOptions options, std::function<void(v1::NodeMessage)> send);
  ~RankSupervisor();  // StopAll(), then joins every thread

  // Starts the assignment's ranks that this supervisor has not started before, running or ended
  // (assignments are resent on reconnect and may arrive twice). Failures to start are reported as
  // rank exits with code 127.
  void Launch(const v1::Assignment& assignment);
  // Stops the ranks of one job attempt (attempt 0: every attempt of the job).
  void Stop(const std::string& job_id, int attempt);
  // Sends `signal` (a number) to each running rank of the attempt, its whole process tree
  // (through its shepherd). Returns how many ranks it went to.
  int Signal(const std::string& job_id, int attempt, int signal);
  // Stops every rank and waits until all have exited.
  void StopAll();
  // Leaves every rank running under its shepherd, for the next worker to adopt (an upgrade); the
  // ranks still queued are dropped (the coordinator resends them). Waits until no thread follows a
  // rank any more. Nothing is started afterwards.
  void Detach();
  // Takes over the ranks that a worker before this one left on the work directory, still running
  // or ended but not yet collected, and returns them (RANK_RUNNING). A rank whose shepherd is gone
  // (killed while no worker ran) cannot be: it is reported ended (137) and returned as
  // RANK_EXITED with the reason. Call before the first session's hello.
  std::vector<v1::RankStatus> Adopt();
  // How long a shepherd keeps its rank once no worker holds it (the coordinator's node timeout:
  // by then the rank's attempt has been given up). Applies to ranks started afterwards.
  void set_orphan_timeout(absl::Duration timeout);
  // The status of every live rank (RANK_RUNNING) and of every rank of a launch still queued
  // (RANK_STARTING): the hello of a session lists them.
  std::vector<v1::RankStatus> Running() const;
  int running_count() const;
  // The recent lines of every live rank (the newest kRecentLogLines, kRecentLogBytes at most), and
  // of the last kEndedRecentLogs ranks that ended within kEndedRecentLogsFor, as log messages
  // with their seqs (LogLines.again), oldest first: what a new session sends again, so that a
  // coordinator that took over or restarted gets what its predecessor had received but not
  // stored (it keeps each line once, LogLines.seqs).
  std::vector<v1::NodeMessage> RecentLogs() const;
  static constexpr size_t kRecentLogLines = 4096;
  static constexpr size_t kRecentLogBytes = size_t{1} << 20;
  static constexpr size_t kEndedRecentLogs = 16;
  static constexpr absl::Duration kEndedRecentLogsFor = absl::Minutes(2);

 private:
  using RankKey = std::tuple<std::string, int, int>;  // job, attempt, rank
  struct Rank {
    int device = 0;
    int64_t grace_ms = 0;  // its shepherd's SIGTERM-to-SIGKILL grace (0: not known, an old one)
    int conn = -1;         // to its shepherd
    bool stop_sent = false;
    std::thread reader;
  };

  void SupervisorLoop();
  // Where a command job's rank finds TORCHELASTIC_ERROR_FILE: WORK/JOB/attempt-N/errors/rank-R.json
  // (the folder its owner's, the attempt's folder the worker's).
  std::string ErrorFilePath(const RankKey& key) const;
  // `prepared`: how preparing the attempt's context went (PrepareContext); an error fails the rank.
  void Start(const v1::Assignment& a, int rank, int device, const absl::Status& prepared)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The account that runs the ranks of `owner`'s jobs: the owner's when this worker switches
  // accounts (run_as), else none (this worker's own).
  absl::StatusOr<std::optional<UnixAccount>> AccountOf(const std::string& owner) const;
  // A command job's context (JobSpec.context): fetched through options_.contexts and unpacked,
  // as the owner, into the attempt's "work" folder, before its first rank here starts. Without
  // the supervisor's lock: it may wait on the coordinator.
  absl::Status PrepareContext(const v1::Assignment& a, const std::string& digest);
  // PrepareContext on a thread of its own (in preparing_), so that one attempt's context (a large
  // one, a slow coordinator, an unpacker its owner stopped: up to its 5-minute timeout) holds up
  // only that attempt's launch, not every user's on the node; its outcome goes to contexts_.
  void Prepare(const v1::Assignment& a, const std::string& digest)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts what launches_ holds that can start: each launch whose context is ready or not
  // needed, in order; a context not yet asked for is asked for (Prepare), and its launch waits.
  void StartLaunches() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With private_tmp: the attempt's tmp folder in its folder `dir`, the owner's, and its
  // namespaces (private_tmp.h; kept once made, for its other ranks here).
  absl::Status PrepareOwnTmp(const v1::Assignment& a, const v1::JobSpec& spec,
                             const std::string& dir, const UnixAccount* owner);
  // A command job's rank: the spec's program with torchrun's environment (Start's part for them).
  void StartCommand(const v1::Assignment& a, const v1::JobSpec& spec, const RankKey& key, int rank,
                    int device, const std::optional<UnixAccount>& account, const std::string& work,
                    const std::string& checkpoint_dir) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank's cgroup limits: RankLimits, and the GPUs other than `device` denied.
  CgroupLimits RankCgroupLimits(const v1::Resources& resources, int device) const;
  // Its cgroup's name under the host's parents: PREFIX/JOB/attempt-N/rank-R.
  std::string RankCgroupName(const RankKey& key) const;
  // What is left of a rank whose shepherd is gone: every process in its cgroup (the rank's
  // children; PR_SET_PDEATHSIG ends only the rank's own process) killed, the cgroup removed.
  void KillWhatIsLeft(const RankKey& key);
  // Forks and execs `argv` in `cwd` with `env` (then the worker's environment, without its token
  // and the names `env` sets), as `account` when set, in a process group of its own, held to
  // `resources` (the spec's: what it asks for overrides rank_limits).
  void Exec(const v1::Assignment& a, const RankKey& key, int device,
            const std::optional<UnixAccount>& account, std::vector<std::string> argv,
            std::vector<std::string> env, const std::string& cwd, const v1::JobSpec& spec)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Follows one rank through its shepherd (connection `conn`; `shepherd`: its pid when this
  // worker started it, else 0): relays its log from byte `offset` (-1: a new shepherd, whose hello
  // comes first) and reports its exit, unless the supervisor detaches first.
  void Follow(RankKey key, int conn, pid_t shepherd, int64_t offset);
  void AskToStop(Rank& rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a rank of the attempt (0: of any attempt of the job) runs or waits to start here.
  bool Live(const std::string& job_id, int attempt) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands each ended attempt none of whose ranks runs or waits here any more to folders_, which
  // empties its work and errors folders as their owner: the account that ran its ranks, or for an
  // attempt adopted from an earlier worker, the work folder's owner.
  void RemoveEndedWork() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a rank of account `uid` runs, waits to start or might (a context being prepared, a
  // rank whose account is not known: adopted) on this worker.
  bool AccountLive(uid_t uid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps a line of a rank's for RecentLogs.
  void Remember(const RankKey& key, int64_t seq, const std::string& line);
  void ReportExit(const RankKey& key, int exit_code, const std::string& message,
                  const v1::RankUsage& usage = {});

  const SupervisorOptions options_;
  const std::function<void(v1::NodeMessage)> send_;

  mutable absl::Mutex mu_;
  std::map<RankKey, Rank> ranks_ ABSL_GUARDED_BY(mu_);
  // Every rank this supervisor has started (or failed to start): a resent assignment starts none
  // of them again. An ended attempt's go forget_started_after its end (started_expiry_).
  std::set<RankKey> started_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<absl::Time, std::pair<std::string, int>>> started_expiry_
      ABSL_GUARDED_BY(mu_);
  // Command jobs: the MASTER_PORT of each attempt with ranks here, the same for all of them.
  std::map<std::pair<std::string, int>, int> attempt_ports_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::Assignment> launches_ ABSL_GUARDED_BY(mu_);
  // Bumped by each change SupervisorLoop's launches wait on (a launch, a context prepared).
  uint64_t launch_events_ ABSL_GUARDED_BY(mu_) = 0;
  // Attempts whose context was prepared here, and how that went (until the attempt ends here);
  // those whose context is being prepared, with the thread preparing it.
  std::map<std::pair<std::string, int>, absl::Status> contexts_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int>, std::thread> preparing_ ABSL_GUARDED_BY(mu_);
  static constexpr size_t kMaxPreparing = 4;  // contexts prepared at once
  std::vector<std::thread> finished_readers_ ABSL_GUARDED_BY(mu_);
  // The account that runs each attempt's ranks here (none: this process's), from their start, and
  // the attempts a rank of which has ended since (RemoveEndedWork).
  std::map<std::pair<std::string, int>, std::optional<UnixAccount>> attempt_accounts_
      ABSL_GUARDED_BY(mu_);
  std::set<std::pair<std::string, int>> ended_attempts_ ABSL_GUARDED_BY(mu_);
  // Accounts whose shared memory is to be scrubbed (RemoveEndedWork), until when to try.
  std::map<uid_t, absl::Time> scrubs_ ABSL_GUARDED_BY(mu_);
  static constexpr absl::Duration kScrubFor = absl::Minutes(10);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool detaching_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration orphan_timeout_ ABSL_GUARDED_BY(mu_) = absl::Seconds(10);
  std::mt19937_64 mark_random_ ABSL_GUARDED_BY(mu_){std::random_device{}()};
  struct RecentLines {
    std::deque<std::pair<int64_t, std::string>> lines;  // (seq, line)
    size_t bytes = 0;
    absl::Time ended = absl::InfiniteFuture();  // when the rank ended
  };
  mutable absl::Mutex recent_mu_;  // never held while calling send_
  std::map<RankKey, RecentLines> recent_ ABSL_GUARDED_BY(recent_mu_);
  // Made before supervisor_ starts; stopped once it has ended (its thread calls Live).
  std::unique_ptr<AttemptFolders> folders_;
  std::thread supervisor_;
};

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_RANK_SUPERVISOR_H_
