// A coordinator replica: one of several coordinators sharing a PostgreSQL store, of which one (the
// holder of the leader's lease, leader_lease.h) serves at a time.
//
// A replica that does not hold the lease stands by: it listens on its address and answers every
// call with UNAVAILABLE, the leader's address in the trailing metadata kLeaderMetadata
// (common/coordinator_endpoints.h), and NOT_SERVING to health checks; every poll_interval it tries
// to take the lease. Once it has, it starts the full coordinator on the same address, its store
// fenced by the lease's epoch, loads the state and the nodes' re-registrations rebuild the rest;
// it renews the lease every renew_interval from the moment it takes it (through a start that
// loads a large state for longer than the lease lasts). It steps down (stops serving and stands by
// again) when a renewal finds the lease passed on, when a write finds itself fenced, or when it has
// not renewed for as long as a lease lasts (a leader cut off from the database stops before its
// lease could have been taken over). On SIGTERM the leader shuts down and releases the lease, so
// that a standby takes over at its next poll.
//
// Called by main.cc for a PostgreSQL store.
#ifndef TRAINYARD_SERVER_COORDINATOR_REPLICA_H_
#define TRAINYARD_SERVER_COORDINATOR_REPLICA_H_

#include <functional>
#include <string>

#include "absl/time/time.h"
#include "server/coordinator/coordinator_server.h"

namespace trainyard::coordinator {

struct ReplicaOptions {
  std::string id;                 // in the lease row and logs; default HOST:STATE_DIR (absolute)
  std::string advertise_address;  // what clients dial to reach it; default the bound address
  absl::Duration lease_ttl = absl::Seconds(5);
  absl::Duration renew_interval = absl::Seconds(1);
  absl::Duration poll_interval = absl::Milliseconds(500);
};

// Runs the replica until SIGTERM or SIGINT (blocked by the caller). `on_listening` runs once, with
// the bound address and its web console's URL (empty: none), when the replica first listens.
// Returns the process's exit code: 0 after a signal, 1 when it cannot start (the reason logged
// and on stderr).
//
// With options.web_address, a standby answers every request there with a redirect to the leader's
// console (web::WebRedirect; the leader's URL is in the lease), and the leader serves the console
// there itself.
int RunReplica(CoordinatorOptions options, ReplicaOptions replica,
               const std::function<void(const std::string& address, const std::string& web_url)>&
                   on_listening);

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_REPLICA_H_
