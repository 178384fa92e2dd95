#include "server/coordinator/rendezvous.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace trainyard::coordinator {
namespace {

absl::Status NotOpen(const ScopeId& scope) {
  return absl::FailedPreconditionError(
      absl::StrCat("job ", scope.job_id, " attempt ", scope.attempt, " is not running"));
}

void RunAll(std::vector<std::function<void()>>& deferred) {
  for (auto& f : deferred) f();
}

}  // namespace

Rendezvous::Rendezvous(RendezvousLimits limits)
    : limits_(limits), timer_([this] { TimerLoop(); }) {}

absl::Status Rendezvous::CheckKeyLength(const char* field, const std::string& key) const {
  if (static_cast<int64_t>(key.size()) > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", key.size(), " bytes, at most ", limits_.max_key_bytes));
  }
  return absl::OkStatus();
}

absl::Status Rendezvous::Put(const ScopeId& scope_id, Scope& scope, const std::string& key,
                             std::string value) {
  RETURN_IF_ERROR(CheckKeyLength("key", key));
  if (static_cast<int64_t>(value.size()) > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: ", value.size(), " bytes, at most ", limits_.max_value_bytes));
  }
  auto it = scope.kv.find(key);
  const int64_t keys = static_cast<int64_t>(scope.kv.size() + scope.barriers.size()) +
                       (it == scope.kv.end() ? 1 : 0);
  const int64_t bytes = scope.bytes + static_cast<int64_t>(value.size()) +
                        (it == scope.kv.end() ? static_cast<int64_t>(key.size())
                                              : -static_cast<int64_t>(it->second.size()));
  if (keys > limits_.max_keys) {
    return absl::ResourceExhaustedError(absl::StrCat("key: job ", scope_id.job_id, " attempt ",
                                                     scope_id.attempt, " holds ", keys - 1,
                                                     " keys, its cap (--rendezvous-max-keys)"));
  }
  if (bytes > limits_.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("value: job ", scope_id.job_id, " attempt ", scope_id.attempt, " would hold ",
                     bytes, " bytes of keys and values, over its cap of ", limits_.max_bytes,
                     " (--rendezvous-max-bytes)"));
  }
  scope.bytes = bytes;
  if (it == scope.kv.end()) {
    scope.kv.emplace(key, std::move(value));
  } else {
    it->second = std::move(value);
  }
  return absl::OkStatus();
}

absl::Status Rendezvous::CheckRoomForWaiter(const ScopeId& scope_id, const Scope& scope) const {
  if (static_cast<int64_t>(scope.waiters.size()) >= limits_.max_waiters) {
    return absl::ResourceExhaustedError(absl::StrCat("job ", scope_id.job_id, " attempt ",
                                                     scope_id.attempt, " has ", limits_.max_waiters,
                                                     " calls waiting already, its cap"));
  }
  return absl::OkStatus();
}

Rendezvous::~Rendezvous() {
  std::vector<Deferred> deferred;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, scope] : scopes_) {
      for (auto& [wid, w] : scope.waiters) {
        deferred.push_back(Fail(w, absl::UnavailableError("the coordinator is shutting down")));
      }
    }
    scopes_.clear();
    deadlines_.clear();
  }
  timer_.join();
  RunAll(deferred);
}

Rendezvous::Scope* Rendezvous::FindScope(const ScopeId& scope) {
  auto it = scopes_.find(scope);
  return it == scopes_.end() ? nullptr : &it->second;
}

void Rendezvous::OpenScope(const ScopeId& scope) {
  absl::MutexLock lock(&mu_);
  scopes_.try_emplace(scope);
}

void Rendezvous::CloseScope(const ScopeId& scope_id) {
  std::vector<Deferred> deferred;
  {
    absl::MutexLock lock(&mu_);
    Scope* scope = FindScope(scope_id);
    if (scope == nullptr) return;
    for (auto& [wid, w] : scope->waiters) {
      deferred.push_back(
          Fail(w, absl::AbortedError(absl::StrCat("job ", scope_id.job_id, " attempt ",
                                                  scope_id.attempt, " ended"))));
    }
    scopes_.erase(scope_id);
  }
  RunAll(deferred);
}

Rendezvous::Deferred Rendezvous::Fail(Waiter& w, absl::Status status) {
  if (w.on_value) return [cb = std::move(w.on_value), status] { cb(status); };
  return [cb = std::move(w.on_done), status] { cb(status); };
}

void Rendezvous::Wake(Scope& scope, std::vector<Deferred>& out) {
  for (auto it = scope.waiters.begin(); it != scope.waiters.end();) {
    Waiter& w = it->second;
    bool ready = true;
    if (!w.barrier.empty()) {
      ready = scope.barriers[w.barrier].complete;
    } else {
      for (const auto& k : w.keys) {
        if (scope.kv.count(k) == 0) {
          ready = false;
          break;
        }
      }
    }
    if (!ready) {
      ++it;
      continue;
    }
    if (w.on_value) {
      out.push_back([cb = std::move(w.on_value), v = scope.kv[w.keys[0]]] { cb(v); });
    } else {
      out.push_back([cb = std::move(w.on_done)] { cb(absl::OkStatus()); });
    }
    it = scope.waiters.erase(it);  // its deadline entry is skipped when it fires
  }
}

void Rendezvous::AddWaiter(const ScopeId& scope_id, Scope& scope, Waiter waiter) {
  const int64_t id = next_waiter_id_++;
  deadlines_.emplace(waiter.deadline, std::make_pair(scope_id, id));
  scope.waiters.emplace(id, std::move(waiter));
}

absl::Status Rendezvous::Set(const ScopeId& scope_id, const std::string& key, std::string value) {
  std::vector<Deferred> deferred;
  {
    absl::MutexLock lock(&mu_);
    Scope* scope = FindScope(scope_id);
    if (scope == nullptr) return NotOpen(scope_id);
    RETURN_IF_ERROR(Put(scope_id, *scope, key, std::move(value)));
    Wake(*scope, deferred);
  }
  RunAll(deferred);
  return absl::OkStatus();
}

void Rendezvous::Get(const ScopeId& scope_id, const std::string& key, absl::Duration timeout,
                     ValueCallback done) {
  absl::StatusOr<std::string> result;
  {
    absl::MutexLock lock(&mu_);
    Scope* scope = FindScope(scope_id);
    if (scope == nullptr) {
      result = NotOpen(scope_id);
    } else if (auto it = scope->kv.find(key); it != scope->kv.end()) {
      result = it->second;
    } else if (absl::Status room = CheckRoomForWaiter(scope_id, *scope); !room.ok()) {
      result = room;
    } else {
      Waiter w;
      w.keys = {key};
      w.on_value = std::move(done);
      w.deadline = absl::Now() + timeout;
      AddWaiter(scope_id, *scope, std::move(w));
      return;
    }
  }
  done(std::move(result));
}

absl::StatusOr<int64_t> Rendezvous::Add(const ScopeId& scope_id, const std::string& key,
                                        int64_t delta) {
  std::vector<Deferred> deferred;
  int64_t value = 0;
  {
    absl::MutexLock lock(&mu_);
    Scope* scope = FindScope(scope_id);
    if (scope == nullptr) return NotOpen(scope_id);
    auto it = scope->kv.find(key);
    if (it != scope->kv.end() && !it->second.empty() && !absl::SimpleAtoi(it->second, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("key: the value of '", key, "' is not an integer"));
    }
    value += delta;
    RETURN_IF_ERROR(Put(scope_id, *scope, key, absl::StrCat(value)));
    Wake(*scope, deferred);
  }
  RunAll(deferred);
  return value;
}

absl::StatusOr<std::string> Rendezvous::CompareSet(const ScopeId& scope_id, const std::string& key,
                                                   const std::string& expected,
                                                   std::string desired) {
  std::vector<Deferred> deferred;
  std::string now;
  {
    absl::MutexLock lock(&mu_);
    Scope* scope = FindScope(scope_id);
    if (scope == nullptr) return NotOpen(scope_id);
    auto it = scope->kv.find(key);
    const std::string current = it == scope->kv.end() ? std::string() : it->second;
    if (current == expected) {
      RETURN_IF_ERROR(Put(scope_id, *scope, key, std::move(desired)));
      Wake(*scope, deferred);
    }
    auto stored = scope->kv.find(key);
    now = stored != scope->kv.end() ? stored->second : std::string();
  }
  RunAll(deferred);
  return now;
}

absl::StatusOr<bool> Rendezvous::Check(const ScopeId& scope_id,
                                       const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  Scope* scope = FindScope(scope_id);
  if (scope == nullptr) return NotOpen(scope_id);
  for (const auto& k : keys) {
    if (scope->kv.count(k) == 0) return false;
  }
  return true;
}

absl::StatusOr<bool> Rendezvous::DeleteKey(const ScopeId& scope_id, const std::string& key) {
  absl::MutexLock lock(&mu_);
  Scope* scope = FindScope(scope_id);
  if (scope == nullptr) return NotOpen(scope_id);
  auto it = scope->kv.find(key);
  if (it == scope->kv.end()) return false;
  scope->bytes -= static_cast<int64_t>(it->first.size() + it->second.size());
  scope->kv.erase(it);
  return true;
}

absl::StatusOr<int64_t> Rendezvous::NumKeys(const ScopeId& scope_id) {
  absl::MutexLock lock(&mu_);
  Scope* scope = FindScope(scope_id);
  if (scope == nullptr) return NotOpen(scope_id);
  return static_cast<int64_t>(scope->kv.size());
}

void Rendezvous::Wait(const ScopeId& scope_id, std::vector<std::string> keys,
                      absl::Duration timeout, DoneCallback done) {
  std::vector<Deferred> deferred;
  {
    absl::MutexLock lock(&mu_);
    Scope* scope = FindScope(scope_id);
    absl::Status room;
    if (scope != nullptr) room = CheckRoomForWaiter(scope_id, *scope);
    if (scope == nullptr) {
      deferred.push_back([done, s = NotOpen(scope_id)] { done(s); });
    } else if (!room.ok()) {
      deferred.push_back([done, room] { done(room); });
    } else {
      Waiter w;
      w.keys = std::move(keys);
      w.on_done = std::move(done);
      w.deadline = absl::Now() + timeout;
      AddWaiter(scope_id, *scope, std::move(w));
      Wake(*scope, deferred);
    }
  }
  RunAll(deferred);
}

void Rendezvous::Barrier(const ScopeId& scope_id, const std::string& name, int rank, int world_size,
                         absl::Duration timeout, DoneCallback done) {
  std::vector<Deferred> deferred;
  {
    absl::MutexLock lock(&mu_);
    Scope* scope = FindScope(scope_id);
    absl::Status error;
    if (scope == nullptr) {
      error = NotOpen(scope_id);
    } else if (world_size < 1) {
      error =
          absl::InvalidArgumentError(absl::StrCat("world_size: must be >= 1, got ", world_size));
    } else if (rank < 0 || rank >= world_size) {
      error = absl::InvalidArgumentError(
          absl::StrCat("rank: must be in [0, ", world_size, "), got ", rank));
    } else if (absl::Status s = CheckKeyLength("name", name); !s.ok()) {
      error = s;
    } else if (absl::Status s = CheckRoomForWaiter(scope_id, *scope); !s.ok()) {
      error = s;
    } else if (scope->barriers.count(name) == 0 &&
               static_cast<int64_t>(scope->kv.size() + scope->barriers.size()) >=
                   limits_.max_keys) {
      error = absl::ResourceExhaustedError(
          absl::StrCat("name: job ", scope_id.job_id, " attempt ", scope_id.attempt, " holds ",
                       limits_.max_keys, " keys and barriers, its cap (--rendezvous-max-keys)"));
    }
    if (error.ok()) {
      BarrierState& b = scope->barriers[name];
      if (b.world_size == 0) b.world_size = world_size;
      if (b.world_size != world_size) {
        error = absl::InvalidArgumentError(absl::StrCat("world_size: barrier '", name,
                                                        "' has world_size ", b.world_size, ", got ",
                                                        world_size));
      } else {
        b.ranks.insert(rank);
        if (static_cast<int>(b.ranks.size()) == b.world_size) b.complete = true;
        Waiter w;
        w.barrier = name;
        w.on_done = std::move(done);
        w.deadline = absl::Now() + timeout;
        AddWaiter(scope_id, *scope, std::move(w));
        Wake(*scope, deferred);
      }
    }
    if (!error.ok()) deferred.push_back([done, error] { done(error); });
  }
  RunAll(deferred);
}

bool Rendezvous::TimerShouldWake() {
  return stopping_ || (!deadlines_.empty() && deadlines_.begin()->first < wake_at_);
}

void Rendezvous::TimerLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    wake_at_ = deadlines_.empty() ? absl::Now() + absl::Seconds(1) : deadlines_.begin()->first;
    // Wakes early when stopping or when a waiter with an earlier deadline arrives.
    mu_.AwaitWithDeadline(absl::Condition(this, &Rendezvous::TimerShouldWake), wake_at_);
    if (stopping_) break;
    std::vector<Deferred> deferred;
    const absl::Time now = absl::Now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      auto [scope_id, waiter_id] = deadlines_.begin()->second;
      deadlines_.erase(deadlines_.begin());
      Scope* scope = FindScope(scope_id);
      if (scope == nullptr) continue;
      auto it = scope->waiters.find(waiter_id);
      if (it == scope->waiters.end()) continue;
      deferred.push_back(Fail(it->second, absl::DeadlineExceededError(absl::StrCat(
                                              "timed out waiting in job ", scope_id.job_id,
                                              " attempt ", scope_id.attempt))));
      scope->waiters.erase(it);
    }
    if (!deferred.empty()) {
      mu_.Unlock();
      RunAll(deferred);
      mu_.Lock();
    }
  }
}

}  // namespace trainyard::coordinator
