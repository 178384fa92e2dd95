// Compile-time check, built only where cuda.h is installed: the driver API entry points that
// worker/daemon/cuda_devices.cc looks up by name have the shapes it declares for them (an int-sized
// CUresult with CUDA_SUCCESS 0, an int CUdevice, a 16-byte CUuuid, and these parameter lists).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstddef>
#include <type_traits>

static_assert(CUDA_VERSION >= 11040, "cuDeviceGetUuid_v2 needs CUDA 11.4 or later");
static_assert(sizeof(CUresult) == sizeof(int) && CUDA_SUCCESS == 0);
static_assert(std::is_same_v<CUdevice, int>);
static_assert(sizeof(CUuuid) == 16);
static_assert(std::is_same_v<PFN_cuInit_v2000, CUresult (*)(unsigned int)>);
static_assert(std::is_same_v<PFN_cuDeviceGetCount_v2000, CUresult (*)(int*)>);
static_assert(std::is_same_v<PFN_cuDeviceGet_v2000, CUresult (*)(CUdevice*, int)>);
static_assert(std::is_same_v<PFN_cuDeviceGetName_v2000, CUresult (*)(char*, int, CUdevice)>);
static_assert(std::is_same_v<PFN_cuDeviceTotalMem_v3020, CUresult (*)(size_t*, CUdevice)>);
static_assert(std::is_same_v<PFN_cuDeviceGetUuid_v11040, CUresult (*)(CUuuid*, CUdevice)>);
static_assert(std::is_same_v<PFN_cuGetErrorString_v6000, CUresult (*)(CUresult, const char**)>);
// The versioned symbols the worker asks dlsym for are the ones cuda.h's macros name.
#define TRAINYARD_STR2(x) #x
#define TRAINYARD_STR(x) TRAINYARD_STR2(x)
constexpr bool Same(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || Same(a + 1, b + 1));
}
static_assert(Same(TRAINYARD_STR(cuDeviceTotalMem), "cuDeviceTotalMem_v2"));
static_assert(Same(TRAINYARD_STR(cuDeviceGetUuid), "cuDeviceGetUuid_v2"));

int main() { return 0; }
