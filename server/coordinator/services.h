// The coordinator's gRPC adapters: thin translations between trainyard.v1 messages and the
// managers (JobManager through job_handlers.h's interfaces, NodeRegistry, Rendezvous,
// IdentityRegistry), on gRPC's callback API. Each
// call is authenticated first (the "authorization" metadata, IdentityRegistry::Authenticate) and
// authorized by the rules in the protos' service comments; a refused call changes nothing and
// ends with UNAUTHENTICATED or PERMISSION_DENIED naming what was missing. Calls that change
// something are written to the audit log (user, method, job, result). They own no state beyond
// their in-flight streams. Created and owned by CoordinatorServer; gRPC's threads call them.
#ifndef TRAINYARD_SERVER_COORDINATOR_SERVICES_H_
#define TRAINYARD_SERVER_COORDINATOR_SERVICES_H_

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/coordinator/context_store.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/identity.h"
#include "server/coordinator/job_handlers.h"
#include "server/coordinator/job_history.h"
#include "server/coordinator/job_series.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/node_registry.h"
#include "server/coordinator/rendezvous.h"
#include "server/coordinator/serial_executor.h"
#include "server/coordinator/service_auth.h"
#include "trainyard/v1/admin.grpc.pb.h"
#include "trainyard/v1/identity.grpc.pb.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/node.grpc.pb.h"
#include "trainyard/v1/rendezvous.grpc.pb.h"
#include "trainyard/v1/trainer.grpc.pb.h"

namespace trainyard::coordinator {

class JobServiceImpl final : public v1::JobService::CallbackService {
 public:
  // Logs and metrics of jobs no longer in memory come from `history`.
  // Jobs' contexts (uploads, and the check that a submit names one of the owner's) in `contexts`.
  JobServiceImpl(JobLifecycle& jobs, const UsageReports& usage, JobLogs& logs, JobMetrics& metrics,
                 const JobHistory& history, const IdentityRegistry& identities,
                 ContextStore& contexts)
      : jobs_(jobs),
        usage_(usage),
        logs_(logs),
        metrics_(metrics),
        history_(history),
        identities_(identities),
        contexts_(contexts) {}

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* ctx,
                                      const v1::SubmitJobRequest* request,
                                      v1::SubmitJobResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx,
                                   const v1::GetJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* ctx,
                                      const v1::CancelJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* ctx,
                                                   const v1::WatchJobRequest* request) override;
  grpc::ServerWriteReactor<v1::LogLine>* StreamLogs(grpc::CallbackServerContext* ctx,
                                                    const v1::StreamLogsRequest* request) override;
  grpc::ServerWriteReactor<v1::StepReport>* StreamMetrics(
      grpc::CallbackServerContext* ctx, const v1::StreamMetricsRequest* request) override;
  grpc::ServerUnaryReactor* CheckpointJob(grpc::CallbackServerContext* ctx,
                                          const v1::CheckpointJobRequest* request,
                                          v1::Job* response) override;
  grpc::ServerUnaryReactor* SignalJob(grpc::CallbackServerContext* ctx,
                                      const v1::SignalJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerUnaryReactor* GetQuota(grpc::CallbackServerContext* ctx,
                                     const v1::GetQuotaRequest* request,
                                     v1::QuotaReport* response) override;
  grpc::ServerWriteReactor<v1::ExportChunk>* FetchExport(
      grpc::CallbackServerContext* ctx, const v1::FetchExportRequest* request) override;
  grpc::ServerReadReactor<v1::ContextChunk>* UploadContext(
      grpc::CallbackServerContext* ctx, v1::UploadContextResponse* response) override;

 private:
  // The job, if the caller may see and control it: its owner or an admin.
  absl::StatusOr<v1::Job> AccessibleJob(grpc::CallbackServerContext* ctx, const std::string& job_id,
                                        const char* method, Principal* caller) const;

  JobLifecycle& jobs_;
  const UsageReports& usage_;
  JobLogs& logs_;
  JobMetrics& metrics_;
  const JobHistory& history_;
  const IdentityRegistry& identities_;
  ContextStore& contexts_;
  // WatchJob, StreamLogs and StreamMetrics: at most this many open a user (the console's are
  // among them: a job's page holds three, and a user eight pages). Each holds what the job kept
  // when it opened (up to 64 MiB of logs) plus 16 MiB of what followed: 2.5 GiB at the most.
  StreamSlots streams_{32};
  // UploadContext: at most this many under way a user (each holds up to 80 MiB until it ends).
  StreamSlots uploads_{2};
};

class TrainerServiceImpl final : public v1::TrainerService::CallbackService {
 public:
  // `prometheus` may be null.
  // `incarnation`: this coordinator's (TrainerCommands.incarnation), new at each start.
  TrainerServiceImpl(TrainerReports& jobs, JobMetrics& metrics, CoordinatorMetrics* prometheus,
                     const IdentityRegistry& identities, std::string incarnation)
      : jobs_(jobs),
        metrics_(metrics),
        prometheus_(prometheus),
        identities_(identities),
        incarnation_(std::move(incarnation)) {}

  grpc::ServerUnaryReactor* ReportStep(grpc::CallbackServerContext* ctx,
                                       const v1::StepReport* request,
                                       v1::TrainerCommands* response) override;
  grpc::ServerUnaryReactor* ReportCheckpoint(grpc::CallbackServerContext* ctx,
                                             const v1::CheckpointReport* request,
                                             v1::TrainerCommands* response) override;

 private:
  TrainerReports& jobs_;
  JobMetrics& metrics_;
  CoordinatorMetrics* prometheus_;
  const IdentityRegistry& identities_;
  const std::string incarnation_;
};

// What each node's messages hold of the node-events thread's queue: a node whose messages come
// faster than they are handled (a store stalled by a failover, ranks printing at GB/s) holds at
// most kMaxBytes of the coordinator's memory with its log lines, across its sessions (a worker
// reconnects while its older messages wait), and all nodes kMaxTotalBytes. Log lines past either
// are dropped, counted by rank until the rank's next kept lines or its end say how many.
// Thread-safe.
class NodeBacklog {
 public:
  using RankKey = std::tuple<std::string, int32_t, int32_t>;  // job, attempt, rank

  // What a message holds while it waits: its bytes, and each line's own string.
  static int64_t Charge(const v1::NodeMessage& message);
  // Counts `charge` more of `node`'s; false, counting nothing, when `droppable` (log lines) and
  // that would pass a cap. The rest (hellos, heartbeats, rank status: a few hundred bytes each)
  // always count.
  bool Add(const std::string& node, int64_t charge, bool droppable);
  // `charge` of `node`'s handled.
  void Remove(const std::string& node, int64_t charge);
  int64_t Bytes(const std::string& node) const;
  // `lines` of `rank` of `node`'s dropped (the first kMaxDroppedRanks ranks of a node counted
  // each).
  void Dropped(const std::string& node, const RankKey& rank, int64_t lines);
  // How many lines of `rank` were dropped since this was last asked (0: none).
  int64_t TakeDropped(const std::string& node, const RankKey& rank);

  static constexpr int64_t kMaxBytes = int64_t{32} << 20;
  static constexpr int64_t kMaxTotalBytes = int64_t{512} << 20;
  static constexpr int64_t kLineCharge = 64;  // a std::string and its allocation
  static constexpr size_t kMaxDroppedRanks = 4096;

 private:
  struct Node {
    int64_t bytes = 0;
    std::map<RankKey, int64_t> dropped;  // not yet said
    int64_t episode = 0;                 // lines dropped since it began dropping; 0: it is not
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);  // (none with nothing to keep)
  int64_t total_ ABSL_GUARDED_BY(mu_) = 0;
};

class NodeServiceImpl final : public v1::NodeService::CallbackService {
 public:
  // `node_certificates`: node calls authenticate with a verified client certificate whose common
  // name is the node id (mutual TLS), a node token being optional.
  // `lifecycle`: only to find the job of a parameter-server credential.
  // `contexts`: the jobs' contexts its nodes fetch.
  NodeServiceImpl(NodeRegistry& nodes, AttemptTracker& jobs, const JobLifecycle& lifecycle,
                  JobLogs& logs, ContextStore& contexts, absl::Duration heartbeat_interval,
                  const IdentityRegistry& identities, bool node_certificates = false)
      : nodes_(nodes),
        jobs_(jobs),
        lifecycle_(lifecycle),
        logs_(logs),
        contexts_(contexts),
        heartbeat_interval_(heartbeat_interval),
        identities_(identities),
        node_certificates_(node_certificates) {}

  // Where the node-events thread's delays are observed (set once, before serving; may stay null).
  void SetMetrics(CoordinatorMetrics* metrics) { metrics_ = metrics; }

  grpc::ServerUnaryReactor* RegisterNode(grpc::CallbackServerContext* ctx,
                                         const v1::RegisterNodeRequest* request,
                                         v1::RegisterNodeResponse* response) override;
  grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage>* Session(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ListNodes(grpc::CallbackServerContext* ctx,
                                      const v1::ListNodesRequest* request,
                                      v1::ListNodesResponse* response) override;
  grpc::ServerUnaryReactor* VerifyJobCredential(grpc::CallbackServerContext* ctx,
                                                const v1::VerifyJobCredentialRequest* request,
                                                v1::VerifyJobCredentialResponse* response) override;
  // Admins only, audited: cordon, drain or uncordon a node (node.proto).
  grpc::ServerUnaryReactor* CordonNode(grpc::CallbackServerContext* ctx,
                                       const v1::CordonNodeRequest* request,
                                       v1::CordonNodeResponse* response) override;
  grpc::ServerWriteReactor<v1::ContextChunk>* FetchContext(
      grpc::CallbackServerContext* ctx, const v1::FetchContextRequest* request) override;

 private:
  NodeRegistry& nodes_;
  AttemptTracker& jobs_;
  const JobLifecycle& lifecycle_;
  JobLogs& logs_;
  ContextStore& contexts_;
  const absl::Duration heartbeat_interval_;
  CoordinatorMetrics* metrics_ = nullptr;
  NodeBacklog backlog_;  // (before node_events_: its tasks count down here as it drains)
  // The sessions' work that may wait on the job manager, in arrival order (serial_executor.h).
  SerialExecutor node_events_{"ty-node-events"};
  const IdentityRegistry& identities_;
  const bool node_certificates_;
};

class RendezvousServiceImpl final : public v1::RendezvousService::CallbackService {
 public:
  RendezvousServiceImpl(Rendezvous& rendezvous, const IdentityRegistry& identities)
      : rdzv_(rendezvous), identities_(identities) {}

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx, const v1::SetRequest* request,
                                v1::SetResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::GetRequest* request,
                                v1::GetResponse* response) override;
  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* ctx, const v1::AddRequest* request,
                                v1::AddResponse* response) override;
  grpc::ServerUnaryReactor* CompareSet(grpc::CallbackServerContext* ctx,
                                       const v1::CompareSetRequest* request,
                                       v1::CompareSetResponse* response) override;
  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const v1::CheckRequest* request,
                                  v1::CheckResponse* response) override;
  grpc::ServerUnaryReactor* DeleteKey(grpc::CallbackServerContext* ctx,
                                      const v1::DeleteKeyRequest* request,
                                      v1::DeleteKeyResponse* response) override;
  grpc::ServerUnaryReactor* NumKeys(grpc::CallbackServerContext* ctx,
                                    const v1::NumKeysRequest* request,
                                    v1::NumKeysResponse* response) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* ctx, const v1::WaitRequest* request,
                                 v1::WaitResponse* response) override;
  grpc::ServerUnaryReactor* Barrier(grpc::CallbackServerContext* ctx,
                                    const v1::BarrierRequest* request,
                                    v1::BarrierResponse* response) override;

 private:
  Rendezvous& rdzv_;
  const IdentityRegistry& identities_;
};

// AdminService (admin.proto): admins only, every call audited.
class AdminServiceImpl final : public v1::AdminService::CallbackService {
 public:
  // Backups are made in `scratch_dir` (the state directory: the file is unlinked once open, and
  // streamed from its descriptor).
  AdminServiceImpl(JobStore& store, std::string scratch_dir, const IdentityRegistry& identities)
      : store_(store), scratch_dir_(std::move(scratch_dir)), identities_(identities) {}

  grpc::ServerWriteReactor<v1::BackupChunk>* Backup(grpc::CallbackServerContext* ctx,
                                                    const v1::BackupRequest* request) override;

 private:
  JobStore& store_;
  const std::string scratch_dir_;
  const IdentityRegistry& identities_;
};

class IdentityServiceImpl final : public v1::IdentityService::CallbackService {
 public:
  explicit IdentityServiceImpl(IdentityRegistry& identities) : identities_(identities) {}

  grpc::ServerUnaryReactor* WhoAmI(grpc::CallbackServerContext* ctx,
                                   const v1::WhoAmIRequest* request,
                                   v1::WhoAmIResponse* response) override;
  grpc::ServerUnaryReactor* CreateUser(grpc::CallbackServerContext* ctx,
                                       const v1::CreateUserRequest* request,
                                       v1::User* response) override;
  grpc::ServerUnaryReactor* ListUsers(grpc::CallbackServerContext* ctx,
                                      const v1::ListUsersRequest* request,
                                      v1::ListUsersResponse* response) override;
  grpc::ServerUnaryReactor* DisableUser(grpc::CallbackServerContext* ctx,
                                        const v1::DisableUserRequest* request,
                                        v1::User* response) override;
  grpc::ServerUnaryReactor* CreateToken(grpc::CallbackServerContext* ctx,
                                        const v1::CreateTokenRequest* request,
                                        v1::CreateTokenResponse* response) override;
  grpc::ServerUnaryReactor* ListTokens(grpc::CallbackServerContext* ctx,
                                       const v1::ListTokensRequest* request,
                                       v1::ListTokensResponse* response) override;
  grpc::ServerUnaryReactor* RevokeToken(grpc::CallbackServerContext* ctx,
                                        const v1::RevokeTokenRequest* request,
                                        v1::TokenInfo* response) override;
  grpc::ServerUnaryReactor* UpdateUser(grpc::CallbackServerContext* ctx,
                                       const v1::UpdateUserRequest* request,
                                       v1::User* response) override;
  grpc::ServerUnaryReactor* CreateAccount(grpc::CallbackServerContext* ctx,
                                          const v1::CreateAccountRequest* request,
                                          v1::Account* response) override;
  grpc::ServerUnaryReactor* UpdateAccount(grpc::CallbackServerContext* ctx,
                                          const v1::UpdateAccountRequest* request,
                                          v1::Account* response) override;
  grpc::ServerUnaryReactor* DeleteAccount(grpc::CallbackServerContext* ctx,
                                          const v1::DeleteAccountRequest* request,
                                          v1::Account* response) override;
  grpc::ServerUnaryReactor* ListAccounts(grpc::CallbackServerContext* ctx,
                                         const v1::ListAccountsRequest* request,
                                         v1::ListAccountsResponse* response) override;
  grpc::ServerUnaryReactor* DenyNode(grpc::CallbackServerContext* ctx,
                                     const v1::DenyNodeRequest* request,
                                     v1::DeniedNode* response) override;
  grpc::ServerUnaryReactor* ListDeniedNodes(grpc::CallbackServerContext* ctx,
                                            const v1::ListDeniedNodesRequest* request,
                                            v1::ListDeniedNodesResponse* response) override;

 private:
  IdentityRegistry& identities_;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_SERVICES_H_
