// The parallel strategies (worker/trainer/strategy/strategy.h) on their own, without the trainer:
// real Gloo ranks as threads of one process. Each layout's steps on two ranks must leave the model
// where one rank's DDP steps over the same global batch leave it, and each must resume from the
// checkpoints it writes. (The trainer's end-to-end tests run them as processes under the worker.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "common/job_config.h"
#include "tests/testing/subprocess.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/parallel/parallel_dims.h"
#include "worker/trainer/strategy/strategy.h"

namespace trainyard::trainer {
namespace {

constexpr int kMicroBatch = 2;  // windows of a micro-batch
constexpr int kSteps = 2;

void Log(const std::string&) {}

// A job of a small GPT on `world` ranks: `layout` is "ddp", "fsdp" or "pipeline" (two stages).
JobConfig Job(const std::string& layout, int world) {
  JobConfig job;
  ModelConfig& m = job.model;
  m.kind = "gpt";
  m.n_layer = 2;
  m.d_model = 16;
  m.n_head = 2;
  m.seq_len = 8;
  m.vocab = 32;
  TrainConfig& t = job.train;
  t.steps = kSteps;
  t.micro_batch = kMicroBatch;
  t.lr = 1e-2;
  t.seed = 7;
  t.optimizer = OptimizerKind::kAdamW;
  t.weight_decay = 0.1;
  // The global batch is 4 windows: one rank takes them in 2 micro-batches, two ranks one each,
  // a pipeline's stages 2 micro-batches.
  t.grad_accum = 2 / world;
  t.micro_batches = 2;
  if (layout == "fsdp") job.parallel.strategy = Strategy::kFsdp;
  if (layout == "pipeline") job.parallel.pipeline_stages = 2;
  return job;
}

// The global batch of step `step`: 4 windows of seq_len + 1 tokens, the same for every layout.
torch::Tensor GlobalBatch(int64_t step, const ModelConfig& m) {
  torch::Generator gen = at::detail::createCPUGenerator(1000 + step);
  return torch::randint(m.vocab, {2 * kMicroBatch, m.seq_len + 1}, gen, torch::kLong);
}

// What a rank's run left: every parameter by name (after GatherModel, where it holds them), and
// each step's gradient norm.
struct RunResult {
  std::map<std::string, torch::Tensor> params;
  std::vector<double> grad_norms;
  bool holds_whole = true;
};

// CUDA graphs' bookkeeping on the CPU (StepGraphs, runtime/step_graph.h): a stand-in for a
// graph that keeps the captured body and runs it again at each replay, as a graph's kernels run
// again on its input tensors (the windows, the learning rate and the step count, filled before
// each replay). The capture itself needs a GPU (tests/gpu_test.sh cuda_graphs).
struct GraphStandIn {
  int warmup_steps = 0;
  int captures = 0;
  int64_t replays = 0;
};

// The learning rate of `step`: it changes every step (a graph must not keep the first one).
double StepLr(const JobConfig& job, int64_t step) { return job.train.lr / (1 + step % 3); }

// Runs `steps` steps of `job` on `world` ranks (threads with real Gloo groups), each rank's
// windows of the global batch by the strategy's split. With `resumed_step`, first resumes from
// `dir` (and says from which step); without, writes a checkpoint into `dir` after (when not "").
// With `graphs`, each step goes through the strategy's step graphs, with a GraphStandIn.
std::vector<RunResult> RunLayout(const JobConfig& job, int world, const std::string& dir = "",
                                 int64_t* resumed_step = nullptr, int steps = kSteps,
                                 GraphStandIn* graphs = nullptr) {
  // oneDNN's matmul primitives share their scratchpad: two ranks in one process must not run them
  // at once (a trainer's ranks are processes of their own). Read at the first matmul.
  ::setenv("TRAINYARD_MATMUL", "blas", 1);
  std::vector<RunResult> results(world);
  // The models are built before the threads: BuildModel seeds torch's global generator.
  std::vector<ParallelDims> dims(world);
  std::vector<std::shared_ptr<LanguageModel>> models(world);
  for (int rank = 0; rank < world; ++rank) {
    auto d = ParallelDims::Make(job, job.model, rank, world, world);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return results;
    dims[rank] = *d;
    ModelOptions options;
    options.materialize = !d->from_rank0 || rank == 0;
    models[rank] = BuildModel(job.model, options, job.train.seed);
  }
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto rank_main = [&](int rank) {
    const ParallelDims& d = dims[rank];
    CommGroups groups;
    if (world == 1) {
      groups.world = MakeLocalCommunicator();
      if (d.fsdp) groups.shard = MakeLocalCommunicator();
    } else {
      auto comm = MakeGlooCommunicator(store, rank, world, "127.0.0.1", std::chrono::seconds(60));
      ASSERT_TRUE(comm.ok()) << comm.status();
      groups.world = *std::move(comm);
      if (d.fsdp) {
        auto shard = MakeSubgroupCommunicator(store, "fsdp-shard-0", rank, world, "127.0.0.1",
                                              std::chrono::seconds(60));
        ASSERT_TRUE(shard.ok()) << shard.status();
        groups.shard = *std::move(shard);
      }
    }
    LanguageModel& model = *models[rank];
    StrategyInputs in;
    in.model = &model;
    in.dims = &d;
    in.groups = &groups;
    in.train = &job.train;
    in.parallel = &job.parallel;
    in.hyper = HyperFor(job.train);
    in.checkpoint_dir = resumed_step != nullptr ? dir : "";
    in.log = &Log;
    Resumed resumed;
    auto made = MakeStrategy(in, &resumed);
    ASSERT_TRUE(made.ok()) << made.status();
    ParallelStrategy& strategy = **made;
    if (resumed_step != nullptr && rank == 0) *resumed_step = resumed.step;
    const StepGraphs* step_graphs = nullptr;
    if (graphs != nullptr) {
      ASSERT_EQ(strategy.StepGraphBlocker(), "");
      GraphCapture stand_in = [graphs](const std::function<void()>& body) {
        ++graphs->captures;
        return absl::StatusOr<GraphReplay>(body);
      };
      auto owned = std::make_unique<StepGraphs>(stand_in, &Log, graphs->warmup_steps);
      step_graphs = owned.get();
      strategy.UseStepGraphs(std::move(owned));
    }
    const int count = strategy.micro_batches();
    for (int64_t step = resumed.step; step < resumed.step + steps; ++step) {
      const torch::Tensor batch = GlobalBatch(step, job.model);
      StepWork work;
      work.step = step;
      work.micro.count = count;
      // The replica's share of the global batch, in micro-batches of kMicroBatch windows.
      work.micro.windows = [&](int i) {
        return batch.narrow(0, (strategy.replica() * count + i) * kMicroBatch, kMicroBatch);
      };
      work.micro.loss = [&](int, const torch::Tensor& w) { return model.Loss(w) / count; };
      work.micro.loss_of = [&](int, const torch::Tensor& logits, const torch::Tensor& w) {
        return model.LossOf(logits, w) / count;
      };
      StepResult r;
      const double lr = StepLr(job, step);
      if (strategy.GraphedStep(work, lr, r)) {
        ASSERT_TRUE(r.grad_norm_device.defined());
        results[rank].grad_norms.push_back(r.grad_norm_device.item<double>());
        continue;
      }
      strategy.ForwardBackward(work, r);
      ASSERT_TRUE(strategy.ComputeGradNorm(r).ok());
      results[rank].grad_norms.push_back(r.grad_norm);
      const double clip = job.train.grad_clip;
      ASSERT_TRUE(strategy
                      .OptimizerStep(
                          lr, clip > 0 && r.grad_norm > clip ? clip / (r.grad_norm + 1e-6) : 1.0, r)
                      .ok());
    }
    if (graphs != nullptr) graphs->replays = step_graphs->replays();
    if (!dir.empty() && resumed_step == nullptr) {
      auto saved = strategy.Save(dir, resumed.step + steps, {"", std::nullopt}, {});
      ASSERT_TRUE(saved.ok()) << saved.status();
      if (rank == 0) {
        ASSERT_TRUE(saved->has_value());
        EXPECT_EQ((*saved)->info.step, resumed.step + steps);
      }
    }
    ASSERT_TRUE(strategy.GatherModel().ok());
    results[rank].holds_whole = strategy.HoldsWholeModel();
    if (!results[rank].holds_whole) return;  // (a pipeline's other stages are freed here)
    for (const auto& item : model.named_parameters()) {
      results[rank].params[item.key()] = item.value().detach().clone();
    }
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) threads.emplace_back(rank_main, rank);
  for (auto& t : threads) t.join();
  return results;
}

void ExpectSameModel(const RunResult& got, const RunResult& want, const std::string& what) {
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (const auto& [name, p] : want.params) {
    const torch::Tensor& q = got.params.at(name);
    EXPECT_TRUE(q.allclose(p, 1e-4, 1e-5))
        << what << ": " << name << " differs by " << (q - p).abs().max().item<float>();
  }
}

void ExpectSameNorms(const RunResult& got, const RunResult& want, const std::string& what) {
  ASSERT_EQ(got.grad_norms.size(), want.grad_norms.size()) << what;
  for (size_t i = 0; i < want.grad_norms.size(); ++i) {
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], 1e-4 * want.grad_norms[i]) << what << i;
  }
}

TEST(StrategyTest, EachLayoutOnTwoRanksStepsAsOneRankOverTheSameGlobalBatch) {
  const std::vector<RunResult> one = RunLayout(Job("ddp", 1), 1);
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(one[0].grad_norms.size(), size_t{kSteps});
  EXPECT_GT(one[0].grad_norms[0], 0);
  for (const std::string layout : {"ddp", "fsdp", "pipeline"}) {
    const std::vector<RunResult> two = RunLayout(Job(layout, 2), 2);
    ASSERT_EQ(two.size(), 2u);
    for (int rank = 0; rank < 2; ++rank) {
      const std::string what = layout + " rank " + std::to_string(rank);
      ExpectSameNorms(two[rank], one[0], what);
      // A pipeline's rank 0 gathers the stages; its other ranks hold their own stage only.
      EXPECT_EQ(two[rank].holds_whole, layout != "pipeline" || rank == 0) << what;
      if (two[rank].holds_whole) ExpectSameModel(two[rank], one[0], what);
    }
  }
}

TEST(StrategyTest, EachLayoutResumesFromTheCheckpointItWrites) {
  for (const std::string layout : {"ddp", "fsdp", "pipeline"}) {
    testing::TempDir tmp;
    const std::string dir = tmp.path() + "/checkpoints";
    const JobConfig job = Job(layout, 2);
    // kSteps steps and a checkpoint, then kSteps more from it.
    RunLayout(job, 2, dir);
    ASSERT_TRUE(std::filesystem::exists(dir + "/step-" + std::to_string(kSteps) + "/meta.json"))
        << layout;
    int64_t resumed_step = -1;
    const std::vector<RunResult> resumed = RunLayout(job, 2, dir, &resumed_step);
    EXPECT_EQ(resumed_step, kSteps) << layout;
    // Against one rank's DDP steps over the same global batches, straight through.
    const std::vector<RunResult> straight = RunLayout(Job("ddp", 1), 1, "", nullptr, 2 * kSteps);
    ExpectSameModel(resumed[0], straight[0], layout + " resumed");
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_NEAR(resumed[0].grad_norms[i], straight[0].grad_norms[kSteps + i],
                  1e-4 * straight[0].grad_norms[kSteps + i])
          << layout << " resumed step " << kSteps + i;
    }
  }
}

// A one-rank DDP step through CUDA graphs' bookkeeping (GraphStandIn): after its warm-up steps the
// step is captured once and replayed, and each replay updates the model as the eager step does,
// with that step's windows, learning rate and AdamW step count (bias correction), clipping
// included; a checkpoint written after replays resumes the eager run's way.
TEST(StrategyTest, TheStepThroughAGraphUpdatesAsTheEagerStep) {
  JobConfig job = Job("ddp", 1);
  job.train.grad_clip = 0.05;  // (small enough to clip: the divisor is the graph's)
  const int steps = 6;
  const std::vector<RunResult> eager = RunLayout(job, 1, "", nullptr, steps);
  testing::TempDir tmp;
  const std::string dir = tmp.path() + "/checkpoints";
  GraphStandIn graphs;
  graphs.warmup_steps = 2;
  const std::vector<RunResult> graphed = RunLayout(job, 1, dir, nullptr, steps, &graphs);
  EXPECT_EQ(graphs.captures, 1);
  EXPECT_EQ(graphs.replays, steps - graphs.warmup_steps);
  ASSERT_EQ(graphed.size(), 1u);
  ExpectSameNorms(graphed[0], eager[0], "graphed");
  ExpectSameModel(graphed[0], eager[0], "graphed");
  EXPECT_GT(eager[0].grad_norms.back(), job.train.grad_clip);  // the clipping was used

  // The replays' checkpoint (its AdamW step counts are the host's) resumes as the eager run goes
  // on: 2 more steps from it against 8 straight.
  int64_t resumed_step = -1;
  const std::vector<RunResult> resumed = RunLayout(job, 1, dir, &resumed_step, 2);
  EXPECT_EQ(resumed_step, steps);
  const std::vector<RunResult> straight = RunLayout(job, 1, "", nullptr, steps + 2);
  ExpectSameModel(resumed[0], straight[0], "resumed after replays");
}

// What keeps one rank's DDP step from a CUDA graph, as the strategy says it: nothing with AdamW;
// another optimizer; AdamW in per-parameter groups (train.no_weight_decay); FSDP's layout.
TEST(StrategyTest, SaysWhyItsStepCannotBeAGraph) {
  auto blocker = [](const JobConfig& job) -> std::string {
    auto dims = ParallelDims::Make(job, job.model, 0, 1, 1);
    EXPECT_TRUE(dims.ok()) << dims.status();
    if (!dims.ok()) return "";
    auto model = BuildModel(job.model, ModelOptions(), job.train.seed);
    CommGroups groups;
    groups.world = MakeLocalCommunicator();
    if (dims->fsdp) groups.shard = MakeLocalCommunicator();
    StrategyInputs in;
    in.model = model.get();
    in.dims = &*dims;
    in.groups = &groups;
    in.train = &job.train;
    in.parallel = &job.parallel;
    in.hyper = HyperFor(job.train);
    in.log = &Log;
    Resumed resumed;
    auto made = MakeStrategy(in, &resumed);
    EXPECT_TRUE(made.ok()) << made.status();
    return made.ok() ? (*made)->StepGraphBlocker() : "";
  };
  const JobConfig job = Job("ddp", 1);
  EXPECT_EQ(blocker(job), "");
  JobConfig lion = job;
  lion.train.optimizer = OptimizerKind::kLion;
  EXPECT_EQ(blocker(lion), "train.optimizer lion is not AdamW");
  JobConfig groups = job;
  groups.train.no_weight_decay = {"bias"};
  EXPECT_THAT(blocker(groups), ::testing::HasSubstr("train.no_weight_decay"));
  EXPECT_THAT(blocker(Job("fsdp", 1)), ::testing::HasSubstr("FSDP gathers and frees its shards"));
}

// Offload's strategy needs parameter servers (OffloadE2eTest runs it against real ones); what it
// is given is checked before any rendezvous.
TEST(StrategyTest, AnOffloadJobWithoutParameterServerRangesFailsBeforeItsRendezvous) {
  JobConfig job = Job("ddp", 1);
  job.parallel.strategy = Strategy::kOffload;
  auto dims = ParallelDims::Make(job, job.model, 0, 1, 1);
  ASSERT_TRUE(dims.ok()) << dims.status();
  auto none = OffloadRanges(*dims, "");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(none.status().message()), ::testing::StartsWith("parallel.strategy:"));
  auto ranges = OffloadRanges(*dims, "127.0.0.1:7000=0:100,127.0.0.1:7001=100:200");
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  EXPECT_EQ(ranges->size(), 2u);
  // Another layout takes none, whatever the flag says.
  auto ddp = ParallelDims::Make(Job("ddp", 1), job.model, 0, 1, 1);
  ASSERT_TRUE(ddp.ok());
  auto unused = OffloadRanges(*ddp, "");
  ASSERT_TRUE(unused.ok());
  EXPECT_TRUE(unused->empty());
}

}  // namespace
}  // namespace trainyard::trainer
