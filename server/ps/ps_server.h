// PsServer: one trainyard-ps process. Owns the ShardManager, the AdamW thread pool, the gRPC
// server (ParameterServerService, health, reflection), the TCP data plane (DataPlaneServer: the
// bulk transfers off gRPC) and the /metrics endpoint, and keeps the
// server registered with the coordinator as a PARAMETER_SERVER node: register, then a session
// stream with heartbeats, re-established with backoff when the coordinator goes away. The
// coordinator's "cancel" for a job on that stream frees the job's shard.
//
// Thread-safe: Start on the main thread, Shutdown from any thread (once).
#ifndef TRAINYARD_SERVER_PS_PS_SERVER_H_
#define TRAINYARD_SERVER_PS_PS_SERVER_H_

#include <grpcpp/grpcpp.h>
#include <prometheus/registry.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/coordinator_endpoints.h"
#include "common/metrics_endpoint.h"
#include "common/tls.h"
#include "kernels/adam/thread_pool.h"
#include "server/ps/data_plane_server.h"
#include "server/ps/job_authorizer.h"
#include "server/ps/ps_service.h"
#include "server/ps/shard_manager.h"

namespace trainyard::ps {

struct PsOptions {
  std::string listen_address = "127.0.0.1:7080";
  std::string coordinator;  // HOST:PORT; empty: serve without registering
  std::string token;        // node token sent to the coordinator (identity.proto)
  // Users whose offload jobs this server takes (Node.owners); empty: any user's. A node token
  // limited to some owners' jobs must be registered with owners within its own.
  std::vector<std::string> owners;
  TlsServerOptions tls;              // serving (common/tls.h); its cert is the client one too
  TlsClientOptions coordinator_tls;  // the coordinator's CA (and our certificate, for mTLS)
  std::string node_id;               // default: ps-<hostname>-<port>
  std::string advertise;             // address trainers dial; default: the bound address
  int64_t capacity_bytes = 0;        // memory for shards; 0 = half the host's memory
  int threads = 0;                   // AdamW threads; 0 = every core
  std::string metrics_address;       // empty: no /metrics
  int max_message_bytes = 64 << 20;
  std::string tcp_congestion;  // of the listening and accepted sockets; empty: the host's
  // HOST:PORT of the TCP data plane; empty: the --listen host on a free port; "off": none
  // (trainers then push and pull over gRPC).
  std::string data_listen_address;
  // The data plane without TLS although gRPC serves TLS (--data-plane-insecure): for a trusted
  // network, to spare the encryption's CPU. Without --tls-cert the data plane is plain anyway.
  bool data_plane_insecure = false;
  // The /metrics endpoint's bearer token file, TLS (with tls's certificate) and consent to a
  // non-loopback address without a token (common/metrics_endpoint.h).
  std::string metrics_token_file;
  bool metrics_tls = false;
  bool metrics_insecure = false;
  absl::Duration max_backoff = absl::Seconds(2);  // between attempts to reach the coordinator
};

class PsServer {
 public:
  static absl::StatusOr<std::unique_ptr<PsServer>> Start(PsOptions options);
  ~PsServer();

  const std::string& address() const { return address_; }
  // What trainers dial for the data plane (the advertised host, the bound port); empty: none.
  const std::string& data_plane_address() const { return data_plane_address_; }
  bool data_plane_tls() const { return data_plane_tls_; }
  const std::string& metrics_address() const;
  const std::string& node_id() const { return options_.node_id; }
  ShardManager& shards() { return *shards_; }

  // Stops registering, then the gRPC server and the data plane (in-flight calls get 5 s to
  // finish).
  void Shutdown();

 private:
  explicit PsServer(PsOptions options);
  void RegistrationLoop();
  // One registration + session; returns when the session ends.
  void RunSession();
  void RefreshGauges();

  PsOptions options_;
  CoordinatorEndpoints endpoints_{options_.coordinator};  // the session's coordinator
  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Gauge* resident_bytes_ = nullptr;
  prometheus::Gauge* capacity_bytes_ = nullptr;
  prometheus::Gauge* jobs_ = nullptr;
  std::unique_ptr<adam::ThreadPool> pool_;
  std::unique_ptr<ShardManager> shards_;
  std::unique_ptr<JobAuthorizer> authorizer_;  // before the servers that use it
  std::shared_ptr<grpc::ChannelCredentials> coordinator_credentials_;
  std::unique_ptr<DataPlaneServer> data_plane_;
  std::string data_plane_address_;
  bool data_plane_tls_ = false;
  std::unique_ptr<ParameterServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  std::string address_;
  std::thread registration_thread_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* session_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace trainyard::ps

#endif  // TRAINYARD_SERVER_PS_PS_SERVER_H_
