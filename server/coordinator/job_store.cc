// JobStore::CommitSync and the in-memory JobStore backend (NewInMemoryJobStore).
//
// The in-memory store is used by unit tests of the logic above the store and runs the shared store
// test suite (tests/job_store_test.cc) next to SQLite. It owns its rows and one apply thread.
#include "server/coordinator/job_store.h"

#include <algorithm>
#include <deque>
#include <iterator>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace trainyard::coordinator {

bool IsPostgresLocation(const std::string& location) {
  return absl::StartsWith(location, "postgresql://") || absl::StartsWith(location, "postgres://");
}

absl::StatusOr<std::unique_ptr<JobStore>> OpenJobStore(const std::string& location,
                                                       const JobStoreOptions& options) {
  if (IsPostgresLocation(location)) return OpenPostgresJobStore(location, options);
  return OpenSqliteJobStore(location, options);
}

absl::Status JobStore::CommitSync(WriteBatch batch) {
  absl::Notification done;
  absl::Status result;
  Commit(std::move(batch), [&](absl::Status status) {
    result = std::move(status);
    done.Notify();
  });
  done.WaitForNotification();
  return result;
}

namespace {

// Keeps jobs, nodes and records in maps and enforces the same constraints as the SQL schema (unique
// id, unique seq), so that a batch that SQLite would reject is rejected here too.
//
// Commit() may be called from any thread; batches are applied, and their callbacks run, in call
// order on the store's own apply thread (never inline), as the JobStore contract requires.
// Loads and Stats may be called from any thread, including from a callback.
class InMemoryJobStore final : public JobStore {
 public:
  absl::Status Backup(const std::string&) override {
    return absl::FailedPreconditionError(
        "the in-memory job store keeps no files: there is nothing to back up");
  }
  InMemoryJobStore() : apply_thread_([this] { ApplyLoop(); }) {}

  // Applies every queued batch and runs its callback before returning.
  ~InMemoryJobStore() override {
    {
      absl::MutexLock lock(&queue_mu_);
      stopping_ = true;
    }
    apply_thread_.join();
  }

  void Commit(WriteBatch batch, DoneCallback done) override {
    absl::MutexLock lock(&queue_mu_);
    queue_.push_back({std::move(batch), std::move(done)});
  }

  absl::StatusOr<std::vector<StoredJob>> LoadJobs() override {
    absl::MutexLock lock(&data_mu_);
    std::vector<StoredJob> jobs;
    jobs.reserve(jobs_.size());
    for (const auto& [seq, id] : seq_to_id_) jobs.push_back(jobs_.at(id));
    return jobs;
  }

  absl::StatusOr<std::vector<StoredNode>> LoadNodes() override {
    absl::MutexLock lock(&data_mu_);
    std::vector<StoredNode> nodes;
    nodes.reserve(nodes_.size());
    for (const auto& [id, payload] : nodes_) nodes.push_back({id, payload});
    return nodes;
  }

  absl::StatusOr<std::vector<StoredRecord>> LoadRecords(const std::string& kind) override {
    absl::MutexLock lock(&data_mu_);
    std::vector<StoredRecord> records;
    for (auto it = records_.lower_bound({kind, ""});
         it != records_.end() && it->first.first == kind; ++it) {
      records.push_back(it->second);
    }
    return records;
  }

  absl::StatusOr<StoredJob> GetJob(const std::string& id) override {
    absl::MutexLock lock(&data_mu_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job ", id));
    return it->second;
  }

  absl::StatusOr<StoredRecord> GetRecord(const std::string& kind, const std::string& id) override {
    absl::MutexLock lock(&data_mu_);
    auto it = records_.find({kind, id});
    if (it == records_.end()) return absl::NotFoundError(absl::StrCat("no ", kind, " ", id));
    return it->second;
  }

  absl::StatusOr<std::vector<StoredJob>> ListJobs(const JobQuery& query) override {
    absl::MutexLock lock(&data_mu_);
    std::vector<StoredJob> jobs;
    for (auto it = std::make_reverse_iterator(seq_to_id_.lower_bound(query.before_seq));
         it != seq_to_id_.rend() && jobs.size() < query.limit; ++it) {
      const StoredJob& job = jobs_.at(it->second);
      if (!query.owner.empty() && job.owner != query.owner) continue;
      if (!query.states.empty() &&
          std::find(query.states.begin(), query.states.end(), job.state) == query.states.end()) {
        continue;
      }
      jobs.push_back(job);
    }
    return jobs;
  }

  JobStoreStats Stats() const override {
    absl::MutexLock lock(&data_mu_);
    return stats_;
  }

 private:
  struct Pending {
    WriteBatch batch;
    DoneCallback done;
  };

  void ApplyLoop() {
    while (true) {
      std::deque<Pending> pending;
      {
        absl::MutexLock lock(&queue_mu_);
        queue_mu_.Await(absl::Condition(
            +[](InMemoryJobStore* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->queue_mu_) {
              return s->stopping_ || !s->queue_.empty();
            },
            this));
        if (queue_.empty()) return;  // stopping, and everything queued has been applied
        pending.swap(queue_);
      }
      for (Pending& p : pending) {
        absl::Status status;
        {
          absl::MutexLock lock(&data_mu_);
          const absl::Time start = absl::Now();
          status = Apply(p.batch);
          if (status.ok()) {
            ++stats_.batches;
            ++stats_.transactions;
            stats_.last_commit_seconds = absl::ToDoubleSeconds(absl::Now() - start);
          }
        }
        p.done(std::move(status));
      }
    }
  }

  // Applies all of `batch` or, on error, nothing of it.
  absl::Status Apply(const WriteBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(data_mu_) {
    // The previous row of every job id the batch touched (nullopt: absent), to undo on error.
    std::map<std::string, std::optional<StoredJob>> undo;
    for (const StoredJob& job : batch.put_jobs) {
      auto seq_it = seq_to_id_.find(job.seq);
      if (seq_it != seq_to_id_.end() && seq_it->second != job.id) {
        absl::Status error = absl::AlreadyExistsError(absl::StrCat(
            "job ", job.id, ": seq ", job.seq, " is already used by job ", seq_it->second));
        Undo(undo);
        return error;
      }
      auto job_it = jobs_.find(job.id);
      if (job_it == jobs_.end()) {
        undo.emplace(job.id, std::nullopt);  // keeps the first entry if the id was seen before
        jobs_.emplace(job.id, job);
      } else {
        undo.emplace(job.id, job_it->second);
        seq_to_id_.erase(job_it->second.seq);
        job_it->second = job;
      }
      seq_to_id_[job.seq] = job.id;
    }
    // Nodes cannot fail, so they are applied only once the jobs have succeeded.
    for (const StoredNode& node : batch.put_nodes) nodes_[node.id] = node.payload;
    for (const std::string& id : batch.delete_nodes) nodes_.erase(id);
    for (const StoredRecord& r : batch.put_records) records_[{r.kind, r.id}] = r;
    for (const auto& key : batch.delete_records) records_.erase(key);
    if (batch.delete_records_expired_at_ms > 0) {
      for (auto it = records_.begin(); it != records_.end();) {
        const int64_t expires = it->second.expires_ms;
        it = expires > 0 && expires <= batch.delete_records_expired_at_ms ? records_.erase(it)
                                                                          : std::next(it);
      }
    }
    return absl::OkStatus();
  }

  void Undo(const std::map<std::string, std::optional<StoredJob>>& undo)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(data_mu_) {
    // Remove every touched row first, then restore: restoring one row's old seq may collide with
    // the new seq of another touched row.
    for (const auto& [id, previous] : undo) {
      auto it = jobs_.find(id);
      if (it == jobs_.end()) continue;
      seq_to_id_.erase(it->second.seq);
      jobs_.erase(it);
    }
    for (const auto& [id, previous] : undo) {
      if (!previous.has_value()) continue;
      jobs_.emplace(id, *previous);
      seq_to_id_[previous->seq] = id;
    }
  }

  absl::Mutex queue_mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(queue_mu_);
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;

  mutable absl::Mutex data_mu_;
  std::map<std::string, StoredJob> jobs_ ABSL_GUARDED_BY(data_mu_);     // by id
  std::map<int64_t, std::string> seq_to_id_ ABSL_GUARDED_BY(data_mu_);  // seq -> job id
  std::map<std::string, std::string> nodes_ ABSL_GUARDED_BY(data_mu_);  // id -> payload
  std::map<std::pair<std::string, std::string>, StoredRecord> records_
      ABSL_GUARDED_BY(data_mu_);  // by (kind, id)
  JobStoreStats stats_ ABSL_GUARDED_BY(data_mu_);

  std::thread apply_thread_;  // last: starts after the fields above are constructed
};

}  // namespace

std::unique_ptr<JobStore> NewInMemoryJobStore() { return std::make_unique<InMemoryJobStore>(); }

}  // namespace trainyard::coordinator
