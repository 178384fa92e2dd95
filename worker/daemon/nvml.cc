#include "worker/daemon/nvml.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
struct NvmlEventData {
  NvmlDevice device;
  unsigned long long event_type;
  unsigned long long event_data;  // the XID, for nvmlEventTypeXidCriticalError
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlNotFound = 6;
constexpr int kNvmlGpuIsLost = 15;
constexpr int kNvmlTemperatureGpu = 0;
constexpr int kNvmlMemoryErrorUncorrected = 1;
constexpr int kNvmlVolatileEcc = 0;
constexpr unsigned long long kNvmlEventTypeXidCriticalError = 0x8;

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
  // Optional: health.
  int (*total_ecc)(NvmlDevice, int, int, unsigned long long*);
  int (*remapped_rows)(NvmlDevice, unsigned int*, unsigned int*, unsigned int*, unsigned int*);
  int (*event_set_create)(void**);
  int (*event_set_free)(void*);
  int (*register_events)(NvmlDevice, unsigned long long, void*);
  int (*event_set_wait)(void*, NvmlEventData*, unsigned int);
  int (*minor_number)(NvmlDevice, unsigned int*);  // optional

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
  load("nvmlDeviceGetTotalEccErrors", api->total_ecc);
  load("nvmlDeviceGetRemappedRows", api->remapped_rows);
  load("nvmlEventSetCreate", api->event_set_create);
  load("nvmlEventSetFree", api->event_set_free);
  load("nvmlDeviceRegisterEvents", api->register_events);
  load("nvmlEventSetWait_v2", api->event_set_wait);
  load("nvmlDeviceGetMinorNumber", api->minor_number);
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
  if (event_set_ != nullptr && api_->event_set_free != nullptr) api_->event_set_free(event_set_);
  api_->shutdown();
  dlclose(handle_);
}

absl::StatusOr<int> Nvml::MinorNumber(const std::string& uuid) const {
  if (api_->minor_number == nullptr) {
    return absl::UnimplementedError("NVML has no nvmlDeviceGetMinorNumber");
  }
  NvmlDevice device = nullptr;
  if (const int rc = api_->by_uuid(uuid.c_str(), &device); rc != kNvmlSuccess) {
    return absl::NotFoundError(absl::StrCat("NVML: ", uuid, ": ", api_->Error(rc)));
  }
  unsigned int minor = 0;
  if (const int rc = api_->minor_number(device, &minor); rc != kNvmlSuccess) {
    return absl::UnavailableError(
        absl::StrCat("nvmlDeviceGetMinorNumber: ", uuid, ": ", api_->Error(rc)));
  }
  return static_cast<int>(minor);
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
    const std::string why = absl::StrCat("nvmlDeviceGetUtilizationRates: ", api_->Error(rc));
    return rc == kNvmlGpuIsLost ? absl::FailedPreconditionError(why) : absl::UnavailableError(why);
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
  unsigned long long ecc = 0;
  if (api_->total_ecc != nullptr && api_->total_ecc(device, kNvmlMemoryErrorUncorrected,
                                                    kNvmlVolatileEcc, &ecc) == kNvmlSuccess) {
    s.ecc_uncorrected_errors = static_cast<int64_t>(ecc);
  }
  unsigned int corrected = 0, uncorrected = 0, pending = 0, failed = 0;
  if (api_->remapped_rows != nullptr &&
      api_->remapped_rows(device, &corrected, &uncorrected, &pending, &failed) == kNvmlSuccess) {
    s.row_remap_pending = pending != 0;
    s.row_remap_failed = failed != 0;
  }
  return s;
}

absl::Status Nvml::WatchXids(const std::vector<std::string>& uuids) {
  if (api_->event_set_create == nullptr || api_->register_events == nullptr ||
      api_->event_set_wait == nullptr) {
    return absl::UnimplementedError("this NVML has no event API: XID events are not watched");
  }
  if (event_set_ == nullptr) {
    if (const int rc = api_->event_set_create(&event_set_); rc != kNvmlSuccess) {
      event_set_ = nullptr;
      return absl::UnavailableError(absl::StrCat("nvmlEventSetCreate: ", api_->Error(rc)));
    }
  }
  std::vector<std::string> refused;
  watched_.assign(uuids.size(), nullptr);
  for (size_t i = 0; i < uuids.size(); ++i) {
    NvmlDevice device = nullptr;
    int rc = api_->by_uuid(uuids[i].c_str(), &device);
    if (rc == kNvmlSuccess) {
      rc = api_->register_events(device, kNvmlEventTypeXidCriticalError, event_set_);
    }
    if (rc == kNvmlSuccess) {
      watched_[i] = device;
    } else {
      refused.push_back(absl::StrCat("GPU ", i, ": ", api_->Error(rc)));
    }
  }
  if (!refused.empty()) {
    return absl::UnavailableError(
        absl::StrCat("XID events not watched for ", absl::StrJoin(refused, "; ")));
  }
  return absl::OkStatus();
}

std::vector<XidEvent> Nvml::TakeXids() {
  std::vector<XidEvent> out;
  if (event_set_ == nullptr) return out;
  for (int i = 0; i < 1024; ++i) {  // bounded: a storm of events waits for the next call
    NvmlEventData data{};
    if (api_->event_set_wait(event_set_, &data, 0) != kNvmlSuccess) break;  // a timeout: none left
    if ((data.event_type & kNvmlEventTypeXidCriticalError) == 0) continue;
    for (size_t g = 0; g < watched_.size(); ++g) {
      if (watched_[g] == data.device) {
        out.push_back({static_cast<int>(g), static_cast<int64_t>(data.event_data)});
      }
    }
  }
  return out;
}

}  // namespace trainyard::worker
