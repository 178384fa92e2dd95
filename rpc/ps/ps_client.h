// The client side of a parameter server's two bulk calls, PushGradients and UpdateAndPull, on a
// generic stub and byte buffers (ps_wire.h): pushed gradients are sent from the caller's array
// (each message is a small header plus a slice pointing there) and pulled parameters are copied
// from gRPC's receive buffers straight into the caller's array. What the offload trainer and
// bench/ps_transfer_bench use. No LibTorch.
//
// Each call runs on its own completion queue, its operations waited for in turn; one thread per
// call.
#ifndef TRAINYARD_RPC_PS_PS_CLIENT_H_
#define TRAINYARD_RPC_PS_PS_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "trainyard/v1/ps.pb.h"

namespace trainyard::ps {

// Pushes the gradients of [begin, end) (element `begin` at `data`, in header.format()) in chunks
// of `chunk_elements` as one PushGradients stream; `header` gives job_id, attempt, step and
// format. `data` must not change until the call returns. The server's status, or INTERNAL for a
// reply that does not parse; DEADLINE_EXCEEDED after `timeout` (InfiniteDuration: none).
grpc::Status PushGradientsZeroCopy(grpc::GenericStub& stub, const v1::GradientChunk& header,
                                   const void* data, int64_t begin, int64_t end,
                                   int64_t chunk_elements, absl::Duration timeout,
                                   v1::PushGradientsResponse* response);

// Runs UpdateAndPull `request` and decodes every chunk into `out` (element request.begin() at
// `out`, in request.format()); `on_first_chunk`, if set, runs when the first chunk arrives.
// INTERNAL (the call cancelled) for a chunk that is malformed or outside the range, or when the
// chunks do not cover the range exactly once in count.
grpc::Status UpdateAndPullZeroCopy(grpc::GenericStub& stub, const v1::UpdateAndPullRequest& request,
                                   void* out, absl::Duration timeout,
                                   const std::function<void()>& on_first_chunk = nullptr);

// A channel to a parameter server at `address` (with `credentials`: TLS or plaintext) whose every
// call carries `authorization` as its "authorization" metadata (e.g. "Bearer <job credential>";
// empty: none).
std::shared_ptr<grpc::Channel> CreatePsChannel(
    const std::string& address, const grpc::ChannelArguments& args,
    const std::string& authorization,
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials());

}  // namespace trainyard::ps

#endif  // TRAINYARD_RPC_PS_PS_CLIENT_H_
