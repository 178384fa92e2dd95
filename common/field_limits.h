// Size limits on every field of a request: no string longer than a cap, no list longer than a
// cap, no message larger than a cap, checked by walking the message with protobuf reflection so
// that a field added later is covered without another line of code. The error names the field
// by its path ("spec.data.path", "spec.command[3]", "spec.env[HOME]").
//
// Pure; thread-safe.
#ifndef TRAINYARD_COMMON_FIELD_LIMITS_H_
#define TRAINYARD_COMMON_FIELD_LIMITS_H_

#include <cstddef>
#include <string>

#include <google/protobuf/message.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace trainyard {

struct FieldLimits {
  size_t max_string_bytes = 4096;         // each string or bytes field (PATH_MAX)
  size_t max_repeated = 1024;             // elements of each list or map
  size_t max_message_bytes = 256 * 1024;  // the whole message, serialized
};

// OK, or INVALID_ARGUMENT: "PATH: N bytes, at most M" (strings), "PATH: not valid UTF-8" (a
// `string` field, which protobuf cannot carry otherwise), "PATH: N entries, at most M"
// (lists, maps), then "ROOT: N bytes serialized, at most M" (the whole message; ROOT "request"
// when `root` is empty). `root` prefixes
// every path ("spec" gives "spec.data.path"); empty: paths start at the message's fields.
// CheckpointReport.kept: the newest checkpoints retention keeps that a report carries and a job
// records (what `yard describe` lists).
inline constexpr int kMaxKeptCheckpoints = 100;
// The largest step or checkpoint report a rank may send (serialized).
inline constexpr size_t kMaxReportBytes = 64 * 1024;

absl::Status CheckFieldSizes(const google::protobuf::Message& message, const FieldLimits& limits,
                             absl::string_view root = "");

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_FIELD_LIMITS_H_
