#include "worker/trainer/strategy/strategy.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/trainer/runtime/device.h"

namespace trainyard::trainer {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// train.no_weight_decay: whether weight decay applies to the parameter `name` of `model` (of
// `dim` dimensions): "bias" leaves out biases, "norm" normalization weights (the other vectors),
// "embedding" the embeddings (a tied head's weight with them), as HF Trainer's
// get_decay_parameter_names.
bool Decays(const LanguageModel& model, const std::vector<std::string>& skip,
            const std::string& name, int64_t dim) {
  auto skips = [&](const char* kind) {
    return std::find(skip.begin(), skip.end(), kind) != skip.end();
  };
  const bool bias = absl::EndsWith(name, ".bias");
  if (bias) return !skips("bias");
  if (dim == 1) return !skips("norm");
  if (model.IsEmbedding(name)) return !skips("embedding");
  return true;
}

}  // namespace

std::string ParallelStrategy::StepGraphBlocker() const {
  if (dims().model_parallel) {
    return "pipeline stages and tensor parallelism exchange activations in sends and receives "
           "that the host schedules";
  }
  if (dims().fsdp) {
    return "FSDP gathers and frees its shards unit by unit from the host and reads the gradient "
           "norm back";
  }
  return "this layout's step is not captured";
}

void ParallelStrategy::LogResumed(const std::optional<CheckpointInfo>& loaded) const {
  if (loaded.has_value()) {
    Log(absl::StrCat("resumed from ", loaded->path, " at step ", loaded->step));
  }
}

std::vector<bool> ParallelStrategy::DecayFlags(const std::vector<torch::Tensor>& params) const {
  const std::vector<std::string>& skip = train().no_weight_decay;
  if (skip.empty()) return {};
  std::map<const void*, std::string> names;
  for (const auto& item : model().named_parameters()) {
    names[item.value().unsafeGetTensorImpl()] = item.key();
  }
  std::vector<bool> out;
  for (const torch::Tensor& p : params) {
    out.push_back(Decays(model(), skip, names[p.unsafeGetTensorImpl()], p.dim()));
  }
  return out;
}

FsdpConfig ParallelStrategy::MakeFsdpConfig() const {
  const ParallelConfig& par = parallel();
  FsdpConfig c;
  c.sharding = par.sharding;
  c.wrap = par.wrap;
  c.min_num_params = par.min_num_params;
  c.backward_prefetch = par.backward_prefetch;
  c.forward_prefetch = par.forward_prefetch;
  c.max_gathered_units = par.max_gathered_units;
  c.optimizer = in_.hyper;
  if (!train().no_weight_decay.empty()) {
    c.decays = [model = in_.model, train = in_.train](const std::string& name, int64_t dim) {
      return Decays(*model, train->no_weight_decay, name, dim);
    };
  }
  return c;
}

void DataParallelStrategy::ForwardBackward(const StepWork& work, StepResult& r) {
  const int n = work.micro.count;
  for (int micro = 0; micro < n; ++micro) {
    BeforeMicroBatch(micro == n - 1, work.step);
    if (work.seed_dropout) work.seed_dropout(micro);
    const torch::Tensor windows = work.micro.windows(micro);
    torch::Tensor loss;
    {
      AutocastScope autocast(in_.device, train().precision);
      loss = work.micro.loss(micro, windows);
    }
    AfterForward(loss);
    const auto backward_start = std::chrono::steady_clock::now();
    if (work.loss_scale.has_value()) {
      (loss * *work.loss_scale).backward();
    } else {
      loss.backward();
    }
    r.comm_wait_s += AfterBackward();
    r.backward_s += SecondsSince(backward_start);
    if (in_.device.is_cuda()) {
      const torch::Tensor l = loss.detach().to(torch::kDouble);
      r.loss_device = r.loss_device.defined() ? r.loss_device + l : l;
    } else {
      r.loss_sum += loss.item<double>();
    }
  }
  r.comm_wait_s += AfterMicroBatches();
}

double DataParallelStrategy::EvalLossSum(const MicroBatches& micro) {
  double sum = 0;
  AutocastScope autocast(in_.device, train().precision);
  for (int b = 0; b < micro.count; ++b) {
    BeforeEvalForward();
    sum += micro.loss(b, micro.windows(b)).item<double>();
  }
  AfterEval();
  return sum;
}

absl::StatusOr<std::unique_ptr<ParallelStrategy>> MakeStrategy(const StrategyInputs& inputs,
                                                               Resumed* resumed) {
  const ParallelDims& dims = *inputs.dims;
  if (dims.model_parallel) return MakePipelineStrategy(inputs, resumed);
  if (dims.fsdp) return MakeFsdpStrategy(inputs, resumed);
  if (dims.offload) return MakeOffloadStrategy(inputs, resumed);
  return MakeDdpStrategy(inputs, resumed);
}

absl::StatusOr<std::vector<PsRangeRef>> OffloadRanges(const ParallelDims& dims,
                                                      const std::string& flag) {
  if (!dims.offload) return std::vector<PsRangeRef>();
  if (flag.empty()) {
    return absl::InvalidArgumentError(
        "parallel.strategy: offload needs parameter-server ranges (--ps), which the coordinator "
        "assigns");
  }
  return ParsePsRanges(flag);
}

void MoveModel(LanguageModel& model, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  for (torch::Tensor p : model.parameters()) {
    if (p.numel() > 0 && p.storage().nbytes() == 0) {
      torch::Tensor empty = torch::empty(p.sizes(), p.options().device(device));
      FreeStorage(empty);
      p.set_data(empty);
    } else {
      p.set_data(p.to(device));
    }
  }
  for (torch::Tensor b : model.buffers()) b.set_data(b.to(device));
}

int64_t CountElements(const std::vector<torch::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& p : tensors) n += p.numel();
  return n;
}

int64_t DenseStateBytes(int64_t held, const std::vector<torch::Tensor>& optimized,
                        OptimizerKind optimizer, bool offloaded) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : optimized) shapes.push_back(p.sizes().vec());
  return held * int64_t{4} + CountElements(optimized) * int64_t{4} +
         (offloaded ? 0 : OptimizerStateBytes(optimizer, shapes, 1));
}

std::string DescribeFsdp(const ParallelConfig& parallel, const FsdpModel& fsdp) {
  return absl::StrFormat("fsdp %s: %d units, shard group %d", Name(parallel.sharding),
                         fsdp.num_units(), fsdp.shard_count());
}

}  // namespace trainyard::trainer
