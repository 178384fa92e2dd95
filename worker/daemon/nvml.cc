#include "worker/daemon/nvml.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace trainyard::worker {
namespace {

// The NVML entry points used here, as nvml.h declares them (nvmlReturn_t is an enum,
// nvmlDevice_t an opaque pointer; NVML_TEMPERATURE_GPU is 0).
using NvmlDevice = struct NvmlDeviceOpaque*;
struct NvmlUtilization {
  unsigned int gpu;
  unsigned int memory;
};
struct NvmlMemory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlNotFound = 6;
constexpr int kNvmlTemperatureGpu = 0;

}  // namespace

struct Nvml::Api {
  int (*init)();
  int (*shutdown)();
  const char* (*error_string)(int);
  int (*by_uuid)(const char*, NvmlDevice*);
  int (*utilization)(NvmlDevice, NvmlUtilization*);
  int (*memory)(NvmlDevice, NvmlMemory*);
  int (*temperature)(NvmlDevice, int, unsigned int*);
  int (*power)(NvmlDevice, unsigned int*);  // milliwatts; optional

  std::string Error(int code) const {
    const char* s = error_string != nullptr ? error_string(code) : nullptr;
    return s != nullptr ? std::string(s) : absl::StrCat("NVML error ", code);
  }
};

absl::StatusOr<std::unique_ptr<Nvml>> Nvml::Open(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::NotFoundError(
        absl::StrCat("no NVML: ", library, ": ", why != nullptr ? why : "cannot open"));
  }
  auto api = std::make_unique<Api>();
  auto load = [&](const char* name, auto& fn) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, name));
    return fn != nullptr;
  };
  const bool ok = load("nvmlInit_v2", api->init) && load("nvmlShutdown", api->shutdown) &&
                  load("nvmlDeviceGetHandleByUUID", api->by_uuid) &&
                  load("nvmlDeviceGetUtilizationRates", api->utilization) &&
                  load("nvmlDeviceGetMemoryInfo", api->memory) &&
                  load("nvmlDeviceGetTemperature", api->temperature);
  load("nvmlErrorString", api->error_string);
  load("nvmlDeviceGetPowerUsage", api->power);
  if (!ok) {
    dlclose(handle);
    return absl::FailedPreconditionError(
        absl::StrCat(library, " lacks the NVML entry points the worker reads"));
  }
  if (const int rc = api->init(); rc != kNvmlSuccess) {
    const std::string why = api->Error(rc);
    dlclose(handle);
    return absl::FailedPreconditionError(absl::StrCat("nvmlInit: ", why));
  }
  return std::unique_ptr<Nvml>(new Nvml(handle, std::move(api)));
}

Nvml::Nvml(void* handle, std::unique_ptr<Api> api) : handle_(handle), api_(std::move(api)) {}

Nvml::~Nvml() {
  api_->shutdown();
  dlclose(handle_);
}

absl::StatusOr<GpuSample> Nvml::Sample(const std::string& uuid) const {
  NvmlDevice device = nullptr;
  if (const int rc = api_->by_uuid(uuid.c_str(), &device); rc != kNvmlSuccess) {
    const std::string why = absl::StrCat("NVML: ", uuid, ": ", api_->Error(rc));
    return rc == kNvmlNotFound ? absl::NotFoundError(why) : absl::UnavailableError(why);
  }
  GpuSample s;
  NvmlUtilization u{};
  if (const int rc = api_->utilization(device, &u); rc != kNvmlSuccess) {
    return absl::UnavailableError(absl::StrCat("nvmlDeviceGetUtilizationRates: ", api_->Error(rc)));
  }
  s.utilization = std::min(100u, u.gpu) / 100.0;
  NvmlMemory m{};
  if (const int rc = api_->memory(device, &m); rc != kNvmlSuccess) {
    return absl::UnavailableError(absl::StrCat("nvmlDeviceGetMemoryInfo: ", api_->Error(rc)));
  }
  s.memory_used_bytes = static_cast<int64_t>(m.used);
  s.memory_total_bytes = static_cast<int64_t>(m.total);
  unsigned int celsius = 0;
  if (const int rc = api_->temperature(device, kNvmlTemperatureGpu, &celsius); rc != kNvmlSuccess) {
    return absl::UnavailableError(absl::StrCat("nvmlDeviceGetTemperature: ", api_->Error(rc)));
  }
  s.temperature_celsius = celsius;
  unsigned int milliwatts = 0;
  if (api_->power != nullptr && api_->power(device, &milliwatts) == kNvmlSuccess) {
    s.power_watts = milliwatts / 1000.0;
  }
  return s;
}

}  // namespace trainyard::worker
