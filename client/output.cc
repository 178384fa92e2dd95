#include "client/output.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"

namespace trainyard::client {

std::string FormatTable(const std::vector<std::string>& headers,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(headers.size());
  for (size_t i = 0; i < headers.size(); ++i) width[i] = headers[i].size();
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size() && i < width.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string l;
    for (size_t i = 0; i < cells.size(); ++i) {
      if (i + 1 == cells.size()) {
        absl::StrAppend(&l, cells[i]);
      } else {
        absl::StrAppend(&l, cells[i], std::string(width[i] - cells[i].size() + 2, ' '));
      }
    }
    absl::StrAppend(&out, l, "\n");
  };
  line(headers);
  for (const auto& row : rows) line(row);
  return out;
}

std::string FormatFields(const std::vector<std::pair<std::string, std::string>>& fields) {
  size_t width = 0;
  for (const auto& [k, v] : fields) width = std::max(width, k.size());
  std::string out;
  for (const auto& [k, v] : fields) {
    absl::StrAppend(&out, k, ":", std::string(width - k.size() + 2, ' '), v, "\n");
  }
  return out;
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

std::string Ago(int64_t unix_ms, int64_t now_ms) {
  if (unix_ms == 0) return "-";
  const int64_t s = std::max<int64_t>(0, (now_ms - unix_ms) / 1000);
  if (s < 60) return absl::StrCat(s, "s ago");
  if (s < 3600) return absl::StrCat(s / 60, "m ago");
  if (s < 86400) return absl::StrCat(s / 3600, "h ago");
  return absl::StrCat(s / 86400, "d ago");
}

std::string ProgressLine(const v1::StepReport& r, double seconds_per_step) {
  const std::string tail = absl::StrFormat(
      "loss %.4f tok/s %s%s", r.loss(), HumanCount(static_cast<int64_t>(r.tokens_per_second())),
      r.mfu() > 0 ? absl::StrFormat(" mfu %.1f%%", 100 * r.mfu()) : "");
  // A program's own report without a total (the SDK's report(step, loss=...)): no bar, no ETA.
  if (r.total_steps() <= 0) return absl::StrFormat("step %d %s", r.step(), tail);
  const int width = 24;
  const double frac = std::clamp(double(r.step()) / r.total_steps(), 0.0, 1.0);
  const int filled = static_cast<int>(frac * width);
  std::string bar(width, ' ');
  for (int i = 0; i < filled; ++i) bar[i] = '=';
  if (filled < width) bar[filled] = '>';
  const double eta_s = std::max<double>(0, (r.total_steps() - r.step()) * seconds_per_step);
  return absl::StrFormat("step %d/%d [%s] %3.0f%% ETA %s %s", r.step(), r.total_steps(), bar,
                         100 * frac,
                         absl::FormatDuration(absl::Seconds(static_cast<int64_t>(eta_s))), tail);
}

std::string HumanCount(int64_t n) {
  if (n >= 1'000'000'000) return absl::StrFormat("%.1fB", n / 1e9);
  if (n >= 1'000'000) return absl::StrFormat("%.1fM", n / 1e6);
  if (n >= 1'000) return absl::StrFormat("%.1fK", n / 1e3);
  return absl::StrCat(n);
}

}  // namespace trainyard::client
