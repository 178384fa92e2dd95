#include "server/coordinator/coordinator_metrics.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace trainyard::coordinator {
namespace {

using prometheus::Histogram;

Histogram::BucketBoundaries LatencyBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
}

Histogram::BucketBoundaries WaitBuckets() {
  return {1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400};
}

// "/trainyard.v1.JobService/SubmitJob" → "JobService/SubmitJob". Methods outside our services
// and gRPC's own collapse into "other", so unknown method names cannot grow the label set.
std::string MethodLabel(const char* full) {
  absl::string_view m(full == nullptr ? "" : full);
  if (absl::ConsumePrefix(&m, "/trainyard.v1.")) return std::string(m);
  if (absl::StartsWith(m, "/grpc.health.") || absl::StartsWith(m, "/grpc.reflection.")) {
    return std::string(m.substr(1));
  }
  return "other";
}

class RpcInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcInterceptor(CoordinatorMetrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      metrics_->ObserveRpc(
          method_, absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
          absl::ToDoubleSeconds(absl::Now() - start_));
    }
    methods->Proceed();
  }

 private:
  CoordinatorMetrics* metrics_;
  std::string method_;
  absl::Time start_;
};

class RpcInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcInterceptorFactory(CoordinatorMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcInterceptor(metrics_, MethodLabel(info->method()));
  }

 private:
  CoordinatorMetrics* metrics_;
};

}  // namespace

CoordinatorMetrics::CoordinatorMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      jobs_(prometheus::BuildGauge()
                .Name("trainyard_jobs")
                .Help("Jobs in each state")
                .Register(*registry_)),
      queue_wait_(prometheus::BuildHistogram()
                      .Name("trainyard_job_queue_wait_seconds")
                      .Help("Time from submission to a job's first start")
                      .Register(*registry_)
                      .Add({}, WaitBuckets())),
      scheduling_pass_(prometheus::BuildHistogram()
                           .Name("trainyard_scheduling_pass_seconds")
                           .Help("Duration of one scheduling pass")
                           .Register(*registry_)
                           .Add({}, LatencyBuckets())),
      node_event_delay_(prometheus::BuildHistogram()
                            .Name("trainyard_node_event_delay_seconds")
                            .Help("Time a node's message waited on the node-events thread before "
                                  "it was handled (hellos, rank status, logs, heartbeat acks)")
                            .Register(*registry_)
                            .Add({}, LatencyBuckets())),
      dropped_log_lines_(prometheus::BuildCounter()
                             .Name("trainyard_node_log_lines_dropped_total")
                             .Help("Log lines of nodes' ranks dropped while a node's messages "
                                   "waiting on the node-events thread were at their cap (each "
                                   "rank's log says how many)")
                             .Register(*registry_)
                             .Add({})),
      placements_(prometheus::BuildCounter()
                      .Name("trainyard_placements_total")
                      .Help("Job attempts placed on nodes, by kind (normal or backfill)")
                      .Register(*registry_)),
      preemptions_(prometheus::BuildCounter()
                       .Name("trainyard_preemptions_total")
                       .Help("Running jobs asked to checkpoint and stop for a job of higher "
                             "priority, or for an account taking back devices they borrowed")
                       .Register(*registry_)
                       .Add({})),
      nodes_(prometheus::BuildGauge()
                 .Name("trainyard_nodes")
                 .Help("Worker nodes by state (ready or lost); cordoned and draining (an admin's "
                       "hold, still running ranks) count them again")
                 .Register(*registry_)),
      account_running_(prometheus::BuildGauge()
                           .Name("trainyard_account_running_devices")
                           .Help("Devices held by an account's running jobs")
                           .Register(*registry_)),
      account_queued_(prometheus::BuildGauge()
                          .Name("trainyard_account_queued_devices")
                          .Help("Devices asked for by an account's waiting jobs")
                          .Register(*registry_)),
      account_quota_(prometheus::BuildGauge()
                         .Name("trainyard_account_quota_devices")
                         .Help("Devices guaranteed to an account (only accounts with a quota)")
                         .Register(*registry_)),
      account_share_(prometheus::BuildGauge()
                         .Name("trainyard_account_share_ratio")
                         .Help("An account's fair share: its weight over all accounts' weights")
                         .Register(*registry_)),
      account_usage_ratio_(prometheus::BuildGauge()
                               .Name("trainyard_account_usage_ratio")
                               .Help("An account's decayed usage over all accounts' decayed usage")
                               .Register(*registry_)),
      account_usage_seconds_(prometheus::BuildGauge()
                                 .Name("trainyard_account_usage_device_seconds")
                                 .Help("An account's decayed usage in device-seconds (half-life: "
                                       "--fair-share-half-life)")
                                 .Register(*registry_)),
      devices_(prometheus::BuildGauge()
                   .Name("trainyard_devices")
                   .Help("Devices of ready nodes per pool, allocated and total")
                   .Register(*registry_)),
      rpc_requests_(prometheus::BuildCounter()
                        .Name("trainyard_rpc_requests_total")
                        .Help("RPCs served, by method and status code")
                        .Register(*registry_)),
      auth_refusals_(prometheus::BuildCounter()
                         .Name("trainyard_auth_refusals_total")
                         .Help("Calls refused for their credential, by method and reason "
                               "(UNAUTHENTICATED: none or invalid; PERMISSION_DENIED: not allowed)")
                         .Register(*registry_)),
      auth_failures_(prometheus::BuildCounter()
                         .Name("trainyard_auth_failures_total")
                         .Help("Failed authentications by reason: guess (malformed or unknown "
                               "credential, wrong secret), stale (expired, revoked, disabled), "
                               "throttled (refused unchecked after too many failures)")
                         .Register(*registry_)),
      rpc_duration_(prometheus::BuildHistogram()
                        .Name("trainyard_rpc_duration_seconds")
                        .Help("RPC duration by method (streams: their whole life)")
                        .Register(*registry_)),
      store_commit_(prometheus::BuildHistogram()
                        .Name("trainyard_store_commit_seconds")
                        .Help("Duration of one durable store transaction, fsync included")
                        .Register(*registry_)
                        .Add({}, LatencyBuckets())),
      job_loss_(prometheus::BuildGauge()
                    .Name("trainyard_job_loss")
                    .Help("Latest training loss of a running job")
                    .Register(*registry_)),
      job_tokens_per_second_(prometheus::BuildGauge()
                                 .Name("trainyard_job_tokens_per_second")
                                 .Help("Latest tokens/s of a running job (all ranks)")
                                 .Register(*registry_)),
      job_mfu_(prometheus::BuildGauge()
                   .Name("trainyard_job_mfu")
                   .Help("Latest model FLOPs utilisation of a running job on GPUs, 0 to 1 "
                         "(model FLOPs at its tokens/s over its GPUs' peak)")
                   .Register(*registry_)),
      job_step_seconds_(prometheus::BuildGauge()
                            .Name("trainyard_job_step_seconds")
                            .Help("Duration of a running job's latest optimizer step")
                            .Register(*registry_)),
      job_step_(prometheus::BuildGauge()
                    .Name("trainyard_job_step")
                    .Help("Optimizer steps a running job has completed")
                    .Register(*registry_)),
      job_total_steps_(prometheus::BuildGauge()
                           .Name("trainyard_job_total_steps")
                           .Help("Optimizer steps a running job will run in all")
                           .Register(*registry_)),
      job_grad_norm_(prometheus::BuildGauge()
                         .Name("trainyard_job_grad_norm")
                         .Help("Global gradient norm of a running job's latest step")
                         .Register(*registry_)),
      job_resident_bytes_(prometheus::BuildGauge()
                              .Name("trainyard_job_resident_bytes")
                              .Help("Resident memory of a running job's rank 0")
                              .Register(*registry_)),
      job_eval_loss_(prometheus::BuildGauge()
                         .Name("trainyard_job_eval_loss")
                         .Help("Held-out loss of a running job's latest evaluation "
                               "(train.eval_every)")
                         .Register(*registry_)),
      job_eval_perplexity_(prometheus::BuildGauge()
                               .Name("trainyard_job_eval_perplexity")
                               .Help("exp(eval_loss) of a running job's latest evaluation")
                               .Register(*registry_)),
      job_device_peak_bytes_(prometheus::BuildGauge()
                                 .Name("trainyard_job_device_peak_bytes")
                                 .Help("Peak GPU memory a running job's rank 0 allocated so far")
                                 .Register(*registry_)),
      job_metric_(prometheus::BuildGauge()
                      .Name("trainyard_job_metric")
                      .Help("A running job's own metric by name, as its program reports it "
                            "(report(step, accuracy=...)): the first 64 names of a job")
                      .Register(*registry_)),
      rank_cpu_seconds_(prometheus::BuildCounter()
                            .Name("trainyard_rank_cpu_seconds_total")
                            .Help("CPU time of the ranks that ended, by the account charged "
                                  "(as sacct's TotalCPU)")
                            .Register(*registry_)),
      rank_peak_rss_(prometheus::BuildHistogram()
                         .Name("trainyard_rank_peak_rss_bytes")
                         .Help("Peak resident set of each rank that ended (its largest process, "
                               "as sacct's MaxRSS)")
                         .Register(*registry_)
                         .Add({}, prometheus::Histogram::BucketBoundaries{
                                      double(int64_t{64} << 20), double(int64_t{256} << 20),
                                      double(int64_t{1} << 30), double(int64_t{4} << 30),
                                      double(int64_t{16} << 30), double(int64_t{64} << 30),
                                      double(int64_t{256} << 30)})) {
  for (int s = v1::JobState_MIN; s <= v1::JobState_MAX; ++s) {
    if (s == v1::JOB_STATE_UNSPECIFIED || !v1::JobState_IsValid(s)) continue;
    jobs_.Add({{"state", v1::JobState_Name(static_cast<v1::JobState>(s))}});
  }
  nodes_.Add({{"state", "ready"}});
  nodes_.Add({{"state", "lost"}});
  nodes_.Add({{"state", "cordoned"}});
  nodes_.Add({{"state", "draining"}});
  placements_.Add({{"kind", "normal"}});
  placements_.Add({{"kind", "backfill"}});
}

void CoordinatorMetrics::RefreshAccounts(const std::vector<v1::AccountUsage>& accounts) {
  absl::MutexLock lock(&mu_);
  std::set<std::string> listed;
  for (const v1::AccountUsage& a : accounts) {
    const prometheus::Labels labels = {{"account", a.name()}};
    listed.insert(a.name());
    account_running_.Add(labels).Set(static_cast<double>(a.running_devices()));
    account_queued_.Add(labels).Set(static_cast<double>(a.queued_devices()));
    if (a.has_quota_devices()) {
      account_quota_.Add(labels).Set(static_cast<double>(a.quota_devices()));
    } else if (accounts_.count(a.name()) != 0) {
      account_quota_.Remove(&account_quota_.Add(labels));
    }
    account_share_.Add(labels).Set(a.share_fraction());
    account_usage_ratio_.Add(labels).Set(a.usage_fraction());
    account_usage_seconds_.Add(labels).Set(a.usage_device_hours() * 3600);
  }
  for (const std::string& gone : accounts_) {
    if (listed.count(gone) != 0) continue;
    const prometheus::Labels labels = {{"account", gone}};
    for (auto* family : {&account_running_, &account_queued_, &account_quota_, &account_share_,
                         &account_usage_ratio_, &account_usage_seconds_}) {
      family->Remove(&family->Add(labels));
    }
  }
  accounts_ = std::move(listed);
}

void CoordinatorMetrics::Refresh(const std::map<v1::JobState, int>& jobs_by_state,
                                 const std::vector<v1::Node>& nodes,
                                 const std::vector<std::string>& running_jobs) {
  for (int s = v1::JobState_MIN; s <= v1::JobState_MAX; ++s) {
    if (s == v1::JOB_STATE_UNSPECIFIED || !v1::JobState_IsValid(s)) continue;
    auto it = jobs_by_state.find(static_cast<v1::JobState>(s));
    jobs_.Add({{"state", v1::JobState_Name(static_cast<v1::JobState>(s))}})
        .Set(it == jobs_by_state.end() ? 0 : it->second);
  }
  int ready = 0, lost = 0, cordoned = 0, draining = 0;
  std::map<std::string, std::pair<int, int>> pools;  // pool → (allocated, total)
  for (const v1::Node& n : nodes) {
    // An admin's hold, whatever the node's health: draining while it still runs ranks.
    if (n.cordoned()) {
      ++(n.draining() && !n.allocated_devices().empty() ? draining : cordoned);
    }
    if (n.state() != v1::NODE_READY) {
      ++lost;
      continue;
    }
    ++ready;
    auto label = n.labels().find("pool");
    auto& pool = pools[label == n.labels().end() ? "default" : label->second];
    pool.first += n.allocated_devices_size();
    pool.second += n.devices_size();
  }
  nodes_.Add({{"state", "ready"}}).Set(ready);
  nodes_.Add({{"state", "lost"}}).Set(lost);
  nodes_.Add({{"state", "cordoned"}}).Set(cordoned);
  nodes_.Add({{"state", "draining"}}).Set(draining);

  absl::MutexLock lock(&mu_);
  for (auto& [pool, gauges] : pool_devices_) {
    if (pools.count(pool) == 0) {
      gauges.first->Set(0);
      gauges.second->Set(0);
    }
  }
  for (const auto& [pool, counts] : pools) {
    auto it = pool_devices_.find(pool);
    if (it == pool_devices_.end()) {
      it =
          pool_devices_
              .emplace(pool, std::make_pair(&devices_.Add({{"pool", pool}, {"state", "allocated"}}),
                                            &devices_.Add({{"pool", pool}, {"state", "total"}})))
              .first;
    }
    it->second.first->Set(counts.first);
    it->second.second->Set(counts.second);
  }
  // Training series exist only while their job runs, so cardinality stays bounded.
  const std::set<std::string> running(running_jobs.begin(), running_jobs.end());
  for (auto it = job_series_.begin(); it != job_series_.end();) {
    if (running.count(it->first) > 0) {
      ++it;
      continue;
    }
    const JobSeries& s = it->second;
    job_loss_.Remove(s.loss);
    job_tokens_per_second_.Remove(s.tokens_per_second);
    job_step_seconds_.Remove(s.step_seconds);
    job_step_.Remove(s.step);
    job_total_steps_.Remove(s.total_steps);
    job_grad_norm_.Remove(s.grad_norm);
    job_resident_bytes_.Remove(s.resident_bytes);
    job_device_peak_bytes_.Remove(s.device_peak_bytes);
    if (s.mfu != nullptr) job_mfu_.Remove(s.mfu);
    if (s.eval_loss != nullptr) {
      job_eval_loss_.Remove(s.eval_loss);
      job_eval_perplexity_.Remove(s.eval_perplexity);
    }
    for (const auto& [name, gauge] : s.program) job_metric_.Remove(gauge);
    it = job_series_.erase(it);
  }
}

void CoordinatorMetrics::ObservePreemption() { preemptions_.Increment(); }

void CoordinatorMetrics::ObserveAuthFailure(const char* reason) {
  auth_failures_.Add({{"reason", reason}}).Increment();
}

void CoordinatorMetrics::ObservePlacement(bool backfilled, double queue_wait_seconds,
                                          bool first_start) {
  placements_.Add({{"kind", backfilled ? "backfill" : "normal"}}).Increment();
  if (first_start) queue_wait_.Observe(queue_wait_seconds);
}

void CoordinatorMetrics::ObserveSchedulingPass(double seconds) {
  scheduling_pass_.Observe(seconds);
}

void CoordinatorMetrics::ObserveNodeEventDelay(double seconds) {
  node_event_delay_.Observe(seconds);
}

void CoordinatorMetrics::ObserveDroppedLogLines(int64_t lines) {
  dropped_log_lines_.Increment(static_cast<double>(lines));
}

void CoordinatorMetrics::ObserveStoreCommit(double seconds) { store_commit_.Observe(seconds); }

void CoordinatorMetrics::ObserveRpc(const std::string& method, const std::string& code,
                                    double seconds) {
  rpc_requests_.Add({{"method", method}, {"code", code}}).Increment();
  rpc_duration_.Add({{"method", method}}, LatencyBuckets()).Observe(seconds);
  if (code == "UNAUTHENTICATED" || code == "PERMISSION_DENIED") {
    auth_refusals_.Add({{"method", method}, {"reason", code}}).Increment();
  }
}

void CoordinatorMetrics::ObserveStep(const v1::StepReport& r) {
  absl::MutexLock lock(&mu_);
  auto it = job_series_.find(r.job_id());
  if (it == job_series_.end()) {
    const prometheus::Labels labels = {{"job", r.job_id()}};
    it = job_series_
             .emplace(
                 r.job_id(),
                 JobSeries{&job_loss_.Add(labels), &job_tokens_per_second_.Add(labels),
                           &job_step_seconds_.Add(labels), &job_step_.Add(labels),
                           &job_total_steps_.Add(labels), &job_grad_norm_.Add(labels),
                           &job_resident_bytes_.Add(labels), &job_device_peak_bytes_.Add(labels)})
             .first;
  }
  JobSeries& s = it->second;
  if (r.has_eval_loss() && std::isfinite(r.eval_loss())) {
    if (s.eval_loss == nullptr) {
      const prometheus::Labels labels = {{"job", r.job_id()}};
      s.eval_loss = &job_eval_loss_.Add(labels);
      s.eval_perplexity = &job_eval_perplexity_.Add(labels);
    }
    s.eval_loss->Set(r.eval_loss());
    s.eval_perplexity->Set(std::exp(r.eval_loss()));
  }
  if (r.mfu() > 0 && std::isfinite(r.mfu())) {
    if (s.mfu == nullptr) s.mfu = &job_mfu_.Add({{"job", r.job_id()}});
    s.mfu->Set(r.mfu());
  } else if (s.mfu != nullptr) {  // (an attempt on a device without a known peak)
    job_mfu_.Remove(s.mfu);
    s.mfu = nullptr;
  }
  s.loss->Set(r.loss());
  s.tokens_per_second->Set(r.tokens_per_second());
  s.step_seconds->Set(r.step_seconds());
  s.step->Set(static_cast<double>(r.step()));
  s.total_steps->Set(static_cast<double>(r.total_steps()));
  s.grad_norm->Set(r.grad_norm());
  s.resident_bytes->Set(static_cast<double>(r.resident_bytes()));
  s.device_peak_bytes->Set(static_cast<double>(r.device_peak_bytes()));
  for (const auto& [name, value] : r.metrics()) {
    if (!std::isfinite(value) || name.empty() || name.size() > kMaxProgramMetricNameBytes) continue;
    auto gauge = s.program.find(name);
    if (gauge == s.program.end()) {
      if (s.program.size() >= kMaxProgramMetrics) continue;
      gauge =
          s.program.emplace(name, &job_metric_.Add({{"job", r.job_id()}, {"name", name}})).first;
    }
    gauge->second->Set(value);
  }
}

void CoordinatorMetrics::ObserveRankUsage(const std::string& account, const v1::RankUsage& usage) {
  if (usage.cpu_seconds() > 0 && std::isfinite(usage.cpu_seconds())) {
    rank_cpu_seconds_.Add({{"account", account.empty() ? "-" : account}})
        .Increment(usage.cpu_seconds());
  }
  if (usage.peak_rss_bytes() > 0)
    rank_peak_rss_.Observe(static_cast<double>(usage.peak_rss_bytes()));
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
CoordinatorMetrics::InterceptorFactory() {
  return std::make_unique<RpcInterceptorFactory>(this);
}

}  // namespace trainyard::coordinator
