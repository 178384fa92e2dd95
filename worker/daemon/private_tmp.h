// A job's private /tmp and /dev/shm (the worker's --private-tmp), as Slurm's job_container/tmpfs
// and systemd's PrivateTmp: each rank runs in a mount namespace of its own where /tmp is its
// attempt's folder ATTEMPT/tmp (on the work directory's disk, the owner's, mode 0700) and
// /dev/shm its attempt's tmpfs ATTEMPT/shm (memory, charged to the cgroup of the rank that
// writes it). The ranks of one attempt on a node share both (NCCL's shared-memory transport
// between them works as before); no other job, and no later attempt, sees them; and they go
// when the attempt's ranks on the node have ended (attempt_folders.h): the tmp folder emptied as
// its owner, the tmpfs unmounted, which frees what a killed rank left there at once.
//
// The attempt's ranks on a node also share an IPC namespace of their own (SysV shared memory,
// semaphores and message queues, POSIX message queues), kept by a bind mount of it at
// ATTEMPT/ipc that each rank's child joins (setns); unmounted when they end, it goes with
// everything in it once their last process has.
//
// Every other mount is the host's, as it was (mounts made on the host later still reach the
// rank: the namespace is the host's slave). What a rank cannot see: the host's /tmp and
// /dev/shm, and so any path under them, which is why the worker refuses --private-tmp with a
// work directory, trainer or TLS CA there, and a rank fails to start whose job's workdir or
// checkpoint folder is there, naming the field. The network stays the host's
// (docs/security.md).
#ifndef TRAINYARD_WORKER_DAEMON_PRIVATE_TMP_H_
#define TRAINYARD_WORKER_DAEMON_PRIVATE_TMP_H_

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"

namespace trainyard::worker {

// The host folder `path` is (or is under, after resolving links) that a rank of a worker with
// --private-tmp sees a private one of instead: "/tmp" or "/dev/shm"; "" for any other path.
std::string PrivateFolderOver(const std::string& path);

// Whether this process may give ranks a mount namespace of their own (root, CAP_SYS_ADMIN, a
// kernel that allows it): tried in a child that ends at once. The reason when not.
absl::Status CheckMountNamespaces();

// Mounts an attempt's /dev/shm at `path` (made here, the worker's folder below the attempt's): a
// tmpfs the owner `uid`:`gid` holds alone (mode 0700), nosuid and nodev. Already mounted: OK.
absl::Status MountAttemptShm(const std::string& path, uid_t uid, gid_t gid);
// Unmounts (lazily: a process still holding a file keeps only that) the tmpfs at `path` and
// removes the folder. True when it is gone, or was never there.
bool UnmountAttemptShm(const std::string& path);

// Makes an attempt's IPC namespace, kept by a bind mount of it on the file `path` (made here).
// Already there: OK.
absl::Status MakeAttemptIpc(const std::string& path);
// Unmounts the IPC namespace kept at `path` and removes the file. True when it is gone, or was
// never there.
bool UnmountAttemptIpc(const std::string& path);

// In a rank's forked child, as root, before it switches to the owner's account: the IPC
// namespace kept at `ipc`, and a mount namespace of its own, the host's slave, with `tmp` bound
// over /tmp and `shm` over /dev/shm. Allocates nothing (a forked child). 0, else the errno of
// the step that failed, and `step` names it.
int EnterPrivateTmp(const char* tmp, const char* shm, const char* ipc, const char** step);

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_PRIVATE_TMP_H_
