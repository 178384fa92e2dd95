// FsdpModel (see fsdp.h).
#include "worker/trainer/parallel/fsdp.h"
#include "worker/trainer/runtime/torch_compat.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace trainyard::trainer {

// Runs communication tasks one at a time, in the order they were enqueued.
class FsdpModel::CommThread {
 public:
  CommThread() : thread_([this] { Loop(); }) {}
  ~CommThread() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  std::shared_future<void> Enqueue(std::function<void()> fn) {
    auto task = std::make_shared<std::packaged_task<void()>>(std::move(fn));
    std::shared_future<void> done = task->get_future().share();
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
    return done;
  }

 private:
  void Loop() {
    while (true) {
      std::shared_ptr<std::packaged_task<void()>> task;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this] { return stopping_ || !queue_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      (*task)();  // an exception lands in the task's future
    }
  }

  absl::Mutex mu_;
  std::deque<std::shared_ptr<std::packaged_task<void()>>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

class FsdpModel::GradHook : public torch::autograd::FunctionPostHook {
 public:
  GradHook(FsdpModel* fsdp, int param) : fsdp_(fsdp), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fsdp_->OnGradReady(param_);
    return outputs;
  }

 private:
  FsdpModel* fsdp_;
  int param_;
};

std::vector<std::pair<int, int>> WrapBlocks(const std::vector<int64_t>& block_params,
                                            WrapPolicy policy, int64_t min_num_params) {
  std::vector<std::pair<int, int>> out;
  const int n = static_cast<int>(block_params.size());
  if (policy != WrapPolicy::kSizeBased) {
    for (int b = 0; b < n; ++b) out.emplace_back(b, b);
    return out;
  }
  int first = 0;
  int64_t sum = 0;
  for (int b = 0; b < n; ++b) {
    sum += block_params[b];
    if (sum >= min_num_params) {
      out.emplace_back(first, b);
      first = b + 1;
      sum = 0;
    }
  }
  return out;  // blocks first..n-1 (too few parameters for a unit) stay in the root
}

FsdpModel::FsdpModel(LanguageModel& model, Communicator& world, Communicator& shard,
                     Communicator* replica, const FsdpConfig& config)
    : model_(model), world_(world), shard_(shard), replica_(replica), config_(config) {}

FsdpModel::~FsdpModel() {
  model_.set_block_hooks(nullptr);
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  comm_thread_.reset();  // finishes what is queued first
}

absl::StatusOr<std::unique_ptr<FsdpModel>> FsdpModel::Create(
    LanguageModel& model, Communicator& world, Communicator& shard, Communicator* replica,
    const FsdpConfig& config, bool from_rank0) {
  if (config.sharding != Sharding::kFullShard && config.sharding != Sharding::kShardGradOp &&
      config.sharding != Sharding::kHybridShard) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.sharding_strategy: FsdpModel does not run ", Name(config.sharding),
                     " (NO_SHARD runs as DDP)"));
  }
  if (shard.world_size() * (replica ? replica->world_size() : 1) != world.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FSDP groups: ", shard.world_size(), " shards x ", replica ? replica->world_size() : 1,
        " replicas do not make the world of ", world.world_size(), " ranks"));
  }
  std::unique_ptr<FsdpModel> fsdp(new FsdpModel(model, world, shard, replica, config));
  absl::Status s = fsdp->Build(from_rank0);
  if (!s.ok()) return s;
  return fsdp;
}

absl::Status FsdpModel::Build(bool from_rank0) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : model_.named_parameters()) {
    if (!config_.holds || config_.holds(item.key())) named.emplace_back(item.key(), item.value());
  }
  const int nblocks = model_.NumBlocks();
  std::vector<int64_t> block_params(nblocks, 0);
  std::vector<int> block_of_param;
  for (const auto& [name, value] : named) {
    const int b = model_.BlockOf(name);
    if (b >= nblocks) {
      return absl::InternalError(absl::StrCat("parameter ", name, " names block ", b));
    }
    block_of_param.push_back(b);
    if (b >= 0) block_params[b] += value.numel();
    params_.push_back(value);
  }
  unit_of_block_.assign(nblocks, 0);
  units_.emplace_back();  // the root
  for (auto [first, last] : WrapBlocks(block_params, config_.wrap, config_.min_num_params)) {
    // Only blocks with parameters here (a pipeline stage's) begin or end a unit.
    while (first <= last && block_params[first] == 0) ++first;
    while (last >= first && block_params[last] == 0) --last;
    if (first > last) continue;
    Unit u;
    u.first_block = first;
    u.last_block = last;
    for (int b = first; b <= last; ++b) unit_of_block_[b] = static_cast<int>(units_.size());
    units_.push_back(std::move(u));
  }
  unit_of_param_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const int b = block_of_param[i];
    unit_of_param_[i] = b < 0 ? 0 : unit_of_block_[b];
    Unit& u = units_[unit_of_param_[i]];
    (params_[i].requires_grad() ? u.train : u.frozen).params.push_back(static_cast<int>(i));
  }

  const int S = shard_.world_size(), me = shard_.rank();
  // The model's device: flat buffers, gradients and optimizer state live there.
  const torch::Device device = params_.empty() ? torch::Device(torch::kCPU) : params_[0].device();
  int64_t train_total = 0, frozen_total = 0;  // shard elements
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    Unit& u = units_[ui];
    for (const bool frozen : {false, true}) {
      FlatParam& f = frozen ? u.frozen : u.train;
      if (frozen && f.params.empty()) continue;
      flats_.emplace_back(static_cast<int>(ui), frozen);
      FsdpLayout::Unit lu;
      lu.frozen = frozen;
      for (int p : f.params) {
        f.offsets.push_back(f.numel);
        FsdpLayout::Param lp;
        lp.name = named[p].first;
        lp.shape.assign(params_[p].sizes().begin(), params_[p].sizes().end());
        lp.offset = f.numel;
        lp.index = p;
        lu.params.push_back(std::move(lp));
        f.numel += params_[p].numel();
      }
      lu.numel = f.numel;
      layout_.units.push_back(std::move(lu));
      f.padded = (f.numel + S - 1) / S * S;
      f.shard_numel = f.padded / S;
      (frozen ? frozen_total : train_total) += f.shard_numel;

      // Fill the flat buffer (on rank 0, or everywhere), hand it around, keep this rank's shard.
      f.full = torch::zeros({f.padded}, torch::TensorOptions(torch::kFloat).device(device));
      const bool has_values = !from_rank0 || world_.rank() == 0;
      if (has_values) {
        for (size_t k = 0; k < f.params.size(); ++k) {
          const torch::Tensor& p = params_[f.params[k]];
          f.full.narrow(0, f.offsets[k], p.numel()).copy_(p.reshape({-1}));
        }
      }
      if (from_rank0 && f.padded > 0) world_.Broadcast({f.full}, 0);
      f.shard = f.full.narrow(0, me * f.shard_numel, f.shard_numel).clone();
      if (!frozen) {
        f.shard.set_requires_grad(true);
        f.shard.mutable_grad() = torch::zeros_like(f.shard);
      }
      // A shard group of one (one rank, or HYBRID_SHARD with one rank per node): the shard is
      // the whole unit, so the parameters are views of it and nothing is ever gathered or freed.
      if (single_shard()) f.full = f.shard.detach();
      for (size_t k = 0; k < f.params.size(); ++k) {
        torch::Tensor& p = params_[f.params[k]];
        p.set_data(f.full.narrow(0, f.offsets[k], p.numel()).view(p.sizes()));
      }
      if (!single_shard()) FreeStorage(f.full);  // sharded until first use
    }
    if (single_shard()) u.gathered = Gathered::kYes;
  }
  // Parameter and gradient shards; frozen parameter shards.
  Track((2 * train_total + frozen_total) * static_cast<int64_t>(sizeof(float)));

  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) continue;  // frozen: no gradient, no hook
    // Keep the accumulator alive: the variable holds it only weakly.
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(
        accumulator->add_post_hook(std::make_unique<GradHook>(this, static_cast<int>(i))));
    accumulators_.push_back(std::move(accumulator));
  }
  // The optimizer's slots: every trained flat buffer's shard (empty ones too, so that every rank
  // of the shard group steps the same slots), with the parameters laid out in the buffer.
  std::vector<OptimizerSlot> slots;
  for (int i = 0; i < num_flats(); ++i) {
    if (flats_[i].second) {
      slot_of_flat_.push_back(-1);
      continue;
    }
    const FlatParam& f = Flat(i);
    slot_of_flat_.push_back(static_cast<int>(slots.size()));
    std::vector<OptimizerSlot::Param> params = OptimizerParams(layout_.units[i]);
    if (config_.decays) {
      for (size_t k = 0; k < params.size(); ++k) {
        const FsdpLayout::Param& param = layout_.units[i].params[k];
        params[k].decay = config_.decays(param.name, static_cast<int64_t>(param.shape.size()));
      }
    }
    slots.push_back(
        {f.shard, single_shard() ? 0 : shard_.rank() * f.shard_numel, std::move(params)});
  }
  optimizer_ = std::make_unique<SlotOptimizer>(config_.optimizer, std::move(slots), &shard_);
  comm_thread_ = std::make_unique<CommThread>();
  model_.set_block_hooks(this);
  return absl::OkStatus();
}

const FsdpModel::FlatParam& FsdpModel::Flat(int i) const {
  const auto& [unit, frozen] = flats_[i];
  return frozen ? units_[unit].frozen : units_[unit].train;
}

FsdpModel::FlatParam& FsdpModel::Flat(int i) {
  const auto& [unit, frozen] = flats_[i];
  return frozen ? units_[unit].frozen : units_[unit].train;
}

void FsdpModel::Track(int64_t delta_bytes) {
  const int64_t now = current_bytes_.fetch_add(delta_bytes) + delta_bytes;
  int64_t peak = peak_bytes_.load();
  while (now > peak && !peak_bytes_.compare_exchange_weak(peak, now)) {
  }
}

int FsdpModel::GatheredBlockUnits() const {
  if (single_shard()) return 0;  // always whole, never counted
  int n = 0;
  for (size_t i = 1; i < units_.size(); ++i) n += units_[i].gathered != Gathered::kNo;
  return n;
}

void FsdpModel::StartGather(int ui) {
  Unit& u = units_[ui];
  const int64_t numel = GatheredNumel(u);
  if (u.gathered != Gathered::kNo || numel == 0) {
    if (numel == 0) u.gathered = Gathered::kYes;
    return;
  }
  for (FlatParam* f : {&u.train, &u.frozen}) {
    if (f->padded > 0) AllocateStorage(f->full, f->padded * static_cast<int64_t>(sizeof(float)));
  }
  Track(numel * static_cast<int64_t>(sizeof(float)));
  u.gathered = Gathered::kInFlight;
  ++gathers_;
  u.gather_done = comm_thread_->Enqueue([this, ui] {
    Unit& unit = units_[ui];
    for (FlatParam* f : {&unit.train, &unit.frozen}) {
      if (f->padded == 0) continue;
      std::vector<torch::Tensor> outs;
      for (int r = 0; r < shard_.world_size(); ++r) {
        outs.push_back(f->full.narrow(0, r * f->shard_numel, f->shard_numel));
      }
      shard_.AllGatherInto(f->shard.detach(), std::move(outs));
    }
  });
}

void FsdpModel::EnsureGathered(int ui) {
  StartGather(ui);
  Unit& u = units_[ui];
  if (u.gathered == Gathered::kInFlight) {
    u.gather_done.get();  // rethrows a failed all-gather
    u.gathered = Gathered::kYes;
  }
}

void FsdpModel::Prefetch(int ui) {
  if (ui <= 0 || ui >= num_units()) return;
  if (units_[ui].gathered != Gathered::kNo) return;
  if (GatheredBlockUnits() >= config_.max_gathered_units) return;
  StartGather(ui);
}

void FsdpModel::Release(int ui) {
  Unit& u = units_[ui];
  const int64_t numel = GatheredNumel(u);
  if (u.gathered == Gathered::kNo || numel == 0 || single_shard()) return;
  if (u.gathered == Gathered::kInFlight) u.gather_done.get();
  for (FlatParam* f : {&u.train, &u.frozen}) {
    if (f->padded > 0) FreeStorage(f->full);
  }
  Track(-numel * static_cast<int64_t>(sizeof(float)));
  u.gathered = Gathered::kNo;
}

void FsdpModel::BeginForward(bool sync_gradients) {
  if (!hooks_on_) return;
  sync_gradients_ = sync_gradients;
  for (Unit& u : units_) {
    u.pending_grads = static_cast<int>(u.train.params.size());
    u.reduced = false;
    u.input_grad_done = false;
  }
  reductions_.clear();
  EnsureGathered(0);
}

void FsdpModel::BeforeBlock(int block) {
  const int ui = unit_of_block_[block];
  if (ui == 0 || block != units_[ui].first_block) return;
  EnsureGathered(ui);
  if (config_.forward_prefetch) Prefetch(ui + 1);
}

void FsdpModel::AfterBlock(int block, const torch::Tensor& output) {
  const int ui = unit_of_block_[block];
  if (ui == 0 || block != units_[ui].last_block) return;
  const bool training = torch::GradMode::is_enabled() && output.requires_grad();
  if (training) {
    output.register_hook([this, ui](const torch::Tensor&) { PreBackward(ui); });
  }
  if (!training || config_.sharding != Sharding::kShardGradOp) Release(ui);
}

void FsdpModel::ReleaseAfterForward() {
  if (!hooks_on_) return;
  for (int ui = 0; ui < num_units(); ++ui) Release(ui);
}

void FsdpModel::WatchLoss(const torch::Tensor& loss) {
  if (!hooks_on_ || !loss.requires_grad()) return;
  loss.register_hook([this](const torch::Tensor&) { PreBackward(0); });
}

// Gradients of the unit's parameters accumulate into views of one flat buffer: a zeroed one per
// micro-step, reduce-scattered after it; with a shard group of one, the gradient shard itself
// (the whole unit), reduced across replicas only on the last micro-step.
void FsdpModel::PrepareGradients(int ui) {
  Unit& u = units_[ui];
  if (u.grad.defined()) return;
  FlatParam& f = u.train;
  if (single_shard()) {
    u.grad = f.shard.grad();
  } else {
    u.grad = torch::zeros({f.padded}, f.shard.options());
    Track(f.padded * static_cast<int64_t>(sizeof(float)));
  }
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < f.params.size(); ++k) {
    torch::Tensor& p = params_[f.params[k]];
    torch::Tensor view = u.grad.narrow(0, f.offsets[k], p.numel()).view(p.sizes());
    // A gradient autograd stored before the buffer existed is kept.
    if (p.grad().defined()) view.add_(p.grad());
    p.mutable_grad() = view;
  }
}

void FsdpModel::PreBackward(int ui) {
  EnsureGathered(ui);
  PrepareGradients(ui);
  // Block unit ui's output is unit ui+1's input: its gradient is complete, so unit ui+1's frozen
  // weights have served (released before the prefetch below counts the units gathered). The first
  // block unit has no such hook: FinishBackward frees it, right after its backward.
  if (ui > 0 && ui + 1 < num_units()) {
    Unit& next = units_[ui + 1];
    if (!next.frozen.params.empty()) {
      next.input_grad_done = true;
      if (next.reduced) Release(ui + 1);
    }
  }
  if (config_.backward_prefetch == BackwardPrefetch::kBackwardPre) Prefetch(ui - 1);
}

void FsdpModel::OnGradReady(int param) {
  const int ui = unit_of_param_[param];
  Unit& u = units_[ui];
  if (!hooks_on_ || u.reduced) return;
  if (--u.pending_grads == 0) PostBackward(ui);
}

void FsdpModel::PostBackward(int ui) {
  Unit& u = units_[ui];
  u.reduced = true;
  if (config_.backward_prefetch == BackwardPrefetch::kBackwardPost) Prefetch(ui - 1);
  torch::NoGradGuard no_grad;
  if (!u.grad.defined()) PrepareGradients(ui);  // no hook ran: nothing used the unit
  const FlatParam& f = u.train;
  for (size_t k = 0; k < f.params.size(); ++k) {
    torch::Tensor& p = params_[f.params[k]];
    torch::Tensor view = u.grad.narrow(0, f.offsets[k], p.numel());
    // Autograd may have stored a gradient of its own (one that arrived while the parameter had
    // none): it adds to what the buffer holds (earlier micro-steps, with a shard group of one).
    if (p.grad().defined() && p.grad().data_ptr() != view.data_ptr()) {
      view.add_(p.grad().reshape({-1}));
    }
    p.mutable_grad() = torch::Tensor();
  }
  // Frozen weights serve the input's gradient, which may come after the trained gradients.
  if ((u.frozen.params.empty() || u.input_grad_done) && !(ui == 0 && keep_root_)) Release(ui);
  const int world = world_.world_size();
  torch::Tensor grad = std::move(u.grad);
  u.grad = torch::Tensor();
  if (single_shard()) {
    // The gradients accumulated in place: like DDP's no_sync, nothing to send before the last
    // micro-step, then one all-reduce across the replicas and the average.
    if (!sync_gradients_ || f.padded == 0 || world == 1) return;
    reductions_.push_back(comm_thread_->Enqueue([this, ui, world] {
      torch::NoGradGuard no_grad_here;
      torch::Tensor g = units_[ui].train.shard.grad();
      replica_->AllReduceSum({g})->Wait();
      g.div_(world);
    }));
    return;
  }
  reductions_.push_back(comm_thread_->Enqueue([this, ui, grad, world]() mutable {
    torch::NoGradGuard no_grad_here;
    FlatParam& flat = units_[ui].train;
    torch::Tensor mine;
    if (flat.padded > 0) {
      mine = shard_.ReduceScatterSum(grad,
                                     std::vector<int64_t>(shard_.world_size(), flat.shard_numel));
      if (replica_ != nullptr) replica_->AllReduceSum({mine})->Wait();
      flat.shard.mutable_grad().add_(mine, 1.0 / world);
    }
    mine = torch::Tensor();
    grad = torch::Tensor();
    Track(-flat.padded * static_cast<int64_t>(sizeof(float)));
  }));
}

double FsdpModel::FinishBackward() {
  if (!hooks_on_) return 0;
  // Units whose gradients did not all arrive (parameters the loss did not use), last first, as
  // backward would have reached them.
  for (int ui = num_units() - 1; ui >= 0; --ui) {
    if (!units_[ui].reduced) PostBackward(ui);
  }
  const auto start = std::chrono::steady_clock::now();
  for (auto& done : reductions_) done.get();  // rethrows a failed reduce-scatter
  reductions_.clear();
  for (int ui = keep_root_ ? 1 : 0; ui < num_units(); ++ui) Release(ui);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double FsdpModel::GradNorm() {
  torch::Tensor sq = ShardGradSquaredTensor({});
  shard_.AllReduceSum({sq})->Wait();
  return std::sqrt(sq.item<double>());  // the step's one read-back for it
}

void FsdpModel::Step(double lr, double clip_scale) {
  torch::NoGradGuard no_grad;
  optimizer_->Step(lr, clip_scale);
  if (!optimizer_counted_) {
    optimizer_counted_ = true;
    Track(optimizer_->StateBytes());
  }
  for (Unit& u : units_) u.train.shard.mutable_grad().zero_();
}

void FsdpModel::GatherFullParameters() {
  hooks_on_ = false;
  model_.set_block_hooks(nullptr);
  for (int ui = 0; ui < num_units(); ++ui) StartGather(ui);
  for (int ui = 0; ui < num_units(); ++ui) EnsureGathered(ui);
}

torch::Tensor FsdpModel::ShardGradSquaredTensor(const std::vector<std::string>& skip) {
  torch::NoGradGuard no_grad;
  // Each shard's sum of squares in fp64 where it is (a GPU's stay queued there), summed there.
  std::vector<torch::Tensor> held, skipped;
  for (const Unit& u : units_) {
    if (u.train.shard_numel > 0) {
      held.push_back(torch::sum(u.train.shard.grad().pow(2), torch::kDouble).reshape({1}));
    }
  }
  for (const std::string& name : skip) {
    for (const torch::Tensor& g : ShardGradOf(name)) {
      skipped.push_back(torch::sum(g.pow(2), torch::kDouble).reshape({1}));
    }
  }
  if (held.empty()) return torch::zeros({1}, torch::kDouble);
  torch::Tensor sq = torch::cat(held).sum().reshape({1});
  // (In double: a small part subtracted from a large whole.)
  if (!skipped.empty()) sq = sq - torch::cat(skipped).sum();
  return sq;
}

FsdpModel::Placement FsdpModel::Place(const std::string& name) {
  for (size_t i = 0; i < layout_.units.size(); ++i) {
    if (layout_.units[i].frozen) continue;
    for (const FsdpLayout::Param& p : layout_.units[i].params) {
      if (p.name != name) continue;
      int64_t numel = 1;
      for (int64_t d : p.shape) numel *= d;
      return {&Flat(static_cast<int>(i)), p.offset, numel};
    }
  }
  return {};
}

std::pair<int64_t, int64_t> FsdpModel::ShardRange(const Placement& p) const {
  const int64_t lo = shard_.rank() * p.flat->shard_numel;
  const int64_t begin = std::max(p.offset, lo);
  const int64_t end = std::min(p.offset + p.numel, lo + p.flat->shard_numel);
  return {begin - lo, std::max(begin, end) - lo};
}

std::vector<torch::Tensor> FsdpModel::ShardGradOf(const std::string& name) {
  const Placement p = Place(name);
  if (p.flat == nullptr) return {};
  const auto [begin, end] = ShardRange(p);
  if (end <= begin) return {};
  return {p.flat->shard.mutable_grad().narrow(0, begin, end - begin)};
}

torch::Tensor FsdpModel::GatherGrad(const std::string& name) {
  torch::NoGradGuard no_grad;
  const Placement p = Place(name);
  if (p.flat == nullptr) return torch::Tensor();
  torch::Tensor whole = torch::empty({p.flat->padded}, p.flat->shard.options());
  std::vector<torch::Tensor> outs;
  for (int r = 0; r < shard_.world_size(); ++r) {
    outs.push_back(whole.narrow(0, r * p.flat->shard_numel, p.flat->shard_numel));
  }
  shard_.AllGatherInto(p.flat->shard.grad(), std::move(outs));
  return whole.narrow(0, p.offset, p.numel).clone();
}

void FsdpModel::SetGrad(const std::string& name, const torch::Tensor& whole) {
  torch::NoGradGuard no_grad;
  const Placement p = Place(name);
  if (p.flat == nullptr) return;
  const auto [begin, end] = ShardRange(p);
  if (end <= begin) return;
  const int64_t lo = shard_.rank() * p.flat->shard_numel;
  p.flat->shard.mutable_grad()
      .narrow(0, begin, end - begin)
      .copy_(whole.reshape({-1}).narrow(0, lo + begin - p.offset, end - begin));
}

int64_t FsdpModel::bytes_sent() const {
  return shard_.bytes_sent() + (replica_ != nullptr ? replica_->bytes_sent() : 0);
}

std::vector<OptimizerSlot::Param> OptimizerParams(const FsdpLayout::Unit& unit) {
  std::vector<OptimizerSlot::Param> out;
  for (const FsdpLayout::Param& p : unit.params) out.push_back({p.shape, p.offset});
  return out;
}

FsdpShardState FsdpModel::ExportState() {
  FsdpShardState out;
  out.step = optimizer_->step();
  for (int i = 0; i < num_flats(); ++i) {
    out.params.push_back(Flat(i).shard.detach().to(torch::kCPU));
    out.optimizer.push_back(slot_of_flat_[i] < 0 ? std::map<std::string, torch::Tensor>()
                                                 : optimizer_->State(slot_of_flat_[i]));
  }
  return out;
}

absl::Status FsdpModel::ImportState(const FsdpShardState& state) {
  torch::NoGradGuard no_grad;
  // Every rank's step, also one whose slots hold no state (all of them empty or padding).
  if (state.step > 0) optimizer_->SetStep(state.step);
  for (int i = 0; i < num_flats(); ++i) {
    FlatParam& f = Flat(i);
    f.shard.copy_(state.params[i]);
    if (slot_of_flat_[i] < 0 || state.optimizer[i].empty()) continue;
    RETURN_IF_ERROR(optimizer_->SetState(slot_of_flat_[i], state.optimizer[i], state.step));
  }
  if (optimizer_->step() > 0 && !optimizer_counted_) {
    optimizer_counted_ = true;
    Track(optimizer_->StateBytes());
  }
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
