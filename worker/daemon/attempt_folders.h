// AttemptFolders: what a worker's ended attempts leave on its disk, and when it goes. Each attempt
// of a job has a folder WORK_DIR/JOB/attempt-N (the worker's, mode 0711): its spec, each rank's
// log (rank-R.log) and, while a rank runs, its shepherd's socket (rank-R.sock); the ranks' "work"
// folder (the unpacked context, what they wrote) and "errors" folder (their error files) in it are
// their owner's, and so is its "tmp" folder under --private-tmp, whose namespaces are kept in
// the namespace folder (private_tmp.h).
// Once the attempt's ranks on the node have ended:
//  - its work, errors and tmp folders are emptied as their owner (the unpacker of job_context.h,
//    never with root's rights) and removed, on this object's own thread: a job that left a
//    million files delays no launch; its namespaces are unmounted (also with keep), which frees
//    its /dev/shm once its last process has gone;
//  - the whole folder goes once nothing in it changed for `keep_ended_for` (its logs: the
//    coordinator holds them; what stays is for the operator), and the job's folder with it when
//    nothing else is left there (a job's checkpoints there stay).
//
// Thread-safe; one thread of its own.
#ifndef TRAINYARD_WORKER_DAEMON_ATTEMPT_FOLDERS_H_
#define TRAINYARD_WORKER_DAEMON_ATTEMPT_FOLDERS_H_

#include <sys/stat.h>

#include <atomic>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/daemon/run_as.h"

namespace trainyard::worker {

// The account to empty a folder with status `st` as: its owner's (uid and group; no name, no
// other groups), or none when it is this process's own.
std::optional<UnixAccount> FolderOwner(const struct stat& st);

struct AttemptFolderOptions {
  std::string work_dir;
  // The unpacker (trainyard-worker) and its environment (ShepherdEnvironment): EmptyFolderAs.
  std::string unpacker = "/proc/self/exe";
  std::vector<std::string> unpacker_env;
  // True: nothing is removed (debugging, tests that read what a rank left) but the attempts'
  // namespaces.
  bool keep = false;
  // The worker's namespace folder (--private-tmp; private_tmp.h); empty: none.
  std::string namespaces;
  // How long an ended attempt's folder stays once nothing in it has changed; InfiniteDuration:
  // for good.
  absl::Duration keep_ended_for = absl::Hours(24);
  // How long one folder's emptying may take (the unpacker is killed then; the folder stays).
  absl::Duration empty_timeout = absl::Minutes(1);
};

class AttemptFolders {
 public:
  // `if_idle(job, attempt, then)`: when no rank of that attempt (attempt 0: of any attempt of
  // the job) runs or waits to start on this worker, runs `then` (when given) before anything can
  // start one, and returns true; else false. A live attempt's folder is never touched. Called
  // without this object's lock.
  using IfIdle = std::function<bool(const std::string& job_id, int attempt,
                                    const std::function<void()>& then)>;
  AttemptFolders(AttemptFolderOptions options, IfIdle if_idle);
  ~AttemptFolders();  // Stop()

  // Every rank of the attempt on this worker has ended: its work and errors folders are emptied
  // as `owner` (none: this process's own account) and removed, soon, on this object's thread,
  // unless by then a rank of it is here again (a shepherd's socket in its folder, or if_idle says
  // so: ranks a restarted worker is still adopting), whose own end queues it again.
  void Ended(const std::string& job_id, int attempt, std::optional<UnixAccount> owner);
  // Removes now the folders of ended attempts unchanged for keep_ended_for (the thread does so
  // every keep_ended_for / 4, between a second and ten minutes): those with no live rank and no
  // shepherd's socket, whose entries are files, and work and errors folders, which are emptied
  // as their owner first. Returns how many attempts' folders went. (The thread's scan lets an
  // attempt that ends meanwhile go first, between two folders, and goes on after it.)
  int RemoveExpired();
  // Waits until what Ended queued has been done (tests).
  void Drain();
  // Drops what is queued, and waits for the thread to end (a folder being emptied is finished, a
  // scan under way ends there); nothing is removed afterwards (a worker that detaches leaves its
  // ranks' folders to the next one). Idempotent.
  void Stop();

 private:
  struct Pending {
    std::string job_id;
    int attempt = 0;
    std::optional<UnixAccount> owner;
    bool namespaces_only = false;  // (keep: the folders stay)
  };
  // The attempt's namespaces (private_tmp.h), unmounted; a warning when they stay.
  void RemoveNamespaces(const std::string& job_id, int attempt);
  // Those of every attempt in the namespace folder that no rank here runs or waits to start.
  void RemoveIdleNamespaces();
  void Loop();
  // RemoveExpired's scan. `yield` (the thread's): stops after a folder emptied while an ended
  // attempt waits (`*cut`: it did), so that a scan that empties many does not hold up the
  // clean-up of the attempts that end meanwhile, their namespaces' memory included.
  int Scan(bool yield, bool* cut);
  // Empties `folder` as `owner` and removes it; false, with a warning, when it stays.
  bool EmptyAndRemove(const std::string& folder, const UnixAccount* owner);

  const AttemptFolderOptions options_;
  const IfIdle if_idle_;
  absl::Mutex scan_mu_;  // one scan at a time (the thread's and a caller's)
  absl::Mutex mu_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // an entry taken from pending_ is being done
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopping_{false};  // stop_, for a scan under way without the lock
  std::thread thread_;
};

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_ATTEMPT_FOLDERS_H_
