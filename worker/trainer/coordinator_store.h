// CoordinatorStore: a c10d::Store over the coordinator's RendezvousService, scoped to one job
// attempt, so the ranks of an attempt can build a Gloo (or NCCL) process group without a TCPStore.
// The coordinator closes the scope when the attempt ends, which fails blocked calls.
//
// Thread-safe (gRPC stubs are); c10d and Gloo call it from their own threads. Errors are thrown as
// c10::Error, as c10d expects of a store.
#ifndef TRAINYARD_WORKER_TRAINER_COORDINATOR_STORE_H_
#define TRAINYARD_WORKER_TRAINER_COORDINATOR_STORE_H_

#include <grpcpp/grpcpp.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "trainyard/v1/rendezvous.grpc.pb.h"

namespace trainyard::trainer {

class CoordinatorStore : public c10d::Store {
 public:
  // `timeout` bounds blocking reads (get, wait) unless a call passes its own.
  CoordinatorStore(std::shared_ptr<grpc::Channel> channel, std::string job_id, int attempt,
                   std::chrono::milliseconds timeout);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  // Blocks until the key exists or the store's timeout passes.
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The rendezvous Barrier: returns once `world_size` ranks have entered `name`.
  void Barrier(const std::string& name, int rank, int world_size);

 private:
  // A context whose deadline is the call's own timeout plus a margin for the round trip.
  void Prepare(grpc::ClientContext& ctx, std::chrono::milliseconds timeout) const;
  // Throws c10::Error naming the call and key when `s` is not OK.
  void Check(const grpc::Status& s, const char* call, const std::string& key) const;
  // The timeout to send: the store's, or 30 s when it has none.
  std::chrono::milliseconds EffectiveTimeout(std::chrono::milliseconds timeout) const;

  std::unique_ptr<v1::RendezvousService::Stub> stub_;
  v1::RendezvousScope scope_;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_COORDINATOR_STORE_H_
