// SlotOptimizer's set-up, dispatch, device step and state, and ParameterOptimizer (see
// optimizers.h); each optimizer's CPU step is in a file of its own.
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/optim/slot_internal.h"
#include "worker/trainer/runtime/torch_compat.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/adam/cpu_adam.h"
#include "worker/trainer/optim/fused_adamw.h"

namespace trainyard::trainer {

OptimizerHyper HyperFor(OptimizerKind kind, double weight_decay) {
  OptimizerHyper h;
  h.kind = kind;
  h.weight_decay = weight_decay;
  if (kind == OptimizerKind::kLion) {
    h.beta1 = 0.9;
    h.beta2 = 0.99;
  }
  return h;
}

OptimizerHyper HyperFor(const TrainConfig& t) {
  OptimizerHyper h = HyperFor(t.optimizer, t.weight_decay);
  h.beta1 = t.adam_beta1.value_or(h.beta1);
  h.beta2 = t.adam_beta2.value_or(h.beta2);
  h.eps = t.adam_epsilon.value_or(h.eps);
  h.adafactor_eps1 = t.adafactor_eps;
  h.adafactor_clip = t.adafactor_clip_threshold;
  h.adafactor_decay = t.adafactor_decay_rate;
  return h;
}

SlotOptimizer::SlotOptimizer(const OptimizerHyper& hyper, std::vector<OptimizerSlot> slots,
                             Communicator* group)
    : hyper_(hyper), slots_(std::move(slots)), group_(group) {
  for (const OptimizerSlot& s : slots_) {
    TORCH_CHECK(s.param.scalar_type() == torch::kFloat && s.param.is_contiguous(),
                "SlotOptimizer: slots must be contiguous fp32");
    for (const OptimizerSlot::Param& p : s.params) has_undecayed_ = has_undecayed_ || !p.decay;
    TORCH_CHECK(s.param.device() == slots_[0].param.device(),
                "SlotOptimizer: slots on different devices");
  }
  on_device_ = !slots_.empty() && !slots_[0].param.device().is_cpu();
  host_stepped_ =
      on_device_ && hyper_.kind != OptimizerKind::kAdamW && hyper_.kind != OptimizerKind::kLion;
}

SlotOptimizer::~SlotOptimizer() = default;

int64_t SlotOptimizer::FactorNumel(const std::vector<OptimizerSlot::Param>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += FactorsOf(p.shape).numel();
  return n;
}

void SlotOptimizer::Initialize() {
  initialized_ = true;
  state_.clear();
  for (const OptimizerSlot& s : slots_) {
    auto st = std::make_unique<SlotState>();
    const int64_t n = s.param.numel();
    switch (hyper_.kind) {
      case OptimizerKind::kAdamW:
        st->m = torch::zeros({n}, s.param.options());
        st->v = torch::zeros({n}, s.param.options());
        break;
      case OptimizerKind::kLion:
        st->m = torch::zeros({n}, s.param.options());
        break;
      case OptimizerKind::kAdamW8bit: {
        const Pieces pieces = EightBitPieces(s.params, s.begin, n);
        st->m = torch::zeros({pieces.fp32});
        st->v = torch::zeros({pieces.fp32});
        if (pieces.blocks > 0) {
          st->m_codes = torch::zeros({n}, torch::kUInt8);
          st->v_codes = torch::zeros({n}, torch::kUInt8);
          st->m_absmax = torch::zeros({pieces.blocks});
          st->v_absmax = torch::zeros({pieces.blocks});
        }
        break;
      }
      case OptimizerKind::kAdafactor:
        st->factors = torch::zeros({FactorNumel(s.params)});
        break;
    }
    state_.push_back(std::move(st));
  }
}

void SlotOptimizer::Step(double lr, double grad_scale) {
  torch::NoGradGuard no_grad;
  if (!initialized_) Initialize();
  ++step_;
  const double factor = 1.0 - lr * hyper_.weight_decay;
  const bool undecay = factor != 1.0 && factor != 0.0 && has_undecayed_;
  const bool decays_last = hyper_.kind == OptimizerKind::kAdamW8bit;
  if (undecay && !decays_last) Undecay(factor);
  if (host_stepped_) {
    StepOnHost(lr, grad_scale);
  } else if (on_device_ || tensor_ops_) {
    StepOnDevice(lr, grad_scale);
  } else {
    StepOnCpu(lr, grad_scale);
  }
  if (undecay && decays_last) Undecay(factor);
}

void SlotOptimizer::Undecay(double factor) {
  for (const OptimizerSlot& s : slots_) {
    const torch::Tensor flat = s.param.detach().view({-1});
    const int64_t end = s.begin + flat.numel();
    for (const OptimizerSlot::Param& p : s.params) {
      if (p.decay) continue;
      int64_t numel = 1;
      for (int64_t d : p.shape) numel *= d;
      const int64_t lo = std::max(p.offset, s.begin), hi = std::min(p.offset + numel, end);
      if (lo < hi) flat.narrow(0, lo - s.begin, hi - lo).div_(factor);
    }
  }
}

void SlotOptimizer::StepOnHost(double lr, double grad_scale) {
  if (host_.empty()) {
    for (const OptimizerSlot& s : slots_) {
      OptimizerSlot h = s;
      h.param = torch::empty(s.param.sizes(),
                             torch::TensorOptions().dtype(torch::kFloat).pinned_memory(on_device_));
      host_.push_back(std::move(h));
      host_grads_.push_back(torch::empty_like(host_.back().param));
    }
  }
  for (int i = 0; i < num_slots(); ++i) {
    const torch::Tensor& p = slots_[i].param;
    host_[i].param.copy_(p.detach());
    if (p.grad().defined()) {
      host_grads_[i].copy_(p.grad());
      host_[i].param.mutable_grad() = host_grads_[i];
    } else {
      host_[i].param.mutable_grad() = torch::Tensor();
    }
  }
  // The CPU kernels read slots_: the host copies stand in for the device slots while they run.
  std::swap(slots_, host_);
  StepOnCpu(lr, grad_scale);
  std::swap(slots_, host_);
  for (int i = 0; i < num_slots(); ++i) slots_[i].param.detach().copy_(host_[i].param);
}

void SlotOptimizer::StepOnCpu(double lr, double grad_scale) {
  if (hyper_.kind == OptimizerKind::kAdafactor) {
    StepAdafactor(lr, grad_scale);
    return;
  }
  for (int i = 0; i < num_slots(); ++i) {
    const torch::Tensor& p = slots_[i].param;
    if (!p.grad().defined() || p.numel() == 0) continue;  // as PyTorch's optimizers skip it
    const torch::Tensor g = p.grad().contiguous();
    const auto scale = static_cast<float>(grad_scale);
    switch (hyper_.kind) {
      case OptimizerKind::kAdamW:
        StepAdamW(i, g.data_ptr<float>(), scale, lr);
        break;
      case OptimizerKind::kLion:
        StepLion(i, g.data_ptr<float>(), scale, lr);
        break;
      case OptimizerKind::kAdamW8bit:
        StepAdamW8bit(i, g.data_ptr<float>(), scale, lr);
        break;
      case OptimizerKind::kAdafactor:
        break;
    }
  }
}

void SlotOptimizer::StepOnDevice(double lr, double grad_scale) {
  std::vector<torch::Tensor> params, grads, m, v;
  const double b1 = hyper_.beta1, b2 = hyper_.beta2;
  for (int i = 0; i < num_slots(); ++i) {
    const torch::Tensor& p = slots_[i].param;
    if (!p.grad().defined() || p.numel() == 0) continue;
    // Flat, as the state is (a slot may be a whole parameter of any shape).
    torch::Tensor param = p.detach().view({-1});
    const torch::Tensor grad = p.grad().reshape({-1});
    if (hyper_.kind == OptimizerKind::kAdamW) {
      params.push_back(param);
      grads.push_back(grad);
      m.push_back(state_[i]->m);
      v.push_back(state_[i]->v);
      continue;
    }
    // Lion, as StepLion computes it, in tensor operations.
    torch::Tensor mom = state_[i]->m;
    const torch::Tensor g = grad_scale == 1.0 ? grad : grad * grad_scale;
    const torch::Tensor update = torch::sign(mom * b1 + g * (1 - b1));
    param.mul_(1.0 - lr * hyper_.weight_decay);
    param.sub_(update, lr);
    mom.mul_(b2).add_(g, 1 - b2);
  }
  FusedAdamWOnDevice(params, grads, m, v, step_, lr, b1, b2, hyper_.weight_decay, hyper_.eps,
                     grad_scale);
}

void SlotOptimizer::SetStep(int64_t step) {
  if (!initialized_) Initialize();
  step_ = step;
}

const std::vector<std::string>& SlotOptimizer::StateNames() {
  static const auto* const kNames = new std::vector<std::string>{
      "exp_avg",          "exp_avg_sq",        "exp_avg.codes", "exp_avg.absmax",
      "exp_avg_sq.codes", "exp_avg_sq.absmax", "factors"};
  return *kNames;
}

std::map<std::string, torch::Tensor> SlotOptimizer::State(int i) const {
  std::map<std::string, torch::Tensor> out = LiveState(i);
  if (on_device_) {
    for (auto& [name, t] : out) t = t.to(torch::kCPU);
  }
  return out;
}

std::map<std::string, torch::Tensor> SlotOptimizer::LiveState(int i) const {
  std::map<std::string, torch::Tensor> out;
  if (!initialized_) return out;
  const SlotState& st = *state_[i];
  // (An 8-bit slot without small parameters has no fp32 moments.)
  if (st.m.defined() && (st.m.numel() > 0 || hyper_.kind != OptimizerKind::kAdamW8bit)) {
    out["exp_avg"] = st.m;
  }
  if (st.v.defined() && (st.v.numel() > 0 || hyper_.kind != OptimizerKind::kAdamW8bit)) {
    out["exp_avg_sq"] = st.v;
  }
  if (st.m_codes.defined()) {
    out["exp_avg.codes"] = st.m_codes;
    out["exp_avg.absmax"] = st.m_absmax;
    out["exp_avg_sq.codes"] = st.v_codes;
    out["exp_avg_sq.absmax"] = st.v_absmax;
  }
  if (st.factors.defined()) out["factors"] = st.factors;
  return out;
}

absl::Status SlotOptimizer::SetState(int i, const std::map<std::string, torch::Tensor>& state,
                                     int64_t step) {
  if (!initialized_) Initialize();
  step_ = step;
  SlotState& st = *state_[i];
  const int64_t n = slots_[i].param.numel();
  std::map<std::string, torch::Tensor> given = state;
  // 8-bit slots take elementwise fp32 moments too (resharded or consolidated checkpoints): given
  // without codes, and [n] long.
  if (hyper_.kind == OptimizerKind::kAdamW8bit && given.count("exp_avg.codes") == 0 &&
      given.count("exp_avg") != 0 && given.count("exp_avg_sq") != 0 &&
      given.at("exp_avg").numel() == n && given.at("exp_avg_sq").numel() == n) {
    const Pieces pieces = EightBitPieces(slots_[i].params, slots_[i].begin, n);
    for (auto [name, fp32, codes, absmax, is_signed] :
         {std::make_tuple("exp_avg", st.m, st.m_codes, st.m_absmax, true),
          std::make_tuple("exp_avg_sq", st.v, st.v_codes, st.v_absmax, false)}) {
      const torch::Tensor x =
          given.at(name).to(torch::kCPU).to(torch::kFloat).contiguous().reshape({-1});
      const float* xs = x.data_ptr<float>();
      for (const Piece& piece : pieces.pieces) {
        if (!piece.quantized) {
          std::copy(xs + piece.lo, xs + piece.hi, fp32.data_ptr<float>() + piece.packed);
          continue;
        }
        ForEachBlock(piece, [&](int64_t b, int64_t lo, int64_t hi) {
          absmax.data_ptr<float>()[b] =
              QuantizeBlock(xs + lo, hi - lo, is_signed, codes.data_ptr<uint8_t>() + lo);
        });
      }
      given.erase(name);
    }
    if (!given.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected optimizer state ", given.begin()->first));
    }
    return absl::OkStatus();
  }
  std::map<std::string, torch::Tensor> mine = LiveState(i);
  for (const auto& [name, t] : given) {
    auto it = mine.find(name);
    if (it == mine.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected optimizer state ", name, " for ", Name(hyper_.kind)));
    }
    if (it->second.numel() != t.numel() || it->second.scalar_type() != t.scalar_type()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state ", name, " has ", t.numel(),
                                                     " elements, want ", it->second.numel()));
    }
  }
  for (const auto& [name, t] : mine) {
    auto it = given.find(name);
    if (it == given.end()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state ", name, " is missing"));
    }
    t.copy_(it->second.reshape({-1}));
  }
  return absl::OkStatus();
}

int64_t SlotOptimizer::StateBytes() const {
  int64_t bytes = 0;
  for (const auto& st : state_) {
    for (const torch::Tensor* t :
         {&st->m, &st->v, &st->m_codes, &st->v_codes, &st->m_absmax, &st->v_absmax, &st->factors}) {
      if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
    }
  }
  return bytes;
}

absl::StatusOr<std::map<std::string, torch::Tensor>> SlotOptimizer::Elementwise(
    OptimizerKind kind, const std::vector<OptimizerSlot::Param>& params, int64_t begin, int64_t n,
    const std::map<std::string, torch::Tensor>& state) {
  if (kind != OptimizerKind::kAdamW8bit) return state;
  std::map<std::string, torch::Tensor> out;
  const Pieces pieces = EightBitPieces(params, begin, n);
  // No state: none yet (before the first step), unless the slot is padding alone, whose state is
  // no tensor at all and whose moments are zeros.
  if (state.empty() && !pieces.pieces.empty()) return out;
  // A tensor of the state, checked to have `numel` elements of `type`.
  auto get = [&](const std::string& name, int64_t numel,
                 torch::ScalarType type) -> absl::StatusOr<torch::Tensor> {
    auto it = state.find(name);
    if (numel == 0) return torch::zeros({0}, type);
    if (it == state.end()) return absl::DataLossError(absl::StrCat("no optimizer state ", name));
    if (it->second.numel() != numel || it->second.scalar_type() != type) {
      return absl::DataLossError(absl::StrCat("optimizer state ", name, " has ", it->second.numel(),
                                              " elements, want ", numel));
    }
    return it->second.contiguous();
  };
  for (auto [name, is_signed] :
       {std::make_pair("exp_avg", true), std::make_pair("exp_avg_sq", false)}) {
    ASSIGN_OR_RETURN(const torch::Tensor fp32, get(name, pieces.fp32, torch::kFloat));
    const bool quantized = pieces.blocks > 0;
    ASSIGN_OR_RETURN(const torch::Tensor codes,
                     get(absl::StrCat(name, ".codes"), quantized ? n : 0, torch::kUInt8));
    ASSIGN_OR_RETURN(const torch::Tensor absmax,
                     get(absl::StrCat(name, ".absmax"), pieces.blocks, torch::kFloat));
    torch::Tensor x = torch::zeros({n});
    float* xs = x.data_ptr<float>();
    const auto& map = DynamicMap(is_signed);
    for (const Piece& piece : pieces.pieces) {
      if (!piece.quantized) {
        std::copy_n(fp32.data_ptr<float>() + piece.packed, piece.hi - piece.lo, xs + piece.lo);
        continue;
      }
      ForEachBlock(piece, [&](int64_t b, int64_t lo, int64_t hi) {
        for (int64_t k = lo; k < hi; ++k) {
          xs[k] = map[codes.data_ptr<uint8_t>()[k]] * absmax.data_ptr<float>()[b];
        }
      });
    }
    out[name] = x;
  }
  return out;
}

namespace {

std::vector<OptimizerSlot> WholeParameters(const std::vector<torch::Tensor>& params,
                                           const std::vector<bool>& decay) {
  std::vector<OptimizerSlot> slots;
  for (size_t i = 0; i < params.size(); ++i) {
    OptimizerSlot s;
    s.param = params[i];
    s.params.push_back({params[i].sizes().vec(), 0, decay.empty() || decay[i]});
    slots.push_back(std::move(s));
  }
  return slots;
}

// Optimizer options that only carry the learning rate (the base class needs some).
std::unique_ptr<torch::optim::OptimizerOptions> LrOptions() {
  return std::make_unique<torch::optim::AdamWOptions>(1e-3);
}

}  // namespace

ParameterOptimizer::ParameterOptimizer(const std::vector<torch::Tensor>& params,
                                       const OptimizerHyper& hyper, const std::vector<bool>& decay)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(params)}, LrOptions()),
      core_(hyper, WholeParameters(params, decay), nullptr) {
  TORCH_CHECK(decay.empty() || decay.size() == params.size(),
              "ParameterOptimizer: one decay flag per parameter");
}

torch::Tensor ParameterOptimizer::step(LossClosure /*closure*/) {
  TORCH_CHECK(false, "ParameterOptimizer: call Update(lr, grad_scale)");
}

void ParameterOptimizer::save(torch::serialize::OutputArchive& archive) const {
  // train.optimizer's name, as bytes.
  const std::string name = Name(core_.kind());
  archive.write("kind", torch::tensor(std::vector<int64_t>(name.begin(), name.end()), torch::kLong)
                            .to(torch::kUInt8));
  archive.write("step", torch::tensor({core_.step()}, torch::kLong));
  for (int i = 0; i < core_.num_slots(); ++i) {
    for (const auto& [name, t] : core_.State(i)) archive.write(absl::StrCat(i, ".", name), t);
  }
}

void ParameterOptimizer::load(torch::serialize::InputArchive& archive) {
  torch::Tensor kind, step;
  TORCH_CHECK(archive.try_read("kind", kind),
              "the optimizer state was written by train.optimizer adamw; this job's is ",
              Name(core_.kind()));
  const torch::Tensor bytes = kind.to(torch::kUInt8).contiguous();
  const std::string written(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                            static_cast<size_t>(bytes.numel()));
  TORCH_CHECK(written == Name(core_.kind()), "the optimizer state was written by train.optimizer ",
              written, "; this job's is ", Name(core_.kind()));
  archive.read("step", step);
  if (step.item<int64_t>() == 0) return;
  for (int i = 0; i < core_.num_slots(); ++i) {
    std::map<std::string, torch::Tensor> state;
    for (const std::string& name : SlotOptimizer::StateNames()) {
      torch::Tensor t;
      if (archive.try_read(absl::StrCat(i, ".", name), t)) state[name] = t;
    }
    const absl::Status s = core_.SetState(i, state, step.item<int64_t>());
    TORCH_CHECK(s.ok(), "parameter ", i, ": ", s.message());
  }
}

const char* OptimizerName(const torch::optim::Optimizer& optimizer) {
  if (const auto* o = dynamic_cast<const ParameterOptimizer*>(&optimizer)) {
    return Name(o->core().kind());
  }
  return Name(OptimizerKind::kAdamW);
}

void OptimizerStep(torch::optim::Optimizer& optimizer, double lr, double grad_scale) {
  if (auto* o = dynamic_cast<ParameterOptimizer*>(&optimizer)) {
    o->Update(lr, grad_scale);
    return;
  }
  FusedAdamWStep(dynamic_cast<torch::optim::AdamW&>(optimizer), lr, grad_scale);
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const std::vector<torch::Tensor>& params,
                                                       const OptimizerHyper& hyper, double lr,
                                                       const std::vector<bool>& decay) {
  const bool all_decay = std::all_of(decay.begin(), decay.end(), [](bool d) { return d; });
  if (!all_decay) return std::make_unique<ParameterOptimizer>(params, hyper, decay);
  if (hyper.kind == OptimizerKind::kAdamW) {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr)
                                                             .betas({hyper.beta1, hyper.beta2})
                                                             .eps(hyper.eps)
                                                             .weight_decay(hyper.weight_decay));
  }
  return std::make_unique<ParameterOptimizer>(params, hyper);
}

void OptimizerStateTo(torch::optim::Optimizer& optimizer, const torch::Device& device) {
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(&optimizer);
  if (adamw == nullptr) return;
  for (auto& [key, state] : adamw->state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*state);
    if (st.exp_avg().defined()) st.exp_avg(st.exp_avg().to(device));
    if (st.exp_avg_sq().defined()) st.exp_avg_sq(st.exp_avg_sq().to(device));
    if (st.max_exp_avg_sq().defined()) st.max_exp_avg_sq(st.max_exp_avg_sq().to(device));
  }
}

OptimizerStateOnCpu::OptimizerStateOnCpu(torch::optim::Optimizer& optimizer) {
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(&optimizer);
  if (adamw == nullptr) return;
  auto to_cpu = [](const torch::Tensor& t) { return t.defined() ? t.to(torch::kCPU) : t; };
  try {
    for (auto& [key, state] : adamw->state()) {
      auto& st = static_cast<torch::optim::AdamWParamState&>(*state);
      kept_.push_back({&st, st.exp_avg(), st.exp_avg_sq(), st.max_exp_avg_sq()});
      st.exp_avg(to_cpu(st.exp_avg()));
      st.exp_avg_sq(to_cpu(st.exp_avg_sq()));
      st.max_exp_avg_sq(to_cpu(st.max_exp_avg_sq()));
    }
  } catch (...) {
    Restore();  // (a copy that failed half-way: no destructor will run)
    throw;
  }
}

OptimizerStateOnCpu::~OptimizerStateOnCpu() { Restore(); }

void OptimizerStateOnCpu::Restore() {
  for (Kept& k : kept_) {
    k.state->exp_avg(k.exp_avg);
    k.state->exp_avg_sq(k.exp_avg_sq);
    k.state->max_exp_avg_sq(k.max_exp_avg_sq);
  }
  kept_.clear();
}

std::map<std::string, torch::Tensor> ParameterState(torch::optim::Optimizer& optimizer, size_t i,
                                                    int64_t* step) {
  if (auto* parameters = dynamic_cast<ParameterOptimizer*>(&optimizer)) {
    *step = parameters->core().step();
    return parameters->core().State(static_cast<int>(i));
  }
  const torch::Tensor& p = optimizer.param_groups().at(0).params().at(i);
  *step = 0;
  auto it = optimizer.state().find(OptimizerStateKey(p));
  if (it == optimizer.state().end()) return {};
  const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
  *step = st.step();
  return {{"exp_avg", st.exp_avg()}, {"exp_avg_sq", st.exp_avg_sq()}};
}

absl::Status SetParameterState(torch::optim::Optimizer& optimizer, size_t i,
                               const std::map<std::string, torch::Tensor>& state, int64_t step) {
  if (state.empty()) return absl::OkStatus();  // no step yet
  if (auto* parameters = dynamic_cast<ParameterOptimizer*>(&optimizer)) {
    return parameters->core().SetState(static_cast<int>(i), state, step);
  }
  const torch::Tensor& p = optimizer.param_groups().at(0).params().at(i);
  auto st = std::make_unique<torch::optim::AdamWParamState>();
  st->step(step);
  for (const char* name : {"exp_avg", "exp_avg_sq"}) {
    auto it = state.find(name);
    if (it == state.end() || !it->second.sizes().equals(p.sizes())) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW state '", name, "' is missing or of another shape"));
    }
    torch::Tensor t = it->second.to(torch::kFloat).contiguous().clone();
    if (std::string(name) == "exp_avg") {
      st->exp_avg(t);
    } else {
      st->exp_avg_sq(t);
    }
  }
  optimizer.state()[OptimizerStateKey(p)] = std::move(st);
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
