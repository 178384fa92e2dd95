// Channel arguments for the coordinator's long-lived clients (worker daemons, parameter servers,
// ranks): gRPC's reconnect backoff capped at 1 s instead of its default 120 s. After the
// coordinator has been away for a while (a restart, an upgrade), a default channel keeps failing
// calls fast for as long as its grown backoff lasts, seconds to minutes after the coordinator is
// back; a node silent past --node-timeout is then declared lost and its jobs restart. A
// connection refused costs the coordinator's host nothing, so trying every second is cheap.
//
// Each attempt is given kCoordinatorConnectTimeoutMs to connect and finish its TLS handshake
// (gRPC reads GRPC_ARG_MIN_RECONNECT_BACKOFF_MS as that time, its min_connect_timeout, not as a
// backoff). It was 100 ms: on a busy host a handshake that took longer never completed, every
// attempt cut short ("tcp handshaker shutdown"), and a rank's reports were all lost.
#ifndef TRAINYARD_COMMON_COORDINATOR_CHANNEL_H_
#define TRAINYARD_COMMON_COORDINATOR_CHANNEL_H_

#include <grpcpp/grpcpp.h>

namespace trainyard {

inline constexpr int kCoordinatorMaxReconnectBackoffMs = 1000;
inline constexpr int kCoordinatorConnectTimeoutMs = 5000;

inline grpc::ChannelArguments CoordinatorChannelArguments() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kCoordinatorConnectTimeoutMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kCoordinatorMaxReconnectBackoffMs);
  return args;
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_COORDINATOR_CHANNEL_H_
