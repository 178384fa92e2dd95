// A private PostgreSQL server for tests: initdb into a fresh temporary folder, then the server
// listening on a Unix socket in that folder only (no TCP port, so tests running side by side never
// collide), trust authentication, fsync on (crash tests rely on it). Run as the `postgres` account
// (or `nobody`) when the test runs as root, since PostgreSQL refuses to run as root. The server is
// killed if the test process dies (PR_SET_PDEATHSIG, set after the change of account).
// Not thread-safe: one test thread uses it.
#ifndef TRAINYARD_TESTS_TESTING_POSTGRES_SERVER_H_
#define TRAINYARD_TESTS_TESTING_POSTGRES_SERVER_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace trainyard::testing {

struct PostgresServerOptions {
  std::string netns;           // run in this network namespace (tests/testing/netns.h); "": ours
  std::string listen_address;  // also listen on TCP at this address (port 5432); "": socket only
  std::string trust_network;   // a CIDR whose TCP clients are trusted without a password
};

class PostgresServer {
 public:
  // Starts a server and waits until it accepts connections. FAILED_PRECONDITION naming what is
  // missing where PostgreSQL's server programs are not installed (the caller skips).
  static absl::StatusOr<std::unique_ptr<PostgresServer>> Start(
      const PostgresServerOptions& options = {});

  // Stops the server (fast shutdown, then SIGKILL) and removes its folder.
  ~PostgresServer();

  // A libpq URI for `database` on this server, as the superuser: over its Unix socket, or over
  // TCP at options.listen_address.
  std::string Uri(const std::string& database = "postgres") const;
  std::string TcpUri(const std::string& database) const;

  // Creates a new empty database (CREATE DATABASE).
  absl::Status CreateDatabase(const std::string& name);

  // Runs `sql` on `database`; the first column of the first row ("" if none).
  absl::StatusOr<std::string> Query(const std::string& database, const std::string& sql);

  // The server process (the postmaster).
  pid_t pid() const { return pid_; }

 private:
  PostgresServer(std::string dir, PostgresServerOptions options)
      : dir_(std::move(dir)), options_(std::move(options)) {}

  std::string dir_;  // holds data/ and the socket
  PostgresServerOptions options_;
  pid_t pid_ = -1;
};

// One connection, kept open between statements (a transaction across several Exec calls).
class PostgresSession {
 public:
  static absl::StatusOr<std::unique_ptr<PostgresSession>> Connect(const std::string& uri);
  ~PostgresSession();
  // Runs `sql`: the first column of the first row ("" if none).
  absl::StatusOr<std::string> Exec(const std::string& sql);

 private:
  explicit PostgresSession(void* conn) : conn_(conn) {}
  void* conn_;  // PGconn
};

// The folder of PostgreSQL's programs (initdb, postgres, pg_dump, pg_restore), the newest version
// installed; empty if none.
std::string PostgresBinDir();

// One server for the whole test process, started at the first call; nullptr (and `why` set) where
// none can be started.
PostgresServer* SharedPostgresServer(std::string* why);

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_POSTGRES_SERVER_H_
