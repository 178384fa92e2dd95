// trainyard-ps: a parameter-server shard. Parses flags, starts a PsServer, prints the bound
// address on the first line of stdout (and "metrics ADDR" on the second with --metrics-address),
// registers with the coordinator and serves until SIGTERM or SIGINT.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "common/cli_checks.h"
#include "common/credentials.h"
#include "common/log_text.h"
#include "common/server_main.h"
#include "common/tls.h"
#include "common/version.h"
#include "rpc/ps/tcp_congestion.h"
#include "server/ps/ps_server.h"

int main(int argc, char** argv) {
  trainyard::BlockTerminationSignals();
  // Multi-MiB gradient and parameter messages: keep freed buffers in the heap instead of handing
  // them back to the kernel, or every message touches fresh pages (page faults dominated the
  // push/pull time in bench/ps_transfer_bench: 2-5x slower). One arena: glibc unmaps a thread
  // arena's heap as soon as it is empty, whatever the trim threshold, and gRPC's threads receive
  // each push into their own arenas (pushes 1.6-2.6x faster with one).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_ARENA_MAX, 1);
  trainyard::ps::PsOptions options;
  CLI::App app{
      "trainyard-ps: a parameter-server shard holding offload jobs' fp32 master weights and "
      "AdamW state, updated with a vectorized CPU AdamW"};
  app.set_version_flag("--version", std::string("trainyard-ps ") + trainyard::kVersion);
  app.add_option("--listen", options.listen_address,
                 "HOST:PORT to serve gRPC on; port 0 picks a free one (printed on stdout)")
      ->capture_default_str();
  app.add_option("--coordinator", options.coordinator,
                 "coordinator HOST:PORT to register with (empty: standalone)");
  app.add_option("--node-id", options.node_id, "stable name (default ps-HOSTNAME-PORT)");
  app.add_option("--advertise", options.advertise,
                 "address trainers dial (default: the bound address)");
  app.add_option("--memory-bytes", options.capacity_bytes,
                 "memory offered to shards, 18 bytes per parameter (default: half the host's)")
      ->check(trainyard::NonNegative());
  app.add_option("--threads", options.threads, "AdamW threads (default: every core)")
      ->check(trainyard::NonNegative());
  app.add_option("--metrics-address", options.metrics_address,
                 "HOST:PORT of the Prometheus /metrics endpoint (port 0: a free one)");
  app.add_option("--max-message-bytes", options.max_message_bytes, "largest gRPC message")
      ->capture_default_str();
  app.add_option("--data-listen", options.data_listen_address,
                 "HOST:PORT of the TCP data plane that trainers push gradients to and pull "
                 "parameters from, off gRPC (default: the --listen host, a free port, told to "
                 "trainers through GetDataPlane; \"off\": none, trainers use gRPC)");
  app.add_option("--tcp-congestion", options.tcp_congestion,
                 "TCP congestion control of trainer connections, e.g. reno or cubic (default: "
                 "the host's; a host default of bbr without the fq qdisc paces every "
                 "connection, which halved throughput on loopback in bench/RESULTS.md)")
      ->envname(trainyard::ps::kTcpCongestionEnv);
  app.add_option("--tls-cert", options.tls.cert_file,
                 "TLS certificate chain (PEM) to serve gRPC with; also the client certificate "
                 "shown to a coordinator that asks for mutual TLS");
  app.add_option("--tls-key", options.tls.key_file, "its private key (PEM)");
  app.add_option("--tls-ca", options.coordinator_tls.ca_file,
                 "CA (PEM) to verify the coordinator with (env TRAINYARD_TLS_CA)")
      ->envname(trainyard::kTlsCaEnv);
  app.add_flag("--insecure", options.tls.insecure,
               "serve without TLS on a non-loopback --listen address");
  app.add_option("--tls-reload", options.tls.reload_seconds,
                 "seconds between reads of --tls-cert and --tls-key (gRPC): renewed files take "
                 "effect for new connections without a restart")
      ->capture_default_str()
      ->check(trainyard::Positive());
  app.add_option("--metrics-token-file", options.metrics_token_file,
                 "scrapes of /metrics need \"Authorization: Bearer <the file's token>\" (mode "
                 "0600)");
  app.add_flag("--metrics-tls", options.metrics_tls, "serve /metrics over TLS with --tls-cert");
  app.add_flag("--metrics-insecure", options.metrics_insecure,
               "serve /metrics on a non-loopback address without --metrics-token-file");
  app.add_flag("--data-plane-insecure", options.data_plane_insecure,
               "with --tls-cert, keep the TCP data plane (gradients and parameters) in plain TCP: "
               "for a trusted network, to spare the encryption's CPU (bench/RESULTS.md)");
  app.add_option("--owners", options.owners,
                 "take only these users' offload jobs (repeat, or separate with commas); needed "
                 "when the node token is limited to some owners (yard admin token create --node "
                 "NAME --owners USER)")
      ->delimiter(',');
  std::string token_file;
  app.add_option("--token-file", token_file,
                 "file holding this server's node token for --coordinator (yard admin token "
                 "create --node NAME; mode 0600); default: env TRAINYARD_TOKEN");
  trainyard::DecimalIntegers(app);
  CLI11_PARSE(app, argc, argv);

  trainyard::InstallEscapingLogger("ps");
  if (options.coordinator_tls.enabled()) {  // our certificate, for a coordinator asking for one
    options.coordinator_tls.cert_file = options.tls.cert_file;
    options.coordinator_tls.key_file = options.tls.key_file;
  }
  if (!options.coordinator.empty()) {
    auto token = trainyard::FindNodeToken(token_file, !options.coordinator_tls.cert_file.empty());
    if (!token.ok()) {
      std::cerr << "trainyard-ps: " << token.status().message() << "\n";
      return 2;
    }
    options.token = *std::move(token);
  }
  auto server = trainyard::ps::PsServer::Start(options);
  if (!server.ok()) {
    std::cerr << "trainyard-ps: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("%s\n", (*server)->address().c_str());
  if (!(*server)->metrics_address().empty()) {
    std::printf("metrics %s\n", (*server)->metrics_address().c_str());
  }
  std::fflush(stdout);
  spdlog::info("serving on {} as {}; data plane {}; TCP congestion control {}",
               (*server)->address(), (*server)->node_id(),
               (*server)->data_plane_address().empty()
                   ? std::string("off")
                   : absl::StrCat((*server)->data_plane_address(),
                                  (*server)->data_plane_tls() ? " (TLS)" : " (plain TCP)"),
               trainyard::ps::TcpCongestionInUse(options.tcp_congestion));
  const int sig = trainyard::WaitForTerminationSignal();
  spdlog::info("signal {}: shutting down", sig);
  (*server)->Shutdown();  // registration stopped, in-flight calls finished
  spdlog::info("stopped");
  spdlog::shutdown();
  // Skip library teardown: ~grpc::Server's grpc_shutdown joins a poller thread that may sit up to
  // ~10 s in epoll_wait, which only delays the exit (shards live in memory, nothing to flush).
  std::_Exit(0);
}
