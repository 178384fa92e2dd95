#include "server/coordinator/device_ledger.h"

#include <limits>

namespace trainyard::coordinator {

bool DeviceLedger::Hold(const std::string& node_id, int device) {
  return held_[node_id].insert(device).second;
}

void DeviceLedger::Free(const std::string& node_id, int device) {
  auto held = held_.find(node_id);
  if (held == held_.end()) return;
  held->second.erase(device);
  if (held->second.empty()) held_.erase(held);
}

int DeviceLedger::HeldCount(const std::string& node_id) const {
  auto held = held_.find(node_id);
  return held == held_.end() ? 0 : static_cast<int>(held->second.size());
}

std::vector<int> DeviceLedger::HeldOn(const std::string& node_id) const {
  auto held = held_.find(node_id);
  if (held == held_.end()) return {};
  return std::vector<int>(held->second.begin(), held->second.end());
}

void DeviceLedger::Drain(const RankKey& rank, const std::string& node_id, int device,
                         absl::Time deadline) {
  draining_[rank] = DrainingRank{node_id, device, deadline};
}

bool DeviceLedger::IsDraining(const RankKey& rank) const { return draining_.count(rank) > 0; }

bool DeviceLedger::DrainsOn(const RankKey& rank, const std::string& node_id) const {
  auto it = draining_.find(rank);
  return it != draining_.end() && it->second.node_id == node_id;
}

void DeviceLedger::FreeUnlessDraining(const std::string& node_id, int device) {
  for (const auto& [key, d] : draining_) {
    if (d.node_id == node_id && d.device == device) return;  // a rank sharing it still stops
  }
  Free(node_id, device);
}

bool DeviceLedger::EndDraining(const RankKey& rank, const std::string& node_id) {
  auto it = draining_.find(rank);
  if (it == draining_.end() || it->second.node_id != node_id) return false;
  const DrainingRank d = it->second;
  draining_.erase(it);
  FreeUnlessDraining(d.node_id, d.device);
  return true;
}

bool DeviceLedger::AnyDraining(const std::string& job_id) const {
  auto it = draining_.lower_bound(
      {job_id, std::numeric_limits<int>::min(), std::numeric_limits<int>::min()});
  return it != draining_.end() && std::get<0>(it->first) == job_id;
}

std::set<std::string> DeviceLedger::DrainingJobs(absl::Time now) const {
  std::set<std::string> jobs;
  for (const auto& [rank, draining] : Draining(now)) jobs.insert(std::get<0>(rank));
  return jobs;
}

std::vector<std::pair<DeviceLedger::RankKey, DeviceLedger::DrainingRank>> DeviceLedger::Draining(
    absl::Time now) const {
  std::vector<std::pair<RankKey, DrainingRank>> out;
  for (const auto& [rank, draining] : draining_) {
    if (draining.deadline > now) out.emplace_back(rank, draining);
  }
  return out;
}

bool DeviceLedger::SettleNode(const std::string& node_id, const std::set<RankKey>& alive,
                              const std::function<absl::Time(const RankKey& rank)>& deadline_of) {
  bool freed = false;
  std::vector<DrainingRank> gone;
  for (auto it = draining_.begin(); it != draining_.end();) {
    if (it->second.node_id != node_id) {
      ++it;
    } else if (alive.count(it->first) > 0) {
      it->second.deadline = deadline_of(it->first);
      ++it;
    } else {
      gone.push_back(it->second);
      it = draining_.erase(it);
      freed = true;
    }
  }
  for (const DrainingRank& d : gone) FreeUnlessDraining(d.node_id, d.device);
  return freed;
}

std::vector<std::pair<DeviceLedger::RankKey, DeviceLedger::DrainingRank>> DeviceLedger::Expire(
    absl::Time now, const std::function<bool(const std::string& node_id)>& reachable,
    const std::function<bool(const RankKey& rank)>& held) {
  std::vector<std::pair<RankKey, DrainingRank>> expired;
  for (auto it = draining_.begin(); it != draining_.end();) {
    if (it->second.deadline > now || !reachable(it->second.node_id) || (held && held(it->first))) {
      ++it;
      continue;
    }
    expired.emplace_back(*it);
    it = draining_.erase(it);
  }
  for (const auto& [key, d] : expired) FreeUnlessDraining(d.node_id, d.device);
  return expired;
}

int DeviceLedger::ReservePort(const std::string& node_id) {
  std::set<int>& used = ports_[node_id];
  for (int port = kFirstMasterPort; port < kFirstMasterPort + kMasterPorts; ++port) {
    if (used.insert(port).second) return port;
  }
  return 0;
}

void DeviceLedger::HoldPort(const std::string& node_id, int port) { ports_[node_id].insert(port); }

void DeviceLedger::ReleasePort(const std::string& node_id, int port) {
  auto ports = ports_.find(node_id);
  if (ports == ports_.end()) return;
  ports->second.erase(port);
  if (ports->second.empty()) ports_.erase(ports);
}

}  // namespace trainyard::coordinator
