// JobConfig: what a training rank needs of a job spec, as plain C++ values. The trainer's compute
// side (LibTorch) reads this instead of the protobuf trainyard.v1.JobSpec, because LibTorch's
// CUDA packages ship protobuf headers of their own that clash with the system's: no translation
// unit may include both a generated .pb.h and LibTorch. common/spec.h makes one from a validated
// spec (ToJobConfig). No protobuf, no LibTorch here; pure values, thread-compatible.
#ifndef TRAINYARD_COMMON_JOB_CONFIG_H_
#define TRAINYARD_COMMON_JOB_CONFIG_H_

#include <cstdint>
#include <string>

namespace trainyard {

enum class Strategy { kDdp, kFsdp, kOffload };
// PyTorch FSDP's ShardingStrategy.
enum class Sharding { kFullShard, kShardGradOp, kNoShard, kHybridShard };
// Accelerate's fsdp_auto_wrap_policy.
enum class WrapPolicy { kTransformerBased, kSizeBased };
// PyTorch FSDP's BackwardPrefetch.
enum class BackwardPrefetch { kBackwardPre, kBackwardPost, kNoPrefetch };
enum class Precision { kFp32, kBf16 };

// Names as written in specs: "ddp", "FULL_SHARD", "TRANSFORMER_BASED_WRAP", "BACKWARD_PRE",
// "fp32".
const char* Name(Strategy s);
const char* Name(Sharding s);
const char* Name(WrapPolicy p);
const char* Name(BackwardPrefetch p);
const char* Name(Precision p);

struct ModelConfig {
  std::string kind;  // "gpt" or "mlp"
  int n_layer = 0;
  int n_head = 0;
  int d_model = 0;
  int seq_len = 0;
  int vocab = 0;
  bool tie_weights = false;
  int d_hidden = 0;  // mlp
};

struct DataConfig {
  std::string path;
  std::string format;  // "bytes" or "uint16"
};

struct TrainConfig {
  int64_t steps = 0;
  int micro_batch = 0;
  int grad_accum = 1;
  double lr = 0;
  int64_t warmup = 0;
  Precision precision = Precision::kFp32;
  bool activation_checkpointing = false;
  uint64_t seed = 0;
  double weight_decay = 0;
  double grad_clip = 0;  // max global gradient norm; 0 = none
};

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
};

struct JobConfig {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  ParallelConfig parallel;
  int64_t checkpoint_every_steps = 0;  // 0 = on request and before a graceful stop only
};

// Number of parameters of the model (embeddings included, tied head counted once).
int64_t ModelParameterCount(const ModelConfig& model);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_JOB_CONFIG_H_
