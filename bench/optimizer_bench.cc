// trainyard's optimizers (worker/trainer/optim/optimizers.h) on the parameters of a Llama-shaped
// model (common/job_config's TrainedParameterShapes): the median time of one step over every
// parameter and the bytes of optimizer state each holds. bench/optimizer_bench.sh runs it beside
// the reference implementations in PyTorch on the same shapes and threads.
//
//   optimizer_bench [--reps N] [--threads N] [--layers N] [--d-model N] [--d-hidden N] [--vocab N]
// prints one JSON object per optimizer.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/job_config.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {
namespace {

int Main(int argc, char** argv) {
  int reps = 7, threads = 0;
  ModelConfig m;
  m.kind = "llama";
  m.n_layer = 6;
  m.d_model = 768;
  m.n_head = 12;
  m.d_hidden = 2048;
  m.vocab = 32000;
  m.seq_len = 512;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--reps") reps = value;
    if (flag == "--threads") threads = value;
    if (flag == "--layers") m.n_layer = value;
    if (flag == "--d-model") m.d_model = value;
    if (flag == "--d-hidden") m.d_hidden = value;
    if (flag == "--vocab") m.vocab = value;
  }
  if (threads > 0) torch::set_num_threads(threads);
  const std::vector<std::vector<int64_t>> shapes = TrainedParameterShapes(m, LoraConfig{});
  torch::manual_seed(1);
  std::vector<OptimizerSlot> slots;
  int64_t params = 0;
  for (const auto& shape : shapes) {
    OptimizerSlot slot{torch::randn(shape) * 0.02, 0, {{shape, 0}}};
    slot.param.mutable_grad() = torch::randn(shape) * 1e-3;
    params += slot.param.numel();
    slots.push_back(std::move(slot));
  }
  for (const OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdafactor,
                                   OptimizerKind::kLion, OptimizerKind::kAdamW8bit}) {
    SlotOptimizer optimizer(HyperFor(kind, 0.1), slots, nullptr);
    optimizer.Step(1e-4, 1);  // creates the state
    std::vector<double> ms;
    for (int r = 0; r < reps; ++r) {
      const auto start = std::chrono::steady_clock::now();
      optimizer.Step(1e-4, 1);
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
    std::sort(ms.begin(), ms.end());
    const nlohmann::json out = {{"impl", "trainyard"},
                                {"optimizer", Name(kind)},
                                {"params", params},
                                {"tensors", static_cast<int64_t>(shapes.size())},
                                {"threads", torch::get_num_threads()},
                                {"median_ms", ms[ms.size() / 2]},
                                {"state_bytes", optimizer.StateBytes()}};
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace trainyard::trainer

int main(int argc, char** argv) { return trainyard::trainer::Main(argc, argv); }
