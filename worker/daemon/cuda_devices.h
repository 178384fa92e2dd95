// The NVIDIA GPUs of this host, as the CUDA driver sees them. The driver library (libcuda.so.1)
// is opened at run time, so the worker builds and runs on hosts without a driver or toolkit; the
// driver applies the worker's own CUDA_VISIBLE_DEVICES, as it does for any CUDA program.
// Not handled: MIG. CUDA shows a process one MIG instance unless CUDA_VISIBLE_DEVICES names
// several, and their UUIDs are written MIG-..., not GPU-...; listing them needs NVML.
#ifndef TRAINYARD_WORKER_DAEMON_CUDA_DEVICES_H_
#define TRAINYARD_WORKER_DAEMON_CUDA_DEVICES_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainyard::worker {

struct CudaDevice {
  int ordinal = 0;   // CUDA's device number in this process
  std::string name;  // "NVIDIA H100 80GB HBM3"
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L shows it
  int64_t memory_bytes = 0;  // total device memory
};

// Lists the devices through the driver API in `driver_library` (default: the system's).
// NotFound: the library cannot be opened (no NVIDIA driver: an ordinary CPU host).
// FailedPrecondition: the driver is there but fails (cuInit's error string in the message).
absl::StatusOr<std::vector<CudaDevice>> ListCudaDevices(
    const std::string& driver_library = "libcuda.so.1");

// A device UUID's 16 bytes in nvidia-smi's form, which CUDA_VISIBLE_DEVICES accepts.
std::string FormatGpuUuid(const std::array<unsigned char, 16>& bytes);

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_CUDA_DEVICES_H_
