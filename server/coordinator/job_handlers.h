// The coordinator's job managers as its gRPC adapters see them: one interface per concern, as
// Ray's GCS puts each manager behind the handler interface its gRPC service calls
// (JobInfoGcsServiceHandler, NodeInfoGcsServiceHandler, ...). The adapters (job_service.cc,
// trainer_service.cc, node_service.cc) hold these references only, and each states which it
// uses:
//   JobLifecycle    JobService: submit (admission and persistence), read, list, cancel,
//                   checkpoint requests, watches
//   UsageReports    JobService and metrics: quotas, fair share, why a job waits; IdentityService:
//                   whether an account is in use
//   TrainerReports  TrainerService: ranks' step and checkpoint reports
//   AttemptTracker  NodeService: node sessions, rank events, drains; the node registry's loss
//                   listener (node loss arrives there, not through a service)
// JobManager (job_manager.h) implements all four, one file per concern behind them
// (job_manager.cc, job_admission.cc, job_usage.cc, job_attempts.cc; the scheduling pass,
// job_scheduling.cc, is the server's scheduler thread's). One lock serves them, as one event loop
// serves Ray's GCS managers: a job's state, its devices, its rendezvous and its usage change
// together.
#ifndef TRAINYARD_SERVER_COORDINATOR_JOB_HANDLERS_H_
#define TRAINYARD_SERVER_COORDINATOR_JOB_HANDLERS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trainyard/v1/job.pb.h"
#include "trainyard/v1/node.pb.h"
#include "trainyard/v1/trainer.pb.h"

namespace trainyard::coordinator {

class JobLifecycle {
 public:
  using JobCallback = std::function<void(absl::StatusOr<v1::Job>)>;
  using WatchCallback = std::function<void(const v1::Job&)>;
  struct ListResult {
    std::vector<v1::Job> jobs;  // newest first
    std::string next_page_token;
  };

  virtual ~JobLifecycle() = default;

  // Applies defaults, validates (INVALID_ARGUMENT naming the field) and checks that the model fits
  // some node's devices and the owner's limits (RESOURCE_EXHAUSTED at max_queued_jobs;
  // INVALID_ARGUMENT for more devices than its caps or account allow ever, or preemptible: false
  // beyond its account's quota), stores the job durably as QUEUED (charged to the owner's
  // account), then calls `done` with it. Nothing is stored on error. `request_id` (may be empty)
  // makes it idempotent: the owner's earlier job of that id, if any within kRequestIdLifetime,
  // is answered instead (UNAVAILABLE while that one is still being stored: retry).
  virtual void Submit(const std::string& owner, v1::JobSpec spec, const std::string& request_id,
                      JobCallback done) = 0;
  // From memory, or for a finished job past its retention from the store. NOT_FOUND, or the
  // store's error.
  virtual absl::StatusOr<v1::Job> Get(const std::string& job_id) const = 0;
  // Whether the job is held in memory (a job being submitted or evicted may be in neither).
  virtual bool IsResident(const std::string& job_id) const = 0;
  virtual absl::StatusOr<ListResult> List(const v1::ListJobsRequest& request) const = 0;
  // Cancels a waiting or running job (its ranks are told to stop); `done` after it is durable.
  // NOT_FOUND, or FAILED_PRECONDITION for a job that already ended.
  virtual void Cancel(const std::string& job_id, const std::string& reason, JobCallback done) = 0;
  // Asks a running job for a checkpoint: RUNNING → CHECKPOINTING until its ranks report one.
  // NOT_FOUND, or FAILED_PRECONDITION if the job is not running.
  virtual void RequestCheckpoint(const std::string& job_id, JobCallback done) = 0;
  // Sends signal `signal` (common/signal_names.h: checked by the caller) to every rank of the
  // running job's current attempt, through the workers that run them. Nothing is stored.
  // NOT_FOUND, or FAILED_PRECONDITION if the job is not running.
  virtual absl::StatusOr<v1::Job> Signal(const std::string& job_id, const std::string& signal) = 0;
  // ROOT/JOB_ID: the job's checkpoints (and checkpoint.export's files in its "export" folder).
  virtual std::string CheckpointDir(const std::string& job_id) const = 0;
  // Subscribes to a job's durable changes. Returns a handle for Unwatch and fills `current`
  // with the job as it is now, and `current_durable` with whether that state is on disk yet (if
  // not, `on_change` receives it once it is). Callbacks may repeat a version already seen.
  virtual absl::StatusOr<int64_t> Watch(const std::string& job_id, WatchCallback on_change,
                                        v1::Job* current, bool* current_durable) = 0;
  virtual void Unwatch(int64_t handle) = 0;
};

class UsageReports {
 public:
  virtual ~UsageReports() = default;

  // A user's and its account's use, quota and share (every account's with `all_accounts`).
  virtual v1::QuotaReport Quota(const std::string& user, bool all_accounts) const = 0;
  // Every account's use, quota and share (for metrics), by name.
  virtual std::vector<v1::AccountUsage> AccountUsages() const = 0;
  // Why a waiting job waits, in words, as of the latest scheduling pass ("" for a job that does
  // not wait). Jobs of others than `viewer` are not named unless `viewer_is_admin`.
  virtual std::string WhyWaiting(const std::string& job_id, const std::string& viewer,
                                 bool viewer_is_admin) const = 0;
  // An unfinished job charged to `account`, if any ("" if none): accounts in use stay.
  virtual std::string UnfinishedJobOf(const std::string& account) const = 0;
};

class TrainerReports {
 public:
  virtual ~TrainerReports() = default;

  // A step report from one of a job's ranks: returns the job's pending commands, and with
  // `record` (rank 0's report, new) updates the job's progress. A rank of an ended attempt in
  // its stop grace is told to stop and `record` is set false (its steps are not the job's any
  // more). FAILED_PRECONDITION for an attempt that is not the job's running one otherwise.
  virtual absl::StatusOr<v1::TrainerCommands> OnStepReport(const v1::StepReport& report,
                                                           bool& record) = 0;
  // A checkpoint written by a job's ranks: recorded durably; CHECKPOINTING → RUNNING.
  virtual absl::StatusOr<v1::TrainerCommands> OnCheckpointReport(
      const v1::CheckpointReport& report) = 0;
};

class AttemptTracker {
 public:
  virtual ~AttemptTracker() = default;

  // A node's session opened, `running` being the ranks it runs: stops the stale ones and frees the
  // devices of stopped ranks that it no longer runs.
  virtual void OnNodeHello(const std::string& node_id,
                           const google::protobuf::RepeatedPtrField<v1::RankStatus>& running) = 0;
  // A rank's status from the node running it; stale attempts are told to stop.
  virtual void OnRankStatus(const std::string& node_id, const v1::RankStatus& status) = 0;
  // Fails (or restarts, within max_restarts) every running attempt with ranks on these nodes.
  virtual void OnNodesLost(const std::vector<std::string>& node_ids) = 0;
  // Whether rank `rank` of attempt `attempt` of the job runs on `node_id` (placed there, or an
  // older attempt's rank still stopping there): what a node may report on.
  virtual bool RankRunsOn(const std::string& node_id, const std::string& job_id, int attempt,
                          int rank) const = 0;
  // Assignments of running attempts with ranks on `node_id`; resent when its session attaches.
  virtual std::vector<v1::Assignment> AssignmentsFor(const std::string& node_id) const = 0;
  // Every node with the device indices running attempts hold on it.
  virtual std::vector<v1::Node> NodesWithAllocations() const = 0;
  // An admin drains `node_id` (already cordoned in the registry): each running job with ranks
  // there is asked to checkpoint and stop within its preemption grace, then goes to PREEMPTED
  // and waits to be placed again, elsewhere: the preemption path, with "drain of node N" as the
  // preemptor. Returns the ids of the jobs it asked (a job already stopping is not asked again).
  virtual std::vector<std::string> DrainNode(const std::string& node_id, const std::string& by) = 0;
  // Asks the scheduler loop for a pass soon (after a node joins or comes back).
  virtual void RequestSchedulingPass() = 0;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_JOB_HANDLERS_H_
