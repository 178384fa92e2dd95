// Hugging Face model directories of the Llama family (Llama 2/3, Mistral-style models), without
// LibTorch: config.json read into a LlamaConfig, the tensors such a model has (names and shapes
// as transformers' LlamaForCausalLM saves them), and a checkpoint (model.safetensors, or
// model.safetensors.index.json and its shards) checked against them before any weight is read:
// every tensor present, of its shape, in a floating-point dtype, and nothing unexpected. Errors
// are INVALID_ARGUMENT (NOT_FOUND for a missing file) naming the file and the first tensor or
// field that does not fit.
//
// Thread-safe: pure functions; an HfCheckpoint is immutable once open.
#ifndef TRAINYARD_WORKER_TRAINER_HF_CHECKPOINT_H_
#define TRAINYARD_WORKER_TRAINER_HF_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_config.h"
#include "worker/trainer/safetensors.h"

namespace trainyard::trainer {

// config.json of a LlamaForCausalLM (model_type "llama" or "mistral").
struct LlamaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // grouped-query attention; absent: num_attention_heads
  int64_t head_dim = 0;             // absent: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 0;
  double rope_theta = 10000;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  // rope_scaling: "" (none), "linear", "dynamic" or "llama3", with its factor (and llama3's
  // low_freq_factor, high_freq_factor and original_max_position_embeddings).
  std::string rope_scaling_type;
  double rope_scaling_factor = 1;
  double rope_low_freq_factor = 1;
  double rope_high_freq_factor = 4;
  int64_t rope_original_max_position_embeddings = 0;
  std::string torch_dtype;  // as saved: "float32", "bfloat16", "float16" or ""
};

// INVALID_ARGUMENT naming `file` and the field: not JSON, another architecture, a size missing
// or out of range, heads that do not divide the hidden size or the key-value heads.
absl::StatusOr<LlamaConfig> ParseLlamaConfig(absl::string_view json, const std::string& file);

// DIR/config.json, read and parsed (NOT_FOUND when it cannot be read).
absl::StatusOr<LlamaConfig> ReadLlamaConfig(const std::string& dir);

// Fills `model`'s llama sizes left at 0 from `config` (read from `file`) and copies its rope
// scaling; INVALID_ARGUMENT naming the spec's field when one given disagrees with the checkpoint.
absl::Status ResolveLlamaConfig(const LlamaConfig& config, const std::string& file,
                                ModelConfig* model);
// The config.json of a llama `model` (as transformers' LlamaConfig writes it, float32).
std::string LlamaConfigJson(const ModelConfig& model);

// PEFT's adapter_config.json for a LoRA adapter of a llama model (peft_type LORA, task_type
// CAUSAL_LM); `base_model`: base_model_name_or_path, or "" for none.
std::string LoraAdapterConfigJson(const LoraConfig& lora, const std::string& base_model);
// The LlamaConfig a llama `model` has.
LlamaConfig LlamaConfigOf(const ModelConfig& model);

struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> shape;
};

// Every tensor of a LlamaForCausalLM with `config`, in the order of the model's modules (the
// embedding, each layer's norms, attention and MLP, the final norm, then lm_head unless tied).
std::vector<ExpectedTensor> LlamaTensors(const LlamaConfig& config);

// A model directory's weights: which file holds each tensor, all mapped.
class HfCheckpoint {
 public:
  // Opens DIR/model.safetensors.index.json and its shards, else DIR/model.safetensors. NOT_FOUND
  // when neither exists or a shard is missing; INVALID_ARGUMENT for a bad file (see
  // safetensors.h), or a tensor the index places in one shard that another holds.
  static absl::StatusOr<std::unique_ptr<HfCheckpoint>> Open(const std::string& dir);

  // Checks the tensors against `expected`: the first missing one, one of another shape, one not
  // in F32, F16 or BF16, or one the model does not have, named with its file.
  absl::Status Check(const std::vector<ExpectedTensor>& expected) const;

  struct Located {
    const SafetensorsFile* file = nullptr;
    const SafetensorsTensor* tensor = nullptr;
  };
  // nullptr members for a tensor the checkpoint does not have.
  Located Find(const std::string& name) const;
  size_t size() const { return where_.size(); }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Located> where_;  // by tensor name
};

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_HF_CHECKPOINT_H_
