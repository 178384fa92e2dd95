// CoordinatorStore: a c10d::Store over the coordinator's RendezvousService (RendezvousClient),
// scoped to one job attempt, so the ranks of an attempt can build a Gloo or NCCL process group
// without a TCPStore. LibTorch side: the gRPC calls live in rendezvous_client.cc.
//
// Thread-safe (the client is); c10d, Gloo and NCCL call it from their own threads. Errors are
// thrown as c10::Error, as c10d expects of a store.
#ifndef TRAINYARD_WORKER_TRAINER_COMM_COORDINATOR_STORE_H_
#define TRAINYARD_WORKER_TRAINER_COMM_COORDINATOR_STORE_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "worker/trainer/control/rendezvous_client.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {

class CoordinatorStore : public c10d::Store {
 public:
  // `timeout` bounds blocking reads (get, wait) unless a call passes its own.
  CoordinatorStore(std::shared_ptr<RendezvousClient> client, std::chrono::milliseconds timeout);

#if TRAINYARD_TORCH2
  // A store on the same client (NCCL's watchdog keeps one of its own).
  c10::intrusive_ptr<c10d::Store> clone() override;
#endif
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

 private:
  std::shared_ptr<RendezvousClient> client_;
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_COMM_COORDINATOR_STORE_H_
