// Untrusted text in logs. Anything a caller sends (a job name, a user name in a refused request,
// a reason, a rank's output) may hold newlines, carriage returns or terminal escapes; written
// as is, it could start a forged log line ("audit: admin ... CreateUser mallory -> OK") or
// rewrite an operator's terminal. Every server's logger escapes the control characters of each
// message (InstallEscapingLogger), and audit lines quote each user-supplied field (Quoted).
//
// Thread-safe: pure functions; InstallEscapingLogger once at start-up, from main().
#ifndef TRAINYARD_COMMON_LOG_TEXT_H_
#define TRAINYARD_COMMON_LOG_TEXT_H_

#include <spdlog/formatter.h>

#include <memory>
#include <string>

#include "absl/strings/string_view.h"

namespace trainyard {

// `text` with every control character (below 0x20, and 0x7f) written as an escape: \n, \r, \t,
// or \xHH, so that it cannot break a line or drive a terminal. Printable bytes, UTF-8 included,
// are kept (a literal backslash too: for an unambiguous field, use Quoted).
std::string EscapeControl(absl::string_view text);

// `text` escaped as EscapeControl does, with '"' and '\' escaped too, between double quotes: a
// field that reads as one token whatever it holds.
std::string Quoted(absl::string_view text);

// `text` with every byte that does not belong to a valid UTF-8 sequence replaced by U+FFFD (a
// proto3 string must be valid UTF-8; a rank may print any bytes).
std::string ValidUtf8(std::string text);

// The longest prefix of `text` of at most `max_bytes` that does not end inside a UTF-8 character:
// a cut that keeps valid UTF-8 valid (a character split at the cut would make a proto3 string,
// and so its whole message, unreadable).
absl::string_view Utf8Prefix(absl::string_view text, size_t max_bytes);

// spdlog's default line layout, "[time] [logger] [level] message", with the message escaped by
// EscapeControl: for any sink.
std::unique_ptr<spdlog::formatter> EscapingFormatter();

// Makes the default logger a stderr logger named `name` whose messages are escaped with
// EscapeControl before they are written: no message can span two lines.
void InstallEscapingLogger(const std::string& name);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_LOG_TEXT_H_
