#include "server/coordinator/node_registry.h"

#include <algorithm>

#include <cmath>
#include <limits>
#include <set>

#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/host_port.h"
#include "common/log_text.h"
#include "common/status_macros.h"

namespace trainyard::coordinator {
namespace {

int64_t ToUnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

absl::Status FieldError(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

}  // namespace

absl::Status ValidateRegisterNodeRequest(const v1::RegisterNodeRequest& r) {
  if (r.node_id().empty()) return FieldError("node_id", "required");
  if (r.node_id().size() > 128) return FieldError("node_id", "at most 128 characters");
  for (char c : r.node_id()) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return FieldError("node_id", absl::StrCat("only letters, digits, '-', '_' and '.' are "
                                                "allowed, got '",
                                                r.node_id(), "'"));
    }
  }
  if (!v1::NodeRole_IsValid(r.role())) {
    return FieldError("role", absl::StrCat("unknown node role ", r.role()));
  }
  if (r.role() == v1::PARAMETER_SERVER) {
    if (!r.devices().empty()) return FieldError("devices", "a parameter server offers no devices");
    if (r.memory_bytes() <= 0) {
      return FieldError("memory_bytes", "a parameter server must offer memory for shards");
    }
    if (r.address().empty()) {
      return FieldError("address", "a parameter server must say where trainers reach it");
    }
    return absl::OkStatus();
  }
  for (int i = 0; i < r.owners_size(); ++i) {
    if (r.owners(i).empty() || r.owners(i).size() > 64) {
      return FieldError(absl::StrCat("owners[", i, "]"), "empty or longer than 64 characters");
    }
  }
  if (r.devices().empty()) return FieldError("devices", "at least one device is required");
  if (r.devices_size() > 1024) return FieldError("devices", "at most 1024 devices");
  std::set<int> indices;
  for (int i = 0; i < r.devices_size(); ++i) {
    const auto& d = r.devices(i);
    const std::string field = absl::StrCat("devices[", i, "]");
    if (d.index() < 0) return FieldError(field + ".index", "must be >= 0");
    if (!indices.insert(d.index()).second) {
      return FieldError(field + ".index", absl::StrCat("duplicate device index ", d.index()));
    }
    if (!v1::DeviceKind_IsValid(d.kind()) || d.kind() == v1::DEVICE_KIND_UNSPECIFIED) {
      return FieldError(field + ".kind", absl::StrCat("unknown device kind ", d.kind()));
    }
    if (d.memory_bytes() < 0) return FieldError(field + ".memory_bytes", "must be >= 0");
  }
  if (r.memory_bytes() < 0) return FieldError("memory_bytes", "must be >= 0");
  const v1::HostResources& h = r.host();
  auto bad_cpus = [](double cpus) { return !std::isfinite(cpus) || cpus < 0 || cpus > 1e6; };
  if (bad_cpus(h.cpus())) return FieldError("host.cpus", "must be in [0, 1e6]");
  if (bad_cpus(h.cpus_per_device()))
    return FieldError("host.cpus_per_device", "must be in [0, 1e6]");
  if (h.memory_bytes() < 0) return FieldError("host.memory_bytes", "must be >= 0");
  if (h.memory_per_device() < 0) return FieldError("host.memory_per_device", "must be >= 0");
  if (h.cgroups().size() > 256) return FieldError("host.cgroups", "at most 256 bytes");
  if (h.stop_grace_ms() < 0 || h.stop_grace_ms() > 24 * 3600 * 1000) {
    return FieldError("host.stop_grace_ms", "must be in [0, 86400000] (a day)");
  }
  if (h.max_stop_grace_ms() < 0 || h.max_stop_grace_ms() > 24 * 3600 * 1000) {
    return FieldError("host.max_stop_grace_ms", "must be in [0, 86400000] (a day)");
  }
  return absl::OkStatus();
}

NodeRegistry::NodeRegistry(JobStore& store, const Clock& clock, absl::Duration node_timeout)
    : store_(store), clock_(clock), node_timeout_(node_timeout) {}

absl::Status NodeRegistry::Load(const std::vector<StoredNode>& stored) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  for (const StoredNode& s : stored) {
    Entry entry;
    if (!entry.node.ParseFromString(s.payload)) {
      return absl::DataLossError(absl::StrCat("node ", s.id, ": unreadable record"));
    }
    entry.last_heartbeat = now;
    if (auto old = nodes_.find(s.id); old != nodes_.end()) Unindex(old->second);
    Entry& e = nodes_[s.id] = std::move(entry);
    Index(e);
  }
  return absl::OkStatus();
}

namespace {

// A node's smallest device (it counts for the node: any rank may land on it), and its count;
// nullopt when it does not count for admission.
bool Counts(const v1::Node& n) {
  return n.state() == v1::NODE_READY && n.role() != v1::PARAMETER_SERVER && !n.devices().empty();
}

int64_t SmallestDevice(const v1::Node& n) {
  int64_t smallest = std::numeric_limits<int64_t>::max();
  for (const auto& d : n.devices()) smallest = std::min(smallest, d.memory_bytes());
  return smallest;
}

}  // namespace

void NodeRegistry::Index(const Entry& e) {
  if (e.node.role() == v1::PARAMETER_SERVER) parameter_servers_.insert(e.node.id());
  if (!Counts(e.node)) return;
  smallest_device_bytes_.insert(SmallestDevice(e.node));
  device_counts_.insert(e.node.devices_size());
}

void NodeRegistry::Unindex(const Entry& e) {
  parameter_servers_.erase(e.node.id());
  if (!Counts(e.node)) return;
  smallest_device_bytes_.erase(smallest_device_bytes_.find(SmallestDevice(e.node)));
  device_counts_.erase(device_counts_.find(e.node.devices_size()));
}

ClusterCapacity NodeRegistry::Capacity() const {
  absl::MutexLock lock(&mu_);
  ClusterCapacity c;
  if (!smallest_device_bytes_.empty()) c.largest_device_bytes = *smallest_device_bytes_.rbegin();
  if (!device_counts_.empty()) c.max_devices_per_node = *device_counts_.rbegin();
  return c;
}

namespace {

// A second daemon with the same node id, while the first holds its session.
absl::Status AlreadyConnected(const std::string& node_id) {
  return absl::AlreadyExistsError(absl::StrCat(
      "node_id: node ", node_id,
      " already has a session open (another daemon with the same node id?); refused while it "
      "is connected"));
}

}  // namespace

void NodeRegistry::Register(const v1::RegisterNodeRequest& request,
                            std::function<void(absl::StatusOr<v1::Node>)> done) {
  if (absl::Status s = ValidateRegisterNodeRequest(request); !s.ok()) {
    done(s);
    return;
  }
  v1::Node node;
  WriteBatch batch;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = nodes_.find(request.node_id()); it != nodes_.end() &&
                                                  it->second.session != nullptr &&
                                                  it->second.node.state() != v1::NODE_LOST) {
      done(AlreadyConnected(request.node_id()));
      return;
    }
    const absl::Time now = clock_.Now();
    Entry& entry = nodes_[request.node_id()];
    Unindex(entry);
    // A LOST node's old session (a half-open connection, say) gives way to the one to come.
    if (entry.node.state() == v1::NODE_LOST) entry.session.reset();
    node.set_id(request.node_id());
    node.set_hostname(request.hostname());
    node.set_address(request.address());
    *node.mutable_devices() = request.devices();
    node.set_memory_bytes(request.memory_bytes());
    *node.mutable_labels() = request.labels();
    node.set_role(request.role() == v1::PARAMETER_SERVER ? v1::PARAMETER_SERVER : v1::WORKER);
    *node.mutable_owners() = request.owners();
    *node.mutable_host() = request.host();
    node.set_state(v1::NODE_READY);
    node.set_registered_time_ms(ToUnixMs(now));
    node.set_last_heartbeat_ms(ToUnixMs(now));
    // An admin's cordon outlives the worker's restarts.
    node.set_cordoned(entry.node.cordoned());
    node.set_draining(entry.node.draining());
    node.set_cordon_reason(entry.node.cordon_reason());
    node.set_cordoned_by(entry.node.cordoned_by());
    node.set_cordoned_time_ms(entry.node.cordoned_time_ms());
    entry.node = node;
    entry.last_heartbeat = now;
    Index(entry);
    batch.put_nodes.push_back({node.id(), node.SerializeAsString()});
  }
  store_.Commit(std::move(batch), [node, done = std::move(done)](absl::Status s) {
    if (!s.ok()) {
      done(s);
    } else {
      done(node);
    }
  });
}

namespace {

// Each sample onto the GPU it names, when its figures are in range; a list longer than the node's
// devices is not a worker's and is dropped whole.
constexpr size_t kMaxFaultBytes = 256;  // DeviceSample.fault

void KeepSamples(v1::Node& node,
                 const google::protobuf::RepeatedPtrField<v1::DeviceSample>& samples,
                 int64_t now_ms, std::vector<std::string>* new_faults) {
  auto* devices = node.mutable_devices();
  if (samples.size() > devices->size()) return;
  for (const v1::DeviceSample& s : samples) {
    if (s.index() < 0 || s.index() >= devices->size()) continue;
    v1::Device& d = (*devices)[s.index()];
    const bool sane = d.kind() == v1::CUDA_GPU && std::isfinite(s.utilization()) &&
                      s.utilization() >= 0 && s.utilization() <= 1 &&
                      std::isfinite(s.temperature_celsius()) && std::isfinite(s.power_watts()) &&
                      s.memory_used_bytes() >= 0 && s.memory_total_bytes() >= 0 &&
                      s.memory_used_bytes() <= s.memory_total_bytes() &&
                      s.ecc_uncorrected_errors() >= -1 && s.last_xid() >= 0 &&
                      s.fault().size() <= kMaxFaultBytes &&
                      std::all_of(s.fault().begin(), s.fault().end(),
                                  [](char c) { return c >= 0x20 && c <= 0x7e; });
    if (!sane) continue;
    if (!s.fault().empty() && (!d.has_sample() || d.sample().fault() != s.fault())) {
      new_faults->push_back(absl::StrCat("GPU ", s.index(), " (", d.name(), "): ", s.fault()));
    }
    *d.mutable_sample() = s;
    d.mutable_sample()->set_time_ms(now_ms);
  }
}

}  // namespace

absl::StatusOr<bool> NodeRegistry::Heartbeat(
    const std::string& node_id, const google::protobuf::RepeatedPtrField<v1::DeviceSample>& samples,
    std::vector<std::string>* new_faults) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return absl::NotFoundError(absl::StrCat("node ", node_id, " not found"));
  it->second.last_heartbeat = clock_.Now();
  std::vector<std::string> faults;
  KeepSamples(it->second.node, samples, ToUnixMs(it->second.last_heartbeat), &faults);
  if (!faults.empty()) {
    v1::Node& n = it->second.node;
    if (!n.cordoned()) {  // no new ranks on a GPU that has failed
      n.set_cordoned(true);
      n.set_cordoned_time_ms(ToUnixMs(clock_.Now()));
      n.set_cordon_reason(absl::StrJoin(faults, "; "));
      n.set_cordoned_by("trainyard");
      WriteBatch batch;
      batch.put_nodes.push_back({n.id(), n.SerializeAsString()});
      store_.Commit(std::move(batch), [id = n.id()](absl::Status s) {
        if (!s.ok()) spdlog::error("node {}: its cordon was not saved: {}", id, s.ToString());
      });
    }
    if (new_faults != nullptr) new_faults->insert(new_faults->end(), faults.begin(), faults.end());
  }
  // LOST is a state a node leaves: heartbeats that were late (a stalled network, a coordinator
  // too busy to read them) do not keep a live node out of the cluster for good.
  if (it->second.node.state() == v1::NODE_LOST && it->second.session != nullptr) {
    it->second.node.set_state(v1::NODE_READY);
    Index(it->second);
    return true;
  }
  return false;
}

std::vector<std::string> NodeRegistry::CheckTimeouts() {
  std::vector<std::string> lost;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_.Now();
    for (auto& [id, entry] : nodes_) {
      if (entry.node.state() == v1::NODE_READY && now - entry.last_heartbeat > node_timeout_) {
        Unindex(entry);
        entry.node.set_state(v1::NODE_LOST);
        Index(entry);
        lost.push_back(id);
      }
    }
  }
  if (!lost.empty() && lost_listener_) lost_listener_(lost);
  return lost;
}

absl::Status NodeRegistry::AttachSession(const std::string& node_id,
                                         std::shared_ptr<NodeSessionSink> sink) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) {
    return absl::NotFoundError(absl::StrCat("node ", node_id, " is not registered"));
  }
  // A LOST node's session may be a half-open connection that never closes: a new one replaces it.
  if (it->second.session != nullptr && it->second.node.state() != v1::NODE_LOST) {
    return AlreadyConnected(node_id);
  }
  it->second.session = std::move(sink);
  it->second.last_heartbeat = clock_.Now();
  Unindex(it->second);
  it->second.node.set_state(v1::NODE_READY);
  Index(it->second);
  return absl::OkStatus();
}

void NodeRegistry::CloseSessions(const std::vector<std::string>& node_ids,
                                 const absl::Status& why) {
  std::vector<std::shared_ptr<NodeSessionSink>> sinks;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : node_ids) {
      auto it = nodes_.find(id);
      if (it == nodes_.end() || it->second.session == nullptr) continue;
      sinks.push_back(std::move(it->second.session));
      it->second.session.reset();
    }
  }
  for (const auto& sink : sinks) sink->Close(why);
}

void NodeRegistry::DetachSession(const std::string& node_id, const NodeSessionSink* sink) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it != nodes_.end() && it->second.session.get() == sink) it->second.session.reset();
}

bool NodeRegistry::Send(const std::string& node_id, const v1::CoordinatorMessage& message) {
  std::shared_ptr<NodeSessionSink> sink;
  {
    absl::MutexLock lock(&mu_);
    auto it = nodes_.find(node_id);
    if (it == nodes_.end() || it->second.session == nullptr) return false;
    sink = it->second.session;
  }
  sink->Send(message);
  return true;
}

std::vector<SchedulingNode> NodeRegistry::SchedulingView() const {
  absl::MutexLock lock(&mu_);
  std::vector<SchedulingNode> out;
  out.reserve(nodes_.size());
  for (const auto& [id, entry] : nodes_) {
    SchedulingNode& n = out.emplace_back();
    n.id = id;
    n.state = entry.node.state();
    n.connected = entry.session != nullptr;
    n.device_indices.reserve(entry.node.devices_size());
    for (const v1::Device& d : entry.node.devices()) n.device_indices.push_back(d.index());
    n.owners.assign(entry.node.owners().begin(), entry.node.owners().end());
    n.cordoned = entry.node.cordoned();
    n.host = entry.node.host();
  }
  return out;
}

void NodeRegistry::SetCordon(const std::string& node_id, v1::CordonAction action,
                             const std::string& reason, const std::string& by,
                             std::function<void(absl::StatusOr<v1::Node>)> done) {
  v1::Node node;
  WriteBatch batch;
  {
    absl::MutexLock lock(&mu_);
    auto it = nodes_.find(node_id);
    if (it == nodes_.end()) {
      done(absl::NotFoundError(absl::StrCat("node_id: no node ", Quoted(node_id))));
      return;
    }
    v1::Node& n = it->second.node;
    if (action == v1::UNCORDON) {
      n.clear_cordoned();
      n.clear_draining();
      n.clear_cordon_reason();
      n.clear_cordoned_by();
      n.clear_cordoned_time_ms();
    } else {
      if (!n.cordoned()) n.set_cordoned_time_ms(ToUnixMs(clock_.Now()));
      n.set_cordoned(true);
      n.set_draining(n.draining() || action == v1::DRAIN);
      n.set_cordon_reason(reason);
      n.set_cordoned_by(by);
    }
    node = n;
    batch.put_nodes.push_back({node.id(), node.SerializeAsString()});
  }
  store_.Commit(std::move(batch), [node, done = std::move(done)](absl::Status s) {
    if (!s.ok()) {
      done(s);
    } else {
      done(node);
    }
  });
}

std::vector<v1::Node> NodeRegistry::ListParameterServers() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Node> out;
  out.reserve(parameter_servers_.size());
  for (const std::string& id : parameter_servers_) {
    const Entry& entry = nodes_.at(id);
    out.push_back(entry.node);
    out.back().set_last_heartbeat_ms(ToUnixMs(entry.last_heartbeat));
    out.back().set_connected(entry.session != nullptr);
  }
  return out;
}

std::vector<v1::Node> NodeRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Node> out;
  out.reserve(nodes_.size());
  for (const auto& [id, entry] : nodes_) {
    out.push_back(entry.node);
    out.back().set_last_heartbeat_ms(ToUnixMs(entry.last_heartbeat));
    out.back().set_connected(entry.session != nullptr);
  }
  return out;
}

absl::Duration NodeRegistry::StopGraceOf(const std::string& node_id,
                                         std::optional<int64_t> job_stop_grace_seconds) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return absl::ZeroDuration();
  const v1::HostResources& h = it->second.node.host();
  if (!job_stop_grace_seconds.has_value()) {
    return absl::Milliseconds(std::max(h.stop_grace_ms(), h.max_stop_grace_ms()));
  }
  // (An older worker says no maximum: it gives every job its --stop-grace.)
  if (*job_stop_grace_seconds <= 0 || h.max_stop_grace_ms() == 0) {
    return absl::Milliseconds(h.stop_grace_ms());
  }
  return std::min(absl::Seconds(*job_stop_grace_seconds),
                  absl::Milliseconds(h.max_stop_grace_ms()));
}

std::string NodeRegistry::HostOf(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return "";
  const std::string host = HostOfAddress(it->second.node.address());
  return host.empty() ? it->second.node.hostname() : host;
}

}  // namespace trainyard::coordinator
