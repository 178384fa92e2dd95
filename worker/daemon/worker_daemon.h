// WorkerDaemon: a node of the cluster. Registers its devices (CUDA GPUs or CPU slots), keeps a
// session stream to the coordinator (heartbeats, logs and rank status up; assignments and cancels
// down), reconnects with backoff when the coordinator goes away, and hands ranks to a
// RankSupervisor.
//
// Thread-safe: Run() on the main thread until Shutdown() from any thread. Messages for the
// coordinator queue in an outbox that survives reconnects (log lines beyond a cap are dropped;
// rank exits never are).
#ifndef TRAINYARD_WORKER_DAEMON_WORKER_DAEMON_H_
#define TRAINYARD_WORKER_DAEMON_WORKER_DAEMON_H_

#include <grpcpp/grpcpp.h>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/coordinator_endpoints.h"
#include "common/tls.h"
#include "trainyard/v1/node.grpc.pb.h"
#include "worker/daemon/cuda_devices.h"
#include "worker/daemon/nvml.h"
#include "worker/daemon/rank_supervisor.h"

namespace trainyard::worker {

struct WorkerOptions {
  std::string coordinator = "127.0.0.1:7070";
  std::string token;             // this node's node token (identity.proto); sent on every call
  TlsClientOptions tls;          // the coordinator's CA; a client certificate for mutual TLS
  std::string node_id;           // stable name; default: the host name
  std::string address;           // shown in `yard nodes`
  int cpu_slots = 1;             // devices offered when `gpus` is empty; each runs one rank
  std::vector<CudaDevice> gpus;  // offered instead of CPU slots when not empty, one rank each
  // Samples `gpus` at each heartbeat (metrics and `yard nodes`); null: no samples.
  std::shared_ptr<Nvml> nvml;
  SupervisorOptions supervisor;
  // The CPUs and memory ranks may use, a rank's charge when its job asks for none, and how ranks
  // are held (RegisterNodeRequest.host; HostResourcesOf).
  v1::HostResources host;
  // The longest pause between attempts to reach the coordinator (before jitter of up to 20%). With
  // the channel's own reconnect backoff (coordinator_channel.h) a worker is back within about
  // 3.4 s of a restarted coordinator, well inside the default --node-timeout of 10 s.
  absl::Duration max_backoff = absl::Seconds(2);
};

// Physical memory (sysconf), and the CPUs this process may run on (its affinity).
int64_t PhysicalMemoryBytes();
int AffinityCpus();

// What a worker offering `devices` reports of its host: `cpus` and `memory_bytes` ranks may use,
// each device's share of them as the charge of a rank that asks for nothing (or `limits`, the
// per-slot cgroup limits, where set), and `cgroups` (DescribeCgroups).
v1::HostResources HostResourcesOf(double cpus, int64_t memory_bytes, int devices,
                                  const CgroupLimits& limits, const std::string& cgroups);

class WorkerDaemon {
 public:
  explicit WorkerDaemon(WorkerOptions options);
  ~WorkerDaemon();

  enum ShutdownMode {
    kStopRanks,   // SIGTERM to every rank, SIGKILL after the grace; Run() returns once all ended
    kLeaveRanks,  // ranks keep running under their shepherds for the next worker to adopt
  };
  // Serves until Shutdown(); then stops or leaves every rank as Shutdown() asked. Ranks a worker
  // before this one left on the work directory are adopted first (their hello lists them).
  void Run();
  void Shutdown(ShutdownMode mode = kStopRanks);

  // The worker's Prometheus metrics (trainyard_worker_*), for its /metrics endpoint.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  // One registration + session; returns when the session ends.
  void RunSession();
  // Queues a message for the coordinator (from supervisor threads too).
  void Send(v1::NodeMessage message);
  // Drains the outbox and sends heartbeats into `stream` until the session ends.
  // Cuts the session when the oldest unanswered heartbeat is older than `unanswered_limit`.
  void WriterLoop(grpc::ClientReaderWriter<v1::NodeMessage, v1::CoordinatorMessage>* stream,
                  absl::Duration heartbeat_interval, absl::Duration unanswered_limit);

  // Counts a rank exit by reason and refreshes the device and rank gauges.
  void RecordRankExit(int exit_code);
  int device_count() const {
    return options_.gpus.empty() ? options_.cpu_slots : static_cast<int>(options_.gpus.size());
  }
  // (Re)makes channel_ and stub_ for endpoints_.current(); on the session thread only.
  void Connect();
  // Job `job_id`'s context archive, from the coordinator of the current channel (NodeService.
  // FetchContext); the supervisor's thread calls it (through its ContextCache).
  absl::StatusOr<std::string> FetchContext(const std::string& job_id);
  void RefreshGauges();
  // Reads each GPU through NVML into the gauges and `heartbeat` (writer thread).
  void SampleGpus(v1::Heartbeat* heartbeat);

  const WorkerOptions options_;
  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Family<prometheus::Gauge>& devices_;
  prometheus::Gauge& running_ranks_;
  prometheus::Family<prometheus::Counter>& rank_exits_;
  prometheus::Histogram& heartbeat_rtt_;
  prometheus::Gauge& connected_;
  prometheus::Family<prometheus::Gauge>& gpu_utilization_;
  prometheus::Family<prometheus::Gauge>& gpu_memory_used_;
  prometheus::Family<prometheus::Gauge>& gpu_memory_total_;
  prometheus::Family<prometheus::Gauge>& gpu_temperature_;
  prometheus::Family<prometheus::Gauge>& gpu_power_;
  prometheus::Family<prometheus::Gauge>& gpu_ecc_uncorrected_;
  prometheus::Family<prometheus::Counter>& gpu_xid_events_;
  prometheus::Family<prometheus::Gauge>& gpu_healthy_;
  // Writer thread only, one entry per GPU: a failure is logged once; a fault is kept until the
  // worker restarts (as the Kubernetes device plugin keeps a GPU unhealthy); the last XID seen.
  std::vector<bool> gpu_sample_failing_;
  std::vector<std::string> gpu_faults_;
  std::vector<int64_t> gpu_last_xid_;
  CoordinatorEndpoints endpoints_{options_.coordinator};
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::NodeService::Stub> stub_;
  std::unique_ptr<RankSupervisor> supervisor_;
  absl::Mutex channel_mu_;
  std::shared_ptr<grpc::Channel> fetch_channel_ ABSL_GUARDED_BY(channel_mu_);  // channel_'s copy

  absl::Mutex mu_;
  std::deque<v1::NodeMessage> outbox_ ABSL_GUARDED_BY(mu_);
  int64_t outbox_log_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of its log messages
  bool session_open_ ABSL_GUARDED_BY(mu_) = false;
  // The writer cut the session because its heartbeats went unanswered.
  bool unanswered_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  ShutdownMode shutdown_mode_ ABSL_GUARDED_BY(mu_) = kStopRanks;
  grpc::ClientContext* session_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::map<int64_t, absl::Time> heartbeats_in_flight_ ABSL_GUARDED_BY(mu_);  // seq → sent
};

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_WORKER_DAEMON_H_
