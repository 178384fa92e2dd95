// DeviceLedger (server/coordinator/device_ledger.h): JobManager's attempts and devices, on its own.
#include "server/coordinator/device_ledger.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>

namespace trainyard::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

// SettleNode's deadline for every rank: `t`.
std::function<absl::Time(const DeviceLedger::RankKey&)> At(absl::Time t) {
  return [t](const DeviceLedger::RankKey&) { return t; };
}

TEST(DeviceLedgerTest, ADeviceIsHeldOnceUntilFreed) {
  DeviceLedger ledger;
  EXPECT_TRUE(ledger.Hold("a", 1));
  EXPECT_TRUE(ledger.Hold("a", 0));
  EXPECT_FALSE(ledger.Hold("a", 1));  // taken
  EXPECT_TRUE(ledger.Hold("b", 1));   // another node's
  EXPECT_EQ(ledger.HeldCount("a"), 2);
  EXPECT_THAT(ledger.HeldOn("a"), ElementsAre(0, 1));
  ledger.Free("a", 1);
  ledger.Free("a", 7);  // not held: nothing
  ledger.Free("c", 0);  // unknown node: nothing
  EXPECT_THAT(ledger.HeldOn("a"), ElementsAre(0));
  ledger.Free("a", 0);
  EXPECT_EQ(ledger.HeldCount("a"), 0);
  EXPECT_TRUE(ledger.Hold("a", 1));
}

TEST(DeviceLedgerTest, ADrainingRankKeepsItsDeviceUntilItsExitOnItsNode) {
  DeviceLedger ledger;
  ASSERT_TRUE(ledger.Hold("a", 3));
  const DeviceLedger::RankKey rank{"job-1", 2, 0};
  ledger.Drain(rank, "a", 3, kT0);
  EXPECT_TRUE(ledger.IsDraining(rank));
  EXPECT_TRUE(ledger.DrainsOn(rank, "a"));
  EXPECT_FALSE(ledger.DrainsOn(rank, "b"));
  EXPECT_TRUE(ledger.AnyDraining("job-1"));
  EXPECT_FALSE(ledger.AnyDraining("job-10"));  // a prefix is not the job
  EXPECT_THAT(ledger.DrainingJobs(kT0 - absl::Seconds(1)), ElementsAre("job-1"));
  EXPECT_THAT(ledger.DrainingJobs(kT0), IsEmpty());  // past its deadline (a node away)
  EXPECT_FALSE(ledger.Hold("a", 3));
  EXPECT_FALSE(ledger.EndDraining(rank, "b"));  // another node speaks only for its own ranks
  EXPECT_TRUE(ledger.IsDraining(rank));
  EXPECT_TRUE(ledger.EndDraining(rank, "a"));
  EXPECT_FALSE(ledger.IsDraining(rank));
  EXPECT_FALSE(ledger.AnyDraining("job-1"));
  EXPECT_THAT(ledger.DrainingJobs(kT0 - absl::Seconds(1)), IsEmpty());
  EXPECT_TRUE(ledger.Hold("a", 3));
}

// resources.ranks_per_node: ranks sharing a device hold it until the last of them has exited,
// whichever way each one's draining ends.
TEST(DeviceLedgerTest, RanksSharingADeviceHoldItUntilTheLastOfThemEnds) {
  DeviceLedger ledger;
  ASSERT_TRUE(ledger.Hold("a", 0));
  const DeviceLedger::RankKey r0{"job-1", 1, 0}, r1{"job-1", 1, 1}, r2{"job-1", 1, 2};
  for (const auto& r : {r0, r1, r2}) ledger.Drain(r, "a", 0, kT0 + absl::Seconds(10));
  EXPECT_TRUE(ledger.EndDraining(r0, "a"));
  EXPECT_FALSE(ledger.Hold("a", 0));  // r1 and r2 still stop on it
  EXPECT_TRUE(ledger.SettleNode("a", {r2}, At(kT0 + absl::Seconds(10))));  // r1 is gone
  EXPECT_FALSE(ledger.Hold("a", 0));
  auto expired = ledger.Expire(kT0 + absl::Seconds(11), [](const std::string&) { return true; });
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].first, r2);
  EXPECT_TRUE(ledger.Hold("a", 0));  // the last one: free
}

TEST(DeviceLedgerTest, ANodesHelloFreesItsGoneRanksAndGivesRunningOnesANewDeadline) {
  DeviceLedger ledger;
  const DeviceLedger::RankKey gone{"job-1", 1, 0}, alive{"job-1", 1, 1}, other{"job-2", 1, 0};
  for (int d = 0; d < 2; ++d) ASSERT_TRUE(ledger.Hold("a", d));
  ASSERT_TRUE(ledger.Hold("b", 0));
  ledger.Drain(gone, "a", 0, kT0);
  ledger.Drain(alive, "a", 1, kT0);
  ledger.Drain(other, "b", 0, kT0);
  EXPECT_TRUE(ledger.SettleNode("a", {alive}, At(kT0 + absl::Seconds(60))));
  EXPECT_FALSE(ledger.IsDraining(gone));
  EXPECT_THAT(ledger.HeldOn("a"), ElementsAre(1));
  EXPECT_TRUE(ledger.IsDraining(other));  // node b said nothing
  EXPECT_FALSE(ledger.SettleNode("a", {alive}, At(kT0 + absl::Seconds(60))));  // nothing to free
  // Past the first deadline only node b's rank expires; a's got a new one.
  const auto expired =
      ledger.Expire(kT0 + absl::Seconds(1), [](const std::string&) { return true; });
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].first, other);
  EXPECT_EQ(expired[0].second.device, 0);
  EXPECT_EQ(ledger.HeldCount("b"), 0);
  EXPECT_TRUE(ledger.IsDraining(alive));
}

TEST(DeviceLedgerTest, RanksOnANodeThatIsNotReachableDoNotExpire) {
  DeviceLedger ledger;
  ASSERT_TRUE(ledger.Hold("a", 0));
  ledger.Drain({"job-1", 1, 0}, "a", 0, kT0);
  auto unreachable = [](const std::string& node) { return node != "a"; };
  EXPECT_THAT(ledger.Expire(kT0 + absl::Hours(1), unreachable), IsEmpty());
  EXPECT_EQ(ledger.HeldCount("a"), 1);
  EXPECT_THAT(ledger.Expire(kT0 - absl::Seconds(1), [](const std::string&) { return true; }),
              IsEmpty());  // before its deadline
  EXPECT_EQ(ledger.Expire(kT0, [](const std::string&) { return true; }).size(), 1u);
  EXPECT_EQ(ledger.HeldCount("a"), 0);
}

// A rank not yet told to stop (its release's write is not durable, a store stalled past the
// drain timeout) keeps its device past its deadline; once told, it expires as any.
TEST(DeviceLedgerTest, ARankNotYetToldToStopDoesNotExpire) {
  DeviceLedger ledger;
  ASSERT_TRUE(ledger.Hold("a", 0));
  const DeviceLedger::RankKey rank{"job-1", 1, 0};
  ledger.Drain(rank, "a", 0, kT0);
  auto reachable = [](const std::string&) { return true; };
  bool told = false;
  auto held = [&](const DeviceLedger::RankKey& key) { return key == rank && !told; };
  EXPECT_THAT(ledger.Expire(kT0 + absl::Hours(1), reachable, held), IsEmpty());
  EXPECT_EQ(ledger.HeldCount("a"), 1);
  told = true;
  EXPECT_EQ(ledger.Expire(kT0 + absl::Hours(1), reachable, held).size(), 1u);
  EXPECT_EQ(ledger.HeldCount("a"), 0);
}

TEST(DeviceLedgerTest, MasterPortsAreTorchrunsFromTheFirstFreeOnePerNodeUntilNoneIsLeft) {
  DeviceLedger ledger;
  EXPECT_EQ(ledger.ReservePort("a"), 29500);
  EXPECT_EQ(ledger.ReservePort("a"), 29501);
  EXPECT_EQ(ledger.ReservePort("b"), 29500);
  ledger.ReleasePort("a", 29500);
  EXPECT_EQ(ledger.ReservePort("a"), 29500);
  ledger.HoldPort("c", 29500);  // a job loaded at start keeps its port
  EXPECT_EQ(ledger.ReservePort("c"), 29501);
  for (int i = 2; i < DeviceLedger::kMasterPorts; ++i) ASSERT_NE(ledger.ReservePort("a"), 0);
  EXPECT_EQ(ledger.ReservePort("a"), 0);  // all taken: the worker picks one
}

TEST(DeviceLedgerTest, ExitedRanksAreKeptPerJobUntilForgotten) {
  DeviceLedger ledger;
  ledger.Exited("job-1").insert(1);
  ledger.Exited("job-1").insert(0);
  EXPECT_THAT(ledger.Exited("job-1"), ElementsAre(0, 1));
  EXPECT_THAT(ledger.Exited("job-2"), IsEmpty());
  ledger.ForgetExited("job-1");
  EXPECT_THAT(ledger.Exited("job-1"), IsEmpty());
}

}  // namespace
}  // namespace trainyard::coordinator
