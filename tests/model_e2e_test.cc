// The trainer's models and training options end to end (tests/testing/trainer_e2e.h): Llama from
// a Hugging Face checkpoint, evaluation, keep_best, no_weight_decay, resume settings, LoRA, the
// Hugging Face export, loss masks.
#include "tests/testing/trainer_e2e.h"

namespace trainyard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using trainer::DumpedParam;

// Two FSDP ranks, rank 0 reading the checkpoint and sending the other its shards
// (cpu_ram_efficient_loading), train what one rank trains from the same checkpoint; the sizes
// the spec leaves out come from config.json.
TEST_F(TrainerE2eTest, LlamaFromAHuggingFaceCheckpointTrainsTheSameOnTwoFsdpRanksAsOnOne) {
  const std::string model_dir = dir_.path() + "/hf-model";
  const auto start = WriteLlamaCheckpoint(model_dir, LlamaSpec(1, 8).model(), 5);
  v1::JobSpec spec = LlamaSpec(2, 4);
  auto* m = spec.mutable_model();
  for (auto set :
       {&v1::ModelSpec::set_n_layer, &v1::ModelSpec::set_d_model, &v1::ModelSpec::set_n_head,
        &v1::ModelSpec::set_n_kv_head, &v1::ModelSpec::set_d_hidden, &v1::ModelSpec::set_vocab}) {
    (m->*set)(0);
  }
  UseCheckpoint(spec, model_dir);
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_strategy(v1::FSDP);
  spec.mutable_parallel()->set_cpu_ram_efficient_loading(true);
  const v1::JobSpec one = OneRankWholeBatch(spec);

  const std::string fsdp_dump = dir_.path() + "/fsdp.params",
                    one_dump = dir_.path() + "/one.params";
  RunResult rf = Run(StartJob(spec, "fsdp"), 2, {"--dump-params", fsdp_dump});
  EXPECT_THAT(rf.exit_codes, ::testing::Each(0)) << Joined(rf);
  EXPECT_THAT(Joined(rf), HasSubstr(absl::StrCat("loaded 21 tensors from ", model_dir)));
  RunResult r1 = Run(StartJob(one, "one"), 1, {"--dump-params", one_dump});
  EXPECT_THAT(r1.exit_codes, ::testing::ElementsAre(0)) << Joined(r1);
  const auto fsdp = ReadDump(fsdp_dump), single = ReadDump(one_dump);
  ExpectSameParams(fsdp, single, 1e-5);
  // Two pipeline stages (there is no broadcast: every stage loads the checkpoint itself).
  v1::JobSpec staged = spec;
  staged.mutable_parallel()->set_strategy(v1::DDP);
  staged.mutable_parallel()->set_pipeline_stages(2);
  staged.mutable_train()->set_micro_batches(2);
  const std::string staged_dump = dir_.path() + "/staged.params";
  RunResult rp = Run(StartJob(staged, "staged"), 2, {"--dump-params", staged_dump});
  EXPECT_THAT(rp.exit_codes, ::testing::Each(0)) << Joined(rp);
  ExpectSameParams(ReadDump(staged_dump), single, 1e-5);
  // Trained from the checkpoint: 10 Adam steps of lr 1e-3 move no value by more than 0.05.
  ASSERT_EQ(fsdp.size(), start.size());
  for (const DumpedParam& p : fsdp) {
    SCOPED_TRACE(p.name);
    ASSERT_EQ(start.count(p.name), 1u);
    const std::vector<float>& v = start.at(p.name);
    ASSERT_EQ(p.values.size(), v.size());
    float moved = 0;
    for (size_t i = 0; i < v.size(); ++i) moved = std::max(moved, std::abs(p.values[i] - v[i]));
    EXPECT_LT(moved, 0.05);
    EXPECT_GT(moved, 0);
  }
}

// Evaluation (train.eval_every, data.eval_path with a loss mask): the eval loss after the last
// step is what transformers computes from the exported model on the same held-out windows, and
// one rank, two DDP ranks, two FSDP ranks, two pipeline stages and two tensor-parallel ranks report
// the same eval losses, on the steps asked for only.
TEST_F(TrainerE2eTest, EvalLossIsTransformersOnTheSameWindowsUnderEveryLayout) {
  // Nine devices for the five runs (whose attempts stay placed).
  auto more = testing::NodeSession::Connect(channel_, tokens_->Node("n2"), "n2", 8);
  std::mt19937 gen(17);
  std::uniform_int_distribution<int> token(0, 255), bit(0, 1);
  auto write_tokens = [&](const std::string& path, int n) {
    std::string bytes;
    for (int i = 0; i < n; ++i) {
      const uint16_t t = static_cast<uint16_t>(token(gen));
      bytes.append(reinterpret_cast<const char*>(&t), 2);
    }
    std::ofstream(path, std::ios::binary) << bytes;
  };
  const std::string train = dir_.path() + "/train.u16", held = dir_.path() + "/held.u16",
                    mask = dir_.path() + "/held.mask";
  write_tokens(train, 4000);
  write_tokens(held, 1000);
  std::string mask_bytes;
  for (int i = 0; i < 1000; ++i) mask_bytes.push_back(static_cast<char>(bit(gen)));
  std::ofstream(mask, std::ios::binary) << mask_bytes;

  v1::JobSpec spec = LlamaSpec(2, 4);
  spec.mutable_model()->set_n_kv_head(2);  // two tensor-parallel ranks split the heads
  spec.mutable_data()->set_path(train);
  spec.mutable_data()->set_format("uint16");
  spec.mutable_data()->set_eval_path(held);
  spec.mutable_data()->set_eval_loss_mask(mask);
  spec.mutable_train()->set_steps(4);
  spec.mutable_train()->set_eval_every(2);
  spec.mutable_train()->set_eval_batches(2);  // 2 global batches of 8: 16 windows
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  auto eval_losses = [&](const v1::JobSpec& s, int ranks, const std::string& name) {
    const std::string metrics = dir_.path() + "/" + name + ".jsonl";
    RunResult r = Run(StartJob(s, name), ranks, {"--metrics-file", metrics});
    EXPECT_THAT(r.exit_codes, ::testing::Each(0)) << Joined(r);
    EXPECT_THAT(Joined(r), HasSubstr("eval step 4 eval_loss "));
    return ReadEvalLosses(metrics);
  };
  v1::JobSpec one = OneRankWholeBatch(spec);
  one.mutable_checkpoint()->set_export_format(v1::EXPORT_HF);
  const Job one_job = StartJob(one, "one");
  const std::string one_metrics = dir_.path() + "/one.jsonl";
  RunResult r1 = Run(one_job, 1, {"--metrics-file", one_metrics});
  ASSERT_THAT(r1.exit_codes, ::testing::ElementsAre(0)) << Joined(r1);
  const std::map<int64_t, double> single = ReadEvalLosses(one_metrics);
  ASSERT_EQ(single.size(), 2u);  // steps 2 and 4
  ASSERT_EQ(single.count(2), 1u);
  ASSERT_EQ(single.count(4), 1u);

  // transformers on the exported model (the parameters after step 4), windows 0..15.
  const testing::CommandResult ref =
      testing::RunCommand({testing::TestBinPath("../hf-venv/bin/python"),
                           std::string(TRAINYARD_SOURCE_DIR) + "/tests/eval_loss_reference.py",
                           one_job.checkpoint_dir + "/export", held, mask, "16", "16"},
                          {"HF_HUB_OFFLINE=1", "TRANSFORMERS_VERBOSITY=error"}, absl::Seconds(240));
  ASSERT_EQ(ref.exit_code, 0) << ref.out << ref.err;
  const nlohmann::json want = nlohmann::json::parse(ref.out);
  EXPECT_NEAR(single.at(4), want.at("loss").get<double>(), 1e-5 * want.at("loss").get<double>());
  EXPECT_GT(want.at("count").get<double>(), 16 * 16 / 4);  // the mask leaves about half

  v1::JobSpec fsdp = spec;
  fsdp.mutable_parallel()->set_strategy(v1::FSDP);
  v1::JobSpec staged = spec;
  staged.mutable_parallel()->set_pipeline_stages(2);
  staged.mutable_train()->set_micro_batch(4);
  staged.mutable_train()->set_micro_batches(2);
  v1::JobSpec tensor = spec;
  tensor.mutable_train()->set_micro_batch(8);
  tensor.mutable_parallel()->set_tensor_parallel(2);
  for (const auto& [name, s] : std::vector<std::pair<std::string, v1::JobSpec>>{
           {"ddp", spec}, {"fsdp", fsdp}, {"staged", staged}, {"tensor", tensor}}) {
    SCOPED_TRACE(name);
    const auto got = eval_losses(s, 2, name);
    ASSERT_EQ(got.size(), 2u);
    for (const auto& [step, loss] : single) {
      ASSERT_EQ(got.count(step), 1u) << step;
      EXPECT_NEAR(got.at(step), loss, 1e-5 * loss) << "step " << step;
    }
  }
}

// checkpoint.keep_best: besides the newest (keep_last 1), the checkpoint of the lowest eval loss
// stays; the coordinator lists what is kept, with the eval losses.
TEST_F(TrainerE2eTest, KeepBestKeepsTheLowestEvalLossCheckpointAndTheCoordinatorListsIt) {
  v1::JobSpec spec = TinySpec(1, 8);
  spec.mutable_train()->set_steps(8);
  // Large enough that the held-out loss is lowest at step 4 and rises after (seeded: it does).
  spec.mutable_train()->set_lr(3e-2);
  spec.mutable_train()->set_eval_every(2);
  spec.mutable_train()->set_eval_batches(2);
  spec.mutable_data()->set_eval_path("/usr/share/common-licenses/GPL-2");
  spec.mutable_checkpoint()->set_every_steps(2);
  spec.mutable_checkpoint()->set_keep_last(1);
  spec.mutable_checkpoint()->set_keep_best(true);
  const Job job = StartJob(spec, "best");
  const std::string metrics = dir_.path() + "/best.jsonl";
  RunResult r = Run(job, 1, {"--metrics-file", metrics});
  ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0)) << Joined(r);
  const std::map<int64_t, double> evals = ReadEvalLosses(metrics);
  ASSERT_EQ(evals.size(), 4u);
  int64_t best = 0;
  for (const auto& [step, loss] : evals) {
    if (best == 0 || loss <= evals.at(best)) best = step;
  }
  EXPECT_NE(best, 8) << "the best is the newest: the test no longer shows keep_best";
  std::vector<std::string> folders;
  for (const auto& e : std::filesystem::directory_iterator(job.checkpoint_dir)) {
    folders.push_back(e.path().filename().string());
  }
  std::sort(folders.begin(), folders.end());
  std::vector<std::string> want = {"latest", absl::StrCat("step-", best)};
  if (best != 8) want.push_back("step-8");
  std::sort(want.begin(), want.end());
  EXPECT_EQ(folders, want);
  // The coordinator's record of the job: what is kept, with its eval loss, and the latest eval.
  const v1::Job got = Stored(job);
  ASSERT_EQ(got.kept_checkpoints_size(), best == 8 ? 1 : 2);
  EXPECT_EQ(got.kept_checkpoints(0).step(), best);
  ASSERT_TRUE(got.kept_checkpoints(0).has_eval_loss());
  EXPECT_NEAR(got.kept_checkpoints(0).eval_loss(), evals.at(best), 1e-12);
  EXPECT_EQ(got.kept_checkpoints(got.kept_checkpoints_size() - 1).step(), 8);
  EXPECT_NEAR(got.eval_loss(), evals.at(8), 1e-12);
}

// train.no_weight_decay under FSDP (the exclusions fall inside flat buffers' shards) trains what
// one DDP rank trains, and it matters: without it the model trains otherwise.
TEST_F(TrainerE2eTest, NoWeightDecayTrainsTheSameUnderFsdpAsOnOneRank) {
  v1::JobSpec spec = TinySpec(2, 4);
  spec.mutable_train()->set_weight_decay(0.5);
  spec.mutable_train()->add_no_weight_decay("bias");
  spec.mutable_train()->add_no_weight_decay("norm");
  spec.mutable_parallel()->set_strategy(v1::FSDP);
  auto train = [&](const v1::JobSpec& s, int ranks, const std::string& name) {
    const std::string dump = dir_.path() + "/" + name + ".params";
    RunResult r = Run(StartJob(s, name), ranks, {"--dump-params", dump});
    EXPECT_THAT(r.exit_codes, ::testing::Each(0)) << Joined(r);
    return ReadDump(dump);
  };
  const auto one = train(OneRankWholeBatch(spec), 1, "one");
  ExpectSameParams(train(spec, 2, "fsdp"), one, 1e-5, /*skip_key_bias=*/true);
  v1::JobSpec decayed = OneRankWholeBatch(spec);
  decayed.mutable_train()->clear_no_weight_decay();
  const auto all = train(decayed, 1, "all");
  ASSERT_EQ(all.size(), one.size());
  double moved = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    moved = std::max(moved, RelativeDifference(one[i], all[i], 0, one[i].values.size()));
  }
  EXPECT_GT(moved, 1e-4);
}

// A resume keeps the schedule and the optimizer's settings: another adam_beta2 is refused naming
// the field, the same ones resume.
TEST_F(TrainerE2eTest, AResumeWithOtherOptimizerSettingsIsRefusedNamingTheField) {
  v1::JobSpec spec = TinySpec(1, 8);
  spec.mutable_train()->set_steps(4);
  spec.mutable_train()->set_adam_beta2(0.99);
  spec.mutable_train()->add_no_weight_decay("bias");
  spec.mutable_checkpoint()->set_every_steps(2);
  const Job job = StartJob(spec, "settings");
  RunResult first = Run(job, 1, {"--stop-after-steps", "2"});
  ASSERT_THAT(first.exit_codes, ::testing::ElementsAre(0)) << Joined(first);
  auto with = [&](const std::string& name, std::function<void(v1::TrainSpec&)> change) {
    v1::JobSpec other;
    std::ifstream in(job.spec_path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(other.ParseFromString(bytes));
    change(*other.mutable_train());
    Job changed = job;
    changed.spec_path = dir_.path() + "/" + name + ".spec";
    std::ofstream(changed.spec_path, std::ios::binary) << other.SerializeAsString();
    return changed;
  };
  for (const auto& [name, change, field] :
       std::vector<std::tuple<std::string, std::function<void(v1::TrainSpec&)>, std::string>>{
           {"beta2", [](v1::TrainSpec& t) { t.set_adam_beta2(0.999); }, "train.adam_beta2"},
           {"decay", [](v1::TrainSpec& t) { t.add_no_weight_decay("norm"); },
            "train.no_weight_decay"},
           {"lr", [](v1::TrainSpec& t) { t.set_lr(2e-3); }, "train.lr"}}) {
    SCOPED_TRACE(name);
    const testing::CommandResult r =
        testing::RunCommand(Argv(with(name, change), 0, 1, {}), {}, absl::Seconds(60));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat(field, ": the checkpoint ", job.checkpoint_dir,
                                              "/step-2 was trained with ")));
  }
  RunResult resumed = Run(job, 1, {});
  ASSERT_THAT(resumed.exit_codes, ::testing::ElementsAre(0)) << Joined(resumed);
  EXPECT_THAT(Joined(resumed), HasSubstr("resumed from"));
}

TEST_F(TrainerE2eTest, ABadLlamaCheckpointIsRefusedAtStartNamingTheTensorAndTheFile) {
  const v1::JobSpec spec = LlamaSpec(1, 8);
  auto refused = [&](const std::string& model_dir, const v1::JobSpec& s) {
    v1::JobSpec with = s;
    UseCheckpoint(with, model_dir);
    const Job job = StartJob(with, "bad");
    testing::CommandResult r = testing::RunCommand(Argv(job, 0, 1, {}), {}, absl::Seconds(60));
    EXPECT_NE(r.exit_code, 0);
    return r.err;
  };
  const std::string missing = dir_.path() + "/missing";
  WriteLlamaCheckpoint(missing, spec.model(), 1, "model.layers.1.mlp.up_proj.weight");
  EXPECT_THAT(refused(missing, spec),
              AllOf(HasSubstr("model.from: tensor model.layers.1.mlp.up_proj.weight"),
                    HasSubstr("is missing from the checkpoint"), HasSubstr(missing)));

  const std::string truncated = dir_.path() + "/truncated";
  WriteLlamaCheckpoint(truncated, spec.model(), 1);
  const std::string shard = truncated + "/model-00002-of-00002.safetensors";
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 4);
  EXPECT_THAT(refused(truncated, spec), AllOf(HasSubstr("model.from: "), HasSubstr(shard)));

  // The spec disagrees with config.json.
  v1::JobSpec three_layers = spec;
  three_layers.mutable_model()->set_n_layer(3);
  EXPECT_THAT(refused(missing, three_layers),
              HasSubstr("model.n_layer: the spec says 3 but " + missing +
                        "/config.json has num_hidden_layers 2"));
}

// LoRA from a Hugging Face checkpoint: two FSDP ranks train what one rank trains; the base
// weights come out bit-identical to the checkpoint's and only the adapters move; the exported
// adapter (PEFT's layout) holds exactly the trained adapters, and --merge-lora the merged model.
TEST_F(TrainerE2eTest, LoraTrainsOnlyTheAdaptersTheSameOnTwoFsdpRanksAsOnOneAndExportsThem) {
  const std::string model_dir = dir_.path() + "/hf-model";
  const auto start = WriteLlamaCheckpoint(model_dir, LlamaSpec(1, 8).model(), 5);
  v1::JobSpec spec = LlamaSpec(2, 4);
  UseCheckpoint(spec, model_dir);
  spec.mutable_train()->set_lr(1e-2);
  auto* lora = spec.mutable_train()->mutable_lora();
  lora->set_r(2);
  lora->set_alpha(4);
  lora->add_target_modules("q_proj");
  lora->add_target_modules("v_proj");
  lora->add_target_modules("down_proj");
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_strategy(v1::FSDP);
  const v1::JobSpec one = OneRankWholeBatch(spec);

  const std::string fsdp_dump = dir_.path() + "/fsdp.params",
                    one_dump = dir_.path() + "/one.params";
  const Job fsdp_job = StartJob(spec, "fsdp");
  RunResult rf = Run(fsdp_job, 2, {"--dump-params", fsdp_dump});
  EXPECT_THAT(rf.exit_codes, ::testing::Each(0)) << Joined(rf);
  // 2 layers x (q: 2x(32+32), v: 2x(32+16), down: 2x(128+32)) trainable.
  EXPECT_THAT(Joined(rf), HasSubstr("(1088 trainable: LoRA r 2 on q_proj,v_proj,down_proj)"));
  RunResult r1 = Run(StartJob(one, "one"), 1, {"--dump-params", one_dump});
  EXPECT_THAT(r1.exit_codes, ::testing::ElementsAre(0)) << Joined(r1);
  const auto fsdp = ReadDump(fsdp_dump), single = ReadDump(one_dump);
  ExpectSameParams(fsdp, single, 1e-5);

  int adapters = 0;
  std::map<std::string, const DumpedParam*> by_name;
  for (const DumpedParam& p : fsdp) {
    SCOPED_TRACE(p.name);
    by_name[p.name] = &p;
    if (absl::StrContains(p.name, ".lora_")) {
      ++adapters;
      // B starts at zero (A's start is random: the FSDP run equal to the DDP one above covers it).
      if (absl::StrContains(p.name, ".lora_B.")) {
        EXPECT_NE(p.values, std::vector<float>(p.values.size(), 0.0f));
      }
      continue;
    }
    ASSERT_EQ(start.count(p.name), 1u);
    EXPECT_EQ(p.values, start.at(p.name));  // bit-identical
  }
  EXPECT_EQ(adapters, 2 * 3 * 2);

  // The adapter alone, as PEFT saves it.
  const std::string adapter_dir = dir_.path() + "/adapter", merged_dir = dir_.path() + "/merged";
  testing::CommandResult e = testing::RunCommand({testing::BinPath("trainyard-trainer"),
                                                  "--export-hf", fsdp_job.checkpoint_dir, "--spec",
                                                  fsdp_job.spec_path, "--out", adapter_dir});
  ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
  EXPECT_THAT(e.err + e.out, HasSubstr("exported the LoRA adapter of step 10"));
  const nlohmann::json config =
      nlohmann::json::parse(std::ifstream(adapter_dir + "/adapter_config.json"), nullptr, false);
  EXPECT_EQ(config.value("peft_type", ""), "LORA");
  EXPECT_EQ(config.value("r", 0), 2);
  EXPECT_EQ(config.value("lora_alpha", 0.0), 4.0);
  EXPECT_EQ(config.value("base_model_name_or_path", ""), model_dir);
  EXPECT_EQ(config["target_modules"], nlohmann::json::array({"q_proj", "v_proj", "down_proj"}));
  auto file = trainer::SafetensorsFile::Open(adapter_dir + "/adapter_model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->header().tensors.size(), size_t(adapters));
  for (const auto& [name, p] : by_name) {
    if (!absl::StrContains(name, ".lora_")) continue;
    const trainer::SafetensorsTensor* t = (*file)->header().Find("base_model.model." + name);
    ASSERT_NE(t, nullptr) << name;
    const auto bytes = (*file)->Bytes(*t);
    ASSERT_EQ(bytes.size(), p->values.size() * sizeof(float)) << name;
    EXPECT_EQ(std::memcmp(bytes.data(), p->values.data(), bytes.size()), 0) << name;
  }

  // Merged: W + (alpha / r) B A for the targeted projections, the rest as trained.
  e = testing::RunCommand({testing::BinPath("trainyard-trainer"), "--export-hf",
                           fsdp_job.checkpoint_dir, "--spec", fsdp_job.spec_path, "--out",
                           merged_dir, "--merge-lora"});
  ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
  file = trainer::SafetensorsFile::Open(merged_dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->header().tensors.size(), start.size());
  const std::string down = "model.layers.1.mlp.down_proj";
  const DumpedParam &w = *by_name.at(down + ".weight"), &a = *by_name.at(down + ".lora_A.weight"),
                    &b = *by_name.at(down + ".lora_B.weight");
  const trainer::SafetensorsTensor* t = (*file)->header().Find(down + ".weight");
  ASSERT_NE(t, nullptr);
  const auto bytes = (*file)->Bytes(*t);
  ASSERT_EQ(bytes.size(), w.values.size() * sizeof(float));
  const float* merged = reinterpret_cast<const float*>(bytes.data());
  const int64_t out = w.shape[0], in = w.shape[1], r = 2;
  double worst = 0;
  for (int64_t i = 0; i < out; ++i) {
    for (int64_t j = 0; j < in; ++j) {
      double delta = 0;
      for (int64_t k = 0; k < r; ++k) delta += double{b.values[i * r + k]} * a.values[k * in + j];
      worst = std::max(worst, std::abs(merged[i * in + j] - (w.values[i * in + j] + 2.0 * delta)));
    }
  }
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(std::abs(merged[0] - w.values[0]), 0);  // the adapter did change the projection

  // --merge-lora without LoRA is refused naming the flag.
  e = testing::RunCommand({testing::BinPath("trainyard-trainer"), "--export-hf",
                           fsdp_job.checkpoint_dir, "--spec",
                           StartJob(LlamaSpec(1, 8), "plain").spec_path, "--out",
                           dir_.path() + "/plain", "--merge-lora"});
  EXPECT_NE(e.exit_code, 0);
  EXPECT_THAT(e.err, HasSubstr("--merge-lora: the job has no train.lora"));
}

// LoRA dropout draws its masks from a generator seeded by (seed, rank, step, micro-step): the
// activation-checkpointing recompute draws the same ones (the generator is set back to its state
// at forward), and a run resumed from a checkpoint draws what an uninterrupted one draws.
TEST_F(TrainerE2eTest, LoraDropoutIsTheSameRecomputedAndResumed) {
  auto spec_of = [](double dropout, bool checkpointing, int ranks) {
    v1::JobSpec s = LlamaSpec(ranks, 8 / ranks);
    s.mutable_train()->set_steps(8);
    s.mutable_train()->set_activation_checkpointing(checkpointing);
    auto* lora = s.mutable_train()->mutable_lora();
    lora->set_r(4);
    lora->set_alpha(8);
    lora->set_dropout(dropout);
    for (const std::string& t : LoraTargetNames()) lora->add_target_modules(t);
    return s;
  };
  // (The node has 8 slots and these jobs never end in the coordinator: 7 are used.)
  auto losses = [&](const v1::JobSpec& spec, const std::string& name,
                    const std::vector<std::string>& every_rank = {}, const Job* reuse = nullptr) {
    Job job = StartJob(spec, name);
    if (reuse != nullptr) job.checkpoint_dir = reuse->checkpoint_dir;
    const std::string metrics = dir_.path() + "/" + name + ".jsonl";
    RunResult r = Run(job, spec.resources().slots(), {"--metrics-file", metrics}, every_rank);
    EXPECT_THAT(r.exit_codes, ::testing::Each(0)) << Joined(r);
    return std::make_pair(job, ReadLosses(metrics));
  };
  const auto [plain_job, plain] = losses(spec_of(0.1, false, 2), "plain");
  ASSERT_EQ(plain.size(), 8u);
  // Recomputed (activation checkpointing) for 3 steps, then resumed from the checkpoint.
  const auto [first_job, first] =
      losses(spec_of(0.1, true, 2), "first", {"--stop-after-steps", "3"});
  ASSERT_EQ(first.size(), 3u);
  for (const auto& [step, loss] : first) EXPECT_NEAR(loss, plain.at(step), 1e-6) << step;
  const auto [resumed_job, resumed] = losses(spec_of(0.1, true, 2), "resumed", {}, &first_job);
  ASSERT_EQ(resumed.size(), 5u);
  for (const auto& [step, loss] : resumed) EXPECT_NEAR(loss, plain.at(step), 1e-6) << step;
  // The dropout does something (without it, one rank trains what two do).
  const auto [none_job, none] = losses(spec_of(0, false, 1), "none");
  EXPECT_GT(std::abs(none.at(8) - plain.at(8)), 1e-4) << "dropout changed nothing";
}

// `trainyard-trainer --export-hf`: a llama job's latest checkpoint, DDP or sharded FSDP, as a
// Hugging Face directory holding exactly the trained parameters (tests/llama_reference_test
// loads such a directory in transformers).
TEST_F(TrainerE2eTest, ExportHfWritesTheTrainedLlamaFromDdpAndFsdpCheckpoints) {
  for (const v1::Strategy strategy : {v1::DDP, v1::FSDP}) {
    const std::string tag = v1::Strategy_Name(strategy);
    SCOPED_TRACE(tag);
    v1::JobSpec spec = LlamaSpec(2, 4);
    spec.mutable_model()->set_tie_weights(true);
    spec.mutable_parallel()->set_strategy(strategy);
    const std::string dump = dir_.path() + "/" + tag + ".params", out = dir_.path() + "/" + tag;
    const Job job = StartJob(spec, tag);
    const std::string checkpoints = job.checkpoint_dir;
    RunResult r = Run(job, 2, {"--dump-params", dump});
    ASSERT_THAT(r.exit_codes, ::testing::Each(0)) << Joined(r);
    testing::CommandResult e =
        testing::RunCommand({testing::BinPath("trainyard-trainer"), "--export-hf", checkpoints,
                             "--spec", job.spec_path, "--out", out});
    ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
    EXPECT_THAT(e.err + e.out, HasSubstr("exported step 10"));

    const nlohmann::json config =
        nlohmann::json::parse(std::ifstream(out + "/config.json"), nullptr, false);
    EXPECT_EQ(config.value("model_type", ""), "llama");
    EXPECT_EQ(config.value("num_key_value_heads", 0), 1);
    EXPECT_EQ(config.value("tie_word_embeddings", false), true);
    auto file = trainer::SafetensorsFile::Open(out + "/model.safetensors");
    ASSERT_TRUE(file.ok()) << file.status();
    const auto trained = ReadDump(dump);
    EXPECT_EQ((*file)->header().tensors.size(), trained.size());
    for (const DumpedParam& p : trained) {
      const trainer::SafetensorsTensor* t = (*file)->header().Find(p.name);
      ASSERT_NE(t, nullptr) << p.name;
      EXPECT_EQ(t->shape, p.shape) << p.name;
      const auto bytes = (*file)->Bytes(*t);
      ASSERT_EQ(bytes.size(), p.values.size() * sizeof(float)) << p.name;
      EXPECT_EQ(std::memcmp(bytes.data(), p.values.data(), bytes.size()), 0) << p.name;
    }
    EXPECT_FALSE(std::filesystem::exists(out + "/.consolidated"));
  }
  // Only llama jobs export; the error names the field.
  const Job gpt = StartJob(TinySpec(1, 8), "gpt");
  testing::CommandResult e =
      testing::RunCommand({testing::BinPath("trainyard-trainer"), "--export-hf", gpt.checkpoint_dir,
                           "--spec", gpt.spec_path, "--out", dir_.path() + "/gpt"});
  EXPECT_EQ(e.exit_code, 2);
  EXPECT_THAT(e.err, HasSubstr("model.kind: --export-hf writes Llama-family models"));
}

// data.loss_mask (prompt/response fine-tuning): the loss is the mean over the counted targets of
// the step's whole global batch, so two ranks with gradient accumulation train what one rank
// with the whole batch trains; a mask of all ones trains what no mask trains; a bad mask fails
// the rank at start naming data.loss_mask.
TEST_F(TrainerE2eTest, LossMaskCountsOnlyMaskedTargetsTheSameOnAnyRanksAndMicroBatches) {
  auto more = testing::NodeSession::Connect(channel_, tokens_->Node("n2"), "n2", 8);
  const std::string data = "/usr/share/common-licenses/GPL-3";
  const int64_t n = std::filesystem::file_size(data);
  std::mt19937 gen(3);
  std::string mask;  // alternating prompts (0) and responses (1) of 1..40 tokens
  for (char bit = 0; static_cast<int64_t>(mask.size()) < n; bit ^= 1) {
    mask.append(std::uniform_int_distribution<int>(1, 40)(gen), bit);
  }
  mask.resize(n);
  const std::string mask_path = dir_.path() + "/mask.bin", ones_path = dir_.path() + "/ones.bin";
  std::ofstream(mask_path, std::ios::binary) << mask;
  std::ofstream(ones_path, std::ios::binary) << std::string(n, 1);

  auto spec_of = [&](int ranks, int micro_batch, int grad_accum, const std::string& mask_file) {
    v1::JobSpec s = TinySpec(ranks, micro_batch);
    s.mutable_train()->set_grad_accum(grad_accum);
    s.mutable_data()->set_loss_mask(mask_file);
    return s;
  };
  auto train = [&](const v1::JobSpec& spec, int ranks, const std::string& name) {
    const std::string dump = dir_.path() + "/" + name + ".params";
    RunResult r = Run(StartJob(spec, name), ranks, {"--dump-params", dump});
    EXPECT_THAT(r.exit_codes, ::testing::Each(0)) << Joined(r);
    return ReadDump(dump);
  };
  const auto two = train(spec_of(2, 2, 2, mask_path), 2, "two");
  const auto one = train(spec_of(1, 8, 1, mask_path), 1, "one");
  ExpectSameParams(two, one, 1e-5, /*skip_key_bias=*/true);
  // 2 pipeline stages x 2 tensor-parallel ranks, 4 micro-batches of 2: the same targets count.
  v1::JobSpec staged = spec_of(4, 2, 1, mask_path);
  staged.mutable_train()->set_micro_batches(4);
  staged.mutable_parallel()->set_pipeline_stages(2);
  staged.mutable_parallel()->set_tensor_parallel(2);
  ExpectSameParams(train(staged, 4, "staged"), one, 1e-5, /*skip_key_bias=*/true);
  const auto unmasked = train(spec_of(1, 8, 1, ""), 1, "unmasked");
  ExpectSameParams(train(spec_of(1, 8, 1, ones_path), 1, "ones"), unmasked, 1e-5, true);
  // The mask matters: half the targets left out train another model.
  double moved = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    moved = std::max(moved, RelativeDifference(one[i], unmasked[i], 0, one[i].values.size()));
  }
  EXPECT_GT(moved, 1e-3);

  const std::string short_path = dir_.path() + "/short.bin";
  std::ofstream(short_path, std::ios::binary) << std::string(n - 1, 1);
  const Job bad = StartJob(spec_of(1, 8, 1, short_path), "bad");
  testing::CommandResult r = testing::RunCommand(Argv(bad, 0, 1, {}), {}, absl::Seconds(60));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("data.loss_mask: '", short_path, "' has ", n - 1,
                                            " bytes; it needs one per token")));
}

}  // namespace
}  // namespace trainyard
