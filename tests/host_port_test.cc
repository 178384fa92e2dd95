// The client a peer's address stands for (common/host_port.h ClientOfAddress), the key the
// coordinator counts failed sign-ins under: an IPv4 address, an IPv6 /64, gRPC's peer forms.
#include "common/host_port.h"

#include <gtest/gtest.h>

namespace trainyard {
namespace {

TEST(ClientOfAddressTest, AnIpv4AddressIsItsOwnClient) {
  EXPECT_EQ(ClientOfAddress("ipv4:10.1.2.3:5000"), "ipv4:10.1.2.3");
  EXPECT_EQ(ClientOfAddress("10.1.2.3"), "ipv4:10.1.2.3");
  EXPECT_EQ(ClientOfAddress(" 127.0.0.2:80 "), "ipv4:127.0.0.2");
  EXPECT_NE(ClientOfAddress("ipv4:10.1.2.3:1"), ClientOfAddress("ipv4:10.1.2.4:1"));
}

// A host is given a /64: every address in it is one client, so rotating addresses does not start
// a fresh count; another /64 is another client.
TEST(ClientOfAddressTest, AnIpv6AddressCountsAsItsSlash64) {
  EXPECT_EQ(ClientOfAddress("ipv6:[2001:db8:1:2::7]:5000"), "ipv6:2001:db8:1:2::/64");
  EXPECT_EQ(ClientOfAddress("ipv6:%5B2001:db8:1:2:aaaa:bbbb:cccc:dddd%5D:5000"),
            "ipv6:2001:db8:1:2::/64");
  EXPECT_EQ(ClientOfAddress("2001:db8:1:2:ffff::1"), "ipv6:2001:db8:1:2::/64");  // a browser's
  EXPECT_NE(ClientOfAddress("2001:db8:1:2::1"), ClientOfAddress("2001:db8:1:3::1"));
  EXPECT_EQ(ClientOfAddress("ipv6:[::1]:5000"), "ipv6:::/64");
}

// An operator whose hosts share a /64 counts each address (--auth-peer-ipv6-prefix 128); one
// whose users are given /56s or /48s counts those; a prefix that ends inside a byte keeps that
// byte's top bits; out of range, the nearest of 16 and 128.
TEST(ClientOfAddressTest, AnotherIpv6PrefixCountsItsNetwork) {
  EXPECT_EQ(ClientOfAddress("ipv6:[2001:db8:1:2::7]:5000", 128), "ipv6:2001:db8:1:2::7/128");
  EXPECT_NE(ClientOfAddress("2001:db8:1:2::7", 128), ClientOfAddress("2001:db8:1:2::8", 128));
  EXPECT_EQ(ClientOfAddress("2001:db8:1:2ff::7", 56), "ipv6:2001:db8:1:200::/56");
  EXPECT_EQ(ClientOfAddress("2001:db8:1:2ff::7", 56), ClientOfAddress("2001:db8:1:2aa::1", 56));
  EXPECT_EQ(ClientOfAddress("2001:db8:1:2ff::7", 48), "ipv6:2001:db8:1::/48");
  EXPECT_EQ(ClientOfAddress("2001:db8:1:ffff::7", 60), "ipv6:2001:db8:1:fff0::/60");
  EXPECT_EQ(ClientOfAddress("2001:db8:1:2::7", 64), ClientOfAddress("2001:db8:1:2::7"));
  EXPECT_EQ(ClientOfAddress("2001:db8:1:2::7", 200), "ipv6:2001:db8:1:2::7/128");
  EXPECT_EQ(ClientOfAddress("2001:db8:1:2::7", 0), "ipv6:2001::/16");
  // (IPv4 and link-local addresses are themselves whatever the prefix.)
  EXPECT_EQ(ClientOfAddress("ipv6:[::ffff:10.1.2.3]:5000", 48), "ipv4:10.1.2.3");
  EXPECT_EQ(ClientOfAddress("fe80::1%eth0", 48), "ipv6:fe80::1");
}

// A dual-stack listener sees IPv4 clients as IPv4-mapped IPv6 addresses, and a NAT64 gateway
// passes them on in 64:ff9b::/96: each is its IPv4 address, not one /64 that every IPv4 client
// would share.
TEST(ClientOfAddressTest, AnIpv4MappedOrNat64AddressIsTheIpv4Address) {
  EXPECT_EQ(ClientOfAddress("ipv6:[::ffff:10.1.2.3]:5000"), "ipv4:10.1.2.3");
  EXPECT_EQ(ClientOfAddress("::ffff:10.1.2.4"), "ipv4:10.1.2.4");
  EXPECT_EQ(ClientOfAddress("ipv6:[64:ff9b::10.1.2.5]:5000"), "ipv4:10.1.2.5");
  EXPECT_EQ(ClientOfAddress("64:ff9b::a01:206"), "ipv4:10.1.2.6");
}

// Every host on a link has an address in fe80::/64: each is its own client (its zone dropped).
TEST(ClientOfAddressTest, ALinkLocalAddressIsItsOwnClient) {
  EXPECT_EQ(ClientOfAddress("[fe80::1%25eth0]:7"), "ipv6:fe80::1");
  EXPECT_EQ(ClientOfAddress("fe80::1%eth0"), "ipv6:fe80::1");
  EXPECT_NE(ClientOfAddress("fe80::1"), ClientOfAddress("fe80::2"));
}

TEST(ClientOfAddressTest, AnythingElseIsAsItIs) {
  EXPECT_EQ(ClientOfAddress("unix:/run/trainyard.sock"), "unix:/run/trainyard.sock");
  EXPECT_EQ(ClientOfAddress("unknown"), "unknown");
  EXPECT_EQ(ClientOfAddress(""), "");
  EXPECT_EQ(ClientOfAddress("ipv6:[::1"), "ipv6:[::1");
}

}  // namespace
}  // namespace trainyard
