// `yard local up|down|status`: a coordinator and worker daemons (one unless told otherwise) started
// in the background on loopback with a state directory, recorded in STATE_DIR/local.json so
// that later `yard local` calls find, check and stop them. Single-threaded.
#ifndef TRAINYARD_CLIENT_LOCAL_CLUSTER_H_
#define TRAINYARD_CLIENT_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace trainyard::client {

struct LocalProcess {
  std::string name;  // "coordinator"
  pid_t pid = 0;
  std::string address;          // what it serves on
  std::string log;              // its stderr
  std::string metrics_address;  // its Prometheus /metrics endpoint, if serving one
  std::string web_url;          // the coordinator's web console, if serving one
  bool alive = false;
};

struct LocalCluster {
  std::string state_dir;
  std::string coordinator_address;
  std::string admin_token_file;  // the local admin's token (STATE_DIR/admin.token)
  std::string saved_token_to;    // where LocalUp saved it for yard, if it did
  std::string tls_ca;            // the CA its clients verify it with; empty: plaintext
  std::string web_url;           // the web console (http://127.0.0.1:PORT); empty: none
  std::vector<LocalProcess> processes;
};

struct LocalUpOptions {
  std::string state_dir;
  std::string listen = "127.0.0.1:7070";
  std::string bin_dir;  // where trainyard-coordinator and trainyard-worker live
  // Worker daemons, named local-1, local-2, ...: one by default, so that a job submitted to a new
  // local cluster runs (with none it waited for good, as the coordinator alone has no devices).
  int workers = 1;
  int slots_per_worker = 1;     // CPU slots (ranks) of each worker
  int threads_per_slot = 0;     // 0: this machine's cores / (workers * slots)
  int parameter_servers = 0;    // trainyard-ps shards, named local-ps-1, ... (offload jobs)
  int64_t ps_memory_bytes = 0;  // each; 0: trainyard-ps's default (half the host's memory)
  bool metrics = false;         // every process serves /metrics on a free loopback port
  std::string web_address;      // the coordinator's --web-address (HOST:PORT); empty: none
  // TCP congestion control of the parameter-server connections (trainyard-ps and the workers'
  // ranks get it as TRAINYARD_TCP_CONGESTION); empty: the host's default.
  std::string tcp_congestion;
  // Where yard looks for a token: LocalUp saves the local admin's token there unless the file
  // already holds a token this coordinator accepts; a file with another token is kept as .bak.
  // Empty: save nothing.
  std::string save_token_to;
  // TLS: the coordinator and parameter servers serve with tls_cert/tls_key (valid for
  // 127.0.0.1), every client verifies them with tls_ca. All empty: plaintext on loopback.
  std::string tls_cert, tls_key, tls_ca;
  // More lines of the workers' user map: (trainyard user, Unix account) for users whose ranks run
  // as an account of another name (a local cluster with several users on one account).
  std::vector<std::pair<std::string, std::string>> run_as;
  // More flags for the coordinator (e.g. --preemption --min-run-time 0s).
  std::vector<std::string> coordinator_flags;
};

// Starts the cluster and returns once the coordinator serves and every worker has registered.
// The coordinator makes the local admin (STATE_DIR/admin.token); each worker and parameter server
// gets a node token of its own (STATE_DIR/NAME.token, mode 0600, given by --token-file).
// FAILED_PRECONDITION if one is
// already running from this state directory.
absl::StatusOr<LocalCluster> LocalUp(const LocalUpOptions& options);
// SIGTERM to every process (workers first, so they stop their ranks while the coordinator still
// listens), SIGKILL after `grace_seconds`; NOT_FOUND if none was started.
absl::Status LocalDown(const std::string& state_dir, int grace_seconds = 15);
// What runs now; NOT_FOUND if nothing was started from this state directory.
absl::StatusOr<LocalCluster> LocalStatus(const std::string& state_dir);

// Directory of the running executable (to find its sibling programs).
std::string SelfDir();

}  // namespace trainyard::client

#endif  // TRAINYARD_CLIENT_LOCAL_CLUSTER_H_
