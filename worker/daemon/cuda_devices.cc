#include "worker/daemon/cuda_devices.h"

#include <dlfcn.h>

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace trainyard::worker {
namespace {

// The few driver API entry points used here, declared as cuda.h declares them (CUresult is an
// enum, CUdevice an int, CUuuid 16 bytes); tests/cuda_driver_api_check.cc holds cuda.h to the
// same shapes where the toolkit is installed. The versioned names are what cuda.h's macros resolve
// to.
using CUresult = int;
using CUdevice = int;
struct CUuuid {
  char bytes[16];
};
constexpr CUresult kCudaSuccess = 0;

struct DriverApi {
  CUresult (*cuInit)(unsigned int flags) = nullptr;
  CUresult (*cuDeviceGetCount)(int* count) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal) = nullptr;
  CUresult (*cuDeviceGetName)(char* name, int len, CUdevice device) = nullptr;
  CUresult (*cuDeviceTotalMem_v2)(size_t* bytes, CUdevice device) = nullptr;
  CUresult (*cuDeviceGetUuid_v2)(CUuuid* uuid, CUdevice device) = nullptr;
  CUresult (*cuGetErrorString)(CUresult error, const char** text) = nullptr;
};

struct LibraryCloser {
  void operator()(void* handle) const { dlclose(handle); }
};

template <typename Fn>
bool Load(void* library, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(dlsym(library, name));
  return fn != nullptr;
}

}  // namespace

std::string FormatGpuUuid(const std::array<unsigned char, 16>& b) {
  std::string hex;
  for (unsigned char c : b) absl::StrAppendFormat(&hex, "%02x", c);
  return absl::StrCat("GPU-", hex.substr(0, 8), "-", hex.substr(8, 4), "-", hex.substr(12, 4), "-",
                      hex.substr(16, 4), "-", hex.substr(20));
}

absl::StatusOr<std::vector<CudaDevice>> ListCudaDevices(const std::string& driver_library) {
  std::unique_ptr<void, LibraryCloser> library(
      dlopen(driver_library.c_str(), RTLD_NOW | RTLD_LOCAL));
  if (library == nullptr) {
    const char* why = dlerror();
    return absl::NotFoundError(
        absl::StrCat("no CUDA driver: ", why != nullptr ? why : driver_library));
  }
  DriverApi api;
  void* lib = library.get();
  if (!Load(lib, "cuInit", api.cuInit) || !Load(lib, "cuDeviceGetCount", api.cuDeviceGetCount) ||
      !Load(lib, "cuDeviceGet", api.cuDeviceGet) ||
      !Load(lib, "cuDeviceGetName", api.cuDeviceGetName) ||
      !Load(lib, "cuDeviceTotalMem_v2", api.cuDeviceTotalMem_v2) ||
      !Load(lib, "cuDeviceGetUuid_v2", api.cuDeviceGetUuid_v2) ||
      !Load(lib, "cuGetErrorString", api.cuGetErrorString)) {
    return absl::FailedPreconditionError(absl::StrCat(
        driver_library, " lacks a CUDA driver API entry point (driver older than CUDA 11.4?)"));
  }
  // Stays loaded from here on: the driver does not support being unloaded after cuInit.
  library.release();
  auto check = [&api](CUresult r, const char* call) -> absl::Status {
    if (r == kCudaSuccess) return absl::OkStatus();
    const char* text = nullptr;
    if (api.cuGetErrorString(r, &text) != kCudaSuccess || text == nullptr) text = "unknown error";
    return absl::FailedPreconditionError(absl::StrCat("CUDA driver: ", call, ": ", text));
  };
  if (absl::Status s = check(api.cuInit(0), "cuInit"); !s.ok()) return s;
  int count = 0;
  if (absl::Status s = check(api.cuDeviceGetCount(&count), "cuDeviceGetCount"); !s.ok()) return s;
  std::vector<CudaDevice> devices;
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    if (absl::Status s = check(api.cuDeviceGet(&dev, i), "cuDeviceGet"); !s.ok()) return s;
    char name[256] = {0};
    size_t bytes = 0;
    CUuuid uuid{};
    if (absl::Status s = check(api.cuDeviceGetName(name, sizeof(name) - 1, dev), "cuDeviceGetName");
        !s.ok())
      return s;
    if (absl::Status s = check(api.cuDeviceTotalMem_v2(&bytes, dev), "cuDeviceTotalMem"); !s.ok())
      return s;
    if (absl::Status s = check(api.cuDeviceGetUuid_v2(&uuid, dev), "cuDeviceGetUuid"); !s.ok())
      return s;
    std::array<unsigned char, 16> raw;
    for (int k = 0; k < 16; ++k) raw[k] = static_cast<unsigned char>(uuid.bytes[k]);
    devices.push_back({i, name, FormatGpuUuid(raw), static_cast<int64_t>(bytes)});
  }
  return devices;
}

}  // namespace trainyard::worker
