#include "tests/testing/netns.h"

#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/testing/subprocess.h"

namespace trainyard::testing {
namespace {

// Runs `ip ARGS...` (or another command); its stderr as the error.
absl::Status Run(std::vector<std::string> argv) {
  if (argv[0] == "ip" || argv[0] == "tc") argv[0] = "/usr/sbin/" + argv[0];
  const CommandResult result = RunCommand(argv, {}, absl::Seconds(20));
  if (result.exit_code == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(absl::StrJoin(argv, " "), ": ", result.err, result.out));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TestNetwork>> TestNetwork::Create() {
  if (::geteuid() != 0) {
    return absl::FailedPreconditionError("network namespaces need root; this test runs as uid " +
                                         std::to_string(::geteuid()));
  }
  if (::access("/usr/sbin/ip", X_OK) != 0) {
    return absl::FailedPreconditionError("no /usr/sbin/ip (apt-get install iproute2)");
  }
  const int pid = static_cast<int>(::getpid());
  const std::string subnet = absl::StrCat("10.", 100 + (pid >> 8) % 100, ".", pid & 255, ".");
  std::unique_ptr<TestNetwork> net(new TestNetwork(absl::StrCat("ty", pid), subnet));
  net->bridge_ = absl::StrCat("tyb", pid);
  if (absl::Status made = Run({"ip", "link", "add", net->bridge_, "type", "bridge"}); !made.ok()) {
    net->bridge_.clear();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make a bridge (no CAP_NET_ADMIN here?): ", made.message()));
  }
  // What hosts need, tried once: a namespace and a pair of virtual links.
  const std::string probe = net->prefix_ + "-probe",
                    link = absl::StrCat("tyv", pid % 1000000, "-p"),
                    peer = absl::StrCat("typ", pid % 1000000, "-p");
  absl::Status can = Run({"ip", "netns", "add", probe});
  if (can.ok()) {
    can = Run({"ip", "link", "add", link, "type", "veth", "peer", "name", peer});
    Run({"ip", "link", "del", link}).IgnoreError();
    Run({"ip", "netns", "del", probe}).IgnoreError();
  }
  if (!can.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make network namespaces and virtual links here: ", can.message()));
  }
  net->gateway_ = subnet + "254";
  if (absl::Status s = Run({"ip", "addr", "add", net->gateway_ + "/24", "dev", net->bridge_});
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Run({"ip", "link", "set", net->bridge_, "up"}); !s.ok()) return s;
  return net;
}

TestNetwork::~TestNetwork() {
  for (const auto& [name, index] : hosts_) {
    Run({"ip", "netns", "del", Namespace(name)}).IgnoreError();  // its link goes with it
  }
  if (!bridge_.empty()) Run({"ip", "link", "del", bridge_}).IgnoreError();
}

std::string TestNetwork::Link(const std::string& name) const {
  auto it = hosts_.find(name);
  return absl::StrCat("tyv", ::getpid() % 1000000, "-", it != hosts_.end() ? it->second : 0);
}

absl::StatusOr<std::string> TestNetwork::AddHost(const std::string& name) {
  const int index = static_cast<int>(hosts_.size()) + 1;
  hosts_[name] = index;
  const std::string ns = Namespace(name), link = Link(name),
                    peer = absl::StrCat("typ", ::getpid() % 1000000, "-", index),
                    address = Address(name);
  for (const std::vector<std::string>& step : std::vector<std::vector<std::string>>{
           {"ip", "netns", "add", ns},
           {"ip", "link", "add", link, "type", "veth", "peer", "name", peer},
           {"ip", "link", "set", peer, "netns", ns},
           {"ip", "link", "set", link, "master", bridge_},
           {"ip", "link", "set", link, "up"},
           {"ip", "-n", ns, "link", "set", peer, "name", "eth0"},
           {"ip", "-n", ns, "addr", "add", address + "/24", "dev", "eth0"},
           {"ip", "-n", ns, "link", "set", "eth0", "up"},
           {"ip", "-n", ns, "link", "set", "lo", "up"},
       }) {
    if (absl::Status s = Run(step); !s.ok()) return s;
  }
  return address;
}

std::string TestNetwork::Address(const std::string& name) const {
  auto it = hosts_.find(name);
  return it == hosts_.end() ? std::string() : absl::StrCat(subnet_, it->second);
}

std::vector<std::string> TestNetwork::In(const std::string& name,
                                         std::vector<std::string> argv) const {
  argv.insert(argv.begin(), {"/usr/sbin/ip", "netns", "exec", Namespace(name)});
  return argv;
}

absl::Status TestNetwork::Partition(const std::string& name) {
  return Run({"ip", "link", "set", Link(name), "down"});
}

absl::Status TestNetwork::Heal(const std::string& name) {
  return Run({"ip", "link", "set", Link(name), "up"});
}

absl::Status TestNetwork::Block(const std::string& from, const std::string& to) {
  return Run({"ip", "-n", Namespace(from), "route", "add", "blackhole", Address(to) + "/32"});
}

absl::Status TestNetwork::Unblock(const std::string& from, const std::string& to) {
  return Run({"ip", "-n", Namespace(from), "route", "del", "blackhole", Address(to) + "/32"});
}

absl::Status TestNetwork::Shape(const std::string& name, const std::string& rate) {
  // Out of the host (its eth0), and into it (the bridge side's egress).
  if (absl::Status s =
          Run({"ip", "netns", "exec", Namespace(name), "/usr/sbin/tc", "qdisc", "add", "dev",
               "eth0", "root", "tbf", "rate", rate, "burst", "256kbit", "latency", "100ms"});
      !s.ok()) {
    return s;
  }
  return Run({"tc", "qdisc", "add", "dev", Link(name), "root", "tbf", "rate", rate, "burst",
              "256kbit", "latency", "100ms"});
}

}  // namespace trainyard::testing
