// Lion (Chen et al. 2023) on CPU slots (see optimizers.h).
#include "worker/trainer/optim/slot_internal.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace trainyard::trainer {

void SlotOptimizer::StepLion(int i, const float* grad, float scale, double lr) {
  float* p = slots_[i].param.data_ptr<float>();
  float* m = state_[i]->m.data_ptr<float>();
  const auto b1 = static_cast<float>(hyper_.beta1), b2 = static_cast<float>(hyper_.beta2);
  const auto decay = static_cast<float>(1.0 - lr * hyper_.weight_decay);
  const auto rate = static_cast<float>(lr);
  at::parallel_for(0, slots_[i].param.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const float g = grad[k] * scale;
      const float c = m[k] * b1 + g * (1 - b1);
      const float update = static_cast<float>((c > 0) - (c < 0));
      p[k] = p[k] * decay;
      p[k] = p[k] - rate * update;
      m[k] = m[k] * b2 + g * (1 - b2);
    }
  });
}

}  // namespace trainyard::trainer
