// The models trainyard-trainer trains, as torch::nn modules with a deterministic initialization
// (torch::manual_seed(train.seed) then GPT-2 style: N(0, 0.02) weights, zero biases, unit
// LayerNorms), no dropout (so activation recompute is exact):
//  - "gpt": token + learned position embeddings, n_layer pre-norm blocks (LayerNorm -> causal
//    multi-head self-attention with a fused qkv Linear and an output Linear; LayerNorm -> 4x GELU
//    MLP), a final LayerNorm and an LM head (the token embedding when model.tie_weights).
//  - "mlp": the mean of the context's token embeddings, n_layer residual blocks
//    (Linear d_model->d_hidden, GELU, Linear d_hidden->d_model), a Linear head with bias that
//    predicts the token after the context.
//  - "llama": transformers' LlamaForCausalLM, its parameters named as in its state dict
//    (model.embed_tokens, model.layers.<i>.{input_layernorm, self_attn.{q,k,v,o}_proj,
//    post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head): RMSNorm, rotary
//    position embeddings (rope_theta; linear, dynamic or llama3 scaling), grouped-query attention,
//    a SwiGLU MLP, no biases, the head tied to the embedding or not. Initialized N(0, 0.02) with
//    unit norms, or from a checkpoint (hf_weights.h).
// Parameter counts equal common/job_config.h ModelParameterCount.
//
// fp32: every Linear (and the tied head) and the attention's batched products run their matmuls,
// forward and backward, on oneDNN or the BLAS, the trainer's choice at start (onednn_matmul.h,
// matmul_choice.h).
// bf16: every Linear (and the tied head) runs its matmul in bfloat16 on bf16 copies of its input
// and weights, with fp32 master weights and fp32 everywhere else (LayerNorm, softmax, loss).
//
// Not thread-safe; one training thread uses a model.
#ifndef TRAINYARD_WORKER_TRAINER_MODEL_MODEL_H_
#define TRAINYARD_WORKER_TRAINER_MODEL_MODEL_H_

#include <torch/torch.h>

#include <limits>
#include <memory>
#include <vector>

#include "common/job_config.h"
#include "worker/trainer/kernels/matmul_choice.h"
#include "worker/trainer/model/tensor_parallel.h"

namespace trainyard::trainer {

struct ModelOptions {
  bool bf16 = false;
  // Recompute each GPT block in backward instead of keeping its activations.
  bool activation_checkpointing = false;
  // On CUDA, the GPT block's LayerNorms (the Llama layer's RMSNorms) fused with the residual add
  // before and the cast after them (kernels/fused_norm.h); false: torch's modules (benchmarks
  // compare).
  bool fused_norms = true;
  // false: build the modules but leave every parameter without storage (right shape, zero bytes,
  // not to be read) and skip the initialization; a rank that receives its FSDP shards from rank 0
  // builds its model so, one module at a time, and never holds the whole model.
  bool materialize = true;
  // LoRA on llama's targeted projections: each gains lora_A and lora_B (named as PEFT names them:
  // "<projection>.lora_A.weight"), initialized as PEFT does (A Kaiming-uniform, B zero, so the
  // model starts as the base), and every other parameter is frozen (requires_grad false).
  LoraConfig lora;
};

// Called by the models around each block's forward (FSDP gathers and frees units here).
class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  virtual void BeforeBlock(int block) = 0;
  // `output`: what block `block` returned; the hook may register a gradient hook on it.
  virtual void AfterBlock(int block, const torch::Tensor& output) = 0;
};

class LanguageModel : public torch::nn::Module {
 public:
  LanguageModel(int64_t seq_len, bool activation_checkpointing)
      : seq_len_(seq_len), activation_checkpointing_(activation_checkpointing) {}

  // The repeated blocks (GPT blocks, MLP residual blocks), run in index order by forward.
  virtual int NumBlocks() const = 0;
  // The block a parameter (by its name in named_parameters()) belongs to; -1 for the rest
  // (embeddings, final norm, head: FSDP's root unit).
  virtual int BlockOf(const std::string& param_name) const = 0;
  // Of the parameters outside the blocks, true for those Embed uses (the embeddings); the others
  // (final norm, head) are Head's.
  virtual bool IsEmbedding(const std::string& param_name) const = 0;
  // The name of the embedding that Head uses as its weight too (model.tie_weights); "" if none.
  virtual std::string TiedWeight() const { return ""; }
  // nullptr: none. Not owned; must outlive the forward passes that use it.
  void set_block_hooks(BlockHooks* hooks) { hooks_ = hooks; }

  // Tensor parallelism (gpt and llama): once set, the model's parameters must be this rank's
  // shards (TensorParallelShard by TensorParallelSplitOf) and forward runs Megatron-LM's layers
  // (tensor_parallel.h): attention heads, MLP hidden units and the vocabulary split over the
  // group, logits and loss vocabulary-parallel. A default TensorParallel (after the parameters
  // are whole again) turns it off.
  void SetTensorParallel(const TensorParallel& tp) { tp_ = tp; }
  const TensorParallel& tensor_parallel() const { return tp_; }
  // How parameter `name` is cut over a tensor-parallel group; replicated by default.
  virtual TensorParallelSplit TensorParallelSplitOf(const std::string& name) const { return {}; }

  // The forward pass in the three parts a pipeline runs on its stages: Embed, the blocks in
  // order (RunBlock), Head.
  // [b, t] int64 tokens (t <= seq_len) -> the first block's input (HiddenShape).
  virtual torch::Tensor Embed(const torch::Tensor& inputs) = 0;
  // Block `i` on `x`, between the hooks; under activation checkpointing (with grad enabled)
  // only its input is kept and the block is recomputed in backward.
  torch::Tensor RunBlock(int i, torch::Tensor x);
  // The last block's output -> logits ([b, t, vocab]; the MLP's [b, vocab]).
  virtual torch::Tensor Head(const torch::Tensor& x) = 0;
  // When Head(x) is HeadInput(x) times HeadWeight() transposed and nothing else: that weight
  // ([vocab, d]); undefined otherwise (the fused loss is then not used).
  virtual torch::Tensor HeadWeight() const { return torch::Tensor(); }
  virtual torch::Tensor HeadInput(const torch::Tensor& x) { return x; }
  // Shape of what the blocks take and return for `batch` windows of seq_len tokens.
  virtual std::vector<int64_t> HiddenShape(int64_t batch) const = 0;

  // Mean next-token cross-entropy of `windows` ([batch, seq_len + 1] int64 tokens): the GPT
  // predicts every position of the window, the MLP only the last token.
  torch::Tensor Loss(const torch::Tensor& windows);
  // The sum of the next-token cross-entropies of `windows`, each weighted by `weights` ([batch,
  // seq_len] float, one per target token, 0 or 1: data.loss_mask); the MLP weighs its one
  // prediction by the last column.
  torch::Tensor MaskedLossSum(const torch::Tensor& windows, const torch::Tensor& weights);
  // Loss and MaskedLossSum of Head's `logits` for `windows`.
  torch::Tensor LossOf(const torch::Tensor& logits, const torch::Tensor& windows) const;
  torch::Tensor MaskedLossSumOf(const torch::Tensor& logits, const torch::Tensor& windows,
                                const torch::Tensor& weights) const;
  // Where Loss and MaskedLossSum take the head and its cross-entropy in one fused, chunked step
  // that never holds the whole batch's logits (kernels/fused_loss.h): kAuto on CUDA when the
  // logits would hold at least kFusedLossMinLogits values, kOn on any device and size (tests
  // compare it with the unfused composition on the CPU), kOff never. Only for a head that is one
  // bias-free product (HeadWeight), without tensor parallelism. Below the threshold the fused
  // path's extra launches cost more than the passes over the logits it saves (the example GPT,
  // vocabulary 256, ran 17% slower with it on an H100: bench/RESULTS.md).
  enum class FusedLoss { kAuto, kOn, kOff };
  static constexpr int64_t kFusedLossMinLogits = int64_t{1} << 24;
  void set_fused_loss(FusedLoss fused) { fused_loss_ = fused; }
  // Whether Loss and MaskedLossSum of `rows` predicted positions on `device` use the fused loss.
  bool UsesFusedLoss(const torch::Device& device,
                     int64_t rows = std::numeric_limits<int64_t>::max() / 2) const;
  // Tokens that one window contributes to throughput figures.
  int64_t TokensPerWindow() const { return seq_len_; }
  // Logits [vocab] of the token that follows `context` ([1, t] int64, t >= 1); only the last
  // seq_len tokens of the context are used.
  torch::Tensor NextTokenLogits(const torch::Tensor& context);

  // The plain forward of block `i` (RunBlock wraps it). Public for the checkpointing function.
  virtual torch::Tensor BlockForward(int i, const torch::Tensor& x) = 0;

 protected:
  // The MLP predicts the last token of a window only.
  virtual bool PredictsLastTokenOnly() const { return false; }
  // A block draws random numbers (dropout) in training, so its recompute must replay them.
  virtual bool BlockUsesRng() const { return false; }

  BlockHooks* hooks_ = nullptr;
  TensorParallel tp_;  // the blocks keep a pointer to it
  int64_t seq_len_;
  bool activation_checkpointing_;
  FusedLoss fused_loss_ = FusedLoss::kAuto;

 private:
  // Embed and the blocks: the last block's output.
  torch::Tensor Hidden(const torch::Tensor& inputs);
  torch::Tensor Logits(const torch::Tensor& inputs) { return Head(Hidden(inputs)); }
  // sum_i weights_i * CE_i of the windows' targets through the fused loss (weights may be
  // undefined: all ones).
  torch::Tensor FusedLossSum(const torch::Tensor& windows, const torch::Tensor& weights);
};

// Frees a tensor's storage in place: the tensor (and every view and saved copy that shares the
// storage) keeps its shape but holds zero bytes until AllocateStorage gives it memory again.
void FreeStorage(const torch::Tensor& t);
// Gives a freed storage `bytes` of fresh, uninitialized CPU memory.
void AllocateStorage(const torch::Tensor& t, int64_t bytes);

// Samples `length` tokens after `prompt` (temperature sampling, drawn from `seed`), without
// gradients. For showing what a trained model learned.
std::vector<int64_t> Generate(LanguageModel& model, const std::vector<int64_t>& prompt, int length,
                              double temperature, uint64_t seed, int64_t seq_len);

// True for a LoRA adapter's parameter (by its name in named_parameters()).
bool IsLoraParameter(const std::string& name);
// The parameters that train (all of them, or under LoRA the adapters), in registration order.
std::vector<torch::Tensor> TrainableParameters(torch::nn::Module& model);

// The GEMMs one forward of `micro_batch` windows runs through Linear and BatchedMatmul, for timing
// the matmul paths (kernels/matmul_choice.h): each Linear module's shape (this rank's shard under
// tensor parallelism) and a tied head's, and the causal attention's two products in every block on
// this rank's heads. `fp32_linear` false (bf16 Linear layers): the attention's only.
MatmulWork GemmWorkOf(const LanguageModel& model, const ModelConfig& spec, int64_t micro_batch,
                      bool fp32_linear);

// Builds model.kind with its parameters drawn from `seed`.
std::shared_ptr<LanguageModel> BuildModel(const ModelConfig& spec, const ModelOptions& options,
                                          uint64_t seed);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_MODEL_MODEL_H_
