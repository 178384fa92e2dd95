// Durable job submission over gRPC: N concurrent clients (own channels) call SubmitJob on a real
// coordinator (in this process, loopback TCP) for a fixed time; each reply means the job is on
// disk. Reports throughput and p50/p99 latency with group commit on and off, in the same run, for
// the SQLite store (a file in --dir) and the PostgreSQL store (a private server the bench starts
// in --dir, fsync on, over its Unix socket; where PostgreSQL is installed), against the goals
// (SQLite: 1,000 submits/s, p99 < 10 ms; PostgreSQL: 2,000 submits/s, p99 < 10 ms) and Slurm's
// published 500 jobs/s.
//
//   build/bin/submit_bench [--clients 8] [--seconds 5] [--reps 3] [--dir /var/tmp]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "server/coordinator/coordinator_server.h"
#include "tests/testing/postgres_server.h"
#include "trainyard/v1/job.grpc.pb.h"

namespace trainyard {
namespace {

struct Result {
  double submits_per_s = 0;
  double p50_ms = 0;
  double p99_ms = 0;
  double jobs_per_fsync = 0;
  int64_t errors = 0;
};

v1::JobSpec Spec(int i) {
  v1::JobSpec s;
  s.set_name(absl::StrFormat("bench-%d", i));
  s.set_priority(1 + i % 100);
  s.mutable_resources()->set_slots(1 + i % 8);
  auto* m = s.mutable_model();
  m->set_n_layer(4);
  m->set_n_head(4);
  m->set_d_model(256);
  m->set_seq_len(128);
  s.mutable_data()->set_path("/usr/share/common-licenses/GPL-3");
  s.mutable_train()->set_steps(300);
  return s;
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

// `store`: empty for SQLite in the state directory, else a PostgreSQL URI (a fresh database).
Result RunOnce(bool group_commit, int clients, double seconds, const std::string& base,
               const std::string& store) {
  const std::string dir = absl::StrFormat("%s/trainyard-submit-bench-%d", base, getpid());
  std::filesystem::remove_all(dir);
  coordinator::CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.state_dir = dir;
  o.store = store;
  o.group_commit = group_commit;
  o.background_threads = false;  // no scheduling: measure the submit path alone
  // Nothing is scheduled, so every submit stays queued: without this a client would reach the
  // default cap of 1,000 queued jobs per user within a second and the rest of its run would
  // measure refusals.
  o.limits.max_queued_jobs_per_user = -1;
  auto server = coordinator::CoordinatorServer::Start(o);
  if (!server.ok()) {
    std::fprintf(stderr, "start: %s\n", server.status().ToString().c_str());
    std::exit(1);
  }
  const std::string address = (*server)->address();

  std::atomic<bool> go{false}, stop{false};
  std::atomic<int64_t> errors{0};
  std::vector<std::vector<double>> latencies(clients);
  // One user (and API token) per client, made before the clock starts.
  std::vector<std::string> tokens;
  for (int c = 0; c < clients; ++c) {
    const std::string user = absl::StrFormat("user%d", c);
    auto created = (*server)->identities().CreateUser(user, v1::USER);
    auto token = (*server)->identities().CreateToken(user, "", 0, "bench");
    if (!created.ok() || !token.ok()) {
      std::fprintf(stderr, "users: %s %s\n", created.status().ToString().c_str(),
                   token.status().ToString().c_str());
      std::exit(1);
    }
    tokens.push_back("Bearer " + token->text);
  }
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection per client
      auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
      auto stub = v1::JobService::NewStub(channel);
      auto submit = [&](int i) {
        grpc::ClientContext ctx;
        ctx.AddMetadata("authorization", tokens[c]);
        v1::SubmitJobRequest r;
        *r.mutable_spec() = Spec(i);
        v1::SubmitJobResponse resp;
        return stub->SubmitJob(&ctx, r, &resp).ok();
      };
      for (int i = 0; i < 20; ++i) submit(i);  // warm-up: connection, caches
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; !stop.load(); ++i) {
        const absl::Time t0 = absl::Now();
        if (!submit(i)) errors.fetch_add(1);
        latencies[c].push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(300));  // let every client warm up
  const auto before = (*server)->Stats();
  const absl::Time start = absl::Now();
  go.store(true);
  absl::SleepFor(absl::Seconds(seconds));
  stop.store(true);
  for (auto& t : threads) t.join();
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  const auto after = (*server)->Stats();
  (*server)->Shutdown();
  server->reset();
  std::filesystem::remove_all(dir);

  std::vector<double> all;
  for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  Result r;
  r.submits_per_s = all.size() / elapsed;
  r.p50_ms = Percentile(all, 0.50);
  r.p99_ms = Percentile(all, 0.99);
  const int64_t tx = after.transactions - before.transactions;
  r.jobs_per_fsync = tx > 0 ? double(after.batches - before.batches) / tx : 0;
  r.errors = errors.load();
  return r;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace
}  // namespace trainyard

int main(int argc, char** argv) {
  int clients = 8, reps = 3;
  double seconds = 5;
  std::string dir = "/var/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--clients")) clients = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--seconds")) seconds = std::atof(argv[i + 1]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--dir")) dir = argv[i + 1];
  }
  std::printf(
      "durable SubmitJob over gRPC: %d clients, %.0f s per run, median of %d runs, "
      "SQLite WAL synchronous=FULL in %s; PostgreSQL synchronous_commit=on, fsync on, in %s\n\n",
      clients, seconds, reps, dir.c_str(), dir.c_str());
  // A private PostgreSQL server on the same disk; without one, its rows say why.
  setenv("TMPDIR", dir.c_str(), 1);
  auto postgres = trainyard::testing::PostgresServer::Start();
  std::printf("| %-42s | %10s | %8s | %8s | %12s | %6s | %-22s |\n", "case", "submits/s", "p50 ms",
              "p99 ms", "jobs / commit", "errors", "goal");
  std::printf("|%s|\n", std::string(133, '-').c_str());
  int database = 0;
  for (bool on_postgres : {false, true}) {
    if (on_postgres && !postgres.ok()) {
      std::printf("| %-42s | %s\n", "trainyard on PostgreSQL",
                  std::string(postgres.status().message()).c_str());
      continue;
    }
    for (bool group : {true, false}) {
      std::vector<double> tput, p50, p99, per_fsync;
      int64_t errors = 0;
      for (int r = 0; r < reps; ++r) {
        std::string store;
        if (on_postgres) {
          const std::string name = absl::StrFormat("bench_%d", ++database);
          if (absl::Status made = (*postgres)->CreateDatabase(name); !made.ok()) {
            std::fprintf(stderr, "create database: %s\n", made.ToString().c_str());
            return 1;
          }
          store = (*postgres)->Uri(name);
        }
        auto res = trainyard::RunOnce(group, clients, seconds, dir, store);
        tput.push_back(res.submits_per_s);
        p50.push_back(res.p50_ms);
        p99.push_back(res.p99_ms);
        per_fsync.push_back(res.jobs_per_fsync);
        errors += res.errors;
      }
      const double t = trainyard::Median(tput), q99 = trainyard::Median(p99);
      const double goal = on_postgres ? 2000 : 1000;
      const std::string name =
          absl::StrFormat("trainyard on %s, %s", on_postgres ? "PostgreSQL" : "SQLite",
                          group ? "group commit" : "commit per submit");
      std::printf(
          "| %-42s | %10.0f | %8.2f | %8.2f | %13.2f | %6lld | %-22s |\n", name.c_str(), t,
          trainyard::Median(p50), q99, trainyard::Median(per_fsync), static_cast<long long>(errors),
          absl::StrFormat("%.0f/s, p99<10ms: %s", goal, (t >= goal && q99 < 10) ? "met" : "NOT met")
              .c_str());
    }
  }
  std::printf("| %-42s | %10d | %8s | %8s | %13s | %6s | %-22s |\n", "anchor: Slurm (published)",
              500, "-", "-", "-", "-", "-");
  return 0;
}
