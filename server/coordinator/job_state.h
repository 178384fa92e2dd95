// The job state machine of the brief's states, as pure functions. Used by the JobManager to check
// every transition it makes; unit-tested exhaustively.
#ifndef TRAINYARD_SERVER_COORDINATOR_JOB_STATE_H_
#define TRAINYARD_SERVER_COORDINATOR_JOB_STATE_H_

#include "trainyard/v1/job.pb.h"

namespace trainyard::coordinator {

// SUCCEEDED, FAILED, CANCELLED: nothing follows.
bool IsTerminal(v1::JobState state);
// QUEUED, RESTARTING, PREEMPTED: waiting to be placed by the scheduler.
bool IsPending(v1::JobState state);
// RUNNING, CHECKPOINTING: ranks hold devices.
bool IsActive(v1::JobState state);
// Whether the coordinator may move a job from `from` to `to`.
bool IsValidTransition(v1::JobState from, v1::JobState to);

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_JOB_STATE_H_
