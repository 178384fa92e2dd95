// PlanStepGraphs and StepGraphs (see step_graph.h).
#include "worker/trainer/runtime/step_graph.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace trainyard::trainer {

StepGraphPlan PlanStepGraphs(const StepGraphFacts& f) {
  StepGraphPlan plan;
  if (!f.cuda) return plan;  // nothing to say on the CPU
  auto off = [&](const std::string& why) {
    plan.why_not = why;
    return plan;
  };
  if (!f.requested) return off("--cuda-graphs off");
  if (!f.can_capture) return off("this trainer's LibTorch cannot capture CUDA graphs");
  if (f.precision == Precision::kFp16) {
    return off(
        "fp16's dynamic loss scaling reads its overflow check on the host to skip or apply each "
        "update");
  }
  switch (f.optimizer) {
    case OptimizerKind::kAdamW:
      break;
    case OptimizerKind::kLion:
      return off(
          "train.optimizer lion takes its learning rate as a host number (AdamW's fused kernel "
          "reads it, and its step count, from the device)");
    default:
      return off(
          absl::StrCat("train.optimizer ", Name(f.optimizer), " steps its state in host memory"));
  }
  if (f.loss_mask) {
    return off(
        "data.loss_mask weighs each step's loss by a count of its targets, made on the host "
        "every step");
  }
  if (f.lora_dropout) {
    return off("LoRA dropout seeds the generator from the host for each micro-batch");
  }
  // (After the reasons above, which say more than the layout's own.)
  if (!f.layout_blocker.empty()) return off(f.layout_blocker);
  plan.on = true;
  return plan;
}

StepGraphs::StepGraphs(GraphCapture capture, std::function<void(const std::string&)> log,
                       int warmup_steps)
    : capture_(std::move(capture)), log_(std::move(log)), warmup_steps_(warmup_steps) {}

void StepGraphs::Drop(int64_t step, const std::string& why) {
  if (!replay_) return;
  log_(absl::StrCat("cuda graphs: step ", step, ": ", why, ": warming up to capture again"));
  replay_ = nullptr;
  eager_steps_ = 0;
}

bool StepGraphs::Run(const std::string& shapes, int64_t step, const std::function<void()>& body,
                     const std::function<void()>& before_replay) {
  if (!on_) return false;
  if (shapes != shapes_) {
    if (replay_) {
      log_(absl::StrCat("cuda graphs: step ", step, "'s shapes (", shapes,
                        ") differ from the graph's (", shapes_, "): warming up to capture again"));
    }
    replay_ = nullptr;  // (waits for the device, frees the graph's memory)
    shapes_ = shapes;
    eager_steps_ = 0;
  }
  if (eager_steps_ < warmup_steps_) {
    ++eager_steps_;
    return false;
  }
  if (!replay_) {
    absl::StatusOr<GraphReplay> captured = capture_(body);
    if (!captured.ok()) {
      on_ = false;
      log_(absl::StrCat("cuda graphs: off from step ", step,
                        ": the capture failed: ", captured.status().message()));
      return false;
    }
    replay_ = *std::move(captured);
    ++captures_;
    log_(absl::StrCat("cuda graphs: step ", step, " captured (inputs ", shapes, ") after ",
                      eager_steps_, " eager steps; replayed from here on"));
  }
  before_replay();
  replay_();
  ++replays_;
  return true;
}

}  // namespace trainyard::trainer
