// ParameterServers: an offload rank's clients of the parameter servers that hold its job's ranges
// of the flat parameter vector (parallel.strategy: offload). The trainer's gRPC side: its header
// names no gRPC or protobuf type, so OffloadOptimizer (LibTorch side) hands it plain fp32 arrays.
// Pushes and pulls travel over each server's TCP data plane where it offers one
// (rpc/ps/data_plane_client.h), else over gRPC byte buffers (rpc/ps/ps_client.h); shard
// initialisation and state reads are gRPC streams. Every call has a deadline
// (PsClientConfig::rpc_timeout) and its errors name the server.
//
// Thread-compatible: one thread at a time (OffloadOptimizer's pusher, or the training thread while
// the pusher is idle); a call that spans several servers talks to them on threads of its own.
#ifndef TRAINYARD_WORKER_TRAINER_CONTROL_PARAMETER_SERVERS_H_
#define TRAINYARD_WORKER_TRAINER_CONTROL_PARAMETER_SERVERS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainyard::trainer {

struct PsRangeRef {
  std::string address;
  int64_t begin = 0;
  int64_t end = 0;
};

// Parses --ps "ADDRESS=BEGIN:END,..." (contiguous ranges from 0, in order). INVALID_ARGUMENT
// names what is wrong.
absl::StatusOr<std::vector<PsRangeRef>> ParsePsRanges(const std::string& flag);

struct PsClientConfig {
  std::string job_id;
  int attempt = 1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;  // the servers' AdamW
  // Deadline of every call to a parameter server: one that hangs (stopped, cut off) fails the
  // rank with DEADLINE_EXCEEDED naming it instead of stalling the job.
  absl::Duration rpc_timeout = absl::Minutes(2);
  // TCP congestion control of the connections to the servers; empty: the host's
  // (rpc/ps/tcp_congestion.h).
  std::string tcp_congestion;
  // How pushes and pulls travel: "tcp", each server's data plane where it offers one, else gRPC;
  // "grpc", always the gRPC calls.
  std::string transport = "tcp";
};

class ParameterServers {
 public:
  // Connects to every range's server (and asks for its data plane). INVALID_ARGUMENT for a bad
  // transport or congestion control, naming the flag.
  static absl::StatusOr<std::unique_ptr<ParameterServers>> Connect(std::vector<PsRangeRef> ranges,
                                                                   PsClientConfig config);
  ~ParameterServers();

  // Elements all ranges cover together.
  int64_t total() const;

  // Rank 0: every server's shard initialised at `step` from the flat fp32 arrays of total()
  // elements: `params`, and `m`, `v` (AdamW moments; both null for a fresh optimizer).
  absl::Status InitShards(int64_t step, const float* params, const float* m, const float* v);
  // Sends the gradients of flat elements [lo, hi) for `step` (data[0] is element lo) to the
  // servers holding them, at once where several do.
  absl::Status Push(int64_t step, const float* data, int64_t lo, int64_t hi);
  // Applies AdamW step `step` (learning rate, gradient scale for clipping) to elements [lo, hi)
  // on the servers holding them and receives the updated fp32 parameters into out[0 .. hi-lo).
  absl::Status UpdateAndPull(int64_t step, double lr, double grad_scale, int64_t lo, int64_t hi,
                             float* out);
  // The servers' master weights and AdamW moments after `step`, into arrays of total() elements.
  absl::Status ReadState(int64_t step, float* master, float* m, float* v);

  // How each server is spoken to, for the rank's log: "ADDRESS: data plane HOST:PORT" or
  // "ADDRESS: gRPC (why)", comma-separated.
  std::string TransportSummary() const;
  // The congestion control the connections use, for the rank's log.
  std::string TcpCongestionInUse() const;

 private:
  struct Server;
  ParameterServers() = default;
  // Runs fn on each server that holds part of [lo, hi), with that part; the first error wins.
  absl::Status ForEachOverlap(
      int64_t lo, int64_t hi,
      const std::function<absl::Status(const Server&, int64_t, int64_t)>& fn);

  PsClientConfig config_;
  std::vector<std::unique_ptr<Server>> servers_;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CONTROL_PARAMETER_SERVERS_H_
