// OffloadOptimizer (see offload.h).
#include "worker/trainer/parallel/offload.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {

class OffloadOptimizer::Hook : public torch::autograd::FunctionPostHook {
 public:
  Hook(OffloadOptimizer* owner, int param) : owner_(owner), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    owner_->MarkReady(param_);
    return outputs;
  }

 private:
  OffloadOptimizer* owner_;
  int param_;
};

OffloadOptimizer::OffloadOptimizer(std::vector<torch::Tensor> params, Communicator& comm,
                                   OffloadConfig config)
    : params_(std::move(params)), comm_(comm), config_(std::move(config)) {}

OffloadOptimizer::~OffloadOptimizer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (pusher_.joinable()) pusher_.join();
}

absl::StatusOr<std::unique_ptr<OffloadOptimizer>> OffloadOptimizer::Create(
    std::vector<torch::Tensor> params, Communicator& comm, std::vector<PsRangeRef> ranges,
    OffloadConfig config, double bucket_mb) {
  std::unique_ptr<OffloadOptimizer> o(
      new OffloadOptimizer(std::move(params), comm, std::move(config)));
  for (const auto& p : o->params_) {
    o->offsets_.push_back(o->total_);
    o->total_ += p.numel();
  }
  if (ranges.empty() || ranges.back().end != o->total_) {
    return absl::InvalidArgumentError(absl::StrCat("--ps: the ranges cover ",
                                                   ranges.empty() ? 0 : ranges.back().end,
                                                   " parameters but the model has ", o->total_));
  }
  const int world = comm.world_size();
  o->slice_ = (o->total_ + world - 1) / world;
  ASSIGN_OR_RETURN(o->servers_, ParameterServers::Connect(std::move(ranges), o->config_.servers));
  // Buckets in reverse registration order (the order backward produces gradients), as DDP's:
  // each a contiguous range of the flat vector of about bucket_mb.
  const int n = static_cast<int>(o->params_.size());
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20)) / 4);
  o->bucket_of_.assign(n, 0);
  for (int i = n - 1; i >= 0; --i) {
    const int64_t numel = o->params_[i].numel();
    if (o->buckets_.empty() || (o->buckets_.back().end - o->buckets_.back().begin > 0 &&
                                o->buckets_.back().end - o->buckets_.back().begin + numel > cap)) {
      Bucket b;
      b.end = o->offsets_[i] + numel;
      b.begin = b.end;
      b.last_param = i;
      o->buckets_.push_back(b);
    }
    Bucket& b = o->buckets_.back();
    b.begin = o->offsets_[i];
    b.first_param = i;
    o->bucket_of_[i] = static_cast<int>(o->buckets_.size()) - 1;
  }
  // On a GPU the gradients land in pinned host memory, which the servers' transfers read.
  const bool on_device = !o->params_.empty() && !o->params_[0].device().is_cpu();
  o->grads_ = torch::zeros({o->total_},
                           torch::TensorOptions().dtype(torch::kFloat).pinned_memory(on_device));
  o->ready_.assign(n, false);
  for (int i = 0; i < n; ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(o->params_[i]);
    o->hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<Hook>(o.get(), i)));
    o->accumulators_.push_back(std::move(accumulator));
  }
  o->pusher_ = std::thread([raw = o.get()] { raw->PusherLoop(); });
  return o;
}

void OffloadOptimizer::Prepare(bool sync, int64_t step) {
  sync_ = sync;
  step_ = step;
  if (!sync) return;
  std::fill(ready_.begin(), ready_.end(), false);
  for (Bucket& b : buckets_) b.pending = b.last_param - b.first_param + 1;
  next_launch_ = 0;
  pushed_bytes_ = 0;
}

void OffloadOptimizer::MarkReady(int param) {
  if (!sync_ || ready_[param]) return;
  ready_[param] = true;
  const torch::Tensor& grad = params_[param].grad();
  torch::NoGradGuard no_grad;
  grads_.narrow(0, offsets_[param], grad.numel()).copy_(grad.reshape({-1}));
  --buckets_[bucket_of_[param]].pending;
  LaunchReady();
}

void OffloadOptimizer::LaunchReady() {
  while (next_launch_ < num_buckets() && buckets_[next_launch_].pending == 0) {
    Task task;
    task.bucket = next_launch_;
    task.step = step_;
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
    ++tasks_queued_;
    ++next_launch_;
  }
}

void OffloadOptimizer::PusherLoop() {
  while (true) {
    Task task;
    bool failed;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](OffloadOptimizer* o)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(o->mu_) { return o->stop_ || !o->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());
      queue_.pop_front();
      failed = !push_status_.ok();
    }
    absl::Status s;
    try {
      if (failed) {
        // The step has failed already: another call to a server that timed out would only add
        // its deadline to the time until the rank reports the failure.
      } else if (task.update) {
        s = UpdateAndPull(task.step, task.lr, task.grad_scale, pending_slice_);
      } else {
        ReduceBucket(buckets_[task.bucket]);
        s = PushBucket(buckets_[task.bucket], task.step);
      }
    } catch (const std::exception& e) {
      s = absl::UnavailableError(absl::StrCat("gradient all-reduce failed: ", e.what()));
    }
    absl::MutexLock lock(&mu_);
    if (push_status_.ok()) push_status_ = s;
    ++tasks_done_;
  }
}

void OffloadOptimizer::ReduceBucket(const Bucket& bucket) {
  const int world = comm_.world_size();
  if (world == 1) return;
  // Each rank's part of the bucket, in rank order (the slices are consecutive).
  std::vector<int64_t> counts(world, 0);
  for (int r = 0; r < world; ++r) {
    const int64_t a = std::min(total_, r * slice_), b = std::min(total_, a + slice_);
    counts[r] = std::max<int64_t>(0, std::min(b, bucket.end) - std::max(a, bucket.begin));
  }
  torch::Tensor flat = grads_.narrow(0, bucket.begin, bucket.end - bucket.begin);
  torch::Tensor mine = comm_.ReduceScatterSum(flat, counts);  // a view into grads_
  mine.div_(world);
}

absl::Status OffloadOptimizer::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](OffloadOptimizer* o)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(o->mu_) { return o->tasks_done_ == o->tasks_queued_; },
      this));
  return push_status_;
}

void OffloadOptimizer::GatherIntoModel(const torch::Tensor& slice) {
  Unflatten(torch::cat(comm_.AllGather(slice)).narrow(0, 0, total_));
}

absl::Status OffloadOptimizer::PushBucket(const Bucket& bucket, int64_t step) {
  const auto [a, b] = OwnedSlice();
  const int64_t lo = std::max(a, bucket.begin), hi = std::min(b, bucket.end);
  if (lo >= hi) return absl::OkStatus();
  // Sent from grads_ itself: it does not change until the push returns.
  RETURN_IF_ERROR(servers_->Push(step, grads_.data_ptr<float>() + lo, lo, hi));
  pushed_bytes_ += (hi - lo) * 4;
  return absl::OkStatus();
}

absl::StatusOr<double> OffloadOptimizer::FinishBackward(double* waited_s) {
  {
    torch::NoGradGuard no_grad;
    for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
      if (ready_[i]) continue;
      torch::Tensor dst = grads_.narrow(0, offsets_[i], params_[i].numel());
      if (params_[i].grad().defined()) {
        dst.copy_(params_[i].grad().reshape({-1}));
      } else {
        dst.zero_();
      }
      ready_[i] = true;
      --buckets_[bucket_of_[i]].pending;
    }
  }
  LaunchReady();
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = Drain();
  if (waited_s != nullptr) {
    *waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  sync_ = false;
  // delayed_update: the previous step's parameters, pulled during this backward, join the model.
  if (status.ok() && pending_) {
    GatherIntoModel(pending_slice_);
    pending_ = false;
  }
  if (!status.ok()) return status;
  // Each rank has the mean gradients of its slice only: sum the squares over the ranks.
  const auto [a, b] = OwnedSlice();
  torch::Tensor sq =
      torch::full({1}, grads_.narrow(0, a, b - a).pow(2).sum().item<double>(), torch::kDouble);
  comm_.AllReduceSum({sq})->Wait();
  return std::sqrt(sq.item<double>());
}

std::pair<int64_t, int64_t> OffloadOptimizer::OwnedSlice() const {
  const int64_t a = std::min(total_, comm_.rank() * slice_);
  return {a, std::min(total_, a + slice_)};
}

torch::Tensor OffloadOptimizer::Flatten() const {
  std::vector<torch::Tensor> parts;
  for (const auto& p : params_) parts.push_back(p.detach().reshape(-1));
  return torch::cat(parts).to(torch::kCPU).to(torch::kFloat).contiguous();
}

void OffloadOptimizer::Unflatten(const torch::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : params_) {
    p.copy_(flat.narrow(0, offset, p.numel()).view_as(p));
    offset += p.numel();
  }
}

absl::Status OffloadOptimizer::Initialize(int64_t step, torch::optim::Optimizer& shadow) {
  if (comm_.rank() == 0) {
    const torch::Tensor flat = Flatten();
    // After a resume the shadow optimizer holds m and v (a fresh one has no state).
    torch::Tensor m, v;
    bool has_state = !shadow.state().empty();
    if (has_state) {
      std::vector<torch::Tensor> ms, vs;
      for (const auto& p : params_) {
        auto it = shadow.state().find(OptimizerStateKey(p));
        if (it == shadow.state().end()) {
          ms.push_back(torch::zeros({p.numel()}));
          vs.push_back(torch::zeros({p.numel()}));
          continue;
        }
        auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
        ms.push_back(st.exp_avg().reshape(-1).to(torch::kCPU));
        vs.push_back(st.exp_avg_sq().reshape(-1).to(torch::kCPU));
      }
      m = torch::cat(ms).contiguous();
      v = torch::cat(vs).contiguous();
    }
    RETURN_IF_ERROR(servers_->InitShards(step, flat.data_ptr<float>(),
                                         has_state ? m.data_ptr<float>() : nullptr,
                                         has_state ? v.data_ptr<float>() : nullptr));
  }
  comm_.Barrier();  // no rank pushes before every shard is initialized
  return absl::OkStatus();
}

absl::Status OffloadOptimizer::UpdateAndPull(int64_t step, double lr, double grad_scale,
                                             torch::Tensor& mine) {
  const auto [a, b] = OwnedSlice();
  if (a < b)
    RETURN_IF_ERROR(servers_->UpdateAndPull(step, lr, grad_scale, a, b, mine.data_ptr<float>()));
  pulled_bytes_ = (b - a) * 4;
  return absl::OkStatus();
}

absl::Status OffloadOptimizer::Step(double lr, double grad_scale) {
  if (!pending_slice_.defined()) {
    pending_slice_ = torch::zeros(
        {slice_}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(grads_.is_pinned()));
  }
  for (auto& p : params_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  if (config_.delayed_update) {
    Task task;
    task.update = true;
    task.step = step_;
    task.lr = lr;
    task.grad_scale = grad_scale;
    pending_ = true;
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
    ++tasks_queued_;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(UpdateAndPull(step_, lr, grad_scale, pending_slice_));
  GatherIntoModel(pending_slice_);
  return absl::OkStatus();
}

absl::Status OffloadOptimizer::Flush() {
  if (!pending_) return absl::OkStatus();
  RETURN_IF_ERROR(Drain());
  GatherIntoModel(pending_slice_);
  pending_ = false;
  return absl::OkStatus();
}

absl::Status OffloadOptimizer::ReadIntoShadow(int64_t step, torch::optim::Optimizer& shadow) {
  torch::Tensor master = torch::empty({total_}), m = torch::empty({total_}),
                v = torch::empty({total_});
  RETURN_IF_ERROR(servers_->ReadState(step, master.data_ptr<float>(), m.data_ptr<float>(),
                                      v.data_ptr<float>()));
  Unflatten(master);
  int64_t offset = 0;
  for (const auto& p : params_) {
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(step);
    // (On the parameters' device, as the state of a DDP job's AdamW is.)
    state->exp_avg(m.narrow(0, offset, p.numel()).view_as(p).clone().to(p.device()));
    state->exp_avg_sq(v.narrow(0, offset, p.numel()).view_as(p).clone().to(p.device()));
    shadow.state()[OptimizerStateKey(p)] = std::move(state);
    offset += p.numel();
  }
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
