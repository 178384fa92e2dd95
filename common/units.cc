// HumanBytes and ParseBytes (see units.h).
#include "common/units.h"

#include <cctype>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace trainyard {

std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", v, units[u]);
}

std::optional<int64_t> ParseBytes(const std::string& text) {
  size_t pos = 0;
  while (pos < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[pos])) || text[pos] == '.')) {
    ++pos;
  }
  double value = 0;
  if (pos == 0 || !absl::SimpleAtod(text.substr(0, pos), &value)) return std::nullopt;
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text.substr(pos)));
  const std::pair<const char*, double> units[] = {{"", 1},
                                                  {"b", 1},
                                                  {"k", 1e3},
                                                  {"kb", 1e3},
                                                  {"kib", 1024.0},
                                                  {"m", 1e6},
                                                  {"mb", 1e6},
                                                  {"mib", 1048576.0},
                                                  {"g", 1e9},
                                                  {"gb", 1e9},
                                                  {"gib", 1073741824.0},
                                                  {"t", 1e12},
                                                  {"tb", 1e12},
                                                  {"tib", 1099511627776.0}};
  for (const auto& [name, scale] : units) {
    if (unit == name) return static_cast<int64_t>(value * scale);
  }
  return std::nullopt;
}

}  // namespace trainyard
