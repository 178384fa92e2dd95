// What only the CUDA flavour of the trainer has (cuda_support.cc, built when the LibTorch has
// torch_cuda); the CPU flavour links cuda_support_none.cc, whose functions say there is no CUDA.
// LibTorch side only.
#ifndef TRAINYARD_WORKER_TRAINER_COMM_CUDA_SUPPORT_H_
#define TRAINYARD_WORKER_TRAINER_COMM_CUDA_SUPPORT_H_

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
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

// Whether this trainer can capture CUDA graphs (the CUDA flavour).
bool CudaGraphsBuilt();

// After waiting for device `index`, makes a stream of its own (from LibTorch's pool) this
// thread's current stream there: CUDA graphs are not captured on the default stream, and the
// eager steps before a capture must run on the stream the capture will (cuBLAS keeps a workspace
// per stream). Everything the thread queues from then on goes to that stream.
void UseStreamOfItsOwn(int index);

// Captures `body` on the current stream into a CUDA graph (at::cuda::CUDAGraph, a private memory
// pool; its kernels are recorded, not run), after waiting for the device and handing the caching
// allocator's free blocks back, as torch.cuda.graph does. Returns the graph's replay, queued on
// the current stream; destroying the last copy waits for the device and frees the graph. An
// error (one line) when the body throws or does what a capture cannot (a wait for the device, a
// copy from pageable memory): the capture is ended and nothing ran. UNIMPLEMENTED without CUDA.
absl::StatusOr<std::function<void()>> CaptureCudaGraph(const std::function<void()>& body);

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
