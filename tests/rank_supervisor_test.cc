// RankSupervisor with real rank processes (tests/test_rank.cc): what it reports for assignments
// that arrive more than once, as they do when a session opens while a placement is being sent.
#include "worker/daemon/rank_supervisor.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"

namespace trainyard::worker {
namespace {

// A failed rank's message leads with its cause, not with the first thing it printed.
TEST(FailureMessageTest, LeadsWithTheLastErrorLine) {
  EXPECT_EQ(FailureMessage({"LibTorch 1.13.0", "BLAS: OpenBLAS",
                            "trainyard-trainer: error: data.path: cannot open '/nope'"}),
            "trainyard-trainer: error: data.path: cannot open '/nope'\nLibTorch 1.13.0\n"
            "BLAS: OpenBLAS\ntrainyard-trainer: error: data.path: cannot open '/nope'");
  // Python: the exception, Traceback's last line, even with output after it.
  const std::string m = FailureMessage(
      {"Traceback (most recent call last):", "  File \"train.py\", line 3, in <module>",
       "ValueError: bad learning rate", "cleaning up"});
  EXPECT_EQ(m.substr(0, m.find('\n')), "ValueError: bad learning rate");
  // No error word: the last non-empty line.
  const std::string quiet = FailureMessage({"step 1", "step 2", ""});
  EXPECT_EQ(quiet.substr(0, quiet.find('\n')), "step 2");
  EXPECT_EQ(FailureMessage({}), "");
  EXPECT_EQ(FailureMessage({"only line: Error"}), "only line: Error");
}

using testing::TempDir;

// The rank status messages a supervisor sent, in order.
class Reports {
 public:
  void Add(const v1::NodeMessage& m) {
    if (!m.has_rank_status()) return;
    absl::MutexLock lock(&mu_);
    statuses_.push_back(m.rank_status());
  }
  // Waits until `job_id` rank `rank` has exited; false after 30 s.
  bool AwaitExit(const std::string& job_id, int rank) {
    absl::MutexLock lock(&mu_);
    auto exited = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const v1::RankStatus& s : statuses_) {
        if (s.job_id() == job_id && s.rank() == rank && s.phase() == v1::RANK_EXITED) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&exited), absl::Seconds(30));
  }
  // The exit code of `job_id` rank `rank`'s first exit; -1 when none.
  int ExitCode(const std::string& job_id, int rank) {
    absl::MutexLock lock(&mu_);
    for (const v1::RankStatus& s : statuses_) {
      if (s.job_id() == job_id && s.rank() == rank && s.phase() == v1::RANK_EXITED) {
        return s.exit_code();
      }
    }
    return -1;
  }
  // How many times `job_id` rank `rank` was reported in `phase`.
  int Count(const std::string& job_id, int rank, v1::RankPhase phase) {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const v1::RankStatus& s : statuses_) {
      n += s.job_id() == job_id && s.rank() == rank && s.phase() == phase;
    }
    return n;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::RankStatus> statuses_ ABSL_GUARDED_BY(mu_);
};

v1::Assignment AssignmentOf(const std::string& job_id, int ranks) {
  v1::Assignment a;
  a.set_job_id(job_id);
  a.set_attempt(1);
  a.set_world_size(ranks);
  a.set_first_rank(0);
  for (int i = 0; i < ranks; ++i) a.add_device_indices(i);
  a.set_spec(testing::TinySpec("succeed", ranks).SerializeAsString());
  a.set_owner("alice");
  return a;
}

class RankSupervisorTest : public ::testing::Test {
 protected:
  RankSupervisorTest() {
    SupervisorOptions options;
    options.trainer_path = testing::TestBinPath("test_rank");
    options.work_dir = dir_.path() + "/work";
    options.shepherd_path = testing::BinPath("trainyard-worker");  // not this test's binary
    supervisor_ =
        std::make_unique<RankSupervisor>(options, [this](v1::NodeMessage m) { reports_.Add(m); });
  }

  TempDir dir_;
  Reports reports_;
  std::unique_ptr<RankSupervisor> supervisor_;
};

TEST_F(RankSupervisorTest, AnAssignmentSentTwiceStartsEachRankOnce) {
  const v1::Assignment a = AssignmentOf("job-1", 2);
  supervisor_->Launch(a);
  supervisor_->Launch(a);  // crossed the first on its way: both queued
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  ASSERT_TRUE(reports_.AwaitExit("job-1", 1));
  // Launches are started in order: once job-2 has run, a third copy of job-1's would have too.
  supervisor_->Launch(a);  // after its ranks ended
  supervisor_->Launch(AssignmentOf("job-2", 1));
  ASSERT_TRUE(reports_.AwaitExit("job-2", 0));
  EXPECT_EQ(reports_.ExitCode("job-2", 0), 0);
  for (int rank : {0, 1}) {
    EXPECT_EQ(reports_.ExitCode("job-1", rank), 0) << "rank " << rank;
    EXPECT_EQ(reports_.Count("job-1", rank, v1::RANK_RUNNING), 1) << "rank " << rank;
    EXPECT_EQ(reports_.Count("job-1", rank, v1::RANK_EXITED), 1) << "rank " << rank;
  }
}

TEST_F(RankSupervisorTest, AnAssignmentStoppedBeforeItStartedIsNotStartedByAResend) {
  const v1::Assignment a = AssignmentOf("job-1", 1);
  supervisor_->Stop("job-1", 1);  // nothing of it yet: a no-op
  supervisor_->Launch(a);
  supervisor_->Stop("job-1", 1);  // may catch it queued, or stop it running
  ASSERT_TRUE(reports_.AwaitExit("job-1", 0));
  supervisor_->Launch(a);
  supervisor_->Launch(AssignmentOf("job-2", 1));
  ASSERT_TRUE(reports_.AwaitExit("job-2", 0));
  EXPECT_EQ(reports_.Count("job-1", 0, v1::RANK_EXITED), 1);
  EXPECT_LE(reports_.Count("job-1", 0, v1::RANK_RUNNING), 1);
}

}  // namespace
}  // namespace trainyard::worker
