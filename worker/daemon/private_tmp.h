// A job's private /tmp, /dev/shm and SysV IPC (the worker's --private-tmp), as Slurm's
// job_container/tmpfs and systemd's PrivateTmp: the ranks of an attempt on a node run in a mount
// namespace and an IPC namespace of the attempt's, made once for its first rank and joined
// (setns) by each rank's forked child before it drops to the owner's account:
//  - /tmp there is the attempt's folder ATTEMPT/tmp (on the work directory's disk, the owner's,
//    mode 0700);
//  - /dev/shm there is a tmpfs of the attempt's (memory, charged to the cgroup of the rank that
//    writes it; the owner's, mode 0700, nosuid, nodev, at most the attempt's ranks' memory here);
//  - SysV shared memory, semaphores and message queues and POSIX message queues are the IPC
//    namespace's.
// The ranks of an attempt on a node share all three (NCCL's shared-memory transport between them
// works as before); no other job, and no later attempt, sees them. The namespaces are kept by
// bind mounts of their files in the worker's namespace folder (WORK_DIR/.namespaces: root's,
// mode 0700, a private mount: no user can open them and pin them, and no copy of them leaks into
// another namespace); the tmpfs exists in the attempt's mount namespace only. When the attempt's
// ranks on the node have ended (attempt_folders.h) the files are unmounted, and the namespaces go,
// with what is in them, once the last of their processes has; the tmp folder is emptied as its
// owner.
//
// Every other mount is the host's, as it was when the attempt's namespace was made (it is the
// host's slave: mounts made on a shared host mount later reach the ranks too). What a rank cannot
// see: the host's /tmp and /dev/shm, and so any path under them, which is why the worker refuses
// --private-tmp with a work directory, trainer or TLS CA there, and a rank fails to start whose
// job's workdir or checkpoint folder is there, naming the field. The network stays the host's
// (docs/security.md).
#ifndef TRAINYARD_WORKER_DAEMON_PRIVATE_TMP_H_
#define TRAINYARD_WORKER_DAEMON_PRIVATE_TMP_H_

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace trainyard::worker {

// The host folder `path` is (or is under) that a rank of a worker with --private-tmp sees a
// private one of instead: "/tmp" or "/dev/shm"; "" for any other path. `resolve_links`: links
// resolved first (the operator's paths; never a job's, which a root process must not follow: a
// job's link into /tmp fails in the rank's child, where it leads into the private one).
std::string PrivateFolderOver(const std::string& path, bool resolve_links);

// Whether this process may give ranks namespaces of their own (root, CAP_SYS_ADMIN, a kernel that
// allows it): tried in a child that ends at once. The reason when not.
absl::Status CheckMountNamespaces();

// The worker's namespace folder in `work_dir`.
std::string NamespaceFolder(const std::string& work_dir);
// Makes a trial attempt's namespaces in `work_dir` (PrepareNamespaceFolder first), joins them as
// a rank would, checks that /tmp there is the trial's folder, and removes them: every mount and
// setns an attempt needs, so that a host that refuses one (an AppArmor or SELinux policy, a
// read-only /dev) is told at the worker's start, not by each rank failing. The failed step.
absl::Status TryAttemptNamespaces(const std::string& work_dir);
// Makes the namespace folder (root's, mode 0700) and a private mount of it (a mount namespace's
// file may not be bound where the bind would propagate); one there already is kept.
absl::Status PrepareNamespaceFolder(const std::string& folder);

// An attempt's namespaces, kept at FOLDER/JOB@ATTEMPT.mnt and .ipc.
struct AttemptNamespaces {
  std::string mnt, ipc;
};
AttemptNamespaces NamespacesOf(const std::string& folder, const std::string& job_id, int attempt);
// A name of the namespace folder, "JOB@ATTEMPT.mnt" or ".ipc": its job and attempt; false for
// any other name.
bool ParseNamespaceName(const std::string& name, std::string* job_id, int* attempt);

// The size of an attempt's /dev/shm on a node: its ranks' memory there (`rank_bytes` each, 0: no
// limit), but no more than the kernel's default for a tmpfs, half of `host_bytes`; 0 (that
// default) without a limit.
int64_t AttemptShmBytes(int64_t rank_bytes, int ranks, int64_t host_bytes);

// Makes an attempt's namespaces, unless they are there already (its other ranks here): the
// mount namespace, the host's slave without the namespace folder, where `tmp` is bound over /tmp
// and a tmpfs of at most `shm_bytes` (0: the kernel's default, half the memory) held by `uid`:
// `gid` alone is mounted over /dev/shm, and the IPC namespace.
absl::Status MakeAttemptNamespaces(const AttemptNamespaces& ns, const std::string& namespace_folder,
                                   const std::string& tmp, uid_t uid, gid_t gid, int64_t shm_bytes);
// Empties the attempt's namespaces from inside (every SysV object and POSIX queue removed, the
// /dev/shm tmpfs unmounted: what anything that still holds them keeps is only its own open
// files), then unmounts their files and removes them. True when they are gone, or were never
// there.
bool RemoveAttemptNamespaces(const AttemptNamespaces& ns);

// In a rank's forked child, as root, before it switches to the owner's account: joins the IPC
// namespace kept at `ipc` and the mount namespace kept at `mnt` (its root and working folder then
// the namespace's root). Allocates nothing. 0, else the errno of the step that failed, and
// `step` names it.
int EnterAttemptNamespaces(const char* mnt, const char* ipc, const char** step);

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_PRIVATE_TMP_H_
