// A model's parameters from and to Hugging Face safetensors, by name (the llama model's
// parameters are named as transformers' LlamaForCausalLM's state dict; hf_checkpoint.h checks a
// checkpoint against those names and shapes first). LibTorch side; hf_checkpoint.h has no
// LibTorch.
//
// Thread-compatible.
#ifndef TRAINYARD_WORKER_TRAINER_CHECKPOINT_HF_WEIGHTS_H_
#define TRAINYARD_WORKER_TRAINER_CHECKPOINT_HF_WEIGHTS_H_

#include <torch/torch.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "worker/trainer/io/hf_checkpoint.h"

namespace trainyard::trainer {

// model.from: fills the sizes `m` leaves out from the checkpoint's config.json and opens it, every
// tensor checked (names, shapes, dtypes; headers only), so that a bad checkpoint fails before any
// rank waits for another. Errors name model.from. Null when `m` has no model.from.
absl::StatusOr<std::unique_ptr<HfCheckpoint>> OpenModelFrom(ModelConfig* m);

// Copies every parameter of `model` but LoRA adapters from the mapped `checkpoint`, converting F16
// and BF16 to the parameter's fp32 (exactly: both widen without rounding). INVALID_ARGUMENT naming
// the file and tensor for one the checkpoint lacks, of another shape, or not F32/F16/BF16.
absl::Status LoadHfWeights(const HfCheckpoint& checkpoint, torch::nn::Module& model);

// Writes a Hugging Face model directory for a llama `config` with `model`'s parameters:
// DIR/config.json and DIR/model.safetensors (fp32), through temporary files renamed into place.
// LoRA adapters are merged into their projections (W + alpha/r * B A, PEFT's merge_and_unload).
absl::Status ExportHfModel(const ModelConfig& config, const LoraConfig& lora,
                           torch::nn::Module& model, const std::string& dir);

// Writes the LoRA adapters of `model` alone, as PEFT's save_pretrained does:
// DIR/adapter_config.json and DIR/adapter_model.safetensors (fp32, tensors named
// "base_model.model.<parameter name>"). `base_model`: the base's directory, or "".
absl::Status ExportLoraAdapter(const LoraConfig& lora, torch::nn::Module& model,
                               const std::string& base_model, const std::string& dir);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CHECKPOINT_HF_WEIGHTS_H_
