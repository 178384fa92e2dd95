// Converts between absl::Status and grpc::Status; the canonical codes map one to one.
#ifndef TRAINYARD_COMMON_GRPC_STATUS_H_
#define TRAINYARD_COMMON_GRPC_STATUS_H_

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"

namespace trainyard {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_GRPC_STATUS_H_
