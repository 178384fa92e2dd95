// ContextStore (server/coordinator/context_store.h) on a real SQLite store and a fake clock: an
// upload is its owner's alone, expires a day after upload unless a job names it, lives as long as
// the job's logs once one does, and a user's uploads together are capped.
#include "server/coordinator/context_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/clock.h"
#include "common/context_archive.h"
#include "tests/testing/subprocess.h"

namespace trainyard::coordinator {
namespace {

using ::testing::HasSubstr;

class ContextStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = OpenSqliteJobStore(dir_.path() + "/state.db");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  ContextStore Contexts(int64_t max_bytes_per_user = int64_t{2} << 30) {
    ContextStoreOptions options;
    options.unclaimed = absl::Hours(24);
    options.claimed = absl::Hours(24 * 30);
    options.max_bytes_per_user = max_bytes_per_user;
    return ContextStore(*store_, clock_, options);
  }
  // What the coordinator's periodic purge does (JobHistory::PurgeExpired).
  void Purge() {
    WriteBatch batch;
    batch.delete_records_expired_at_ms = absl::ToUnixMillis(clock_.Now());
    ASSERT_TRUE(store_->CommitSync(std::move(batch)).ok());
  }

  testing::TempDir dir_;
  FakeClock clock_;
  std::unique_ptr<JobStore> store_;
};

TEST_F(ContextStoreTest, AnUploadIsItsOwnersAloneAndExpiresUnlessAJobNamesIt) {
  ContextStore contexts = Contexts();
  const std::string archive = "archive bytes", digest = ContextDigest(archive);
  auto expires = contexts.Put("alice", digest, archive);
  ASSERT_TRUE(expires.ok()) << expires.status();
  EXPECT_EQ(*expires, absl::ToUnixMillis(clock_.Now() + absl::Hours(24)));
  EXPECT_EQ(contexts.Read("alice", digest).value_or(""), archive);
  // bob, who did not upload it, can neither name nor read it.
  EXPECT_THAT(contexts.Claim("bob", digest).message(), HasSubstr("is not a context you uploaded"));
  EXPECT_TRUE(absl::IsNotFound(contexts.Read("bob", digest).status()));

  // Named by a job within the day: kept for the logs' retention from then.
  clock_.Advance(absl::Hours(23));
  ASSERT_TRUE(contexts.Claim("alice", digest).ok());
  clock_.Advance(absl::Hours(24 * 20));
  Purge();
  EXPECT_EQ(contexts.Read("alice", digest).value_or(""), archive);
  clock_.Advance(absl::Hours(24 * 11));
  Purge();
  EXPECT_TRUE(absl::IsNotFound(contexts.Read("alice", digest).status()));

  // Unnamed for a day: gone, and a submit naming it is refused.
  const std::string other = "other bytes";
  ASSERT_TRUE(contexts.Put("alice", ContextDigest(other), other).ok());
  clock_.Advance(absl::Hours(25));
  EXPECT_TRUE(absl::IsNotFound(contexts.Claim("alice", ContextDigest(other))));
}

// A job's nodes fetch its context at once: while one copy is held, every fetch shares it without
// reading the store again (here the store's record is overwritten meanwhile, and the fetch still
// gets the held copy); once none is held, or once it has expired, the store is read.
TEST_F(ContextStoreTest, FetchesInFlightShareOneCopyOfAnArchive) {
  ContextStore contexts = Contexts();
  const std::string archive(3 << 20, 'x'), digest = ContextDigest(archive);
  ASSERT_TRUE(contexts.Put("alice", digest, archive).ok());
  auto first = contexts.ReadShared("alice", digest);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(**first, archive);
  EXPECT_TRUE(absl::IsNotFound(contexts.ReadShared("bob", digest).status())) << "alice's alone";

  auto overwrite = [&](const std::string& payload) {
    WriteBatch batch;
    auto record = store_->GetRecord(ContextStore::kRecordKind, "alice/" + digest);
    ASSERT_TRUE(record.ok()) << record.status();
    batch.put_records.push_back(
        {ContextStore::kRecordKind, "alice/" + digest, payload, record->expires_ms});
    ASSERT_TRUE(store_->CommitSync(std::move(batch)).ok());
  };
  overwrite("changed");
  auto second = contexts.ReadShared("alice", digest);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->get(), first->get()) << "one copy, not read again";
  first->reset();
  second->reset();
  EXPECT_EQ(*contexts.ReadShared("alice", digest).value(), "changed") << "none held: read";

  auto held = contexts.ReadShared("alice", digest);
  clock_.Advance(absl::Hours(25));  // unclaimed: expired, though a copy is held
  EXPECT_TRUE(absl::IsNotFound(contexts.ReadShared("alice", digest).status()));
}

TEST_F(ContextStoreTest, AUsersUploadsTogetherAreCapped) {
  ContextStore contexts = Contexts(/*max_bytes_per_user=*/100);
  const std::string a(60, 'a'), b(60, 'b');
  ASSERT_TRUE(contexts.Put("alice", ContextDigest(a), a).ok());
  ASSERT_TRUE(contexts.Put("alice", ContextDigest(a), a).ok());  // the same again: not counted
  auto over = contexts.Put("alice", ContextDigest(b), b);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("context: you keep"));
  EXPECT_TRUE(contexts.Put("bob", ContextDigest(b), b).ok());  // another user's count
  clock_.Advance(absl::Hours(25));                             // alice's first has expired
  EXPECT_TRUE(contexts.Put("alice", ContextDigest(b), b).ok());
}

}  // namespace
}  // namespace trainyard::coordinator
