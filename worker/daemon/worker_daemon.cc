#include "worker/daemon/worker_daemon.h"

#include <unistd.h>

#include <spdlog/spdlog.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace trainyard::worker {
namespace {

constexpr int kMaxQueuedLogMessages = 2000;

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t{pages} * page : 0;
}

}  // namespace

WorkerDaemon::WorkerDaemon(WorkerOptions options) : options_(std::move(options)) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  channel_ =
      grpc::CreateCustomChannel(options_.coordinator, grpc::InsecureChannelCredentials(), args);
  stub_ = v1::NodeService::NewStub(channel_);
  supervisor_ = std::make_unique<RankSupervisor>(options_.supervisor,
                                                 [this](v1::NodeMessage m) { Send(std::move(m)); });
}

WorkerDaemon::~WorkerDaemon() { Shutdown(); }

void WorkerDaemon::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  if (session_ctx_ != nullptr) session_ctx_->TryCancel();
}

void WorkerDaemon::Send(v1::NodeMessage message) {
  absl::MutexLock lock(&mu_);
  if (message.has_logs()) {
    if (outbox_log_messages_ >= kMaxQueuedLogMessages) return;  // coordinator unreachable
    ++outbox_log_messages_;
  }
  outbox_.push_back(std::move(message));
}

void WorkerDaemon::Run() {
  absl::Duration backoff = absl::Milliseconds(100);
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
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
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
  for (int i = 0; i < options_.cpu_slots; ++i) {
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
    const grpc::Status s = stub_->RegisterNode(&ctx, request, &registered);
    if (!s.ok()) {
      spdlog::warn("cannot register with {}: {}", options_.coordinator, s.error_message());
      return;
    }
  }
  const absl::Duration interval =
      absl::Milliseconds(std::max<int64_t>(50, registered.heartbeat_interval_ms()));
  spdlog::info("registered as {} with {} slot(s); heartbeat every {}", options_.node_id,
               options_.cpu_slots, absl::FormatDuration(interval));

  grpc::ClientContext ctx;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    session_ctx_ = &ctx;
  }
  auto stream = stub_->Session(&ctx);
  v1::NodeMessage hello;
  hello.mutable_hello()->set_node_id(options_.node_id);
  bool ok = stream->Write(hello);
  if (ok) {
    // Ranks still running from before a reconnect: the coordinator stops stale ones.
    for (const v1::RankStatus& r : supervisor_->Running()) {
      v1::NodeMessage m;
      *m.mutable_rank_status() = r;
      Send(std::move(m));
    }
    {
      absl::MutexLock lock(&mu_);
      session_open_ = true;
    }
    std::thread writer([&] { WriterLoop(stream.get(), interval); });
    v1::CoordinatorMessage in;
    while (stream->Read(&in)) {
      if (in.has_assignment()) {
        const auto& a = in.assignment();
        spdlog::info("assignment: {} attempt {} ranks {}..{} of {}", a.job_id(), a.attempt(),
                     a.first_rank(), a.first_rank() + a.device_indices_size() - 1, a.world_size());
        supervisor_->Launch(a);
      } else if (in.has_cancel()) {
        spdlog::info("stop {} attempt {}: {}", in.cancel().job_id(), in.cancel().attempt(),
                     in.cancel().reason());
        supervisor_->Stop(in.cancel().job_id(), in.cancel().attempt(), in.cancel().reason());
      }
    }
    {
      absl::MutexLock lock(&mu_);
      session_open_ = false;
    }
    writer.join();
  }
  const grpc::Status s = stream->Finish();
  {
    absl::MutexLock lock(&mu_);
    session_ctx_ = nullptr;
  }
  spdlog::warn("session with {} ended: {}", options_.coordinator,
               s.ok() ? std::string("closed") : s.error_message());
}

void WorkerDaemon::WriterLoop(
    grpc::ClientReaderWriter<v1::NodeMessage, v1::CoordinatorMessage>* stream,
    absl::Duration heartbeat_interval) {
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
    if (absl::Now() >= next_heartbeat) {
      m.mutable_heartbeat()->set_seq(++seq);
      m.mutable_heartbeat()->set_sent_time_ms(absl::ToUnixMillis(absl::Now()));
      next_heartbeat = absl::Now() + heartbeat_interval;
    } else if (!outbox_.empty()) {
      m = std::move(outbox_.front());
      outbox_.pop_front();
      if (m.has_logs()) --outbox_log_messages_;
    } else {
      continue;
    }
    mu_.Unlock();
    const bool ok = stream->Write(m);
    mu_.Lock();
    if (!ok) {
      if (!m.has_heartbeat()) {
        outbox_.push_front(std::move(m));  // resent after reconnecting
        if (outbox_.front().has_logs()) ++outbox_log_messages_;
      }
      break;
    }
  }
}

}  // namespace trainyard::worker
