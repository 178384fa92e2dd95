// FusedAdamWStep (see fused_adamw.h).
#include "worker/trainer/optim/fused_adamw.h"
#include "worker/trainer/runtime/torch_compat.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <unordered_set>

#include "kernels/adam/cpu_adam.h"
#if TRAINYARD_CUDA_KERNELS
#include "worker/trainer/kernels/adamw_cuda.h"
#endif

namespace trainyard::trainer {

namespace {

std::atomic<bool> g_own_kernel{true};
// DeviceAdamWKernel's answer: 0 none yet, 1 the project's kernel, 2 LibTorch's.
std::atomic<int> g_device_path{0};

// One AdamW update of CUDA tensors at `step` with `lr` (or, where lr_t and step_t are defined,
// with the values they hold on the device when the update runs), the gradients divided by
// `divisor` (undefined: 1): the project's multi-tensor kernel where it takes them and is chosen,
// else LibTorch's _fused_adamw_.
void DeviceAdamW(const std::vector<torch::Tensor>& ps, const std::vector<torch::Tensor>& grads,
                 const std::vector<torch::Tensor>& m, const std::vector<torch::Tensor>& v,
                 double lr, int64_t step, const torch::Tensor& lr_t, const torch::Tensor& step_t,
                 double beta1, double beta2, double weight_decay, double eps,
                 const torch::Tensor& divisor) {
  if (ps.empty()) return;
  torch::NoGradGuard no_grad;
  const auto opts = ps[0].options().dtype(torch::kFloat);
  const torch::Tensor div = divisor.defined() ? divisor.to(opts).reshape({}) : torch::Tensor();
#if TRAINYARD_CUDA_KERNELS
  if (g_own_kernel.load() && AdamWMultiTensorCudaTakes(ps, grads, m, v)) {
    AdamWMultiTensorCuda(ps, grads, m, v, lr, step, lr_t, step_t, beta1, beta2, weight_decay, eps,
                         div);
    g_device_path = 1;
    return;
  }
#endif
#if TRAINYARD_TORCH2
  // The kernel divides the gradients by its grad_scale.
  std::optional<torch::Tensor> grad_scale;
  if (div.defined()) grad_scale = div;
  if (lr_t.defined()) {
    const std::vector<torch::Tensor> state_steps(ps.size(), step_t);
    at::_fused_adamw_(ps, grads, m, v, /*max_exp_avg_sqs=*/{}, state_steps, lr_t, beta1, beta2,
                      weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false, grad_scale,
                      std::nullopt);
  } else {
    // Every tensor is at the same step: one tensor read by the kernel for all of them.
    const std::vector<torch::Tensor> state_steps(ps.size(),
                                                 torch::full({}, static_cast<double>(step), opts));
    at::_fused_adamw_(ps, grads, m, v, /*max_exp_avg_sqs=*/{}, state_steps, lr, beta1, beta2,
                      weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false, grad_scale,
                      std::nullopt);
  }
  g_device_path = 2;
#else
  (void)grads, (void)m, (void)v, (void)step, (void)lr, (void)lr_t, (void)step_t, (void)beta1;
  (void)beta2, (void)weight_decay, (void)eps, (void)div;
  TORCH_CHECK(false, "FusedAdamWOnDevice: this LibTorch has no CUDA");
#endif
}

// The parameter's AdamW state, made as torch::optim::AdamW makes it (zero moments, step 0) the
// first time, with its step count advanced for the update about to be applied.
torch::optim::AdamWParamState& AdvanceState(torch::optim::AdamW& optimizer,
                                            const torch::Tensor& p) {
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
  return st;
}

// A CPU parameter: the parameter server's vectorized kernel, over LibTorch's intra-op threads.
void CpuStep(const torch::optim::AdamWOptions& options, torch::Tensor& p,
             torch::optim::AdamWParamState& st, double lr, double grad_scale) {
  TORCH_CHECK(p.scalar_type() == torch::kFloat && p.is_contiguous(),
              "FusedAdamWStep: parameters must be contiguous fp32");
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

// CUDA parameters: DeviceAdamW (the project's multi-tensor kernel, or LibTorch's fused one), the
// gradients divided by `grad_divisor` (undefined: 1).
void CudaStep(torch::optim::AdamW& optimizer, const torch::optim::AdamWOptions& options,
              const std::vector<torch::Tensor>& params, double lr,
              const torch::Tensor& grad_divisor) {
  if (params.empty()) return;
  std::vector<torch::Tensor> grads, m, v;
  int64_t step = 0;
  for (const auto& p : params) {
    auto& st = AdvanceState(optimizer, p);
    TORCH_CHECK(grads.empty() || st.step() == step,
                "FusedAdamWStep: parameters at different step counts on the GPU");
    step = st.step();
    grads.push_back(p.grad());
    m.push_back(st.exp_avg());
    v.push_back(st.exp_avg_sq());
  }
  FusedAdamWOnDevice(params, grads, m, v, step, lr, std::get<0>(options.betas()),
                     std::get<1>(options.betas()), options.weight_decay(), options.eps(),
                     grad_divisor);
}

// `grad_scale` as the fused kernel's divisor on the parameters' device; undefined for 1.
torch::Tensor Divisor(const std::vector<torch::Tensor>& params, double grad_scale) {
  if (params.empty() || grad_scale == 1.0) return torch::Tensor();
  return torch::full({}, 1.0 / grad_scale, params[0].options().dtype(torch::kFloat));
}

void Step(torch::optim::AdamW& optimizer, double lr, double grad_scale,
          const torch::Tensor* grad_divisor) {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    std::vector<torch::Tensor> on_gpu;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.is_cuda()) {
        on_gpu.push_back(p);
      } else {
        TORCH_CHECK(grad_divisor == nullptr,
                    "FusedAdamWStep: a gradient divisor tensor is for CUDA parameters");
        CpuStep(options, p, AdvanceState(optimizer, p), lr, grad_scale);
      }
    }
    CudaStep(optimizer, options, on_gpu, lr,
             grad_divisor != nullptr ? *grad_divisor : Divisor(on_gpu, grad_scale));
  }
}

}  // namespace

void FusedAdamWStep(torch::optim::AdamW& optimizer, double lr, double grad_scale) {
  Step(optimizer, lr, grad_scale, nullptr);
}

void FusedAdamWStep(torch::optim::AdamW& optimizer, double lr, const torch::Tensor& grad_divisor) {
  Step(optimizer, lr, 1.0, &grad_divisor);
}

void FusedAdamWOnDevice(const std::vector<torch::Tensor>& params,
                        const std::vector<torch::Tensor>& grads,
                        const std::vector<torch::Tensor>& m, const std::vector<torch::Tensor>& v,
                        int64_t step, double lr, double beta1, double beta2, double weight_decay,
                        double eps, double grad_scale) {
  FusedAdamWOnDevice(params, grads, m, v, step, lr, beta1, beta2, weight_decay, eps,
                     Divisor(params, grad_scale));
}

void FusedAdamWOnDevice(const std::vector<torch::Tensor>& params,
                        const std::vector<torch::Tensor>& grads,
                        const std::vector<torch::Tensor>& m, const std::vector<torch::Tensor>& v,
                        int64_t step, double lr, double beta1, double beta2, double weight_decay,
                        double eps, const torch::Tensor& grad_divisor) {
  DeviceAdamW(params, grads, m, v, lr, step, torch::Tensor(), torch::Tensor(), beta1, beta2,
              weight_decay, eps, grad_divisor);
}

void SetOwnAdamWKernel(bool enabled) { g_own_kernel = enabled; }

const char* DeviceAdamWKernel() {
  switch (g_device_path.load()) {
    case 1:
      return "trainyard";
    case 2:
      return "torch";
    default:
      return "none";
  }
}

torch::optim::AdamWParamState& AdamWStateOf(torch::optim::AdamW& optimizer, const torch::Tensor& p,
                                            const char* caller) {
  auto it = optimizer.state().find(OptimizerStateKey(p));
  TORCH_CHECK(it != optimizer.state().end() && it->second != nullptr, caller,
              ": a parameter without AdamW state");
  return static_cast<torch::optim::AdamWParamState&>(*it->second);
}

int64_t AdvanceAdamWSteps(torch::optim::AdamW& optimizer,
                          const std::vector<torch::Tensor>& params) {
  int64_t step = -1;
  for (const auto& p : params) {
    auto& st = AdamWStateOf(optimizer, p, "AdvanceAdamWSteps");
    st.step(st.step() + 1);
    TORCH_CHECK(step < 0 || st.step() == step,
                "AdvanceAdamWSteps: parameters at different step counts");
    step = st.step();
  }
  return step;
}

void FusedAdamWFromDevice(torch::optim::AdamW& optimizer, const std::vector<torch::Tensor>& params,
                          const torch::Tensor& lr, const torch::Tensor& step,
                          const torch::Tensor& grad_divisor) {
  torch::NoGradGuard no_grad;
  std::unordered_set<const void*> wanted;
  for (const auto& p : params) wanted.insert(p.unsafeGetTensorImpl());
  // One launch per parameter group (their weight decays differ).
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    std::vector<torch::Tensor> ps, grads, m, v;
    for (auto& p : group.params()) {
      if (!p.grad().defined() || wanted.count(p.unsafeGetTensorImpl()) == 0) continue;
      auto& st = AdamWStateOf(optimizer, p, "FusedAdamWFromDevice");
      if (!p.is_cuda()) {
        // The CPU (tests of the graphs' bookkeeping): the values read back, the step count
        // checked against the host's.
        TORCH_CHECK(step.item<double>() == static_cast<double>(st.step()),
                    "FusedAdamWFromDevice: the step tensor says ", step.item<double>(),
                    ", the parameter's state ", st.step());
        CpuStep(options, p, st, lr.item<double>(),
                grad_divisor.defined() ? 1.0 / grad_divisor.item<double>() : 1.0);
        continue;
      }
      ps.push_back(p);
      grads.push_back(p.grad());
      m.push_back(st.exp_avg());
      v.push_back(st.exp_avg_sq());
    }
    DeviceAdamW(ps, grads, m, v, 0.0, 0, lr, step, std::get<0>(options.betas()),
                std::get<1>(options.betas()), options.weight_decay(), options.eps(), grad_divisor);
  }
}

}  // namespace trainyard::trainer
