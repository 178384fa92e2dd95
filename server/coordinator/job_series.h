// JobSeries<T>: per-job append-only records (log lines, step metrics) kept in memory with caps
// on their number and their bytes (the oldest go first),
// with subscribers that get the backlog and then every new record, for `yard logs -f` and
// `yard metrics -f`. When a finished job leaves the coordinator's memory its records are persisted
// (job_history.h) and Erased here. Records with a seq (LogLine.seq, StepReport.seq: growing per
// attempt and rank) are kept once: a record whose seq is not past the last one kept of its attempt
// and rank is a copy sent again (after a failover or a restart) and is dropped, also when the
// series was read back from the store. Thread-safe; subscriber callbacks run on the appending
// thread, outside the lock, in append order per job.
#ifndef TRAINYARD_SERVER_COORDINATOR_JOB_SERIES_H_
#define TRAINYARD_SERVER_COORDINATOR_JOB_SERIES_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/seq_filter.h"

namespace trainyard::coordinator {

// Where the records a tail left out end, for each attempt and rank of `records` (oldest first)
// whose first `skip` the tail leaves out: the seq before the rank's first record in the tail, or,
// for a rank with none there, `last`'s (its last record kept). What StreamLogsRequest.positions
// sends: a reader that takes these first, then the tail, then (read again) every record, takes
// each record past the tail once and none the tail left out.
template <typename Records>
SeqFilter::Last TailPositions(const Records& records, size_t skip, SeqFilter::Last last) {
  std::set<std::pair<int32_t, int32_t>> in_tail;
  for (size_t i = skip; i < records.size(); ++i) {
    const auto& r = records[i];
    if (r.seq() <= 0 || !in_tail.insert({r.attempt(), r.rank()}).second) continue;
    last[{r.attempt(), r.rank()}] = r.seq() - 1;  // (the first of its in the tail)
  }
  return last;
}

template <typename T>
class JobSeries {
 public:
  using Callback = std::function<void(const std::vector<T>&)>;

  // T is a protobuf message; its bytes are its serialized size.
  JobSeries(size_t max_records_per_job, size_t max_bytes_per_job)
      : max_records_(max_records_per_job), max_bytes_(max_bytes_per_job) {}

  // Returns how many of `records` were new (kept and delivered).
  size_t Append(const std::string& job_id, std::vector<T> records) {
    std::vector<std::shared_ptr<Callback>> callbacks;
    {
      absl::MutexLock lock(&mu_);
      Series& s = series_[job_id];
      // Copies sent again go first (records stay in order).
      records.erase(std::remove_if(records.begin(), records.end(),
                                   [&s](const T& r) { return !s.seqs.Take(r); }),
                    records.end());
      if (records.empty()) return 0;
      ++s.appends;
      for (const T& r : records) {
        s.records.push_back(r);
        s.bytes += r.ByteSizeLong();
      }
      while (s.records.size() > max_records_ || (s.bytes > max_bytes_ && !s.records.empty())) {
        s.bytes -= s.records.front().ByteSizeLong();
        s.records.pop_front();
      }
      for (const auto& [handle, cb] : s.subscribers) callbacks.push_back(cb);
      // Delivery happens outside the lock, but in order: appends for one job come from one
      // stream (a node session or a rank's reports), so they do not race each other.
    }
    for (const auto& cb : callbacks) (*cb)(records);
    return records.size();
  }

  // Whether Append would keep `record` now (it has no seq, or one past the last kept).
  bool Fresh(const std::string& job_id, const T& record) const {
    absl::MutexLock lock(&mu_);
    auto it = series_.find(job_id);
    return it == series_.end() || it->second.seqs.Fresh(record);
  }

  // Returns a handle for Unsubscribe. `on_records` gets the kept records first (the last `tail`
  // of them, or all for tail 0; called here, under the lock, so that no append can be delivered
  // before them), then every later append. `kept` (if not null) says how many were kept;
  // `on_positions` (if given) gets their TailPositions before them.
  int64_t Subscribe(const std::string& job_id, size_t tail, Callback on_records,
                    size_t* kept = nullptr,
                    const std::function<void(const SeqFilter::Last&)>& on_positions = nullptr) {
    absl::MutexLock lock(&mu_);
    Series& s = series_[job_id];
    const size_t skip = tail == 0 || tail >= s.records.size() ? 0 : s.records.size() - tail;
    if (kept != nullptr) *kept = s.records.size();
    // (None from an empty series: a job's records read from the store come with their own, and
    // the seqs kept here for a stale reader would hide them.)
    if (on_positions && !s.records.empty()) {
      on_positions(TailPositions(s.records, skip, s.seqs.last()));
    }
    on_records(std::vector<T>(s.records.begin() + skip, s.records.end()));
    const int64_t handle = next_handle_++;
    s.subscribers[handle] = std::make_shared<Callback>(std::move(on_records));
    handles_[handle] = job_id;
    return handle;
  }

  void Unsubscribe(int64_t handle) {
    absl::MutexLock lock(&mu_);
    auto it = handles_.find(handle);
    if (it == handles_.end()) return;
    auto series = series_.find(it->second);
    series->second.subscribers.erase(handle);
    // A reader of a job with nothing kept leaves nothing behind.
    if (series->second.records.empty() && series->second.subscribers.empty()) {
      series_.erase(series);
    }
    handles_.erase(it);
  }

  // The records kept for `job_id`, oldest first.
  std::vector<T> Snapshot(const std::string& job_id) const {
    absl::MutexLock lock(&mu_);
    auto it = series_.find(job_id);
    if (it == series_.end()) return {};
    return std::vector<T>(it->second.records.begin(), it->second.records.end());
  }

  // Drops the records kept for `job_id` (subscribers stay subscribed).
  void Erase(const std::string& job_id) {
    absl::MutexLock lock(&mu_);
    auto it = series_.find(job_id);
    if (it == series_.end()) return;
    if (it->second.subscribers.empty()) {
      series_.erase(it);
    } else {
      it->second.records.clear();
      it->second.bytes = 0;
    }
  }

  // How many times records were appended for `job_id` (0: never, or erased): a version, to tell
  // whether the series changed since it was last looked at.
  uint64_t Appends(const std::string& job_id) const {
    absl::MutexLock lock(&mu_);
    auto it = series_.find(job_id);
    return it == series_.end() ? 0 : it->second.appends;
  }

  // How many jobs have records or subscribers here.
  size_t Jobs() const {
    absl::MutexLock lock(&mu_);
    return series_.size();
  }

 private:
  struct Series {
    std::deque<T> records;
    size_t bytes = 0;  // of records
    uint64_t appends = 0;
    SeqFilter seqs;  // what was kept, by seq
    std::map<int64_t, std::shared_ptr<Callback>> subscribers;
  };

  const size_t max_records_;
  const size_t max_bytes_;
  mutable absl::Mutex mu_;
  std::map<std::string, Series> series_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::string> handles_ ABSL_GUARDED_BY(mu_);
  int64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_JOB_SERIES_H_
