// GradientReducer (see ddp.h).
#include "worker/trainer/parallel/ddp.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>

namespace trainyard::trainer {

class GradientReducer::Hook : public torch::autograd::FunctionPostHook {
 public:
  Hook(GradientReducer* reducer, int param) : reducer_(reducer), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    reducer_->MarkReady(param_);
    return outputs;
  }

 private:
  GradientReducer* reducer_;
  int param_;
};

GradientReducer::GradientReducer(std::vector<torch::Tensor> params, Communicator& comm,
                                 double bucket_mb, double first_bucket_mb)
    : params_(std::move(params)), comm_(comm) {
  const int n = static_cast<int>(params_.size());
  slots_.resize(n);
  ready_.assign(n, false);
  int64_t cap_bytes = static_cast<int64_t>(first_bucket_mb * (1 << 20));
  int64_t filled_bytes = 0;
  for (int i = n - 1; i >= 0; --i) {
    const int64_t bytes = params_[i].numel() * static_cast<int64_t>(sizeof(float));
    if (buckets_.empty() || (filled_bytes > 0 && filled_bytes + bytes > cap_bytes)) {
      if (!buckets_.empty()) cap_bytes = static_cast<int64_t>(bucket_mb * (1 << 20));
      buckets_.emplace_back();
      filled_bytes = 0;
    }
    Bucket& b = buckets_.back();
    slots_[i] = Slot{static_cast<int>(buckets_.size()) - 1, filled_bytes / 4};
    b.params.push_back(i);
    filled_bytes += bytes;
  }
  for (Bucket& b : buckets_) {
    int64_t numel = 0;
    for (int p : b.params) numel += params_[p].numel();
    // On the parameters' device: on a GPU the bucket's all-reduce (NCCL) runs on its own stream
    // while backward goes on.
    b.buffer = torch::zeros({numel}, params_[b.params[0]].options().dtype(torch::kFloat));
    bytes_per_step_ += numel * static_cast<int64_t>(sizeof(float));
  }
  for (int i = 0; i < n; ++i) {
    // Keep the accumulator alive: the variable holds it only weakly.
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<Hook>(this, i)));
    accumulators_.push_back(std::move(accumulator));
  }
}

GradientReducer::~GradientReducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void GradientReducer::Prepare(bool sync) {
  sync_ = sync;
  if (!sync) return;
  std::fill(ready_.begin(), ready_.end(), false);
  for (Bucket& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.handle.reset();
  }
  next_launch_ = 0;
}

void GradientReducer::MarkReady(int param) {
  if (!sync_ || ready_[param]) return;
  ready_[param] = true;
  const Slot& slot = slots_[param];
  Bucket& b = buckets_[slot.bucket];
  const torch::Tensor& grad = params_[param].grad();
  torch::NoGradGuard no_grad;
  b.buffer.narrow(0, slot.offset, grad.numel()).copy_(grad.reshape({-1}));
  --b.pending;
  LaunchReady();
}

void GradientReducer::LaunchReady() {
  while (next_launch_ < num_buckets() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_];
    b.handle = comm_.AllReduceAverage({b.buffer});
    ++next_launch_;
  }
}

double GradientReducer::Finish() {
  torch::NoGradGuard no_grad;
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    if (ready_[i]) continue;
    const Slot& slot = slots_[i];
    Bucket& b = buckets_[slot.bucket];
    torch::Tensor dst = b.buffer.narrow(0, slot.offset, params_[i].numel());
    if (params_[i].grad().defined()) {
      dst.copy_(params_[i].grad().reshape({-1}));
    } else {
      dst.zero_();
    }
    ready_[i] = true;
    --b.pending;
  }
  LaunchReady();
  const auto start = std::chrono::steady_clock::now();
  for (Bucket& b : buckets_) b.handle->Wait();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    const Slot& slot = slots_[i];
    torch::Tensor mean = buckets_[slot.bucket].buffer.narrow(0, slot.offset, params_[i].numel());
    params_[i].mutable_grad() = mean.view_as(params_[i]);
  }
  sync_ = false;
  return waited;
}

}  // namespace trainyard::trainer
