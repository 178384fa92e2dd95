// What each GPU is doing, through NVML (libnvidia-ml.so.1, the library nvidia-smi reads):
// utilization, memory used, temperature, power, and its health: uncorrected ECC errors, row
// remapping, critical XID events. The library is opened at run time, as the driver
// API is (cuda_devices.h), so the worker builds and runs where there is none; GPUs are found by
// the UUIDs the driver API listed. The worker samples at each heartbeat, exports the samples to
// Prometheus (trainyard_worker_gpu_*) and sends them to the coordinator (`yard nodes`).
// Thread-compatible: the worker's writer thread samples.
#ifndef TRAINYARD_WORKER_DAEMON_NVML_H_
#define TRAINYARD_WORKER_DAEMON_NVML_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainyard::worker {

struct GpuSample {
  double utilization = 0;  // share of the last sample period a kernel ran, 0..1
  int64_t memory_used_bytes = 0;
  int64_t memory_total_bytes = 0;
  double temperature_celsius = 0;
  double power_watts = 0;  // 0 where the board does not say
  // Uncorrected ECC errors since the driver loaded (volatile); -1 where the GPU does not say.
  int64_t ecc_uncorrected_errors = -1;
  // Row remapping (A100 and later): a remapping failed, or one waits for a GPU reset.
  bool row_remap_failed = false;
  bool row_remap_pending = false;
};

// A critical XID event (nvmlEventTypeXidCriticalError): which GPU (its index in the UUIDs given
// to WatchXids) and the XID.
struct XidEvent {
  int gpu = 0;
  int64_t xid = 0;
};

class Nvml {
 public:
  // Opens `library` and initializes NVML. NOT_FOUND when the library cannot be opened (no NVIDIA
  // driver), FAILED_PRECONDITION when it fails to start (its error string in the message).
  static absl::StatusOr<std::unique_ptr<Nvml>> Open(const std::string& library);
  ~Nvml();  // nvmlShutdown, dlclose

  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  // The GPU with this UUID ("GPU-xxxxxxxx-..."): NOT_FOUND if NVML does not know it, else
  // UNAVAILABLE naming the call that failed (a GPU that fell off the bus).
  // FAILED_PRECONDITION when NVML says the GPU is lost (fallen off the bus).
  absl::StatusOr<GpuSample> Sample(const std::string& uuid) const;

  // The minor number of the GPU with this UUID: its device file is /dev/nvidiaMINOR (CUDA's
  // ordinals follow CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, the minors do not).
  absl::StatusOr<int> MinorNumber(const std::string& uuid) const;

  // Starts collecting critical XID events of these GPUs. Where NVML cannot (no event API, a GPU
  // that does not support it), an error names it; the other samples go on.
  absl::Status WatchXids(const std::vector<std::string>& uuids);
  // The XID events since the last call, without waiting.
  std::vector<XidEvent> TakeXids();

 private:
  struct Api;
  Nvml(void* handle, std::unique_ptr<Api> api);
  void* handle_;
  std::unique_ptr<Api> api_;
  void* event_set_ = nullptr;
  std::vector<void*> watched_;  // device handles, by index given to WatchXids
};

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_NVML_H_
