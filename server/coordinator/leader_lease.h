// Leadership among coordinators that share one PostgreSQL database: a lease row with an expiry
// and an epoch that grows by one at every change of leader.
//
// The lease is the one row of table trainyard_leader (epoch, holder, address, expires_at,
// web_url). Its
// expiry is on the database server's clock, so the coordinators' clocks never matter. A replica
// takes the lease only when it is free or expired, and then with the next epoch; the leader
// extends it well before it expires. Every write transaction of a store opened with
// PostgresJobStoreOptions::fence_epoch ends with one message that the server runs as a whole,
// `SELECT trainyard_fence(epoch); COMMIT`: the fence locks the row FOR SHARE and fails unless the
// epoch is still its own and the lease unexpired, so a leader that was paused, partitioned or
// overtaken never commits after its lease, and holds the row only while the server commits (a
// takeover, which waits at most lock_timeout for the row, is never held up by a stalled leader).
// A leader's write session also has idle_in_transaction_session_timeout shorter than its lease:
// the server ends a transaction that a paused leader left open, with its row locks, before a
// standby can take over.
//
// Used by the coordinator's main (take the lease, stand by, renew) and by the store tests.
#ifndef TRAINYARD_SERVER_COORDINATOR_LEADER_LEASE_H_
#define TRAINYARD_SERVER_COORDINATOR_LEADER_LEASE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainyard::coordinator {

struct LeaseHolder {
  int64_t epoch = 0;    // 0: no leader has ever held it
  std::string holder;   // the replica's id
  std::string address;  // where clients reach it (gRPC HOST:PORT)
  std::string web_url;  // its web console (http(s)://HOST:PORT); empty: none
  bool expired = true;  // on the database's clock
};

// Not thread-safe: one thread (the coordinator's lease loop) uses it.
class LeaderLease {
 public:
  virtual ~LeaderLease() = default;

  // Takes the lease for `ttl` if it is free, expired, or held by this same replica id (a restart in
  // place: the earlier process is gone, as one state directory has one coordinator): the new
  // epoch, which fences anything the earlier holder might still write. NOT_FOUND (with no change)
  // while another replica holds it; UNAVAILABLE when the database cannot be reached.
  virtual absl::StatusOr<int64_t> TryAcquire(absl::Duration ttl) = 0;
  // Extends the lease held at `epoch` to `ttl` from now. FAILED_PRECONDITION when it is no longer
  // this epoch's (it expired and another replica took it); UNAVAILABLE when the database cannot be
  // reached (the caller steps down if that lasts until its lease would end).
  virtual absl::Status Renew(int64_t epoch, absl::Duration ttl) = 0;
  // Ends the lease held at `epoch` now, so that a standby takes over without waiting for it to
  // expire (a clean shutdown). Not an error when it is no longer held.
  virtual absl::Status Release(int64_t epoch) = 0;
  // Who holds (or last held) the lease.
  virtual absl::StatusOr<LeaseHolder> Current() = 0;
};

// The lease in the PostgreSQL database `uri` (whose schema OpenPostgresJobStore made), for the
// replica `holder` reachable at `address`, its web console (if any) at `web_url`. UNIMPLEMENTED
// in a build without libpq.
absl::StatusOr<std::unique_ptr<LeaderLease>> OpenLeaderLease(const std::string& uri,
                                                             const std::string& holder,
                                                             const std::string& address,
                                                             const std::string& web_url = "");

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_LEADER_LEASE_H_
