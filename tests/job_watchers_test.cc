// JobWatchers (server/coordinator/job_watchers.h): JobManager's watches, on their own.
#include "server/coordinator/job_watchers.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace trainyard::coordinator {
namespace {

// Calls the callbacks with a job of `id`, as JobManager does once the lock is released.
void Notify(const std::vector<std::shared_ptr<JobWatchers::Callback>>& callbacks,
            const std::string& id) {
  v1::Job job;
  job.set_id(id);
  for (const auto& cb : callbacks) (*cb)(job);
}

TEST(JobWatchersTest, ADurableVersionNotifiesTheJobsWatchersOnlyUntilTheyAreRemoved) {
  JobWatchers watchers;
  std::vector<std::string> seen;
  auto record = [&seen](const std::string& who) {
    return [&seen, who](const v1::Job& job) { seen.push_back(who + ":" + job.id()); };
  };
  const int64_t a = watchers.Add("job-1", record("a"));
  const int64_t b = watchers.Add("job-1", record("b"));
  watchers.Add("job-2", record("c"));
  EXPECT_NE(a, 0);
  EXPECT_NE(a, b);
  EXPECT_EQ(watchers.size(), 3u);
  Notify(watchers.Durable("job-1", 3), "job-1");
  EXPECT_EQ(seen, (std::vector<std::string>{"a:job-1", "b:job-1"}));
  watchers.Remove(a);
  watchers.Remove(a);      // twice: nothing
  watchers.Remove(12345);  // unknown: nothing
  seen.clear();
  Notify(watchers.Durable("job-1", 4), "job-1");
  EXPECT_EQ(seen, (std::vector<std::string>{"b:job-1"}));
  watchers.Remove(b);
  EXPECT_TRUE(watchers.Durable("job-1", 5).empty());
  EXPECT_EQ(watchers.size(), 1u);
}

TEST(JobWatchersTest, TheDurableVersionIsTheNewestSaidAndForgottenWithTheJob) {
  JobWatchers watchers;
  EXPECT_FALSE(watchers.IsDurable("job-1", 1));
  watchers.SetDurable("job-1", 3);
  EXPECT_TRUE(watchers.IsDurable("job-1", 3));
  EXPECT_TRUE(watchers.IsDurable("job-1", 2));
  EXPECT_FALSE(watchers.IsDurable("job-1", 4));
  watchers.Durable("job-1", 2);  // an older commit's answer, after a newer one's
  EXPECT_TRUE(watchers.IsDurable("job-1", 3));
  watchers.Durable("job-1", 5);
  EXPECT_TRUE(watchers.IsDurable("job-1", 5));
  watchers.Forget("job-1");
  EXPECT_FALSE(watchers.IsDurable("job-1", 1));
}

}  // namespace
}  // namespace trainyard::coordinator
