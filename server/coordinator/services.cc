#include "server/coordinator/services.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <optional>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/credentials.h"
#include "common/field_limits.h"
#include "common/grpc_status.h"
#include "common/log_text.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "server/coordinator/audit.h"
#include "server/coordinator/job_state.h"

namespace trainyard::coordinator {
namespace {

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The caller's address without its port ("ipv4:127.0.0.1", "ipv6:[::1]"): the key failed
// authentications are counted under.
std::string PeerHost(grpc::CallbackServerContext* ctx) {
  std::string peer = ctx->peer();
  const size_t colon = peer.rfind(':');
  const size_t first = peer.find(':');
  if (colon != std::string::npos && colon != first) peer.resize(colon);
  return peer;
}

// The principal of the call's "authorization: Bearer <credential>" metadata.
absl::StatusOr<Principal> Authenticate(grpc::CallbackServerContext* ctx,
                                       const IdentityRegistry& identities) {
  const auto& md = ctx->client_metadata();
  auto it = md.find(kAuthorizationMetadata);
  if (it == md.end()) {
    return absl::UnauthenticatedError(
        "no credential: send call metadata \"authorization: Bearer <token>\" (yard: "
        "--token-file, TRAINYARD_TOKEN or yard login)");
  }
  ASSIGN_OR_RETURN(std::string credential,
                   BearerCredential(absl::string_view(it->second.data(), it->second.size())));
  return identities.AuthenticateFrom(credential, PeerHost(ctx));
}

// Audits a refusal and passes it on.
absl::Status Refused(const char* method, const std::string& who, absl::Status status,
                     const std::string& target = "") {
  WriteAudit({who, method, target, status, ""});
  return status;
}

// Every field of a request within the default FieldLimits (strings 4096 bytes, lists 1024
// entries, 256 KiB in all): INVALID_ARGUMENT naming the field.
absl::Status CheckRequest(const google::protobuf::Message& request) {
  return CheckFieldSizes(request, FieldLimits{});
}

// The largest cancel reason kept (it becomes the job's message).
constexpr size_t kMaxReasonBytes = 1024;
// The largest step or checkpoint report a rank may send.
constexpr size_t kMaxReportBytes = 64 * 1024;

// A user's (or admin's) API token: node tokens and job credentials may not make user calls.
absl::StatusOr<Principal> AuthenticateUser(grpc::CallbackServerContext* ctx,
                                           const IdentityRegistry& identities, const char* method) {
  auto p = Authenticate(ctx, identities);
  if (!p.ok()) return Refused(method, "anonymous", p.status());
  if (p->kind != Principal::Kind::kUser) {
    return Refused(method, p->Describe(),
                   absl::PermissionDeniedError(absl::StrCat(
                       method, " needs a user's API token; the call carried a ",
                       p->kind == Principal::Kind::kNode ? "node token" : "job credential")));
  }
  return p;
}

absl::StatusOr<Principal> AuthenticateAdmin(grpc::CallbackServerContext* ctx,
                                            const IdentityRegistry& identities,
                                            const char* method) {
  ASSIGN_OR_RETURN(Principal p, AuthenticateUser(ctx, identities, method));
  if (!p.IsAdmin()) {
    return Refused(method, p.Describe(),
                   absl::PermissionDeniedError(
                       absl::StrCat(method, " is for admins; ", p.user, " is not one")));
  }
  return p;
}

// The ranks of one attempt, with that attempt's job credential.
absl::Status AuthenticateRank(grpc::CallbackServerContext* ctx, const IdentityRegistry& identities,
                              const char* method, const std::string& job_id, int32_t attempt) {
  auto p = Authenticate(ctx, identities);
  if (!p.ok()) return Refused(method, "anonymous", p.status());
  if (p->kind != Principal::Kind::kJob) {
    return Refused(method, p->Describe(),
                   absl::PermissionDeniedError(absl::StrCat(
                       method, " is for a job's ranks, with the job credential of its attempt")));
  }
  if (p->job_id != job_id || p->attempt != attempt) {
    return Refused(method, p->Describe(),
                   absl::PermissionDeniedError(absl::StrCat("the job credential is for ", p->job_id,
                                                            " attempt ", p->attempt, ", not for ",
                                                            job_id, " attempt ", attempt)));
  }
  return absl::OkStatus();
}

// A node: by its node token, or with `certificates` (mutual TLS) by its verified client
// certificate, whose common name is the node id (a token, if also sent, must name the same
// node). For `node_id` (when not empty) only if that is the node.
absl::StatusOr<Principal> AuthenticateNode(grpc::CallbackServerContext* ctx,
                                           const IdentityRegistry& identities, const char* method,
                                           const std::string& node_id, bool certificates = false) {
  const bool has_token = ctx->client_metadata().count(kAuthorizationMetadata) != 0;
  Principal p;
  if (certificates) {
    const std::string name = PeerCertificateName(*ctx);
    if (name.empty()) {
      return Refused(method, "anonymous",
                     absl::UnauthenticatedError(absl::StrCat(
                         method,
                         " needs a client certificate whose common name is the node id "
                         "(this coordinator asks nodes for mutual TLS)")));
    }
    p.kind = Principal::Kind::kNode;
    p.node = name;
  }
  if (has_token || !certificates) {
    auto token = Authenticate(ctx, identities);
    if (!token.ok()) return Refused(method, "anonymous", token.status());
    if (token->kind != Principal::Kind::kNode) {
      return Refused(method, token->Describe(),
                     absl::PermissionDeniedError(absl::StrCat(
                         method, " needs a node token (yard admin token create --node NAME)")));
    }
    if (certificates && token->node != p.node) {
      return Refused(
          method, token->Describe(),
          absl::PermissionDeniedError(absl::StrCat("the node token is for node ", token->node,
                                                   ", the client certificate for ", p.node)));
    }
    p = *token;
  }
  if (identities.IsNodeDenied(p.node)) {
    return Refused(method, p.Describe(),
                   absl::PermissionDeniedError(absl::StrCat(
                       "node ", p.node, " is denied by an admin (yard admin node allow ", p.node,
                       " lifts it)")));
  }
  if (!node_id.empty() && p.node != node_id) {
    return Refused(method, p.Describe(),
                   absl::PermissionDeniedError(absl::StrCat(
                       "node_id: the node's ", certificates ? "certificate" : "node token",
                       " is for node ", p.node, ", not ", node_id)));
  }
  return p;
}

// What a call that changes something did, and for whom.
void Audit(const Principal& who, const char* method, const std::string& target,
           const absl::Status& result) {
  WriteAudit({who.Describe(), method, target, result, ""});
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

// The longest log line kept from a rank; longer ones are cut, saying how much was cut.
constexpr size_t kMaxLogLineBytes = 16 * 1024;

// Session: hello first, then heartbeats and rank status up; commands down.
class SessionReactor final
    : public grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage> {
 public:
  // `token_node`: the node the caller's node token is bound to; hello must name it.
  SessionReactor(NodeRegistry& nodes, JobManager& jobs, JobLogs& logs,
                 const IdentityRegistry& identities, std::string token_node, SerialExecutor& events,
                 CoordinatorMetrics* metrics)
      : nodes_(nodes),
        jobs_(jobs),
        logs_(logs),
        identities_(identities),
        events_(events),
        metrics_(metrics),
        token_node_(std::move(token_node)),
        sink_(std::make_shared<Sink>(this)) {
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
      if (incoming_.hello().node_id() != token_node_) {
        spdlog::warn("audit: node {} Session refused: hello names node {}", token_node_,
                     Quoted(incoming_.hello().node_id()));
        End(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                         absl::StrCat("hello.node_id: the node token is for node ", token_node_,
                                      ", not ", incoming_.hello().node_id())));
        return;
      }
      if (absl::Status s = nodes_.AttachSession(incoming_.hello().node_id(), sink_); !s.ok()) {
        End(ToGrpcStatus(s));
        return;
      }
      node_id_ = incoming_.hello().node_id();
      // What waits on the job manager runs on the node-events thread, in arrival order; the
      // callback thread goes back to reading (its heartbeats count as they arrive).
      Defer([&jobs = jobs_, sink = sink_, node = node_id_, running = incoming_.hello().running()] {
        jobs.OnNodeHello(node, running);
        jobs.RequestSchedulingPass();
        for (const v1::Assignment& a : jobs.AssignmentsFor(node)) {
          v1::CoordinatorMessage m;
          *m.mutable_assignment() = a;
          sink->Send(m);
        }
      });
    } else if (incoming_.has_heartbeat()) {
      // A node an admin denied while its session was open: its session ends here.
      if (identities_.IsNodeDenied(node_id_)) {
        spdlog::warn("audit: node {} Session ended: the node is denied", node_id_);
        End(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                         absl::StrCat("node ", node_id_, " is denied by an admin")));
        return;
      }
      auto back = nodes_.Heartbeat(node_id_, incoming_.heartbeat().devices());
      if (!back.ok()) {
        End(ToGrpcStatus(back.status()));
        return;
      }
      if (*back) {
        spdlog::info("node {} is back: READY again (its lost attempts stay failed)", node_id_);
      }
      // Acknowledged once what the node sent before it has been handled.
      Defer([&jobs = jobs_, sink = sink_, seq = incoming_.heartbeat().seq(), back = *back] {
        if (back) jobs.RequestSchedulingPass();
        v1::CoordinatorMessage ack;
        ack.mutable_heartbeat_ack()->set_seq(seq);
        sink->Send(ack);
      });
    } else if (incoming_.has_rank_status()) {
      Defer([&jobs = jobs_, node = node_id_, status = incoming_.rank_status()] {
        jobs.OnRankStatus(node, status);
      });
    } else if (incoming_.has_logs()) {
      Defer([&jobs = jobs_, &logs = logs_, node = node_id_, in = incoming_.logs()] {
        HandleLogs(jobs, logs, node, in);
      });
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
    void Close(const absl::Status& why) override { queue.FinishWhenDrained(ToGrpcStatus(why)); }
    WriteQueue<Base, v1::CoordinatorMessage> queue;
  };

  // Runs `task` on the node-events thread after what the node sent before, timing its wait.
  void Defer(std::function<void()> task) {
    events_.Post([metrics = metrics_, arrived = absl::Now(), task = std::move(task)] {
      if (metrics != nullptr) {
        metrics->ObserveNodeEventDelay(absl::ToDoubleSeconds(absl::Now() - arrived));
      }
      task();
    });
  }

  static void HandleLogs(JobManager& jobs, JobLogs& logs, const std::string& node,
                         const v1::LogLines& in) {
    if (!jobs.RankRunsOn(node, in.job_id(), in.attempt(), in.rank())) {
      // A node speaks only for the ranks it runs.
      spdlog::warn("audit: node {} sent lines of rank {} of {}, which it does not run: dropped",
                   node, in.rank(), Quoted(in.job_id()));
      return;
    }
    std::vector<v1::LogLine> lines;
    lines.reserve(in.lines_size());
    for (const std::string& text : in.lines()) {
      v1::LogLine l;
      l.set_attempt(in.attempt());
      l.set_rank(in.rank());
      if (text.size() > kMaxLogLineBytes) {
        // Kept, cut: a rank's line is its owner's data, but no line may be unbounded.
        l.set_text(absl::StrCat(text.substr(0, kMaxLogLineBytes), " [truncated ",
                                text.size() - kMaxLogLineBytes, " bytes]"));
      } else {
        l.set_text(text);
      }
      lines.push_back(std::move(l));
    }
    logs.Append(in.job_id(), std::move(lines));
  }

  void End(grpc::Status status) {
    if (!node_id_.empty()) nodes_.DetachSession(node_id_, sink_.get());
    sink_->queue.FinishWhenDrained(std::move(status));
  }

  NodeRegistry& nodes_;
  JobManager& jobs_;
  JobLogs& logs_;
  const IdentityRegistry& identities_;
  SerialExecutor& events_;
  CoordinatorMetrics* const metrics_;
  const std::string token_node_;
  std::shared_ptr<Sink> sink_;
  v1::NodeMessage incoming_;
  std::string node_id_;  // set by hello; only the reactor's own callbacks touch it
};

// StreamLogs / StreamMetrics: the records kept so far, then (with follow) each new one until the
// job ends. A finished job no longer in memory has its records read from the store (`persisted`).
template <typename T>
class SeriesReactor final : public grpc::ServerWriteReactor<T> {
 public:
  SeriesReactor(JobManager& jobs, JobSeries<T>& series, const std::string& job_id, size_t tail,
                bool follow, std::function<absl::StatusOr<std::vector<T>>()> persisted)
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
    // The kept records, then every later one, in order.
    size_t kept = 0;
    subscription_ = series_.Subscribe(
        job_id, tail,
        [queue = queue_](const std::vector<T>& records) {
          for (const T& r : records) queue->Push(r);
        },
        &kept);
    // Memory forgets a job before its records: no records and no job means they are in the store.
    if (kept == 0 && IsTerminal(current.state()) && !jobs_.IsResident(job_id)) {
      absl::StatusOr<std::vector<T>> records = persisted();
      if (!records.ok()) {
        queue_->FinishWhenDrained(ToGrpcStatus(records.status()));
        return;
      }
      const size_t skip = tail == 0 || tail >= records->size() ? 0 : records->size() - tail;
      for (size_t i = skip; i < records->size(); ++i) queue_->Push((*records)[i]);
    }
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

// An export folder opened for reading: its descriptor and its regular files, in name order. The
// job's checkpoint folder belongs to the job's owner, who could put links or special files in
// it: the folder is opened without following a link, and every file by name in it without
// following one either, non-blocking (a FIFO answers at once), and served only when it is a
// regular file with one link.
struct ExportDir {
  int fd = -1;
  std::vector<std::string> files;
};

// Opens `name` in the folder `dirfd` (AT_FDCWD: a path) as a folder without following a link.
int OpenFolderNoFollow(int dirfd, const std::string& name) {
  return ::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

absl::StatusOr<ExportDir> OpenExportDir(const std::string& job_dir) {
  const int job_fd = OpenFolderNoFollow(AT_FDCWD, job_dir);
  if (job_fd < 0) return absl::NotFoundError(absl::StrCat("no folder ", job_dir));
  ExportDir out;
  out.fd = OpenFolderNoFollow(job_fd, "export");
  ::close(job_fd);
  if (out.fd < 0) return absl::NotFoundError(absl::StrCat("no folder ", job_dir, "/export"));
  const int list_fd = ::dup(out.fd);
  DIR* dir = list_fd < 0 ? nullptr : ::fdopendir(list_fd);
  if (dir == nullptr) {
    if (list_fd >= 0) ::close(list_fd);
    ::close(out.fd);
    return absl::InternalError(absl::StrCat("cannot list ", job_dir, "/export"));
  }
  while (const dirent* entry = ::readdir(dir)) {
    struct stat st;
    if (::fstatat(out.fd, entry->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
      out.files.emplace_back(entry->d_name);
    }
  }
  ::closedir(dir);  // closes list_fd
  std::sort(out.files.begin(), out.files.end());
  return out;
}

// FetchExport: an ExportDir's files in chunks of kExportChunkBytes, one read ahead of the client
// (the next chunk is read when the last one is written).
class ExportReactor final : public grpc::ServerWriteReactor<v1::ExportChunk> {
 public:
  static constexpr int64_t kExportChunkBytes = 1 << 20;

  explicit ExportReactor(ExportDir dir) : dir_(std::move(dir)) { Next(); }
  ~ExportReactor() override {
    if (file_fd_ >= 0) ::close(file_fd_);
    ::close(dir_.fd);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  // Writes the next chunk, or finishes.
  void Next() {
    if (file_ >= dir_.files.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    const std::string& name = dir_.files[file_];
    if (file_fd_ < 0) {
      file_fd_ = ::openat(dir_.fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      struct stat st;
      if (file_fd_ < 0 || ::fstat(file_fd_, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) {
        Finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("the export's ", name, " is not a plain file")));
        return;
      }
      size_ = st.st_size;
      offset_ = 0;
    }
    const int64_t want = std::min(kExportChunkBytes, size_ - offset_);
    chunk_.Clear();
    chunk_.set_file(name);
    chunk_.set_file_size(size_);
    chunk_.set_offset(offset_);
    std::string* data = chunk_.mutable_data();
    data->resize(static_cast<size_t>(want));
    for (int64_t got = 0; got < want;) {
      const ssize_t n = ::pread(file_fd_, data->data() + got, static_cast<size_t>(want - got),
                                static_cast<off_t>(offset_ + got));
      if (n <= 0 && !(n < 0 && errno == EINTR)) {
        Finish(grpc::Status(grpc::StatusCode::INTERNAL,
                            absl::StrCat("the export's ", name, " changed while read")));
        return;
      }
      if (n > 0) got += n;
    }
    offset_ += want;
    if (offset_ >= size_) {  // the file's last chunk (an empty file's only one)
      ::close(file_fd_);
      file_fd_ = -1;
      ++file_;
    }
    StartWrite(&chunk_);
  }

  ExportDir dir_;
  size_t file_ = 0;
  int file_fd_ = -1;
  int64_t size_ = 0, offset_ = 0;
  v1::ExportChunk chunk_;
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
  if (scope.job_id().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("scope.job_id: ", scope.job_id().size(), " bytes, at most 128"));
  }
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

absl::Status CheckKey(const Rendezvous& rdzv, const std::string& key,
                      const std::string& field = "key") {
  if (key.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  if (static_cast<int64_t>(key.size()) > rdzv.limits().max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", key.size(), " bytes, at most ", rdzv.limits().max_key_bytes));
  }
  return absl::OkStatus();
}

// The keys of a Wait or Check: at most 1024, each a valid key.
absl::Status CheckKeys(const Rendezvous& rdzv,
                       const google::protobuf::RepeatedPtrField<std::string>& keys) {
  if (keys.size() > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("keys: ", keys.size(), " keys, at most 1024"));
  }
  for (int i = 0; i < keys.size(); ++i) {
    RETURN_IF_ERROR(CheckKey(rdzv, keys[i], absl::StrCat("keys[", i, "]")));
  }
  return absl::OkStatus();
}

}  // namespace

// ---- JobService ----

absl::StatusOr<v1::Job> JobServiceImpl::AccessibleJob(grpc::CallbackServerContext* ctx,
                                                      const std::string& job_id, const char* method,
                                                      Principal* caller) const {
  ASSIGN_OR_RETURN(*caller, AuthenticateUser(ctx, identities_, method));
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  auto job = jobs_.Get(job_id);
  if (job.ok() && job->owner() != caller->user && !caller->IsAdmin()) {
    // Answered exactly as a job that does not exist, so that ids and owners cannot be found out
    // by trying; the audit log keeps the truth.
    Refused(method, caller->Describe(),
            absl::PermissionDeniedError(absl::StrCat("the job belongs to ", job->owner())), job_id)
        .IgnoreError();
    return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
  }
  return job;
}

grpc::ServerUnaryReactor* JobServiceImpl::SubmitJob(grpc::CallbackServerContext* ctx,
                                                    const v1::SubmitJobRequest* request,
                                                    v1::SubmitJobResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto user = AuthenticateUser(ctx, identities_, "SubmitJob");
  if (!user.ok()) return Done(ctx, user.status());
  auto* reactor = ctx->DefaultReactor();
  jobs_.Submit(user->user, request->spec(),
               [reactor, response, who = *user](absl::StatusOr<v1::Job> job) {
                 Audit(who, "SubmitJob", job.ok() ? job->id() : "-", job.status());
                 if (job.ok()) *response->mutable_job() = *std::move(job);
                 reactor->Finish(ToGrpcStatus(job.status()));
               });
  return reactor;
}

grpc::ServerUnaryReactor* JobServiceImpl::GetJob(grpc::CallbackServerContext* ctx,
                                                 const v1::GetJobRequest* request,
                                                 v1::Job* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  Principal caller;
  auto job = AccessibleJob(ctx, request->job_id(), "GetJob", &caller);
  if (job.ok()) {
    *response = *std::move(job);
    response->set_why_waiting(jobs_.WhyWaiting(response->id(), caller.user, caller.IsAdmin()));
  }
  return Done(ctx, job.status());
}

grpc::ServerUnaryReactor* JobServiceImpl::ListJobs(grpc::CallbackServerContext* ctx,
                                                   const v1::ListJobsRequest* request,
                                                   v1::ListJobsResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateUser(ctx, identities_, "ListJobs");
  if (!caller.ok()) return Done(ctx, caller.status());
  v1::ListJobsRequest scoped = *request;
  if (!caller->IsAdmin()) {
    if (scoped.owner().empty()) {
      scoped.set_owner(caller->user);
    } else if (scoped.owner() != caller->user) {
      return Done(
          ctx,
          Refused("ListJobs", caller->Describe(),
                  absl::PermissionDeniedError(absl::StrCat(
                      "owner: only admins may list another user's jobs (", scoped.owner(), ")"))));
    }
  }
  auto result = jobs_.List(scoped);
  if (result.ok()) {
    for (auto& job : result->jobs) *response->add_jobs() = std::move(job);
    response->set_next_page_token(result->next_page_token);
  }
  return Done(ctx, result.status());
}

grpc::ServerUnaryReactor* JobServiceImpl::CancelJob(grpc::CallbackServerContext* ctx,
                                                    const v1::CancelJobRequest* request,
                                                    v1::Job* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  Principal caller;
  auto job = AccessibleJob(ctx, request->job_id(), "CancelJob", &caller);
  if (!job.ok()) return Done(ctx, job.status());
  if (request->reason().size() > kMaxReasonBytes) {
    return Done(ctx, absl::InvalidArgumentError(absl::StrCat("reason: ", request->reason().size(),
                                                             " bytes, at most ", kMaxReasonBytes)));
  }
  auto* reactor = ctx->DefaultReactor();
  const std::string reason = request->reason().empty() ? absl::StrCat("cancelled by ", caller.user)
                                                       : absl::StrCat("cancelled by ", caller.user,
                                                                      ": ", request->reason());
  jobs_.Cancel(request->job_id(), reason,
               [reactor, response, caller, id = request->job_id()](absl::StatusOr<v1::Job> job) {
                 Audit(caller, "CancelJob", id, job.status());
                 if (job.ok()) *response = *std::move(job);
                 reactor->Finish(ToGrpcStatus(job.status()));
               });
  return reactor;
}

grpc::ServerWriteReactor<v1::JobEvent>* JobServiceImpl::WatchJob(
    grpc::CallbackServerContext* ctx, const v1::WatchJobRequest* request) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) {
    return RejectStream<v1::JobEvent>(ToGrpcStatus(s));
  }
  Principal caller;
  if (auto job = AccessibleJob(ctx, request->job_id(), "WatchJob", &caller); !job.ok()) {
    return RejectStream<v1::JobEvent>(ToGrpcStatus(job.status()));
  }
  return new WatchReactor(jobs_, request->job_id());
}

grpc::ServerWriteReactor<v1::LogLine>* JobServiceImpl::StreamLogs(
    grpc::CallbackServerContext* ctx, const v1::StreamLogsRequest* request) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) {
    return RejectStream<v1::LogLine>(ToGrpcStatus(s));
  }
  Principal caller;
  if (auto job = AccessibleJob(ctx, request->job_id(), "StreamLogs", &caller); !job.ok()) {
    return RejectStream<v1::LogLine>(ToGrpcStatus(job.status()));
  }
  if (request->tail() < 0) {
    return RejectStream<v1::LogLine>(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                     absl::StrCat("tail: must be >= 0, got ", request->tail())));
  }
  return new SeriesReactor<v1::LogLine>(
      jobs_, logs_, request->job_id(), static_cast<size_t>(request->tail()), request->follow(),
      [this, id = request->job_id()] { return history_.Logs(id); });
}

grpc::ServerWriteReactor<v1::ExportChunk>* JobServiceImpl::FetchExport(
    grpc::CallbackServerContext* ctx, const v1::FetchExportRequest* request) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) {
    return RejectStream<v1::ExportChunk>(ToGrpcStatus(s));
  }
  Principal caller;
  auto job = AccessibleJob(ctx, request->job_id(), "FetchExport", &caller);
  auto refuse = [&](absl::Status status) {
    Audit(caller, "FetchExport", request->job_id(), status);
    return RejectStream<v1::ExportChunk>(ToGrpcStatus(status));
  };
  if (!job.ok()) return RejectStream<v1::ExportChunk>(ToGrpcStatus(job.status()));
  if (job->spec().checkpoint().export_format() == v1::EXPORT_FORMAT_UNSPECIFIED) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat(request->job_id(),
                     " has no export: its spec sets no checkpoint.export (hf or hf_merged)")));
  }
  if (job->state() != v1::SUCCEEDED) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat(request->job_id(), " is ", v1::JobState_Name(job->state()),
                     ": its export is written when it succeeds")));
  }
  const std::string job_dir = jobs_.CheckpointDir(request->job_id());
  absl::StatusOr<ExportDir> dir = OpenExportDir(job_dir);
  if (!dir.ok() || dir->files.empty()) {
    if (dir.ok()) ::close(dir->fd);
    return refuse(
        absl::NotFoundError(absl::StrCat(request->job_id(), "'s export is not in ", job_dir,
                                         "/export (the trainer writes it there)")));
  }
  Audit(caller, "FetchExport", request->job_id(), absl::OkStatus());
  return new ExportReactor(*std::move(dir));
}

grpc::ServerWriteReactor<v1::StepReport>* JobServiceImpl::StreamMetrics(
    grpc::CallbackServerContext* ctx, const v1::StreamMetricsRequest* request) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) {
    return RejectStream<v1::StepReport>(ToGrpcStatus(s));
  }
  Principal caller;
  if (auto job = AccessibleJob(ctx, request->job_id(), "StreamMetrics", &caller); !job.ok()) {
    return RejectStream<v1::StepReport>(ToGrpcStatus(job.status()));
  }
  return new SeriesReactor<v1::StepReport>(
      jobs_, metrics_, request->job_id(), 0, request->follow(),
      [this, id = request->job_id()] { return history_.Metrics(id); });
}

grpc::ServerUnaryReactor* JobServiceImpl::CheckpointJob(grpc::CallbackServerContext* ctx,
                                                        const v1::CheckpointJobRequest* request,
                                                        v1::Job* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  Principal caller;
  auto job = AccessibleJob(ctx, request->job_id(), "CheckpointJob", &caller);
  if (!job.ok()) return Done(ctx, job.status());
  auto* reactor = ctx->DefaultReactor();
  jobs_.RequestCheckpoint(request->job_id(), [reactor, response, caller,
                                              id = request->job_id()](absl::StatusOr<v1::Job> job) {
    Audit(caller, "CheckpointJob", id, job.status());
    if (job.ok()) *response = *std::move(job);
    reactor->Finish(ToGrpcStatus(job.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* JobServiceImpl::GetQuota(grpc::CallbackServerContext* ctx,
                                                   const v1::GetQuotaRequest* request,
                                                   v1::QuotaReport* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateUser(ctx, identities_, "GetQuota");
  if (!caller.ok()) return Done(ctx, caller.status());
  const std::string user = request->user().empty() ? caller->user : request->user();
  if (!caller->IsAdmin() && user != caller->user) {
    return Done(ctx, Refused("GetQuota", caller->Describe(),
                             absl::PermissionDeniedError(absl::StrCat(
                                 "user: only admins may see another user's quota (", user, ")"))));
  }
  if (!caller->IsAdmin() && request->all_accounts()) {
    return Done(ctx, Refused("GetQuota", caller->Describe(),
                             absl::PermissionDeniedError(
                                 "all_accounts: only admins may see every account's use")));
  }
  if (!identities_.GetUser(user).ok()) {
    return Done(ctx, absl::NotFoundError(absl::StrCat("user: no user ", user)));
  }
  *response = jobs_.Quota(user, request->all_accounts());
  return Done(ctx, absl::OkStatus());
}

// ---- TrainerService ----

grpc::ServerUnaryReactor* TrainerServiceImpl::ReportStep(grpc::CallbackServerContext* ctx,
                                                         const v1::StepReport* request,
                                                         v1::TrainerCommands* response) {
  if (absl::Status s =
          AuthenticateRank(ctx, identities_, "ReportStep", request->job_id(), request->attempt());
      !s.ok()) {
    return Done(ctx, s);
  }
  if (absl::Status s = CheckFieldSizes(*request, FieldLimits{4096, 1024, kMaxReportBytes}, "");
      !s.ok()) {
    return Done(ctx, s);
  }
  if (request->job_id().empty()) return Done(ctx, absl::InvalidArgumentError("job_id: required"));
  if (request->step() < 1) {
    return Done(
        ctx, absl::InvalidArgumentError(absl::StrCat("step: must be >= 1, got ", request->step())));
  }
  if (request->metrics_size() > 64) {
    return Done(ctx, absl::InvalidArgumentError(absl::StrCat("metrics: ", request->metrics_size(),
                                                             " entries, at most 64")));
  }
  auto commands = jobs_.OnStepReport(*request);
  if (commands.ok()) {
    *response = *commands;
    // Other ranks' reports only fetch the commands.
    if (request->rank() == 0) {
      metrics_.Append(request->job_id(), {*request});
      if (prometheus_ != nullptr) prometheus_->ObserveStep(*request);
    }
  }
  return Done(ctx, commands.status());
}

grpc::ServerUnaryReactor* TrainerServiceImpl::ReportCheckpoint(grpc::CallbackServerContext* ctx,
                                                               const v1::CheckpointReport* request,
                                                               v1::TrainerCommands* response) {
  if (absl::Status s = AuthenticateRank(ctx, identities_, "ReportCheckpoint", request->job_id(),
                                        request->attempt());
      !s.ok()) {
    return Done(ctx, s);
  }
  if (absl::Status s = CheckFieldSizes(*request, FieldLimits{4096, 1024, kMaxReportBytes}, "");
      !s.ok()) {
    return Done(ctx, s);
  }
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
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller =
      AuthenticateNode(ctx, identities_, "RegisterNode", request->node_id(), node_certificates_);
  if (!caller.ok()) return Done(ctx, caller.status());
  // A node that takes only some users' jobs (a worker not running as root, a user's parameter
  // server) must hold a node token naming them: a token for any user's jobs is for nodes an
  // admin trusts with every job, and a node may not pick whose jobs it attracts.
  if (caller->node_owners.empty() && !caller->token_id.empty() && !request->owners().empty()) {
    return Done(
        ctx,
        Refused(
            "RegisterNode", caller->Describe(),
            absl::PermissionDeniedError(absl::StrCat(
                "owners: the node asks for the jobs of ", absl::StrJoin(request->owners(), ", "),
                " only, but its node token names no owners; give it a token that "
                "does (yard admin token create --node ",
                request->node_id(), " --owners ", absl::StrJoin(request->owners(), ","), ")"))));
  }
  // A node token limited to some owners' jobs: the node may not claim more (or any owner's).
  if (!caller->node_owners.empty()) {
    const auto& allowed = caller->node_owners;
    const bool within =
        !request->owners().empty() &&
        std::all_of(request->owners().begin(), request->owners().end(), [&](const std::string& o) {
          return std::find(allowed.begin(), allowed.end(), o) != allowed.end();
        });
    if (!within) {
      return Done(
          ctx, Refused("RegisterNode", caller->Describe(),
                       absl::PermissionDeniedError(absl::StrCat(
                           "owners: the node token allows only the jobs of ",
                           absl::StrJoin(allowed, ", "), "; the node asked for ",
                           request->owners().empty() ? std::string("any user's")
                                                     : absl::StrJoin(request->owners(), ", ")))));
    }
  }
  auto* reactor = ctx->DefaultReactor();
  nodes_.Register(*request, [this, reactor, response, who = *caller,
                             id = request->node_id()](absl::StatusOr<v1::Node> node) {
    Audit(who, "RegisterNode", id, node.status());
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
  // The node's name is checked against hello's node_id when hello arrives.
  auto caller = AuthenticateNode(ctx, identities_, "Session", "", node_certificates_);
  if (!caller.ok()) {
    class Rejected final : public grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage> {
     public:
      explicit Rejected(grpc::Status s) { Finish(std::move(s)); }
      void OnDone() override { delete this; }
    };
    return new Rejected(ToGrpcStatus(caller.status()));
  }
  return new SessionReactor(nodes_, jobs_, logs_, identities_, caller->node, node_events_,
                            metrics_);
}

grpc::ServerUnaryReactor* NodeServiceImpl::ListNodes(grpc::CallbackServerContext* ctx,
                                                     const v1::ListNodesRequest* request,
                                                     v1::ListNodesResponse* response) {
  if (auto caller = AuthenticateUser(ctx, identities_, "ListNodes"); !caller.ok()) {
    return Done(ctx, caller.status());
  }
  for (v1::Node& node : jobs_.NodesWithAllocations()) *response->add_nodes() = std::move(node);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* NodeServiceImpl::VerifyJobCredential(
    grpc::CallbackServerContext* ctx, const v1::VerifyJobCredentialRequest* request,
    v1::VerifyJobCredentialResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateNode(ctx, identities_, "VerifyJobCredential", "", node_certificates_);
  if (!caller.ok()) return Done(ctx, caller.status());
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto refuse = [&](absl::Status status) {
    return Done(ctx, Refused("VerifyJobCredential", caller->Describe(), std::move(status)));
  };
  // A parameter server is shown the attempt's credential for that server alone, never the job
  // credential, which the rendezvous and the reports accept.
  if (ParseJobCredential(request->credential()).ok()) {
    return refuse(absl::PermissionDeniedError(
        "credential: a job credential (tyj.); a rank shows a parameter server only its "
        "parameter-server credential (tys.), which is good at that server alone"));
  }
  auto rank = ParseServerCredential(request->credential());
  if (!rank.ok()) {
    return refuse(
        absl::UnauthenticatedError(absl::StrCat("credential: ", rank.status().message())));
  }
  auto job = jobs_.Get(rank->job_id);
  if (!job.ok()) {
    return refuse(absl::UnauthenticatedError(
        "credential: not a parameter-server credential this coordinator made"));
  }
  // Which of the attempt's ranges (by server address) it was made for: made with the attempt's
  // job credential, so the mac of a forged one, or of another attempt's, matches none.
  const std::string job_credential = identities_.JobCredentialFor(rank->job_id, rank->attempt);
  const v1::PsRange* range = nullptr;
  for (const v1::PsRange& r : job->ps_placement()) {
    if (ConstantTimeEquals(DeriveServerCredential(job_credential, r.address()),
                           request->credential())) {
      range = &r;
      break;
    }
  }
  if (job->attempt() != rank->attempt || !IsActive(job->state())) {
    return Done(ctx, absl::FailedPreconditionError(absl::StrCat(
                         rank->job_id, " attempt ", rank->attempt, " is not running (attempt ",
                         job->attempt(), " is ", v1::JobState_Name(job->state()), ")")));
  }
  if (range == nullptr) {
    return refuse(
        absl::UnauthenticatedError(absl::StrCat("credential: not made for a parameter server of ",
                                                rank->job_id, " attempt ", rank->attempt)));
  }
  if (range->node_id() != caller->node) {
    return refuse(absl::PermissionDeniedError(
        absl::StrCat("credential: made for the parameter server at ", range->address(), " (node ",
                     range->node_id(), "), not node ", caller->node)));
  }
  response->set_job_id(rank->job_id);
  response->set_attempt(rank->attempt);
  return Done(ctx, absl::OkStatus());
}

// ---- RendezvousService ----

// Parses the scope and checks that the caller holds the job credential of that attempt.
#define TY_SCOPE_OR_FINISH(var, scope_msg)                                                       \
  auto var##_or = ParseScope(scope_msg);                                                         \
  if (!var##_or.ok()) return Done(ctx, var##_or.status());                                       \
  const ScopeId var = *var##_or;                                                                 \
  if (absl::Status auth = AuthenticateRank(ctx, identities_, __func__, var.job_id, var.attempt); \
      !auth.ok()) {                                                                              \
    return Done(ctx, auth);                                                                      \
  }

grpc::ServerUnaryReactor* RendezvousServiceImpl::Set(grpc::CallbackServerContext* ctx,
                                                     const v1::SetRequest* r, v1::SetResponse*) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
  return Done(ctx, rdzv_.Set(scope, r->key(), r->value()));
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Get(grpc::CallbackServerContext* ctx,
                                                     const v1::GetRequest* r,
                                                     v1::GetResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
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
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.Add(scope, r->key(), r->delta());
  if (v.ok()) response->set_value(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::CompareSet(grpc::CallbackServerContext* ctx,
                                                            const v1::CompareSetRequest* r,
                                                            v1::CompareSetResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.CompareSet(scope, r->key(), r->expected(), r->desired());
  if (v.ok()) response->set_value(*std::move(v));
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Check(grpc::CallbackServerContext* ctx,
                                                       const v1::CheckRequest* r,
                                                       v1::CheckResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKeys(rdzv_, r->keys()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.Check(scope, {r->keys().begin(), r->keys().end()});
  if (v.ok()) response->set_all_present(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::DeleteKey(grpc::CallbackServerContext* ctx,
                                                           const v1::DeleteKeyRequest* r,
                                                           v1::DeleteKeyResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
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
  if (absl::Status s = CheckKeys(rdzv_, r->keys()); !s.ok()) return Done(ctx, s);
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
  if (absl::Status s = CheckKey(rdzv_, r->name(), "name"); !s.ok()) return Done(ctx, s);
  auto timeout = ParseTimeout(r->timeout_ms());
  if (!timeout.ok()) return Done(ctx, timeout.status());
  auto* reactor = ctx->DefaultReactor();
  rdzv_.Barrier(scope, r->name(), r->rank(), r->world_size(), *timeout,
                [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); });
  return reactor;
}

#undef TY_SCOPE_OR_FINISH

// ---- IdentityService ----

grpc::ServerUnaryReactor* IdentityServiceImpl::WhoAmI(grpc::CallbackServerContext* ctx,
                                                      const v1::WhoAmIRequest*,
                                                      v1::WhoAmIResponse* response) {
  auto p = Authenticate(ctx, identities_);
  if (!p.ok()) return Done(ctx, Refused("WhoAmI", "anonymous", p.status()));
  response->set_user(p->user);
  response->set_role(p->kind == Principal::Kind::kJob ? v1::ROLE_UNSPECIFIED : p->role);
  response->set_node(p->node);
  response->set_job_id(p->job_id);
  response->set_attempt(p->attempt);
  response->set_token_id(p->token_id);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::CreateUser(grpc::CallbackServerContext* ctx,
                                                          const v1::CreateUserRequest* request,
                                                          v1::User* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities_, "CreateUser");
  if (!caller.ok()) return Done(ctx, caller.status());
  auto user = identities_.CreateUser(request->name(), request->role(), request->account());
  Audit(*caller, "CreateUser", request->name(), user.status());
  if (user.ok()) *response = *std::move(user);
  return Done(ctx, user.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::ListUsers(grpc::CallbackServerContext* ctx,
                                                         const v1::ListUsersRequest*,
                                                         v1::ListUsersResponse* response) {
  auto caller = AuthenticateAdmin(ctx, identities_, "ListUsers");
  if (!caller.ok()) return Done(ctx, caller.status());
  for (v1::User& u : identities_.ListUsers()) *response->add_users() = std::move(u);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::DisableUser(grpc::CallbackServerContext* ctx,
                                                           const v1::DisableUserRequest* request,
                                                           v1::User* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities_, "DisableUser");
  if (!caller.ok()) return Done(ctx, caller.status());
  auto user = identities_.SetDisabled(request->name(), !request->enable());
  Audit(*caller, request->enable() ? "EnableUser" : "DisableUser", request->name(), user.status());
  if (user.ok()) *response = *std::move(user);
  return Done(ctx, user.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::CreateToken(grpc::CallbackServerContext* ctx,
                                                           const v1::CreateTokenRequest* request,
                                                           v1::CreateTokenResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateUser(ctx, identities_, "CreateToken");
  if (!caller.ok()) return Done(ctx, caller.status());
  const std::string user = request->user().empty() ? caller->user : request->user();
  if (!caller->IsAdmin() && (user != caller->user || !request->node().empty())) {
    return Done(ctx, Refused("CreateToken", caller->Describe(),
                             absl::PermissionDeniedError(
                                 request->node().empty()
                                     ? absl::StrCat("user: only admins may create tokens for "
                                                    "another user (",
                                                    user, ")")
                                     : std::string("node: only admins may create node tokens"))));
  }
  auto token =
      identities_.CreateToken(user, request->node(), request->ttl_seconds(), request->description(),
                              {request->owners().begin(), request->owners().end()});
  // The token's id only: its secret goes to the caller and nowhere else.
  Audit(*caller, "CreateToken",
        absl::StrCat(user, request->node().empty() ? "" : " node " + request->node(), " ",
                     token.ok() ? token->info.id() : "-"),
        token.status());
  if (token.ok()) {
    response->set_token(token->text);
    *response->mutable_info() = token->info;
  }
  return Done(ctx, token.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::ListTokens(grpc::CallbackServerContext* ctx,
                                                          const v1::ListTokensRequest* request,
                                                          v1::ListTokensResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateUser(ctx, identities_, "ListTokens");
  if (!caller.ok()) return Done(ctx, caller.status());
  std::string user = request->user().empty() ? caller->user : request->user();
  if (request->all()) user.clear();
  if (!caller->IsAdmin() && user != caller->user) {
    return Done(
        ctx,
        Refused("ListTokens", caller->Describe(),
                absl::PermissionDeniedError("user: only admins may list other users' tokens")));
  }
  for (v1::TokenInfo& t : identities_.ListTokens(user)) *response->add_tokens() = std::move(t);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::RevokeToken(grpc::CallbackServerContext* ctx,
                                                           const v1::RevokeTokenRequest* request,
                                                           v1::TokenInfo* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateUser(ctx, identities_, "RevokeToken");
  if (!caller.ok()) return Done(ctx, caller.status());
  if (request->id().empty()) return Done(ctx, absl::InvalidArgumentError("id: required"));
  auto existing = identities_.GetToken(request->id());
  if (!existing.ok()) return Done(ctx, existing.status());
  if (!caller->IsAdmin() && existing->user() != caller->user) {
    // As for a token that does not exist: token ids are not to be found out by trying.
    Refused("RevokeToken", caller->Describe(),
            absl::PermissionDeniedError(absl::StrCat("the token belongs to ", existing->user())),
            request->id())
        .IgnoreError();
    return Done(ctx, absl::NotFoundError(absl::StrCat("id: no token ", request->id())));
  }
  auto token = identities_.RevokeToken(request->id());
  Audit(*caller, "RevokeToken", request->id(), token.status());
  if (token.ok()) *response = *std::move(token);
  return Done(ctx, token.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::UpdateUser(grpc::CallbackServerContext* ctx,
                                                          const v1::UpdateUserRequest* request,
                                                          v1::User* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities_, "UpdateUser");
  if (!caller.ok()) return Done(ctx, caller.status());
  auto user = identities_.UpdateUser(*request);
  Audit(*caller, "UpdateUser", request->name(), user.status());
  if (user.ok()) *response = *std::move(user);
  return Done(ctx, user.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::CreateAccount(
    grpc::CallbackServerContext* ctx, const v1::CreateAccountRequest* request,
    v1::Account* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities_, "CreateAccount");
  if (!caller.ok()) return Done(ctx, caller.status());
  auto account = identities_.CreateAccount(request->account());
  Audit(*caller, "CreateAccount", request->account().name(), account.status());
  if (account.ok()) *response = *std::move(account);
  return Done(ctx, account.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::UpdateAccount(
    grpc::CallbackServerContext* ctx, const v1::UpdateAccountRequest* request,
    v1::Account* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities_, "UpdateAccount");
  if (!caller.ok()) return Done(ctx, caller.status());
  auto account = identities_.UpdateAccount(request->account());
  Audit(*caller, "UpdateAccount", request->account().name(), account.status());
  if (account.ok()) *response = *std::move(account);
  return Done(ctx, account.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::DeleteAccount(
    grpc::CallbackServerContext* ctx, const v1::DeleteAccountRequest* request,
    v1::Account* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities_, "DeleteAccount");
  if (!caller.ok()) return Done(ctx, caller.status());
  auto account = identities_.DeleteAccount(request->name());
  Audit(*caller, "DeleteAccount", request->name(), account.status());
  if (account.ok()) *response = *std::move(account);
  return Done(ctx, account.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::ListAccounts(grpc::CallbackServerContext* ctx,
                                                            const v1::ListAccountsRequest*,
                                                            v1::ListAccountsResponse* response) {
  auto caller = AuthenticateUser(ctx, identities_, "ListAccounts");
  if (!caller.ok()) return Done(ctx, caller.status());
  for (v1::Account& a : identities_.ListAccounts()) *response->add_accounts() = std::move(a);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::DenyNode(grpc::CallbackServerContext* ctx,
                                                        const v1::DenyNodeRequest* request,
                                                        v1::DeniedNode* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities_, "DenyNode");
  if (!caller.ok()) return Done(ctx, caller.status());
  if (request->allow()) {
    const absl::Status allowed = identities_.AllowNode(request->node());
    Audit(*caller, "AllowNode", request->node(), allowed);
    if (allowed.ok()) response->set_node(request->node());
    return Done(ctx, allowed);
  }
  auto denied = identities_.DenyNode(request->node(), request->reason(), caller->user);
  Audit(*caller, "DenyNode", request->node(), denied.status());
  if (denied.ok()) *response = *std::move(denied);
  return Done(ctx, denied.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::ListDeniedNodes(
    grpc::CallbackServerContext* ctx, const v1::ListDeniedNodesRequest*,
    v1::ListDeniedNodesResponse* response) {
  auto caller = AuthenticateAdmin(ctx, identities_, "ListDeniedNodes");
  if (!caller.ok()) return Done(ctx, caller.status());
  for (v1::DeniedNode& n : identities_.ListDeniedNodes()) *response->add_nodes() = std::move(n);
  return Done(ctx, absl::OkStatus());
}

}  // namespace trainyard::coordinator
