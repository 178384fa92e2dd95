// Which kept checkpoints a rank's checkpoint report carries (KeptToReport): the newest, at most
// kMaxKeptCheckpoints and within a budget of path bytes, oldest first. And the reporter's drain at
// exit against a real gRPC TrainerService: every step while the coordinator answers, however
// slowly; a bounded wait, and a count in the log, when it is gone.
#include "worker/trainer/control/reporter.h"
#include "worker/trainer/control/step_report.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/field_limits.h"
#include "trainyard/v1/trainer.grpc.pb.h"

namespace trainyard::trainer {
namespace {

using ::testing::ElementsAre;

CheckpointReport WithKept(int count, size_t path_bytes) {
  CheckpointReport r;
  for (int i = 1; i <= count; ++i) {
    std::string path = "/ckpt/step-" + std::to_string(i);
    path.resize(path_bytes, 'x');
    r.kept.push_back({i, path, std::nullopt});
  }
  return r;
}

TEST(KeptToReportTest, AllWhenFewAndShort) {
  EXPECT_THAT(KeptToReport(WithKept(3, 20), 1024), ElementsAre(0, 1, 2));
  EXPECT_THAT(KeptToReport(WithKept(0, 20), 1024), ElementsAre());
}

TEST(KeptToReportTest, TheNewestHundredOldestFirst) {
  const std::vector<size_t> kept = KeptToReport(WithKept(150, 20), 1 << 20);
  ASSERT_EQ(kept.size(), static_cast<size_t>(kMaxKeptCheckpoints));
  EXPECT_EQ(kept.front(), 50u);
  EXPECT_EQ(kept.back(), 149u);
}

// Long paths: as many of the newest as fit in the budget, so the report stays under the
// coordinator's cap instead of being refused whole.
TEST(KeptToReportTest, LongPathsAreCutToTheBudget) {
  EXPECT_THAT(KeptToReport(WithKept(10, 1000), 3500), ElementsAre(7, 8, 9));
  EXPECT_THAT(KeptToReport(WithKept(10, 1000), 999), ElementsAre());
  // 100 paths of 4096 bytes (PATH_MAX) would be 400 KiB; half the report cap takes 8 of them.
  const std::vector<size_t> kept = KeptToReport(WithKept(100, 4096), kMaxReportBytes / 2);
  EXPECT_EQ(kept.size(), 8u);
  EXPECT_EQ(kept.back(), 99u);
}

// A coordinator's TrainerService that takes `latency` to answer each step report (a busy machine)
// and keeps the steps it was sent, each seq once as the coordinator does (a report whose answer
// came after the rank's deadline is sent again).
class SlowTrainerService final : public v1::TrainerService::Service {
 public:
  explicit SlowTrainerService(absl::Duration latency) : latency_(latency) {}

  grpc::Status ReportStep(grpc::ServerContext*, const v1::StepReport* report,
                          v1::TrainerCommands* commands) override {
    absl::SleepFor(latency_);  // (the service's speed, not a wait for an event)
    commands->set_incarnation("one");
    absl::MutexLock lock(&mu_);
    if (seqs_.insert(report->seq()).second) steps_.push_back(report->step());
    return grpc::Status::OK;
  }

  std::vector<int64_t> steps() {
    absl::MutexLock lock(&mu_);
    return steps_;
  }

 private:
  const absl::Duration latency_;
  absl::Mutex mu_;
  std::vector<int64_t> steps_ ABSL_GUARDED_BY(mu_);
  std::set<int64_t> seqs_ ABSL_GUARDED_BY(mu_);
};

absl::Mutex log_mu;
std::vector<std::string>* log_lines ABSL_GUARDED_BY(log_mu) = new std::vector<std::string>;

void Log(const std::string& line) {
  absl::MutexLock lock(&log_mu);
  log_lines->push_back(line);
}

std::vector<std::string> LogLines() {
  absl::MutexLock lock(&log_mu);
  std::vector<std::string> out = *log_lines;
  log_lines->clear();
  return out;
}

void ReportSteps(Reporter& reporter, int steps) {
  for (int i = 1; i <= steps; ++i) {
    StepReport r;
    r.step = i;
    r.total_steps = steps;
    reporter.ReportStep(r);
  }
}

// A step's line in the rank's log and --metrics-file: the backward's time where the host measured
// it (the CPU), left out where it is not the backward's (a GPU, whose host only queues kernels).
std::vector<std::string> g_step_lines;
void KeepLine(const std::string& line) { g_step_lines.push_back(line); }

TEST(StepReporterTest, TheBackwardsTimeOnlyWhereTheHostMeasuredIt) {
  const std::string path = ::testing::TempDir() + "/step_report_test.jsonl";
  std::remove(path.c_str());
  g_step_lines.clear();
  auto reporter = StepReporter::Open(path, nullptr, KeepLine);
  ASSERT_TRUE(reporter.ok()) << reporter.status();
  StepRecord cpu;
  cpu.step = 1;
  cpu.total_steps = 2;
  cpu.step_seconds = 0.05;
  cpu.backward_seconds = 0.012;
  (*reporter)->Report(cpu);
  StepRecord gpu = cpu;
  gpu.step = 2;
  gpu.backward_seconds.reset();
  (*reporter)->Report(gpu);
  reporter->reset();  // (closes the file)
  ASSERT_EQ(g_step_lines.size(), 2u);
  EXPECT_THAT(g_step_lines[0], ::testing::HasSubstr("step_ms 50 backward_ms 12 comm_wait_ms"));
  EXPECT_THAT(g_step_lines[1], ::testing::HasSubstr("step_ms 50 comm_wait_ms"));
  EXPECT_THAT(g_step_lines[1], ::testing::Not(::testing::HasSubstr("backward")));
  std::ifstream in(path);
  std::string first, second;
  ASSERT_TRUE(std::getline(in, first));
  ASSERT_TRUE(std::getline(in, second));
  EXPECT_THAT(first, ::testing::HasSubstr("\"backward_seconds\":0.012"));
  EXPECT_THAT(second, ::testing::HasSubstr("\"step\":2"));
  EXPECT_THAT(second, ::testing::Not(::testing::HasSubstr("backward")));
  std::remove(path.c_str());
}

// A coordinator that answers, slowly, gets every step, though sending them takes longer than the
// 5 s the drain waits for a coordinator that does not answer (the last steps were lost so on a
// busy machine).
TEST(ReporterTest, AtExitEveryStepIsSentWhileTheCoordinatorAnswers) {
  SlowTrainerService service(absl::Milliseconds(100));
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  constexpr int kSteps = 80;  // 8 s of answers at least
  {
    Reporter reporter(absl::StrCat("127.0.0.1:", port), "job-1", 1, 0, &Log);
    ReportSteps(reporter, kSteps);
  }
  std::vector<int64_t> expected;
  for (int i = 1; i <= kSteps; ++i) expected.push_back(i);
  EXPECT_EQ(service.steps(), expected);
  EXPECT_THAT(LogLines(), ::testing::Not(::testing::Contains(::testing::HasSubstr("not sent"))));
  server->Shutdown();
}

// A coordinator that is gone holds the exit for the drain's 5 s and the last report's deadline,
// not for each report, and the log says how many were not sent.
TEST(ReporterTest, AtExitACoordinatorThatIsGoneCostsSecondsAndIsLogged) {
  // A port that was just free (a server started and stopped on it).
  int port = 0;
  {
    SlowTrainerService unused(absl::ZeroDuration());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&unused);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    ASSERT_NE(server, nullptr);
    server->Shutdown();
  }
  const absl::Time start = absl::Now();
  {
    Reporter reporter(absl::StrCat("127.0.0.1:", port), "job-1", 1, 0, &Log);
    ReportSteps(reporter, 20);
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_THAT(LogLines(),
              ::testing::Contains(::testing::HasSubstr(
                  "warning: 20 step reports were not sent at exit (a rank waits 5s for the "
                  "coordinator's answer, 1m in all)")));
}

}  // namespace
}  // namespace trainyard::trainer
