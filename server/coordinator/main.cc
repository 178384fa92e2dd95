// trainyard-coordinator: parses flags, starts a CoordinatorServer, prints the bound address on the
// first line of stdout, and shuts down cleanly on SIGTERM or SIGINT.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include <CLI/CLI.hpp>

#include "common/server_main.h"
#include "common/version.h"
#include "server/coordinator/coordinator_server.h"

int main(int argc, char** argv) {
  trainyard::BlockTerminationSignals();
  const char* home = std::getenv("HOME");
  trainyard::coordinator::CoordinatorOptions options;
  options.state_dir = std::string(home != nullptr ? home : ".") + "/.trainyard";
  std::string node_timeout = "10s";
  std::string heartbeat_interval = "2s";

  CLI::App app{"trainyard-coordinator: the trainyard control plane (jobs, scheduling, nodes)"};
  app.set_version_flag("--version", std::string("trainyard-coordinator ") + trainyard::kVersion);
  app.add_option("--listen", options.listen_address,
                 "HOST:PORT to serve gRPC on; port 0 picks a free one (printed on stdout)")
      ->capture_default_str();
  app.add_option("--state-dir", options.state_dir, "directory for the job database")
      ->capture_default_str();
  app.add_option("--metrics-address", options.metrics_address,
                 "HOST:PORT of the Prometheus /metrics endpoint (port 0: a free one, printed "
                 "on the second line of stdout)");
  app.add_option(
      "--checkpoint-root", options.checkpoint_root,
      "where jobs' checkpoints live, seen by every worker (default STATE_DIR/checkpoints)");
  app.add_option("--node-timeout", node_timeout,
                 "a node silent for this long is lost and its jobs restart or fail")
      ->capture_default_str();
  app.add_option("--heartbeat-interval", heartbeat_interval, "heartbeat period asked of nodes")
      ->capture_default_str();
  app.add_option("--max-message-bytes", options.max_message_bytes, "largest gRPC message accepted")
      ->capture_default_str();
  app.add_flag("--preemption", options.preemption,
               "a job that cannot be placed may preempt running jobs of lower priority: they are "
               "asked to checkpoint and stop, and resume from that checkpoint later");
  std::string preemption_grace = "120s", min_run_time = "5m", max_grace = "10m", half_life = "168h";
  app.add_option("--preemption-grace", preemption_grace,
                 "how long a preempted job may take to checkpoint and stop before its ranks are "
                 "stopped, unless its spec sets preemption_grace")
      ->capture_default_str();
  app.add_option("--max-preemption-grace", max_grace, "the most a job's preemption_grace may be")
      ->capture_default_str();
  app.add_option("--fair-share-half-life", half_life,
                 "accounts' and users' usage (device-seconds) halves every this long, as Slurm's "
                 "PriorityDecayHalfLife")
      ->capture_default_str();
  app.add_option("--min-run-time", min_run_time,
                 "a job runs at least this long before it may be preempted (again)")
      ->capture_default_str();
  app.add_option("--tls-cert", options.tls.cert_file, "TLS certificate chain (PEM) to serve with");
  app.add_option("--tls-key", options.tls.key_file, "its private key (PEM)");
  app.add_option("--tls-client-ca", options.tls.client_ca_file,
                 "CA (PEM) of client certificates: mutual TLS; workers and parameter servers "
                 "then authenticate with a certificate whose common name is their node id");
  app.add_flag("--insecure", options.tls.insecure,
               "serve without TLS on a non-loopback --listen address (tokens in clear)");
  CLI11_PARSE(app, argc, argv);

  spdlog::set_default_logger(spdlog::stderr_color_mt("coordinator"));
  auto timeout = trainyard::ParseFlagDuration("--node-timeout", node_timeout);
  auto interval = trainyard::ParseFlagDuration("--heartbeat-interval", heartbeat_interval);
  auto grace = trainyard::ParseFlagDuration("--preemption-grace", preemption_grace);
  auto min_run = trainyard::ParseFlagDuration("--min-run-time", min_run_time);
  auto max_grace_d = trainyard::ParseFlagDuration("--max-preemption-grace", max_grace);
  auto half_life_d = trainyard::ParseFlagDuration("--fair-share-half-life", half_life);
  for (const auto* d : {&timeout, &interval, &grace, &min_run, &max_grace_d, &half_life_d}) {
    if (!d->ok()) {
      std::cerr << "trainyard-coordinator: " << d->status().message() << "\n";
      return 2;
    }
  }
  options.node_timeout = *timeout;
  options.heartbeat_interval = *interval;
  options.preemption_grace = *grace;
  options.min_run_time = *min_run;
  options.max_preemption_grace = *max_grace_d;
  if (options.preemption_grace > options.max_preemption_grace) {
    std::cerr << "trainyard-coordinator: --preemption-grace (" << preemption_grace
              << ") must not exceed --max-preemption-grace (" << max_grace << ")\n";
    return 2;
  }
  options.fair_share_half_life = *half_life_d;

  auto server = trainyard::coordinator::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::cerr << "trainyard-coordinator: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("%s\n", (*server)->address().c_str());
  if (!(*server)->metrics_address().empty()) {
    std::printf("metrics %s\n", (*server)->metrics_address().c_str());
  }
  std::fflush(stdout);
  spdlog::info("serving on {} (state in {})", (*server)->address(), options.state_dir);

  const int sig = trainyard::WaitForTerminationSignal();
  spdlog::info("signal {}: shutting down", sig);
  (*server)->Shutdown();
  spdlog::info("stopped");
  return 0;
}
