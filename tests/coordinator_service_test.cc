// The coordinator's gRPC API end to end, in process: a real CoordinatorServer on a free loopback
// port with a real SQLite store in a temp dir, a FakeClock, and no background threads, so each
// test decides when scheduling passes and heartbeat checks happen.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <csignal>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/failpoint.h"
#include "server/coordinator/coordinator_server.h"
#include "server/coordinator/job_history.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/services.h"
#include "tests/testing/coordinator_fixture.h"
#include "tests/testing/grpc_probe.h"
#include "tests/testing/node_session.h"
#include "tests/testing/subprocess.h"
#include "trainyard/v1/admin.grpc.pb.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/node.grpc.pb.h"
#include "trainyard/v1/rendezvous.grpc.pb.h"
#include "trainyard/v1/trainer.grpc.pb.h"

namespace trainyard::coordinator {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

v1::JobSpec Spec(int devices, const std::string& name = "job", int max_restarts = 0) {
  v1::JobSpec s;
  s.set_name(name);
  s.mutable_resources()->set_slots(devices);
  auto* m = s.mutable_model();
  m->set_kind("gpt");
  m->set_n_layer(2);
  m->set_n_head(2);
  m->set_d_model(32);
  m->set_seq_len(16);
  m->set_vocab(256);
  s.mutable_data()->set_path("/usr/share/common-licenses/GPL-3");
  s.mutable_train()->set_steps(10);
  s.set_max_restarts(max_restarts);
  return s;
}

class CoordinatorServiceTest : public testing::CoordinatorFixture {
 protected:
  void Configure(CoordinatorOptions& o) override { o.node_timeout = absl::Seconds(10); }

  // A call as `user` (with a token of that user; empty: no credential at all).
  void Prepare(grpc::ClientContext& ctx, const std::string& user = "alice") {
    PrepareToken(ctx, user.empty() ? std::string() : tokens_->User(user));
  }
  // A step report of the assignment's attempt, with its job credential: the trainer's commands.
  grpc::Status ReportStep(const v1::Assignment& a, int64_t step, v1::TrainerCommands* commands) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Job(a.job_id(), a.attempt()));
    v1::StepReport r;
    r.set_job_id(a.job_id());
    r.set_attempt(a.attempt());
    r.set_step(step);
    return trainer_->ReportStep(&ctx, r, commands);
  }
  void PrepareToken(grpc::ClientContext& ctx, const std::string& token) {
    testing::Authorize(ctx, token);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  }

  grpc::Status Submit(const v1::JobSpec& spec, v1::Job* job, const std::string& user = "alice") {
    grpc::ClientContext ctx;
    Prepare(ctx, user);
    v1::SubmitJobRequest r;
    *r.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(&ctx, r, &resp);
    if (job != nullptr) *job = resp.job();
    return s;
  }

  v1::Job MustSubmit(const v1::JobSpec& spec, const std::string& user = "alice") {
    v1::Job job;
    grpc::Status s = Submit(spec, &job, user);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }

  grpc::Status Get(const std::string& id, v1::Job* job) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::GetJobRequest r;
    r.set_job_id(id);
    return jobs_->GetJob(&ctx, r, job);
  }

  grpc::Status Cancel(const std::string& id, v1::Job* job = nullptr) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::CancelJobRequest r;
    r.set_job_id(id);
    v1::Job out;
    grpc::Status s = jobs_->CancelJob(&ctx, r, &out);
    if (job != nullptr) *job = out;
    return s;
  }

  v1::ListJobsResponse List(v1::ListJobsRequest r, grpc::Status* status = nullptr,
                            const std::string& user = "alice") {
    grpc::ClientContext ctx;
    Prepare(ctx, user);
    v1::ListJobsResponse resp;
    grpc::Status s = jobs_->ListJobs(&ctx, r, &resp);
    if (status != nullptr) *status = s;
    return resp;
  }

  // The node as `yard nodes` lists it (an empty node when it is not listed).
  // A stopping rank's device on `node` stays held for `hold` from now: a second before, `next`
  // (waiting for it) is not placed; a second after, it is placed there (its assignment in
  // `placed`, when given).
  void ExpectHeldFor(testing::NodeSession& node, absl::Duration hold, const v1::Job& next,
                     v1::Assignment* placed = nullptr) {
    clock_.Advance(hold - absl::Seconds(1));
    node.Heartbeat();
    EXPECT_EQ(server_->jobs().SchedulePass(), 0) << "within " << absl::FormatDuration(hold);
    clock_.Advance(absl::Seconds(2));
    node.Heartbeat();
    ASSERT_EQ(server_->jobs().SchedulePass(), 1) << "past " << absl::FormatDuration(hold);
    const v1::Assignment a = node.NextCommand().assignment();
    EXPECT_EQ(a.job_id(), next.id());
    if (placed != nullptr) *placed = a;
  }

  // Node n1's worker restarting, with --stop-grace 10s and --max-stop-grace `max_stop_grace`,
  // while rank 0 of `a` runs on under its shepherd (still stopping, or not told to yet), which
  // reports `reported` as its grace (zero: not said, as an older worker). The new session.
  std::unique_ptr<testing::NodeSession> RestartWithRankRunning(
      std::unique_ptr<testing::NodeSession> node, const v1::Assignment& a,
      absl::Duration max_stop_grace, absl::Duration reported = absl::ZeroDuration()) {
    node.reset();
    WaitUntilDisconnected("n1");
    v1::RankStatus rank = RunningRank(a, 0);
    if (reported > absl::ZeroDuration())
      rank.set_stop_grace_ms(absl::ToInt64Milliseconds(reported));
    return testing::NodeSession::ConnectWith(
        channel_, tokens_->Node("n1"), WithGraces("n1", absl::Seconds(10), max_stop_grace), {rank});
  }

  // A job whose spec asks `grace` placed on n1 (its --stop-grace 10s, --max-stop-grace 10m): the
  // node's session, the job and its assignment.
  struct Placed {
    std::unique_ptr<testing::NodeSession> node;
    v1::Job job;
    v1::Assignment assignment;
  };
  Placed PlacedWithStopGrace(absl::Duration grace) {
    Placed p;
    p.node = testing::NodeSession::ConnectWith(
        channel_, tokens_->Node("n1"), WithGraces("n1", absl::Seconds(10), absl::Minutes(10)));
    v1::JobSpec spec = Spec(1);
    spec.set_stop_grace_seconds(absl::ToInt64Seconds(grace));
    p.job = MustSubmit(spec);
    EXPECT_EQ(server_->jobs().SchedulePass(), 1);
    p.assignment = p.node->NextCommand().assignment();
    return p;
  }

  // Until the coordinator has seen node `id`'s session end (at most 10 s).
  void WaitUntilDisconnected(const std::string& id) {
    for (absl::Time give_up = absl::Now() + absl::Seconds(10);
         Node(id).connected() && absl::Now() < give_up;) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  // A hello's status of rank `rank` of `a`'s attempt, running on device 0.
  static v1::RankStatus RunningRank(const v1::Assignment& a, int rank) {
    v1::RankStatus status;
    status.set_job_id(a.job_id());
    status.set_attempt(a.attempt());
    status.set_rank(rank);
    status.set_device(0);
    status.set_phase(v1::RANK_RUNNING);
    return status;
  }

  v1::Node Node(const std::string& id) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::ListNodesResponse resp;
    EXPECT_TRUE(nodes_->ListNodes(&ctx, {}, &resp).ok());
    for (const v1::Node& n : resp.nodes()) {
      if (n.id() == id) return n;
    }
    ADD_FAILURE() << "no node " << id;
    return {};
  }

  // Watches `id` until its state is `state` (or the stream ends); returns the last job seen.
  v1::Job WaitForState(const std::string& id, v1::JobState state) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::WatchJobRequest r;
    r.set_job_id(id);
    auto reader = jobs_->WatchJob(&ctx, r);
    v1::JobEvent e;
    v1::Job last;
    while (reader->Read(&e)) {
      last = e.job();
      if (last.state() == state) {
        ctx.TryCancel();
        break;
      }
    }
    reader->Finish();
    return last;
  }

  grpc::Status Register(const std::string& node_id, int devices) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Node(node_id));
    v1::RegisterNodeRequest r;
    r.set_node_id(node_id);
    r.set_hostname("localhost");
    r.set_memory_bytes(int64_t{8} << 30);
    for (int i = 0; i < devices; ++i) {
      auto* d = r.add_devices();
      d->set_index(i);
      d->set_kind(v1::CPU_SLOT);
    }
    v1::RegisterNodeResponse resp;
    return nodes_->RegisterNode(&ctx, r, &resp);
  }

  std::unique_ptr<testing::NodeSession> Connect(const std::string& node_id, int devices) {
    return testing::NodeSession::Connect(channel_, tokens_->Node(node_id), node_id, devices);
  }

  // A worker of 4 slots that counts its CPUs and memory: 4 CPUs and 16 GiB for ranks, 1 CPU and
  // 4 GiB a rank that asks for none.
  static v1::RegisterNodeRequest CountingNode(const std::string& node_id) {
    const int64_t gib = int64_t{1} << 30;
    v1::RegisterNodeRequest r;
    r.set_node_id(node_id);
    r.set_hostname("localhost");
    r.set_memory_bytes(20 * gib);
    for (int i = 0; i < 4; ++i) {
      v1::Device* d = r.add_devices();
      d->set_index(i);
      d->set_kind(v1::CPU_SLOT);
    }
    r.mutable_host()->set_cpus(4);
    r.mutable_host()->set_memory_bytes(16 * gib);
    r.mutable_host()->set_cpus_per_device(1);
    r.mutable_host()->set_memory_per_device(4 * gib);
    return r;
  }

  // A one-slot worker's registration that says its stop graces (--stop-grace, --max-stop-grace;
  // 0: not said).
  static v1::RegisterNodeRequest WithGraces(const std::string& node_id, absl::Duration grace,
                                            absl::Duration max_grace) {
    v1::RegisterNodeRequest r;
    r.set_node_id(node_id);
    r.set_hostname("localhost");
    r.set_memory_bytes(int64_t{8} << 30);
    r.add_devices()->set_kind(v1::CPU_SLOT);
    r.mutable_host()->set_stop_grace_ms(absl::ToInt64Milliseconds(grace));
    r.mutable_host()->set_max_stop_grace_ms(absl::ToInt64Milliseconds(max_grace));
    return r;
  }
};

TEST_F(CoordinatorServiceTest, SubmitStoresAQueuedJobThatGetReturns) {
  v1::Job job = MustSubmit(Spec(2, "first"));
  EXPECT_EQ(job.id(), "job-1");
  EXPECT_EQ(job.owner(), "alice");
  EXPECT_EQ(job.state(), v1::QUEUED);
  EXPECT_EQ(job.spec().priority(), 50);  // default applied
  EXPECT_EQ(job.spec().parallel().strategy(), v1::DDP);
  v1::Job got;
  ASSERT_TRUE(Get(job.id(), &got).ok());
  EXPECT_EQ(got.spec().name(), "first");
  EXPECT_EQ(got.state(), v1::QUEUED);
  EXPECT_EQ(MustSubmit(Spec(1)).id(), "job-2");
}

TEST_F(CoordinatorServiceTest, SubmitWithoutUserIsUnauthenticated) {
  grpc::Status s = Submit(Spec(1), nullptr, /*user=*/"");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("authorization: Bearer"));
}

TEST_F(CoordinatorServiceTest, BadSpecsAreRejectedNamingTheFieldAndNothingIsStored) {
  struct Case {
    std::function<void(v1::JobSpec&)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](v1::JobSpec& s) { s.mutable_resources()->set_slots(0); }, "resources.slots"},
      {[](v1::JobSpec& s) { s.mutable_resources()->set_slots(-2); }, "resources.slots"},
      {[](v1::JobSpec& s) { s.mutable_model()->set_n_head(3); }, "model.n_head"},
      {[](v1::JobSpec& s) { s.set_priority(101); }, "priority"},
      {[](v1::JobSpec& s) { s.set_priority(-5); }, "priority"},
      {[](v1::JobSpec& s) { s.mutable_parallel()->set_strategy(static_cast<v1::Strategy>(17)); },
       "parallel.strategy"},
      {[](v1::JobSpec& s) { s.mutable_model()->set_kind("lstm"); }, "model.kind"},
      {[](v1::JobSpec& s) { s.mutable_data()->clear_path(); }, "data.path"},
      {[](v1::JobSpec& s) { s.set_name("bad name!"); }, "name"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = Spec(1);
    c.mutate(spec);
    grpc::Status s = Submit(spec, nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_THAT(s.error_message(), StartsWith(c.field + ":"));
  }
  EXPECT_EQ(List({}).jobs_size(), 0);
}

// A layout rule is the validator's, so the coordinator refuses such a job at submit (it used to
// be queued and placed, then fail on its ranks): fp16's loss scaling runs with DDP only.
TEST_F(CoordinatorServiceTest, Fp16WithFsdpIsRefusedAtSubmitNamingTheFieldNotOnARank) {
  v1::JobSpec spec = Spec(2);
  spec.mutable_train()->set_mixed_precision(v1::FP16);
  spec.mutable_parallel()->set_strategy(v1::FSDP);
  grpc::Status s = Submit(spec, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), StartsWith("train.mixed_precision: fp16"));
  EXPECT_EQ(List({}).jobs_size(), 0);
  spec.mutable_parallel()->set_strategy(v1::DDP);
  MustSubmit(spec);
}

TEST_F(CoordinatorServiceTest, OversizedRequestIsResourceExhaustedAndNothingIsStored) {
  v1::JobSpec spec = Spec(1);
  spec.set_name(std::string(5 << 20, 'a'));  // over the 4 MiB limit
  grpc::Status s = Submit(spec, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(List({}).jobs_size(), 0);
}

TEST_F(CoordinatorServiceTest, UnknownJobIsNotFound) {
  v1::Job job;
  grpc::Status s = Get("job-404", &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("job-404"));
  EXPECT_EQ(Cancel("job-404").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Get("", &job).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// Only a succeeded job whose spec has checkpoint.export has an export to fetch; every refusal
// says why, and sends no chunk.
TEST_F(CoordinatorServiceTest, FetchExportRefusesAJobWithoutAnExportOrThatHasNotSucceeded) {
  auto fetch = [&](const std::string& id, const std::string& user = "alice") {
    grpc::ClientContext ctx;
    Prepare(ctx, user);
    v1::FetchExportRequest r;
    r.set_job_id(id);
    auto reader = jobs_->FetchExport(&ctx, r);
    v1::ExportChunk chunk;
    int chunks = 0;
    while (reader->Read(&chunk)) ++chunks;
    EXPECT_EQ(chunks, 0) << id;
    return reader->Finish();
  };
  const v1::Job plain = MustSubmit(Spec(1));
  grpc::Status s = fetch(plain.id());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(s.error_message(), plain.id() +
                                   " has no export: its spec sets no checkpoint.export "
                                   "(hf or hf_merged)");

  v1::JobSpec llama = Spec(1);
  llama.mutable_model()->set_kind("llama");
  llama.mutable_checkpoint()->set_export_format(v1::EXPORT_HF);
  const v1::Job queued = MustSubmit(llama);
  s = fetch(queued.id());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(s.error_message(), queued.id() + " is QUEUED: its export is written when it succeeds");
  EXPECT_EQ(fetch(queued.id(), "bob").error_code(), grpc::StatusCode::NOT_FOUND);  // as missing
  EXPECT_EQ(fetch("job-404").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(fetch("").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CoordinatorServiceTest, CancellingAFinishedJobIsFailedPrecondition) {
  v1::Job job = MustSubmit(Spec(1));
  v1::Job cancelled;
  ASSERT_TRUE(Cancel(job.id(), &cancelled).ok());
  EXPECT_EQ(cancelled.state(), v1::CANCELLED);
  EXPECT_THAT(cancelled.message(), HasSubstr("cancelled by alice"));
  grpc::Status again = Cancel(job.id());
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(again.error_message(), HasSubstr("CANCELLED"));
}

TEST_F(CoordinatorServiceTest, ListFiltersByStateAndOwnerAndPagesNewestFirst) {
  for (int i = 0; i < 5; ++i) MustSubmit(Spec(1), "alice");
  for (int i = 0; i < 2; ++i) MustSubmit(Spec(1), "bob");
  ASSERT_TRUE(Cancel("job-2").ok());

  v1::ListJobsRequest r;  // an admin's view: every owner's jobs
  r.set_page_size(3);
  std::vector<std::string> ids;
  while (true) {
    v1::ListJobsResponse page = List(r, nullptr, "admin");
    EXPECT_LE(page.jobs_size(), 3);
    for (const auto& j : page.jobs()) ids.push_back(j.id());
    if (page.next_page_token().empty()) break;
    r.set_page_token(page.next_page_token());
  }
  EXPECT_THAT(ids, ElementsAre("job-7", "job-6", "job-5", "job-4", "job-3", "job-2", "job-1"));

  v1::ListJobsRequest by_owner;
  by_owner.set_owner("bob");
  EXPECT_EQ(List(by_owner, nullptr, "admin").jobs_size(), 2);
  v1::ListJobsRequest by_state;
  by_state.add_states(v1::CANCELLED);
  v1::ListJobsResponse cancelled = List(by_state);
  ASSERT_EQ(cancelled.jobs_size(), 1);
  EXPECT_EQ(cancelled.jobs(0).id(), "job-2");

  grpc::Status s;
  v1::ListJobsRequest bad_token;
  bad_token.set_page_token("xyz");
  List(bad_token, &s);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), StartsWith("page_token:"));
  v1::ListJobsRequest big;
  big.set_page_size(5000);
  List(big, &s);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), StartsWith("page_size:"));
  v1::ListJobsRequest bad_state;
  bad_state.add_states(static_cast<v1::JobState>(99));
  List(bad_state, &s);
  EXPECT_THAT(s.error_message(), StartsWith("states[0]:"));
}

TEST_F(CoordinatorServiceTest, WatchStreamsTheCurrentStateThenChangesUntilTheEnd) {
  v1::Job job = MustSubmit(Spec(1));
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::WatchJobRequest r;
  r.set_job_id(job.id());
  auto reader = jobs_->WatchJob(&ctx, r);
  v1::JobEvent e;
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.job().state(), v1::QUEUED);
  ASSERT_TRUE(Cancel(job.id()).ok());
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.job().state(), v1::CANCELLED);
  EXPECT_FALSE(reader->Read(&e));  // the stream ends after a terminal state
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(CoordinatorServiceTest, WatchingAnUnknownJobIsNotFoundAndNoIdIsInvalid) {
  for (const std::string id : {"job-9", ""}) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::WatchJobRequest r;
    r.set_job_id(id);
    auto reader = jobs_->WatchJob(&ctx, r);
    v1::JobEvent e;
    EXPECT_FALSE(reader->Read(&e));
    grpc::Status s = reader->Finish();
    if (id.empty()) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(s.error_message(), StartsWith("job_id:"));
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    }
  }
}

TEST_F(CoordinatorServiceTest, PlacedGangReachesItsNodeAndSucceedsWhenAllRanksExitCleanly) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2));
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  v1::CoordinatorMessage m = node->NextCommand();
  ASSERT_TRUE(m.has_assignment());
  const v1::Assignment a = m.assignment();
  EXPECT_EQ(a.job_id(), job.id());
  EXPECT_EQ(a.attempt(), 1);
  EXPECT_EQ(a.world_size(), 2);
  EXPECT_EQ(a.first_rank(), 0);
  EXPECT_THAT(a.device_indices(), ElementsAre(0, 1));
  EXPECT_EQ(a.coordinator_address(), server_->address());
  v1::JobSpec sent;
  ASSERT_TRUE(sent.ParseFromString(a.spec()));
  EXPECT_EQ(sent.name(), "job");

  v1::Job running;
  ASSERT_TRUE(Get(job.id(), &running).ok());
  EXPECT_EQ(running.state(), v1::RUNNING);
  EXPECT_EQ(running.attempt(), 1);
  ASSERT_EQ(running.placement_size(), 1);
  EXPECT_EQ(running.placement(0).node_id(), "n1");

  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::ListNodesResponse nodes;
  ASSERT_TRUE(nodes_->ListNodes(&ctx, {}, &nodes).ok());
  ASSERT_EQ(nodes.nodes_size(), 1);
  EXPECT_EQ(nodes.nodes(0).allocated_devices_size(), 2);

  node->ReportExit(a, 0, 0);
  node->ReportExit(a, 1, 0);
  EXPECT_EQ(WaitForState(job.id(), v1::SUCCEEDED).state(), v1::SUCCEEDED);
}

// A placement whose write failed (a full disk, a database gone for a moment) is written again by
// the ticker, and its ranks are assigned once it is durable. (The job stayed RUNNING in memory,
// its devices held, with no assignment sent until the node's next hello, and QUEUED in the store.)
TEST_F(CoordinatorServiceTest, APlacementWhoseWriteFailedIsWrittenAgainThenAssigned) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2));
  ASSERT_TRUE(ArmFailpoint("store-commit", "fail@1"));  // the placement's write, the next one
  absl::Cleanup disarm = [] { DisarmFailpoint("store-commit"); };  // (passed or not)
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  // Once the failed write's callback has run, the ticker's retry finds the job (as Tick calls it).
  int again = 0;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);
       (again = server_->jobs().RetryUnsaved()) == 0;) {
    ASSERT_LT(absl::Now(), deadline) << "the failed write was never retried";
    // (Before the retry the store is behind: the job is still QUEUED there.)
    auto stored = server_->jobs().ReadFromStore(job.id());
    ASSERT_TRUE(stored.ok()) << stored.status();
    EXPECT_EQ(stored->state(), v1::QUEUED);
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(again, 1);
  v1::CoordinatorMessage m = node->NextCommand();
  ASSERT_TRUE(m.has_assignment());
  EXPECT_EQ(m.assignment().job_id(), job.id());
  EXPECT_EQ(m.assignment().attempt(), 1);
  auto stored = server_->jobs().ReadFromStore(job.id());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->state(), v1::RUNNING);
  EXPECT_EQ(stored->attempt(), 1);
  EXPECT_EQ(server_->jobs().RetryUnsaved(), 0) << "written once, nothing left";
  node->ReportExit(m.assignment(), 0, 0);
  node->ReportExit(m.assignment(), 1, 0);
  EXPECT_EQ(WaitForState(job.id(), v1::SUCCEEDED).state(), v1::SUCCEEDED);
}

// A node's backlog on the node-events thread: its log lines past its cap, or past all nodes', are
// refused, never its other messages; what was dropped of a rank is the node's (a session that
// ends does not lose it: the next one's lines of the rank say it), said once.
TEST(NodeBacklogTest, CapsANodeAndAllAndKeepsWhatWasDroppedUntilSaid) {
  NodeBacklog backlog;
  const int64_t half = NodeBacklog::kMaxBytes / 2;
  EXPECT_TRUE(backlog.Add("n1", half, /*droppable=*/true));
  EXPECT_TRUE(backlog.Add("n1", half, true));
  EXPECT_FALSE(backlog.Add("n1", 1, true));
  EXPECT_TRUE(backlog.Add("n1", 100, /*droppable=*/false));
  EXPECT_EQ(backlog.Bytes("n1"), NodeBacklog::kMaxBytes + 100);
  const NodeBacklog::RankKey rank{"job-1", 1, 0};
  backlog.Dropped("n1", rank, 5);
  backlog.Dropped("n1", rank, 3);
  EXPECT_EQ(backlog.TakeDropped("n2", rank), 0);
  backlog.Remove("n1", half);
  backlog.Remove("n1", half);
  backlog.Remove("n1", 100);
  EXPECT_EQ(backlog.Bytes("n1"), 0);
  EXPECT_EQ(backlog.TakeDropped("n1", rank), 8);
  EXPECT_EQ(backlog.TakeDropped("n1", rank), 0);
  for (int64_t i = 0; i < NodeBacklog::kMaxTotalBytes / NodeBacklog::kMaxBytes; ++i) {
    EXPECT_TRUE(backlog.Add(absl::StrCat("node-", i), NodeBacklog::kMaxBytes, true)) << i;
  }
  EXPECT_FALSE(backlog.Add("another", 1, true)) << "past all nodes' cap";
  EXPECT_TRUE(backlog.Add("another", 1, false));
  // A message's charge: its bytes and each line's own string.
  v1::NodeMessage m;
  m.mutable_logs()->add_lines("x");
  m.mutable_logs()->add_lines("y");
  EXPECT_EQ(NodeBacklog::Charge(m),
            static_cast<int64_t>(m.ByteSizeLong()) + 2 * NodeBacklog::kLineCharge);
}

// A cancel stops the job's ranks once it is durable. The stop went out first: a coordinator that
// restarted before the cancel's write landed still had the job running while its ranks had been
// stopped (their node's hello then failed the attempt, and a job with restarts left ran again).
// Here the cancel's write fails: no stop until the retry has written it.
TEST_F(CoordinatorServiceTest, ACancelStopsTheRanksOnceItIsDurable) {
  auto node = Connect("n1", 1);
  const v1::Job job = MustSubmit(Spec(1, "job", /*max_restarts=*/2));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  ASSERT_TRUE(ArmFailpoint("store-commit", "fail@1"));  // the cancel's write
  absl::Cleanup disarm = [] { DisarmFailpoint("store-commit"); };
  absl::Notification answered;
  absl::Status cancelled;
  server_->jobs().Cancel(job.id(), "", [&](absl::StatusOr<v1::Job> r) {
    cancelled = r.status();
    answered.Notify();
  });
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_FALSE(cancelled.ok());
  node->Heartbeat();  // (what was sent to the node before its ack is read)
  EXPECT_EQ(node->pending(), 0u) << "the ranks were stopped before the cancel was durable";
  // Nor is a rank that reports running meanwhile (a no longer current attempt's is told to stop).
  v1::NodeMessage running;
  running.mutable_rank_status()->set_job_id(job.id());
  running.mutable_rank_status()->set_attempt(a.attempt());
  running.mutable_rank_status()->set_rank(0);
  running.mutable_rank_status()->set_phase(v1::RANK_RUNNING);
  ASSERT_TRUE(node->Write(running));
  node->Heartbeat();
  EXPECT_EQ(node->pending(), 0u)
      << "a rank that reported was stopped before the cancel was durable";
  // Nor does a rank's report hear "stop" (the trainer and the SDK exit when told).
  auto report = [&](v1::TrainerCommands* commands) { return ReportStep(a, 3, commands); };
  v1::TrainerCommands commands;
  ASSERT_TRUE(report(&commands).ok());
  EXPECT_FALSE(commands.stop_requested()) << "told to stop before the cancel was durable";
  EXPECT_EQ(server_->jobs().RetryUnsaved(), 1);  // (as the ticker does)
  const v1::CoordinatorMessage m = node->NextCommand();
  ASSERT_TRUE(m.has_cancel()) << m.ShortDebugString();
  ASSERT_TRUE(report(&commands).ok());
  EXPECT_TRUE(commands.stop_requested());
  EXPECT_EQ(m.cancel().job_id(), job.id());
  EXPECT_EQ(m.cancel().attempt(), a.attempt());
  auto stored = server_->jobs().ReadFromStore(job.id());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->state(), v1::CANCELLED);
}

// A drain (as a preemption) asks the job's ranks to checkpoint and stop once the ask is durable.
// Asked before, a coordinator that restarted without it had the job running when its ranks exited
// 0 after their checkpoint: SUCCEEDED, its steps unfinished. Here the drain's write fails.
TEST_F(CoordinatorServiceTest, ADrainAsksTheRanksToStopOnceItIsDurable) {
  auto node = Connect("n1", 1);
  const v1::Job job = MustSubmit(Spec(1, "job", /*max_restarts=*/2));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  auto report = [&](v1::TrainerCommands* commands) { return ReportStep(a, 3, commands); };
  ASSERT_TRUE(ArmFailpoint("store-commit", "fail@1"));  // the drain's write
  absl::Cleanup disarm = [] { DisarmFailpoint("store-commit"); };
  EXPECT_THAT(server_->jobs().DrainNode("n1", "admin"), ::testing::ElementsAre(job.id()));
  v1::TrainerCommands commands;
  ASSERT_TRUE(report(&commands).ok());
  EXPECT_FALSE(commands.stop_requested()) << "asked to stop before the drain was durable";
  // Once the failed write's callback has run, the ticker's retry writes it; then the ask comes.
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);
       server_->jobs().RetryUnsaved() == 0;) {
    ASSERT_LT(absl::Now(), deadline) << "the failed write was never retried";
    ASSERT_TRUE(report(&commands).ok());
    EXPECT_FALSE(commands.stop_requested()) << "asked to stop before the drain was durable";
    absl::SleepFor(absl::Milliseconds(5));
  }
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20); !commands.stop_requested();) {
    ASSERT_LT(absl::Now(), deadline) << "never asked to stop once the drain was durable";
    ASSERT_TRUE(report(&commands).ok());
  }
  auto stored = server_->jobs().ReadFromStore(job.id());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_NE(stored->preempt_deadline_ms(), 0);
}

// A job's logs read while its end is being written come whole. The end's durable notice, arriving
// while the reader's kept lines were being queued, ended the stream at once: `yard logs` of a job
// that had just ended printed part of it, or nothing, and succeeded. (Held here: the end's write
// at "store-commit", the reader between its watch and its lines at "series-replay".)
TEST_F(CoordinatorServiceTest, LogsReadWhileTheJobsEndIsWrittenComeWhole) {
  auto node = Connect("n1", 1);
  const v1::Job job = MustSubmit(Spec(1));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  v1::NodeMessage m;
  m.mutable_logs()->set_job_id(job.id());
  m.mutable_logs()->set_attempt(1);
  m.mutable_logs()->set_rank(0);
  for (const char* line : {"one", "two", "three"}) m.mutable_logs()->add_lines(line);
  ASSERT_TRUE(node->Write(m));
  node->Heartbeat();  // (handled in order: the lines are kept)
  absl::Cleanup disarm = [] {
    DisarmFailpoint("store-commit");
    DisarmFailpoint("series-replay");
  };
  ASSERT_TRUE(ArmFailpoint("store-commit", "pause"));
  node->ReportExit(a, 0, 0);
  ASSERT_TRUE(AwaitFailpointPasses("store-commit", 1, 20'000));  // the end's write, held
  ASSERT_TRUE(ArmFailpoint("series-replay", "pause"));
  std::vector<std::string> lines;
  grpc::Status read;
  std::thread reader([&] {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::StreamLogsRequest r;
    r.set_job_id(job.id());
    auto stream = jobs_->StreamLogs(&ctx, r);
    for (v1::LogLine line; stream->Read(&line);) lines.push_back(line.text());
    read = stream->Finish();
  });
  absl::Cleanup join = [&] {
    DisarmFailpoint("series-replay");
    DisarmFailpoint("store-commit");
    reader.join();
  };
  ASSERT_TRUE(AwaitFailpointPasses("series-replay", 1, 20'000));  // watching, nothing queued
  // The end is written and its watchers told, the reader's among them (the store's callbacks run
  // in order: a later submit's answer comes after them).
  DisarmFailpoint("store-commit");
  MustSubmit(Spec(1, "later"));
  DisarmFailpoint("series-replay");
  std::move(join).Invoke();
  EXPECT_TRUE(read.ok()) << read.error_message();
  EXPECT_THAT(lines, ElementsAre("one", "two", "three"));
}

// Idempotent submits (issue 54): a submit sent again with its request id (a client retrying after
// a lost answer) gets the first job, and the job is stored once, across a restart of the
// coordinator too; another owner's same id is its own; after 24 h the id is forgotten; a
// malformed id is refused naming the field.
TEST_F(CoordinatorServiceTest, ASubmitRetriedWithItsRequestIdReturnsTheFirstJobOnly) {
  auto submit = [&](const std::string& user, const std::string& request_id, v1::Job* job) {
    grpc::ClientContext ctx;
    Prepare(ctx, user);
    v1::SubmitJobRequest r;
    *r.mutable_spec() = Spec(1, "once");
    r.set_request_id(request_id);
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(&ctx, r, &resp);
    *job = resp.job();
    return s;
  };
  v1::Job first, again, bobs;
  ASSERT_TRUE(submit("alice", "req-1", &first).ok());
  EXPECT_EQ(first.request_id(), "req-1");
  ASSERT_TRUE(submit("alice", "req-1", &again).ok());
  EXPECT_EQ(again.id(), first.id());
  ASSERT_TRUE(submit("bob", "req-1", &bobs).ok());
  EXPECT_NE(bobs.id(), first.id());
  EXPECT_EQ(List({}).jobs_size(), 1);  // alice's

  Restart();
  ASSERT_TRUE(submit("alice", "req-1", &again).ok());
  EXPECT_EQ(again.id(), first.id());
  EXPECT_EQ(List({}).jobs_size(), 1);

  v1::Job other;
  grpc::Status bad = submit("alice", "has space", &other);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("request_id:"));
  clock_.Advance(absl::Hours(25));
  ASSERT_TRUE(submit("alice", "req-1", &other).ok());
  EXPECT_NE(other.id(), first.id());
  EXPECT_EQ(List({}).jobs_size(), 2);
}

// CPUs and memory (issue 52): a job whose ranks no set of nodes holds is refused at submit naming
// the field; placement counts what running jobs' ranks hold (their requests, or the node's charge
// per device); the node lists what it offers and what is held.
TEST_F(CoordinatorServiceTest, JobsArePlacedByTheirRanksCpusAndMemoryAndRefusedWhenNoNodeHolds) {
  const int64_t gib = int64_t{1} << 30;
  v1::RegisterNodeRequest r = CountingNode("n1");
  r.mutable_host()->set_cgroups("cgroup v1 (memory, cpu, pids, freezer)");
  auto n1 = testing::NodeSession::ConnectWith(channel_, tokens_->Node("n1"), r);

  v1::JobSpec too_much = Spec(1, "too-much");
  too_much.mutable_resources()->set_memory_bytes(32 * gib);
  grpc::Status s = Submit(too_much, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("resources.memory: 1 ranks of 32.0 GiB each fit on no set of nodes"));
  v1::JobSpec cpus = Spec(2, "cpus");
  cpus.mutable_resources()->set_cpus(3);
  s = Submit(cpus, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("resources.cpus: 2 ranks of 3 CPUs each"));
  v1::JobSpec bad = Spec(1, "bad");
  bad.mutable_resources()->set_cpus(-1);
  s = Submit(bad, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("resources.cpus"));

  // a: 2 ranks of 6 GiB hold 12 of the 16 GiB; b asks nothing (4 GiB a rank here) for 2 ranks:
  // 2 devices are free, but memory for 1 rank only.
  v1::JobSpec big = Spec(2, "a");
  big.mutable_resources()->set_memory_bytes(6 * gib);
  const v1::Job a = MustSubmit(big);
  const v1::Job b = MustSubmit(Spec(2, "b"));
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  v1::Job got;
  ASSERT_TRUE(Get(a.id(), &got).ok());
  EXPECT_EQ(got.state(), v1::RUNNING);
  ASSERT_TRUE(Get(b.id(), &got).ok());
  EXPECT_EQ(got.state(), v1::QUEUED);
  EXPECT_THAT(got.why_waiting(), HasSubstr("waiting for 2 free devices (with the CPUs and memory"));
  // A list says why too when asked (the web console's sharing page), for waiting jobs only, and
  // for a page of at most 200.
  v1::ListJobsRequest list;
  list.set_why_waiting(true);
  const v1::ListJobsResponse listed = List(list);
  ASSERT_EQ(listed.jobs_size(), 2);
  EXPECT_EQ(listed.jobs(0).id(), b.id());
  EXPECT_EQ(listed.jobs(0).why_waiting(), got.why_waiting());
  EXPECT_EQ(listed.jobs(1).why_waiting(), "");
  EXPECT_EQ(List(v1::ListJobsRequest()).jobs(0).why_waiting(), "") << "not asked";
  list.set_page_size(201);
  grpc::Status refused;
  List(list, &refused);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(refused.error_message(), "page_size: at most 200 with why_waiting, got 201");
  const v1::Node node = Node("n1");
  EXPECT_EQ(node.host().memory_bytes(), 16 * gib);
  EXPECT_EQ(node.host().cgroups(), "cgroup v1 (memory, cpu, pids, freezer)");
  EXPECT_EQ(node.allocated_memory_bytes(), 12 * gib);
  EXPECT_DOUBLE_EQ(node.allocated_cpus(), 2);  // a's ranks asked no CPUs: 1 each here
  EXPECT_EQ(node.allocated_devices_size(), 2);
  // A node's per-device share of its CPUs (2/3 of one), on each of its 3 devices, fits its CPUs.
  EXPECT_LE(3 * CpuMillis(2.0 / 3), CpuMillis(2));
  EXPECT_EQ(CpuMillis(4.35), 4350);
}

// A cancelled job's ranks hold their CPUs and memory, not only their devices, until they exit:
// a job that needs them waits (and the node lists them as held), though devices are free.
TEST_F(CoordinatorServiceTest, AStoppingRanksCpusAndMemoryStayHeldUntilItExits) {
  const int64_t gib = int64_t{1} << 30;
  auto n1 = testing::NodeSession::ConnectWith(channel_, tokens_->Node("n1"), CountingNode("n1"));
  // a: 2 ranks of 2 CPUs and 6 GiB each, all the CPUs and 12 of the 16 GiB.
  v1::JobSpec big = Spec(2, "a");
  big.mutable_resources()->set_cpus(2);
  big.mutable_resources()->set_memory_bytes(6 * gib);
  const v1::Job a = MustSubmit(big);
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment placed = n1->NextCommand().assignment();
  ASSERT_TRUE(Cancel(a.id()).ok());
  ASSERT_TRUE(n1->NextCommand().has_cancel());
  v1::JobSpec small = Spec(1, "b");  // 1 CPU and 4 GiB, the node's charge per device
  const v1::Job b = MustSubmit(small);
  EXPECT_EQ(server_->jobs().SchedulePass(), 0) << "2 devices are free, no CPU is";
  v1::Node node = Node("n1");
  EXPECT_DOUBLE_EQ(node.allocated_cpus(), 4);
  EXPECT_EQ(node.allocated_memory_bytes(), 12 * gib);
  EXPECT_EQ(node.allocated_devices_size(), 2);

  n1->ReportExit(placed, 0, 128 + SIGTERM);
  n1->Heartbeat();  // processed
  node = Node("n1");
  EXPECT_DOUBLE_EQ(node.allocated_cpus(), 2);
  EXPECT_EQ(node.allocated_memory_bytes(), 6 * gib);
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(n1->NextCommand().assignment().job_id(), b.id());
}

// yard admin node cordon|drain|uncordon: admins only; a cordoned node takes no new ranks while
// its running ones go on; a drain asks its running jobs to checkpoint and stop (the preemption
// path), after which they wait to be placed elsewhere and the node is empty.
TEST_F(CoordinatorServiceTest, ACordonedNodeTakesNoNewRanksAndADrainMovesItsJobsOff) {
  auto n1 = Connect("n1", 1);
  auto n2 = Connect("n2", 1);
  auto cordon = [&](const std::string& node, v1::CordonAction action, const std::string& token,
                    v1::CordonNodeResponse* out = nullptr,
                    const std::string& reason = "disk check") {
    grpc::ClientContext ctx;
    PrepareToken(ctx, token);
    v1::CordonNodeRequest r;
    r.set_node_id(node);
    r.set_action(action);
    r.set_reason(reason);
    v1::CordonNodeResponse resp;
    grpc::Status s = nodes_->CordonNode(&ctx, r, &resp);
    if (out != nullptr) *out = resp;
    return s;
  };
  const std::string admin = tokens_->User("root", v1::ADMIN);
  EXPECT_EQ(cordon("n1", v1::CORDON, tokens_->User("alice")).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(cordon("n9", v1::CORDON, admin).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::Status bad = cordon("n1", v1::CORDON_ACTION_UNSPECIFIED, admin);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), StartsWith("action:"));
  // The reason is kept with the node and shown to everyone: at most 1024 bytes.
  v1::CordonNodeResponse longest;
  ASSERT_TRUE(cordon("n1", v1::CORDON, admin, &longest, std::string(1024, 'r')).ok());
  EXPECT_EQ(longest.node().cordon_reason().size(), 1024u);
  ASSERT_TRUE(cordon("n1", v1::UNCORDON, admin).ok());
  bad = cordon("n1", v1::CORDON, admin, nullptr, std::string(1025, 'r'));
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), StartsWith("reason: 1025 bytes, at most 1024"));
  EXPECT_FALSE(Node("n1").cordoned()) << "a refused call changes nothing";

  v1::CordonNodeResponse done;
  ASSERT_TRUE(cordon("n1", v1::CORDON, admin, &done).ok());
  EXPECT_TRUE(done.node().cordoned());
  EXPECT_FALSE(done.node().draining());
  EXPECT_EQ(done.node().cordon_reason(), "disk check");
  EXPECT_EQ(done.node().cordoned_by(), "root");

  // n1 is free but cordoned: the job goes to n2, and the next one waits.
  v1::Job a = MustSubmit(Spec(1, "a"));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment on_n2 = n2->NextCommand().assignment();
  EXPECT_EQ(on_n2.job_id(), a.id());
  v1::Job b = MustSubmit(Spec(1, "b"));
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  v1::Job got;
  ASSERT_TRUE(Get(b.id(), &got).ok());
  EXPECT_EQ(got.state(), v1::QUEUED);

  // Uncordoned, n1 takes b; drained, n2's job is asked to checkpoint and stop.
  ASSERT_TRUE(cordon("n1", v1::UNCORDON, admin, &done).ok());
  EXPECT_FALSE(done.node().cordoned());
  EXPECT_TRUE(done.node().cordon_reason().empty());
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(n1->NextCommand().assignment().job_id(), b.id());
  ASSERT_TRUE(cordon("n2", v1::DRAIN, admin, &done).ok());
  EXPECT_TRUE(done.node().cordoned());
  EXPECT_TRUE(done.node().draining());
  EXPECT_THAT(done.moving_jobs(), ElementsAre(a.id()));
  ASSERT_TRUE(Get(a.id(), &got).ok());
  EXPECT_NE(got.preempt_deadline_ms(), 0);
  EXPECT_EQ(got.preempted_by(), "drain of node n2");
  // Its rank checkpoints and exits 0: the job waits (PREEMPTED) for a node other than n2.
  n2->ReportExit(on_n2, 0, 0);
  got = WaitForState(a.id(), v1::PREEMPTED);
  EXPECT_THAT(got.message(), HasSubstr("preempted by drain of node n2"));
  EXPECT_EQ(server_->jobs().SchedulePass(), 0) << "n2 is drained, n1 busy";
  const v1::Node drained = Node("n2");
  EXPECT_TRUE(drained.draining());
  EXPECT_TRUE(drained.allocated_devices().empty());
  // A second drain of an empty node asks nobody.
  ASSERT_TRUE(cordon("n2", v1::DRAIN, admin, &done).ok());
  EXPECT_TRUE(done.moving_jobs().empty());

  // The hold is stored with the node: a coordinator started again on the same state keeps it.
  n1.reset();
  n2.reset();
  server_->Shutdown();
  server_.reset();  // lets go of the state dir's lock
  coordinator::CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.state_dir = dir_.path() + "/state";
  o.clock = &clock_;
  o.background_threads = false;
  Configure(o);
  auto restarted = coordinator::CoordinatorServer::Start(o);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  server_ = std::move(*restarted);
  std::map<std::string, v1::Node> after;
  for (v1::Node& n : server_->nodes().List()) after[n.id()] = std::move(n);
  ASSERT_EQ(after.count("n2"), 1u);
  EXPECT_TRUE(after["n2"].cordoned());
  EXPECT_TRUE(after["n2"].draining());
  EXPECT_EQ(after["n2"].cordon_reason(), "disk check");
  EXPECT_FALSE(after["n1"].cordoned());
}

TEST_F(CoordinatorServiceTest, GangSpansNodesWhenNoSingleNodeFitsAndWaitsWhenNothingFits) {
  auto n1 = Connect("n1", 2);
  auto n2 = Connect("n2", 2);
  v1::Job big = MustSubmit(Spec(4, "big"));
  v1::Job too_big = MustSubmit(Spec(5, "too-big"));
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  v1::Assignment a1 = n1->NextCommand().assignment();
  v1::Assignment a2 = n2->NextCommand().assignment();
  EXPECT_EQ(a1.job_id(), big.id());
  EXPECT_EQ(a2.job_id(), big.id());
  EXPECT_EQ(a1.world_size(), 4);
  EXPECT_EQ(a1.device_indices_size() + a2.device_indices_size(), 4);
  EXPECT_THAT((std::vector<int>{a1.first_rank(), a2.first_rank()}),
              ::testing::UnorderedElementsAre(0, 2));
  v1::Job waiting;
  ASSERT_TRUE(Get(too_big.id(), &waiting).ok());
  EXPECT_EQ(waiting.state(), v1::QUEUED);
}

TEST_F(CoordinatorServiceTest, HigherPriorityJobIsPlacedFirst) {
  auto node = Connect("n1", 1);
  v1::JobSpec low = Spec(1, "low");
  low.set_priority(10);
  v1::JobSpec high = Spec(1, "high");
  high.set_priority(90);
  MustSubmit(low);
  v1::Job h = MustSubmit(high);
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(node->NextCommand().assignment().job_id(), h.id());
}

TEST_F(CoordinatorServiceTest, SilentNodeIsLostAndItsJobRestartsThenFailsWithoutRestartsLeft) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2, "job", /*max_restarts=*/1));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  node->NextCommand();

  // Heartbeats keep it alive past the timeout measured from registration.
  clock_.Advance(absl::Seconds(6));
  node->Heartbeat();
  clock_.Advance(absl::Seconds(6));
  server_->Tick();
  v1::Job j;
  ASSERT_TRUE(Get(job.id(), &j).ok());
  EXPECT_EQ(j.state(), v1::RUNNING);

  clock_.Advance(absl::Seconds(11));
  server_->Tick();
  j = WaitForState(job.id(), v1::RESTARTING);
  EXPECT_EQ(j.state(), v1::RESTARTING);
  EXPECT_THAT(j.message(), HasSubstr("node n1 lost"));
  EXPECT_EQ(j.restarts(), 1);
  EXPECT_EQ(j.placement_size(), 0);
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::ListNodesResponse nodes;
  ASSERT_TRUE(nodes_->ListNodes(&ctx, {}, &nodes).ok());
  EXPECT_EQ(nodes.nodes(0).state(), v1::NODE_LOST);
  // Its ranks may still run (cut off, not dead): their devices stay held until the node is back.
  EXPECT_EQ(nodes.nodes(0).allocated_devices_size(), 2);

  // The node comes back running nothing; the job's second attempt starts there, and is lost again.
  auto again = Connect("n1", 2);
  EXPECT_EQ(Node("n1").allocated_devices_size(), 0);
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(again->NextCommand().assignment().attempt(), 2);
  ASSERT_TRUE(Get(job.id(), &j).ok());
  EXPECT_THAT(j.message(), StartsWith("restarted: node n1 lost"));
  clock_.Advance(absl::Seconds(11));
  server_->Tick();
  j = WaitForState(job.id(), v1::FAILED);
  EXPECT_EQ(j.state(), v1::FAILED);
  EXPECT_THAT(j.message(), HasSubstr("no restarts left"));
}

// A node whose heartbeats stopped for a while, its session still open, is declared LOST: its old
// ranks are told to stop and then its session is closed, so that a worker that is still there
// reconnects; on its new session it is READY again (it is not lost for good) and takes new ranks.
TEST_F(CoordinatorServiceTest, ALostNodeIsCutOffAndReadyAgainWhenItReconnects) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2, "job", /*max_restarts=*/1));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment first = node->NextCommand().assignment();
  clock_.Advance(absl::Seconds(11));
  server_->Tick();
  EXPECT_EQ(Node("n1").state(), v1::NODE_LOST);
  EXPECT_EQ(WaitForState(job.id(), v1::RESTARTING).state(), v1::RESTARTING);
  // It was told to stop the lost attempt's ranks.
  const v1::CoordinatorMessage cancel = node->NextCommand();
  ASSERT_TRUE(cancel.has_cancel()) << cancel.DebugString();
  EXPECT_EQ(cancel.cancel().attempt(), first.attempt());

  const grpc::Status ended = node->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ended.error_message(), HasSubstr("node declared lost: no heartbeat for 10s"));
  EXPECT_FALSE(Node("n1").connected());

  // The worker reconnects; its stopped ranks have exited meanwhile.
  auto again = Connect("n1", 2);
  EXPECT_EQ(Node("n1").state(), v1::NODE_READY);
  EXPECT_TRUE(Node("n1").connected());
  again->ReportExit(first, 0, 143);
  again->ReportExit(first, 1, 143);
  again->Heartbeat();
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(again->NextCommand().assignment().attempt(), first.attempt() + 1);
}

// A node cut off long enough to be lost comes back with a rank of the old attempt still running:
// the coordinator stops it, and its device waits for its exit before the next attempt gets it,
// however long the node was away.
TEST_F(CoordinatorServiceTest, ANodeBackWithAStaleRankStopsItAndHoldsItsDeviceUntilItExits) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2, "job", /*max_restarts=*/1));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  node.reset();  // cut off
  WaitUntilDisconnected("n1");
  clock_.Advance(absl::Seconds(11));
  server_->Tick();
  ASSERT_EQ(WaitForState(job.id(), v1::RESTARTING).state(), v1::RESTARTING);
  // Away for longer than the drain timeout: without a session, nothing times out.
  clock_.Advance(absl::Minutes(5));
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  EXPECT_EQ(Node("n1").allocated_devices_size(), 2);

  v1::RankStatus stale;
  stale.set_job_id(job.id());
  stale.set_attempt(a.attempt());
  stale.set_rank(1);
  stale.set_phase(v1::RANK_RUNNING);
  auto again = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 2, {stale});
  v1::CoordinatorMessage m = again->NextCommand();
  ASSERT_TRUE(m.has_cancel()) << m.DebugString();
  EXPECT_EQ(m.cancel().attempt(), a.attempt());
  EXPECT_EQ(Node("n1").allocated_devices_size(), 1) << "rank 0 is gone, rank 1 still runs";
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);

  again->ReportExit(a, 1, 128 + SIGTERM);
  again->Heartbeat();
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(again->NextCommand().assignment().attempt(), a.attempt() + 1);
}

// A node that reconnects (to a restarted coordinator, or to a new leader rebuilding its view)
// listing the ranks it runs is not sent them again; one that lists none gets its assignment again,
// once.
TEST_F(CoordinatorServiceTest, AReconnectingNodeGetsAgainOnlyTheAssignmentsItDoesNotRun) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2, "job"));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  ASSERT_EQ(a.job_id(), job.id());
  node.reset();
  WaitUntilDisconnected("n1");
  std::vector<v1::RankStatus> running(2);
  for (int r = 0; r < 2; ++r) {
    running[r].set_job_id(job.id());
    running[r].set_attempt(a.attempt());
    running[r].set_rank(r);
    running[r].set_phase(v1::RANK_RUNNING);
  }
  // (Connect waits for the ack of a heartbeat sent after the hello, which comes after whatever
  // the hello made the coordinator send.)
  auto again = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 2, running);
  again->Heartbeat();
  EXPECT_EQ(again->pending(), 0u) << "the ranks the node runs were assigned again: "
                                  << again->NextCommand().DebugString();
  again.reset();
  WaitUntilDisconnected("n1");

  auto fresh = Connect("n1", 2);  // lists nothing: a worker started again from scratch
  fresh->Heartbeat();
  ASSERT_EQ(fresh->pending(), 1u);
  v1::CoordinatorMessage m = fresh->NextCommand();
  ASSERT_TRUE(m.has_assignment());
  EXPECT_EQ(m.assignment().job_id(), job.id());
  EXPECT_EQ(m.assignment().attempt(), a.attempt());
  fresh->Heartbeat();
  EXPECT_EQ(fresh->pending(), 0u);
  EXPECT_EQ(WaitForState(job.id(), v1::RUNNING).attempt(), a.attempt());
}

TEST_F(CoordinatorServiceTest, JobPastItsMaxRuntimeFailsAndFreesItsDevices) {
  auto node = Connect("n1", 1);
  v1::JobSpec spec = Spec(1, "limited", /*max_restarts=*/3);
  spec.set_max_runtime_seconds(60);
  v1::Job job = MustSubmit(spec);
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  node->NextCommand();
  clock_.Advance(absl::Seconds(59));
  node->Heartbeat();
  server_->Tick();
  v1::Job j;
  ASSERT_TRUE(Get(job.id(), &j).ok());
  EXPECT_EQ(j.state(), v1::RUNNING);
  clock_.Advance(absl::Seconds(2));
  node->Heartbeat();
  server_->Tick();
  j = WaitForState(job.id(), v1::FAILED);
  EXPECT_EQ(j.state(), v1::FAILED);  // no restart: the limit belongs to the job
  EXPECT_THAT(j.message(), HasSubstr("exceeded max_runtime of 1m"));
  v1::CoordinatorMessage m = node->NextCommand();
  ASSERT_TRUE(m.has_cancel());
  EXPECT_EQ(m.cancel().job_id(), job.id());
}

TEST_F(CoordinatorServiceTest, ShortJobIsBackfilledAheadOfABlockedBiggerJob) {
  auto node = Connect("n1", 2);
  v1::JobSpec running = Spec(1, "running");
  running.set_max_runtime_seconds(600);
  MustSubmit(running);
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  node->NextCommand();
  v1::JobSpec head = Spec(2, "head");  // waits for the running job's device
  head.set_priority(90);
  v1::JobSpec short_job = Spec(1, "short");
  short_job.set_priority(10);
  short_job.set_max_runtime_seconds(300);  // ends before the head can start
  v1::JobSpec long_job = Spec(1, "long");
  long_job.set_priority(20);
  long_job.set_max_runtime_seconds(3600);  // would delay the head: must wait
  v1::Job h = MustSubmit(head);
  v1::Job l = MustSubmit(long_job);
  v1::Job s = MustSubmit(short_job);
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  EXPECT_EQ(a.job_id(), s.id());
  v1::Job got;
  ASSERT_TRUE(Get(s.id(), &got).ok());
  EXPECT_TRUE(got.backfilled());
  ASSERT_TRUE(Get(h.id(), &got).ok());
  EXPECT_EQ(got.state(), v1::QUEUED);
  ASSERT_TRUE(Get(l.id(), &got).ok());
  EXPECT_EQ(got.state(), v1::QUEUED);
}

TEST_F(CoordinatorServiceTest, RankFailureRestartsTheJobWithTheExitCode) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2, "job", /*max_restarts=*/2));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  node->ReportExit(a, 1, 3);
  v1::Job j = WaitForState(job.id(), v1::RESTARTING);
  EXPECT_THAT(j.message(), HasSubstr("rank 1 on node n1 exited with code 3"));
  // The other rank is told to stop.
  v1::CoordinatorMessage cancel = node->NextCommand();
  ASSERT_TRUE(cancel.has_cancel());
  EXPECT_EQ(cancel.cancel().job_id(), job.id());
  EXPECT_EQ(cancel.cancel().attempt(), 1);
}

// The devices of a cancelled job are free once its ranks have reported their exit, not before:
// a rank still shutting down may hold its GPU's memory.
TEST_F(CoordinatorServiceTest, CancellingARunningJobStopsItsRanksAndFreesItsDevicesOnceTheyExit) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  ASSERT_TRUE(Cancel(job.id()).ok());
  v1::CoordinatorMessage m = node->NextCommand();
  ASSERT_TRUE(m.has_cancel());
  EXPECT_EQ(m.cancel().job_id(), job.id());
  v1::Job next = MustSubmit(Spec(2, "next"));
  EXPECT_EQ(server_->jobs().SchedulePass(), 0) << "ranks still stopping";
  EXPECT_EQ(Node("n1").allocated_devices_size(), 2);

  node->ReportExit(a, 0, 128 + SIGTERM);
  node->Heartbeat();  // processed
  EXPECT_EQ(server_->jobs().SchedulePass(), 0) << "rank 1 still stopping";
  EXPECT_EQ(Node("n1").allocated_devices_size(), 1);
  node->ReportExit(a, 1, 128 + SIGKILL);
  node->Heartbeat();
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(node->NextCommand().assignment().job_id(), next.id());
}

// A failed rank's own device is free at once; its peers' devices once they have stopped; and a
// rank that never reports its exit (its worker died with it) gives its device back after a minute.
TEST_F(CoordinatorServiceTest, AFailedAttemptsDevicesFreeAsItsRanksExitOrAfterTheDrainTimeout) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  node->ReportExit(a, 1, 3);
  EXPECT_TRUE(node->NextCommand().has_cancel());  // rank 0 is told to stop
  EXPECT_EQ(WaitForState(job.id(), v1::FAILED).state(), v1::FAILED);

  EXPECT_EQ(Node("n1").allocated_devices_size(), 1);
  v1::Job one = MustSubmit(Spec(1, "one"));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1) << "rank 1's device is free";
  EXPECT_EQ(node->NextCommand().assignment().job_id(), one.id());
  v1::Job two = MustSubmit(Spec(2, "two"));
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);

  clock_.Advance(absl::Seconds(59));
  node->Heartbeat();
  ASSERT_TRUE(Cancel(one.id()).ok());  // its rank never reports either
  EXPECT_TRUE(node->NextCommand().has_cancel());
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  clock_.Advance(absl::Seconds(2));
  node->Heartbeat();
  EXPECT_EQ(server_->jobs().SchedulePass(), 0) << "only rank 0 of the first job timed out";
  EXPECT_EQ(Node("n1").allocated_devices_size(), 1);
  clock_.Advance(absl::Seconds(59));
  node->Heartbeat();
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(node->NextCommand().assignment().job_id(), two.id());
}

// A worker that gives its ranks a long stop grace (--stop-grace 5m) says so at registration: a
// cancelled rank that has not reported its exit keeps its device through that grace and a margin,
// not the default minute, so that no new rank is placed beside one still saving its checkpoint.
TEST_F(CoordinatorServiceTest, AStoppedRanksDeviceIsHeldThroughItsNodesStopGrace) {
  auto node = testing::NodeSession::ConnectWith(
      channel_, tokens_->Node("n1"), WithGraces("n1", absl::Minutes(5), absl::ZeroDuration()));
  EXPECT_EQ(Node("n1").host().stop_grace_ms(), 5 * 60 * 1000);
  v1::Job job = MustSubmit(Spec(1));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  node->NextCommand();  // its assignment
  ASSERT_TRUE(Cancel(job.id()).ok());
  ASSERT_TRUE(node->NextCommand().has_cancel());
  v1::Job next = MustSubmit(Spec(1, "next"));
  clock_.Advance(absl::Minutes(5));  // past the default minute, within the grace and margin
  node->Heartbeat();
  EXPECT_EQ(server_->jobs().SchedulePass(), 0) << "the cancelled rank may still be saving";
  EXPECT_EQ(Node("n1").allocated_devices_size(), 1);
  clock_.Advance(absl::Seconds(31));
  node->Heartbeat();
  EXPECT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(node->NextCommand().assignment().job_id(), next.id());

  // A grace over a day, or a maximum over a day, is refused, naming the field.
  for (const auto& [r, field] :
       {std::pair{WithGraces("n2", absl::Hours(25), absl::ZeroDuration()), "host.stop_grace_ms"},
        {WithGraces("n2", absl::Seconds(10), absl::Hours(25)), "host.max_stop_grace_ms"}}) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Node("n2"));
    v1::RegisterNodeResponse resp;
    const grpc::Status refused = nodes_->RegisterNode(&ctx, r, &resp);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_THAT(refused.error_message(), HasSubstr(absl::StrCat(field, ": must be in")));
  }
}

// A job's own stop_grace, up to the node's --max-stop-grace, is how long its stopping rank keeps
// its device (with the margin), as the worker gives it that long before SIGKILL.
TEST_F(CoordinatorServiceTest, AStoppedRanksDeviceIsHeldThroughItsJobsStopGraceUpToTheNodes) {
  auto node = testing::NodeSession::ConnectWith(
      channel_, tokens_->Node("n1"), WithGraces("n1", absl::Seconds(10), absl::Minutes(10)));
  // (asked, what it gets: the node's maximum caps the second)
  for (const auto& [asked, held] :
       {std::pair{absl::Minutes(3), absl::Minutes(3)}, {absl::Hours(1), absl::Minutes(10)}}) {
    v1::JobSpec spec = Spec(1);
    spec.set_stop_grace_seconds(absl::ToInt64Seconds(asked));
    v1::Job job = MustSubmit(spec);
    ASSERT_EQ(server_->jobs().SchedulePass(), 1);
    EXPECT_EQ(node->NextCommand().assignment().job_id(), job.id());
    ASSERT_TRUE(Cancel(job.id()).ok());
    ASSERT_TRUE(node->NextCommand().has_cancel());
    v1::Job next = MustSubmit(Spec(1, "next"));
    SCOPED_TRACE(FormatDuration(asked));
    v1::Assignment a;
    ExpectHeldFor(*node, held + absl::Seconds(30), next, &a);
    ASSERT_EQ(a.job_id(), next.id());
    node->ReportExit(a, 0, 0);
    ASSERT_EQ(WaitForState(next.id(), v1::SUCCEEDED).state(), v1::SUCCEEDED);
  }
}

// A node that says hello while a cancelled rank still stops gives that rank a new grace: its
// job's (3 minutes here, and the margin), not the node's longest (its 10-minute maximum).
TEST_F(CoordinatorServiceTest, ARankStillStoppingAtItsNodesHelloGetsItsJobsGraceAgain) {
  auto [node, job, a] = PlacedWithStopGrace(absl::Seconds(180));
  ASSERT_TRUE(Cancel(job.id()).ok());
  ASSERT_TRUE(node->NextCommand().has_cancel());
  v1::Job next = MustSubmit(Spec(1, "next"));
  clock_.Advance(absl::Minutes(1));
  // The worker reconnects, its rank still stopping.
  auto again = RestartWithRankRunning(std::move(node), a, absl::Minutes(10));
  ASSERT_TRUE(again->NextCommand().has_cancel());                     // told to stop again
  ExpectHeldFor(*again, absl::Minutes(3) + absl::Seconds(30), next);  // the grace and the margin
}

// A worker restarted with a lower --max-stop-grace still runs a rank its shepherd gives the old,
// longer grace: the hello says so (RankStatus.stop_grace_ms), and the device is held for that
// grace and the margin from the hello, not for the node's new maximum.
TEST_F(CoordinatorServiceTest, ARankStillStoppingKeepsTheGraceItsShepherdReportsAtTheHello) {
  auto [node, job, a] = PlacedWithStopGrace(absl::Seconds(600));
  ASSERT_TRUE(Cancel(job.id()).ok());
  ASSERT_TRUE(node->NextCommand().has_cancel());
  v1::Job next = MustSubmit(Spec(1, "next"));
  // The worker restarts with --max-stop-grace 1m, its rank still stopping.
  auto again = RestartWithRankRunning(std::move(node), a, absl::Minutes(1), absl::Minutes(10));
  ASSERT_TRUE(again->NextCommand().has_cancel());                      // told to stop again
  ExpectHeldFor(*again, absl::Minutes(10) + absl::Seconds(30), next);  // the grace and the margin
}

// The same for a rank still running at the hello, its job's current attempt: stopped later (a
// cancel), it keeps the grace its shepherd reported, not the node's new maximum.
TEST_F(CoordinatorServiceTest, ARunningRankStoppedAfterTheHelloKeepsTheGraceItsShepherdReported) {
  auto [node, job, a] = PlacedWithStopGrace(absl::Seconds(600));
  // The worker restarts with --max-stop-grace 1m, its rank running on.
  auto again = RestartWithRankRunning(std::move(node), a, absl::Minutes(1), absl::Minutes(10));
  again->Heartbeat();
  ASSERT_EQ(WaitForState(job.id(), v1::RUNNING).state(), v1::RUNNING);
  ASSERT_TRUE(Cancel(job.id()).ok());
  ASSERT_TRUE(again->NextCommand().has_cancel());
  v1::Job next = MustSubmit(Spec(1, "next"));
  ExpectHeldFor(*again, absl::Minutes(10) + absl::Seconds(30), next);  // the grace and the margin
}

// A job array's %N counts a task once: a task restarting while its failed attempt's ranks still
// stop holds its own place (it starts again on free devices, as any job does), and the array's
// other tasks still wait for it.
TEST_F(CoordinatorServiceTest, ARestartingArrayTaskIsNotHeldByItsOwnStoppingRanks) {
  auto node = Connect("n1", 4);
  std::vector<v1::Job> tasks;
  for (int i = 0; i < 2; ++i) {
    v1::JobSpec spec = Spec(2, absl::StrCat("task-", i), /*max_restarts=*/1);
    spec.mutable_array()->set_id("sweep");
    spec.mutable_array()->set_index(i);
    spec.mutable_array()->set_count(2);
    spec.mutable_array()->set_max_running(1);
    tasks.push_back(MustSubmit(spec));
  }
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment first = node->NextCommand().assignment();
  ASSERT_EQ(first.job_id(), tasks[0].id());
  node->ReportExit(first, 1, 3);                  // rank 1 fails...
  ASSERT_TRUE(node->NextCommand().has_cancel());  // ...rank 0 is told to stop, and does not yet
  ASSERT_EQ(WaitForState(tasks[0].id(), v1::RESTARTING).state(), v1::RESTARTING);
  // Three devices are free: task 0 starts again on two; task 1 still waits for the array.
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment again = node->NextCommand().assignment();
  EXPECT_EQ(again.job_id(), tasks[0].id());
  EXPECT_EQ(again.attempt(), first.attempt() + 1);
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  v1::Job waiting;
  ASSERT_TRUE(Get(tasks[1].id(), &waiting).ok());
  EXPECT_EQ(waiting.state(), v1::QUEUED);
  EXPECT_THAT(waiting.why_waiting(), HasSubstr("at most 1 at once"));
}

TEST_F(CoordinatorServiceTest, BadNodeRegistrationsAndSessionsAreRejected) {
  grpc::ClientContext ctx;
  PrepareToken(ctx, tokens_->Node("n1"));
  v1::RegisterNodeRequest r;
  v1::RegisterNodeResponse resp;
  grpc::Status s = nodes_->RegisterNode(&ctx, r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), StartsWith("node_id:"));

  grpc::ClientContext ctx2;
  PrepareToken(ctx2, tokens_->Node("n1"));
  r.set_node_id("n1");
  r.add_devices()->set_kind(v1::CPU_SLOT);
  r.add_devices()->set_kind(v1::CPU_SLOT);  // index 0 twice
  s = nodes_->RegisterNode(&ctx2, r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), StartsWith("devices[1].index: duplicate"));

  // A session that does not start with hello, and one for a node never registered.
  for (bool hello : {false, true}) {
    grpc::ClientContext sctx;
    PrepareToken(sctx, tokens_->Node("ghost"));
    auto stream = nodes_->Session(&sctx);
    v1::NodeMessage m;
    if (hello) {
      m.mutable_hello()->set_node_id("ghost");
    } else {
      m.mutable_heartbeat()->set_seq(1);
    }
    stream->Write(m);
    stream->WritesDone();
    v1::CoordinatorMessage in;
    while (stream->Read(&in)) {
    }
    grpc::Status fs = stream->Finish();
    EXPECT_EQ(fs.error_code(),
              hello ? grpc::StatusCode::NOT_FOUND : grpc::StatusCode::INVALID_ARGUMENT);
  }
}

TEST_F(CoordinatorServiceTest, RendezvousIsScopedToTheRunningAttemptAndBlocksUntilSet) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  node->NextCommand();
  v1::RendezvousScope scope;
  scope.set_job_id(job.id());
  scope.set_attempt(1);
  const std::string rank_token = tokens_->Job(job.id(), 1);

  // A blocked Get returns once another rank sets the key.
  auto getter = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    PrepareToken(ctx, rank_token);
    v1::GetRequest r;
    *r.mutable_scope() = scope;
    r.set_key("master");
    r.set_timeout_ms(10000);
    v1::GetResponse resp;
    grpc::Status s = rdzv_->Get(&ctx, r, &resp);
    return s.ok() ? resp.value() : "error: " + s.error_message();
  });
  {
    grpc::ClientContext ctx;
    PrepareToken(ctx, rank_token);
    v1::SetRequest r;
    *r.mutable_scope() = scope;
    r.set_key("master");
    r.set_value("127.0.0.1:29500");
    v1::SetResponse resp;
    ASSERT_TRUE(rdzv_->Set(&ctx, r, &resp).ok());
  }
  EXPECT_EQ(getter.get(), "127.0.0.1:29500");

  // Add counts; a missing key times out; another attempt is not running.
  for (int expected : {1, 2}) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, rank_token);
    v1::AddRequest r;
    *r.mutable_scope() = scope;
    r.set_key("count");
    r.set_delta(1);
    v1::AddResponse resp;
    ASSERT_TRUE(rdzv_->Add(&ctx, r, &resp).ok());
    EXPECT_EQ(resp.value(), expected);
  }
  {
    grpc::ClientContext ctx;
    PrepareToken(ctx, rank_token);
    v1::GetRequest r;
    *r.mutable_scope() = scope;
    r.set_key("never");
    r.set_timeout_ms(100);
    v1::GetResponse resp;
    EXPECT_EQ(rdzv_->Get(&ctx, r, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Job(job.id(), 2));  // that attempt's own credential
    v1::SetRequest r;
    *r.mutable_scope() = scope;
    r.mutable_scope()->set_attempt(2);
    r.set_key("k");
    v1::SetResponse resp;
    grpc::Status s = rdzv_->Set(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("attempt 2 is not running"));
  }
  // Two ranks meet at a barrier.
  auto enter = [&](int rank) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, rank_token);
    v1::BarrierRequest r;
    *r.mutable_scope() = scope;
    r.set_name("init");
    r.set_rank(rank);
    r.set_world_size(2);
    r.set_timeout_ms(10000);
    v1::BarrierResponse resp;
    return rdzv_->Barrier(&ctx, r, &resp).error_code();
  };
  auto rank0 = std::async(std::launch::async, enter, 0);
  EXPECT_EQ(enter(1), grpc::StatusCode::OK);
  EXPECT_EQ(rank0.get(), grpc::StatusCode::OK);
  {
    grpc::ClientContext ctx;
    PrepareToken(ctx, rank_token);
    v1::BarrierRequest r;
    *r.mutable_scope() = scope;
    r.set_name("init2");
    r.set_rank(5);
    r.set_world_size(2);
    v1::BarrierResponse resp;
    grpc::Status s = rdzv_->Barrier(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), StartsWith("rank:"));
  }
  // When the attempt ends, its keys go with it.
  ASSERT_TRUE(Cancel(job.id()).ok());
  grpc::ClientContext ctx;
  PrepareToken(ctx, rank_token);
  v1::CheckRequest r;
  *r.mutable_scope() = scope;
  r.add_keys("master");
  v1::CheckResponse resp;
  EXPECT_EQ(rdzv_->Check(&ctx, r, &resp).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(CoordinatorServiceTest, StepReportsFeedMetricsAndCarryCheckpointRequestsUntilReported) {
  auto node = Connect("n1", 1);
  v1::Job job = MustSubmit(Spec(1));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  EXPECT_EQ(a.checkpoint_dir(), dir_.path() + "/state/checkpoints/" + job.id());

  auto report = [&](int64_t step, int attempt, v1::TrainerCommands* commands) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Job(job.id(), attempt));
    v1::StepReport r;
    r.set_job_id(job.id());
    r.set_attempt(attempt);
    r.set_step(step);
    r.set_total_steps(10);
    r.set_loss(5.0 - step);
    return trainer_->ReportStep(&ctx, r, commands);
  };
  v1::TrainerCommands commands;
  ASSERT_TRUE(report(1, 1, &commands).ok());
  EXPECT_FALSE(commands.checkpoint_requested());
  EXPECT_EQ(report(2, 7, &commands).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(report(0, 1, &commands).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  {  // yard checkpoint → CHECKPOINTING; the next report asks the ranks for one
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::CheckpointJobRequest r;
    r.set_job_id(job.id());
    v1::Job j;
    ASSERT_TRUE(jobs_->CheckpointJob(&ctx, r, &j).ok());
    EXPECT_EQ(j.state(), v1::CHECKPOINTING);
  }
  ASSERT_TRUE(report(2, 1, &commands).ok());
  EXPECT_TRUE(commands.checkpoint_requested());
  // Rank 0's report of its step-2 checkpoint, edited by `edit`.
  auto checkpoint = [&](const std::function<void(v1::CheckpointReport&)>& edit) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Job(job.id(), 1));
    v1::CheckpointReport r;
    r.set_job_id(job.id());
    r.set_attempt(1);
    r.set_step(2);
    r.set_path("/ckpt/step-2");
    r.set_bytes(1234);
    edit(r);
    return trainer_->ReportCheckpoint(&ctx, r, &commands);
  };
  ASSERT_TRUE(checkpoint([](v1::CheckpointReport&) {}).ok());
  EXPECT_FALSE(commands.checkpoint_requested());
  v1::Job j = WaitForState(job.id(), v1::RUNNING);
  EXPECT_EQ(j.last_checkpoint().step(), 2);
  EXPECT_EQ(j.last_checkpoint().path(), "/ckpt/step-2");
  EXPECT_EQ(j.step(), 2);
  {  // A malformed report is refused naming the field, and changes nothing.
    // With an older checkpoint that retention keeps.
    auto with_kept = [&](const std::function<void(v1::CheckpointReport&)>& edit) {
      return checkpoint([&](v1::CheckpointReport& r) {
        v1::KeptCheckpoint* kept = r.add_kept();
        kept->set_step(1);
        kept->set_path("/ckpt/step-1");
        kept->set_eval_loss(1.5);
        edit(r);
      });
    };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const std::vector<std::pair<std::function<void(v1::CheckpointReport&)>, std::string>> bad = {
        {[&](v1::CheckpointReport& r) { r.mutable_kept(0)->set_eval_loss(nan); },
         "kept[0].eval_loss: must be finite"},
        {[&](v1::CheckpointReport& r) { r.set_eval_loss(std::numeric_limits<double>::infinity()); },
         "eval_loss: must be finite"},
        {[](v1::CheckpointReport& r) { r.mutable_kept(0)->clear_path(); },
         "kept[0].path: required"},
        {[](v1::CheckpointReport& r) { r.mutable_kept(0)->set_step(-1); },
         "kept[0].step: must be >= 0, got -1"},
        {[](v1::CheckpointReport& r) { r.set_bytes(-5); }, "bytes: must be >= 0, got -5"},
        {[](v1::CheckpointReport& r) {
           for (int i = 0; i < 100; ++i) *r.add_kept() = r.kept(0);
         },
         "kept: 101 entries, at most 100"},
    };
    for (const auto& [edit, message] : bad) {
      const grpc::Status s = with_kept(edit);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
      EXPECT_EQ(s.error_message(), message);
    }
    v1::Job kept;
    ASSERT_TRUE(Get(job.id(), &kept).ok());
    EXPECT_EQ(kept.kept_checkpoints_size(), 0);
    ASSERT_TRUE(with_kept([](v1::CheckpointReport&) {}).ok());
    ASSERT_TRUE(Get(job.id(), &kept).ok());
    ASSERT_EQ(kept.kept_checkpoints_size(), 1);
    EXPECT_EQ(kept.kept_checkpoints(0).step(), 1);
    EXPECT_EQ(kept.kept_checkpoints(0).eval_loss(), 1.5);
  }
  ASSERT_TRUE(report(3, 1, &commands).ok());
  EXPECT_FALSE(commands.checkpoint_requested());
  {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Job(job.id(), 1));
    v1::StepReport r;
    r.set_job_id(job.id());
    r.set_attempt(1);
    r.set_step(4);
    // Another rank's report fetches the commands; it is not one of the job's rows.
    r.set_rank(1);
    ASSERT_TRUE(trainer_->ReportStep(&ctx, r, &commands).ok());
    // A program's own metrics: at most 64 by name.
    for (int i = 0; i < 65; ++i) (*r.mutable_metrics())[absl::StrCat("m", i)] = i;
    grpc::ClientContext ctx2;
    PrepareToken(ctx2, tokens_->Job(job.id(), 1));
    grpc::Status s = trainer_->ReportStep(&ctx2, r, &commands);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(s.error_message(), "metrics: 65 entries, at most 64");
  }

  // The metrics stream has every accepted report of rank 0, in order.
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::StreamMetricsRequest r;
  r.set_job_id(job.id());
  auto reader = jobs_->StreamMetrics(&ctx, r);
  std::vector<int64_t> steps;
  v1::StepReport step;
  while (reader->Read(&step)) steps.push_back(step.step());
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_THAT(steps, ElementsAre(1, 2, 3));
}

// A coordinator restarted under a running job (an upgrade) shows the job's logs and metrics from
// before the restart, and adds to them; restarted again once the job ended, it still shows them.
TEST_F(CoordinatorServiceTest, ARunningJobsLogsAndMetricsSurviveARestart) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  ASSERT_TRUE(node->NextCommand().has_assignment());
  auto report = [&](int64_t step) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Job(job.id(), 1));
    v1::StepReport r;
    r.set_job_id(job.id());
    r.set_attempt(1);
    r.set_step(step);
    r.set_total_steps(10);
    r.set_loss(5.0 - step);
    v1::TrainerCommands commands;
    return trainer_->ReportStep(&ctx, r, &commands);
  };
  auto log = [&](const std::string& text) {
    v1::NodeMessage m;
    m.mutable_logs()->set_job_id(job.id());
    m.mutable_logs()->set_attempt(1);
    m.mutable_logs()->set_rank(0);
    m.mutable_logs()->add_lines(text);
    ASSERT_TRUE(node->Write(m));
    node->Heartbeat();  // the lines are handled before the ack
  };
  auto steps = [&] {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::StreamMetricsRequest r;
    r.set_job_id(job.id());
    auto reader = jobs_->StreamMetrics(&ctx, r);
    std::vector<int64_t> out;
    for (v1::StepReport step; reader->Read(&step);) out.push_back(step.step());
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  };
  auto lines = [&] {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::StreamLogsRequest r;
    r.set_job_id(job.id());
    auto reader = jobs_->StreamLogs(&ctx, r);
    std::vector<std::string> out;
    for (v1::LogLine line; reader->Read(&line);) out.push_back(line.text());
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  };
  for (int64_t step : {1, 2, 3}) ASSERT_TRUE(report(step).ok());
  log("before the restart");
  ASSERT_THAT(steps(), ElementsAre(1, 2, 3));

  node.reset();
  Restart();
  EXPECT_THAT(steps(), ElementsAre(1, 2, 3));
  EXPECT_THAT(lines(), ElementsAre("before the restart"));
  // The node comes back with its ranks running; the job goes on where it was.
  std::vector<v1::RankStatus> running(2);
  for (int r = 0; r < 2; ++r) {
    running[r].set_job_id(job.id());
    running[r].set_attempt(1);
    running[r].set_rank(r);
    running[r].set_phase(v1::RANK_RUNNING);
  }
  node = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 2, running);
  ASSERT_TRUE(report(4).ok());
  log("after it");
  EXPECT_THAT(steps(), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(lines(), ElementsAre("before the restart", "after it"));
  EXPECT_EQ(WaitForState(job.id(), v1::RUNNING).attempt(), 1);

  // It ends, and the coordinator restarts within the finished job's retention (the job is held
  // in memory again): its logs and metrics are all there (issue 54; they were lost).
  v1::Assignment a;
  a.set_job_id(job.id());
  a.set_attempt(1);
  node->ReportExit(a, 0, 0);
  node->ReportExit(a, 1, 0);
  ASSERT_EQ(WaitForState(job.id(), v1::SUCCEEDED).state(), v1::SUCCEEDED);
  node.reset();
  Restart();
  EXPECT_THAT(steps(), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(lines(), ElementsAre("before the restart", "after it"));
}

// Issue 54: a job's logs and metrics are stored in the transaction that ends it, so that a
// coordinator killed, failed over or backed up right after the end (before any tick could save
// them; this fixture runs none) has them.
TEST_F(CoordinatorServiceTest, AJobsEndStoresItsLogsAndMetricsWithItForABackupRightAfter) {
  auto node = Connect("n1", 1);
  v1::Job job = MustSubmit(Spec(1));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  ASSERT_TRUE(node->NextCommand().has_assignment());
  for (int64_t step = 1; step <= 3; ++step) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Job(job.id(), 1));
    v1::StepReport r;
    r.set_job_id(job.id());
    r.set_attempt(1);
    r.set_step(step);
    r.set_seq(step);
    v1::TrainerCommands commands;
    ASSERT_TRUE(trainer_->ReportStep(&ctx, r, &commands).ok());
  }
  v1::NodeMessage m;
  m.mutable_logs()->set_job_id(job.id());
  m.mutable_logs()->set_attempt(1);
  m.mutable_logs()->add_lines("the last words");
  m.mutable_logs()->add_seqs(1);
  ASSERT_TRUE(node->Write(m));
  v1::Assignment a;
  a.set_job_id(job.id());
  a.set_attempt(1);
  node->ReportExit(a, 0, 0);
  ASSERT_EQ(WaitForState(job.id(), v1::SUCCEEDED).state(), v1::SUCCEEDED);

  // A backup at once, as an admin would take it.
  auto admin = v1::AdminService::NewStub(channel_);
  grpc::ClientContext ctx;
  PrepareToken(ctx, tokens_->User("root", v1::ADMIN));
  auto reader = admin->Backup(&ctx, v1::BackupRequest());
  std::string bytes;
  for (v1::BackupChunk chunk; reader->Read(&chunk);) bytes += chunk.data();
  ASSERT_TRUE(reader->Finish().ok());
  const std::string backup = dir_.path() + "/backup.db";
  std::ofstream(backup, std::ios::binary) << bytes;
  auto store = coordinator::OpenSqliteJobStore(backup);
  ASSERT_TRUE(store.ok()) << store.status();
  auto logs = (*store)->GetRecord(coordinator::kJobLogsRecord, job.id());
  auto metrics = (*store)->GetRecord(coordinator::kJobMetricsRecord, job.id());
  ASSERT_TRUE(logs.ok()) << logs.status();
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  auto lines = coordinator::DecodeSeries<v1::LogLine>(logs->payload);
  auto steps = coordinator::DecodeSeries<v1::StepReport>(metrics->payload);
  ASSERT_TRUE(lines.ok() && steps.ok());
  ASSERT_EQ(lines->size(), 1u);
  EXPECT_EQ((*lines)[0].text(), "the last words");
  ASSERT_EQ(steps->size(), 3u);
  EXPECT_EQ((*steps)[2].step(), 3);
  // They expire with the finished job's retention, as its eviction would have them.
  EXPECT_GT(logs->expires_ms, 0);
}

// A coordinator that writes running jobs' logs and metrics out at every tick.
class SavingCoordinatorServiceTest : public CoordinatorServiceTest {
 protected:
  void Configure(CoordinatorOptions& o) override {
    CoordinatorServiceTest::Configure(o);
    o.limits.history.save_unfinished_interval = absl::ZeroDuration();
  }
};

// What a leader that dies (no shutdown) leaves of a running job's metrics and logs: what its
// ticker last wrote, read here from the store by a second connection.
TEST_F(SavingCoordinatorServiceTest, RunningJobsLogsAndMetricsReachTheStoreAsTheyGrow) {
  auto node = Connect("n1", 1);
  v1::Job job = MustSubmit(Spec(1));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  ASSERT_TRUE(node->NextCommand().has_assignment());
  auto report = [&](int64_t step) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Job(job.id(), 1));
    v1::StepReport r;
    r.set_job_id(job.id());
    r.set_attempt(1);
    r.set_step(step);
    r.set_total_steps(10);
    v1::TrainerCommands commands;
    return trainer_->ReportStep(&ctx, r, &commands);
  };
  auto stored_steps = [&]() -> size_t {
    auto store = coordinator::OpenSqliteJobStore(dir_.path() + "/state/coordinator.db");
    EXPECT_TRUE(store.ok()) << store.status();
    if (!store.ok()) return 0;
    auto record = (*store)->GetRecord(coordinator::kJobMetricsRecord, job.id());
    if (!record.ok()) return 0;
    auto steps = coordinator::DecodeSeries<v1::StepReport>(record->payload);
    EXPECT_TRUE(steps.ok()) << steps.status();
    return steps.ok() ? steps->size() : 0;
  };
  EXPECT_EQ(stored_steps(), 0u);
  ASSERT_TRUE(report(1).ok());
  ASSERT_TRUE(report(2).ok());
  server_->Tick();
  EXPECT_EQ(stored_steps(), 2u);
  ASSERT_TRUE(report(3).ok());
  server_->Tick();
  EXPECT_EQ(stored_steps(), 3u);
}

TEST_F(CoordinatorServiceTest, CheckpointingAJobThatIsNotRunningIsFailedPrecondition) {
  v1::Job job = MustSubmit(Spec(1));
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::CheckpointJobRequest r;
  r.set_job_id(job.id());
  v1::Job j;
  grpc::Status s = jobs_->CheckpointJob(&ctx, r, &j);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("QUEUED"));
}

TEST_F(CoordinatorServiceTest, FollowedLogsStreamRankLinesAndEndWithTheJob) {
  auto node = Connect("n1", 2);
  v1::Job job = MustSubmit(Spec(2));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::StreamLogsRequest r;
  r.set_job_id(job.id());
  r.set_follow(true);
  auto reader = jobs_->StreamLogs(&ctx, r);
  for (int rank : {0, 1}) {
    v1::NodeMessage m;
    auto* l = m.mutable_logs();
    l->set_job_id(job.id());
    l->set_attempt(1);
    l->set_rank(rank);
    l->add_lines(absl::StrCat("line a from ", rank));
    l->add_lines(absl::StrCat("line b from ", rank));
    ASSERT_TRUE(node->Write(m));
  }
  std::vector<std::string> got;
  v1::LogLine line;
  for (int i = 0; i < 4 && reader->Read(&line); ++i) {
    got.push_back(absl::StrCat(line.rank(), ":", line.text()));
  }
  EXPECT_THAT(
      got, ElementsAre("0:line a from 0", "0:line b from 0", "1:line a from 1", "1:line b from 1"));
  node->ReportExit(a, 0, 0);
  node->ReportExit(a, 1, 0);
  EXPECT_FALSE(reader->Read(&line));  // the stream ends with the job
  EXPECT_TRUE(reader->Finish().ok());

  grpc::ClientContext tail_ctx;
  Prepare(tail_ctx);
  r.set_follow(false);
  r.set_tail(1);
  auto tail = jobs_->StreamLogs(&tail_ctx, r);
  ASSERT_TRUE(tail->Read(&line));
  EXPECT_EQ(line.text(), "line b from 1");
  EXPECT_FALSE(tail->Read(&line));
}

TEST_F(CoordinatorServiceTest, JobThatFitsNoNodesMemoryIsRejectedNamingAStrategyThatFits) {
  {  // 4 devices of 1 GiB each
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Node("small"));
    v1::RegisterNodeRequest r;
    r.set_node_id("small");
    for (int i = 0; i < 4; ++i) {
      auto* d = r.add_devices();
      d->set_index(i);
      d->set_kind(v1::CUDA_GPU);
      d->set_memory_bytes(int64_t{1} << 30);
    }
    v1::RegisterNodeResponse resp;
    ASSERT_TRUE(nodes_->RegisterNode(&ctx, r, &resp).ok());
  }
  v1::JobSpec big = Spec(4, "bert-sized");  // ~109M parameters: 1.6 GiB of state under DDP
  big.mutable_model()->set_n_layer(12);
  big.mutable_model()->set_n_head(12);
  big.mutable_model()->set_d_model(768);
  big.mutable_model()->set_seq_len(128);
  big.mutable_model()->set_vocab(30522);
  big.mutable_data()->set_format("uint16");
  big.mutable_train()->set_micro_batch(1);
  grpc::Status s = Submit(big, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), StartsWith("parallel.strategy: ddp fp32 needs "));
  EXPECT_THAT(s.error_message(), HasSubstr("the largest device of any node has 1.00 GiB"));
  EXPECT_THAT(s.error_message(), HasSubstr("fsdp FULL_SHARD would fit"));
  // And the smallest pipeline x tensor layout of 4 ranks.
  EXPECT_THAT(s.error_message(), ::testing::ContainsRegex("; so would (pipeline|tensor) "));
  EXPECT_EQ(List({}).jobs_size(), 0);
  // The same model sharded fits.
  big.mutable_parallel()->set_strategy(v1::FSDP);
  big.mutable_parallel()->set_sharding_strategy(v1::FULL_SHARD);
  EXPECT_TRUE(Submit(big, nullptr).ok());
}

v1::JobSpec OffloadSpec(const std::string& name) {
  v1::JobSpec s = Spec(1, name);
  s.mutable_parallel()->set_strategy(v1::OFFLOAD);
  return s;
}

// 42,368 parameters x 18 bytes.
constexpr int64_t kOffloadSpecPsBytes = 762624;

TEST_F(CoordinatorServiceTest, OffloadJobsNeedParameterServersWithRoomAndNothingIsStoredOtherwise) {
  auto worker = Connect("n1", 1);
  grpc::Status s = Submit(OffloadSpec("none"), nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("none that takes alice's jobs is registered"));
  auto ps = testing::NodeSession::ConnectParameterServer(channel_, tokens_->Node("ps1"), "ps1",
                                                         kOffloadSpecPsBytes - 1, "127.0.0.1:9");
  s = Submit(OffloadSpec("small"), nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("parallel.strategy: offload needs"));
  EXPECT_THAT(s.error_message(), HasSubstr("42368 parameters x 18 bytes"));
  EXPECT_EQ(List({}).jobs_size(), 0);
}

TEST_F(CoordinatorServiceTest, OffloadJobIsSplitOverParameterServersAndWaitsForTheirMemory) {
  auto worker = Connect("n1", 2);
  // Together they hold one job's state, not two.
  auto ps1 = testing::NodeSession::ConnectParameterServer(channel_, tokens_->Node("ps1"), "ps1",
                                                          500000, "127.0.0.1:11");
  auto ps2 = testing::NodeSession::ConnectParameterServer(channel_, tokens_->Node("ps2"), "ps2",
                                                          500000, "127.0.0.1:12");
  v1::Job first = MustSubmit(OffloadSpec("first"));
  v1::Job second = MustSubmit(OffloadSpec("second"));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);

  const v1::Assignment a = worker->NextCommand().assignment();
  EXPECT_EQ(a.job_id(), first.id());
  ASSERT_EQ(a.ps_ranges_size(), 2);
  EXPECT_EQ(a.ps_ranges(0).address(), "127.0.0.1:11");
  EXPECT_EQ(a.ps_ranges(0).begin(), 0);
  EXPECT_EQ(a.ps_ranges(0).end(), a.ps_ranges(1).begin());
  EXPECT_EQ(a.ps_ranges(1).end(), 42368);
  EXPECT_EQ(a.ps_ranges(0).end() - a.ps_ranges(0).begin(), 21184);  // balanced

  v1::Job j;
  ASSERT_TRUE(Get(second.id(), &j).ok());
  EXPECT_EQ(j.state(), v1::QUEUED);
  EXPECT_THAT(j.message(), HasSubstr("waiting for parameter-server memory"));
  {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::ListNodesResponse nodes;
    ASSERT_TRUE(nodes_->ListNodes(&ctx, {}, &nodes).ok());
    ASSERT_EQ(nodes.nodes_size(), 3);
    for (const auto& n : nodes.nodes()) {
      if (n.id() == "n1") continue;
      EXPECT_EQ(n.role(), v1::PARAMETER_SERVER);
      EXPECT_EQ(n.reserved_bytes(), 21184 * 18) << n.id();
    }
  }

  // Cancelling the first job tells both servers to drop its shards; the second job then fits.
  ASSERT_TRUE(Cancel(first.id()).ok());
  for (auto* ps : {ps1.get(), ps2.get()}) {
    const v1::CoordinatorMessage m = ps->NextCommand();
    ASSERT_TRUE(m.has_cancel());
    EXPECT_EQ(m.cancel().job_id(), first.id());
  }
  worker->NextCommand();  // the cancel of its ranks
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  ASSERT_TRUE(Get(second.id(), &j).ok());
  EXPECT_EQ(j.state(), v1::RUNNING);
  EXPECT_EQ(j.ps_placement_size(), 2);
}

TEST_F(CoordinatorServiceTest, LostParameterServerFailsTheAttemptNamingIt) {
  auto worker = Connect("n1", 1);
  auto ps = testing::NodeSession::ConnectParameterServer(channel_, tokens_->Node("ps1"), "ps1",
                                                         int64_t{1} << 30, "127.0.0.1:11");
  v1::Job job = MustSubmit(OffloadSpec("job"));
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  worker->NextCommand();
  clock_.Advance(absl::Seconds(6));
  worker->Heartbeat();
  clock_.Advance(absl::Seconds(6));
  worker->Heartbeat();
  server_->Tick();  // ps1 was silent for 12 s, the worker for 6
  v1::Job j = WaitForState(job.id(), v1::FAILED);
  EXPECT_EQ(j.state(), v1::FAILED);
  EXPECT_THAT(j.message(), HasSubstr("parameter server ps1 lost"));
  EXPECT_THAT(j.message(), ::testing::Not(HasSubstr("node n1")));
}

TEST_F(CoordinatorServiceTest, BadParameterServerRegistrationsNameTheField) {
  auto reg = [&](v1::RegisterNodeRequest r) {
    grpc::ClientContext ctx;
    PrepareToken(ctx, tokens_->Node(r.node_id()));
    v1::RegisterNodeResponse resp;
    return nodes_->RegisterNode(&ctx, r, &resp);
  };
  v1::RegisterNodeRequest r;
  r.set_node_id("ps1");
  r.set_role(v1::PARAMETER_SERVER);
  r.set_address("127.0.0.1:1");
  grpc::Status s = reg(r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("memory_bytes"));
  r.set_memory_bytes(1 << 20);
  r.add_devices()->set_kind(v1::CPU_SLOT);
  s = reg(r);
  EXPECT_THAT(s.error_message(), HasSubstr("devices"));
  r.clear_devices();
  r.clear_address();
  s = reg(r);
  EXPECT_THAT(s.error_message(), HasSubstr("address"));
  r.set_address("127.0.0.1:1");
  r.set_role(static_cast<v1::NodeRole>(7));
  s = reg(r);
  EXPECT_THAT(s.error_message(), HasSubstr("role"));
}

TEST_F(CoordinatorServiceTest, HealthAndReflectionAreServed) {
  auto health = testing::HealthCheck(channel_);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  auto services = testing::ReflectionServices(channel_);
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_THAT(*services, Contains("trainyard.v1.JobService"));
  EXPECT_THAT(*services, Contains("trainyard.v1.NodeService"));
  EXPECT_THAT(*services, Contains("trainyard.v1.RendezvousService"));
  EXPECT_THAT(*services, Contains("trainyard.v1.TrainerService"));
  EXPECT_THAT(*services, Contains("grpc.health.v1.Health"));
}

TEST_F(CoordinatorServiceTest, SecondCoordinatorOnTheSameStateDirIsRefused) {
  CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.state_dir = dir_.path() + "/state";
  o.background_threads = false;
  auto second = CoordinatorServer::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("in use"));
}

TEST_F(CoordinatorServiceTest, StateSurvivesAShutdownAndRestartInProcess) {
  MustSubmit(Spec(1, "a"));
  v1::Job b = MustSubmit(Spec(1, "b"));
  ASSERT_TRUE(Cancel(b.id()).ok());
  ASSERT_TRUE(Register("n1", 3).ok());
  server_->Shutdown();
  server_.reset();
  SetUp();
  v1::Job a2, b2;
  ASSERT_TRUE(Get("job-1", &a2).ok());
  ASSERT_TRUE(Get("job-2", &b2).ok());
  EXPECT_EQ(a2.state(), v1::QUEUED);
  EXPECT_EQ(b2.state(), v1::CANCELLED);
  EXPECT_EQ(MustSubmit(Spec(1, "c")).id(), "job-3");  // ids continue
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::ListNodesResponse nodes;
  ASSERT_TRUE(nodes_->ListNodes(&ctx, {}, &nodes).ok());
  ASSERT_EQ(nodes.nodes_size(), 1);
  EXPECT_EQ(nodes.nodes(0).devices_size(), 3);
}

// A GPU's sample (the worker's NVML reading, in its heartbeat) is kept on the device it names when
// its figures are in range; others are dropped, and a list longer than the node's devices whole.
TEST_F(CoordinatorServiceTest, GpuSamplesAreKeptOnlyWhenTheyNameAGpuAndAreInRange) {
  v1::RegisterNodeRequest r;
  r.set_node_id("g");
  r.set_hostname("localhost");
  r.set_memory_bytes(int64_t{8} << 30);
  for (int i = 0; i < 2; ++i) {
    v1::Device* d = r.add_devices();
    d->set_index(i);
    d->set_kind(v1::CUDA_GPU);
    d->set_memory_bytes(int64_t{80} << 30);
  }
  auto node = testing::NodeSession::ConnectWith(channel_, tokens_->Node("g"), r);
  auto sample = [](int index, float utilization) {
    v1::DeviceSample s;
    s.set_index(index);
    s.set_utilization(utilization);
    s.set_memory_used_bytes(1 << 20);
    s.set_memory_total_bytes(int64_t{80} << 30);
    s.set_temperature_celsius(50);
    return s;
  };
  v1::NodeMessage hb;
  *hb.mutable_heartbeat()->add_devices() = sample(0, 0.5f);
  *hb.mutable_heartbeat()->add_devices() = sample(1, 1.5f);  // over 100%
  ASSERT_TRUE(node->Write(hb));
  node->Heartbeat();  // processed in order
  v1::Node n = Node("g");
  ASSERT_TRUE(n.devices(0).has_sample());
  EXPECT_FLOAT_EQ(n.devices(0).sample().utilization(), 0.5f);
  EXPECT_GT(n.devices(0).sample().time_ms(), 0);
  EXPECT_FALSE(n.devices(1).has_sample());

  v1::NodeMessage too_many;
  for (int i : {0, 1, 1}) *too_many.mutable_heartbeat()->add_devices() = sample(i, 0.25f);
  ASSERT_TRUE(node->Write(too_many));
  node->Heartbeat();
  n = Node("g");
  EXPECT_FLOAT_EQ(n.devices(0).sample().utilization(), 0.5f);  // unchanged
  EXPECT_FALSE(n.devices(1).has_sample());

  // A fault's text is the node's own: one with control characters or over 256 bytes is not a
  // worker's, and is dropped with its sample; it does not cordon the node.
  for (const std::string& fault :
       {std::string("XID 79\n\x1b[31mfake log line"), std::string(257, 'x')}) {
    v1::NodeMessage bad;
    v1::DeviceSample s = sample(1, 0.75f);
    s.set_fault(fault);
    *bad.mutable_heartbeat()->add_devices() = s;
    ASSERT_TRUE(node->Write(bad));
    node->Heartbeat();
    n = Node("g");
    EXPECT_FALSE(n.devices(1).has_sample());
    EXPECT_FALSE(n.cordoned());
  }
  // A well-formed fault is kept and cordons the node, naming the GPU.
  v1::NodeMessage faulty;
  v1::DeviceSample s = sample(1, 0.75f);
  s.set_fault(std::string(256, 'x'));
  *faulty.mutable_heartbeat()->add_devices() = s;
  ASSERT_TRUE(node->Write(faulty));
  node->Heartbeat();
  n = Node("g");
  ASSERT_TRUE(n.devices(1).has_sample());
  EXPECT_EQ(n.devices(1).sample().fault(), std::string(256, 'x'));
  EXPECT_TRUE(n.cordoned());
  EXPECT_THAT(n.cordon_reason(), HasSubstr("GPU 1"));
}

// Back-pressure: past --max-pending-submits submissions waiting for the store, a submit is
// refused at once with RESOURCE_EXHAUSTED and retry advice (0 here: every submit), and nothing of
// it is kept; the capacity check reads the registry's index (a node's smallest device, the most
// devices on one node) as nodes come and go.
class BackPressureTest : public CoordinatorServiceTest {
 protected:
  void Configure(CoordinatorOptions& o) override {
    CoordinatorServiceTest::Configure(o);
    o.limits.max_pending_submits = 0;
  }
};

TEST_F(BackPressureTest, ASubmitPastThePendingCapIsRefusedWithRetryAdvice) {
  v1::Job job;
  const grpc::Status s = Submit(Spec(1), &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--max-pending-submits"));
  EXPECT_THAT(s.error_message(), HasSubstr("retry"));
  EXPECT_TRUE(server_->jobs().List(v1::ListJobsRequest())->jobs.empty());
}

TEST_F(CoordinatorServiceTest, TheCapacityIndexFollowsNodesAsTheyComeAndGo) {
  EXPECT_EQ(server_->nodes().Capacity().max_devices_per_node, 0);
  auto small = Connect("small", 2);
  auto big = Connect("big", 4);
  EXPECT_EQ(server_->nodes().Capacity().max_devices_per_node, 4);
  EXPECT_EQ(server_->nodes().Capacity().largest_device_bytes,
            Node("big").devices(0).memory_bytes());
  big.reset();
  clock_.Advance(absl::Seconds(11));
  small->Heartbeat();  // small stays; big is lost
  server_->Tick();
  EXPECT_EQ(Node("big").state(), v1::NODE_LOST);
  EXPECT_EQ(server_->nodes().Capacity().max_devices_per_node, 2);
  auto back = Connect("big", 4);
  EXPECT_EQ(server_->nodes().Capacity().max_devices_per_node, 4);
}

}  // namespace
}  // namespace trainyard::coordinator
