// What every gRPC adapter of the coordinator shares: who the caller is (a user, an admin, a
// node, the ranks of one attempt), the audit line of what it did, the request size limits, and
// the plumbing of streaming replies. The adapters (job_service.cc, trainer_service.cc,
// node_service.cc, rendezvous_service.cc, identity_service.cc) call these and the managers only.
#pragma once

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/coordinator_endpoints.h"
#include "google/protobuf/message.h"
#include "server/coordinator/identity.h"

namespace trainyard::coordinator {

// Finishes a unary call with `status` and returns its reactor.
grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const absl::Status& status);

// The principal of the call's "authorization: Bearer <credential>" metadata.
absl::StatusOr<Principal> Authenticate(grpc::CallbackServerContext* ctx,
                                       const IdentityRegistry& identities);

// Audits a refusal and passes it on.
absl::Status Refused(const char* method, const std::string& who, absl::Status status,
                     const std::string& target = "");

// Every field of a request within the default FieldLimits (strings 4096 bytes, lists 1024
// entries, 256 KiB in all): INVALID_ARGUMENT naming the field.
absl::Status CheckRequest(const google::protobuf::Message& request);

// A user's (or admin's) API token: node tokens and job credentials may not make user calls.
absl::StatusOr<Principal> AuthenticateUser(grpc::CallbackServerContext* ctx,
                                           const IdentityRegistry& identities, const char* method);

// A user's API token with the admin role.
absl::StatusOr<Principal> AuthenticateAdmin(grpc::CallbackServerContext* ctx,
                                            const IdentityRegistry& identities, const char* method);

// The ranks of one attempt, with that attempt's job credential.
absl::Status AuthenticateRank(grpc::CallbackServerContext* ctx, const IdentityRegistry& identities,
                              const char* method, const std::string& job_id, int32_t attempt);

// A node: by its node token, or with `certificates` (mutual TLS) by its verified client
// certificate, whose common name is the node id (a token, if also sent, must name the same
// node). For `node_id` (when not empty) only if that is the node.
absl::StatusOr<Principal> AuthenticateNode(grpc::CallbackServerContext* ctx,
                                           const IdentityRegistry& identities, const char* method,
                                           const std::string& node_id, bool certificates = false);

// What a call that changes something did, and for whom.
void Audit(const Principal& who, const char* method, const std::string& target,
           const absl::Status& result);

// Serializes writes on a streaming reactor: gRPC allows one write in flight at a time. Shared
// (by shared_ptr) between the reactor and the producers that outlive it; Close() cuts them off
// when the reactor is done. Thread-safe.
template <typename Reactor, typename Message>
class WriteQueue {
 public:
  explicit WriteQueue(Reactor* reactor) : reactor_(reactor) {}

  // Queues `message`; false once the stream is finishing or closed. Past the limit (LimitTo) the
  // stream ends instead, RESOURCE_EXHAUSTED: its reader is too slow (or reads nothing).
  bool Push(Message message) {
    absl::MutexLock lock(&mu_);
    if (reactor_ == nullptr || finish_.has_value() || finished_) return false;
    const size_t bytes = message.ByteSizeLong();
    if (max_bytes_ > 0 && queued_bytes_ + bytes > max_bytes_) {
      while (queue_.size() > (writing_ ? 1u : 0u)) {  // (the one in flight stays until it is done)
        queued_bytes_ -= queue_.back().ByteSizeLong();
        queue_.pop_back();
      }
      finish_ = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                             absl::StrCat(kFellBehind, max_bytes_ >> 20,
                                          " MiB behind; read it again from where it stopped"));
      if (!writing_) {
        finished_ = true;
        reactor_->Finish(*finish_);
      }
      return false;
    }
    queued_bytes_ += bytes;
    queue_.push_back(std::move(message));
    if (!writing_) {
      writing_ = true;
      reactor_->StartWrite(&queue_.front());
    }
    return true;
  }

  // At most `bytes` more queued than now (0: no limit, the default): for a stream that follows
  // what comes, once what was kept is queued.
  // The allowance shrinks back to `bytes` as what was queued before drains.
  void LimitTo(size_t bytes) {
    absl::MutexLock lock(&mu_);
    max_bytes_ = queued_bytes_ + bytes;
    extra_bytes_ = bytes;
  }

  // From the reactor's OnWriteDone.
  void OnWriteDone(bool ok) {
    absl::MutexLock lock(&mu_);
    queued_bytes_ -= queue_.front().ByteSizeLong();
    queue_.pop_front();
    if (extra_bytes_ > 0) max_bytes_ = std::min(max_bytes_, queued_bytes_ + extra_bytes_);
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
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t max_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t extra_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // LimitTo's
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// The streams a user holds open at once (logs, metrics, watches): each holds a reactor and its
// queue, so a cap per user keeps one user from holding the coordinator's memory. Thread-safe.
class StreamSlots {
 public:
  explicit StreamSlots(int per_user) : state_(std::make_shared<State>()), per_user_(per_user) {}
  int per_user() const { return per_user_; }
  // One of `user`'s slots, given back when the last copy of the handle goes; null when `user`
  // holds all theirs.
  std::shared_ptr<void> Take(const std::string& user) {
    absl::MutexLock lock(&state_->mu);
    int& open = state_->open[user];
    if (open >= per_user_) return nullptr;
    ++open;
    return std::shared_ptr<void>(state_.get(), [state = state_, user](void*) {
      absl::MutexLock lock(&state->mu);
      if (--state->open[user] <= 0) state->open.erase(user);
    });
  }

 private:
  struct State {
    absl::Mutex mu;
    std::map<std::string, int> open ABSL_GUARDED_BY(mu);
  };
  const std::shared_ptr<State> state_;
  const int per_user_;
};

// Reads `n` bytes at `offset` of `fd` into `out` (resized to n), retrying short reads and EINTR;
// false if the file ends first or a read fails. For streams of a file's chunks.
bool ReadAt(int fd, int64_t offset, int64_t n, std::string* out);

// A stream refused before it started: finishes with `status` at once.
template <typename T>
grpc::ServerWriteReactor<T>* RejectStream(grpc::Status status) {
  class Rejected final : public grpc::ServerWriteReactor<T> {
   public:
    explicit Rejected(grpc::Status s) { this->Finish(std::move(s)); }
    void OnDone() override { delete this; }
  };
  return new Rejected(std::move(status));
}

}  // namespace trainyard::coordinator
