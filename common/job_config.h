// JobConfig: what a training rank needs of a job spec, as plain C++ values. The trainer's compute
// side (LibTorch) reads this instead of the protobuf trainyard.v1.JobSpec, because LibTorch's
// CUDA packages ship protobuf headers of their own that clash with the system's: no translation
// unit may include both a generated .pb.h and LibTorch. common/spec.h makes one from a validated
// spec (ToJobConfig). No protobuf, no LibTorch here; pure values, thread-compatible.
#ifndef TRAINYARD_COMMON_JOB_CONFIG_H_
#define TRAINYARD_COMMON_JOB_CONFIG_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace trainyard {

enum class Strategy { kDdp, kFsdp, kOffload };
// PyTorch FSDP's ShardingStrategy.
enum class Sharding { kFullShard, kShardGradOp, kNoShard, kHybridShard };
// Accelerate's fsdp_auto_wrap_policy.
enum class WrapPolicy { kTransformerBased, kSizeBased };
// PyTorch FSDP's BackwardPrefetch.
enum class BackwardPrefetch { kBackwardPre, kBackwardPost, kNoPrefetch };
enum class Precision { kFp32, kBf16, kFp16 };
// parallel.pipeline_schedule.
enum class PipelineSchedule { kGpipe, kOneFOneB };
// checkpoint.export: none, a Hugging Face directory (LoRA: the PEFT adapter), or LoRA merged.
enum class ExportFormat { kNone, kHf, kHfMerged };
// train.optimizer.
enum class OptimizerKind { kAdamW, kAdafactor, kLion, kAdamW8bit };
// train.lr_schedule (common/lr_schedule.h).
enum class LrSchedule {
  kWarmupCosine,
  kConstant,
  kConstantWithWarmup,
  kLinear,
  kCosine,
  kCosineWithMinLr
};

// One table per enum: each value, its number in trainyard.v1 (the wire) and its name as written in
// specs. Name(), the spec's YAML choices and the conversion from the wire (common/spec.cc, which
// checks every number against the generated enum at compile time) all read these tables; a new
// value is one new row. A row with wire 0 is the unset value, not written in specs.
template <typename E>
struct EnumEntry {
  E value;
  int wire;
  const char* name;
};

inline constexpr EnumEntry<Strategy> kStrategies[] = {
    {Strategy::kDdp, 1, "ddp"}, {Strategy::kFsdp, 2, "fsdp"}, {Strategy::kOffload, 3, "offload"}};
inline constexpr EnumEntry<Sharding> kShardings[] = {{Sharding::kFullShard, 1, "FULL_SHARD"},
                                                     {Sharding::kShardGradOp, 2, "SHARD_GRAD_OP"},
                                                     {Sharding::kNoShard, 3, "NO_SHARD"},
                                                     {Sharding::kHybridShard, 4, "HYBRID_SHARD"}};
inline constexpr EnumEntry<WrapPolicy> kWrapPolicies[] = {
    {WrapPolicy::kTransformerBased, 1, "TRANSFORMER_BASED_WRAP"},
    {WrapPolicy::kSizeBased, 2, "SIZE_BASED_WRAP"}};
inline constexpr EnumEntry<BackwardPrefetch> kBackwardPrefetches[] = {
    {BackwardPrefetch::kBackwardPre, 1, "BACKWARD_PRE"},
    {BackwardPrefetch::kBackwardPost, 2, "BACKWARD_POST"},
    {BackwardPrefetch::kNoPrefetch, 3, "NO_PREFETCH"}};
inline constexpr EnumEntry<Precision> kPrecisions[] = {
    {Precision::kFp32, 1, "fp32"}, {Precision::kBf16, 2, "bf16"}, {Precision::kFp16, 3, "fp16"}};
inline constexpr EnumEntry<PipelineSchedule> kPipelineSchedules[] = {
    {PipelineSchedule::kGpipe, 1, "gpipe"}, {PipelineSchedule::kOneFOneB, 2, "1f1b"}};
inline constexpr EnumEntry<ExportFormat> kExportFormats[] = {
    {ExportFormat::kNone, 0, "none"},
    {ExportFormat::kHf, 1, "hf"},
    {ExportFormat::kHfMerged, 2, "hf_merged"}};
inline constexpr EnumEntry<OptimizerKind> kOptimizers[] = {
    {OptimizerKind::kAdamW, 1, "adamw"},
    {OptimizerKind::kAdafactor, 2, "adafactor"},
    {OptimizerKind::kLion, 3, "lion"},
    {OptimizerKind::kAdamW8bit, 4, "adamw_8bit"}};
inline constexpr EnumEntry<LrSchedule> kLrSchedules[] = {
    {LrSchedule::kWarmupCosine, 1, "warmup_cosine"},
    {LrSchedule::kConstant, 2, "constant"},
    {LrSchedule::kConstantWithWarmup, 3, "constant_with_warmup"},
    {LrSchedule::kLinear, 4, "linear"},
    {LrSchedule::kCosine, 5, "cosine"},
    {LrSchedule::kCosineWithMinLr, 6, "cosine_with_min_lr"}};

// The name of `value` in `table` ("?" if it has no row).
template <typename E, size_t N>
constexpr const char* NameIn(const EnumEntry<E> (&table)[N], E value) {
  for (const auto& row : table) {
    if (row.value == value) return row.name;
  }
  return "?";
}

// The value whose wire number is `wire`; `fallback` for a number with no row (the unset 0).
template <typename E, size_t N>
constexpr E FromWire(const EnumEntry<E> (&table)[N], int wire, E fallback) {
  for (const auto& row : table) {
    if (row.wire == wire) return row.value;
  }
  return fallback;
}

// Names as written in specs: "ddp", "FULL_SHARD", "TRANSFORMER_BASED_WRAP", "BACKWARD_PRE",
// "fp32", "1f1b", "adamw_8bit", "hf_merged".
inline const char* Name(Strategy s) { return NameIn(kStrategies, s); }
inline const char* Name(Sharding s) { return NameIn(kShardings, s); }
inline const char* Name(WrapPolicy p) { return NameIn(kWrapPolicies, p); }
inline const char* Name(BackwardPrefetch p) { return NameIn(kBackwardPrefetches, p); }
inline const char* Name(Precision p) { return NameIn(kPrecisions, p); }
inline const char* Name(PipelineSchedule s) { return NameIn(kPipelineSchedules, s); }
inline const char* Name(ExportFormat f) { return NameIn(kExportFormats, f); }
inline const char* Name(OptimizerKind k) { return NameIn(kOptimizers, k); }
inline const char* Name(LrSchedule s) { return NameIn(kLrSchedules, s); }

struct ModelConfig {
  std::string kind;  // "gpt", "mlp" or "llama"
  int n_layer = 0;
  int n_head = 0;
  int d_model = 0;
  int seq_len = 0;
  int vocab = 0;
  bool tie_weights = false;
  int d_hidden = 0;  // mlp; llama: the SwiGLU MLP's width
  // gpt and mlp: the MLP's GELU, exact (erf) or GPT-2's tanh approximation (gelu_tanh).
  bool gelu_tanh = false;
  // llama:
  std::string from;  // a Hugging Face model directory; "": random initialization
  int n_kv_head = 0;
  int head_dim = 0;  // 0: d_model / n_head
  double rope_theta = 10000;
  double rms_norm_eps = 1e-6;
  // From the checkpoint's config.json only: rope_scaling's type ("", "linear", "dynamic",
  // "llama3") and parameters, and max_position_embeddings (dynamic scaling starts beyond it).
  std::string rope_scaling;
  double rope_factor = 1;
  double rope_low_freq_factor = 1;
  double rope_high_freq_factor = 4;
  int64_t rope_original_max_position = 0;
  int64_t max_position_embeddings = 0;
  // Mistral's sliding_window, from model.from's config.json (0: none): each position attends to
  // itself and the sliding_window - 1 before it.
  int64_t sliding_window = 0;
  // From model.from's config.json: the family ("llama", "mistral" or "qwen2"; the export writes
  // it back), the MLP's activation (hidden_act: "silu", "gelu", "gelu_pytorch_tanh" or "relu")
  // and whether q/k/v have biases (Qwen2's).
  std::string family = "llama";
  std::string hidden_act = "silu";
  bool qkv_bias = false;
  int64_t max_window_layers = 0;  // Qwen2's, for the export

  int HeadDim() const { return head_dim > 0 ? head_dim : n_head > 0 ? d_model / n_head : 0; }
  int KvHeads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
};

struct DataConfig {
  std::string path;
  std::string format;     // "bytes", "uint16" or "uint32"
  std::string loss_mask;  // "": every target counts; else one 0/1 byte per token
  // Held-out data (train.eval_every), of `format`; "": no evaluation.
  std::string eval_path;
  std::string eval_loss_mask;
};

// LoRA (PEFT's LoraConfig): each targeted projection W (a llama q/k/v/o/gate/up/down_proj) gains
// y += (alpha / r) * B(A(dropout(x))), A [r, in] and B [out, r]; the base weights are frozen.
struct LoraConfig {
  int r = 0;  // 0: no LoRA, every parameter trains
  double alpha = 0;
  double dropout = 0;
  std::vector<std::string> target_modules;  // e.g. "q_proj"

  bool enabled() const { return r > 0; }
  double scale() const { return alpha / r; }
  bool Targets(const std::string& module) const;
};

struct TrainConfig {
  int64_t steps = 0;
  int micro_batch = 0;
  int grad_accum = 1;
  double lr = 0;
  int64_t warmup = 0;  // steps (warmup_ratio resolved)
  LrSchedule lr_schedule = LrSchedule::kWarmupCosine;
  double min_lr_ratio = 0.1;  // warmup_cosine and cosine_with_min_lr
  Precision precision = Precision::kFp32;
  bool activation_checkpointing = false;
  uint64_t seed = 0;
  double weight_decay = 0;
  double grad_clip = 0;  // max global gradient norm; 0 = none
  LoraConfig lora;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  int micro_batches = 1;  // pipeline parallelism: micro-batches per step
  // Evaluation on data.eval_path: every eval_every steps (0: after the last step only), over
  // eval_batches global batches of its windows (0: all of them, up to kMaxEvalWindows).
  int64_t eval_every = 0;
  int eval_batches = 0;
  // The optimizer's constants; unset: the optimizer's defaults (OptimizerDefaults).
  std::optional<double> adam_beta1, adam_beta2, adam_epsilon;
  double adafactor_eps = 1e-30;
  double adafactor_clip_threshold = 1.0;
  double adafactor_decay_rate = -0.8;
  // Parameter kinds weight_decay skips: "bias", "norm", "embedding".
  std::vector<std::string> no_weight_decay;
};

// Most held-out windows one evaluation reads.
inline constexpr int64_t kMaxEvalWindows = 65536;

struct ParallelConfig {
  Strategy strategy = Strategy::kDdp;
  Sharding sharding = Sharding::kFullShard;
  double bucket_mb = 25;
  bool delayed_update = false;  // offload
  WrapPolicy wrap = WrapPolicy::kTransformerBased;
  int64_t min_num_params = 0;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  int max_gathered_units = 2;
  bool cpu_ram_efficient_loading = true;
  int pipeline_stages = 1;
  PipelineSchedule pipeline_schedule = PipelineSchedule::kOneFOneB;
  std::vector<int> pipeline_split;  // blocks per stage; empty: balanced by parameters
  int tensor_parallel = 1;
  bool sequence_parallel = false;
};

struct JobConfig {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  ParallelConfig parallel;
  int64_t checkpoint_every_steps = 0;  // 0 = on request and before a graceful stop only
  int64_t checkpoint_keep_last = 0;    // 0 = every checkpoint is kept (retention.h)
  bool checkpoint_keep_best = false;   // also the one of the lowest eval_loss
  // Written into <checkpoint dir>/export by rank 0 at the end of a run that trained every step.
  ExportFormat export_format = ExportFormat::kNone;
};

// Number of parameters of the model (embeddings included, tied head counted once).
int64_t ModelParameterCount(const ModelConfig& model);
// Parameters of one of the model's repeated blocks (GPT block, MLP residual block, Llama layer).
int64_t BlockParameterCount(const ModelConfig& model);
// The first block of each of `stages` pipeline stages, then n_layer (stages + 1 entries): from
// `split` (blocks per stage, already checked to sum to n_layer) or, when it is empty, balanced by
// parameters (the first stage also holds the embeddings, the last the final norm and the head;
// 1 <= stages <= n_layer).
std::vector<int> PipelineBoundaries(const ModelConfig& model, int stages,
                                    const std::vector<int>& split);
// Parameters each stage of `bounds` (PipelineBoundaries) holds (the tied embedding on the first
// and the last stage both).
std::vector<int64_t> StageParameterCounts(const ModelConfig& model, const std::vector<int>& bounds);
// What `model`'s sizes do not allow of `parallel`'s pipeline and tensor-parallel layout, as
// "FIELD: why"; "" when it fits. Sizes still 0 (model.from's config.json fills them) are not
// judged: the spec checks what it has, the trainer checks again once they are known.
std::string ModelParallelMisfit(const ModelConfig& model, const ParallelConfig& parallel);
// Parameters LoRA adds (the adapters, which are all that trains); 0 without LoRA.
int64_t LoraParameterCount(const ModelConfig& model, const LoraConfig& lora);
// Shapes of the parameters that train (every parameter, or under LoRA the adapters), in no
// particular order: what optimizer state is sized by.
std::vector<std::vector<int64_t>> TrainedParameterShapes(const ModelConfig& model,
                                                         const LoraConfig& lora);
// Elements of optimizer state for parameters of these shapes on one rank, the elementwise state
// split over `shards` ranks (FSDP's shard group; 1 for whole parameters). AdamW: m and v (fp32);
// Lion: m; Adafactor: a row and a column vector per matrix, a full vector per 1-D parameter (its
// state is replicated, not sharded); 8-bit AdamW: bytes, not elements (see OptimizerStateBytes).
int64_t OptimizerStateBytes(OptimizerKind kind, const std::vector<std::vector<int64_t>>& shapes,
                            int64_t shards);
// The llama projections LoRA may target, in a layer's order.
const std::vector<std::string>& LoraTargetNames();

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_JOB_CONFIG_H_
