// PipelineStage and the stages' parameters and state (see pipeline.h).
#include "worker/trainer/parallel/pipeline.h"

#include <malloc.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {
namespace {

using Clock = std::chrono::steady_clock;

// Tags of the point-to-point messages, above those the collectives' send/recv use.
constexpr int kActivationTag = 1 << 30;
constexpr int kGradientTag = kActivationTag + 1;
constexpr int kTiedTag = kActivationTag + 2;
constexpr int kGatherTag = kActivationTag + 3;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

int64_t HeapInUse() {
  const struct mallinfo2 info = ::mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

}  // namespace

PipelineLayout MakePipelineLayout(int rank, int world, int stages, int tensor_parallel,
                                  std::vector<int> bounds) {
  PipelineLayout l;
  l.stages = stages;
  l.tensor_parallel = tensor_parallel;
  l.replicas = world / (stages * tensor_parallel);
  l.tp_rank = rank % tensor_parallel;
  l.stage = rank / tensor_parallel % stages;
  l.replica = rank / (tensor_parallel * stages);
  l.bounds = std::move(bounds);
  return l;
}

torch::Tensor Whole(const torch::Tensor& t, TensorParallelSplit split, Communicator* tensor) {
  if (tensor == nullptr || split.dim < 0) return t.detach();
  return TensorParallelUnshard(tensor->AllGather(t.detach().contiguous()), split);
}

torch::Tensor CutAsParameter(const torch::Tensor& state, torch::IntArrayRef shape,
                             const std::function<torch::Tensor(const torch::Tensor&)>& cut) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (state.dim() == 0 || state.numel() != numel) return state;
  const torch::Tensor out = cut(state.reshape(shape));
  return state.dim() == out.dim() ? out : out.reshape({-1});
}

namespace {

// The model's parameter names by their tensors.
std::map<const void*, std::string> NamesByTensor(const LanguageModel& model) {
  std::map<const void*, std::string> names;
  for (const auto& item : model.named_parameters()) {
    names[item.value().unsafeGetTensorImpl()] = item.key();
  }
  return names;
}

}  // namespace

bool StageHolds(const LanguageModel& model, const PipelineLayout& layout, const std::string& name) {
  const int block = model.BlockOf(name);
  if (block >= 0) {
    return block >= layout.bounds[layout.stage] && block < layout.bounds[layout.stage + 1];
  }
  if (model.IsEmbedding(name)) {
    return layout.first() || (layout.last() && name == model.TiedWeight());
  }
  return layout.last();
}

std::vector<std::pair<std::string, torch::Tensor>> StageParameters(LanguageModel& model,
                                                                   const PipelineLayout& layout) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model.named_parameters()) {
    if (StageHolds(model, layout, item.key())) out.emplace_back(item.key(), item.value());
  }
  return out;
}

void KeepTensorParallelShards(LanguageModel& model,
                              const std::vector<std::pair<std::string, torch::Tensor>>& params,
                              const PipelineLayout& layout) {
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : params) {
    const TensorParallelSplit split = model.TensorParallelSplitOf(name);
    if (split.dim < 0) continue;
    torch::Tensor param = p;
    param.set_data(TensorParallelShard(p.detach(), split, layout.tp_rank, layout.tensor_parallel));
  }
}

std::map<std::string, std::map<std::string, torch::Tensor>> StageStates(
    const LanguageModel& model, torch::optim::Optimizer& whole, const PipelineLayout& layout,
    int64_t* step) {
  const std::map<const void*, std::string> names = NamesByTensor(model);
  std::map<std::string, std::map<std::string, torch::Tensor>> out;
  *step = 0;
  const auto& all = whole.param_groups().at(0).params();
  for (size_t j = 0; j < all.size(); ++j) {
    const std::string& name = names.at(all[j].unsafeGetTensorImpl());
    if (!StageHolds(model, layout, name)) continue;
    const TensorParallelSplit split = model.TensorParallelSplitOf(name);
    // The whole parameter's shape: this rank's shard's, times the group along the split.
    std::vector<int64_t> shape = all[j].sizes().vec();
    if (split.dim >= 0) shape[split.dim] *= layout.tensor_parallel;
    int64_t param_step = 0;
    std::map<std::string, torch::Tensor> state = ParameterState(whole, j, &param_step);
    *step = std::max(*step, param_step);
    for (auto& [key, value] : state) {
      value = CutAsParameter(value, shape, [&](const torch::Tensor& t) {
        return TensorParallelShard(t, split, layout.tp_rank, layout.tensor_parallel);
      });
    }
    out[name] = std::move(state);
  }
  return out;
}

absl::Status KeepStageState(const LanguageModel& model, torch::optim::Optimizer& whole,
                            torch::optim::Optimizer& stage, const PipelineLayout& layout) {
  int64_t step = 0;
  const auto states = StageStates(model, whole, layout, &step);
  const std::map<const void*, std::string> names = NamesByTensor(model);
  const auto& kept = stage.param_groups().at(0).params();
  for (size_t k = 0; k < kept.size(); ++k) {
    auto it = states.find(names.at(kept[k].unsafeGetTensorImpl()));
    if (it == states.end()) continue;
    RETURN_IF_ERROR(SetParameterState(stage, k, it->second, step));
  }
  return absl::OkStatus();
}

PipelineStage::PipelineStage(LanguageModel& model, Communicator& world, PipelineLayout layout,
                             PipelineSchedule schedule, int micro_batch, GradientReducer* reducer,
                             FsdpModel* fsdp, Communicator* tensor)
    : model_(model),
      world_(world),
      layout_(std::move(layout)),
      schedule_(schedule),
      micro_batch_(micro_batch),
      reducer_(reducer),
      fsdp_(fsdp),
      tensor_(tensor) {
  hidden_options_ = torch::TensorOptions()
                        .dtype(torch::kFloat)
                        .device(model.parameters().empty() ? torch::Device(torch::kCPU)
                                                           : model.parameters()[0].device());
  const std::string tied = model.TiedWeight();
  if (!tied.empty() && layout_.stages > 1 && (layout_.first() || layout_.last())) {
    tied_ = model.named_parameters()[tied];
    tied_name_ = tied;
  }
  if (tensor_ != nullptr) {
    for (const auto& [name, p] : StageParameters(model_, layout_)) {
      if (p.requires_grad() && model_.TensorParallelSplitOf(name).dim < 0) {
        replicated_.push_back(p);
        replicated_names_.push_back(name);
      }
    }
  }
}

std::vector<PipelineStage::Op> PipelineStage::Schedule(int m) const {
  std::vector<Op> ops;
  if (schedule_ == PipelineSchedule::kGpipe) {
    for (int i = 0; i < m; ++i) ops.push_back({true, i});
    for (int i = 0; i < m; ++i) ops.push_back({false, i});
    return ops;
  }
  // 1F1B: warm up with the forwards that fill the stages after this one, then one forward and
  // one backward in turn, then the remaining backwards.
  const int warmup = std::min(layout_.stages - layout_.stage - 1, m);
  int forward = 0, backward = 0;
  for (; forward < warmup; ++forward) ops.push_back({true, forward});
  while (forward < m) {
    ops.push_back({true, forward++});
    ops.push_back({false, backward++});
  }
  while (backward < m) ops.push_back({false, backward++});
  return ops;
}

torch::Tensor PipelineStage::Step(
    int micro_batches, const std::function<torch::Tensor(int)>& windows,
    const std::function<torch::Tensor(int, const torch::Tensor&, const torch::Tensor&)>& loss) {
  const auto start = Clock::now();
  const int64_t heap_at_start = HeapInUse();
  stats_ = PipelineStepStats{};
  const int prev = layout_.first() ? -1 : layout_.RankOf(layout_.stage - 1, layout_.replica);
  const int next = layout_.last() ? -1 : layout_.RankOf(layout_.stage + 1, layout_.replica);
  const std::vector<int64_t> hidden = model_.HiddenShape(micro_batch_);
  const int begin = layout_.bounds[layout_.stage], end = layout_.bounds[layout_.stage + 1];

  // Per micro-batch in flight: the stage's input (whose gradient goes back) and its output (or
  // loss, on the last stage).
  std::map<int, std::pair<torch::Tensor, torch::Tensor>> alive;
  // Sends in flight with their tensors: a micro-batch's activations until its gradient comes back
  // (by then the next stage has them), gradients until more than P are out (the previous stage
  // takes them in order), so a stage keeps O(P) boundary tensors, not O(m).
  std::map<int, std::pair<std::unique_ptr<CommHandle>, torch::Tensor>> activation_sends;
  std::deque<std::pair<std::unique_ptr<CommHandle>, torch::Tensor>> gradient_sends;
  torch::Tensor loss_sum;
  int backwards_left = micro_batches;
  for (const Op& op : Schedule(micro_batches)) {
    if (op.forward) {
      if (fsdp_ != nullptr) fsdp_->BeginForward();
      torch::Tensor x;
      torch::Tensor w;
      if (layout_.first() || layout_.last()) w = windows(op.micro);
      if (layout_.first()) {
        x = model_.Embed(w.narrow(1, 0, w.size(1) - 1));
      } else {
        x = torch::empty(hidden, hidden_options_);
        const auto wait = Clock::now();
        world_.Recv(x, prev, kActivationTag);
        stats_.idle_seconds += Seconds(wait);
        x.requires_grad_(true);
      }
      torch::Tensor y = x;
      for (int b = begin; b < end; ++b) y = model_.RunBlock(b, y);
      if (layout_.last()) {
        y = loss(op.micro, model_.Head(y), w);
        if (fsdp_ != nullptr) fsdp_->WatchLoss(y);
        const torch::Tensor value = y.detach().to(torch::kDouble);
        loss_sum = loss_sum.defined() ? loss_sum + value : value;
      } else {
        // (fp32 whatever autocast computed the block's last operation in: the next stage's
        // buffer is.)
        torch::Tensor out = y.detach().to(torch::kFloat).contiguous();
        activation_sends[op.micro] = {world_.Send(out, next, kActivationTag), out};
      }
      alive[op.micro] = {x, y};
      stats_.peak_in_flight = std::max<int>(stats_.peak_in_flight, alive.size());
      stats_.peak_activation_bytes =
          std::max(stats_.peak_activation_bytes, HeapInUse() - heap_at_start);
    } else {
      auto [x, y] = std::move(alive.at(op.micro));
      alive.erase(op.micro);
      const bool sync = --backwards_left == 0;
      if (reducer_ != nullptr) reducer_->Prepare(sync);
      if (fsdp_ != nullptr) fsdp_->BeginBackward(sync);
      if (layout_.last()) {
        y.backward();
      } else {
        torch::Tensor grad = torch::empty(hidden, hidden_options_);
        const auto wait = Clock::now();
        world_.Recv(grad, next, kGradientTag);
        auto sent = activation_sends.find(op.micro);
        sent->second.first->Wait();  // done: its gradient came back
        activation_sends.erase(sent);
        stats_.idle_seconds += Seconds(wait);
        torch::autograd::backward({y}, {grad});
      }
      if (fsdp_ != nullptr) stats_.comm_wait_seconds += fsdp_->FinishBackward();
      if (!layout_.first()) {
        torch::Tensor g = x.grad().contiguous();
        gradient_sends.emplace_back(world_.Send(g, prev, kGradientTag), g);
        if (static_cast<int>(gradient_sends.size()) > layout_.stages) {
          const auto wait_send = Clock::now();
          gradient_sends.front().first->Wait();
          stats_.idle_seconds += Seconds(wait_send);
          gradient_sends.pop_front();
        }
      }
    }
  }
  const auto wait = Clock::now();
  for (auto& [micro, send] : activation_sends) send.first->Wait();
  for (auto& [handle, tensor] : gradient_sends) handle->Wait();
  stats_.idle_seconds += Seconds(wait);
  stats_.seconds = Seconds(start);
  return loss_sum;
}

double PipelineStage::Evaluate(
    int micro_batches, const std::function<torch::Tensor(int)>& windows,
    const std::function<torch::Tensor(int, const torch::Tensor&, const torch::Tensor&)>& loss) {
  torch::NoGradGuard no_grad;
  const int prev = layout_.first() ? -1 : layout_.RankOf(layout_.stage - 1, layout_.replica);
  const int next = layout_.last() ? -1 : layout_.RankOf(layout_.stage + 1, layout_.replica);
  const std::vector<int64_t> hidden = model_.HiddenShape(micro_batch_);
  const int begin = layout_.bounds[layout_.stage], end = layout_.bounds[layout_.stage + 1];
  double loss_sum = 0;
  std::deque<std::pair<std::unique_ptr<CommHandle>, torch::Tensor>> sends;
  for (int micro = 0; micro < micro_batches; ++micro) {
    if (fsdp_ != nullptr) fsdp_->BeginForward(/*sync_gradients=*/false);
    torch::Tensor w;
    if (layout_.first() || layout_.last()) w = windows(micro);
    torch::Tensor x;
    if (layout_.first()) {
      x = model_.Embed(w.narrow(1, 0, w.size(1) - 1));
    } else {
      x = torch::empty(hidden, hidden_options_);
      world_.Recv(x, prev, kActivationTag);
    }
    for (int b = begin; b < end; ++b) x = model_.RunBlock(b, x);
    if (layout_.last()) {
      loss_sum += loss(micro, model_.Head(x), w).item<double>();
    } else {
      torch::Tensor out = x.to(torch::kFloat).contiguous();
      sends.emplace_back(world_.Send(out, next, kActivationTag), out);
      // At most P sends in flight, as Step keeps them.
      if (static_cast<int>(sends.size()) > layout_.stages) {
        sends.front().first->Wait();
        sends.pop_front();
      }
    }
  }
  for (auto& [handle, tensor] : sends) handle->Wait();
  if (fsdp_ != nullptr) fsdp_->ReleaseAfterForward();
  return loss_sum;
}

void PipelineStage::SyncTiedGradient() {
  if (!tied_.defined() || !tied_.requires_grad()) return;  // frozen (LoRA): nothing to add
  const int other = layout_.RankOf(layout_.first() ? layout_.stages - 1 : 0, layout_.replica);
  torch::Tensor mine = fsdp_ != nullptr         ? fsdp_->GatherGrad(tied_name_)
                       : tied_.grad().defined() ? tied_.grad().contiguous().clone()
                                                : torch::zeros_like(tied_);
  torch::Tensor theirs = torch::empty_like(mine);
  std::unique_ptr<CommHandle> sent = world_.Send(mine, other, kTiedTag);
  world_.Recv(theirs, other, kTiedTag);
  sent->Wait();
  // a + b on one end, b + a on the other: the same float.
  if (fsdp_ != nullptr) {
    fsdp_->SetGrad(tied_name_, mine + theirs);
  } else {
    tied_.mutable_grad() = mine + theirs;
  }
}

void PipelineStage::SyncSequenceParallelGradients() {
  if (tensor_ == nullptr || !model_.tensor_parallel().sequence) return;
  std::vector<torch::Tensor> grads;
  if (fsdp_ != nullptr) {
    // The same views on every rank of the group: its ranks' FSDP layouts are the same.
    for (const std::string& name : replicated_names_) {
      for (torch::Tensor& g : fsdp_->ShardGradOf(name)) grads.push_back(g);
    }
  } else {
    for (torch::Tensor p : replicated_) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      if (!p.grad().is_contiguous()) p.mutable_grad() = p.grad().contiguous();
      grads.push_back(p.grad());
    }
  }
  if (!grads.empty()) tensor_->AllReduceSum(grads)->Wait();
}

double PipelineStage::GradNormSquared(const std::vector<torch::Tensor>& trainable) {
  torch::NoGradGuard no_grad;
  // The last stage's copy of the tied weight is the first stage's; count it there only.
  const bool skip_tied = tied_.defined() && !layout_.first();
  if (fsdp_ != nullptr) {
    // Every rank of the stage's shard group holds its own shard of the averaged gradients (and
    // under HYBRID_SHARD so does each replica of the group).
    std::vector<std::string> skip;
    if (skip_tied) skip.push_back(tied_name_);
    if (layout_.tp_rank != 0)
      skip.insert(skip.end(), replicated_names_.begin(), replicated_names_.end());
    torch::Tensor total = fsdp_->ShardGradSquaredTensor(skip);
    world_.AllReduceSum({total})->Wait();
    return total.item<double>() / fsdp_->replica_count();  // the one read-back
  }
  // Tensor parallelism: shards count on every rank, replicated parameters on rank 0 of the group.
  std::set<const void*> skip;
  if (layout_.tp_rank != 0) {
    for (const auto& p : replicated_) skip.insert(p.unsafeGetTensorImpl());
  }
  // Each norm squared in fp64 where the gradients are, summed there (one read-back, after the
  // all-reduce, in place of one per parameter).
  std::vector<torch::Tensor> squares;
  for (const auto& p : trainable) {
    if (!p.grad().defined()) continue;
    if (skip_tied && p.is_same(tied_)) continue;
    if (skip.count(p.unsafeGetTensorImpl()) > 0) continue;
    squares.push_back(p.grad().norm().to(torch::kDouble).pow(2).reshape({1}));
  }
  // Every replica holds the same averaged gradients: sum over all ranks, divide by replicas.
  torch::Tensor total =
      squares.empty() ? torch::zeros({1}, torch::kDouble) : torch::cat(squares).sum().reshape({1});
  world_.AllReduceSum({total})->Wait();
  return total.item<double>() / layout_.replicas;
}

void PipelineStage::GatherToRankZero() {
  if (layout_.replica != 0) return;
  torch::NoGradGuard no_grad;
  // Tensor parallelism: the group's rank 0 puts the stage's shards together and runs whole.
  if (tensor_ != nullptr) {
    for (auto& [name, p] : StageParameters(model_, layout_)) {
      const TensorParallelSplit split = model_.TensorParallelSplitOf(name);
      if (split.dim < 0) continue;
      torch::Tensor whole = Whole(p, split, tensor_);
      if (layout_.tp_rank == 0) p.set_data(whole);
    }
    model_.SetTensorParallel({});
    if (layout_.tp_rank != 0) return;
  }
  const bool rank0 = layout_.first();
  std::vector<std::unique_ptr<CommHandle>> sends;
  for (int s = 1; s < layout_.stages; ++s) {
    PipelineLayout other = layout_;
    other.stage = s;
    if (!rank0 && s != layout_.stage) continue;
    for (auto& [name, p] : StageParameters(model_, other)) {
      if (!model_.TiedWeight().empty() && name == model_.TiedWeight()) continue;  // stage 0's
      if (rank0) {
        if (p.storage().nbytes() == 0) AllocateStorage(p, p.numel() * p.element_size());
        torch::Tensor in = p.detach();
        world_.Recv(in, layout_.RankOf(s, 0), kGatherTag);
      } else {
        sends.push_back(world_.Send(p.detach(), 0, kGatherTag));
      }
    }
  }
  for (auto& h : sends) h->Wait();
}

}  // namespace trainyard::trainer
