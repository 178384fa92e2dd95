// Which kept checkpoints a rank's checkpoint report carries (KeptToReport): the newest, at most
// kMaxKeptCheckpoints and within a budget of path bytes, oldest first.
#include "worker/trainer/control/reporter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/field_limits.h"

namespace trainyard::trainer {
namespace {

using ::testing::ElementsAre;

CheckpointReport WithKept(int count, size_t path_bytes) {
  CheckpointReport r;
  for (int i = 1; i <= count; ++i) {
    std::string path = "/ckpt/step-" + std::to_string(i);
    path.resize(path_bytes, 'x');
    r.kept.push_back({i, path, std::nullopt});
  }
  return r;
}

TEST(KeptToReportTest, AllWhenFewAndShort) {
  EXPECT_THAT(KeptToReport(WithKept(3, 20), 1024), ElementsAre(0, 1, 2));
  EXPECT_THAT(KeptToReport(WithKept(0, 20), 1024), ElementsAre());
}

TEST(KeptToReportTest, TheNewestHundredOldestFirst) {
  const std::vector<size_t> kept = KeptToReport(WithKept(150, 20), 1 << 20);
  ASSERT_EQ(kept.size(), static_cast<size_t>(kMaxKeptCheckpoints));
  EXPECT_EQ(kept.front(), 50u);
  EXPECT_EQ(kept.back(), 149u);
}

// Long paths: as many of the newest as fit in the budget, so the report stays under the
// coordinator's cap instead of being refused whole.
TEST(KeptToReportTest, LongPathsAreCutToTheBudget) {
  EXPECT_THAT(KeptToReport(WithKept(10, 1000), 3500), ElementsAre(7, 8, 9));
  EXPECT_THAT(KeptToReport(WithKept(10, 1000), 999), ElementsAre());
  // 100 paths of 4096 bytes (PATH_MAX) would be 400 KiB; half the report cap takes 8 of them.
  const std::vector<size_t> kept = KeptToReport(WithKept(100, 4096), kMaxReportBytes / 2);
  EXPECT_EQ(kept.size(), 8u);
  EXPECT_EQ(kept.back(), 99u);
}

}  // namespace
}  // namespace trainyard::trainer
