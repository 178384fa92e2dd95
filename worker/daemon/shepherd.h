// The rank shepherd: one small process per rank between the worker and the rank, as slurmstepd is
// between slurmd and a job step. It starts the rank with its output going to the rank's log file,
// waits for its exit and keeps the exit status until a worker collects it. So a rank outlives a
// restart of its worker (an upgrade, a crash), and the next worker on the same work directory
// adopts it. A shepherd that no worker has held for its orphan timeout stops its rank (SIGTERM,
// then SIGKILL after the grace) and ends: a worker that does not come back leaves nothing running.
//
// The shepherd is trainyard-worker itself, run by RankSupervisor as
//   trainyard-worker --shepherd NAME=VALUE... -- PROGRAM ARGS...
// with a fixed environment of its own (PATH, and the worker's LD_LIBRARY_PATH: its libraries), its
// listening socket as file descriptor 3 and the rank's
// environment in a memfd (env_fd=4). It runs as the worker's account (root on a shared cluster)
// and holds nothing the job controls in a way it acts on: it forks the rank, which switches to
// the owner's account first and only then reads its environment, looks a bare PROGRAM up in
// that environment's PATH and executes it. So LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH and the like
// in a job's env reach only the owner's processes, and a PATH into folders the owner cannot read
// tells the owner nothing. It is single-threaded (nothing of gRPC starts in it).
//
// Its socket, PREFIX.sock (SOCK_SEQPACKET, mode 0600, the worker's account, in the attempt's
// folder that only the worker's account writes), carries one message per packet:
//   shepherd → worker  "rank PID DEVICE OFFSET" when a worker connects: the rank's pid, its device
//                      index and how much of the log the last worker said it had sent on;
//                      "exit CODE" once the rank has ended (128 + N: killed by signal N).
//   worker → shepherd  "sent OFFSET": log bytes sent on so far (a later worker resumes there);
//                      "stop": SIGTERM to the rank's processes now, SIGKILL after the grace;
//                      "done": the exit is collected; the shepherd removes its socket and ends.
// One worker at a time: a new connection replaces the one before.
#ifndef TRAINYARD_WORKER_DAEMON_SHEPHERD_H_
#define TRAINYARD_WORKER_DAEMON_SHEPHERD_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainyard::worker {

// The first argument that makes trainyard-worker a shepherd.
inline constexpr char kShepherdFlag[] = "--shepherd";

// Runs a shepherd with `argv` (what follows kShepherdFlag): NAME=VALUE settings, "--", then the
// rank's program and arguments. Settings: prefix (the log is PREFIX.log, the socket PREFIX.sock),
// cwd, device, grace_ms, orphan_ms, log_keep (the log's last bytes kept on disk once the worker
// says it sent them; the older blocks are punched out; 0: all), mark (the rank's
// TRAINYARD_RANK_MARK, by which its processes are found), env_fd (the descriptor of the rank's
// environment, NUL-separated NAME=VALUE entries; without it the rank's environment is empty),
// cgroup (repeated: the rank's cgroup folders, which its process joins before it drops privileges,
// which stopping it signals whole, whose OOM kills its log reports, and which the shepherd removes
// at its end; cgroups.h), mnt and ipc (together: the files of the attempt's mount and IPC
// namespaces, which the rank joins before it drops privileges; private_tmp.h), and uid,
// gid, groups (comma-separated) to run the rank as another account. Returns the process's exit
// code.
int RunShepherd(int argc, char** argv);

// A listening SOCK_SEQPACKET socket at `path` (replacing a stale one), mode 0600. Paths of any
// length (a Unix socket's address holds 107 bytes): bound through /proc/self/fd of its folder.
absl::StatusOr<int> ListenShepherdSocket(const std::string& path);
// A connection to the shepherd socket at `path`; NOT_FOUND when nothing listens there.
absl::StatusOr<int> ConnectShepherdSocket(const std::string& path);
// A shepherd's first message, "rank PID DEVICE OFFSET GRACE_MS" ("rank PID DEVICE OFFSET" from a
// shepherd of an older worker: grace_ms 0, not known; more words, from a newer one's, ignored).
struct ShepherdHello {
  int device = 0;
  int64_t offset = 0;    // log bytes the last worker said it had sent on
  int64_t grace_ms = 0;  // SIGTERM to SIGKILL when it stops the rank (its grace_ms=)
};
std::optional<ShepherdHello> ParseShepherdHello(const std::string& message);
// One message of at most 256 bytes sent on `fd`; false when the peer is gone.
bool SendShepherdMessage(int fd, const std::string& message);
// The next message on `fd`, waiting at most `timeout`: empty when none came in time;
// UNAVAILABLE when the peer is gone.
absl::StatusOr<std::string> ReceiveShepherdMessage(int fd, absl::Duration timeout);

// Whether process `pid` has `uid` as any of its user ids (real, effective, saved, file system; from
// /proc/PID/status: /proc/PID itself is root's for a process that is not dumpable). Reads nothing
// of the process's memory (its environment could block for good).
bool ProcessHasUid(pid_t pid, uid_t uid);

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_SHEPHERD_H_
