#include "server/coordinator/group_committer.h"

#include <pthread.h>

#include <utility>

#include "absl/time/clock.h"
#include "common/failpoint.h"

namespace trainyard::coordinator {

GroupCommitter::GroupCommitter(bool group_commit, Transaction transaction,
                               std::function<void(double seconds)> on_commit)
    : group_commit_(group_commit),
      transaction_(std::move(transaction)),
      on_commit_(std::move(on_commit)) {}

void GroupCommitter::Start() {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "ty-store-commit");
    Loop();
  });
}

void GroupCommitter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void GroupCommitter::Commit(WriteBatch batch, JobStore::DoneCallback done) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({std::move(batch), std::move(done)});
}

JobStoreStats GroupCommitter::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void GroupCommitter::Loop() {
  while (true) {
    std::vector<Pending> pending;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](GroupCommitter* c)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) { return c->stopping_ || !c->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping, and everything queued has been written
      // With group commit, everything queued while the previous transaction was written shares
      // the next one; without, one batch at a time.
      const size_t take = group_commit_ ? queue_.size() : 1;
      for (size_t i = 0; i < take; ++i) {
        pending.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    std::vector<absl::Status> results = WriteGroup(pending);
    for (size_t i = 0; i < pending.size(); ++i) pending[i].done(std::move(results[i]));
  }
}

std::vector<absl::Status> GroupCommitter::WriteGroup(const std::vector<Pending>& pending) {
  std::vector<absl::Status> results(pending.size());
  std::vector<size_t> to_write;  // an empty batch needs no transaction and cannot fail
  for (size_t i = 0; i < pending.size(); ++i) {
    if (!pending[i].batch.empty()) to_write.push_back(i);
  }
  if (!to_write.empty()) {
    std::vector<const WriteBatch*> batches;
    for (size_t i : to_write) batches.push_back(&pending[i].batch);
    absl::Status group_status = Run(batches);
    if (!group_status.ok()) {
      if (to_write.size() == 1) {
        results[to_write[0]] = std::move(group_status);
      } else {
        for (size_t i : to_write) results[i] = Run({&pending[i].batch});
      }
    }
  }
  int64_t committed = 0;
  for (const absl::Status& status : results) committed += status.ok() ? 1 : 0;
  absl::MutexLock lock(&mu_);
  stats_.batches += committed;
  return results;
}

absl::Status GroupCommitter::Run(const std::vector<const WriteBatch*>& batches) {
  const absl::Time start = absl::Now();
  // (Tests: a store that fails a write, as a full disk or a lost database connection would.)
  if (FailpointFails("store-commit")) return absl::UnavailableError("failpoint store-commit");
  absl::Status status = transaction_(batches);
  if (!status.ok()) return status;
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  {
    absl::MutexLock lock(&mu_);
    ++stats_.transactions;
    stats_.last_commit_seconds = seconds;
  }
  if (on_commit_) on_commit_(seconds);
  return absl::OkStatus();
}

}  // namespace trainyard::coordinator
