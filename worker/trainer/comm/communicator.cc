// Communicator's shared collectives (the average, a ring reduce-scatter over Send and Recv)
// and subgroups; the back ends are local_communicator.cc, gloo_communicator.cc and, on
// CUDA builds, NCCL in cuda_support.cc (see communicator.h).
#include "worker/trainer/comm/communicator.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

namespace trainyard::trainer {

std::unique_ptr<CommHandle> Communicator::AllReduceAverage(std::vector<torch::Tensor> tensors) {
  if (world_size() > 1) {
    for (auto& t : tensors) t.div_(world_size());
  }
  return AllReduceSum(std::move(tensors));
}

torch::Tensor Communicator::ReduceScatterSum(torch::Tensor& flat,
                                             const std::vector<int64_t>& counts) {
  const int n = world_size(), r = rank();
  TORCH_CHECK(static_cast<int>(counts.size()) == n, "ReduceScatterSum: one count per rank");
  std::vector<int64_t> begin(n + 1, 0);
  for (int i = 0; i < n; ++i) begin[i + 1] = begin[i] + counts[i];
  TORCH_CHECK(flat.dim() == 1 && flat.numel() == begin[n] && flat.is_contiguous(),
              "ReduceScatterSum: flat must be 1-D, contiguous, of sum(counts) elements");
  auto chunk = [&](int i) {
    i = ((i % n) + n) % n;
    return flat.narrow(0, begin[i], counts[i]);
  };
  // Step s: send the partial sum of chunk r-s-1 to the right, receive chunk r-s-2 from the left
  // and add it in. After n-1 steps chunk r holds the sum over all ranks.
  const int tag = next_tag_;
  next_tag_ += n;
  for (int s = 0; s < n - 1; ++s) {
    const int send_i = r - s - 1, recv_i = r - s - 2;
    torch::Tensor incoming = torch::empty_like(chunk(recv_i));
    // Send (which counts its bytes) to the right while receiving from the left; empty chunks
    // (counts of 0) are neither sent nor received.
    std::unique_ptr<CommHandle> sent;
    if (chunk(send_i).numel() > 0) sent = Send(chunk(send_i), (r + 1) % n, tag + s);
    if (incoming.numel() > 0) Recv(incoming, (r + n - 1) % n, tag + s);
    if (sent) sent->Wait();
    chunk(recv_i).add_(incoming);
  }
  return chunk(r);
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeSubgroupCommunicator(
    c10::intrusive_ptr<c10d::Store> store, const std::string& name, int group_rank, int group_size,
    const std::string& hostname, std::chrono::milliseconds timeout) {
  if (group_size == 1) return MakeLocalCommunicator();
  return MakeGlooCommunicator(c10::make_intrusive<c10d::PrefixStore>(name, std::move(store)),
                              group_rank, group_size, hostname, timeout, /*same_host=*/false);
}

}  // namespace trainyard::trainer
