// JobHistory: what is left of a finished job once it leaves the coordinator's memory. After the
// job's retention (JobManagerOptions::finished_job_retention), EvictFinished writes the job's kept
// log lines and step metrics to the store as records ("job_logs" and "job_metrics", keyed by job
// id, capped in bytes and expiring after their own retention), and only once they are durable does
// memory forget the job and its records. `yard describe`, `ls`, `logs` and `metrics` of such a
// job are then served from the store (JobManager::Get and List, Logs and Metrics here), as Slurm
// serves finished jobs from its accounting store once MinJobAge has passed.
//
// Thread-safe. EvictFinished and PurgeExpired wait for the store: call them from a thread of the
// coordinator's (the ticker), never from a store callback.
#ifndef TRAINYARD_SERVER_COORDINATOR_JOB_HISTORY_H_
#define TRAINYARD_SERVER_COORDINATOR_JOB_HISTORY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/coordinator/job_manager.h"
#include "server/coordinator/job_series.h"
#include "server/coordinator/job_store.h"
#include "trainyard/v1/job.pb.h"
#include "trainyard/v1/trainer.pb.h"

namespace trainyard::coordinator {

using JobLogs = JobSeries<v1::LogLine>;
using JobMetrics = JobSeries<v1::StepReport>;

inline constexpr char kJobLogsRecord[] = "job_logs";
inline constexpr char kJobMetricsRecord[] = "job_metrics";

struct JobHistoryOptions {
  // How long a finished job's persisted logs and metrics are kept (infinite: for ever). The job
  // itself stays in the store.
  absl::Duration retention = absl::Hours(24 * 30);
  // Persisted bytes per job: the newest log lines are kept; metrics are thinned evenly (the
  // first and the last step always stay), so that a loss curve keeps its shape.
  size_t max_log_bytes_per_job = size_t{4} << 20;
  size_t max_metric_bytes_per_job = size_t{4} << 20;
  // Bytes of logs and metrics written in one eviction transaction, at most (one job always).
  size_t max_batch_bytes = size_t{64} << 20;
  // How often the logs and metrics of running jobs that changed are written to the store (and at
  // shutdown), so that a leader that dies loses at most this much of them.
  absl::Duration save_unfinished_interval = absl::Seconds(30);
};

class JobHistory {
 public:
  JobHistory(JobStore& store, JobManager& jobs, JobLogs& logs, JobMetrics& metrics,
             const Clock& clock, JobHistoryOptions options)
      : store_(store),
        jobs_(jobs),
        logs_(logs),
        metrics_(metrics),
        clock_(clock),
        options_(options) {}

  // Moves up to `max_jobs` finished jobs past their retention out of memory, oldest first: their
  // logs and metrics go to the store, then memory forgets them. Returns how many left memory;
  // on a store error, none did (they are tried again at the next call).
  absl::StatusOr<int> EvictFinished(size_t max_jobs);
  // Deletes the persisted logs and metrics whose retention has passed.
  absl::Status PurgeExpired();

  // Writes the kept logs and metrics of every job held in memory to the store (as the same
  // records; without expiry for unfinished jobs, a finished one's as its eviction would set it),
  // so that a coordinator started again on the store (a restart, an upgrade, a standby taking
  // over, a restored backup) still shows them: at shutdown, every save_unfinished_interval with
  // `changed_only` (only the series appended to since they were last written), and as soon as a
  // job ended. Returns how many jobs were written.
  absl::StatusOr<int> SaveUnfinished(bool changed_only = false);
  // Reads back into memory what SaveUnfinished wrote for the jobs held in memory (unfinished, and
  // finished within the retention): at start. Returns how many jobs had any.
  absl::StatusOr<int> LoadUnfinished();

  // A finished job's persisted lines or steps, oldest first; none if it had none or they have
  // expired. DATA_LOSS for an unreadable record.
  absl::StatusOr<std::vector<v1::LogLine>> Logs(const std::string& job_id) const;
  absl::StatusOr<std::vector<v1::StepReport>> Metrics(const std::string& job_id) const;

 private:
  JobStore& store_;
  JobManager& jobs_;
  JobLogs& logs_;
  JobMetrics& metrics_;
  const Clock& clock_;
  const JobHistoryOptions options_;
  absl::Mutex save_mu_;  // one SaveUnfinished at a time (the ticker, then shutdown)
  // Per unfinished job: the Appends() of its logs and metrics when they were last written.
  std::map<std::string, std::pair<uint64_t, uint64_t>> saved_ ABSL_GUARDED_BY(save_mu_);
};

// The records of job `id`'s kept logs and metrics as SaveUnfinished and a job's end write them
// (JobManager::EndRecords): none for a series with nothing kept; a finished job's (`end_ms` > 0)
// expire `options.retention` after its end, as its eviction would have them expire.
std::vector<StoredRecord> SeriesRecords(const JobLogs& logs, const JobMetrics& metrics,
                                        const JobHistoryOptions& options, const std::string& id,
                                        int64_t end_ms);

// The persisted form of a series: each record as a varint length and its bytes. Exposed for
// tests. Logs keep their newest records within `max_bytes`; metrics (thin) keep every k-th.
template <typename T>
std::string EncodeSeries(const std::vector<T>& records, size_t max_bytes, bool thin);
// DecodeSeries leaves out a record that does not parse (a log line cut inside a UTF-8 character
// by a coordinator before 2026-11-30 is one: protobuf refuses it) and counts it in `*unreadable`;
// DATA_LOSS where the framing is broken.
template <typename T>
absl::StatusOr<std::vector<T>> DecodeSeries(const std::string& payload, int* unreadable = nullptr);

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_JOB_HISTORY_H_
