// A small network of "hosts" for multi-host tests on one machine: each host a network namespace
// with one interface on a bridge in the test's own namespace (which also gets an address, so the
// test reaches every host), on a /24 of 10.0.0.0/8 chosen from the test's pid. Partitions cut a
// host's link or drop what one host sends another; Shape limits a host's rate (tc tbf; the
// machine's kernel lacks netem, so no delay or loss). Needs root (CAP_NET_ADMIN and
// CAP_SYS_ADMIN) and iproute2: Create says why not where they are missing, and tests skip.
// Everything is removed on destruction. One test thread uses it.
#ifndef TRAINYARD_TESTS_TESTING_NETNS_H_
#define TRAINYARD_TESTS_TESTING_NETNS_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainyard::testing {

class TestNetwork {
 public:
  static absl::StatusOr<std::unique_ptr<TestNetwork>> Create();
  ~TestNetwork();

  // A new host `name` (a few letters): its address.
  absl::StatusOr<std::string> AddHost(const std::string& name);
  // The address of host `name`, and of the test's own namespace on the bridge.
  std::string Address(const std::string& name) const;
  const std::string& gateway() const { return gateway_; }
  // The namespace's name (for ip netns exec, setns).
  std::string Namespace(const std::string& name) const { return prefix_ + "-" + name; }
  // `argv` run inside host `name` (ip netns exec).
  std::vector<std::string> In(const std::string& name, std::vector<std::string> argv) const;

  // Takes host `name`'s link down (nothing in or out), and up again.
  absl::Status Partition(const std::string& name);
  absl::Status Heal(const std::string& name);
  // Drops what host `from` sends to host `to` (a blackhole route in `from`), and ends that.
  absl::Status Block(const std::string& from, const std::string& to);
  absl::Status Unblock(const std::string& from, const std::string& to);
  // Limits what host `name` sends, and what it is sent, to `rate` (tc's units: "100mbit").
  absl::Status Shape(const std::string& name, const std::string& rate);

 private:
  TestNetwork(std::string prefix, std::string subnet)
      : prefix_(std::move(prefix)), subnet_(std::move(subnet)) {}

  std::string Link(const std::string& name) const;  // the host's interface on the bridge side

  const std::string prefix_;  // "ty" + pid: namespaces, bridge and links are named from it
  const std::string subnet_;  // "10.A.B."
  std::string bridge_;
  std::string gateway_;
  std::map<std::string, int> hosts_;  // name -> index (its address is subnet_ + index)
};

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_NETNS_H_
