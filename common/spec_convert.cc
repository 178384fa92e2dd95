// From a validated spec to the trainer's plain values (JobConfig), and the enums' names.
#include "common/spec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/llama_config.h"
#include "common/status_macros.h"

namespace trainyard {
namespace {

// The tables of job_config.h against the generated enums: each row's number is the wire's value
// of the same meaning, in the same order.
template <typename E, size_t N, typename W, size_t M>
constexpr bool SameNumbers(const EnumEntry<E> (&table)[N], const W (&wire)[M]) {
  if (N != M) return false;
  for (size_t i = 0; i < N; ++i) {
    if (table[i].wire != static_cast<int>(wire[i])) return false;
  }
  return true;
}
static_assert(SameNumbers(kStrategies, {v1::DDP, v1::FSDP, v1::OFFLOAD}));
static_assert(SameNumbers(kShardings,
                          {v1::FULL_SHARD, v1::SHARD_GRAD_OP, v1::NO_SHARD, v1::HYBRID_SHARD}));
static_assert(SameNumbers(kWrapPolicies, {v1::TRANSFORMER_BASED_WRAP, v1::SIZE_BASED_WRAP}));
static_assert(SameNumbers(kBackwardPrefetches,
                          {v1::BACKWARD_PRE, v1::BACKWARD_POST, v1::NO_PREFETCH}));
static_assert(SameNumbers(kPrecisions, {v1::FP32, v1::BF16, v1::FP16}));
static_assert(SameNumbers(kPipelineSchedules, {v1::GPIPE, v1::ONE_F_ONE_B}));
static_assert(SameNumbers(kExportFormats,
                          {v1::EXPORT_FORMAT_UNSPECIFIED, v1::EXPORT_HF, v1::EXPORT_HF_MERGED}));
static_assert(SameNumbers(kOptimizers, {v1::ADAMW, v1::ADAFACTOR, v1::LION, v1::ADAMW_8BIT}));
static_assert(SameNumbers(kLrSchedules, {v1::WARMUP_COSINE, v1::CONSTANT, v1::CONSTANT_WITH_WARMUP,
                                         v1::LINEAR, v1::COSINE, v1::COSINE_WITH_MIN_LR}));

// The spec name of a wire value; the generated name, lower-cased, for a number with no row.
template <typename E, size_t N, typename W>
std::string WireName(const EnumEntry<E> (&table)[N], W wire) {
  for (const auto& row : table) {
    if (row.wire == static_cast<int>(wire)) return row.name;
  }
  const auto* value =
      google::protobuf::GetEnumDescriptor<W>()->FindValueByNumber(static_cast<int>(wire));
  return value != nullptr ? absl::AsciiStrToLower(value->name())
                          : absl::StrCat(static_cast<int>(wire));
}

}  // namespace

int RankBlockOf(const v1::JobSpec& spec) {
  const auto& p = spec.parallel();
  const int tensor = std::max(1, p.tensor_parallel()), stages = std::max(1, p.pipeline_stages());
  if (p.strategy() == v1::FSDP && p.sharding_strategy() == v1::HYBRID_SHARD &&
      stages * tensor > 1) {
    return stages * tensor;
  }
  return tensor;
}

std::string StrategyName(v1::Strategy s) { return WireName(kStrategies, s); }

std::string ShardingStrategyName(v1::ShardingStrategy s) { return WireName(kShardings, s); }

std::string MixedPrecisionName(v1::MixedPrecision p) { return WireName(kPrecisions, p); }

std::string OptimizerName(v1::Optimizer o) { return WireName(kOptimizers, o); }

std::string LrScheduleName(v1::LrSchedule s) { return WireName(kLrSchedules, s); }

ModelConfig ToModelConfig(const v1::ModelSpec& m) {
  ModelConfig c;
  c.kind = m.kind();
  c.n_layer = m.n_layer();
  c.n_head = m.n_head();
  c.d_model = m.d_model();
  c.seq_len = m.seq_len();
  c.vocab = m.vocab();
  c.tie_weights = m.tie_weights();
  c.d_hidden = m.d_hidden();
  c.gelu_tanh = m.activation() == "gelu_tanh";
  c.from = m.from();
  c.n_kv_head = m.n_kv_head();
  c.head_dim = m.head_dim();
  if (m.rope_theta() > 0) c.rope_theta = m.rope_theta();
  if (m.rms_norm_eps() > 0) c.rms_norm_eps = m.rms_norm_eps();
  return c;
}

absl::Status FillModelFromCheckpoint(v1::JobSpec& spec) {
  if (spec.model().kind() != "llama" || spec.model().from().empty()) return absl::OkStatus();
  v1::ModelSpec& m = *spec.mutable_model();
  ModelConfig c = ToModelConfig(m);
  RETURN_IF_ERROR(ResolveFromCheckpoint(&c).status());
  m.set_n_layer(c.n_layer);
  m.set_d_model(c.d_model);
  m.set_n_head(c.n_head);
  m.set_n_kv_head(c.n_kv_head);
  m.set_head_dim(c.head_dim);
  m.set_d_hidden(c.d_hidden);
  m.set_vocab(c.vocab);
  m.set_tie_weights(c.tie_weights);
  return absl::OkStatus();
}

int64_t ModelParameterCount(const v1::ModelSpec& m) {
  return ModelParameterCount(ToModelConfig(m));
}

JobConfig ToJobConfig(const v1::JobSpec& spec) {
  JobConfig c;
  c.model = ToModelConfig(spec.model());
  c.data.path = spec.data().path();
  c.data.format = spec.data().format();
  c.data.loss_mask = spec.data().loss_mask();
  c.data.eval_path = spec.data().eval_path();
  c.data.eval_loss_mask = spec.data().eval_loss_mask();
  const v1::TrainSpec& t = spec.train();
  c.train.steps = t.steps();
  c.train.micro_batch = t.micro_batch();
  c.train.grad_accum = t.grad_accum();
  c.train.lr = t.lr();
  // Hugging Face's TrainingArguments.get_warmup_steps: ceil(steps x warmup_ratio).
  c.train.warmup =
      t.warmup() > 0
          ? t.warmup()
          : static_cast<int64_t>(std::ceil(static_cast<double>(t.steps()) * t.warmup_ratio()));
  c.train.lr_schedule = FromWire(kLrSchedules, t.lr_schedule(), LrSchedule::kWarmupCosine);
  if (t.has_min_lr_ratio()) c.train.min_lr_ratio = t.min_lr_ratio();
  c.train.precision = FromWire(kPrecisions, t.mixed_precision(), Precision::kFp32);
  c.train.activation_checkpointing = t.activation_checkpointing();
  c.train.seed = t.seed();
  c.train.weight_decay = t.weight_decay();
  c.train.grad_clip = t.grad_clip();
  c.train.optimizer = FromWire(kOptimizers, t.optimizer(), OptimizerKind::kAdamW);
  c.train.eval_every = t.eval_every();
  c.train.eval_batches = t.eval_batches();
  if (t.has_adam_beta1()) c.train.adam_beta1 = t.adam_beta1();
  if (t.has_adam_beta2()) c.train.adam_beta2 = t.adam_beta2();
  if (t.has_adam_epsilon()) c.train.adam_epsilon = t.adam_epsilon();
  if (t.has_adafactor_eps()) c.train.adafactor_eps = t.adafactor_eps();
  if (t.has_adafactor_clip_threshold()) {
    c.train.adafactor_clip_threshold = t.adafactor_clip_threshold();
  }
  if (t.has_adafactor_decay_rate()) c.train.adafactor_decay_rate = t.adafactor_decay_rate();
  c.train.no_weight_decay.assign(t.no_weight_decay().begin(), t.no_weight_decay().end());
  if (t.has_lora()) {
    c.train.lora.r = t.lora().r();
    c.train.lora.alpha = t.lora().alpha();
    c.train.lora.dropout = t.lora().dropout();
    c.train.lora.target_modules.assign(t.lora().target_modules().begin(),
                                       t.lora().target_modules().end());
  }
  const v1::ParallelSpec& p = spec.parallel();
  c.parallel.strategy = FromWire(kStrategies, p.strategy(), Strategy::kDdp);
  c.parallel.sharding = FromWire(kShardings, p.sharding_strategy(), Sharding::kFullShard);
  c.parallel.bucket_mb = p.bucket_mb();
  c.parallel.delayed_update = p.delayed_update();
  c.parallel.wrap = FromWire(kWrapPolicies, p.auto_wrap_policy(), WrapPolicy::kTransformerBased);
  c.parallel.min_num_params = p.min_num_params();
  c.parallel.backward_prefetch =
      FromWire(kBackwardPrefetches, p.backward_prefetch(), BackwardPrefetch::kBackwardPre);
  c.parallel.forward_prefetch = p.forward_prefetch();
  c.parallel.max_gathered_units = p.max_gathered_units();
  c.parallel.cpu_ram_efficient_loading = p.cpu_ram_efficient_loading();
  c.parallel.pipeline_stages = p.pipeline_stages();
  c.parallel.pipeline_schedule =
      FromWire(kPipelineSchedules, p.pipeline_schedule(), PipelineSchedule::kOneFOneB);
  c.parallel.pipeline_split.assign(p.pipeline_split().begin(), p.pipeline_split().end());
  c.parallel.tensor_parallel = p.tensor_parallel();
  c.parallel.sequence_parallel = p.sequence_parallel();
  c.train.micro_batches = std::max(1, t.micro_batches());
  c.checkpoint_every_steps = spec.checkpoint().every_steps();
  c.checkpoint_keep_last = spec.checkpoint().keep_last();
  c.checkpoint_keep_best = spec.checkpoint().keep_best();
  c.export_format =
      FromWire(kExportFormats, spec.checkpoint().export_format(), ExportFormat::kNone);
  return c;
}

}  // namespace trainyard
