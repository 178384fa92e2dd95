// A server interceptor that answers a request gRPC could not parse (bytes that are not the
// method's protobuf message) with INVALID_ARGUMENT naming the message type, instead of the bare
// UNIMPLEMENTED or INTERNAL, without a message, that gRPC's C++ server sends before any handler
// runs. Only for methods of the protos linked in (trainyard.v1); other statuses pass unchanged.
// Thread-safe: one interceptor per call.
#ifndef TRAINYARD_COMMON_MALFORMED_REQUEST_H_
#define TRAINYARD_COMMON_MALFORMED_REQUEST_H_

#include <grpcpp/support/server_interceptor.h>

#include <memory>

namespace trainyard {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MalformedRequestInterceptorFactory();

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_MALFORMED_REQUEST_H_
