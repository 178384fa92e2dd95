// Failpoints for fault-injection tests (as etcd's gofail and TiKV's fail-rs): named places in the
// code where a test makes the process die as a crash would, at the one instant that no signal sent
// from outside can hit reliably (between a commit and its answer, say), stall, or fail.
//
// Armed by the environment variable TRAINYARD_FAILPOINTS, read once:
// "NAME=ACTION[,NAME=ACTION...]", an ACTION one of
//   exit@N    the Nth time the process passes NAME it exits at once with status 137, as if
//             SIGKILLed (no destructor, no flush, no answer);
//   sleep:MS  every pass stalls MS milliseconds (at most an hour), as a slow disk or a large
//             state would;
//   fail@N    the Nth pass fails (FailpointFails is true), once: where the code can fail there
//             (a store's transaction, say);
//   pause     every pass waits until the failpoint is disarmed or armed otherwise (a test's own
//             process: a thread held at one place while the test does what it checks).
// or, in a test's own process, by ArmFailpoint (N counted from then; DisarmFailpoint ends it).
// Unarmed, as in production, passing a failpoint costs one atomic load. A malformed value is
// ignored, named on stderr.
//
// The failpoints: "submit-after-commit" (a submitted job is durable, its answer not yet sent);
// "load-jobs" (a starting coordinator is about to load its jobs from the store); "store-commit"
// (a store's transaction, which fails with UNAVAILABLE); "node-event" (the coordinator's
// node-events thread is about to handle a node's message); "series-replay" (a StreamLogs or
// StreamMetrics call watches its job and is about to queue the kept records).
#ifndef TRAINYARD_COMMON_FAILPOINT_H_
#define TRAINYARD_COMMON_FAILPOINT_H_

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

namespace trainyard {
namespace failpoint_internal {

struct Armed {
  int64_t exit_at = 0;   // the pass that exits (1 = the first); 0: none
  int64_t fail_at = 0;   // the pass that fails
  int64_t sleep_ms = 0;  // what each pass stalls
  bool pause = false;    // each pass waits until disarmed
  int64_t passes = 0;
};

// "exit@N", "sleep:MS", "fail@N" or "pause"; nullopt when malformed.
inline std::optional<Armed> ParseAction(std::string_view action) {
  if (action == "pause") {
    Armed armed;
    armed.pause = true;
    return armed;
  }
  const bool exits = action.substr(0, 5) == "exit@";
  const bool fails = action.substr(0, 5) == "fail@";
  const bool sleeps = action.substr(0, 6) == "sleep:";
  if (!exits && !fails && !sleeps) return std::nullopt;
  const std::string count(action.substr(sleeps ? 6 : 5));
  char* end = nullptr;
  const long long n = count.empty() ? 0 : std::strtoll(count.c_str(), &end, 10);
  if (n <= 0 || end == nullptr || *end != '\0' || (sleeps && n > 3600 * 1000)) return std::nullopt;
  Armed armed;
  (exits ? armed.exit_at : fails ? armed.fail_at : armed.sleep_ms) = n;
  return armed;
}

struct Table {
  std::mutex mu;
  std::condition_variable changed;                  // a failpoint armed or disarmed
  std::map<std::string, Armed, std::less<>> armed;  // (guarded by mu)
  std::atomic<bool> any{false};
};

// The process's table, first armed from TRAINYARD_FAILPOINTS (all or nothing).
inline Table& TheTable() {
  static Table* table = [] {
    auto* t = new Table();
    const char* env = std::getenv("TRAINYARD_FAILPOINTS");
    if (env == nullptr) return t;
    std::string_view rest(env);
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      const size_t equals = item.find('=');
      const std::optional<Armed> armed = equals == 0 || equals == std::string_view::npos
                                             ? std::nullopt
                                             : ParseAction(item.substr(equals + 1));
      if (!armed.has_value()) {
        std::fprintf(stderr,
                     "TRAINYARD_FAILPOINTS: ignoring malformed failpoint (want NAME=exit@N, "
                     "NAME=sleep:MS, NAME=fail@N or NAME=pause)\n");
        t->armed.clear();
        return t;
      }
      t->armed[std::string(item.substr(0, equals))] = *armed;
    }
    t->any = !t->armed.empty();
    return t;
  }();
  return *table;
}

}  // namespace failpoint_internal

// Passes the failpoint `name` (see above): exits or stalls when so armed; true when this pass is
// the one armed to fail.
inline bool FailpointFails(std::string_view name) {
  failpoint_internal::Table& table = failpoint_internal::TheTable();
  if (!table.any.load(std::memory_order_relaxed)) return false;
  int64_t sleep_ms = 0;
  bool fails = false;
  {
    std::unique_lock<std::mutex> lock(table.mu);
    auto it = table.armed.find(name);
    if (it == table.armed.end()) return false;
    failpoint_internal::Armed& a = it->second;
    ++a.passes;
    if (a.passes == a.exit_at) ::_exit(137);
    fails = a.passes == a.fail_at;
    sleep_ms = a.sleep_ms;
    table.changed.notify_all();  // (a pass: AwaitFailpointPasses' waiters)
    if (a.pause) {
      table.changed.wait(lock, [&table, name] {
        auto armed = table.armed.find(name);
        return armed == table.armed.end() || !armed->second.pause;
      });
    }
  }
  if (sleep_ms > 0) {
    struct timespec stall = {static_cast<time_t>(sleep_ms / 1000),
                             static_cast<long>(sleep_ms % 1000) * 1000000};
    while (::nanosleep(&stall, &stall) != 0 && errno == EINTR) {
    }
  }
  return fails;
}

inline void Failpoint(std::string_view name) { (void)FailpointFails(name); }

// Arms `name` in this process with `action` (as in TRAINYARD_FAILPOINTS, its passes counted from
// now); false when the action is malformed. For tests that run the code in their own process.
inline bool ArmFailpoint(const std::string& name, std::string_view action) {
  const std::optional<failpoint_internal::Armed> armed = failpoint_internal::ParseAction(action);
  if (!armed.has_value()) return false;
  failpoint_internal::Table& table = failpoint_internal::TheTable();
  std::lock_guard<std::mutex> lock(table.mu);
  table.armed[name] = *armed;
  table.any = true;
  table.changed.notify_all();
  return true;
}

// Waits until `name` has been passed at least `passes` times since it was armed, or `timeout_ms`
// went by; whether it was. For tests that wait for a thread to reach a paused failpoint.
inline bool AwaitFailpointPasses(const std::string& name, int64_t passes, int64_t timeout_ms) {
  failpoint_internal::Table& table = failpoint_internal::TheTable();
  std::unique_lock<std::mutex> lock(table.mu);
  return table.changed.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] {
    auto it = table.armed.find(name);
    return it != table.armed.end() && it->second.passes >= passes;
  });
}

// Disarms `name` in this process (a test's end, whether or not it was passed).
inline void DisarmFailpoint(const std::string& name) {
  failpoint_internal::Table& table = failpoint_internal::TheTable();
  std::lock_guard<std::mutex> lock(table.mu);
  table.armed.erase(name);
  table.any = !table.armed.empty();
  table.changed.notify_all();
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_FAILPOINT_H_
