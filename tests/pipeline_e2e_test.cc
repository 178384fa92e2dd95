// The trainer's model parallelism end to end (tests/testing/trainer_e2e.h): pipeline stages and
// tensor parallelism (alone, with replicas, FSDP, LoRA, sequence parallelism) against one rank,
// activation bounds of the schedules, resharding checkpoints, HYBRID_SHARD within stages.
#include "tests/testing/trainer_e2e.h"

namespace trainyard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using trainer::DumpedParam;

// Qwen2 (Llama with q/k/v biases) from its checkpoint: two FSDP ranks and 2 pipeline stages x 2
// tensor-parallel ranks (the biases split with their heads) train what one rank trains, and the
// biases train.
TEST_F(TrainerE2eTest, Qwen2TrainsTheSameUnderFsdpAndPipelineWithTensorParallelAsOnOneRank) {
  const std::string model_dir = dir_.path() + "/qwen2";
  v1::JobSpec spec = LlamaSpec(2, 4);
  spec.mutable_model()->set_n_kv_head(2);
  const auto start = WriteLlamaCheckpoint(model_dir, spec.model(), 5, "", /*qwen2=*/true);
  UseCheckpoint(spec, model_dir);
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_strategy(v1::FSDP);
  const v1::JobSpec one = OneRankWholeBatch(spec);
  auto train = [&](const v1::JobSpec& s, int ranks, const std::string& name) {
    const std::string dump = dir_.path() + "/" + name + ".params";
    RunResult r = Run(StartJob(s, name), ranks, {"--dump-params", dump});
    EXPECT_THAT(r.exit_codes, ::testing::Each(0)) << Joined(r);
    if (name == "one") {
      // 2 layers x 12 tensors, the embedding, the final norm and lm_head.
      EXPECT_THAT(Joined(r), HasSubstr(absl::StrCat("loaded 27 tensors from ", model_dir)));
    }
    return ReadDump(dump);
  };
  const auto single = train(one, 1, "one");
  ExpectSameParams(train(spec, 2, "fsdp"), single, 1e-5, /*skip_key_bias=*/true);
  v1::JobSpec staged = spec;
  staged.mutable_resources()->set_slots(4);
  staged.mutable_train()->set_micro_batch(2);
  staged.mutable_train()->set_micro_batches(4);
  staged.mutable_parallel()->set_strategy(v1::DDP);
  staged.mutable_parallel()->set_pipeline_stages(2);
  staged.mutable_parallel()->set_tensor_parallel(2);
  ExpectSameParams(train(staged, 4, "staged"), single, 1e-5, /*skip_key_bias=*/true);
  // The query and value biases train (the key's true gradient is zero: see ExpectSameParams).
  int biases = 0;
  for (const DumpedParam& p : single) {
    if (!absl::EndsWith(p.name, "q_proj.bias") && !absl::EndsWith(p.name, "v_proj.bias")) continue;
    SCOPED_TRACE(p.name);
    ++biases;
    ASSERT_EQ(start.count(p.name), 1u);
    EXPECT_NE(p.values, start.at(p.name)) << "the bias did not train";
  }
  EXPECT_EQ(biases, 2 * 2);
}

// ---------------------------------------------------------------------------------------------
// Pipeline parallelism

struct PipelineVariant {
  std::string name;
  int stages;
  v1::PipelineSchedule schedule;
  bool activation_checkpointing = false;
  int replicas = 1;
  bool tie_weights = false;
  std::string model = "gpt";
  int micro_batches = 0;  // 0: the default, 2 x stages
  v1::Optimizer optimizer = v1::ADAMW;
  int tensor = 1;         // parallel.tensor_parallel
  bool sequence = false;  // parallel.sequence_parallel
  bool lora = false;      // train.lora on every projection (llama)
  // parallel.strategy fsdp with this sharding over each stage's replicas (unspecified: ddp).
  v1::ShardingStrategy fsdp = v1::SHARDING_STRATEGY_UNSPECIFIED;
  int local_world = 0;  // --local-world-size of every rank (HYBRID_SHARD's nodes); 0: all
};

// `v` with fsdp `sharding` over each part's replicas, named `name`.
PipelineVariant WithFsdp(PipelineVariant v, std::string name,
                         v1::ShardingStrategy sharding = v1::FULL_SHARD) {
  v.name = std::move(name);
  v.fsdp = sharding;
  return v;
}

// `v` with fsdp HYBRID_SHARD on nodes of `local_world` ranks, named `name`.
PipelineVariant WithHybrid(PipelineVariant v, std::string name, int local_world) {
  v = WithFsdp(std::move(v), std::move(name), v1::HYBRID_SHARD);
  v.local_world = local_world;
  return v;
}

// `v` fine-tuning LoRA adapters, named `name`.
PipelineVariant WithLora(PipelineVariant v, std::string name) {
  v.name = std::move(name);
  v.lora = true;
  return v;
}

// `v` with sequence parallelism, named `name`.
PipelineVariant WithSequence(PipelineVariant v, std::string name) {
  v.name = std::move(name);
  v.sequence = true;
  return v;
}

// `v` with `tensor` tensor-parallel ranks, named `name`.
PipelineVariant WithTensor(PipelineVariant v, std::string name, int tensor) {
  v.name = std::move(name);
  v.tensor = tensor;
  return v;
}

void PrintTo(const PipelineVariant& v, std::ostream* os) { *os << v.name; }

// Blocks of 4 (so 4 stages get one each), micro-batches of 2 windows.
v1::JobSpec PipelineSpec(const PipelineVariant& v) {
  v1::JobSpec s = TinySpec(v.stages * v.tensor * v.replicas, 2);
  s.mutable_model()->set_kind(v.model);
  s.mutable_model()->set_n_layer(4);
  if (v.model == "mlp") s.mutable_model()->set_d_hidden(48);
  if (v.model == "llama") {  // grouped-query attention: 4 query heads on fewer key-value heads
    s.mutable_model()->set_n_head(4);
    s.mutable_model()->set_n_kv_head(v.tensor > 1 ? 2 : 1);
  }
  s.mutable_parallel()->set_tensor_parallel(v.tensor);
  s.mutable_parallel()->set_sequence_parallel(v.sequence);
  if (v.lora) {
    auto* lora = s.mutable_train()->mutable_lora();
    lora->set_r(4);
    lora->set_alpha(8);
    for (const std::string& target : LoraTargetNames()) lora->add_target_modules(target);
  }
  s.mutable_model()->set_tie_weights(v.tie_weights);
  s.mutable_train()->set_activation_checkpointing(v.activation_checkpointing);
  s.mutable_train()->set_optimizer(v.optimizer);
  // Without stages (tensor parallelism alone) the micro-batches are gradient accumulation's.
  const int micro_batches = v.micro_batches > 0 ? v.micro_batches : 2 * v.stages;
  if (v.stages > 1) {
    s.mutable_train()->set_micro_batches(micro_batches);
  } else {
    s.mutable_train()->set_grad_accum(micro_batches);
  }
  s.mutable_parallel()->set_pipeline_stages(v.stages);
  s.mutable_parallel()->set_pipeline_schedule(v.schedule);
  if (v.fsdp != v1::SHARDING_STRATEGY_UNSPECIFIED) {
    s.mutable_parallel()->set_strategy(v1::FSDP);
    s.mutable_parallel()->set_sharding_strategy(v.fsdp);
  }
  return s;
}

// The same job on one rank, which accumulates the gradients of the same number of micro-batches
// (each of the replicas' windows together).
v1::JobSpec OneRankOf(const v1::JobSpec& pipelined) {
  v1::JobSpec s = pipelined;
  const int replicas =
      s.resources().slots() / (s.parallel().pipeline_stages() * s.parallel().tensor_parallel());
  s.mutable_resources()->set_slots(1);
  s.mutable_train()->set_micro_batch(s.train().micro_batch() * replicas);
  if (s.parallel().pipeline_stages() > 1)
    s.mutable_train()->set_grad_accum(s.train().micro_batches());
  s.mutable_train()->set_micro_batches(0);
  s.mutable_parallel()->set_pipeline_stages(1);
  s.mutable_parallel()->set_tensor_parallel(1);
  s.mutable_parallel()->set_sequence_parallel(false);
  s.mutable_parallel()->set_strategy(v1::DDP);
  return s;
}

class PipelineEquivalenceTest : public TrainerE2eTest,
                                public ::testing::WithParamInterface<PipelineVariant> {};

// P stages (x D replicas) with m micro-batches train what one rank with the whole batch trains:
// every step's loss within 1e-5, and the parameters after 10 steps.
TEST_P(PipelineEquivalenceTest, LossesAndParametersMatchOneRank) {
  const PipelineVariant& v = GetParam();
  const v1::JobSpec spec = PipelineSpec(v);
  const int world = v.stages * v.tensor * v.replicas;
  // Room for 8 ranks and the reference beside them.
  std::unique_ptr<testing::NodeSession> more;
  if (world >= 8) more = testing::NodeSession::Connect(channel_, tokens_->Node("n2"), "n2", 8);
  const Job pipe = StartJob(spec, "pipe");
  const Job one = StartJob(OneRankOf(spec), "one");
  const std::string pipe_dump = dir_.path() + "/pipe.params",
                    one_dump = dir_.path() + "/one.params";
  const std::string pipe_metrics = dir_.path() + "/pipe.jsonl";
  const std::string one_metrics = dir_.path() + "/one.jsonl";

  std::vector<std::string> every_rank;
  if (v.local_world > 0) every_rank = {"--local-world-size", absl::StrCat(v.local_world)};
  RunResult rp =
      Run(pipe, world, {"--dump-params", pipe_dump, "--metrics-file", pipe_metrics}, every_rank);
  EXPECT_THAT(rp.exit_codes, ::testing::Each(0)) << Joined(rp);
  EXPECT_THAT(Joined(rp), HasSubstr("step 10/10"));
  EXPECT_THAT(Joined(rp), HasSubstr(absl::StrCat("pipeline stage 0/", v.stages)));
  EXPECT_THAT(Joined(rp), HasSubstr(v.schedule == v1::GPIPE ? ", gpipe," : ", 1f1b,"));
  if (v.fsdp != v1::SHARDING_STRATEGY_UNSPECIFIED) {
    EXPECT_THAT(Joined(rp), HasSubstr(absl::StrCat(" replicas (fsdp ",
                                                   v1::ShardingStrategy_Name(v.fsdp), ": ")));
    // HYBRID_SHARD: the replicas on one node.
    const int shard_group = v.local_world > 0 ? v.local_world / (v.stages * v.tensor) : v.replicas;
    EXPECT_THAT(Joined(rp), HasSubstr(absl::StrCat("shard group ", shard_group, ")")));
  }
  RunResult r1 = Run(one, 1, {"--dump-params", one_dump, "--metrics-file", one_metrics});
  EXPECT_THAT(r1.exit_codes, ::testing::ElementsAre(0)) << Joined(r1);

  const auto expected = ReadLosses(one_metrics), got = ReadLosses(pipe_metrics);
  ASSERT_EQ(expected.size(), 10u);
  ASSERT_EQ(got.size(), 10u);
  for (const auto& [step, loss] : expected) EXPECT_NEAR(got.at(step), loss, 1e-5) << step;
  ExpectSameParams(ReadDump(pipe_dump), ReadDump(one_dump), 1e-5, /*skip_key_bias=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PipelineEquivalenceTest,
    ::testing::Values(
        PipelineVariant{"TwoStagesGpipe", 2, v1::GPIPE},
        PipelineVariant{"TwoStages1F1B", 2, v1::ONE_F_ONE_B},
        PipelineVariant{"FourStagesGpipe", 4, v1::GPIPE},
        PipelineVariant{"FourStages1F1B", 4, v1::ONE_F_ONE_B},
        PipelineVariant{"TwoStagesGpipeCheckpointing", 2, v1::GPIPE, true},
        PipelineVariant{"TwoStages1F1BCheckpointing", 2, v1::ONE_F_ONE_B, true},
        PipelineVariant{"FourStagesGpipeCheckpointing", 4, v1::GPIPE, true},
        PipelineVariant{"FourStages1F1BCheckpointing", 4, v1::ONE_F_ONE_B, true},
        // Data parallelism over the stages, and the tied embedding on both ends.
        PipelineVariant{"TwoStagesTwoReplicas1F1BTied", 2, v1::ONE_F_ONE_B, false, 2, true},
        PipelineVariant{"TwoStagesTwoReplicasGpipeCheckpointing", 2, v1::GPIPE, true, 2},
        PipelineVariant{"LlamaTiedFourStages1F1B", 4, v1::ONE_F_ONE_B, false, 1, true, "llama"},
        PipelineVariant{"MlpTwoStagesGpipeThreeMicroBatches", 2, v1::GPIPE, false, 1, false, "mlp",
                        3},
        PipelineVariant{"LionTwoStages1F1B", 2, v1::ONE_F_ONE_B, false, 1, false, "gpt", 0,
                        v1::LION},
        // Tensor parallelism, alone and with stages and replicas.
        WithTensor({"", 1, v1::ONE_F_ONE_B}, "TwoTensorRanks", 2),
        WithTensor({"", 1, v1::ONE_F_ONE_B, true, 1, true}, "TwoTensorRanksTiedCheckpointing", 2),
        WithTensor({"", 1, v1::ONE_F_ONE_B, false, 1, true, "llama"}, "LlamaTwoTensorRanksTied", 2),
        WithTensor({"", 2, v1::GPIPE}, "TwoStagesTwoTensorRanksGpipe", 2),
        WithTensor({"", 2, v1::ONE_F_ONE_B, true}, "TwoStagesTwoTensorRanks1F1BCheckpointing", 2),
        WithTensor({"", 2, v1::ONE_F_ONE_B, false, 2, true},
                   "TwoStagesTwoTensorRanksTwoReplicas1F1BTied", 2),
        WithTensor({"", 2, v1::GPIPE, true, 2},
                   "TwoStagesTwoTensorRanksTwoReplicasGpipeCheckpointing", 2),
        WithTensor({"", 2, v1::GPIPE, false, 2}, "TwoStagesTwoTensorRanksTwoReplicasGpipe", 2),
        WithTensor({"", 2, v1::ONE_F_ONE_B, true, 2},
                   "TwoStagesTwoTensorRanksTwoReplicas1F1BCheckpointing", 2),
        WithTensor({"", 2, v1::ONE_F_ONE_B, false, 1, false, "gpt", 0, v1::LION},
                   "LionTwoStagesTwoTensorRanks", 2),
        // Sequence parallelism.
        WithSequence(WithTensor({"", 1, v1::ONE_F_ONE_B, true, 1, true}, "", 2),
                     "TwoTensorRanksSequenceParallelTiedCheckpointing"),
        WithSequence(WithTensor({"", 1, v1::ONE_F_ONE_B, false, 1, false, "llama"}, "", 2),
                     "LlamaTwoTensorRanksSequenceParallel"),
        WithSequence(WithTensor({"", 2, v1::ONE_F_ONE_B, false, 2}, "", 2),
                     "TwoStagesTwoTensorRanksTwoReplicasSequenceParallel1F1B"),
        // LoRA: the frozen base (and tied embedding) on the stages, only the adapters train.
        WithLora({"", 2, v1::ONE_F_ONE_B, false, 1, true, "llama"}, "LlamaLoraTiedTwoStages1F1B"),
        WithLora({"", 2, v1::GPIPE, true, 2, false, "llama"},
                 "LlamaLoraTwoStagesTwoReplicasGpipeCheckpointing"),
        // FSDP within the stages: each stage's replicas shard it.
        WithFsdp({"", 2, v1::ONE_F_ONE_B, false, 2, true}, "FsdpTwoStagesTwoReplicas1F1BTied"),
        WithFsdp({"", 2, v1::GPIPE, true, 2}, "FsdpTwoStagesTwoReplicasGpipeCheckpointing"),
        WithFsdp({"", 2, v1::GPIPE, false, 2, true}, "ShardGradOpTwoStagesTwoReplicasGpipeTied",
                 v1::SHARD_GRAD_OP),
        // (Adafactor on llama: see the FSDP tests' note on GPT's key bias.)
        WithFsdp({"", 2, v1::ONE_F_ONE_B, false, 2, false, "llama", 0, v1::ADAFACTOR},
                 "FsdpLlamaAdafactorTwoStagesTwoReplicas1F1B"),
        WithFsdp(WithTensor({"", 2, v1::ONE_F_ONE_B, true, 2, true}, "", 2),
                 "FsdpTwoStagesTwoTensorRanksTwoReplicas1F1BTiedCheckpointing"),
        WithFsdp(WithSequence(WithTensor({"", 2, v1::GPIPE, false, 2, false, "llama"}, "", 2), ""),
                 "FsdpLlamaTwoStagesTwoTensorRanksTwoReplicasSequenceParallelGpipe"),
        WithFsdp(WithLora({"", 2, v1::ONE_F_ONE_B, true, 2, true, "llama"}, ""),
                 "FsdpLlamaLoraTiedTwoStagesTwoReplicas1F1BCheckpointing"),
        // HYBRID_SHARD: 2 nodes of 2 replicas each (shards of 2, replicated), and nodes of one
        // replica (nothing sharded, the nodes' gradients all-reduced).
        WithHybrid({"", 2, v1::ONE_F_ONE_B, false, 4, true}, "HybridTwoStagesFourReplicas1F1BTied",
                   4),
        WithHybrid({"", 2, v1::GPIPE, true, 2}, "HybridTwoStagesOneReplicaPerNodeGpipe", 2)),
    [](const auto& info) { return info.param.name; });

// The per-step maxima of a metrics file's `key`.
int64_t MaxOf(const std::vector<nlohmann::json>& reports, const std::string& key) {
  int64_t out = 0;
  for (const auto& r : reports) out = std::max(out, r.at(key).get<int64_t>());
  return out;
}

// 1F1B keeps at most P micro-batches of activations on a stage whatever m is; GPipe keeps all m.
// Measured on stage 0 (rank 0) by the trainer: micro-batches in flight, and the heap's growth
// over the step's start.
TEST_F(TrainerE2eTest, OneFOneBBoundsActivationsByTheStagesWhileGpipeGrowsWithMicroBatches) {
  struct Measured {
    int64_t in_flight, bytes;
  };
  auto measure = [&](v1::PipelineSchedule schedule, int micro_batches) {
    PipelineVariant v{"", 2, schedule};
    v.micro_batches = micro_batches;
    v1::JobSpec spec = PipelineSpec(v);
    spec.mutable_model()->set_d_model(64);
    spec.mutable_model()->set_seq_len(64);
    spec.mutable_train()->set_micro_batch(8);
    spec.mutable_train()->set_steps(3);
    spec.mutable_train()->set_warmup(1);
    const std::string name = absl::StrCat(v1::PipelineSchedule_Name(schedule), micro_batches);
    const Job job = StartJob(spec, name);
    const std::string metrics = dir_.path() + "/" + name + ".jsonl";
    RunResult r = Run(job, 2, {"--metrics-file", metrics});
    EXPECT_THAT(r.exit_codes, ::testing::Each(0)) << Joined(r);
    const auto reports = ReadReports(metrics);
    EXPECT_EQ(reports.size(), 3u);
    return Measured{MaxOf(reports, "pipeline_in_flight_peak"),
                    MaxOf(reports, "pipeline_activation_peak_bytes")};
  };
  const Measured gpipe4 = measure(v1::GPIPE, 4), gpipe8 = measure(v1::GPIPE, 8);
  const Measured f1b4 = measure(v1::ONE_F_ONE_B, 4), f1b8 = measure(v1::ONE_F_ONE_B, 8);
  EXPECT_EQ(gpipe4.in_flight, 4);
  EXPECT_EQ(gpipe8.in_flight, 8);
  EXPECT_EQ(f1b4.in_flight, 2);
  EXPECT_EQ(f1b8.in_flight, 2);
  // One micro-batch's activations on stage 0 (two GPT blocks of 8 x 64 tokens) are a few MB:
  // GPipe's peak doubles with m; 1F1B's stays within P micro-batches' and one backward's
  // temporaries.
  const int64_t per_micro_batch = gpipe8.bytes / 8;
  EXPECT_GT(per_micro_batch, 1'000'000) << per_micro_batch;
  EXPECT_GT(gpipe8.bytes, gpipe4.bytes * 17 / 10) << gpipe8.bytes << " vs " << gpipe4.bytes;
  EXPECT_LT(f1b8.bytes, f1b4.bytes * 5 / 4) << f1b8.bytes << " vs " << f1b4.bytes;
  EXPECT_LE(f1b8.bytes, (2 + 1) * per_micro_batch) << f1b8.bytes << " vs " << gpipe8.bytes;
}

// FSDP within pipeline stages: stage 0 of 2 stages x 2 replicas holds its shards of the stage
// (parameters, gradients and AdamW's moments, 16 bytes a parameter over 2) plus, gathered, its
// root (the embeddings, kept from forward to the end of backward) and one block unit, each with
// its parameters and, during backward, its unsharded gradient; ddp would hold 16 bytes of each.
TEST_F(TrainerE2eTest, FsdpWithinAStageHoldsItsShardsPlusOneGatheredUnit) {
  PipelineVariant v = WithFsdp({"", 2, v1::ONE_F_ONE_B, false, 2, true}, "memory");
  v1::JobSpec spec = PipelineSpec(v);
  spec.mutable_model()->set_n_layer(6);
  spec.mutable_model()->set_d_model(64);
  spec.mutable_model()->set_n_head(4);
  spec.mutable_parallel()->set_forward_prefetch(false);
  spec.mutable_parallel()->set_backward_prefetch(v1::NO_PREFETCH);
  spec.mutable_train()->set_steps(3);
  const Job job = StartJob(spec, "memory");
  const std::string metrics = dir_.path() + "/memory.jsonl";
  RunResult r = Run(job, 4, {"--metrics-file", metrics});
  ASSERT_THAT(r.exit_codes, ::testing::Each(0)) << Joined(r);

  // Stage 0's blocks and parameters, as rank 0 logs them.
  const std::string log = Joined(r);
  std::smatch stage0;
  ASSERT_TRUE(std::regex_search(
      log, stage0, std::regex(R"(pipeline stage 0/2 \(blocks 0\.\.(\d+), (\d+) parameters\))")))
      << log;
  const int last_block = std::stoi(stage0[1]);
  const int64_t held = std::stoll(stage0[2]);
  const int64_t d = 64, w = 2;
  auto padded = [w](int64_t n) { return (n + w - 1) / w * w; };
  const int64_t root = padded(256 * d + 16 * d);  // tok_emb (tied), pos_emb
  const int64_t block = padded(12 * d * d + 13 * d);
  ASSERT_EQ(held, 256 * d + 16 * d + (last_block + 1) * (12 * d * d + 13 * d));
  const int64_t shards = 16 * (root + (last_block + 1) * block) / w;
  const int64_t expected = shards + 8 * root + 8 * block;
  int64_t peak = 0;
  for (const auto& report : ReadReports(metrics)) {
    peak = std::max(peak, report.at("model_state_peak_bytes").get<int64_t>());
  }
  std::cout << "FSDP FULL_SHARD in stage 0 (blocks 0.." << last_block << "): peak model state "
            << peak << " bytes, expected " << expected << "; ddp " << 16 * held << "\n";
  EXPECT_NEAR(static_cast<double>(peak), static_cast<double>(expected), 0.1 * expected);
  EXPECT_LT(peak, 16 * held * 3 / 4) << "well below ddp's stage";
}

class PipelineReshardTest : public TrainerE2eTest,
                            public ::testing::WithParamInterface<PipelineVariant> {};

// A checkpoint of 2 stages x 2 tensor-parallel ranks (or 2 stages x 2 fsdp replicas) resumes on 4
// DDP ranks, whose checkpoint resumes on the first layout again: every step's loss as one
// uninterrupted run's. With AdamW (moments shaped as the parameters), Lion (a flat moment) and,
// under fsdp, Adafactor (factors).
TEST_P(PipelineReshardTest, CheckpointsReshardToDdpAndBack) {
  // Room for the four 4-rank jobs (a job's attempt builds its Gloo groups once).
  auto more = testing::NodeSession::Connect(channel_, tokens_->Node("n2"), "n2", 8);
  const PipelineVariant& v = GetParam();
  v1::JobSpec pipe_spec = PipelineSpec(v);  // 4 micro-batches of 4 windows (of 2 per replica)
  pipe_spec.mutable_train()->set_steps(12);
  pipe_spec.mutable_train()->set_micro_batch(4 / v.replicas);
  v1::JobSpec ddp_spec = pipe_spec;  // 4 ranks, each a quarter of the 16 windows, no pipeline
  ddp_spec.mutable_train()->set_micro_batch(4);
  ddp_spec.mutable_train()->set_micro_batches(0);
  ddp_spec.mutable_parallel()->set_pipeline_stages(1);
  ddp_spec.mutable_parallel()->set_tensor_parallel(1);
  ddp_spec.mutable_parallel()->set_strategy(v1::DDP);

  const Job straight = StartJob(pipe_spec, "straight");
  const std::string straight_metrics = dir_.path() + "/straight.jsonl";
  RunResult a = Run(straight, 4, {"--metrics-file", straight_metrics});
  ASSERT_THAT(a.exit_codes, ::testing::Each(0)) << Joined(a);

  const std::string metrics = dir_.path() + "/split.jsonl";
  const Job first = StartJob(pipe_spec, "first");
  RunResult b1 = Run(first, 4, {"--metrics-file", metrics}, {"--stop-after-steps", "4"});
  ASSERT_THAT(b1.exit_codes, ::testing::Each(0)) << Joined(b1);
  EXPECT_THAT(Joined(b1), HasSubstr("checkpoint step 4"));
  EXPECT_TRUE(std::filesystem::exists(first.checkpoint_dir + "/step-4/stage-0.pt"));
  EXPECT_TRUE(std::filesystem::exists(first.checkpoint_dir + "/step-4/stage-1.pt"));

  Job ddp = StartJob(ddp_spec, "ddp");
  ddp.checkpoint_dir = first.checkpoint_dir;
  RunResult b2 = Run(ddp, 4, {"--metrics-file", metrics}, {"--stop-after-steps", "4"});
  ASSERT_THAT(b2.exit_codes, ::testing::Each(0)) << Joined(b2);
  EXPECT_THAT(Joined(b2), HasSubstr("resumed from " + first.checkpoint_dir + "/step-4"));
  EXPECT_TRUE(std::filesystem::exists(first.checkpoint_dir + "/step-8/model.pt"));

  Job back = StartJob(pipe_spec, "back");
  back.checkpoint_dir = first.checkpoint_dir;
  RunResult b3 = Run(back, 4, {"--metrics-file", metrics});
  ASSERT_THAT(b3.exit_codes, ::testing::Each(0)) << Joined(b3);
  EXPECT_THAT(Joined(b3), HasSubstr("resumed from " + first.checkpoint_dir + "/step-8"));

  const auto expected = ReadLosses(straight_metrics), got = ReadLosses(metrics);
  ASSERT_EQ(expected.size(), 12u);
  ASSERT_EQ(got.size(), 12u);
  for (const auto& [step, loss] : expected) EXPECT_NEAR(got.at(step), loss, 1e-5) << step;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PipelineReshardTest,
    ::testing::Values(
        WithTensor({"", 2, v1::ONE_F_ONE_B, false, 1, true}, "TwoStagesTwoTensorRanksAdamW", 2),
        WithTensor({"", 2, v1::ONE_F_ONE_B, false, 1, true, "gpt", 0, v1::LION},
                   "TwoStagesTwoTensorRanksLion", 2),
        WithFsdp({"", 2, v1::ONE_F_ONE_B, false, 2, true}, "FsdpTwoStagesTwoReplicasAdamW"),
        WithFsdp({"", 2, v1::GPIPE, false, 2, false, "llama", 0, v1::ADAFACTOR},
                 "FsdpLlamaTwoStagesTwoReplicasAdafactor")),
    [](const auto& info) { return info.param.name; });

// HYBRID_SHARD within pipeline stages shards each stage over the replicas on one node: a node
// must hold whole replicas.
TEST_F(TrainerE2eTest, HybridShardWithinStagesNeedsWholeReplicasOnANode) {
  v1::JobSpec spec = PipelineSpec(WithHybrid({"", 4, v1::ONE_F_ONE_B, false, 2}, "split", 2));
  const Job job = StartJob(spec, "split");
  testing::CommandResult r =
      testing::RunCommand(Argv(job, 0, 8, {"--local-world-size", "2"}), {}, absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("parallel.sharding_strategy: HYBRID_SHARD shards each part of the "
                               "model over its replicas on one node, so every node needs whole "
                               "replicas of 4 ranks"));
}

TEST_F(TrainerE2eTest, HybridShardOnUnevenNodesFailsFast) {
  FsdpVariant v{"uneven", v1::HYBRID_SHARD, v1::BACKWARD_PRE, false};
  const Job job = StartJob(FsdpSpec(v, 3, 2), "uneven");
  testing::CommandResult r =
      testing::RunCommand(Argv(job, 0, 3, {"--local-world-size", "2"}), {}, absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("HYBRID_SHARD needs the same number of ranks on every node"));
}

}  // namespace
}  // namespace trainyard
