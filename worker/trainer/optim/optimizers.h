// The optimizers of train.optimizer, on the trainer's tensors:
//   adamw       torch.optim.AdamW (the parameter server's fused kernel, as FusedAdamWStep);
//   lion        Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; the
//               arithmetic of lucidrains' lion-pytorch): update = sign(b1 m + (1 - b1) g),
//               p -= lr (update + wd p), m = b2 m + (1 - b2) g; one moment;
//   adafactor   transformers.optimization.Adafactor with an external learning rate
//               (relative_step, scale_parameter and warmup_init off, beta1 None, eps
//               (1e-30, 1e-3), clip_threshold 1, decay_rate -0.8): a matrix's second moment
//               kept as a row and a column vector, the update's RMS clipped per parameter;
//   adamw_8bit  AdamW whose moments are stored as bitsandbytes' AdamW8bit stores them: in blocks
//               of 256 elements, one byte per element (the nearest value of bitsandbytes' dynamic
//               quantization map, signed for m, unsigned for v) scaled by the block's absolute
//               maximum; parameters under 4096 elements keep fp32 moments, as bitsandbytes does.
//               The update is its CUDA kernel's (kOptimizerStatic8bit2StateBlockwise), whose
//               weight decay follows the Adam step.
//
// On a GPU (slots on the device) AdamW runs as LibTorch's fused kernel and Lion in tensor
// operations, with the same arithmetic; Adafactor and 8-bit AdamW keep their state in host
// memory and step there with the CPU kernels (StepOnHost), as DeepSpeed's CPU optimizers do.
//
// SlotOptimizer runs them over "slots": tensors that are a whole parameter (DDP), or a rank's
// shard of a flat buffer of parameters (FSDP). Elementwise state (AdamW's and Lion's moments,
// the 8-bit codes) is the slot's own; 8-bit blocks are each parameter's 256 elements from its
// first, so a shard boundary inside a block splits it into a block on either side (its two parts
// have absmaxes of their own); Adafactor's factors need whole rows and columns, so under
// FSDP every rank sums its shard's part of the squared gradients (and of the updates' squares for
// the RMS clip) over the shard group and keeps the factors of every parameter of the buffer,
// identical on every rank. So an FSDP job computes what the same job on one rank does.
//
// Thread-compatible; the training thread calls everything.
#ifndef TRAINYARD_WORKER_TRAINER_OPTIM_OPTIMIZERS_H_
#define TRAINYARD_WORKER_TRAINER_OPTIM_OPTIMIZERS_H_

#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "worker/trainer/comm/communicator.h"

namespace trainyard::trainer {

inline constexpr double kAdafactorEps1 = 1e-30;  // added to the squared gradient
inline constexpr double kAdafactorClip = 1.0;    // the update's RMS threshold
inline constexpr double kAdafactorDecay = -0.8;  // beta2 at step t: 1 - t^decay

struct OptimizerHyper {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  // Adafactor's (train.adafactor_*; transformers' defaults).
  double adafactor_eps1 = kAdafactorEps1, adafactor_clip = kAdafactorClip,
         adafactor_decay = kAdafactorDecay;
};

// A job's hyper-parameters: AdamW's (and 8-bit AdamW's) betas (0.9, 0.95) and eps 1e-8 as in
// GPT-3 and nanoGPT; Lion's betas (0.9, 0.99) as in its paper; Adafactor's constants above.
OptimizerHyper HyperFor(OptimizerKind kind, double weight_decay);
// The same with what the spec sets (train.adam_beta1/2, adam_epsilon, adafactor_*).
OptimizerHyper HyperFor(const TrainConfig& train);

inline constexpr int64_t k8bitBlock = 256;
inline constexpr int64_t k8bitMinSize = 4096;

// bitsandbytes' create_dynamic_map(signed) (sorted, 256 values in [-1, 1]).
const std::array<float, 256>& DynamicMap(bool is_signed);
// The index of DynamicMap(is_signed)'s value nearest v (the lower index of two as near).
uint8_t NearestCode(float v, bool is_signed);

// A tensor the optimizer updates: fp32, contiguous, its .grad() what a step applies (an undefined
// gradient counts as zero). `begin` is where it starts in the buffer its parameters are laid out
// in, `params` every parameter of that buffer (a whole parameter: itself at offset 0).
struct OptimizerSlot {
  struct Param {
    std::vector<int64_t> shape;
    int64_t offset = 0;
    bool decay = true;  // false: weight decay leaves it alone (train.no_weight_decay)
  };
  torch::Tensor param;
  int64_t begin = 0;
  std::vector<Param> params;
};

class SlotOptimizer {
 public:
  // `group`: the ranks holding the other parts of the slots' buffers, over which Adafactor sums
  // (every rank of it must step the same slots); nullptr when the slots are whole parameters.
  SlotOptimizer(const OptimizerHyper& hyper, std::vector<OptimizerSlot> slots, Communicator* group);
  ~SlotOptimizer();
  SlotOptimizer(const SlotOptimizer&) = delete;
  SlotOptimizer& operator=(const SlotOptimizer&) = delete;

  // One update of every slot with learning rate `lr`, the gradients multiplied by `grad_scale`.
  // The state is created on the first step. Leaves the gradients as they are.
  void Step(double lr, double grad_scale);

  // Steps CPU slots as GPU ones are stepped (tensor operations), so that CPU tests check that
  // path's arithmetic: Lion only (AdamW's is LibTorch's fused CUDA kernel). Before the first step.
  void UseDeviceArithmetic() {
    TORCH_CHECK(hyper_.kind == OptimizerKind::kLion, "UseDeviceArithmetic: lion only");
    tensor_ops_ = true;
  }

  // Steps CPU slots as GPU slots of Adafactor and 8-bit AdamW are stepped (through host copies),
  // so that CPU tests check that path. Before the first step.
  void UseHostStepping() { host_stepped_ = true; }

  OptimizerKind kind() const { return hyper_.kind; }
  int64_t step() const { return step_; }
  // Sets the step count (a resumed run's), creating the state if it is not there yet.
  void SetStep(int64_t step);
  int num_slots() const { return static_cast<int>(slots_.size()); }

  // The state of slot `i` as checkpoints hold it, by name (empty before the first step; on the
  // CPU, copied from a GPU's):
  //   adamw: exp_avg, exp_avg_sq; lion: exp_avg; adafactor: factors (per parameter of the
  //   buffer, in order, a matrix's row then column vector or a vector's full second moment);
  //   adamw_8bit: exp_avg, exp_avg_sq (fp32, of the elements of parameters under 4096 elements,
  //   in order) and, when the slot holds part of a larger one, exp_avg.codes, exp_avg_sq.codes
  //   (uint8 [n]), exp_avg.absmax, exp_avg_sq.absmax (fp32, per block).
  std::map<std::string, torch::Tensor> State(int i) const;
  // Every name State may use, for readers of checkpoints.
  static const std::vector<std::string>& StateNames();
  // Installs state of that form at optimizer step `step`. 8-bit slots also take the elementwise
  // fp32 exp_avg and exp_avg_sq of Elementwise (quantized here). INVALID_ARGUMENT naming the tensor
  // if a name or size is wrong.
  absl::Status SetState(int i, const std::map<std::string, torch::Tensor>& state, int64_t step);
  // Bytes of optimizer state held now.
  int64_t StateBytes() const;

  // The elementwise fp32 moments ([n] each) of the checkpointed state of a slot of `kind` that
  // starts at `begin` of a buffer of `params` and holds `n` elements: 8-bit codes dequantized;
  // every other state as it is (Adafactor's factors are not elementwise). A slot of padding alone
  // (no parameter's elements) has zero moments; other slots without state (no step yet) give
  // none. For resharding and consolidation.
  // DATA_LOSS naming the tensor when one is missing or of another size.
  static absl::StatusOr<std::map<std::string, torch::Tensor>> Elementwise(
      OptimizerKind kind, const std::vector<OptimizerSlot::Param>& params, int64_t begin, int64_t n,
      const std::map<std::string, torch::Tensor>& state);
  // Elements of Adafactor's factors for a buffer of these parameters.
  static int64_t FactorNumel(const std::vector<OptimizerSlot::Param>& params);

 private:
  struct SlotState;
  // One slot's update; the gradient `g` is multiplied by `scale` in the pass.
  void StepAdamW(int i, const float* g, float scale, double lr);
  void StepLion(int i, const float* g, float scale, double lr);
  void StepAdamW8bit(int i, const float* g, float scale, double lr);
  void StepAdafactor(double lr, double grad_scale);
  // Every slot's update on a GPU: AdamW through LibTorch's fused kernel, Lion in tensor
  // operations.
  void StepOnDevice(double lr, double grad_scale);
  // Adafactor and 8-bit AdamW on GPU slots, as DeepSpeed's CPU optimizers step: their (compact)
  // state lives in host memory, where their CPU kernels run; each step copies the parameters and
  // gradients into pinned host buffers and the updated parameters back. The CPU loops' results,
  // bit for bit.
  void StepOnHost(double lr, double grad_scale);
  // Every slot's update by the CPU kernels (slots_ on the CPU).
  void StepOnCpu(double lr, double grad_scale);
  void Initialize();
  // Divides the elements of the parameters weight decay leaves alone by `factor` (the step's
  // decay, 1 - lr * weight_decay): before a step that decays first (AdamW, Lion, Adafactor) or
  // after one that decays last (8-bit AdamW), so that those elements come out undecayed (within
  // fp32 rounding) whatever path stepped them.
  void Undecay(double factor);
  // State's tensors themselves (on the slots' device).
  std::map<std::string, torch::Tensor> LiveState(int i) const;

  OptimizerHyper hyper_;
  std::vector<OptimizerSlot> slots_;
  Communicator* group_;
  std::vector<std::unique_ptr<SlotState>> state_;
  int64_t step_ = 0;
  bool initialized_ = false;
  bool on_device_ = false;      // the slots are on a GPU
  bool host_stepped_ = false;   // StepOnHost: adafactor and adamw_8bit on a GPU
  bool tensor_ops_ = false;     // UseDeviceArithmetic
  bool has_undecayed_ = false;  // a parameter of a slot that weight decay leaves alone
  // StepOnHost: the slots' pinned host copies and their gradients' (made at the first step).
  std::vector<OptimizerSlot> host_;
  std::vector<torch::Tensor> host_grads_;
};

// A SlotOptimizer over whole parameters as a torch::optim::Optimizer, so that DDP checkpoints
// (checkpoint.h) save and load it: optimizer.pt holds "kind", "step" and "<i>.<name>" for each
// parameter's state. Loading a file of another optimizer fails naming both.
class ParameterOptimizer : public torch::optim::Optimizer {
 public:
  // `decay`: per parameter, false where weight decay leaves it alone (empty: all decay).
  ParameterOptimizer(const std::vector<torch::Tensor>& params, const OptimizerHyper& hyper,
                     const std::vector<bool>& decay = {});

  void Update(double lr, double grad_scale) { core_.Step(lr, grad_scale); }
  SlotOptimizer& core() { return core_; }
  const SlotOptimizer& core() const { return core_; }

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  SlotOptimizer core_;
};

// The train.optimizer name of a trainer's optimizer: "adamw" for torch::optim::AdamW.
const char* OptimizerName(const torch::optim::Optimizer& optimizer);

// One update of a trainer's optimizer (torch::optim::AdamW through FusedAdamWStep, or a
// ParameterOptimizer).
void OptimizerStep(torch::optim::Optimizer& optimizer, double lr, double grad_scale);

// The optimizer of `params` a job with these hyper-parameters trains with. `decay`: per
// parameter, false where weight decay leaves it alone (empty: all decay); AdamW with such
// parameters is a ParameterOptimizer, whose checkpoints are its own (a resume keeps the setting).
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const std::vector<torch::Tensor>& params,
                                                       const OptimizerHyper& hyper, double lr,
                                                       const std::vector<bool>& decay = {});

// Moves torch::optim::AdamW's state tensors (its moments) to `device`: checkpoints hold them on
// the CPU, a GPU rank steps them on its device. A no-op for the other optimizers, whose state is
// made on their parameters' device.
void OptimizerStateTo(torch::optim::Optimizer& optimizer, const torch::Device& device);

// torch::optim::AdamW's state on the CPU while this lives (torch::save reads it there), then the
// very device tensors back, not copies of them: a CUDA graph of the step holds their addresses
// (runtime/step_graph.h). A no-op for the other optimizers, and for state on the CPU already.
class OptimizerStateOnCpu {
 public:
  explicit OptimizerStateOnCpu(torch::optim::Optimizer& optimizer);
  ~OptimizerStateOnCpu();
  OptimizerStateOnCpu(const OptimizerStateOnCpu&) = delete;
  OptimizerStateOnCpu& operator=(const OptimizerStateOnCpu&) = delete;

 private:
  void Restore();

  struct Kept {
    torch::optim::AdamWParamState* state;
    torch::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
  };
  std::vector<Kept> kept_;
};

// The state of parameter `i` (of the first parameter group) of a MakeOptimizer optimizer by
// name (AdamW: exp_avg and exp_avg_sq; the others: SlotOptimizer::State's), empty before its
// first step; `step` gets its optimizer steps. For checkpoints that move state between
// optimizers over other sets of parameters (pipeline stages).
std::map<std::string, torch::Tensor> ParameterState(torch::optim::Optimizer& optimizer, size_t i,
                                                    int64_t* step);
// Installs state of that form (no-op when empty); INVALID_ARGUMENT naming a missing or misshapen
// tensor.
absl::Status SetParameterState(torch::optim::Optimizer& optimizer, size_t i,
                               const std::map<std::string, torch::Tensor>& state, int64_t step);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_OPTIM_OPTIMIZERS_H_
