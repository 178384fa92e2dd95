// Failpoints for fault-injection tests (as etcd's gofail and TiKV's fail-rs): named places in the
// code where a test makes the process die as a crash would, at the one instant that no signal sent
// from outside can hit reliably (between a commit and its answer, say).
//
// Armed only by the environment variable TRAINYARD_FAILPOINTS, read once:
// "NAME=ACTION[,NAME=ACTION...]", an ACTION one of
//   exit@N    the Nth time the process passes NAME it exits at once with status 137, as if
//             SIGKILLed (no destructor, no flush, no answer);
//   sleep:MS  every pass stalls MS milliseconds (at most an hour), as a slow disk or a large
//             state would.
// Unset, as in production, passing a failpoint costs one atomic load. A malformed value is
// ignored, named on stderr.
//
// The failpoints: "submit-after-commit" (a submitted job is durable, its answer not yet sent);
// "load-jobs" (a starting coordinator is about to load its jobs from the store).
#ifndef TRAINYARD_COMMON_FAILPOINT_H_
#define TRAINYARD_COMMON_FAILPOINT_H_

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>

namespace trainyard {
namespace failpoint_internal {

struct Armed {
  int64_t exit_at = 0;   // the pass that exits (1 = the first); 0: none
  int64_t sleep_ms = 0;  // what each pass stalls
  std::atomic<int64_t> passes{0};
};

// name -> its arming; empty when TRAINYARD_FAILPOINTS is unset or malformed.
inline const std::map<std::string, std::unique_ptr<Armed>, std::less<>>& Table() {
  static const auto* table = [] {
    auto* t = new std::map<std::string, std::unique_ptr<Armed>, std::less<>>();
    const char* env = std::getenv("TRAINYARD_FAILPOINTS");
    if (env == nullptr) return t;
    std::string_view rest(env);
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      const size_t equals = item.find('=');
      const std::string_view action =
          equals == std::string_view::npos ? std::string_view() : item.substr(equals + 1);
      const bool exits = action.substr(0, 5) == "exit@";
      const bool sleeps = action.substr(0, 6) == "sleep:";
      char* end = nullptr;
      const std::string count(action.substr(exits ? 5 : sleeps ? 6 : action.size()));
      const long long n = count.empty() ? 0 : std::strtoll(count.c_str(), &end, 10);
      if (equals == 0 || equals == std::string_view::npos || n <= 0 || end == nullptr ||
          *end != '\0' || (sleeps && n > 3600 * 1000)) {
        std::fprintf(stderr,
                     "TRAINYARD_FAILPOINTS: ignoring malformed failpoint (want NAME=exit@N or "
                     "NAME=sleep:MS)\n");
        t->clear();
        return t;
      }
      auto armed = std::make_unique<Armed>();
      (exits ? armed->exit_at : armed->sleep_ms) = n;
      (*t)[std::string(item.substr(0, equals))] = std::move(armed);
    }
    return t;
  }();
  return *table;
}

}  // namespace failpoint_internal

// Passes the failpoint `name` (see above): returns, unless armed to exit at this pass.
inline void Failpoint(std::string_view name) {
  const auto& table = failpoint_internal::Table();
  if (table.empty()) return;
  auto it = table.find(name);
  if (it == table.end()) return;
  if (it->second->passes.fetch_add(1) + 1 == it->second->exit_at) ::_exit(137);
  if (const int64_t ms = it->second->sleep_ms; ms > 0) {
    struct timespec stall = {static_cast<time_t>(ms / 1000),
                             static_cast<long>(ms % 1000) * 1000000};
    while (::nanosleep(&stall, &stall) != 0 && errno == EINTR) {
    }
  }
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_FAILPOINT_H_
