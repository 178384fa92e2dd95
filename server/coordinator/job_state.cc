#include "server/coordinator/job_state.h"

namespace trainyard::coordinator {

bool IsTerminal(v1::JobState s) {
  return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED;
}

bool IsPending(v1::JobState s) {
  return s == v1::QUEUED || s == v1::RESTARTING || s == v1::PREEMPTED;
}

bool IsActive(v1::JobState s) { return s == v1::RUNNING || s == v1::CHECKPOINTING; }

bool IsValidTransition(v1::JobState from, v1::JobState to) {
  if (from == to || IsTerminal(from) || to == v1::JOB_STATE_UNSPECIFIED || to == v1::QUEUED) {
    return false;
  }
  if (IsPending(from)) {
    // A waiting job starts, is cancelled, or (a bad spec found late) fails.
    return to == v1::RUNNING || to == v1::CANCELLED || to == v1::FAILED;
  }
  switch (from) {
    case v1::RUNNING:
      return true;  // any other state
    case v1::CHECKPOINTING:
      return to != v1::CHECKPOINTING;
    default:
      return false;
  }
}

}  // namespace trainyard::coordinator
