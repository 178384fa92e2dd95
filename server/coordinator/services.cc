#include "server/coordinator/services.h"

#include <deque>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "server/coordinator/job_state.h"

namespace trainyard::coordinator {
namespace {

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::StatusOr<std::string> CallerUser(grpc::CallbackServerContext* ctx) {
  const auto& md = ctx->client_metadata();
  auto it = md.find(kUserMetadataKey);
  if (it == md.end() || it->second.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat("missing call metadata '", kUserMetadataKey, "' naming the user"));
  }
  return std::string(it->second.data(), it->second.size());
}

// Serializes writes on a streaming reactor: gRPC allows one write in flight at a time. Shared
// (by shared_ptr) between the reactor and the producers that outlive it; Close() cuts them off
// when the reactor is done. Thread-safe.
template <typename Reactor, typename Message>
class WriteQueue {
 public:
  explicit WriteQueue(Reactor* reactor) : reactor_(reactor) {}

  // Queues `message`; false once the stream is finishing or closed.
  bool Push(Message message) {
    absl::MutexLock lock(&mu_);
    if (reactor_ == nullptr || finish_.has_value()) return false;
    queue_.push_back(std::move(message));
    if (!writing_) {
      writing_ = true;
      reactor_->StartWrite(&queue_.front());
    }
    return true;
  }

  // From the reactor's OnWriteDone.
  void OnWriteDone(bool ok) {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    writing_ = false;
    if (reactor_ == nullptr || finished_) return;
    if (!ok) {
      finished_ = true;
      reactor_->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"));
      return;
    }
    if (!queue_.empty()) {
      writing_ = true;
      reactor_->StartWrite(&queue_.front());
    } else if (finish_.has_value()) {
      finished_ = true;
      reactor_->Finish(*finish_);
    }
  }

  // Finishes the stream with `status` once the queued messages are written.
  void FinishWhenDrained(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    if (reactor_ == nullptr || finished_ || finish_.has_value()) return;
    finish_ = std::move(status);
    if (!writing_) {
      finished_ = true;
      reactor_->Finish(*finish_);
    }
  }

  // From the reactor's OnDone: no calls reach the reactor after this.
  void Close() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  Reactor* reactor_ ABSL_GUARDED_BY(mu_);
  std::deque<Message> queue_ ABSL_GUARDED_BY(mu_);  // front is in flight while writing_
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// WatchJob: the job's state now, then each durable change, until a terminal state.
class WatchReactor final : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  WatchReactor(JobManager& jobs, const std::string& job_id)
      : jobs_(jobs),
        queue_(std::make_shared<Queue>(this)),
        last_version_(std::make_shared<State>()) {
    v1::Job current;
    bool durable = false;
    auto handle = jobs_.Watch(
        job_id,
        [queue = queue_, state = last_version_](const v1::Job& job) { Deliver(queue, state, job); },
        &current, &durable);
    if (!handle.ok()) {
      queue_->FinishWhenDrained(ToGrpcStatus(handle.status()));
      return;
    }
    handle_ = *handle;
    // A state not yet on disk arrives through the callback once it is.
    if (durable) Deliver(queue_, last_version_, current);
  }

  void OnWriteDone(bool ok) override { queue_->OnWriteDone(ok); }
  // The client went away or the server is shutting down: gRPC still waits for our Finish.
  void OnCancel() override {
    queue_->FinishWhenDrained(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
  }
  void OnDone() override {
    if (handle_ != 0) jobs_.Unwatch(handle_);
    queue_->Close();
    delete this;
  }

 private:
  using Queue = WriteQueue<grpc::ServerWriteReactor<v1::JobEvent>, v1::JobEvent>;
  struct State {
    absl::Mutex mu;
    int64_t version ABSL_GUARDED_BY(mu) = 0;
  };

  static void Deliver(const std::shared_ptr<Queue>& queue, const std::shared_ptr<State>& state,
                      const v1::Job& job) {
    absl::MutexLock lock(&state->mu);  // keeps events in version order
    if (job.version() <= state->version) return;
    state->version = job.version();
    v1::JobEvent event;
    *event.mutable_job() = job;
    queue->Push(std::move(event));
    if (IsTerminal(job.state())) queue->FinishWhenDrained(grpc::Status::OK);
  }

  JobManager& jobs_;
  std::shared_ptr<Queue> queue_;
  std::shared_ptr<State> last_version_;
  int64_t handle_ = 0;
};

// Session: hello first, then heartbeats and rank status up; commands down.
class SessionReactor final
    : public grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage> {
 public:
  SessionReactor(NodeRegistry& nodes, JobManager& jobs, JobLogs& logs)
      : nodes_(nodes), jobs_(jobs), logs_(logs), sink_(std::make_shared<Sink>(this)) {
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the node closed its side or went away
      End(grpc::Status::OK);
      return;
    }
    if (node_id_.empty()) {
      if (!incoming_.has_hello() || incoming_.hello().node_id().empty()) {
        End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "hello.node_id: the first message of a session must be hello"));
        return;
      }
      if (absl::Status s = nodes_.AttachSession(incoming_.hello().node_id(), sink_); !s.ok()) {
        End(ToGrpcStatus(s));
        return;
      }
      node_id_ = incoming_.hello().node_id();
      jobs_.OnNodeHello(node_id_, incoming_.hello().running());
      jobs_.RequestSchedulingPass();
      for (const v1::Assignment& a : jobs_.AssignmentsFor(node_id_)) {
        v1::CoordinatorMessage m;
        *m.mutable_assignment() = a;
        sink_->Send(m);
      }
    } else if (incoming_.has_heartbeat()) {
      if (absl::Status s = nodes_.Heartbeat(node_id_); !s.ok()) {
        End(ToGrpcStatus(s));
        return;
      }
      v1::CoordinatorMessage ack;
      ack.mutable_heartbeat_ack()->set_seq(incoming_.heartbeat().seq());
      sink_->Send(ack);
    } else if (incoming_.has_rank_status()) {
      jobs_.OnRankStatus(node_id_, incoming_.rank_status());
    } else if (incoming_.has_logs()) {
      const v1::LogLines& in = incoming_.logs();
      std::vector<v1::LogLine> lines;
      lines.reserve(in.lines_size());
      for (const std::string& text : in.lines()) {
        v1::LogLine l;
        l.set_attempt(in.attempt());
        l.set_rank(in.rank());
        l.set_text(text);
        lines.push_back(std::move(l));
      }
      logs_.Append(in.job_id(), std::move(lines));
    }
    StartRead(&incoming_);
  }

  void OnWriteDone(bool ok) override { sink_->queue.OnWriteDone(ok); }
  // May run concurrently with OnReadDone: touches only the thread-safe queue. OnDone detaches.
  void OnCancel() override {
    sink_->queue.FinishWhenDrained(grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled"));
  }

  void OnDone() override {
    if (!node_id_.empty()) nodes_.DetachSession(node_id_, sink_.get());
    sink_->queue.Close();
    delete this;
  }

 private:
  using Base = grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage>;
  struct Sink final : NodeSessionSink {
    explicit Sink(Base* reactor) : queue(reactor) {}
    void Send(const v1::CoordinatorMessage& message) override { queue.Push(message); }
    WriteQueue<Base, v1::CoordinatorMessage> queue;
  };

  void End(grpc::Status status) {
    if (!node_id_.empty()) nodes_.DetachSession(node_id_, sink_.get());
    sink_->queue.FinishWhenDrained(std::move(status));
  }

  NodeRegistry& nodes_;
  JobManager& jobs_;
  JobLogs& logs_;
  std::shared_ptr<Sink> sink_;
  v1::NodeMessage incoming_;
  std::string node_id_;  // set by hello; only the reactor's own callbacks touch it
};

// StreamLogs / StreamMetrics: the records kept so far, then (with follow) each new one until the
// job ends.
template <typename T>
class SeriesReactor final : public grpc::ServerWriteReactor<T> {
 public:
  SeriesReactor(JobManager& jobs, JobSeries<T>& series, const std::string& job_id, size_t tail,
                bool follow)
      : jobs_(jobs), series_(series), queue_(std::make_shared<Queue>(this)) {
    v1::Job current;
    bool durable = false;
    auto watch = jobs_.Watch(
        job_id,
        [queue = queue_](const v1::Job& job) {
          if (IsTerminal(job.state())) queue->FinishWhenDrained(grpc::Status::OK);
        },
        &current, &durable);
    if (!watch.ok()) {
      queue_->FinishWhenDrained(ToGrpcStatus(watch.status()));
      return;
    }
    watch_ = *watch;
    std::vector<T> backlog;
    subscription_ =
        series_.Subscribe(job_id, tail, &backlog, [queue = queue_](const std::vector<T>& records) {
          for (const T& r : records) queue->Push(r);
        });
    for (T& r : backlog) queue_->Push(std::move(r));
    if (!follow || (durable && IsTerminal(current.state()))) {
      queue_->FinishWhenDrained(grpc::Status::OK);
    }
  }

  void OnWriteDone(bool ok) override { queue_->OnWriteDone(ok); }
  void OnCancel() override {
    queue_->FinishWhenDrained(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
  }
  void OnDone() override {
    if (watch_ != 0) jobs_.Unwatch(watch_);
    if (subscription_ != 0) series_.Unsubscribe(subscription_);
    queue_->Close();
    delete this;
  }

 private:
  using Queue = WriteQueue<grpc::ServerWriteReactor<T>, T>;
  JobManager& jobs_;
  JobSeries<T>& series_;
  std::shared_ptr<Queue> queue_;
  int64_t watch_ = 0;
  int64_t subscription_ = 0;
};

template <typename T>
grpc::ServerWriteReactor<T>* RejectStream(grpc::Status status) {
  class Rejected final : public grpc::ServerWriteReactor<T> {
   public:
    explicit Rejected(grpc::Status s) { this->Finish(std::move(s)); }
    void OnDone() override { delete this; }
  };
  return new Rejected(std::move(status));
}

absl::StatusOr<ScopeId> ParseScope(const v1::RendezvousScope& scope) {
  if (scope.job_id().empty()) return absl::InvalidArgumentError("scope.job_id: required");
  if (scope.attempt() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("scope.attempt: must be >= 1, got ", scope.attempt()));
  }
  return ScopeId{scope.job_id(), scope.attempt()};
}

absl::StatusOr<absl::Duration> ParseTimeout(int64_t timeout_ms) {
  if (timeout_ms < 0 || timeout_ms > 3'600'000) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: must be in 0..3600000, got ", timeout_ms));
  }
  return timeout_ms == 0 ? absl::Seconds(30) : absl::Milliseconds(timeout_ms);
}

absl::Status CheckKey(const std::string& key) {
  if (key.empty()) return absl::InvalidArgumentError("key: required");
  return absl::OkStatus();
}

}  // namespace

// ---- JobService ----

grpc::ServerUnaryReactor* JobServiceImpl::SubmitJob(grpc::CallbackServerContext* ctx,
                                                    const v1::SubmitJobRequest* request,
                                                    v1::SubmitJobResponse* response) {
  auto user = CallerUser(ctx);
  if (!user.ok()) return Done(ctx, user.status());
  auto* reactor = ctx->DefaultReactor();
  jobs_.Submit(*user, request->spec(), [reactor, response](absl::StatusOr<v1::Job> job) {
    if (job.ok()) *response->mutable_job() = *std::move(job);
    reactor->Finish(ToGrpcStatus(job.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* JobServiceImpl::GetJob(grpc::CallbackServerContext* ctx,
                                                 const v1::GetJobRequest* request,
                                                 v1::Job* response) {
  if (request->job_id().empty()) return Done(ctx, absl::InvalidArgumentError("job_id: required"));
  auto job = jobs_.Get(request->job_id());
  if (job.ok()) *response = *std::move(job);
  return Done(ctx, job.status());
}

grpc::ServerUnaryReactor* JobServiceImpl::ListJobs(grpc::CallbackServerContext* ctx,
                                                   const v1::ListJobsRequest* request,
                                                   v1::ListJobsResponse* response) {
  auto result = jobs_.List(*request);
  if (result.ok()) {
    for (auto& job : result->jobs) *response->add_jobs() = std::move(job);
    response->set_next_page_token(result->next_page_token);
  }
  return Done(ctx, result.status());
}

grpc::ServerUnaryReactor* JobServiceImpl::CancelJob(grpc::CallbackServerContext* ctx,
                                                    const v1::CancelJobRequest* request,
                                                    v1::Job* response) {
  if (request->job_id().empty()) return Done(ctx, absl::InvalidArgumentError("job_id: required"));
  auto user = CallerUser(ctx);
  if (!user.ok()) return Done(ctx, user.status());
  auto* reactor = ctx->DefaultReactor();
  const std::string reason = request->reason().empty()
                                 ? absl::StrCat("cancelled by ", *user)
                                 : absl::StrCat("cancelled by ", *user, ": ", request->reason());
  jobs_.Cancel(request->job_id(), reason, [reactor, response](absl::StatusOr<v1::Job> job) {
    if (job.ok()) *response = *std::move(job);
    reactor->Finish(ToGrpcStatus(job.status()));
  });
  return reactor;
}

grpc::ServerWriteReactor<v1::JobEvent>* JobServiceImpl::WatchJob(
    grpc::CallbackServerContext* ctx, const v1::WatchJobRequest* request) {
  if (request->job_id().empty()) {
    return RejectStream<v1::JobEvent>(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required"));
  }
  return new WatchReactor(jobs_, request->job_id());
}

grpc::ServerWriteReactor<v1::LogLine>* JobServiceImpl::StreamLogs(
    grpc::CallbackServerContext* ctx, const v1::StreamLogsRequest* request) {
  if (request->job_id().empty()) {
    return RejectStream<v1::LogLine>(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required"));
  }
  if (request->tail() < 0) {
    return RejectStream<v1::LogLine>(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                     absl::StrCat("tail: must be >= 0, got ", request->tail())));
  }
  return new SeriesReactor<v1::LogLine>(jobs_, logs_, request->job_id(),
                                        static_cast<size_t>(request->tail()), request->follow());
}

grpc::ServerWriteReactor<v1::StepReport>* JobServiceImpl::StreamMetrics(
    grpc::CallbackServerContext* ctx, const v1::StreamMetricsRequest* request) {
  if (request->job_id().empty()) {
    return RejectStream<v1::StepReport>(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required"));
  }
  return new SeriesReactor<v1::StepReport>(jobs_, metrics_, request->job_id(), 0,
                                           request->follow());
}

grpc::ServerUnaryReactor* JobServiceImpl::CheckpointJob(grpc::CallbackServerContext* ctx,
                                                        const v1::CheckpointJobRequest* request,
                                                        v1::Job* response) {
  if (request->job_id().empty()) return Done(ctx, absl::InvalidArgumentError("job_id: required"));
  auto* reactor = ctx->DefaultReactor();
  jobs_.RequestCheckpoint(request->job_id(), [reactor, response](absl::StatusOr<v1::Job> job) {
    if (job.ok()) *response = *std::move(job);
    reactor->Finish(ToGrpcStatus(job.status()));
  });
  return reactor;
}

// ---- TrainerService ----

grpc::ServerUnaryReactor* TrainerServiceImpl::ReportStep(grpc::CallbackServerContext* ctx,
                                                         const v1::StepReport* request,
                                                         v1::TrainerCommands* response) {
  if (request->job_id().empty()) return Done(ctx, absl::InvalidArgumentError("job_id: required"));
  if (request->step() < 1) {
    return Done(
        ctx, absl::InvalidArgumentError(absl::StrCat("step: must be >= 1, got ", request->step())));
  }
  auto commands = jobs_.OnStepReport(*request);
  if (commands.ok()) {
    *response = *commands;
    metrics_.Append(request->job_id(), {*request});
    if (prometheus_ != nullptr) prometheus_->ObserveStep(*request);
  }
  return Done(ctx, commands.status());
}

grpc::ServerUnaryReactor* TrainerServiceImpl::ReportCheckpoint(grpc::CallbackServerContext* ctx,
                                                               const v1::CheckpointReport* request,
                                                               v1::TrainerCommands* response) {
  if (request->job_id().empty()) return Done(ctx, absl::InvalidArgumentError("job_id: required"));
  if (request->path().empty()) return Done(ctx, absl::InvalidArgumentError("path: required"));
  auto commands = jobs_.OnCheckpointReport(*request);
  if (commands.ok()) *response = *commands;
  return Done(ctx, commands.status());
}

// ---- NodeService ----

grpc::ServerUnaryReactor* NodeServiceImpl::RegisterNode(grpc::CallbackServerContext* ctx,
                                                        const v1::RegisterNodeRequest* request,
                                                        v1::RegisterNodeResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  nodes_.Register(*request, [this, reactor, response](absl::StatusOr<v1::Node> node) {
    if (node.ok()) {
      *response->mutable_node() = *std::move(node);
      response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(heartbeat_interval_));
      response->set_node_timeout_ms(absl::ToInt64Milliseconds(nodes_.node_timeout()));
      jobs_.RequestSchedulingPass();
    }
    reactor->Finish(ToGrpcStatus(node.status()));
  });
  return reactor;
}

grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage>* NodeServiceImpl::Session(
    grpc::CallbackServerContext* ctx) {
  return new SessionReactor(nodes_, jobs_, logs_);
}

grpc::ServerUnaryReactor* NodeServiceImpl::ListNodes(grpc::CallbackServerContext* ctx,
                                                     const v1::ListNodesRequest* request,
                                                     v1::ListNodesResponse* response) {
  for (v1::Node& node : jobs_.NodesWithAllocations()) *response->add_nodes() = std::move(node);
  return Done(ctx, absl::OkStatus());
}

// ---- RendezvousService ----

#define TY_SCOPE_OR_FINISH(var, scope_msg)                 \
  auto var##_or = ParseScope(scope_msg);                   \
  if (!var##_or.ok()) return Done(ctx, var##_or.status()); \
  const ScopeId var = *var##_or

grpc::ServerUnaryReactor* RendezvousServiceImpl::Set(grpc::CallbackServerContext* ctx,
                                                     const v1::SetRequest* r, v1::SetResponse*) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(r->key()); !s.ok()) return Done(ctx, s);
  return Done(ctx, rdzv_.Set(scope, r->key(), r->value()));
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Get(grpc::CallbackServerContext* ctx,
                                                     const v1::GetRequest* r,
                                                     v1::GetResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(r->key()); !s.ok()) return Done(ctx, s);
  auto timeout = ParseTimeout(r->timeout_ms());
  if (!timeout.ok()) return Done(ctx, timeout.status());
  auto* reactor = ctx->DefaultReactor();
  rdzv_.Get(scope, r->key(), *timeout, [reactor, response](absl::StatusOr<std::string> v) {
    if (v.ok()) response->set_value(*std::move(v));
    reactor->Finish(ToGrpcStatus(v.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Add(grpc::CallbackServerContext* ctx,
                                                     const v1::AddRequest* r,
                                                     v1::AddResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(r->key()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.Add(scope, r->key(), r->delta());
  if (v.ok()) response->set_value(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::CompareSet(grpc::CallbackServerContext* ctx,
                                                            const v1::CompareSetRequest* r,
                                                            v1::CompareSetResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(r->key()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.CompareSet(scope, r->key(), r->expected(), r->desired());
  if (v.ok()) response->set_value(*std::move(v));
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Check(grpc::CallbackServerContext* ctx,
                                                       const v1::CheckRequest* r,
                                                       v1::CheckResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  auto v = rdzv_.Check(scope, {r->keys().begin(), r->keys().end()});
  if (v.ok()) response->set_all_present(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::DeleteKey(grpc::CallbackServerContext* ctx,
                                                           const v1::DeleteKeyRequest* r,
                                                           v1::DeleteKeyResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(r->key()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.DeleteKey(scope, r->key());
  if (v.ok()) response->set_deleted(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::NumKeys(grpc::CallbackServerContext* ctx,
                                                         const v1::NumKeysRequest* r,
                                                         v1::NumKeysResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  auto v = rdzv_.NumKeys(scope);
  if (v.ok()) response->set_num_keys(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Wait(grpc::CallbackServerContext* ctx,
                                                      const v1::WaitRequest* r, v1::WaitResponse*) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (r->keys().empty()) return Done(ctx, absl::InvalidArgumentError("keys: at least one key"));
  auto timeout = ParseTimeout(r->timeout_ms());
  if (!timeout.ok()) return Done(ctx, timeout.status());
  auto* reactor = ctx->DefaultReactor();
  rdzv_.Wait(scope, {r->keys().begin(), r->keys().end()}, *timeout,
             [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); });
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Barrier(grpc::CallbackServerContext* ctx,
                                                         const v1::BarrierRequest* r,
                                                         v1::BarrierResponse*) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (r->name().empty()) return Done(ctx, absl::InvalidArgumentError("name: required"));
  auto timeout = ParseTimeout(r->timeout_ms());
  if (!timeout.ok()) return Done(ctx, timeout.status());
  auto* reactor = ctx->DefaultReactor();
  rdzv_.Barrier(scope, r->name(), r->rank(), r->world_size(), *timeout,
                [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); });
  return reactor;
}

#undef TY_SCOPE_OR_FINISH

}  // namespace trainyard::coordinator
