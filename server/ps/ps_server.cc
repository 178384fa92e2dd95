#include "server/ps/ps_server.h"

#include <unistd.h>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "common/coordinator_channel.h"
#include "common/credentials.h"
#include "common/grpc_server.h"
#include "common/status_macros.h"
#include "rpc/ps/tcp_congestion.h"
#include "rpc/ps/tcp_io.h"
#include "trainyard/v1/node.grpc.pb.h"

namespace trainyard::ps {
namespace {

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t{pages} * page : 0;
}

std::string HostName() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace

PsServer::PsServer(PsOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<PsServer>> PsServer::Start(PsOptions options) {
  if (options.capacity_bytes < 0) {
    return absl::InvalidArgumentError("--memory-bytes: negative");
  }
  RETURN_IF_ERROR(CheckTcpCongestion(options.tcp_congestion, "--tcp-congestion"));
  if (options.capacity_bytes == 0) options.capacity_bytes = PhysicalMemoryBytes() / 2;
  if (options.threads <= 0) {
    options.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }
  std::unique_ptr<PsServer> s(new PsServer(std::move(options)));
  auto& histogram =
      prometheus::BuildHistogram()
          .Name("trainyard_ps_adam_step_seconds")
          .Help("Time of one AdamW update of a range")
          .Register(*s->registry_)
          .Add({}, prometheus::Histogram::BucketBoundaries{0.0005, 0.001, 0.0025, 0.005, 0.01,
                                                           0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5});
  auto& pushed = prometheus::BuildCounter()
                     .Name("trainyard_ps_pushed_bytes_total")
                     .Help("Gradient bytes received")
                     .Register(*s->registry_)
                     .Add({});
  auto& pulled = prometheus::BuildCounter()
                     .Name("trainyard_ps_pulled_bytes_total")
                     .Help("Parameter bytes sent")
                     .Register(*s->registry_)
                     .Add({});
  s->resident_bytes_ = &prometheus::BuildGauge()
                            .Name("trainyard_ps_resident_bytes")
                            .Help("Bytes held by the shards of running jobs")
                            .Register(*s->registry_)
                            .Add({});
  s->capacity_bytes_ = &prometheus::BuildGauge()
                            .Name("trainyard_ps_capacity_bytes")
                            .Help("Memory this parameter server offers to shards")
                            .Register(*s->registry_)
                            .Add({});
  s->jobs_ = &prometheus::BuildGauge()
                  .Name("trainyard_ps_jobs")
                  .Help("Jobs with a shard here")
                  .Register(*s->registry_)
                  .Add({});

  s->pool_ = std::make_unique<adam::ThreadPool>(s->options_.threads);
  s->shards_ = std::make_unique<ShardManager>(s->options_.capacity_bytes, *s->pool_);
  const PsMetrics metrics{&pushed, &pulled, &histogram};
  std::string listen_host, advertise_host;
  int unused_port = 0;
  RETURN_IF_ERROR(
      SplitHostPort(s->options_.listen_address, "--listen", &listen_host, &unused_port));
  if (!s->options_.advertise.empty()) {
    RETURN_IF_ERROR(
        SplitHostPort(s->options_.advertise, "--advertise", &advertise_host, &unused_port));
  }
  ASSIGN_OR_RETURN(s->coordinator_credentials_,
                   MakeChannelCredentials(s->options_.coordinator_tls));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> server_credentials,
                   MakeServerCredentials(s->options_.tls, s->options_.listen_address));
  // Calls on a job's shard need the job credential of its attempt, checked with the
  // coordinator; a standalone server has no one to check with.
  if (s->options_.coordinator.empty()) {
    spdlog::warn("standalone (no --coordinator): every call is admitted without a job credential");
    s->authorizer_ = NewOpenJobAuthorizer();
  } else {
    s->authorizer_ = NewCoordinatorJobAuthorizer(
        s->options_.coordinator,
        [credentials = s->coordinator_credentials_](const std::string& address) {
          return grpc::CreateCustomChannel(address, credentials, CoordinatorChannelArguments());
        },
        s->options_.token);
  }
  if (s->options_.data_listen_address != "off") {
    DataPlaneOptions data;
    data.authorizer = s->authorizer_.get();
    data.listen_address = s->options_.data_listen_address.empty() ? JoinHostPort(listen_host, 0)
                                                                  : s->options_.data_listen_address;
    data.tcp_congestion = s->options_.tcp_congestion;
    // TLS wherever gRPC has it, with the same certificate, unless asked otherwise.
    if (!s->options_.tls.cert_file.empty() && !s->options_.data_plane_insecure) {
      ASSIGN_OR_RETURN(
          data.tls, TlsConfig::Server(s->options_.tls.cert_file, s->options_.tls.key_file,
                                      absl::Seconds(std::max(1, s->options_.tls.reload_seconds))));
    }
    s->data_plane_tls_ = data.tls != nullptr;
    ASSIGN_OR_RETURN(s->data_plane_, DataPlaneServer::Start(data, *s->shards_, metrics));
    s->data_plane_address_ =
        JoinHostPort(advertise_host.empty() ? listen_host : advertise_host, s->data_plane_->port());
  }
  s->service_ = std::make_unique<ParameterServiceImpl>(*s->shards_, metrics, s->data_plane_address_,
                                                       s->authorizer_.get(), s->data_plane_tls_);

  GrpcServerOptions grpc_options;
  grpc_options.listen_address = s->options_.listen_address;
  grpc_options.listen_flag = "--listen";
  grpc_options.credentials = server_credentials;
  grpc_options.max_message_bytes = s->options_.max_message_bytes;
  grpc_options.services = {s->service_.get()};
  grpc_options.configure = [tcp_congestion =
                                s->options_.tcp_congestion](grpc::ServerBuilder& builder) {
    // Pings on connections with calls in flight, so a client that vanished (host down,
    // half-open connection) ends its calls: a pull it left holds its range against updates
    // until then.
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 20000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    if (!tcp_congestion.empty()) builder.SetOption(TcpCongestionOption(tcp_congestion));
  };
  ASSIGN_OR_RETURN(StartedGrpcServer started, StartGrpcServer(std::move(grpc_options)));
  s->server_ = std::move(started.server);
  const int port = started.port;
  s->address_ = JoinHostPort(listen_host, port);
  if (s->options_.advertise.empty()) s->options_.advertise = s->address_;
  if (s->options_.node_id.empty()) s->options_.node_id = absl::StrCat("ps-", HostName(), "-", port);
  if (!s->options_.metrics_address.empty()) {
    ASSIGN_OR_RETURN(
        s->metrics_endpoint_,
        MetricsEndpoint::Start(
            MetricsOptionsFor(s->options_.metrics_address, s->options_.metrics_token_file,
                              s->options_.metrics_insecure, s->options_.metrics_tls,
                              s->options_.tls),
            s->registry_));
  }
  s->RefreshGauges();
  s->registration_thread_ = std::thread([raw = s.get()] { raw->RegistrationLoop(); });
  return s;
}

PsServer::~PsServer() { Shutdown(); }

const std::string& PsServer::metrics_address() const {
  static const std::string kNone;
  return metrics_endpoint_ ? metrics_endpoint_->bound_address() : kNone;
}

void PsServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    if (session_ctx_ != nullptr) session_ctx_->TryCancel();
  }
  if (registration_thread_.joinable()) registration_thread_.join();
  // Calls waiting (for a step, for lent elements) end now; the others get 5 s, on gRPC and on
  // the data plane alike (which stops accepting first).
  if (shards_) shards_->Close();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  if (data_plane_) data_plane_->StopAccepting();
  if (server_) server_->Shutdown(absl::ToChronoTime(deadline));
  if (data_plane_) data_plane_->Shutdown(deadline);
}

void PsServer::RefreshGauges() {
  resident_bytes_->Set(static_cast<double>(shards_->reserved_bytes()));
  capacity_bytes_->Set(static_cast<double>(shards_->capacity_bytes()));
  jobs_->Set(shards_->List().shards_size());
}

void PsServer::RegistrationLoop() {
  // With a coordinator: register and hold a session, again after a pause that grows while the
  // coordinator stays away. Without one: only refresh the gauges every second.
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    const absl::Time started = absl::Now();
    if (!options_.coordinator.empty()) RunSession();
    if (absl::Now() - started > absl::Seconds(10)) backoff = absl::Milliseconds(100);
    RefreshGauges();
    const absl::Duration pause = options_.coordinator.empty() ? absl::Seconds(1) : backoff;
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), pause)) break;
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

void PsServer::RunSession() {
  auto channel = grpc::CreateCustomChannel(endpoints_.current(), coordinator_credentials_,
                                           CoordinatorChannelArguments());
  auto stub = v1::NodeService::NewStub(channel);
  v1::RegisterNodeRequest request;
  request.set_node_id(options_.node_id);
  request.set_hostname(HostName());
  request.set_address(options_.advertise);
  request.set_memory_bytes(options_.capacity_bytes);
  request.set_role(v1::PARAMETER_SERVER);
  for (const std::string& owner : options_.owners) request.add_owners(owner);
  v1::RegisterNodeResponse registered;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!options_.token.empty())
      ctx.AddMetadata(kAuthorizationMetadata, "Bearer " + options_.token);
    const grpc::Status s = stub->RegisterNode(&ctx, request, &registered);
    if (!s.ok()) {
      const std::string address = endpoints_.current();
      const std::string tls = s.error_code() == grpc::StatusCode::UNAVAILABLE
                                  ? DiagnoseTls(address, options_.coordinator_tls)
                                  : std::string();
      spdlog::warn("cannot register with {}: {}", address, tls.empty() ? s.error_message() : tls);
      endpoints_.Follow(s, ctx);  // the next try goes to the leader, or down the list
      return;
    }
  }
  const absl::Duration interval =
      absl::Milliseconds(std::max<int64_t>(50, registered.heartbeat_interval_ms()));
  spdlog::info("registered as {} ({} bytes for shards); heartbeat every {}", options_.node_id,
               options_.capacity_bytes, absl::FormatDuration(interval));

  grpc::ClientContext ctx;
  if (!options_.token.empty()) ctx.AddMetadata(kAuthorizationMetadata, "Bearer " + options_.token);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    session_ctx_ = &ctx;
  }
  auto stream = stub->Session(&ctx);
  v1::NodeMessage hello;
  hello.mutable_hello()->set_node_id(options_.node_id);
  if (stream->Write(hello)) {
    absl::Mutex write_mu;
    bool open = true;
    std::thread heartbeats([&] {
      int64_t seq = 0;
      absl::MutexLock lock(&write_mu);
      while (open) {
        v1::NodeMessage m;
        m.mutable_heartbeat()->set_seq(++seq);
        m.mutable_heartbeat()->set_sent_time_ms(absl::ToUnixMillis(absl::Now()));
        if (!stream->Write(m)) break;
        write_mu.Unlock();
        RefreshGauges();
        write_mu.Lock();
        write_mu.AwaitWithTimeout(absl::Condition(
                                      +[](bool* o) { return !*o; }, &open),
                                  interval);
      }
    });
    v1::CoordinatorMessage in;
    while (stream->Read(&in)) {
      if (in.has_cancel() && shards_->Drop(in.cancel().job_id(), in.cancel().attempt())) {
        spdlog::info("dropped the shard of {}: {}", in.cancel().job_id(), in.cancel().reason());
      }
    }
    {
      absl::MutexLock lock(&write_mu);
      open = false;
    }
    heartbeats.join();
  }
  const grpc::Status s = stream->Finish();
  {
    absl::MutexLock lock(&mu_);
    session_ctx_ = nullptr;
  }
  spdlog::warn("session with {} ended: {}", endpoints_.current(),
               s.ok() ? std::string("closed") : s.error_message());
  endpoints_.Follow(s, ctx);
}

}  // namespace trainyard::ps
