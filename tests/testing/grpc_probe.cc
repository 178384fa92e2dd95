#include "tests/testing/grpc_probe.h"

#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/impl/codegen/rpc_method.h>
#include <grpcpp/impl/codegen/sync_stream.h>

#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "tests/protos/grpc_mirror.pb.h"

namespace trainyard::testing {

absl::StatusOr<std::string> HealthCheck(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                   grpc::internal::RpcMethod::NORMAL_RPC, channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  HealthCheckRequest request;
  HealthCheckResponse response;
  grpc::Status s = grpc::internal::BlockingUnaryCall<HealthCheckRequest, HealthCheckResponse>(
      channel.get(), method, &ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return HealthCheckResponse::ServingStatus_Name(response.status());
}

absl::StatusOr<std::vector<std::string>> ReflectionServices(
    const std::shared_ptr<grpc::Channel>& channel) {
  grpc::internal::RpcMethod method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                   grpc::internal::RpcMethod::BIDI_STREAMING, channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  std::unique_ptr<grpc::ClientReaderWriter<ServerReflectionRequest, ServerReflectionResponse>>
      stream(grpc::internal::ClientReaderWriterFactory<
             ServerReflectionRequest, ServerReflectionResponse>::Create(channel.get(), method,
                                                                        &ctx));
  ServerReflectionRequest request;
  request.set_list_services("*");
  stream->Write(request);
  stream->WritesDone();
  ServerReflectionResponse response;
  std::vector<std::string> names;
  while (stream->Read(&response)) {
    for (const auto& svc : response.list_services_response().service()) {
      names.push_back(svc.name());
    }
  }
  grpc::Status s = stream->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return names;
}

}  // namespace trainyard::testing
