#include "worker/daemon/worker_daemon.h"

#include <sched.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/context_archive.h"
#include "common/coordinator_channel.h"
#include "common/credentials.h"
#include "common/placement.h"
#include "common/signal_names.h"

namespace trainyard::worker {
namespace {

// What the outbox holds of log messages while the coordinator is away (bytes: one message may be
// a megabyte or two of a rank's output); beyond it new lines are dropped.
constexpr int64_t kMaxQueuedLogBytes = int64_t{64} << 20;

int64_t LogBytes(const v1::NodeMessage& m) {
  return m.has_logs() ? static_cast<int64_t>(m.ByteSizeLong()) : 0;
}

// XIDs that an application causes (NVIDIA's Kubernetes device plugin skips the same ones): the
// GPU itself is fine. Every other critical XID marks it faulty.
bool IsApplicationXid(int64_t xid) {
  for (int64_t app : {13, 31, 43, 45, 68, 109}) {
    if (xid == app) return true;
  }
  return false;
}

std::string XidFault(int64_t xid) {
  const char* what = xid == 48    ? "double-bit ECC error"
                     : xid == 63  ? "ECC page retirement or row remapping"
                     : xid == 64  ? "ECC page retirement or row remapping failed"
                     : xid == 74  ? "NVLink error"
                     : xid == 79  ? "the GPU has fallen off the bus"
                     : xid == 92  ? "high single-bit ECC error rate"
                     : xid == 94  ? "contained ECC error"
                     : xid == 95  ? "uncontained ECC error"
                     : xid == 119 ? "GSP RPC timeout"
                     : xid == 120 ? "GSP error"
                                  : nullptr;
  return what != nullptr ? absl::StrCat("XID ", xid, " (", what, ")") : absl::StrCat("XID ", xid);
}

}  // namespace

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t{pages} * page : 0;
}

int AffinityCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

v1::HostResources HostResourcesOf(double cpus, int64_t memory_bytes, int devices,
                                  const CgroupLimits& limits, const std::string& cgroups) {
  v1::HostResources host;
  devices = std::max(1, devices);
  host.set_cpus(cpus);
  host.set_memory_bytes(memory_bytes);
  host.set_cpus_per_device(limits.cpus > 0 ? limits.cpus : cpus / devices);
  host.set_memory_per_device(limits.memory_bytes > 0 ? limits.memory_bytes
                                                     : memory_bytes / devices);
  host.set_cgroups(cgroups.substr(0, 256));
  return host;
}

WorkerDaemon::WorkerDaemon(WorkerOptions options)
    : options_(std::move(options)),
      devices_(prometheus::BuildGauge()
                   .Name("trainyard_worker_devices")
                   .Help("Devices this worker offers (total) and runs ranks on (allocated)")
                   .Register(*registry_)),
      running_ranks_(prometheus::BuildGauge()
                         .Name("trainyard_worker_running_ranks")
                         .Help("Trainer ranks running on this worker")
                         .Register(*registry_)
                         .Add({})),
      rank_exits_(prometheus::BuildCounter()
                      .Name("trainyard_worker_rank_exits_total")
                      .Help("Rank exits by reason: success (0), failure, killed (by a signal)")
                      .Register(*registry_)),
      heartbeat_rtt_(prometheus::BuildHistogram()
                         .Name("trainyard_worker_heartbeat_rtt_seconds")
                         .Help("Round trip of a heartbeat to the coordinator and its ack")
                         .Register(*registry_)
                         .Add({}, prometheus::Histogram::BucketBoundaries{0.0005, 0.001, 0.0025,
                                                                          0.005, 0.01, 0.025, 0.05,
                                                                          0.1, 0.25, 0.5, 1, 2.5})),
      connected_(prometheus::BuildGauge()
                     .Name("trainyard_worker_connected")
                     .Help("1 while the session with the coordinator is open")
                     .Register(*registry_)
                     .Add({})),
      gpu_utilization_(prometheus::BuildGauge()
                           .Name("trainyard_worker_gpu_utilization_ratio")
                           .Help("Share of the last sample period a kernel ran on the GPU (NVML)")
                           .Register(*registry_)),
      gpu_memory_used_(prometheus::BuildGauge()
                           .Name("trainyard_worker_gpu_memory_used_bytes")
                           .Help("GPU memory in use, every process's (NVML)")
                           .Register(*registry_)),
      gpu_memory_total_(prometheus::BuildGauge()
                            .Name("trainyard_worker_gpu_memory_total_bytes")
                            .Help("GPU memory in all (NVML)")
                            .Register(*registry_)),
      gpu_temperature_(prometheus::BuildGauge()
                           .Name("trainyard_worker_gpu_temperature_celsius")
                           .Help("GPU core temperature (NVML)")
                           .Register(*registry_)),
      gpu_power_(prometheus::BuildGauge()
                     .Name("trainyard_worker_gpu_power_watts")
                     .Help("GPU board power draw (NVML; absent where the board does not say)")
                     .Register(*registry_)),
      gpu_ecc_uncorrected_(prometheus::BuildGauge()
                               .Name("trainyard_worker_gpu_ecc_uncorrected_errors")
                               .Help("Uncorrected ECC errors since the driver loaded (NVML, "
                                     "volatile; absent where the GPU does not say)")
                               .Register(*registry_)),
      gpu_xid_events_(prometheus::BuildCounter()
                          .Name("trainyard_worker_gpu_xid_events_total")
                          .Help("Critical XID events by GPU and XID (NVML)")
                          .Register(*registry_)),
      gpu_healthy_(prometheus::BuildGauge()
                       .Name("trainyard_worker_gpu_healthy")
                       .Help("0 once a GPU reported a fault (a critical XID, uncorrected ECC "
                             "errors, a failed row remapping, lost), until the worker restarts")
                       .Register(*registry_)),
      gpu_sample_failing_(options_.gpus.size(), false),
      gpu_faults_(options_.gpus.size()),
      gpu_last_xid_(options_.gpus.size(), 0) {
  for (const char* reason : {"success", "failure", "killed"}) {
    rank_exits_.Add({{"reason", reason}});
  }
  devices_.Add({{"state", "total"}}).Set(device_count());
  if (options_.nvml != nullptr) {
    std::vector<std::string> uuids;
    for (const CudaDevice& gpu : options_.gpus) uuids.push_back(gpu.uuid);
    if (absl::Status s = options_.nvml->WatchXids(uuids); !s.ok()) {
      spdlog::warn("GPU health: {}", std::string(s.message()));
    }
    for (size_t i = 0; i < options_.gpus.size(); ++i) {
      gpu_healthy_.Add({{"gpu", std::to_string(i)}, {"uuid", options_.gpus[i].uuid}}).Set(1);
    }
  }
  devices_.Add({{"state", "allocated"}}).Set(0);
  Connect();
  // Jobs' contexts, fetched from the coordinator, cached beside the attempts' folders.
  SupervisorOptions supervisor = options_.supervisor;
  if (supervisor.contexts == nullptr) {
    supervisor.contexts = std::make_shared<ContextCache>(
        supervisor.work_dir + "/.contexts",
        [this](const std::string& job_id) { return FetchContext(job_id); });
  }
  supervisor_ = std::make_unique<RankSupervisor>(std::move(supervisor),
                                                 [this](v1::NodeMessage m) { Send(std::move(m)); });
}

WorkerDaemon::~WorkerDaemon() {
  Shutdown();
  // Its threads (a context being fetched) use this object's channel: they end first.
  supervisor_.reset();
}

void WorkerDaemon::Connect() {
  grpc::ChannelArguments args = CoordinatorChannelArguments();
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  // Its own subchannels, not the process-wide pool's: a new channel starts afresh (RunSession).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // main() checked the TLS files: a failure here fails closed (every call fails, none in clear).
  auto credentials = MakeChannelCredentials(options_.tls);
  channel_ = grpc::CreateCustomChannel(
      endpoints_.current(),
      credentials.ok() ? *credentials : grpc::SslCredentials(grpc::SslCredentialsOptions()), args);
  stub_ = v1::NodeService::NewStub(channel_);
  absl::MutexLock lock(&channel_mu_);
  fetch_channel_ = channel_;
}

absl::StatusOr<std::string> WorkerDaemon::FetchContext(const std::string& job_id) {
  std::shared_ptr<grpc::Channel> channel;
  {
    absl::MutexLock lock(&channel_mu_);
    channel = fetch_channel_;
  }
  auto stub = v1::NodeService::NewStub(channel);
  grpc::ClientContext ctx;
  if (!options_.token.empty()) ctx.AddMetadata(kAuthorizationMetadata, "Bearer " + options_.token);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  v1::FetchContextRequest request;
  request.set_node_id(options_.node_id);
  request.set_job_id(job_id);
  auto reader = stub->FetchContext(&ctx, request);
  std::string archive;
  int64_t size = -1;
  v1::ContextChunk chunk;
  bool too_large = false;
  while (reader->Read(&chunk)) {
    if (size < 0) size = chunk.size_bytes();
    if (size > kMaxContextArchiveBytes ||
        static_cast<int64_t>(archive.size() + chunk.data().size()) > size) {
      too_large = true;
      ctx.TryCancel();
      break;
    }
    archive += chunk.data();
  }
  const grpc::Status s = reader->Finish();
  if (too_large) return absl::DataLossError("the job's context arrived larger than announced");
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("fetching the job's context: ", s.error_message()));
  }
  if (static_cast<int64_t>(archive.size()) != size) {
    return absl::DataLossError("the job's context arrived cut short");
  }
  return archive;
}

void WorkerDaemon::Shutdown(ShutdownMode mode) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  stopping_ = true;
  shutdown_mode_ = mode;
  if (mode == kLeaveRanks) {
    // No more lines are read; those read are sent before the session ends (for up to 2 s), so
    // that the next worker neither repeats nor loses them.
    mu_.Unlock();
    supervisor_->Detach();
    mu_.Lock();
    auto sent = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return outbox_.empty() || !session_open_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&sent), absl::Seconds(2));
  }
  if (session_ctx_ != nullptr) session_ctx_->TryCancel();
}

void WorkerDaemon::RecordRankExit(int exit_code) {
  const char* reason = exit_code == 0 ? "success" : exit_code >= 128 ? "killed" : "failure";
  rank_exits_.Add({{"reason", reason}}).Increment();
}

void WorkerDaemon::RefreshGauges() {
  const int running = supervisor_ ? supervisor_->running_count() : 0;
  running_ranks_.Set(running);
  devices_.Add({{"state", "allocated"}}).Set(std::min(running, device_count()));
}

void WorkerDaemon::SampleGpus(v1::Heartbeat* heartbeat) {
  if (options_.nvml == nullptr) return;
  auto fault = [this](size_t i, const std::string& why) {
    if (!gpu_faults_[i].empty()) return;  // the first one stays
    gpu_faults_[i] = why.substr(0, 256);
    spdlog::error("GPU {} ({}) is faulty: {}; the coordinator cordons this node", i,
                  options_.gpus[i].uuid, gpu_faults_[i]);
    gpu_healthy_.Add({{"gpu", std::to_string(i)}, {"uuid", options_.gpus[i].uuid}}).Set(0);
  };
  for (const XidEvent& e : options_.nvml->TakeXids()) {
    if (e.gpu < 0 || e.gpu >= static_cast<int>(options_.gpus.size())) continue;
    const size_t i = static_cast<size_t>(e.gpu);
    gpu_last_xid_[i] = e.xid;
    gpu_xid_events_
        .Add({{"gpu", std::to_string(i)},
              {"uuid", options_.gpus[i].uuid},
              {"xid", std::to_string(e.xid)}})
        .Increment();
    if (IsApplicationXid(e.xid)) {
      spdlog::warn("GPU {}: XID {} (an application's error; the GPU stays in service)", i, e.xid);
    } else {
      fault(i, XidFault(e.xid));
    }
  }
  for (size_t i = 0; i < options_.gpus.size(); ++i) {
    const CudaDevice& gpu = options_.gpus[i];
    auto sample = options_.nvml->Sample(gpu.uuid);
    if (!sample.ok() && sample.status().code() == absl::StatusCode::kFailedPrecondition) {
      fault(i, absl::StrCat("lost: ", sample.status().message()));  // fallen off the bus
    }
    if (!sample.ok()) {
      if (!gpu_sample_failing_[i])
        spdlog::warn("GPU {}: {}", i, std::string(sample.status().message()));
      gpu_sample_failing_[i] = true;
      if (!gpu_faults_[i].empty()) {  // what the coordinator must know even without a sample
        v1::DeviceSample* d = heartbeat->add_devices();
        d->set_index(static_cast<int32_t>(i));
        d->set_ecc_uncorrected_errors(-1);
        d->set_last_xid(gpu_last_xid_[i]);
        d->set_fault(gpu_faults_[i]);
      }
      continue;
    }
    if (sample->ecc_uncorrected_errors > 0) {
      fault(i, absl::StrCat(sample->ecc_uncorrected_errors,
                            " uncorrected ECC error(s) since the driver loaded"));
    }
    if (sample->row_remap_failed) fault(i, "a row remapping failed");
    if (sample->row_remap_pending) fault(i, "a row remapping waits for a GPU reset");
    if (gpu_sample_failing_[i]) spdlog::info("GPU {}: NVML answers again", i);
    gpu_sample_failing_[i] = false;
    const prometheus::Labels labels = {{"gpu", std::to_string(i)}, {"uuid", gpu.uuid}};
    gpu_utilization_.Add(labels).Set(sample->utilization);
    gpu_memory_used_.Add(labels).Set(static_cast<double>(sample->memory_used_bytes));
    gpu_memory_total_.Add(labels).Set(static_cast<double>(sample->memory_total_bytes));
    gpu_temperature_.Add(labels).Set(sample->temperature_celsius);
    if (sample->power_watts > 0) gpu_power_.Add(labels).Set(sample->power_watts);
    v1::DeviceSample* d = heartbeat->add_devices();
    d->set_index(static_cast<int32_t>(i));
    d->set_utilization(static_cast<float>(sample->utilization));
    d->set_memory_used_bytes(sample->memory_used_bytes);
    d->set_memory_total_bytes(sample->memory_total_bytes);
    d->set_temperature_celsius(static_cast<float>(sample->temperature_celsius));
    d->set_power_watts(static_cast<float>(sample->power_watts));
    d->set_ecc_uncorrected_errors(sample->ecc_uncorrected_errors);
    d->set_last_xid(gpu_last_xid_[i]);
    d->set_fault(gpu_faults_[i]);
    if (sample->ecc_uncorrected_errors >= 0) {
      gpu_ecc_uncorrected_.Add(labels).Set(static_cast<double>(sample->ecc_uncorrected_errors));
    }
  }
}

void WorkerDaemon::Send(v1::NodeMessage message) {
  if (message.has_rank_status() && message.rank_status().phase() == v1::RANK_EXITED) {
    RecordRankExit(message.rank_status().exit_code());
  }
  absl::MutexLock lock(&mu_);
  if (const int64_t bytes = LogBytes(message); bytes > 0) {
    if (outbox_log_bytes_ + bytes > kMaxQueuedLogBytes) return;  // coordinator unreachable
    outbox_log_bytes_ += bytes;
  }
  outbox_.push_back(std::move(message));
}

void WorkerDaemon::Run() {
  for (const v1::RankStatus& r : supervisor_->Adopt()) {
    if (r.phase() == v1::RANK_RUNNING) {
      spdlog::info(
          "adopted rank {} of {} attempt {} on device {}, left running by the worker "
          "before",
          r.rank(), r.job_id(), r.attempt(), r.device());
    } else {
      spdlog::warn(
          "cannot adopt rank {} of {} attempt {}: {}; its attempt ends and the job "
          "restarts from its checkpoint",
          r.rank(), r.job_id(), r.attempt(), r.message());
    }
  }
  absl::Duration backoff = absl::Milliseconds(100);
  // Each worker's pauses differ by up to 20%, so that a cluster's workers do not all come back
  // to a restarted coordinator in the same instant.
  std::mt19937_64 random(std::random_device{}());
  std::uniform_real_distribution<double> jitter(0.8, 1.2);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
    }
    const absl::Time started = absl::Now();
    RunSession();
    if (absl::Now() - started > absl::Seconds(10)) backoff = absl::Milliseconds(100);
    absl::MutexLock lock(&mu_);
    if (stopping_) break;
    // Reconnect after a pause that grows while the coordinator stays away.
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff * jitter(random));
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  ShutdownMode mode;
  {
    absl::MutexLock lock(&mu_);
    mode = shutdown_mode_;
  }
  if (mode == kLeaveRanks) return;  // Shutdown detached the ranks already
  spdlog::info("stopping {} rank(s)", supervisor_->running_count());
  supervisor_->StopAll();
}

void WorkerDaemon::RunSession() {
  v1::RegisterNodeRequest request;
  request.set_node_id(options_.node_id);
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  request.set_hostname(host);
  request.set_address(options_.address);
  request.set_memory_bytes(PhysicalMemoryBytes());
  *request.mutable_host() = options_.host;
  request.mutable_host()->set_stop_grace_ms(
      absl::ToInt64Milliseconds(options_.supervisor.stop_grace));
  request.mutable_host()->set_max_stop_grace_ms(
      absl::ToInt64Milliseconds(options_.supervisor.max_stop_grace));
  // The users whose jobs this worker can run (all, as root).
  if (options_.supervisor.run_as != nullptr) {
    for (const std::string& owner : options_.supervisor.run_as->Owners()) {
      request.add_owners(owner);
    }
  }
  for (const CudaDevice& gpu : options_.gpus) {
    v1::Device* d = request.add_devices();
    d->set_index(request.devices_size() - 1);
    d->set_kind(v1::CUDA_GPU);
    d->set_name(absl::StrCat(gpu.name, " (", gpu.uuid, ")"));
    d->set_memory_bytes(gpu.memory_bytes);
  }
  for (int i = 0; options_.gpus.empty() && i < options_.cpu_slots; ++i) {
    v1::Device* d = request.add_devices();
    d->set_index(i);
    d->set_kind(v1::CPU_SLOT);
    d->set_name(absl::StrCat("cpu-slot-", i));
    d->set_memory_bytes(PhysicalMemoryBytes() / options_.cpu_slots);
  }
  v1::RegisterNodeResponse registered;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!options_.token.empty())
      ctx.AddMetadata(kAuthorizationMetadata, "Bearer " + options_.token);
    const grpc::Status s = stub_->RegisterNode(&ctx, request, &registered);
    if (!s.ok()) {
      const std::string address = endpoints_.current();
      const std::string tls = s.error_code() == grpc::StatusCode::UNAVAILABLE
                                  ? DiagnoseTls(address, options_.tls)
                                  : std::string();
      spdlog::warn("cannot register with {}: {}", address, tls.empty() ? s.error_message() : tls);
      // A standby names the leader; a replica that is gone sends us down the list.
      if (endpoints_.Follow(s, ctx)) {
        spdlog::info("trying the coordinator at {}", endpoints_.current());
        Connect();
      } else if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
        // A channel of its own each time: gRPC 1.51's channel, once its connection attempts
        // have failed for a while, kept failing calls for seconds after the coordinator was back
        // (attempts cut off as "tcp handshaker shutdown"), long enough for the node to be
        // declared lost; a new channel connects on its first call.
        Connect();
      }
      return;
    }
  }
  const absl::Duration interval =
      absl::Milliseconds(std::max<int64_t>(50, registered.heartbeat_interval_ms()));
  // A rank whose worker has been away this long has lost its attempt: its shepherd stops it.
  if (registered.node_timeout_ms() > 0) {
    supervisor_->set_orphan_timeout(absl::Milliseconds(registered.node_timeout_ms()));
  }
  spdlog::info("registered as {} with {} {}; heartbeat every {}", options_.node_id, device_count(),
               options_.gpus.empty() ? "CPU slot(s)" : "CUDA GPU(s)",
               absl::FormatDuration(interval));

  grpc::ClientContext ctx;
  if (!options_.token.empty()) ctx.AddMetadata(kAuthorizationMetadata, "Bearer " + options_.token);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    session_ctx_ = &ctx;
  }
  auto stream = stub_->Session(&ctx);
  v1::NodeMessage hello;
  hello.mutable_hello()->set_node_id(options_.node_id);
  // Ranks still running from before a reconnect: the coordinator stops stale ones.
  for (v1::RankStatus& r : supervisor_->Running())
    *hello.mutable_hello()->add_running() = std::move(r);
  bool ok = stream->Write(hello);
  if (ok) {
    // The running ranks' recent lines go first, again: a coordinator that took over (or came
    // back) may lack what the one before it received but had not stored; it keeps each line once.
    std::vector<v1::NodeMessage> again = supervisor_->RecentLogs();
    if (!again.empty()) {
      int lines = 0;
      for (const v1::NodeMessage& m : again) lines += m.logs().lines_size();
      spdlog::info("sending the ranks' last {} log line(s) again", lines);
    }
    {
      absl::MutexLock lock(&mu_);
      session_open_ = true;
      for (auto it = again.rbegin(); it != again.rend(); ++it) {
        outbox_log_bytes_ += LogBytes(*it);
        outbox_.push_front(std::move(*it));
      }
    }
    connected_.Set(1);
    // Heartbeats unanswered this long: the coordinator has judged this node lost by now (or the
    // connection is half open); the session is cut and a new one made.
    const absl::Duration unanswered = std::max(
        2 * interval, absl::Milliseconds(
                          registered.node_timeout_ms() > 0 ? registered.node_timeout_ms() : 10000));
    std::thread writer([&] { WriterLoop(stream.get(), interval, unanswered); });
    v1::CoordinatorMessage in;
    while (stream->Read(&in)) {
      if (in.has_assignment()) {
        const auto& a = in.assignment();
        spdlog::info("assignment: {} attempt {} ranks {}..{} of {}", a.job_id(), a.attempt(),
                     a.first_rank(), a.first_rank() + RanksOf(a) - 1, a.world_size());
        supervisor_->Launch(a);
      } else if (in.has_heartbeat_ack()) {
        absl::MutexLock lock(&mu_);
        auto it = heartbeats_in_flight_.find(in.heartbeat_ack().seq());
        if (it != heartbeats_in_flight_.end()) {
          heartbeat_rtt_.Observe(absl::ToDoubleSeconds(absl::Now() - it->second));
          heartbeats_in_flight_.erase(heartbeats_in_flight_.begin(), std::next(it));
        }
      } else if (in.has_cancel()) {
        spdlog::info("stop {} attempt {}: {}", in.cancel().job_id(), in.cancel().attempt(),
                     in.cancel().reason());
        supervisor_->Stop(in.cancel().job_id(), in.cancel().attempt());
      } else if (in.has_signal()) {
        const v1::SignalRanks& s = in.signal();
        const std::optional<int> number = SignalNumber(s.signal());
        const int ranks =
            number.has_value() ? supervisor_->Signal(s.job_id(), s.attempt(), *number) : 0;
        spdlog::info("signal {} to {} attempt {}: {} ranks", s.signal(), s.job_id(), s.attempt(),
                     ranks);
      }
    }
    {
      absl::MutexLock lock(&mu_);
      session_open_ = false;
      heartbeats_in_flight_.clear();
    }
    connected_.Set(0);
    writer.join();
  }
  const grpc::Status s = stream->Finish();
  {
    absl::MutexLock lock(&mu_);
    session_ctx_ = nullptr;
  }
  spdlog::warn("session with {} ended: {}", endpoints_.current(),
               s.ok() ? std::string("closed") : s.error_message());
  bool unanswered = false;
  {
    absl::MutexLock lock(&mu_);
    std::swap(unanswered, unanswered_);
  }
  // A coordinator that stopped answering (paused, cut off) is like one that is gone: with several
  // replicas, the next session goes down the list.
  if (unanswered ? endpoints_.Follow(std::string()) : endpoints_.Follow(s, ctx)) Connect();
}

void WorkerDaemon::WriterLoop(
    grpc::ClientReaderWriter<v1::NodeMessage, v1::CoordinatorMessage>* stream,
    absl::Duration heartbeat_interval, absl::Duration unanswered_limit) {
  int64_t seq = 0;
  absl::Time next_heartbeat = absl::Now();
  absl::MutexLock lock(&mu_);
  while (session_open_) {
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !outbox_.empty() || !session_open_;
    };
    mu_.AwaitWithDeadline(absl::Condition(&ready), next_heartbeat);
    if (!session_open_) break;
    v1::NodeMessage m;
    if (absl::Now() >= next_heartbeat && !heartbeats_in_flight_.empty() &&
        absl::Now() - heartbeats_in_flight_.begin()->second > unanswered_limit) {
      spdlog::warn("no heartbeat answered for {}: reconnecting",
                   absl::FormatDuration(absl::Now() - heartbeats_in_flight_.begin()->second));
      if (session_ctx_ != nullptr) session_ctx_->TryCancel();
      unanswered_ = true;
      break;
    }
    if (absl::Now() >= next_heartbeat) {
      m.mutable_heartbeat()->set_seq(++seq);
      m.mutable_heartbeat()->set_sent_time_ms(absl::ToUnixMillis(absl::Now()));
      heartbeats_in_flight_[seq] = absl::Now();
      next_heartbeat = absl::Now() + heartbeat_interval;
      mu_.Unlock();
      RefreshGauges();  // once per heartbeat interval
      SampleGpus(m.mutable_heartbeat());
      mu_.Lock();
    } else if (!outbox_.empty()) {
      m = std::move(outbox_.front());
      outbox_.pop_front();
      outbox_log_bytes_ -= LogBytes(m);
    } else {
      continue;
    }
    mu_.Unlock();
    const bool ok = stream->Write(m);
    mu_.Lock();
    if (!ok) {
      if (!m.has_heartbeat()) {
        outbox_log_bytes_ += LogBytes(m);
        outbox_.push_front(std::move(m));  // resent after reconnecting
      }
      break;
    }
  }
}

}  // namespace trainyard::worker
