// Rendezvous: a key-value store with blocking reads and barriers, one namespace per job attempt,
// through which the ranks of an attempt find each other (a c10d::Store on the trainer side).
// The JobManager opens a scope when it places an attempt and closes it when the attempt ends;
// closing fails the scope's waiters with ABORTED. Blocking calls complete through callbacks, so
// gRPC threads never block. Timeouts run on real time, on a timer thread owned here.
//
// Thread-safe. Callbacks run on the calling thread or the timer thread, never under mu_.
#ifndef TRAINYARD_SERVER_COORDINATOR_RENDEZVOUS_H_
#define TRAINYARD_SERVER_COORDINATOR_RENDEZVOUS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace trainyard::coordinator {

struct ScopeId {
  std::string job_id;
  int attempt = 0;
  bool operator<(const ScopeId& o) const {
    return job_id != o.job_id ? job_id < o.job_id : attempt < o.attempt;
  }
};

// What one attempt may hold; the ranks of a job hold its credential, and so can its owner.
struct RendezvousLimits {
  int64_t max_key_bytes = 512;        // keys and barrier names
  int64_t max_value_bytes = 1 << 20;  // one value
  int64_t max_keys = 10'000;          // keys plus barriers
  int64_t max_bytes = 16 << 20;       // keys and values together
  int64_t max_waiters = 10'000;       // blocked Get, Wait and Barrier calls
};

class Rendezvous {
 public:
  using ValueCallback = std::function<void(absl::StatusOr<std::string>)>;
  using DoneCallback = std::function<void(absl::Status)>;

  // Over a limit: INVALID_ARGUMENT for a key, name or value longer than allowed, and
  // RESOURCE_EXHAUSTED naming the limit's flag for a scope that holds too many keys or bytes or
  // waiters.
  explicit Rendezvous(RendezvousLimits limits = {});
  ~Rendezvous();  // fails every waiter with UNAVAILABLE and joins the timer thread

  const RendezvousLimits& limits() const { return limits_; }

  void OpenScope(const ScopeId& scope);
  void CloseScope(const ScopeId& scope);

  // Every call below fails with FAILED_PRECONDITION if the scope is not open.
  absl::Status Set(const ScopeId& scope, const std::string& key, std::string value);
  // Calls `done` with the value once `key` exists; DEADLINE_EXCEEDED after `timeout`.
  void Get(const ScopeId& scope, const std::string& key, absl::Duration timeout,
           ValueCallback done);
  // Adds `delta` to the integer stored at `key` (absent = 0) and returns the sum; the value is
  // kept as decimal text, as c10d's stores do. INVALID_ARGUMENT if the value is not an integer.
  absl::StatusOr<int64_t> Add(const ScopeId& scope, const std::string& key, int64_t delta);
  // Stores `desired` if the current value equals `expected` (absent matches ""); returns the
  // value now stored.
  absl::StatusOr<std::string> CompareSet(const ScopeId& scope, const std::string& key,
                                         const std::string& expected, std::string desired);
  absl::StatusOr<bool> Check(const ScopeId& scope, const std::vector<std::string>& keys);
  absl::StatusOr<bool> DeleteKey(const ScopeId& scope, const std::string& key);
  absl::StatusOr<int64_t> NumKeys(const ScopeId& scope);
  // Calls `done` once every key exists; DEADLINE_EXCEEDED after `timeout`.
  void Wait(const ScopeId& scope, std::vector<std::string> keys, absl::Duration timeout,
            DoneCallback done);
  // Calls `done` once `world_size` distinct ranks entered barrier `name`; a barrier that already
  // completed returns at once. INVALID_ARGUMENT for a rank outside [0, world_size) or a
  // world_size that differs from the barrier's first caller's.
  void Barrier(const ScopeId& scope, const std::string& name, int rank, int world_size,
               absl::Duration timeout, DoneCallback done);

 private:
  struct Waiter {
    std::vector<std::string> keys;  // Get: one key; Wait: all keys
    ValueCallback on_value;         // Get
    DoneCallback on_done;           // Wait and Barrier
    absl::Time deadline;
    std::string barrier;  // non-empty for a barrier waiter
  };
  struct BarrierState {
    int world_size = 0;
    std::set<int> ranks;
    bool complete = false;
  };
  struct Scope {
    std::map<std::string, std::string> kv;
    int64_t bytes = 0;  // of kv's keys and values
    std::map<std::string, BarrierState> barriers;
    std::map<int64_t, Waiter> waiters;  // by waiter id
  };
  // A callback to run after mu_ is released.
  using Deferred = std::function<void()>;

  Scope* FindScope(const ScopeId& scope) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores key = value within the limits.
  absl::Status Put(const ScopeId& scope_id, Scope& scope, const std::string& key, std::string value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckKeyLength(const char* field, const std::string& key) const;
  absl::Status CheckRoomForWaiter(const ScopeId& scope_id, const Scope& scope) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes the waiters of `scope` that the current keys satisfy.
  void Wake(Scope& scope, std::vector<Deferred>& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddWaiter(const ScopeId& scope_id, Scope& scope, Waiter waiter)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static Deferred Fail(Waiter& waiter, absl::Status status);
  void TimerLoop();
  bool TimerShouldWake() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RendezvousLimits limits_;
  absl::Mutex mu_;
  std::map<ScopeId, Scope> scopes_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, std::pair<ScopeId, int64_t>> deadlines_ ABSL_GUARDED_BY(mu_);
  int64_t next_waiter_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time wake_at_ ABSL_GUARDED_BY(mu_);  // when the timer thread wakes next
  std::thread timer_;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_RENDEZVOUS_H_
