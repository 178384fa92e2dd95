// Preemption that checkpoints first, over the wire: a real CoordinatorServer (SQLite store, a
// FakeClock, no background threads) with --preemption; a node session plays the worker and the
// TrainerService calls play the ranks. A high-priority job that cannot be placed asks a lower one
// to checkpoint and stop; the victim goes to PREEMPTED (no restart counted), the high job runs,
// and the victim is placed again to resume from its checkpoint. A victim that ignores the request
// has its ranks stopped after the grace period.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "common/clock.h"
#include "server/coordinator/coordinator_server.h"
#include "tests/testing/coordinator_fixture.h"
#include "tests/testing/http_get.h"
#include "tests/testing/node_session.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/trainer.grpc.pb.h"

namespace trainyard::coordinator {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kGrace = absl::Seconds(30);
constexpr absl::Duration kMinRunTime = absl::Minutes(1);

class PreemptionTest : public testing::CoordinatorFixture {
 protected:
  void Configure(CoordinatorOptions& o) override {
    o.node_timeout = absl::Hours(1);  // the fake clock moves in minutes
    o.preemption = true;
    o.metrics_address = "127.0.0.1:0";
    o.preemption_grace = kGrace;
    o.min_run_time = kMinRunTime;
  }

  void SetUp() override {
    CoordinatorFixture::SetUp();
    node_ = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 2);
  }

  void TearDown() override {
    node_.reset();
    CoordinatorFixture::TearDown();
  }

  std::string Submit(int priority, int steps = 100) {
    v1::JobSpec spec = testing::TinySpec(priority > 50 ? "high" : "low", 2);
    spec.set_priority(priority);
    spec.mutable_train()->set_steps(steps);
    grpc::ClientContext ctx;
    testing::Authorize(ctx, tokens_->User("alice"));
    v1::SubmitJobRequest r;
    *r.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    EXPECT_TRUE(jobs_->SubmitJob(&ctx, r, &resp).ok());
    return resp.job().id();
  }

  v1::Job Job(const std::string& id) {
    auto job = server_->jobs().Get(id);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.value_or(v1::Job());
  }

  // What rank 0 of `id`'s attempt hears back when it reports `step`.
  v1::TrainerCommands Report(const std::string& id, int attempt, int64_t step) {
    grpc::ClientContext ctx;
    testing::Authorize(ctx, tokens_->Job(id, attempt));
    v1::StepReport r;
    r.set_job_id(id);
    r.set_attempt(attempt);
    r.set_step(step);
    r.set_total_steps(100);
    v1::TrainerCommands commands;
    EXPECT_TRUE(trainer_->ReportStep(&ctx, r, &commands).ok());
    return commands;
  }

  void ReportCheckpoint(const std::string& id, int attempt, int64_t step) {
    grpc::ClientContext ctx;
    testing::Authorize(ctx, tokens_->Job(id, attempt));
    v1::CheckpointReport r;
    r.set_job_id(id);
    r.set_attempt(attempt);
    r.set_step(step);
    r.set_path("/ckpt/step-" + std::to_string(step));
    v1::TrainerCommands commands;
    EXPECT_TRUE(trainer_->ReportCheckpoint(&ctx, r, &commands).ok());
  }

  // Both ranks of the assignment exit with `code`; returns once the coordinator has them.
  void ExitAll(const v1::Assignment& a, int code) {
    node_->ReportExit(a, 0, code);
    node_->ReportExit(a, 1, code);
    node_->Heartbeat();
  }

  // A low-priority job running on both devices, checkpointed at step 3, and a high-priority job
  // waiting behind it, past the low one's minimum run time.
  void LowRunningHighWaiting(std::string* low, std::string* high, v1::Assignment* low_ranks) {
    *low = Submit(10);
    ASSERT_EQ(server_->jobs().SchedulePass(), 1);
    *low_ranks = node_->NextCommand().assignment();
    EXPECT_FALSE(Report(*low, 1, 3).stop_requested());
    ReportCheckpoint(*low, 1, 3);
    *high = Submit(90);
    EXPECT_EQ(server_->jobs().SchedulePass(), 0);
    EXPECT_EQ(Job(*low).preempt_deadline_ms(), 0) << "not within its minimum run time";
    clock_.Advance(kMinRunTime + absl::Seconds(1));
    EXPECT_EQ(server_->jobs().SchedulePass(), 0);  // asks; places nothing yet
    const v1::Job victim = Job(*low);
    EXPECT_NE(victim.preempt_deadline_ms(), 0);
    EXPECT_EQ(victim.preempted_by(), *high);
    EXPECT_THAT(victim.message(), HasSubstr("asked to checkpoint and stop"));
  }

  std::unique_ptr<testing::NodeSession> node_;
};

TEST_F(PreemptionTest, TheVictimCheckpointsStopsAndResumesAfterTheHigherPriorityJob) {
  std::string low, high;
  v1::Assignment low_ranks;
  LowRunningHighWaiting(&low, &high, &low_ranks);
  // Its ranks hear "stop" (after a checkpoint) with their next report once the ask is durable
  // (CoordinatorServiceTest.ADrainAsksTheRanksToStopOnceItIsDurable: not before).
  bool stop = false;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20); !stop;) {
    ASSERT_LT(absl::Now(), deadline) << "never asked to stop";
    stop = Report(low, 1, 4).stop_requested();
  }
  ReportCheckpoint(low, 1, 4);
  // Another pass while they stop does not pick more victims (there are none) or place high.
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  ExitAll(low_ranks, 0);
  v1::Job preempted = Job(low);
  EXPECT_EQ(preempted.state(), v1::PREEMPTED);
  EXPECT_EQ(preempted.restarts(), 0) << "a preemption is no restart";
  EXPECT_EQ(preempted.preemptions(), 1);
  EXPECT_THAT(preempted.message(), HasSubstr("resumes from the checkpoint of step 4"));

  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment high_ranks = node_->NextCommand().assignment();
  EXPECT_EQ(high_ranks.job_id(), high);
  EXPECT_EQ(Job(low).state(), v1::PREEMPTED) << "waits while high runs";
  ExitAll(high_ranks, 0);
  EXPECT_EQ(Job(high).state(), v1::SUCCEEDED);

  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment again = node_->NextCommand().assignment();
  EXPECT_EQ(again.job_id(), low);
  EXPECT_EQ(again.attempt(), 2);
  const v1::Job resumed = Job(low);
  EXPECT_EQ(resumed.state(), v1::RUNNING);
  EXPECT_EQ(resumed.preempt_deadline_ms(), 0);
  EXPECT_THAT(resumed.message(), HasSubstr("resumed after: preempted by " + high));
  // One preemption counted on /metrics.
  auto page = testing::HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_THAT(*page, HasSubstr("\ntrainyard_preemptions_total 1\n"));
  EXPECT_FALSE(Report(low, 2, 5).stop_requested());
  // Just started again: the minimum run time protects it from another preemption at once.
  Submit(95);
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  EXPECT_EQ(Job(low).preempt_deadline_ms(), 0);
}

TEST_F(PreemptionTest, AVictimThatIgnoresTheRequestHasItsRanksStoppedAfterTheGrace) {
  std::string low, high;
  v1::Assignment low_ranks;
  LowRunningHighWaiting(&low, &high, &low_ranks);
  clock_.Advance(kGrace - absl::Seconds(1));
  server_->Tick();
  clock_.Advance(absl::Seconds(2));
  server_->Tick();  // the grace is over: the worker is told to stop the attempt's ranks
  const v1::CoordinatorMessage stop = node_->NextCommand();
  ASSERT_TRUE(stop.has_cancel()) << stop.DebugString();
  EXPECT_EQ(stop.cancel().job_id(), low);
  EXPECT_EQ(stop.cancel().attempt(), 1);
  EXPECT_THAT(stop.cancel().reason(), HasSubstr("grace period over"));
  node_->ReportExit(low_ranks, 0, 128 + 9);  // killed
  node_->Heartbeat();
  v1::Job preempted = Job(low);
  EXPECT_EQ(preempted.state(), v1::PREEMPTED);
  EXPECT_EQ(preempted.restarts(), 0);
  EXPECT_THAT(preempted.message(), HasSubstr("resumes from the checkpoint of step 3"));
  node_->ReportExit(low_ranks, 1, 128 + 9);
  node_->Heartbeat();
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  v1::CoordinatorMessage next = node_->NextCommand();
  while (next.has_cancel()) next = node_->NextCommand();  // the release's stop of the attempt
  EXPECT_EQ(next.assignment().job_id(), high);
}

TEST_F(PreemptionTest, AVictimThatFinishesWhileStoppingSucceeds) {
  std::string low, high;
  v1::Assignment low_ranks;
  LowRunningHighWaiting(&low, &high, &low_ranks);
  Report(low, 1, 100);  // its last step
  ExitAll(low_ranks, 0);
  EXPECT_EQ(Job(low).state(), v1::SUCCEEDED);
}

TEST_F(PreemptionTest, AVictimWhoseNodeIsLostRestartsWithoutBeingAskedToStopAgain) {
  std::string low, high;
  v1::Assignment low_ranks;
  LowRunningHighWaiting(&low, &high, &low_ranks);
  node_.reset();  // cut off: its node times out, the attempt ends another way
  for (absl::Time give_up = absl::Now() + absl::Seconds(10);
       server_->nodes().List()[0].connected() && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(10));  // the session's end has no event to wait on here
  }
  clock_.Advance(absl::Hours(2));
  server_->Tick();
  const v1::Job lost = Job(low);
  EXPECT_NE(lost.state(), v1::RUNNING);
  EXPECT_EQ(lost.preempt_deadline_ms(), 0) << "the request ended with the attempt";
}

}  // namespace
}  // namespace trainyard::coordinator
