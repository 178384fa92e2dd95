#include "common/signal_names.h"

#include <csignal>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"

namespace trainyard {
namespace {

constexpr std::pair<const char*, int> kSignals[] = {
    {"HUP", SIGHUP},   {"INT", SIGINT},   {"QUIT", SIGQUIT},   {"USR1", SIGUSR1},
    {"USR2", SIGUSR2}, {"ALRM", SIGALRM}, {"TERM", SIGTERM},   {"CONT", SIGCONT},
    {"STOP", SIGSTOP}, {"TSTP", SIGTSTP}, {"WINCH", SIGWINCH}, {"KILL", SIGKILL}};

}  // namespace

std::string CanonicalSignalName(absl::string_view name) {
  std::string upper = absl::AsciiStrToUpper(name);
  if (absl::StartsWith(upper, "SIG")) upper.erase(0, 3);
  for (const auto& [known, number] : kSignals) {
    if (upper == known) return upper;
  }
  return "";
}

std::optional<int> SignalNumber(absl::string_view name) {
  const std::string canonical = CanonicalSignalName(name);
  for (const auto& [known, number] : kSignals) {
    if (canonical == known) return number;
  }
  return std::nullopt;
}

bool IsUserSignal(int number) {
  for (const auto& [known, n] : kSignals) {
    if (n == number) return true;
  }
  return false;
}

std::string SignalNamesText() {
  std::vector<std::string> names;
  for (const auto& [known, number] : kSignals) names.emplace_back(known);
  return absl::StrJoin(names, ", ");
}

}  // namespace trainyard
