// FusedAdamWStep (see fused_adamw.h).
#include "worker/trainer/fused_adamw.h"
#include "worker/trainer/torch_compat.h"

#include <ATen/Parallel.h>

#include "server/adam/cpu_adam.h"

namespace trainyard::trainer {

void FusedAdamWStep(torch::optim::AdamW& optimizer, double lr, double grad_scale) {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(p.scalar_type() == torch::kFloat && p.is_contiguous(),
                  "FusedAdamWStep: parameters must be contiguous fp32");
      auto& slot = optimizer.state()[OptimizerStateKey(p)];
      if (slot == nullptr) {
        auto st = std::make_unique<torch::optim::AdamWParamState>();
        st->step(0);
        st->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        st->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(st);
      }
      auto& st = static_cast<torch::optim::AdamWParamState&>(*slot);
      st.step(st.step() + 1);
      const torch::Tensor grad = p.grad().contiguous();
      adam::AdamWConfig c;
      c.lr = static_cast<float>(lr);
      c.beta1 = static_cast<float>(std::get<0>(options.betas()));
      c.beta2 = static_cast<float>(std::get<1>(options.betas()));
      c.eps = static_cast<float>(options.eps());
      c.weight_decay = static_cast<float>(options.weight_decay());
      c.step = st.step();
      c.grad_scale = static_cast<float>(grad_scale);
      float* param = p.data_ptr<float>();
      float* m = st.exp_avg().data_ptr<float>();
      float* v = st.exp_avg_sq().data_ptr<float>();
      const float* g = grad.data_ptr<float>();
      at::parallel_for(0, p.numel(), adam::kParallelChunk, [&](int64_t begin, int64_t end) {
        adam::AdamWStep(c, param + begin, m + begin, v + begin, g + begin, nullptr, end - begin);
      });
    }
  }
}

}  // namespace trainyard::trainer
