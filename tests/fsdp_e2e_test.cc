// The trainer's FSDP layout end to end (tests/testing/trainer_e2e.h): every sharding strategy
// against one DDP rank, its peak model state, HYBRID_SHARD, sharded checkpoints resumed at the
// same and other world sizes.
#include "tests/testing/trainer_e2e.h"

namespace trainyard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using trainer::DumpedParam;

class FsdpEquivalenceTest : public TrainerE2eTest,
                            public ::testing::WithParamInterface<FsdpVariant> {};

// N FSDP ranks with micro-batch 8/N each train what one DDP rank with micro-batch 8 trains.
TEST_P(FsdpEquivalenceTest, MatchesOneDdpRankWithTheWholeBatch) {
  const FsdpVariant& v = GetParam();
  v1::JobSpec reference = FsdpSpec(v, 1, 8);
  reference.mutable_parallel()->set_strategy(v1::DDP);
  const Job fsdp = StartJob(FsdpSpec(v, v.world, 8 / v.world), "fsdp");
  const Job ddp = StartJob(reference, "ddp");
  const std::string fsdp_dump = dir_.path() + "/fsdp.params";
  const std::string ddp_dump = dir_.path() + "/ddp.params";
  std::vector<std::string> every_rank;
  if (v.local_world > 0) every_rank = {"--local-world-size", std::to_string(v.local_world)};

  RunResult rf = Run(fsdp, v.world, {"--dump-params", fsdp_dump}, every_rank);
  EXPECT_THAT(rf.exit_codes, ::testing::Each(0)) << Joined(rf);
  EXPECT_THAT(Joined(rf), HasSubstr("step 10/10"));
  if (v.sharding != v1::NO_SHARD) {
    EXPECT_THAT(Joined(rf),
                HasSubstr(absl::StrCat("fsdp ", v1::ShardingStrategy_Name(v.sharding))));
  }
  RunResult rd = Run(ddp, 1, {"--dump-params", ddp_dump});
  EXPECT_THAT(rd.exit_codes, ::testing::ElementsAre(0)) << Joined(rd);

  // 8-bit moments are quantized: a gradient that differs by a rounding (summed in another order
  // on other ranks) may land on the next code, a difference within the quantization's
  // resolution; and under FSDP the blocks are the rank's shard's, as bitsandbytes' under PyTorch
  // FSDP, which sees flat shards.
  const double tolerance = v.optimizer == v1::ADAMW_8BIT ? 1e-3 : 1e-5;
  ExpectSameParams(ReadDump(fsdp_dump), ReadDump(ddp_dump), tolerance, /*skip_key_bias=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FsdpEquivalenceTest,
    ::testing::Values(
        FsdpVariant{"FullShard", v1::FULL_SHARD, v1::NO_PREFETCH, false},
        FsdpVariant{"FullShardPrefetch", v1::FULL_SHARD, v1::BACKWARD_PRE, true},
        FsdpVariant{"FullShardBackwardPost", v1::FULL_SHARD, v1::BACKWARD_POST, false},
        FsdpVariant{"ShardGradOp", v1::SHARD_GRAD_OP, v1::NO_PREFETCH, false},
        FsdpVariant{"ShardGradOpPrefetch", v1::SHARD_GRAD_OP, v1::BACKWARD_PRE, true},
        FsdpVariant{"NoShard", v1::NO_SHARD, v1::BACKWARD_PRE, false},
        FsdpVariant{"HybridShard2x2", v1::HYBRID_SHARD, v1::NO_PREFETCH, false, 4, 2},
        FsdpVariant{"HybridShard2x2Prefetch", v1::HYBRID_SHARD, v1::BACKWARD_PRE, true, 4, 2},
        FsdpVariant{"HybridShardOneRankPerNode", v1::HYBRID_SHARD, v1::BACKWARD_PRE, false, 2, 1},
        FsdpVariant{"HybridShardOneRankPerNodeAccum", v1::HYBRID_SHARD, v1::BACKWARD_PRE, false, 2,
                    1, 3},
        FsdpVariant{"FullShardAccumCheckpointTied", v1::FULL_SHARD, v1::BACKWARD_PRE, true, 2, 0, 2,
                    true, true},
        FsdpVariant{"SizeBasedWrapEveryRankBuilds", v1::FULL_SHARD, v1::BACKWARD_PRE, false, 2, 0,
                    1, false, false, v1::SIZE_BASED_WRAP, 20000, false},
        FsdpVariant{"MlpFullShardPrefetch", v1::FULL_SHARD, v1::BACKWARD_PRE, true, 2, 0, 1, false,
                    false, v1::TRANSFORMER_BASED_WRAP, 0, true, "mlp"},
        FsdpVariant{"LlamaFullShardPrefetch", v1::FULL_SHARD, v1::BACKWARD_PRE, true, 2, 0, 1,
                    false, false, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama"},
        FsdpVariant{"LlamaShardGradOpAccumCheckpointTied", v1::SHARD_GRAD_OP, v1::BACKWARD_PRE,
                    false, 2, 0, 2, true, true, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama"},
        FsdpVariant{"LlamaNoShard", v1::NO_SHARD, v1::BACKWARD_PRE, false, 2, 0, 1, false, false,
                    v1::TRANSFORMER_BASED_WRAP, 0, true, "llama"},
        // LoRA: the frozen base in flat buffers of its own, gathered but never reduced.
        FsdpVariant{"LoraFullShardPrefetch", v1::FULL_SHARD, v1::BACKWARD_PRE, true, 2, 0, 1, false,
                    false, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama", true},
        FsdpVariant{"LoraFullShardBackwardPostEveryRankBuilds", v1::FULL_SHARD, v1::BACKWARD_POST,
                    false, 2, 0, 1, false, false, v1::TRANSFORMER_BASED_WRAP, 0, false, "llama",
                    true},
        FsdpVariant{"LoraShardGradOpAccumCheckpointTied", v1::SHARD_GRAD_OP, v1::BACKWARD_PRE,
                    false, 2, 0, 2, true, true, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama", true},
        FsdpVariant{"LoraHybridShard2x2", v1::HYBRID_SHARD, v1::BACKWARD_PRE, false, 4, 2, 1, false,
                    false, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama", true},
        FsdpVariant{"LoraHybridShardOneRankPerNodeAccum", v1::HYBRID_SHARD, v1::BACKWARD_PRE, false,
                    2, 1, 3, false, false, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama", true},
        FsdpVariant{"LoraNoShardIsDdpAccumCheckpoint", v1::NO_SHARD, v1::BACKWARD_PRE, false, 2, 0,
                    2, true, false, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama", true},
        // Lion's moment is elementwise; Adafactor's factors are summed over the shard group.
        // Adafactor on llama only: GPT's key bias gets rounding noise for a gradient (see
        // ExpectSameParams), which Adafactor normalizes into lr-sized steps, and its RMS clip of
        // the whole qkv bias carries that noise into the query and value thirds.
        WithOptimizer({"", v1::FULL_SHARD, v1::BACKWARD_PRE, true}, "LionFullShardPrefetch",
                      v1::LION),
        WithOptimizer({"", v1::FULL_SHARD, v1::BACKWARD_PRE, true, 2, 0, 1, false, false,
                       v1::TRANSFORMER_BASED_WRAP, 0, true, "llama"},
                      "AdafactorLlamaFullShardPrefetch", v1::ADAFACTOR),
        WithOptimizer({"", v1::HYBRID_SHARD, v1::BACKWARD_PRE, false, 4, 2, 1, false, false,
                       v1::TRANSFORMER_BASED_WRAP, 0, true, "llama"},
                      "AdafactorLlamaHybridShard2x2", v1::ADAFACTOR),
        WithOptimizer({"", v1::SHARD_GRAD_OP, v1::BACKWARD_PRE, false, 2, 0, 2, true, true,
                       v1::TRANSFORMER_BASED_WRAP, 0, true, "llama", true},
                      "AdafactorLoraShardGradOpAccumCheckpointTied", v1::ADAFACTOR),
        WithOptimizer({"", v1::NO_SHARD, v1::BACKWARD_PRE, false}, "AdamW8bitNoShardIsDdp",
                      v1::ADAMW_8BIT),
        WithOptimizer({"", v1::FULL_SHARD, v1::BACKWARD_PRE, true}, "AdamW8bitFullShardPrefetch",
                      v1::ADAMW_8BIT)),
    [](const auto& info) { return info.param.name; });

// The model-state bytes FULL_SHARD keeps on a rank: its shards (parameters, gradients, AdamW's two
// moments) plus the largest working set gathered at once, which without prefetch is the root unit
// (kept from forward to the end of backward) and one block, each with its parameters and, during
// backward, its unsharded gradient. A test of the tracker's figure against that count, and against
// DDP's whole model state.
// The model of the memory tests: 6 blocks of d_model 64, tied head; 3 steps of micro-batch 4.
v1::JobSpec MemorySpec(const FsdpVariant& v) {
  v1::JobSpec spec = FsdpSpec(v, 2, 4);
  spec.mutable_model()->set_n_layer(6);
  spec.mutable_model()->set_d_model(64);
  spec.mutable_model()->set_n_head(4);
  spec.mutable_model()->set_tie_weights(true);
  spec.mutable_train()->set_steps(3);
  return spec;
}

TEST_F(TrainerE2eTest, FsdpPeakModelStateIsTheShardsPlusOneGatheredUnit) {
  v1::JobSpec spec = MemorySpec({"memory", v1::FULL_SHARD, v1::NO_PREFETCH, false});
  const Job job = StartJob(spec, "memory");
  const std::string metrics = dir_.path() + "/memory.jsonl";
  RunResult r = Run(job, 2, {"--metrics-file", metrics});
  ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(r);

  const int64_t d = 64, w = 2;
  auto padded = [w](int64_t n) { return (n + w - 1) / w * w; };
  const int64_t root = padded(256 * d + 16 * d + 2 * d);  // tok_emb (tied head), pos_emb, ln_f
  const int64_t block = padded(12 * d * d + 13 * d);
  const int64_t params = root + 6 * block;
  const int64_t shards = 16 * params / w;
  const int64_t expected = shards + 8 * root + 8 * block;
  int64_t peak = 0;
  for (const auto& report : ReadReports(metrics)) {
    peak = std::max(peak, report.at("model_state_peak_bytes").get<int64_t>());
  }
  std::cout << "FSDP FULL_SHARD peak model state " << peak << " bytes, expected " << expected
            << " (shards " << shards << " + root and one block unit, parameters and gradients "
            << 8 * (root + block) << "); DDP " << 16 * params << "\n";
  EXPECT_NEAR(static_cast<double>(peak), static_cast<double>(expected), 0.1 * expected)
      << "shards " << shards << ", root unit " << 4 * root << ", block unit " << 4 * block;
  EXPECT_LT(peak, 16 * params * 3 / 4) << "well below DDP's whole model state";
}

// LoRA's saving in the model state `yard metrics` shows (model_state_peak_bytes): under
// FULL_SHARD a rank holds its shard of the frozen base as weights only (4 bytes each, no gradient,
// no AdamW moments) and 16 bytes per adapter parameter of its shard, plus what is gathered; a
// full fine-tune of the same llama holds 16 bytes per parameter of its shard. Under DDP the figure
// reported is the count of what the rank holds: 4 bytes per parameter, 12 more per trained one
// (the adapters only: a frozen parameter counted as trained would show here).
TEST_F(TrainerE2eTest, LoraPeakModelStateHoldsTheFrozenBaseAsWeightsOnly) {
  auto spec_of = [](bool lora, v1::Strategy strategy) {
    v1::JobSpec s = LlamaSpec(2, 4);
    auto* m = s.mutable_model();
    m->set_n_layer(6);
    m->set_d_model(64);
    m->set_n_head(4);
    m->set_n_kv_head(4);
    m->set_d_hidden(192);
    m->set_tie_weights(true);
    s.mutable_train()->set_steps(3);
    s.mutable_parallel()->set_strategy(strategy);
    s.mutable_parallel()->set_sharding_strategy(v1::FULL_SHARD);
    s.mutable_parallel()->set_backward_prefetch(v1::NO_PREFETCH);
    if (lora) {
      s.mutable_train()->mutable_lora()->set_r(4);
      s.mutable_train()->mutable_lora()->set_alpha(8);
      for (const std::string& t : LoraTargetNames()) {
        s.mutable_train()->mutable_lora()->add_target_modules(t);
      }
    }
    return s;
  };
  auto peak_of = [&](const v1::JobSpec& spec, const std::string& name) {
    const std::string metrics = dir_.path() + "/" + name + ".jsonl";
    RunResult r = Run(StartJob(spec, name), 2, {"--metrics-file", metrics});
    EXPECT_THAT(r.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(r);
    int64_t peak = 0;
    for (const auto& report : ReadReports(metrics)) {
      peak = std::max(peak, report.at("model_state_peak_bytes").get<int64_t>());
    }
    return peak;
  };
  const int64_t d = 64, w = 2;
  auto padded = [w](int64_t n) { return (n + w - 1) / w * w; };
  const int64_t root = padded(256 * d + d);                       // embedding (tied head), norm
  const int64_t block = padded(2 * d + 4 * d * d + 3 * d * 192);  // norms, attention, MLP
  const int64_t adapters = padded(4 * (4 * 2 * d) + 4 * 2 * (d + 192) + 4 * (192 + d));
  const int64_t base = root + 6 * block;
  const int64_t shards = 4 * base / w + 16 * 6 * adapters / w;
  // The root stays gathered; one block unit (base and adapters, and the adapters' unsharded
  // gradient) at the least, two at the most (the next is gathered by the hook on the gradient of
  // this one's input, which also frees this one).
  const int64_t low = shards + 4 * root + 4 * (block + 2 * adapters);
  const int64_t high = shards + 4 * root + 2 * 4 * (block + 2 * adapters);

  const int64_t lora = peak_of(spec_of(true, v1::FSDP), "lora-fsdp");
  const int64_t full = peak_of(spec_of(false, v1::FSDP), "full-fsdp");
  std::cout << "FULL_SHARD peak model state: LoRA " << lora << " bytes (expected " << low << ".."
            << high << "), full fine-tune " << full << "\n";
  EXPECT_GE(lora, low);
  EXPECT_LE(lora, high);
  EXPECT_LT(lora, full / 2);

  const int64_t ddp = peak_of(spec_of(true, v1::DDP), "lora-ddp");
  EXPECT_EQ(ddp, 4 * (256 * d + d + 6 * (2 * d + 4 * d * d + 3 * d * 192)) +
                     16 * 6 * (4 * (4 * 2 * d) + 4 * 2 * (d + 192) + 4 * (192 + d)));
}

// HYBRID_SHARD with one rank per node shards over a group of one: nothing is gathered and the
// gradients accumulate in place, so a rank holds exactly DDP's model state and no more.
TEST_F(TrainerE2eTest, HybridShardWithOneRankPerNodeHoldsWhatDdpHolds) {
  const Job job =
      StartJob(MemorySpec({"hybrid-memory", v1::HYBRID_SHARD, v1::BACKWARD_PRE, true, 2, 1, 2}),
               "hybrid-memory");
  const std::string metrics = dir_.path() + "/hybrid-memory.jsonl";
  RunResult r = Run(job, 2, {"--metrics-file", metrics}, {"--local-world-size", "1"});
  ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(r);
  EXPECT_THAT(Joined(r), HasSubstr("fsdp HYBRID_SHARD: 7 units, shard group 1"));

  const int64_t d = 64;
  const int64_t params = (256 * d + 16 * d + 2 * d) + 6 * (12 * d * d + 13 * d);
  int64_t peak = 0;
  for (const auto& report : ReadReports(metrics)) {
    peak = std::max(peak, report.at("model_state_peak_bytes").get<int64_t>());
    // One ring all-reduce of the gradients per step, none on the accumulation micro-step:
    // 2 (n - 1) / n of the 4-byte gradients with n = 2.
    EXPECT_EQ(report.at("comm_bytes").get<int64_t>(), 4 * params) << report;
  }
  EXPECT_EQ(peak, 16 * params) << "DDP's parameters, gradients and Adam moments";
}

// FSDP sharded checkpoints: 20 steps straight equal 10 steps, a sharded checkpoint and 10 more in
// new processes; the same checkpoint also resumes on another world size (reshard on load) and,
// consolidated, as a DDP job.
class FsdpCheckpointTest : public TrainerE2eTest,
                           public ::testing::WithParamInterface<FsdpVariant> {};

// Sharded checkpoints resume exactly on the same and another world size, and consolidate into a
// DDP checkpoint; with LoRA, whose checkpoint holds frozen flat buffers without moments and whose
// DDP optimizer covers only the adapters, too.
TEST_P(FsdpCheckpointTest, ShardedCheckpointResumesSameAndOtherWorldSizes) {
  const FsdpVariant& v = GetParam();
  v1::JobSpec spec = FsdpSpec(v, 2, 4);
  spec.mutable_train()->set_steps(20);
  const Job straight = StartJob(spec, "straight");
  const Job split = StartJob(spec, "split");
  const std::string straight_metrics = dir_.path() + "/straight.jsonl";
  const std::string split_metrics = dir_.path() + "/split.jsonl";

  RunResult a = Run(straight, 2, {"--metrics-file", straight_metrics});
  ASSERT_THAT(a.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(a);
  RunResult b1 = Run(split, 2, {"--metrics-file", split_metrics}, {"--stop-after-steps", "10"});
  ASSERT_THAT(b1.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(b1);
  EXPECT_THAT(Joined(b1), HasSubstr("checkpoint step 10"));
  const std::string step10 = split.checkpoint_dir + "/step-10";
  EXPECT_TRUE(std::filesystem::exists(step10 + "/shard-0-of-2.pt"));
  EXPECT_TRUE(std::filesystem::exists(step10 + "/shard-1-of-2.pt"));
  EXPECT_TRUE(std::filesystem::exists(step10 + "/manifest.json"));
  // Copies of the step-10 checkpoint for the other two resumptions.
  const std::string reshard_dir = dir_.path() + "/reshard-ckpt";
  std::filesystem::create_directories(reshard_dir);
  std::filesystem::copy(step10, reshard_dir + "/step-10");
  std::filesystem::copy(split.checkpoint_dir + "/latest", reshard_dir + "/latest");

  // The next attempt (a new rendezvous scope: a job's attempt builds its Gloo groups once).
  Job resumed = StartJob(spec, "resumed");
  resumed.checkpoint_dir = split.checkpoint_dir;
  RunResult b2 = Run(resumed, 2, {"--metrics-file", split_metrics});
  ASSERT_THAT(b2.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(b2);
  EXPECT_THAT(Joined(b2), HasSubstr("resumed from"));
  const auto expected = ReadLosses(straight_metrics), got = ReadLosses(split_metrics);
  ASSERT_EQ(expected.size(), 20u);
  ASSERT_EQ(got.size(), 20u);
  for (const auto& [step, loss] : expected) EXPECT_NEAR(got.at(step), loss, 1e-6) << step;

  // Reshard on load: one FSDP rank with the whole batch resumes the two-rank checkpoint.
  v1::JobSpec one_spec = FsdpSpec(v, 1, 8);
  one_spec.mutable_train()->set_steps(20);
  const Job one = StartJob(one_spec, "one");
  Job resharded = one;
  resharded.checkpoint_dir = reshard_dir;
  const std::string one_metrics = dir_.path() + "/one.jsonl";
  RunResult c = Run(resharded, 1, {"--metrics-file", one_metrics});
  ASSERT_THAT(c.exit_codes, ::testing::ElementsAre(0)) << Joined(c);
  EXPECT_THAT(Joined(c), HasSubstr("resumed from"));
  // 8-bit moments live in blocks of each rank's shard: another shard count quantizes them again
  // in other blocks, which changes the moments within the quantization's resolution.
  const double other_layout = v.optimizer == v1::ADAMW_8BIT ? 1e-3 : 1e-5;
  const auto one_losses = ReadLosses(one_metrics);
  ASSERT_EQ(one_losses.size(), 10u);
  for (const auto& [step, loss] : one_losses) {
    EXPECT_NEAR(loss, expected.at(step), other_layout) << step;
  }

  // Consolidated into a DDP checkpoint, it resumes a DDP job.
  const std::string consolidated = dir_.path() + "/consolidated";
  testing::CommandResult k =
      testing::RunCommand({testing::BinPath("trainyard-trainer"), "--consolidate-checkpoint",
                           step10, "--out", consolidated},
                          {}, absl::Seconds(60));
  ASSERT_EQ(k.exit_code, 0) << k.out << k.err;
  // It records the settings the sharded one does, so a resume under others is refused.
  auto settings_of = [](const std::string& path) {
    std::ifstream in(path + "/meta.json");
    const nlohmann::json meta = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    return meta.is_object() && meta.contains("settings") ? meta.at("settings").dump() : "";
  };
  EXPECT_THAT(settings_of(step10), HasSubstr("\"lr\""));
  EXPECT_EQ(settings_of(consolidated + "/step-10"), settings_of(step10));
  v1::JobSpec ddp_spec = one_spec;
  ddp_spec.mutable_parallel()->set_strategy(v1::DDP);
  Job ddp = StartJob(ddp_spec, "ddp");
  ddp.checkpoint_dir = consolidated;
  {  // The same job (its credential) with another learning rate.
    v1::JobSpec other_spec = ddp_spec;
    other_spec.mutable_train()->set_lr(ddp_spec.train().lr() * 2);
    Job other = ddp;
    other.spec_path = dir_.path() + "/other.spec";
    std::ofstream(other.spec_path, std::ios::binary) << other_spec.SerializeAsString();
    const testing::CommandResult refused =
        testing::RunCommand(Argv(other, 0, 1, {}), {}, absl::Seconds(60));
    EXPECT_NE(refused.exit_code, 0);
    EXPECT_THAT(refused.err, HasSubstr("train.lr: the checkpoint " + consolidated + "/step-10"));
  }
  const std::string ddp_metrics = dir_.path() + "/ddp.jsonl";
  RunResult d = Run(ddp, 1, {"--metrics-file", ddp_metrics});
  ASSERT_THAT(d.exit_codes, ::testing::ElementsAre(0)) << Joined(d);
  EXPECT_THAT(Joined(d), HasSubstr("resumed from"));
  const auto ddp_losses = ReadLosses(ddp_metrics);
  ASSERT_EQ(ddp_losses.size(), 10u);
  for (const auto& [step, loss] : ddp_losses) {
    EXPECT_NEAR(loss, expected.at(step), other_layout) << step;
  }

  // A DDP job cannot read the sharded one as it is: it says so and what to do.
  Job wrong = ddp;
  wrong.checkpoint_dir = split.checkpoint_dir;
  testing::CommandResult e = testing::RunCommand(Argv(wrong, 0, 1, {}), {}, absl::Seconds(60));
  EXPECT_EQ(e.exit_code, 1);
  EXPECT_THAT(e.err, HasSubstr("is sharded"));
  EXPECT_THAT(e.err, HasSubstr("--consolidate-checkpoint"));
}

INSTANTIATE_TEST_SUITE_P(
    Models, FsdpCheckpointTest,
    ::testing::Values(FsdpVariant{"Gpt", v1::FULL_SHARD, v1::BACKWARD_PRE, true},
                      FsdpVariant{"LlamaLora", v1::FULL_SHARD, v1::BACKWARD_PRE, true, 2, 0, 1,
                                  false, false, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama", true},
                      WithOptimizer({"", v1::FULL_SHARD, v1::BACKWARD_PRE, true, 2, 0, 1, false,
                                     false, v1::TRANSFORMER_BASED_WRAP, 0, true, "llama"},
                                    "LlamaAdafactor", v1::ADAFACTOR),
                      WithOptimizer({"", v1::FULL_SHARD, v1::BACKWARD_PRE, true}, "GptAdamW8bit",
                                    v1::ADAMW_8BIT)),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace trainyard
