// SubmitRequests (server/coordinator/submit_requests.h): JobManager's request ids, on their own.
#include "server/coordinator/submit_requests.h"

#include <gtest/gtest.h>

namespace trainyard::coordinator {
namespace {

constexpr int64_t kNow = 1'000'000'000;
constexpr int64_t kDayMs = 24 * 3600 * 1000;

TEST(SubmitRequestsTest, ARequestIdIsKeptPerOwnerUntilItExpiresADayLater) {
  SubmitRequests requests;
  const std::string key = SubmitRequests::Key("alice", "r1");
  EXPECT_EQ(key, "alice/r1");
  EXPECT_FALSE(requests.Find(key, kNow).has_value());
  EXPECT_EQ(requests.Start(key, "job-1", kNow), kNow + kDayMs);
  EXPECT_TRUE(requests.Contains(key));
  EXPECT_FALSE(requests.Contains(SubmitRequests::Key("bob", "r1")));  // another owner's
  auto known = requests.Find(key, kNow + 1);
  ASSERT_TRUE(known.has_value());
  EXPECT_EQ(known->job_id, "job-1");
  EXPECT_FALSE(known->durable);  // still being stored: a retry is told to wait
  requests.Stored(key, "job-1", true);
  known = requests.Find(key, kNow + kDayMs - 1);
  ASSERT_TRUE(known.has_value());
  EXPECT_TRUE(known->durable);
  EXPECT_FALSE(requests.Find(key, kNow + kDayMs).has_value());  // expired, and forgotten
  EXPECT_FALSE(requests.Contains(key));
}

TEST(SubmitRequestsTest, ASubmitThatWasNotStoredIsForgottenSoThatARetrySubmitsAfresh) {
  SubmitRequests requests;
  const std::string key = SubmitRequests::Key("alice", "r1");
  requests.Start(key, "job-1", kNow);
  requests.Stored(key, "job-9", false);  // another job's answer: not this request's
  EXPECT_TRUE(requests.Contains(key));
  requests.Stored(key, "job-1", false);
  EXPECT_FALSE(requests.Contains(key));
  // A retry made job-2; the first submit's late answer does not touch it.
  requests.Start(key, "job-2", kNow + 5);
  requests.Stored(key, "job-1", true);
  auto known = requests.Find(key, kNow + 6);
  ASSERT_TRUE(known.has_value());
  EXPECT_EQ(known->job_id, "job-2");
  EXPECT_FALSE(known->durable);
}

TEST(SubmitRequestsTest, LoadedIdsAreDurableAndTheStoresExpiredOnesAreDeletedOnceAMinute) {
  SubmitRequests requests;
  requests.Load("alice/r1", "job-7", kNow + 10);
  auto known = requests.Find("alice/r1", kNow);
  ASSERT_TRUE(known.has_value());
  EXPECT_TRUE(known->durable);
  EXPECT_TRUE(requests.PruneStoreDue(kNow));
  EXPECT_FALSE(requests.PruneStoreDue(kNow + 59'999));
  EXPECT_TRUE(requests.PruneStoreDue(kNow + 60'000));
}

}  // namespace
}  // namespace trainyard::coordinator
