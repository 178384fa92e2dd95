// The SQLite JobStore backend (OpenSqliteJobStore, declared in job_store.h): the coordinator's
// durable record of jobs and nodes.
//
// Called by the coordinator's JobManager (writes, and loads at startup) and by the shared store
// tests. Owns two connections to one database file (WAL, synchronous=FULL): a write connection
// used only by the commit thread, and a read connection for loads and reads. Owns the commit
// thread, which drains the queue of batches and writes them with group commit (many batches, one
// transaction, one fsync).
#include <pthread.h>
#include <sqlite3.h>

#include <algorithm>
#include <climits>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "server/coordinator/group_committer.h"
#include "server/coordinator/job_store.h"

namespace trainyard::coordinator {
namespace {

// Schema migrations, in order: kMigrations[i] takes the database from user_version i to i + 1.
// Append only; never edit a migration that has shipped.
constexpr const char* kMigrations[] = {
    // Version 1.
    "CREATE TABLE jobs ("
    "  id TEXT PRIMARY KEY,"
    "  seq INTEGER NOT NULL UNIQUE,"
    "  owner TEXT NOT NULL,"
    "  state TEXT NOT NULL,"
    "  payload BLOB NOT NULL);"
    "CREATE INDEX jobs_owner ON jobs(owner);"
    "CREATE INDEX jobs_state ON jobs(state);"
    "CREATE TABLE nodes ("
    "  id TEXT PRIMARY KEY,"
    "  payload BLOB NOT NULL);",
    // Version 2: users, API tokens and other keyed records.
    "CREATE TABLE records ("
    "  kind TEXT NOT NULL,"
    "  id TEXT NOT NULL,"
    "  payload BLOB NOT NULL,"
    "  PRIMARY KEY (kind, id));",
    // Version 3: records that expire (finished jobs' logs and metrics), and listing one owner's
    // jobs newest first without sorting them all.
    "ALTER TABLE records ADD COLUMN expires_ms INTEGER NOT NULL DEFAULT 0;"
    "CREATE INDEX records_expiry ON records(expires_ms) WHERE expires_ms > 0;"
    "CREATE INDEX jobs_owner_seq ON jobs(owner, seq);",
};
constexpr int kSchemaVersion = sizeof(kMigrations) / sizeof(kMigrations[0]);

// How long a connection waits for a lock held by another connection (e.g. a second process on
// the same file, or a checkpoint) before failing with SQLITE_BUSY.
constexpr int kBusyTimeoutMs = 10'000;

struct DbCloser {
  void operator()(sqlite3* db) const { sqlite3_close_v2(db); }
};
using DbPtr = std::unique_ptr<sqlite3, DbCloser>;

struct StmtFinalizer {
  void operator()(sqlite3_stmt* stmt) const { sqlite3_finalize(stmt); }
};
using StmtPtr = std::unique_ptr<sqlite3_stmt, StmtFinalizer>;

absl::StatusCode CodeFor(int rc) {
  switch (rc & 0xff) {
    case SQLITE_CONSTRAINT:
      return (rc == SQLITE_CONSTRAINT_UNIQUE || rc == SQLITE_CONSTRAINT_PRIMARYKEY)
                 ? absl::StatusCode::kAlreadyExists
                 : absl::StatusCode::kInvalidArgument;
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_FULL:
    case SQLITE_IOERR:
    case SQLITE_CANTOPEN:
      return absl::StatusCode::kUnavailable;
    case SQLITE_PERM:
    case SQLITE_READONLY:
    case SQLITE_AUTH:
      return absl::StatusCode::kPermissionDenied;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::StatusCode::kDataLoss;
    default:
      return absl::StatusCode::kInternal;
  }
}

// A status for SQLite result code `rc`, with the connection's message and `context`.
absl::Status SqliteError(sqlite3* db, int rc, const std::string& context) {
  const char* message = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  return absl::Status(CodeFor(rc), absl::StrCat(context, ": ", message, " (sqlite code ", rc, ")"));
}

absl::Status Exec(sqlite3* db, const char* sql) {
  char* error = nullptr;
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, &error);
  if (rc == SQLITE_OK) return absl::OkStatus();
  absl::Status status(CodeFor(sqlite3_extended_errcode(db)),
                      absl::StrCat(sql, ": ", error != nullptr ? error : sqlite3_errstr(rc)));
  sqlite3_free(error);
  return status;
}

absl::StatusOr<StmtPtr> Prepare(sqlite3* db, const char* sql) {
  sqlite3_stmt* stmt = nullptr;
  const int rc = sqlite3_prepare_v3(db, sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
  if (rc != SQLITE_OK) return SqliteError(db, rc, absl::StrCat("prepare ", sql));
  return StmtPtr(stmt);
}

// Runs a statement that returns at most one row, and returns that row's first column as an int.
absl::StatusOr<int64_t> QueryInt(sqlite3* db, const char* sql) {
  ASSIGN_OR_RETURN(StmtPtr stmt, Prepare(db, sql));
  const int rc = sqlite3_step(stmt.get());
  if (rc != SQLITE_ROW) return SqliteError(db, rc, sql);
  return sqlite3_column_int64(stmt.get(), 0);
}

absl::StatusOr<std::string> QueryText(sqlite3* db, const char* sql) {
  ASSIGN_OR_RETURN(StmtPtr stmt, Prepare(db, sql));
  const int rc = sqlite3_step(stmt.get());
  if (rc != SQLITE_ROW) return SqliteError(db, rc, sql);
  const unsigned char* text = sqlite3_column_text(stmt.get(), 0);
  return std::string(text != nullptr ? reinterpret_cast<const char*>(text) : "");
}

absl::StatusOr<DbPtr> OpenConnection(const std::string& path) {
  sqlite3* raw = nullptr;
  const int rc =
      sqlite3_open_v2(path.c_str(), &raw,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  DbPtr db(raw);  // sqlite3_open_v2 returns a handle to close even when it fails
  if (rc != SQLITE_OK) {
    return SqliteError(db.get(), rc, absl::StrCat("cannot open job store database ", path));
  }
  sqlite3_extended_result_codes(db.get(), 1);
  sqlite3_busy_timeout(db.get(), kBusyTimeoutMs);
  // journal_mode=WAL persists in the file; synchronous is per connection. With WAL and FULL, every
  // commit fsyncs the WAL before it returns, so a committed batch survives a crash or power loss.
  ASSIGN_OR_RETURN(std::string mode, QueryText(db.get(), "PRAGMA journal_mode=WAL"));
  if (mode != "wal") {
    return absl::FailedPreconditionError(
        absl::StrCat("job store database ", path, " cannot use WAL journal mode (got ", mode, ")"));
  }
  RETURN_IF_ERROR(Exec(db.get(), "PRAGMA synchronous=FULL"));
  return db;
}

// Copies database `from` (its main schema, in one step: one read transaction) into a new
// database file at `path` (which must not exist), left in rollback-journal mode so that the file
// alone holds it, and synced.
absl::Status CopyDatabase(sqlite3* from, const std::string& path, const std::string& what) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    return absl::AlreadyExistsError(absl::StrCat(what, ": ", path, " exists"));
  }
  sqlite3* raw = nullptr;
  int rc =
      sqlite3_open_v2(path.c_str(), &raw,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  DbPtr to(raw);
  if (rc != SQLITE_OK) return SqliteError(to.get(), rc, what);
  sqlite3_backup* backup = sqlite3_backup_init(to.get(), "main", from, "main");
  if (backup == nullptr) return SqliteError(to.get(), sqlite3_errcode(to.get()), what);
  rc = sqlite3_backup_step(backup, -1);
  const int finished = sqlite3_backup_finish(backup);
  if (rc != SQLITE_DONE) return SqliteError(to.get(), rc, what);
  if (finished != SQLITE_OK) return SqliteError(to.get(), finished, what);
  ASSIGN_OR_RETURN(const std::string mode, QueryText(to.get(), "PRAGMA journal_mode=DELETE"));
  if (mode != "delete") {
    return absl::InternalError(absl::StrCat(what, ": journal mode ", mode, ", not delete"));
  }
  return absl::OkStatus();
}

// Brings the schema of `db` up to kSchemaVersion, in one transaction.
absl::Status Migrate(sqlite3* db, const std::string& path) {
  RETURN_IF_ERROR(Exec(db, "BEGIN IMMEDIATE"));
  absl::Status status = [&]() -> absl::Status {
    // Read inside the write transaction, so that two processes opening a new file do not both
    // run the migrations.
    ASSIGN_OR_RETURN(const int64_t version, QueryInt(db, "PRAGMA user_version"));
    if (version > kSchemaVersion) {
      return absl::FailedPreconditionError(
          absl::StrCat("job store database ", path, " has schema version ", version,
                       ", newer than the latest version this build knows (", kSchemaVersion, ")"));
    }
    for (int64_t v = version; v < kSchemaVersion; ++v) {
      RETURN_IF_ERROR(Exec(db, kMigrations[v]));
    }
    if (version < kSchemaVersion) {
      RETURN_IF_ERROR(Exec(db, absl::StrCat("PRAGMA user_version=", kSchemaVersion).c_str()));
    }
    return Exec(db, "COMMIT");
  }();
  if (!status.ok() && !sqlite3_get_autocommit(db)) Exec(db, "ROLLBACK").IgnoreError();
  return status;
}

// Binds `value` as a blob; an empty string becomes a zero-length blob, never NULL.
int BindBlob(sqlite3_stmt* stmt, int index, const std::string& value) {
  if (value.empty()) return sqlite3_bind_zeroblob(stmt, index, 0);
  return sqlite3_bind_blob64(stmt, index, value.data(), value.size(), SQLITE_STATIC);
}

int BindText(sqlite3_stmt* stmt, int index, const std::string& value) {
  return sqlite3_bind_text64(stmt, index, value.data(), value.size(), SQLITE_STATIC, SQLITE_UTF8);
}

std::string ColumnBytes(sqlite3_stmt* stmt, int column) {
  const void* data = sqlite3_column_blob(stmt, column);  // NULL for a zero-length value
  const int size = sqlite3_column_bytes(stmt, column);
  if (data == nullptr || size <= 0) return std::string();
  return std::string(static_cast<const char*>(data), static_cast<size_t>(size));
}

// Resets a statement (ending its implicit read transaction) and clears its bindings on scope
// exit, so that a reused statement never holds a stale snapshot or dangling blob pointers.
class ScopedReset {
 public:
  explicit ScopedReset(sqlite3_stmt* stmt) : stmt_(stmt) {}
  ~ScopedReset() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  ScopedReset(const ScopedReset&) = delete;
  ScopedReset& operator=(const ScopedReset&) = delete;

 private:
  sqlite3_stmt* stmt_;
};

// Steps a write statement to completion.
absl::Status StepDone(sqlite3* db, sqlite3_stmt* stmt, const std::string& context) {
  const int rc = sqlite3_step(stmt);
  if (rc != SQLITE_DONE) return SqliteError(db, sqlite3_extended_errcode(db), context);
  return absl::OkStatus();
}

// Commit() and Stats() may be called from any thread; writes run only on the commit thread, which
// also runs the callbacks; reads (Load*, Get*, ListJobs) may be called from any thread (one at a
// time on the read connection), including from a callback.
class SqliteJobStore final : public JobStore {
 public:
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path,
                                                        const SqliteJobStoreOptions& options) {
    ASSIGN_OR_RETURN(DbPtr write_db, OpenConnection(path));
    RETURN_IF_ERROR(Migrate(write_db.get(), path));
    ASSIGN_OR_RETURN(DbPtr read_db, OpenConnection(path));
    std::unique_ptr<SqliteJobStore> store(
        new SqliteJobStore(options, std::move(write_db), std::move(read_db)));
    RETURN_IF_ERROR(store->PrepareStatements());
    store->committer_.Start();
    return store;
  }

  // Writes every queued batch and runs its callback, then closes the database.
  ~SqliteJobStore() override { committer_.Stop(); }

  void Commit(WriteBatch batch, DoneCallback done) override {
    committer_.Commit(std::move(batch), std::move(done));
  }

  absl::Status Backup(const std::string& path) override {
    // (The read connection's lock: the copy is one read transaction, a snapshot that commits
    // made meanwhile do not change.)
    absl::MutexLock lock(&read_mu_);
    return CopyDatabase(read_db_.get(), path, absl::StrCat("backup to ", path));
  }

  absl::StatusOr<std::vector<StoredJob>> LoadJobs() override {
    absl::MutexLock lock(&read_mu_);
    sqlite3_stmt* stmt = select_jobs_.get();
    ScopedReset reset(stmt);
    std::vector<StoredJob> jobs;
    int rc;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) jobs.push_back(JobAt(stmt));
    if (rc != SQLITE_DONE) return SqliteError(read_db_.get(), rc, "load jobs");
    return jobs;
  }

  absl::StatusOr<std::vector<StoredNode>> LoadNodes() override {
    absl::MutexLock lock(&read_mu_);
    sqlite3_stmt* stmt = select_nodes_.get();
    ScopedReset reset(stmt);
    std::vector<StoredNode> nodes;
    int rc;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      nodes.push_back({ColumnBytes(stmt, 0), ColumnBytes(stmt, 1)});
    }
    if (rc != SQLITE_DONE) return SqliteError(read_db_.get(), rc, "load nodes");
    return nodes;
  }

  absl::StatusOr<std::vector<StoredRecord>> LoadRecords(const std::string& kind) override {
    absl::MutexLock lock(&read_mu_);
    sqlite3_stmt* stmt = select_records_.get();
    ScopedReset reset(stmt);
    BindText(stmt, 1, kind);
    std::vector<StoredRecord> records;
    int rc;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      records.push_back(
          {kind, ColumnBytes(stmt, 0), ColumnBytes(stmt, 1), sqlite3_column_int64(stmt, 2)});
    }
    if (rc != SQLITE_DONE) return SqliteError(read_db_.get(), rc, "load " + kind + " records");
    return records;
  }

  absl::StatusOr<StoredJob> GetJob(const std::string& id) override {
    absl::MutexLock lock(&read_mu_);
    sqlite3_stmt* stmt = select_job_.get();
    ScopedReset reset(stmt);
    BindText(stmt, 1, id);
    const int rc = sqlite3_step(stmt);
    if (rc == SQLITE_DONE) return absl::NotFoundError(absl::StrCat("no job ", id));
    if (rc != SQLITE_ROW) return SqliteError(read_db_.get(), rc, "get job");
    return JobAt(stmt);
  }

  absl::StatusOr<StoredRecord> GetRecord(const std::string& kind, const std::string& id) override {
    absl::MutexLock lock(&read_mu_);
    sqlite3_stmt* stmt = select_record_.get();
    ScopedReset reset(stmt);
    BindText(stmt, 1, kind);
    BindText(stmt, 2, id);
    const int rc = sqlite3_step(stmt);
    if (rc == SQLITE_DONE) return absl::NotFoundError(absl::StrCat("no ", kind, " ", id));
    if (rc != SQLITE_ROW) return SqliteError(read_db_.get(), rc, "get " + kind);
    return StoredRecord{kind, id, ColumnBytes(stmt, 0), sqlite3_column_int64(stmt, 1)};
  }

  absl::StatusOr<std::vector<StoredJob>> ListJobs(const JobQuery& query) override {
    // The states as ",A,B," for instr(): one statement whatever their number.
    std::string states;
    if (!query.states.empty()) states = absl::StrCat(",", absl::StrJoin(query.states, ","), ",");
    absl::MutexLock lock(&read_mu_);
    sqlite3_stmt* stmt = query.owner.empty() ? list_jobs_.get() : list_owner_jobs_.get();
    ScopedReset reset(stmt);
    sqlite3_bind_int64(stmt, 1, query.before_seq);
    BindText(stmt, 2, states);
    sqlite3_bind_int64(stmt, 3, static_cast<int64_t>(std::min<size_t>(query.limit, INT32_MAX)));
    if (!query.owner.empty()) BindText(stmt, 4, query.owner);
    std::vector<StoredJob> jobs;
    int rc;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) jobs.push_back(JobAt(stmt));
    if (rc != SQLITE_DONE) return SqliteError(read_db_.get(), rc, "list jobs");
    return jobs;
  }

  JobStoreStats Stats() const override { return committer_.Stats(); }

 private:
  // The job in the current row of a statement that selects id, seq, owner, state, payload.
  static StoredJob JobAt(sqlite3_stmt* stmt) {
    StoredJob job;
    job.id = ColumnBytes(stmt, 0);
    job.seq = sqlite3_column_int64(stmt, 1);
    job.owner = ColumnBytes(stmt, 2);
    job.state = ColumnBytes(stmt, 3);
    job.payload = ColumnBytes(stmt, 4);
    return job;
  }

  SqliteJobStore(const SqliteJobStoreOptions& options, DbPtr write_db, DbPtr read_db)
      : options_(options),
        write_db_(std::move(write_db)),
        read_db_(std::move(read_db)),
        committer_(
            options.group_commit,
            [this](const std::vector<const WriteBatch*>& batches) {
              return RunTransaction(batches);
            },
            options.on_commit) {}

  absl::Status PrepareStatements() {
    sqlite3* w = write_db_.get();
    ASSIGN_OR_RETURN(begin_, Prepare(w, "BEGIN IMMEDIATE"));
    ASSIGN_OR_RETURN(commit_, Prepare(w, "COMMIT"));
    ASSIGN_OR_RETURN(rollback_, Prepare(w, "ROLLBACK"));
    // Not INSERT OR REPLACE: that would silently delete another job holding the same seq. Here a
    // seq collision with a different id fails the statement (and the batch).
    ASSIGN_OR_RETURN(put_job_, Prepare(w,
                                       "INSERT INTO jobs(id, seq, owner, state, payload) "
                                       "VALUES(?1, ?2, ?3, ?4, ?5) ON CONFLICT(id) DO UPDATE SET "
                                       "seq = excluded.seq, owner = excluded.owner, "
                                       "state = excluded.state, payload = excluded.payload"));
    ASSIGN_OR_RETURN(put_node_,
                     Prepare(w,
                             "INSERT INTO nodes(id, payload) VALUES(?1, ?2) "
                             "ON CONFLICT(id) DO UPDATE SET payload = excluded.payload"));
    ASSIGN_OR_RETURN(delete_node_, Prepare(w, "DELETE FROM nodes WHERE id = ?1"));
    ASSIGN_OR_RETURN(delete_record_, Prepare(w, "DELETE FROM records WHERE kind = ?1 AND id = ?2"));
    ASSIGN_OR_RETURN(put_record_,
                     Prepare(w,
                             "INSERT INTO records(kind, id, payload, expires_ms) "
                             "VALUES(?1, ?2, ?3, ?4) ON CONFLICT(kind, id) DO UPDATE SET "
                             "payload = excluded.payload, expires_ms = excluded.expires_ms"));
    ASSIGN_OR_RETURN(delete_expired_,
                     Prepare(w, "DELETE FROM records WHERE expires_ms > 0 AND expires_ms <= ?1"));
    sqlite3* r = read_db_.get();
    {
      absl::MutexLock lock(&read_mu_);
      ASSIGN_OR_RETURN(select_jobs_,
                       Prepare(r, "SELECT id, seq, owner, state, payload FROM jobs ORDER BY seq"));
      ASSIGN_OR_RETURN(select_nodes_, Prepare(r, "SELECT id, payload FROM nodes ORDER BY id"));
      ASSIGN_OR_RETURN(
          select_records_,
          Prepare(r, "SELECT id, payload, expires_ms FROM records WHERE kind = ?1 ORDER BY id"));
      ASSIGN_OR_RETURN(select_job_,
                       Prepare(r, "SELECT id, seq, owner, state, payload FROM jobs WHERE id = ?1"));
      ASSIGN_OR_RETURN(
          select_record_,
          Prepare(r, "SELECT payload, expires_ms FROM records WHERE kind = ?1 AND id = ?2"));
      // ?2 is ",STATE,STATE," or empty for any state.
      ASSIGN_OR_RETURN(list_jobs_,
                       Prepare(r,
                               "SELECT id, seq, owner, state, payload FROM jobs WHERE seq < ?1 "
                               "AND (?2 = '' OR instr(?2, ',' || state || ',') > 0) "
                               "ORDER BY seq DESC LIMIT ?3"));
      ASSIGN_OR_RETURN(list_owner_jobs_,
                       Prepare(r,
                               "SELECT id, seq, owner, state, payload FROM jobs WHERE owner = ?4 "
                               "AND seq < ?1 AND (?2 = '' OR instr(?2, ',' || state || ',') > 0) "
                               "ORDER BY seq DESC LIMIT ?3"));
    }
    return absl::OkStatus();
  }

  // Writes `batches` in one BEGIN IMMEDIATE..COMMIT transaction (one fsync). On error nothing of
  // them is applied.
  absl::Status RunTransaction(const std::vector<const WriteBatch*>& batches) {
    sqlite3* db = write_db_.get();
    absl::Status status = [&]() -> absl::Status {
      {
        ScopedReset reset(begin_.get());
        RETURN_IF_ERROR(StepDone(db, begin_.get(), "begin transaction"));
      }
      for (const WriteBatch* batch : batches) RETURN_IF_ERROR(WriteBatchRows(*batch));
      ScopedReset reset(commit_.get());
      return StepDone(db, commit_.get(), "commit transaction");
    }();
    if (!status.ok()) {
      if (!sqlite3_get_autocommit(db)) {
        ScopedReset reset(rollback_.get());
        sqlite3_step(rollback_.get());  // fails only if no transaction is open
      }
      return status;
    }
    return absl::OkStatus();
  }

  absl::Status WriteBatchRows(const WriteBatch& batch) {
    sqlite3* db = write_db_.get();
    for (const StoredJob& job : batch.put_jobs) {
      sqlite3_stmt* stmt = put_job_.get();
      ScopedReset reset(stmt);
      BindText(stmt, 1, job.id);
      sqlite3_bind_int64(stmt, 2, job.seq);
      BindText(stmt, 3, job.owner);
      BindText(stmt, 4, job.state);
      BindBlob(stmt, 5, job.payload);
      RETURN_IF_ERROR(StepDone(db, stmt, absl::StrCat("put job ", job.id, " seq ", job.seq)));
    }
    for (const StoredNode& node : batch.put_nodes) {
      sqlite3_stmt* stmt = put_node_.get();
      ScopedReset reset(stmt);
      BindText(stmt, 1, node.id);
      BindBlob(stmt, 2, node.payload);
      RETURN_IF_ERROR(StepDone(db, stmt, absl::StrCat("put node ", node.id)));
    }
    for (const std::string& id : batch.delete_nodes) {
      sqlite3_stmt* stmt = delete_node_.get();
      ScopedReset reset(stmt);
      BindText(stmt, 1, id);
      RETURN_IF_ERROR(StepDone(db, stmt, absl::StrCat("delete node ", id)));
    }
    for (const StoredRecord& record : batch.put_records) {
      sqlite3_stmt* stmt = put_record_.get();
      ScopedReset reset(stmt);
      BindText(stmt, 1, record.kind);
      BindText(stmt, 2, record.id);
      BindBlob(stmt, 3, record.payload);
      sqlite3_bind_int64(stmt, 4, record.expires_ms);
      RETURN_IF_ERROR(StepDone(db, stmt, absl::StrCat("put ", record.kind, " ", record.id)));
    }
    for (const auto& [kind, id] : batch.delete_records) {
      sqlite3_stmt* stmt = delete_record_.get();
      ScopedReset reset(stmt);
      BindText(stmt, 1, kind);
      BindText(stmt, 2, id);
      RETURN_IF_ERROR(StepDone(db, stmt, absl::StrCat("delete ", kind, " ", id)));
    }
    if (batch.delete_records_expired_at_ms > 0) {
      sqlite3_stmt* stmt = delete_expired_.get();
      ScopedReset reset(stmt);
      sqlite3_bind_int64(stmt, 1, batch.delete_records_expired_at_ms);
      RETURN_IF_ERROR(StepDone(db, stmt, "delete expired records"));
    }
    return absl::OkStatus();
  }

  const SqliteJobStoreOptions options_;

  // Used only by the commit thread once the store is open. Declared before the statements so that
  // they are finalized first.
  DbPtr write_db_;
  StmtPtr begin_, commit_, rollback_, put_job_, put_node_, delete_node_, put_record_,
      delete_record_, delete_expired_;

  absl::Mutex read_mu_;  // serializes loads on the read connection
  DbPtr read_db_;
  StmtPtr select_jobs_ ABSL_GUARDED_BY(read_mu_);
  StmtPtr select_nodes_ ABSL_GUARDED_BY(read_mu_);
  StmtPtr select_records_ ABSL_GUARDED_BY(read_mu_);
  StmtPtr select_job_ ABSL_GUARDED_BY(read_mu_);
  StmtPtr select_record_ ABSL_GUARDED_BY(read_mu_);
  StmtPtr list_jobs_ ABSL_GUARDED_BY(read_mu_);
  StmtPtr list_owner_jobs_ ABSL_GUARDED_BY(read_mu_);

  // Last: stopped (everything queued written) before the connections close.
  GroupCommitter committer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<JobStore>> OpenSqliteJobStore(const std::string& path,
                                                             const SqliteJobStoreOptions& options) {
  return SqliteJobStore::Open(path, options);
}

absl::Status RestoreSqliteBackup(const std::string& backup, const std::string& path) {
  sqlite3* raw = nullptr;
  int rc =
      sqlite3_open_v2(backup.c_str(), &raw, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, nullptr);
  DbPtr from(raw);
  if (rc != SQLITE_OK) return SqliteError(from.get(), rc, absl::StrCat("cannot open ", backup));
  // (A file that is not a database fails here: SQLite reads nothing until the first query.)
  auto version = QueryInt(from.get(), "PRAGMA user_version");
  auto jobs = QueryInt(from.get(),
                       "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'jobs'");
  if (!version.ok() || !jobs.ok() || *version < 1 || *jobs != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(backup, " is not a trainyard coordinator's database (yard admin backup)"));
  }
  if (*version > kSchemaVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(backup, " has schema version ", *version,
                     ", newer than the latest version this build knows (", kSchemaVersion, ")"));
  }
  ASSIGN_OR_RETURN(const std::string check, QueryText(from.get(), "PRAGMA integrity_check"));
  if (check != "ok") {
    return absl::DataLossError(absl::StrCat(backup, " fails SQLite's integrity check: ", check));
  }
  return CopyDatabase(from.get(), path, absl::StrCat("restore of ", backup));
}

}  // namespace trainyard::coordinator
