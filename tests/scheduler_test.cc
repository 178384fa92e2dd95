// Unit tests for the coordinator's Scheduler (server/coordinator/scheduler.h): gang placement,
// ordering, packing, EASY backfill and edge cases, plus a seeded randomized test that checks the
// invariants on a few hundred random snapshots against an independent simulation.
#include "server/coordinator/scheduler.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace trainyard::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

const absl::Time kNow = absl::FromUnixSeconds(1'700'000'000);

// Grants as (node, devices) pairs, for comparison and printing.
std::vector<std::pair<int, int>> Pairs(const std::vector<DeviceGrant>& grants) {
  std::vector<std::pair<int, int>> pairs;
  for (const DeviceGrant& g : grants) pairs.emplace_back(g.node, g.devices);
  return pairs;
}

MATCHER_P2(Grant, node, devices, "") { return arg.node == node && arg.devices == devices; }

// A cluster of schedulable nodes with `total_devices` each and the given free counts.
ClusterSnapshot Cluster(const std::vector<int>& free_devices, int total_devices = 8) {
  ClusterSnapshot s;
  s.now = kNow;
  for (size_t n = 0; n < free_devices.size(); ++n) {
    s.nodes.push_back({"node" + std::to_string(n), total_devices, free_devices[n], true});
  }
  return s;
}

PendingJobInfo Job(const std::string& id, int devices, int priority = 50, int64_t submit_seq = 0,
                   std::optional<absl::Duration> max_runtime = std::nullopt) {
  PendingJobInfo job;
  job.id = id;
  job.devices = devices;
  job.priority = priority;
  job.submit_seq = submit_seq;
  job.max_runtime = max_runtime;
  return job;
}

RunningJobInfo Running(const std::string& id, std::vector<DeviceGrant> grants,
                       std::optional<absl::Time> expected_end) {
  return {id, std::move(grants), expected_end};
}

std::vector<std::string> PlacedIds(const ScheduleResult& r) {
  std::vector<std::string> ids;
  for (const Placement& p : r.placements) ids.push_back(p.job_id);
  return ids;
}

PendingJobInfo OwnedJob(const std::string& id, int devices, const std::string& owner,
                        int64_t submit_seq = 0) {
  PendingJobInfo job = Job(id, devices, 50, submit_seq);
  job.owner = owner;
  return job;
}

TEST(SchedulerTest, ANodeThatTakesOnlySomeOwnersGetsOnlyTheirJobs) {
  // node0 is any owner's; node1 runs ranks only as alice (a worker without root, say). Both are
  // empty: bob's two jobs must share node0 though node1 would be the better fit for the second.
  ClusterSnapshot s = Cluster({8, 8});
  s.nodes[1].owners = {"alice"};
  s.pending = {OwnedJob("bob-a", 5, "bob", 1), OwnedJob("alice-a", 8, "alice", 2),
               OwnedJob("bob-b", 3, "bob", 3), OwnedJob("bob-c", 1, "bob", 4)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(PlacedIds(r), ElementsAre("bob-a", "alice-a", "bob-b"));
  for (const Placement& p : r.placements) {
    ASSERT_EQ(p.grants.size(), 1u) << p.job_id;
    EXPECT_EQ(p.grants[0].node, p.job_id == "alice-a" ? 1 : 0) << p.job_id;
  }
  // bob-c waits for node0 (node1's devices are all alice's anyway), with no known start.
  EXPECT_FALSE(r.reservation.has_value());
  EXPECT_THAT(r.unplaceable, IsEmpty());
}

// CPUs and memory (issue 52): node 0 has 4 free devices but 16 GiB; node 1, 8 devices and
// 64 GiB. Best fit would put a 4-rank job on node 0, but at 8 GiB a rank only 2 fit there.
ClusterSnapshot HostsWithMemory() {
  ClusterSnapshot s = Cluster({4, 8});
  const int64_t gib = int64_t{1} << 30;
  s.nodes[0].total_memory = 16 * gib;
  s.nodes[0].free_memory = 16 * gib;
  s.nodes[0].memory_per_device = 2 * gib;
  s.nodes[1].total_memory = 64 * gib;
  s.nodes[1].free_memory = 64 * gib;
  s.nodes[1].memory_per_device = 8 * gib;
  return s;
}

PendingJobInfo JobWithMemory(const std::string& id, int devices, int64_t gib_per_rank,
                             int64_t submit_seq) {
  PendingJobInfo job = Job(id, devices, 50, submit_seq);
  job.memory_bytes = gib_per_rank << 30;
  return job;
}

TEST(SchedulerTest, ANodeTakesOnlyTheRanksItsMemoryHolds) {
  ClusterSnapshot s = HostsWithMemory();
  // big: 4 x 8 GiB goes to node 1; small asks nothing (2 GiB a rank on node 0) and best-fits
  // node 0's 4 devices; wide: 5 x 8 GiB, with node 1 left 4 devices and 32 GiB, and node 0 none.
  s.pending = {JobWithMemory("big", 4, 8, 1), Job("small", 4, 50, 2),
               JobWithMemory("wide", 5, 8, 3)};
  ScheduleResult r = Schedule(s);
  ASSERT_THAT(PlacedIds(r), ElementsAre("big", "small"));
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(1, 4)));
  EXPECT_THAT(r.placements[1].grants, ElementsAre(Grant(0, 4)));
  EXPECT_EQ(r.waits[2].reason, WaitReason::kDevices);

  // A gang split by memory: 3 x 8 GiB, where node 0 holds 2 and node 1 (its memory held by
  // running ranks but 8 GiB) holds 1.
  s = HostsWithMemory();
  s.nodes[1].free_memory = 8LL << 30;  // running ranks hold the rest: 1 more fits there
  s.pending = {JobWithMemory("gang", 3, 8, 1)};
  r = Schedule(s);
  ASSERT_THAT(PlacedIds(r), ElementsAre("gang"));
  int on0 = 0, on1 = 0;
  for (const DeviceGrant& g : r.placements[0].grants) (g.node == 0 ? on0 : on1) += g.devices;
  EXPECT_EQ(on0, 2);
  EXPECT_EQ(on1, 1);
}

TEST(SchedulerTest, CpusCountAsMemoryDoesAndANodeThatCountsNeitherTakesAny) {
  ClusterSnapshot s = Cluster({8, 8});
  s.nodes[0].total_cpu_millis = 4000;
  s.nodes[0].free_cpu_millis = 4000;
  PendingJobInfo two = Job("two-cpus", 2, 50, 1);
  two.cpu_millis = 2000;
  PendingJobInfo more = Job("one-more", 1, 50, 2);
  more.cpu_millis = 1000;
  s.nodes[1].schedulable = false;
  s.pending = {two, more};
  ScheduleResult r = Schedule(s);
  // two-cpus holds all 4 CPUs of node 0; one-more waits though 6 devices are free.
  EXPECT_THAT(PlacedIds(r), ElementsAre("two-cpus"));
  EXPECT_EQ(r.waits[1].reason, WaitReason::kDevices);
  // Node 1 counts no CPUs: it takes the rank.
  s.nodes[1].schedulable = true;
  r = Schedule(s);
  ASSERT_THAT(PlacedIds(r), ElementsAre("two-cpus", "one-more"));
  EXPECT_THAT(r.placements[1].grants, ElementsAre(Grant(1, 1)));
}

TEST(SchedulerTest, AJobWhoseRanksNoNodeSetHoldsIsUnplaceableAndBlocksNothing) {
  ClusterSnapshot s = HostsWithMemory();
  // 80 GiB a rank: no node holds one. 6 x 16 GiB: node 0 holds 1, node 1 4, so 5 in all.
  s.pending = {JobWithMemory("huge", 1, 80, 1), JobWithMemory("many", 6, 16, 2),
               JobWithMemory("fits", 5, 16, 3)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.unplaceable, ElementsAre("huge", "many"));
  ASSERT_THAT(PlacedIds(r), ElementsAre("fits"));
}

TEST(SchedulerTest, AJobLargerThanTheNodesItMayUseIsUnplaceable) {
  ClusterSnapshot s = Cluster({8, 8}, 8);
  s.nodes[1].owners = {"alice"};
  s.pending = {OwnedJob("bob-12", 12, "bob"), OwnedJob("alice-12", 12, "alice", 1)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.unplaceable, ElementsAre("bob-12"));
  ASSERT_THAT(PlacedIds(r), ElementsAre("alice-12"));
}

TEST(SchedulerTest, ARestrictedNodeIsLeftOutOfOtherOwnersReservations) {
  // bob's 6-device job waits; node1 (alice's only) has its devices free now, but they must not
  // count towards bob's reservation: it starts when node0's running job ends.
  ClusterSnapshot s = Cluster({0, 8}, 8);
  s.nodes[1].owners = {"alice"};
  s.running = {Running("r", {{0, 8}}, kNow + absl::Hours(2))};
  s.pending = {OwnedJob("bob", 6, "bob")};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->start, kNow + absl::Hours(2));
  ASSERT_EQ(r.reservation->grants.size(), 1u);
  EXPECT_EQ(r.reservation->grants[0].node, 0);
  // alice's job backfills onto her node at once, and bob's reservation stays.
  s.pending.push_back(OwnedJob("alice", 8, "alice", 1));
  r = Schedule(s);
  ASSERT_THAT(PlacedIds(r), ElementsAre("alice"));
  EXPECT_EQ(r.placements[0].grants[0].node, 1);
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->job_id, "bob");
}

// A running job of `devices` devices on `node`, at `priority`, started `ran` ago, its last
// checkpoint `since_checkpoint` ago (nullopt: none).
RunningJobInfo RunningFor(const std::string& id, int node, int devices, int priority,
                          absl::Duration ran,
                          std::optional<absl::Duration> since_checkpoint = std::nullopt) {
  RunningJobInfo r = Running(id, {{node, devices}}, std::nullopt);
  r.priority = priority;
  r.start = kNow - ran;
  if (since_checkpoint.has_value()) r.last_checkpoint = kNow - *since_checkpoint;
  return r;
}

TEST(SchedulerTest, ABlockedJobPreemptsTheLowerPriorityJobsThatLoseTheLeastWork) {
  // Four full nodes of 2 devices; the head needs 4 devices.
  ClusterSnapshot s = Cluster({0, 0, 0, 0}, 2);
  s.preemption = true;
  s.running = {
      RunningFor("fresh-ckpt", 0, 2, 10, absl::Hours(5), absl::Minutes(1)),  // lost 2*60 s
      RunningFor("old-ckpt", 1, 2, 10, absl::Hours(5), absl::Hours(2)),      // lost 2*7200 s
      RunningFor("no-ckpt", 2, 2, 10, absl::Hours(1)),                       // lost 2*3600 s
      RunningFor("important", 3, 2, 95, absl::Hours(5)),                     // higher priority
  };
  s.pending = {Job("head", 4, 90)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_EQ(r.preemption->job_id, "head");
  EXPECT_THAT(r.preemption->victims, ElementsAre("fresh-ckpt", "no-ckpt"));
}

TEST(SchedulerTest, NoPreemptionOfEqualPriorityOrTooYoungJobsOrWhenOff) {
  ClusterSnapshot s = Cluster({0, 0}, 2);
  s.preemption = true;
  s.running = {RunningFor("equal", 0, 2, 90, absl::Hours(1)),
               RunningFor("young", 1, 2, 10, absl::Minutes(1))};
  s.pending = {Job("head", 2, 90)};
  EXPECT_FALSE(Schedule(s).preemption.has_value());
  s.running[1].start = kNow - absl::Minutes(6);  // past the 5 min minimum run time
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("young"));
  s.preemption = false;
  EXPECT_FALSE(Schedule(s).preemption.has_value());
}

TEST(SchedulerTest, JobsAlreadyStoppingForTheHeadAreWaitedForNotAddedTo) {
  ClusterSnapshot s = Cluster({1, 0, 0}, 2);
  s.preemption = true;
  s.running = {RunningFor("stopping", 1, 2, 10, absl::Hours(1)),
               RunningFor("other", 2, 2, 10, absl::Hours(1))};
  s.running[0].preempting = true;
  s.pending = {Job("head", 3, 90)};
  EXPECT_FALSE(Schedule(s).preemption.has_value()) << "1 free + 2 stopping hold the head";
  s.pending = {Job("head", 5, 90)};
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("other"));
}

// A head placed in blocks (a tensor-parallel group, HYBRID_SHARD's replica) counts only whole
// blocks as room: one free device on each of two nodes is no room for a group of 2, so it
// preempts the cheaper job beside one of them; devices of a stopping job that make no whole
// block do not make it wait either.
TEST(SchedulerTest, AHeadPlacedInBlocksPreemptsForWholeBlocks) {
  ClusterSnapshot s = Cluster({1, 1}, 2);
  s.preemption = true;
  s.running = {RunningFor("costly", 0, 1, 10, absl::Hours(3)),
               RunningFor("cheap", 1, 1, 10, absl::Hours(1))};
  PendingJobInfo head = Job("tp2", 2, 90);
  head.rank_block = 2;
  s.pending = {head};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("cheap"));
  // Devices one by one (no blocks), the two free ones would do.
  s.pending = {Job("plain", 2, 90)};
  EXPECT_THAT(PlacedIds(Schedule(s)), ElementsAre("plain"));

  // Node 0 full (a job stopping on one device, "cheap" on the other), node 1 one free device
  // beside "costly": the stopping job leaves one free device on each node, no whole block, so
  // the head still preempts, the job that completes node 0.
  s = Cluster({0, 1}, 2);
  s.preemption = true;
  s.running = {RunningFor("stopping", 0, 1, 10, absl::Hours(1)),
               RunningFor("cheap", 0, 1, 10, absl::Hours(1)),
               RunningFor("costly", 1, 1, 10, absl::Hours(3))};
  s.running[0].preempting = true;
  s.pending = {head};
  r = Schedule(s);
  ASSERT_TRUE(r.preemption.has_value());
  EXPECT_THAT(r.preemption->victims, ElementsAre("cheap"));
  // Devices one by one, the free one and the stopping one would do: it waits for them.
  s.pending = {Job("plain", 2, 90)};
  EXPECT_FALSE(Schedule(s).preemption.has_value());
}

TEST(SchedulerTest, NoPreemptionWhenEvenEveryCandidateWouldNotMakeRoom) {
  ClusterSnapshot s = Cluster({0, 0}, 2);
  s.preemption = true;
  s.running = {RunningFor("low", 0, 2, 10, absl::Hours(1)),
               RunningFor("high", 1, 2, 99, absl::Hours(1))};
  s.pending = {Job("head", 4, 90)};
  EXPECT_FALSE(Schedule(s).preemption.has_value());
}

TEST(SchedulerTest, EmptySnapshotYieldsNothing) {
  ScheduleResult r = Schedule(ClusterSnapshot{});
  EXPECT_THAT(r.placements, IsEmpty());
  EXPECT_FALSE(r.reservation.has_value());
  EXPECT_THAT(r.unplaceable, IsEmpty());

  ClusterSnapshot no_nodes;
  no_nodes.pending.push_back(Job("a", 1));
  r = Schedule(no_nodes);
  EXPECT_THAT(r.placements, IsEmpty());
  EXPECT_THAT(r.unplaceable, ElementsAre("a"));
}

TEST(SchedulerTest, GangJobIsPlacedWhollyOrNotAtAll) {
  ClusterSnapshot s = Cluster({3, 2});
  s.pending.push_back(Job("six", 6));
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  EXPECT_THAT(r.unplaceable, IsEmpty());  // 16 devices exist; they are just not free

  s.pending = {Job("five", 5)};
  r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 1u);
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(0, 3), Grant(1, 2)));
  EXPECT_FALSE(r.placements[0].backfilled);
}

TEST(SchedulerTest, HigherPriorityIsPlacedFirst) {
  ClusterSnapshot s = Cluster({8});
  s.pending = {Job("p10", 1, 10, 1), Job("p90", 1, 90, 2), Job("p50", 1, 50, 3)};
  EXPECT_THAT(PlacedIds(Schedule(s)), ElementsAre("p90", "p50", "p10"));

  // Only room for one: the higher priority wins although submitted later.
  s = Cluster({4});
  s.pending = {Job("low", 4, 10, 1), Job("high", 4, 90, 2)};
  EXPECT_THAT(PlacedIds(Schedule(s)), ElementsAre("high"));
}

TEST(SchedulerTest, EqualPriorityFollowsSubmissionOrder) {
  ClusterSnapshot s = Cluster({8});
  s.pending = {Job("c", 1, 50, 3), Job("a", 1, 50, 1), Job("b", 1, 50, 2)};
  EXPECT_THAT(PlacedIds(Schedule(s)), ElementsAre("a", "b", "c"));

  s = Cluster({2});
  s.pending = {Job("later", 2, 50, 5), Job("earlier", 2, 50, 2)};
  EXPECT_THAT(PlacedIds(Schedule(s)), ElementsAre("earlier"));
}

TEST(SchedulerTest, SingleNodeJobUsesBestFitNode) {
  ClusterSnapshot s = Cluster({6, 3, 8, 3});
  s.pending = {Job("three", 3, 50, 1), Job("five", 5, 50, 2)};
  ScheduleResult r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 2u);
  // Fewest free that fits; tie between nodes 1 and 3 goes to the lower index.
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(1, 3)));
  // 6 free on node 0 is a tighter fit than 8 on node 2.
  EXPECT_THAT(r.placements[1].grants, ElementsAre(Grant(0, 5)));
}

TEST(SchedulerTest, MultiNodeJobUsesFewestNodes) {
  ClusterSnapshot s = Cluster({2, 8, 5, 8, 1});
  s.pending = {Job("thirteen", 13)};
  ScheduleResult r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 1u);
  // Most free first (node 1), then the best fit for the remaining 5 (node 2), not node 3.
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(1, 8), Grant(2, 5)));
}

TEST(SchedulerTest, FragmentedFreeDevicesHostGangUpToTheirSum) {
  ClusterSnapshot s = Cluster({2, 2, 2, 2});
  s.pending = {Job("eight", 8)};
  ScheduleResult r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 1u);
  EXPECT_THAT(r.placements[0].grants,
              ElementsAre(Grant(0, 2), Grant(1, 2), Grant(2, 2), Grant(3, 2)));

  s.pending = {Job("nine", 9)};
  r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  EXPECT_THAT(r.unplaceable, IsEmpty());
}

// resources.nodes (torchrun's --nnodes): one block of devices on each of that many distinct nodes,
// the best-fitting ones, never two blocks on one node.
TEST(SchedulerTest, AJobOnNNodesTakesOneBlockOnEachOfNDistinctNodes) {
  ClusterSnapshot s = Cluster({8, 2, 3});
  PendingJobInfo job = Job("nodes3", 3);  // 3 nodes, 1 device each
  job.one_block_per_node = true;
  s.pending = {job};
  ScheduleResult r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 1u);
  // Packed, it would all go to node 2 (3 free): spread, one on each, best fit first.
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(1, 1), Grant(2, 1), Grant(0, 1)));
  // The nodes keep their other devices for the next job of the pass.
  s.pending = {job, Job("after", 9, 50, 1)};
  r = Schedule(s);
  EXPECT_THAT(PlacedIds(r), ElementsAre("nodes3", "after"));

  // 2 nodes of 2 devices each: a node with 3 free takes 2, not 3 (or 2 + 2).
  s = Cluster({3, 1, 4});
  job = Job("nodes2x2", 4);
  job.rank_block = 2;
  job.one_block_per_node = true;
  s.pending = {job};
  r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 1u);
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(0, 2), Grant(2, 2)));

  // Enough devices, too few nodes with a block free: it waits (for node 1's running job); on a
  // cluster of fewer nodes than it asks for, it can never run.
  s = Cluster({8, 0});
  s.running = {Running("r", {{1, 8}}, kNow + absl::Hours(1))};
  job = Job("nodes2", 2);
  job.one_block_per_node = true;
  s.pending = {job};
  r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  EXPECT_THAT(r.unplaceable, IsEmpty());
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->start, kNow + absl::Hours(1));
  EXPECT_THAT(r.reservation->grants, ElementsAre(Grant(0, 1), Grant(1, 1)));
  s = Cluster({8});
  s.pending = {job};
  EXPECT_THAT(Schedule(s).unplaceable, ElementsAre("nodes2"));
}

// parallel.tensor_parallel: every node's share of the job is a whole number of tensor-parallel
// groups, so no group spans nodes.
TEST(SchedulerTest, ATensorParallelJobTakesEachNodeInWholeGroups) {
  ClusterSnapshot s = Cluster({3, 3, 1});
  PendingJobInfo job = Job("tp2", 4);
  job.rank_block = 2;
  s.pending = {job};
  ScheduleResult r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 1u);
  // Without blocks it would take 3 + 1.
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(0, 2), Grant(1, 2)));
  s.pending = {Job("plain", 4)};
  EXPECT_THAT(Schedule(s).placements[0].grants, ElementsAre(Grant(0, 3), Grant(2, 1)));

  // 5 free devices, but only 4 in whole groups of 2 (2 + 2 + 0): a 6-rank job waits for them.
  s = Cluster({3, 3, 1});
  job.devices = 6;
  s.pending = {job};
  r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  EXPECT_THAT(r.unplaceable, IsEmpty());
  EXPECT_EQ(r.waits[0].reason, WaitReason::kDevices);

  // Nodes of 1 device can never hold a group of 2; nor can a job that is not a whole number of
  // groups be placed.
  s = Cluster({1, 1, 1, 1}, /*total_devices=*/1);
  job.devices = 2;
  s.pending = {job};
  r = Schedule(s);
  EXPECT_THAT(r.unplaceable, ElementsAre("tp2"));
  s = Cluster({8});
  job.devices = 3;
  s.pending = {job};
  EXPECT_THAT(Schedule(s).unplaceable, ElementsAre("tp2"));
}

// Node 0: 4 free, 4 held until now+1h. Node 1: full, held forever. A head job of 8 can start on
// node 0 at now+1h.
ClusterSnapshot HeadWaitsOneHourOnNode0() {
  ClusterSnapshot s = Cluster({4, 0});
  s.running = {Running("r1", {{0, 4}}, kNow + absl::Hours(1)),
               Running("r2", {{1, 8}}, std::nullopt)};
  s.pending = {Job("head", 8, 90, 1)};
  return s;
}

TEST(SchedulerTest, ShortJobIsBackfilledWhileHeadWaits) {
  ClusterSnapshot s = HeadWaitsOneHourOnNode0();
  s.pending.push_back(Job("short", 4, 10, 2, absl::Minutes(30)));
  ScheduleResult r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 1u);
  EXPECT_EQ(r.placements[0].job_id, "short");
  EXPECT_TRUE(r.placements[0].backfilled);
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(0, 4)));
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->job_id, "head");
  EXPECT_EQ(r.reservation->start, kNow + absl::Hours(1));
  EXPECT_THAT(r.reservation->grants, ElementsAre(Grant(0, 8)));
}

TEST(SchedulerTest, JobEndingExactlyAtReservationIsBackfilled) {
  ClusterSnapshot s = HeadWaitsOneHourOnNode0();
  s.pending.push_back(Job("exact", 4, 10, 2, absl::Hours(1)));
  EXPECT_THAT(PlacedIds(Schedule(s)), ElementsAre("exact"));
}

TEST(SchedulerTest, LongJobThatWouldDelayHeadIsNotBackfilled) {
  ClusterSnapshot s = HeadWaitsOneHourOnNode0();
  s.pending.push_back(Job("long", 4, 10, 2, absl::Hours(2)));
  s.pending.push_back(Job("unknown", 1, 10, 3));
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->start, kNow + absl::Hours(1));
}

TEST(SchedulerTest, JobWithoutRuntimeIsBackfilledOnDevicesHeadDoesNotNeed) {
  // Free now: node 0 has 4, node 2 has 5 (9 total). Head of 10 starts at now+1h on node 0 (8) and
  // node 2 (2), leaving 3 spare devices on node 2.
  ClusterSnapshot s = Cluster({4, 0, 5});
  s.running = {Running("r1", {{0, 4}}, kNow + absl::Hours(1)),
               Running("r2", {{1, 8}}, std::nullopt), Running("r3", {{2, 3}}, std::nullopt)};
  s.pending = {Job("head", 10, 90, 1), Job("x", 2, 10, 2), Job("y", 4, 10, 3), Job("z", 1, 10, 4)};
  ScheduleResult r = Schedule(s);
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->start, kNow + absl::Hours(1));
  EXPECT_THAT(r.reservation->grants, ElementsAre(Grant(0, 8), Grant(2, 2)));
  // x would best-fit on node 0 (4 free) but goes to node 2; y (4) does not fit in the 1 spare
  // device left; z (1) does.
  ASSERT_EQ(r.placements.size(), 2u);
  EXPECT_EQ(r.placements[0].job_id, "x");
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(2, 2)));
  EXPECT_TRUE(r.placements[0].backfilled);
  EXPECT_EQ(r.placements[1].job_id, "z");
  EXPECT_THAT(r.placements[1].grants, ElementsAre(Grant(2, 1)));
}

TEST(SchedulerTest, NoBackfillWhenHeadStartIsUnknown) {
  ClusterSnapshot s = Cluster({4});
  s.running = {Running("forever", {{0, 4}}, std::nullopt)};
  s.pending = {Job("head", 8, 90, 1), Job("tiny", 1, 10, 2, absl::Minutes(1))};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  EXPECT_FALSE(r.reservation.has_value());
  EXPECT_THAT(r.unplaceable, IsEmpty());
}

TEST(SchedulerTest, ReservationCountsJobsPlacedInSamePass) {
  ClusterSnapshot s = Cluster({8});
  s.pending = {Job("first", 8, 90, 1, absl::Hours(1)), Job("second", 8, 80, 2)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(PlacedIds(r), ElementsAre("first"));
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->job_id, "second");
  EXPECT_EQ(r.reservation->start, kNow + absl::Hours(1));
  EXPECT_THAT(r.reservation->grants, ElementsAre(Grant(0, 8)));
}

TEST(SchedulerTest, OverdueRunningJobIsProjectedToEndNow) {
  ClusterSnapshot s = Cluster({0});
  s.running = {Running("overdue", {{0, 8}}, kNow - absl::Minutes(10))};
  s.pending = {Job("head", 8)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.placements, IsEmpty());
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->start, kNow);
}

TEST(SchedulerTest, UnplaceableJobDoesNotBlockOthers) {
  ClusterSnapshot s = Cluster({8, 8, 8});
  s.nodes[2].schedulable = false;
  s.pending = {Job("huge", 17, 100, 1), Job("zero", 0, 100, 2), Job("fits", 16, 10, 3)};
  ScheduleResult r = Schedule(s);
  EXPECT_THAT(r.unplaceable, ElementsAre("huge", "zero"));
  ASSERT_EQ(r.placements.size(), 1u);
  EXPECT_EQ(r.placements[0].job_id, "fits");
  EXPECT_FALSE(r.placements[0].backfilled);
  EXPECT_FALSE(r.reservation.has_value());
}

TEST(SchedulerTest, NonSchedulableNodesAreIgnored) {
  ClusterSnapshot s = Cluster({8, 2});
  s.nodes[0].schedulable = false;
  s.running = {Running("r", {{1, 6}}, kNow + absl::Hours(1))};
  s.pending = {Job("two", 2, 90, 1), Job("four", 4, 50, 2)};
  ScheduleResult r = Schedule(s);
  ASSERT_EQ(r.placements.size(), 1u);
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(1, 2)));
  ASSERT_TRUE(r.reservation.has_value());
  EXPECT_EQ(r.reservation->job_id, "four");
  EXPECT_THAT(r.reservation->grants, ElementsAre(Grant(1, 4)));
}

TEST(SchedulerTest, FreeOutsideZeroToTotalIsClamped) {
  ClusterSnapshot s = Cluster({10, -3}, /*total_devices=*/4);
  s.pending = {Job("five", 5, 90, 1), Job("four", 4, 50, 2), Job("one", 1, 10, 3)};
  ScheduleResult r = Schedule(s);
  // Capacity is 8, so "five" is placeable, but only node 0's 4 (not 10) devices are free.
  EXPECT_THAT(r.unplaceable, IsEmpty());
  EXPECT_FALSE(r.reservation.has_value());  // no running job will ever free node 1
  EXPECT_THAT(r.placements, IsEmpty());     // "five" blocks with an unknown start

  s.pending = {Job("four", 4, 50, 2), Job("one", 1, 10, 3)};
  r = Schedule(s);
  EXPECT_THAT(PlacedIds(r), ElementsAre("four"));
  EXPECT_THAT(r.placements[0].grants, ElementsAre(Grant(0, 4)));
}

// ---------------------------------------------------------------------------------------------
// Randomized checks.

ClusterSnapshot RandomSnapshot(std::mt19937& rng) {
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  ClusterSnapshot s;
  s.now = kNow;
  const int num_nodes = uniform(0, 10);
  std::vector<int> free;
  for (int n = 0; n < num_nodes; ++n) {
    const int total = uniform(1, 8);
    s.nodes.push_back({"n" + std::to_string(n), total, total, uniform(0, 9) != 0});
    free.push_back(total);
  }
  const int num_running = num_nodes == 0 ? 0 : uniform(0, 12);
  for (int j = 0; j < num_running; ++j) {
    RunningJobInfo job;
    job.id = "r" + std::to_string(j);
    const int spans = uniform(1, 2);
    for (int k = 0; k < spans; ++k) {
      const int n = uniform(0, num_nodes - 1);
      if (free[n] == 0) continue;
      const int take = uniform(1, free[n]);
      free[n] -= take;
      job.grants.push_back({n, take});
    }
    if (job.grants.empty()) continue;
    if (uniform(0, 3) != 0) job.expected_end = kNow + absl::Minutes(uniform(-20, 180));
    s.running.push_back(job);
  }
  for (int n = 0; n < num_nodes; ++n) {
    s.nodes[n].free_devices = free[n];
    if (uniform(0, 29) == 0) s.nodes[n].free_devices = s.nodes[n].total_devices + 3;  // bug input
  }
  const int num_pending = uniform(0, 15);
  for (int j = 0; j < num_pending; ++j) {
    std::optional<absl::Duration> runtime;
    if (uniform(0, 1) == 0) runtime = absl::Minutes(uniform(1, 200));
    s.pending.push_back(
        Job("p" + std::to_string(j), uniform(1, 20), 10 * uniform(1, 3), uniform(0, 6), runtime));
  }
  return s;
}

void ExpectSameResult(const ScheduleResult& a, const ScheduleResult& b) {
  ASSERT_EQ(a.placements.size(), b.placements.size());
  for (size_t i = 0; i < a.placements.size(); ++i) {
    EXPECT_EQ(a.placements[i].job_id, b.placements[i].job_id);
    EXPECT_EQ(Pairs(a.placements[i].grants), Pairs(b.placements[i].grants));
    EXPECT_EQ(a.placements[i].backfilled, b.placements[i].backfilled);
  }
  ASSERT_EQ(a.reservation.has_value(), b.reservation.has_value());
  if (a.reservation.has_value()) {
    EXPECT_EQ(a.reservation->job_id, b.reservation->job_id);
    EXPECT_EQ(a.reservation->start, b.reservation->start);
    EXPECT_EQ(Pairs(a.reservation->grants), Pairs(b.reservation->grants));
  }
  EXPECT_EQ(a.unplaceable, b.unplaceable);
}

TEST(SchedulerTest, ScheduleIsDeterministicRegardlessOfPendingOrder) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 100; ++iter) {
    ClusterSnapshot s = RandomSnapshot(rng);
    const ScheduleResult first = Schedule(s);
    ExpectSameResult(first, Schedule(s));
    std::shuffle(s.pending.begin(), s.pending.end(), rng);
    ExpectSameResult(first, Schedule(s));
  }
}

// Per-node free devices at `at` if all running jobs and `placements` end as expected, starting from
// `free_now` (after the placements). Mirrors the documented projection, written independently.
std::vector<int> ProjectFree(const ClusterSnapshot& s, std::vector<int> free_now,
                             const std::vector<const Placement*>& placements,
                             const std::map<std::string, const PendingJobInfo*>& by_id,
                             absl::Time at) {
  auto release = [&](const std::vector<DeviceGrant>& grants, absl::Time end) {
    if (std::max(end, s.now) > at) return;
    for (const DeviceGrant& g : grants) {
      if (!s.nodes[g.node].schedulable) continue;
      free_now[g.node] = std::min(s.nodes[g.node].total_devices, free_now[g.node] + g.devices);
    }
  };
  for (const RunningJobInfo& r : s.running) {
    if (r.expected_end.has_value()) release(r.grants, *r.expected_end);
  }
  for (const Placement* p : placements) {
    const PendingJobInfo& job = *by_id.at(p->job_id);
    if (job.max_runtime.has_value()) release(p->grants, s.now + *job.max_runtime);
  }
  return free_now;
}

int Sum(const std::vector<int>& v) {
  int total = 0;
  for (int x : v) total += x;
  return total;
}

void CheckInvariants(const ClusterSnapshot& s, const ScheduleResult& r) {
  std::map<std::string, const PendingJobInfo*> by_id;
  for (const PendingJobInfo& j : s.pending) by_id[j.id] = &j;
  std::vector<const PendingJobInfo*> order;
  for (const PendingJobInfo& j : s.pending) order.push_back(&j);
  std::sort(order.begin(), order.end(), [](const PendingJobInfo* a, const PendingJobInfo* b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    if (a->submit_seq != b->submit_seq) return a->submit_seq < b->submit_seq;
    return a->id < b->id;
  });
  int capacity = 0;
  std::vector<int> free(s.nodes.size(), 0);
  for (size_t n = 0; n < s.nodes.size(); ++n) {
    if (!s.nodes[n].schedulable) continue;
    capacity += s.nodes[n].total_devices;
    free[n] = std::clamp(s.nodes[n].free_devices, 0, s.nodes[n].total_devices);
  }

  // Unplaceable: exactly the oversized jobs, in order.
  std::vector<std::string> expected_unplaceable;
  std::vector<const PendingJobInfo*> placeable;
  for (const PendingJobInfo* j : order) {
    if (j->devices > capacity) {
      expected_unplaceable.push_back(j->id);
    } else {
      placeable.push_back(j);
    }
  }
  EXPECT_EQ(r.unplaceable, expected_unplaceable);

  // Gangs are whole, on schedulable nodes, never over-allocating a node.
  std::set<std::string> placed;
  for (const Placement& p : r.placements) {
    ASSERT_TRUE(placed.insert(p.job_id).second) << "placed twice: " << p.job_id;
    int devices = 0;
    std::set<int> nodes;
    for (const DeviceGrant& g : p.grants) {
      ASSERT_GE(g.node, 0);
      ASSERT_LT(g.node, static_cast<int>(s.nodes.size()));
      EXPECT_TRUE(s.nodes[g.node].schedulable);
      EXPECT_GT(g.devices, 0);
      EXPECT_TRUE(nodes.insert(g.node).second) << "node listed twice in " << p.job_id;
      devices += g.devices;
      free[g.node] -= g.devices;
      EXPECT_GE(free[g.node], 0) << "node " << g.node << " over-allocated by " << p.job_id;
    }
    EXPECT_EQ(devices, by_id.at(p.job_id)->devices) << p.job_id;
  }

  // In-order placements are a prefix of the order; the head follows; backfills come after it.
  size_t k = 0;
  for (; k < r.placements.size() && !r.placements[k].backfilled; ++k) {
    ASSERT_LT(k, placeable.size());
    EXPECT_EQ(r.placements[k].job_id, placeable[k]->id);
  }
  const size_t in_order = k;
  for (; k < r.placements.size(); ++k) EXPECT_TRUE(r.placements[k].backfilled);
  if (in_order == placeable.size()) {
    EXPECT_FALSE(r.reservation.has_value());
    EXPECT_EQ(r.placements.size(), in_order);
    return;
  }
  const PendingJobInfo& head = *placeable[in_order];
  EXPECT_EQ(placed.count(head.id), 0u);

  // Independently recompute the head's earliest start from the in-order state only.
  std::vector<int> free_in_order = free;
  std::vector<const Placement*> in_order_placements, all_placements;
  for (size_t i = 0; i < r.placements.size(); ++i) {
    all_placements.push_back(&r.placements[i]);
    if (i < in_order) {
      in_order_placements.push_back(&r.placements[i]);
    } else {
      for (const DeviceGrant& g : r.placements[i].grants) free_in_order[g.node] += g.devices;
    }
  }
  EXPECT_LT(Sum(free_in_order), head.devices) << "head fitted but was not placed";
  std::vector<absl::Time> times;
  for (const RunningJobInfo& rj : s.running) {
    if (rj.expected_end.has_value()) times.push_back(std::max(*rj.expected_end, s.now));
  }
  for (const Placement* p : in_order_placements) {
    const PendingJobInfo& j = *by_id.at(p->job_id);
    if (j.max_runtime.has_value()) times.push_back(s.now + *j.max_runtime);
  }
  std::sort(times.begin(), times.end());
  std::optional<absl::Time> earliest;
  for (absl::Time t : times) {
    if (Sum(ProjectFree(s, free_in_order, in_order_placements, by_id, t)) >= head.devices) {
      earliest = t;
      break;
    }
  }
  ASSERT_EQ(r.reservation.has_value(), earliest.has_value());
  if (!earliest.has_value()) {
    EXPECT_EQ(r.placements.size(), in_order) << "backfill past a head with unknown start";
    return;
  }
  EXPECT_EQ(r.reservation->job_id, head.id);
  EXPECT_EQ(r.reservation->start, *earliest);

  // The head's grants still fit at its start with every backfill in place: not delayed.
  const std::vector<int> at_start =
      ProjectFree(s, free, all_placements, by_id, r.reservation->start);
  int reserved = 0;
  for (const DeviceGrant& g : r.reservation->grants) {
    EXPECT_TRUE(s.nodes[g.node].schedulable);
    EXPECT_LE(g.devices, at_start[g.node]) << "backfill delays head on node " << g.node;
    reserved += g.devices;
  }
  EXPECT_EQ(reserved, head.devices);

  // Dropping the backfilled jobs does not change the reservation either.
  ClusterSnapshot without = s;
  without.pending.clear();
  for (const PendingJobInfo& j : s.pending) {
    bool backfilled = false;
    for (const Placement& p : r.placements) backfilled |= p.backfilled && p.job_id == j.id;
    if (!backfilled) without.pending.push_back(j);
  }
  const ScheduleResult r2 = Schedule(without);
  ASSERT_TRUE(r2.reservation.has_value());
  EXPECT_EQ(r2.reservation->start, r.reservation->start);
}

TEST(SchedulerTest, RandomSnapshotsKeepInvariants) {
  std::mt19937 rng(42);
  int backfills = 0, reservations = 0, placements = 0;
  for (int iter = 0; iter < 500; ++iter) {
    const ClusterSnapshot s = RandomSnapshot(rng);
    const ScheduleResult r = Schedule(s);
    SCOPED_TRACE("iteration " + std::to_string(iter));
    CheckInvariants(s, r);
    if (HasFatalFailure()) return;
    placements += r.placements.size();
    reservations += r.reservation.has_value();
    for (const Placement& p : r.placements) backfills += p.backfilled;
  }
  // The generator must exercise the interesting paths, or the checks above prove little.
  // (With seed 42: 478 placements, 281 reservations, 106 backfills.)
  EXPECT_GT(placements, 300);
  EXPECT_GT(reservations, 100);
  EXPECT_GT(backfills, 50);
}

// CPUs and memory on random clusters: whatever the mix of jobs asking for nothing, for less than
// a device's share and for more, no node's placements hold more CPUs or memory than it had free,
// and every placed job is one that asked for devices the pass could give.
TEST(SchedulerTest, RandomClustersThatCountCpusAndMemoryAreNeverOvercommitted) {
  std::mt19937 rng(7);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int placed = 0, capped_somewhere = 0;
  for (int iter = 0; iter < 300; ++iter) {
    ClusterSnapshot s;
    s.now = kNow;
    const int nodes = uniform(1, 8);
    for (int n = 0; n < nodes; ++n) {
      SchedNode node{"node" + std::to_string(n), 8, uniform(0, 8), true};
      if (uniform(0, 3) > 0) {
        node.total_cpu_millis = 16'000;
        node.free_cpu_millis = uniform(0, 16) * 1000;
        node.cpu_millis_per_device = 2'000;
        node.total_memory = 64;
        node.free_memory = uniform(0, 64);
        node.memory_per_device = 8;
      }
      s.nodes.push_back(node);
    }
    const int jobs = uniform(1, 12);
    for (int j = 0; j < jobs; ++j) {
      PendingJobInfo job = Job("j" + std::to_string(j), uniform(1, 10), uniform(1, 100), j);
      const int kind = uniform(0, 2);  // nothing, at most a device's share, more
      if (kind == 1) {
        job.cpu_millis = uniform(1, 2) * 1000;
        job.memory_bytes = uniform(1, 8);
      } else if (kind == 2) {
        job.cpu_millis = uniform(3, 8) * 1000;
        job.memory_bytes = uniform(9, 32);
      }
      s.pending.push_back(job);
    }
    const ScheduleResult r = Schedule(s);
    std::vector<int64_t> cpu(nodes, 0), memory(nodes, 0), devices(nodes, 0);
    std::map<std::string, const PendingJobInfo*> by_id;
    for (const PendingJobInfo& j : s.pending) by_id[j.id] = &j;
    for (const Placement& p : r.placements) {
      const PendingJobInfo& job = *by_id.at(p.job_id);
      int total = 0;
      for (const DeviceGrant& g : p.grants) {
        const SchedNode& n = s.nodes[g.node];
        devices[g.node] += g.devices;
        cpu[g.node] += g.devices * (job.cpu_millis > 0 ? job.cpu_millis : n.cpu_millis_per_device);
        memory[g.node] +=
            g.devices * (job.memory_bytes > 0 ? job.memory_bytes : n.memory_per_device);
        total += g.devices;
      }
      EXPECT_EQ(total, job.devices) << p.job_id;
      ++placed;
    }
    for (int n = 0; n < nodes; ++n) {
      const SchedNode& node = s.nodes[n];
      SCOPED_TRACE("iteration " + std::to_string(iter) + " node " + std::to_string(n));
      EXPECT_LE(devices[n], node.free_devices);
      if (node.total_cpu_millis >= 0) {
        EXPECT_LE(cpu[n], node.free_cpu_millis);
        capped_somewhere += devices[n] < node.free_devices && node.free_cpu_millis - cpu[n] < 2'000;
      }
      if (node.total_memory >= 0) EXPECT_LE(memory[n], node.free_memory);
    }
    if (HasFailure()) return;
  }
  EXPECT_GT(placed, 300);           // the generator places plenty
  EXPECT_GT(capped_somewhere, 20);  // and CPUs, not devices, often bound a node
}

}  // namespace
}  // namespace trainyard::coordinator
