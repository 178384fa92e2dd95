#include "worker/trainer/checkpoint/export.h"

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/trainer/checkpoint/checkpoint.h"
#include "worker/trainer/checkpoint/fsdp_checkpoint.h"
#include "worker/trainer/checkpoint/hf_weights.h"
#include "worker/trainer/io/param_dump.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {
namespace {

// A llama job's model as Hugging Face files in `out_dir`: under LoRA the adapter alone in PEFT's
// layout, or with `merge_lora` the model with it merged in; otherwise the model.
absl::Status ExportModel(const ModelConfig& m, const LoraConfig& lora, LanguageModel& model,
                         bool merge_lora, const std::string& out_dir) {
  if (lora.enabled() && !merge_lora) return ExportLoraAdapter(lora, model, m.from, out_dir);
  return ExportHfModel(m, lora, model, out_dir);
}

}  // namespace

absl::Status WriteJobExport(const ModelConfig& m, const LoraConfig& lora, LanguageModel& model,
                            ExportFormat format, const std::string& checkpoint_dir) {
  namespace fs = std::filesystem;
  // Of this process: an earlier attempt's rank 0 may still be writing its own.
  const std::string tmp = absl::StrCat(checkpoint_dir, "/.export.tmp-", ::getpid());
  const std::string final_dir = checkpoint_dir + "/export";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", ec.message()));
  RETURN_IF_ERROR(ExportModel(m, lora, model, format == ExportFormat::kHfMerged, tmp));
  for (fs::directory_iterator it(tmp, ec), end; !ec && it != end; it.increment(ec)) {
    RETURN_IF_ERROR(SyncPath(it->path().string()));
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list '", tmp, "': ", ec.message()));
  RETURN_IF_ERROR(SyncPath(tmp));
  fs::remove_all(final_dir, ec);
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename '", tmp, "' to '", final_dir, "'"));
  }
  return SyncPath(checkpoint_dir);
}

absl::Status WriteParameterDump(const std::string& path, torch::nn::Module& model) {
  std::vector<DumpedParam> params;
  for (const auto& item : model.named_parameters()) {
    torch::Tensor t = item.value().detach().to(torch::kCPU, torch::kFloat).contiguous();
    DumpedParam p;
    p.name = item.key();
    p.shape.assign(t.sizes().begin(), t.sizes().end());
    p.values.assign(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    params.push_back(std::move(p));
  }
  return WriteParamDump(path, std::move(params));
}

absl::Status ConsolidateCheckpoint(const std::string& sharded, const std::string& out_dir,
                                   void (*log)(const std::string& line)) {
  try {
    ASSIGN_OR_RETURN(CheckpointInfo info, ConsolidateShardedCheckpoint(sharded, out_dir));
    log(absl::StrCat("consolidated step ", info.step, " into ", info.path, " (", info.bytes,
                     " bytes)"));
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

absl::Status ExportCheckpointToHf(const JobConfig& job, const std::string& checkpoint_dir,
                                  const std::string& out_dir, bool merge_lora,
                                  void (*log)(const std::string& line)) {
  ModelConfig m = job.model;
  const LoraConfig& lora = job.train.lora;
  if (m.kind != "llama") {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.kind: --export-hf writes Llama-family models (llama), this job trains ", m.kind));
  }
  if (merge_lora && !lora.enabled()) {
    return absl::InvalidArgumentError(
        "--merge-lora: the job has no train.lora; its export is the whole model already");
  }
  if (!m.from.empty()) RETURN_IF_ERROR(ResolveFromCheckpoint(&m).status());
  try {
    ASSIGN_OR_RETURN(std::optional<CheckpointInfo> latest, FindLatestCheckpoint(checkpoint_dir));
    if (!latest.has_value()) {
      return absl::NotFoundError(
          absl::StrCat("--export-hf: no checkpoint in '", checkpoint_dir, "' (no 'latest')"));
    }
    std::string source = checkpoint_dir;
    const std::string consolidated = out_dir + "/.consolidated";
    // Removed however this ends.
    const std::unique_ptr<const std::string, void (*)(const std::string*)> cleanup(
        &consolidated, [](const std::string* path) {
          std::error_code ec;
          std::filesystem::remove_all(*path, ec);
        });
    if (std::filesystem::exists(latest->path + "/manifest.json")) {  // sharded (fsdp)
      ASSIGN_OR_RETURN(CheckpointInfo info,
                       ConsolidateShardedCheckpoint(latest->path, consolidated));
      (void)info;
      source = consolidated;
    }
    ModelOptions options;
    options.lora = lora;
    std::shared_ptr<LanguageModel> model = BuildModel(m, options, job.train.seed);
    // The checkpoint holds the optimizer's state too (of the parameters that train).
    const std::unique_ptr<torch::optim::Optimizer> optimizer =
        MakeOptimizer(TrainableParameters(*model),
                      HyperFor(job.train.optimizer, job.train.weight_decay), job.train.lr);
    absl::StatusOr<std::optional<CheckpointInfo>> loaded =
        LoadLatestCheckpoint(source, *model, *optimizer);
    if (!loaded.ok()) return loaded.status();
    RETURN_IF_ERROR(ExportModel(m, lora, *model, merge_lora, out_dir));
    log(absl::StrCat("exported ", lora.enabled() && !merge_lora ? "the LoRA adapter of " : "",
                     "step ", latest->step, " of ", checkpoint_dir, " to ", out_dir,
                     lora.enabled() && merge_lora ? " (LoRA merged)" : ""));
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

}  // namespace trainyard::trainer
