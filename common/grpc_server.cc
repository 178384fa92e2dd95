#include "common/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/malformed_request.h"

namespace trainyard {

absl::StatusOr<StartedGrpcServer> StartGrpcServer(GrpcServerOptions options) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  StartedGrpcServer started;
  builder.AddListeningPort(options.listen_address, options.credentials, &started.port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MalformedRequestInterceptorFactory());
  for (auto& i : options.interceptors) interceptors.push_back(std::move(i));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  if (options.configure) options.configure(builder);
  started.server = builder.BuildAndStart();
  if (started.server == nullptr || started.port == 0) {
    return absl::UnavailableError(
        absl::StrCat(options.listen_flag, ": cannot bind ", options.listen_address));
  }
  return started;
}

MetricsEndpointOptions MetricsOptionsFor(const std::string& address, const std::string& token_file,
                                         bool insecure, bool metrics_tls,
                                         const TlsServerOptions& tls) {
  MetricsEndpointOptions metrics;
  metrics.address = address;
  metrics.token_file = token_file;
  metrics.insecure = insecure;
  if (metrics_tls) {
    metrics.tls_cert_file = tls.cert_file;
    metrics.tls_key_file = tls.key_file;
    metrics.tls_reload = absl::Seconds(tls.reload_seconds);
  }
  return metrics;
}

}  // namespace trainyard
