// CoordinatorServer: creates and wires the coordinator's parts (JobStore, NodeRegistry,
// Rendezvous, JobManager, the gRPC services) and runs its two background threads: the scheduler
// loop (a pass whenever something changed, and once a second for backfill windows) and the
// ticker that declares nodes lost. main.cc and in-process tests start it.
//
// Thread-safe: Shutdown may be called from any thread, once.
#ifndef TRAINYARD_SERVER_COORDINATOR_COORDINATOR_SERVER_H_
#define TRAINYARD_SERVER_COORDINATOR_COORDINATOR_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics_endpoint.h"
#include "common/tls.h"
#include "server/coordinator/context_store.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/identity.h"
#include "server/coordinator/job_history.h"
#include "server/coordinator/job_manager.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/node_registry.h"
#include "server/coordinator/rendezvous.h"
#include "server/coordinator/services.h"
#include "server/web/web_console.h"

namespace trainyard::coordinator {

// Limits on what callers may make the coordinator hold; each has a flag (main.cc) and is listed
// in docs/security.md ("Limits").
struct CoordinatorLimits {
  // Jobs a user may have queued, unless an admin set the user's own max_queued_jobs; negative:
  // no cap.
  int64_t max_queued_jobs_per_user = 1000;
  // Submissions accepted but not yet durable (waiting for the store), all users together: past
  // it a submit is refused with RESOURCE_EXHAUSTED and retry advice (back-pressure at the rate the
  // store commits) instead of queueing without bound. Negative: no cap.
  int64_t max_pending_submits = 2048;
  int64_t max_tokens_per_user = 100;  // unrevoked, unexpired; negative: no cap
  // checkpoint.keep_last at most this (keep_last 0, every checkpoint, refused); 0: no cap.
  int64_t max_kept_checkpoints = 0;
  // A job listing's page ends before its jobs pass this many bytes (0: half of max_message_bytes).
  size_t max_list_bytes = 0;
  RendezvousLimits rendezvous;                 // per job attempt
  size_t max_log_bytes_per_job = 64 << 20;     // kept in memory; the oldest lines go first
  size_t max_metric_bytes_per_job = 64 << 20;  // kept in memory; the oldest steps go first
  // A finished job stays in memory this long, then is served from the store (infinite: kept in
  // memory until restart). Its logs and metrics go to the store then, within `history`'s caps,
  // and stay there for `history.retention`.
  absl::Duration finished_job_retention = absl::Minutes(5);
  JobHistoryOptions history;
  // Failed authentications: a token id may have `burst` wrong secrets, a peer `burst` guesses
  // (malformed or unknown credentials, wrong secrets), refilling at per_second.
  AuthThrottleOptions auth_per_token{10, 1};
  AuthThrottleOptions auth_per_peer{30, 1};
  // The bits of an IPv6 peer's address that name its client for auth_per_peer (16 to 128): its
  // /64 by default, 128 where hosts share a /64.
  int auth_peer_ipv6_prefix = 64;
};

struct CoordinatorOptions {
  std::string listen_address = "127.0.0.1:7070";  // port 0 picks a free port
  // TLS (common/tls.h). With a client CA, node calls need a client certificate naming the node.
  TlsServerOptions tls;
  std::string
      state_dir;  // holds coordinator.db (unless `store` says otherwise); created if missing
  // Where the jobs, nodes, users and tokens live: empty for STATE_DIR/coordinator.db (SQLite), or
  // a PostgreSQL URI (postgresql://...; no password in it: libpq's password file).
  std::string store;
  // A backup (yard admin backup) to start from: the state directory must hold no coordinator.db
  // yet. Empty: none.
  std::string restore_from;
  std::string metrics_address;     // HOST:PORT of the Prometheus /metrics endpoint; empty: none
  std::string metrics_token_file;  // scrapes need this bearer token (common/metrics_endpoint.h)
  bool metrics_tls = false;        // serve /metrics over TLS with tls.cert_file / tls.key_file
  bool metrics_insecure = false;   // a non-loopback metrics address without a token
  // HOST:PORT of the web console and its HTTP/JSON API (server/web/web_console.h), over TLS with
  // tls.cert_file / tls.key_file when the coordinator has them; empty: none.
  std::string web_address;
  // Behind a proxy: the URL browsers reach the console at, and the proxies' addresses whose
  // X-Forwarded-For is believed (web::WebConsoleOptions's public_url and trusted_proxies).
  std::string web_public_url;
  std::vector<std::string> web_trusted_proxies;
  std::string checkpoint_root;  // jobs' checkpoints (ROOT/JOB_ID); default STATE_DIR/checkpoints
  absl::Duration node_timeout = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::Seconds(2);
  int max_message_bytes = 4 << 20;  // larger requests get RESOURCE_EXHAUSTED
  const Clock* clock = nullptr;     // nullptr: the real clock
  // When false, no background threads: tests drive passes and timeouts themselves.
  bool background_threads = true;
  // Share one fsync among concurrent writes. Off only to measure what it buys (bench/).
  bool group_commit = true;
  // Preemption that checkpoints first (JobManagerOptions::preemption); off by default.
  bool preemption = false;
  absl::Duration preemption_grace = absl::Seconds(120);
  absl::Duration min_run_time = absl::Minutes(5);
  absl::Duration max_preemption_grace = absl::Minutes(10);    // caps jobs' preemption_grace
  absl::Duration fair_share_half_life = absl::Hours(24 * 7);  // decay of accounts' usage
  UsageReset fair_share_usage_reset = UsageReset::kNone;      // when all usage starts over
  absl::Duration usage_save_interval = absl::Seconds(30);     // and at shutdown
  CoordinatorLimits limits;
  std::string audit_log;  // a JSON-lines audit log (one object per event); empty: none
  // The key that signs job credentials, in a file of mode 0600 (ReadSecretFile); replicas of one
  // cluster share it, so that running ranks' credentials stay valid after a failover. Empty:
  // STATE_DIR/job-credential.key, made on first start.
  std::string job_credential_key_file;
  // A replica that leads (replica.h): its lease's epoch fences every write of the store
  // (JobStoreOptions::fence_epoch), and on_fenced runs when a write found the lease passed on.
  int64_t fence_epoch = 0;
  std::function<void()> on_fenced;
  // JobStoreOptions::idle_in_transaction_limit: set by a leading replica below its lease.
  absl::Duration idle_in_transaction_limit = absl::ZeroDuration();
  // The coordinator addresses that ranks are given (TRAINYARD_COORDINATOR): every replica's, so
  // that they follow a failover. Empty: this coordinator's own address.
  std::string rank_coordinator_addresses;
};

// INVALID_ARGUMENT for a web console on a non-loopback address without TLS (tokens and cookies
// in clear) unless tls.insecure; for a bad web_public_url, an http:// one unless tls.insecure,
// and either web_public_url or web_trusted_proxies without a web_address.
absl::Status CheckWebAddress(const CoordinatorOptions& options);

class CoordinatorServer {
 public:
  // Opens the store (taking an exclusive lock on the state directory), reloads jobs, nodes, users
  // and tokens, and starts serving. On first start (no user yet) creates the user "admin" and
  // writes its token to admin_token_path() (mode 0600). Job credentials are signed with the key
  // in STATE_DIR/job-credential.key (0600; made on first start). FAILED_PRECONDITION if another
  // coordinator holds the state directory.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(CoordinatorOptions options);

  ~CoordinatorServer();  // Shutdown()

  // Stops accepting calls, ends streams, stops background threads, drains the store.
  void Shutdown();
  // Blocks until Shutdown has completed.
  void Wait();

  // "host:port" actually bound.
  const std::string& address() const { return address_; }
  // "host:port" of /metrics, empty if not serving metrics.
  std::string metrics_address() const {
    return metrics_endpoint_ ? metrics_endpoint_->bound_address() : std::string();
  }
  int port() const { return port_; }
  // "http(s)://host:port" of the web console, empty if not serving it.
  std::string web_url() const { return web_ ? web_->url() : std::string(); }

  JobManager& jobs() { return *jobs_; }
  IdentityRegistry& identities() { return *identities_; }
  // STATE_DIR/admin.token: the first admin's token, readable only by the coordinator's account.
  std::string admin_token_path() const { return options_.state_dir + "/admin.token"; }
  JobStoreStats Stats() const { return store_->Stats(); }
  NodeRegistry& nodes() { return *nodes_; }
  // One round of the ticker's work: marks silent nodes lost and fails their attempts, ends jobs
  // past their max_runtime, and moves finished jobs past their retention out of memory.
  void Tick();
  // The last of these (JobHistory::EvictFinished, in rounds of at most 1,000 jobs); returns how
  // many jobs left memory.
  int EvictFinishedJobs();
  JobLogs& logs() { return *logs_; }
  JobMetrics& step_metrics() { return *metrics_; }

 private:
  explicit CoordinatorServer(CoordinatorOptions options);
  // Start's steps, in order.
  absl::Status LockStateDir();  // the state directory, private, and its lock (one coordinator)
  absl::Status StartMetricsEndpoint();
  absl::Status OpenStore();  // SQLite in the state directory (restored first), or PostgreSQL
  absl::Status RestoreSqliteState(const std::string& db,
                                  const SqliteJobStoreOptions& store_options);
  absl::Status LoadIdentities();  // users, tokens, accounts; the first admin's token
  absl::Status LoadJobs();        // nodes, jobs, usage, request ids, running jobs' logs
  JobManagerOptions JobOptions();
  void MakeServices();
  absl::Status Serve(std::shared_ptr<grpc::ServerCredentials> credentials);
  void SchedulerLoop();
  void TickerLoop();
  void WakeScheduler();

  CoordinatorOptions options_;
  const Clock& clock_;
  int lock_fd_ = -1;
  std::unique_ptr<CoordinatorMetrics> metrics_prom_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<IdentityRegistry> identities_;
  std::unique_ptr<NodeRegistry> nodes_;
  std::unique_ptr<Rendezvous> rendezvous_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<JobLogs> logs_;
  std::unique_ptr<JobMetrics> metrics_;
  std::unique_ptr<JobHistory> history_;
  std::unique_ptr<ContextStore> contexts_;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<TrainerServiceImpl> trainer_service_;
  std::unique_ptr<NodeServiceImpl> node_service_;
  std::unique_ptr<RendezvousServiceImpl> rendezvous_service_;
  std::unique_ptr<IdentityServiceImpl> identity_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<web::WebConsole> web_;  // after server_: it calls it in-process
  // The web console's key to name the browser of each of its calls (IdentityRegistry::
  // SetConsoleKey); random at each start, never stored.
  std::string console_key_;
  std::string address_;
  int port_ = 0;

  absl::Mutex mu_;
  bool schedule_requested_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_usage_save_ = absl::Now();       // the ticker thread's
  absl::Time last_unfinished_save_ = absl::Now();  // (ticker thread)
  // The coordinators ranks are given (JobManagerOptions::rank_coordinators), known once bound.
  absl::Mutex address_mu_;  // held only to read or write it
  std::string rank_coordinators_ ABSL_GUARDED_BY(address_mu_);
  absl::Time last_history_purge_;  // likewise
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread scheduler_thread_;
  std::thread ticker_thread_;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_COORDINATOR_SERVER_H_
