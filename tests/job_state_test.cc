// The job state machine, checked over every pair of states.
#include "server/coordinator/job_state.h"

#include <gtest/gtest.h>

namespace trainyard::coordinator {
namespace {

const v1::JobState kAll[] = {v1::QUEUED, v1::RUNNING,   v1::CHECKPOINTING, v1::SUCCEEDED,
                             v1::FAILED, v1::CANCELLED, v1::PREEMPTED,     v1::RESTARTING};

TEST(JobStateTest, TerminalStatesHaveNoSuccessor) {
  for (v1::JobState from : {v1::SUCCEEDED, v1::FAILED, v1::CANCELLED}) {
    EXPECT_TRUE(IsTerminal(from));
    for (v1::JobState to : kAll) EXPECT_FALSE(IsValidTransition(from, to)) << from << "->" << to;
  }
}

TEST(JobStateTest, NothingReturnsToQueuedOrStaysPut) {
  for (v1::JobState from : kAll) {
    EXPECT_FALSE(IsValidTransition(from, v1::QUEUED));
    EXPECT_FALSE(IsValidTransition(from, from));
  }
}

TEST(JobStateTest, WaitingJobsStartOrAreCancelledOrFail) {
  for (v1::JobState from : {v1::QUEUED, v1::RESTARTING, v1::PREEMPTED}) {
    EXPECT_TRUE(IsPending(from));
    EXPECT_TRUE(IsValidTransition(from, v1::RUNNING));
    EXPECT_TRUE(IsValidTransition(from, v1::CANCELLED));
    EXPECT_TRUE(IsValidTransition(from, v1::FAILED));
    EXPECT_FALSE(IsValidTransition(from, v1::SUCCEEDED));
    EXPECT_FALSE(IsValidTransition(from, v1::CHECKPOINTING));
  }
}

TEST(JobStateTest, RunningJobsMayEndRestartCheckpointOrBePreempted) {
  for (v1::JobState to : {v1::CHECKPOINTING, v1::SUCCEEDED, v1::FAILED, v1::CANCELLED,
                          v1::PREEMPTED, v1::RESTARTING}) {
    EXPECT_TRUE(IsValidTransition(v1::RUNNING, to)) << to;
  }
  EXPECT_TRUE(IsValidTransition(v1::CHECKPOINTING, v1::RUNNING));
  EXPECT_TRUE(IsActive(v1::RUNNING));
  EXPECT_TRUE(IsActive(v1::CHECKPOINTING));
  EXPECT_FALSE(IsActive(v1::QUEUED));
}

}  // namespace
}  // namespace trainyard::coordinator
