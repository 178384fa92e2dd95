// What leaves the trainer as files for other tools: the parameters (--dump-params), a job's model
// as Hugging Face files (or its LoRA adapter in PEFT's layout), at the end of a run
// (checkpoint.export) or from a checkpoint
// (`trainyard-trainer --export-hf`), and a sharded FSDP checkpoint consolidated into a DDP one
// (`--consolidate-checkpoint`).
#ifndef TRAINYARD_WORKER_TRAINER_CHECKPOINT_EXPORT_H_
#define TRAINYARD_WORKER_TRAINER_CHECKPOINT_EXPORT_H_

#include <string>

#include "absl/status/status.h"
#include "common/job_config.h"
#include "worker/trainer/model/model.h"

namespace trainyard::trainer {

// checkpoint.export at the end of a run: written into DIR/.export.tmp-PID, every file fsynced, then
// renamed to DIR/export (replacing an earlier attempt's), which `yard fetch` serves.
absl::Status WriteJobExport(const ModelConfig& m, const LoraConfig& lora, LanguageModel& model,
                            ExportFormat format, const std::string& checkpoint_dir);

// --dump-params: every parameter of `model` (on the CPU) as io/param_dump.h writes them.
absl::Status WriteParameterDump(const std::string& path, torch::nn::Module& model);

// See trainer.h (RunConsolidate, RunExportHf); `log` gets the line that says what was written.
absl::Status ConsolidateCheckpoint(const std::string& sharded, const std::string& out_dir,
                                   void (*log)(const std::string& line));
absl::Status ExportCheckpointToHf(const JobConfig& job, const std::string& checkpoint_dir,
                                  const std::string& out_dir, bool merge_lora,
                                  void (*log)(const std::string& line));

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_CHECKPOINT_EXPORT_H_
