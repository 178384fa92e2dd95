// What the GPU path shares with the CPU, tested on the CPU: dynamic loss scaling (LossScaler, and
// a whole fp16 run skipping exactly the step whose gradients overflow), the loss scale carried by
// checkpoints, gradient norms, and the device of what the trainer builds. The same code runs on a
// GPU in tests/gpu_test.sh.
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"
#include "worker/trainer/checkpoint/checkpoint.h"
#include "worker/trainer/comm/cuda_support.h"
#include "worker/trainer/io/param_dump.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/profiler.h"
#include "worker/trainer/runtime/step_graph.h"
#include "worker/trainer/trainer.h"

namespace trainyard::trainer {
namespace {

using ::testing::HasSubstr;

// --profile-steps: refused naming the flag when malformed; traces the steps it names, or (a
// LibTorch built without Kineto, as Debian's 1.13) says it cannot and the training goes on.
TEST(StepProfilerTest, ParsesItsStepsAndTracesThemOrSaysWhyNot) {
  for (const char* bad : {"3", "0:2", "2:0", "2:101", "a:b", "1:2:3"}) {
    auto p = StepProfiler::Make(bad, "/tmp/x.json", false);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_THAT(std::string(p.status().message()), HasSubstr("--profile-steps")) << bad;
  }
  EXPECT_THAT(std::string(StepProfiler::Make("2:3", "", false).status().message()),
              HasSubstr("--profile-out"));
  auto none = StepProfiler::Make("", "", false);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->last_step(), 0);

  const std::string out = ::testing::TempDir() + "/profile-test.json";
  std::filesystem::remove(out);
  auto p = StepProfiler::Make("2:2", out, false);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->last_step(), 3);
  torch::Tensor x = torch::ones({64, 64});
  for (int64_t step = 1; step <= 4; ++step) {
    p->Before(step);
    x = torch::mm(x, x) / 64;
    const absl::Status traced = p->After(step);
    if (step != 3) {
      EXPECT_TRUE(traced.ok()) << step << ": " << traced;
      continue;
    }
    if (traced.ok()) {
      std::ifstream in(out);
      const std::string text((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      EXPECT_THAT(text, HasSubstr("traceEvents"));
      EXPECT_THAT(text, HasSubstr("aten::mm"));
    } else {
      EXPECT_EQ(traced.code(), absl::StatusCode::kUnavailable) << traced;
      EXPECT_THAT(std::string(traced.message()), HasSubstr("Kineto"));
    }
  }
  std::filesystem::remove(out);
}

TEST(LossScalerTest, BacksOffOnOverflowAndGrowsAfterTheIntervalAsGradScaler) {
  LossScaler::Options o;
  o.init_scale = 1024;
  o.growth_interval = 3;
  LossScaler s(o);
  s.Update(true);
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.skipped_steps(), 1);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.growth_tracker(), 2);
  s.Update(false);  // the third clean step in a row
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.growth_tracker(), 0);
  s.Update(false);
  s.Update(true);  // an overflow resets the count
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.growth_tracker(), 0);
}

TEST(LossScalerTest, UnscaleDividesAndFindsInfAndNan) {
  LossScaler::Options o;
  o.init_scale = 4;
  LossScaler s(o);
  torch::Tensor a = torch::ones({3}, torch::requires_grad());
  torch::Tensor b = torch::ones({2}, torch::requires_grad());
  torch::Tensor frozen = torch::ones({2});
  a.mutable_grad() = torch::full({3}, 8.0);
  b.mutable_grad() = torch::full({2}, 2.0);
  EXPECT_FALSE(s.Unscale({a, b, frozen}));
  EXPECT_TRUE(torch::equal(a.grad(), torch::full({3}, 2.0)));
  EXPECT_TRUE(torch::equal(b.grad(), torch::full({2}, 0.5)));
  b.mutable_grad()[1] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(s.Unscale({a, b}));
  b.mutable_grad() = torch::zeros({2});
  b.mutable_grad()[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(s.Unscale({a, b}));
}

TEST(LossScalerTest, StateRoundTripsAndBadStateIsRefusedNamingIt) {
  LossScaler s;
  s.Update(true);
  s.Update(false);
  LossScaler t;
  ASSERT_TRUE(t.SetState(s.State()).ok());
  EXPECT_EQ(t.scale(), 32768);
  EXPECT_EQ(t.growth_tracker(), 1);
  auto bad = s.State();
  bad[0].second = torch::tensor({-1.0}, torch::kDouble);
  const absl::Status status = t.SetState(bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("loss_scale"));
  EXPECT_FALSE(t.SetState({}).ok());
}

// Where a step is captured as a CUDA graph: one rank's DDP with AdamW in fp32 or bf16 on a GPU;
// everything else says why not (nothing on the CPU, where there is nothing to capture).
TEST(StepGraphPlanTest, OnForDdpWithAdamWOnAGpuAndSaysWhyNotElsewhere) {
  StepGraphFacts gpu;
  gpu.cuda = true;
  gpu.can_capture = true;
  gpu.precision = Precision::kBf16;
  EXPECT_TRUE(PlanStepGraphs(gpu).on);
  EXPECT_EQ(PlanStepGraphs(gpu).why_not, "");
  gpu.precision = Precision::kFp32;
  EXPECT_TRUE(PlanStepGraphs(gpu).on);

  StepGraphFacts cpu = gpu;
  cpu.cuda = false;
  EXPECT_FALSE(PlanStepGraphs(cpu).on);
  EXPECT_EQ(PlanStepGraphs(cpu).why_not, "");

  auto why_not = [&](const std::function<void(StepGraphFacts&)>& change) {
    StepGraphFacts f = gpu;
    change(f);
    const StepGraphPlan plan = PlanStepGraphs(f);
    EXPECT_FALSE(plan.on);
    return plan.why_not;
  };
  EXPECT_EQ(why_not([](StepGraphFacts& f) { f.requested = false; }), "--cuda-graphs off");
  EXPECT_THAT(why_not([](StepGraphFacts& f) { f.can_capture = false; }),
              HasSubstr("cannot capture"));
  EXPECT_EQ(why_not([](StepGraphFacts& f) { f.layout_blocker = "FSDP gathers"; }), "FSDP gathers");
  // (A feature's reason before the layout's.)
  EXPECT_THAT(why_not([](StepGraphFacts& f) {
                f.layout_blocker = "FSDP gathers";
                f.precision = Precision::kFp16;
              }),
              HasSubstr("fp16's dynamic loss scaling"));
  EXPECT_THAT(why_not([](StepGraphFacts& f) { f.precision = Precision::kFp16; }),
              HasSubstr("fp16's dynamic loss scaling"));
  EXPECT_THAT(why_not([](StepGraphFacts& f) { f.optimizer = OptimizerKind::kLion; }),
              HasSubstr("lion takes its learning rate as a host number"));
  EXPECT_THAT(why_not([](StepGraphFacts& f) { f.optimizer = OptimizerKind::kAdafactor; }),
              HasSubstr("adafactor steps its state in host memory"));
  EXPECT_THAT(why_not([](StepGraphFacts& f) { f.optimizer = OptimizerKind::kAdamW8bit; }),
              HasSubstr("steps its state in host memory"));
  EXPECT_THAT(why_not([](StepGraphFacts& f) { f.loss_mask = true; }), HasSubstr("loss_mask"));
  EXPECT_THAT(why_not([](StepGraphFacts& f) { f.lora_dropout = true; }), HasSubstr("LoRA dropout"));
}

// StepGraphs' bookkeeping, with a capture that records what it is asked: warm-up steps run
// eagerly, then one capture and replays (each after its inputs are filled); new shapes drop the
// graph, warm up again and capture again, as does a graph dropped because what it read moved; a
// failed capture turns graphs off for the run, said once in the log.
TEST(StepGraphsTest, WarmsUpCapturesOnceReplaysAndCapturesAgainForNewShapes) {
  std::vector<std::string> events, log;
  int captures = 0;
  bool fail = false;
  GraphCapture capture = [&](const std::function<void()>& body) -> absl::StatusOr<GraphReplay> {
    ++captures;
    events.push_back("capture");
    if (fail) return absl::InternalError("operation not permitted when stream is capturing");
    return GraphReplay([&events] { events.push_back("replay"); });
  };
  StepGraphs graphs(
      capture, [&](const std::string& line) { log.push_back(line); }, 2);
  auto step = [&](const std::string& shapes, int64_t n) {
    events.clear();
    const bool replayed = graphs.Run(
        shapes, n, [] {}, [&events] { events.push_back("fill"); });
    if (!replayed) events.push_back("eager");
    return events;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(step("2x9", 1), V({"eager"}));
  EXPECT_EQ(step("2x9", 2), V({"eager"}));
  EXPECT_EQ(step("2x9", 3), V({"capture", "fill", "replay"}));
  EXPECT_EQ(step("2x9", 4), V({"fill", "replay"}));
  EXPECT_EQ(step("2x9", 5), V({"fill", "replay"}));
  EXPECT_EQ(captures, 1);
  EXPECT_EQ(graphs.replays(), 3);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_THAT(log[0], HasSubstr("step 3 captured (inputs 2x9) after 2 eager steps"));

  // New shapes: warm-up again, then a second capture.
  EXPECT_EQ(step("1x9", 6), V({"eager"}));
  EXPECT_THAT(log.back(), HasSubstr("(1x9) differ from the graph's (2x9)"));
  EXPECT_EQ(step("1x9", 7), V({"eager"}));
  EXPECT_EQ(step("1x9", 8), V({"capture", "fill", "replay"}));
  EXPECT_EQ(graphs.captures(), 2);

  // Dropped (what it read has moved): warm-up and a capture again with the same shapes.
  graphs.Drop(9, "parameters moved");
  EXPECT_THAT(log.back(), HasSubstr("step 9: parameters moved: warming up to capture again"));
  EXPECT_FALSE(graphs.captured());
  EXPECT_EQ(step("1x9", 9), V({"eager"}));
  EXPECT_EQ(step("1x9", 10), V({"eager"}));
  EXPECT_EQ(step("1x9", 11), V({"capture", "fill", "replay"}));
  EXPECT_TRUE(graphs.captured());
  EXPECT_EQ(graphs.captures(), 3);

  // Back to the first shapes, and this time the capture fails: eager from then on.
  fail = true;
  EXPECT_EQ(step("2x9", 12), V({"eager"}));
  EXPECT_EQ(step("2x9", 13), V({"eager"}));
  EXPECT_EQ(step("2x9", 14), V({"capture", "eager"}));
  EXPECT_FALSE(graphs.on());
  EXPECT_THAT(log.back(), HasSubstr("cuda graphs: off from step 14: the capture failed: operation "
                                    "not permitted when stream is capturing"));
  const size_t lines = log.size();
  EXPECT_EQ(step("2x9", 15), V({"eager"}));
  EXPECT_EQ(step("5x9", 16), V({"eager"}));
  EXPECT_EQ(captures, 4);
  EXPECT_EQ(log.size(), lines);
}

// Without CUDA the capture says so (the plan never asks for it there).
TEST(StepGraphsTest, TheCpuFlavourCannotCapture) {
  if (CudaGraphsBuilt()) GTEST_SKIP() << "the CUDA flavour";
  auto captured = CaptureCudaGraph([] {});
  EXPECT_EQ(captured.status().code(), absl::StatusCode::kUnimplemented);
}

TEST(DeviceTest, GradNormIsTheNormOfAllGradients) {
  torch::Tensor a = torch::zeros({2}, torch::requires_grad());
  torch::Tensor b = torch::zeros({1}, torch::requires_grad());
  torch::Tensor none = torch::zeros({1}, torch::requires_grad());
  a.mutable_grad() = torch::tensor({3.0f, 0.0f});
  b.mutable_grad() = torch::tensor({4.0f});
  EXPECT_DOUBLE_EQ(GradNorm({a, b, none}), 5.0);
  EXPECT_EQ(GradNorm({none}), 0.0);
}

TEST(DeviceTest, TheCpuIsAlwaysThereAndCudaIsRefusedWithoutIt) {
  EXPECT_TRUE(ResolveDevice("cpu").ok());
  EXPECT_EQ(ResolveDevice("tpu").status().code(), absl::StatusCode::kInvalidArgument);
  if (!CudaUsable()) {
    const auto cuda = ResolveDevice("cuda");
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(cuda.status().message()), HasSubstr("--device cuda"));
    EXPECT_EQ(SupportedDevices(), "cpu");
  }
}

// The example GPT, small, on the bytes of a licence text every Debian machine has.
JobConfig SmallJob(int64_t steps, Precision precision) {
  JobConfig job;
  job.model.kind = "gpt";
  job.model.n_layer = 2;
  job.model.n_head = 2;
  job.model.d_model = 64;
  job.model.seq_len = 32;
  job.model.vocab = 256;
  job.data.path = "/usr/share/common-licenses/GPL-3";
  job.data.format = "bytes";
  job.train.steps = steps;
  job.train.micro_batch = 4;
  job.train.lr = 1e-3;
  job.train.warmup = 1;
  job.train.precision = precision;
  job.train.seed = 1;
  job.train.weight_decay = 0.1;
  job.train.grad_clip = 1.0;
  return job;
}

std::vector<DumpedParam> Train(const JobConfig& job, const std::string& dir,
                               int64_t inject_overflow_step) {
  TrainerOptions o;
  o.job = job;
  o.checkpoint_dir = dir + "/checkpoints";
  o.dump_params = dir + "/params.bin";
  o.coordinator = "127.0.0.1:1";
  o.inject_overflow_step = inject_overflow_step;
  const absl::Status s = RunTrainer(o);
  EXPECT_TRUE(s.ok()) << s;
  auto dump = ReadParamDump(o.dump_params);
  EXPECT_TRUE(dump.ok()) << dump.status();
  return dump.ok() ? *dump : std::vector<DumpedParam>{};
}

// torch.amp.GradScaler's contract on a whole run: the step whose gradients overflow changes
// nothing (parameters, optimizer state), so three steps with the third overflowing end where two
// clean steps end; the loss scale halves and the checkpoint carries it.
TEST(Fp16Test, AnOverflowSkipsExactlyThatStepAndTheScaleIsCheckpointed) {
  testing::TempDir tmp;
  const auto skipped = Train(SmallJob(3, Precision::kFp16), tmp.path() + "/a", 3);
  const auto two = Train(SmallJob(2, Precision::kFp16), tmp.path() + "/b", 0);
  const auto three = Train(SmallJob(3, Precision::kFp16), tmp.path() + "/c", 0);
  ASSERT_EQ(skipped.size(), two.size());
  ASSERT_FALSE(skipped.empty());
  bool third_changed_something = false;
  for (size_t i = 0; i < skipped.size(); ++i) {
    EXPECT_EQ(skipped[i].values, two[i].values) << skipped[i].name;
    third_changed_something |= three[i].values != two[i].values;
  }
  EXPECT_TRUE(third_changed_something);

  // The checkpoint of the run with the overflow holds the halved scale, and a resumed run
  // starts from it.
  auto model = BuildModel(SmallJob(3, Precision::kFp16).model, ModelOptions(), 1);
  auto optimizer = MakeOptimizer(model->parameters(), OptimizerHyper(), 1e-3);
  ExtraState extra;
  auto loaded = LoadLatestCheckpoint(tmp.path() + "/a/checkpoints", *model, *optimizer, &extra);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  LossScaler scaler;
  ASSERT_TRUE(scaler.SetState(extra).ok());
  EXPECT_EQ(scaler.scale(), 32768);
}

// fp32 and bf16 checkpoints carry no loss scale (no amp.pt), and fp16 trains like fp32 on the CPU
// (the same arithmetic, the loss scaled and unscaled by powers of two).
TEST(Fp16Test, OnTheCpuFp16ComputesAsFp32) {
  testing::TempDir tmp;
  const auto fp16 = Train(SmallJob(3, Precision::kFp16), tmp.path() + "/a", 0);
  const auto fp32 = Train(SmallJob(3, Precision::kFp32), tmp.path() + "/b", 0);
  ASSERT_EQ(fp16.size(), fp32.size());
  for (size_t i = 0; i < fp16.size(); ++i)
    EXPECT_EQ(fp16[i].values, fp32[i].values) << fp16[i].name;
  auto model = BuildModel(SmallJob(3, Precision::kFp32).model, ModelOptions(), 1);
  auto optimizer = MakeOptimizer(model->parameters(), OptimizerHyper(), 1e-3);
  ExtraState extra = {{"stale", torch::zeros({1})}};
  ASSERT_TRUE(LoadLatestCheckpoint(tmp.path() + "/b/checkpoints", *model, *optimizer, &extra).ok());
  EXPECT_TRUE(extra.empty());
}

}  // namespace
}  // namespace trainyard::trainer
