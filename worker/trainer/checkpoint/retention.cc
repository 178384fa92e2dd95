#include "worker/trainer/checkpoint/retention.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace trainyard::trainer {

std::optional<double> CheckpointEvalLoss(const std::string& path) {
  std::ifstream in(path + "/meta.json");
  if (!in) return std::nullopt;
  const nlohmann::json meta = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object()) return std::nullopt;
  auto it = meta.find("eval_loss");
  if (it == meta.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

absl::StatusOr<Retained> PruneCheckpoints(const std::string& dir, const RetentionPolicy& policy) {
  namespace fs = std::filesystem;
  Retained out;
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
  std::map<int64_t, std::optional<double>> losses;
  for (const auto& [step, name] : steps) losses[step] = CheckpointEvalLoss(dir + "/" + name);
  auto kept_list = [&] {
    for (const auto& [step, name] : steps) out.kept.push_back({step, name, losses[step]});
    return out;
  };
  // Only what is older than the checkpoint `latest` names goes: never it, nor a newer one.
  int64_t latest_step = -1;
  for (const auto& [step, name] : steps) {
    if (name == latest) latest_step = step;
  }
  // Nothing published yet: nothing is known to be safe.
  if (policy.keep_last <= 0 || latest_step < 0) return kept_list();
  // keep_best: the lowest eval_loss up to latest (the newest of equals).
  int64_t best = -1;
  if (policy.keep_best) {
    for (const auto& [step, loss] : losses) {
      if (step > latest_step || !loss.has_value()) continue;
      if (best < 0 || *loss <= *losses[best]) best = step;
    }
  }
  int64_t kept = 0;
  for (auto it = steps.rbegin(); it != steps.rend();) {
    if (it->first >= latest_step || kept < policy.keep_last || it->first == best) {
      if (it->first <= latest_step && it->first != best) ++kept;
      ++it;
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
    out.removed.push_back(it->second);
    it = std::map<int64_t, std::string>::reverse_iterator(steps.erase(std::next(it).base()));
  }
  for (const fs::path& p : leftovers) {
    fs::remove_all(p, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot remove checkpoint ", p.string(), ": ", ec.message()));
    }
  }
  std::reverse(out.removed.begin(), out.removed.end());
  return kept_list();
}

CheckpointReport RetainAfterCheckpoint(const std::string& dir, const RetentionPolicy& policy,
                                       int64_t step, const std::string& path, int64_t bytes,
                                       void (*log)(const std::string& line)) {
  CheckpointReport report{step, path, bytes, CheckpointEvalLoss(path), {}};
  // The oldest beyond checkpoint.keep_last go (but the best, with keep_best).
  absl::StatusOr<Retained> pruned = PruneCheckpoints(dir, policy);
  if (!pruned.ok()) {
    log(absl::StrCat("checkpoint retention: ", pruned.status().message()));
    return report;
  }
  if (!pruned->removed.empty()) {
    log(absl::StrCat("removed ", absl::StrJoin(pruned->removed, ", "), " (checkpoint.keep_last ",
                     policy.keep_last, policy.keep_best ? ", keep_best" : "", ")"));
  }
  for (const Retained::Checkpoint& c : pruned->kept) {
    report.kept.push_back({c.step, dir + "/" + c.name, c.eval_loss});
  }
  return report;
}

}  // namespace trainyard::trainer
