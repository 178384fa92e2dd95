// ShmAllReduce: a sum all-reduce of float arrays among the ranks of one host through a shared
// memory segment, what NCCL does within a node and Gloo does not (Gloo sends through loopback TCP,
// whose copies through the kernel take CPU time that the ranks' compute needs, and on a host
// whose cores all compute, overlap cannot hide them). DeepSpeed's CPU backend does the same.
//
// The segment holds one slot per rank and two result buffers. Arrays go through in chunks: every
// rank copies its chunk into its slot; a barrier; rank r sums the r-th part of the chunk over all
// slots into the result buffer; a barrier; every rank copies the result out. The result buffers
// alternate, so two barriers per chunk keep every rank in step. Barriers spin briefly, then sleep
// on a futex; a waiting rank checks that its peers' processes still exist, so a rank that died
// fails the others at once instead of at the timeout.
//
// Rank 0 creates the segment and removes its name once every rank has mapped it (or when the
// rendezvous fails); if rank 0 is killed in that window, the worker removes the name when it
// reaps the rank (the name carries rank 0's pid). A peer
// counts as gone when its pid no longer exists; a zombie not yet reaped still counts as alive
// (the worker reaps its ranks at once). Not thread-safe: one thread at a time calls SumInPlace,
// Abort from any thread; every rank must make the same calls in the same order.
#ifndef TRAINYARD_WORKER_TRAINER_COMM_SHM_ALLREDUCE_H_
#define TRAINYARD_WORKER_TRAINER_COMM_SHM_ALLREDUCE_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainyard::trainer {

class ShmAllReduce {
 public:
  // How the ranks find the segment: a key-value store shared by the job's ranks (the c10d store
  // in the trainer). `get` blocks until the key is set.
  struct Rendezvous {
    std::function<void(const std::string& key, const std::string& value)> set;
    std::function<std::string(const std::string& key)> get;
  };

  // Every rank of the host calls it (rank 0 creates). `timeout` bounds the rendezvous and every
  // barrier. `chunk_elements` sets the slot size (tests make it small).
  static absl::StatusOr<std::unique_ptr<ShmAllReduce>> Create(const Rendezvous& rendezvous,
                                                              int rank, int world_size,
                                                              absl::Duration timeout,
                                                              int64_t chunk_elements = 512 << 10);
  ~ShmAllReduce();

  // Sums data[0, n) over all ranks, in place. DeadlineExceeded or Aborted (a peer's process is
  // gone) leave the segment unusable: the job's attempt is over.
  absl::Status SumInPlace(float* data, int64_t n);
  // Makes a SumInPlace waiting in a barrier (now or later) return Cancelled within ~20 ms: for
  // tearing down while a peer no longer takes part.
  void Abort() { aborted_.store(true); }

  int64_t segment_bytes() const { return bytes_; }

 private:
  struct Header;
  ShmAllReduce(void* base, int64_t bytes, int rank, int world, int64_t chunk,
               absl::Duration timeout);
  absl::Status Barrier();
  float* slot(int r) const;
  float* result(int which) const;

  void* base_;
  int64_t bytes_;
  int rank_;
  int world_;
  int64_t chunk_;
  absl::Duration timeout_;
  int64_t calls_ = 0;  // chunks done, for alternating the result buffers
  bool broken_ = false;
  std::atomic<bool> aborted_{false};
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_COMM_SHM_ALLREDUCE_H_
