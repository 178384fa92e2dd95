#include "worker/trainer/checkpoint/retention.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace trainyard::trainer {

absl::StatusOr<std::vector<std::string>> PruneCheckpoints(const std::string& dir,
                                                          int64_t keep_last) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  if (keep_last <= 0) return removed;
  std::string latest;
  {
    std::ifstream in(dir + "/latest");
    std::getline(in, latest);
    latest = std::string(absl::StripAsciiWhitespace(latest));
  }
  std::error_code ec;
  std::map<int64_t, std::string> steps;  // complete checkpoints by step
  std::vector<fs::path> leftovers;       // removals a crash interrupted
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t step = 0;
    if (absl::StartsWith(name, ".step-") && absl::EndsWith(name, ".removing")) {
      leftovers.push_back(entry.path());
    } else if (absl::StartsWith(name, "step-") && absl::SimpleAtoi(name.substr(5), &step) &&
               entry.is_directory(ec) && !entry.is_symlink(ec)) {
      steps[step] = name;
    }
  }
  if (ec)
    return absl::UnavailableError(absl::StrCat("checkpoint folder ", dir, ": ", ec.message()));
  // Only what is older than the checkpoint `latest` names goes: never it, nor a newer one.
  int64_t latest_step = -1;
  for (const auto& [step, name] : steps) {
    if (name == latest) latest_step = step;
  }
  if (latest_step < 0) return removed;  // nothing published yet: nothing is known to be safe
  int64_t kept = 0;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (it->first >= latest_step || kept < keep_last) {
      if (it->first <= latest_step) ++kept;
      continue;
    }
    const fs::path from = fs::path(dir) / it->second;
    const fs::path to = fs::path(dir) / absl::StrCat(".", it->second, ".removing");
    fs::rename(from, to, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot remove checkpoint ", from.string(), ": ", ec.message()));
    }
    leftovers.push_back(to);
    removed.push_back(it->second);
  }
  for (const fs::path& p : leftovers) {
    fs::remove_all(p, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot remove checkpoint ", p.string(), ": ", ec.message()));
    }
  }
  std::reverse(removed.begin(), removed.end());
  return removed;
}

}  // namespace trainyard::trainer
