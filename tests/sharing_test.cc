// Unit tests of the scheduler's sharing rules (accounts' quotas and borrowing, users' caps, fair
// share by decayed usage, preemption across accounts) and of the decayed usage ledger, with a fake
// clock: everything here is pure logic, time comes in as data.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator/fair_share.h"
#include "server/coordinator/scheduler.h"

namespace trainyard::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

const absl::Time kNow = absl::FromUnixSeconds(1'700'000'000);

ClusterSnapshot Cluster(int nodes, int devices_per_node) {
  ClusterSnapshot s;
  s.now = kNow;
  for (int n = 0; n < nodes; ++n) {
    s.nodes.push_back({"node" + std::to_string(n), devices_per_node, devices_per_node, true, {}});
  }
  return s;
}

// Accounts "a" and "b" (indices 0 and 1), one user each ("alice" in a, "bob" in b: users 0, 1).
ClusterSnapshot TwoAccounts(int nodes, int devices_per_node) {
  ClusterSnapshot s = Cluster(nodes, devices_per_node);
  s.accounts = {{"a"}, {"b"}};
  s.users = {{"alice", 0}, {"bob", 1}};
  return s;
}

PendingJobInfo Job(const std::string& id, int user, int devices, int priority = 50,
                   int64_t seq = 0) {
  PendingJobInfo job;
  job.id = id;
  job.user = user;
  job.devices = devices;
  job.priority = priority;
  job.submit_seq = seq;
  return job;
}

// A running job on `node`, started `ran` before kNow, no checkpoint.
RunningJobInfo Running(const std::string& id, int user, int node, int devices, int priority,
                       absl::Duration ran) {
  RunningJobInfo r;
  r.id = id;
  r.user = user;
  r.grants = {{node, devices}};
  r.priority = priority;
  r.start = kNow - ran;
  return r;
}

// Takes `devices` free devices off the nodes, first nodes first (for jobs put in `running`).
void Hold(ClusterSnapshot& s, int node, int devices) { s.nodes[node].free_devices -= devices; }

std::vector<std::string> PlacedIds(const ScheduleResult& r) {
  std::vector<std::string> ids;
  for (const Placement& p : r.placements) ids.push_back(p.job_id);
  return ids;
}

WaitReason ReasonOf(const ClusterSnapshot& s, const ScheduleResult& r, const std::string& id) {
  for (size_t i = 0; i < s.pending.size(); ++i) {
    if (s.pending[i].id == id) return r.waits[i].reason;
  }
  ADD_FAILURE() << "no pending job " << id;
  return WaitReason::kPlaced;
}

TEST(SharingTest, AnAccountUsesItsQuotaPlusItsBorrowLimitAndNoMore) {
  ClusterSnapshot s = TwoAccounts(2, 8);
  s.accounts[0].quota = 4;
  s.accounts[0].borrow_limit = 2;
  s.pending = {Job("a1", 0, 2, 50, 1), Job("a2", 0, 2, 50, 2), Job("a3", 0, 2, 50, 3),
               Job("a4", 0, 2, 50, 4), Job("b1", 1, 4, 50, 5)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(PlacedIds(r), UnorderedElementsAre("a1", "a2", "a3", "b1"));
  EXPECT_EQ(ReasonOf(s, r, "a4"), WaitReason::kAccountLimit);
  EXPECT_FALSE(r.reservation.has_value()) << "a job held by its account's limit blocks nobody";

  // Without a borrow limit the quota guarantees but does not cap.
  s.accounts[0].borrow_limit = -1;
  EXPECT_THAT(PlacedIds(Schedule(s)), UnorderedElementsAre("a1", "a2", "a3", "a4", "b1"));
}

TEST(SharingTest, AUsersCapOnRunningDevicesHoldsItsJobsAndNotOthers) {
  ClusterSnapshot s = TwoAccounts(2, 8);
  s.users.push_back({"carol", 0});  // user 2, account a
  s.users[0].max_devices = 3;
  s.running = {Running("alice-running", 0, 0, 2, 50, absl::Hours(1))};
  Hold(s, 0, 2);
  s.pending = {Job("alice-1", 0, 1, 50, 1), Job("alice-2", 0, 1, 50, 2),
               Job("carol-1", 2, 4, 50, 3)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(PlacedIds(r), UnorderedElementsAre("alice-1", "carol-1"));
  EXPECT_EQ(ReasonOf(s, r, "alice-2"), WaitReason::kUserLimit);
  EXPECT_EQ(r.waits[1].position, 1) << "alice's jobs keep their place in the order";
}

TEST(SharingTest, ANonPreemptibleJobRunsOnlyWithinItsAccountsQuota) {
  ClusterSnapshot s = TwoAccounts(1, 8);
  s.accounts[0].quota = 4;
  s.pending = {Job("fits", 0, 3, 50, 1), Job("beyond", 0, 2, 50, 2), Job("no-quota", 1, 1, 50, 3)};
  for (PendingJobInfo& job : s.pending) job.preemptible = false;
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(PlacedIds(r), ElementsAre("fits"));
  EXPECT_EQ(ReasonOf(s, r, "beyond"), WaitReason::kNotPreemptibleBeyondQuota);
  EXPECT_EQ(ReasonOf(s, r, "no-quota"), WaitReason::kNotPreemptibleBeyondQuota)
      << "an account without quota guarantees nothing";
  s.pending[1].preemptible = true;
  EXPECT_THAT(PlacedIds(Schedule(s)), ElementsAre("fits", "beyond")) << "preemptible may borrow";
}

TEST(SharingTest, JobsWithinQuotaGoFirstThenPriorityThenTheAccountFurthestBelowItsShare) {
  ClusterSnapshot s = TwoAccounts(1, 4);
  s.accounts.push_back({"c"});
  s.users.push_back({"carol", 2});
  s.accounts[0].quota = 2;
  s.accounts[0].usage = 1e6;  // far above its share...
  s.accounts[1].usage = 3000;
  s.accounts[1].share = 3;     // 1000 per share
  s.accounts[2].usage = 2000;  // 2000 per share
  s.pending = {Job("c", 2, 2, 50, 1), Job("b", 1, 2, 50, 2), Job("a", 0, 2, 50, 3),
               Job("high", 2, 1, 60, 4)};
  ScheduleResult r = Schedule(s);
  // ...but within its quota, ahead even of a higher priority; then b (1000 per share) before c
  // (2000 per share).
  EXPECT_THAT(PlacedIds(r), ElementsAre("a", "high"));
  EXPECT_EQ(ReasonOf(s, r, "b"), WaitReason::kDevices) << "the head";
  EXPECT_EQ(ReasonOf(s, r, "c"), WaitReason::kHeadStartUnknown);
  EXPECT_EQ(r.waits[0].position, 3);
}

TEST(SharingTest, APriorityChosenByAUserDoesNotOverrideAnotherAccountsGuarantee) {
  ClusterSnapshot s = TwoAccounts(1, 4);
  s.preemption = true;
  s.accounts[0].quota = 4;
  s.running = {Running("b-borrowing", 1, 0, 4, 10, absl::Hours(1))};
  Hold(s, 0, 4);
  // b's urgent job borrows too; a's job fits in a's quota: a's is the head, and reclaims.
  s.pending = {Job("b-urgent", 1, 4, 100, 1), Job("a-own", 0, 4, 1, 2)};
  ScheduleResult r = Schedule(s);
  EXPECT_EQ(ReasonOf(s, r, "a-own"), WaitReason::kDevices);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_EQ(r.preemption->job_id, "a-own");
  EXPECT_THAT(r.preemption->victims, ElementsAre("b-borrowing"));
}

TEST(SharingTest, ReclaimingNeverLeavesTheBorrowerBelowItsOwnQuota) {
  ClusterSnapshot s = TwoAccounts(2, 4);
  s.preemption = true;
  s.accounts[0].quota = 4;
  s.accounts[1].quota = 2;
  // b holds 6: its first 2 devices' job is within its quota, then a 4-device job that borrows 4...
  s.running = {Running("b-small", 1, 0, 2, 10, absl::Hours(3)),
               Running("b-big", 1, 1, 4, 10, absl::Hours(2))};
  Hold(s, 0, 2);
  Hold(s, 1, 4);
  s.pending = {Job("a-own", 0, 4, 50)};
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("b-big"));
}

TEST(SharingTest, AVictimLargerThanWhatItsAccountBorrowsIsLeftAlone) {
  ClusterSnapshot s = TwoAccounts(2, 4);
  s.preemption = true;
  s.accounts[0].quota = 4;
  s.accounts[1].quota = 4;
  s.accounts.push_back({"c"});
  s.users.push_back({"carol", 2});
  // b holds 5 with a quota of 4: b-later borrows 1 of its 2 devices. Taking it would leave b
  // at 3, below its quota, so a's job (within a's quota) waits instead.
  s.running = {Running("b-first", 1, 0, 3, 10, absl::Hours(4)),
               Running("b-later", 1, 1, 2, 10, absl::Hours(2)),
               Running("c-fixed", 2, 1, 2, 10, absl::Hours(1))};
  s.running[2].preemptible = false;
  Hold(s, 0, 3);
  Hold(s, 1, 4);
  s.pending = {Job("a-own", 0, 3, 50)};
  EXPECT_FALSE(Schedule(s).preemption.has_value());
  s.accounts[1].quota = 3;  // now b-later borrows both its devices
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("b-later"));
}

TEST(SharingTest, AJobStoppingForAnotherIsNotCountedWithinItsAccountsQuota) {
  ClusterSnapshot s = TwoAccounts(2, 4);
  s.preemption = true;
  s.accounts[1].quota = 4;
  // b's older job is already stopping; its newer one is the one b's quota now protects.
  s.running = {Running("b-old", 1, 0, 4, 10, absl::Hours(3)),
               Running("b-new", 1, 1, 4, 10, absl::Hours(2))};
  s.running[0].preempting = true;
  Hold(s, 0, 4);
  Hold(s, 1, 4);
  s.pending = {Job("a-high", 0, 8, 90)};
  EXPECT_FALSE(Schedule(s).preemption.has_value()) << "b-new is within b's quota";
}

// What an account's stopping jobs give back is the head's room, not slack over its quota: b
// holds 10 with a quota of 4, but 4 of them are leaving; taking b-borrowing too would leave b
// with 2 once they are gone.
TEST(SharingTest, AnAccountsStoppingDevicesAreNoSlackForTakingAnotherOfItsJobs) {
  ClusterSnapshot s = TwoAccounts(3, 4);
  s.preemption = true;
  s.accounts[0].quota = 8;
  s.accounts[1].quota = 4;
  s.running = {Running("b-kept", 1, 0, 2, 10, absl::Hours(4)),
               Running("b-borrowing", 1, 1, 4, 10, absl::Hours(3)),
               Running("b-stopping", 1, 2, 4, 10, absl::Hours(2))};
  s.running[2].preempting = true;
  s.running[2].preemptible = false;
  Hold(s, 0, 2);
  Hold(s, 1, 4);
  Hold(s, 2, 4);
  s.pending = {Job("a-own", 0, 8, 50)};
  EXPECT_FALSE(Schedule(s).preemption.has_value()) << "b would end below its quota";
  s.accounts[1].quota = 2;  // now b-borrowing borrows all its devices
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("b-borrowing"));
}

TEST(SharingTest, WithinAnAccountTheUserWithLessUsageGoesFirst) {
  ClusterSnapshot s = TwoAccounts(1, 1);
  s.users.push_back({"carol", 0});
  s.users[0].usage = 500;
  s.users[2].usage = 100;
  s.pending = {Job("alice", 0, 1, 50, 1), Job("carol", 2, 1, 50, 2)};
  EXPECT_THAT(PlacedIds(Schedule(s)), ElementsAre("carol"));
}

TEST(SharingTest, TheLenderTakesBorrowedDevicesBackWhateverTheBorrowersPriority) {
  ClusterSnapshot s = TwoAccounts(2, 4);
  s.preemption = true;
  s.accounts[0].quota = 4;
  s.accounts[1].quota = 4;
  // b runs 8 devices: its earliest job is within its quota, its later one borrows a's.
  s.running = {Running("b-own", 1, 0, 4, 10, absl::Hours(3)),
               Running("b-borrowed", 1, 1, 4, 90, absl::Hours(2))};
  Hold(s, 0, 4);
  Hold(s, 1, 4);
  s.pending = {Job("a-needs-its-quota", 0, 4, 50)};
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("b-borrowed"));

  // Beyond its own quota, a's job may only take borrowed devices of lower priority.
  s.pending = {Job("a-borrowing", 0, 8, 50)};
  EXPECT_FALSE(Schedule(s).preemption.has_value());
  s.running[1].priority = 40;
  s.running[0].priority = 10;
  r = Schedule(s);
  EXPECT_FALSE(r.preemption.has_value()) << "b-own is protected by b's quota";
}

TEST(SharingTest, GuaranteedJobsArePreemptedOnlyByTheirOwnAccountsHigherPriorityJobs) {
  ClusterSnapshot s = TwoAccounts(1, 4);
  s.preemption = true;
  s.accounts[0].quota = 4;
  s.accounts.push_back({"no-quota"});
  s.users.push_back({"carol", 2});
  s.running = {Running("a-low", 0, 0, 4, 10, absl::Hours(1))};
  Hold(s, 0, 4);
  s.pending = {Job("carol-high", 2, 4, 99)};
  EXPECT_FALSE(Schedule(s).preemption.has_value());
  s.pending = {Job("alice-high", 0, 4, 99)};
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("a-low"));
  s.running[0].preemptible = false;
  EXPECT_FALSE(Schedule(s).preemption.has_value()) << "a non-preemptible job is never a victim";
}

TEST(SharingTest, WithoutQuotasPreemptionIsByPriorityAcrossAccounts) {
  ClusterSnapshot s = TwoAccounts(1, 4);
  s.preemption = true;
  s.running = {Running("b-low", 1, 0, 4, 10, absl::Hours(1))};
  Hold(s, 0, 4);
  s.pending = {Job("a-equal", 0, 4, 10)};
  EXPECT_FALSE(Schedule(s).preemption.has_value());
  s.pending = {Job("a-high", 0, 4, 11)};
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("b-low"));
}

TEST(UsageLedgerTest, UsageHalvesEveryHalfLifeAndAddsUp) {
  UsageLedger ledger(absl::Hours(10));
  ledger.Charge("a", 1000, kNow);
  EXPECT_DOUBLE_EQ(ledger.At("a", kNow), 1000);
  EXPECT_NEAR(ledger.At("a", kNow + absl::Hours(10)), 500, 1e-9);
  EXPECT_NEAR(ledger.At("a", kNow + absl::Hours(20)), 250, 1e-9);
  ledger.Charge("a", 100, kNow + absl::Hours(10));
  EXPECT_NEAR(ledger.At("a", kNow + absl::Hours(20)), 300, 1e-9);
  EXPECT_EQ(ledger.At("b", kNow), 0);
  EXPECT_NEAR(ledger.At("a", kNow), 600, 1e-9) << "a clock that runs back does not grow usage";
  ledger.Charge("a", -5, kNow + absl::Hours(10));
  ledger.Charge("a", std::nan(""), kNow + absl::Hours(10));
  EXPECT_NEAR(ledger.At("a", kNow + absl::Hours(10)), 600, 1e-9);
  EXPECT_EQ(UsageLedger(absl::ZeroDuration()).half_life(), absl::Hours(24 * 7));
}

// The closed form against the ledger itself, stepped minute by minute: an account that ran 8
// devices alone for 2 days (half-life 7 days), then one that arrives and takes all 8 while the
// first runs none. The late one goes first until its usage per share reaches the first one's.
TEST(UsageLedgerTest, TimeUntilEvenUsageMatchesTheLedgerStepByStep) {
  const absl::Duration half_life = absl::Hours(24 * 7);
  UsageLedger ledger(half_life);
  absl::Time t = kNow;
  for (int m = 0; m < 2 * 24 * 60; ++m) {
    t += absl::Minutes(1);
    ledger.Charge("early", 8 * 60.0, t);
  }
  const auto even =
      TimeUntilEvenUsage(ledger.At("early", t), 1, 0, ledger.At("late", t), 1, 8, half_life);
  ASSERT_TRUE(even.has_value());
  absl::Duration stepped;
  while (ledger.At("late", t) < ledger.At("early", t)) {
    t += absl::Minutes(1);
    stepped += absl::Minutes(1);
    ledger.Charge("early", 0, t);
    ledger.Charge("late", 8 * 60.0, t);
  }
  EXPECT_LE(absl::AbsDuration(*even - stepped), absl::Minutes(2)) << *even << " vs " << stepped;
  // About the head start again: the early usage decays only a little meanwhile.
  EXPECT_GT(*even, absl::Hours(38));  // 40.0 h
  EXPECT_LT(*even, absl::Hours(48));
  // Shares weigh usage: an early account of share 3 holds a third of that usage per share, so the
  // late one catches up about three times sooner.
  const auto weighted = TimeUntilEvenUsage(8 * 3600 * 48, 3, 0, 0, 1, 8, half_life);
  ASSERT_TRUE(weighted.has_value());
  EXPECT_LT(*weighted, *even / 2);
  // Not ahead: zero. Ahead for good: the one behind runs more per share than the one ahead.
  EXPECT_EQ(TimeUntilEvenUsage(10, 1, 0, 20, 1, 0, half_life), absl::ZeroDuration());
  EXPECT_FALSE(TimeUntilEvenUsage(100, 1, 8, 0, 1, 4, half_life).has_value());
  EXPECT_FALSE(TimeUntilEvenUsage(100, 0, 0, 0, 1, 4, half_life).has_value());
}

TEST(UsageLedgerTest, UsageStartsOverAtEachResetPeriod) {
  // Wednesday 2026-11-25 12:00 UTC.
  const absl::Time wed =
      absl::FromCivil(absl::CivilSecond(2026, 11, 25, 12, 0, 0), absl::UTCTimeZone());
  EXPECT_EQ(NextReset(UsageReset::kDaily, wed),
            absl::FromCivil(absl::CivilDay(2026, 11, 26), absl::UTCTimeZone()));
  EXPECT_EQ(NextReset(UsageReset::kWeekly, wed),
            absl::FromCivil(absl::CivilDay(2026, 11, 30), absl::UTCTimeZone()));  // a Monday
  EXPECT_EQ(PeriodStart(UsageReset::kWeekly, wed),
            absl::FromCivil(absl::CivilDay(2026, 11, 23), absl::UTCTimeZone()));
  EXPECT_EQ(NextReset(UsageReset::kMonthly, wed),
            absl::FromCivil(absl::CivilDay(2026, 12, 1), absl::UTCTimeZone()));
  EXPECT_EQ(NextReset(UsageReset::kNone, wed), absl::InfiniteFuture());
  UsageLedger weekly(absl::Hours(24 * 7), UsageReset::kWeekly);
  weekly.Charge("a", 1000, wed);
  EXPECT_NEAR(weekly.At("a", wed + absl::Hours(24 * 4)), 1000 * std::exp2(-4.0 / 7), 1e-9);
  EXPECT_EQ(weekly.At("a", wed + absl::Hours(24 * 5)), 0);  // past Monday 00:00
  weekly.Charge("a", 10, wed + absl::Hours(24 * 5));
  EXPECT_DOUBLE_EQ(weekly.At("a", wed + absl::Hours(24 * 5)), 10);
  EXPECT_EQ(ParseUsageReset("weekly"), UsageReset::kWeekly);
  EXPECT_FALSE(ParseUsageReset("fortnightly").has_value());
}

// A saturated cluster over simulated time, one-minute scheduling passes: every account keeps
// `queued_per_user` jobs queued per user; jobs run for their max_runtime; usage is charged each
// minute to the ledger (half-life 7 days) and fed back into the snapshot.
class Simulation {
 public:
  struct Account {
    std::string name;
    double share;
    int users;
  };

  Simulation(int nodes, int devices_per_node, std::vector<Account> accounts, std::vector<int> sizes,
             uint32_t seed)
      : sizes_(std::move(sizes)), rng_(seed) {
    snapshot_ = Cluster(nodes, devices_per_node);
    for (const Account& a : accounts) {
      snapshot_.accounts.push_back({a.name, -1, -1, a.share, 0});
      for (int u = 0; u < a.users; ++u) {
        snapshot_.users.push_back({a.name + "-user" + std::to_string(u),
                                   static_cast<int>(snapshot_.accounts.size()) - 1, -1, 0});
      }
    }
    device_seconds_.assign(snapshot_.accounts.size(), 0);
  }

  void Run(absl::Duration duration, int queued_per_user) {
    const absl::Time end = snapshot_.now + duration;
    while (snapshot_.now < end) {
      snapshot_.now += absl::Minutes(1);
      Charge(absl::Minutes(1));
      Finish();
      TopUp(queued_per_user);
      for (size_t a = 0; a < snapshot_.accounts.size(); ++a) {
        snapshot_.accounts[a].usage = ledger_.At(snapshot_.accounts[a].name, snapshot_.now);
      }
      for (SchedUser& u : snapshot_.users) u.usage = ledger_.At(u.name, snapshot_.now);
      Apply(Schedule(snapshot_));
    }
  }

  double device_seconds(int account) const { return device_seconds_[account]; }
  // Longest time any job waited between submission and start (jobs still queued: until now).
  absl::Duration longest_wait() const {
    absl::Duration longest = max_started_wait_;
    for (const PendingJobInfo& p : snapshot_.pending) {
      longest = std::max(longest, snapshot_.now - submitted_.at(p.id));
    }
    return longest;
  }
  int64_t started() const { return started_; }

 private:
  void Charge(absl::Duration dt) {
    for (const RunningJobInfo& r : snapshot_.running) {
      int devices = 0;
      for (const DeviceGrant& g : r.grants) devices += g.devices;
      const double ds = devices * absl::ToDoubleSeconds(dt);
      const SchedUser& user = snapshot_.users[r.user];
      device_seconds_[user.account] += ds;
      ledger_.Charge(snapshot_.accounts[user.account].name, ds, snapshot_.now);
      ledger_.Charge(user.name, ds, snapshot_.now);
    }
  }

  void Finish() {
    std::vector<RunningJobInfo> still;
    for (RunningJobInfo& r : snapshot_.running) {
      if (*r.expected_end <= snapshot_.now) {
        for (const DeviceGrant& g : r.grants) snapshot_.nodes[g.node].free_devices += g.devices;
      } else {
        still.push_back(std::move(r));
      }
    }
    snapshot_.running = std::move(still);
  }

  void TopUp(int queued_per_user) {
    std::vector<int> queued(snapshot_.users.size(), 0);
    for (const PendingJobInfo& p : snapshot_.pending) ++queued[p.user];
    for (size_t u = 0; u < snapshot_.users.size(); ++u) {
      for (; queued[u] < queued_per_user; ++queued[u]) {
        PendingJobInfo job;
        job.id = "job-" + std::to_string(next_seq_);
        job.submit_seq = next_seq_++;
        job.user = static_cast<int>(u);
        job.devices = sizes_[std::uniform_int_distribution<size_t>(0, sizes_.size() - 1)(rng_)];
        job.max_runtime = absl::Minutes(std::uniform_int_distribution<int>(10, 120)(rng_));
        submitted_[job.id] = snapshot_.now;
        snapshot_.pending.push_back(std::move(job));
      }
    }
  }

  void Apply(const ScheduleResult& result) {
    std::map<std::string, const Placement*> placed;
    for (const Placement& p : result.placements) placed[p.job_id] = &p;
    std::vector<PendingJobInfo> still;
    for (PendingJobInfo& job : snapshot_.pending) {
      const auto it = placed.find(job.id);
      if (it == placed.end()) {
        still.push_back(std::move(job));
        continue;
      }
      RunningJobInfo r;
      r.id = job.id;
      r.user = job.user;
      r.start = snapshot_.now;
      r.expected_end = snapshot_.now + *job.max_runtime;
      for (const DeviceGrant& g : it->second->grants) {
        snapshot_.nodes[g.node].free_devices -= g.devices;
      }
      r.grants = it->second->grants;
      max_started_wait_ = std::max(max_started_wait_, snapshot_.now - submitted_.at(job.id));
      ++started_;
      snapshot_.running.push_back(std::move(r));
    }
    snapshot_.pending = std::move(still);
  }

  std::vector<int> sizes_;
  std::mt19937 rng_;
  ClusterSnapshot snapshot_;
  UsageLedger ledger_;
  std::vector<double> device_seconds_;
  std::map<std::string, absl::Time> submitted_;
  absl::Duration max_started_wait_;
  int64_t next_seq_ = 0;
  int64_t started_ = 0;
};

TEST(SharingTest, FairShareConvergesToTheConfiguredSharesOverSimulatedTime) {
  // Two accounts with shares 1:3, both always with work queued, on 32 devices, for 4 days.
  Simulation sim(4, 8, {{"one", 1, 2}, {"three", 3, 3}}, {1, 2, 4, 8}, 7);
  sim.Run(absl::Hours(24 * 4), 5);
  const double one = sim.device_seconds(0), three = sim.device_seconds(1);
  ASSERT_GT(one, 0);
  const double ratio = three / one;
  EXPECT_NEAR(ratio, 3.0, 3.0 * 0.05) << "device-hours " << one / 3600 << " : " << three / 3600;
  const double total_capacity = 32.0 * 4 * 24 * 3600;
  EXPECT_GT((one + three) / total_capacity, 0.9) << "the cluster stays busy";
}

TEST(SharingTest, NoJobStarvesInASaturatedCluster) {
  // Three accounts of unequal shares and sizes up to half the cluster, 4 simulated days. Fair
  // share gives each user at least its share of the devices, and the head's reservation keeps
  // large jobs from being passed over forever, so each job starts within the time its user's
  // share needs to run the jobs queued ahead of it (each at most 16 devices x 120 min), plus one
  // longest job for the reservation.
  const std::vector<Simulation::Account> accounts = {{"small", 1, 1}, {"mid", 2, 2}, {"big", 5, 4}};
  const int queued_per_user = 4;
  const double capacity = 32, max_size = 16;
  const absl::Duration max_runtime = absl::Minutes(120);
  absl::Duration bound;
  for (const Simulation::Account& a : accounts) {
    const double user_devices = capacity * a.share / 8 / a.users;
    bound = std::max(bound, queued_per_user * max_size / user_devices * max_runtime + max_runtime);
  }
  Simulation sim(4, 8, accounts, {1, 2, 4, 16}, 11);
  sim.Run(absl::Hours(24 * 4), queued_per_user);
  EXPECT_GT(sim.started(), 400);
  EXPECT_LT(sim.longest_wait(), bound)
      << absl::FormatDuration(sim.longest_wait()) << " > " << absl::FormatDuration(bound);
}

}  // namespace
}  // namespace trainyard::coordinator
