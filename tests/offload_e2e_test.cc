// The trainer's offload layout end to end (tests/testing/trainer_e2e.h): ranks against real
// parameter servers, their resume, their failures, every server RPC's credential checks.
#include "tests/testing/trainer_e2e.h"

namespace trainyard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using trainer::DumpedParam;

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

}  // namespace
}  // namespace trainyard
