// DataPlaneClient: the client side of one trainyard-ps data plane (data_plane_wire.h), what the
// offload trainer and bench/ps_transfer_bench push gradients and pull parameters with when the
// server offers one. Gradients are sent from the caller's array and parameters received into the
// caller's array, nothing copied in between.
//
// Keeps a pool of connections: a call takes an idle one or opens one, and gives it back when it
// ended cleanly, so concurrent calls each have their own. A call that fails with UNAVAILABLE (the
// connection closed or reset) on a connection the pool kept from earlier, before any byte of an
// answer came, is tried once more on a new one (the server may have closed the old one; pushes
// and updates are idempotent). A request the server would refuse (ValidateRequest) is refused
// here with the same INVALID_ARGUMENT, nothing sent.
//
// Thread-safe.
#ifndef TRAINYARD_RPC_PS_DATA_PLANE_CLIENT_H_
#define TRAINYARD_RPC_PS_DATA_PLANE_CLIENT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/ps/data_plane_wire.h"
#include "rpc/ps/tcp_io.h"
#include "rpc/ps/tls_io.h"
#include "trainyard/v1/ps.pb.h"

namespace trainyard::ps {

// The address to dial for a data plane that GetDataPlane named `data_plane_address`, of a server
// reached over gRPC at `grpc_address`: the same, unless its host is a wildcard (a server
// listening on every interface without --advertise), then the gRPC address's host with the data
// plane's port. INVALID_ARGUMENT naming GetDataPlane.address when it is not HOST:PORT.
absl::StatusOr<std::string> DataPlaneDialAddress(const std::string& data_plane_address,
                                                 const std::string& grpc_address);

class DataPlaneClient {
 public:
  // `address`: HOST:PORT of the data plane (GetDataPlane's answer); `tcp_congestion` of its
  // connections (empty: the host's); `credential`: the parameter-server credential
  // (DeriveServerCredential) every request carries.
  // `tls`: TLS on every connection, the server verified against its CA and the dialled host
  // (TlsConfig::Client); null: plain TCP.
  DataPlaneClient(std::string address, std::string tcp_congestion, std::string credential = "",
                  std::shared_ptr<const TlsConfig> tls = nullptr);

  const std::string& address() const { return address_; }
  bool tls() const { return tls_ != nullptr; }

  // As PushGradientsZeroCopy (ps_client.h): the gradients of [begin, end), element `begin` at
  // `data`, in header.format(), staged in chunks of `chunk_elements`. The server's status, or
  // UNAVAILABLE / DEADLINE_EXCEEDED for the connection.
  absl::Status Push(const v1::GradientChunk& header, const void* data, int64_t begin, int64_t end,
                    int64_t chunk_elements, absl::Duration timeout,
                    v1::PushGradientsResponse* response);

  // As UpdateAndPullZeroCopy (ps_client.h): runs `request` and receives the parameters of
  // [request.begin(), request.end()) into `out`; `on_first_byte`, if set, runs when the answer's
  // header arrived (after the update). INTERNAL for an answer of the wrong size.
  absl::Status UpdateAndPull(const v1::UpdateAndPullRequest& request, void* out,
                             absl::Duration timeout,
                             const std::function<void()>& on_first_byte = nullptr);

 private:
  // One call on one connection. `payload`: a push's gradients; `out`: where a pull's data goes.
  // `*answered` tells whether any byte of the response arrived; `*keep` whether the connection
  // may serve another call.
  absl::Status CallOnce(Conn& conn, const DataPlaneRequest& request, const void* payload, void* out,
                        absl::Time deadline, const std::function<void()>& on_first_byte,
                        DataPlaneResponse* response, bool* answered, bool* keep);
  absl::Status Call(const DataPlaneRequest& request, const void* payload, void* out,
                    absl::Duration timeout, const std::function<void()>& on_first_byte,
                    DataPlaneResponse* response);

  const std::string address_;
  const std::string tcp_congestion_;
  const std::string credential_;
  const std::shared_ptr<const TlsConfig> tls_;
  absl::Mutex mu_;
  std::vector<Conn> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainyard::ps

#endif  // TRAINYARD_RPC_PS_DATA_PLANE_CLIENT_H_
