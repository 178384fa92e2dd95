#include "worker/trainer/checkpoint/hf_weights.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/trainer/model/model.h"

namespace trainyard::trainer {

absl::StatusOr<std::unique_ptr<HfCheckpoint>> OpenModelFrom(ModelConfig* m) {
  if (m->from.empty()) return nullptr;
  auto prefixed = [](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("model.from: ", s.message()));
  };
  ASSIGN_OR_RETURN(const LlamaConfig config, ResolveFromCheckpoint(m));
  auto opened = HfCheckpoint::Open(m->from);
  if (!opened.ok()) return prefixed(opened.status());
  if (absl::Status s = (*opened)->Check(LlamaTensors(config)); !s.ok()) return prefixed(s);
  return opened;
}
namespace {

absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out.flush()) return absl::InternalError(absl::StrCat(tmp, ": cannot write"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot rename ", tmp, " into place"));
  }
  return absl::OkStatus();
}

// An fp32 safetensors entry of `t`.
SafetensorsEntry Entry(const std::string& name, const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kFloat).contiguous();
  SafetensorsEntry e;
  e.name = name;
  e.dtype = SafetensorsDtype::kF32;
  e.shape = c.sizes().vec();
  e.bytes.assign(static_cast<const char*>(c.data_ptr()), c.numel() * sizeof(float));
  return e;
}

}  // namespace

absl::Status LoadHfWeights(const HfCheckpoint& checkpoint, torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    if (IsLoraParameter(name)) continue;  // initialized, not loaded
    torch::Tensor param = item.value();
    const HfCheckpoint::Located at = checkpoint.Find(name);
    if (at.tensor == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("the checkpoint has no tensor ", name));
    }
    const std::string where = absl::StrCat(at.file->path(), ": tensor ", name);
    if (at.tensor->shape != param.sizes().vec()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has shape [", absl::StrJoin(at.tensor->shape, ", "),
                       "], the model [", absl::StrJoin(param.sizes().vec(), ", "), "]"));
    }
    torch::ScalarType type;
    switch (at.tensor->dtype) {
      case SafetensorsDtype::kF32:
        type = torch::kFloat;
        break;
      case SafetensorsDtype::kF16:
        type = torch::kHalf;
        break;
      case SafetensorsDtype::kBF16:
        type = torch::kBFloat16;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(where, " is ",
                                                       SafetensorsDtypeName(at.tensor->dtype),
                                                       "; weights must be F32, F16 or BF16"));
    }
    const absl::Span<const uint8_t> bytes = at.file->Bytes(*at.tensor);
    // A view of the mapping (read only), converted into the parameter's own memory.
    const torch::Tensor source = torch::from_blob(
        const_cast<uint8_t*>(bytes.data()), at.tensor->shape, torch::TensorOptions().dtype(type));
    param.copy_(source);
  }
  return absl::OkStatus();
}

absl::Status ExportHfModel(const ModelConfig& config, const LoraConfig& lora,
                           torch::nn::Module& model, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  torch::NoGradGuard no_grad;
  const auto params = model.named_parameters();
  std::vector<SafetensorsEntry> entries;
  for (const auto& item : params) {
    if (IsLoraParameter(item.key())) continue;
    torch::Tensor t = item.value().detach().to(torch::kFloat);
    // "<projection>.weight" with an adapter: merged (its bias, Qwen2's, is the base's).
    const std::string projection = item.key().substr(0, item.key().rfind('.'));
    const torch::Tensor* a = params.find(projection + ".lora_A.weight");
    const torch::Tensor* b = params.find(projection + ".lora_B.weight");
    if (a != nullptr && b != nullptr && absl::EndsWith(item.key(), ".weight")) {
      t = t + torch::matmul(*b, *a) * lora.scale();
    }
    entries.push_back(Entry(item.key(), t));
  }
  auto file = SerializeSafetensors(std::move(entries), {{"format", "pt"}});
  if (!file.ok()) return file.status();
  if (absl::Status s = WriteFileAtomically(dir + "/model.safetensors", *file); !s.ok()) return s;
  return WriteFileAtomically(dir + "/config.json", LlamaConfigJson(config));
}

absl::Status ExportLoraAdapter(const LoraConfig& lora, torch::nn::Module& model,
                               const std::string& base_model, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  std::vector<SafetensorsEntry> entries;
  for (const auto& item : model.named_parameters()) {
    if (!IsLoraParameter(item.key())) continue;
    entries.push_back(Entry("base_model.model." + item.key(), item.value().detach()));
  }
  if (entries.empty()) return absl::FailedPreconditionError("the model has no LoRA adapters");
  auto file = SerializeSafetensors(std::move(entries), {{"format", "pt"}});
  if (!file.ok()) return file.status();
  if (absl::Status s = WriteFileAtomically(dir + "/adapter_model.safetensors", *file); !s.ok()) {
    return s;
  }
  return WriteFileAtomically(dir + "/adapter_config.json", LoraAdapterConfigJson(lora, base_model));
}

}  // namespace trainyard::trainer
