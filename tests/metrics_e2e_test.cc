// The Prometheus endpoints of a real coordinator and a real worker (test_rank ranks): after a job
// runs, both /metrics pages carry the expected series and values, training series of a job exist
// only while it runs, and `promtool check metrics` accepts both pages.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/yard_client.h"
#include "tests/testing/http_get.h"
#include "tests/testing/identity.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"
#include "trainyard/v1/trainer.grpc.pb.h"

namespace trainyard {
namespace {

using testing::BinPath;
using ::testing::HasSubstr;
using testing::HttpGet;
using testing::Subprocess;
using testing::TempDir;

// The value of the sample `series` (name with labels as exposed) on a /metrics page; nullopt if
// absent.
std::optional<double> Sample(const std::string& page, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(page, '\n')) {
    if (!absl::StartsWith(line, series + " ")) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
  }
  return std::nullopt;
}

class MetricsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = Subprocess::Start({BinPath("trainyard-coordinator"), "--listen", "127.0.0.1:0",
                                "--state-dir", dir_.path() + "/state", "--metrics-address",
                                "127.0.0.1:0", "--heartbeat-interval", "0.2"});
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = std::move(*c);
    address_ = coordinator_->ReadLine(absl::Seconds(30)).value_or("");
    const std::string metrics_line = coordinator_->ReadLine(absl::Seconds(30)).value_or("");
    ASSERT_TRUE(absl::StartsWith(metrics_line, "metrics ")) << metrics_line;
    coordinator_metrics_ = metrics_line.substr(8);
    const auto channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    admin_token_ = testing::AdminToken(dir_.path() + "/state");
    const std::string node_token = dir_.path() + "/w1.token";
    const std::string user_map = dir_.path() + "/user-map";  // alice runs as this account
    std::ofstream(user_map) << "alice " << getpwuid(geteuid())->pw_name << "\n";
    ASSERT_TRUE(
        WriteSecretFile(node_token, testing::CreateToken(channel, admin_token_, "admin", "w1"))
            .ok());
    auto w = Subprocess::Start(
        {BinPath("trainyard-worker"), "--coordinator", address_, "--node-id", "w1", "--cpu-slots",
         "2", "--trainer", testing::TestBinPath("test_rank"), "--work-dir", dir_.path() + "/work",
         "--metrics-address", "127.0.0.1:0", "--token-file", node_token, "--user-map", user_map});
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = std::move(*w);
    const std::string worker_line = worker_->ReadLine(absl::Seconds(30)).value_or("");
    ASSERT_TRUE(absl::StartsWith(worker_line, "metrics ")) << worker_line;
    worker_metrics_ = worker_line.substr(8);
    client_ = std::make_unique<client::YardClient>(
        address_, testing::CreateToken(channel, admin_token_, "alice"));
  }

  // Scrapes `endpoint` until `series` has `value` (gauges refresh on the coordinator's ticker and
  // the worker's heartbeat); returns the last page.
  std::string ScrapeUntil(const std::string& endpoint, const std::string& series,
                          std::optional<double> value) {
    std::string page;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      auto got = HttpGet(endpoint, "/metrics");
      EXPECT_TRUE(got.ok()) << got.status();
      page = got.value_or("");
      if (Sample(page, series) == value) return page;
      absl::SleepFor(absl::Milliseconds(50));  // the next refresh; no event to wait on
    }
    ADD_FAILURE() << series << " never became " << (value ? std::to_string(*value) : "absent")
                  << "\n"
                  << page;
    return page;
  }

  void ExpectPromtoolAccepts(const std::string& page) {
    const std::string path = dir_.path() + "/page.txt";
    std::ofstream(path) << page;
    auto r = testing::RunCommand({"/bin/sh", "-c", "promtool check metrics < " + path});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  }

  TempDir dir_;
  std::unique_ptr<Subprocess> coordinator_, worker_;
  std::string address_, coordinator_metrics_, worker_metrics_, admin_token_;
  std::unique_ptr<client::YardClient> client_;
};

TEST_F(MetricsE2eTest, CoordinatorAndWorkerExportWhatHappened) {
  auto job = client_->Submit(testing::TinySpec("succeed", 2));
  ASSERT_TRUE(job.ok()) << job.status();
  auto done = client_->Watch(job->id(), absl::Seconds(120), [](const v1::Job&) { return false; });
  // Watch sees durable states only: the state in memory tells a stuck store from stuck ranks.
  ASSERT_TRUE(done.ok()) << done.status() << "; in memory: "
                         << client_->Get(job->id()).value_or(v1::Job()).ShortDebugString();
  ASSERT_EQ(done->state(), v1::SUCCEEDED) << done->message();

  const std::string c = ScrapeUntil(coordinator_metrics_, "trainyard_jobs{state=\"SUCCEEDED\"}", 1);
  EXPECT_EQ(Sample(c, "trainyard_jobs{state=\"QUEUED\"}"), 0);
  EXPECT_EQ(Sample(c, "trainyard_placements_total{kind=\"normal\"}"), 1);
  EXPECT_EQ(Sample(c, "trainyard_rpc_requests_total{code=\"OK\",method=\"JobService/SubmitJob\"}"),
            1);
  EXPECT_EQ(Sample(c, "trainyard_nodes{state=\"ready\"}"), 1);
  EXPECT_EQ(Sample(c, "trainyard_devices{pool=\"default\",state=\"total\"}"), 2);
  EXPECT_EQ(Sample(c, "trainyard_job_queue_wait_seconds_count"), 1);
  EXPECT_GE(Sample(c, "trainyard_store_commit_seconds_count").value_or(0), 3);
  EXPECT_GE(Sample(c, "trainyard_scheduling_pass_seconds_count").value_or(0), 1);
  ExpectPromtoolAccepts(c);

  const std::string w =
      ScrapeUntil(worker_metrics_, "trainyard_worker_rank_exits_total{reason=\"success\"}", 2);
  EXPECT_EQ(Sample(w, "trainyard_worker_devices{state=\"total\"}"), 2);
  EXPECT_EQ(Sample(w, "trainyard_worker_connected"), 1);
  EXPECT_GE(Sample(w, "trainyard_worker_heartbeat_rtt_seconds_count").value_or(0), 1);
  ExpectPromtoolAccepts(w);
}

TEST_F(MetricsE2eTest, TrainingSeriesExistWhileTheJobRuns) {
  auto job = client_->Submit(testing::TinySpec("hang", 1));
  ASSERT_TRUE(job.ok());
  ASSERT_TRUE(client_
                  ->Watch(job->id(), absl::Seconds(60),
                          [](const v1::Job& j) { return j.state() == v1::RUNNING; })
                  .ok());
  // What rank 0 of a trainer reports after a step.
  auto trainer = v1::TrainerService::NewStub(
      grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  // The attempt's job credential, as its worker got it (signed with the state directory's key).
  auto key = ReadSecretFile(dir_.path() + "/state/job-credential.key");
  ASSERT_TRUE(key.ok()) << key.status();
  testing::Authorize(ctx, MakeJobCredential(*key, job->id(), 1));
  v1::StepReport r;
  r.set_job_id(job->id());
  r.set_attempt(1);
  r.set_step(7);
  r.set_total_steps(10);
  r.set_loss(2.5);
  r.set_tokens_per_second(1234);
  v1::TrainerCommands commands;
  ASSERT_TRUE(trainer->ReportStep(&ctx, r, &commands).ok());
  const std::string series = "trainyard_job_loss{job=\"" + job->id() + "\"}";
  const std::string page = ScrapeUntil(coordinator_metrics_, series, 2.5);
  EXPECT_EQ(Sample(page, "trainyard_job_step{job=\"" + job->id() + "\"}"), 7);
  EXPECT_EQ(Sample(page, "trainyard_job_tokens_per_second{job=\"" + job->id() + "\"}"), 1234);
  // Rank 0's report `r` as of step `step`, changed by `edit`, sent with the attempt's credential.
  auto report = [&](int step, const std::function<void(v1::StepReport&)>& edit) {
    grpc::ClientContext c;
    testing::Authorize(c, MakeJobCredential(*key, job->id(), 1));
    v1::StepReport m = r;
    m.set_step(step);
    edit(m);
    v1::TrainerCommands answer;
    ASSERT_TRUE(trainer->ReportStep(&c, m, &answer).ok());
  };
  // No MFU (a CPU rank's report): no series; from the first report with one, its value.
  const std::string mfu = "trainyard_job_mfu{job=\"" + job->id() + "\"}";
  EXPECT_EQ(Sample(page, mfu), std::nullopt);
  report(8, [](v1::StepReport& m) { m.set_mfu(0.357); });
  EXPECT_EQ(Sample(ScrapeUntil(coordinator_metrics_, mfu, 0.357), mfu), 0.357);
  // A later report without one (a requeued attempt on an unknown GPU) takes the series away.
  report(9, [](v1::StepReport& m) { m.set_mfu(0); });
  EXPECT_EQ(
      Sample(ScrapeUntil(coordinator_metrics_, "trainyard_job_step{job=\"" + job->id() + "\"}", 9),
             mfu),
      std::nullopt);
  // Its account (the default one: no quota series) holds its device; usage grows as it runs.
  const std::string account = ScrapeUntil(
      coordinator_metrics_, "trainyard_account_running_devices{account=\"default\"}", 1);
  EXPECT_EQ(Sample(account, "trainyard_account_queued_devices{account=\"default\"}"), 0);
  EXPECT_EQ(Sample(account, "trainyard_account_share_ratio{account=\"default\"}"), 1);
  EXPECT_EQ(Sample(account, "trainyard_account_quota_devices{account=\"default\"}"), std::nullopt);
  std::optional<double> usage;
  for (int i = 0; i < 200 && usage.value_or(0) == 0; ++i) {
    usage = Sample(HttpGet(coordinator_metrics_, "/metrics").value_or(""),
                   "trainyard_account_usage_device_seconds{account=\"default\"}");
    if (usage.value_or(0) == 0) absl::SleepFor(absl::Milliseconds(50));  // the next tick
  }
  EXPECT_GT(usage.value_or(0), 0);
  // The program's own metrics: one family labelled by job and name, at most 64 names a job
  // whatever the reports say, finite values only, names as text (escaped in the exposition).
  auto report_metrics = [&](int step, const std::map<std::string, double>& metrics) {
    report(step, [&](v1::StepReport& m) {
      for (const auto& [name, value] : metrics) (*m.mutable_metrics())[name] = value;
    });
  };
  std::map<std::string, double> first;
  for (int i = 0; i < 63; ++i) first[absl::StrFormat("m%02d", i)] = i;
  first["quote\"d"] = 0.5;
  report_metrics(10, first);
  report_metrics(11, {{"m00", 42}, {"m01", std::nan("")}, {"late", 1}});
  const std::string metric = absl::StrCat("trainyard_job_metric{job=\"", job->id(), "\",name=");
  const std::string page_m = ScrapeUntil(coordinator_metrics_, metric + "\"m00\"}", 42);
  EXPECT_EQ(Sample(page_m, metric + "\"m01\"}"), 1);  // NaN left it as it was
  EXPECT_EQ(Sample(page_m, metric + "\"m62\"}"), 62);
  EXPECT_EQ(Sample(page_m, metric + "\"quote\\\"d\"}"), 0.5);
  EXPECT_EQ(Sample(page_m, metric + "\"late\"}"), std::nullopt);  // the 65th name
  int names = 0;
  for (absl::string_view line : absl::StrSplit(page_m, '\n'))
    names += absl::StartsWith(line, metric);
  EXPECT_EQ(names, 64);
  ExpectPromtoolAccepts(page_m);
  report(12, [](v1::StepReport& m) { m.set_mfu(0.5); });  // an MFU again, to see it go
  ScrapeUntil(coordinator_metrics_, mfu, 0.5);
  ASSERT_TRUE(client_->Cancel(job->id(), "done").ok());
  ScrapeUntil(coordinator_metrics_, series, std::nullopt);  // removed with the job
  const std::string after = HttpGet(coordinator_metrics_, "/metrics").value_or("");
  EXPECT_EQ(Sample(after, metric + "\"m00\"}"), std::nullopt);
  EXPECT_EQ(Sample(after, mfu), std::nullopt);
}

TEST_F(MetricsE2eTest, RefusedCallsAreCountedByMethodAndReason) {
  const std::string unauthenticated =
      "trainyard_auth_refusals_total{method=\"JobService/GetJob\",reason=\"UNAUTHENTICATED\"}";
  const std::string denied =
      "trainyard_auth_refusals_total{method=\"IdentityService/ListUsers\",reason=\"PERMISSION_"
      "DENIED\"}";
  {  // no credential at all, written by hand: YardClient would not send the call
    auto stub =
        v1::JobService::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::GetJobRequest r;
    r.set_job_id("job-1");
    v1::Job job;
    ASSERT_EQ(stub->GetJob(&ctx, r, &job).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  ASSERT_EQ(client_->ListUsers().status().code(), absl::StatusCode::kPermissionDenied);
  const std::string page = ScrapeUntil(coordinator_metrics_, denied, 1);
  EXPECT_EQ(Sample(page, unauthenticated), 1);
}

}  // namespace
}  // namespace trainyard
