// NodeRegistry: the worker nodes the coordinator knows, their devices, liveness and session
// streams. Heartbeat timeouts use the injected Clock, so tests advance a FakeClock instead of
// sleeping. Knows nothing of jobs: the JobManager asks it for a view of the nodes and reacts to
// the nodes it reports lost. Owned by CoordinatorServer.
//
// Thread-safe: called from gRPC callback threads, the store's commit thread and the server's
// ticker. Lock order: JobManager::mu_ before NodeRegistry::mu_; never calls out while locked.
#ifndef TRAINYARD_SERVER_COORDINATOR_NODE_REGISTRY_H_
#define TRAINYARD_SERVER_COORDINATOR_NODE_REGISTRY_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/coordinator/job_store.h"
#include "trainyard/v1/job.pb.h"
#include "trainyard/v1/node.pb.h"

namespace trainyard::coordinator {

// Where the coordinator writes messages for one connected node (a session stream's reactor).
// Thread-safe; Send must not block.
class NodeSessionSink {
 public:
  virtual ~NodeSessionSink() = default;
  virtual void Send(const v1::CoordinatorMessage& message) = 0;
  // Ends the session with `why` once what was sent is written (the node reconnects).
  virtual void Close(const absl::Status& why) = 0;
};

// What submit-time admission needs of the whole cluster, kept up to date as nodes come and go
// (O(log nodes) per change) instead of read from a copy of every node per submit.
// What a scheduling pass needs of a node: far less to copy than the node (no names, labels or
// samples), since a pass takes every node.
struct SchedulingNode {
  std::string id;
  v1::NodeState state = v1::NODE_STATE_UNSPECIFIED;
  bool connected = false;
  std::vector<int> device_indices;
  std::vector<std::string> owners;
  bool cordoned = false;   // an admin's hold: no new ranks
  v1::HostResources host;  // CPUs and memory as its worker counts them (zeros: not counted)
};

// CPUs in thousandths (the scheduler counts whole numbers), rounded down: a node's per-device
// share (2/3 CPU) times its devices never exceeds its CPUs.
inline int64_t CpuMillis(double cpus) { return static_cast<int64_t>(cpus * 1000 + 1e-6); }
// What one rank of a job asking `r` holds on a node whose worker reports `host`: its request,
// else the node's charge per device; thousandths of a CPU, and bytes.
inline int64_t RankCpuMillis(const v1::Resources& r, const v1::HostResources& host) {
  return CpuMillis(r.cpus() > 0 ? r.cpus() : host.cpus_per_device());
}
inline int64_t RankMemoryBytes(const v1::Resources& r, const v1::HostResources& host) {
  return r.memory_bytes() > 0 ? r.memory_bytes() : host.memory_per_device();
}

struct ClusterCapacity {
  // Of the READY workers: the largest "smallest device" of a node (0: none, or sizes unknown)
  // and the most devices on one node.
  int64_t largest_device_bytes = 0;
  int max_devices_per_node = 0;
};

class NodeRegistry {
 public:
  NodeRegistry(JobStore& store, const Clock& clock, absl::Duration node_timeout);

  // Loads nodes saved by an earlier run. Their heartbeat clock starts now: a node that does not
  // come back within the node timeout is reported lost by the next CheckTimeouts.
  absl::Status Load(const std::vector<StoredNode>& nodes);

  // Validates and registers (or re-registers) a node; `done` gets the node once it is durable.
  // INVALID_ARGUMENT names the bad field; ALREADY_EXISTS while the node's session is open
  // (and the node not LOST).
  void Register(const v1::RegisterNodeRequest& request,
                std::function<void(absl::StatusOr<v1::Node>)> done);

  // Records a heartbeat now; true when it brought a LOST node whose session is open back to
  // READY (its ranks' attempts were failed and their ranks told to stop when it was lost; it
  // takes new ranks again). NOT_FOUND for an unknown node. `samples`: the node's GPUs as its
  // worker read them (nvml.h), each kept on its device (Device.sample) when its index names one of
  // the node's GPUs and its figures are in range; the others are dropped.
  // A GPU whose fault (DeviceSample.fault) appears or changes cordons the node, unless it is
  // cordoned already, as an admin would, by "trainyard" (durable in the background); each such
  // fault ("GPU I (NAME): FAULT") is added to `new_faults` when given.
  absl::StatusOr<bool> Heartbeat(
      const std::string& node_id,
      const google::protobuf::RepeatedPtrField<v1::DeviceSample>& samples = {},
      std::vector<std::string>* new_faults = nullptr);

  // Who hears of lost nodes (the job manager's AttemptTracker::OnNodesLost): called by
  // CheckTimeouts with the nodes it found lost, without this registry's lock held. Set once,
  // before serving.
  void SetLostListener(std::function<void(const std::vector<std::string>&)> listener) {
    lost_listener_ = std::move(listener);
  }
  // Marks READY nodes whose last heartbeat is older than the node timeout LOST, tells the lost
  // listener, and returns their ids.
  std::vector<std::string> CheckTimeouts();
  // Ends the open sessions of these nodes with `why` once what was queued for them (their ranks'
  // cancels) is written; their workers reconnect and say which ranks still run.
  void CloseSessions(const std::vector<std::string>& node_ids, const absl::Status& why);

  // Attaches the session stream of a registered node and counts as a heartbeat; a LOST node
  // becomes READY again. NOT_FOUND for an unknown node, ALREADY_EXISTS while another session of
  // the node is open and the node is not LOST (a second daemon never takes a live node over).
  absl::Status AttachSession(const std::string& node_id, std::shared_ptr<NodeSessionSink> sink);
  // Detaches `sink` if it is still the node's current session.
  void DetachSession(const std::string& node_id, const NodeSessionSink* sink);

  // Sends to the node's session; false if the node has none.
  bool Send(const std::string& node_id, const v1::CoordinatorMessage& message);

  // An admin's CORDON, DRAIN or UNCORDON of a node (who: `by`), durable before `done` gets the
  // node. A cordon survives re-registration and restarts; UNCORDON clears it and any drain.
  // NOT_FOUND for an unknown node. The job manager moves a draining node's jobs (DrainNode).
  void SetCordon(const std::string& node_id, v1::CordonAction action, const std::string& reason,
                 const std::string& by, std::function<void(absl::StatusOr<v1::Node>)> done);

  // All nodes, ordered by id.
  std::vector<v1::Node> List() const;
  // Every node as a scheduling pass sees it, ordered by id.
  std::vector<SchedulingNode> SchedulingView() const;
  // The parameter servers only (as List), without copying the workers.
  std::vector<v1::Node> ListParameterServers() const;
  ClusterCapacity Capacity() const;
  // Where other hosts reach the node: its registered address without the port, else its
  // hostname ("" for an unknown node).
  std::string HostOf(const std::string& node_id) const;
  // How long the node's worker gives a rank it stops before SIGKILL: the job's stop_grace_seconds
  // (when > 0) up to the worker's --max-stop-grace, else its --stop-grace; without a job (one this
  // coordinator does not know), the longest it may give any job. Zero for an unknown node or an
  // older worker.
  absl::Duration StopGraceOf(const std::string& node_id,
                             std::optional<int64_t> job_stop_grace_seconds) const;

  absl::Duration node_timeout() const { return node_timeout_; }

 private:
  std::function<void(const std::vector<std::string>&)> lost_listener_;
  struct Entry {
    v1::Node node;
    absl::Time last_heartbeat;
    std::shared_ptr<NodeSessionSink> session;
  };

  // The capacity index: an entry counts while it is a READY worker with devices. Unindex before
  // changing an entry's state, role or devices, Index after.
  void Index(const Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unindex(const Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  JobStore& store_;
  const Clock& clock_;
  const absl::Duration node_timeout_;

  mutable absl::Mutex mu_;
  std::map<std::string, Entry> nodes_ ABSL_GUARDED_BY(mu_);
  std::multiset<int64_t> smallest_device_bytes_ ABSL_GUARDED_BY(mu_);
  std::multiset<int> device_counts_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> parameter_servers_ ABSL_GUARDED_BY(mu_);
};

// Checks a registration: node_id, devices (unique non-negative indices, known kinds), memory.
absl::Status ValidateRegisterNodeRequest(const v1::RegisterNodeRequest& request);

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_NODE_REGISTRY_H_
