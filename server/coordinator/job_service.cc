#include "server/coordinator/service_auth.h"
#include "server/coordinator/services.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/context_archive.h"
#include "common/failpoint.h"
#include "common/grpc_status.h"
#include "common/log_text.h"
#include "common/seq_filter.h"
#include "common/signal_names.h"
#include "common/status_macros.h"
#include "server/coordinator/job_state.h"

namespace trainyard::coordinator {
namespace {

// The largest cancel reason kept (it becomes the job's message).
constexpr size_t kMaxReasonBytes = 1024;
// The largest ListJobs page with why_waiting.
constexpr int kMaxWhyWaitingPage = 200;
// How far a stream's reader may fall behind what follows (beyond what was kept when it opened)
// before the stream ends, RESOURCE_EXHAUSTED: a reader that reads nothing held it all.
constexpr size_t kMaxStreamBacklogBytes = size_t{16} << 20;

// A user's streams are all open: the call's refusal.
grpc::Status NoStreamSlot(const char* method, const StreamSlots& slots) {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat(method, ": you have ", slots.per_user(),
                                   " streams open (watches, logs and metrics); close one first"));
}
// WatchJob: the job's state now, then each durable change, until a terminal state.
class WatchReactor final : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  WatchReactor(JobLifecycle& jobs, const std::string& job_id, std::shared_ptr<void> slot)
      : jobs_(jobs),
        slot_(std::move(slot)),
        queue_(std::make_shared<Queue>(this)),
        last_version_(std::make_shared<State>()) {
    queue_->LimitTo(kMaxStreamBacklogBytes);
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

  JobLifecycle& jobs_;
  const std::shared_ptr<void> slot_;  // one of the caller's StreamSlots
  std::shared_ptr<Queue> queue_;
  std::shared_ptr<State> last_version_;
  int64_t handle_ = 0;
};

// StreamLogs / StreamMetrics: the records kept so far, then (with follow) each new one until the
// job ends. A finished job no longer in memory has its records read from the store (`persisted`).
template <typename T>
class SeriesReactor final : public grpc::ServerWriteReactor<T> {
  using Queue = WriteQueue<grpc::ServerWriteReactor<T>, T>;
  // Whether the job has ended and the kept records are queued: the stream finishes once both.
  class EndGate {
   public:
    void Ended(Queue& queue) { Set(&ended_, queue); }
    void Queued(Queue& queue) { Set(&queued_, queue); }

   private:
    void Set(bool* flag, Queue& queue) {
      absl::MutexLock lock(&mu_);
      *flag = true;
      if (ended_ && queued_) queue.FinishWhenDrained(grpc::Status::OK);
    }
    absl::Mutex mu_;
    bool ended_ ABSL_GUARDED_BY(mu_) = false;
    bool queued_ ABSL_GUARDED_BY(mu_) = false;
  };

 public:
  SeriesReactor(JobLifecycle& jobs, JobSeries<T>& series, const std::string& job_id, size_t tail,
                bool follow, bool positions,
                std::function<absl::StatusOr<std::vector<T>>()> persisted,
                std::shared_ptr<void> slot)
      : jobs_(jobs),
        series_(series),
        slot_(std::move(slot)),
        queue_(std::make_shared<Queue>(this)) {
    v1::Job current;
    bool durable = false;
    // The job's durable end ends the stream, once what was kept is queued: the end's notice can
    // come while the kept records are being queued below (it ended the stream at once, and a
    // reader of a job that had just ended got part of its records, or none, and OK).
    auto end = std::make_shared<EndGate>();
    auto watch = jobs_.Watch(
        job_id,
        [queue = queue_, end](const v1::Job& job) {
          if (IsTerminal(job.state())) end->Ended(*queue);
        },
        &current, &durable);
    if (!watch.ok()) {
      queue_->FinishWhenDrained(ToGrpcStatus(watch.status()));
      return;
    }
    watch_ = *watch;
    Failpoint("series-replay");  // (tests: the end's notice while the records are queued)
    // The kept records, then every later one, in order.
    size_t kept = 0;
    // With a tail, where what it leaves out ends, before it (StreamLogsRequest.positions): so that
    // they reach the reader before the tail does (a reader that falls behind loses what is still
    // queued, and reads again from the first line).
    std::function<void(const SeqFilter::Last&)> push_positions;
    if constexpr (std::is_same_v<T, v1::LogLine>) {
      if (positions && tail > 0) {
        push_positions = [queue = queue_](const SeqFilter::Last& last) {
          for (const auto& [key, seq] : last) {
            if (seq <= 0) continue;  // (nothing before it)
            v1::LogLine position;
            position.set_attempt(key.first);
            position.set_rank(key.second);
            position.set_seq(seq);
            position.set_position(true);
            queue->Push(position);
          }
        };
      }
    }
    subscription_ = series_.Subscribe(
        job_id, tail,
        [queue = queue_](const std::vector<T>& records) {
          for (const T& r : records) queue->Push(r);
        },
        &kept, push_positions);
    // Memory forgets a job before its records: no records and no job means they are in the store.
    if (kept == 0 && IsTerminal(current.state()) && !jobs_.IsResident(job_id)) {
      absl::StatusOr<std::vector<T>> records = persisted();
      if (!records.ok()) {
        queue_->FinishWhenDrained(ToGrpcStatus(records.status()));
        return;
      }
      const size_t skip = tail == 0 || tail >= records->size() ? 0 : records->size() - tail;
      if (push_positions) {
        SeqFilter taken;
        for (const T& r : *records) taken.Take(r);
        push_positions(TailPositions(*records, skip, taken.last()));
      }
      for (size_t i = skip; i < records->size(); ++i) queue_->Push((*records)[i]);
    }
    queue_->LimitTo(kMaxStreamBacklogBytes);  // (what was kept is queued whole)
    if (!follow || (durable && IsTerminal(current.state()))) {
      queue_->FinishWhenDrained(grpc::Status::OK);
    }
    end->Queued(*queue_);
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
  JobLifecycle& jobs_;
  JobSeries<T>& series_;
  const std::shared_ptr<void> slot_;  // one of the caller's StreamSlots
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
    if (!ReadAt(file_fd_, offset_, want, chunk_.mutable_data())) {
      Finish(grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("the export's ", name, " changed while read")));
      return;
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

// UploadContext: the chunks of one archive, checked against the first chunk's digest and size,
// then stored for the caller (the store's write waits on the gRPC thread that read the last
// chunk: once an upload).
class UploadContextReactor final : public grpc::ServerReadReactor<v1::ContextChunk> {
 public:
  static constexpr size_t kMaxChunkBytes = size_t{1} << 20;

  UploadContextReactor(ContextStore& contexts, Principal caller,
                       v1::UploadContextResponse* response, std::shared_ptr<void> slot)
      : contexts_(contexts),
        caller_(std::move(caller)),
        response_(response),
        slot_(std::move(slot)) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client has sent everything (or went away: then Finish goes nowhere)
      Complete();
      return;
    }
    if (first_) {
      first_ = false;
      digest_ = chunk_.digest();
      size_ = chunk_.size_bytes();
      if (!IsContextDigest(digest_)) {
        digest_ = std::string(Utf8Prefix(digest_, 80));  // (the audit's target: not megabytes)
        return Refuse(absl::InvalidArgumentError(
            absl::StrCat("digest: expected sha256: and 64 lowercase hex digits, got '",
                         EscapeControl(digest_), "'")));
      }
      if (size_ <= 0 || size_ > kMaxContextArchiveBytes) {
        return Refuse(absl::InvalidArgumentError(
            absl::StrCat("size_bytes: ", size_, ", expected 1..", kMaxContextArchiveBytes,
                         " (a context holds at most 64 MiB of files)")));
      }
      archive_.reserve(static_cast<size_t>(size_));
    } else if (!chunk_.digest().empty() || chunk_.size_bytes() != 0) {
      return Refuse(absl::InvalidArgumentError("digest, size_bytes: only in the first chunk"));
    }
    if (chunk_.data().size() > kMaxChunkBytes ||
        archive_.size() + chunk_.data().size() > static_cast<size_t>(size_)) {
      return Refuse(absl::InvalidArgumentError(
          absl::StrCat("data: more than the ", size_, " bytes of size_bytes (or a chunk over ",
                       kMaxChunkBytes, ")")));
    }
    archive_ += chunk_.data();
    StartRead(&chunk_);
  }
  void OnDone() override { delete this; }

 private:
  void Refuse(absl::Status status) {
    Audit(caller_, "UploadContext", digest_.empty() ? "-" : digest_, status);
    Finish(ToGrpcStatus(status));
  }
  void Complete() {
    if (first_ || archive_.size() != static_cast<size_t>(size_)) {
      return Refuse(absl::InvalidArgumentError(
          absl::StrCat("data: ", archive_.size(), " bytes arrived, size_bytes said ", size_)));
    }
    if (ContextDigest(archive_) != digest_) {
      return Refuse(absl::InvalidArgumentError(absl::StrCat(
          "digest: the bytes' digest is ", ContextDigest(archive_), ", not ", digest_)));
    }
    absl::StatusOr<int64_t> expires = contexts_.Put(caller_.user, digest_, archive_);
    Audit(caller_, "UploadContext", digest_, expires.status());
    if (expires.ok()) {
      response_->set_context(digest_);
      response_->set_size_bytes(size_);
      response_->set_expires_ms(*expires);
    }
    Finish(ToGrpcStatus(expires.status()));
  }

  ContextStore& contexts_;
  const Principal caller_;
  v1::UploadContextResponse* response_;
  const std::shared_ptr<void> slot_;  // one of the caller's upload slots
  v1::ContextChunk chunk_;
  bool first_ = true;
  std::string digest_;
  int64_t size_ = 0;
  std::string archive_;
};

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
  // A context is one the submitter uploaded (never another user's, whatever its digest).
  if (const std::string& context = request->spec().context(); !context.empty()) {
    absl::Status s =
        IsContextDigest(context)
            ? contexts_.Claim(user->user, context)
            : absl::InvalidArgumentError(absl::StrCat(
                  "context: the uploaded context's sha256:<64 hex>, got '",
                  EscapeControl(context.substr(0, 80)), "' (yard submit --context DIR)"));
    if (!s.ok()) {
      Audit(*user, "SubmitJob", "-", s);
      return Done(ctx, s);
    }
  }
  auto* reactor = ctx->DefaultReactor();
  jobs_.Submit(user->user, request->spec(), request->request_id(),
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
    response->set_why_waiting(usage_.WhyWaiting(response->id(), caller.user, caller.IsAdmin()));
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
  // (Each job's reason looks at the whole queue: a page of them is bounded.)
  if (request->why_waiting() && request->page_size() > kMaxWhyWaitingPage) {
    return Done(ctx, absl::InvalidArgumentError(
                         absl::StrCat("page_size: at most ", kMaxWhyWaitingPage,
                                      " with why_waiting, got ", request->page_size())));
  }
  auto result = jobs_.List(scoped);
  if (result.ok()) {
    for (auto& job : result->jobs) {
      v1::Job* out = response->add_jobs();
      *out = std::move(job);
      if (request->why_waiting() && IsPending(out->state())) {
        out->set_why_waiting(usage_.WhyWaiting(out->id(), caller->user, caller->IsAdmin()));
      }
    }
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
  std::shared_ptr<void> slot = streams_.Take(caller.user);
  if (slot == nullptr) return RejectStream<v1::JobEvent>(NoStreamSlot("WatchJob", streams_));
  return new WatchReactor(jobs_, request->job_id(), std::move(slot));
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
  std::shared_ptr<void> slot = streams_.Take(caller.user);
  if (slot == nullptr) return RejectStream<v1::LogLine>(NoStreamSlot("StreamLogs", streams_));
  return new SeriesReactor<v1::LogLine>(
      jobs_, logs_, request->job_id(), static_cast<size_t>(request->tail()), request->follow(),
      request->positions(), [this, id = request->job_id()] { return history_.Logs(id); },
      std::move(slot));
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

grpc::ServerReadReactor<v1::ContextChunk>* JobServiceImpl::UploadContext(
    grpc::CallbackServerContext* ctx, v1::UploadContextResponse* response) {
  // A reactor that refuses at once (nothing read).
  class Refuse final : public grpc::ServerReadReactor<v1::ContextChunk> {
   public:
    explicit Refuse(grpc::Status s) { Finish(s); }
    void OnDone() override { delete this; }
  };
  auto caller = AuthenticateUser(ctx, identities_, "UploadContext");
  if (!caller.ok()) return new Refuse(ToGrpcStatus(caller.status()));
  std::shared_ptr<void> slot = uploads_.Take(caller->user);
  if (slot == nullptr) {
    const absl::Status refused = absl::ResourceExhaustedError(
        absl::StrCat("UploadContext: you have ", uploads_.per_user(),
                     " uploads under way; send this one when one of them has ended"));
    Audit(*caller, "UploadContext", "-", refused);
    return new Refuse(ToGrpcStatus(refused));
  }
  return new UploadContextReactor(contexts_, *std::move(caller), response, std::move(slot));
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
  std::shared_ptr<void> slot = streams_.Take(caller.user);
  if (slot == nullptr) {
    return RejectStream<v1::StepReport>(NoStreamSlot("StreamMetrics", streams_));
  }
  return new SeriesReactor<v1::StepReport>(
      jobs_, metrics_, request->job_id(), 0, request->follow(), /*positions=*/false,
      [this, id = request->job_id()] { return history_.Metrics(id); }, std::move(slot));
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

// The job's owner and admins (AccessibleJob); every attempt at it audited, refusals included.
grpc::ServerUnaryReactor* JobServiceImpl::SignalJob(grpc::CallbackServerContext* ctx,
                                                    const v1::SignalJobRequest* request,
                                                    v1::Job* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  Principal caller;
  auto job = AccessibleJob(ctx, request->job_id(), "SignalJob", &caller);
  if (!job.ok()) return Done(ctx, job.status());
  const std::string signal = CanonicalSignalName(request->signal());
  const std::string subject =
      absl::StrCat(request->job_id(), " SIG", signal.empty() ? std::string("?") : signal);
  if (signal.empty()) {
    job = absl::InvalidArgumentError(absl::StrCat("signal: '",
                                                  EscapeControl(request->signal().substr(0, 32)),
                                                  "' is not one of ", SignalNamesText()));
  } else {
    job = jobs_.Signal(request->job_id(), signal);
  }
  Audit(caller, "SignalJob", subject, job.status());
  if (job.ok()) *response = *std::move(job);
  return Done(ctx, job.status());
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
  *response = usage_.Quota(user, request->all_accounts());
  return Done(ctx, absl::OkStatus());
}

}  // namespace trainyard::coordinator
