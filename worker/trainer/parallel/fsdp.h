// FsdpModel: PyTorch-FSDP-style fully sharded data parallelism for a LanguageModel.
//
// LoRA: parameters that do not train (requires_grad false) go into a second flat buffer per unit,
// gathered with it but never reduce-scattered and without optimizer state or gradient buffers.
// Such a unit is freed after backward has computed the gradient of its input, not when its trained
// gradients are in: the frozen weights are still needed for that input gradient. Its input is the
// previous unit's output, whose gradient hook (PreBackward) frees it, as PyTorch FSDP's
// reshard-only post-backward hook does; the first block unit is freed by FinishBackward.
//
// Units: the wrap policy groups the model's blocks into units (TRANSFORMER_BASED_WRAP: one block
// each; SIZE_BASED_WRAP: consecutive blocks until min_num_params); everything else (embeddings,
// final norm, head, blocks left over) is the root unit, unit 0. Each unit's parameters live in one
// flat fp32 buffer padded to a multiple of the shard group's size; a rank keeps only its shard
// (1/S of it) between uses, and the module's parameters are views of the flat buffer, whose
// storage is allocated while the unit is gathered and freed otherwise (saved autograd tensors
// share that storage, so a unit gathered again before its backward serves them too).
//
// Per micro-step: BeginForward gathers the root (kept until the end of its backward, as PyTorch
// keeps the root unsharded; in a pipeline stage until the step's last backward, BeginBackward);
// each block unit is gathered before its first block runs forward (and, with forward_prefetch, the
// next one starts gathering), freed after its last block under FULL_SHARD / HYBRID_SHARD or kept
// until after its backward under SHARD_GRAD_OP. A hook on the unit's output gathers it again before
// its backward (BACKWARD_PRE also starts gathering the unit whose backward comes next); gradients
// accumulate straight into a flat buffer of the unit; once all of them are in (BACKWARD_POST starts
// the next gather here), the unit is freed and its gradient reduce-scattered (then, under
// HYBRID_SHARD, all-reduced over the replicas), divided by the world size and added to the rank's
// gradient shard. Block units gathered at once never exceed max_gathered_units: a prefetch that
// would go over it is skipped. A shard group of one (one rank, or HYBRID_SHARD with one rank per
// node) never gathers: the parameters are views of the shard and the gradients accumulate in the
// gradient shard, all-reduced over the replicas on a step's last micro-step; so it holds what DDP
// holds (PyTorch runs NO_SHARD there).
//
// All communication runs on one thread in the order the training thread asks for it, which is the
// same on every rank; the training thread overlaps compute with it and waits only for what it
// needs. The optimizer (optimizers.h: a SlotOptimizer over the trained flat buffers' shards)
// updates only the shards; Adafactor sums its row and column statistics over the shard group.
//
// Model-state memory: the tracker counts the bytes of the shards (parameters, gradients, optimizer
// state once it exists) plus gathered parameters and unsharded gradients as they are allocated
// and freed; peak_bytes() is what `yard metrics` shows as model_state_peak_bytes.
//
// Devices: the flat buffers, gradients and optimizer state live on the model's device (a GPU
// rank's: its gathers and reduce-scatters are NCCL's, into and out of the flat buffers in place).
// Checkpoints (ExportState) hold CPU tensors.
//
// Thread-safety: one training thread calls everything; the hooks run on it (CPU autograd) or, on
// a GPU, on autograd's device thread while the training thread waits in backward().
#ifndef TRAINYARD_WORKER_TRAINER_PARALLEL_FSDP_H_
#define TRAINYARD_WORKER_TRAINER_PARALLEL_FSDP_H_

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {

struct FsdpConfig {
  Sharding sharding = Sharding::kFullShard;  // FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD
  WrapPolicy wrap = WrapPolicy::kTransformerBased;
  int64_t min_num_params = 100'000'000;  // SIZE_BASED_WRAP
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  int max_gathered_units = 2;
  OptimizerHyper optimizer;
  // The parameters to shard, by name (empty: all of the model's). Under pipeline parallelism a
  // stage's: the others are never run here, and blocks without parameters to shard form no unit.
  std::function<bool(const std::string&)> holds;
  // Whether weight decay applies to a parameter, by name and dimensions (empty: to all;
  // train.no_weight_decay).
  std::function<bool(const std::string& name, int64_t dim)> decays;
};

// Block units under a wrap policy: each entry is the blocks [first, last] of one unit, in order.
// Blocks not listed belong to the root. `block_params`: parameters of each block.
std::vector<std::pair<int, int>> WrapBlocks(const std::vector<int64_t>& block_params,
                                            WrapPolicy policy, int64_t min_num_params);

// Where each parameter sits in its unit's flat buffer (the sharded checkpoint's manifest).
struct FsdpLayout {
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
    int64_t offset = 0;  // elements into the unit's flat buffer
    // Position among the parameters the model shards (model.named_parameters(), or those
    // FsdpConfig::holds keeps: 0, 1, ... without gaps).
    int index = 0;
  };
  // One flat buffer: a unit's parameters that train, or (LoRA) its frozen ones.
  struct Unit {
    int64_t numel = 0;  // unpadded
    std::vector<Param> params;
    bool frozen = false;  // gathered, never reduced, no optimizer state
  };
  // Per unit (unit 0 the root) its trained flat buffer, then its frozen one if it has any.
  std::vector<Unit> units;
};

// A flat buffer's parameters as the optimizer sees them (shape, offset in the buffer).
std::vector<OptimizerSlot::Param> OptimizerParams(const FsdpLayout::Unit& unit);

// One rank's optimizer-visible state: per flat buffer (as FsdpLayout lists them) its parameter
// shard (padded shard length) and its optimizer state by name (SlotOptimizer::State; empty
// before the first step and for frozen buffers).
struct FsdpShardState {
  std::vector<torch::Tensor> params;
  std::vector<std::map<std::string, torch::Tensor>> optimizer;
  int64_t step = 0;  // optimizer steps taken
};

class FsdpModel : public BlockHooks {
 public:
  // `world`: every rank. `shard`: the ranks the shards are spread over (all of them, or under
  // HYBRID_SHARD the node's); `replica`: the ranks that hold the same shard as this one
  // (HYBRID_SHARD across nodes; nullptr otherwise). With `from_rank0`, rank 0 of `world` holds the
  // initialized model and the others' parameters may be unmaterialized (ModelOptions::materialize =
  // false): each rank receives its shards, one unit at a time. Otherwise every rank's model holds
  // the same values already. The communicators and the model must outlive this object.
  static absl::StatusOr<std::unique_ptr<FsdpModel>> Create(LanguageModel& model,
                                                           Communicator& world, Communicator& shard,
                                                           Communicator* replica,
                                                           const FsdpConfig& config,
                                                           bool from_rank0);
  ~FsdpModel() override;

  FsdpModel(const FsdpModel&) = delete;
  FsdpModel& operator=(const FsdpModel&) = delete;

  // Before each micro-step's forward; `sync_gradients` on the last micro-step of a step (with a
  // shard group of one, gradients are only reduced then, as under DDP's no_sync).
  void BeginForward(bool sync_gradients = true);
  // Pipeline schedules, whose micro-batches' forwards and backwards interleave (several forwards
  // may come before their backwards): BeginForward before every forward, and before every
  // backward BeginBackward (`sync_gradients` on the step's last), then FinishBackward after it.
  // Each backward's gradients are reduce-scattered as it ends, as without a pipeline; the root
  // stays gathered from the step's first forward to its last backward (as PyTorch keeps the root
  // unsharded), so it is gathered once a step.
  void BeginBackward(bool sync_gradients) {
    BeginForward(sync_gradients);
    keep_root_ = !sync_gradients;
  }
  // After the forward, before backward: gathers the root's gradients when backward starts.
  void WatchLoss(const torch::Tensor& loss);
  // After forwards that have no backward (evaluation, under no_grad: each block unit is freed
  // after its last block already): frees the root too, and any unit still gathered.
  void ReleaseAfterForward();
  // After each micro-step's backward: reduce-scatters what backward left (gradients that never
  // came count as zero), waits for all of it and frees every gathered unit. Returns the seconds
  // spent waiting. The gradient shards accumulate over micro-steps.
  double FinishBackward();
  // The global gradient norm (the shards' gradients all-reduced over the shard group).
  double GradNorm();
  // This rank's part of the squared gradient norm: its gradient shards' squares, less those of
  // the parameters named in `skip`, as a one-element fp64 tensor where the shards are (not read
  // back). No communication.
  torch::Tensor ShardGradSquaredTensor(const std::vector<std::string>& skip);
  // The views of this rank's gradient shards that hold parameter `name`'s elements (at most one
  // per flat buffer; none when its elements lie in other ranks' shards). After FinishBackward;
  // every rank of the shard group has the same layout, so the same views of two groups' ranks
  // hold the same elements of the parameter (tensor parallelism's replicated parameters).
  std::vector<torch::Tensor> ShardGradOf(const std::string& name);
  // Parameter `name`'s whole gradient (flat, [numel]), put together over the shard group (every
  // rank of it calls it, after FinishBackward), and the setting of this rank's part of it from
  // `whole` (any shape of numel elements).
  torch::Tensor GatherGrad(const std::string& name);
  void SetGrad(const std::string& name, const torch::Tensor& whole);
  // The optimizer on the shards: gradients scaled by `clip_scale`, learning rate `lr`; then
  // zeroes the gradient shards.
  void Step(double lr, double clip_scale);
  // Gathers every unit for good and turns the hooks off: the model then holds its full
  // parameters (for the final dump and sample). Every rank must call it.
  void GatherFullParameters();

  const FsdpLayout& layout() const { return layout_; }
  int shard_rank() const { return shard_.rank(); }
  Communicator& shard_group() { return shard_; }
  int shard_count() const { return shard_.world_size(); }
  // Ranks holding the same shard (HYBRID_SHARD's nodes; 1 otherwise).
  int replica_count() const { return replica_ != nullptr ? replica_->world_size() : 1; }
  // True on the ranks that write the shards of a checkpoint (replica 0).
  bool writes_shards() const { return replica_ == nullptr || replica_->rank() == 0; }
  FsdpShardState ExportState();
  // Installs shards and optimizer state (when there is some) of this rank's padded shard length.
  absl::Status ImportState(const FsdpShardState& state);
  const OptimizerHyper& optimizer() const { return config_.optimizer; }
  // Flat buffers, as FsdpLayout lists them.
  int num_flats() const { return static_cast<int>(flats_.size()); }
  int64_t shard_numel(int flat) const { return Flat(flat).shard_numel; }
  int64_t padded_numel(int flat) const { return Flat(flat).padded; }

  int num_units() const { return static_cast<int>(units_.size()); }
  // Bytes this rank sent (all-gathers and reduce-scatters) and gathers issued, since the start.
  int64_t bytes_sent() const;
  int64_t gathers() const { return gathers_; }
  // Model-state bytes now and at their peak (see the file comment).
  int64_t current_bytes() const { return current_bytes_.load(); }
  int64_t peak_bytes() const { return peak_bytes_.load(); }

  // BlockHooks.
  void BeforeBlock(int block) override;
  void AfterBlock(int block, const torch::Tensor& output) override;

 private:
  enum class Gathered { kNo, kInFlight, kYes };
  struct FlatParam {
    std::vector<int> params;  // indices into params_
    std::vector<int64_t> offsets;
    int64_t numel = 0, padded = 0, shard_numel = 0;
    torch::Tensor full;   // [padded]; storage only while gathered
    torch::Tensor shard;  // [shard_numel]; the optimizer's parameter unless frozen
  };
  // Under LoRA a unit's frozen base weights sit in a flat buffer of their own (as PyTorch FSDP
  // needs uniform requires_grad per FlatParameter): gathered with the unit, never reduced.
  struct Unit {
    FlatParam train, frozen;
    int first_block = -1, last_block = -1;  // -1 for the root
    torch::Tensor grad;                     // [train.padded] unsharded gradient during backward
    Gathered gathered = Gathered::kNo;
    std::shared_future<void> gather_done;
    int pending_grads = 0;
    bool reduced = false;  // this micro-step
    // This micro-step's gradient of the unit's input is computed: its backward is over.
    bool input_grad_done = false;
  };
  class CommThread;
  class GradHook;

  FsdpModel(LanguageModel& model, Communicator& world, Communicator& shard, Communicator* replica,
            const FsdpConfig& config);
  absl::Status Build(bool from_rank0);

  void StartGather(int unit);
  void EnsureGathered(int unit);
  void Prefetch(int unit);
  void Release(int unit);
  int GatheredBlockUnits() const;
  void PrepareGradients(int unit);
  void PreBackward(int unit);
  void OnGradReady(int param);
  void PostBackward(int unit);
  void Track(int64_t delta_bytes);
  // A shard group of one: the shard is the whole unit, never gathered nor freed.
  bool single_shard() const { return shard_.world_size() == 1; }
  // Flat buffer `i` as FsdpLayout lists them.
  const FlatParam& Flat(int i) const;
  FlatParam& Flat(int i);
  static int64_t GatheredNumel(const Unit& u) { return u.train.padded + u.frozen.padded; }
  // Where the trained parameter `name` lies: its flat buffer (trained) and element range in it.
  struct Placement {
    FlatParam* flat = nullptr;
    int64_t offset = 0, numel = 0;
  };
  Placement Place(const std::string& name);
  // The part of `p`'s range inside this rank's shard: [begin, end) in the shard.
  std::pair<int64_t, int64_t> ShardRange(const Placement& p) const;

  LanguageModel& model_;
  Communicator& world_;
  Communicator& shard_;
  Communicator* replica_;
  FsdpConfig config_;
  std::vector<torch::Tensor> params_;
  std::vector<int> unit_of_param_;
  std::vector<int> unit_of_block_;
  std::vector<Unit> units_;
  std::vector<std::pair<int, bool>> flats_;  // (unit, frozen) of each flat buffer, layout order
  FsdpLayout layout_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::unique_ptr<SlotOptimizer> optimizer_;
  std::vector<int> slot_of_flat_;  // the optimizer's slot of each flat buffer; -1 if frozen
  std::unique_ptr<CommThread> comm_thread_;
  std::vector<std::shared_future<void>> reductions_;  // this micro-step's, in order
  bool hooks_on_ = true;
  bool keep_root_ = false;  // a pipeline's backward before the step's last
  bool sync_gradients_ = true;
  bool optimizer_counted_ = false;
  int64_t gathers_ = 0;
  std::atomic<int64_t> current_bytes_{0}, peak_bytes_{0};
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_PARALLEL_FSDP_H_
