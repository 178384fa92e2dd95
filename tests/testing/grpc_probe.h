// Asks a server, over a real channel, whether it serves grpc.health.v1.Health and which services
// its reflection lists. Test helper.
#ifndef TRAINYARD_TESTS_TESTING_GRPC_PROBE_H_
#define TRAINYARD_TESTS_TESTING_GRPC_PROBE_H_

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainyard::testing {

// The overall health status ("SERVING", ...) from grpc.health.v1.Health/Check.
absl::StatusOr<std::string> HealthCheck(const std::shared_ptr<grpc::Channel>& channel);
// Service names listed by grpc.reflection.v1alpha.ServerReflection.
absl::StatusOr<std::vector<std::string>> ReflectionServices(
    const std::shared_ptr<grpc::Channel>& channel);

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_GRPC_PROBE_H_
