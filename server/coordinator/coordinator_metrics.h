// CoordinatorMetrics: the coordinator's Prometheus metrics (names in dashboards/README.md).
// Gauges that describe state (jobs by state, nodes, devices, running jobs' training figures) are
// set by Refresh() from the managers, on the ticker; events (placements, queue waits, scheduling
// passes, RPCs, store commits) are recorded as they happen. Also the gRPC server interceptor that
// counts RPCs by method and code. Thread-safe (prometheus-cpp metrics are).
#ifndef TRAINYARD_SERVER_COORDINATOR_COORDINATOR_METRICS_H_
#define TRAINYARD_SERVER_COORDINATOR_COORDINATOR_METRICS_H_

#include <grpcpp/support/server_interceptor.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "trainyard/v1/job.pb.h"
#include "trainyard/v1/node.pb.h"
#include "trainyard/v1/trainer.pb.h"

namespace trainyard::coordinator {

class CoordinatorMetrics {
 public:
  CoordinatorMetrics();

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // State gauges: job counts by state, the nodes (with their allocated devices), and the ids of
  // running jobs (training series of every other job are removed).
  void Refresh(const std::map<v1::JobState, int>& jobs_by_state, const std::vector<v1::Node>& nodes,
               const std::vector<std::string>& running_jobs);
  // Per account: running and queued devices, quota (only while it has one), configured share and
  // decayed usage as fractions of all accounts', and decayed usage in device-seconds. Accounts no
  // longer listed lose their series.
  void RefreshAccounts(const std::vector<v1::AccountUsage>& accounts);
  void ObservePlacement(bool backfilled, double queue_wait_seconds, bool first_start);
  // A running job asked to checkpoint and stop for one of higher priority.
  void ObservePreemption();
  void ObserveSchedulingPass(double seconds);
  // How long a node's message (hello, rank status, log lines, a heartbeat's ack) waited on the
  // node-events thread before it was handled: the coordinator's own share of a heartbeat's round
  // trip.
  void ObserveNodeEventDelay(double seconds);
  // Log lines of a node's ranks dropped while its messages waiting on that thread were at their
  // cap (NodeBacklog, services.h).
  void ObserveDroppedLogLines(int64_t lines);
  void ObserveStoreCommit(double seconds);
  void ObserveRpc(const std::string& method, const std::string& code, double seconds);
  // A running job's step: its training series, and its program's own metrics by name
  // (trainyard_job_metric{job, name}; the first kMaxProgramMetrics names of a job, each at most
  // kMaxProgramMetricNameBytes, finite values only: bounded cardinality whatever a program
  // reports).
  void ObserveStep(const v1::StepReport& report);
  static constexpr size_t kMaxProgramMetrics = 64;
  static constexpr size_t kMaxProgramMetricNameBytes = 128;
  // A rank that ended: its CPU time counted to `account`, its peak RSS into the histogram.
  void ObserveRankUsage(const std::string& account, const v1::RankUsage& usage);
  // A failed authentication: "guess" (malformed, unknown, wrong secret), "stale" (expired,
  // revoked, user disabled) or "throttled" (refused unchecked: too many failures lately).
  void ObserveAuthFailure(const char* reason);

  // Creates an interceptor per RPC that calls ObserveRpc when the RPC sends its status.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

 private:
  struct JobSeries {
    prometheus::Gauge* loss;
    prometheus::Gauge* tokens_per_second;
    prometheus::Gauge* step_seconds;
    prometheus::Gauge* step;
    prometheus::Gauge* total_steps;
    prometheus::Gauge* grad_norm;
    prometheus::Gauge* resident_bytes;
    prometheus::Gauge* device_peak_bytes;
    // From the job's first evaluation (train.eval_every) on; nullptr before.
    prometheus::Gauge* eval_loss = nullptr;
    prometheus::Gauge* eval_perplexity = nullptr;
    // From the job's first step with a known MFU on; nullptr before (the CPU's jobs: never).
    prometheus::Gauge* mfu = nullptr;
    // The program's own metrics (StepReport.metrics) by name, the first kMaxProgramMetrics.
    std::map<std::string, prometheus::Gauge*> program;
  };

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Gauge>& jobs_;
  prometheus::Histogram& queue_wait_;
  prometheus::Histogram& scheduling_pass_;
  prometheus::Histogram& node_event_delay_;
  prometheus::Counter& dropped_log_lines_;
  prometheus::Family<prometheus::Counter>& placements_;
  prometheus::Counter& preemptions_;
  prometheus::Family<prometheus::Gauge>& nodes_;
  prometheus::Family<prometheus::Gauge>& account_running_;
  prometheus::Family<prometheus::Gauge>& account_queued_;
  prometheus::Family<prometheus::Gauge>& account_quota_;
  prometheus::Family<prometheus::Gauge>& account_share_;
  prometheus::Family<prometheus::Gauge>& account_usage_ratio_;
  prometheus::Family<prometheus::Gauge>& account_usage_seconds_;
  prometheus::Family<prometheus::Gauge>& devices_;
  prometheus::Family<prometheus::Counter>& rpc_requests_;
  prometheus::Family<prometheus::Counter>& auth_refusals_;
  prometheus::Family<prometheus::Counter>& auth_failures_;
  prometheus::Family<prometheus::Histogram>& rpc_duration_;
  prometheus::Histogram& store_commit_;
  prometheus::Family<prometheus::Gauge>& job_loss_;
  prometheus::Family<prometheus::Gauge>& job_tokens_per_second_;
  prometheus::Family<prometheus::Gauge>& job_mfu_;
  prometheus::Family<prometheus::Gauge>& job_step_seconds_;
  prometheus::Family<prometheus::Gauge>& job_step_;
  prometheus::Family<prometheus::Gauge>& job_total_steps_;
  prometheus::Family<prometheus::Gauge>& job_grad_norm_;
  prometheus::Family<prometheus::Gauge>& job_resident_bytes_;
  prometheus::Family<prometheus::Gauge>& job_eval_loss_;
  prometheus::Family<prometheus::Gauge>& job_eval_perplexity_;
  prometheus::Family<prometheus::Gauge>& job_device_peak_bytes_;
  prometheus::Family<prometheus::Gauge>& job_metric_;
  prometheus::Family<prometheus::Counter>& rank_cpu_seconds_;
  prometheus::Histogram& rank_peak_rss_;

  absl::Mutex mu_;
  std::map<std::string, JobSeries> job_series_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> accounts_ ABSL_GUARDED_BY(mu_);  // with series
  std::map<std::string, std::pair<prometheus::Gauge*, prometheus::Gauge*>> pool_devices_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_COORDINATOR_METRICS_H_
