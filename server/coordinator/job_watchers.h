// JobWatchers: JobManager's owner of watches. Who watches which job (`yard wait`, `yard logs -f`,
// the SDK's streams), and which version of each job is known to be durable: a watch event is sent
// only once a version is on disk, while reads may be a few milliseconds ahead of it.
//
// State with no lock of its own: JobManager holds its mutex around every call, and calls the
// callbacks Durable returns after releasing it.
#ifndef TRAINYARD_SERVER_COORDINATOR_JOB_WATCHERS_H_
#define TRAINYARD_SERVER_COORDINATOR_JOB_WATCHERS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "server/coordinator/job_handlers.h"

namespace trainyard::coordinator {

class JobWatchers {
 public:
  using Callback = JobLifecycle::WatchCallback;

  // A watch of `job_id`; its handle (never 0) for Remove.
  int64_t Add(const std::string& job_id, Callback on_change);
  void Remove(int64_t handle);  // an unknown handle: nothing
  size_t size() const { return by_handle_.size(); }

  // `version` of the job is durable (a later call may say an older one: it is kept the newest).
  // Returns the callbacks of its watchers, to be called without the lock: a concurrent Add either
  // sees the version as durable or is among those returned.
  std::vector<std::shared_ptr<Callback>> Durable(const std::string& job_id, int64_t version);
  // Records a durable version without notifying (a job loaded or just submitted).
  void SetDurable(const std::string& job_id, int64_t version);
  bool IsDurable(const std::string& job_id, int64_t version) const;
  // The job left memory: its durable version is forgotten (its watches stay until removed).
  void Forget(const std::string& job_id) { durable_.erase(job_id); }

 private:
  struct Watch {
    std::string job_id;
    std::shared_ptr<Callback> callback;
  };
  std::map<int64_t, Watch> by_handle_;
  std::map<std::string, std::set<int64_t>> by_job_;  // a job's handles: no scan of every watch
  std::map<std::string, int64_t> durable_;
  int64_t next_handle_ = 1;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_JOB_WATCHERS_H_
