// AdamW on CPU slots: the Highway kernel of kernels/adam (see optimizers.h).
#include "worker/trainer/optim/slot_internal.h"

#include "kernels/adam/cpu_adam.h"

namespace trainyard::trainer {

void SlotOptimizer::StepAdamW(int i, const float* g, float scale, double lr) {
  SlotState& st = *state_[i];
  adam::AdamWConfig c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(hyper_.beta1);
  c.beta2 = static_cast<float>(hyper_.beta2);
  c.eps = static_cast<float>(hyper_.eps);
  c.weight_decay = static_cast<float>(hyper_.weight_decay);
  c.step = step_;
  c.grad_scale = scale;
  float* param = slots_[i].param.data_ptr<float>();
  float* m = st.m.data_ptr<float>();
  float* v = st.v.data_ptr<float>();
  at::parallel_for(0, slots_[i].param.numel(), adam::kParallelChunk, [&](int64_t b, int64_t e) {
    adam::AdamWStep(c, param + b, m + b, v + b, g + b, nullptr, e - b);
  });
}

}  // namespace trainyard::trainer
