// A stand-in for libcuda.so.1 in the worker's tests on hosts without NVIDIA GPUs: the handful of
// driver API calls worker/daemon/cuda_devices.cc makes, answering for FAKE_CUDA_DEVICES devices
// (default 2) of FAKE_CUDA_MEMORY_MIB each (default 81559, an H100's 80 GB). FAKE_CUDA_INIT_ERROR
// set: cuInit fails with CUDA_ERROR_NO_DEVICE, as on a host whose driver sees no GPU.
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kNotInitialized = 3;
constexpr int kNoDevice = 100;
constexpr int kInvalidDevice = 101;

bool initialized = false;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

int Count() { return EnvInt("FAKE_CUDA_DEVICES", 2); }

int CheckDevice(int device) {
  if (!initialized) return kNotInitialized;
  return device >= 0 && device < Count() ? kSuccess : kInvalidDevice;
}

}  // namespace

extern "C" {

int cuInit(unsigned int flags) {
  if (flags != 0) return kInvalidValue;
  if (std::getenv("FAKE_CUDA_INIT_ERROR") != nullptr) return kNoDevice;
  initialized = true;
  return kSuccess;
}

int cuGetErrorString(int error, const char** text) {
  switch (error) {
    case kSuccess:
      *text = "no error";
      return kSuccess;
    case kInvalidValue:
      *text = "invalid argument";
      return kSuccess;
    case kNotInitialized:
      *text = "initialization error";
      return kSuccess;
    case kNoDevice:
      *text = "no CUDA-capable device is detected";
      return kSuccess;
    case kInvalidDevice:
      *text = "invalid device ordinal";
      return kSuccess;
    default:
      *text = nullptr;
      return kInvalidValue;
  }
}

int cuDeviceGetCount(int* count) {
  if (!initialized) return kNotInitialized;
  *count = Count();
  return kSuccess;
}

int cuDeviceGet(int* device, int ordinal) {
  if (int r = CheckDevice(ordinal); r != kSuccess) return r;
  *device = ordinal;
  return kSuccess;
}

int cuDeviceGetName(char* name, int len, int device) {
  if (int r = CheckDevice(device); r != kSuccess) return r;
  std::snprintf(name, static_cast<size_t>(len), "Fake GPU %d", device);
  return kSuccess;
}

int cuDeviceTotalMem_v2(size_t* bytes, int device) {
  if (int r = CheckDevice(device); r != kSuccess) return r;
  *bytes = static_cast<size_t>(EnvInt("FAKE_CUDA_MEMORY_MIB", 81559)) << 20;
  return kSuccess;
}

int cuDeviceGetUuid_v2(unsigned char* uuid, int device) {
  if (int r = CheckDevice(device); r != kSuccess) return r;
  for (int i = 0; i < 16; ++i) uuid[i] = static_cast<unsigned char>(0xa0 + i);
  uuid[15] = static_cast<unsigned char>(device);
  return kSuccess;
}

}  // extern "C"
