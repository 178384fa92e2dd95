// The rank shepherd: one small process per rank between the worker and the rank, as slurmstepd is
// between slurmd and a job step. It starts the rank with its output going to the rank's log file,
// waits for its exit and keeps the exit status until a worker collects it. So a rank outlives a
// restart of its worker (an upgrade, a crash), and the next worker on the same work directory
// adopts it. A shepherd that no worker has held for its orphan timeout stops its rank (SIGTERM,
// then SIGKILL after the grace) and ends: a worker that does not come back leaves nothing running.
//
// The shepherd is trainyard-worker itself, run by RankSupervisor as
//   trainyard-worker --shepherd NAME=VALUE... -- PROGRAM ARGS...
// with the rank's environment and its listening socket as file descriptor 3. It is
// single-threaded (nothing of gRPC starts in it).
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
// cwd, device, grace_ms, orphan_ms, and uid, gid, groups (comma-separated) to run the rank as
// another account. Returns the process's exit code.
int RunShepherd(int argc, char** argv);

// A listening SOCK_SEQPACKET socket at `path` (replacing a stale one), mode 0600. Paths of any
// length (a Unix socket's address holds 107 bytes): bound through /proc/self/fd of its folder.
absl::StatusOr<int> ListenShepherdSocket(const std::string& path);
// A connection to the shepherd socket at `path`; NOT_FOUND when nothing listens there.
absl::StatusOr<int> ConnectShepherdSocket(const std::string& path);
// A shepherd's first message, "rank PID DEVICE OFFSET".
struct ShepherdHello {
  int device = 0;
  int64_t offset = 0;  // log bytes the last worker said it had sent on
};
std::optional<ShepherdHello> ParseShepherdHello(const std::string& message);
// One message of at most 256 bytes sent on `fd`; false when the peer is gone.
bool SendShepherdMessage(int fd, const std::string& message);
// The next message on `fd`, waiting at most `timeout`: empty when none came in time;
// UNAVAILABLE when the peer is gone.
absl::StatusOr<std::string> ReceiveShepherdMessage(int fd, absl::Duration timeout);

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_SHEPHERD_H_
