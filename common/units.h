// Sizes in bytes as people write and read them: yard (estimate-memory, nodes, exports) and the
// worker (--memory-per-slot, its OOM messages). Pure functions.
#ifndef TRAINYARD_COMMON_UNITS_H_
#define TRAINYARD_COMMON_UNITS_H_

#include <cstdint>
#include <optional>
#include <string>

namespace trainyard {

// "512.0 MiB", "16.0 GiB", "100 B".
std::string HumanBytes(int64_t bytes);
// "16GiB", "80G", "512MiB", "1.5GB" or plain bytes (K, M, G, T decimal; KiB, MiB, GiB, TiB
// binary); nullopt if malformed.
std::optional<int64_t> ParseBytes(const std::string& text);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_UNITS_H_
