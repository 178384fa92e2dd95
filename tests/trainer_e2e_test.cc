// trainyard-trainer end to end (tests/testing/trainer_e2e.h): DDP against a single rank,
// checkpoint and resume (also after SIGKILL), retention, SIGTERM, bad input, the rank's context,
// --help and --version, the BLAS it reports and the matmul path it chooses.
#include "tests/testing/trainer_e2e.h"

#include "absl/strings/numbers.h"

namespace trainyard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using trainer::DumpedParam;

struct Variant {
  std::string name;
  int grad_accum;
  bool activation_checkpointing;
  bool tie_weights;
  bool one_rank_per_node = false;  // all-reduce through Gloo, not shared memory
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class DdpEquivalenceTest : public TrainerE2eTest, public ::testing::WithParamInterface<Variant> {};

// Two ranks with micro-batch B/2 each train exactly what one rank with micro-batch B trains.
TEST_P(DdpEquivalenceTest, TwoRanksMatchOneRankWithTheWholeBatch) {
  const Variant& v = GetParam();
  auto with_variant = [&v](v1::JobSpec s) {
    s.mutable_train()->set_grad_accum(v.grad_accum);
    s.mutable_train()->set_activation_checkpointing(v.activation_checkpointing);
    s.mutable_model()->set_tie_weights(v.tie_weights);
    return s;
  };
  const Job two = StartJob(with_variant(TinySpec(2, 4)), "two");
  const Job one = StartJob(with_variant(TinySpec(1, 8)), "one");
  const std::string two_dump = dir_.path() + "/two.params";
  const std::string one_dump = dir_.path() + "/one.params";

  std::vector<std::string> every_rank;
  if (v.one_rank_per_node) every_rank = {"--local-world-size", "1"};
  RunResult r2 = Run(two, 2, {"--dump-params", two_dump}, every_rank);
  EXPECT_THAT(r2.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(r2);
  EXPECT_THAT(Joined(r2), HasSubstr("step 10/10"));
  EXPECT_THAT(Joined(r2),
              HasSubstr(v.one_rank_per_node
                            ? "collectives: gloo on 127.0.0.1\n"
                            : "collectives: gloo on 127.0.0.1; fp32 all-reduce through shared "
                              "memory (2 ranks "
                              "on this host)"));
  RunResult r1 = Run(one, 1, {"--dump-params", one_dump});
  EXPECT_THAT(r1.exit_codes, ::testing::ElementsAre(0)) << Joined(r1);

  const auto p2 = ReadDump(two_dump), p1 = ReadDump(one_dump);
  ExpectSameParams(p2, p1, 1e-5, /*skip_key_bias=*/true);
}

INSTANTIATE_TEST_SUITE_P(Variants, DdpEquivalenceTest,
                         ::testing::Values(Variant{"Plain", 1, false, false},
                                           Variant{"GradAccum2", 2, false, true},
                                           Variant{"ActivationCheckpointing", 1, true, false},
                                           Variant{"OverGloo", 1, false, false, true}),
                         [](const auto& info) { return info.param.name; });

TEST_F(TrainerE2eTest, LossFallsOverTraining) {
  v1::JobSpec spec = TinySpec(2, 8);
  spec.mutable_train()->set_steps(40);
  const Job job = StartJob(spec, "falls");
  const std::string metrics = dir_.path() + "/falls.jsonl";
  RunResult r = Run(job, 2, {"--metrics-file", metrics});
  EXPECT_THAT(r.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(r);
  const auto losses = ReadLosses(metrics);
  ASSERT_EQ(losses.size(), 40u);
  double first = 0, last = 0;
  for (int s = 1; s <= 5; ++s) first += losses.at(s);
  for (int s = 36; s <= 40; ++s) last += losses.at(s);
  EXPECT_LT(last, first - 5 * 0.5)
      << "mean loss of the first and last 5 steps: " << first / 5 << " -> " << last / 5;
}

class ResumeTest : public TrainerE2eTest, public ::testing::WithParamInterface<v1::Optimizer> {};

// 20 steps straight equal 10 steps, a checkpoint, and a new process for the other 10, with every
// optimizer (its state, 8-bit codes included, goes through the checkpoint exactly).
TEST_P(ResumeTest, ResumeFromCheckpointReproducesEveryLoss) {
  v1::JobSpec spec = TinySpec(1, 8);
  spec.mutable_train()->set_steps(20);
  spec.mutable_train()->set_optimizer(GetParam());
  const Job straight = StartJob(spec, "straight");
  const Job split = StartJob(spec, "split");
  const std::string straight_metrics = dir_.path() + "/straight.jsonl";
  const std::string split_metrics = dir_.path() + "/split.jsonl";

  RunResult a =
      Run(straight, 1,
          {"--metrics-file", straight_metrics, "--dump-params", dir_.path() + "/straight.params"});
  ASSERT_THAT(a.exit_codes, ::testing::ElementsAre(0)) << Joined(a);
  EXPECT_THAT(Joined(a), HasSubstr(absl::StrCat(
                             "optimizer ", absl::AsciiStrToLower(v1::Optimizer_Name(GetParam())))));
  RunResult b1 = Run(split, 1, {"--metrics-file", split_metrics, "--stop-after-steps", "10"});
  ASSERT_THAT(b1.exit_codes, ::testing::ElementsAre(0)) << Joined(b1);
  EXPECT_THAT(Joined(b1), HasSubstr("checkpoint step 10"));
  EXPECT_THAT(Joined(b1), ::testing::Not(HasSubstr("step 11/20")));
  RunResult b2 = Run(
      split, 1, {"--metrics-file", split_metrics, "--dump-params", dir_.path() + "/split.params"});
  ASSERT_THAT(b2.exit_codes, ::testing::ElementsAre(0)) << Joined(b2);
  EXPECT_THAT(Joined(b2), HasSubstr("resumed from"));

  const auto expected = ReadLosses(straight_metrics), got = ReadLosses(split_metrics);
  ASSERT_EQ(expected.size(), 20u);
  ASSERT_EQ(got.size(), 20u);
  for (const auto& [step, loss] : expected) EXPECT_NEAR(got.at(step), loss, 1e-6) << step;
  ExpectSameParams(ReadDump(dir_.path() + "/split.params"),
                   ReadDump(dir_.path() + "/straight.params"), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, ResumeTest,
                         ::testing::Values(v1::ADAMW, v1::LION, v1::ADAFACTOR, v1::ADAMW_8BIT),
                         [](const auto& info) { return v1::Optimizer_Name(info.param); });

// A checkpoint written with one optimizer is refused by a job with another, naming the field,
// whichever strategy wrote it.
TEST_F(TrainerE2eTest, ACheckpointOfAnotherOptimizerIsRefusedNamingIt) {
  for (const v1::Strategy strategy : {v1::DDP, v1::FSDP}) {
    v1::JobSpec spec = TinySpec(1, 8);
    spec.mutable_train()->set_steps(4);
    spec.mutable_train()->set_optimizer(v1::LION);
    spec.mutable_parallel()->set_strategy(strategy);
    const Job lion = StartJob(spec, absl::StrCat("lion-", strategy));
    RunResult a = Run(lion, 1, {"--stop-after-steps", "2"});
    ASSERT_THAT(a.exit_codes, ::testing::ElementsAre(0)) << Joined(a);
    spec.mutable_train()->set_optimizer(v1::ADAMW);
    Job adamw = StartJob(spec, absl::StrCat("adamw-", strategy));
    adamw.checkpoint_dir = lion.checkpoint_dir;
    RunResult b = Run(adamw, 1, {});
    EXPECT_THAT(b.exit_codes, ::testing::ElementsAre(1)) << Joined(b);
    EXPECT_THAT(Joined(b), HasSubstr("was written with train.optimizer lion; this job's is adamw"));
  }
}

// A rank SIGKILLed after its step-10 checkpoint resumes from it (or from a later one it wrote
// before the signal landed) and still reproduces the straight run.
TEST_F(TrainerE2eTest, ResumeAfterSigkillReproducesEveryLoss) {
  v1::JobSpec spec = TinySpec(1, 8);
  spec.mutable_train()->set_steps(20);
  spec.mutable_checkpoint()->set_every_steps(10);
  const Job straight = StartJob(spec, "straight");
  const Job killed = StartJob(spec, "killed");
  const std::string straight_metrics = dir_.path() + "/straight.jsonl";
  const std::string killed_metrics = dir_.path() + "/killed.jsonl";
  const std::string resumed_metrics = dir_.path() + "/resumed.jsonl";

  RunResult a =
      Run(straight, 1,
          {"--metrics-file", straight_metrics, "--dump-params", dir_.path() + "/straight.params"});
  ASSERT_THAT(a.exit_codes, ::testing::ElementsAre(0)) << Joined(a);

  auto procs = Launch(killed, 1, {"--metrics-file", killed_metrics});
  ASSERT_EQ(procs.size(), 1u);
  bool saw_checkpoint = false;
  while (auto line = procs[0]->ReadLine(kRunTimeout)) {
    if (absl::StartsWith(*line, "checkpoint step 10 ")) {
      saw_checkpoint = true;
      procs[0]->Signal(SIGKILL);
      break;
    }
  }
  ASSERT_TRUE(saw_checkpoint);
  std::optional<int> status = procs[0]->Wait(absl::Seconds(30));
  ASSERT_TRUE(status.has_value());

  RunResult b =
      Run(killed, 1,
          {"--metrics-file", resumed_metrics, "--dump-params", dir_.path() + "/killed.params"});
  ASSERT_THAT(b.exit_codes, ::testing::ElementsAre(0)) << Joined(b);
  EXPECT_THAT(Joined(b), HasSubstr("resumed from"));

  const auto expected = ReadLosses(straight_metrics);
  const auto before = ReadLosses(killed_metrics), after = ReadLosses(resumed_metrics);
  ASSERT_GE(before.size(), 10u);
  for (const auto& [step, loss] : before) {
    EXPECT_NEAR(loss, expected.at(step), 1e-6) << step;
  }
  if (after.empty()) {
    EXPECT_EQ(before.size(), 20u);  // it reached the end before the signal
  }
  for (const auto& [step, loss] : after) {
    EXPECT_GT(step, 10);
    EXPECT_NEAR(loss, expected.at(step), 1e-6) << step;
  }
  ExpectSameParams(ReadDump(dir_.path() + "/killed.params"),
                   ReadDump(dir_.path() + "/straight.params"), 1e-6);
}

// checkpoint.keep_last: a job that checkpoints every 2 steps keeps the newest 2 folders. Killed
// after its step-6 checkpoint, it resumes from the newest (what retention never removes), its
// losses are the straight run's, and at the end only step-10 and step-12 are left.
TEST_F(TrainerE2eTest, RetentionKeepsTheNewestCheckpointsAndAKilledRunStillResumes) {
  v1::JobSpec spec = TinySpec(1, 8);
  spec.mutable_train()->set_steps(12);
  spec.mutable_checkpoint()->set_every_steps(2);
  spec.mutable_checkpoint()->set_keep_last(2);
  const Job straight = StartJob(spec, "straight");
  const Job killed = StartJob(spec, "killed");
  const std::string straight_metrics = dir_.path() + "/straight.jsonl";
  const std::string killed_metrics = dir_.path() + "/killed.jsonl";
  const std::string resumed_metrics = dir_.path() + "/resumed.jsonl";
  auto folders = [](const std::string& dir) {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  RunResult a = Run(straight, 1, {"--metrics-file", straight_metrics});
  ASSERT_THAT(a.exit_codes, ::testing::ElementsAre(0)) << Joined(a);
  EXPECT_THAT(folders(straight.checkpoint_dir),
              ::testing::ElementsAre("latest", "step-10", "step-12"));
  EXPECT_THAT(Joined(a), HasSubstr("removed step-2 (checkpoint.keep_last 2)"));

  auto procs = Launch(killed, 1, {"--metrics-file", killed_metrics});
  ASSERT_EQ(procs.size(), 1u);
  bool saw_checkpoint = false;
  while (auto line = procs[0]->ReadLine(kRunTimeout)) {
    if (absl::StartsWith(*line, "checkpoint step 6 ")) {
      saw_checkpoint = true;
      procs[0]->Signal(SIGKILL);
      break;
    }
  }
  ASSERT_TRUE(saw_checkpoint);
  ASSERT_TRUE(procs[0]->Wait(absl::Seconds(30)).has_value());
  RunResult b = Run(killed, 1, {"--metrics-file", resumed_metrics});
  ASSERT_THAT(b.exit_codes, ::testing::ElementsAre(0)) << Joined(b);
  EXPECT_THAT(Joined(b), HasSubstr("resumed from"));
  const auto expected = ReadLosses(straight_metrics);
  for (const std::string& file : {killed_metrics, resumed_metrics}) {
    for (const auto& [step, loss] : ReadLosses(file)) {
      EXPECT_NEAR(loss, expected.at(step), 1e-6) << file << " step " << step;
    }
  }
  EXPECT_THAT(folders(killed.checkpoint_dir),
              ::testing::ElementsAre("latest", "step-10", "step-12"));
}

TEST_F(TrainerE2eTest, SigtermCheckpointsAndExitsZeroOnEveryRank) {
  v1::JobSpec spec = TinySpec(2, 4);
  spec.mutable_train()->set_steps(100000);
  const Job job = StartJob(spec, "term");
  auto procs = Launch(job, 2, {});
  ASSERT_EQ(procs.size(), 2u);
  std::vector<std::string> lines;
  while (auto line = procs[0]->ReadLine(kRunTimeout)) {
    lines.push_back(*line);
    if (absl::StartsWith(*line, "step 3/")) break;
  }
  procs[1]->Signal(SIGTERM);  // one rank is enough: the ranks agree on it
  RunResult r = Finish(procs, lines);
  EXPECT_THAT(r.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(r);
  EXPECT_THAT(Joined(r), HasSubstr("(SIGTERM)"));
  std::ifstream latest(job.checkpoint_dir + "/latest");
  std::string name;
  latest >> name;
  EXPECT_TRUE(absl::StartsWith(name, "step-")) << name;
}

TEST_F(TrainerE2eTest, MissingDataPathFailsFastNamingIt) {
  v1::JobSpec spec = TinySpec(1, 8);
  const std::string missing = dir_.path() + "/no-such-file.txt";
  spec.mutable_data()->set_path(missing);
  const Job job = StartJob(spec, "missing");
  testing::CommandResult r = testing::RunCommand(Argv(job, 0, 1, {}), {}, absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(missing));
  EXPECT_THAT(r.err, HasSubstr("data.path"));
}

TEST_F(TrainerE2eTest, SeqLenLongerThanTheDataFailsWithAClearMessage) {
  const std::string small = dir_.path() + "/small.txt";
  std::ofstream(small) << "just a few bytes";
  v1::JobSpec spec = TinySpec(1, 8);
  spec.mutable_data()->set_path(small);
  spec.mutable_model()->set_seq_len(64);
  const Job job = StartJob(spec, "small");
  testing::CommandResult r = testing::RunCommand(Argv(job, 0, 1, {}), {}, absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("model.seq_len: 64 needs at least 65 tokens"));
  EXPECT_THAT(r.err, HasSubstr(small));
}

// The hidden benchmark flags' bad values are refused naming the flag (CLI11 leaves a hidden
// option's name out of its own message), as the listed flags' are; numbers out of range say the
// bound (common/cli_checks.h), not CLI11's range up to the largest double.
TEST_F(TrainerE2eTest, HiddenFlagsBadValuesNameTheFlag) {
  const std::string trainer = testing::BinPath("trainyard-trainer");
  struct Case {
    std::vector<std::string> flag;
    std::string error;
  };
  for (const Case& c :
       {Case{{"--loss-chunk-mib", "-5"}, "--loss-chunk-mib: Value -5 not in range 0 to 65536"},
        Case{{"--fused-loss", "bogus"}, "--fused-loss: bogus not in {auto,off}"},
        Case{{"--fused-linear", "on"}, "--fused-linear: on not in {auto,off}"},
        Case{{"--adamw-kernel", "apex"}, "--adamw-kernel: apex not in"},
        Case{{"--peak-tflops", "-1"}, "--peak-tflops: must be >= 0, got -1"},
        Case{{"--world-size", "0"}, "--world-size: must be > 0, got 0"},
        Case{{"--threads", "two"}, "--threads: not a number: two"},
        Case{{"--ps-rpc-timeout", "inf"}, "--ps-rpc-timeout: out of range: inf"},
        Case{{"--inject-overflow-at-step", "1.5"}, "--inject-overflow-at-step:"},
        Case{{"--device", "tpu"}, "--device: tpu not in {cpu,cuda}"}}) {
    std::vector<std::string> argv = {trainer, "--spec", "unused.yaml"};
    argv.insert(argv.end(), c.flag.begin(), c.flag.end());
    testing::CommandResult r = testing::RunCommand(argv);
    EXPECT_NE(r.exit_code, 0) << c.flag[0];
    EXPECT_THAT(r.err, HasSubstr(c.error)) << r.err;
    EXPECT_THAT(r.err, Not(::testing::StartsWith(":"))) << r.err;
  }
}

// A rank's context comes whole, from the worker's RankContext file, or whole from flags: a flag
// beside --context, a missing flag, or a file that is not a context is refused naming it.
TEST_F(TrainerE2eTest, TakesItsContextFromOneFileOrFromFlagsNotBoth) {
  const std::string trainer = testing::BinPath("trainyard-trainer");
  const std::string context = dir_.path() + "/rank-0.pb";
  {
    std::ofstream out(context, std::ios::binary);
    out << "not a context";
  }
  testing::CommandResult beside =
      testing::RunCommand({trainer, "--context", context, "--rank", "1"});
  EXPECT_EQ(beside.exit_code, 2);
  EXPECT_THAT(beside.err, HasSubstr("--rank: not with --context"));
  testing::CommandResult bad = testing::RunCommand({trainer, "--context", context});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("is not a binary trainyard.v1.RankContext"));
  testing::CommandResult missing = testing::RunCommand({trainer, "--rank", "0"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, HasSubstr("--spec: required (or --context FILE)"));
  // A binary spec given by hand is checked as the coordinator checks one (only the worker's
  // context is taken as it is).
  v1::JobSpec broken = TinySpec(1, 8);
  broken.mutable_train()->set_lr(-1);
  const std::string spec = dir_.path() + "/broken.pb";
  {
    std::ofstream out(spec, std::ios::binary);
    out << broken.SerializeAsString();
  }
  testing::CommandResult refused = testing::RunCommand(
      {trainer, "--spec", spec, "--job-id", "j", "--attempt", "1", "--rank", "0", "--world-size",
       "1", "--coordinator", "127.0.0.1:1", "--checkpoint-dir", "", "--threads", "1"});
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_THAT(refused.err, HasSubstr("train.lr: must be in (0, 10], got -1"));
}

// The worker offers GPUs only to a trainer that lists cuda; the default build (Debian's CPU
// LibTorch) trains on CPU only, and a rank that is given a GPU anyway (worker --gpus all) fails at
// once, saying so. (The CUDA build's GPU path: tests/gpu_test.sh, on a GPU machine.)
TEST_F(TrainerE2eTest, SaysItTrainsOnCpuOnlyAndRefusesAGpu) {
  testing::CommandResult devices =
      testing::RunCommand({testing::BinPath("trainyard-trainer"), "--supported-devices"});
  EXPECT_EQ(devices.exit_code, 0) << devices.err;
  EXPECT_EQ(devices.out, "cpu\n");
  const Job job = StartJob(TinySpec(1, 8), "on-gpu");
  testing::CommandResult r =
      testing::RunCommand(Argv(job, 0, 1, {"--device", "cuda"}), {}, absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("--device cuda: this trainer was built with LibTorch"));
  EXPECT_THAT(r.err, HasSubstr("without CUDA"));
}

TEST_F(TrainerE2eTest, AnswersHelpAndVersion) {
  testing::CommandResult v =
      testing::RunCommand({testing::BinPath("trainyard-trainer"), "--version"});
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_THAT(v.out, HasSubstr("trainyard-trainer"));
  testing::CommandResult h = testing::RunCommand({testing::BinPath("trainyard-trainer"), "--help"});
  EXPECT_EQ(h.exit_code, 0);
  EXPECT_THAT(h.out, HasSubstr("--checkpoint-dir"));
  // The tool modes are listed too.
  EXPECT_THAT(h.out, HasSubstr("--export-hf CHECKPOINT_DIR --spec SPEC --out DIR [--merge-lora]"));
  EXPECT_THAT(h.out, HasSubstr("--consolidate-checkpoint DIR/step-N --out DIR"));
}

// Each rank logs which BLAS kernels do its matmuls (they can halve a step's speed), and so does
// --version; OPENBLAS_CORETYPE is reported as the environment's choice.
TEST_F(TrainerE2eTest, ReportsItsBlasKernels) {
  const std::string trainer = testing::BinPath("trainyard-trainer");
  testing::CommandResult v =
      testing::RunCommand({"/usr/bin/env", "-u", "OPENBLAS_CORETYPE", trainer, "--version"});
  ASSERT_EQ(v.exit_code, 0) << v.out;
  EXPECT_THAT(v.out, ::testing::ContainsRegex("BLAS: OpenBLAS .*; kernels [A-Za-z0-9]+\n"));
  EXPECT_THAT(v.out, ::testing::Not(HasSubstr("OPENBLAS_CORETYPE")));

  // Prescott: OpenBLAS's SSE3 kernels, which every x86-64 CPU runs.
  testing::CommandResult chosen =
      testing::RunCommand({trainer, "--version"}, {"OPENBLAS_CORETYPE=Prescott"});
  ASSERT_EQ(chosen.exit_code, 0) << chosen.out;
  EXPECT_THAT(chosen.out, HasSubstr("kernels Prescott (set by OPENBLAS_CORETYPE)"));

  const Job job = StartJob(TinySpec(1, 4), "blas");
  RunResult r = Run(job, 1, {}, {}, {"OPENBLAS_CORETYPE=Prescott"});
  EXPECT_THAT(r.exit_codes, ::testing::ElementsAre(0)) << Joined(r);
  EXPECT_THAT(Joined(r), HasSubstr("kernels Prescott (set by OPENBLAS_CORETYPE)"));
}

// A step's loss and gradient norm come back while the next step runs, so its line is written one
// step later; a step after which something happens (a checkpoint, an evaluation, a stop, the last
// step) is reported before it. Every step is reported once, in order, with its own loss (the
// metrics file's losses are the log's), over two ranks.
TEST_F(TrainerE2eTest, ReportsEachStepOnceAndBeforeItsCheckpointEvaluationOrStop) {
  v1::JobSpec spec = TinySpec(2, 4);
  spec.mutable_train()->set_steps(9);
  spec.mutable_checkpoint()->set_every_steps(3);
  spec.mutable_data()->set_eval_path("/usr/share/common-licenses/GPL-2");
  spec.mutable_train()->set_eval_every(5);
  spec.mutable_train()->set_eval_batches(1);
  const std::string metrics = dir_.path() + "/steps.jsonl";
  // Stopped by --stop-after-steps 7, before its last step: 7 steps reported.
  RunResult r =
      Run(StartJob(spec, "behind"), 2, {"--metrics-file", metrics}, {"--stop-after-steps", "7"});
  ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(r);
  std::vector<std::string> events;  // "step N", "checkpoint N", "eval N", "stop N" in log order
  std::map<int64_t, double> logged;
  const std::regex step_line(R"(^step (\d+)/9 loss ([0-9.]+) )");
  for (const std::string& line : r.lines) {
    std::smatch m;
    int64_t n = 0;
    if (std::regex_search(line, m, step_line)) {
      events.push_back("step " + m[1].str());
      logged[std::stoll(m[1].str())] = std::stod(m[2].str());
    } else if (absl::StartsWith(line, "checkpoint step ") &&
               absl::SimpleAtoi(line.substr(16, 1), &n)) {
      events.push_back("checkpoint " + std::to_string(n));
    } else if (absl::StartsWith(line, "eval step ")) {
      events.push_back("eval " + line.substr(10, line.find(' ', 10) - 10));
    } else if (absl::StartsWith(line, "stopping after step ")) {
      events.push_back("stop " + line.substr(20, line.find(' ', 20) - 20));
    }
  }
  EXPECT_THAT(events, ::testing::ElementsAre("step 1", "step 2", "step 3", "checkpoint 3", "step 4",
                                             "step 5", "eval 5", "step 6", "checkpoint 6", "step 7",
                                             "checkpoint 7", "stop 7"))
      << Joined(r);
  const std::map<int64_t, double> recorded = ReadLosses(metrics);
  ASSERT_EQ(recorded.size(), 7u);
  for (const auto& [step, loss] : recorded) EXPECT_NEAR(logged.at(step), loss, 1e-4) << step;
}

// With TRAINYARD_MATMUL auto, rank 0 times oneDNN and the BLAS on the model's own GEMMs at start,
// says which won and by how much, and every rank takes that path. Each side is made slow in turn,
// by more than any load on the machine hides: OpenBLAS held to its SSE3 kernels (Prescott), then
// oneDNN held to SSE4.1 against OpenBLAS's AVX2 kernels (Haswell: set, since Debian's OpenBLAS
// takes Prescott's for CPUs newer than it knows, as on Intel's AMX Xeons, where its own choice
// and SSE4.1 oneDNN run about even). TRAINYARD_MATMUL pins the path (no timing); a value it does
// not know stops the trainer before its rendezvous.
TEST_F(TrainerE2eTest, ChoosesItsMatmulPathByTimingTheModelsGemms) {
  v1::JobSpec spec = TinySpec(2, 8);
  spec.mutable_model()->set_d_model(256);
  spec.mutable_model()->set_n_head(4);
  spec.mutable_model()->set_seq_len(128);
  spec.mutable_train()->set_steps(2);
  spec.mutable_train()->set_warmup(1);
  const std::regex timed(
      R"(matmuls: (oneDNN|the BLAS): ([0-9.]+) ms a micro-batch's GEMMs \(forward and backward\), )"
      R"((oneDNN|the BLAS) ([0-9.]+) ms \(timed at start)");
  struct Case {
    std::string env, blas_env, winner;
  };
  for (const Case& c :
       {Case{"OPENBLAS_CORETYPE=Prescott", "", "oneDNN"},
        Case{"ONEDNN_MAX_CPU_ISA=SSE41", "OPENBLAS_CORETYPE=Haswell", "the BLAS"}}) {
    const Job job = StartJob(spec, "matmuls");
    std::vector<std::string> env = {"TRAINYARD_MATMUL=auto", c.env};
    if (!c.blas_env.empty()) env.push_back(c.blas_env);
    RunResult r = Run(job, 2, {}, {}, env);
    ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0, 0)) << c.env << "\n" << Joined(r);
    const std::string log = Joined(r);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(log, m, timed)) << c.env << "\n" << log;
    EXPECT_EQ(m[1].str(), c.winner) << c.env << "\n" << m[0];
    EXPECT_LT(std::stod(m[2].str()), std::stod(m[4].str())) << m[0];
  }

  const Job pinned = StartJob(spec, "matmuls");
  RunResult r = Run(pinned, 1, {}, {}, {"TRAINYARD_MATMUL=blas"});
  ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0)) << Joined(r);
  EXPECT_THAT(Joined(r), HasSubstr("matmuls: BLAS (TRAINYARD_MATMUL)"));
  EXPECT_THAT(Joined(r), ::testing::Not(HasSubstr("timed at start")));

  const std::string trainer = testing::BinPath("trainyard-trainer");
  testing::CommandResult version =
      testing::RunCommand({trainer, "--version"}, {"TRAINYARD_MATMUL=auto"});
  EXPECT_THAT(version.out, HasSubstr("or the BLAS, the faster on the model's GEMMs"));
  const Job bad = StartJob(spec, "matmuls");
  RunResult refused = Run(bad, 1, {}, {}, {"TRAINYARD_MATMUL=fastest"});
  EXPECT_THAT(refused.exit_codes, ::testing::ElementsAre(::testing::Ne(0))) << Joined(refused);
}

// MFU (common/mfu.h): with a peak (the worker's TRAINYARD_PEAK_TFLOPS; a GPU's from the table),
// each step's log line, metrics-file line and report to the coordinator carry the model FLOPs
// at its tokens/s over that peak; without one (the CPU), none do.
TEST_F(TrainerE2eTest, ReportsMfuWhereThePeakIsKnown) {
  v1::JobSpec spec = TinySpec(1, 4);
  spec.mutable_train()->set_steps(3);
  const Job job = StartJob(spec, "mfu");
  const std::string metrics = dir_.path() + "/mfu.jsonl";
  RunResult r = Run(job, 1, {"--metrics-file", metrics}, {}, {"TRAINYARD_PEAK_TFLOPS=0.002"});
  ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0)) << Joined(r);
  int64_t parameters = 0;
  for (const std::string& line : r.lines) {
    if (auto at = line.find(" model, "); at != std::string::npos && parameters == 0) {
      ASSERT_TRUE(
          absl::SimpleAtoi(line.substr(at + 8, line.find(' ', at + 8) - at - 8), &parameters))
          << line;
    }
  }
  ASSERT_GT(parameters, 0) << Joined(r);
  const v1::ModelSpec& m = spec.model();
  const double flops =
      6.0 * parameters + 12.0 * m.n_layer() * m.d_model() * m.seq_len();  // a token's
  std::ifstream in(metrics);
  int steps = 0;
  for (std::string line; std::getline(in, line); ++steps) {
    const auto row = nlohmann::json::parse(line);
    ASSERT_TRUE(row.contains("mfu")) << line;
    EXPECT_NEAR(row["mfu"].get<double>(), row["tokens_per_second"].get<double>() * flops / 0.002e12,
                1e-9 * row["mfu"].get<double>())
        << line;
  }
  EXPECT_EQ(steps, 3);
  EXPECT_THAT(Joined(r), ::testing::ContainsRegex("step 3/3 .* mfu [0-9.]+%"));
  // The coordinator has it with each step.
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::StreamMetricsRequest request;
  request.set_job_id(job.id);
  auto reader = jobs_->StreamMetrics(&ctx, request);
  int reported = 0;
  for (v1::StepReport report; reader->Read(&report); ++reported) EXPECT_GT(report.mfu(), 0);
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(reported, 3) << Joined(r);  // (the rank's lines say what its reporter met)

  // No peak: no MFU anywhere (on the CPU; a GPU in the table has one without being told).
  const char* device = std::getenv("TRAINYARD_TEST_DEVICE");
  if ((device != nullptr && std::string(device) != "cpu") ||
      std::getenv("TRAINYARD_PEAK_TFLOPS") != nullptr) {
    return;
  }
  const Job plain = StartJob(spec, "no-mfu");
  const std::string plain_metrics = dir_.path() + "/no-mfu.jsonl";
  RunResult p = Run(plain, 1, {"--metrics-file", plain_metrics});
  ASSERT_THAT(p.exit_codes, ::testing::ElementsAre(0)) << Joined(p);
  EXPECT_THAT(Joined(p), Not(HasSubstr(" mfu ")));
  std::ifstream plain_in(plain_metrics);
  for (std::string line; std::getline(plain_in, line);) EXPECT_THAT(line, Not(HasSubstr("mfu")));
}

// A LoRA job's MFU counts its frozen base weights at 4 FLOPs a token (forward and the input's
// gradient; no weight gradient) and its adapters at 6.
TEST_F(TrainerE2eTest, MfuCountsFrozenWeightsWithoutTheirGradient) {
  v1::JobSpec spec = LlamaSpec(1, 4);
  spec.mutable_train()->set_steps(4);
  auto* lora = spec.mutable_train()->mutable_lora();
  lora->set_r(4);
  lora->set_alpha(8);
  for (const std::string& t : LoraTargetNames()) lora->add_target_modules(t);
  const Job job = StartJob(spec, "lora-mfu");
  const std::string metrics = dir_.path() + "/lora-mfu.jsonl";
  RunResult r = Run(job, 1, {"--metrics-file", metrics}, {}, {"TRAINYARD_PEAK_TFLOPS=0.002"});
  ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0)) << Joined(r);
  int64_t parameters = 0, trainable = 0;
  for (const std::string& line : r.lines) {
    const auto at = line.find(" model, "), paren = line.find(" parameters (");
    if (at == std::string::npos || paren == std::string::npos || parameters != 0) continue;
    ASSERT_TRUE(absl::SimpleAtoi(line.substr(at + 8, paren - at - 8), &parameters)) << line;
    const size_t first = paren + 13;
    ASSERT_TRUE(absl::SimpleAtoi(line.substr(first, line.find(' ', first) - first), &trainable))
        << line;
  }
  ASSERT_GT(parameters, 0) << Joined(r);
  ASSERT_GT(trainable, 0) << Joined(r);
  ASSERT_LT(trainable, parameters / 2) << Joined(r);  // (6 x parameters: a quarter more)
  const v1::ModelSpec& m = spec.model();
  const double flops = 6.0 * trainable + 4.0 * (parameters - trainable) +
                       12.0 * m.n_layer() * m.d_model() * m.seq_len();
  const auto reports = ReadReports(metrics);
  ASSERT_EQ(reports.size(), 4u);
  for (const auto& row : reports) {
    EXPECT_NEAR(row.at("mfu").get<double>(),
                row.at("tokens_per_second").get<double>() * flops / 0.002e12,
                1e-9 * row.at("mfu").get<double>())
        << row.dump();
  }
}

}  // namespace
}  // namespace trainyard
