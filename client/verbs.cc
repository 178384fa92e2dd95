

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/local_cluster.h"
#include "client/verbs.h"
#include "client/yard_client.h"
#include "common/credentials.h"

namespace trainyard::client {

// Where `yard login` and `yard local up` save a token, and where yard looks last:
// $XDG_CONFIG_HOME/trainyard/token, else ~/.config/trainyard/token.
std::string DefaultTokenFile() {
  if (const char* xdg = std::getenv("XDG_CONFIG_HOME"); xdg != nullptr && *xdg != '\0') {
    return absl::StrCat(xdg, "/trainyard/token");
  }
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr ? home : ".", "/.config/trainyard/token");
}

std::string DefaultCoordinator() {
  const char* env = std::getenv("TRAINYARD_COORDINATOR");
  return env != nullptr && *env != '\0' ? env : "127.0.0.1:7070";
}

std::string DefaultLocalStateDir() {
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr ? home : ".", "/.trainyard/local");
}

int Fail(const absl::Status& s) {
  std::string message(s.message());
  std::replace(message.begin(), message.end(), '\n', ' ');
  std::cerr << "yard: " << message << " (" << absl::StatusCodeToString(s.code()) << ")\n";
  return 1;
}

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

std::string RoleName(v1::Role role) { return role == v1::ADMIN ? "admin" : "user"; }

std::string TimeOrDash(int64_t unix_ms) {
  return unix_ms == 0 ? "-"
                      : absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(unix_ms),
                                         absl::LocalTimeZone());
}

std::string Share(double share) { return absl::StrFormat("%g", share); }

}  // namespace trainyard::client
