// Communicator: the collectives the training loop needs (all-reduce, broadcast, barrier), behind
// an interface so that NCCL can join Gloo without touching the loop. MakeLocalCommunicator serves
// world size 1 without a process group; MakeGlooCommunicator builds a c10d::ProcessGroupGloo on a
// store (the CoordinatorStore in production).
//
// Every rank must issue the same collectives in the same order. Failures (a peer died, a timeout)
// are thrown as c10::Error; the trainer's boundary turns them into a status. One thread at a time
// calls a Communicator (the training thread, or the offload pusher while the training thread waits
// for it); handles are waited on by the thread that started them.
#ifndef TRAINYARD_WORKER_TRAINER_COMM_COMMUNICATOR_H_
#define TRAINYARD_WORKER_TRAINER_COMM_COMMUNICATOR_H_

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainyard::trainer {

// An operation in flight.
class CommHandle {
 public:
  virtual ~CommHandle() = default;
  // Blocks until the operation completed; its tensors may then be read and written again.
  virtual void Wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // What carries the collectives, for the rank's log.
  virtual std::string Describe() const = 0;

  // Starts summing each tensor (dense, contiguous) in place over all ranks and returns at
  // once. The tensors must not be touched until the handle's Wait() returns.
  virtual std::unique_ptr<CommHandle> AllReduceSum(std::vector<torch::Tensor> tensors) = 0;
  // Like AllReduceSum, leaving the mean over ranks (divides by world size first, as DDP does).
  std::unique_ptr<CommHandle> AllReduceAverage(std::vector<torch::Tensor> tensors);
  // Copies `root`'s tensors into every other rank's, in place; blocks.
  virtual void Broadcast(std::vector<torch::Tensor> tensors, int root) = 0;
  // Every rank contributes `in` (same shape everywhere); returns world_size() tensors, rank r's
  // contribution at index r. Blocks. (Gloo's list form: Debian's LibTorch has no flat
  // _allgather_base.)
  virtual std::vector<torch::Tensor> AllGather(const torch::Tensor& in) = 0;
  // Like AllGather, writing rank r's contribution into outs[r] (contiguous, in's shape; e.g.
  // consecutive chunks of one flat buffer). Blocks.
  virtual void AllGatherInto(const torch::Tensor& in, std::vector<torch::Tensor> outs) = 0;
  // Reduce-scatter (sum) of `flat`, the same size on every rank, cut into world_size()
  // consecutive chunks of `counts[r]` elements (counts may differ and be 0): returns this rank's
  // chunk summed over all ranks. Blocks. Gloo in Debian's LibTorch has no reduce_scatter; this is
  // the ring algorithm over send/recv: world_size - 1 steps, each rank sending
  // sum(counts) - counts[rank] elements in all (the bandwidth-optimal volume). `flat` is used as
  // scratch space. NCCL overrides it with its own reduce-scatter when the counts are equal.
  virtual torch::Tensor ReduceScatterSum(torch::Tensor& flat, const std::vector<int64_t>& counts);
  // Returns once every rank has entered.
  virtual void Barrier() = 0;

  // Point to point (pipeline stages): starts sending `t` (contiguous; not to be written
  // until the handle's Wait() returns) to rank `to`, which receives it with Recv(from = this
  // rank, the same tag). Sends from one rank to another with one tag arrive in order.
  virtual std::unique_ptr<CommHandle> Send(const torch::Tensor& t, int to, int tag) = 0;
  // Receives into `t` (contiguous, of the sent shape and dtype) from rank `from`; blocks.
  virtual void Recv(torch::Tensor& t, int from, int tag) = 0;

  // Bytes this rank sent through AllReduceSum, ReduceScatterSum, AllGather, AllGatherInto and
  // Send so far: all-reduce counted as a ring sends it (2 (n - 1) / n of the tensor), all-gather as
  // Gloo's ring does ((n - 1) times the contribution).
  int64_t bytes_sent() const { return bytes_sent_.load(); }

 protected:
  // Collectives run on communication threads too (FSDP, offload), while the trainer reads this.
  std::atomic<int64_t> bytes_sent_{0};

 private:
  int next_tag_ = 0;
};

// World size 1: every collective is the identity.
std::unique_ptr<Communicator> MakeLocalCommunicator();

// A Gloo process group over `store`; its transport listens on `hostname` (an address of this host
// that the other ranks can reach). Blocks until every rank has joined or `timeout` passes.
// `same_host`: every rank runs on this host, so fp32 all-reduces go through shared memory
// (ShmAllReduce, on a thread of their own) instead of Gloo; if the segment cannot be made, all
// ranks stay with Gloo. Every rank must pass the same value. GPU tensors travel through host
// copies (synchronous ones, before and after each collective), as when PyTorch runs the gloo
// backend on CUDA tensors: for ranks that cannot use NCCL (several ranks sharing one GPU, which
// NCCL refuses), never for speed.
absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, const std::string& hostname,
    std::chrono::milliseconds timeout, bool same_host = false);

// A group of some of the ranks (its own Gloo process group, its keys under `name` in `store`):
// `group_rank` of `group_size`. Every member calls it with the same name. Size 1 needs no group.
absl::StatusOr<std::unique_ptr<Communicator>> MakeSubgroupCommunicator(
    c10::intrusive_ptr<c10d::Store> store, const std::string& name, int group_rank, int group_size,
    const std::string& hostname, std::chrono::milliseconds timeout);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_COMM_COMMUNICATOR_H_
