// A stand-in for libnvidia-ml.so.1 in the worker's tests on hosts without NVIDIA GPUs: the NVML
// calls worker/daemon/nvml.cc makes, for the GPUs tests/fake_cuda_driver.cc lists (found by their
// UUIDs, "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae0<i>"). Every GPU reports FAKE_NVML_UTILIZATION
// percent busy (default 37) plus twice its index, FAKE_NVML_MEMORY_USED_MIB used (default 1024) of
// FAKE_CUDA_MEMORY_MIB (default 81559), FAKE_NVML_TEMPERATURE degrees (default 54) plus its index,
// and 250 W. FAKE_NVML_INIT_ERROR set: nvmlInit fails (NVML_ERROR_DRIVER_NOT_LOADED).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

constexpr int kSuccess = 0;
constexpr int kUninitialized = 1;
constexpr int kInvalidArgument = 2;
constexpr int kNotFound = 6;
constexpr int kDriverNotLoaded = 9;

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

int nvmlDeviceGetUtilizationRates(void* device, Utilization* u) {
  if (!initialized) return kUninitialized;
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

}  // extern "C"
