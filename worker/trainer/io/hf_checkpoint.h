// Hugging Face model directories of the Llama family (Llama 2/3, Mistral-style models), without
// LibTorch: config.json (common/llama_config.h), the tensors such a model has (names and shapes
// as transformers' LlamaForCausalLM saves them), and a checkpoint (model.safetensors, or
// model.safetensors.index.json and its shards) checked against them before any weight is read:
// every tensor present, of its shape, in a floating-point dtype, and nothing unexpected. Errors
// are INVALID_ARGUMENT (NOT_FOUND for a missing file) naming the file and the first tensor or
// field that does not fit.
//
// Thread-safe: pure functions; an HfCheckpoint is immutable once open.
#ifndef TRAINYARD_WORKER_TRAINER_IO_HF_CHECKPOINT_H_
#define TRAINYARD_WORKER_TRAINER_IO_HF_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_config.h"
#include "common/llama_config.h"
#include "worker/trainer/io/safetensors.h"

namespace trainyard::trainer {

// config.json's reading and writing live in common/ (yard reads it too); by their old names here.
using ::trainyard::LlamaConfig;
using ::trainyard::LlamaConfigJson;
using ::trainyard::LlamaConfigOf;
using ::trainyard::ParseLlamaConfig;
using ::trainyard::ReadLlamaConfig;
using ::trainyard::ReadSmallFile;
using ::trainyard::ResolveFromCheckpoint;
using ::trainyard::ResolveLlamaConfig;

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

#endif  // TRAINYARD_WORKER_TRAINER_IO_HF_CHECKPOINT_H_
