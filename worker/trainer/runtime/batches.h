// A step's token windows and loss weights as tensors (in host memory; ToDevice moves them).
#ifndef TRAINYARD_WORKER_TRAINER_RUNTIME_BATCHES_H_
#define TRAINYARD_WORKER_TRAINER_RUNTIME_BATCHES_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "worker/trainer/io/data.h"

namespace trainyard::trainer {

// The windows of `samples` as a [batch, seq_len + 1] int64 tensor.
torch::Tensor MakeBatch(const TokenData& data, const std::vector<int64_t>& samples, int seq_len);

// The loss weights of `samples`' targets ([batch, seq_len] float, see TargetWeights).
torch::Tensor MaskWeights(const std::vector<uint8_t>& mask, const std::vector<int64_t>& samples,
                          int seq_len);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_RUNTIME_BATCHES_H_
