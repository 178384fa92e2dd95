// JobManager's helpers shared by its files: job_manager.cc (lifecycle: submit, list, cancel,
// watch, eviction), job_admission.cc (what a job may ask for), job_scheduling.cc (the pass and its
// placements), job_attempts.cc (node and rank events, attempts, reports) and job_usage.cc (usage,
// quotas, fair share, why_waiting). Internal to the coordinator; the interface is job_manager.h.
#pragma once

#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "server/coordinator/job_manager.h"

namespace trainyard::coordinator {

inline int64_t NowMs(const Clock& clock) { return absl::ToUnixMillis(clock.Now()); }

// Keys of the usage ledger.
inline std::string AccountKey(const std::string& account) {
  return absl::StrCat("account:", account);
}
inline std::string UserKey(const std::string& user) { return absl::StrCat("user:", user); }

// When the head of the queue is expected to start, for why_waiting.
inline std::string StartText(const std::optional<absl::Time>& start, absl::Time now) {
  if (!start.has_value()) {
    return "start unknown: the devices are held by jobs without max_runtime";
  }
  return absl::StrCat("expected to start in ",
                      absl::FormatDuration(absl::Trunc(std::max(absl::ZeroDuration(), *start - now),
                                                       absl::Seconds(1))));
}

// A duration for people: "40 minutes", "4.8 hours", "3.5 days".
inline std::string HumanDuration(absl::Duration d) {
  const double hours = absl::ToDoubleHours(std::max(d, absl::ZeroDuration()));
  if (hours < 1) return absl::StrFormat("%.0f minutes", hours * 60);
  if (hours < 48) return absl::StrFormat("%.1f hours", hours);
  return absl::StrFormat("%.1f days", hours / 24);
}

// How long the devices of a stopped rank on a connected node stay allocated when its exit is never
// reported (a lost message): the node's SIGTERM → SIGKILL grace (its worker's --stop-grace, 10 s
// by default) and kDrainMargin, at least kDrainTimeout (JobManager::DrainDeadline).
inline constexpr absl::Duration kDrainTimeout = absl::Seconds(60);
inline constexpr absl::Duration kDrainMargin = absl::Seconds(30);
// The most a node's report of a rank's stop grace counts for (RankStatus.stop_grace_ms), as a
// node's own --stop-grace at registration.
inline constexpr absl::Duration kMaxReportedGrace = absl::Hours(24);
// Placements one pass applies; the rest wait for the next pass, which follows at once. Bounds how
// long a pass holds the job manager under a burst (rank reports and submits wait for it).
inline constexpr int kMaxPlacementsPerPass = 128;

// Whether `node` takes `owner`'s jobs: it names no owners, or `owner` among them (a worker or
// parameter server registered with a node token limited to some owners' jobs).
inline bool TakesJobsOf(const v1::Node& node, const std::string& owner) {
  return node.owners().empty() ||
         std::find(node.owners().begin(), node.owners().end(), owner) != node.owners().end();
}

inline StoredJob ToStored(const v1::Job& job) {
  return StoredJob{job.id(), job.seq(), job.owner(), v1::JobState_Name(job.state()),
                   job.SerializeAsString()};
}

}  // namespace trainyard::coordinator
