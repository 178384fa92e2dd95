// PostgresServer in a build without libpq: none can be started, and the tests that need one skip.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "tests/testing/postgres_server.h"

namespace trainyard::testing {

absl::StatusOr<std::unique_ptr<PostgresServer>> PostgresServer::Start(
    const PostgresServerOptions& options) {
  return absl::FailedPreconditionError("this build has no PostgreSQL client library (libpq-dev)");
}

PostgresServer::~PostgresServer() = default;

std::string PostgresServer::Uri(const std::string& database) const { return ""; }

std::string PostgresServer::TcpUri(const std::string& database) const { return ""; }

absl::Status PostgresServer::CreateDatabase(const std::string& name) {
  return absl::FailedPreconditionError("no PostgreSQL");
}

absl::StatusOr<std::string> PostgresServer::Query(const std::string& database,
                                                  const std::string& sql) {
  return absl::FailedPreconditionError("no PostgreSQL");
}

absl::StatusOr<std::unique_ptr<PostgresSession>> PostgresSession::Connect(const std::string& uri) {
  return absl::FailedPreconditionError("no PostgreSQL");
}

PostgresSession::~PostgresSession() = default;

absl::StatusOr<std::string> PostgresSession::Exec(const std::string& sql) {
  return absl::FailedPreconditionError("no PostgreSQL");
}

std::string PostgresBinDir() { return ""; }

PostgresServer* SharedPostgresServer(std::string* why) {
  if (why != nullptr) *why = "this build has no PostgreSQL client library (libpq-dev)";
  return nullptr;
}

}  // namespace trainyard::testing
