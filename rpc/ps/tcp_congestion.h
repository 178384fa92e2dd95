// The TCP congestion control of the connections that carry parameter-server traffic (gradients
// pushed, parameters pulled), chosen per connection instead of taking the host's default.
//
// Why: a host whose default is BBR without the fq qdisc paces every TCP connection from the
// kernel's own timers. On the development VM that halved gRPC push and pull throughput on
// loopback and made it swing from run to run (bench/RESULTS.md, "TCP congestion control").
// Operators choose with `--tcp-congestion` on trainyard-ps and `--ps-tcp-congestion` on the
// trainer, or TRAINYARD_TCP_CONGESTION for both; empty keeps the host's default.
#ifndef TRAINYARD_RPC_PS_TCP_CONGESTION_H_
#define TRAINYARD_RPC_PS_TCP_CONGESTION_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace grpc {
class ChannelArguments;
class ServerBuilderOption;
}  // namespace grpc

namespace trainyard::ps {

// The environment variable both binaries read as the default of their flag.
inline constexpr char kTcpCongestionEnv[] = "TRAINYARD_TCP_CONGESTION";

// The congestion control a new TCP socket gets on this host (net.ipv4.tcp_congestion_control).
absl::StatusOr<std::string> HostTcpCongestion();

// OK when this process may set `name` on its TCP sockets. INVALID_ARGUMENT naming `flag` when
// the kernel does not know it (listing net.ipv4.tcp_available_congestion_control) or when this
// process is not allowed to use it (not root and not in tcp_allowed_congestion_control).
absl::Status CheckTcpCongestion(const std::string& name, const std::string& flag);

// `name`, or when it is empty the host's default marked as such ("bbr (the host's)"): what a
// process's connections use, for its log.
std::string TcpCongestionInUse(const std::string& name);

// Sets `name` on TCP socket `fd`; empty `name`: nothing. The error names TCP_CONGESTION and errno.
absl::Status SetSocketTcpCongestion(int fd, const std::string& name);

// The congestion control of connected or listening TCP socket `fd`.
absl::StatusOr<std::string> SocketTcpCongestion(int fd);

// Makes every TCP socket gRPC opens for a channel built with `args` (client connections) use
// `name`. Empty `name`: nothing changes. Check `name` with CheckTcpCongestion first; a socket on
// which setting it still fails keeps the host's default (gRPC would otherwise drop the
// connection).
void SetTcpCongestion(grpc::ChannelArguments* args, const std::string& name);

// The same for a server: its listening sockets and every connection they accept.
std::unique_ptr<grpc::ServerBuilderOption> TcpCongestionOption(const std::string& name);

}  // namespace trainyard::ps

#endif  // TRAINYARD_RPC_PS_TCP_CONGESTION_H_
