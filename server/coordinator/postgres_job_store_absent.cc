// OpenPostgresJobStore in a build without libpq (CMake found no PostgreSQL client library): it
// says so, and the coordinator keeps its SQLite store.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/coordinator/job_store.h"

namespace trainyard::coordinator {

std::string DescribePostgresLocation(const std::string& uri) { return "(a PostgreSQL database)"; }

absl::StatusOr<std::unique_ptr<JobStore>> OpenPostgresJobStore(
    const std::string& uri, const PostgresJobStoreOptions& options) {
  return absl::UnimplementedError(
      "store: this build has no PostgreSQL client library; install libpq-dev and build again");
}

}  // namespace trainyard::coordinator
