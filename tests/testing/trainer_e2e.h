// The trainer end-to-end tests' fixture (tests/*_e2e_test.cc of the trainer: trainer_e2e_test,
// offload_e2e_test, fsdp_e2e_test, model_e2e_test, pipeline_e2e_test): an in-process coordinator
// (real gRPC on loopback, real SQLite in a temp dir, no background threads) places each job on a
// registered node, which opens the job attempt's rendezvous scope; the tests then start real
// trainer processes that build their Gloo group through it. Tiny models and one thread per rank
// keep each test within a minute on 2 cores. Also the specs the files share (FSDP's variants, a
// Llama checkpoint written for the tests).
#ifndef TRAINYARD_TESTS_TESTING_TRAINER_E2E_H_
#define TRAINYARD_TESTS_TESTING_TRAINER_E2E_H_

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

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using trainer::DumpedParam;

constexpr absl::Duration kRunTimeout = absl::Seconds(120);

inline v1::JobSpec TinySpec(int ranks, int micro_batch) {
  v1::JobSpec s;
  s.set_name("tiny");
  s.mutable_resources()->set_slots(ranks);
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

inline void PrintTo(const FsdpVariant& v, std::ostream* os) { *os << v.name; }

// `v` trained with another optimizer, named `name`.
inline FsdpVariant WithOptimizer(FsdpVariant v, std::string name, v1::Optimizer optimizer) {
  v.name = std::move(name);
  v.optimizer = optimizer;
  return v;
}

inline v1::JobSpec FsdpSpec(const FsdpVariant& v, int ranks, int micro_batch) {
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

// ---------------------------------------------------------------------------------------------
// llama from a Hugging Face checkpoint

// Writes a Hugging Face model directory for llama `m` (config.json, two safetensors shards and
// their index) with values drawn from `seed`: N(0, 0.5), norms near 1. Leaves out the tensor
// `leave_out`. Returns the values by tensor name.
// A Qwen2 checkpoint when `qwen2` (q/k/v biases).
inline std::map<std::string, std::vector<float>> WriteLlamaCheckpoint(
    const std::string& dir, const v1::ModelSpec& m, uint32_t seed,
    const std::string& leave_out = "", bool qwen2 = false) {
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

inline v1::JobSpec LlamaSpec(int ranks, int micro_batch) {
  v1::JobSpec s = TinySpec(ranks, micro_batch);
  s.mutable_model()->set_kind("llama");
  s.mutable_model()->set_n_kv_head(1);
  ApplyJobSpecDefaults(s);
  return s;
}

// `spec` starting from the Hugging Face directory `model_dir`, whose config.json gives rope_theta
// and rms_norm_eps.
inline void UseCheckpoint(v1::JobSpec& spec, const std::string& model_dir) {
  spec.mutable_model()->set_from(model_dir);
  spec.mutable_model()->clear_rope_theta();
  spec.mutable_model()->clear_rms_norm_eps();
}

// The one-rank DDP reference of a two-rank `spec` of micro-batch 4: the same global batch.
inline v1::JobSpec OneRankWholeBatch(const v1::JobSpec& spec) {
  v1::JobSpec one = spec;
  one.mutable_resources()->set_slots(1);
  one.mutable_train()->set_micro_batch(8);
  one.mutable_parallel()->set_strategy(v1::DDP);
  return one;
}

}  // namespace trainyard

#endif  // TRAINYARD_TESTS_TESTING_TRAINER_E2E_H_
