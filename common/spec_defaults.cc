// The job spec's defaults, filled once where a spec comes in (yard, the coordinator).
#include "common/spec.h"

#include "absl/strings/str_cat.h"
#include "common/llama_config.h"

namespace trainyard {

using v1::JobSpec;

void ApplyJobSpecDefaults(JobSpec& spec) {
  if (spec.priority() == 0) spec.set_priority(50);
  if (IsCommandJob(spec)) return;  // the program's own settings are its business
  if (!spec.checkpoint().has_keep_last()) spec.mutable_checkpoint()->set_keep_last(3);
  auto& m = *spec.mutable_model();
  if (m.kind().empty()) m.set_kind("gpt");
  if (m.kind() == "mlp" && m.d_hidden() == 0) m.set_d_hidden(4 * m.d_model());
  // llama without a checkpoint: Llama's MLP width (8/3 d_model, rounded up to a multiple of 64)
  // and defaults; with one, its config.json fills what is left at 0 (in the trainer).
  if (m.kind() == "llama" && m.from().empty()) {
    if (m.d_hidden() == 0) m.set_d_hidden((8 * m.d_model() / 3 + 63) / 64 * 64);
    if (m.n_kv_head() == 0) m.set_n_kv_head(m.n_head());
    if (m.rope_theta() == 0) m.set_rope_theta(10000);
    if (m.rms_norm_eps() == 0) m.set_rms_norm_eps(1e-6);
  }
  auto& d = *spec.mutable_data();
  if (d.format().empty()) d.set_format("bytes");
  if (m.vocab() == 0 && d.format() == "bytes") m.set_vocab(256);
  auto& t = *spec.mutable_train();
  if (t.micro_batch() == 0) t.set_micro_batch(8);
  if (t.grad_accum() == 0) t.set_grad_accum(1);
  if (t.lr() == 0) t.set_lr(3e-4);
  if (t.mixed_precision() == v1::MIXED_PRECISION_UNSPECIFIED) t.set_mixed_precision(v1::FP32);
  if (t.optimizer() == v1::OPTIMIZER_UNSPECIFIED) t.set_optimizer(v1::ADAMW);
  if (t.lr_schedule() == v1::LR_SCHEDULE_UNSPECIFIED) t.set_lr_schedule(v1::WARMUP_COSINE);
  if (t.seed() == 0) t.set_seed(1);
  if (t.has_lora()) {  // PEFT's LoraConfig defaults, with its llama targets
    auto& lora = *t.mutable_lora();
    if (lora.r() == 0) lora.set_r(8);
    if (lora.alpha() == 0) lora.set_alpha(8);
    if (lora.target_modules().empty()) {
      lora.add_target_modules("q_proj");
      lora.add_target_modules("v_proj");
    }
  }
  auto& p = *spec.mutable_parallel();
  if (p.strategy() == v1::STRATEGY_UNSPECIFIED) p.set_strategy(v1::DDP);
  if (p.sharding_strategy() == v1::SHARDING_STRATEGY_UNSPECIFIED) {
    p.set_sharding_strategy(v1::FULL_SHARD);
  }
  if (p.bucket_mb() == 0) p.set_bucket_mb(25);
  if (p.auto_wrap_policy() == v1::WRAP_POLICY_UNSPECIFIED) {
    p.set_auto_wrap_policy(v1::TRANSFORMER_BASED_WRAP);
  }
  if (p.min_num_params() == 0) p.set_min_num_params(100'000'000);  // PyTorch's default
  if (p.backward_prefetch() == v1::BACKWARD_PREFETCH_UNSPECIFIED) {
    p.set_backward_prefetch(v1::BACKWARD_PRE);
  }
  if (p.max_gathered_units() == 0) p.set_max_gathered_units(2);
  if (!p.has_cpu_ram_efficient_loading()) p.set_cpu_ram_efficient_loading(true);
  if (p.pipeline_stages() == 0) p.set_pipeline_stages(1);
  if (p.tensor_parallel() == 0) p.set_tensor_parallel(1);
  if (p.pipeline_schedule() == v1::PIPELINE_SCHEDULE_UNSPECIFIED) {
    p.set_pipeline_schedule(v1::ONE_F_ONE_B);
  }
  if (t.micro_batches() == 0 && p.pipeline_stages() > 1) {
    t.set_micro_batches(2 * p.pipeline_stages());
  }
}

}  // namespace trainyard
