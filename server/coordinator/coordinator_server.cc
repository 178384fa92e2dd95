#include "server/coordinator/coordinator_server.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/credentials.h"
#include "common/log_text.h"
#include "common/malformed_request.h"
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
  const std::string& dir = s->options_.state_dir;
  RETURN_IF_ERROR(MakePrivateDir(dir, /*passable=*/s->options_.checkpoint_root.empty()));
  const std::string lock_path = dir + "/coordinator.lock";
  s->lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (s->lock_fd_ < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("state_dir: cannot open ", lock_path, ": ", strerror(errno)));
  }
  if (flock(s->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("state_dir: ", dir, " is in use by another coordinator"));
  }

  s->metrics_prom_ = std::make_unique<CoordinatorMetrics>();
  if (!s->options_.metrics_address.empty()) {
    MetricsEndpointOptions metrics;
    metrics.address = s->options_.metrics_address;
    metrics.token_file = s->options_.metrics_token_file;
    metrics.insecure = s->options_.metrics_insecure;
    if (s->options_.metrics_tls) {
      metrics.tls_cert_file = s->options_.tls.cert_file;
      metrics.tls_key_file = s->options_.tls.key_file;
      metrics.tls_reload = absl::Seconds(s->options_.tls.reload_seconds);
    }
    ASSIGN_OR_RETURN(s->metrics_endpoint_,
                     MetricsEndpoint::Start(metrics, s->metrics_prom_->registry()));
  }
  SqliteJobStoreOptions store_options;
  store_options.group_commit = s->options_.group_commit;
  store_options.on_commit = [m = s->metrics_prom_.get()](double seconds) {
    m->ObserveStoreCommit(seconds);
  };
  store_options.fence_epoch = s->options_.fence_epoch;
  store_options.on_fenced = s->options_.on_fenced;
  store_options.idle_in_transaction_limit = s->options_.idle_in_transaction_limit;
  if (IsPostgresLocation(s->options_.store)) {
    if (!s->options_.restore_from.empty()) {
      return absl::InvalidArgumentError(
          "restore_from: a PostgreSQL store is restored with pg_restore or psql, not --restore "
          "(docs/operations.md)");
    }
    ASSIGN_OR_RETURN(s->store_, OpenPostgresJobStore(s->options_.store, store_options));
    spdlog::info("state in PostgreSQL: {}", DescribePostgresLocation(s->options_.store));
  } else if (!s->options_.store.empty()) {
    return absl::InvalidArgumentError(
        "store: a PostgreSQL URI, postgresql://[user@]host[:port]/database (or leave it out for "
        "STATE_DIR/coordinator.db)");
  } else {
    if (!s->options_.restore_from.empty()) {
      // Only into an empty state directory: a restore never overwrites state.
      const std::string db = dir + "/coordinator.db";
      if (::access(db.c_str(), F_OK) == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "restore_from: ", db, " exists; restore into a state directory without one"));
      }
      const std::string part = db + ".restoring";
      ::unlink(part.c_str());  // (an interrupted restore's)
      absl::Status restored = RestoreSqliteBackup(s->options_.restore_from, part);
      // Read whole, as the start below will, before it takes the state directory's name: a
      // file that only looks like a backup (another schema under the same table name) fails
      // here and leaves the directory as it was, so that a retry with the right file works.
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
      spdlog::info("restored the state from {}", s->options_.restore_from);
    }
    // SQLite gives its -wal and -shm files the database file's mode.
    RETURN_IF_ERROR(MakePrivateFile(dir + "/coordinator.db"));
    ASSIGN_OR_RETURN(s->store_, OpenSqliteJobStore(dir + "/coordinator.db", store_options));
  }
  if (!s->options_.audit_log.empty()) RETURN_IF_ERROR(OpenAuditJsonLog(s->options_.audit_log));
  ASSIGN_OR_RETURN(std::string job_key, JobCredentialKey(dir, s->options_.job_credential_key_file));
  s->identities_ = std::make_unique<IdentityRegistry>(*s->store_, s->clock_, std::move(job_key));
  s->identities_->SetAuthThrottle(s->options_.limits.auth_per_token,
                                  s->options_.limits.auth_per_peer);
  s->identities_->SetMaxTokensPerUser(s->options_.limits.max_tokens_per_user);
  s->identities_->SetAuthFailureObserver(
      [m = s->metrics_prom_.get()](const char* reason) { m->ObserveAuthFailure(reason); });
  RETURN_IF_ERROR(s->identities_->Load());
  ASSIGN_OR_RETURN(std::optional<std::string> admin_token, s->identities_->BootstrapAdmin());
  if (admin_token.has_value()) {
    RETURN_IF_ERROR(WriteSecretFile(s->admin_token_path(), *admin_token));
    spdlog::info("created user admin; its token is in {} (readable only by this account)",
                 s->admin_token_path());
  }
  s->nodes_ = std::make_unique<NodeRegistry>(*s->store_, s->clock_, s->options_.node_timeout);
  s->rendezvous_ = std::make_unique<Rendezvous>(s->options_.limits.rendezvous);
  s->logs_ = std::make_unique<JobLogs>(/*max_records_per_job=*/50'000,
                                       s->options_.limits.max_log_bytes_per_job);
  s->metrics_ = std::make_unique<JobMetrics>(/*max_records_per_job=*/200'000,
                                             s->options_.limits.max_metric_bytes_per_job);
  JobManagerOptions jobs;
  // Set before serving: a submit's callback wakes the scheduler at once.
  jobs.scheduler_wakeup = [raw = s.get()] { raw->WakeScheduler(); };
  // (The address exists only once the server is bound, with the server already serving: a
  // node's hello in the instant before would be sent its assignments without it; new placements
  // come only from the scheduler, which starts after.)
  jobs.rank_coordinators = [raw = s.get()] {
    absl::MutexLock lock(&raw->address_mu_);
    return raw->rank_coordinators_;
  };
  jobs.preemption = s->options_.preemption;
  jobs.preemption_grace = s->options_.preemption_grace;
  jobs.min_run_time = s->options_.min_run_time;
  jobs.max_preemption_grace = s->options_.max_preemption_grace;
  jobs.max_kept_checkpoints = s->options_.limits.max_kept_checkpoints;
  jobs.sharing = [ids = s->identities_.get()] { return ids->Sharing(); };
  jobs.fair_share_half_life = s->options_.fair_share_half_life;
  jobs.usage_reset = s->options_.fair_share_usage_reset;
  jobs.job_credential = [ids = s->identities_.get()](const std::string& job, int32_t attempt) {
    return ids->JobCredentialFor(job, attempt);
  };
  jobs.checkpoint_root = s->options_.checkpoint_root.empty()
                             ? std::filesystem::absolute(dir + "/checkpoints").string()
                             : s->options_.checkpoint_root;
  jobs.finished_job_retention = s->options_.limits.finished_job_retention;
  jobs.metrics = s->metrics_prom_.get();
  jobs.default_max_queued_jobs = s->options_.limits.max_queued_jobs_per_user;
  jobs.max_pending_submits = s->options_.limits.max_pending_submits;
  // A listing stays well inside a message, whatever its jobs hold.
  jobs.max_list_bytes = s->options_.limits.max_list_bytes > 0
                            ? s->options_.limits.max_list_bytes
                            : static_cast<size_t>(s->options_.max_message_bytes) / 2;
  // A job's end stores its logs and metrics in the same transaction.
  jobs.end_records = [logs = s->logs_.get(), metrics = s->metrics_.get(),
                      history = s->options_.limits.history](const v1::Job& job) {
    return SeriesRecords(*logs, *metrics, history, job.id(), job.end_time_ms());
  };
  s->jobs_ = std::make_unique<JobManager>(*s->store_, *s->nodes_, *s->rendezvous_, s->clock_,
                                          std::move(jobs));
  RETURN_IF_ERROR(s->jobs_->LoadUsage());
  RETURN_IF_ERROR(s->jobs_->LoadRequestIds());
  s->identities_->SetAccountInUse([jobs = s->jobs_.get()](const std::string& account) {
    return jobs->UnfinishedJobOf(account);
  });
  ASSIGN_OR_RETURN(auto stored_nodes, s->store_->LoadNodes());
  RETURN_IF_ERROR(s->nodes_->Load(stored_nodes));
  ASSIGN_OR_RETURN(auto stored_jobs, s->store_->LoadJobs());
  RETURN_IF_ERROR(s->jobs_->Load(stored_jobs));
  spdlog::info(
      "loaded {} jobs and {} nodes from {}", stored_jobs.size(), stored_nodes.size(),
      IsPostgresLocation(s->options_.store) ? DescribePostgresLocation(s->options_.store) : dir);

  s->history_ = std::make_unique<JobHistory>(*s->store_, *s->jobs_, *s->logs_, *s->metrics_,
                                             s->clock_, s->options_.limits.history);
  // Running jobs' logs and metrics from before a restart (or from the leader before this one).
  ASSIGN_OR_RETURN(const int resumed, s->history_->LoadUnfinished());
  if (resumed > 0) spdlog::info("loaded the logs and metrics of {} unfinished job(s)", resumed);
  const IdentityRegistry& ids = *s->identities_;
  // Node loss reaches the job manager's attempt tracker by the registry's listener.
  AttemptTracker* attempts = s->jobs_.get();
  s->nodes_->SetLostListener([attempts](const std::vector<std::string>& lost) {
    for (const auto& id : lost) spdlog::warn("node {} lost: no heartbeat", id);
    attempts->OnNodesLost(lost);
  });
  // Each service gets the handlers it calls (job_handlers.h).
  s->job_service_ = std::make_unique<JobServiceImpl>(*s->jobs_, *s->jobs_, *s->logs_, *s->metrics_,
                                                     *s->history_, ids);
  // (A new name for this coordinator's life: ranks send their recent reports again to it.)
  s->trainer_service_ = std::make_unique<TrainerServiceImpl>(
      *s->jobs_, *s->metrics_, s->metrics_prom_.get(), ids, Base64Url(RandomBytes(12)));
  s->node_service_ = std::make_unique<NodeServiceImpl>(
      *s->nodes_, *s->jobs_, *s->jobs_, *s->logs_, s->options_.heartbeat_interval, ids,
      /*node_certificates=*/!s->options_.tls.client_ca_file.empty());
  s->node_service_->SetMetrics(s->metrics_prom_.get());
  s->rendezvous_service_ = std::make_unique<RendezvousServiceImpl>(*s->rendezvous_, ids);
  s->identity_service_ = std::make_unique<IdentityServiceImpl>(*s->identities_);
  s->admin_service_ = std::make_unique<AdminServiceImpl>(*s->store_, dir, *s->identities_);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(s->options_.listen_address, credentials, &s->port_);
  builder.SetMaxReceiveMessageSize(s->options_.max_message_bytes);
  builder.SetMaxSendMessageSize(s->options_.max_message_bytes);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  // First, so that the metrics count the corrected code.
  interceptors.push_back(MalformedRequestInterceptorFactory());
  interceptors.push_back(s->metrics_prom_->InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.RegisterService(s->job_service_.get());
  builder.RegisterService(s->node_service_.get());
  builder.RegisterService(s->rendezvous_service_.get());
  builder.RegisterService(s->trainer_service_.get());
  builder.RegisterService(s->identity_service_.get());
  builder.RegisterService(s->admin_service_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("listen: cannot bind ", s->options_.listen_address));
  }
  const std::string& listen = s->options_.listen_address;
  s->address_ = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", s->port_);
  {
    absl::MutexLock lock(&s->address_mu_);
    s->rank_coordinators_ = RankCoordinators(s->options_.rank_coordinator_addresses, s->address_);
  }

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
