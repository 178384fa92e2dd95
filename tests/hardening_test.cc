// What an outside tester broke (issue 38), each over the wire against a real in-process
// coordinator (SQLite store, loopback gRPC, FakeClock): an owners-limited parameter server gets
// only its owners' shards; refused fields never forge a log line; oversized fields are refused
// naming them and listings keep working; the queued-job, token and rendezvous caps; a
// flood of bad credentials is throttled and counted while valid ones from its address pass; another
// user's job answers as a missing one; the state directory and its files are the coordinator's
// alone, and nothing is written before the flags are checked; the JSON-lines audit log.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/yard_client.h"
#include "common/credentials.h"
#include "common/failpoint.h"
#include "common/log_text.h"
#include "server/coordinator/coordinator_server.h"
#include "server/coordinator/services.h"
#include "tests/testing/coordinator_fixture.h"
#include "tests/testing/http_get.h"
#include "tests/testing/node_session.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"

namespace trainyard::coordinator {
namespace {

using grpc::StatusCode;
using ::testing::HasSubstr;
using ::testing::Not;

class HardeningTest : public testing::CoordinatorFixture {
 protected:
  void Configure(CoordinatorOptions& options) override {
    options.metrics_address = "127.0.0.1:0";
    options.limits.max_queued_jobs_per_user = 20;
    options.limits.max_tokens_per_user = 5;
    options.limits.max_kept_checkpoints = 4;
    options.limits.rendezvous.max_keys = 4;
    options.limits.rendezvous.max_bytes = 1000;
    options.limits.rendezvous.max_value_bytes = 600;
    options.audit_log = dir_.path() + "/audit.jsonl";
  }

  static void Prepare(grpc::ClientContext& ctx, const std::string& token) {
    testing::Authorize(ctx, token);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  }

  grpc::Status Submit(const std::string& token, const v1::JobSpec& spec, v1::Job* job = nullptr) {
    grpc::ClientContext ctx;
    Prepare(ctx, token);
    v1::SubmitJobRequest r;
    *r.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(&ctx, r, &resp);
    if (job != nullptr) *job = resp.job();
    return s;
  }

  grpc::Status GetJob(const std::string& token, const std::string& id) {
    grpc::ClientContext ctx;
    Prepare(ctx, token);
    v1::GetJobRequest r;
    r.set_job_id(id);
    v1::Job job;
    return jobs_->GetJob(&ctx, r, &job);
  }

  grpc::Status WhoAmI(const std::string& token,
                      const std::vector<std::pair<std::string, std::string>>& metadata = {}) {
    grpc::ClientContext ctx;
    Prepare(ctx, token);
    for (const auto& [key, value] : metadata) ctx.AddMetadata(key, value);
    v1::WhoAmIResponse resp;
    return identity_->WhoAmI(&ctx, {}, &resp);
  }

  grpc::Status CreateToken(const std::string& token, std::string* id = nullptr) {
    grpc::ClientContext ctx;
    Prepare(ctx, token);
    v1::CreateTokenRequest r;
    v1::CreateTokenResponse resp;
    grpc::Status s = identity_->CreateToken(&ctx, r, &resp);
    if (id != nullptr) *id = resp.info().id();
    return s;
  }

  // A running attempt of one of alice's jobs on node n1.
  v1::Job RunningJob() {
    node_ = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 2);
    v1::Job job;
    EXPECT_TRUE(Submit(tokens_->User("alice"), testing::TinySpec("succeed", 1), &job).ok());
    EXPECT_EQ(server_->jobs().SchedulePass(), 1);
    auto running = server_->jobs().Get(job.id());
    EXPECT_TRUE(running.ok());
    return running.ok() ? *running : job;
  }

  std::unique_ptr<testing::NodeSession> node_;
};

v1::JobSpec OffloadSpec(const std::string& name) {
  v1::JobSpec s = testing::TinySpec(name, 1);
  s.mutable_parallel()->set_strategy(v1::OFFLOAD);
  return s;
}

// --max-kept-checkpoints: a spec keeping more checkpoints than the cluster allows, or every one,
// is refused naming checkpoint.keep_last; within it (and the default 3) it is taken.
TEST_F(HardeningTest, ASpecKeepingMoreCheckpointsThanTheClusterCapIsRefused) {
  const std::string alice = tokens_->User("alice");
  v1::JobSpec spec = testing::TinySpec("keeps", 1);
  spec.mutable_checkpoint()->set_keep_last(5);
  grpc::Status s = Submit(alice, spec);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "checkpoint.keep_last: this cluster keeps at most 4 checkpoints per job; got 5");
  spec.mutable_checkpoint()->set_keep_last(0);
  s = Submit(alice, spec);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("got 0 (every one)"));
  spec.mutable_checkpoint()->set_keep_last(4);
  EXPECT_TRUE(Submit(alice, spec).ok());
  spec.mutable_checkpoint()->clear_keep_last();  // the default, 3
  EXPECT_TRUE(Submit(alice, spec).ok());
}

TEST_F(HardeningTest, AnOwnersLimitedParameterServerNeverGetsAnotherOwnersShards) {
  tokens_->User("bob");
  auto worker = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 2);
  // An admin gives bob a node token for his own jobs; bob runs a parameter server with it.
  auto bob_node = server_->identities().CreateToken("admin", "bobps", 0, "bob's", {"bob"});
  ASSERT_TRUE(bob_node.ok()) << bob_node.status();
  v1::RegisterNodeRequest r;
  r.set_node_id("bobps");
  r.set_hostname("localhost");
  r.set_address("127.0.0.1:9");
  r.set_memory_bytes(int64_t{1} << 30);
  r.set_role(v1::PARAMETER_SERVER);
  r.add_owners("bob");
  auto bobps = testing::NodeSession::ConnectWith(channel_, bob_node->text, r);

  // Alone, it takes no job of alice's: her offload job is refused at once, storing nothing.
  v1::Job refused;
  grpc::Status s = Submit(tokens_->User("alice"), OffloadSpec("alice-1"), &refused);
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("none that takes alice's jobs"));

  // With a server for everyone beside it, alice's shards all go there; bob's may use both.
  auto shared = testing::NodeSession::ConnectParameterServer(channel_, tokens_->Node("ps-any"),
                                                             "ps-any", 500000, "127.0.0.1:10");
  v1::Job alice_job, bob_job;
  ASSERT_TRUE(Submit(tokens_->User("alice"), OffloadSpec("alice-2"), &alice_job).ok());
  ASSERT_TRUE(Submit(tokens_->User("bob"), OffloadSpec("bob-1"), &bob_job).ok());
  ASSERT_EQ(server_->jobs().SchedulePass(), 2);
  auto alice_placed = server_->jobs().Get(alice_job.id());
  auto bob_placed = server_->jobs().Get(bob_job.id());
  ASSERT_TRUE(alice_placed.ok() && bob_placed.ok());
  ASSERT_GE(alice_placed->ps_placement_size(), 1);
  for (const v1::PsRange& range : alice_placed->ps_placement()) {
    EXPECT_EQ(range.node_id(), "ps-any");
  }
  bool bob_on_bobps = false;
  for (const v1::PsRange& range : bob_placed->ps_placement()) {
    bob_on_bobps = bob_on_bobps || range.node_id() == "bobps";
  }
  EXPECT_TRUE(bob_on_bobps) << bob_placed->DebugString();

  // bob's server cannot vouch for alice's credential: it holds no range of her job.
  grpc::ClientContext ctx;
  Prepare(ctx, bob_node->text);
  v1::VerifyJobCredentialRequest verify;
  verify.set_credential(DeriveServerCredential(
      tokens_->Job(alice_job.id(), alice_placed->attempt()), "127.0.0.1:10"));
  v1::VerifyJobCredentialResponse verified;
  EXPECT_EQ(nodes_->VerifyJobCredential(&ctx, verify, &verified).error_code(),
            StatusCode::PERMISSION_DENIED);
}

TEST_F(HardeningTest, ANodeTakingOnlySomeOwnersJobsNeedsATokenNamingThem) {
  auto try_register = [&](const std::string& token, const std::vector<std::string>& owners) {
    grpc::ClientContext ctx;
    Prepare(ctx, token);
    v1::RegisterNodeRequest r;
    r.set_node_id("w9");
    r.set_hostname("localhost");
    r.add_devices()->set_kind(v1::CPU_SLOT);
    for (const std::string& o : owners) r.add_owners(o);
    v1::RegisterNodeResponse resp;
    return nodes_->RegisterNode(&ctx, r, &resp);
  };
  // A token for any user's jobs (a root worker's) may not register as bob's only.
  const grpc::Status s = try_register(tokens_->Node("w9"), {"bob"});
  EXPECT_EQ(s.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("yard admin token create --node w9 --owners bob"));
  auto limited = server_->identities().CreateToken("admin", "w9", 0, "", {"bob", "carol"});
  ASSERT_TRUE(limited.ok());
  EXPECT_EQ(try_register(limited->text, {"bob", "alice"}).error_code(),
            StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(try_register(limited->text, {"bob"}).ok());
  EXPECT_TRUE(try_register(tokens_->Node("w9"), {}).ok());
}

TEST_F(HardeningTest, ADeniedNodeLosesItsSessionAndCannotComeBackUntilAllowed) {
  auto n1 = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 1);
  const std::string& admin = tokens_->User("admin", v1::ADMIN);
  auto deny = [&](bool allow) {
    grpc::ClientContext ctx;
    Prepare(ctx, admin);
    v1::DenyNodeRequest r;
    r.set_node("n1");
    r.set_reason("its host was compromised");
    r.set_allow(allow);
    v1::DeniedNode resp;
    return identity_->DenyNode(&ctx, r, &resp);
  };
  ASSERT_TRUE(deny(false).ok());
  // Its open session ends at its next heartbeat.
  v1::NodeMessage hb;
  hb.mutable_heartbeat()->set_seq(1);
  n1->Write(hb);
  const grpc::Status ended = n1->Finish();
  EXPECT_EQ(ended.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(ended.error_message(), HasSubstr("node n1 is denied"));
  // Its token no longer counts; the denial survives in the store and is listed.
  grpc::ClientContext ctx;
  Prepare(ctx, tokens_->Node("n1"));
  v1::RegisterNodeRequest r;
  r.set_node_id("n1");
  r.add_devices()->set_kind(v1::CPU_SLOT);
  v1::RegisterNodeResponse resp;
  const grpc::Status refused = nodes_->RegisterNode(&ctx, r, &resp);
  EXPECT_EQ(refused.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(refused.error_message(), HasSubstr("yard admin node allow n1"));
  ASSERT_EQ(server_->identities().ListDeniedNodes().size(), 1u);
  EXPECT_EQ(server_->identities().ListDeniedNodes()[0].reason(), "its host was compromised");
  EXPECT_EQ(server_->identities().ListDeniedNodes()[0].denied_by(), "admin");
  // Lifted, it comes back.
  ASSERT_TRUE(deny(true).ok());
  auto again = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 1);
  EXPECT_TRUE(server_->identities().ListDeniedNodes().empty());
}

TEST_F(HardeningTest, TrainyardPsRegistersTheOwnersItIsGivenWithinItsToken) {
  auto token = server_->identities().CreateToken("admin", "bobps", 0, "bob's", {"bob"});
  ASSERT_TRUE(token.ok()) << token.status();
  const std::string token_file = dir_.path() + "/bobps.token";
  ASSERT_TRUE(WriteSecretFile(token_file, token->text).ok());
  auto ps = testing::Subprocess::Start({testing::BinPath("trainyard-ps"), "--listen", "127.0.0.1:0",
                                        "--coordinator", server_->address(), "--node-id", "bobps",
                                        "--owners", "bob", "--token-file", token_file,
                                        "--memory-bytes", "1000000", "--data-listen", "off"});
  ASSERT_TRUE(ps.ok()) << ps.status();
  // Registered once the coordinator lists it (the server registers right after it serves).
  std::optional<v1::Node> registered;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       !registered.has_value() && absl::Now() < deadline;) {
    for (const v1::Node& n : server_->nodes().List()) {
      if (n.id() == "bobps" && n.connected()) registered = n;
    }
    if (!registered.has_value()) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(registered.has_value());
  EXPECT_EQ(registered->role(), v1::PARAMETER_SERVER);
  EXPECT_THAT(std::vector<std::string>(registered->owners().begin(), registered->owners().end()),
              ::testing::ElementsAre("bob"));
  // Its node token allows bob's jobs only: without --owners it is refused, saying why.
  // (It retries with backoff; killed after 5 s, its log holds the refusal.)
  const testing::CommandResult bare =
      testing::RunCommand({testing::BinPath("trainyard-ps"), "--listen", "127.0.0.1:0",
                           "--coordinator", server_->address(), "--node-id", "bobps",
                           "--token-file", token_file, "--data-listen", "off"},
                          {}, absl::Seconds(5));
  EXPECT_THAT(bare.err, HasSubstr("owners: the node token allows only the jobs of bob"));
}

// Captures what the coordinator logs, through the servers' escaping formatter, for one test.
class LogCapture {
 public:
  LogCapture() : previous_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
    sink->set_formatter(EscapingFormatter());
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  }
  ~LogCapture() { spdlog::set_default_logger(previous_); }
  std::vector<std::string> Lines() {
    spdlog::default_logger()->flush();
    return absl::StrSplit(out_.str(), '\n', absl::SkipEmpty());
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::logger> previous_;
};

TEST_F(HardeningTest, ANewlineInARefusedFieldNeverStartsALogLine) {
  const std::string forged = "x\naudit: user admin CreateUser \"mallory\" -> OK\r\x1b[2Kforged";
  LogCapture capture;
  const std::string& alice = tokens_->User("alice");
  {
    grpc::ClientContext ctx;
    Prepare(ctx, alice);
    v1::ListJobsRequest r;
    r.set_owner(forged);
    v1::ListJobsResponse resp;
    EXPECT_EQ(jobs_->ListJobs(&ctx, r, &resp).error_code(), StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    Prepare(ctx, alice);
    v1::GetQuotaRequest r;
    r.set_user(forged);
    v1::QuotaReport resp;
    EXPECT_EQ(jobs_->GetQuota(&ctx, r, &resp).error_code(), StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    Prepare(ctx, alice);
    v1::CreateTokenRequest r;
    r.set_user(forged);
    v1::CreateTokenResponse resp;
    EXPECT_EQ(identity_->CreateToken(&ctx, r, &resp).error_code(), StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->User("admin", v1::ADMIN));
    v1::CreateUserRequest r;
    r.set_name(forged);
    v1::User resp;
    EXPECT_EQ(identity_->CreateUser(&ctx, r, &resp).error_code(), StatusCode::INVALID_ARGUMENT);
  }
  const std::vector<std::string> lines = capture.Lines();
  ASSERT_GE(lines.size(), 4u);
  int escaped = 0;
  for (const std::string& line : lines) {
    // Every line is one of ours: "[date time] [logger] [level] ...", nothing else.
    EXPECT_EQ(line.rfind("[20", 0), 0u) << line;
    EXPECT_THAT(line, Not(HasSubstr("\r")));
    EXPECT_THAT(line, Not(HasSubstr("\x1b")));
    escaped += line.find("x\\naudit: user admin") != std::string::npos;
  }
  EXPECT_GE(escaped, 4);
}

// A coordinator whose job listings page at 20,000 bytes: pages of two large jobs.
class HardeningListingTest : public HardeningTest {
 protected:
  void Configure(CoordinatorOptions& options) override {
    HardeningTest::Configure(options);
    options.limits.max_list_bytes = 20'000;
  }
};

TEST_F(HardeningListingTest, OversizedFieldsAreRefusedNamingThemAndListingsKeepWorking) {
  const std::string& alice = tokens_->User("alice");
  v1::JobSpec big = testing::TinySpec("big", 1);
  big.mutable_data()->set_path(std::string(1 << 20, 'a'));
  grpc::Status s = Submit(alice, big);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("data.path: 1048576 bytes, at most 4096"));

  v1::Job job;
  ASSERT_TRUE(Submit(alice, testing::TinySpec("ok", 1), &job).ok());
  {
    grpc::ClientContext ctx;
    Prepare(ctx, alice);
    v1::CancelJobRequest r;
    r.set_job_id(job.id());
    r.set_reason(std::string(3 << 20, 'r'));
    v1::Job resp;
    s = jobs_->CancelJob(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("reason: 3145728 bytes, at most"));
  }
  auto kept = server_->jobs().Get(job.id());
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->state(), v1::QUEUED);  // the refusal changed nothing

  // Large jobs, listed by an admin page after page: every page stays within its byte budget.
  v1::JobSpec large = testing::TinySpec("large", 1);
  large.mutable_data()->set_path("/" + std::string(4000, 'p'));
  large.mutable_data()->set_loss_mask("/" + std::string(4000, 'm'));
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(Submit(alice, large).ok());
  // (This fixture's pages end at 20,000 bytes: two such jobs.)
  std::string token;
  int listed = 0, pages = 0;
  do {
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->User("admin", v1::ADMIN));
    v1::ListJobsRequest r;
    r.set_page_size(1000);
    r.set_page_token(token);
    v1::ListJobsResponse resp;
    ASSERT_TRUE(jobs_->ListJobs(&ctx, r, &resp).ok());
    EXPECT_LE(resp.ByteSizeLong(), 20'000u + 9'000u);
    listed += resp.jobs_size();
    ++pages;
    token = resp.next_page_token();
  } while (!token.empty());
  EXPECT_EQ(listed, 7);
  EXPECT_GE(pages, 3);
}

TEST_F(HardeningTest, TheQueuedJobOverTheDefaultCapIsRefused) {
  const std::string& alice = tokens_->User("alice");
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(Submit(alice, testing::TinySpec(absl::StrCat("q", i), 1)).ok()) << i;
  }
  grpc::Status s = Submit(alice, testing::TinySpec("q20", 1));
  EXPECT_EQ(s.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("has 20 jobs queued, its cap of 20"));
  EXPECT_THAT(s.error_message(), HasSubstr("--max-queued-jobs-per-user"));
  // Another user is not held back, and alice's quota shows the cap.
  EXPECT_TRUE(Submit(tokens_->User("bob"), testing::TinySpec("b", 1)).ok());
  grpc::ClientContext ctx;
  Prepare(ctx, alice);
  v1::QuotaReport quota;
  ASSERT_TRUE(jobs_->GetQuota(&ctx, {}, &quota).ok());
  EXPECT_EQ(quota.max_queued_jobs(), 20);
  EXPECT_EQ(quota.queued_jobs(), 20);
}

TEST_F(HardeningTest, APerUserTokenCapRefusesTheNextTokenUntilOneIsRevoked) {
  const std::string& alice = tokens_->User("alice");  // her first token
  std::string id;
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(CreateToken(alice, &id).ok()) << i;
  grpc::Status s = CreateToken(alice);
  EXPECT_EQ(s.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("holds 5 API tokens"));
  ASSERT_TRUE(server_->identities().RevokeToken(id).ok());
  EXPECT_TRUE(CreateToken(alice).ok());
  // Node tokens are not capped: a cluster has one per node.
  for (int i = 0; i < 8; ++i) tokens_->Node(absl::StrCat("node", i));
}

TEST_F(HardeningTest, TheRendezvousRefusesTheKeyOrByteOverItsCap) {
  const v1::Job job = RunningJob();
  ASSERT_EQ(job.state(), v1::RUNNING);
  const std::string credential = tokens_->Job(job.id(), job.attempt());
  auto set = [&](const std::string& key, const std::string& value) {
    grpc::ClientContext ctx;
    Prepare(ctx, credential);
    v1::SetRequest r;
    r.mutable_scope()->set_job_id(job.id());
    r.mutable_scope()->set_attempt(job.attempt());
    r.set_key(key);
    r.set_value(value);
    v1::SetResponse resp;
    return rdzv_->Set(&ctx, r, &resp);
  };
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(set(absl::StrCat("k", i), "v").ok()) << i;
  grpc::Status s = set("k4", "v");
  EXPECT_EQ(s.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--rendezvous-max-keys"));
  EXPECT_TRUE(set("k0", "again").ok());  // an existing key may change
  s = set("k1", std::string(601, 'x'));
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("value: 601 bytes, at most 600"));
  ASSERT_TRUE(set("k1", std::string(600, 'x')).ok());
  s = set("k2", std::string(600, 'x'));  // 1200 bytes in all
  EXPECT_EQ(s.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--rendezvous-max-bytes"));
  s = set(std::string(513, 'k'), "v");
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("key: 513 bytes, at most 512"));
  // Deleting frees room.
  grpc::ClientContext ctx;
  Prepare(ctx, credential);
  v1::DeleteKeyRequest del;
  del.mutable_scope()->set_job_id(job.id());
  del.mutable_scope()->set_attempt(job.attempt());
  del.set_key("k1");
  v1::DeleteKeyResponse deleted;
  ASSERT_TRUE(rdzv_->DeleteKey(&ctx, del, &deleted).ok());
  EXPECT_TRUE(set("k2", std::string(600, 'x')).ok());
}

TEST_F(HardeningTest, ALongLogLineIsCutAndALargeStepReportRefused) {
  const v1::Job job = RunningJob();
  ASSERT_EQ(job.state(), v1::RUNNING);
  const std::string credential = tokens_->Job(job.id(), job.attempt());
  // A rank's 100 KB line reaches its owner cut to 16 KiB, saying so; the next line is whole.
  v1::NodeMessage m;
  auto* l = m.mutable_logs();
  l->set_job_id(job.id());
  l->set_attempt(job.attempt());
  l->set_rank(0);
  l->add_lines(std::string(100'000, 'x'));
  l->add_lines("after");
  ASSERT_TRUE(node_->Write(m));
  node_->Heartbeat();  // processed in order: the lines are in before the ack
  grpc::ClientContext ctx;
  Prepare(ctx, tokens_->User("alice"));
  v1::StreamLogsRequest r;
  r.set_job_id(job.id());
  auto reader = jobs_->StreamLogs(&ctx, r);
  v1::LogLine line;
  ASSERT_TRUE(reader->Read(&line));
  EXPECT_EQ(line.text(), std::string(16 * 1024, 'x') + " [truncated " +
                             std::to_string(100'000 - 16 * 1024) + " bytes]");
  ASSERT_TRUE(reader->Read(&line));
  EXPECT_EQ(line.text(), "after");
  reader->Finish().IgnoreError();

  // A step report beyond its limits (here: 10,000 per-stage idle times) is refused naming them.
  grpc::ClientContext report_ctx;
  Prepare(report_ctx, credential);
  v1::StepReport report;
  report.set_job_id(job.id());
  report.set_attempt(job.attempt());
  report.set_step(1);
  for (int i = 0; i < 10'000; ++i) report.add_pipeline_stage_idle(0.5);
  v1::TrainerCommands commands;
  const grpc::Status s = trainer_->ReportStep(&report_ctx, report, &commands);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("pipeline_stage_idle: 10000 entries, at most 1024"));
}

TEST_F(HardeningTest, AMalformedRequestIsInvalidArgumentNotInternal) {
  grpc::GenericStub generic(channel_);
  // `bytes` as the request of `method`, sent as they are; the call's status.
  auto call_raw = [&](const std::string& method, const std::string& bytes) {
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->User("alice"));
    const grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::CompletionQueue cq;
    auto call = generic.PrepareUnaryCall(&ctx, method, request, &cq);
    call->StartCall();
    grpc::Status status;
    call->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return status;
  };
  // Bytes that are no protobuf message: a field of wire type 7, which does not exist.
  for (const char* method :
       {"/trainyard.v1.JobService/SubmitJob", "/trainyard.v1.IdentityService/CreateToken",
        "/trainyard.v1.RendezvousService/Set"}) {
    const grpc::Status status = call_raw(method, "\x0f\xff\xff\xff");
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << method << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("request: not a valid trainyard.v1.")) << method;
  }
  // A method that does not exist stays UNIMPLEMENTED.
  EXPECT_EQ(call_raw("/trainyard.v1.JobService/NoSuchMethod", "").error_code(),
            StatusCode::UNIMPLEMENTED);
}

// Failures are throttled, not addresses (issue 52): a client flooding bad credentials from the
// address every test client shares (127.0.0.1) gets RESOURCE_EXHAUSTED past its burst, while a
// valid token, the very token id it guesses at, and a node registering from the same address are
// all taken in the middle of the flood.
TEST_F(HardeningTest, AFloodOfBadCredentialsIsThrottledWhileValidOnesFromTheSameAddressPass) {
  const std::string alice = tokens_->User("alice");
  const std::string bob = tokens_->User("bob");
  const std::string node_token = tokens_->Node("n1");
  std::string wrong = alice;
  wrong.back() = wrong.back() == 'A' ? 'B' : 'A';
  for (int i = 0; i < 10; ++i) EXPECT_EQ(WhoAmI(wrong).error_code(), StatusCode::UNAUTHENTICATED);
  grpc::Status s = WhoAmI(wrong);
  EXPECT_EQ(s.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("too many failed authentications"));
  // The guessed-at token id, with its right secret, and another user's token are taken.
  EXPECT_TRUE(WhoAmI(alice).ok());
  EXPECT_TRUE(WhoAmI(bob).ok());

  // The address's own budget (30 failures, 10 used above) runs out on unknown ids...
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(WhoAmI(absl::StrCat("tyt.nosuchid", i, ".secret")).error_code(),
              StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(WhoAmI("tyt.nosuchid99.secret").error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(WhoAmI("not a token").error_code(), StatusCode::RESOURCE_EXHAUSTED);
  // ...and still every valid credential from it passes: users, a node's registration and its
  // session, a job's own credential.
  EXPECT_TRUE(WhoAmI(bob).ok());
  EXPECT_TRUE(WhoAmI(alice).ok());
  const v1::Job running = RunningJob();  // registers n1 and starts a job on it
  ASSERT_EQ(running.state(), v1::RUNNING);
  EXPECT_EQ(WhoAmI("tyt.nosuchid100.secret").error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(WhoAmI(node_token).ok());
  EXPECT_TRUE(WhoAmI(tokens_->Job(running.id(), running.attempt())).ok());
  // One failure is forgiven a second; the held answers were not counted against the address.
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(WhoAmI("tyt.nosuchid101.secret").error_code(), StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(WhoAmI("tyt.nosuchid102.secret").error_code(), StatusCode::RESOURCE_EXHAUSTED);

  auto metrics = testing::HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, HasSubstr("trainyard_auth_failures_total{reason=\"guess\"} 31"));
  EXPECT_THAT(*metrics, HasSubstr("trainyard_auth_failures_total{reason=\"throttled\"} 5"));
}

// An IPv6 peer's failures count under its /64 by default, and under the address itself with
// --auth-peer-ipv6-prefix 128: the option reaches the registry's ClientOf, which makes both keys
// the throttle counts a call's failures under (its peer's, or the browser's a console call
// names). (The tests' clients reach the coordinator over IPv4 loopback: the key's use by a
// call is HardeningTest.AFloodOfBadCredentials...'s.)
class HardeningPerAddressTest : public HardeningTest {
 protected:
  void Configure(CoordinatorOptions& options) override {
    HardeningTest::Configure(options);
    options.limits.auth_peer_ipv6_prefix = 128;
  }
};

TEST_F(HardeningTest, AnIpv6PeersFailuresCountUnderItsSlash64) {
  EXPECT_EQ(server_->identities().ClientOf("ipv6:[2001:db8:1:2::7]:5000"),
            "ipv6:2001:db8:1:2::/64");
}

TEST_F(HardeningPerAddressTest, AnIpv6PeersFailuresCountUnderItsAddressWithPrefix128) {
  EXPECT_EQ(server_->identities().ClientOf("ipv6:[2001:db8:1:2::7]:5000"),
            "ipv6:2001:db8:1:2::7/128");
  EXPECT_NE(server_->identities().ClientOf("2001:db8:1:2::7"),
            server_->identities().ClientOf("2001:db8:1:2::8"));
}

// Only the web console may name the browser a call's failures count under (with the key the
// coordinator gave it at start, here with its console on): a client that names other addresses
// itself, without a key or with a guessed one, is throttled as its own peer all the same.
class HardeningWithConsoleTest : public HardeningTest {
 protected:
  void Configure(CoordinatorOptions& options) override {
    HardeningTest::Configure(options);
#ifdef TRAINYARD_TEST_WEB
    options.web_address = "127.0.0.1:0";
#endif
  }
};

TEST_F(HardeningWithConsoleTest, AClientCannotNameAnotherAddressForItsFailures) {
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(WhoAmI(absl::StrCat("tyt.nosuchid", i, ".secret"),
                     {{kConsoleKeyMetadata, i % 2 == 0 ? "" : "guessed-key"},
                      {kConsoleClientMetadata, absl::StrCat("10.0.0.", i)}})
                  .error_code(),
              StatusCode::UNAUTHENTICATED)
        << i;
  }
  EXPECT_EQ(WhoAmI("tyt.nosuchid30.secret",
                   {{kConsoleKeyMetadata, "guessed-key"}, {kConsoleClientMetadata, "10.0.0.99"}})
                .error_code(),
            StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(WhoAmI("tyt.nosuchid31.secret").error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(WhoAmI(tokens_->User("alice")).ok());
}

// Accounting (issue 52): what a worker says each rank used is kept with the job (rank, node,
// attempt) and counted for Prometheus: CPU seconds by account, peak RSS in a histogram; a
// negative or non-finite figure from a node is not taken.
TEST_F(HardeningTest, RankUsageIsKeptWithTheJobAndCountedByAccount) {
  const v1::Job job = RunningJob();
  ASSERT_EQ(job.state(), v1::RUNNING);
  const v1::CoordinatorMessage m = node_->NextCommand();
  ASSERT_TRUE(m.has_assignment());
  v1::RankUsage usage;
  usage.set_peak_rss_bytes(int64_t{300} << 20);
  usage.set_memory_peak_bytes(int64_t{320} << 20);
  usage.set_cpu_seconds(12.5);
  usage.set_rank(7);  // the coordinator's own say: the status's rank
  node_->ReportExit(m.assignment(), 0, 0, &usage);
  // The job's watch: its changes until it ends.
  grpc::ClientContext ctx;
  Prepare(ctx, tokens_->User("alice"));
  v1::WatchJobRequest watch;
  watch.set_job_id(job.id());
  auto reader = jobs_->WatchJob(&ctx, watch);
  v1::JobEvent event;
  std::optional<v1::Job> done;
  while (reader->Read(&event)) {
    if (event.job().state() == v1::SUCCEEDED) {
      done = event.job();
      ctx.TryCancel();
      break;
    }
  }
  reader->Finish();
  ASSERT_TRUE(done.has_value()) << "the job did not succeed";
  ASSERT_EQ(done->rank_usage_size(), 1);
  const v1::RankUsage& kept = done->rank_usage(0);
  EXPECT_EQ(kept.rank(), 0);
  EXPECT_EQ(kept.attempt(), job.attempt());
  EXPECT_EQ(kept.node_id(), "n1");
  EXPECT_EQ(kept.peak_rss_bytes(), int64_t{300} << 20);
  EXPECT_EQ(kept.memory_peak_bytes(), int64_t{320} << 20);
  EXPECT_DOUBLE_EQ(kept.cpu_seconds(), 12.5);
  auto metrics = testing::HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, HasSubstr("trainyard_rank_cpu_seconds_total{account=\"default\"} 12.5"));
  EXPECT_THAT(*metrics, HasSubstr("trainyard_rank_peak_rss_bytes_count 1"));
}

// A cancelled job's rank exits after the cancel (its stop grace): what it used is kept with the
// job and written to the store, though the job itself changes no more (before, it stayed in
// memory and was gone after a restart).
TEST_F(HardeningTest, RankUsageOfACancelledJobIsStoredToo) {
  const v1::Job job = RunningJob();
  ASSERT_EQ(job.state(), v1::RUNNING);
  const v1::CoordinatorMessage m = node_->NextCommand();
  ASSERT_TRUE(m.has_assignment());
  {
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->User("alice"));
    v1::CancelJobRequest r;
    r.set_job_id(job.id());
    v1::Job resp;
    ASSERT_TRUE(jobs_->CancelJob(&ctx, r, &resp).ok());
  }
  auto cancelled = server_->jobs().Get(job.id());
  ASSERT_TRUE(cancelled.ok());
  ASSERT_EQ(cancelled->state(), v1::CANCELLED);
  ASSERT_EQ(cancelled->rank_usage_size(), 0);

  v1::RankUsage usage;
  usage.set_cpu_seconds(3.5);
  usage.set_peak_rss_bytes(int64_t{100} << 20);
  node_->ReportExit(m.assignment(), 0, 143, &usage);
  std::optional<v1::Job> used;  // the node's message is handled on the coordinator's own time
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       !used.has_value() && absl::Now() < deadline;) {
    auto now = server_->jobs().Get(job.id());
    if (now.ok() && now->rank_usage_size() > 0) {
      used = *now;
    } else {
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  ASSERT_TRUE(used.has_value()) << "the rank's usage was not recorded";
  EXPECT_GT(used->version(), cancelled->version());
  node_.reset();
  Restart();  // SIGTERM's path: the store's pending writes finish first
  auto stored = server_->jobs().Get(job.id());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->state(), v1::CANCELLED);
  ASSERT_EQ(stored->rank_usage_size(), 1);
  EXPECT_EQ(stored->rank_usage(0).exit_code(), 143);
  EXPECT_DOUBLE_EQ(stored->rank_usage(0).cpu_seconds(), 3.5);
  EXPECT_EQ(stored->rank_usage(0).peak_rss_bytes(), int64_t{100} << 20);
}

TEST_F(HardeningTest, AnotherUsersJobAnswersExactlyAsAMissingOne) {
  v1::Job job;
  ASSERT_TRUE(Submit(tokens_->User("alice"), testing::TinySpec("mine", 1), &job).ok());
  const std::string& bob = tokens_->User("bob");
  const grpc::Status other = GetJob(bob, job.id());
  const grpc::Status missing = GetJob(bob, "job-999");
  EXPECT_EQ(other.error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(missing.error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(other.error_message(), absl::StrCat("job ", job.id(), " not found"));
  EXPECT_EQ(missing.error_message(), "job job-999 not found");
  EXPECT_TRUE(GetJob(tokens_->User("alice"), job.id()).ok());
  // A token of alice's, revoked by bob: as a token that does not exist.
  std::string id;
  ASSERT_TRUE(CreateToken(tokens_->User("alice"), &id).ok());
  grpc::ClientContext ctx;
  Prepare(ctx, bob);
  v1::RevokeTokenRequest r;
  r.set_id(id);
  v1::TokenInfo info;
  const grpc::Status revoke = identity_->RevokeToken(&ctx, r, &info);
  EXPECT_EQ(revoke.error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(revoke.error_message(), absl::StrCat("id: no token ", id));
}

// A follower that reads nothing: its stream ends once 16 MiB wait for it (the queue grew without
// bound, holding the coordinator's memory for as long as the job ran).
TEST_F(HardeningTest, AStreamWhoseReaderFallsFarBehindEnds) {
  const v1::Job job = RunningJob();
  ASSERT_EQ(job.state(), v1::RUNNING);
  grpc::ClientContext ctx;
  Prepare(ctx, tokens_->User("alice"));
  v1::StreamLogsRequest r;
  r.set_job_id(job.id());
  r.set_follow(true);
  auto reader = jobs_->StreamLogs(&ctx, r);
  // 12 messages of 200 lines of 16 KiB: 38 MiB, more than the queue and gRPC's windows hold.
  for (int m = 0; m < 12; ++m) {
    v1::NodeMessage message;
    auto* l = message.mutable_logs();
    l->set_job_id(job.id());
    l->set_attempt(job.attempt());
    l->set_rank(0);
    for (int i = 0; i < 200; ++i) l->add_lines(std::string(16 * 1024, 'a' + m));
    ASSERT_TRUE(node_->Write(message));
  }
  node_->Heartbeat();  // processed in order: every line is in before the ack
  v1::LogLine line;
  int read = 0;
  while (reader->Read(&line)) ++read;
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("fell more than 16 MiB behind"));
  EXPECT_LT(read, 2400);
}

// yard's follower of a job's logs that falls behind (its terminal is slower than the job prints)
// reads the stream again from the start when the coordinator ends it, and prints every line once,
// in order, until the job ends (`yard logs -f` ended with the error).
TEST_F(HardeningTest, AFollowerThatFellBehindReadsAgainAndMissesNothing) {
  const v1::Job job = RunningJob();
  ASSERT_EQ(job.state(), v1::RUNNING);
  // 12 messages of 200 lines of 16 KiB (38 MiB), each line with its seq, as a worker sends them.
  auto send = [&](int m) {
    v1::NodeMessage message;
    auto* l = message.mutable_logs();
    l->set_job_id(job.id());
    l->set_attempt(job.attempt());
    l->set_rank(0);
    for (int i = 0; i < 200; ++i) {
      l->add_seqs(int64_t{m * 200 + i} * (16 * 1024 + 1) + 1);
      l->add_lines(absl::StrCat(m * 200 + i, " ", std::string(16 * 1024 - 6, 'a' + m)));
    }
    return node_->Write(message);
  };
  ASSERT_TRUE(send(0));
  absl::Mutex mu;
  std::vector<std::string> lines;
  bool released = false;
  absl::Status followed;
  client::YardClient yard(server_->address(), tokens_->User("alice"));
  std::thread follower([&] {
    followed = yard.Logs(job.id(), /*follow=*/true, 0, [&](const v1::LogLine& line) {
      absl::MutexLock lock(&mu);
      lines.push_back(line.text().substr(0, line.text().find(' ')));
      mu.Await(absl::Condition(&released));  // stalls at its first line until all is sent
    });
  });
  {
    absl::MutexLock lock(&mu);
    auto first = [&] { return !lines.empty(); };
    // (No ASSERT until the follower is joined: it ends once the job does.)
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&first), absl::Seconds(20)));
  }
  for (int m = 1; m < 12; ++m) EXPECT_TRUE(send(m));
  node_->Heartbeat();  // processed in order: every line is in before the ack
  {
    absl::MutexLock lock(&mu);
    released = true;
    auto all = [&] { return lines.size() >= 2400; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(60))) << lines.size();
  }
  const v1::Assignment a = node_->NextCommand().assignment();
  node_->ReportExit(a, 0, 0);
  follower.join();
  EXPECT_TRUE(followed.ok()) << followed;
  ASSERT_EQ(lines.size(), 2400u);
  for (int i = 0; i < 2400; ++i) ASSERT_EQ(lines[i], absl::StrCat(i)) << "line " << i;
}

// `yard logs -f --tail N` that falls behind reads the stream again from the first line kept, and
// prints only what came after what it printed: none of the lines the tail left out. (A rank with
// no line in the printed tail, here rank 1, printed its whole kept history again.)
TEST_F(HardeningTest, AFollowerOfATailThatFellBehindPrintsNoLineTheTailLeftOut) {
  node_ = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 2);
  v1::Job job;
  ASSERT_TRUE(Submit(tokens_->User("alice"), testing::TinySpec("tail", 2), &job).ok());
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  ASSERT_EQ(server_->jobs().Get(job.id())->state(), v1::RUNNING);
  const int32_t attempt = server_->jobs().Get(job.id())->attempt();
  int64_t next[2] = {0, 0};  // each rank's next line number
  // `count` lines of `bytes` each for `rank`, with their seqs, as a worker sends them.
  auto send = [&](int32_t rank, int count, size_t bytes) {
    v1::NodeMessage message;
    auto* l = message.mutable_logs();
    l->set_job_id(job.id());
    l->set_attempt(attempt);
    l->set_rank(rank);
    for (int i = 0; i < count; ++i, ++next[rank]) {
      l->add_seqs(next[rank] * (16 * 1024 + 1) + 1);
      std::string text = absl::StrCat(rank, ":", next[rank]);
      if (text.size() < bytes) text += std::string(bytes - text.size(), ' ');
      l->add_lines(std::move(text));
    }
    return node_->Write(message);
  };
  ASSERT_TRUE(send(1, 5, 8));   // rank 1's history, which the tail leaves out
  ASSERT_TRUE(send(0, 20, 8));  // the tail is rank 0's last 10
  node_->Heartbeat();           // processed in order: every line is in before the ack
  absl::Mutex mu;
  std::vector<std::string> lines;
  bool released = false;
  absl::Status followed;
  client::YardClient yard(server_->address(), tokens_->User("alice"));
  std::thread follower([&] {
    followed = yard.Logs(job.id(), /*follow=*/true, /*tail=*/10, [&](const v1::LogLine& line) {
      absl::MutexLock lock(&mu);
      lines.emplace_back(absl::StripTrailingAsciiWhitespace(line.text()));
      mu.Await(absl::Condition(&released));  // stalls at its first line until all is sent
    });
  });
  {
    absl::MutexLock lock(&mu);
    auto first = [&] { return !lines.empty(); };
    // (No ASSERT until the follower is joined: it ends once the job does.)
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&first), absl::Seconds(20)));
  }
  // 38 MiB of rank 0's lines: more than the stream may hold for a reader that reads nothing.
  for (int m = 0; m < 12; ++m) EXPECT_TRUE(send(0, 200, 16 * 1024));
  EXPECT_TRUE(send(1, 3, 8));
  node_->Heartbeat();
  std::vector<std::string> expected;
  for (int i = 10; i < 20 + 12 * 200; ++i) expected.push_back(absl::StrCat("0:", i));
  for (int i = 5; i < 8; ++i) expected.push_back(absl::StrCat("1:", i));
  {
    absl::MutexLock lock(&mu);
    released = true;
    auto all = [&] { return lines.size() >= expected.size(); };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(60))) << lines.size();
  }
  const v1::Assignment a = node_->NextCommand().assignment();
  node_->ReportExit(a, 0, 0);
  node_->ReportExit(a, 1, 0);
  follower.join();
  EXPECT_TRUE(followed.ok()) << followed;
  // Rank 0's lines in order, rank 1's after its last one printed: the same lines, each once.
  std::vector<std::string> rank0;
  for (const std::string& line : lines) {
    if (absl::StartsWith(line, "0:")) rank0.push_back(line);
  }
  EXPECT_EQ(rank0, std::vector<std::string>(expected.begin(), expected.end() - 3));
  std::vector<std::string> sorted = lines, want = expected;
  std::sort(sorted.begin(), sorted.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(sorted, want);
}

// A node's messages waiting on the coordinator's node-events thread hold at most
// NodeBacklog::kMaxBytes of its memory: while the thread is held (a store stalled by a failover;
// here the "node-event" failpoint), the node's log lines past the cap are dropped and counted
// (trainyard_node_log_lines_dropped_total), and the rank's log says how many, before its next
// kept lines or before its end. Its heartbeats and rank status are never dropped. (Every message
// waited in memory: ranks printing fast during a stall grew the coordinator without bound.)
TEST_F(HardeningTest, ANodesLogLinesPastItsBacklogAreDroppedAndTheRanksLogSaysHowMany) {
  const v1::Job job = RunningJob();
  ASSERT_EQ(job.state(), v1::RUNNING);
  const v1::Assignment a = node_->NextCommand().assignment();
  int64_t next = 0;  // the next line's number
  auto message = [&](int lines) {
    v1::NodeMessage m;
    auto* l = m.mutable_logs();
    l->set_job_id(job.id());
    l->set_attempt(job.attempt());
    l->set_rank(0);
    for (int i = 0; i < lines; ++i, ++next) {
      l->add_seqs(next + 1);
      l->add_lines(absl::StrCat(next, " ", std::string(16 * 1024 - 8, 'x')));
    }
    return m;
  };
  auto dropped_metric = [&]() -> int64_t {
    auto page = testing::HttpGet(server_->metrics_address(), "/metrics");
    if (!page.ok()) return -1;
    for (absl::string_view line : absl::StrSplit(*page, '\n')) {
      int64_t n = 0;
      if (absl::ConsumePrefix(&line, "trainyard_node_log_lines_dropped_total ") &&
          absl::SimpleAtoi(line, &n)) {
        return n;
      }
    }
    return -1;
  };
  // Sends `count` messages of 64 lines (1 MiB) while the thread is held at the first; returns the
  // numbers of the lines kept, as the backlog's cap decides (the held one counts until handled).
  auto flood = [&](int count, int64_t dropped_before, std::vector<int64_t>* kept) {
    EXPECT_TRUE(ArmFailpoint("node-event", "pause"));
    int64_t held = 0, dropped = dropped_before;
    for (int i = 0; i < count; ++i) {
      const int64_t first = next;
      const v1::NodeMessage m = message(64);
      const int64_t bytes = coordinator::NodeBacklog::Charge(m);
      if (held + bytes > coordinator::NodeBacklog::kMaxBytes) {
        dropped += 64;
      } else {
        held += bytes;
        for (int64_t n = first; n < next; ++n) kept->push_back(n);
      }
      EXPECT_TRUE(node_->Write(m));
      if (i == 0) {
        EXPECT_TRUE(AwaitFailpointPasses("node-event", 1, 20'000));
      }
    }
    // Every message read once the metric counts what was dropped.
    for (const absl::Time deadline = absl::Now() + absl::Seconds(60);
         dropped_metric() != dropped;) {
      if (absl::Now() > deadline) {
        ADD_FAILURE() << "dropped " << dropped_metric() << " lines, not " << dropped;
        break;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return dropped;
  };
  absl::Cleanup disarm = [] { DisarmFailpoint("node-event"); };
  std::vector<int64_t> kept;
  const int64_t first_drop = flood(48, 0, &kept);
  ASSERT_GT(first_drop, 0);
  ASSERT_GT(kept.size(), 0u);
  DisarmFailpoint("node-event");
  node_->Heartbeat();  // handled in order: the backlog is empty again
  v1::NodeMessage after;
  after.mutable_logs()->set_job_id(job.id());
  after.mutable_logs()->set_attempt(job.attempt());
  after.mutable_logs()->set_rank(0);
  const int64_t after_line = next++;
  after.mutable_logs()->add_seqs(after_line + 1);
  after.mutable_logs()->add_lines("after the stall");
  ASSERT_TRUE(node_->Write(after));
  node_->Heartbeat();
  client::YardClient yard(server_->address(), tokens_->User("alice"));
  auto read = [&] {
    std::vector<std::string> lines;  // numbered lines by their number, the rest whole
    EXPECT_TRUE(yard.Logs(job.id(), /*follow=*/false, 0,
                          [&](const v1::LogLine& line) {
                            const std::string first = line.text().substr(0, line.text().find(' '));
                            int64_t n = 0;
                            lines.push_back(absl::SimpleAtoi(first, &n) ? first : line.text());
                          })
                    .ok());
    return lines;
  };
  const std::string said =
      " lines of this rank's output were dropped here: the coordinator was "
      "behind on node n1's messages";
  // The kept lines, each once, in order; what was dropped said; the line after the stall.
  std::vector<std::string> want;
  for (int64_t n : kept) want.push_back(absl::StrCat(n));
  EXPECT_EQ(static_cast<int64_t>(kept.size()) + first_drop, after_line);
  want.push_back(absl::StrCat("[trainyard] ", first_drop, said));
  want.push_back("after the stall");
  std::vector<std::string> lines = read();
  ASSERT_EQ(lines.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(lines[i], want[i]) << "line " << i;

  // Again, then the rank ends before another line of it is kept.
  const size_t kept_first = kept.size();
  const int64_t second_drop = flood(40, first_drop, &kept) - first_drop;
  ASSERT_GT(kept.size(), kept_first);
  ASSERT_GT(second_drop, 0);
  DisarmFailpoint("node-event");
  node_->ReportExit(a, 0, 0);
  node_->Heartbeat();  // handled in order: the exit, and all before it

  // The ended job keeps its newest lines (its stored logs are capped): the second flood's last
  // kept line, then what it dropped said.
  EXPECT_EQ(static_cast<int64_t>(kept.size()) + first_drop + second_drop + 1, next);
  lines = read();
  ASSERT_GE(lines.size(), 2u);
  EXPECT_EQ(lines[lines.size() - 2], absl::StrCat(kept.back()));
  EXPECT_EQ(lines.back(), absl::StrCat("[trainyard] ", second_drop, said));
}

// A user's uploads under way at once: 2 at most (each holds up to 80 MiB until it ends; a client
// could start fifty and stall them).
TEST_F(HardeningTest, AUserHasAtMostTwoUploadsUnderWay) {
  auto start = [&](grpc::ClientContext& ctx, v1::UploadContextResponse& resp) {
    Prepare(ctx, tokens_->User("alice"));
    auto writer = jobs_->UploadContext(&ctx, &resp);
    v1::ContextChunk chunk;
    chunk.set_digest("sha256:" + std::string(64, 'a'));
    chunk.set_size_bytes(1 << 20);
    chunk.set_data(std::string(1000, 'x'));
    writer->Write(chunk);
    return writer;
  };
  // Three held open at once: whichever the server takes third is refused (whatever order the
  // calls reach it in), which its writes then show; the other two hold their slots until they
  // end, cut short.
  grpc::ClientContext c[3];
  v1::UploadContextResponse r[3];
  std::vector<std::unique_ptr<grpc::ClientWriter<v1::ContextChunk>>> uploads;
  for (int i = 0; i < 3; ++i) uploads.push_back(start(c[i], r[i]));
  bool seen = false;
  v1::ContextChunk more;
  more.set_data("x");
  for (int round = 0; round < 500 && !seen; ++round) {
    for (auto& upload : uploads) seen = seen || !upload->Write(more);
    if (!seen) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(seen) << "no upload was refused";
  int refused = 0, cut_short = 0;
  for (auto& upload : uploads) {
    upload->WritesDone();
    const grpc::Status s = upload->Finish();
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      EXPECT_THAT(s.error_message(), HasSubstr("you have 2 uploads under way"));
    }
    cut_short += s.error_code() == grpc::StatusCode::INVALID_ARGUMENT;
  }
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(cut_short, 2);
  // Another user's are their own.
  grpc::ClientContext c4;
  v1::UploadContextResponse r4;
  Prepare(c4, tokens_->User("bob"));
  auto bobs = jobs_->UploadContext(&c4, &r4);
  bobs->WritesDone();
  EXPECT_EQ(bobs->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // (no chunk)
}

// A user's watches, logs and metrics streams open at once: 32 at most.
TEST_F(HardeningTest, AUserHoldsAtMost32StreamsOpen) {
  const v1::Job job = RunningJob();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::JobEvent>>> watches;
  v1::JobEvent event;
  for (int i = 0; i < 32; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    Prepare(*contexts.back(), tokens_->User("alice"));
    v1::WatchJobRequest r;
    r.set_job_id(job.id());
    watches.push_back(jobs_->WatchJob(contexts.back().get(), r));
    ASSERT_TRUE(watches.back()->Read(&event)) << i;  // open: the job as it is
  }
  auto logs = [&] {
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->User("alice"));
    v1::StreamLogsRequest r;
    r.set_job_id(job.id());
    auto reader = jobs_->StreamLogs(&ctx, r);
    v1::LogLine line;
    while (reader->Read(&line)) {
    }
    return reader->Finish();
  };
  const grpc::Status refused = logs();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(refused.error_message(),
            "StreamLogs: you have 32 streams open (watches, logs and metrics); close one first");
  // Another user's are their own; one of alice's closed gives hers back.
  grpc::ClientContext admin;
  Prepare(admin, tokens_->User("root", v1::ADMIN));
  v1::WatchJobRequest r;
  r.set_job_id(job.id());
  auto theirs = jobs_->WatchJob(&admin, r);
  EXPECT_TRUE(theirs->Read(&event));
  admin.TryCancel();
  theirs->Finish().IgnoreError();
  contexts.back()->TryCancel();
  watches.back()->Finish().IgnoreError();
  watches.pop_back();
  grpc::Status again;
  for (int tries = 0; tries < 500; ++tries) {  // (the server learns of the cancel on its own)
    again = logs();
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(again.ok()) << again.error_message();
  for (size_t i = 0; i < watches.size(); ++i) {
    contexts[i]->TryCancel();
    watches[i]->Finish().IgnoreError();
  }
}

TEST_F(HardeningTest, TheJsonAuditLogHasOneObjectPerEventWhateverTheFieldsHold) {
  {
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->User("admin", v1::ADMIN));
    v1::CreateUserRequest r;
    r.set_name("carol");
    v1::User resp;
    ASSERT_TRUE(identity_->CreateUser(&ctx, r, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->User("alice"));
    v1::ListJobsRequest r;
    r.set_owner("x\n{\"forged\": true}");
    v1::ListJobsResponse resp;
    ASSERT_FALSE(jobs_->ListJobs(&ctx, r, &resp).ok());
  }
  {
    // A refused upload's digest of a megabyte: audited by its first 80 bytes, not whole.
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->User("alice"));
    v1::UploadContextResponse resp;
    auto writer = jobs_->UploadContext(&ctx, &resp);
    v1::ContextChunk chunk;
    chunk.set_digest(std::string(1 << 20, 'd'));
    chunk.set_size_bytes(1);
    writer->Write(chunk);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  struct stat st;
  ASSERT_EQ(::stat((dir_.path() + "/audit.jsonl").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::ifstream in(dir_.path() + "/audit.jsonl");
  std::string line;
  bool created = false, refused = false, upload = false;
  while (std::getline(in, line)) {
    const nlohmann::json event = nlohmann::json::parse(line);  // throws on a broken line
    EXPECT_FALSE(event.contains("forged")) << line;
    EXPECT_LT(line.size(), 4096u) << line.substr(0, 200);
    upload =
        upload || (event["method"] == "UploadContext" && event["target"] == std::string(80, 'd') &&
                   event["result"] == "INVALID_ARGUMENT");
    created = created || (event["method"] == "CreateUser" && event["target"] == "carol" &&
                          event["result"] == "OK" && event["principal"] == "admin admin");
    refused = refused || (event["method"] == "ListJobs" && event["result"] == "PERMISSION_DENIED" &&
                          event["message"].get<std::string>().find("x\n{") != std::string::npos);
  }
  EXPECT_TRUE(created);
  EXPECT_TRUE(refused);
  EXPECT_TRUE(upload);
}

struct stat StatOf(const std::string& path) {
  struct stat st = {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st;
}

TEST(StateDirTest, TheStateDirectoryAndItsFilesAreTheCoordinatorsAlone) {
  testing::TempDir dir;
  for (const bool own_checkpoint_root : {false, true}) {
    CoordinatorOptions o;
    o.listen_address = "127.0.0.1:0";
    o.state_dir = dir.path() + (own_checkpoint_root ? "/b" : "/a");
    if (own_checkpoint_root) o.checkpoint_root = dir.path() + "/checkpoints";
    o.background_threads = false;
    auto server = CoordinatorServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    // 0711 while the default checkpoint root lies inside: ranks pass through, nobody lists.
    EXPECT_EQ(StatOf(o.state_dir).st_mode & 0777, own_checkpoint_root ? 0700u : 0711u);
    for (const char* file : {"coordinator.db", "coordinator.db-wal", "coordinator.lock",
                             "admin.token", "job-credential.key"}) {
      EXPECT_EQ(StatOf(o.state_dir + "/" + file).st_mode & 0777, 0600u) << file;
    }
    (*server)->Shutdown();
  }
  // A state directory an older version left readable is made private again.
  ASSERT_EQ(::chmod((dir.path() + "/b").c_str(), 0755), 0);
  ASSERT_EQ(::chmod((dir.path() + "/b/coordinator.db").c_str(), 0644), 0);
  CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.state_dir = dir.path() + "/b";
  o.checkpoint_root = dir.path() + "/checkpoints";
  o.background_threads = false;
  auto server = CoordinatorServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(StatOf(o.state_dir).st_mode & 0777, 0700u);
  EXPECT_EQ(StatOf(o.state_dir + "/coordinator.db").st_mode & 0777, 0600u);
}

TEST(StateDirTest, NothingIsWrittenBeforeTheFlagsAndFilesAreChecked) {
  testing::TempDir dir;
  CoordinatorOptions bad_listen;
  bad_listen.listen_address = "no-port-here";
  bad_listen.state_dir = dir.path() + "/state";
  bad_listen.background_threads = false;
  auto s = CoordinatorServer::Start(bad_listen);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("listen: expected HOST:PORT"));
  EXPECT_FALSE(std::filesystem::exists(bad_listen.state_dir));

  CoordinatorOptions bad_key = bad_listen;
  bad_key.listen_address = "127.0.0.1:0";
  bad_key.tls.cert_file = dir.path() + "/missing.crt";
  bad_key.tls.key_file = dir.path() + "/missing.key";
  s = CoordinatorServer::Start(bad_key);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("tls"));
  EXPECT_FALSE(std::filesystem::exists(bad_key.state_dir));
}

}  // namespace
}  // namespace trainyard::coordinator
