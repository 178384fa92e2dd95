// TokenData, DistributedSampler and LearningRate (see data.h).
#include "worker/trainer/io/data.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/lr_schedule.h"
#include "common/status_macros.h"

namespace trainyard::trainer {
namespace {

// SplitMix64: a small, portable generator, so permutations are the same on every platform.
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

absl::StatusOr<TokenData> TokenData::Load(const std::string& path, const std::string& format,
                                          int vocab) {
  if (format != "bytes" && format != "uint16" && format != "uint32") {
    return absl::InvalidArgumentError(
        absl::StrCat("data.format: unknown value '", format, "' (bytes, uint16 or uint32)"));
  }
  if (format == "bytes" && vocab < 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.vocab: data.format bytes needs vocab >= 256, got ", vocab));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("data.path: cannot read '", path, "': ", std::strerror(errno)));
  }
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    return absl::NotFoundError(
        absl::StrCat("data.path: error reading '", path, "': ", std::strerror(errno)));
  }
  if (raw.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("data.path: '", path, "' is empty"));
  }
  TokenData data;
  if (format == "bytes") {
    data.tokens_.reserve(raw.size());
    for (char c : raw) data.tokens_.push_back(static_cast<unsigned char>(c));
    return data;
  }
  const size_t width = format == "uint16" ? 2 : 4;
  if (raw.size() % width != 0) {
    return absl::InvalidArgumentError(absl::StrCat("data.path: '", path, "' has ", raw.size(),
                                                   " bytes, not a whole number of ", format,
                                                   " tokens"));
  }
  data.tokens_.resize(raw.size() / width);
  for (size_t i = 0; i < data.tokens_.size(); ++i) {
    uint64_t value = 0;  // little-endian
    for (size_t b = 0; b < width; ++b) {
      value |= static_cast<uint64_t>(static_cast<unsigned char>(raw[width * i + b])) << (8 * b);
    }
    if (value >= static_cast<uint64_t>(vocab)) {
      return absl::InvalidArgumentError(absl::StrCat("data.path: token ", value, " at index ", i,
                                                     " of '", path, "' is >= model.vocab (", vocab,
                                                     ")"));
    }
    data.tokens_[i] = static_cast<int32_t>(value);  // < vocab, an int
  }
  return data;
}

int64_t NumSamples(int64_t num_tokens, int seq_len) {
  if (seq_len <= 0 || num_tokens < seq_len + 1) return 0;
  return (num_tokens - 1) / seq_len;
}

DistributedSampler::DistributedSampler(int64_t num_samples, uint64_t seed, int micro_batch,
                                       int grad_accum, int world_size, int rank)
    : num_samples_(num_samples),
      seed_(seed),
      micro_batch_(micro_batch),
      grad_accum_(grad_accum),
      world_size_(world_size),
      rank_(rank),
      global_batch_(int64_t{micro_batch} * grad_accum * world_size) {}

const std::vector<int64_t>& DistributedSampler::Permutation(int64_t epoch) {
  auto it = permutations_.find(epoch);
  if (it != permutations_.end()) return it->second;
  while (permutations_.size() >= 2) permutations_.erase(permutations_.begin());
  std::vector<int64_t> perm(num_samples_);
  for (int64_t i = 0; i < num_samples_; ++i) perm[i] = i;
  uint64_t state = seed_ * 0x100000001B3ULL ^ (static_cast<uint64_t>(epoch) + 0x5851F42DULL);
  for (int64_t i = num_samples_ - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(SplitMix64(state) % static_cast<uint64_t>(i + 1));
    std::swap(perm[i], perm[j]);
  }
  return permutations_.emplace(epoch, std::move(perm)).first->second;
}

int64_t DistributedSampler::StreamAt(int64_t position) {
  return Permutation(position / num_samples_)[position % num_samples_];
}

std::vector<int64_t> DistributedSampler::MicroBatch(int64_t step, int micro) {
  const int64_t start = step * global_batch_ + int64_t{rank_} * micro_batch_ * grad_accum_ +
                        int64_t{micro} * micro_batch_;
  std::vector<int64_t> out(micro_batch_);
  for (int i = 0; i < micro_batch_; ++i) out[i] = StreamAt(start + i);
  return out;
}

std::vector<int64_t> DistributedSampler::GlobalBatch(int64_t step) {
  std::vector<int64_t> out(global_batch_);
  for (int64_t i = 0; i < global_batch_; ++i) out[i] = StreamAt(step * global_batch_ + i);
  return out;
}

double LearningRate(int64_t step, int64_t total_steps, int64_t warmup, double lr) {
  TrainConfig t;  // warmup_cosine to 0.1 x lr
  t.steps = total_steps;
  t.warmup = warmup;
  t.lr = lr;
  return ScheduledLearningRate(step, t);
}

absl::StatusOr<std::vector<uint8_t>> LoadLossMask(const std::string& path, int64_t num_tokens) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    return absl::NotFoundError(absl::StrCat("data.loss_mask: cannot read '", path, "'"));
  }
  std::vector<uint8_t> mask((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (static_cast<int64_t>(mask.size()) != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("data.loss_mask: '", path, "' has ", mask.size(),
                                                   " bytes; it needs one per token of data.path (",
                                                   num_tokens, ")"));
  }
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i] > 1) {
      return absl::InvalidArgumentError(absl::StrCat("data.loss_mask: '", path, "' byte ", i,
                                                     " is ", int{mask[i]}, "; only 0 and 1"));
    }
  }
  return mask;
}

int64_t CountedTargets(const std::vector<uint8_t>& mask, const std::vector<int64_t>& samples,
                       int seq_len, bool last_only) {
  int64_t n = 0;
  for (int64_t s : samples) {
    const int64_t start = s * seq_len;
    for (int j = last_only ? seq_len : 1; j <= seq_len; ++j) n += mask[start + j];
  }
  return n;
}

std::vector<float> TargetWeights(const std::vector<uint8_t>& mask,
                                 const std::vector<int64_t>& samples, int seq_len) {
  std::vector<float> w;
  w.reserve(samples.size() * seq_len);
  for (int64_t s : samples) {
    const int64_t start = s * seq_len;
    for (int j = 1; j <= seq_len; ++j) w.push_back(mask[start + j]);
  }
  return w;
}

uint64_t DropoutSeed(uint64_t seed, int rank, int64_t step, int micro) {
  // splitmix64 over the position's parts, one after another.
  uint64_t x = seed;
  for (uint64_t part : {uint64_t(rank), uint64_t(step), uint64_t(micro)}) {
    x += 0x9e3779b97f4a7c15ULL + part;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    x ^= x >> 31;
  }
  return x;
}

absl::StatusOr<TrainingData> LoadTrainingData(const DataConfig& data, const ModelConfig& m) {
  // A failure of `s` with its message under `field`.
  auto named = [](const char* field, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
  };
  TrainingData out;
  ASSIGN_OR_RETURN(out.train, TokenData::Load(data.path, data.format, m.vocab));
  if (!data.loss_mask.empty()) {
    ASSIGN_OR_RETURN(out.loss_mask, LoadLossMask(data.loss_mask, out.train.size()));
  }
  out.num_samples = NumSamples(out.train.size(), m.seq_len);
  if (out.num_samples < 1) {
    return absl::InvalidArgumentError(absl::StrCat("model.seq_len: ", m.seq_len, " needs at least ",
                                                   m.seq_len + 1, " tokens, but data.path '",
                                                   data.path, "' has only ", out.train.size()));
  }
  if (data.eval_path.empty()) return out;
  auto eval = TokenData::Load(data.eval_path, data.format, m.vocab);
  if (!eval.ok()) return named("data.eval_path", eval.status());
  out.eval = *std::move(eval);
  if (!data.eval_loss_mask.empty()) {
    auto mask = LoadLossMask(data.eval_loss_mask, out.eval->size());
    if (!mask.ok()) return named("data.eval_loss_mask", mask.status());
    out.eval_mask = *std::move(mask);
  }
  out.eval_windows = std::min(NumSamples(out.eval->size(), m.seq_len), kMaxEvalWindows);
  if (out.eval_windows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.eval_path: '", data.eval_path, "' has ", out.eval->size(),
                     " tokens; one window of model.seq_len + 1 = ", m.seq_len + 1, " needs more"));
  }
  return out;
}

EvalShare PlanEvalShare(int64_t total, int replica, int replicas, int micro) {
  const int64_t per = (total + replicas - 1) / replicas;
  const int micro_batches = static_cast<int>((per + micro - 1) / micro);
  EvalShare share;
  share.windows.resize(micro_batches);
  share.padding.resize(micro_batches);
  for (int b = 0; b < micro_batches; ++b) {
    for (int64_t j = 0; j < micro; ++j) {
      const int64_t in_share = b * int64_t{micro} + j, window = int64_t{replica} * per + in_share;
      const bool padding = in_share >= per || window >= total;
      share.padding[b].push_back(padding);
      share.windows[b].push_back(padding ? 0 : window);
    }
  }
  return share;
}

}  // namespace trainyard::trainer
