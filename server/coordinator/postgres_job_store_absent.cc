// OpenPostgresJobStore in a build without libpq (CMake found no PostgreSQL client library): it
// says so, and the coordinator keeps its SQLite store.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/leader_lease.h"

namespace trainyard::coordinator {

std::string DescribePostgresLocation(const std::string& uri) { return "(a PostgreSQL database)"; }

absl::StatusOr<std::unique_ptr<JobStore>> OpenPostgresJobStore(
    const std::string& uri, const PostgresJobStoreOptions& options) {
  return absl::UnimplementedError(
      "store: this build has no PostgreSQL client library; install libpq-dev and build again");
}

absl::StatusOr<std::unique_ptr<LeaderLease>> OpenLeaderLease(const std::string& uri,
                                                             const std::string& holder,
                                                             const std::string& address,
                                                             const std::string& web_url) {
  return absl::UnimplementedError("this build has no PostgreSQL client library");
}

}  // namespace trainyard::coordinator
