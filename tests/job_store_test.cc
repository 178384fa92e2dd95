// Tests of the JobStore backends: one shared suite (JobStoreTest) that every backend runs through
// a factory (SQLite, PostgreSQL on a private server the test starts, in-memory), the durable
// backends' suite (reopening, group commit accounting), then SQLite-only and PostgreSQL-only tests
// (schema, migrations, errors).
#include "server/coordinator/job_store.h"

#include <sqlite3.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator/leader_lease.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/subprocess.h"

namespace trainyard::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::trainyard::testing::TempDir;

StoredJob Job(int64_t seq, std::string payload = "", std::string owner = "alice",
              std::string state = "QUEUED") {
  return StoredJob{absl::StrCat("job-", seq), seq, std::move(owner), std::move(state),
                   payload.empty() ? absl::StrCat("payload-", seq) : std::move(payload)};
}

WriteBatch PutJobs(std::vector<StoredJob> jobs) {
  WriteBatch batch;
  batch.put_jobs = std::move(jobs);
  return batch;
}

WriteBatch PutNodes(std::vector<StoredNode> nodes) {
  WriteBatch batch;
  batch.put_nodes = std::move(nodes);
  return batch;
}

// Every byte value, NULs included, and a NUL at both ends.
std::string BinaryPayload() {
  std::string payload(1, '\0');
  for (int i = 0; i < 256; ++i) payload.push_back(static_cast<char>(i));
  payload.push_back('\0');
  return payload;
}

std::vector<int64_t> Seqs(const std::vector<StoredJob>& jobs) {
  std::vector<int64_t> seqs;
  for (const StoredJob& job : jobs) seqs.push_back(job.seq);
  return seqs;
}

// Parks the store's callback thread inside the callback of a first batch, so that batches
// committed meanwhile queue up behind it; Release() lets it go on. Used to make grouping
// deterministic. One test thread uses it.
class CallbackThreadParker {
 public:
  CallbackThreadParker(JobStore& store, WriteBatch first) {
    store.Commit(std::move(first), [this](absl::Status status) {
      first_status_ = std::move(status);
      parked_.Notify();
      release_.WaitForNotification();
    });
    parked_.WaitForNotification();
  }
  ~CallbackThreadParker() { Release(); }

  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
  }
  const absl::Status& first_status() const { return first_status_; }

 private:
  absl::Status first_status_;
  absl::Notification parked_;
  absl::Notification release_;
};

// Collects the statuses of asynchronous commits; Wait() returns once all `count` have arrived.
// Callbacks run on the store's thread; the test thread calls Wait and statuses.
class Results {
 public:
  explicit Results(int count) : statuses_(count), pending_(count) {}

  JobStore::DoneCallback Callback(int index) {
    return [this, index](absl::Status status) {
      {
        absl::MutexLock lock(&mu_);
        statuses_[index] = std::move(status);
      }
      pending_.DecrementCount();
    };
  }
  void Wait() { pending_.Wait(); }
  std::vector<absl::Status> statuses() {
    absl::MutexLock lock(&mu_);
    return statuses_;
  }

 private:
  absl::Mutex mu_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  absl::BlockingCounter pending_;
};

struct Backend {
  std::string name;
  // Opens the store kept in `dir`; opening again on the same dir sees the same data if `durable`.
  std::function<absl::StatusOr<std::unique_ptr<JobStore>>(const std::string& dir,
                                                          const JobStoreOptions& options)>
      open;
  bool durable = false;
  // Why this backend cannot run here (the test is skipped), or empty.
  std::function<std::string()> unavailable = [] { return std::string(); };
};

// So that gtest names the backend instead of dumping its bytes.
void PrintTo(const Backend& backend, std::ostream* os) { *os << backend.name; }

// The database of the shared test server that stands for `dir` (one per test), created at its
// first use.
absl::StatusOr<std::string> PostgresUriFor(const std::string& dir) {
  std::string why;
  testing::PostgresServer* server = testing::SharedPostgresServer(&why);
  if (server == nullptr) return absl::FailedPreconditionError(why);
  std::string name = "t_" + dir.substr(dir.rfind('/') + 1);
  for (char& c : name) c = (c == '-') ? '_' : c;
  static std::set<std::string>* created = new std::set<std::string>();
  if (created->insert(name).second) {
    absl::Status status = server->CreateDatabase(name);
    if (!status.ok()) return status;
  }
  return server->Uri(name);
}

std::string PostgresUnavailable() {
  std::string why;
  return testing::SharedPostgresServer(&why) == nullptr ? why : "";
}

const Backend kBackends[] = {
    {"Sqlite",
     [](const std::string& dir, const JobStoreOptions& options) {
       return OpenSqliteJobStore(dir + "/jobs.db", options);
     },
     /*durable=*/true},
    {"Postgres",
     [](const std::string& dir,
        const JobStoreOptions& options) -> absl::StatusOr<std::unique_ptr<JobStore>> {
       absl::StatusOr<std::string> uri = PostgresUriFor(dir);
       if (!uri.ok()) return uri.status();
       return OpenPostgresJobStore(*uri, options);
     },
     /*durable=*/true, PostgresUnavailable},
    {"InMemory",
     [](const std::string& dir, const JobStoreOptions& options)
         -> absl::StatusOr<std::unique_ptr<JobStore>> { return NewInMemoryJobStore(); },
     /*durable=*/false},
};

class JobStoreTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    if (const std::string why = GetParam().unavailable(); !why.empty()) {
      GTEST_SKIP() << "no " << GetParam().name << " here: " << why;
    }
    Reopen();
  }

  void Reopen(const JobStoreOptions& options = {}) {
    store_.reset();
    auto store = GetParam().open(dir_.path(), options);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }

  std::vector<StoredJob> LoadJobs() {
    auto jobs = store_->LoadJobs();
    EXPECT_TRUE(jobs.ok()) << jobs.status();
    return jobs.ok() ? *jobs : std::vector<StoredJob>{};
  }

  std::vector<StoredNode> LoadNodes() {
    auto nodes = store_->LoadNodes();
    EXPECT_TRUE(nodes.ok()) << nodes.status();
    return nodes.ok() ? *nodes : std::vector<StoredNode>{};
  }

  TempDir dir_;
  std::unique_ptr<JobStore> store_;
};

TEST_P(JobStoreTest, RoundTripsJobsAndNodesWithBinaryPayloads) {
  const StoredJob binary_job{"job-1", 1, "alice", "QUEUED", BinaryPayload()};
  const StoredJob nul_only_job{"job-2", 2, "bob", "RUNNING", std::string(3, '\0')};
  const StoredJob empty_job{"job-3", 3, "carol", "FAILED", ""};
  const StoredNode binary_node{"node-a", BinaryPayload()};
  const StoredNode empty_node{"node-b", ""};
  WriteBatch batch;
  batch.put_jobs = {binary_job, nul_only_job, empty_job};
  batch.put_nodes = {binary_node, empty_node};
  ASSERT_TRUE(store_->CommitSync(batch).ok());

  EXPECT_THAT(LoadJobs(), ElementsAre(binary_job, nul_only_job, empty_job));
  EXPECT_THAT(LoadNodes(), ElementsAre(binary_node, empty_node));
  EXPECT_EQ(LoadJobs()[0].payload.size(), 258u);
}

TEST_P(JobStoreTest, EmptyStoreLoadsNothing) {
  EXPECT_THAT(LoadJobs(), IsEmpty());
  EXPECT_THAT(LoadNodes(), IsEmpty());
}

TEST_P(JobStoreTest, PutJobWithExistingIdReplacesItAndFreesItsOldSeq) {
  ASSERT_TRUE(store_->CommitSync(PutJobs({Job(1, "v1")})).ok());
  const StoredJob replaced{"job-1", 5, "alice", "RUNNING", "v2"};
  ASSERT_TRUE(store_->CommitSync(PutJobs({replaced})).ok());
  EXPECT_THAT(LoadJobs(), ElementsAre(replaced));

  // Seq 1 is free again once job-1 moved to seq 5.
  ASSERT_TRUE(store_->CommitSync(PutJobs({{"job-other", 1, "bob", "QUEUED", "x"}})).ok());
  EXPECT_THAT(Seqs(LoadJobs()), ElementsAre(1, 5));
}

TEST_P(JobStoreTest, PutNodeWithExistingIdReplacesItsPayload) {
  ASSERT_TRUE(store_->CommitSync(PutNodes({{"node-a", "old"}, {"node-b", "b"}})).ok());
  ASSERT_TRUE(store_->CommitSync(PutNodes({{"node-a", "new"}})).ok());
  EXPECT_THAT(LoadNodes(), ElementsAre(StoredNode{"node-a", "new"}, StoredNode{"node-b", "b"}));
}

TEST_P(JobStoreTest, DeleteNodeRemovesOnlyThatNodeAndIgnoresMissingIds) {
  ASSERT_TRUE(store_->CommitSync(PutNodes({{"node-a", "a"}, {"node-b", "b"}})).ok());
  WriteBatch batch;
  batch.delete_nodes = {"node-a", "node-never-existed"};
  ASSERT_TRUE(store_->CommitSync(batch).ok());
  EXPECT_THAT(LoadNodes(), ElementsAre(StoredNode{"node-b", "b"}));
}

TEST_P(JobStoreTest, BatchAppliesPutsBeforeDeletesOfTheSameNode) {
  WriteBatch batch;
  batch.put_nodes = {{"node-a", "a"}, {"node-b", "b"}};
  batch.delete_nodes = {"node-a"};
  ASSERT_TRUE(store_->CommitSync(batch).ok());
  EXPECT_THAT(LoadNodes(), ElementsAre(StoredNode{"node-b", "b"}));
}

TEST_P(JobStoreTest, LoadJobsOrdersBySeqNotByIdOrCommitOrder) {
  ASSERT_TRUE(store_->CommitSync(PutJobs({{"a", 30, "u", "QUEUED", "p"}})).ok());
  ASSERT_TRUE(
      store_->CommitSync(PutJobs({{"b", 10, "u", "QUEUED", "p"}, {"c", 20, "u", "QUEUED", "p"}}))
          .ok());
  ASSERT_TRUE(store_->CommitSync(PutJobs({{"d", -5, "u", "QUEUED", "p"}})).ok());
  const std::vector<StoredJob> jobs = LoadJobs();
  EXPECT_THAT(Seqs(jobs), ElementsAre(-5, 10, 20, 30));
  ASSERT_EQ(jobs.size(), 4u);
  EXPECT_EQ(jobs[0].id, "d");
  EXPECT_EQ(jobs[3].id, "a");
}

TEST_P(JobStoreTest, LoadNodesOrdersById) {
  ASSERT_TRUE(store_->CommitSync(PutNodes({{"n3", "3"}, {"n1", "1"}, {"n2", "2"}})).ok());
  EXPECT_THAT(LoadNodes(),
              ElementsAre(StoredNode{"n1", "1"}, StoredNode{"n2", "2"}, StoredNode{"n3", "3"}));
}

TEST_P(JobStoreTest, BatchWithDuplicateSeqFailsAsAWholeAndAppliesNothing) {
  const StoredJob existing = Job(1, "existing");
  ASSERT_TRUE(store_->CommitSync(PutJobs({existing})).ok());

  // Two new jobs with the same seq, plus other writes that must not survive the failure.
  WriteBatch within;
  within.put_jobs = {Job(2), {"job-dup", 2, "bob", "QUEUED", "x"}};
  within.put_nodes = {{"node-a", "a"}};
  const absl::Status within_status = store_->CommitSync(within);
  EXPECT_FALSE(within_status.ok());

  // A new job taking the seq of an existing one, after a replacement of that existing job.
  WriteBatch against_existing;
  against_existing.put_jobs = {{"job-1", 1, "alice", "RUNNING", "changed"},
                               Job(3),
                               {"job-thief", 1, "mallory", "QUEUED", "x"}};
  const absl::Status against_status = store_->CommitSync(against_existing);
  EXPECT_FALSE(against_status.ok());

  EXPECT_THAT(LoadJobs(), ElementsAre(existing));
  EXPECT_THAT(LoadNodes(), IsEmpty());
  // The store stays usable.
  ASSERT_TRUE(store_->CommitSync(PutJobs({Job(2)})).ok());
  EXPECT_THAT(Seqs(LoadJobs()), ElementsAre(1, 2));
}

TEST_P(JobStoreTest, FailingBatchDoesNotFailBatchesQueuedBesideIt) {
  ASSERT_TRUE(store_->CommitSync(PutJobs({Job(1)})).ok());
  Results results(3);
  {
    // Park the callback thread so that the three batches below are written together.
    CallbackThreadParker parker(*store_, PutJobs({Job(2)}));
    store_->Commit(PutJobs({Job(3)}), results.Callback(0));
    store_->Commit(PutJobs({Job(4), {"job-dup", 1, "bob", "QUEUED", "x"}}), results.Callback(1));
    store_->Commit(PutJobs({Job(5)}), results.Callback(2));
    parker.Release();
    results.Wait();
    EXPECT_TRUE(parker.first_status().ok()) << parker.first_status();
  }
  const std::vector<absl::Status> statuses = results.statuses();
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_FALSE(statuses[1].ok());
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  EXPECT_THAT(Seqs(LoadJobs()), ElementsAre(1, 2, 3, 5));
}

TEST_P(JobStoreTest, EmptyBatchSucceeds) {
  EXPECT_TRUE(store_->CommitSync(WriteBatch{}).ok());
  EXPECT_THAT(LoadJobs(), IsEmpty());
}

TEST_P(JobStoreTest, CallbacksRunExactlyOnceInCommitOrder) {
  constexpr int kBatches = 300;
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<int> calls(kBatches, 0);
  absl::BlockingCounter pending(kBatches);
  for (int i = 0; i < kBatches; ++i) {
    // Every fifth batch fails (seq 0 is taken by job-0), so failures are ordered too.
    WriteBatch batch = PutJobs({Job(i)});
    if (i % 5 == 4) batch.put_jobs.push_back({absl::StrCat("dup-", i), 0, "u", "QUEUED", "x"});
    store_->Commit(std::move(batch), [&, i](absl::Status status) {
      absl::MutexLock lock(&mu);
      order.push_back(i);
      ++calls[i];
      EXPECT_EQ(status.ok(), i % 5 != 4) << "batch " << i << ": " << status;
      pending.DecrementCount();
    });
  }
  pending.Wait();
  store_.reset();  // after this no callback can run any more
  std::vector<int> expected_order(kBatches);
  for (int i = 0; i < kBatches; ++i) expected_order[i] = i;
  EXPECT_EQ(order, expected_order);
  EXPECT_EQ(calls, std::vector<int>(kBatches, 1));
}

TEST_P(JobStoreTest, CallbackMayCommitAgain) {
  absl::Notification second_done;
  absl::Status second_status;
  store_->Commit(PutJobs({Job(1)}), [&](absl::Status status) {
    EXPECT_TRUE(status.ok()) << status;
    store_->Commit(PutJobs({Job(2)}), [&](absl::Status status) {
      second_status = status;
      second_done.Notify();
    });
  });
  second_done.WaitForNotification();
  EXPECT_TRUE(second_status.ok()) << second_status;
  EXPECT_THAT(Seqs(LoadJobs()), ElementsAre(1, 2));
}

TEST_P(JobStoreTest, ConcurrentCommitsFromEightThreadsAllLand) {
  constexpr int kThreads = 8;
  constexpr int kBatchesPerThread = 50;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kBatchesPerThread; ++i) {
        WriteBatch batch = PutJobs({Job(t * 1000 + i)});
        batch.put_nodes = {{absl::StrCat("node-", t), absl::StrCat(i)}};
        if (!store_->CommitSync(std::move(batch)).ok()) ++failures;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);

  std::vector<int64_t> expected_seqs;
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kBatchesPerThread; ++i) expected_seqs.push_back(t * 1000 + i);
  }
  EXPECT_EQ(Seqs(LoadJobs()), expected_seqs);
  const std::vector<StoredNode> nodes = LoadNodes();
  ASSERT_EQ(nodes.size(), static_cast<size_t>(kThreads));
  for (const StoredNode& node : nodes) EXPECT_EQ(node.payload, "49") << node.id;
  const JobStoreStats stats = store_->Stats();
  EXPECT_EQ(stats.batches, kThreads * kBatchesPerThread);
  EXPECT_GE(stats.transactions, 1);
  EXPECT_LE(stats.transactions, stats.batches);
}

TEST_P(JobStoreTest, LoadsSeeEveryBatchWhoseCallbackRan) {
  constexpr int kBatches = 200;
  constexpr int kMinLoads = 20;
  std::atomic<int> acked{0};
  std::atomic<bool> stop{false};
  std::atomic<int> loads{0};
  // A reader that checks that each load holds at least every batch acknowledged before it began.
  std::thread reader([&] {
    do {
      const int acked_before = acked.load();
      auto jobs = store_->LoadJobs();
      ASSERT_TRUE(jobs.ok()) << jobs.status();
      ASSERT_GE(static_cast<int>(jobs->size()), acked_before);
      ++loads;
    } while (!stop.load() || loads.load() < kMinLoads);
  });
  absl::BlockingCounter pending(kBatches);
  for (int i = 0; i < kBatches; ++i) {
    store_->Commit(PutJobs({Job(i)}), [&, i](absl::Status status) {
      EXPECT_TRUE(status.ok()) << status;
      ++acked;
      if (i % 10 == 0) {  // a load from inside the callback sees the batch being acknowledged
        auto jobs = store_->LoadJobs();
        EXPECT_TRUE(jobs.ok() && jobs->size() >= static_cast<size_t>(i + 1)) << "batch " << i;
      }
      pending.DecrementCount();
    });
  }
  pending.Wait();
  stop = true;
  reader.join();
  EXPECT_GE(loads.load(), kMinLoads);
  EXPECT_EQ(LoadJobs().size(), static_cast<size_t>(kBatches));
}

TEST_P(JobStoreTest, RecordsRoundTripByKindOrderedByIdAndReplaceById) {
  WriteBatch batch;
  batch.put_records = {{"user", "bob", "b"},
                       {"token", "00ff", BinaryPayload()},
                       {"user", "alice", "a"},
                       {"user", "carol", ""}};
  ASSERT_TRUE(store_->CommitSync(batch).ok());
  WriteBatch replace;
  replace.put_records = {{"user", "bob", "b2"}};
  ASSERT_TRUE(store_->CommitSync(replace).ok());

  auto users = store_->LoadRecords("user");
  ASSERT_TRUE(users.ok()) << users.status();
  EXPECT_THAT(*users,
              ElementsAre(StoredRecord{"user", "alice", "a"}, StoredRecord{"user", "bob", "b2"},
                          StoredRecord{"user", "carol", ""}));
  EXPECT_THAT(*store_->LoadRecords("token"),
              ElementsAre(StoredRecord{"token", "00ff", BinaryPayload()}));
  EXPECT_THAT(*store_->LoadRecords("account"), IsEmpty());
}

TEST_P(JobStoreTest, BatchWithDuplicateSeqAppliesNoneOfItsRecords) {
  ASSERT_TRUE(store_->CommitSync(PutJobs({Job(1)})).ok());
  WriteBatch batch;
  batch.put_jobs = {{"job-other", 1, "bob", "QUEUED", "x"}};
  batch.put_records = {{"user", "bob", "b"}};
  EXPECT_FALSE(store_->CommitSync(batch).ok());
  EXPECT_THAT(*store_->LoadRecords("user"), IsEmpty());
}

TEST_P(JobStoreTest, GetJobAndGetRecordReadOneRowOrSayNotFound) {
  const StoredJob job{"job-3", 3, "bob", "SUCCEEDED", BinaryPayload()};
  WriteBatch batch;
  batch.put_jobs = {Job(1), job};
  batch.put_records = {{"job_logs", "job-3", BinaryPayload(), 1234}};
  ASSERT_TRUE(store_->CommitSync(batch).ok());

  auto got = store_->GetJob("job-3");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, job);
  EXPECT_EQ(store_->GetJob("job-2").status().code(), absl::StatusCode::kNotFound);
  auto record = store_->GetRecord("job_logs", "job-3");
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(*record, (StoredRecord{"job_logs", "job-3", BinaryPayload(), 1234}));
  EXPECT_EQ(store_->GetRecord("job_metrics", "job-3").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->GetRecord("job_logs", "job-1").status().code(), absl::StatusCode::kNotFound);
}

TEST_P(JobStoreTest, ListJobsPagesNewestFirstByOwnerAndState) {
  WriteBatch batch;
  for (int64_t seq = 1; seq <= 9; ++seq) {
    batch.put_jobs.push_back(
        Job(seq, "", seq % 3 == 0 ? "bob" : "alice", seq % 2 == 0 ? "SUCCEEDED" : "FAILED"));
  }
  ASSERT_TRUE(store_->CommitSync(batch).ok());
  auto list = [&](std::string owner, std::vector<std::string> states, size_t limit = 100,
                  int64_t before_seq = std::numeric_limits<int64_t>::max()) {
    JobQuery q;
    q.before_seq = before_seq;
    q.owner = std::move(owner);
    q.states = std::move(states);
    q.limit = limit;
    auto jobs = store_->ListJobs(q);
    EXPECT_TRUE(jobs.ok()) << jobs.status();
    return jobs.ok() ? Seqs(*jobs) : std::vector<int64_t>{};
  };
  EXPECT_THAT(list("", {}), ElementsAre(9, 8, 7, 6, 5, 4, 3, 2, 1));
  EXPECT_THAT(list("", {}, 3), ElementsAre(9, 8, 7));
  EXPECT_THAT(list("", {}, 3, 7), ElementsAre(6, 5, 4));
  EXPECT_THAT(list("bob", {}), ElementsAre(9, 6, 3));
  EXPECT_THAT(list("", {"SUCCEEDED"}), ElementsAre(8, 6, 4, 2));
  EXPECT_THAT(list("alice", {"FAILED", "CANCELLED"}), ElementsAre(7, 5, 1));
  // A state name is matched whole, not as a part of a longer one.
  EXPECT_THAT(list("", {"FAIL"}), IsEmpty());
  EXPECT_THAT(list("carol", {}), IsEmpty());
  EXPECT_THAT(list("", {}, 100, 1), IsEmpty());
}

TEST_P(JobStoreTest, ExpiredRecordsGoAndTheOthersStay) {
  WriteBatch batch;
  batch.put_records = {{"job_logs", "a", "1", 100},
                       {"job_logs", "b", "2", 200},
                       {"job_logs", "c", "3", 0},
                       {"user", "alice", "u", 0}};
  ASSERT_TRUE(store_->CommitSync(batch).ok());
  WriteBatch expire;
  expire.delete_records_expired_at_ms = 150;
  EXPECT_FALSE(expire.empty());
  ASSERT_TRUE(store_->CommitSync(expire).ok());
  EXPECT_THAT(*store_->LoadRecords("job_logs"), ElementsAre(StoredRecord{"job_logs", "b", "2", 200},
                                                            StoredRecord{"job_logs", "c", "3", 0}));
  expire.delete_records_expired_at_ms = 200;
  ASSERT_TRUE(store_->CommitSync(expire).ok());
  EXPECT_THAT(*store_->LoadRecords("job_logs"), ElementsAre(StoredRecord{"job_logs", "c", "3", 0}));
  EXPECT_THAT(*store_->LoadRecords("user"), ElementsAre(StoredRecord{"user", "alice", "u", 0}));
}

// Only the backends that keep their data across opening: the in-memory store starts empty.
class DurableJobStoreTest : public JobStoreTest {};

TEST_P(DurableJobStoreTest, ReopenSeesEverythingCommitted) {
  const StoredJob job1 = Job(1, BinaryPayload());
  const StoredJob job2{"job-2", 2, "bob", "RUNNING", "p2"};
  ASSERT_TRUE(store_->CommitSync(PutJobs({job1, job2})).ok());
  ASSERT_TRUE(store_->CommitSync(PutNodes({{"node-a", "a"}, {"node-b", "b"}})).ok());
  WriteBatch batch;
  batch.delete_nodes = {"node-a"};
  ASSERT_TRUE(store_->CommitSync(batch).ok());

  WriteBatch records;
  records.put_records = {{"token", "t1", BinaryPayload()}};
  ASSERT_TRUE(store_->CommitSync(records).ok());

  Reopen();
  EXPECT_THAT(LoadJobs(), ElementsAre(job1, job2));
  EXPECT_THAT(LoadNodes(), ElementsAre(StoredNode{"node-b", "b"}));
  EXPECT_THAT(*store_->LoadRecords("token"),
              ElementsAre(StoredRecord{"token", "t1", BinaryPayload()}));
  // And it takes new writes after reopening.
  ASSERT_TRUE(store_->CommitSync(PutJobs({Job(3)})).ok());
  Reopen();
  EXPECT_THAT(Seqs(LoadJobs()), ElementsAre(1, 2, 3));
}

// Commits `batches` while the callback thread is parked in the callback of a batch 0 (job 0), so
// that all of them are queued before any is written; waits for all of them.
std::vector<absl::Status> CommitQueuedBehindParked(JobStore& store,
                                                   std::vector<WriteBatch> batches) {
  Results results(static_cast<int>(batches.size()));
  CallbackThreadParker parker(store, PutJobs({Job(0)}));
  for (size_t i = 0; i < batches.size(); ++i) {
    store.Commit(std::move(batches[i]), results.Callback(static_cast<int>(i)));
  }
  parker.Release();
  results.Wait();
  EXPECT_TRUE(parker.first_status().ok()) << parker.first_status();
  return results.statuses();
}

TEST_P(DurableJobStoreTest, GroupsBatchesQueuedDuringATransactionIntoOneTransaction) {
  JobStore* store = store_.get();
  std::vector<WriteBatch> batches;
  for (int i = 1; i <= 10; ++i) batches.push_back(PutJobs({Job(i)}));
  for (const absl::Status& status : CommitQueuedBehindParked(*store, std::move(batches))) {
    EXPECT_TRUE(status.ok()) << status;
  }
  const JobStoreStats stats = store->Stats();
  EXPECT_EQ(stats.batches, 11);
  EXPECT_EQ(stats.transactions, 2);  // batch 0 alone, then batches 1..10 together
  EXPECT_GT(stats.last_commit_seconds, 0);
  EXPECT_EQ(store->LoadJobs()->size(), 11u);
}

TEST_P(DurableJobStoreTest, WithoutGroupCommitEachBatchGetsItsOwnTransaction) {
  JobStoreOptions options;
  options.group_commit = false;
  Reopen(options);
  JobStore* store = store_.get();
  std::vector<WriteBatch> batches;
  for (int i = 1; i <= 10; ++i) batches.push_back(PutJobs({Job(i)}));
  for (const absl::Status& status : CommitQueuedBehindParked(*store, std::move(batches))) {
    EXPECT_TRUE(status.ok()) << status;
  }
  const JobStoreStats stats = store->Stats();
  EXPECT_EQ(stats.batches, 11);
  EXPECT_EQ(stats.transactions, 11);
}

TEST_P(DurableJobStoreTest, BadBatchInAGroupFallsBackToOneTransactionPerBatch) {
  JobStore* store = store_.get();
  std::vector<WriteBatch> batches;
  batches.push_back(PutJobs({Job(1)}));
  batches.push_back(PutJobs({Job(2), {"job-dup", 1, "bob", "QUEUED", "x"}}));  // seq 1 twice
  batches.push_back(PutJobs({Job(3)}));
  const std::vector<absl::Status> statuses = CommitQueuedBehindParked(*store, std::move(batches));
  ASSERT_EQ(statuses.size(), 3u);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kAlreadyExists) << statuses[1];
  EXPECT_THAT(statuses[1].message(), HasSubstr("job-dup"));
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  const JobStoreStats stats = store->Stats();
  EXPECT_EQ(stats.batches, 3);  // the parked batch and the two good ones
  // The parked batch alone; then, after the group of three failed, one for each good batch (the
  // bad batch's own transaction was rolled back).
  EXPECT_EQ(stats.transactions, 3);
  EXPECT_THAT(Seqs(*store->LoadJobs()), ElementsAre(0, 1, 3));
}

TEST_P(JobStoreTest, DestructorCommitsQueuedBatchesAndRunsEveryCallback) {
  constexpr int kBatches = 100;
  std::atomic<int> ok{0};
  std::atomic<int> failed{0};
  {
    CallbackThreadParker parker(*store_, PutJobs({Job(0)}));
    for (int i = 1; i <= kBatches; ++i) {
      store_->Commit(PutJobs({Job(i)}),
                     [&](absl::Status status) { ++(status.ok() ? ok : failed); });
    }
    // The batches are all still queued: the callback thread is parked. Destroy the store while it
    // is released; the destructor must write and acknowledge all of them.
    parker.Release();
    store_.reset();
  }
  EXPECT_EQ(ok.load(), kBatches);
  EXPECT_EQ(failed.load(), 0);
  if (GetParam().durable) {
    Reopen();
    EXPECT_EQ(LoadJobs().size(), static_cast<size_t>(kBatches + 1));
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, JobStoreTest, ::testing::ValuesIn(kBackends),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param.name;
                         });

std::vector<Backend> DurableBackends() {
  std::vector<Backend> durable;
  for (const Backend& b : kBackends) {
    if (b.durable) durable.push_back(b);
  }
  return durable;
}

INSTANTIATE_TEST_SUITE_P(DurableBackends, DurableJobStoreTest,
                         ::testing::ValuesIn(DurableBackends()),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param.name;
                         });

// ---- SQLite only ----

// Runs `sql` on the database at `path` with a connection of its own; returns the first column of
// the first row (empty if none), or "error: ...".
std::string QuerySqlite(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  std::string result;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK) {
    result = absl::StrCat("error: ", sqlite3_errmsg(db));
    sqlite3_close_v2(db);
    return result;
  }
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
    result = absl::StrCat("error: ", sqlite3_errmsg(db));
  } else {
    const int rc = sqlite3_step(stmt);
    if (rc == SQLITE_ROW) {
      const unsigned char* text = sqlite3_column_text(stmt, 0);
      result = text != nullptr ? reinterpret_cast<const char*>(text) : "";
    } else if (rc != SQLITE_DONE) {
      result = absl::StrCat("error: ", sqlite3_errmsg(db));
    }
  }
  sqlite3_finalize(stmt);
  sqlite3_close_v2(db);
  return result;
}

class SqliteJobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()); }

  std::unique_ptr<JobStore> Open(SqliteJobStoreOptions options = {}) {
    auto store = OpenSqliteJobStore(db_path_, options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }

  TempDir dir_;
  const std::string db_path_ = dir_.path() + "/jobs.db";
};

TEST_F(SqliteJobStoreTest, CreatesSchemaVersion3InWalModeWithIndexes) {
  ASSERT_NE(Open(), nullptr);
  EXPECT_EQ(QuerySqlite(db_path_, "PRAGMA user_version"), "3");
  EXPECT_EQ(QuerySqlite(db_path_, "PRAGMA journal_mode"), "wal");
  EXPECT_EQ(QuerySqlite(db_path_,
                        "SELECT group_concat(name, ',') FROM (SELECT name FROM sqlite_master "
                        "WHERE type = 'index' AND name NOT LIKE 'sqlite_autoindex%' "
                        "ORDER BY name)"),
            "jobs_owner,jobs_owner_seq,jobs_state,records_expiry");
}

TEST_F(SqliteJobStoreTest, StoresJobColumnsAndBinaryPayloadsAsBlobs) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(
        store->CommitSync(PutJobs({{"job-7", 7, "alice", "RUNNING", BinaryPayload()}})).ok());
  }
  EXPECT_EQ(QuerySqlite(db_path_,
                        "SELECT owner || '/' || state || '/' || typeof(payload) || '/' || "
                        "length(payload) FROM jobs WHERE seq = 7"),
            "alice/RUNNING/blob/258");
  EXPECT_EQ(QuerySqlite(db_path_, "SELECT count(*) FROM jobs WHERE owner = 'alice'"), "1");
}

TEST_F(SqliteJobStoreTest, ReopeningTheCurrentVersionKeepsTheData) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->CommitSync(PutJobs({Job(1)})).ok());
  }
  auto store = Open();
  ASSERT_NE(store, nullptr);
  EXPECT_THAT(*store->LoadJobs(), ElementsAre(Job(1)));
  EXPECT_EQ(QuerySqlite(db_path_, "PRAGMA user_version"), "3");
}

TEST_F(SqliteJobStoreTest, MigratesAVersion1DatabaseKeepingItsJobs) {
  // The schema of version 1, as an older coordinator left it, with one job.
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(db_path_.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db,
                         "CREATE TABLE jobs (id TEXT PRIMARY KEY, seq INTEGER NOT NULL UNIQUE, "
                         "owner TEXT NOT NULL, state TEXT NOT NULL, payload BLOB NOT NULL); "
                         "CREATE INDEX jobs_owner ON jobs(owner); "
                         "CREATE INDEX jobs_state ON jobs(state); "
                         "CREATE TABLE nodes (id TEXT PRIMARY KEY, payload BLOB NOT NULL); "
                         "INSERT INTO jobs VALUES('job-1', 1, 'alice', 'QUEUED', x'00'); "
                         "PRAGMA user_version = 1;",
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close_v2(db);
  auto store = Open();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(QuerySqlite(db_path_, "PRAGMA user_version"), "3");
  EXPECT_THAT(*store->LoadJobs(),
              ElementsAre(StoredJob{"job-1", 1, "alice", "QUEUED", std::string(1, '\0')}));
  WriteBatch batch;
  batch.put_records = {{"user", "alice", "a"}};
  ASSERT_TRUE(store->CommitSync(batch).ok());
  EXPECT_THAT(*store->LoadRecords("user"), ElementsAre(StoredRecord{"user", "alice", "a"}));
}

TEST_F(SqliteJobStoreTest, MigratesAVersion2DatabaseKeepingItsRecordsWithoutExpiry) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(db_path_.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db,
                         "CREATE TABLE jobs (id TEXT PRIMARY KEY, seq INTEGER NOT NULL UNIQUE, "
                         "owner TEXT NOT NULL, state TEXT NOT NULL, payload BLOB NOT NULL); "
                         "CREATE INDEX jobs_owner ON jobs(owner); "
                         "CREATE INDEX jobs_state ON jobs(state); "
                         "CREATE TABLE nodes (id TEXT PRIMARY KEY, payload BLOB NOT NULL); "
                         "CREATE TABLE records (kind TEXT NOT NULL, id TEXT NOT NULL, "
                         "payload BLOB NOT NULL, PRIMARY KEY (kind, id)); "
                         "INSERT INTO records VALUES('user', 'alice', 'a'); "
                         "PRAGMA user_version = 2;",
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close_v2(db);
  auto store = Open();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(QuerySqlite(db_path_, "PRAGMA user_version"), "3");
  EXPECT_THAT(*store->LoadRecords("user"), ElementsAre(StoredRecord{"user", "alice", "a", 0}));
  WriteBatch expire;
  expire.delete_records_expired_at_ms = std::numeric_limits<int64_t>::max();
  ASSERT_TRUE(store->CommitSync(expire).ok());
  EXPECT_THAT(*store->LoadRecords("user"), ElementsAre(StoredRecord{"user", "alice", "a", 0}));
}

TEST_F(SqliteJobStoreTest, RefusesDatabaseWithNewerSchemaVersion) {
  ASSERT_NE(Open(), nullptr);
  ASSERT_EQ(QuerySqlite(db_path_, "PRAGMA user_version = 99"), "");
  auto store = OpenSqliteJobStore(db_path_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_THAT(store.status().message(), HasSubstr("schema version 99"));
  EXPECT_THAT(store.status().message(), HasSubstr("(3)"));
  EXPECT_EQ(QuerySqlite(db_path_, "PRAGMA user_version"), "99");  // left untouched
}

TEST_F(SqliteJobStoreTest, ReturnsErrorForPathInMissingDirectory) {
  const std::string path = dir_.path() + "/no/such/dir/jobs.db";
  auto store = OpenSqliteJobStore(path);
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(store.status().message(), HasSubstr(path));
}

TEST_F(SqliteJobStoreTest, ReturnsErrorForPathThatIsADirectory) {
  auto store = OpenSqliteJobStore(dir_.path());
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(store.status().message(), HasSubstr(dir_.path()));
}

TEST_F(SqliteJobStoreTest, ReturnsErrorForFileThatIsNotADatabase) {
  {
    std::ofstream out(db_path_, std::ios::binary);
    out << std::string(8192, 'x');
  }
  auto store = OpenSqliteJobStore(db_path_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDataLoss) << store.status();
}

}  // namespace
}  // namespace trainyard::coordinator

namespace trainyard::coordinator {
namespace {

// An online backup while eight threads commit: the copy, restored and opened, holds a consistent
// instant (every batch acknowledged before the backup began, and of the rest whole batches only)
// and the live store goes on. A second restore onto the same path is refused; so is a restore
// from a file that is not a store's.
TEST_F(SqliteJobStoreTest, OnlineBackupIsAConsistentInstantAndRestoresIntoANewDatabase) {
  auto store = OpenSqliteJobStore(db_path_);
  ASSERT_TRUE(store.ok()) << store.status();
  for (int64_t seq = 1; seq <= 100; ++seq) {
    ASSERT_TRUE((*store)->CommitSync(PutJobs({Job(seq)})).ok());
  }
  // Each batch puts a job and the node named after it: a torn copy would hold one without the
  // other.
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int t = 0; t < 8; ++t) {
    writers.emplace_back([&, t] {
      for (int64_t i = 0; !stop.load(); ++i) {
        const int64_t seq = 1000 + t * 100000 + i;
        WriteBatch batch = PutJobs({Job(seq)});
        batch.put_nodes.push_back({absl::StrCat("node-", seq), "n"});
        if (!(*store)->CommitSync(std::move(batch)).ok()) {
          ADD_FAILURE() << "a commit failed during the backup";
          return;
        }
      }
    });
  }
  const std::string backup = dir_.path() + "/copy.db";
  const absl::Status made = (*store)->Backup(backup);
  stop = true;
  for (auto& w : writers) w.join();
  ASSERT_TRUE(made.ok()) << made;
  EXPECT_EQ((*store)->Backup(backup).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE((*store)->CommitSync(PutJobs({Job(999999999)})).ok()) << "the store goes on";

  const std::string restored = dir_.path() + "/restored.db";
  ASSERT_TRUE(RestoreSqliteBackup(backup, restored).ok());
  EXPECT_EQ(RestoreSqliteBackup(backup, restored).code(), absl::StatusCode::kAlreadyExists);
  auto copy = OpenSqliteJobStore(restored);
  ASSERT_TRUE(copy.ok()) << copy.status();
  auto jobs = (*copy)->LoadJobs();
  auto nodes = (*copy)->LoadNodes();
  ASSERT_TRUE(jobs.ok() && nodes.ok());
  std::set<std::string> node_ids;
  for (const StoredNode& n : *nodes) node_ids.insert(n.id);
  int64_t before = 0;
  for (const StoredJob& j : *jobs) {
    if (j.seq <= 100) {
      ++before;
      continue;
    }
    EXPECT_EQ(node_ids.count(absl::StrCat("node-", j.seq)), 1u) << "a torn batch: " << j.id;
    EXPECT_NE(j.seq, 999999999) << "a commit after the backup";
  }
  EXPECT_EQ(before, 100);
  EXPECT_EQ(node_ids.size(), jobs->size() - 100);

  const std::string junk = dir_.path() + "/junk";
  std::ofstream(junk) << std::string(8192, 'x');
  const absl::Status bad = RestoreSqliteBackup(junk, dir_.path() + "/from-junk.db");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("is not a trainyard coordinator's database"));
  auto memory = NewInMemoryJobStore();
  EXPECT_EQ(memory->Backup(dir_.path() + "/memory.db").code(),
            absl::StatusCode::kFailedPrecondition);
}

// ---- PostgreSQL only ----

class PostgresJobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    server_ = testing::SharedPostgresServer(&why);
    if (server_ == nullptr) GTEST_SKIP() << "no PostgreSQL here: " << why;
    auto uri = PostgresUriFor(dir_.path());
    ASSERT_TRUE(uri.ok()) << uri.status();
    uri_ = *uri;
    database_ = uri_.substr(std::string("postgresql:///").size());
    database_ = database_.substr(0, database_.find('?'));
  }

  std::string Query(const std::string& sql) {
    auto value = server_->Query(database_, sql);
    return value.ok() ? *value : absl::StrCat("error: ", value.status().message());
  }

  TempDir dir_;
  testing::PostgresServer* server_ = nullptr;
  std::string uri_;
  std::string database_;
};

TEST_F(PostgresJobStoreTest, CreatesSchemaVersion4WithIndexesAndStoresPayloadsAsBytea) {
  auto store = OpenPostgresJobStore(uri_);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(Query("SELECT version FROM trainyard_schema"), "4");
  EXPECT_EQ(Query("SELECT count(*) FROM pg_proc WHERE proname = 'trainyard_fence'"), "1");
  EXPECT_EQ(Query("SELECT epoch || ':' || (expires_at = '-infinity') || ':' || web_url "
                  "FROM trainyard_leader"),
            "0:true:");
  EXPECT_EQ(Query("SELECT count(*) FROM trainyard_schema"), "1");
  EXPECT_EQ(Query("SELECT string_agg(indexname, ',' ORDER BY indexname) FROM pg_indexes "
                  "WHERE tablename IN ('jobs', 'records')"),
            "jobs_owner_seq,jobs_pkey,jobs_seq_key,jobs_state,records_expiry,records_pkey");
  ASSERT_TRUE((*store)->CommitSync(PutJobs({Job(7, BinaryPayload())})).ok());
  EXPECT_EQ(Query("SELECT pg_typeof(payload)::text || ':' || length(payload) FROM jobs"),
            "bytea:258");
  EXPECT_EQ(Query("SELECT id || ',' || seq || ',' || owner || ',' || state FROM jobs"),
            "job-7,7,alice,QUEUED");
  // Opening again (a second coordinator, a restart) migrates nothing and keeps the rows.
  auto again = OpenPostgresJobStore(uri_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Query("SELECT version FROM trainyard_schema"), "4");
  EXPECT_THAT(*(*again)->LoadJobs(), ElementsAre(Job(7, BinaryPayload())));
}

TEST_F(PostgresJobStoreTest, StoresOpenedTogetherMigrateOnce) {
  constexpr int kStores = 4;
  std::vector<absl::StatusOr<std::unique_ptr<JobStore>>> stores(kStores);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStores; ++i) {
    threads.emplace_back([&, i] { stores[i] = OpenPostgresJobStore(uri_); });
  }
  for (std::thread& t : threads) t.join();
  for (auto& store : stores) ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(Query("SELECT count(*) || ':' || max(version) FROM trainyard_schema"), "1:4");
  EXPECT_EQ(Query("SELECT count(*) FROM trainyard_leader"), "1");
  ASSERT_TRUE((*stores[0])->CommitSync(PutJobs({Job(1)})).ok());
  EXPECT_EQ((*stores[3])->LoadJobs()->size(), 1u);
}

TEST_F(PostgresJobStoreTest, RefusesDatabaseWithNewerSchemaVersion) {
  ASSERT_TRUE(OpenPostgresJobStore(uri_).ok());
  ASSERT_EQ(Query("UPDATE trainyard_schema SET version = 99"), "");
  auto store = OpenPostgresJobStore(uri_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(store.status().message(), HasSubstr("schema version 99"));
}

TEST_F(PostgresJobStoreTest, RefusesAPasswordInTheUriWithoutEchoingIt) {
  auto store = OpenPostgresJobStore("postgresql://alice:hunter2-secret@localhost/trainyard");
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(store.status().message(), HasSubstr("password"));
  EXPECT_THAT(store.status().message(), HasSubstr("PGPASSFILE"));
  EXPECT_THAT(std::string(store.status().message()), ::testing::Not(HasSubstr("hunter2")));
  auto keyword = OpenPostgresJobStore("postgresql:///db?host=/tmp&password=hunter2-secret");
  EXPECT_EQ(keyword.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenPostgresJobStore("host=/tmp dbname=x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DescribePostgresLocation("postgresql://bob@db.example:5433/yard?sslmode=require"),
            "yard on db.example:5433");
}

TEST_F(PostgresJobStoreTest, AServerThatIsNotThereIsUnavailableNamingIt) {
  TempDir empty;
  auto store = OpenPostgresJobStore(
      absl::StrCat("postgresql:///nowhere?host=", empty.path(), "&user=postgres"));
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(store.status().message(), HasSubstr("cannot connect to the job store database"));
  EXPECT_THAT(store.status().message(), HasSubstr("nowhere on " + empty.path()));
}

TEST_F(PostgresJobStoreTest, CommitsAndReadsGoOnAfterTheServerDroppedTheSessions) {
  auto store = OpenPostgresJobStore(uri_);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->CommitSync(PutJobs({Job(1)})).ok());
  ASSERT_EQ((*store)->LoadJobs()->size(), 1u);
  // What a server restart (or an operator's pg_terminate_backend) does to both connections.
  EXPECT_EQ(Query("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                  "WHERE application_name = 'trainyard-coordinator' AND datname = '" +
                  database_ + "'"),
            "2");
  const absl::Status status = (*store)->CommitSync(PutJobs({Job(2)}));
  EXPECT_TRUE(status.ok()) << status;
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(Seqs(*jobs), ElementsAre(1, 2));
}

TEST_F(PostgresJobStoreTest, MigratesAVersion1DatabaseToTheLeaseKeepingItsJobs) {
  {
    auto store = OpenPostgresJobStore(uri_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->CommitSync(PutJobs({Job(1)})).ok());
  }
  // What a build of schema version 1 left: no lease table, no fence.
  ASSERT_EQ(Query("DROP TABLE trainyard_leader; DROP FUNCTION trainyard_fence; "
                  "UPDATE trainyard_schema SET version = 1"),
            "");
  auto store = OpenPostgresJobStore(uri_);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(Query("SELECT version FROM trainyard_schema"), "4");
  EXPECT_EQ(Query("SELECT epoch FROM trainyard_leader"), "0");
  EXPECT_THAT(Seqs(*(*store)->LoadJobs()), ElementsAre(1));
}

TEST_F(PostgresJobStoreTest, TheLeaseGoesToOneReplicaAtATimeWithAGrowingEpoch) {
  ASSERT_TRUE(OpenPostgresJobStore(uri_).ok());  // the schema
  auto a = OpenLeaderLease(uri_, "replica-a", "10.0.0.1:7070", "https://10.0.0.1:8443");
  auto b = OpenLeaderLease(uri_, "replica-b", "10.0.0.2:7070");  // no web console
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  auto epoch_a = (*a)->TryAcquire(absl::Seconds(30));
  ASSERT_TRUE(epoch_a.ok()) << epoch_a.status();
  EXPECT_EQ(*epoch_a, 1);
  EXPECT_EQ((*b)->TryAcquire(absl::Seconds(30)).status().code(), absl::StatusCode::kNotFound);
  auto current = (*b)->Current();
  ASSERT_TRUE(current.ok()) << current.status();
  EXPECT_EQ(current->epoch, 1);
  EXPECT_EQ(current->holder, "replica-a");
  EXPECT_EQ(current->address, "10.0.0.1:7070");
  EXPECT_EQ(current->web_url, "https://10.0.0.1:8443");  // where standbys send browsers
  EXPECT_FALSE(current->expired);
  EXPECT_TRUE((*a)->Renew(*epoch_a, absl::Seconds(30)).ok());
  // A clean shutdown hands it over at once.
  ASSERT_TRUE((*a)->Release(*epoch_a).ok());
  EXPECT_TRUE((*b)->Current()->expired);
  auto epoch_b = (*b)->TryAcquire(absl::Seconds(30));
  ASSERT_TRUE(epoch_b.ok()) << epoch_b.status();
  EXPECT_EQ(*epoch_b, 2);
  EXPECT_EQ((*a)->Current()->web_url, "");
  EXPECT_EQ((*a)->Renew(*epoch_a, absl::Seconds(30)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*a)->TryAcquire(absl::Seconds(30)).status().code(), absl::StatusCode::kNotFound);
  // Releasing an epoch that is not the holder's changes nothing.
  ASSERT_TRUE((*a)->Release(*epoch_a).ok());
  EXPECT_FALSE((*a)->Current()->expired);
  EXPECT_EQ((*a)->Current()->holder, "replica-b");
}

TEST_F(PostgresJobStoreTest, AReplicaRestartedInPlaceTakesItsOwnLeaseBackAtOnce) {
  ASSERT_TRUE(OpenPostgresJobStore(uri_).ok());
  auto first = OpenLeaderLease(uri_, "host-1:/var/lib/trainyard", "a:7070");
  ASSERT_TRUE(first.ok());
  auto epoch = (*first)->TryAcquire(absl::Seconds(30));
  ASSERT_TRUE(epoch.ok());
  auto other = OpenLeaderLease(uri_, "host-2:/var/lib/trainyard", "b:7070");
  EXPECT_EQ((*other)->TryAcquire(absl::Seconds(30)).status().code(), absl::StatusCode::kNotFound);
  // The same replica id again (its process was killed and started again): the lease, unexpired,
  // is its own to take, with a new epoch that fences the earlier process.
  auto again = OpenLeaderLease(uri_, "host-1:/var/lib/trainyard", "a:7071");
  auto epoch_again = (*again)->TryAcquire(absl::Seconds(30));
  ASSERT_TRUE(epoch_again.ok()) << epoch_again.status();
  EXPECT_EQ(*epoch_again, *epoch + 1);
  EXPECT_EQ((*again)->Current()->address, "a:7071");
  EXPECT_EQ((*first)->Renew(*epoch, absl::Seconds(30)).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(PostgresJobStoreTest, AnExpiredLeaseIsTakenOverAndTheOldLeaderCannotRenewIt) {
  ASSERT_TRUE(OpenPostgresJobStore(uri_).ok());
  auto a = OpenLeaderLease(uri_, "replica-a", "a:7070");
  auto b = OpenLeaderLease(uri_, "replica-b", "b:7070");
  ASSERT_TRUE(a.ok() && b.ok());
  auto epoch_a = (*a)->TryAcquire(absl::Milliseconds(300));
  ASSERT_TRUE(epoch_a.ok()) << epoch_a.status();
  EXPECT_EQ((*b)->TryAcquire(absl::Seconds(30)).status().code(), absl::StatusCode::kNotFound);
  // (The expiry is on the database's clock: wait for the database to say so.)
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!(*b)->Current()->expired && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  auto epoch_b = (*b)->TryAcquire(absl::Seconds(30));
  ASSERT_TRUE(epoch_b.ok()) << epoch_b.status();
  EXPECT_EQ(*epoch_b, *epoch_a + 1);
  EXPECT_EQ((*a)->Renew(*epoch_a, absl::Seconds(30)).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(PostgresJobStoreTest, AFencedStoreCommitsNothingOnceItsLeaseHasPassedOn) {
  ASSERT_TRUE(OpenPostgresJobStore(uri_).ok());
  auto a = OpenLeaderLease(uri_, "replica-a", "a:7070");
  auto b = OpenLeaderLease(uri_, "replica-b", "b:7070");
  ASSERT_TRUE(a.ok() && b.ok());
  auto epoch_a = (*a)->TryAcquire(absl::Seconds(30));
  ASSERT_TRUE(epoch_a.ok());
  std::atomic<int> fenced{0};
  JobStoreOptions options;
  options.fence_epoch = *epoch_a;
  options.on_fenced = [&] { ++fenced; };
  auto store = OpenPostgresJobStore(uri_, options);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->CommitSync(PutJobs({Job(1)})).ok());
  EXPECT_EQ(fenced.load(), 0);

  ASSERT_TRUE((*a)->Release(*epoch_a).ok());
  auto epoch_b = (*b)->TryAcquire(absl::Seconds(30));
  ASSERT_TRUE(epoch_b.ok());
  for (int i = 2; i <= 3; ++i) {
    const absl::Status status = (*store)->CommitSync(PutJobs({Job(i)}));
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_THAT(status.message(), HasSubstr("passed to another coordinator"));
  }
  EXPECT_EQ(fenced.load(), 1);
  EXPECT_EQ(Query("SELECT string_agg(id, ',') FROM jobs"), "job-1");

  // The new leader's store writes; a store of the old epoch still does not.
  options.fence_epoch = *epoch_b;
  options.on_fenced = nullptr;
  auto store_b = OpenPostgresJobStore(uri_, options);
  ASSERT_TRUE(store_b.ok());
  EXPECT_TRUE((*store_b)->CommitSync(PutJobs({Job(4)})).ok());
  EXPECT_EQ((*store)->CommitSync(PutJobs({Job(5)})).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Query("SELECT string_agg(id, ',' ORDER BY seq) FROM jobs"), "job-1,job-4");
}

// Issue 54: a leader paused inside a write transaction (its session idle in transaction, as under
// SIGSTOP) must hold up neither the takeover of its lease nor the new leader's writes, and must
// commit nothing once it resumes.
TEST_F(PostgresJobStoreTest, ALeaderPausedInATransactionHoldsUpNoTakeoverAndCommitsNothingAfter) {
  ASSERT_TRUE(OpenPostgresJobStore(uri_).ok());
  auto a = OpenLeaderLease(uri_, "replica-a", "a:7070");
  auto b = OpenLeaderLease(uri_, "replica-b", "b:7070");
  ASSERT_TRUE(a.ok() && b.ok());
  constexpr absl::Duration kTtl = absl::Seconds(1);
  const absl::Time acquired = absl::Now();
  auto epoch_a = (*a)->TryAcquire(kTtl);
  ASSERT_TRUE(epoch_a.ok()) << epoch_a.status();
  std::atomic<int> commits{0};
  absl::Notification paused, resume;
  JobStoreOptions options;
  options.fence_epoch = *epoch_a;
  options.idle_in_transaction_limit = absl::Milliseconds(500);
  options.before_commit = [&] {
    if (++commits != 2) return;  // the second transaction pauses, once
    paused.Notify();
    resume.WaitForNotification();
  };
  auto store_a = OpenPostgresJobStore(uri_, options);
  ASSERT_TRUE(store_a.ok()) << store_a.status();
  ASSERT_TRUE((*store_a)->CommitSync(PutJobs({Job(1)})).ok());
  absl::Notification a_done;
  absl::Status a_status;
  (*store_a)->Commit(PutJobs({Job(2, "from a")}), [&](const absl::Status& status) {
    a_status = status;
    a_done.Notify();
  });
  paused.WaitForNotification();
  EXPECT_EQ(Query(absl::StrCat("SELECT count(*) FROM pg_stat_activity WHERE datname = '", database_,
                               "' AND state = 'idle in transaction'")),
            "1");

  // The standby polls as a replica does; it takes the lease when it expires, not when a resumes.
  absl::StatusOr<int64_t> epoch_b;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    epoch_b = (*b)->TryAcquire(absl::Seconds(30));
    if (epoch_b.ok()) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  const absl::Duration takeover = absl::Now() - acquired;
  ASSERT_TRUE(epoch_b.ok()) << epoch_b.status();
  EXPECT_LT(takeover, kTtl + absl::Seconds(1)) << "the takeover waited for the paused leader";
  // The new leader writes the very row that a's open transaction wrote: the server ended that
  // transaction at its idle limit, so nothing waits for a.
  options.fence_epoch = *epoch_b;
  options.before_commit = nullptr;
  auto store_b = OpenPostgresJobStore(uri_, options);
  ASSERT_TRUE(store_b.ok()) << store_b.status();
  const absl::Time b_writes = absl::Now();
  EXPECT_TRUE((*store_b)->CommitSync(PutJobs({Job(2, "from b")})).ok());
  EXPECT_LT(absl::Now() - b_writes, absl::Seconds(5));
  EXPECT_FALSE(a_done.HasBeenNotified());

  // a resumes: its transaction commits nothing, and neither does any after it.
  resume.Notify();
  a_done.WaitForNotification();
  EXPECT_EQ(a_status.code(), absl::StatusCode::kUnavailable) << a_status;
  EXPECT_THAT(a_status.message(), HasSubstr("passed to another coordinator"));
  const absl::Status later = (*store_a)->CommitSync(PutJobs({Job(3)}));
  EXPECT_THAT(later.message(), HasSubstr("passed to another coordinator"));
  EXPECT_EQ(Query("SELECT string_agg(id || '=' || encode(payload, 'escape'), ',' ORDER BY seq) "
                  "FROM jobs"),
            "job-1=payload-1,job-2=from b");
}

// A connection that broke with its COMMIT in flight used to leave the outcome unknown (UNAVAILABLE,
// "may or may not have been applied"); the store now asks the server by the transaction's id.
// Here the server ends the session just before the commit is sent: the transaction was rolled
// back, so the store writes it again on a new connection, and it is stored once.
TEST_F(PostgresJobStoreTest, ACommitWhoseConnectionBrokeAsItWasSentIsResolvedByTheServer) {
  std::atomic<int> commits{0};
  JobStoreOptions options;
  options.before_commit = [&] {
    if (++commits != 1) return;
    EXPECT_EQ(Query(absl::StrCat("SELECT count(pg_terminate_backend(pid, 5000)) FROM "
                                 "pg_stat_activity WHERE datname = '",
                                 database_, "' AND state = 'idle in transaction'")),
              "1");
  };
  auto store = OpenPostgresJobStore(uri_, options);
  ASSERT_TRUE(store.ok()) << store.status();
  const absl::Status status = (*store)->CommitSync(PutJobs({Job(1)}));
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(commits.load(), 2);
  EXPECT_EQ(Query("SELECT string_agg(id, ',') FROM jobs"), "job-1");
}

// What docs/operations.md tells operators to do: pg_dump while the store serves, pg_restore into
// an empty database, and a coordinator's store opens on it with everything.
TEST_F(PostgresJobStoreTest, APgDumpRestoredIntoAnEmptyDatabaseHoldsEverything) {
  auto store = OpenPostgresJobStore(uri_);
  ASSERT_TRUE(store.ok()) << store.status();
  WriteBatch batch = PutJobs({Job(1, BinaryPayload()), Job(2, "", "bob", "RUNNING")});
  batch.put_nodes = {{"n1", BinaryPayload()}};
  batch.put_records = {{"token", "t1", BinaryPayload(), 0}, {"job_logs", "job-1", "x", 42}};
  ASSERT_TRUE((*store)->CommitSync(batch).ok());
  const std::string bin = testing::PostgresBinDir();
  const std::string dump = dir_.path() + "/coordinator.dump";
  testing::CommandResult dumped =
      testing::RunCommand({bin + "/pg_dump", "-Fc", "-f", dump, "-d", uri_});
  ASSERT_EQ(dumped.exit_code, 0) << dumped.err;
  const std::string restored_db = database_ + "_restored";
  ASSERT_TRUE(server_->CreateDatabase(restored_db).ok());
  const std::string restored_uri = server_->Uri(restored_db);
  testing::CommandResult restored =
      testing::RunCommand({bin + "/pg_restore", "--no-owner", "-d", restored_uri, dump});
  ASSERT_EQ(restored.exit_code, 0) << restored.err;
  auto copy = OpenPostgresJobStore(restored_uri);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_THAT(*(*copy)->LoadJobs(),
              ElementsAre(Job(1, BinaryPayload()), Job(2, "", "bob", "RUNNING")));
  EXPECT_THAT(*(*copy)->LoadNodes(), ElementsAre(StoredNode{"n1", BinaryPayload()}));
  EXPECT_THAT(*(*copy)->LoadRecords("token"),
              ElementsAre(StoredRecord{"token", "t1", BinaryPayload(), 0}));
  EXPECT_THAT(*(*copy)->LoadRecords("job_logs"),
              ElementsAre(StoredRecord{"job_logs", "job-1", "x", 42}));
  // The lease came along; a restored cluster's first replica takes it as usual.
  auto lease = OpenLeaderLease(restored_uri, "r", "a:7070");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE((*lease)->TryAcquire(absl::Seconds(5)).ok());
}

TEST_F(PostgresJobStoreTest, BackupPointsToPgDump) {
  auto store = OpenPostgresJobStore(uri_);
  ASSERT_TRUE(store.ok()) << store.status();
  const absl::Status status = (*store)->Backup(dir_.path() + "/backup.db");
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("pg_dump"));
}

}  // namespace
}  // namespace trainyard::coordinator
