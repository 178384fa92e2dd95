// The models trainyard-trainer trains, as torch::nn modules with a deterministic initialization
// (torch::manual_seed(train.seed) then GPT-2 style: N(0, 0.02) weights, zero biases, unit
// LayerNorms), no dropout (so activation recompute is exact):
//  - "gpt": token + learned position embeddings, n_layer pre-norm blocks (LayerNorm -> causal
//    multi-head self-attention with a fused qkv Linear and an output Linear; LayerNorm -> 4x GELU
//    MLP), a final LayerNorm and an LM head (the token embedding when model.tie_weights).
//  - "mlp": the mean of the context's token embeddings, n_layer residual blocks
//    (Linear d_model->d_hidden, GELU, Linear d_hidden->d_model), a Linear head with bias that
//    predicts the token after the context.
// Parameter counts equal common/spec.h ModelParameterCount.
//
// bf16: every Linear (and the tied head) runs its matmul in bfloat16 on bf16 copies of its input
// and weights, with fp32 master weights and fp32 everywhere else (LayerNorm, softmax, loss).
//
// Not thread-safe; one training thread uses a model.
#ifndef TRAINYARD_WORKER_TRAINER_MODEL_H_
#define TRAINYARD_WORKER_TRAINER_MODEL_H_

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "trainyard/v1/job.pb.h"

namespace trainyard::trainer {

struct ModelOptions {
  bool bf16 = false;
  // Recompute each GPT block in backward instead of keeping its activations.
  bool activation_checkpointing = false;
};

class LanguageModel : public torch::nn::Module {
 public:
  // Mean next-token cross-entropy of `windows` ([batch, seq_len + 1] int64 tokens): the GPT
  // predicts every position of the window, the MLP only the last token.
  virtual torch::Tensor Loss(const torch::Tensor& windows) = 0;
  // Tokens that one window contributes to throughput figures.
  virtual int64_t TokensPerWindow() const = 0;
  // Logits [vocab] of the token that follows `context` ([1, t] int64, t >= 1); only the last
  // seq_len tokens of the context are used.
  virtual torch::Tensor NextTokenLogits(const torch::Tensor& context) = 0;
};

// Samples `length` tokens after `prompt` (temperature sampling, drawn from `seed`), without
// gradients. For showing what a trained model learned.
std::vector<int64_t> Generate(LanguageModel& model, const std::vector<int64_t>& prompt, int length,
                              double temperature, uint64_t seed, int64_t seq_len);

// Builds model.kind with its parameters drawn from `seed`.
std::shared_ptr<LanguageModel> BuildModel(const v1::ModelSpec& spec, const ModelOptions& options,
                                          uint64_t seed);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_MODEL_H_
