// What the trainyard servers (the coordinator, the parameter server) do alike at start-up: a gRPC
// server with health checking and reflection, message limits, the malformed-request interceptor
// first (so that interceptors after it, as the metrics', see the corrected code), their services
// and settings of their own; and their Prometheus endpoint's options from the shared flags.
#ifndef TRAINYARD_COMMON_GRPC_SERVER_H_
#define TRAINYARD_COMMON_GRPC_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics_endpoint.h"
#include "common/tls.h"

namespace trainyard {

struct GrpcServerOptions {
  std::string listen_address;          // HOST:PORT (port 0: any free one)
  std::string listen_flag = "listen";  // how errors name the listen address
  std::shared_ptr<grpc::ServerCredentials> credentials;
  int max_message_bytes = 4 << 20;       // received and sent
  std::vector<grpc::Service*> services;  // not owned; they outlive the server
  // Interceptors after the malformed-request one.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  // The server's own settings (keepalive, socket options), applied last.
  std::function<void(grpc::ServerBuilder&)> configure;
};

struct StartedGrpcServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;  // the bound one
};

// UNAVAILABLE naming the listen flag when the address cannot be bound.
absl::StatusOr<StartedGrpcServer> StartGrpcServer(GrpcServerOptions options);

// A server's metrics endpoint from its --metrics-* flags: over TLS (`metrics_tls`) with the
// server's own certificate, loaded again as `tls` says.
MetricsEndpointOptions MetricsOptionsFor(const std::string& address, const std::string& token_file,
                                         bool insecure, bool metrics_tls,
                                         const TlsServerOptions& tls);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_GRPC_SERVER_H_
