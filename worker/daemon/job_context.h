// The worker's side of a job's context (`yard submit --context DIR`, common/context_archive.h):
// ContextCache keeps the archives this node fetched from the coordinator
// (NodeService.FetchContext), each checked against its digest whenever used; UnpackContextAs
// unpacks one into an attempt's working folder as the job's owner, through this worker's binary run
// with kUnpackContextFlag, so that nothing the archive holds is written with the worker's (root's)
// rights.
#ifndef TRAINYARD_WORKER_DAEMON_JOB_CONTEXT_H_
#define TRAINYARD_WORKER_DAEMON_JOB_CONTEXT_H_

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/daemon/run_as.h"

namespace trainyard::worker {

// The first argument that makes trainyard-worker a context unpacker:
//   trainyard-worker --unpack-context dest=DIR [uid=U gid=G groups=G1,G2] [empty_only=1]
// with the archive on standard input. It switches to the account first (when given), empties DIR
// (what an earlier unpack left), then unpacks into it (with empty_only, reads and unpacks
// nothing); exit 0, or 1 with the reason on standard error.
inline constexpr char kUnpackContextFlag[] = "--unpack-context";
int RunUnpackContext(int argc, char** argv);

// Writes all of `text` to `fd` (the worker's descriptors: memfds, cached archives); false (errno
// set) on failure.
bool WriteAll(int fd, const std::string& text);

// Thread-safe: one fetch at a time (the supervisor's thread calls it).
class ContextCache {
 public:
  // The archive of job `job_id`'s context, from the coordinator.
  using Fetch = std::function<absl::StatusOr<std::string>(const std::string& job_id)>;

  // Archives live in `dir` (made mode 0700) as <hex digest>.tar.gz; one not used for `keep` is
  // removed when another is fetched.
  ContextCache(std::string dir, Fetch fetch, absl::Duration keep = absl::Hours(24 * 7));

  // The archive named `digest` (job `job_id`'s): the cached copy when its bytes still have that
  // digest, else fetched (and cached). FAILED_PRECONDITION when what arrives has another digest.
  absl::StatusOr<std::string> Get(const std::string& job_id, const std::string& digest);

  const std::string& dir() const { return dir_; }

 private:
  void RemoveUnused() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string dir_;
  const Fetch fetch_;
  const absl::Duration keep_;
  absl::Mutex mu_;
};

// Unpacks `archive` into the existing folder `dest` as `account` (null: this process's own) by
// running `unpacker` (trainyard-worker) with kUnpackContextFlag, its environment `env`. The
// unpacker's error (the archive's fault or the folder's) on failure; DEADLINE_EXCEEDED, the
// unpacker killed, when it has not finished within `timeout` (the owner may stop it: it runs as
// them).
absl::Status UnpackContextAs(const std::string& unpacker, const std::vector<std::string>& env,
                             const std::string& archive, const std::string& dest,
                             const UnixAccount* account, absl::Duration timeout = absl::Minutes(5));

// Empties the existing folder `dest` as `account` (null: this process's own) the same way (the
// unpacker with empty_only): what a user's processes made there is removed with the user's rights
// only, so that no link they plant leads a process of root's elsewhere.
absl::Status EmptyFolderAs(const std::string& unpacker, const std::vector<std::string>& env,
                           const std::string& dest, const UnixAccount* account,
                           absl::Duration timeout = absl::Minutes(5));

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_JOB_CONTEXT_H_
