// How `yard` prints: aligned tables and key-value blocks for people, JSON for scripts.
#ifndef TRAINYARD_CLIENT_OUTPUT_H_
#define TRAINYARD_CLIENT_OUTPUT_H_

#include <google/protobuf/message.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/units.h"
#include "trainyard/v1/trainer.pb.h"

namespace trainyard::client {

// Columns padded to their widest cell; one line per row.
std::string FormatTable(const std::vector<std::string>& headers,
                        const std::vector<std::vector<std::string>>& rows);
// "key:   value" lines with the values aligned.
std::string FormatFields(const std::vector<std::pair<std::string, std::string>>& fields);
// The message as indented JSON with proto field names and every field present.
std::string ToJson(const google::protobuf::Message& message);
// "42s ago", "3m ago", "2h ago", "5d ago"; "-" for 0.
std::string Ago(int64_t unix_ms, int64_t now_ms);
// (Sizes: common/units.h.)
using ::trainyard::HumanBytes;
using ::trainyard::ParseBytes;
// "1.2M", "110.0M", "7.0B".
std::string HumanCount(int64_t n);
// `yard metrics -f`'s status line: "step 120/300 [=======>       ]  40% ETA 1m12s loss 2.3100
// tok/s 12.3K" (and "mfu 35.7%" on GPUs); "step 120 loss ..." where the report has no total.
std::string ProgressLine(const v1::StepReport& r, double seconds_per_step);

}  // namespace trainyard::client

#endif  // TRAINYARD_CLIENT_OUTPUT_H_
