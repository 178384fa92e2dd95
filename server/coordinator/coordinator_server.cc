#include "server/coordinator/coordinator_server.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/credentials.h"
#include "common/failpoint.h"
#include "common/grpc_server.h"
#include "common/log_text.h"
#include "common/status_macros.h"
#include "server/coordinator/audit.h"

namespace trainyard::coordinator {
namespace {

// "HOST:PORT" with a port in 0..65535: INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckListenAddress(const char* field, const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(address).substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected HOST:PORT with a port in 0..65535, got ", Quoted(address)));
  }
  return absl::OkStatus();
}

// Creates `dir` (and its parents) if missing and makes it the coordinator's alone: mode 0700, or
// 0711 when `passable` (others may pass through to the checkpoint folders inside it, which
// workers give to the jobs' owners, but not list it or read its files).
absl::Status MakePrivateDir(const std::string& dir, bool passable) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("state_dir: cannot create ", dir, ": ", ec.message()));
  }
  const mode_t mode = passable ? 0711 : 0700;
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("state_dir: ", dir, " is not a folder"));
  }
  if ((st.st_mode & 0777) != mode && ::chmod(dir.c_str(), mode) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("state_dir: cannot make ", dir, " private (chmod): ", strerror(errno)));
  }
  return absl::OkStatus();
}

// Creates `path` empty if missing and gives it mode 0600 (a database others must not read).
absl::Status MakePrivateFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0 || ::fchmod(fd, 0600) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("state_dir: cannot make ", path, " private: ", strerror(err)));
  }
  ::close(fd);
  return absl::OkStatus();
}

// The key that signs job credentials: read from `file` (replicas share one), or from
// STATE_DIR/job-credential.key, made there on first start.
absl::StatusOr<std::string> JobCredentialKey(const std::string& state_dir,
                                             const std::string& file) {
  if (!file.empty()) {
    auto key = ReadSecretFile(file);
    if (!key.ok()) {
      return absl::Status(key.status().code(),
                          absl::StrCat("job_credential_key: ", key.status().message()));
    }
    if (key->size() < 32) {
      return absl::InvalidArgumentError(
          absl::StrCat("job_credential_key: ", file,
                       " holds fewer than 32 bytes; make one with "
                       "`head -c 32 /dev/urandom | base64 > FILE` (mode 0600)"));
    }
    return key;
  }
  const std::string path = state_dir + "/job-credential.key";
  auto key = ReadSecretFile(path);
  if (key.ok() || !absl::IsNotFound(key.status())) return key;
  const std::string fresh = Base64Url(RandomBytes(32));
  RETURN_IF_ERROR(WriteSecretFile(path, fresh));
  return fresh;
}

// What ranks are given as TRAINYARD_COORDINATOR: `own` alone, or the replicas' `list` with `own`
// moved first when it is in it (a new rank calls the leader that placed it first).
std::string RankCoordinators(const std::string& list, const std::string& own) {
  if (list.empty()) return own;
  std::vector<std::string> addresses = absl::StrSplit(list, ',');
  for (std::string& a : addresses) a = std::string(absl::StripAsciiWhitespace(a));
  auto it = std::find(addresses.begin(), addresses.end(), own);
  if (it != addresses.end()) std::rotate(addresses.begin(), it, it + 1);
  return absl::StrJoin(addresses, ",");
}

}  // namespace

CoordinatorServer::CoordinatorServer(CoordinatorOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? *options_.clock : RealClock::Get()) {}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    CoordinatorOptions options) {
  if (options.state_dir.empty()) return absl::InvalidArgumentError("state_dir: required");
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer(std::move(options)));
  // Everything that can be checked is checked before anything is written: the listen address,
  // the TLS files (read here), the metrics address.
  RETURN_IF_ERROR(CheckListenAddress("listen", s->options_.listen_address));
  if (!s->options_.metrics_address.empty()) {
    RETURN_IF_ERROR(CheckListenAddress("metrics_address", s->options_.metrics_address));
  }
  // Client certificates refused at the handshake are audited, with why.
  s->options_.tls.on_refused_certificate = [](const std::string& why) {
    WriteAudit({"anonymous", "TLS handshake", "", absl::UnauthenticatedError(why), ""});
  };
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   MakeServerCredentials(s->options_.tls, s->options_.listen_address));
  RETURN_IF_ERROR(s->LockStateDir());
  RETURN_IF_ERROR(s->StartMetricsEndpoint());
  RETURN_IF_ERROR(s->OpenStore());
  if (!s->options_.audit_log.empty()) RETURN_IF_ERROR(OpenAuditJsonLog(s->options_.audit_log));
  RETURN_IF_ERROR(s->LoadIdentities());
  RETURN_IF_ERROR(s->LoadJobs());
  s->MakeServices();
  RETURN_IF_ERROR(s->Serve(std::move(credentials)));
  if (s->options_.background_threads) {
    // Named, so that top -H and /proc/PID/task show where the coordinator's time goes.
    s->scheduler_thread_ = std::thread([raw = s.get()] {
      pthread_setname_np(pthread_self(), "ty-scheduler");
      raw->SchedulerLoop();
    });
    s->ticker_thread_ = std::thread([raw = s.get()] {
      pthread_setname_np(pthread_self(), "ty-ticker");
      raw->TickerLoop();
    });
    s->WakeScheduler();
  }
  return s;
}

absl::Status CoordinatorServer::LockStateDir() {
  const std::string& dir = options_.state_dir;
  RETURN_IF_ERROR(MakePrivateDir(dir, /*passable=*/options_.checkpoint_root.empty()));
  const std::string lock_path = dir + "/coordinator.lock";
  lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (lock_fd_ < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("state_dir: cannot open ", lock_path, ": ", strerror(errno)));
  }
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("state_dir: ", dir, " is in use by another coordinator"));
  }
  return absl::OkStatus();
}

absl::Status CoordinatorServer::StartMetricsEndpoint() {
  metrics_prom_ = std::make_unique<CoordinatorMetrics>();
  if (options_.metrics_address.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(
      metrics_endpoint_,
      MetricsEndpoint::Start(
          MetricsOptionsFor(options_.metrics_address, options_.metrics_token_file,
                            options_.metrics_insecure, options_.metrics_tls, options_.tls),
          metrics_prom_->registry()));
  return absl::OkStatus();
}

absl::Status CoordinatorServer::OpenStore() {
  SqliteJobStoreOptions store_options;
  store_options.group_commit = options_.group_commit;
  store_options.on_commit = [m = metrics_prom_.get()](double seconds) {
    m->ObserveStoreCommit(seconds);
  };
  store_options.fence_epoch = options_.fence_epoch;
  store_options.on_fenced = options_.on_fenced;
  store_options.idle_in_transaction_limit = options_.idle_in_transaction_limit;
  if (IsPostgresLocation(options_.store)) {
    if (!options_.restore_from.empty()) {
      return absl::InvalidArgumentError(
          "restore_from: a PostgreSQL store is restored with pg_restore or psql, not --restore "
          "(docs/operations.md)");
    }
    ASSIGN_OR_RETURN(store_, OpenPostgresJobStore(options_.store, store_options));
    spdlog::info("state in PostgreSQL: {}", DescribePostgresLocation(options_.store));
    return absl::OkStatus();
  }
  if (!options_.store.empty()) {
    return absl::InvalidArgumentError(
        "store: a PostgreSQL URI, postgresql://[user@]host[:port]/database (or leave it out for "
        "STATE_DIR/coordinator.db)");
  }
  const std::string db = options_.state_dir + "/coordinator.db";
  if (!options_.restore_from.empty()) RETURN_IF_ERROR(RestoreSqliteState(db, store_options));
  // SQLite gives its -wal and -shm files the database file's mode.
  RETURN_IF_ERROR(MakePrivateFile(db));
  ASSIGN_OR_RETURN(store_, OpenSqliteJobStore(db, store_options));
  return absl::OkStatus();
}

absl::Status CoordinatorServer::RestoreSqliteState(const std::string& db,
                                                   const SqliteJobStoreOptions& store_options) {
  // Only into an empty state directory: a restore never overwrites state.
  if (::access(db.c_str(), F_OK) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("restore_from: ", db, " exists; restore into a state directory without one"));
  }
  const std::string part = db + ".restoring";
  ::unlink(part.c_str());  // (an interrupted restore's)
  absl::Status restored = RestoreSqliteBackup(options_.restore_from, part);
  // Read whole, as the start will, before it takes the state directory's name: a file that only
  // looks like a backup (another schema under the same table name) fails here and leaves the
  // directory as it was, so that a retry with the right file works.
  if (restored.ok()) {
    auto probe = OpenSqliteJobStore(part, store_options);
    if (!probe.ok()) {
      restored = probe.status();
    } else if (auto jobs = (*probe)->LoadJobs(); !jobs.ok()) {
      restored = jobs.status();
    } else if (auto nodes = (*probe)->LoadNodes(); !nodes.ok()) {
      restored = nodes.status();
    }
  }
  for (const char* suffix : {"-wal", "-shm"}) {
    if (!restored.ok()) ::unlink(absl::StrCat(part, suffix).c_str());
  }
  if (restored.ok() && ::rename(part.c_str(), db.c_str()) != 0) {
    restored = absl::InternalError(absl::StrCat("cannot rename ", part, ": ", strerror(errno)));
  }
  if (!restored.ok()) {
    ::unlink(part.c_str());
    return absl::Status(restored.code(), absl::StrCat("restore_from: ", restored.message()));
  }
  spdlog::info("restored the state from {}", options_.restore_from);
  return absl::OkStatus();
}

absl::Status CoordinatorServer::LoadIdentities() {
  ASSIGN_OR_RETURN(std::string job_key,
                   JobCredentialKey(options_.state_dir, options_.job_credential_key_file));
  identities_ = std::make_unique<IdentityRegistry>(*store_, clock_, std::move(job_key));
  identities_->SetAuthThrottle(options_.limits.auth_per_token, options_.limits.auth_per_peer,
                               options_.limits.auth_peer_ipv6_prefix);
  identities_->SetMaxTokensPerUser(options_.limits.max_tokens_per_user);
  if (!options_.web_address.empty()) {
    console_key_ = Base64Url(RandomBytes(32));
    identities_->SetConsoleKey(console_key_);
  }
  identities_->SetAuthFailureObserver(
      [m = metrics_prom_.get()](const char* reason) { m->ObserveAuthFailure(reason); });
  RETURN_IF_ERROR(identities_->Load());
  ASSIGN_OR_RETURN(std::optional<std::string> admin_token, identities_->BootstrapAdmin());
  if (admin_token.has_value()) {
    RETURN_IF_ERROR(WriteSecretFile(admin_token_path(), *admin_token));
    spdlog::info("created user admin; its token is in {} (readable only by this account)",
                 admin_token_path());
  }
  return absl::OkStatus();
}

JobManagerOptions CoordinatorServer::JobOptions() {
  JobManagerOptions jobs;
  // Set before serving: a submit's callback wakes the scheduler at once.
  jobs.scheduler_wakeup = [this] { WakeScheduler(); };
  // (The address exists only once the server is bound, with the server already serving: a
  // node's hello in the instant before would be sent its assignments without it; new placements
  // come only from the scheduler, which starts after.)
  jobs.rank_coordinators = [this] {
    absl::MutexLock lock(&address_mu_);
    return rank_coordinators_;
  };
  jobs.preemption = options_.preemption;
  jobs.preemption_grace = options_.preemption_grace;
  jobs.min_run_time = options_.min_run_time;
  jobs.max_preemption_grace = options_.max_preemption_grace;
  jobs.max_kept_checkpoints = options_.limits.max_kept_checkpoints;
  jobs.sharing = [ids = identities_.get()] { return ids->Sharing(); };
  jobs.fair_share_half_life = options_.fair_share_half_life;
  jobs.usage_reset = options_.fair_share_usage_reset;
  jobs.job_credential = [ids = identities_.get()](const std::string& job, int32_t attempt) {
    return ids->JobCredentialFor(job, attempt);
  };
  jobs.checkpoint_root =
      options_.checkpoint_root.empty()
          ? std::filesystem::absolute(options_.state_dir + "/checkpoints").string()
          : options_.checkpoint_root;
  jobs.finished_job_retention = options_.limits.finished_job_retention;
  jobs.metrics = metrics_prom_.get();
  jobs.default_max_queued_jobs = options_.limits.max_queued_jobs_per_user;
  jobs.max_pending_submits = options_.limits.max_pending_submits;
  // A listing stays well inside a message, whatever its jobs hold.
  jobs.max_list_bytes = options_.limits.max_list_bytes > 0
                            ? options_.limits.max_list_bytes
                            : static_cast<size_t>(options_.max_message_bytes) / 2;
  // A job's end stores its logs and metrics in the same transaction.
  jobs.end_records = [logs = logs_.get(), metrics = metrics_.get(),
                      history = options_.limits.history](const v1::Job& job) {
    return SeriesRecords(*logs, *metrics, history, job.id(), job.end_time_ms());
  };
  return jobs;
}

absl::Status CoordinatorServer::LoadJobs() {
  Failpoint("load-jobs");  // (tests: a start as slow as a large state's)
  nodes_ = std::make_unique<NodeRegistry>(*store_, clock_, options_.node_timeout);
  rendezvous_ = std::make_unique<Rendezvous>(options_.limits.rendezvous);
  logs_ = std::make_unique<JobLogs>(/*max_records_per_job=*/50'000,
                                    options_.limits.max_log_bytes_per_job);
  metrics_ = std::make_unique<JobMetrics>(/*max_records_per_job=*/200'000,
                                          options_.limits.max_metric_bytes_per_job);
  jobs_ = std::make_unique<JobManager>(*store_, *nodes_, *rendezvous_, clock_, JobOptions());
  RETURN_IF_ERROR(jobs_->LoadUsage());
  RETURN_IF_ERROR(jobs_->LoadRequestIds());
  identities_->SetAccountInUse(
      [jobs = jobs_.get()](const std::string& account) { return jobs->UnfinishedJobOf(account); });
  ASSIGN_OR_RETURN(auto stored_nodes, store_->LoadNodes());
  RETURN_IF_ERROR(nodes_->Load(stored_nodes));
  ASSIGN_OR_RETURN(auto stored_jobs, store_->LoadJobs());
  RETURN_IF_ERROR(jobs_->Load(stored_jobs));
  spdlog::info("loaded {} jobs and {} nodes from {}", stored_jobs.size(), stored_nodes.size(),
               IsPostgresLocation(options_.store) ? DescribePostgresLocation(options_.store)
                                                  : options_.state_dir);
  history_ = std::make_unique<JobHistory>(*store_, *jobs_, *logs_, *metrics_, clock_,
                                          options_.limits.history);
  // Jobs' contexts stay as long as their logs (never-ending retention: ten years).
  ContextStoreOptions context_options;
  context_options.claimed = std::min(options_.limits.history.retention, absl::Hours(24 * 3650));
  contexts_ = std::make_unique<ContextStore>(*store_, clock_, context_options);
  // Running jobs' logs and metrics from before a restart (or from the leader before this one).
  ASSIGN_OR_RETURN(const int resumed, history_->LoadUnfinished());
  if (resumed > 0) spdlog::info("loaded the logs and metrics of {} unfinished job(s)", resumed);
  // Node loss reaches the job manager's attempt tracker by the registry's listener.
  AttemptTracker* attempts = jobs_.get();
  nodes_->SetLostListener([attempts](const std::vector<std::string>& lost) {
    for (const auto& id : lost) spdlog::warn("node {} lost: no heartbeat", id);
    attempts->OnNodesLost(lost);
  });
  return absl::OkStatus();
}

// Each service gets the handlers it calls (job_handlers.h).
void CoordinatorServer::MakeServices() {
  const IdentityRegistry& ids = *identities_;
  job_service_ = std::make_unique<JobServiceImpl>(*jobs_, *jobs_, *logs_, *metrics_, *history_, ids,
                                                  *contexts_);
  // (A new name for this coordinator's life: ranks send their recent reports again to it.)
  trainer_service_ = std::make_unique<TrainerServiceImpl>(*jobs_, *metrics_, metrics_prom_.get(),
                                                          ids, Base64Url(RandomBytes(12)));
  node_service_ = std::make_unique<NodeServiceImpl>(
      *nodes_, *jobs_, *jobs_, *logs_, *contexts_, options_.heartbeat_interval, ids,
      /*node_certificates=*/!options_.tls.client_ca_file.empty());
  node_service_->SetMetrics(metrics_prom_.get());
  rendezvous_service_ = std::make_unique<RendezvousServiceImpl>(*rendezvous_, ids);
  identity_service_ = std::make_unique<IdentityServiceImpl>(*identities_);
  admin_service_ = std::make_unique<AdminServiceImpl>(*store_, options_.state_dir, *identities_);
}

absl::Status CheckWebAddress(const CoordinatorOptions& options) {
  if (!options.web_address.empty() && options.tls.cert_file.empty() && !options.tls.insecure &&
      !IsLoopback(options.web_address)) {
    return absl::InvalidArgumentError(
        "--web-address: a non-loopback address sends tokens and session cookies: serve it "
        "with --tls-cert/--tls-key (or say --insecure)");
  }
  if (options.web_address.empty() &&
      (!options.web_public_url.empty() || !options.web_trusted_proxies.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.web_public_url.empty() ? "--web-trusted-proxies" : "--web-public-url",
                     ": there is no web console without --web-address"));
  }
  ASSIGN_OR_RETURN(const std::string origin, web::WebPublicOrigin(options.web_public_url));
  if (absl::StartsWith(origin, "http://") && !options.tls.insecure) {
    return absl::InvalidArgumentError(
        "--web-public-url: an http:// URL sends tokens and session cookies in clear: use the "
        "proxy's https:// one (or say --insecure)");
  }
  return absl::OkStatus();
}

absl::Status CoordinatorServer::Serve(std::shared_ptr<grpc::ServerCredentials> credentials) {
  GrpcServerOptions grpc_options;
  grpc_options.listen_address = options_.listen_address;
  grpc_options.credentials = std::move(credentials);
  grpc_options.max_message_bytes = options_.max_message_bytes;
  grpc_options.services = {job_service_.get(),        node_service_.get(),
                           rendezvous_service_.get(), trainer_service_.get(),
                           identity_service_.get(),   admin_service_.get()};
  grpc_options.interceptors.push_back(metrics_prom_->InterceptorFactory());
  ASSIGN_OR_RETURN(StartedGrpcServer started, StartGrpcServer(std::move(grpc_options)));
  server_ = std::move(started.server);
  port_ = started.port;
  const std::string& listen = options_.listen_address;
  address_ = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port_);
  {
    absl::MutexLock lock(&address_mu_);
    rank_coordinators_ = RankCoordinators(options_.rank_coordinator_addresses, address_);
  }
  RETURN_IF_ERROR(CheckWebAddress(options_));
  if (!options_.web_address.empty()) {
    web::WebConsoleOptions web_options;
    web_options.address = options_.web_address;
    web_options.tls_cert_file = options_.tls.cert_file;
    web_options.tls_key_file = options_.tls.key_file;
    web_options.tls_reload = absl::Seconds(std::max(1, options_.tls.reload_seconds));
    web_options.console_key = console_key_;
    web_options.public_url = options_.web_public_url;
    web_options.trusted_proxies = options_.web_trusted_proxies;
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    ASSIGN_OR_RETURN(web_, web::WebConsole::Start(web_options, server_->InProcessChannel(args)));
  }
  return absl::OkStatus();
}

CoordinatorServer::~CoordinatorServer() {
  Shutdown();
  if (lock_fd_ >= 0) close(lock_fd_);
}

void CoordinatorServer::WakeScheduler() {
  absl::MutexLock lock(&mu_);
  schedule_requested_ = true;
}

void CoordinatorServer::SchedulerLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return schedule_requested_ || stopping_;
    };
    // A pass at least once a second: backfill windows move with time.
    mu_.AwaitWithTimeout(absl::Condition(&woken), absl::Seconds(1));
    if (stopping_) break;
    schedule_requested_ = false;
    mu_.Unlock();
    const absl::Time start = absl::Now();
    const int placed = jobs_->SchedulePass();
    const absl::Duration took = absl::Now() - start;
    metrics_prom_->ObserveSchedulingPass(absl::ToDoubleSeconds(took));
    if (placed > 0) spdlog::info("scheduler placed {} job(s)", placed);
    mu_.Lock();
    // Under a burst the passes are coalesced: the next waits at least as long as this one took
    // (and 2 ms), so that submits and rank reports get the job manager at least half the time.
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stop), std::max(took, absl::Milliseconds(2)));
  }
}

void CoordinatorServer::Tick() {
  // (The registry tells the job manager of lost nodes through its lost listener.)
  const std::vector<std::string> lost = nodes_->CheckTimeouts();
  // Their sessions end once the cancels of their ranks are written: a worker that is still there
  // (its heartbeats late, or its connection half open) reconnects and says what still runs.
  nodes_->CloseSessions(
      lost, absl::UnavailableError(absl::StrCat("node declared lost: no heartbeat for ",
                                                absl::FormatDuration(nodes_->node_timeout()),
                                                "; reconnect and say hello again")));
  if (const int ended = jobs_->EnforceRuntimeLimits(); ended > 0) {
    spdlog::info("{} job(s) exceeded their max_runtime", ended);
  }
  jobs_->ChargeUsage();
  if (const int again = jobs_->RetryUnsaved(); again > 0) {
    spdlog::info("wrote {} job(s) again after a failed write", again);
  }
  EvictFinishedJobs();
  metrics_prom_->Refresh(jobs_->CountByState(), jobs_->NodesWithAllocations(),
                         jobs_->RunningJobs());
  metrics_prom_->RefreshAccounts(jobs_->AccountUsages());
  const absl::Time now = absl::Now();
  if (now - last_usage_save_ >= options_.usage_save_interval) {
    last_usage_save_ = now;
    if (absl::Status s = jobs_->SaveUsage(); !s.ok()) {
      spdlog::error("saving accounts' usage failed: {}", std::string(s.message()));
    }
  }
  // Every interval (a job's end stores its own in the transaction that ends it).
  if (now - last_unfinished_save_ >= options_.limits.history.save_unfinished_interval) {
    last_unfinished_save_ = now;
    if (absl::Status s = history_->SaveUnfinished(/*changed_only=*/true).status(); !s.ok()) {
      spdlog::error("saving running jobs' logs and metrics failed: {}", std::string(s.message()));
    }
  }
}

int CoordinatorServer::EvictFinishedJobs() {
  int evicted = 0;
  while (true) {
    absl::StatusOr<int> n = history_->EvictFinished(1000);
    if (!n.ok()) {
      spdlog::error("moving finished jobs to the store failed: {}",
                    std::string(n.status().message()));
      break;
    }
    evicted += *n;
    if (*n < 1000) break;
  }
  const absl::Time now = clock_.Now();
  if (now - last_history_purge_ >= absl::Minutes(10)) {
    last_history_purge_ = now;
    if (absl::Status s = history_->PurgeExpired(); !s.ok()) {
      spdlog::error("deleting expired job logs and metrics failed: {}", std::string(s.message()));
    }
  }
  return evicted;
}

void CoordinatorServer::TickerLoop() {
  const absl::Duration period = std::max(
      absl::Milliseconds(100), std::min(options_.heartbeat_interval, options_.node_timeout / 4));
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), period);
    if (stopping_) break;
    mu_.Unlock();
    Tick();
    mu_.Lock();
  }
}

void CoordinatorServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      mu_.Await(absl::Condition(&stopped_));
      return;
    }
    stopping_ = true;
  }
  web_.reset();  // its live streams are calls of server_
  if (server_ != nullptr) {
    // Streams (watches, node sessions) are cancelled after the deadline.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  if (scheduler_thread_.joinable()) scheduler_thread_.join();
  if (ticker_thread_.joinable()) ticker_thread_.join();
  if (server_ != nullptr) server_->Wait();
  if (jobs_ != nullptr && store_ != nullptr) {
    jobs_->ChargeUsage();
    if (absl::Status s = jobs_->SaveUsage(); !s.ok()) {
      spdlog::error("saving accounts' usage failed: {}", std::string(s.message()));
    }
  }
  if (history_ != nullptr) {
    // (After the server stopped: no rank adds lines or steps any more.)
    absl::StatusOr<int> saved = history_->SaveUnfinished();
    if (!saved.ok()) {
      spdlog::error("saving unfinished jobs' logs and metrics failed: {}",
                    std::string(saved.status().message()));
    } else if (*saved > 0) {
      spdlog::info("saved the logs and metrics of {} unfinished job(s)", *saved);
    }
  }
  // Destroying the store drains its queue (every acknowledged write reaches the disk) and runs
  // the last callbacks, which still use the managers: so the store goes first.
  store_.reset();
  if (!options_.audit_log.empty()) CloseAuditJsonLog();
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

void CoordinatorServer::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&stopped_));
}

}  // namespace trainyard::coordinator
