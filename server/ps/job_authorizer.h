// JobAuthorizer: whether a call may touch a job's shard on this parameter server. The caller
// must hold the job credential of that job and attempt (identity.proto), which the coordinator
// signs and this server cannot check alone: it asks the coordinator once per credential
// (NodeService.VerifyJobCredential, as this node with its node token; the coordinator answers
// yes only for an attempt that is running with a range on this node) and remembers the answer
// for 30 s, per job for its newest attempt only.
// A standalone server (no --coordinator) has no one to ask: it admits every call, and says so
// at start. Used by the gRPC service and the data plane. Thread-safe.
#ifndef TRAINYARD_SERVER_PS_JOB_AUTHORIZER_H_
#define TRAINYARD_SERVER_PS_JOB_AUTHORIZER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace trainyard::ps {

class JobAuthorizer {
 public:
  virtual ~JobAuthorizer() = default;
  // OK if `credential` (a job credential, without "Bearer "; empty: none was sent) admits a call
  // for `job_id` attempt `attempt` (attempt 0: any attempt of the job). UNAUTHENTICATED for none
  // or a bad one, PERMISSION_DENIED for another job's or attempt's, UNAVAILABLE when the
  // coordinator cannot be asked. Never echoes the credential.
  virtual absl::Status Authorize(absl::string_view credential, const std::string& job_id,
                                 int32_t attempt) = 0;
};

// Admits every call (a standalone server).
std::unique_ptr<JobAuthorizer> NewOpenJobAuthorizer();
// A channel to one coordinator address.
using ChannelFactory = std::function<std::shared_ptr<grpc::Channel>(const std::string& address)>;
// Asks the coordinator (`coordinator`: its address, or its replicas' list, followed as
// common/coordinator_endpoints.h says) with `node_token`, remembering what it accepted.
std::unique_ptr<JobAuthorizer> NewCoordinatorJobAuthorizer(const std::string& coordinator,
                                                           ChannelFactory make_channel,
                                                           std::string node_token);

// The credential of a gRPC call's "authorization: Bearer ..." metadata; empty if none.
std::string CallCredential(const grpc::ServerContext& ctx);

}  // namespace trainyard::ps

#endif  // TRAINYARD_SERVER_PS_JOB_AUTHORIZER_H_
