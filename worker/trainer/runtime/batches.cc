#include "worker/trainer/runtime/batches.h"

namespace trainyard::trainer {

torch::Tensor MakeBatch(const TokenData& data, const std::vector<int64_t>& samples, int seq_len) {
  torch::Tensor batch =
      torch::empty({static_cast<int64_t>(samples.size()), seq_len + 1}, torch::kLong);
  auto acc = batch.accessor<int64_t, 2>();
  const std::vector<int32_t>& tokens = data.tokens();
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t start = samples[i] * seq_len;
    for (int j = 0; j <= seq_len; ++j) acc[i][j] = tokens[start + j];
  }
  return batch;
}

torch::Tensor MaskWeights(const std::vector<uint8_t>& mask, const std::vector<int64_t>& samples,
                          int seq_len) {
  std::vector<float> w = TargetWeights(mask, samples, seq_len);
  return torch::from_blob(w.data(), {static_cast<int64_t>(samples.size()), seq_len}, torch::kFloat)
      .clone();
}

}  // namespace trainyard::trainer
