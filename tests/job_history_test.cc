// Finished jobs leaving the coordinator's memory (issue "a coordinator that holds 10,000 nodes":
// bounded memory): the persisted form of logs and metrics, and, in process over real gRPC with a
// real SQLite store, that an evicted job is still listed, described, watched, and its logs and
// metrics read; that it stays so across a restart; that its logs and metrics expire on their own
// retention; and that the heap after 20,000 finished jobs stays within a fixed bound.
#include "server/coordinator/job_history.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <malloc.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "server/coordinator/job_store.h"
#include "tests/testing/coordinator_fixture.h"
#include "tests/testing/node_session.h"
#include "tests/testing/tiny_spec.h"

namespace trainyard::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

v1::LogLine Line(int rank, const std::string& text) {
  v1::LogLine l;
  l.set_attempt(1);
  l.set_rank(rank);
  l.set_text(text);
  return l;
}

v1::StepReport Step(int64_t step) {
  v1::StepReport r;
  r.set_job_id("job-1");
  r.set_attempt(1);
  r.set_step(step);
  r.set_loss(10.0 / static_cast<double>(step));
  return r;
}

std::vector<int64_t> StepsOf(const std::vector<v1::StepReport>& reports) {
  std::vector<int64_t> steps;
  for (const auto& r : reports) steps.push_back(r.step());
  return steps;
}

v1::LogLine Line(int attempt, int rank, int64_t seq, const std::string& text) {
  v1::LogLine l;
  l.set_attempt(attempt);
  l.set_rank(rank);
  l.set_seq(seq);
  l.set_text(text);
  return l;
}

std::vector<std::string> Texts(const std::vector<v1::LogLine>& lines) {
  std::vector<std::string> out;
  for (const v1::LogLine& l : lines) out.push_back(l.text());
  return out;
}

// Issue 54: a worker sends its ranks' recent lines again on each new session, a rank its recent
// step reports to a new coordinator: the series keeps each seq of an attempt's rank once, and
// what it read back from the store counts.
TEST(JobSeriesTest, ACopySentAgainIsKeptOnceAndUnsequencedRecordsAlways) {
  JobLogs logs(1000, 1 << 20);
  std::vector<std::vector<std::string>> delivered;
  logs.Subscribe("job-1", 0, [&](const std::vector<v1::LogLine>& lines) {
    if (!lines.empty()) delivered.push_back(Texts(lines));
  });
  EXPECT_EQ(logs.Append("job-1", {Line(1, 0, 1, "a"), Line(1, 0, 3, "b")}), 2u);
  // Sent again with one new line: only the new one is kept and delivered.
  EXPECT_EQ(logs.Append("job-1", {Line(1, 0, 1, "a"), Line(1, 0, 3, "b"), Line(1, 0, 9, "c")}), 1u);
  // Seqs are per attempt and rank; a line without one (an older worker's) is always kept.
  EXPECT_EQ(logs.Append("job-1", {Line(1, 1, 1, "rank 1"), Line(2, 0, 1, "attempt 2"),
                                  Line(1, 0, 0, "old worker"), Line(1, 0, 0, "old worker")}),
            4u);
  EXPECT_EQ(logs.Append("job-1", {Line(1, 0, 9, "c"), Line(1, 1, 1, "rank 1")}), 0u);
  EXPECT_THAT(Texts(logs.Snapshot("job-1")),
              ElementsAre("a", "b", "c", "rank 1", "attempt 2", "old worker", "old worker"));
  EXPECT_THAT(delivered,
              ElementsAre(ElementsAre("a", "b"), ElementsAre("c"),
                          ElementsAre("rank 1", "attempt 2", "old worker", "old worker")));
  EXPECT_FALSE(logs.Fresh("job-1", Line(1, 0, 9, "c")));
  EXPECT_TRUE(logs.Fresh("job-1", Line(1, 0, 10, "d")));
  EXPECT_TRUE(logs.Fresh("job-1", Line(1, 0, 0, "unsequenced")));
  EXPECT_TRUE(logs.Fresh("job-2", Line(1, 0, 1, "another job")));

  // A coordinator that read the series back from the store (LoadUnfinished appends it) drops
  // the copies a worker sends it, even of lines the cap has since pushed out of memory.
  JobLogs capped(2, 1 << 20);
  capped.Append("job-1", {Line(1, 0, 1, "a"), Line(1, 0, 2, "b"), Line(1, 0, 3, "c")});
  EXPECT_EQ(capped.Append("job-1", {Line(1, 0, 1, "a"), Line(1, 0, 4, "d")}), 1u);
  EXPECT_THAT(Texts(capped.Snapshot("job-1")), ElementsAre("c", "d"));
}

TEST(SeriesEncodingTest, RoundTripsEveryRecordWhenItFits) {
  const std::vector<v1::LogLine> lines = {Line(0, "a"), Line(1, std::string("b\0c", 3)),
                                          Line(0, "")};
  auto back = DecodeSeries<v1::LogLine>(EncodeSeries(lines, 1 << 20, false));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_THAT(*back, SizeIs(3));
  EXPECT_EQ((*back)[1].text(), std::string("b\0c", 3));
  EXPECT_EQ((*back)[1].rank(), 1);
  EXPECT_EQ((*back)[2].text(), "");
  EXPECT_THAT(*DecodeSeries<v1::LogLine>(""), SizeIs(0));
}

TEST(SeriesEncodingTest, LogsKeepTheirNewestLinesWithinTheCap) {
  std::vector<v1::LogLine> lines;
  for (int i = 0; i < 100; ++i) lines.push_back(Line(0, absl::StrCat("line ", 1000 + i)));
  const std::string payload = EncodeSeries(lines, 200, false);
  EXPECT_LE(payload.size(), 200u);
  auto back = DecodeSeries<v1::LogLine>(payload);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_GT(back->size(), 5u);
  EXPECT_EQ(back->back().text(), "line 1099");
  EXPECT_EQ(back->front().text(), absl::StrCat("line ", 1100 - back->size()));
}

TEST(SeriesEncodingTest, MetricsAreThinnedEvenlyKeepingTheFirstAndLastStep) {
  std::vector<v1::StepReport> steps;
  for (int64_t s = 1; s <= 1000; ++s) steps.push_back(Step(s));
  const size_t full = EncodeSeries(steps, SIZE_MAX, true).size();
  const std::string payload = EncodeSeries(steps, full / 4, true);
  EXPECT_LE(payload.size(), full / 4);
  auto back = DecodeSeries<v1::StepReport>(payload);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_GT(back->size(), 150u);
  EXPECT_EQ(back->front().step(), 1);
  EXPECT_EQ(back->back().step(), 1000);
  // Evenly: one stride between all kept steps but the last.
  const int64_t stride = (*back)[1].step() - (*back)[0].step();
  for (size_t i = 1; i + 1 < back->size(); ++i) {
    EXPECT_EQ((*back)[i].step() - (*back)[i - 1].step(), stride) << i;
  }
}

TEST(SeriesEncodingTest, ACutPayloadIsDataLoss) {
  const std::string payload = EncodeSeries(std::vector<v1::LogLine>{Line(0, "hello")}, 1024, false);
  EXPECT_EQ(DecodeSeries<v1::LogLine>(payload.substr(0, payload.size() - 1)).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeSeries<v1::LogLine>("\xff").status().code(), absl::StatusCode::kDataLoss);
}

// A line whose text is not UTF-8 (as a coordinator cut one inside a character before): its
// record does not parse, and one such record lost the whole series.
std::string UnreadableLineRecord() {
  std::string bytes = Line(0, "caf\xc3\xa9").SerializeAsString();
  bytes[bytes.find("\xc3\xa9") + 1] = 'x';  // "caf\xc3x": a character cut short
  EXPECT_FALSE(v1::LogLine().ParseFromString(bytes));
  return std::string(1, static_cast<char>(bytes.size())) + bytes;  // (a one-byte varint)
}

TEST(SeriesEncodingTest, AnUnreadableRecordIsLeftOutAndCounted) {
  const std::string payload =
      EncodeSeries(std::vector<v1::LogLine>{Line(0, "before")}, 1024, false) +
      UnreadableLineRecord() +
      EncodeSeries(std::vector<v1::LogLine>{Line(0, "after")}, 1024, false);
  int unreadable = 0;
  auto back = DecodeSeries<v1::LogLine>(payload, &unreadable);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_THAT(*back, SizeIs(2));
  EXPECT_EQ((*back)[0].text(), "before");
  EXPECT_EQ((*back)[1].text(), "after");
  EXPECT_EQ(unreadable, 1);
  EXPECT_THAT(*DecodeSeries<v1::LogLine>(std::string("\x02\xff\xff", 3), &unreadable), SizeIs(0));
  EXPECT_EQ(unreadable, 1);
}

class JobHistoryTest : public testing::CoordinatorFixture {
 protected:
  void Configure(CoordinatorOptions& o) override {
    o.limits.finished_job_retention = absl::Minutes(5);
    o.limits.history.retention = absl::Hours(24);
    o.limits.max_queued_jobs_per_user = -1;
  }

  void Prepare(grpc::ClientContext& ctx, const std::string& user = "alice") {
    testing::Authorize(ctx, tokens_->User(user));
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  }

  v1::Job Submit(const std::string& name, int devices = 1) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::SubmitJobRequest r;
    *r.mutable_spec() = testing::TinySpec(name, devices);
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(&ctx, r, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.job();
  }

  grpc::Status Get(const std::string& id, v1::Job* job, const std::string& user = "alice") {
    grpc::ClientContext ctx;
    Prepare(ctx, user);
    v1::GetJobRequest r;
    r.set_job_id(id);
    return jobs_->GetJob(&ctx, r, job);
  }

  // Every page of a listing, as "id:STATE" newest first.
  std::vector<std::string> ListAll(v1::ListJobsRequest r) {
    std::vector<std::string> out;
    for (int pages = 0; pages < 100; ++pages) {
      grpc::ClientContext ctx;
      Prepare(ctx);
      v1::ListJobsResponse resp;
      grpc::Status s = jobs_->ListJobs(&ctx, r, &resp);
      EXPECT_TRUE(s.ok()) << s.error_message();
      for (const v1::Job& j : resp.jobs()) {
        out.push_back(absl::StrCat(j.id(), ":", v1::JobState_Name(j.state())));
      }
      if (resp.next_page_token().empty()) break;
      r.set_page_token(resp.next_page_token());
    }
    return out;
  }

  // "rank:text" for each line; "rank@seq" for each position (StreamLogsRequest.positions).
  std::vector<std::string> Logs(const std::string& id, int tail = 0, bool positions = false) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::StreamLogsRequest r;
    r.set_job_id(id);
    r.set_tail(tail);
    r.set_positions(positions);
    auto reader = jobs_->StreamLogs(&ctx, r);
    std::vector<std::string> out;
    v1::LogLine line;
    while (reader->Read(&line)) {
      out.push_back(line.position() ? absl::StrCat(line.rank(), "@", line.seq())
                                    : absl::StrCat(line.rank(), ":", line.text()));
    }
    grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return out;
  }

  std::vector<int64_t> Metrics(const std::string& id) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::StreamMetricsRequest r;
    r.set_job_id(id);
    auto reader = jobs_->StreamMetrics(&ctx, r);
    std::vector<v1::StepReport> out;
    v1::StepReport step;
    while (reader->Read(&step)) out.push_back(step);
    grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return StepsOf(out);
  }

  // Runs `job` (one rank) on `node` to success: two log lines (seqs 1 and 100) and three step
  // reports.
  void RunToSuccess(testing::NodeSession& node, const v1::Job& job) {
    ASSERT_EQ(server_->jobs().SchedulePass(), 1);
    const v1::Assignment a = node.NextCommand().assignment();
    ASSERT_EQ(a.job_id(), job.id());
    v1::NodeMessage m;
    m.mutable_logs()->set_job_id(job.id());
    m.mutable_logs()->set_attempt(1);
    m.mutable_logs()->add_lines("starting " + job.id());
    m.mutable_logs()->add_seqs(1);
    m.mutable_logs()->add_lines("done " + job.id());
    m.mutable_logs()->add_seqs(100);
    ASSERT_TRUE(node.Write(m));
    for (int64_t step = 1; step <= 3; ++step) {
      grpc::ClientContext ctx;
      testing::Authorize(ctx, tokens_->Job(job.id(), 1));
      v1::StepReport r;
      r.set_job_id(job.id());
      r.set_attempt(1);
      r.set_step(step);
      r.set_total_steps(3);
      r.set_loss(4.0 - static_cast<double>(step));
      v1::TrainerCommands commands;
      ASSERT_TRUE(trainer_->ReportStep(&ctx, r, &commands).ok());
    }
    node.ReportExit(a, 0, 0);
    AwaitSucceeded(job.id());
  }

  // Waits until `job_id` has SUCCEEDED durably (watch events are durable: once it is seen, the
  // job's end is on disk).
  void AwaitSucceeded(const std::string& job_id) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::WatchJobRequest r;
    r.set_job_id(job_id);
    auto reader = jobs_->WatchJob(&ctx, r);
    v1::JobEvent e;
    while (reader->Read(&e) && e.job().state() != v1::SUCCEEDED) {
    }
    EXPECT_EQ(e.job().state(), v1::SUCCEEDED);
    ctx.TryCancel();
    reader->Finish();
  }
};

TEST_F(JobHistoryTest, AnEvictedJobIsStillListedDescribedWatchedAndItsLogsAndMetricsRead) {
  auto node = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 1);
  const v1::Job done = Submit("done");
  RunToSuccess(*node, done);
  const v1::Job cancelled = Submit("cancelled");
  {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::CancelJobRequest r;
    r.set_job_id(cancelled.id());
    v1::Job out;
    ASSERT_TRUE(jobs_->CancelJob(&ctx, r, &out).ok());
  }
  const v1::Job waiting = Submit("waiting", 2);  // never fits the node: stays QUEUED
  v1::Job before;
  ASSERT_TRUE(Get(done.id(), &before).ok());
  // Each rank's position, then the tail: where a reader that reads again goes on from (the seq
  // before the rank's first line in the tail).
  EXPECT_THAT(Logs(done.id(), 1, /*positions=*/true), ElementsAre("0@99", "0:done job-1"));
  EXPECT_THAT(Logs(done.id(), 0, /*positions=*/true),
              ElementsAre("0:starting job-1", "0:done job-1"));

  // Within the retention nothing leaves.
  clock_.Advance(absl::Minutes(4));
  EXPECT_EQ(server_->EvictFinishedJobs(), 0);
  EXPECT_EQ(server_->jobs().ResidentJobs(), 3u);

  clock_.Advance(absl::Minutes(2));
  EXPECT_EQ(server_->EvictFinishedJobs(), 2);
  EXPECT_EQ(server_->jobs().ResidentJobs(), 1u);
  EXPECT_FALSE(server_->jobs().IsResident(done.id()));
  EXPECT_EQ(server_->logs().Jobs(), 0u);
  EXPECT_EQ(server_->step_metrics().Jobs(), 0u);

  // Described as it ended.
  v1::Job after;
  ASSERT_TRUE(Get(done.id(), &after).ok());
  EXPECT_EQ(after.SerializeAsString(), before.SerializeAsString());
  // Only its owner (or an admin) may read it: to others it does not exist, as before.
  v1::Job denied;
  EXPECT_EQ(Get(done.id(), &denied, "bob").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Get("job-99", &denied).error_code(), grpc::StatusCode::NOT_FOUND);

  // Listed with the job in memory, newest first, across pages and filters.
  v1::ListJobsRequest all;
  EXPECT_THAT(ListAll(all), ElementsAre("job-3:QUEUED", "job-2:CANCELLED", "job-1:SUCCEEDED"));
  all.set_page_size(1);
  EXPECT_THAT(ListAll(all), ElementsAre("job-3:QUEUED", "job-2:CANCELLED", "job-1:SUCCEEDED"));
  v1::ListJobsRequest ended;
  ended.add_states(v1::SUCCEEDED);
  ended.add_states(v1::QUEUED);
  EXPECT_THAT(ListAll(ended), ElementsAre("job-3:QUEUED", "job-1:SUCCEEDED"));

  // Its logs (all, and a tail) and metrics, from the store.
  EXPECT_THAT(Logs(done.id()), ElementsAre("0:starting job-1", "0:done job-1"));
  EXPECT_THAT(Logs(done.id(), 1), ElementsAre("0:done job-1"));
  EXPECT_THAT(Logs(done.id(), 1, /*positions=*/true), ElementsAre("0@99", "0:done job-1"));
  EXPECT_THAT(Metrics(done.id()), ElementsAre(1, 2, 3));
  EXPECT_THAT(Logs(cancelled.id()), ElementsAre());

  // Watching it gives its final state and ends.
  {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::WatchJobRequest r;
    r.set_job_id(done.id());
    auto reader = jobs_->WatchJob(&ctx, r);
    v1::JobEvent e;
    ASSERT_TRUE(reader->Read(&e));
    EXPECT_EQ(e.job().state(), v1::SUCCEEDED);
    EXPECT_FALSE(reader->Read(&e));
    EXPECT_TRUE(reader->Finish().ok());
  }
  // Cancelling or checkpointing it says it ended, as for a job in memory.
  {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::CancelJobRequest r;
    r.set_job_id(done.id());
    v1::Job out;
    grpc::Status s = jobs_->CancelJob(&ctx, r, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("already ended in state SUCCEEDED"));
  }
  {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::CheckpointJobRequest r;
    r.set_job_id(done.id());
    v1::Job out;
    EXPECT_EQ(jobs_->CheckpointJob(&ctx, r, &out).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  // New jobs continue the ids.
  EXPECT_EQ(Submit("next").id(), "job-4");
}

// A reader of an evicted job's log with a tail gets the tail whole, though a stale reader (one that
// reads nothing more, its stream full: the job's 9 MiB of log) keeps the job's series subscribed:
// the positions come from the store's copy only (those of the emptied series said every line was
// before them, and the new reader printed nothing).
TEST_F(JobHistoryTest, AStaleReaderOfAnEvictedJobHidesNoLineOfANewReadersTail) {
  auto node = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 1);
  const v1::Job done = Submit("done");
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node->NextCommand().assignment();
  constexpr int kLines = 600;
  for (int m = 0; m < kLines / 100; ++m) {
    v1::NodeMessage message;
    message.mutable_logs()->set_job_id(done.id());
    message.mutable_logs()->set_attempt(1);
    for (int i = m * 100; i < (m + 1) * 100; ++i) {
      message.mutable_logs()->add_seqs(i + 1);
      message.mutable_logs()->add_lines(absl::StrCat("line ", i, " ", std::string(16 << 10, 'x')));
    }
    ASSERT_TRUE(node->Write(message));
  }
  node->ReportExit(a, 0, 0);
  grpc::ClientContext stale_ctx;
  Prepare(stale_ctx);
  v1::StreamLogsRequest stale_request;
  stale_request.set_job_id(done.id());
  stale_request.set_follow(true);
  auto stale = jobs_->StreamLogs(&stale_ctx, stale_request);
  v1::LogLine first;
  ASSERT_TRUE(stale->Read(&first));  // subscribed; it reads no more
  absl::Cleanup finish = [&] {
    stale_ctx.TryCancel();
    while (stale->Read(&first)) {
    }
    stale->Finish();
  };
  AwaitSucceeded(done.id());  // (its end durable: then it may be evicted)
  clock_.Advance(absl::Minutes(6));
  ASSERT_EQ(server_->EvictFinishedJobs(), 1);
  EXPECT_EQ(server_->logs().Jobs(), 1u) << "the stale reader keeps the series subscribed";
  const std::vector<std::string> tail = Logs(done.id(), 1, /*positions=*/true);
  ASSERT_EQ(tail.size(), 2u);
  EXPECT_EQ(tail[0], absl::StrCat("0@", kLines - 1));
  EXPECT_TRUE(absl::StartsWith(tail[1], absl::StrCat("0:line ", kLines - 1, " ")))
      << tail[1].substr(0, 20);
}

TEST_F(JobHistoryTest, AfterARestartOldFinishedJobsStayInTheStoreWithTheirLogs) {
  auto node = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 1);
  const v1::Job done = Submit("done");
  RunToSuccess(*node, done);
  node.reset();
  clock_.Advance(absl::Minutes(6));
  ASSERT_EQ(server_->EvictFinishedJobs(), 1);
  const v1::Job recent = Submit("recent");
  {
    grpc::ClientContext ctx;
    Prepare(ctx);
    v1::CancelJobRequest r;
    r.set_job_id(recent.id());
    v1::Job out;
    ASSERT_TRUE(jobs_->CancelJob(&ctx, r, &out).ok());
  }
  server_->Shutdown();
  server_.reset();
  SetUp();
  // The old job was not loaded into memory; the recently finished one was.
  EXPECT_EQ(server_->jobs().ResidentJobs(), 1u);
  EXPECT_TRUE(server_->jobs().IsResident(recent.id()));
  EXPECT_THAT(ListAll({}), ElementsAre("job-2:CANCELLED", "job-1:SUCCEEDED"));
  EXPECT_THAT(Logs(done.id()), ElementsAre("0:starting job-1", "0:done job-1"));
  EXPECT_THAT(Metrics(done.id()), ElementsAre(1, 2, 3));
  EXPECT_EQ(Submit("next").id(), "job-3");
}

// A rank's line longer than the coordinator keeps is cut between characters: cut inside one
// (before 2026-11-30) it could not be read back, nor could the saved logs holding it, and the
// coordinator did not start again. A saved record that still does not parse is left out.
TEST_F(JobHistoryTest, ALongLineIsCutBetweenCharactersAndAnUnreadableRecordDoesNotStopTheStart) {
  auto node = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 1);
  const v1::Job job = Submit("utf8");
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  ASSERT_EQ(node->NextCommand().assignment().job_id(), job.id());
  // 16383 bytes, then two-byte characters: a cut at 16 KiB lands inside the first of them.
  std::string text(16383, 'x');
  for (int i = 0; i < 100; ++i) text += "\xc3\xa9";
  v1::NodeMessage m;
  m.mutable_logs()->set_job_id(job.id());
  m.mutable_logs()->set_attempt(1);
  m.mutable_logs()->add_lines(text);
  m.mutable_logs()->add_lines("after");
  ASSERT_TRUE(node->Write(m));
  node->Heartbeat();  // processed in order: the lines are in before the ack
  const std::string cut = "0:" + std::string(16383, 'x') + " [truncated 200 bytes]";
  EXPECT_THAT(Logs(job.id()), ElementsAre(cut, "0:after"));
  node.reset();
  Restart();  // the running job's logs saved at the shutdown, read back at the start
  EXPECT_THAT(Logs(job.id()), ElementsAre(cut, "0:after"));

  server_->Shutdown();
  server_.reset();
  {
    auto store = OpenSqliteJobStore(dir_.path() + "/state/coordinator.db");
    ASSERT_TRUE(store.ok()) << store.status();
    WriteBatch batch;
    batch.put_records.push_back(
        {kJobLogsRecord, job.id(),
         EncodeSeries(std::vector<v1::LogLine>{Line(0, "before")}, 1024, false) +
             UnreadableLineRecord() +
             EncodeSeries(std::vector<v1::LogLine>{Line(0, "later")}, 1024, false),
         0});
    ASSERT_TRUE((*store)->CommitSync(std::move(batch)).ok());
  }
  StartServer();
  EXPECT_THAT(Logs(job.id()), ElementsAre("0:before", "0:later"));
}

TEST_F(JobHistoryTest, LogsAndMetricsExpireOnTheirOwnRetentionAndTheJobStays) {
  auto node = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 1);
  const v1::Job done = Submit("done");
  RunToSuccess(*node, done);
  clock_.Advance(absl::Minutes(6));
  ASSERT_EQ(server_->EvictFinishedJobs(), 1);
  ASSERT_THAT(Logs(done.id()), SizeIs(2));
  clock_.Advance(absl::Hours(25));  // past the history's 24 h (and the 10 min between purges)
  server_->EvictFinishedJobs();
  EXPECT_THAT(Logs(done.id()), ElementsAre());
  EXPECT_THAT(Metrics(done.id()), ElementsAre());
  v1::Job job;
  ASSERT_TRUE(Get(done.id(), &job).ok());
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
}

// One malloc arena for every thread, set before any thread starts, so that mallinfo2 (which
// reads the main arena) counts what the store's and gRPC's threads allocate too.
const int kOneArena = mallopt(M_ARENA_MAX, 1);

// The heap the process uses: glibc's count of bytes in allocated blocks.
size_t HeapInUse() {
  EXPECT_EQ(kOneArena, 1);
  return mallinfo2().uordblks;
}

TEST_F(JobHistoryTest, TwentyThousandFinishedJobsLeaveTheHeapWithinAFixedBound) {
  constexpr int kRounds = 4;
  constexpr int kJobsPerRound = 5000;  // 20,000 in all
  constexpr int kChunk = 1000;         // within --max-pending-submits
  JobManager& jobs = server_->jobs();
  int64_t submitted = 0;
  size_t held = 0;  // the heap with a round's jobs in memory, before they leave
  auto round = [&] {
    for (int chunk = 0; chunk < kJobsPerRound / kChunk; ++chunk) {
      std::vector<std::string> ids(kChunk);
      absl::BlockingCounter submits(kChunk);
      for (int i = 0; i < kChunk; ++i) {
        jobs.Submit("alice", testing::TinySpec("j", 1), "", [&, i](absl::StatusOr<v1::Job> job) {
          EXPECT_TRUE(job.ok()) << job.status();
          if (job.ok()) ids[i] = job->id();
          submits.DecrementCount();
        });
      }
      submits.Wait();
      absl::BlockingCounter cancels(kChunk);
      for (const std::string& id : ids) {
        // 100 log lines (about 10 KB) and 20 steps each, as a short job leaves.
        std::vector<v1::LogLine> lines;
        for (int l = 0; l < 100; ++l) {
          lines.push_back(Line(l % 2, absl::StrCat(id, " step ", l, std::string(80, '.'))));
        }
        server_->logs().Append(id, std::move(lines));
        std::vector<v1::StepReport> steps;
        for (int64_t s = 1; s <= 20; ++s) steps.push_back(Step(s));
        server_->step_metrics().Append(id, std::move(steps));
        jobs.Cancel(id, "", [&](absl::StatusOr<v1::Job> job) {
          EXPECT_TRUE(job.ok()) << job.status();
          cancels.DecrementCount();
        });
      }
      cancels.Wait();
      submitted += kChunk;
    }
    held = HeapInUse();
    clock_.Advance(absl::Minutes(6));
    EXPECT_EQ(server_->EvictFinishedJobs(), kJobsPerRound);
    EXPECT_EQ(jobs.ResidentJobs(), 0u);
    EXPECT_EQ(server_->logs().Jobs(), 0u);
    EXPECT_EQ(server_->step_metrics().Jobs(), 0u);
  };
  round();  // warms the store's caches and the allocator
  const size_t baseline = HeapInUse();
  for (int r = 1; r < kRounds; ++r) {
    round();
    const size_t heap = HeapInUse();
    std::cout << "round " << r << ": heap " << heap << " bytes (" << held
              << " with its jobs in memory); after the first round " << baseline << "\n";
    // Held in memory, a round's 5,000 jobs with their logs and metrics take 60 MB or more (so
    // 20,000 would take 240 MB); once they left, the heap is back within 8 MiB of where it was.
    EXPECT_GT(held, baseline + (size_t{48} << 20));
    EXPECT_LT(heap, baseline + (size_t{8} << 20));
  }
  EXPECT_EQ(submitted, kRounds * kJobsPerRound);
  // Every one of them is still there, newest first, with its logs.
  v1::ListJobsRequest page;
  page.set_page_size(3);
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::ListJobsResponse resp;
  ASSERT_TRUE(jobs_->ListJobs(&ctx, page, &resp).ok());
  ASSERT_EQ(resp.jobs_size(), 3);
  EXPECT_EQ(resp.jobs(0).id(), "job-20000");
  EXPECT_EQ(resp.jobs(0).state(), v1::CANCELLED);
  EXPECT_THAT(Logs("job-1", 1), ElementsAre(absl::StrCat("1:job-1 step 99", std::string(80, '.'))));
  EXPECT_THAT(Metrics("job-20000"), SizeIs(20));
}

}  // namespace
}  // namespace trainyard::coordinator
