// JobManager: the coordinator's jobs. Holds every unfinished job, and finished ones for a retention
// time, in memory (the truth while running); older finished jobs are read from the store. Writes
// each change through the JobStore before acknowledging it, runs scheduling passes (snapshot →
// pure Scheduler → placements), hands placements to nodes, and turns node and rank events into
// state changes (restarts within max_restarts, failures with their reason). Knows nothing of gRPC.
//
// Thread-safe: called from gRPC callback threads, the store's commit thread, and the server's
// scheduler and ticker threads. Lock order: mu_, then NodeRegistry's and Rendezvous's locks.
// Store callbacks and watcher callbacks run without mu_ held.
#ifndef TRAINYARD_SERVER_COORDINATOR_JOB_MANAGER_H_
#define TRAINYARD_SERVER_COORDINATOR_JOB_MANAGER_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/device_ledger.h"
#include "server/coordinator/fair_share.h"
#include "server/coordinator/job_handlers.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/job_watchers.h"
#include "server/coordinator/node_registry.h"
#include "server/coordinator/ps_placement.h"
#include "server/coordinator/rendezvous.h"
#include "server/coordinator/scheduler.h"
#include "server/coordinator/sharing_policy.h"
#include "server/coordinator/submit_requests.h"
#include "trainyard/v1/job.pb.h"
#include "trainyard/v1/node.pb.h"
#include "trainyard/v1/trainer.pb.h"

namespace trainyard::coordinator {

// Everything a JobManager is configured with, given at construction (nothing is set later).
struct JobManagerOptions {
  // Called after every change that may let a waiting job start.
  std::function<void()> scheduler_wakeup;
  // The coordinators ranks are given (rendezvous and reports), read at each assignment: the
  // server's address is known only once it is bound. Null: none.
  std::function<std::string()> rank_coordinators;
  // Preemption: a job the scheduler cannot place may preempt running jobs of lower priority that
  // ran for `min_run_time`; they are asked to checkpoint and stop (TrainerCommands.stop_requested),
  // their ranks stopped after their grace (the spec's preemption_grace_seconds, else
  // `preemption_grace`, at most `max_preemption_grace`), and they go to PREEMPTED and wait to be
  // placed again, resuming from that checkpoint. Off by default.
  bool preemption = false;
  absl::Duration preemption_grace = absl::Seconds(120);
  absl::Duration min_run_time = absl::Minutes(5);
  absl::Duration max_preemption_grace = absl::Minutes(10);
  // The cluster's cap on checkpoint.keep_last (0: none): a spec over it is refused at submit.
  int64_t max_kept_checkpoints = 0;
  // Sharing: `sharing` gives accounts' quotas and shares and users' accounts and caps, read at
  // each submission and scheduling pass; usage decays with `fair_share_half_life` and starts
  // over at each `usage_reset`. Null: every job is in the default account with no limits.
  std::function<std::shared_ptr<const SharingPolicy>()> sharing;
  absl::Duration fair_share_half_life = absl::Hours(24 * 7);
  UsageReset usage_reset = UsageReset::kNone;
  // Makes the job credential of an attempt, put into its assignments. Null: none.
  std::function<std::string(const std::string& job_id, int32_t attempt)> job_credential;
  // Where jobs' checkpoints live: ROOT/JOB_ID, shared by the job's attempts so a restarted
  // attempt resumes (empty: the worker picks a local folder).
  std::string checkpoint_root;
  // Finished jobs leave memory `finished_job_retention` after they end (infinite: never): their
  // later reads are served from the store.
  absl::Duration finished_job_retention = absl::InfiniteDuration();
  // Where placements are counted (may be null).
  CoordinatorMetrics* metrics = nullptr;
  // The cap on a user's queued jobs when an admin set none for the user (negative: none).
  int64_t default_max_queued_jobs = -1;
  // Submissions waiting for the store, all owners together, past which Submit answers
  // RESOURCE_EXHAUSTED with retry advice (negative: none).
  int64_t max_pending_submits = -1;
  // A List page ends before its jobs pass this many serialized bytes (always at least one job).
  size_t max_list_bytes = size_t{2} << 20;
  // What a job's end writes beside the job, in the same transaction: its logs' and metrics'
  // records (JobHistory's SeriesRecords), so that they are as durable as the end itself (a
  // failover, a restart or a backup right after it has them). Null: nothing.
  std::function<std::vector<StoredRecord>(const v1::Job& job)> end_records;
};

class JobManager final : public JobLifecycle,
                         public UsageReports,
                         public TrainerReports,
                         public AttemptTracker {
 public:
  using JobLifecycle::JobCallback;
  using JobLifecycle::ListResult;
  using JobLifecycle::WatchCallback;

  JobManager(JobStore& store, NodeRegistry& nodes, Rendezvous& rendezvous, const Clock& clock,
             JobManagerOptions options = {});

  // The handlers (job_handlers.h, where each is documented).
  // JobLifecycle: job_manager.cc (reads, lists, watches, cancels), job_admission.cc (Submit and
  // its checks).
  void Submit(const std::string& owner, v1::JobSpec spec, const std::string& request_id,
              JobCallback done) override;
  // Submits' request ids, as stored (record kind "submit_request"): loaded at start.
  absl::Status LoadRequestIds();
  absl::StatusOr<v1::Job> Get(const std::string& job_id) const override ABSL_LOCKS_EXCLUDED(mu_);
  bool IsResident(const std::string& job_id) const override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ListResult> List(const v1::ListJobsRequest& request) const override;
  void Cancel(const std::string& job_id, const std::string& reason, JobCallback done) override;
  void RequestCheckpoint(const std::string& job_id, JobCallback done) override;
  absl::StatusOr<v1::Job> Signal(const std::string& job_id, const std::string& signal) override
      ABSL_LOCKS_EXCLUDED(mu_);
  std::string CheckpointDir(const std::string& job_id) const override;
  absl::StatusOr<int64_t> Watch(const std::string& job_id, WatchCallback on_change,
                                v1::Job* current, bool* current_durable) override;
  void Unwatch(int64_t handle) override;
  // UsageReports: job_usage.cc.
  v1::QuotaReport Quota(const std::string& user, bool all_accounts) const override;
  std::vector<v1::AccountUsage> AccountUsages() const override;
  std::string WhyWaiting(const std::string& job_id, const std::string& viewer,
                         bool viewer_is_admin) const override ABSL_LOCKS_EXCLUDED(mu_);
  std::string UnfinishedJobOf(const std::string& account) const override ABSL_LOCKS_EXCLUDED(mu_);
  // TrainerReports: job_attempts.cc.
  absl::StatusOr<v1::TrainerCommands> OnStepReport(const v1::StepReport& report,
                                                   bool& record) override;
  absl::StatusOr<v1::TrainerCommands> OnCheckpointReport(
      const v1::CheckpointReport& report) override;
  // AttemptTracker: job_attempts.cc.
  void OnNodeHello(const std::string& node_id,
                   const google::protobuf::RepeatedPtrField<v1::RankStatus>& running) override;
  void OnRankStatus(const std::string& node_id, const v1::RankStatus& status) override;
  void OnNodesLost(const std::vector<std::string>& node_ids) override;
  bool RankRunsOn(const std::string& node_id, const std::string& job_id, int attempt,
                  int rank) const override;
  std::vector<v1::Assignment> AssignmentsFor(const std::string& node_id) const override;
  std::vector<v1::Node> NodesWithAllocations() const override;
  std::vector<std::string> DrainNode(const std::string& node_id, const std::string& by) override;
  void RequestSchedulingPass() override { WakeScheduler(); }

  // The server's own calls: set-up before serving, its threads (scheduler, ticker, evictor).

  // Loads jobs saved by an earlier run (before serving). Running jobs keep their placement and
  // wait for their nodes to come back; DATA_LOSS for an unreadable record.
  absl::Status Load(const std::vector<StoredJob>& jobs);

  // Charges running jobs' devices since the last charge to their accounts' and owners' decayed
  // usage (at most 5 minutes' worth: a stalled coordinator does not bill its pause).
  void ChargeUsage();

  // Writes again each job whose last write failed (a full disk, a database that went away), as it
  // is now, so that the store catches up with memory: a placement that was not stored had sent no
  // assignment, a cancel or an end was not durable. A running job's assignments go out again once
  // written (workers start each rank once). Returns how many it wrote again. The ticker's.
  int RetryUnsaved() ABSL_LOCKS_EXCLUDED(mu_);
  // Usage survives restarts: saved to the store as "usage" records (CommitSync: not on the
  // store's commit thread), loaded before serving (DATA_LOSS for an unreadable record).
  absl::Status SaveUsage();
  absl::Status LoadUsage();
  // Up to `max` finished jobs whose retention has passed, whose final state is durable and whose
  // ranks have all exited, oldest first, now marked as being evicted: not offered again unless
  // handed back to EvictionFailed. Their logs and metrics are the caller's to persist first.
  std::vector<v1::Job> TakeEvictionCandidates(size_t max) ABSL_LOCKS_EXCLUDED(mu_);
  // The ids of the jobs not in a terminal state.
  std::vector<std::string> UnfinishedJobIds() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every job held in memory (unfinished, and finished within the retention), with its end time
  // (Unix ms; 0 while unfinished).
  std::vector<std::pair<std::string, int64_t>> ResidentJobEnds() const ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets jobs taken by TakeEvictionCandidates, or offers them again at the next call.
  void Evict(const std::vector<std::string>& job_ids) ABSL_LOCKS_EXCLUDED(mu_);
  void EvictionFailed(const std::vector<std::string>& job_ids) ABSL_LOCKS_EXCLUDED(mu_);
  // How many jobs are held in memory.
  size_t ResidentJobs() const ABSL_LOCKS_EXCLUDED(mu_);

  // One scheduling pass; returns how many jobs it placed.
  int SchedulePass();

  // Fails running jobs that ran past their spec's max_runtime (as Slurm's time limit does: no
  // restart, the limit belongs to the job). The scheduler's backfill relies on it. Returns how
  // many it ended.
  int EnforceRuntimeLimits();
  // For metrics: how many jobs are in each state, and which jobs run.
  std::map<v1::JobState, int> CountByState() const;
  std::vector<std::string> RunningJobs() const;

  // The job as the store has it (which may be behind memory): NOT_FOUND, DATA_LOSS for an
  // unreadable record, or the store's error. For jobs not in memory, and tests.
  absl::StatusOr<v1::Job> ReadFromStore(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  v1::Job* Find(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // List's page: the jobs in memory merged with the store's rows once some job lives only there.
  absl::StatusOr<ListResult> ListPage(const v1::ListJobsRequest& r, int64_t before_seq,
                                      const std::set<int>& states, size_t limit) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `job` passes a listing's filters.
  static bool Matches(const v1::Job& job, const std::set<int>& states, const std::string& owner);
  // INVALID_ARGUMENT if the job's estimated memory per rank (common/memory_estimate.h) exceeds
  // every ready node's devices, naming a strategy that would fit. Nodes with devices of unknown
  // size (0 bytes), or no nodes at all, are not judged.
  absl::Status CheckFitsSomeNode(const v1::JobSpec& spec) const ABSL_LOCKS_EXCLUDED(mu_);
  // INVALID_ARGUMENT naming resources.cpus or resources.memory when the job's ranks, with what
  // they ask for, fit on no set of the ready workers that take `owner`'s jobs (each node holding
  // as many as its devices, CPUs and memory allow, in whole rank blocks). Not judged without
  // such workers; nodes that do not count CPUs or memory hold as many as their devices.
  absl::Status CheckFitsHosts(const std::string& owner, const v1::JobSpec& spec) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // For offload jobs: INVALID_ARGUMENT when the ready parameter servers together have too little
  // memory for the job's optimizer state, FAILED_PRECONDITION when none is registered.
  // Only servers that take `owner`'s jobs count.
  absl::Status CheckFitsParameterServers(const std::string& owner, const v1::JobSpec& spec) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes running offload jobs hold on each parameter server, by node id.
  std::map<std::string, int64_t> ReservedPsBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Connected, ready parameter servers that take `owner`'s jobs (no owners, or `owner` among
  // theirs) and their memory not held by running offload jobs.
  std::vector<PsCapacity> ParameterServerCapacity(const std::string& owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `after`: the same owner's jobs, none failed or cancelled already (NOT_FOUND naming the entry
  // for a job that is not found or is another user's; FAILED_PRECONDITION for one that ended
  // without success).
  absl::Status CheckDependencies(const std::string& owner, const v1::JobSpec& spec) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // A waiting job's `after` jobs: the first that has not succeeded yet, or ended without success
  // (`failed`); empty when all have. A job no longer held in memory ended long enough ago that
  // the passes since would have failed its dependents had it failed: it succeeded.
  struct Dependency {
    std::string job_id;
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    bool failed = false;
  };
  std::optional<Dependency> UnmetDependency(const v1::Job& job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The waiting tasks of job arrays that may be considered this pass: per array (owner and
  // array.id), the oldest, as many as array.max_running leaves beside its running tasks.
  std::set<std::string> ArrayTasksToConsider() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The owner's tasks of `job`'s array that count against its limit, and of those how many are
  // only stopping (`stopping`, when given).
  int RunningArrayTasks(const v1::Job& job, int* stopping = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tasks of arrays with a limit that count against it: those running, and those whose ended
  // attempt's ranks are still stopping (a cancelled or preempted task draining: its processes
  // run until they exit, as Slurm counts a completing task against %N; at most until the drain
  // timeout, so that a node that went away does not hold an array for ever).
  std::vector<const v1::Job*> RunningLimitedArrayTasks() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the ranks of ended attempts still stopping hold (draining within their deadline), by
  // job: their devices and their number on each node, and when the last one's device is freed
  // at the latest. They are their job's until they exit: they count against its account's quota
  // and its owner's cap, are charged to its fair-share usage, and hold their CPUs and memory on
  // their nodes (a job cancelled or preempted is no way past a quota while it saves).
  struct StoppingRanks {
    std::map<std::string, std::set<int>> devices;  // node id -> devices
    std::map<std::string, int> ranks;              // node id -> ranks
    absl::Time until = absl::InfinitePast();
    int64_t DeviceCount() const;
    // What its ranks on `node_id` hold of the node's CPUs (thousandths) and memory, as a running
    // placement does: per rank when the job asks for them, else the node's charge per device.
    int64_t CpuMillisOn(const std::string& node_id, const v1::Resources& asks,
                        const v1::HostResources& host) const;
    int64_t MemoryBytesOn(const std::string& node_id, const v1::Resources& asks,
                          const v1::HostResources& host) const;
  };
  std::map<std::string, StoppingRanks> Stopping(absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the waiting jobs one of whose `after` jobs ended without success (each pass).
  void FailJobsWithFailedDependencies() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job if `attempt` is its running attempt; else NOT_FOUND or FAILED_PRECONDITION.
  absl::StatusOr<v1::Job*> FindRunningAttempt(const std::string& job_id, int attempt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `rank` of `attempt` is in its stop grace: the attempt was ended (cancelled,
  // preempted past its grace, failed elsewhere) and the rank has not exited yet (its device
  // drains). Such a rank may still report, and is told to stop; its checkpoint is recorded.
  bool InStopGrace(const v1::Job& job, int attempt, int rank) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Until when a rank of `job` (null: of any job) told now to stop on `node_id` keeps its device
  // while its exit is not reported: the stop grace the node gives it and a margin, at least
  // kDrainTimeout. `reported`: the grace the rank's node said its shepherd gives it
  // (RankStatus.stop_grace_ms, at a hello), which it keeps whatever the node's flags are now.
  absl::Time DrainDeadline(const std::string& node_id, const v1::Job* job,
                           std::optional<absl::Duration> reported = std::nullopt) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a checkpoint report as the job's last checkpoint and what retention kept.
  void RecordCheckpoint(v1::Job& job, const v1::CheckpointReport& report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::TrainerCommands CommandsFor(const v1::Job& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves `job` to `to` (a broken transition is a bug: CHECK) and bumps its version.
  void Transition(v1::Job& job, v1::JobState to, std::string message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `job` for the store; once durable, notifies watchers, then runs `after`. A write that
  // fails leaves the job to RetryUnsaved.
  void Persist(const v1::Job& job, std::function<void(absl::Status)> after = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the devices of the job's current attempt and closes its rendezvous scope; its nodes are
  // told to stop its ranks (with `reason`, unless empty) once the job's next Persist is durable.
  void ReleaseAttempt(v1::Job& job, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SchedulePass's parts (job_manager.cc).
  void ExpireDraining(const std::vector<SchedulingNode>& nodes, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordRankUsage(v1::Job& job, const std::string& node_id, const v1::RankStatus& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ClusterSnapshot BuildSnapshot(const SharingPolicy& policy,
                                const std::vector<SchedulingNode>& nodes, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordPass(const ClusterSnapshot& snapshot, const ScheduleResult& result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartPreemption(const ScheduleResult::Preemption& preemption, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool StartPlacement(const Placement& placement, const std::vector<SchedulingNode>& nodes,
                      absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the current attempt as failed: RESTARTING within max_restarts, else FAILED.
  // The attempt of a preempted job has ended (its ranks released): PREEMPTED, to be placed
  // again (no restart counted).
  void Preempted(v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's attempt failed: RESTARTING (within max_restarts) or FAILED. `lost`: nodes declared
  // lost, whose stops go at once, before their sessions close (the attempt is gone with them
  // whatever is durable); the others' once the failure is.
  void FailAttempt(v1::Job& job, const std::string& reason, const std::set<std::string>& lost = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a rank's report of `job`'s released attempt on `node_id` waits for the release's
  // write, which carries a stop of that attempt for that node: then it is not told to stop
  // before.
  bool StopWaitsForWrite(const v1::Job* job, const std::string& node_id,
                         const v1::RankStatus& status) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // (node id, assignment) for each node of the job's current placement.
  std::vector<std::pair<std::string, v1::Assignment>> AssignmentsOf(const v1::Job& job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyWatchers(const v1::Job& job);
  void WakeScheduler();
  // The owner's limits on `spec` (see Submit); `policy` as of now.
  absl::Status CheckSharingLimits(const SharingPolicy& policy, const std::string& owner,
                                  const v1::JobSpec& spec) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration GraceOf(const v1::Job& job) const;
  // Per account: running and queued devices and queued jobs; per owner: running devices and
  // queued jobs.
  struct Use {
    int64_t running_devices = 0;
    int64_t queued_devices = 0;
    int32_t queued_jobs = 0;
  };
  void CountUse(std::map<std::string, Use>* by_account, std::map<std::string, Use>* by_owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every account's shares and decayed usage together, for the fractions.
  struct ShareTotals {
    double shares = 0;
    double usage = 0;
  };
  // Whether an account wants devices: running or queued jobs, or decayed usage.
  bool HasDemand(const std::string& account, const std::map<std::string, Use>& use,
                 absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The shares of the accounts with demand, and every account's decayed usage.
  ShareTotals TotalsOf(const SharingPolicy& policy, const std::map<std::string, Use>& use,
                       absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::AccountUsage AccountUsageOf(const std::string& name, const SharingPolicy& policy,
                                  const ShareTotals& totals, const std::map<std::string, Use>& use,
                                  absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The sharing policy as of now (without one: the default account, no limits). Takes the
  // identity registry's lock: call it before mu_.
  std::shared_ptr<const SharingPolicy> CurrentPolicy() const ABSL_LOCKS_EXCLUDED(mu_);

  JobStore& store_;
  NodeRegistry& nodes_;
  Rendezvous& rendezvous_;
  const Clock& clock_;
  // From JobManagerOptions (their comments there), immutable.
  const std::function<void()> wakeup_;
  const std::function<std::string()> rank_coordinators_;
  const bool preemption_;
  const int64_t max_kept_checkpoints_;
  const absl::Duration preemption_grace_;
  const absl::Duration min_run_time_;
  const absl::Duration max_preemption_grace_;
  const std::function<std::shared_ptr<const SharingPolicy>()> policy_;
  const std::function<std::string(const std::string&, int32_t)> credential_for_;
  const std::string checkpoint_root_;
  CoordinatorMetrics* const metrics_;
  const absl::Duration retention_;
  const int64_t default_max_queued_jobs_;
  const int64_t max_pending_submits_;
  const size_t max_list_bytes_;
  const std::function<std::vector<StoredRecord>(const v1::Job&)> end_records_;

  mutable absl::Mutex mu_;
  std::map<std::string, v1::Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::string> ids_by_seq_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> unfinished_ ABSL_GUARDED_BY(mu_);  // ids of jobs not in a terminal state
  // Of those, how many wait on `after` jobs or are tasks of an array with a limit: the passes
  // skip their work when none do.
  int unfinished_with_after_ ABSL_GUARDED_BY(mu_) = 0;
  int unfinished_array_tasks_ ABSL_GUARDED_BY(mu_) = 0;
  // unfinished_ and its counts, as a job starts or stops being unfinished.
  void AddUnfinished(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether an unfinished job names `job_id` in its `after`.
  bool IsAwaited(const std::string& job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveUnfinished(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finished jobs in memory by (end time in Unix ms, id): the eviction order.
  std::set<std::pair<int64_t, std::string>> finished_by_end_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> evicting_ ABSL_GUARDED_BY(mu_);  // taken, not yet evicted
  // Whether some job lives only in the store (evicted, or left there by Load): then List
  // merges the store's rows with memory's.
  bool jobs_in_store_only_ ABSL_GUARDED_BY(mu_) = false;
  // Preempting jobs whose grace ran out and whose ranks were told to stop.
  std::set<std::string> preempt_stopped_ ABSL_GUARDED_BY(mu_);
  // Preempting (or drained) jobs: the version whose write asks their ranks to stop. They are not
  // asked (CommandsFor) before it is durable. (None for a job loaded with its ask: durable.
  // Their ranks are stopped when the grace runs out all the same: a write not durable by then is
  // rare, and a killed rank fails its attempt, where one that exited 0 ended its job.)
  std::map<std::string, int64_t> stop_asked_at_ ABSL_GUARDED_BY(mu_);
  // Attempts and devices: held devices, draining ranks, exited ranks, master ports.
  DeviceLedger devices_ ABSL_GUARDED_BY(mu_);
  // The grace a running rank of a current attempt gets when stopped, as its node's hello reported
  // it (RankStatus.stop_grace_ms: a worker restarted with other flags keeps its shepherds' graces),
  // for ReleaseAttempt's drains; an attempt's entries go when it is released.
  std::map<DeviceLedger::RankKey, absl::Duration> reported_graces_ ABSL_GUARDED_BY(mu_);
  int64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  // Watches, and the version of each job known to be on disk. Reads (Get, List) may be a few ms
  // ahead of the disk; watch events never are.
  JobWatchers watchers_ ABSL_GUARDED_BY(mu_);
  // Submissions not yet durable, by owner (for max_queued_jobs).
  std::map<std::string, int> submitting_ ABSL_GUARDED_BY(mu_);
  // Submits by (owner, request id): the job each made, and whether it is durable yet.
  SubmitRequests requests_ ABSL_GUARDED_BY(mu_);
  // Jobs that ended and whose end Persist has not written yet (with their logs and metrics).
  std::set<std::string> ends_to_store_ ABSL_GUARDED_BY(mu_);
  // Jobs whose last write failed (Persist), for RetryUnsaved.
  std::set<std::string> unsaved_ ABSL_GUARDED_BY(mu_);
  // The stops (node, message) of each job's released attempt, sent once the write that released
  // it is durable: a coordinator that restarted before then had the job running still while its
  // ranks had been stopped (their node's hello failed the attempt: a cancelled job with restarts
  // left ran again).
  std::map<std::string, std::vector<std::pair<std::string, v1::CoordinatorMessage>>>
      stops_after_write_ ABSL_GUARDED_BY(mu_);
  // Writes under way that carry stops, by job: their ranks' drains do not expire meanwhile (the
  // ranks have not been told yet; a store stalled past the drain timeout freed their devices).
  // (Each with the node and attempt of each stop it carries.)
  std::map<std::string, std::multiset<std::pair<std::string, int>>> stops_in_flight_
      ABSL_GUARDED_BY(mu_);
  // QUEUED jobs by owner, kept by Transition (max_queued_jobs without a scan per submit).
  std::map<std::string, int64_t> queued_by_owner_ ABSL_GUARDED_BY(mu_);
  int64_t pending_submits_ ABSL_GUARDED_BY(mu_) = 0;
  // Decayed device-seconds by "account:NAME" and "user:NAME".
  UsageLedger usage_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Time> last_charge_ ABSL_GUARDED_BY(mu_);
  // The latest scheduling pass: what became of each waiting job, and the head's reservation.
  struct LastPass {
    absl::Time at;
    std::unordered_map<std::string, JobWait> waits;
    std::string head;  // the first job in line that did not fit, if any
    std::optional<absl::Time> head_start;
  };
  std::optional<LastPass> last_pass_ ABSL_GUARDED_BY(mu_);
};

// "job-<seq>"; also accepts a bare number from users.
std::string JobIdForSeq(int64_t seq);
// The account a job is charged to (jobs stored before accounts existed: the default one).
const std::string& AccountOf(const v1::Job& job);

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_JOB_MANAGER_H_
