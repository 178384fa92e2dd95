// What every server's main() shares: signals and durations on the command line.
#ifndef TRAINYARD_COMMON_SERVER_MAIN_H_
#define TRAINYARD_COMMON_SERVER_MAIN_H_

#include <signal.h>

#include <algorithm>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace trainyard {

// Blocks SIGTERM and SIGINT in this thread and every thread it starts afterwards; call first in
// main(), then WaitForTerminationSignal() once serving.
inline void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// Returns the signal (SIGTERM or SIGINT) once one arrives.
inline int WaitForTerminationSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

// The signal (SIGTERM or SIGINT) if one arrives within `timeout`, else 0.
inline int WaitForTerminationSignalFor(absl::Duration timeout) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  const timespec ts = absl::ToTimespec(std::max(timeout, absl::ZeroDuration()));
  const int sig = sigtimedwait(&set, nullptr, &ts);
  return sig > 0 ? sig : 0;
}

// "10s", "1m30s", "500ms", or plain seconds ("10", "2.5").
inline absl::StatusOr<absl::Duration> ParseFlagDuration(const std::string& flag,
                                                        const std::string& text) {
  double seconds = 0;
  absl::Duration d;
  if (absl::SimpleAtod(text, &seconds) && seconds > 0) return absl::Seconds(seconds);
  if (absl::ParseDuration(text, &d) && d > absl::ZeroDuration()) return d;
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": expected a positive duration such as 10s or 500ms, got '", text, "'"));
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_SERVER_MAIN_H_
