// Training data of trainyard-trainer without LibTorch: the token file (data.format "bytes",
// "uint16" or "uint32"), the DistributedSampler that maps an optimizer step to the samples each
// rank trains on, and the learning-rate schedule. All three are pure functions of their inputs and
// the step, which makes resuming at any step exact. Used by the training loop and by unit tests.
//
// Not thread-safe: DistributedSampler caches permutations; one training thread uses it.
#ifndef TRAINYARD_WORKER_TRAINER_IO_DATA_H_
#define TRAINYARD_WORKER_TRAINER_IO_DATA_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_config.h"

namespace trainyard::trainer {

// A whole token file in memory.
class TokenData {
 public:
  // Reads `path`. format "bytes": every byte is a token (vocab must be >= 256); "uint16" and
  // "uint32": flat little-endian tokens of that width (a Hugging Face tokenizer's vocabulary
  // beyond 65,536 needs uint32). NOT_FOUND if the file cannot be read, INVALID_ARGUMENT for a size
  // that is not a whole number of tokens, a token >= vocab, or an empty file; messages name the
  // file.
  static absl::StatusOr<TokenData> Load(const std::string& path, const std::string& format,
                                        int vocab);

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  const std::vector<int32_t>& tokens() const { return tokens_; }

 private:
  std::vector<int32_t> tokens_;
};

// data.loss_mask: one byte per token of a token file of `num_tokens`, each 0 or 1. INVALID_ARGUMENT
// naming data.loss_mask and the file for another length or another value; NOT_FOUND if unreadable.
absl::StatusOr<std::vector<uint8_t>> LoadLossMask(const std::string& path, int64_t num_tokens);

// Targets the loss counts in `samples` (windows of seq_len + 1 tokens, see NumSamples): tokens
// 1..seq_len of each window whose mask is 1, or with `last_only` (a model that predicts only the
// window's last token) that token alone.
int64_t CountedTargets(const std::vector<uint8_t>& mask, const std::vector<int64_t>& samples,
                       int seq_len, bool last_only);

// The loss weight of each target of `samples`, row-major [samples.size(), seq_len]: the mask of
// tokens 1..seq_len of each window (weight j is that of the token the position j predicts).
std::vector<float> TargetWeights(const std::vector<uint8_t>& mask,
                                 const std::vector<int64_t>& samples, int seq_len);

// The seed of the CPU generator for LoRA dropout at (step, micro-step) on `rank`: a function of
// the position alone, so that a resumed run draws the masks an uninterrupted one draws.
uint64_t DropoutSeed(uint64_t seed, int rank, int64_t step, int micro);

// Samples are windows of seq_len + 1 tokens starting at multiples of seq_len; this is how many fit.
int64_t NumSamples(int64_t num_tokens, int seq_len);

// Like PyTorch's DistributedSampler, but the position is a function of the optimizer step: the
// sample stream is epoch 0's permutation of [0, num_samples), then epoch 1's, ...; each epoch's
// permutation is seeded by (seed, epoch). Step t (0-based) trains on the global batch of
// B = micro_batch * grad_accum * world_size consecutive stream entries starting at t * B; rank r
// takes the contiguous slice [r * B / W, (r + 1) * B / W), which it splits into grad_accum
// micro-batches of micro_batch samples.
class DistributedSampler {
 public:
  DistributedSampler(int64_t num_samples, uint64_t seed, int micro_batch, int grad_accum,
                     int world_size, int rank);

  int64_t global_batch() const { return global_batch_; }
  // Sample indices of micro-batch `micro` (0 .. grad_accum-1) of step `step` on this rank.
  std::vector<int64_t> MicroBatch(int64_t step, int micro);
  // Sample indices of the whole global batch of `step`, rank 0's slice first.
  std::vector<int64_t> GlobalBatch(int64_t step);
  // Entry `position` of the sample stream.
  int64_t StreamAt(int64_t position);

 private:
  const std::vector<int64_t>& Permutation(int64_t epoch);

  int64_t num_samples_;
  uint64_t seed_;
  int micro_batch_;
  int grad_accum_;
  int world_size_;
  int rank_;
  int64_t global_batch_;
  std::map<int64_t, std::vector<int64_t>> permutations_;  // by epoch; at most two kept
};

// Learning rate of optimizer step `step` (0-based): linear warmup from lr / warmup to lr over the
// first `warmup` steps, then cosine decay to 0.1 * lr at step `total_steps`.
double LearningRate(int64_t step, int64_t total_steps, int64_t warmup, double lr);

// What a job trains and evaluates on: data.path and its loss mask, data.eval_path and its.
struct TrainingData {
  TokenData train;
  std::vector<uint8_t> loss_mask;  // empty: every target counts
  int64_t num_samples = 0;         // the training windows of model.seq_len + 1 tokens
  std::optional<TokenData> eval;   // data.eval_path
  std::vector<uint8_t> eval_mask;
  int64_t eval_windows = 0;  // the held-out windows an evaluation reads (at most kMaxEvalWindows)
};

// Loads the spec's data for a model of `m`'s sizes. Errors name the spec field and the file;
// INVALID_ARGUMENT when a file has no whole window.
absl::StatusOr<TrainingData> LoadTrainingData(const DataConfig& data, const ModelConfig& m);

// One replica's share of an evaluation over the first `total` held-out windows: replica r reads
// windows [r * per, (r + 1) * per) in micro-batches of `micro`, every replica as many (FSDP's
// gathers and a pipeline's sends match up); a window past the end is window 0, a padding.
struct EvalShare {
  std::vector<std::vector<int64_t>> windows;  // per micro-batch
  std::vector<std::vector<bool>> padding;     // per micro-batch: the windows that weigh nothing
};
EvalShare PlanEvalShare(int64_t total, int replica, int replicas, int micro);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_IO_DATA_H_
