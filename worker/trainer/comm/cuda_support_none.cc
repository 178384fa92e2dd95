// The CPU flavour of cuda_support.h: no CUDA.
#include "worker/trainer/comm/cuda_support.h"

namespace trainyard::trainer {

bool CudaBuild() { return false; }
std::string CudaDeviceSummary(int) { return "no CUDA in this build"; }
std::string CudaDeviceName(int) { return ""; }
void CudaSynchronize() {}
int64_t CudaPeakAllocatedBytes() { return 0; }
void CudaResetPeak() {}
bool CudaGraphsBuilt() { return false; }
void UseStreamOfItsOwn(int) {}

absl::StatusOr<std::function<void()>> CaptureCudaGraph(const std::function<void()>&) {
  return absl::UnimplementedError("CUDA graphs: this trainer was built without CUDA");
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(c10::intrusive_ptr<c10d::Store>,
                                                                   int, int,
                                                                   std::chrono::milliseconds) {
  return absl::UnimplementedError(
      "NCCL: this trainer was built without CUDA (trainyard-trainer --supported-devices)");
}

}  // namespace trainyard::trainer
