#include "worker/trainer/checkpoint/settings.h"

#include <algorithm>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/trainer/checkpoint/checkpoint.h"

namespace trainyard::trainer {

std::string TrainingSettings(const TrainConfig& t, const OptimizerHyper& hyper) {
  nlohmann::json j = {{"lr", t.lr},
                      {"lr_schedule", Name(t.lr_schedule)},
                      {"warmup", t.warmup},
                      {"min_lr_ratio", t.min_lr_ratio},
                      {"weight_decay", t.weight_decay}};
  if (t.optimizer == OptimizerKind::kAdafactor) {
    j["adafactor_eps"] = hyper.adafactor_eps1;
    j["adafactor_clip_threshold"] = hyper.adafactor_clip;
    j["adafactor_decay_rate"] = hyper.adafactor_decay;
  } else {
    j["adam_beta1"] = hyper.beta1;
    j["adam_beta2"] = hyper.beta2;
    if (t.optimizer != OptimizerKind::kLion) j["adam_epsilon"] = hyper.eps;
  }
  std::vector<std::string> skip = t.no_weight_decay;
  std::sort(skip.begin(), skip.end());
  j["no_weight_decay"] = skip;
  return j.dump();
}

absl::Status CheckResumeSettings(const std::string& path, const std::string& settings,
                                 OptimizerKind optimizer) {
  // Another optimizer's checkpoint: its load refuses it, naming train.optimizer.
  if (auto written = CheckpointOptimizer(path); written.ok() && *written != Name(optimizer)) {
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(const std::string recorded, CheckpointSettings(path));
  if (recorded.empty()) return absl::OkStatus();
  const nlohmann::json then = nlohmann::json::parse(recorded, nullptr, false);
  const nlohmann::json now = nlohmann::json::parse(settings, nullptr, false);
  if (!then.is_object() || !now.is_object()) return absl::OkStatus();
  for (const auto& [key, value] : now.items()) {
    auto it = then.find(key);
    if (it == then.end() || *it == value) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "train.", key, ": the checkpoint ", path, " was trained with ", it->dump(),
        ", the spec says ", value.dump(),
        "; a resume keeps the schedule and the optimizer's settings (to change them, start a "
        "new job from the checkpoint's weights)"));
  }
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
