#include "tests/testing/postgres_server.h"

#include <fcntl.h>
#include <grp.h>
#include <libpq-fe.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace trainyard::testing {
namespace {

// The folder of PostgreSQL's server programs (initdb, postgres): the newest version installed.
std::string ServerBinDir() {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/usr/lib/postgresql", ec)) {
    const std::string bin = entry.path().string() + "/bin";
    if (::access((bin + "/initdb").c_str(), X_OK) == 0 &&
        ::access((bin + "/postgres").c_str(), X_OK) == 0) {
      found.push_back(bin);
    }
  }
  if (found.empty()) return "";
  std::sort(found.begin(), found.end(), [](const std::string& a, const std::string& b) {
    return std::strtol(std::filesystem::path(a).parent_path().filename().c_str(), nullptr, 10) <
           std::strtol(std::filesystem::path(b).parent_path().filename().c_str(), nullptr, 10);
  });
  return found.back();
}

struct Account {
  bool change = false;  // only when running as root
  uid_t uid = 0;
  gid_t gid = 0;
};

Account ServerAccount() {
  Account account;
  if (::geteuid() != 0) return account;
  for (const char* name : {"postgres", "nobody"}) {
    if (const passwd* pw = ::getpwnam(name); pw != nullptr) {
      account.change = true;
      account.uid = pw->pw_uid;
      account.gid = pw->pw_gid;
      return account;
    }
  }
  return account;
}

// Starts argv as `account`, its stdout and stderr appended to `log`, in a process group of its
// own, killed when this process dies. Returns the pid, or -1.
pid_t Spawn(const std::vector<std::string>& argv, const Account& account, const std::string& log,
            const std::string& netns = "") {
  const pid_t parent = ::getpid();
  const std::string netns_path = netns.empty() ? "" : "/var/run/netns/" + netns;
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  // Child: only async-signal-safe calls until exec.
  ::setpgid(0, 0);
  if (!netns_path.empty()) {  // (as root, before the change of account)
    const int ns = ::open(netns_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) ::_exit(124);
  }
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
  }
  if (account.change) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(account.gid) != 0 || ::setuid(account.uid) != 0) {
      ::_exit(126);
    }
  }
  // (After the change of account, which clears it.)
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(125);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  ::execv(args[0], args.data());
  ::_exit(127);
}

// Waits up to `timeout` for `pid`; its status, or -1 on timeout.
int WaitFor(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) return status;
    if (done < 0 && errno != EINTR) return 0;
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string Tail(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string all = text.str();
  return all.size() > 2000 ? all.substr(all.size() - 2000) : all;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PostgresServer>> PostgresServer::Start(
    const PostgresServerOptions& options) {
  const std::string bin = ServerBinDir();
  if (bin.empty()) {
    return absl::FailedPreconditionError(
        "no PostgreSQL server programs in /usr/lib/postgresql/*/bin (apt-get install postgresql)");
  }
  const Account account = ServerAccount();
  const char* base = ::getenv("TMPDIR");
  std::string templ = absl::StrCat(base != nullptr ? base : "/tmp", "/trainyard-pg-XXXXXX");
  if (::mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  std::unique_ptr<PostgresServer> server(new PostgresServer(templ, options));
  if (account.change && ::chown(templ.c_str(), account.uid, account.gid) != 0) {
    return absl::InternalError(absl::StrCat("chown ", templ, ": ", std::strerror(errno)));
  }
  const std::string log = templ + "/server.log";
  const pid_t initdb = Spawn({bin + "/initdb", "-D", templ + "/data", "--auth=trust", "-U",
                              "postgres", "-E", "UTF8", "--locale=C", "--no-instructions"},
                             account, log);
  if (initdb < 0 || WaitFor(initdb, absl::Seconds(120)) != 0) {
    return absl::InternalError(absl::StrCat("initdb failed: ", Tail(log)));
  }
  if (!options.trust_network.empty()) {
    std::ofstream(templ + "/data/pg_hba.conf", std::ios::app)
        << "host all all " << options.trust_network << " trust\n";
  }
  server->pid_ = Spawn({bin + "/postgres", "-D", templ + "/data", "-k", templ, "-c",
                        "listen_addresses=" + options.listen_address, "-c", "max_connections=200",
                        "-c", "shared_buffers=32MB"},
                       account, log, options.netns);
  if (server->pid_ < 0) return absl::InternalError("cannot fork the PostgreSQL server");
  const std::string uri = server->Uri();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (PQping(uri.c_str()) != PQPING_OK) {
    int status = 0;
    if (::waitpid(server->pid_, &status, WNOHANG) == server->pid_) {
      server->pid_ = -1;
      return absl::InternalError(absl::StrCat("the PostgreSQL server exited: ", Tail(log)));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the PostgreSQL server did not accept connections in 60 s: ", Tail(log)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return server;
}

PostgresServer::~PostgresServer() {
  if (pid_ > 0) {
    ::kill(pid_, SIGINT);  // fast shutdown
    if (WaitFor(pid_, absl::Seconds(20)) == -1) {
      ::kill(-pid_, SIGKILL);
      WaitFor(pid_, absl::Seconds(20));
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string PostgresServer::Uri(const std::string& database) const {
  return absl::StrCat("postgresql:///", database, "?host=", dir_, "&user=postgres");
}

std::string PostgresServer::TcpUri(const std::string& database) const {
  return absl::StrCat("postgresql://postgres@", options_.listen_address, ":5432/", database);
}

absl::StatusOr<std::string> PostgresServer::Query(const std::string& database,
                                                  const std::string& sql) {
  auto session = PostgresSession::Connect(Uri(database));
  if (!session.ok()) return session.status();
  return (*session)->Exec(sql);
}

absl::StatusOr<std::unique_ptr<PostgresSession>> PostgresSession::Connect(const std::string& uri) {
  PGconn* conn = PQconnectdb(uri.c_str());
  if (PQstatus(conn) != CONNECTION_OK) {
    absl::Status status = absl::UnavailableError(PQerrorMessage(conn));
    PQfinish(conn);
    return status;
  }
  PQsetNoticeProcessor(
      conn, [](void*, const char*) {}, nullptr);
  return std::unique_ptr<PostgresSession>(new PostgresSession(conn));
}

PostgresSession::~PostgresSession() { PQfinish(static_cast<PGconn*>(conn_)); }

absl::StatusOr<std::string> PostgresSession::Exec(const std::string& sql) {
  PGresult* result = PQexec(static_cast<PGconn*>(conn_), sql.c_str());
  absl::StatusOr<std::string> value;
  const ExecStatusType status = PQresultStatus(result);
  if (status == PGRES_TUPLES_OK) {
    value = PQntuples(result) > 0 ? std::string(PQgetvalue(result, 0, 0)) : std::string();
  } else if (status == PGRES_COMMAND_OK) {
    value = std::string();
  } else {
    value = absl::InternalError(absl::StrCat(sql, ": ", PQresultErrorMessage(result)));
  }
  PQclear(result);
  return value;
}

absl::Status PostgresServer::CreateDatabase(const std::string& name) {
  return Query("postgres", absl::StrCat("CREATE DATABASE \"", name, "\"")).status();
}

std::string PostgresBinDir() { return ServerBinDir(); }

PostgresServer* SharedPostgresServer(std::string* why) {
  static absl::StatusOr<std::unique_ptr<PostgresServer>>* server =
      new absl::StatusOr<std::unique_ptr<PostgresServer>>(PostgresServer::Start());
  // Stopped at exit, so that no server outlives the test binary.
  static const bool registered = [] {
    std::atexit([] {
      if (server->ok()) server->value().reset();
    });
    return true;
  }();
  (void)registered;
  if (!server->ok()) {
    if (why != nullptr) *why = server->status().ToString();
    return nullptr;
  }
  return server->value().get();
}

}  // namespace trainyard::testing
