// The PostgreSQL JobStore backend (OpenPostgresJobStore, declared in job_store.h): the
// coordinator's durable record of jobs and nodes in a database that several coordinators (a leader
// and its standbys) and the operator's backups share.
//
// Called by the coordinator's JobManager (writes, and loads at startup) and by the shared store
// tests. Owns two libpq connections: a write connection used only by the commit thread, and a read
// connection for loads and reads. Owns the commit thread, which drains the queue of batches and
// writes them with group commit (many batches, one transaction, one WAL flush on the server).
//
// Parameters go in text form, except payloads (bytea, binary); results come back in binary form,
// so that a bytea is its bytes and a bigint eight big-endian bytes.
#include <endian.h>
#include <libpq-fe.h>
#include <pthread.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "server/coordinator/group_committer.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/leader_lease.h"

namespace trainyard::coordinator {
namespace {

// Schema migrations, in order: kMigrations[i] takes the database from version i to i + 1 (the
// version is the one row of trainyard_schema). Append only; never edit a migration that has
// shipped. Version 1 is the SQLite store's version 3, in PostgreSQL's types.
constexpr const char* kMigrations[] = {
    // Version 1.
    "CREATE TABLE jobs ("
    "  id TEXT PRIMARY KEY,"
    "  seq BIGINT NOT NULL UNIQUE,"
    "  owner TEXT NOT NULL,"
    "  state TEXT NOT NULL,"
    "  payload BYTEA NOT NULL);"
    "CREATE INDEX jobs_owner_seq ON jobs(owner, seq);"
    "CREATE INDEX jobs_state ON jobs(state);"
    "CREATE TABLE nodes ("
    "  id TEXT PRIMARY KEY,"
    "  payload BYTEA NOT NULL);"
    "CREATE TABLE records ("
    "  kind TEXT NOT NULL,"
    "  id TEXT NOT NULL,"
    "  payload BYTEA NOT NULL,"
    "  expires_ms BIGINT NOT NULL DEFAULT 0,"
    "  PRIMARY KEY (kind, id));"
    "CREATE INDEX records_expiry ON records(expires_ms) WHERE expires_ms > 0;",
    // Version 2: the leader's lease (leader_lease.h), one row, free at first.
    "CREATE TABLE trainyard_leader ("
    "  id INTEGER PRIMARY KEY CHECK (id = 1),"
    "  epoch BIGINT NOT NULL,"
    "  holder TEXT NOT NULL,"
    "  address TEXT NOT NULL,"
    "  expires_at TIMESTAMPTZ NOT NULL);"
    "INSERT INTO trainyard_leader VALUES (1, 0, '', '', '-infinity');",
    // Version 3: the fence of a leader's write transaction (leader_lease.h), run in the message
    // that commits it: the lease row locked FOR SHARE only from here to the end of the commit, on
    // the server, whatever the coordinator does meanwhile; SQLSTATE TYF01 when the lease has ended
    // or passed on.
    "CREATE OR REPLACE FUNCTION trainyard_fence(held BIGINT) RETURNS VOID LANGUAGE plpgsql AS $$ "
    "BEGIN "
    "  PERFORM 1 FROM trainyard_leader WHERE id = 1 AND epoch = held "
    "    AND expires_at > clock_timestamp() FOR SHARE; "
    "  IF NOT FOUND THEN "
    "    RAISE EXCEPTION 'the leader''s lease of epoch % has ended or passed on', held "
    "      USING ERRCODE = 'TYF01'; "
    "  END IF; "
    "END $$;",
    // Version 4: the leader's web console (a standby sends browsers there); '' for none.
    "ALTER TABLE trainyard_leader ADD COLUMN web_url TEXT NOT NULL DEFAULT '';",
};
constexpr int kSchemaVersion = sizeof(kMigrations) / sizeof(kMigrations[0]);

// The advisory lock key that serializes migrations between coordinators opening one database.
constexpr int64_t kMigrationLock = 0x7472'6169'6e79'6172;  // "trainyar"

struct ConnCloser {
  void operator()(PGconn* conn) const { PQfinish(conn); }
};
using ConnPtr = std::unique_ptr<PGconn, ConnCloser>;

struct ResultClearer {
  void operator()(PGresult* result) const { PQclear(result); }
};
using ResultPtr = std::unique_ptr<PGresult, ResultClearer>;

// trainyard_fence's SQLSTATE: the lease is no longer the transaction's.
constexpr char kFencedState[] = "TYF01";

// The status for a failed result (or a connection that failed before one), by SQLSTATE class.
absl::Status PostgresError(PGconn* conn, const PGresult* result, const std::string& context) {
  const char* state = result != nullptr ? PQresultErrorField(result, PG_DIAG_SQLSTATE) : nullptr;
  std::string message = result != nullptr ? PQresultErrorMessage(result)
                                          : (conn != nullptr ? PQerrorMessage(conn) : "");
  if (message.empty() && conn != nullptr) message = PQerrorMessage(conn);
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
  absl::StatusCode code = absl::StatusCode::kInternal;
  const std::string sqlstate = state != nullptr ? state : "";
  if (conn == nullptr || PQstatus(conn) != CONNECTION_OK) {
    code = absl::StatusCode::kUnavailable;
  } else if (sqlstate == "23505") {
    code = absl::StatusCode::kAlreadyExists;  // unique_violation
  } else if (absl::StartsWith(sqlstate, "23") || absl::StartsWith(sqlstate, "22")) {
    code = absl::StatusCode::kInvalidArgument;  // integrity constraint, data exception
  } else if (sqlstate == kFencedState) {
    code = absl::StatusCode::kFailedPrecondition;
  } else if (sqlstate == "40001" || sqlstate == "40P01") {
    code = absl::StatusCode::kAborted;  // serialization failure, deadlock
  } else if (absl::StartsWith(sqlstate, "08") || absl::StartsWith(sqlstate, "53") ||
             absl::StartsWith(sqlstate, "57") || sqlstate == "25006" || sqlstate == "55P03") {
    // connection, insufficient resources, operator intervention (a statement timeout too),
    // read-only transaction (a standby server), a lock not taken within lock_timeout
    code = absl::StatusCode::kUnavailable;
  } else if (absl::StartsWith(sqlstate, "28") || absl::StartsWith(sqlstate, "42501")) {
    code = absl::StatusCode::kPermissionDenied;
  }
  return absl::Status(
      code, absl::StrCat(context, ": ", message,
                         sqlstate.empty() ? "" : absl::StrCat(" (SQLSTATE ", sqlstate, ")")));
}

// Runs `sql` (no parameters; several statements allowed) and checks that it succeeded.
absl::Status Exec(PGconn* conn, const std::string& sql, const std::string& context) {
  ResultPtr result(PQexec(conn, sql.c_str()));
  const ExecStatusType status = PQresultStatus(result.get());
  if (result == nullptr || (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK)) {
    return PostgresError(conn, result.get(), context);
  }
  return absl::OkStatus();
}

// The parameters of one statement: text values, or binary ones for payloads. The values point into
// strings that must outlive the call.
class Params {
 public:
  Params& Text(const std::string& value) {
    values_.push_back(value.data());
    lengths_.push_back(static_cast<int>(value.size()));
    formats_.push_back(0);
    return *this;
  }
  Params& Int(int64_t value) {
    ints_.push_back(std::make_unique<std::string>(absl::StrCat(value)));
    return Text(*ints_.back());
  }
  Params& Bytes(const std::string& value) {
    // (A zero-length binary value needs a non-null pointer: null means SQL NULL.)
    values_.push_back(value.empty() ? "" : value.data());
    lengths_.push_back(static_cast<int>(value.size()));
    formats_.push_back(1);
    return *this;
  }
  int size() const { return static_cast<int>(values_.size()); }
  const char* const* values() const { return values_.data(); }
  const int* lengths() const { return lengths_.data(); }
  const int* formats() const { return formats_.data(); }

 private:
  std::vector<const char*> values_;
  std::vector<int> lengths_;
  std::vector<int> formats_;
  std::vector<std::unique_ptr<std::string>> ints_;
};

// The bytes of a column of a binary-format result.
std::string Bytes(const PGresult* result, int row, int column) {
  return std::string(PQgetvalue(result, row, column),
                     static_cast<size_t>(PQgetlength(result, row, column)));
}

// A bigint column of a binary-format result.
int64_t Int64(const PGresult* result, int row, int column) {
  uint64_t network = 0;
  if (PQgetlength(result, row, column) != sizeof(network)) return 0;
  std::memcpy(&network, PQgetvalue(result, row, column), sizeof(network));
  return static_cast<int64_t>(be64toh(network));
}

// One named statement: its SQL, prepared on each connection (again after a reconnect).
struct Statement {
  const char* name;
  const char* sql;
};

constexpr Statement kPutJob = {
    "put_job",
    // Not a delete and insert: a seq held by another job fails the statement (and the batch).
    "INSERT INTO jobs(id, seq, owner, state, payload) VALUES($1, $2, $3, $4, $5) "
    "ON CONFLICT(id) DO UPDATE SET seq = excluded.seq, owner = excluded.owner, "
    "state = excluded.state, payload = excluded.payload"};
constexpr Statement kPutNode = {"put_node",
                                "INSERT INTO nodes(id, payload) VALUES($1, $2) "
                                "ON CONFLICT(id) DO UPDATE SET payload = excluded.payload"};
constexpr Statement kDeleteNode = {"delete_node", "DELETE FROM nodes WHERE id = $1"};
constexpr Statement kPutRecord = {
    "put_record",
    "INSERT INTO records(kind, id, payload, expires_ms) VALUES($1, $2, $3, $4) "
    "ON CONFLICT(kind, id) DO UPDATE SET payload = excluded.payload, "
    "expires_ms = excluded.expires_ms"};
constexpr Statement kDeleteRecord = {"delete_record",
                                     "DELETE FROM records WHERE kind = $1 AND id = $2"};
constexpr Statement kDeleteExpired = {
    "delete_expired", "DELETE FROM records WHERE expires_ms > 0 AND expires_ms <= $1"};
constexpr Statement kWriteStatements[] = {kPutJob,    kPutNode,      kDeleteNode,
                                          kPutRecord, kDeleteRecord, kDeleteExpired};

constexpr Statement kSelectJobs = {"select_jobs",
                                   "SELECT id, seq, owner, state, payload FROM jobs ORDER BY seq"};
constexpr Statement kSelectNodes = {"select_nodes",
                                    "SELECT id, payload FROM nodes ORDER BY id COLLATE \"C\""};
constexpr Statement kSelectRecords = {
    "select_records",
    "SELECT id, payload, expires_ms FROM records WHERE kind = $1 ORDER BY id COLLATE \"C\""};
constexpr Statement kSelectJob = {"select_job",
                                  "SELECT id, seq, owner, state, payload FROM jobs WHERE id = $1"};
constexpr Statement kSelectRecord = {
    "select_record", "SELECT payload, expires_ms FROM records WHERE kind = $1 AND id = $2"};
// $2 is ",STATE,STATE," or empty for any state.
constexpr Statement kListJobs = {
    "list_jobs",
    "SELECT id, seq, owner, state, payload FROM jobs WHERE seq < $1 "
    "AND ($2 = '' OR strpos($2, ',' || state || ',') > 0) ORDER BY seq DESC LIMIT $3"};
constexpr Statement kListOwnerJobs = {
    "list_owner_jobs",
    "SELECT id, seq, owner, state, payload FROM jobs WHERE owner = $4 AND seq < $1 "
    "AND ($2 = '' OR strpos($2, ',' || state || ',') > 0) ORDER BY seq DESC LIMIT $3"};
constexpr Statement kReadStatements[] = {kSelectJobs,   kSelectNodes, kSelectRecords, kSelectJob,
                                         kSelectRecord, kListJobs,    kListOwnerJobs};

// One libpq connection and the statements prepared on it; reconnects when the server went away.
// Not thread-safe: the store uses each one from one thread at a time.
// How long a connection waits for the server: to connect, and for sent data to be acknowledged
// (TCP_USER_TIMEOUT; a server cut off by the network then fails calls instead of hanging them for
// the kernel's minutes). Settings in the URI win.
struct Timeouts {
  const char* connect_seconds = "10";
  const char* tcp_user_timeout_ms = "10000";
};

class Connection {
 public:
  // `settings`: SET statements for the session, run after the common ones.
  Connection(std::string uri, std::vector<Statement> statements, Timeouts timeouts = {},
             std::string settings = "")
      : uri_(std::move(uri)),
        statements_(std::move(statements)),
        timeouts_(timeouts),
        settings_(std::move(settings)) {}

  // Connects (again) if not connected, then sets the session up and prepares the statements.
  absl::Status Ensure() {
    if (conn_ != nullptr && PQstatus(conn_.get()) == CONNECTION_OK) return absl::OkStatus();
    // These first, so that the URI's own settings win.
    const char* keywords[] = {
        "application_name",    "connect_timeout",  "tcp_user_timeout", "keepalives_idle",
        "keepalives_interval", "keepalives_count", "dbname",           nullptr};
    const char* values[] = {"trainyard-coordinator",
                            timeouts_.connect_seconds,
                            timeouts_.tcp_user_timeout_ms,
                            "5",
                            "2",
                            "3",
                            uri_.c_str(),
                            nullptr};
    conn_.reset(PQconnectdbParams(keywords, values, /*expand_dbname=*/1));
    if (conn_ == nullptr || PQstatus(conn_.get()) != CONNECTION_OK) {
      absl::Status status = absl::UnavailableError(absl::StrCat(
          "cannot connect to the job store database ", DescribePostgresLocation(uri_), ": ",
          absl::StripTrailingAsciiWhitespace(conn_ != nullptr ? PQerrorMessage(conn_.get())
                                                              : "out of memory")));
      conn_.reset();
      return status;
    }
    // Notices (e.g. "relation already exists, skipping") are not the coordinator's errors.
    PQsetNoticeProcessor(
        conn_.get(), [](void*, const char*) {}, nullptr);
    absl::Status status = Exec(conn_.get(),
                               "SET synchronous_commit = on; SET client_min_messages = warning; "
                               "SET default_transaction_isolation = 'read committed'; " +
                                   settings_,
                               "set up the session");
    if (status.ok()) status = PrepareAll();
    if (!status.ok()) conn_.reset();
    return status;
  }

  // Prepares the statements (after the schema exists).
  absl::Status PrepareAll() {
    for (const Statement& statement : statements_) {
      ResultPtr result(PQprepare(conn_.get(), statement.name, statement.sql, 0, nullptr));
      if (PQresultStatus(result.get()) != PGRES_COMMAND_OK) {
        return PostgresError(conn_.get(), result.get(), absl::StrCat("prepare ", statement.sql));
      }
    }
    return absl::OkStatus();
  }

  // Runs prepared statement `statement` with `params`; the result in binary form.
  absl::StatusOr<ResultPtr> Run(const Statement& statement, const Params& params,
                                const std::string& context) {
    ResultPtr result(PQexecPrepared(conn_.get(), statement.name, params.size(), params.values(),
                                    params.lengths(), params.formats(), /*resultFormat=*/1));
    const ExecStatusType status = PQresultStatus(result.get());
    if (result == nullptr || (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK)) {
      return PostgresError(conn_.get(), result.get(), context);
    }
    return result;
  }

  PGconn* get() const { return conn_.get(); }
  void Drop() { conn_.reset(); }

 private:
  const std::string uri_;
  const std::vector<Statement> statements_;
  const Timeouts timeouts_;
  const std::string settings_;
  ConnPtr conn_;
};

// Brings the schema up to kSchemaVersion, in one transaction, under an advisory lock.
absl::Status Migrate(PGconn* conn, const std::string& where) {
  RETURN_IF_ERROR(Exec(conn, "BEGIN", "begin the migration"));
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(Exec(conn, absl::StrCat("SELECT pg_advisory_xact_lock(", kMigrationLock, ")"),
                         "lock the schema"));
    RETURN_IF_ERROR(Exec(conn,
                         "CREATE TABLE IF NOT EXISTS trainyard_schema (version INTEGER NOT NULL); "
                         "INSERT INTO trainyard_schema SELECT 0 "
                         "WHERE NOT EXISTS (SELECT 1 FROM trainyard_schema)",
                         "create the schema version table"));
    ResultPtr result(PQexec(conn, "SELECT version FROM trainyard_schema"));
    if (PQresultStatus(result.get()) != PGRES_TUPLES_OK || PQntuples(result.get()) != 1) {
      return PostgresError(conn, result.get(), "read the schema version");
    }
    const int64_t version = std::strtoll(PQgetvalue(result.get(), 0, 0), nullptr, 10);
    if (version > kSchemaVersion) {
      return absl::FailedPreconditionError(
          absl::StrCat("job store database ", where, " has schema version ", version,
                       ", newer than the latest version this build knows (", kSchemaVersion, ")"));
    }
    for (int64_t v = version; v < kSchemaVersion; ++v) {
      RETURN_IF_ERROR(Exec(conn, kMigrations[v], absl::StrCat("migrate to version ", v + 1)));
    }
    if (version < kSchemaVersion) {
      RETURN_IF_ERROR(Exec(conn,
                           absl::StrCat("UPDATE trainyard_schema SET version = ", kSchemaVersion),
                           "record the schema version"));
    }
    return Exec(conn, "COMMIT", "commit the migration");
  }();
  if (!status.ok()) Exec(conn, "ROLLBACK", "roll back the migration").IgnoreError();
  return status;
}

// Commit() and Stats() may be called from any thread; writes run only on the commit thread, which
// also runs the callbacks; reads may be called from any thread (one at a time on the read
// connection), including from a callback.
class PostgresJobStore final : public JobStore {
 public:
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& uri,
                                                        const PostgresJobStoreOptions& options) {
    std::unique_ptr<PostgresJobStore> store(new PostgresJobStore(uri, options));
    {
      // The schema first, then the statements that use it.
      Connection setup(uri, {});
      RETURN_IF_ERROR(setup.Ensure());
      RETURN_IF_ERROR(Migrate(setup.get(), DescribePostgresLocation(uri)));
    }
    RETURN_IF_ERROR(store->write_.Ensure());
    {
      absl::MutexLock lock(&store->read_mu_);
      RETURN_IF_ERROR(store->read_.Ensure());
    }
    store->committer_.Start();
    return store;
  }

  // Writes every queued batch and runs its callback, then closes the connections.
  ~PostgresJobStore() override { committer_.Stop(); }

  void Commit(WriteBatch batch, DoneCallback done) override {
    committer_.Commit(std::move(batch), std::move(done));
  }

  absl::Status Backup(const std::string& path) override {
    return absl::FailedPreconditionError(
        "the coordinator's state is in PostgreSQL: back it up with pg_dump (docs/operations.md)");
  }

  absl::StatusOr<std::vector<StoredJob>> LoadJobs() override {
    absl::MutexLock lock(&read_mu_);
    ASSIGN_OR_RETURN(ResultPtr result, Read(kSelectJobs, Params(), "load jobs"));
    std::vector<StoredJob> jobs;
    for (int row = 0; row < PQntuples(result.get()); ++row)
      jobs.push_back(JobAt(result.get(), row));
    return jobs;
  }

  absl::StatusOr<std::vector<StoredNode>> LoadNodes() override {
    absl::MutexLock lock(&read_mu_);
    ASSIGN_OR_RETURN(ResultPtr result, Read(kSelectNodes, Params(), "load nodes"));
    std::vector<StoredNode> nodes;
    for (int row = 0; row < PQntuples(result.get()); ++row) {
      nodes.push_back({Bytes(result.get(), row, 0), Bytes(result.get(), row, 1)});
    }
    return nodes;
  }

  absl::StatusOr<std::vector<StoredRecord>> LoadRecords(const std::string& kind) override {
    absl::MutexLock lock(&read_mu_);
    ASSIGN_OR_RETURN(ResultPtr result,
                     Read(kSelectRecords, Params().Text(kind), "load " + kind + " records"));
    std::vector<StoredRecord> records;
    for (int row = 0; row < PQntuples(result.get()); ++row) {
      records.push_back({kind, Bytes(result.get(), row, 0), Bytes(result.get(), row, 1),
                         Int64(result.get(), row, 2)});
    }
    return records;
  }

  absl::StatusOr<StoredJob> GetJob(const std::string& id) override {
    absl::MutexLock lock(&read_mu_);
    ASSIGN_OR_RETURN(ResultPtr result, Read(kSelectJob, Params().Text(id), "get job"));
    if (PQntuples(result.get()) == 0) return absl::NotFoundError(absl::StrCat("no job ", id));
    return JobAt(result.get(), 0);
  }

  absl::StatusOr<StoredRecord> GetRecord(const std::string& kind, const std::string& id) override {
    absl::MutexLock lock(&read_mu_);
    ASSIGN_OR_RETURN(ResultPtr result,
                     Read(kSelectRecord, Params().Text(kind).Text(id), "get " + kind));
    if (PQntuples(result.get()) == 0)
      return absl::NotFoundError(absl::StrCat("no ", kind, " ", id));
    return StoredRecord{kind, id, Bytes(result.get(), 0, 0), Int64(result.get(), 0, 1)};
  }

  absl::StatusOr<std::vector<StoredJob>> ListJobs(const JobQuery& query) override {
    std::string states;
    if (!query.states.empty()) states = absl::StrCat(",", absl::StrJoin(query.states, ","), ",");
    Params params;
    params.Int(query.before_seq)
        .Text(states)
        .Int(static_cast<int64_t>(std::min<size_t>(query.limit, INT32_MAX)));
    if (!query.owner.empty()) params.Text(query.owner);
    absl::MutexLock lock(&read_mu_);
    ASSIGN_OR_RETURN(ResultPtr result,
                     Read(query.owner.empty() ? kListJobs : kListOwnerJobs, params, "list jobs"));
    std::vector<StoredJob> jobs;
    for (int row = 0; row < PQntuples(result.get()); ++row)
      jobs.push_back(JobAt(result.get(), row));
    return jobs;
  }

  JobStoreStats Stats() const override { return committer_.Stats(); }

 private:
  PostgresJobStore(const std::string& uri, const PostgresJobStoreOptions& options)
      : options_(options),
        write_(uri,
               std::vector<Statement>(std::begin(kWriteStatements), std::end(kWriteStatements)),
               Timeouts{}, WriteSessionSettings(options)),
        read_(uri, std::vector<Statement>(std::begin(kReadStatements), std::end(kReadStatements))),
        committer_(
            options.group_commit,
            [this](const std::vector<const WriteBatch*>& batches) {
              return RunTransaction(batches);
            },
            options.on_commit) {}

  static std::string WriteSessionSettings(const PostgresJobStoreOptions& options) {
    const int64_t idle_ms = absl::ToInt64Milliseconds(options.idle_in_transaction_limit);
    if (idle_ms <= 0) return "";
    return absl::StrCat("SET idle_in_transaction_session_timeout = ",
                        std::max<int64_t>(idle_ms, 1));
  }

  // The job in `row` of a result that selects id, seq, owner, state, payload.
  static StoredJob JobAt(const PGresult* result, int row) {
    return StoredJob{Bytes(result, row, 0), Int64(result, row, 1), Bytes(result, row, 2),
                     Bytes(result, row, 3), Bytes(result, row, 4)};
  }

  // Runs a read on the read connection, reconnecting first if the server went away; a read that
  // fails because the connection broke is tried once more on a new one.
  absl::StatusOr<ResultPtr> Read(const Statement& statement, const Params& params,
                                 const std::string& context)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_) {
    for (int attempt = 0;; ++attempt) {
      RETURN_IF_ERROR(read_.Ensure());
      absl::StatusOr<ResultPtr> result = read_.Run(statement, params, context);
      if (result.ok() || attempt > 0 || PQstatus(read_.get()) == CONNECTION_OK) return result;
    }
  }

  // Writes `batches` in one BEGIN..COMMIT transaction. On error nothing of them is applied.
  // A connection that broke before COMMIT was sent (the server restarted, closed an idle session,
  // or ended one this process left idle in the transaction by a pause) applied nothing, and the
  // transaction is tried once more on a new connection. One that broke after COMMIT was sent
  // leaves the outcome to ask the server by the transaction's id (txid_status): committed is
  // success, aborted is tried once more as above, and only a server that cannot say leaves it
  // unknown (UNAVAILABLE, "may or may not have been applied").
  // A fenced store checks its lease in the message that commits (trainyard_fence; COMMIT): the
  // server runs both at once, so a transaction commits only while its lease holds, and holds the
  // lease row only for its commit, however long this process stalls before or between them.
  absl::Status RunTransaction(const std::vector<const WriteBatch*>& batches) {
    const std::string commit =
        options_.fence_epoch > 0
            ? absl::StrCat("SELECT trainyard_fence(", options_.fence_epoch, "); COMMIT")
            : "COMMIT";
    for (int attempt = 0;; ++attempt) {
      RETURN_IF_ERROR(write_.Ensure());
      PGconn* conn = write_.get();
      std::string txid;
      bool commit_sent = false;
      absl::Status status = [&]() -> absl::Status {
        ResultPtr begun(PQexec(conn, "BEGIN; SELECT txid_current()"));
        if (PQresultStatus(begun.get()) != PGRES_TUPLES_OK || PQntuples(begun.get()) != 1) {
          return PostgresError(conn, begun.get(), "begin transaction");
        }
        txid = PQgetvalue(begun.get(), 0, 0);
        for (const WriteBatch* batch : batches) RETURN_IF_ERROR(WriteBatchRows(*batch));
        if (options_.before_commit) options_.before_commit();
        commit_sent = true;
        return Exec(conn, commit, "commit transaction");
      }();
      if (status.ok()) break;
      if (PQstatus(conn) != CONNECTION_OK) {
        write_.Drop();  // reconnect
        const std::string outcome = commit_sent ? TransactionOutcome(txid) : "aborted";
        if (outcome == "committed") break;
        if (outcome == "aborted" && attempt == 0) continue;
        if (outcome != "aborted") {
          return absl::UnavailableError(
              absl::StrCat(status.message(),
                           " (the connection broke after COMMIT was sent: the batch may "
                           "or may not have been applied)"));
        }
      } else if (PQtransactionStatus(conn) != PQTRANS_IDLE) {
        Exec(conn, "ROLLBACK", "roll back").IgnoreError();
      }
      if (absl::IsFailedPrecondition(status)) return Fenced();
      return status;
    }
    return absl::OkStatus();
  }

  // What became of transaction `txid` after its connection broke, on a new connection:
  // "committed", "aborted", or "" when the server cannot say (unreachable, or the transaction
  // still in progress on a session the server has not yet noticed is gone, for up to 2 s).
  std::string TransactionOutcome(const std::string& txid) {
    const absl::Time deadline = absl::Now() + absl::Seconds(2);
    while (true) {
      if (!write_.Ensure().ok()) return "";
      const char* values[] = {txid.c_str()};
      ResultPtr result(PQexecParams(write_.get(), "SELECT txid_status($1::bigint)", 1, nullptr,
                                    values, nullptr, nullptr, /*resultFormat=*/0));
      if (PQresultStatus(result.get()) != PGRES_TUPLES_OK || PQntuples(result.get()) != 1 ||
          PQgetisnull(result.get(), 0, 0)) {
        return "";
      }
      const std::string outcome = PQgetvalue(result.get(), 0, 0);
      if (outcome != "in progress" || absl::Now() > deadline) {
        return outcome == "in progress" ? "" : outcome;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  }

  // A transaction that trainyard_fence failed: this store's epoch no longer holds the lease. The
  // first time, tells options_.on_fenced. UNAVAILABLE, as what this coordinator answers then is a
  // call to try at the leader (safe for a retried submit: its request id holds it to one job).
  absl::Status Fenced() {
    if (!fenced_) {
      fenced_ = true;
      if (options_.on_fenced) options_.on_fenced();
    }
    return absl::UnavailableError(
        absl::StrCat("this coordinator's lease (epoch ", options_.fence_epoch,
                     ") has ended or passed to another coordinator: it writes nothing more; "
                     "try the leader"));
  }

  absl::Status WriteBatchRows(const WriteBatch& batch) {
    for (const StoredJob& job : batch.put_jobs) {
      RETURN_IF_ERROR(
          write_
              .Run(kPutJob,
                   Params().Text(job.id).Int(job.seq).Text(job.owner).Text(job.state).Bytes(
                       job.payload),
                   absl::StrCat("put job ", job.id, " seq ", job.seq))
              .status());
    }
    for (const StoredNode& node : batch.put_nodes) {
      RETURN_IF_ERROR(write_
                          .Run(kPutNode, Params().Text(node.id).Bytes(node.payload),
                               absl::StrCat("put node ", node.id))
                          .status());
    }
    for (const std::string& id : batch.delete_nodes) {
      RETURN_IF_ERROR(
          write_.Run(kDeleteNode, Params().Text(id), absl::StrCat("delete node ", id)).status());
    }
    for (const StoredRecord& record : batch.put_records) {
      RETURN_IF_ERROR(write_
                          .Run(kPutRecord,
                               Params()
                                   .Text(record.kind)
                                   .Text(record.id)
                                   .Bytes(record.payload)
                                   .Int(record.expires_ms),
                               absl::StrCat("put ", record.kind, " ", record.id))
                          .status());
    }
    for (const auto& [kind, id] : batch.delete_records) {
      RETURN_IF_ERROR(write_
                          .Run(kDeleteRecord, Params().Text(kind).Text(id),
                               absl::StrCat("delete ", kind, " ", id))
                          .status());
    }
    if (batch.delete_records_expired_at_ms > 0) {
      RETURN_IF_ERROR(write_
                          .Run(kDeleteExpired, Params().Int(batch.delete_records_expired_at_ms),
                               "delete expired records")
                          .status());
    }
    return absl::OkStatus();
  }

  const PostgresJobStoreOptions options_;

  Connection write_;     // used only by the commit thread once the store is open
  bool fenced_ = false;  // (commit thread)

  absl::Mutex read_mu_;  // serializes reads on the read connection
  Connection read_ ABSL_GUARDED_BY(read_mu_);

  // Last: stopped (everything queued written) before the connections close.
  GroupCommitter committer_;
};

constexpr Statement kAcquire = {
    "acquire",
    "UPDATE trainyard_leader SET epoch = epoch + 1, holder = $1, address = $2, "
    "expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond', web_url = $4 "
    "WHERE id = 1 AND (expires_at <= clock_timestamp() OR holder = $1) RETURNING epoch"};
constexpr Statement kRenew = {
    "renew",
    "UPDATE trainyard_leader SET expires_at = clock_timestamp() + $2::bigint * interval "
    "'1 millisecond' WHERE id = 1 AND epoch = $1 AND expires_at > clock_timestamp() "
    "RETURNING epoch"};
constexpr Statement kRelease = {
    "release", "UPDATE trainyard_leader SET expires_at = '-infinity' WHERE id = 1 AND epoch = $1"};
constexpr Statement kCurrent = {
    "current",
    "SELECT epoch, holder, address, expires_at <= clock_timestamp(), web_url "
    "FROM trainyard_leader WHERE id = 1"};

class PostgresLeaderLease final : public LeaderLease {
 public:
  PostgresLeaderLease(const std::string& uri, std::string holder, std::string address,
                      std::string web_url)
      : conn_(uri, {kAcquire, kRenew, kRelease, kCurrent},
              // Short: a renewal must fail well within the lease, not hang; a takeover waits for
              // no lock longer than a commit takes (a fenced commit holds the row), and tries
              // again at its next poll.
              Timeouts{"2", "2000"}, "SET lock_timeout = '1s'; SET statement_timeout = '2s'"),
        holder_(std::move(holder)),
        address_(std::move(address)),
        web_url_(std::move(web_url)) {}

  absl::StatusOr<int64_t> TryAcquire(absl::Duration ttl) override {
    ASSIGN_OR_RETURN(ResultPtr result, Run(kAcquire,
                                           Params()
                                               .Text(holder_)
                                               .Text(address_)
                                               .Int(absl::ToInt64Milliseconds(ttl))
                                               .Text(web_url_),
                                           "take the leader's lease"));
    if (PQntuples(result.get()) == 0) {
      return absl::NotFoundError("another coordinator holds the leader's lease");
    }
    return Int64(result.get(), 0, 0);
  }

  absl::Status Renew(int64_t epoch, absl::Duration ttl) override {
    ASSIGN_OR_RETURN(ResultPtr result,
                     Run(kRenew, Params().Int(epoch).Int(absl::ToInt64Milliseconds(ttl)),
                         "renew the leader's lease"));
    if (PQntuples(result.get()) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("the leader's lease of epoch ", epoch, " has expired or passed on"));
    }
    return absl::OkStatus();
  }

  absl::Status Release(int64_t epoch) override {
    return Run(kRelease, Params().Int(epoch), "release the leader's lease").status();
  }

  absl::StatusOr<LeaseHolder> Current() override {
    ASSIGN_OR_RETURN(ResultPtr result, Run(kCurrent, Params(), "read the leader's lease"));
    if (PQntuples(result.get()) != 1) return absl::InternalError("no leader's lease row");
    LeaseHolder lease;
    lease.epoch = Int64(result.get(), 0, 0);
    lease.holder = Bytes(result.get(), 0, 1);
    lease.address = Bytes(result.get(), 0, 2);
    lease.expired = PQgetlength(result.get(), 0, 3) == 1 && PQgetvalue(result.get(), 0, 3)[0] != 0;
    lease.web_url = Bytes(result.get(), 0, 4);
    return lease;
  }

 private:
  // A statement on the connection, made again once if the server dropped it.
  absl::StatusOr<ResultPtr> Run(const Statement& statement, const Params& params,
                                const std::string& context) {
    for (int attempt = 0;; ++attempt) {
      RETURN_IF_ERROR(conn_.Ensure());
      absl::StatusOr<ResultPtr> result = conn_.Run(statement, params, context);
      if (result.ok() || PQstatus(conn_.get()) == CONNECTION_OK) return result;
      conn_.Drop();
      if (attempt > 0) return result;
    }
  }

  Connection conn_;
  const std::string holder_;
  const std::string address_;
  const std::string web_url_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LeaderLease>> OpenLeaderLease(const std::string& uri,
                                                             const std::string& holder,
                                                             const std::string& address,
                                                             const std::string& web_url) {
  auto lease = std::make_unique<PostgresLeaderLease>(uri, holder, address, web_url);
  RETURN_IF_ERROR(lease->Current().status());
  return lease;
}

std::string DescribePostgresLocation(const std::string& uri) {
  char* error = nullptr;
  PQconninfoOption* options = PQconninfoParse(uri.c_str(), &error);
  if (options == nullptr) {
    PQfreemem(error);
    return "(an unparsable PostgreSQL URI)";
  }
  std::string host = "localhost", port, dbname;
  for (PQconninfoOption* o = options; o->keyword != nullptr; ++o) {
    if (o->val == nullptr || *o->val == '\0') continue;
    if (std::strcmp(o->keyword, "host") == 0 || std::strcmp(o->keyword, "hostaddr") == 0) {
      host = o->val;
    } else if (std::strcmp(o->keyword, "port") == 0) {
      port = o->val;
    } else if (std::strcmp(o->keyword, "dbname") == 0) {
      dbname = o->val;
    }
  }
  PQconninfoFree(options);
  return absl::StrCat(dbname.empty() ? "(the user's database)" : dbname, " on ", host,
                      port.empty() ? "" : ":", port);
}

absl::StatusOr<std::unique_ptr<JobStore>> OpenPostgresJobStore(
    const std::string& uri, const PostgresJobStoreOptions& options) {
  if (!IsPostgresLocation(uri)) {
    return absl::InvalidArgumentError(
        "store: a PostgreSQL location is a URI, postgresql://[user@]host[:port]/database");
  }
  char* error = nullptr;
  PQconninfoOption* parsed = PQconninfoParse(uri.c_str(), &error);
  if (parsed == nullptr) {
    std::string reason = error != nullptr ? error : "out of memory";
    PQfreemem(error);
    return absl::InvalidArgumentError(absl::StrCat("store: not a valid PostgreSQL URI: ",
                                                   absl::StripTrailingAsciiWhitespace(reason)));
  }
  bool has_password = false;
  for (PQconninfoOption* o = parsed; o->keyword != nullptr; ++o) {
    if (std::strcmp(o->keyword, "password") == 0 && o->val != nullptr && *o->val != '\0') {
      has_password = true;
    }
  }
  PQconninfoFree(parsed);
  if (has_password) {
    return absl::InvalidArgumentError(
        "store: the URI holds a password, which every local user could read in the process list; "
        "put it in libpq's password file (~/.pgpass or PGPASSFILE) or PGPASSWORD instead");
  }
  return PostgresJobStore::Open(uri, options);
}

}  // namespace trainyard::coordinator
