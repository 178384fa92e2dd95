// The host of an address as the programs' flags and the nodes give it: HOST:PORT, [IPv6]:PORT, a
// host alone, or a bare IPv6 address. Header-only; pure. (The coordinator's NodeRegistry, the
// worker's node address and the TLS checks' names all take the host this way.)
#ifndef TRAINYARD_COMMON_HOST_PORT_H_
#define TRAINYARD_COMMON_HOST_PORT_H_

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/string_view.h"

namespace trainyard {

// "10.1.2.3:7000" → "10.1.2.3", "[fd00::7]:7000" → "fd00::7", "gpu-7" and "fd00::7" as they are
// (surrounding blanks dropped; "" stays "").
inline std::string HostOfAddress(absl::string_view address) {
  const std::string a(absl::StripAsciiWhitespace(address));
  if (!a.empty() && a.front() == '[') {  // [IPv6]:PORT
    const size_t close = a.find(']');
    return close == std::string::npos ? a : a.substr(1, close - 1);
  }
  // HOST:PORT has one colon; a bare IPv6 address has more.
  return std::count(a.begin(), a.end(), ':') == 1 ? a.substr(0, a.find(':')) : a;
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_HOST_PORT_H_
