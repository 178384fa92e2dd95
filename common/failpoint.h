// Failpoints for fault-injection tests (as etcd's gofail and TiKV's fail-rs): named places in the
// code where a test makes the process die as a crash would, at the one instant that no signal sent
// from outside can hit reliably (between a commit and its answer, say).
//
// Armed only by the environment variable TRAINYARD_FAILPOINTS, read once:
// "NAME=exit@N[,NAME=exit@N...]": the Nth time the process passes NAME it exits at once with
// status 137, as if SIGKILLed (no destructor, no flush, no answer). Unset, as in production,
// passing a failpoint costs one atomic load. A malformed value is ignored, named on stderr.
//
// The failpoints: "submit-after-commit" (a submitted job is durable, its answer not yet sent).
#ifndef TRAINYARD_COMMON_FAILPOINT_H_
#define TRAINYARD_COMMON_FAILPOINT_H_

#include <unistd.h>

#include <atomic>
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
  int64_t exit_at = 0;  // the pass that exits (1 = the first)
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
      char* end = nullptr;
      const std::string count(action.substr(
          action.find('@') == std::string_view::npos ? action.size() : action.find('@') + 1));
      const long long n = count.empty() ? 0 : std::strtoll(count.c_str(), &end, 10);
      if (equals == 0 || equals == std::string_view::npos || action.substr(0, 5) != "exit@" ||
          n <= 0 || end == nullptr || *end != '\0') {
        std::fprintf(stderr,
                     "TRAINYARD_FAILPOINTS: ignoring malformed failpoint (want NAME=exit@N)\n");
        t->clear();
        return t;
      }
      auto armed = std::make_unique<Armed>();
      armed->exit_at = n;
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
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_FAILPOINT_H_
