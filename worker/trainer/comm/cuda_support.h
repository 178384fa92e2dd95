// What only the CUDA flavour of the trainer has (cuda_support.cc, built when the LibTorch has
// torch_cuda); the CPU flavour links cuda_support_none.cc, whose functions say there is no CUDA.
// LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_COMM_CUDA_SUPPORT_H_
#define TRAINYARD_WORKER_TRAINER_COMM_CUDA_SUPPORT_H_

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/trainer/comm/communicator.h"

namespace trainyard::trainer {

// Whether this trainer was built against a CUDA LibTorch.
bool CudaBuild();

// "NVIDIA H100 80GB HBM3, 79.1 GiB, compute 9.0" for CUDA device `index`.
std::string CudaDeviceSummary(int index);

// CUDA's name of device `index` ("NVIDIA H100 80GB HBM3"); "" without CUDA.
std::string CudaDeviceName(int index);

// Waits for every stream of the current device.
void CudaSynchronize();

// Bytes the CUDA caching allocator handed out at most since the last reset (peak memory), and the
// reset; 0 without CUDA.
int64_t CudaPeakAllocatedBytes();
void CudaResetPeak();

// NCCL (c10d::ProcessGroupNCCL) over `store`, whose rendezvous carries NCCL's unique id: the
// collectives of CUDA tensors run on NCCL's own stream per group, ordered after the producing
// kernels and before the consuming ones with CUDA events, so the host never waits for them
// (CommHandle::Wait orders the current stream after the collective). CPU tensors (the trainer's
// small agreement all-reduces) travel through a device copy, blocking. A collective that does not
// finish within `timeout` (a peer died or hangs) aborts the communicator (ncclCommAbort) and ends
// the rank with an error naming the collective, not a hang. UNIMPLEMENTED without CUDA.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
    std::chrono::milliseconds timeout);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_COMM_CUDA_SUPPORT_H_
