// The settings a resume must keep: what a checkpoint's meta.json records of the schedule and the
// optimizer's constants (MetaNotes::settings), and the check that a resume keeps them.
#ifndef TRAINYARD_WORKER_TRAINER_CHECKPOINT_SETTINGS_H_
#define TRAINYARD_WORKER_TRAINER_CHECKPOINT_SETTINGS_H_

#include <string>

#include "absl/status/status.h"
#include "common/job_config.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {

// The settings in effect, by their spec names under train, as a JSON object's text.
std::string TrainingSettings(const TrainConfig& t, const OptimizerHyper& hyper);

// A resume from `path` (its meta.json's settings) under `settings` (TrainingSettings) with
// `optimizer`: the first setting that differs, named, as FAILED_PRECONDITION; a checkpoint that
// records none (written before they were) is taken as it is, one of another optimizer is left to
// the load, which refuses it naming train.optimizer.
absl::Status CheckResumeSettings(const std::string& path, const std::string& settings,
                                 OptimizerKind optimizer);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CHECKPOINT_SETTINGS_H_
