// EventQueue: a live stream's server-sent events, from the web console's producer threads (gRPC
// streams of the coordinator) to the HTTP thread writing them to the browser. Bounded by events
// and by bytes: a reader slower than the cluster holds its producers back (and they, the
// coordinator's stream, which ends a reader that falls far behind), so that a slow browser holds
// at most max_bytes (plus one event) here and max_take in the writer's hands. Closed: the reader
// is gone (producers stop); ended: the producers are done (the reader drains it, then ends the
// response). Thread-safe.
#ifndef TRAINYARD_SERVER_WEB_EVENT_QUEUE_H_
#define TRAINYARD_SERVER_WEB_EVENT_QUEUE_H_

#include <cstddef>
#include <deque>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace trainyard::web {

class EventQueue {
 public:
  static constexpr size_t kMaxEvents = 20000;
  static constexpr size_t kMaxBytes = size_t{4} << 20;
  static constexpr size_t kMaxTake = size_t{1} << 20;

  EventQueue(size_t max_events = kMaxEvents, size_t max_bytes = kMaxBytes,
             size_t max_take = kMaxTake)
      : max_events_(max_events), max_bytes_(max_bytes), max_take_(max_take) {}

  // Queues one server-sent event, waiting while max_events or max_bytes wait; false once closed
  // or sealed.
  bool Push(absl::string_view event, absl::string_view data) {
    absl::MutexLock lock(&mu_);
    auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return closed_ || sealed_ || (queue_.size() < max_events_ && bytes_ < max_bytes_);
    };
    ++waiting_;
    mu_.Await(absl::Condition(&room));
    --waiting_;
    if (closed_ || sealed_) return false;
    queue_.push_back(absl::StrCat("event: ", event, "\ndata: ", data, "\n\n"));
    bytes_ += queue_.back().size();
    return true;
  }

  // Waits up to `timeout` for events; moves them to `out`, up to max_take bytes (and at least
  // one event). False once closed, or ended and drained: nothing more will come.
  bool Take(std::string* out, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !queue_.empty() || closed_ || ended_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    size_t taken = 0;
    while (!queue_.empty() && (taken == 0 || taken + queue_.front().size() <= max_take_)) {
      taken += queue_.front().size();
      bytes_ -= queue_.front().size();
      out->append(queue_.front());
      queue_.pop_front();
    }
    return !closed_ && !(ended_ && queue_.empty());
  }

  // Queues a last event (the stream's refusal) and ends the queue: nothing pushed after it is
  // queued (Push returns false), and the reader ends once it has taken it.
  void Seal(absl::string_view event, absl::string_view data) {
    absl::MutexLock lock(&mu_);
    if (closed_ || sealed_ || ended_) return;  // (ended: its end was said already)
    queue_.push_back(absl::StrCat("event: ", event, "\ndata: ", data, "\n\n"));
    bytes_ += queue_.back().size();
    sealed_ = ended_ = true;
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  void End() {
    absl::MutexLock lock(&mu_);
    ended_ = true;
  }
  bool closed() {
    absl::MutexLock lock(&mu_);
    return closed_;
  }
  // Sleeps up to `d`, less when closed.
  void Sleep(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closed_; };
    mu_.AwaitWithTimeout(absl::Condition(&done), d);
  }
  // The bytes of the events waiting.
  size_t bytes() {
    absl::MutexLock lock(&mu_);
    return bytes_;
  }
  // Waits up to `timeout` until `n` producers wait in Push (tests).
  bool AwaitWaitingProducers(int n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto waiting = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiting_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&waiting), timeout);
  }

 private:
  const size_t max_events_;
  const size_t max_bytes_;
  const size_t max_take_;
  absl::Mutex mu_;
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;  // producers waiting in Push
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool sealed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace trainyard::web

#endif  // TRAINYARD_SERVER_WEB_EVENT_QUEUE_H_
