// The learning rate of each optimizer step under train.lr_schedule: Hugging Face Trainer's
// schedules as transformers' get_scheduler computes them (constant, constant_with_warmup, linear,
// cosine, cosine_with_min_lr: a LambdaLR whose factor at step s is used for optimizer step s,
// 0-based), and trainyard's warmup_cosine. Pure arithmetic; no protobuf, no LibTorch.
#ifndef TRAINYARD_COMMON_LR_SCHEDULE_H_
#define TRAINYARD_COMMON_LR_SCHEDULE_H_

#include <cstdint>

#include "common/job_config.h"

namespace trainyard {

// The learning rate of optimizer step `step` (0-based) of `train`'s `steps`: train.lr times the
// schedule's factor, with `warmup` steps of warmup.
double ScheduledLearningRate(int64_t step, const TrainConfig& train);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_LR_SCHEDULE_H_
