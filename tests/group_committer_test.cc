// GroupCommitter (server/coordinator/group_committer.h), the stores' commit thread, with a
// transaction of the test's own: batches queued while one commits share the next transaction, a
// failed group is written again a batch at a time so one bad batch fails alone, and Stop writes
// what is queued.
#include "server/coordinator/group_committer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/synchronization/notification.h"

namespace trainyard::coordinator {
namespace {

WriteBatch Job(const std::string& id) {
  WriteBatch b;
  b.put_jobs.push_back({id, 1, "alice", "QUEUED", ""});
  return b;
}

struct Recorded {
  absl::Mutex mu;
  std::vector<std::vector<std::string>> transactions;  // the ids each attempted one wrote
  std::vector<std::pair<std::string, absl::Status>> answers ABSL_GUARDED_BY(mu);
};

TEST(GroupCommitterTest, BatchesQueuedDuringACommitShareTheNextAndABadOneFailsAlone) {
  Recorded rec;
  absl::Notification first_started, release_first;
  GroupCommitter committer(
      /*group_commit=*/true,
      [&](const std::vector<const WriteBatch*>& batches) -> absl::Status {
        std::vector<std::string> ids;
        bool bad = false;
        for (const WriteBatch* b : batches) {
          ids.push_back(b->put_jobs[0].id);
          bad = bad || b->put_jobs[0].id == "bad";
        }
        rec.transactions.push_back(ids);
        if (ids == std::vector<std::string>{"first"}) {
          first_started.Notify();
          release_first.WaitForNotification();  // the others queue meanwhile
        }
        return bad ? absl::InvalidArgumentError("bad row") : absl::OkStatus();
      },
      nullptr);
  committer.Start();
  auto answer = [&rec](const std::string& id) {
    return [&rec, id](absl::Status s) {
      absl::MutexLock lock(&rec.mu);
      rec.answers.emplace_back(id, s);
    };
  };
  committer.Commit(Job("first"), answer("first"));
  first_started.WaitForNotification();
  committer.Commit(Job("a"), answer("a"));
  committer.Commit(Job("bad"), answer("bad"));
  committer.Commit(WriteBatch(), answer("empty"));  // needs no transaction
  committer.Commit(Job("b"), answer("b"));
  release_first.Notify();
  committer.Stop();  // writes everything queued first
  EXPECT_EQ(rec.transactions, (std::vector<std::vector<std::string>>{
                                  {"first"}, {"a", "bad", "b"}, {"a"}, {"bad"}, {"b"}}));
  absl::MutexLock lock(&rec.mu);
  ASSERT_EQ(rec.answers.size(), 5u);
  for (const auto& [id, status] : rec.answers) {
    EXPECT_EQ(status.ok(), id != "bad") << id << ": " << status;
  }
  // In the order they were committed.
  EXPECT_EQ(rec.answers[1].first, "a");
  EXPECT_EQ(rec.answers[3].first, "empty");
  const JobStoreStats stats = committer.Stats();
  EXPECT_EQ(stats.batches, 4);       // first, a, b and the empty one
  EXPECT_EQ(stats.transactions, 3);  // first, a, b (the failed group and "bad" did not commit)
}

TEST(GroupCommitterTest, WithoutGroupCommitEachBatchHasATransactionOfItsOwn) {
  std::vector<size_t> sizes;
  double reported = -1;
  GroupCommitter committer(
      /*group_commit=*/false,
      [&](const std::vector<const WriteBatch*>& batches) {
        sizes.push_back(batches.size());
        return absl::OkStatus();
      },
      [&](double seconds) { reported = seconds; });
  // Queued before the thread starts: all three wait together, yet go one at a time.
  int answered = 0;
  for (const char* id : {"a", "b", "c"}) {
    committer.Commit(Job(id), [&answered](absl::Status s) { answered += s.ok(); });
  }
  committer.Start();
  committer.Stop();
  EXPECT_EQ(sizes, (std::vector<size_t>{1, 1, 1}));
  EXPECT_EQ(answered, 3);
  EXPECT_GE(reported, 0);
  EXPECT_EQ(committer.Stats().transactions, 3);
}

}  // namespace
}  // namespace trainyard::coordinator
