

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
#include "common/log_text.h"

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

// A coordinator's message can carry a job's text (a spec's value in a field's error): escaped as a
// job's output is.
int Fail(const absl::Status& s) {
  std::string message(s.message());
  std::replace(message.begin(), message.end(), '\n', ' ');
  std::cerr << "yard: " << TerminalSafe(message) << " (" << absl::StatusCodeToString(s.code())
            << ")\n";
  return 1;
}

// Text from a job (its output, its spec's values, a message naming them) for a terminal: its
// control characters (C0 but tab, DEL, and C1 encoded as UTF-8: an 8-bit CSI) written as escapes,
// so that a job cannot set the reader's window title, clear the screen, write the clipboard (OSC
// 52) or overwrite what was printed before.
std::string TerminalSafe(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == 0xc2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
        static_cast<unsigned char>(text[i + 1]) <= 0x9f) {
      absl::StrAppend(&out, "\\u00",
                      absl::Hex(static_cast<unsigned char>(text[++i]), absl::kZeroPad2));
    } else if ((c < 0x20 && c != '\t') || c == 0x7f) {
      absl::StrAppend(&out, EscapeControl(absl::string_view(&text[i], 1)));
    } else {
      out.push_back(text[i]);
    }
  }
  return out;
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
