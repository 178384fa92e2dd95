// Pipeline checkpoints (see staged_checkpoint.h).
#include "worker/trainer/checkpoint/staged_checkpoint.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {

absl::StatusOr<CheckpointInfo> WriteStagedCheckpoint(
    const std::string& dir, int64_t step, const PipelineLayout& layout, const LanguageModel& model,
    const std::vector<std::pair<std::string, torch::Tensor>>& params,
    torch::optim::Optimizer& optimizer, Communicator& world, Communicator* tensor,
    const MetaNotes& notes) {
  // The first replica's tensor-parallel group gathers its shards; its rank 0 writes.
  auto write_stage = [&](const std::string& tmp) -> absl::Status {
    if (layout.replica != 0) return absl::OkStatus();
    const bool writes = layout.tp_rank == 0;
    auto fill = [&](torch::serialize::OutputArchive& archive) {
      std::map<const void*, std::string> names;
      for (const auto& [param_name, p] : params) {
        const torch::Tensor whole = Whole(p, model.TensorParallelSplitOf(param_name), tensor);
        if (writes) archive.write("param/" + param_name, whole.to(torch::kCPU));
        names[p.unsafeGetTensorImpl()] = param_name;
      }
      const auto& optimized = optimizer.param_groups().at(0).params();
      for (size_t i = 0; i < optimized.size(); ++i) {
        const std::string& param_name = names.at(optimized[i].unsafeGetTensorImpl());
        const TensorParallelSplit split = model.TensorParallelSplitOf(param_name);
        int64_t param_step = 0;
        // Elementwise state is cut as its parameter is (tensor parallelism allows only adamw and
        // lion; without it, Whole leaves any state as it is).
        for (const auto& [key, t] : ParameterState(optimizer, i, &param_step)) {
          const torch::Tensor whole =
              CutAsParameter(t, optimized[i].sizes(),
                             [&](const torch::Tensor& s) { return Whole(s, split, tensor); });
          if (writes) {
            archive.write(absl::StrCat("state/", param_name, "/", key), whole.to(torch::kCPU));
          }
        }
        if (writes) archive.write("step/" + param_name, torch::tensor({param_step}, torch::kLong));
      }
      return writes;
    };
    return WriteSyncedArchive(absl::StrCat(tmp, "/stage-", layout.stage, ".pt"), fill);
  };
  auto finish = [&](const std::string& tmp) -> absl::Status {
    try {
      torch::save(SaveRngState(), tmp + "/rng.pt");
    } catch (const c10::Error& e) {
      return absl::InternalError(
          absl::StrCat("cannot save '", tmp, "/rng.pt': ", e.what_without_backtrace()));
    }
    RETURN_IF_ERROR(SyncPath(tmp + "/rng.pt"));
    return WriteSyncedFile(tmp + "/meta.json",
                           MetaJson(step, OptimizerName(optimizer), notes, layout.stages));
  };
  return WriteCollectiveCheckpoint(dir, step, world, write_stage, finish);
}

}  // namespace trainyard::trainer
