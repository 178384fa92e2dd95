#include "common/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace trainyard {

double ScheduledLearningRate(int64_t step, const TrainConfig& t) {
  const double lr = t.lr;
  const int64_t warmup = t.warmup, total = t.steps;
  if (t.lr_schedule == LrSchedule::kWarmupCosine) {
    // Warmup from lr / warmup at step 0; then a cosine to min_lr_ratio x lr at the last step.
    if (warmup > 0 && step < warmup) return lr * static_cast<double>(step + 1) / warmup;
    const double min_lr = t.min_lr_ratio * lr;
    const int64_t decay_steps = std::max<int64_t>(1, total - warmup);
    const double progress =
        std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps));
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
  }
  if (t.lr_schedule == LrSchedule::kConstant) return lr;
  // transformers: warmup factor step / max(1, warmup), so step 0 trains at 0.
  if (step < warmup) {
    return lr * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
  }
  const double progress = static_cast<double>(step - warmup) /
                          static_cast<double>(std::max<int64_t>(1, total - warmup));
  switch (t.lr_schedule) {
    case LrSchedule::kLinear:
      return lr * std::max(0.0, static_cast<double>(total - step) /
                                    static_cast<double>(std::max<int64_t>(1, total - warmup)));
    case LrSchedule::kCosine:  // num_cycles 0.5
      return lr * std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
    case LrSchedule::kCosineWithMinLr: {
      const double factor = 0.5 * (1.0 + std::cos(M_PI * progress));
      return lr * std::max(0.0, factor * (1.0 - t.min_lr_ratio) + t.min_lr_ratio);
    }
    case LrSchedule::kConstantWithWarmup:
    case LrSchedule::kConstant:
    case LrSchedule::kWarmupCosine:
      break;
  }
  return lr;
}

}  // namespace trainyard
