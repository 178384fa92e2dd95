#include "server/coordinator/replica.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/coordinator_endpoints.h"
#include "common/server_main.h"
#include "common/tls.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/leader_lease.h"
#include "spdlog/spdlog.h"

namespace trainyard::coordinator {
namespace {

// Every method, while this replica stands by: UNAVAILABLE, with the leader's address.
class StandbyService final : public grpc::CallbackGenericService {
 public:
  void SetLeader(const std::string& address) {
    absl::MutexLock lock(&mu_);
    leader_ = address;
  }

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    std::string leader;
    {
      absl::MutexLock lock(&mu_);
      leader = leader_;
    }
    ctx->AddTrailingMetadata(kLeaderMetadata, leader);
    class Refusal final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refusal(const grpc::Status& status) { Finish(status); }
      void OnDone() override { delete this; }
    };
    return new Refusal(grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        leader.empty() ? "this coordinator is a standby and no leader is known yet; try again"
                       : absl::StrCat("this coordinator is a standby; the leader is at ", leader)));
  }

 private:
  absl::Mutex mu_;
  std::string leader_ ABSL_GUARDED_BY(mu_);
};

// A standby's gRPC server and its service (which gRPC lets serve one server only).
struct Standby {
  std::unique_ptr<StandbyService> service = std::make_unique<StandbyService>();
  std::unique_ptr<grpc::Server> server;
};

// The standby's gRPC server on `address`; its server is nullptr (logged) if it cannot bind.
Standby StartStandby(const CoordinatorOptions& options, const std::string& address, int* port) {
  Standby standby;
  StandbyService& service = *standby.service;
  auto credentials = MakeServerCredentials(options.tls, address);
  if (!credentials.ok()) {
    spdlog::error("standby: {}", std::string(credentials.status().message()));
    return standby;
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, *credentials, port);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    spdlog::error("standby: cannot listen on {}", address);
    return standby;
  }
  // Load balancers and Kubernetes' readiness probes send traffic to the leader only.
  if (auto* health = server->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(false);
  }
  standby.server = std::move(server);
  return standby;
}

// HOST:STATE_DIR: one coordinator per state directory (it takes a lock), so unique, and the same
// across restarts in place, which then take their own lease back at once.
std::string DefaultReplicaId(const std::string& state_dir) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::absolute(state_dir, ec);
  return absl::StrCat(host, ":", ec ? state_dir : dir.lexically_normal().string());
}

enum class LeaderEnd { kSignal, kSteppedDown };

// Renews the lease of `epoch` every renew_interval on a thread of its own from its construction
// (before the leader's start, which loads the whole state: a start longer than the lease must not
// let it lapse) until Stop() or its destruction; a renewal stuck on a cut-off database never keeps
// the caller from stepping down in time.
class LeaseRenewer {
 public:
  LeaseRenewer(LeaderLease& lease, int64_t epoch, absl::Time acquired_at,
               const ReplicaOptions& replica)
      : renewed_(acquired_at) {
    thread_ =
        std::thread([this, &lease, epoch, ttl = replica.lease_ttl, every = replica.renew_interval] {
          absl::MutexLock lock(&mu_);
          while (!stop_) {
            mu_.AwaitWithTimeout(absl::Condition(&stop_), every);
            if (stop_) break;
            const absl::Time start = absl::Now();  // (local clock, taken before the call)
            mu_.Unlock();
            const absl::Status status = lease.Renew(epoch, ttl);
            mu_.Lock();
            if (status.ok()) {
              renewed_ = start;
            } else if (absl::IsFailedPrecondition(status)) {
              lost_ = true;
            } else {
              spdlog::warn("cannot renew the leader's lease: {}", std::string(status.message()));
            }
          }
        });
  }
  ~LeaseRenewer() { Stop(); }

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }

  // Why the leader must step down now (empty: it need not): a renewal found the lease passed on,
  // or none succeeded for longer than `limit`.
  std::string WhyStepDown(absl::Duration limit) {
    absl::MutexLock lock(&mu_);
    if (lost_) return "the lease has passed to another replica";
    if (absl::Now() - renewed_ > limit) {
      return absl::StrCat("the lease was not renewed for ",
                          absl::FormatDuration(absl::Now() - renewed_));
    }
    return "";
  }

 private:
  absl::Mutex mu_;
  absl::Time renewed_ ABSL_GUARDED_BY(mu_);
  bool lost_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace

int RunReplica(CoordinatorOptions options, ReplicaOptions replica,
               const std::function<void(const std::string& address, const std::string& web_url)>&
                   on_listening) {
  if (replica.id.empty()) replica.id = DefaultReplicaId(options.state_dir);
  // The schema first (the lease's table is in it), as any replica may be the first to start.
  {
    auto store = OpenPostgresJobStore(options.store);
    if (!store.ok()) {
      std::cerr << "trainyard-coordinator: " << store.status().message() << "\n";
      return 1;
    }
  }
  // The standby listens first: its bound address (a port 0 resolved) is the replica's for good.
  int port = 0;
  Standby standby = StartStandby(options, options.listen_address, &port);
  if (standby.server == nullptr) {
    std::cerr << "trainyard-coordinator: cannot listen on " << options.listen_address << "\n";
    return 1;
  }
  const std::string& listen = options.listen_address;
  options.listen_address = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  if (replica.advertise_address.empty()) replica.advertise_address = options.listen_address;
  // The web console: while standing by, a redirect to the leader's on the same address; its port
  // (a port 0 resolved) is the replica's for good, and its URL (on the advertised host) goes in
  // the lease for the other replicas' redirects.
  std::unique_ptr<web::WebRedirect> redirect;
  std::string web_url;
  web::WebConsoleOptions web_options;
  web_options.address = options.web_address;
  web_options.tls_cert_file = options.tls.cert_file;
  web_options.tls_key_file = options.tls.key_file;
  web_options.tls_reload = absl::Seconds(std::max(1, options.tls.reload_seconds));
  web_options.public_url = options.web_public_url;  // (a standby then answers 503)
  if (!options.web_address.empty() || !options.web_public_url.empty()) {
    if (absl::Status s = CheckWebAddress(options); !s.ok()) {
      std::cerr << "trainyard-coordinator: " << s.message() << "\n";
      return 1;
    }
    auto started = web::WebRedirect::Start(web_options);
    if (!started.ok()) {
      std::cerr << "trainyard-coordinator: " << started.status().message() << "\n";
      return 1;
    }
    redirect = *std::move(started);
    const std::string& web = options.web_address;
    options.web_address = web_options.address =
        absl::StrCat(web.substr(0, web.rfind(':')), ":", redirect->port());
    const std::string& advertised = replica.advertise_address;
    web_url = absl::StrCat(options.tls.cert_file.empty() ? "http://" : "https://",
                           advertised.substr(0, advertised.rfind(':')), ":", redirect->port());
  }
  auto lease = OpenLeaderLease(options.store, replica.id, replica.advertise_address, web_url);
  if (!lease.ok()) {
    std::cerr << "trainyard-coordinator: " << lease.status().message() << "\n";
    return 1;
  }
  on_listening(options.listen_address, web_url);
  spdlog::info("replica {} at {}: standing by for the leader's lease of {}", replica.id,
               replica.advertise_address, DescribePostgresLocation(options.store));

  while (true) {
    // ---- Standing by ----
    if (standby.server == nullptr) {
      standby = StartStandby(options, options.listen_address, &port);
      if (standby.server == nullptr) return 1;
    }
    if (!web_url.empty() && redirect == nullptr) {
      auto started = web::WebRedirect::Start(web_options);
      if (!started.ok()) {
        spdlog::error("cannot serve the standby's web console: {}",
                      std::string(started.status().message()));
        return 1;
      }
      redirect = *std::move(started);
    }
    int64_t epoch = 0;
    absl::Time acquired_at;
    while (epoch == 0) {
      acquired_at = absl::Now();
      absl::StatusOr<int64_t> taken = (*lease)->TryAcquire(replica.lease_ttl);
      if (taken.ok()) {
        epoch = *taken;
        break;
      }
      if (!absl::IsNotFound(taken.status())) {
        spdlog::warn("cannot take the leader's lease: {}", std::string(taken.status().message()));
      } else if (auto current = (*lease)->Current(); current.ok()) {
        standby.service->SetLeader(current->expired ? "" : current->address);
        if (redirect != nullptr) redirect->SetLeader(current->expired ? "" : current->web_url);
      }
      if (const int sig = WaitForTerminationSignalFor(replica.poll_interval); sig != 0) {
        spdlog::info("signal {}: shutting down the standby", sig);
        standby.server->Shutdown();
        return 0;
      }
    }
    spdlog::info("replica {} leads (epoch {})", replica.id, epoch);
    standby.service->SetLeader(replica.advertise_address);

    // ---- Leading ----
    // The leader binds the standby's port beside it (SO_REUSEPORT, gRPC's default) before the
    // standby closes, so that the address never refuses connections meanwhile.
    std::atomic<bool> fenced{false};
    CoordinatorOptions leading = options;
    leading.fence_epoch = epoch;
    leading.on_fenced = [&fenced] { fenced = true; };
    // A transaction left open by a pause of this process ends before a standby can take over
    // (this replica steps down at the same point), so that the new leader waits on no row of it.
    leading.idle_in_transaction_limit =
        std::max(replica.lease_ttl - replica.renew_interval, absl::Milliseconds(100));
    // (The console's port is given up first: unlike gRPC's, it cannot be bound twice.)
    redirect.reset();
    LeaseRenewer renewer(**lease, epoch, acquired_at, replica);
    auto server = CoordinatorServer::Start(leading);
    if (!server.ok()) {
      spdlog::error("cannot serve as the leader: {}", std::string(server.status().message()));
      renewer.Stop();
      (*lease)->Release(epoch).IgnoreError();
      standby.service->SetLeader("");
      if (WaitForTerminationSignalFor(replica.poll_interval) != 0) return 0;
      continue;
    }
    standby.server->Shutdown();
    standby = Standby();
    spdlog::info("serving as the leader on {}", (*server)->address());
    LeaderEnd end = LeaderEnd::kSignal;
    std::string why;
    while (true) {
      if (const int sig = WaitForTerminationSignalFor(absl::Milliseconds(100)); sig != 0) {
        spdlog::info("signal {}: shutting down", sig);
        break;
      }
      // Before the lease can have expired on the database: nobody else leads yet.
      why = renewer.WhyStepDown(replica.lease_ttl - replica.renew_interval);
      if (why.empty() && fenced) why = "a write found the lease passed to another replica";
      if (!why.empty()) {
        end = LeaderEnd::kSteppedDown;
        break;
      }
    }
    if (end == LeaderEnd::kSteppedDown) {
      spdlog::error("stepping down: {}", why);
      // The standby first, beside the leader's server, as above.
      standby = StartStandby(options, options.listen_address, &port);
    }
    (*server)->Shutdown();
    server->reset();
    renewer.Stop();
    if (end == LeaderEnd::kSignal) {
      // A clean end: a standby takes over at its next poll instead of after the lease's expiry.
      if (absl::Status released = (*lease)->Release(epoch); !released.ok()) {
        spdlog::warn("cannot release the leader's lease: {}", std::string(released.message()));
      }
      spdlog::info("stopped");
      return 0;
    }
  }
}

}  // namespace trainyard::coordinator
