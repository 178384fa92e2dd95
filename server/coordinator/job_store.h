// Durable storage for the coordinator's jobs and nodes, behind a small interface so that SQLite
// (the embedded default) and PostgreSQL pass one shared test suite (tests/job_store_test.cc).
//
// The store knows nothing of protobuf or job semantics: a job is a row with a few indexed columns
// and an opaque payload (the serialized trainyard.v1.Job) that the JobManager owns.
#ifndef TRAINYARD_SERVER_COORDINATOR_JOB_STORE_H_
#define TRAINYARD_SERVER_COORDINATOR_JOB_STORE_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainyard::coordinator {

struct StoredJob {
  std::string id;       // primary key
  int64_t seq = 0;      // submission sequence number, unique and increasing; LoadJobs orders by it
  std::string owner;    // indexed, for listing by owner
  std::string state;    // indexed, e.g. "QUEUED"
  std::string payload;  // opaque bytes, stored and returned verbatim

  bool operator==(const StoredJob& o) const {
    return id == o.id && seq == o.seq && owner == o.owner && state == o.state &&
           payload == o.payload;
  }
};

struct StoredNode {
  std::string id;       // primary key
  std::string payload;  // opaque bytes, stored and returned verbatim

  bool operator==(const StoredNode& o) const { return id == o.id && payload == o.payload; }
};

// Any other durable record (users, API tokens, finished jobs' logs, ...): a payload keyed by
// (kind, id).
struct StoredRecord {
  std::string kind;     // e.g. "user", "token"
  std::string id;       // unique within its kind
  std::string payload;  // opaque bytes, stored and returned verbatim
  // Unix ms after which a batch's delete_records_expired_at_ms deletes it; 0: never.
  int64_t expires_ms = 0;

  bool operator==(const StoredRecord& o) const {
    return kind == o.kind && id == o.id && payload == o.payload && expires_ms == o.expires_ms;
  }
};

// Which jobs ListJobs returns: those with seq below before_seq, of `owner` (empty: everyone's), in
// one of `states` (empty: any), newest first, at most `limit`.
struct JobQuery {
  int64_t before_seq = std::numeric_limits<int64_t>::max();
  std::string owner;
  std::vector<std::string> states;
  size_t limit = 100;
};

// A set of writes applied atomically: all of them are durable, or none.
struct WriteBatch {
  std::vector<StoredJob> put_jobs;        // insert or replace by id
  std::vector<StoredNode> put_nodes;      // insert or replace by id
  std::vector<std::string> delete_nodes;  // ids; deleting a missing id is not an error
  std::vector<StoredRecord> put_records;  // insert or replace by (kind, id)
  // (kind, id) pairs, applied after put_records; deleting a missing one is not an error.
  std::vector<std::pair<std::string, std::string>> delete_records;
  // When > 0, deletes every record whose expires_ms is in 1..this (after the puts and deletes).
  int64_t delete_records_expired_at_ms = 0;

  bool empty() const {
    return put_jobs.empty() && put_nodes.empty() && delete_nodes.empty() && put_records.empty() &&
           delete_records.empty() && delete_records_expired_at_ms <= 0;
  }
};

struct JobStoreStats {
  int64_t batches = 0;       // WriteBatches committed
  int64_t transactions = 0;  // durable commits (each one fsync); <= batches thanks to group commit
  double last_commit_seconds = 0;  // wall time of the latest transaction, fsync included
};

// Thread-safe: every method may be called from any thread, concurrently.
class JobStore {
 public:
  using DoneCallback = std::function<void(absl::Status)>;

  virtual ~JobStore() = default;

  // Queues `batch` and returns at once. `done` runs exactly once, on a thread owned by the store,
  // after the batch is durable (OK) or has failed (an error, nothing of the batch applied).
  // Batches are applied in the order of the calls. Batches queued while a transaction is being
  // written share the next transaction and its fsync (group commit). `done` must not block long
  // and must not call Commit synchronously (CommitSync) on the same store; it may call Commit.
  virtual void Commit(WriteBatch batch, DoneCallback done) = 0;

  // Commit, waiting for the result.
  absl::Status CommitSync(WriteBatch batch);

  // Every job, ordered by seq ascending.
  virtual absl::StatusOr<std::vector<StoredJob>> LoadJobs() = 0;
  // Every node, ordered by id.
  virtual absl::StatusOr<std::vector<StoredNode>> LoadNodes() = 0;
  // Every record of `kind`, ordered by id.
  virtual absl::StatusOr<std::vector<StoredRecord>> LoadRecords(const std::string& kind) = 0;

  // Point reads, for what the coordinator no longer keeps in memory (finished jobs past their
  // retention, their logs and metrics). NOT_FOUND when there is no such row.
  virtual absl::StatusOr<StoredJob> GetJob(const std::string& id) = 0;
  virtual absl::StatusOr<StoredRecord> GetRecord(const std::string& kind,
                                                 const std::string& id) = 0;
  // The jobs `query` selects, newest (highest seq) first.
  virtual absl::StatusOr<std::vector<StoredJob>> ListJobs(const JobQuery& query) = 0;

  virtual JobStoreStats Stats() const = 0;
  // Writes a consistent copy of everything stored, as of one instant, to a new file at `path`
  // (which must not exist), while the store keeps serving: for SQLite, its online backup API over
  // a read transaction. FAILED_PRECONDITION for a store that keeps no such copy.
  virtual absl::Status Backup(const std::string& path) = 0;
};

struct JobStoreOptions {
  // When false, each batch gets a transaction of its own (one fsync each); for benchmarks only.
  bool group_commit = true;
  // Called on the commit thread after each durable transaction with its duration (for metrics).
  std::function<void(double seconds)> on_commit;
  // PostgreSQL: when > 0, every transaction commits only while this epoch holds the leader's lease
  // (leader_lease.h); otherwise it fails with UNAVAILABLE ("passed to another coordinator") and
  // applies nothing, and on_fenced runs (once, on the commit thread).
  int64_t fence_epoch = 0;
  std::function<void()> on_fenced;
  // PostgreSQL: the longest the server lets a write transaction wait on this process between
  // statements before it ends the session, rolling the transaction back and releasing its locks
  // (idle_in_transaction_session_timeout). A leader sets it shorter than its lease, so that a
  // coordinator paused inside a transaction holds nothing a new leader needs once its lease can
  // have passed on. Zero: no limit.
  absl::Duration idle_in_transaction_limit = absl::ZeroDuration();
  // Tests only: runs on the commit thread inside each write transaction, after its rows and before
  // the fence and the commit (where a paused process leaves its session idle in transaction).
  std::function<void()> before_commit;
};
using SqliteJobStoreOptions = JobStoreOptions;
using PostgresJobStoreOptions = JobStoreOptions;

// Opens (creating if needed) the SQLite database at `path`: WAL journal, synchronous=FULL, schema
// versioned by PRAGMA user_version and migrated forward on open. Errors: a path that cannot be
// opened, or a database written by a newer schema version (FAILED_PRECONDITION).
absl::StatusOr<std::unique_ptr<JobStore>> OpenSqliteJobStore(
    const std::string& path, const SqliteJobStoreOptions& options = {});

// Makes the SQLite database at `path` (which must not exist) a copy of the backup at `backup`
// (JobStore::Backup's file), checked first: INVALID_ARGUMENT naming `backup` for a file that is not
// a trainyard coordinator's database, DATA_LOSS for one that fails SQLite's integrity check,
// FAILED_PRECONDITION for one of a newer schema than this build knows.
absl::Status RestoreSqliteBackup(const std::string& backup, const std::string& path);

// Whether `location` names a PostgreSQL database: a libpq URI (postgresql://... or postgres://...).
bool IsPostgresLocation(const std::string& location);

// Connects to the PostgreSQL database `uri` (a libpq URI; the password, if one is needed, comes
// from libpq's password file or PGPASSWORD, never from the URI: INVALID_ARGUMENT for a URI that
// holds one, since the coordinator's argv is visible to every local user). Creates the schema or
// migrates it forward, under an advisory lock so that replicas starting together do not both
// migrate. Every session commits synchronously (synchronous_commit=on whatever the server's
// default): a batch is acknowledged only once the server has flushed it. Errors: UNAVAILABLE for a
// server that cannot be reached (with libpq's reason), FAILED_PRECONDITION for a schema newer than
// this build knows, UNIMPLEMENTED in a build without libpq. A lost connection is re-established
// at the next commit or read; a commit whose COMMIT was sent but never answered fails with
// UNAVAILABLE, and may have been applied.
absl::StatusOr<std::unique_ptr<JobStore>> OpenPostgresJobStore(
    const std::string& uri, const PostgresJobStoreOptions& options = {});

// The store `location` names: a PostgreSQL URI (OpenPostgresJobStore) or a SQLite file's path
// (OpenSqliteJobStore).
absl::StatusOr<std::unique_ptr<JobStore>> OpenJobStore(const std::string& location,
                                                       const JobStoreOptions& options = {});

// The host and database of a PostgreSQL URI, for logs ("db on /run/postgresql:5432"); never the
// user's password or other options.
std::string DescribePostgresLocation(const std::string& uri);

// A store that keeps everything in memory; durability ends with the process. For unit tests of
// logic above the store, and as a second backend that the shared store test suite runs.
std::unique_ptr<JobStore> NewInMemoryJobStore();

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_JOB_STORE_H_
