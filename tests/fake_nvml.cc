// A stand-in for libnvidia-ml.so.1 in the worker's tests on hosts without NVIDIA GPUs: the NVML
// calls worker/daemon/nvml.cc makes, for the GPUs tests/fake_cuda_driver.cc lists (found by their
// UUIDs, "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae0<i>"). Every GPU reports FAKE_NVML_UTILIZATION
// percent busy (default 37) plus twice its index, FAKE_NVML_MEMORY_USED_MIB used (default 1024) of
// FAKE_CUDA_MEMORY_MIB (default 81559), FAKE_NVML_TEMPERATURE degrees (default 54) plus its index,
// and 250 W. FAKE_NVML_INIT_ERROR set: nvmlInit fails (NVML_ERROR_DRIVER_NOT_LOADED).
// Faults come from the file FAKE_NVML_FAULT_FILE names, read at every call, one per line:
// "I xid N" (a critical XID event on GPU I, delivered once, in file order), "I ecc N" (N
// uncorrected ECC errors), "I remap-failed", "I remap-pending", "I lost" (the GPU fell off the
// bus: NVML_ERROR_GPU_IS_LOST). FAKE_NVML_MINORS: the GPUs' minor numbers ("1,0"; default their
// indices).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr int kSuccess = 0;
constexpr int kUninitialized = 1;
constexpr int kInvalidArgument = 2;
constexpr int kNotFound = 6;
constexpr int kDriverNotLoaded = 9;
constexpr int kTimeout = 10;
constexpr int kGpuIsLost = 15;

bool initialized = false;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

struct Utilization {
  unsigned int gpu;
  unsigned int memory;
};
struct Memory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};

// Device handles are 1 + the index, as pointers.
int IndexOf(void* device) { return static_cast<int>(reinterpret_cast<intptr_t>(device)) - 1; }
void* HandleOf(int index) { return reinterpret_cast<void*>(static_cast<intptr_t>(index + 1)); }

struct Fault {
  int gpu = -1;
  std::string kind;
  long long value = 0;
};

std::vector<Fault> Faults() {
  std::vector<Fault> out;
  const char* path = std::getenv("FAKE_NVML_FAULT_FILE");
  if (path == nullptr) return out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    Fault f;
    if (words >> f.gpu >> f.kind) {
      words >> f.value;
      out.push_back(f);
    }
  }
  return out;
}

bool Has(int gpu, const std::string& kind) {
  for (const Fault& f : Faults()) {
    if (f.gpu == gpu && f.kind == kind) return true;
  }
  return false;
}

size_t xids_delivered = 0;

struct EventData {
  void* device;
  unsigned long long event_type;
  unsigned long long event_data;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

}  // namespace

extern "C" {

int nvmlInit_v2() {
  if (std::getenv("FAKE_NVML_INIT_ERROR") != nullptr) return kDriverNotLoaded;
  initialized = true;
  return kSuccess;
}

int nvmlShutdown() {
  initialized = false;
  return kSuccess;
}

const char* nvmlErrorString(int code) {
  switch (code) {
    case kNotFound:
      return "Not Found";
    case kDriverNotLoaded:
      return "Driver Not Loaded";
    case kGpuIsLost:
      return "GPU is lost";
    default:
      return "Unknown Error";
  }
}

int nvmlDeviceGetHandleByUUID(const char* uuid, void** device) {
  if (!initialized) return kUninitialized;
  const std::string prefix = "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae0";
  if (uuid == nullptr || device == nullptr) return kInvalidArgument;
  const std::string u(uuid);
  if (u.size() != prefix.size() + 1 || u.compare(0, prefix.size(), prefix) != 0) return kNotFound;
  const int index = u.back() - '0';
  if (index < 0 || index >= EnvInt("FAKE_CUDA_DEVICES", 2)) return kNotFound;
  *device = reinterpret_cast<void*>(static_cast<intptr_t>(index + 1));
  return kSuccess;
}

// FAKE_NVML_MINORS: each GPU's minor number, comma-separated (default: its index).
int nvmlDeviceGetMinorNumber(void* device, unsigned int* minor) {
  if (!initialized) return kUninitialized;
  if (minor == nullptr) return kInvalidArgument;
  const int index = IndexOf(device);
  *minor = static_cast<unsigned int>(index);
  if (const char* list = std::getenv("FAKE_NVML_MINORS"); list != nullptr) {
    std::stringstream in(list);
    std::string item;
    for (int i = 0; std::getline(in, item, ','); ++i) {
      if (i == index) *minor = static_cast<unsigned int>(std::atoi(item.c_str()));
    }
  }
  return kSuccess;
}

int nvmlDeviceGetUtilizationRates(void* device, Utilization* u) {
  if (!initialized) return kUninitialized;
  if (Has(IndexOf(device), "lost")) return kGpuIsLost;
  u->gpu = static_cast<unsigned int>(EnvInt("FAKE_NVML_UTILIZATION", 37) + 2 * IndexOf(device));
  u->memory = 10;
  return kSuccess;
}

int nvmlDeviceGetMemoryInfo(void*, Memory* m) {
  if (!initialized) return kUninitialized;
  m->total = static_cast<unsigned long long>(EnvInt("FAKE_CUDA_MEMORY_MIB", 81559)) << 20;
  m->used = static_cast<unsigned long long>(EnvInt("FAKE_NVML_MEMORY_USED_MIB", 1024)) << 20;
  m->free = m->total - m->used;
  return kSuccess;
}

int nvmlDeviceGetTemperature(void* device, int sensor, unsigned int* celsius) {
  if (!initialized) return kUninitialized;
  if (sensor != 0) return kInvalidArgument;
  *celsius = static_cast<unsigned int>(EnvInt("FAKE_NVML_TEMPERATURE", 54) + IndexOf(device));
  return kSuccess;
}

int nvmlDeviceGetPowerUsage(void*, unsigned int* milliwatts) {
  if (!initialized) return kUninitialized;
  *milliwatts = 250000;
  return kSuccess;
}

int nvmlDeviceGetTotalEccErrors(void* device, int error_type, int counter_type,
                                unsigned long long* count) {
  if (!initialized) return kUninitialized;
  if (error_type != 1 || counter_type != 0) return kInvalidArgument;  // uncorrected, volatile
  *count = 0;
  for (const Fault& f : Faults()) {
    if (f.gpu == IndexOf(device) && f.kind == "ecc") *count += f.value;
  }
  return kSuccess;
}

int nvmlDeviceGetRemappedRows(void* device, unsigned int* corrected, unsigned int* uncorrected,
                              unsigned int* pending, unsigned int* failed) {
  if (!initialized) return kUninitialized;
  *corrected = *uncorrected = 0;
  *pending = Has(IndexOf(device), "remap-pending") ? 1 : 0;
  *failed = Has(IndexOf(device), "remap-failed") ? 1 : 0;
  return kSuccess;
}

int nvmlEventSetCreate(void** set) {
  if (!initialized) return kUninitialized;
  *set = reinterpret_cast<void*>(static_cast<intptr_t>(0x5e7));
  return kSuccess;
}

int nvmlEventSetFree(void*) { return kSuccess; }

int nvmlDeviceRegisterEvents(void*, unsigned long long event_types, void*) {
  if (!initialized) return kUninitialized;
  return (event_types & 0x8) != 0 ? kSuccess : kInvalidArgument;  // XID events only
}

// The next "I xid N" line not yet delivered; never waits.
int nvmlEventSetWait_v2(void*, EventData* data, unsigned int) {
  if (!initialized) return kUninitialized;
  size_t seen = 0;
  for (const Fault& f : Faults()) {
    if (f.kind != "xid") continue;
    if (seen++ < xids_delivered) continue;
    ++xids_delivered;
    *data = EventData{HandleOf(f.gpu), 0x8, static_cast<unsigned long long>(f.value), 0, 0};
    return kSuccess;
  }
  return kTimeout;
}

}  // extern "C"
