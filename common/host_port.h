// The host of an address as the programs' flags and the nodes give it: HOST:PORT, [IPv6]:PORT, a
// host alone, or a bare IPv6 address; and the client a peer's address stands for. Header-only;
// pure. (The coordinator's NodeRegistry, the worker's node address and the TLS checks' names all
// take the host this way; the coordinator's sign-in throttle takes the client.)
#ifndef TRAINYARD_COMMON_HOST_PORT_H_
#define TRAINYARD_COMMON_HOST_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

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

// The client a peer's address stands for, the key its failed sign-ins are counted under: an IPv4
// address ("ipv4:10.1.2.3"), or the network of an IPv6 one, its first `ipv6_prefix_bits` bits
// (16 to 128; by default its /64, "ipv6:2001:db8:1:2::/64"), since a host is given a /64 and may
// take any address in it (a guesser rotating its addresses would start a fresh count with each);
// an operator whose hosts share a /64 counts each address (128), one whose users are given /56s
// or /48s counts those. An IPv4-mapped (::ffff:0:0/96) or NAT64 (64:ff9b::/96) address
// is the IPv4 address it holds; a link-local one (fe80::/10, every host's on a link) is itself.
// Takes gRPC's peer ("ipv4:10.1.2.3:5000", "ipv6:[::1]:5000", "ipv6:%5B::1%5D:5000") and plain
// addresses with or without a port; anything else (a Unix socket's peer) is returned as it is.
inline std::string ClientOfAddress(absl::string_view peer, int ipv6_prefix_bits = 64) {
  const std::string decoded = absl::StrReplaceAll(
      absl::StripAsciiWhitespace(peer), {{"%5B", "["}, {"%5b", "["}, {"%5D", "]"}, {"%5d", "]"}});
  absl::string_view a = decoded;
  if (!absl::ConsumePrefix(&a, "ipv4:")) absl::ConsumePrefix(&a, "ipv6:");
  std::string host = HostOfAddress(a);
  host.resize(std::min(host.find('%'), host.size()));  // an IPv6 zone ("fe80::1%eth0")
  char text[INET6_ADDRSTRLEN] = {};
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    inet_ntop(AF_INET, &v4, text, sizeof(text));
    return std::string("ipv4:") + text;
  }
  if (inet_pton(AF_INET6, host.c_str(), &v6) != 1) return std::string(peer);
  static constexpr unsigned char kNat64[12] = {0x00, 0x64, 0xff, 0x9b};
  if (IN6_IS_ADDR_V4MAPPED(&v6) || std::memcmp(v6.s6_addr, kNat64, 12) == 0) {
    std::memcpy(&v4, &v6.s6_addr[12], 4);
    inet_ntop(AF_INET, &v4, text, sizeof(text));
    return std::string("ipv4:") + text;
  }
  if (IN6_IS_ADDR_LINKLOCAL(&v6)) {
    inet_ntop(AF_INET6, &v6, text, sizeof(text));
    return std::string("ipv6:") + text;
  }
  const int bits = std::clamp(ipv6_prefix_bits, 16, 128);
  for (int byte = 0; byte < 16; ++byte) {
    const int kept = std::clamp(bits - 8 * byte, 0, 8);  // of this byte's 8 bits, from the top
    v6.s6_addr[byte] &= static_cast<unsigned char>(0xff00 >> kept);
  }
  inet_ntop(AF_INET6, &v6, text, sizeof(text));
  return std::string("ipv6:") + text + "/" + std::to_string(bits);
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_HOST_PORT_H_
