// Llama-family model directories' config.json, without LibTorch or protobuf: read into a
// LlamaConfig, a spec's llama sizes resolved against it, and written back (as transformers'
// LlamaConfig writes it); and PEFT's adapter_config.json for a LoRA adapter. The trainer uses it
// for model.from and --export-hf, and yard to fill a spec's sizes from a checkpoint it can read.
// Errors are INVALID_ARGUMENT (NOT_FOUND for a missing file) naming the file and the field.
//
// Thread-safe: pure functions.
#ifndef TRAINYARD_COMMON_LLAMA_CONFIG_H_
#define TRAINYARD_COMMON_LLAMA_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_config.h"

namespace trainyard {

// A whole file of at most 64 MiB (NOT_FOUND when it cannot be read).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path);

// config.json of a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM (model_type "llama",
// "mistral" or "qwen2": Llama with, for Mistral, a sliding window and, for Qwen2, biases on q/k/v).
struct LlamaConfig {
  std::string model_type = "llama";
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
  // Mistral's sliding_window (0: none): each position attends to at most this many (itself
  // included). Qwen2's is taken only with use_sliding_window, which is refused.
  int64_t sliding_window = 0;
  // The MLP's activation: "silu" (swish), "gelu" (erf), "gelu_pytorch_tanh" (gelu_new: the tanh
  // approximation) or "relu".
  std::string hidden_act = "silu";
  bool qkv_bias = false;  // Qwen2: q_proj, k_proj and v_proj have biases
  // Qwen2's, kept for the export (sliding windows are off there).
  int64_t max_window_layers = 0;
};

// INVALID_ARGUMENT naming `file` and the field: not JSON, another architecture, a size missing
// or out of range, heads that do not divide the hidden size or the key-value heads, a field that
// changes the computation in a way trainyard does not implement (an activation, biases, a rope
// type, Qwen2's use_sliding_window).
absl::StatusOr<LlamaConfig> ParseLlamaConfig(absl::string_view json, const std::string& file);

// DIR/config.json, read and parsed (NOT_FOUND when it cannot be read).
absl::StatusOr<LlamaConfig> ReadLlamaConfig(const std::string& dir);

// Fills `model`'s llama sizes left at 0 from `config` (read from `file`) and copies its rope
// scaling; INVALID_ARGUMENT naming the spec's field when one given disagrees with the checkpoint.
absl::Status ResolveLlamaConfig(const LlamaConfig& config, const std::string& file,
                                ModelConfig* model);
// `model.from`'s config.json read (its errors prefixed "model.from: ", codes kept) and `model`'s
// sizes resolved against it (ResolveLlamaConfig); returns the config.
absl::StatusOr<LlamaConfig> ResolveFromCheckpoint(ModelConfig* model);

// The config.json of a llama `model` (as transformers' LlamaConfig, MistralConfig or Qwen2Config
// writes it, by model.family; float32).
std::string LlamaConfigJson(const ModelConfig& model);

// PEFT's adapter_config.json for a LoRA adapter of a llama model (peft_type LORA, task_type
// CAUSAL_LM); `base_model`: base_model_name_or_path, or "" for none.
std::string LoraAdapterConfigJson(const LoraConfig& lora, const std::string& base_model);
// The LlamaConfig a llama `model` has.
LlamaConfig LlamaConfigOf(const ModelConfig& model);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_LLAMA_CONFIG_H_
