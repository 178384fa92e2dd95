// trainyard-trainer end to end: an in-process coordinator (real gRPC on loopback, real SQLite in a
// temp dir, no background threads) places each job on a registered node, which opens the job
// attempt's rendezvous scope; the test then starts real trainer processes that build their Gloo
// group through it. Checks DDP against a single rank, checkpoint/resume (also after SIGKILL), and
// bad input. Tiny models and one thread per rank keep each test within a minute on 2 cores.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <regex>
#include <tuple>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/grpc_status.h"
#include "common/job_config.h"
#include "common/spec.h"
#include "rpc/ps/data_plane_client.h"
#include "rpc/ps/ps_client.h"
#include "server/coordinator/coordinator_server.h"
#include "tests/testing/coordinator_tokens.h"
#include "tests/testing/node_session.h"
#include "tests/testing/ps_shard.h"
#include "tests/testing/subprocess.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/node.grpc.pb.h"
#include "trainyard/v1/ps.grpc.pb.h"
#include "worker/trainer/io/hf_checkpoint.h"
#include "worker/trainer/io/param_dump.h"
#include "worker/trainer/io/safetensors.h"

namespace trainyard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using trainer::DumpedParam;

constexpr absl::Duration kRunTimeout = absl::Seconds(120);

v1::JobSpec TinySpec(int ranks, int micro_batch) {
  v1::JobSpec s;
  s.set_name("tiny");
  s.mutable_resources()->set_gpus(ranks);
  auto* m = s.mutable_model();
  m->set_kind("gpt");
  m->set_n_layer(2);
  m->set_n_head(2);
  m->set_d_model(32);
  m->set_seq_len(16);
  m->set_vocab(256);
  s.mutable_data()->set_path("/usr/share/common-licenses/GPL-3");
  auto* t = s.mutable_train();
  t->set_steps(10);
  t->set_micro_batch(micro_batch);
  t->set_lr(1e-3);
  t->set_warmup(3);
  t->set_seed(11);
  t->set_weight_decay(0.1);
  t->set_grad_clip(1.0);
  s.mutable_parallel()->set_bucket_mb(0.01);  // several buckets even for this model
  return s;
}

struct Job {
  std::string id;
  int attempt = 0;
  std::string spec_path;
  std::string checkpoint_dir;
};

struct RunResult {
  std::vector<std::string> lines;  // rank 0's stdout
  std::vector<int> exit_codes;     // per rank; -1 if killed or still running
};

class TrainerE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    coordinator::CoordinatorOptions o;
    o.listen_address = "127.0.0.1:0";
    o.state_dir = dir_.path() + "/state";
    o.clock = &clock_;
    o.background_threads = false;
    auto s = coordinator::CoordinatorServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel_);
    tokens_ = std::make_unique<testing::CoordinatorTokens>(server_->identities());
    node_ = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 8);
  }

  void TearDown() override {
    node_.reset();
    if (server_) server_->Shutdown();
  }

  void Prepare(grpc::ClientContext& ctx) {
    testing::Authorize(ctx, tokens_->User("alice"));
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  }

  // Submits `spec` and runs a scheduling pass, so the job is RUNNING with its rendezvous scope
  // open; writes the spec (as the coordinator stored it) for the trainers.
  Job StartJob(const v1::JobSpec& spec, const std::string& name) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::SubmitJobRequest r;
    *r.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(&ctx, r, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(server_->jobs().SchedulePass(), 1);
    v1::Job job;
    grpc::ClientContext get_ctx;
    Prepare(get_ctx);
    v1::GetJobRequest g;
    g.set_job_id(resp.job().id());
    EXPECT_TRUE(jobs_->GetJob(&get_ctx, g, &job).ok());
    EXPECT_EQ(job.state(), v1::RUNNING);
    Job out{job.id(), job.attempt(), dir_.path() + "/" + name + ".spec",
            dir_.path() + "/" + name + "-ckpt"};
    std::ofstream f(out.spec_path, std::ios::binary);
    f << job.spec().SerializeAsString();
    return out;
  }

  std::vector<std::string> Argv(const Job& job, int rank, int world,
                                const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {testing::BinPath("trainyard-trainer"),
                                     "--spec",
                                     job.spec_path,
                                     "--job-id",
                                     job.id,
                                     "--attempt",
                                     std::to_string(job.attempt),
                                     "--rank",
                                     std::to_string(rank),
                                     "--world-size",
                                     std::to_string(world),
                                     "--coordinator",
                                     server_->address(),
                                     "--checkpoint-dir",
                                     job.checkpoint_dir,
                                     "--threads",
                                     "1"};
    // TRAINYARD_TEST_DEVICE=cuda (the CUDA build's gpu_layouts test): every rank on that device,
    // one GPU shared through Gloo (TRAINYARD_COLLECTIVES=gloo: NCCL refuses two ranks on one GPU).
    if (const char* device = std::getenv("TRAINYARD_TEST_DEVICE"); device != nullptr && *device) {
      argv.insert(argv.end(), {"--device", device});
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }

  // Starts every rank; `rank0_extra` flags go to rank 0 only, `every_rank_extra` to all,
  // `extra_env`
  // ("K=V") into every rank's environment.
  std::vector<std::unique_ptr<testing::Subprocess>> Launch(
      const Job& job, int world, const std::vector<std::string>& rank0_extra,
      const std::vector<std::string>& every_rank_extra = {},
      const std::vector<std::string>& extra_env = {}) {
    std::vector<std::unique_ptr<testing::Subprocess>> procs;
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> extra = every_rank_extra;
      if (r == 0) extra.insert(extra.end(), rank0_extra.begin(), rank0_extra.end());
      // The job credential, as the worker hands it to a rank.
      std::vector<std::string> env = extra_env;
      env.push_back(absl::StrCat(kJobCredentialEnv, "=", tokens_->Job(job.id, job.attempt)));
      auto p = testing::Subprocess::Start(Argv(job, r, world, extra), env);
      EXPECT_TRUE(p.ok()) << p.status();
      if (p.ok()) procs.push_back(std::move(*p));
    }
    return procs;
  }

  // Reads every rank's stdout to EOF (so no pipe fills up), then reaps them.
  static RunResult Finish(std::vector<std::unique_ptr<testing::Subprocess>>& procs,
                          std::vector<std::string> rank0_lines = {}) {
    RunResult result;
    result.lines = std::move(rank0_lines);
    for (size_t r = 0; r < procs.size(); ++r) {
      while (auto line = procs[r]->ReadLine(kRunTimeout)) {
        if (r == 0) result.lines.push_back(*line);
      }
      std::optional<int> status = procs[r]->Wait(absl::Seconds(30));
      result.exit_codes.push_back(status.has_value() && WIFEXITED(*status) ? WEXITSTATUS(*status)
                                                                           : -1);
    }
    return result;
  }

  RunResult Run(const Job& job, int world, const std::vector<std::string>& rank0_extra,
                const std::vector<std::string>& every_rank_extra = {},
                const std::vector<std::string>& extra_env = {}) {
    auto procs = Launch(job, world, rank0_extra, every_rank_extra, extra_env);
    return Finish(procs);
  }

  static std::string Joined(const RunResult& r) { return absl::StrJoin(r.lines, "\n"); }

  // The job as the coordinator has it (its placement included).
  v1::Job Stored(const Job& job) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::GetJobRequest g;
    g.set_job_id(job.id);
    v1::Job j;
    EXPECT_TRUE(jobs_->GetJob(&ctx, g, &j).ok());
    return j;
  }

  static std::vector<DumpedParam> ReadDump(const std::string& path) {
    auto params = trainer::ReadParamDump(path);
    EXPECT_TRUE(params.ok()) << params.status();
    return params.ok() ? *params : std::vector<DumpedParam>{};
  }

  // The step reports of a --metrics-file, in order.
  static std::vector<nlohmann::json> ReadReports(const std::string& path) {
    std::vector<nlohmann::json> out;
    std::ifstream f(path);
    std::string line;
    while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line));
    return out;
  }

  // Loss by step from a --metrics-file.
  static std::map<int64_t, double> ReadLosses(const std::string& path) {
    std::map<int64_t, double> out;
    for (const auto& j : ReadReports(path)) {
      out[j.at("step").get<int64_t>()] = j.at("loss").get<double>();
    }
    return out;
  }

  // eval_loss by step from a --metrics-file (the steps an evaluation ran), each line's perplexity
  // checked to be its exp.
  static std::map<int64_t, double> ReadEvalLosses(const std::string& path) {
    std::map<int64_t, double> out;
    for (const auto& j : ReadReports(path)) {
      if (!j.contains("eval_loss")) continue;
      out[j.at("step").get<int64_t>()] = j.at("eval_loss").get<double>();
      EXPECT_NEAR(j.at("eval_perplexity").get<double>(), std::exp(j.at("eval_loss").get<double>()),
                  1e-9);
    }
    return out;
  }

  // ||a - b|| / ||b|| over values [begin, end) of one parameter.
  static double RelativeDifference(const DumpedParam& a, const DumpedParam& b, size_t begin,
                                   size_t end) {
    double diff = 0, norm = 0;
    for (size_t k = begin; k < end; ++k) {
      const double d = double{a.values[k]} - b.values[k];
      diff += d * d;
      norm += double{b.values[k]} * b.values[k];
    }
    return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
  }

  // Every parameter of `a` equals `b`'s within ||a - b|| / ||b|| <= tolerance. With
  // `skip_key_bias`, the key third of each qkv bias (and a k_proj's bias) is left out: softmax is
  // invariant to it, so its true gradient is exactly zero and what it gets is rounding noise, which
  // Adam normalizes into lr-sized steps that differ with the summation order (1 rank vs 2). Its
  // query and value thirds are still checked.
  static void ExpectSameParams(const std::vector<DumpedParam>& a, const std::vector<DumpedParam>& b,
                               double tolerance, bool skip_key_bias = false) {
    ASSERT_EQ(a.size(), b.size());
    ASSERT_FALSE(a.empty());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].name, b[i].name);
      ASSERT_EQ(a[i].shape, b[i].shape) << a[i].name;
      const size_t n = a[i].values.size();
      if (skip_key_bias && absl::EndsWith(a[i].name, ".k_proj.bias")) continue;  // all key
      if (skip_key_bias && absl::EndsWith(a[i].name, ".qkv.bias")) {
        EXPECT_LE(RelativeDifference(a[i], b[i], 0, n / 3), tolerance) << a[i].name << " (q)";
        EXPECT_LE(RelativeDifference(a[i], b[i], 2 * n / 3, n), tolerance) << a[i].name << " (v)";
        continue;
      }
      EXPECT_LE(RelativeDifference(a[i], b[i], 0, n), tolerance) << a[i].name;
    }
  }

  testing::TempDir dir_;
  FakeClock clock_;
  std::unique_ptr<coordinator::CoordinatorServer> server_;
  std::unique_ptr<testing::CoordinatorTokens> tokens_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<testing::NodeSession> node_;  // keeps the node connected
};

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
                            ? "collectives: gloo\n"
                            : "collectives: gloo; fp32 all-reduce through shared memory (2 ranks "
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

// Offload jobs: two real trainyard-ps processes registered with the coordinator, which places
// the job's optimizer state on them; the trainers get the ranges as the worker would pass them.
// The first server has its TCP data plane (what ranks push and pull through by default), the
// second has it off, so every job here also shows the fallback to gRPC.
class OffloadE2eTest : public TrainerE2eTest {
 protected:
  void SetUp() override {
    TrainerE2eTest::SetUp();
    for (int i = 0; i < 2; ++i) {
      auto p = testing::Subprocess::Start(
          {testing::BinPath("trainyard-ps"), "--listen", "127.0.0.1:0", "--coordinator",
           server_->address(), "--node-id", absl::StrCat("ps", i), "--memory-bytes",
           absl::StrCat(int64_t{1} << 30), "--threads", "1", "--data-listen",
           i == 0 ? "127.0.0.1:0" : "off"},
          // its node token: environment, never argv
          {absl::StrCat(kTokenEnv, "=", tokens_->Node(absl::StrCat("ps", i)))});
      ASSERT_TRUE(p.ok()) << p.status();
      auto address = (*p)->ReadLine(absl::Seconds(30));
      ASSERT_TRUE(address.has_value());
      ps_addresses_.push_back(*address);
      ps_.push_back(std::move(*p));
    }
    // Both registered with their sessions attached (only connected servers get shards).
    auto nodes = v1::NodeService::NewStub(channel_);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    int connected = 0;
    while (connected < 2 && absl::Now() < deadline) {
      grpc::ClientContext ctx;
      Prepare(ctx);
      v1::ListNodesResponse r;
      ASSERT_TRUE(nodes->ListNodes(&ctx, {}, &r).ok());
      connected = 0;
      for (const auto& n : r.nodes()) {
        connected += n.role() == v1::PARAMETER_SERVER && n.connected() ? 1 : 0;
      }
      if (connected < 2) absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_EQ(connected, 2);
  }

  void TearDown() override {
    for (auto& p : ps_) {
      p->Signal(SIGTERM);
      EXPECT_TRUE(p->Wait(absl::Seconds(30)).has_value());
    }
    TrainerE2eTest::TearDown();
  }

  // One rank of a long offload job through the servers, started with `flags` and read until its
  // third step (its lines so far in `lines`).
  std::vector<std::unique_ptr<testing::Subprocess>> RunPastThirdStep(
      const std::string& name, const std::vector<std::string>& flags,
      std::vector<std::string>* lines) {
    v1::JobSpec spec = OffloadSpec(1, 8);
    spec.mutable_train()->set_steps(1000000);
    const Job job = StartJob(spec, name);
    std::vector<std::string> all = {"--ps", PsFlag(job)};
    all.insert(all.end(), flags.begin(), flags.end());
    auto procs = Launch(job, 1, all);
    EXPECT_EQ(procs.size(), 1u);
    while (auto line = procs[0]->ReadLine(kRunTimeout)) {
      lines->push_back(*line);
      if (absl::StartsWith(*line, "step 3/")) break;
    }
    return procs;
  }

  // `credential` with the last character of its signature changed.
  static std::string Forged(std::string credential) {
    credential.back() = credential.back() == 'A' ? 'B' : 'A';
    return credential;
  }

  // The --ps flag from the job's placement, as the worker builds it.
  std::string PsFlag(const Job& job) {
    const v1::Job j = Stored(job);
    std::string flag;
    for (const auto& r : j.ps_placement()) {
      absl::StrAppend(&flag, flag.empty() ? "" : ",", r.address(), "=", r.begin(), ":", r.end());
    }
    EXPECT_EQ(j.ps_placement_size(), 2) << "the job's state is split over both servers";
    return flag;
  }

  static v1::JobSpec OffloadSpec(int ranks, int micro_batch) {
    v1::JobSpec s = TinySpec(ranks, micro_batch);
    s.mutable_parallel()->set_strategy(v1::OFFLOAD);
    return s;
  }

  std::vector<std::unique_ptr<testing::Subprocess>> ps_;
  std::vector<std::string> ps_addresses_;  // their gRPC addresses, in the order of ps_
};

// The optimizer on two parameter servers trains exactly what DDP's local AdamW trains, and the
// held-out evaluation of the parameters it pulls back equals DDP's.
TEST_F(OffloadE2eTest, TwoRanksTwoServersMatchDdp) {
  auto with_eval = [](v1::JobSpec s) {
    s.mutable_data()->set_eval_path("/usr/share/common-licenses/Apache-2.0");
    s.mutable_train()->set_eval_every(5);
    s.mutable_train()->set_eval_batches(2);
    return s;
  };
  const Job offload = StartJob(with_eval(OffloadSpec(2, 4)), "offload");
  const Job ddp = StartJob(with_eval(TinySpec(2, 4)), "ddp");
  const std::string ps = PsFlag(offload);
  const std::string offload_dump = dir_.path() + "/offload.params";
  const std::string ddp_dump = dir_.path() + "/ddp.params";
  const std::string offload_metrics = dir_.path() + "/offload.jsonl";
  const std::string ddp_metrics = dir_.path() + "/ddp.jsonl";

  // The ranks' server connections with reno rather than the host's congestion control: the
  // option changes nothing but the TCP behaviour (tests/tcp_congestion_test.cc checks the sockets).
  RunResult ro = Run(offload, 2, {"--dump-params", offload_dump, "--metrics-file", offload_metrics},
                     {"--ps", ps, "--ps-tcp-congestion", "reno"});
  EXPECT_THAT(ro.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(ro);
  EXPECT_THAT(Joined(ro), HasSubstr("step 10/10"));
  EXPECT_THAT(Joined(ro), HasSubstr("parameter-server connections: TCP congestion control reno"));
  // The first server's share through its data plane, the second's over gRPC.
  EXPECT_THAT(Joined(ro), ::testing::ContainsRegex(absl::StrCat(
                              "parameter-server transfers: ", ps_addresses_[0],
                              ": data plane 127\\.0\\.0\\.1:[0-9]+, ", ps_addresses_[1],
                              ": gRPC \\(the server's data plane is off\\)")));
  RunResult rd = Run(ddp, 2, {"--dump-params", ddp_dump, "--metrics-file", ddp_metrics});
  EXPECT_THAT(rd.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(rd);
  const std::map<int64_t, double> offload_eval = ReadEvalLosses(offload_metrics);
  const std::map<int64_t, double> ddp_eval = ReadEvalLosses(ddp_metrics);
  ASSERT_EQ(ddp_eval.size(), 2u);  // steps 5 and 10
  ASSERT_EQ(offload_eval.size(), 2u);
  for (const auto& [step, loss] : ddp_eval) {
    ASSERT_EQ(offload_eval.count(step), 1u) << step;
    EXPECT_NEAR(offload_eval.at(step), loss, 1e-5 * loss) << step;
  }

  // The key third of each qkv bias is left out as in DdpEquivalenceTest: its gradient is rounding
  // noise, which Adam scales up to lr-sized steps, so the last-bit differences between the
  // servers' AdamW kernel and LibTorch's show there and nowhere else.
  ExpectSameParams(ReadDump(offload_dump), ReadDump(ddp_dump), 1e-5, /*skip_key_bias=*/true);
}

// 20 offload steps straight equal 10 steps, a checkpoint (the servers' state pulled into it) and
// a new process that sends the state back to the servers and trains 10 more.
TEST_F(OffloadE2eTest, ResumeFromCheckpointReproducesEveryLoss) {
  v1::JobSpec spec = OffloadSpec(1, 8);
  spec.mutable_train()->set_steps(20);
  const Job straight = StartJob(spec, "straight");
  const Job split = StartJob(spec, "split");
  const std::string straight_metrics = dir_.path() + "/straight.jsonl";
  const std::string split_metrics = dir_.path() + "/split.jsonl";

  RunResult a = Run(straight, 1, {"--ps", PsFlag(straight), "--metrics-file", straight_metrics});
  ASSERT_THAT(a.exit_codes, ::testing::ElementsAre(0)) << Joined(a);
  RunResult b1 =
      Run(split, 1,
          {"--ps", PsFlag(split), "--metrics-file", split_metrics, "--stop-after-steps", "10"});
  ASSERT_THAT(b1.exit_codes, ::testing::ElementsAre(0)) << Joined(b1);
  EXPECT_THAT(Joined(b1), HasSubstr("checkpoint step 10"));
  RunResult b2 = Run(split, 1, {"--ps", PsFlag(split), "--metrics-file", split_metrics});
  ASSERT_THAT(b2.exit_codes, ::testing::ElementsAre(0)) << Joined(b2);
  EXPECT_THAT(Joined(b2), HasSubstr("resumed from"));

  const auto expected = ReadLosses(straight_metrics), got = ReadLosses(split_metrics);
  ASSERT_EQ(expected.size(), 20u);
  ASSERT_EQ(got.size(), 20u);
  for (const auto& [step, loss] : expected) EXPECT_NEAR(got.at(step), loss, 1e-6) << step;
}

// delayed_update: step t's update overlaps step t+1, which computes with the parameters of
// step t-1. So step 1 and 2 both see the initial weights: step 1's loss equals the immediate
// run's, step 2's does not (the immediate run has applied update 1 by then), and training still
// converges.
TEST_F(OffloadE2eTest, DelayedUpdateLagsOneStepAndStillTrains) {
  v1::JobSpec immediate = OffloadSpec(2, 4);
  immediate.mutable_train()->set_steps(40);
  v1::JobSpec delayed = immediate;
  delayed.mutable_parallel()->set_delayed_update(true);
  const Job a = StartJob(immediate, "immediate");
  const Job b = StartJob(delayed, "delayed");
  const std::string a_metrics = dir_.path() + "/immediate.jsonl";
  const std::string b_metrics = dir_.path() + "/delayed.jsonl";
  for (const auto& [job, metrics] : {std::pair{a, a_metrics}, std::pair{b, b_metrics}}) {
    RunResult r = Run(job, 2, {"--metrics-file", metrics}, {"--ps", PsFlag(job)});
    ASSERT_THAT(r.exit_codes, ::testing::ElementsAre(0, 0)) << Joined(r);
  }
  const auto la = ReadLosses(a_metrics), lb = ReadLosses(b_metrics);
  ASSERT_EQ(la.size(), 40u);
  ASSERT_EQ(lb.size(), 40u);
  EXPECT_NEAR(lb.at(1), la.at(1), 1e-6);
  EXPECT_GT(std::abs(lb.at(2) - la.at(2)), 1e-4);
  double first = 0, last = 0;
  for (int s = 1; s <= 5; ++s) first += lb.at(s);
  for (int s = 36; s <= 40; ++s) last += lb.at(s);
  EXPECT_LT(last, first - 5 * 0.5)
      << "mean loss of the first and last 5 steps: " << first / 5 << " -> " << last / 5;
}

// A parameter server that dies mid-run fails the ranks at once with a reason naming it (the
// coordinator then fails or restarts the attempt; CoordinatorServiceTest covers that part). The
// first server: its share goes through the data plane.
TEST_F(OffloadE2eTest, KilledServerFailsTheRanksNamingIt) {
  std::vector<std::string> lines;
  auto procs = RunPastThirdStep("killed", {}, &lines);
  ASSERT_EQ(procs.size(), 1u);
  ps_[0]->Signal(SIGKILL);
  ASSERT_TRUE(ps_[0]->Wait(absl::Seconds(30)).has_value());
  ps_.erase(ps_.begin());  // reaped
  RunResult r = Finish(procs, lines);
  EXPECT_THAT(r.exit_codes, ::testing::ElementsAre(1)) << Joined(r);
  EXPECT_THAT(Joined(r), HasSubstr(absl::StrCat("error: parameter server ", ps_addresses_[0])));
}

// A parameter server that stops answering without closing its connections (SIGSTOP: a hung host)
// fails the rank once a call passes --ps-rpc-timeout, naming the server; the job never stalls.
// Through the data plane (the first server) and over gRPC (the second).
TEST_F(OffloadE2eTest, StoppedServerTimesOutAndFailsTheRanksNamingIt) {
  for (const int stopped : {0, 1}) {
    std::vector<std::string> lines;
    auto procs =
        RunPastThirdStep(absl::StrCat("stopped-", stopped), {"--ps-rpc-timeout", "2"}, &lines);
    ASSERT_EQ(procs.size(), 1u);
    ps_[stopped]->Signal(SIGSTOP);
    const absl::Time since = absl::Now();
    RunResult r = Finish(procs, lines);
    ps_[stopped]->Signal(SIGCONT);  // so that the next round and the fixture can use it
    EXPECT_THAT(r.exit_codes, ::testing::ElementsAre(1)) << Joined(r);
    const std::string reason =
        stopped == 0 ? "data plane 127\\.0\\.0\\.1:[0-9]+: [a-z]+ \\([0-9]+ of [0-9]+ bytes "
                       "[a-z]+\\): deadline exceeded"
                     : "Deadline Exceeded";
    EXPECT_THAT(Joined(r), ::testing::ContainsRegex(absl::StrCat("error: parameter server ",
                                                                 ps_addresses_[stopped],
                                                                 " \\([a-z ]+\\): ", reason)))
        << stopped;
    EXPECT_LT(absl::Now() - since, absl::Seconds(10)) << "one deadline, not one per queued call";
  }
}

// Every RPC of ParameterServerService, and a push on the TCP data plane, with every kind of
// credential: the calls on a job's shard admit only the job credential of its running attempt (a
// refusal changes no shard and echoes no secret); ListShards and GetDataPlane are open.
TEST_F(OffloadE2eTest, EveryServerRpcGetsTheExpectedCodeForEveryCredential) {
  const Job job = StartJob(OffloadSpec(1, 8), "table");
  const v1::Job placed = Stored(job);
  ASSERT_EQ(placed.ps_placement_size(), 2);
  const v1::PsRange range = placed.ps_placement(0).node_id() == "ps0"  // the one with a data plane
                                ? placed.ps_placement(0)
                                : placed.ps_placement(1);
  int64_t total = 0;
  for (const auto& r : placed.ps_placement()) total = std::max(total, r.end());
  // A rank shows each server the attempt's credential for that server (derived from the job
  // credential, which no server is shown).
  const std::string job_credential = tokens_->Job(job.id, job.attempt);
  const std::string own = DeriveServerCredential(job_credential, range.address());
  const std::string forged = Forged(own);
  const v1::PsRange& other_range =
      placed.ps_placement(0).node_id() == "ps0" ? placed.ps_placement(1) : placed.ps_placement(0);
  const std::vector<std::pair<std::string, std::string>> credentials = {
      {"none", ""},
      {"malformed", "tyt.not-a-token"},
      {"forged", forged},
      {"user", tokens_->User("alice")},
      {"admin", tokens_->User("admin")},
      {"node", tokens_->Node(range.node_id())},
      {"job_credential", job_credential},
      {"other_server", DeriveServerCredential(job_credential, other_range.address())},
      {"other_job", DeriveServerCredential(tokens_->Job("job-999", 1), range.address())},
      {"other_attempt",
       DeriveServerCredential(tokens_->Job(job.id, job.attempt + 1), range.address())},
      {"own", own}};
  auto expected = [](bool open, const std::string& name) {
    if (open || name == "own") return grpc::StatusCode::OK;
    if (name == "other_job" || name == "other_attempt" || name == "job_credential" ||
        name == "other_server") {
      return grpc::StatusCode::PERMISSION_DENIED;
    }
    return grpc::StatusCode::UNAUTHENTICATED;
  };
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  const std::vector<float> values(range.end() - range.begin(), 0.25f);
  constexpr int64_t kChunk = 4096;
  // Over gRPC, each call on a channel that carries the credential as the trainer's do.
  auto channel_for = [&](const std::string& token) {
    return ps::CreatePsChannel(range.address(), args, token.empty() ? "" : "Bearer " + token);
  };
  v1::DataPlaneInfo data_plane;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(testing::PsStub(range.address())->GetDataPlane(&ctx, {}, &data_plane).ok());
    ASSERT_FALSE(data_plane.address().empty());
  }
  struct Rpc {
    std::string name;
    bool open;
    std::function<grpc::Status(const std::string& token)> call;
  };
  const std::vector<Rpc> rpcs = {
      {"InitShard", false,
       [&](const std::string& token) {
         const auto channel = channel_for(token);
         auto stub = v1::ParameterServerService::NewStub(channel);
         std::vector<float> params(total, 0.5f);
         return testing::InitShard(
             *stub, testing::ShardHeader(job.id, job.attempt, range.begin(), range.end(), total),
             params, 4096);
       }},
      {"PushGradients", false,
       [&](const std::string& token) {
         const auto channel = channel_for(token);
         grpc::GenericStub stub(channel);
         v1::GradientChunk header;
         header.set_job_id(job.id);
         header.set_attempt(job.attempt);
         header.set_step(1);
         header.set_format(v1::WIRE_FP32);
         v1::PushGradientsResponse response;
         return ps::PushGradientsZeroCopy(stub, header, values.data(), range.begin(), range.end(),
                                          kChunk, absl::Seconds(20), &response);
       }},
      {"data-plane push", false,
       [&](const std::string& token) {
         ps::DataPlaneClient client(data_plane.address(), "", token);
         v1::GradientChunk header;
         header.set_job_id(job.id);
         header.set_attempt(job.attempt);
         header.set_step(1);
         header.set_format(v1::WIRE_FP32);
         v1::PushGradientsResponse response;
         // The same chunks as the gRPC push: a retry of it, found as duplicates.
         return ToGrpcStatus(client.Push(header, values.data(), range.begin(), range.end(), kChunk,
                                         absl::Seconds(20), &response));
       }},
      {"UpdateAndPull", false,
       [&](const std::string& token) {
         const auto channel = channel_for(token);
         grpc::GenericStub stub(channel);
         v1::UpdateAndPullRequest request;
         request.set_job_id(job.id);
         request.set_attempt(job.attempt);
         request.set_step(0);
         request.set_begin(range.begin());
         request.set_end(range.end());
         std::vector<float> out(values.size());
         return ps::UpdateAndPullZeroCopy(stub, request, out.data(), absl::Seconds(20));
       }},
      {"ReadShardState", false,
       [&](const std::string& token) {
         const auto channel = channel_for(token);
         auto stub = v1::ParameterServerService::NewStub(channel);
         grpc::ClientContext ctx;
         v1::ReadShardStateRequest r;
         r.set_job_id(job.id);
         r.set_attempt(job.attempt);
         auto reader = stub->ReadShardState(&ctx, r);
         v1::ShardStateChunk chunk;
         while (reader->Read(&chunk)) {
         }
         return reader->Finish();
       }},
      {"ListShards", true,
       [&](const std::string& token) {
         const auto channel = channel_for(token);
         grpc::ClientContext ctx;
         v1::ListShardsResponse r;
         return v1::ParameterServerService::NewStub(channel)->ListShards(&ctx, {}, &r);
       }},
      {"GetDataPlane", true,
       [&](const std::string& token) {
         const auto channel = channel_for(token);
         grpc::ClientContext ctx;
         v1::DataPlaneInfo r;
         return v1::ParameterServerService::NewStub(channel)->GetDataPlane(&ctx, {}, &r);
       }},
      {"DropJob", false,  // last: it frees the shard
       [&](const std::string& token) {
         const auto channel = channel_for(token);
         grpc::ClientContext ctx;
         v1::DropJobRequest r;
         r.set_job_id(job.id);
         v1::DropJobResponse response;
         return v1::ParameterServerService::NewStub(channel)->DropJob(&ctx, r, &response);
       }},
  };
  auto shards = [&] {  // what a refusal must leave as it was
    auto stub = testing::PsStub(range.address());
    grpc::ClientContext ctx;
    v1::ListShardsResponse r;
    EXPECT_TRUE(stub->ListShards(&ctx, {}, &r).ok());
    return r.SerializeAsString();
  };
  for (const Rpc& rpc : rpcs) {
    for (const auto& [name, token] : credentials) {
      if (expected(rpc.open, name) == grpc::StatusCode::OK) continue;
      const std::string before = shards();
      const grpc::Status s = rpc.call(token);
      EXPECT_EQ(s.error_code(), expected(rpc.open, name))
          << rpc.name << " with " << name << ": " << s.error_message();
      EXPECT_THAT(s.error_message(), Not(HasSubstr(own.substr(own.rfind('.') + 1))))
          << "a refusal never echoes a secret";
      EXPECT_EQ(shards(), before) << rpc.name << " with " << name << " changed a shard";
    }
  }
  for (const Rpc& rpc : rpcs) {
    for (const auto& [name, token] : credentials) {
      if (expected(rpc.open, name) != grpc::StatusCode::OK) continue;
      const grpc::Status s = rpc.call(token);
      EXPECT_TRUE(s.ok()) << rpc.name << " with " << name << ": " << s.error_code() << " "
                          << s.error_message();
    }
  }
}

TEST_F(OffloadE2eTest, RangesThatDoNotCoverTheModelFailFast) {
  const Job job = StartJob(OffloadSpec(1, 8), "short");
  std::string ps = PsFlag(job);
  ps = ps.substr(0, ps.find(','));  // only the first server's range
  testing::CommandResult r =
      testing::RunCommand(Argv(job, 0, 1, {"--ps", ps}), {}, absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--ps: the ranges cover"));
}

TEST_F(OffloadE2eTest, UnknownTcpCongestionOrTransportFailsFastNamingTheFlag) {
  const Job job = StartJob(OffloadSpec(1, 8), "short");
  testing::CommandResult r = testing::RunCommand(
      Argv(job, 0, 1, {"--ps", PsFlag(job), "--ps-tcp-congestion", "no-such-cc"}), {},
      absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--ps-tcp-congestion: \"no-such-cc\" is not a congestion control"));
  r = testing::RunCommand(Argv(job, 0, 1, {"--ps", PsFlag(job), "--ps-transport", "udp"}), {},
                          absl::Seconds(60));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--ps-transport"));
}

// ---------------------------------------------------------------------------------------------
// FSDP

struct FsdpVariant {
  std::string name;
  v1::ShardingStrategy sharding;
  v1::BackwardPrefetch backward_prefetch;
  bool forward_prefetch;
  int world = 2;        // ranks of the FSDP run
  int local_world = 0;  // --local-world-size (HYBRID_SHARD: ranks per node)
  int grad_accum = 1;
  bool activation_checkpointing = false;
  bool tie_weights = false;
  v1::WrapPolicy wrap = v1::TRANSFORMER_BASED_WRAP;
  int64_t min_num_params = 0;
  bool rank0_loading = true;
  std::string model = "gpt";
  bool lora = false;  // train.lora on every projection (llama)
  v1::Optimizer optimizer = v1::ADAMW;
};

void PrintTo(const FsdpVariant& v, std::ostream* os) { *os << v.name; }

// `v` trained with another optimizer, named `name`.
FsdpVariant WithOptimizer(FsdpVariant v, std::string name, v1::Optimizer optimizer) {
  v.name = std::move(name);
  v.optimizer = optimizer;
  return v;
}

v1::JobSpec FsdpSpec(const FsdpVariant& v, int ranks, int micro_batch) {
  v1::JobSpec s = TinySpec(ranks, micro_batch);
  s.mutable_model()->set_kind(v.model);
  s.mutable_model()->set_n_layer(3);
  if (v.model == "mlp") s.mutable_model()->set_d_hidden(48);
  if (v.model == "llama") s.mutable_model()->set_n_kv_head(1);  // grouped-query attention
  s.mutable_model()->set_tie_weights(v.tie_weights);
  s.mutable_train()->set_grad_accum(v.grad_accum);
  s.mutable_train()->set_activation_checkpointing(v.activation_checkpointing);
  s.mutable_train()->set_optimizer(v.optimizer);
  auto* p = s.mutable_parallel();
  p->set_strategy(v1::FSDP);
  p->set_sharding_strategy(v.sharding);
  p->set_backward_prefetch(v.backward_prefetch);
  p->set_forward_prefetch(v.forward_prefetch);
  p->set_auto_wrap_policy(v.wrap);
  if (v.min_num_params > 0) p->set_min_num_params(v.min_num_params);
  p->set_cpu_ram_efficient_loading(v.rank0_loading);
  if (v.lora) {
    auto* lora = s.mutable_train()->mutable_lora();
    lora->set_r(4);
    lora->set_alpha(8);
    for (const std::string& target : LoraTargetNames()) lora->add_target_modules(target);
  }
  return s;
}

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

// ---------------------------------------------------------------------------------------------
// llama from a Hugging Face checkpoint

// Writes a Hugging Face model directory for llama `m` (config.json, two safetensors shards and
// their index) with values drawn from `seed`: N(0, 0.5), norms near 1. Leaves out the tensor
// `leave_out`. Returns the values by tensor name.
// A Qwen2 checkpoint when `qwen2` (q/k/v biases).
std::map<std::string, std::vector<float>> WriteLlamaCheckpoint(const std::string& dir,
                                                               const v1::ModelSpec& m,
                                                               uint32_t seed,
                                                               const std::string& leave_out = "",
                                                               bool qwen2 = false) {
  std::filesystem::create_directories(dir);
  ModelConfig config = ToModelConfig(m);
  if (qwen2) {
    config.family = "qwen2";
    config.qkv_bias = true;
  }
  std::ofstream(dir + "/config.json") << trainer::LlamaConfigJson(config);
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0, 0.5);
  std::map<std::string, std::vector<float>> values;
  std::vector<trainer::SafetensorsEntry> shards[2];
  nlohmann::json index = {{"metadata", {{"total_size", 0}}},
                          {"weight_map", nlohmann::json::object()}};
  const auto tensors = trainer::LlamaTensors(trainer::LlamaConfigOf(config));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.name == leave_out) continue;
    std::vector<float>& v = values[t.name];
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    for (int64_t j = 0; j < n; ++j) {
      v.push_back(absl::StrContains(t.name, "norm") ? 1 + normal(gen) / 5 : normal(gen));
    }
    const int shard = i < tensors.size() / 2 ? 0 : 1;
    shards[shard].push_back({t.name, trainer::SafetensorsDtype::kF32, t.shape,
                             std::string(reinterpret_cast<const char*>(v.data()), n * 4)});
    index["weight_map"][t.name] = absl::StrCat("model-0000", shard + 1, "-of-00002.safetensors");
  }
  for (int shard : {0, 1}) {
    auto bytes = trainer::SerializeSafetensors(std::move(shards[shard]), {{"format", "pt"}});
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    std::ofstream(absl::StrCat(dir, "/model-0000", shard + 1, "-of-00002.safetensors"),
                  std::ios::binary)
        << bytes.value_or("");
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  return values;
}

v1::JobSpec LlamaSpec(int ranks, int micro_batch) {
  v1::JobSpec s = TinySpec(ranks, micro_batch);
  s.mutable_model()->set_kind("llama");
  s.mutable_model()->set_n_kv_head(1);
  ApplyJobSpecDefaults(s);
  return s;
}

// `spec` starting from the Hugging Face directory `model_dir`, whose config.json gives rope_theta
// and rms_norm_eps.
void UseCheckpoint(v1::JobSpec& spec, const std::string& model_dir) {
  spec.mutable_model()->set_from(model_dir);
  spec.mutable_model()->clear_rope_theta();
  spec.mutable_model()->clear_rms_norm_eps();
}

// The one-rank DDP reference of a two-rank `spec` of micro-batch 4: the same global batch.
v1::JobSpec OneRankWholeBatch(const v1::JobSpec& spec) {
  v1::JobSpec one = spec;
  one.mutable_resources()->set_gpus(1);
  one.mutable_train()->set_micro_batch(8);
  one.mutable_parallel()->set_strategy(v1::DDP);
  return one;
}

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
  staged.mutable_resources()->set_gpus(4);
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
    RunResult r = Run(job, spec.resources().gpus(), {"--metrics-file", metrics}, every_rank);
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
      s.resources().gpus() / (s.parallel().pipeline_stages() * s.parallel().tensor_parallel());
  s.mutable_resources()->set_gpus(1);
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

}  // namespace
}  // namespace trainyard
