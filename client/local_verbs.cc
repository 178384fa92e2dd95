// yard local: a cluster of local processes on loopback (up, down, status).

#include <cstdlib>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "client/local_cluster.h"
#include "client/output.h"
#include "client/verbs.h"
#include "common/cli_checks.h"
#include "common/credentials.h"
#include "rpc/ps/tcp_congestion.h"

namespace trainyard::client {
namespace {

void PrintCluster(const Globals& g, const LocalCluster& c) {
  if (g.json()) {
    nlohmann::json j = {{"state_dir", c.state_dir},
                        {"coordinator_address", c.coordinator_address},
                        {"admin_token_file", c.admin_token_file},
                        {"saved_token_to", c.saved_token_to},
                        {"tls_ca", c.tls_ca},
                        {"web_url", c.web_url},
                        {"processes", nlohmann::json::array()}};
    for (const auto& p : c.processes) {
      j["processes"].push_back({{"name", p.name},
                                {"pid", p.pid},
                                {"address", p.address},
                                {"alive", p.alive},
                                {"log", p.log},
                                {"metrics_address", p.metrics_address}});
    }
    std::cout << j.dump(1) << "\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& p : c.processes) {
    rows.push_back({p.name, absl::StrCat(p.pid), p.alive ? "running" : "stopped", p.address,
                    p.metrics_address.empty() ? "-" : p.metrics_address, p.log});
  }
  std::cout << FormatTable({"PROCESS", "PID", "STATUS", "ADDRESS", "METRICS", "LOG"}, rows);
  if (!c.admin_token_file.empty()) {
    std::cout << "\nlocal admin's token: " << c.admin_token_file;
    if (!c.saved_token_to.empty()) std::cout << " (yard uses it: " << c.saved_token_to << ")";
    std::cout << "\n";
  }
  if (!c.web_url.empty()) std::cout << "web console: " << c.web_url << "\n";
}

}  // namespace

// local: a cluster on this machine.
void AddLocalVerbs(CLI::App& app, Cli& c) {
  Globals& g = c.g;
  int& rc = c.rc;
  VerbArgs& a = c.args;
  auto* local = app.add_subcommand("local", "run a cluster on this machine, on loopback");
  local->require_subcommand(1);
  auto& up_options = a.up_options;
  up_options.state_dir = DefaultLocalStateDir();
  up_options.bin_dir = SelfDir();
  up_options.save_token_to = DefaultTokenFile();
  local->add_option("--state-dir", up_options.state_dir, "state and logs of the local cluster")
      ->capture_default_str();
  auto* up = local->add_subcommand(
      "up", "start a coordinator and its workers (--workers, default 1) in the background");
  up->add_option("--listen", up_options.listen, "coordinator HOST:PORT")->capture_default_str();
  up->add_option("--workers", up_options.workers, "worker daemons to start")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  up->add_option("--slots", up_options.slots_per_worker, "CPU slots of each worker")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  auto& up_preemption = a.up_preemption;
  auto& up_preemption_grace = a.up_preemption_grace;
  auto& up_min_run_time = a.up_min_run_time;
  up->add_flag("--preemption", up_preemption,
               "jobs may preempt lower-priority ones, which checkpoint first (coordinator "
               "--preemption)");
  up->add_option("--preemption-grace", up_preemption_grace,
                 "coordinator --preemption-grace (default 120s)");
  up->add_option("--min-run-time", up_min_run_time, "coordinator --min-run-time (default 5m)");
  up->add_option("--tls-cert", up_options.tls_cert,
                 "serve the coordinator and parameter servers over TLS with this certificate "
                 "(PEM, valid for 127.0.0.1; clients verify it with the global --tls-ca)");
  up->add_option("--tls-key", up_options.tls_key, "its private key (PEM)");
  auto& up_run_as = a.up_run_as;
  up->add_option("--run-as", up_run_as,
                 "USER=ACCOUNT: the workers run trainyard user USER's ranks as Unix account "
                 "ACCOUNT (repeatable; admin runs as you)");
  up->add_option("--web", up_options.web_address,
                 "the coordinator serves the web console on this HOST:PORT (127.0.0.1:0: a free "
                 "port; see status)");
  up->add_flag("--metrics", up_options.metrics,
               "every process serves Prometheus /metrics on a free loopback port (see status)");
  up->add_option("--threads-per-slot", up_options.threads_per_slot,
                 "threads of each rank (0: cores / (workers * slots))")
      ->capture_default_str();
  up->add_option("--ps", up_options.parameter_servers,
                 "parameter servers to start (for parallel.strategy: offload)")
      ->check(CLI::Range(0, 16))
      ->capture_default_str();
  up->add_option("--ps-memory-bytes", up_options.ps_memory_bytes,
                 "memory each parameter server offers (0: half this machine's)")
      ->check(NonNegative());
  // On loopback, pacing (BBR without fq, say) only costs: reno unless the environment says.
  const char* congestion_env = std::getenv(trainyard::ps::kTcpCongestionEnv);  // (static storage)
  up_options.tcp_congestion = congestion_env != nullptr ? congestion_env : "reno";
  up->add_option("--tcp-congestion", up_options.tcp_congestion,
                 "TCP congestion control of the parameter-server connections (\"\": the host's; "
                 "default $TRAINYARD_TCP_CONGESTION, else reno)")
      ->capture_default_str();
  up->callback([&] {
    // The default falls back to the host's where reno cannot be set (a sandbox's network stack);
    // a name the user chose is checked by LocalUp and refused.
    if (congestion_env == nullptr && up->count("--tcp-congestion") == 0 &&
        !trainyard::ps::CheckTcpCongestion(up_options.tcp_congestion, "").ok()) {
      up_options.tcp_congestion.clear();
    }
    up_options.tls_ca = g.tls.ca_file;
    for (const std::string& pair : up_run_as) {
      const size_t eq = pair.find('=');
      if (eq == 0 || eq == std::string::npos || eq + 1 == pair.size() ||
          pair.find_first_of(" \t\n") != std::string::npos) {
        rc = Fail(absl::InvalidArgumentError(
            absl::StrCat("--run-as: expected USER=ACCOUNT, got '", pair, "'")));
        return;
      }
      up_options.run_as.emplace_back(pair.substr(0, eq), pair.substr(eq + 1));
    }
    if (up_preemption) up_options.coordinator_flags.push_back("--preemption");
    if (!up_preemption_grace.empty()) {
      up_options.coordinator_flags.insert(up_options.coordinator_flags.end(),
                                          {"--preemption-grace", up_preemption_grace});
    }
    if (!up_min_run_time.empty()) {
      up_options.coordinator_flags.insert(up_options.coordinator_flags.end(),
                                          {"--min-run-time", up_min_run_time});
    }
    auto c = LocalUp(up_options);
    if (!c.ok()) {
      rc = Fail(c.status());
      return;
    }
    PrintCluster(g, *c);
    if (!g.json()) {
      std::cout << "\nexport TRAINYARD_COORDINATOR=" << c->coordinator_address << "\n";
      if (!c->tls_ca.empty()) std::cout << "export TRAINYARD_TLS_CA=" << c->tls_ca << "\n";
    }
  });
  auto* down = local->add_subcommand("down", "stop the local cluster");
  down->callback([&] {
    if (absl::Status s = LocalDown(up_options.state_dir); !s.ok()) {
      rc = Fail(s);
    } else if (!g.json()) {
      std::cout << "stopped\n";
    }
  });
  auto* status = local->add_subcommand("status", "show the local cluster's processes");
  status->callback([&] {
    auto c = LocalStatus(up_options.state_dir);
    if (!c.ok()) {
      rc = Fail(c.status());
      return;
    }
    PrintCluster(g, *c);
    for (const auto& p : c->processes) {
      if (!p.alive && rc == 0) {
        rc = Fail(absl::UnavailableError(
            absl::StrCat(p.name, " (pid ", p.pid, ") is not running; see ", p.log)));
      }
    }
  });
}

}  // namespace trainyard::client
