// DeviceLedger: JobManager's owner of attempts and devices. Which devices of the nodes the jobs'
// attempts hold; the ranks of ended attempts still stopping ("draining": a rank told to stop keeps
// its device until it reports its exit, or until the drain timeout passes, so that no new rank
// shares a GPU with one still shutting down); which ranks of each running attempt have exited;
// and the ports of command jobs' rank 0 (MASTER_PORT).
//
// State with no lock of its own: JobManager holds its mutex around every call (its owners share
// the coordinator's one job loop, as Ray's GCS managers share an event loop).
#ifndef TRAINYARD_SERVER_COORDINATOR_DEVICE_LEDGER_H_
#define TRAINYARD_SERVER_COORDINATOR_DEVICE_LEDGER_H_

#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace trainyard::coordinator {

class DeviceLedger {
 public:
  using RankKey = std::tuple<std::string, int, int>;  // (job id, attempt, rank)
  struct DrainingRank {
    std::string node_id;
    int device = 0;
    absl::Time deadline;  // freed then if no exit report came
  };
  // Ports for command jobs' rank 0: from torchrun's 29500 on.
  static constexpr int kFirstMasterPort = 29500;
  static constexpr int kMasterPorts = 1000;

  // Devices. Hold is false when the device is held already.
  bool Hold(const std::string& node_id, int device);
  void Free(const std::string& node_id, int device);
  int HeldCount(const std::string& node_id) const;
  std::vector<int> HeldOn(const std::string& node_id) const;  // ascending

  // Draining ranks. Drain keeps `device` held (it must be) until EndDraining, SettleNode or
  // Expire frees it: once no draining rank is left on it (ranks may share a device:
  // resources.ranks_per_node).
  void Drain(const RankKey& rank, const std::string& node_id, int device, absl::Time deadline);
  bool IsDraining(const RankKey& rank) const;
  bool DrainsOn(const RankKey& rank, const std::string& node_id) const;
  // The rank reported its exit from `node_id`: its device is free. False when it was not draining
  // there (nothing changes).
  bool EndDraining(const RankKey& rank, const std::string& node_id);
  bool AnyDraining(const std::string& job_id) const;
  // The draining ranks that count at `now`, in key order: those within their deadline; one past
  // it (on a node that is away, which Expire leaves to the node's hello) no longer counts.
  std::vector<std::pair<RankKey, DrainingRank>> Draining(absl::Time now) const;
  // The jobs with a rank that counts at `now` (Draining's, any attempt).
  std::set<std::string> DrainingJobs(absl::Time now) const;
  // A node said hello running `alive`: its draining ranks not among them are gone (their devices
  // freed); those among them were told to stop again and get the deadline `deadline_of` gives
  // each. True when any was freed.
  bool SettleNode(const std::string& node_id, const std::set<RankKey>& alive,
                  const std::function<absl::Time(const RankKey& rank)>& deadline_of);
  // Draining ranks past their deadline on nodes that `reachable` says are there (a node cut off
  // may still run them; its hello settles them), but those `held` names (ranks not yet told to
  // stop): their devices freed, and they are returned.
  std::vector<std::pair<RankKey, DrainingRank>> Expire(
      absl::Time now, const std::function<bool(const std::string& node_id)>& reachable,
      const std::function<bool(const RankKey& rank)>& held = nullptr);

  // The ranks of a job's current attempt that have exited (all successfully, until one fails and
  // ends the attempt).
  std::set<int>& Exited(const std::string& job_id) { return exited_[job_id]; }
  void ForgetExited(const std::string& job_id) { exited_.erase(job_id); }

  // A port on `node_id` none of its running attempts holds (0 when all are taken: the node's
  // worker then picks a free one itself); HoldPort keeps a known one (a job loaded at start).
  int ReservePort(const std::string& node_id);
  void HoldPort(const std::string& node_id, int port);
  void ReleasePort(const std::string& node_id, int port);

 private:
  // Frees the device unless a draining rank still holds it.
  void FreeUnlessDraining(const std::string& node_id, int device);

  std::map<std::string, std::set<int>> held_;  // node id → devices
  std::map<RankKey, DrainingRank> draining_;
  std::map<std::string, std::set<int>> exited_;  // job id → ranks
  std::map<std::string, std::set<int>> ports_;   // node id → ports
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_DEVICE_LEDGER_H_
