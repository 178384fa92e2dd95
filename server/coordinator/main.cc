// trainyard-coordinator: parses flags, starts a CoordinatorServer (or, with a PostgreSQL store, a
// replica that leads or stands by: replica.h), prints the bound address on the first line of
// stdout, and shuts down cleanly on SIGTERM or SIGINT.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include <CLI/CLI.hpp>

#include "common/cli_checks.h"
#include "common/coordinator_endpoints.h"
#include "common/log_text.h"
#include "common/server_main.h"
#include "common/version.h"
#include "server/coordinator/coordinator_server.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/replica.h"

namespace {

using trainyard::coordinator::CoordinatorOptions;

// Flags read as text (durations) or converted after parsing.
struct Flags {
  std::string node_timeout = "10s", heartbeat_interval = "2s";
  std::string preemption_grace = "120s", min_run_time = "5m", max_grace = "10m", half_life = "168h";
  std::string usage_reset = "none";
  std::string finished_retention = "5m", history_retention = "720h";
  double refill_seconds = 1;
  std::string lease_ttl = "5s", renew_interval = "1s", lease_poll = "500ms";
};

// Replicas sharing a PostgreSQL store.
void AddReplicaFlags(CLI::App& app, CoordinatorOptions& options,
                     trainyard::coordinator::ReplicaOptions& replica, Flags& f) {
  app.add_option("--lease-ttl", f.lease_ttl,
                 "with a PostgreSQL store: how long the leader's lease lasts unrenewed; a standby "
                 "takes over within about this long of the leader's death")
      ->capture_default_str();
  app.add_option("--lease-renew-interval", f.renew_interval,
                 "how often the leader renews its lease (well under --lease-ttl)")
      ->capture_default_str();
  app.add_option("--lease-poll-interval", f.lease_poll,
                 "how often a standby tries to take the lease")
      ->capture_default_str();
  app.add_option("--replica-id", replica.id,
                 "this replica's name in the lease (default HOST:STATE_DIR, the absolute path)");
  app.add_option("--advertise-address", replica.advertise_address,
                 "HOST:PORT clients reach this replica at, given by standbys to callers "
                 "(default: the address it listens on)");
  app.add_option("--coordinators", options.rank_coordinator_addresses,
                 "every replica's HOST:PORT, comma-separated: given to ranks so that they follow a "
                 "failover (default: the leader's own address)");
}

// Where it serves and keeps its state; how it watches nodes.
void AddServingFlags(CLI::App& app, CoordinatorOptions& options, Flags& f) {
  app.add_option("--listen", options.listen_address,
                 "HOST:PORT to serve gRPC on; port 0 picks a free one (printed on stdout)")
      ->capture_default_str();
  app.add_option("--state-dir", options.state_dir, "directory for the job database")
      ->capture_default_str();
  app.add_option("--store", options.store,
                 "keep the state in this PostgreSQL database (postgresql://[user@]host[:port]/db; "
                 "the password from ~/.pgpass, PGPASSFILE or PGPASSWORD, never in the URI); "
                 "default: STATE_DIR/coordinator.db (SQLite)");
  app.add_option("--job-credential-key", options.job_credential_key_file,
                 "file (mode 0600, at least 32 bytes) with the key that signs ranks' job "
                 "credentials; replicas sharing a PostgreSQL store must share it (default: "
                 "STATE_DIR/job-credential.key, made on first start)");
  app.add_option("--restore", options.restore_from,
                 "start from this backup (yard admin backup --out FILE); the state directory "
                 "must hold no coordinator.db yet");
  app.add_option("--metrics-address", options.metrics_address,
                 "HOST:PORT of the Prometheus /metrics endpoint (port 0: a free one, printed "
                 "on the second line of stdout)");
  app.add_option("--web-address", options.web_address,
                 "HOST:PORT of the web console and its HTTP/JSON API, HTTPS with --tls-cert "
                 "(port 0: a free one; its URL printed as \"web URL\" after the address lines)");
  app.add_option("--web-public-url", options.web_public_url,
                 "behind a proxy (one that terminates TLS, say): https://HOST[:PORT] browsers "
                 "reach the console at; sign-ins from that origin are taken, the session cookie "
                 "is Secure, and yard web links use it");
  app.add_option("--web-trusted-proxies", options.web_trusted_proxies,
                 "comma-separated IP addresses of the proxies in front of the console: from "
                 "them, X-Forwarded-For names the browser whose failed sign-ins are counted")
      ->delimiter(',');
  app.add_option(
      "--checkpoint-root", options.checkpoint_root,
      "where jobs' checkpoints live, seen by every worker (default STATE_DIR/checkpoints)");
  app.add_option("--node-timeout", f.node_timeout,
                 "a node silent for this long is lost and its jobs restart or fail")
      ->capture_default_str();
  app.add_option("--heartbeat-interval", f.heartbeat_interval, "heartbeat period asked of nodes")
      ->capture_default_str();
  app.add_option("--max-message-bytes", options.max_message_bytes, "largest gRPC message accepted")
      ->capture_default_str();
}

// Preemption and fair share.
void AddSchedulingFlags(CLI::App& app, CoordinatorOptions& options, Flags& f) {
  app.add_flag("--preemption", options.preemption,
               "a job that cannot be placed may preempt running jobs of lower priority: they are "
               "asked to checkpoint and stop, and resume from that checkpoint later");
  app.add_option("--preemption-grace", f.preemption_grace,
                 "how long a preempted job may take to checkpoint and stop before its ranks are "
                 "stopped, unless its spec sets preemption_grace")
      ->capture_default_str();
  app.add_option("--max-preemption-grace", f.max_grace, "the most a job's preemption_grace may be")
      ->capture_default_str();
  app.add_option("--fair-share-half-life", f.half_life,
                 "accounts' and users' usage (device-seconds) halves every this long, as Slurm's "
                 "PriorityDecayHalfLife")
      ->capture_default_str();
  app.add_option("--fair-share-usage-reset", f.usage_reset,
                 "none, daily, weekly (Mondays) or monthly: all usage starts over from zero at "
                 "the start of each such period (UTC), as Slurm's PriorityUsageResetPeriod")
      ->capture_default_str();
  app.add_option("--min-run-time", f.min_run_time,
                 "a job runs at least this long before it may be preempted (again)")
      ->capture_default_str();
}

// TLS, the metrics endpoint's protection, the audit trail and the authentication throttles.
void AddSecurityFlags(CLI::App& app, CoordinatorOptions& options, Flags& f) {
  app.add_option("--tls-cert", options.tls.cert_file, "TLS certificate chain (PEM) to serve with");
  app.add_option("--tls-key", options.tls.key_file, "its private key (PEM)");
  app.add_option("--tls-client-ca", options.tls.client_ca_file,
                 "CA (PEM) of client certificates: mutual TLS; workers and parameter servers "
                 "then authenticate with a certificate whose common name is their node id");
  app.add_option("--tls-reload", options.tls.reload_seconds,
                 "seconds between reads of --tls-cert, --tls-key and --tls-client-ca: renewed "
                 "files take effect for new connections without a restart")
      ->capture_default_str()
      ->check(trainyard::Positive());
  app.add_flag("--insecure", options.tls.insecure,
               "serve without TLS on a non-loopback --listen address (tokens in clear)");
  app.add_option("--metrics-token-file", options.metrics_token_file,
                 "scrapes of /metrics need \"Authorization: Bearer <the file's token>\" (mode "
                 "0600; Prometheus: authorization.credentials_file)");
  app.add_flag("--metrics-tls", options.metrics_tls,
               "serve /metrics over TLS with --tls-cert/--tls-key (Prometheus: scheme https, "
               "tls_config.ca_file)");
  app.add_flag("--metrics-insecure", options.metrics_insecure,
               "serve /metrics on a non-loopback address without --metrics-token-file");
  app.add_option("--audit-log", options.audit_log,
                 "also write the audit trail to this file as JSON lines, one object per event "
                 "(created 0600; for log shippers)");
  auto& limits = options.limits;
  app.add_option("--auth-failures-per-token", limits.auth_per_token.burst,
                 "wrong secrets a token id may be sent before further wrong ones are answered "
                 "RESOURCE_EXHAUSTED (one more allowed each --auth-failure-refill seconds; its "
                 "right secret is always taken; 0: no throttle)")
      ->capture_default_str();
  app.add_option("--auth-failures-per-peer", limits.auth_per_peer.burst,
                 "malformed, unknown or wrong credentials one address (an IPv6 client's /64) may "
                 "send before further "
                 "failures are answered RESOURCE_EXHAUSTED (valid credentials from it are always "
                 "taken; 0: no throttle)")
      ->capture_default_str();
  app.add_option("--auth-peer-ipv6-prefix", limits.auth_peer_ipv6_prefix,
                 "the bits of an IPv6 client's address that --auth-failures-per-peer counts as "
                 "one client: 64 (a host's /64, in which it may take any address), 128 where "
                 "hosts share a /64, 56 or 48 where users are given those")
      ->capture_default_str()
      ->check(CLI::Range(16, 128));
  app.add_option("--auth-failure-refill", f.refill_seconds,
                 "seconds after which one more failed authentication is forgiven")
      ->capture_default_str()
      ->check(trainyard::Positive());
}

// What users, jobs and attempts may hold, and how long finished jobs are kept.
void AddLimitFlags(CLI::App& app, CoordinatorOptions& options, Flags& f) {
  auto& limits = options.limits;
  app.add_option("--max-queued-jobs-per-user", limits.max_queued_jobs_per_user,
                 "jobs a user may have queued unless an admin set the user's own max_queued_jobs "
                 "(negative: no cap)")
      ->capture_default_str();
  app.add_option(
         "--max-kept-checkpoints", limits.max_kept_checkpoints,
         "the most checkpoints a job may keep (its checkpoint.keep_last; keep_best may keep "
         "one more); a spec keeping more, or every one (keep_last 0), is refused (0: no "
         "cap)")
      ->capture_default_str()
      ->check(trainyard::NonNegative());
  app.add_option("--max-pending-submits", limits.max_pending_submits,
                 "submissions waiting for the store, all users together, before a submit is "
                 "refused with RESOURCE_EXHAUSTED and retry advice (negative: no cap)")
      ->capture_default_str();
  app.add_option("--max-tokens-per-user", limits.max_tokens_per_user,
                 "unrevoked, unexpired API tokens a user may hold (negative: no cap)")
      ->capture_default_str();
  app.add_option("--rendezvous-max-keys", limits.rendezvous.max_keys,
                 "rendezvous keys and barriers one job attempt may hold")
      ->capture_default_str()
      ->check(trainyard::Positive());
  app.add_option("--rendezvous-max-bytes", limits.rendezvous.max_bytes,
                 "bytes of rendezvous keys and values one job attempt may hold")
      ->capture_default_str()
      ->check(trainyard::Positive());
  app.add_option("--rendezvous-max-value-bytes", limits.rendezvous.max_value_bytes,
                 "the largest rendezvous value")
      ->capture_default_str()
      ->check(trainyard::Positive());
  app.add_option("--max-log-bytes-per-job", limits.max_log_bytes_per_job,
                 "log lines kept in memory per job (the oldest go first)")
      ->capture_default_str()
      ->check(trainyard::Positive());
  app.add_option("--max-metric-bytes-per-job", limits.max_metric_bytes_per_job,
                 "step reports kept in memory per job (the oldest go first)")
      ->capture_default_str()
      ->check(trainyard::Positive());
  app.add_option("--finished-job-retention", f.finished_retention,
                 "a finished job stays in memory this long; then it, its logs and its metrics "
                 "are read from the store (\"inf\": kept in memory until restart)")
      ->capture_default_str();
  app.add_option("--history-retention", f.history_retention,
                 "how long finished jobs' logs and metrics are kept in the store (\"inf\": for "
                 "ever; the jobs themselves stay)")
      ->capture_default_str();
  app.add_option("--history-log-bytes-per-job", limits.history.max_log_bytes_per_job,
                 "log bytes of a finished job written to the store (the newest lines)")
      ->capture_default_str()
      ->check(trainyard::Positive());
  app.add_option("--history-metric-bytes-per-job", limits.history.max_metric_bytes_per_job,
                 "step-report bytes of a finished job written to the store (thinned evenly, the "
                 "first and last steps kept)")
      ->capture_default_str()
      ->check(trainyard::Positive());
}

// The parsed flags into `options`; false (after saying why on stderr) when one is wrong.
bool ApplyReplicaFlags(const Flags& f, const CoordinatorOptions& options,
                       trainyard::coordinator::ReplicaOptions& replica) {
  auto ttl = trainyard::ParseFlagDuration("--lease-ttl", f.lease_ttl);
  auto renew = trainyard::ParseFlagDuration("--lease-renew-interval", f.renew_interval);
  auto poll = trainyard::ParseFlagDuration("--lease-poll-interval", f.lease_poll);
  for (const auto* d : {&ttl, &renew, &poll}) {
    if (!d->ok()) {
      std::cerr << "trainyard-coordinator: " << d->status().message() << "\n";
      return false;
    }
  }
  if (*renew * 2 > *ttl) {
    std::cerr << "trainyard-coordinator: --lease-renew-interval (" << f.renew_interval
              << ") must be at most half of --lease-ttl (" << f.lease_ttl << ")\n";
    return false;
  }
  if (!options.rank_coordinator_addresses.empty()) {
    auto list = trainyard::CoordinatorEndpoints::ParseList("--coordinators",
                                                           options.rank_coordinator_addresses);
    if (!list.ok()) {
      std::cerr << "trainyard-coordinator: " << list.status().message() << "\n";
      return false;
    }
  }
  replica.lease_ttl = *ttl;
  replica.renew_interval = *renew;
  replica.poll_interval = *poll;
  return true;
}

bool ApplyFlags(const Flags& f, CoordinatorOptions& options) {
  auto& limits = options.limits;
  limits.auth_per_token.per_second = 1 / f.refill_seconds;
  limits.auth_per_peer.per_second = 1 / f.refill_seconds;

  auto timeout = trainyard::ParseFlagDuration("--node-timeout", f.node_timeout);
  auto interval = trainyard::ParseFlagDuration("--heartbeat-interval", f.heartbeat_interval);
  auto grace = trainyard::ParseFlagDuration("--preemption-grace", f.preemption_grace);
  auto min_run = trainyard::ParseFlagDuration("--min-run-time", f.min_run_time);
  auto max_grace_d = trainyard::ParseFlagDuration("--max-preemption-grace", f.max_grace);
  auto half_life_d = trainyard::ParseFlagDuration("--fair-share-half-life", f.half_life);
  auto finished_d = trainyard::ParseFlagDuration("--finished-job-retention", f.finished_retention);
  auto history_d = trainyard::ParseFlagDuration("--history-retention", f.history_retention);
  for (const auto* d : {&timeout, &interval, &grace, &min_run, &max_grace_d, &half_life_d,
                        &finished_d, &history_d}) {
    if (!d->ok()) {
      std::cerr << "trainyard-coordinator: " << d->status().message() << "\n";
      return false;
    }
  }
  options.node_timeout = *timeout;
  options.heartbeat_interval = *interval;
  options.preemption_grace = *grace;
  options.min_run_time = *min_run;
  options.max_preemption_grace = *max_grace_d;
  if (options.preemption_grace > options.max_preemption_grace) {
    std::cerr << "trainyard-coordinator: --preemption-grace (" << f.preemption_grace
              << ") must not exceed --max-preemption-grace (" << f.max_grace << ")\n";
    return false;
  }
  options.fair_share_half_life = *half_life_d;
  const auto reset = trainyard::coordinator::ParseUsageReset(f.usage_reset);
  if (!reset.has_value()) {
    std::cerr << "trainyard-coordinator: --fair-share-usage-reset: expected none, daily, weekly "
                 "or monthly, got '"
              << f.usage_reset << "'\n";
    return false;
  }
  options.fair_share_usage_reset = *reset;
  limits.finished_job_retention = *finished_d;
  limits.history.retention = *history_d;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  trainyard::BlockTerminationSignals();
  const char* home = std::getenv("HOME");
  CoordinatorOptions options;
  options.state_dir = std::string(home != nullptr ? home : ".") + "/.trainyard";
  Flags flags;
  CLI::App app{"trainyard-coordinator: the trainyard control plane (jobs, scheduling, nodes)"};
  app.set_version_flag("--version", std::string("trainyard-coordinator ") + trainyard::kVersion);
  AddServingFlags(app, options, flags);
  AddSchedulingFlags(app, options, flags);
  AddSecurityFlags(app, options, flags);
  AddLimitFlags(app, options, flags);
  trainyard::coordinator::ReplicaOptions replica;
  AddReplicaFlags(app, options, replica, flags);
  trainyard::DecimalIntegers(app);
  CLI11_PARSE(app, argc, argv);
  trainyard::InstallEscapingLogger("coordinator");
  if (!ApplyFlags(flags, options) || !ApplyReplicaFlags(flags, options, replica)) return 2;

  if (trainyard::coordinator::IsPostgresLocation(options.store)) {
    if (!options.restore_from.empty()) {
      std::cerr << "trainyard-coordinator: --restore: a PostgreSQL store is restored with "
                   "pg_restore or psql (docs/operations.md)\n";
      return 2;
    }
    return trainyard::coordinator::RunReplica(
        options, replica, [](const std::string& address, const std::string& web_url) {
          std::printf("%s\n", address.c_str());
          if (!web_url.empty()) std::printf("web %s\n", web_url.c_str());
          std::fflush(stdout);
        });
  }

  auto server = trainyard::coordinator::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::cerr << "trainyard-coordinator: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("%s\n", (*server)->address().c_str());
  if (!(*server)->metrics_address().empty()) {
    std::printf("metrics %s\n", (*server)->metrics_address().c_str());
  }
  if (!(*server)->web_url().empty()) std::printf("web %s\n", (*server)->web_url().c_str());
  std::fflush(stdout);
  spdlog::info("serving on {} (state in {})", (*server)->address(),
               options.store.empty()
                   ? options.state_dir
                   : trainyard::coordinator::DescribePostgresLocation(options.store));

  const int sig = trainyard::WaitForTerminationSignal();
  spdlog::info("signal {}: shutting down", sig);
  (*server)->Shutdown();
  spdlog::info("stopped");
  return 0;
}
