// ContextStore: the coordinator's jobs' contexts (JobService.UploadContext, `yard submit
// --context DIR`), the user's folder as an archive (common/context_archive.h) kept in the job store
// (record kind "context", keyed by owner and digest, so one user's upload is never another's),
// beside a small "context_info" record of its size and expiry that a submit reads. A context
// expires a day after its upload unless a job names it; a job's submit extends it to the history
// retention (as long as the job's logs), so that it is removed with what it ran (the store's
// expired records are purged by JobHistory::PurgeExpired). Nodes fetch a job's through
// NodeService.FetchContext.
//
// Thread-safe (the store is); each call waits for the store: call from a handler or a thread of the
// coordinator's, never from a store callback.
#ifndef TRAINYARD_SERVER_COORDINATOR_CONTEXT_STORE_H_
#define TRAINYARD_SERVER_COORDINATOR_CONTEXT_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/coordinator/job_store.h"

namespace trainyard::coordinator {

struct ContextStoreOptions {
  // An upload that no job names is removed after this.
  absl::Duration unclaimed = absl::Hours(24);
  // A context a job names is kept this long after the latest submit that named it (the history
  // retention: JobHistoryOptions::retention).
  absl::Duration claimed = absl::Hours(24 * 30);
  // A user's contexts kept at once (those not expired), at most this many bytes together.
  int64_t max_bytes_per_user = int64_t{2} << 30;
};

class ContextStore {
 public:
  static constexpr char kRecordKind[] = "context";
  static constexpr char kInfoKind[] = "context_info";

  ContextStore(JobStore& store, const Clock& clock, ContextStoreOptions options)
      : store_(store), clock_(clock), options_(options) {}

  // Stores `archive` (whose digest the caller checked) for `owner`. Returns when it expires (Unix
  // ms). Storing what is stored already only extends it. RESOURCE_EXHAUSTED when the owner's
  // other contexts and this one would hold more than max_bytes_per_user.
  absl::StatusOr<int64_t> Put(const std::string& owner, const std::string& digest,
                              const std::string& archive);
  // A job of `owner`'s names `digest`: NOT_FOUND naming "context" unless `owner` uploaded it and it
  // has not expired. Keeps it for `claimed` from now (rewritten when less than half of that is
  // left).
  absl::Status Claim(const std::string& owner, const std::string& digest);
  // The archive `owner` uploaded as `digest`; NOT_FOUND when there is none (or it expired).
  absl::StatusOr<std::string> Read(const std::string& owner, const std::string& digest);
  // The same, shared by every caller that holds it: a job's nodes fetch its context together, and
  // get one copy in memory and one read of the store between them, not one each (an archive is
  // up to 80 MiB; 64 nodes would hold 5 GiB). A copy still held is returned without reading the
  // store again, until the context expires (as of that read).
  absl::StatusOr<std::shared_ptr<const std::string>> ReadShared(const std::string& owner,
                                                                const std::string& digest);

 private:
  static std::string Key(const std::string& owner, const std::string& digest);
  // Read, and when it expires (Unix ms).
  absl::StatusOr<std::string> Read(const std::string& owner, const std::string& digest,
                                   int64_t* expires_ms);
  absl::StatusOr<int64_t> Write(const std::string& owner, const std::string& digest,
                                const std::string& archive, int64_t expires_ms);

  JobStore& store_;
  const Clock& clock_;
  const ContextStoreOptions options_;
  absl::Mutex put_mu_;  // Put's sum and write, one upload at a time
  // Held while a shared copy is read, so that callers that come meanwhile wait for it.
  absl::Mutex shared_mu_;
  struct Shared {
    std::weak_ptr<const std::string> archive;
    int64_t expires_ms = 0;
  };
  std::map<std::string, Shared> shared_ ABSL_GUARDED_BY(shared_mu_);
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_CONTEXT_STORE_H_
