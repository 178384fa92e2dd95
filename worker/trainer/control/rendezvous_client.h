// RendezvousClient: the coordinator's RendezvousService (a key-value store scoped to one job
// attempt) for a training rank. The trainer's gRPC side: its header names no gRPC or
// protobuf type, so the LibTorch side (CoordinatorStore, the c10d::Store over it) can include it.
// The coordinator closes the scope when the attempt ends, which fails blocked calls.
//
// Thread-safe (gRPC stubs are); c10d and Gloo call it from their own threads through the store.
#ifndef TRAINYARD_WORKER_TRAINER_CONTROL_RENDEZVOUS_CLIENT_H_
#define TRAINYARD_WORKER_TRAINER_CONTROL_RENDEZVOUS_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainyard::trainer {

class RendezvousClient {
 public:
  // `coordinator`: HOST:PORT. Calls wait for the channel to connect (ranks may start before the
  // coordinator accepts), within their deadline.
  RendezvousClient(const std::string& coordinator, const std::string& job_id, int attempt);
  ~RendezvousClient();

  // Errors carry the RPC's code and a message naming the call, key, job and attempt. Calls that
  // do not block have a 30 s deadline; `timeout` bounds the blocking ones (plus a margin for the
  // round trip).
  absl::Status Set(const std::string& key, const std::string& value);
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired);
  // Blocks until the key exists.
  absl::StatusOr<std::string> Get(const std::string& key, std::chrono::milliseconds timeout);
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta);
  absl::StatusOr<bool> DeleteKey(const std::string& key);
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys);
  absl::StatusOr<int64_t> NumKeys();
  // Blocks until every key exists.
  absl::Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

 private:
  struct Stub;
  std::unique_ptr<Stub> stub_;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CONTROL_RENDEZVOUS_CLIENT_H_
