// The version every program prints for --version (from the CMake project version).
#ifndef TRAINYARD_COMMON_VERSION_H_
#define TRAINYARD_COMMON_VERSION_H_

#ifndef TRAINYARD_VERSION
#define TRAINYARD_VERSION "0.0.0-dev"
#endif

namespace trainyard {
inline constexpr char kVersion[] = TRAINYARD_VERSION;
}  // namespace trainyard

#endif  // TRAINYARD_COMMON_VERSION_H_
