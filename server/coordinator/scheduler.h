// The coordinator's placement policy: given a snapshot of the cluster (nodes, running jobs, queued
// jobs) it decides which queued jobs start now, on which devices, and when the first blocked job
// is expected to start.
//
// Called by the coordinator's scheduling loop, which builds a ClusterSnapshot under its own lock,
// calls Schedule() and then applies the placements. Schedule() is pure logic: no I/O, no clock
// reads (time comes from snapshot.now), no locks, no threads, no global state. It may be called
// from any thread, concurrently, on distinct or shared (const) snapshots.
//
// Policy, in short: gang placement (all devices of a job at once or none), strict order by priority
// then submission, packing onto as few nodes as possible (best fit on one node when possible), and
// EASY backfill behind the first blocked job (only that job's reservation is protected). A job
// sees only the nodes that take its owner's jobs: the others are out of its placement, its
// reservation and its capacity.
//
// Sharing (all of it data in the snapshot, so the policy stays pure): users belong to accounts
// with an optional device quota (guaranteed devices), a limit on borrowing beyond it, and a fair
// share; users may have a cap on running devices. Jobs that fit in their account's quota go
// before every other (a priority chosen by a user cannot override another account's guarantee);
// then priority; among equal priority, the account furthest below its fair share (by decayed
// usage), then the user with the least usage, then submission.
#ifndef TRAINYARD_SERVER_COORDINATOR_SCHEDULER_H_
#define TRAINYARD_SERVER_COORDINATOR_SCHEDULER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace trainyard::coordinator {

struct SchedNode {
  std::string id;
  int total_devices = 0;
  // Devices not held by any running job. A value outside [0, total_devices] is a caller bug;
  // Schedule() clamps it into that range (it never trusts it to over-allocate).
  int free_devices = 0;
  bool schedulable = true;  // false: node lost/draining; nothing new is placed on it
  // Non-empty: only jobs of these owners are placed here (a worker that cannot run ranks as
  // other accounts); empty: any owner's.
  std::vector<std::string> owners;
  // CPUs (in thousandths) and memory (bytes) ranks may use on the node, and what running ranks
  // leave free; negative: not counted (only devices limit the node). A free value outside
  // [0, total] is clamped into it.
  int64_t total_cpu_millis = -1, free_cpu_millis = -1;
  int64_t total_memory = -1, free_memory = -1;
  // What a rank of a job that asks for no CPUs (no memory) holds here; 0: nothing.
  int64_t cpu_millis_per_device = 0, memory_per_device = 0;
};

struct DeviceGrant {
  int node = 0;     // index into ClusterSnapshot::nodes
  int devices = 0;  // how many devices of that node
};

// An account (team) of users, for quotas and fair share.
struct SchedAccount {
  std::string name;
  // Devices guaranteed to the account: its jobs within it go first, are preempted only for its
  // own jobs of higher priority, and devices other accounts borrowed are taken back for them.
  // Negative: no quota (nothing guaranteed, no limit).
  int64_t quota = -1;
  // Devices it may use beyond its quota while others leave them idle; negative: no limit. Only
  // with a quota.
  int64_t borrow_limit = -1;
  double share = 1;  // fair-share weight (> 0; anything else reads as 1)
  double usage = 0;  // decayed device-seconds as of snapshot.now
};

struct SchedUser {
  std::string name;
  int account = -1;          // index into ClusterSnapshot::accounts; -1: none
  int64_t max_devices = -1;  // cap on the devices its running jobs hold; negative: none
  double usage = 0;          // decayed device-seconds as of snapshot.now
};

struct RunningJobInfo {
  std::string id;
  std::vector<DeviceGrant> grants;
  // start + max_runtime; nullopt = unknown (runs "forever"). A time before snapshot.now (an overdue
  // job) is projected to end at now.
  std::optional<absl::Time> expected_end;
  // For preemption (ClusterSnapshot::preemption):
  int priority = 50;
  absl::Time start = absl::InfinitePast();    // of its current attempt
  std::optional<absl::Time> last_checkpoint;  // its latest checkpoint, if any
  // Already stopping (asked to stop for another job, or an ended attempt's ranks still exiting):
  // its devices come free soon, and it is no victim.
  bool preempting = false;
  int user = -1;            // index into ClusterSnapshot::users; -1: outside accounts and caps
  bool preemptible = true;  // false: never a victim
};

struct PendingJobInfo {
  std::string id;
  int priority = 50;       // 1..100, higher goes first
  int64_t submit_seq = 0;  // lower (earlier) goes first among equal priority; ties broken by id
  int devices = 1;         // gang size: all or nothing; <= 0 is invalid and reported unplaceable
  std::optional<absl::Duration> max_runtime;  // from the spec; nullopt = unknown
  std::string owner;  // only nodes with no owners or with this one among theirs take its ranks
  int user = -1;      // index into ClusterSnapshot::users; -1: outside accounts and caps
  // false: runs only within its account's quota (and so is never preempted for other accounts).
  bool preemptible = true;
  // Every node's share of the job is a multiple of this (parallel.tensor_parallel: a
  // tensor-parallel group's consecutive ranks stay on one node). 1: any split.
  int rank_block = 1;
  // One block on each of devices / rank_block distinct nodes, no more (resources.nodes:
  // torchrun's --nnodes).
  bool one_block_per_node = false;
  // Per rank (resources.cpus in thousandths, resources.memory); 0: the node's per-device charge.
  int64_t cpu_millis = 0;
  int64_t memory_bytes = 0;
};

struct ClusterSnapshot {
  absl::Time now;
  std::vector<SchedNode> nodes;
  std::vector<RunningJobInfo> running;
  std::vector<PendingJobInfo> pending;  // any order
  // Whether a blocked job may preempt running jobs of lower priority that have run for at least
  // min_run_time (so a preempted job is not preempted again at once).
  bool preemption = false;
  absl::Duration min_run_time = absl::Minutes(5);
  std::vector<SchedAccount> accounts;  // empty: no quotas, no fair share
  std::vector<SchedUser> users;
};

struct Placement {
  std::string job_id;
  // Devices sum to the job's size; order = rank order. Each node appears once, so the ranks on one
  // node are contiguous.
  std::vector<DeviceGrant> grants;
  bool backfilled = false;  // started ahead of a higher-ranked blocked job
};

struct Reservation {  // where and when the blocked head job will start
  std::string job_id;
  absl::Time start;
  std::vector<DeviceGrant> grants;
};

// Why a pending job was not placed in a pass.
enum class WaitReason : uint8_t {
  kPlaced,                     // it was placed
  kDevices,                    // the head: not enough free devices (see the reservation)
  kBehindHead,                 // behind the head, and backfill would delay it
  kHeadStartUnknown,           // behind a head whose start cannot be computed: nothing backfills
  kAccountLimit,               // its account's quota plus borrow limit is in use
  kUserLimit,                  // its user's cap on running devices is in use
  kNotPreemptibleBeyondQuota,  // not preemptible, and its account's quota is in use
  kUnplaceable,                // larger than every device it may use (in whole rank_blocks), or
                               // <= 0 devices, or not a whole number of rank_blocks
};

struct JobWait {
  WaitReason reason = WaitReason::kPlaced;
  int position = 0;  // its place in the scheduling order: how many jobs were considered before it
};

struct ScheduleResult {
  std::vector<Placement> placements;       // in decision order
  std::optional<Reservation> reservation;  // the blocked head job's, when its start is computable
  // Pending jobs needing more devices than all schedulable nodes have in total (or <= 0 devices),
  // in scheduling order. They are skipped and never block other jobs.
  std::vector<std::string> unplaceable;
  // With preemption: the running jobs the head should stop for (asked to checkpoint first).
  struct Preemption {
    std::string job_id;                // the head
    std::vector<std::string> victims;  // in the order chosen
  };
  std::optional<Preemption> preemption;
  // Parallel to snapshot.pending: what became of each job, and its place in the order.
  std::vector<JobWait> waits;
};

// Decides which pending jobs start now. Pure and deterministic: same snapshot, same result
// (independent of the order of snapshot.pending).
//
// Jobs are taken first those whose devices plus their account's running devices (as the pass
// starts) fit in its quota, then the others; within each, by priority (descending), then account
// usage / share (ascending, accounts' usage and share as given), then user usage (ascending), then
// submit_seq (ascending), then id. A job whose account
// would exceed quota + borrow_limit, whose user would exceed max_devices, or that is not
// preemptible and would exceed its account's quota is skipped (it neither places nor blocks). Each
// job that fits
// in the free devices of schedulable nodes is placed: on the single node with the fewest free
// devices that holds it (lowest index on ties), else on the nodes with the most free devices first
// (lowest index on ties), the last one chosen by best fit for the remainder, which uses the fewest
// nodes possible. A job with rank_block > 1 takes every node's devices in whole blocks (a node's
// free devices count down to a multiple of it), for its reservation too; it is not backfilled
// onto the devices a reservation leaves spare, and its preemption counts only the whole blocks
// that free devices and stopping or chosen victims make on each node as room.
//
// The first job that does not fit is the head. Its reservation is the earliest time at which the
// projected free devices (running jobs released at expected_end, jobs placed in this pass at
// now + max_runtime) hold it, with grants packed as above on the projected free devices. If that
// time cannot be computed (devices held by jobs of unknown end), nothing after the head is placed.
// Otherwise a later job is backfilled now if it fits now and either ends by the reservation start
// (now + max_runtime <= start), or is packed only on devices the head's reservation does not need.
// Backfill never delays the head's reservation.
//
// With snapshot.preemption, a head that does not fit now may preempt: unless the devices of jobs
// already preempting would make room, it picks victims among preemptible running jobs that have
// run for min_run_time, counting only devices on nodes that take its owner, so as to lose the
// fewest device-seconds of work since the victims' last checkpoints (greedy by lost work per
// freed device, then dropping victims not needed). A victim of the head's own account must have
// lower priority. A victim of another account must run beyond its account's quota (on borrowed
// capacity: of an account's running jobs, the latest started beyond its quota; all of an account
// without quota), and either have lower priority or the head fit within its own account's quota
// (the lender takes its devices back); and no victim of another account may leave that account
// below its quota. Jobs already stopping (preempting) are not counted within their account's
// quota.
//
// CPUs and memory: on a node that counts them, a job may take only as many devices as its ranks'
// CPUs and memory fit in what the node has free (each rank charged its request, or the node's
// per-device charge), for placement, backfill, its capacity (a job no node set can hold is
// unplaceable) and the room its preemption counts; a placement holds them until the job ends.
// Reservations project the devices that running jobs release, within what each node could hold
// of the head's ranks.
//
// Cost: O(P log P + R log R + N log N + placed * (D + log N)) for P pending, R running grants,
// N nodes, D = max devices per node. Nodes that count CPUs or memory add, per job that asks for
// no more than the smallest per-device charge (most jobs), O(K) for the K of them whose free CPUs
// or memory hold fewer such ranks than their free devices; per job that asks for more, O(C) for
// all C of them.
ScheduleResult Schedule(const ClusterSnapshot& snapshot);

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_SCHEDULER_H_
