// GroupCommitter: the durable stores' commit thread (SQLite's and PostgreSQL's alike). Commit
// queues a batch and returns; the thread takes everything queued meanwhile (group commit: one
// transaction, one fsync, for all of them) or, without group commit, one batch at a time, writes
// them through the store's `transaction`, and runs their callbacks in order, on the thread. A group
// whose transaction fails is written again a batch a transaction, so that one bad batch fails
// alone. Stop (and the destructor) writes everything queued first.
//
// Commit and Stats may be called from any thread; `transaction` runs on the commit thread only.
#ifndef TRAINYARD_SERVER_COORDINATOR_GROUP_COMMITTER_H_
#define TRAINYARD_SERVER_COORDINATOR_GROUP_COMMITTER_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/coordinator/job_store.h"

namespace trainyard::coordinator {

class GroupCommitter {
 public:
  // Writes `batches` in one transaction, all or nothing.
  using Transaction = std::function<absl::Status(const std::vector<const WriteBatch*>& batches)>;

  // `on_commit`: the seconds of each committed transaction (metrics; may be null).
  GroupCommitter(bool group_commit, Transaction transaction,
                 std::function<void(double seconds)> on_commit);
  ~GroupCommitter() { Stop(); }
  GroupCommitter(const GroupCommitter&) = delete;
  GroupCommitter& operator=(const GroupCommitter&) = delete;

  void Start();  // the thread ("ty-store-commit")
  void Stop();   // writes everything queued, runs its callbacks, joins

  void Commit(WriteBatch batch, JobStore::DoneCallback done) ABSL_LOCKS_EXCLUDED(mu_);
  JobStoreStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pending {
    WriteBatch batch;
    JobStore::DoneCallback done;
  };
  void Loop();
  // Each batch's status, in order; stats updated before the callbacks run.
  std::vector<absl::Status> WriteGroup(const std::vector<Pending>& pending);
  absl::Status Run(const std::vector<const WriteBatch*>& batches);

  const bool group_commit_;
  const Transaction transaction_;
  const std::function<void(double)> on_commit_;
  mutable absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  JobStoreStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_GROUP_COMMITTER_H_
