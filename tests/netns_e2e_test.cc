// trainyard across a network: the coordinator, workers and PostgreSQL as separate hosts (network
// namespaces on a bridge, tests/testing/netns.h) with real addresses, and partitions between them.
// Skipped, saying why, where network namespaces cannot be made (not root).
//
// - A worker cut off from the coordinator (TLS, mutual) is declared lost after the node timeout;
//   its job restarts on the other worker; when the partition heals, the old rank is stopped.
// - A leader cut off from the database steps down before its lease can have ended: it stands by
//   before the other replica leads.
// - An offload job trains with its parameter server on another host, over the bridge as it is and
//   then with the server's link limited to 50 Mbit/s (tc tbf; this kernel has no netem, so no
//   added delay): the step throughput of both is printed for bench/RESULTS.md.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/yard_client.h"
#include "common/credentials.h"
#include "nlohmann/json.hpp"
#include "tests/testing/grpc_probe.h"
#include "tests/testing/identity.h"
#include "tests/testing/netns.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_pki.h"
#include "tests/testing/tiny_spec.h"

namespace trainyard {
namespace {

using testing::BinPath;
using testing::Subprocess;
using testing::TempDir;
using testing::TestBinPath;
using testing::TestNetwork;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class NetnsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto net = TestNetwork::Create();
    if (!net.ok()) GTEST_SKIP() << "no network namespaces here: " << net.status().message();
    net_ = std::move(*net);
  }

  std::unique_ptr<Subprocess> StartIn(const std::string& host,
                                      const std::vector<std::string>& argv) {
    auto p = Subprocess::Start(net_->In(host, argv));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  // For the tests that train: host "ctl" with the coordinator (TLS, its certificate for its
  // address; heartbeats every 0.25 s), alice's token in a file and a user map that runs her jobs
  // as this account. The caller checks HasFatalFailure.
  void StartControlHost() {
    ASSERT_TRUE(net_->AddHost("ctl").ok());
    const std::string ctl = net_->Address("ctl");
    pki_ = std::make_unique<testing::TestPki>(dir_.path());
    pki_->SignWithSan("ctl", "ctl", "IP:" + ctl);
    const std::string state = dir_.path() + "/state";
    coordinator_ =
        StartIn("ctl", {BinPath("trainyard-coordinator"), "--listen", ctl + ":7070", "--state-dir",
                        state, "--tls-cert", pki_->Path("ctl.pem"), "--tls-key",
                        pki_->Path("ctl.key"), "--heartbeat-interval", "0.25"});
    ASSERT_NE(coordinator_, nullptr);
    address_ = coordinator_->ReadLine(absl::Seconds(30)).value_or("");
    ASSERT_EQ(address_, ctl + ":7070");
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(pki_->Path("ca.pem"));
    channel_ = grpc::CreateChannel(address_, grpc::SslCredentials(ssl));
    admin_ = testing::AdminToken(state);
    alice_file_ = dir_.path() + "/alice.token";
    ASSERT_TRUE(WriteSecretFile(alice_file_, testing::CreateToken(channel_, admin_, "alice")).ok());
    std::ofstream(dir_.path() + "/user-map") << "alice " << getpwuid(geteuid())->pw_name << "\n";
  }

  // A file with node `node`'s token: its path.
  std::string NodeTokenFile(const std::string& node) {
    const std::string path = dir_.path() + "/" + node + ".token";
    EXPECT_TRUE(WriteSecretFile(path, testing::CreateToken(channel_, admin_, "admin", node)).ok());
    return path;
  }

  // The nodes, once `count` of them are ready and connected (an error after 30 s).
  absl::StatusOr<v1::ListNodesResponse> WaitForNodes(int count) {
    client::YardClient client(address_, testing::CreateToken(channel_, admin_, "alice"),
                              TlsClientOptions{pki_->Path("ca.pem"), "", ""});
    for (const absl::Time deadline = absl::Now() + absl::Seconds(30);;) {
      auto nodes = client.ListNodes();
      int ready = 0;
      if (nodes.ok()) {
        for (const auto& n : nodes->nodes()) ready += n.state() == v1::NODE_READY && n.connected();
      }
      if (ready == count) return nodes;
      if (absl::Now() > deadline) return absl::DeadlineExceededError("the nodes did not register");
      absl::SleepFor(absl::Milliseconds(20));  // no watch API for nodes
    }
  }

  // `yard ARGS...` as alice.
  testing::CommandResult Yard(std::vector<std::string> args) {
    args.insert(args.begin(), {BinPath("yard"), "--coordinator", address_, "--tls-ca",
                               pki_->Path("ca.pem"), "--token-file", alice_file_});
    return testing::RunCommand(args, {"HOME=" + dir_.path(), "TRAINYARD_TOKEN="},
                               absl::Seconds(300));
  }

  // Workers on hosts n1 and n2 with `slots` CPU slots each; n2 without --address (it finds its
  // source address toward the coordinator). Both registered at their hosts' addresses.
  std::vector<std::unique_ptr<Subprocess>> StartTwoWorkers(int slots) {
    std::vector<std::unique_ptr<Subprocess>> workers;
    for (const std::string node : {"n1", "n2"}) {
      EXPECT_TRUE(net_->AddHost(node).ok());
      std::vector<std::string> argv = {BinPath("trainyard-worker"),
                                       "--coordinator",
                                       address_,
                                       "--node-id",
                                       node,
                                       "--cpu-slots",
                                       std::to_string(slots),
                                       "--work-dir",
                                       dir_.path() + "/work-" + node,
                                       "--token-file",
                                       NodeTokenFile(node),
                                       "--user-map",
                                       dir_.path() + "/user-map",
                                       "--tls-ca",
                                       pki_->Path("ca.pem")};
      if (node == "n1") argv.insert(argv.end(), {"--address", net_->Address(node)});
      workers.push_back(StartIn(node, argv));
    }
    const auto nodes = WaitForNodes(2);
    EXPECT_TRUE(nodes.ok()) << nodes.status();
    if (nodes.ok()) {
      for (const auto& n : nodes->nodes()) EXPECT_EQ(n.address(), net_->Address(n.id()));
    }
    return workers;
  }

  // Trains a small GPT on `ranks` ranks with `parallel` (a spec's parallel: mapping) for 6
  // steps, on whichever workers are up: its logs.
  std::string TrainGpt(const std::string& name, int ranks, const std::string& parallel) {
    const std::string spec = dir_.path() + "/" + name + ".yaml";
    std::ofstream(spec) << "name: " << name << "\n"
                        << "resources: {gpus: " << ranks << "}\n"
                        << "model: {kind: gpt, n_layer: 2, n_head: 2, d_model: 64, seq_len: 32, "
                           "vocab: 256}\n"
                        << "data: {path: /usr/share/common-licenses/GPL-3, format: bytes}\n"
                        << "train: {steps: 6, micro_batch: 4, lr: 3.0e-3, warmup: 2, seed: 1}\n"
                        << "parallel: " << parallel << "\n"
                        << "checkpoint: {every_steps: 0}\n";
    const testing::CommandResult submit = Yard({"submit", spec});
    EXPECT_EQ(submit.exit_code, 0) << submit.err;
    const std::string job(absl::StripAsciiWhitespace(submit.out));
    const testing::CommandResult wait = Yard({"wait", job});
    const std::string logs = Yard({"logs", job}).out;
    EXPECT_EQ(wait.exit_code, 0) << wait.err << logs;
    const auto series = nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out);
    EXPECT_EQ(series.size(), 6u) << logs;
    // Rank 0's line: its transport on its host's address, not loopback.
    EXPECT_THAT(logs, ::testing::ContainsRegex("collectives: gloo on (" + net_->Address("n1") +
                                               "|" + net_->Address("n2") + ")"));
    return logs;
  }

  TempDir dir_;
  std::unique_ptr<TestNetwork> net_;
  std::unique_ptr<testing::TestPki> pki_;
  std::unique_ptr<Subprocess> coordinator_;
  std::string address_, admin_, alice_file_;
  std::shared_ptr<grpc::Channel> channel_;
};

// The pids in a rank's pids file (test_rank), or none yet.
std::vector<pid_t> RankPids(const std::string& work_dir, const std::string& job, int attempt) {
  std::vector<pid_t> pids;
  std::ifstream in(absl::StrCat(work_dir, "/", job, "/attempt-", attempt, "/work/pids-rank-0"));
  for (pid_t p; in >> p;) pids.push_back(p);
  return pids;
}

TEST_F(NetnsE2eTest, APartitionedWorkersJobRestartsElsewhereAndItsOldRankStopsWhenItHeals) {
  for (const char* host : {"ctl", "n1", "n2"}) ASSERT_TRUE(net_->AddHost(host).ok());
  const std::string ctl = net_->Address("ctl");
  testing::TestPki pki(dir_.path());
  pki.SignWithSan("ctl", "ctl", "IP:" + ctl);
  pki.Sign("n1", "n1");
  pki.Sign("n2", "n2");
  const std::string state = dir_.path() + "/state";
  auto coordinator =
      StartIn("ctl", {BinPath("trainyard-coordinator"), "--listen", ctl + ":7070", "--state-dir",
                      state, "--tls-cert", pki.Path("ctl.pem"), "--tls-key", pki.Path("ctl.key"),
                      "--tls-client-ca", pki.Path("ca.pem"), "--node-timeout", "3s",
                      "--heartbeat-interval", "0.25"});
  ASSERT_NE(coordinator, nullptr);
  const std::string address = coordinator->ReadLine(absl::Seconds(30)).value_or("");
  ASSERT_EQ(address, ctl + ":7070");

  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadFile(pki.Path("ca.pem"));
  const auto channel = grpc::CreateChannel(address, grpc::SslCredentials(ssl));
  const std::string admin = testing::AdminToken(state);
  const std::string alice = testing::CreateToken(channel, admin, "alice");
  std::ofstream(dir_.path() + "/user-map") << "alice " << getpwuid(geteuid())->pw_name << "\n";
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (const std::string node : {"n1", "n2"}) {
    const std::string token_file = dir_.path() + "/" + node + ".token";
    ASSERT_TRUE(
        WriteSecretFile(token_file, testing::CreateToken(channel, admin, "admin", node)).ok());
    workers.push_back(StartIn(node, {BinPath("trainyard-worker"),
                                     "--coordinator",
                                     address,
                                     "--node-id",
                                     node,
                                     "--address",
                                     net_->Address(node),
                                     "--cpu-slots",
                                     "1",
                                     "--trainer",
                                     TestBinPath("test_rank"),
                                     "--work-dir",
                                     dir_.path() + "/work-" + node,
                                     "--keep-work-folders",  // (RankPids reads them)
                                     "--stop-grace",
                                     "1s",
                                     "--token-file",
                                     token_file,
                                     "--user-map",
                                     dir_.path() + "/user-map",
                                     "--tls-ca",
                                     pki.Path("ca.pem"),
                                     "--tls-cert",
                                     pki.Path(node + ".pem"),
                                     "--tls-key",
                                     pki.Path(node + ".key")}));
    ASSERT_NE(workers.back(), nullptr);
  }
  client::YardClient client(address, alice, TlsClientOptions{pki.Path("ca.pem"), "", ""});
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);;) {
    auto nodes = client.ListNodes();
    int ready = 0;
    if (nodes.ok()) {
      for (const auto& n : nodes->nodes()) ready += n.state() == v1::NODE_READY && n.connected();
    }
    if (ready == 2) break;
    ASSERT_LT(absl::Now(), deadline) << "the workers did not register across the network";
    absl::SleepFor(absl::Milliseconds(20));  // no watch API for nodes
  }

  auto job = client.Submit(testing::TinySpec("hang", 1, /*max_restarts=*/2));
  ASSERT_TRUE(job.ok()) << job.status();
  auto first = client.Watch(job->id(), absl::Seconds(60),
                            [](const v1::Job& j) { return j.state() == v1::RUNNING; });
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->placement_size(), 1);
  const std::string cut = first->placement(0).node_id();
  const std::string other = cut == "n1" ? "n2" : "n1";
  const std::string cut_work = dir_.path() + "/work-" + cut;
  std::vector<pid_t> old_rank;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       old_rank.empty() && absl::Now() < deadline;) {
    old_rank = RankPids(cut_work, job->id(), 1);
    if (old_rank.empty()) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(old_rank.size(), 1u);

  // (Taken before the cut: the heartbeats stop at some point during Partition.)
  const absl::Time partitioned = absl::Now();
  ASSERT_TRUE(net_->Partition(cut).ok());
  auto second = client.Watch(job->id(), absl::Seconds(60), [](const v1::Job& j) {
    return j.state() == v1::RUNNING && j.attempt() == 2;
  });
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->attempt(), 2);
  EXPECT_EQ(second->restarts(), 1);
  ASSERT_EQ(second->placement_size(), 1);
  EXPECT_EQ(second->placement(0).node_id(), other);
  // The 3 s node timeout runs from the last heartbeat that got through, which may have been up
  // to one heartbeat interval (250 ms) before the cut (a CI run saw the node lost 2.94 s after
  // it).
  EXPECT_GE(absl::Now() - partitioned, absl::Seconds(3) - absl::Milliseconds(250))
      << "lost before the node timeout";
  // Cut off, the old rank runs on: nothing told it otherwise.
  EXPECT_EQ(kill(old_rank[0], 0), 0);

  ASSERT_TRUE(net_->Heal(cut).ok());
  // Back in touch, the worker lists its running rank; the coordinator stops it as stale.
  bool stopped = false;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(40); absl::Now() < deadline;) {
    if (kill(old_rank[0], 0) != 0) {
      stopped = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(stopped) << "the partitioned node's old rank still runs after the partition healed";
  auto now = client.Get(job->id());
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->state(), v1::RUNNING);
  EXPECT_EQ(now->attempt(), 2);
  ASSERT_TRUE(client.Cancel(job->id(), "done").ok());
}

TEST_F(NetnsE2eTest, ALeaderCutOffFromTheDatabaseStandsByBeforeAnotherLeads) {
  for (const char* host : {"db", "c1", "c2"}) ASSERT_TRUE(net_->AddHost(host).ok());
  testing::PostgresServerOptions options;
  options.netns = net_->Namespace("db");
  options.listen_address = net_->Address("db");
  options.trust_network = net_->Address("db") + "/24";
  auto postgres = testing::PostgresServer::Start(options);
  if (!postgres.ok()) GTEST_SKIP() << "no PostgreSQL here: " << postgres.status().message();
  ASSERT_TRUE((*postgres)->CreateDatabase("cutoff").ok());
  const std::string key = dir_.path() + "/job-credential.key";
  ASSERT_TRUE(WriteSecretFile(key, std::string(44, 'k')).ok());
  testing::TestPki pki(dir_.path());
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadFile(pki.Path("ca.pem"));
  std::vector<std::unique_ptr<Subprocess>> replicas;
  std::vector<std::string> addresses;
  for (const std::string host : {"c1", "c2"}) {
    pki.SignWithSan(host, host, "IP:" + net_->Address(host));
    replicas.push_back(StartIn(host, {BinPath("trainyard-coordinator"),
                                      "--listen",
                                      net_->Address(host) + ":7070",
                                      "--tls-cert",
                                      pki.Path(host + ".pem"),
                                      "--tls-key",
                                      pki.Path(host + ".key"),
                                      "--state-dir",
                                      dir_.path() + "/" + host,
                                      "--store",
                                      (*postgres)->TcpUri("cutoff"),
                                      "--job-credential-key",
                                      key,
                                      "--replica-id",
                                      host,
                                      "--lease-ttl",
                                      "4s",
                                      "--lease-renew-interval",
                                      "0.5s",
                                      "--lease-poll-interval",
                                      "0.2s"}));
    ASSERT_NE(replicas.back(), nullptr);
    addresses.push_back(replicas.back()->ReadLine(absl::Seconds(30)).value_or(""));
    ASSERT_EQ(addresses.back(), net_->Address(host) + ":7070");
    if (host == "c1") {
      ASSERT_TRUE([&] {
        for (const absl::Time deadline = absl::Now() + absl::Seconds(30); absl::Now() < deadline;
             absl::SleepFor(absl::Milliseconds(20))) {
          if (::access((dir_.path() + "/c1/admin.token").c_str(), F_OK) == 0) return true;
        }
        return false;
      }()) << "c1 never led";
    }
  }
  auto serving = [&](int i) {
    auto health =
        testing::HealthCheck(grpc::CreateChannel(addresses[i], grpc::SslCredentials(ssl)));
    return health.ok() && *health == "SERVING";
  };
  ASSERT_TRUE(serving(0));
  ASSERT_FALSE(serving(1));

  // The database stops answering c1 (its replies are dropped); the rest of the network works.
  ASSERT_TRUE(net_->Block("db", "c1").ok());
  const absl::Time cut = absl::Now();
  absl::Time c1_stood_by = absl::InfiniteFuture(), c2_led = absl::InfiniteFuture();
  for (const absl::Time deadline = cut + absl::Seconds(40);
       absl::Now() < deadline && c2_led == absl::InfiniteFuture();) {
    if (c1_stood_by == absl::InfiniteFuture() && !serving(0)) c1_stood_by = absl::Now();
    if (serving(1)) c2_led = absl::Now();
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_NE(c2_led, absl::InfiniteFuture()) << "c2 never led";
  ASSERT_NE(c1_stood_by, absl::InfiniteFuture()) << "c1 never stood by";
  EXPECT_LT(c1_stood_by, c2_led) << "two leaders at once";
  std::cout << "cut off at 0: c1 stood by at " << absl::FormatDuration(c1_stood_by - cut)
            << ", c2 led at " << absl::FormatDuration(c2_led - cut) << "\n";
  ASSERT_TRUE(net_->Unblock("db", "c1").ok());
  // Reconnected, c1 stays a standby.
  EXPECT_FALSE(serving(0));
}

// The median of `key` over a `yard metrics -o json` series.
double Median(const nlohmann::json& series, const char* key) {
  std::vector<double> values;
  for (const auto& step : series) values.push_back(step.value(key, 0.0));
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

TEST_F(NetnsE2eTest, AnOffloadJobTrainsWithItsParameterServerOnAnotherHostAndAShapedLink) {
  if (::access(BinPath("trainyard-trainer").c_str(), X_OK) != 0) {
    GTEST_SKIP() << "no trainyard-trainer in this build";
  }
  StartControlHost();
  if (HasFatalFailure()) return;
  for (const char* host : {"n1", "ps"}) ASSERT_TRUE(net_->AddHost(host).ok());
  const std::string ps = net_->Address("ps");
  pki_->SignWithSan("ps", "ps1", "IP:" + ps);
  auto server = StartIn("ps", {BinPath("trainyard-ps"),
                               "--listen",
                               ps + ":7100",
                               "--data-listen",
                               ps + ":7101",
                               "--coordinator",
                               address_,
                               "--node-id",
                               "ps1",
                               "--threads",
                               "1",
                               "--memory-bytes",
                               "268435456",
                               "--token-file",
                               NodeTokenFile("ps1"),
                               "--tls-cert",
                               pki_->Path("ps.pem"),
                               "--tls-key",
                               pki_->Path("ps.key"),
                               "--tls-ca",
                               pki_->Path("ca.pem")});
  ASSERT_NE(server, nullptr);
  auto worker =
      StartIn("n1", {BinPath("trainyard-worker"), "--coordinator", address_, "--node-id", "n1",
                     "--address", net_->Address("n1"), "--cpu-slots", "2", "--work-dir",
                     dir_.path() + "/work", "--token-file", NodeTokenFile("n1"), "--user-map",
                     dir_.path() + "/user-map", "--tls-ca", pki_->Path("ca.pem")});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(WaitForNodes(2).ok()) << "the worker and the parameter server did not register";
  const std::string spec = dir_.path() + "/offload.yaml";
  std::ofstream(spec) << "name: offload\n"
                      << "resources: {gpus: 2}\n"
                      << "model: {kind: gpt, n_layer: 2, n_head: 2, d_model: 128, seq_len: 32, "
                         "vocab: 256}\n"
                      << "data: {path: /usr/share/common-licenses/GPL-3, format: bytes}\n"
                      << "train: {steps: 30, micro_batch: 8, lr: 3.0e-3, warmup: 5, seed: 1}\n"
                      << "parallel: {strategy: offload}\n"
                      << "checkpoint: {every_steps: 0}\n";
  // Trains the spec to its end: the median tokens/s of its steps (0 on failure).
  auto train = [&]() -> double {
    const testing::CommandResult submit = Yard({"submit", spec});
    EXPECT_EQ(submit.exit_code, 0) << submit.err;
    const std::string job(absl::StripAsciiWhitespace(submit.out));
    const testing::CommandResult wait = Yard({"wait", job});
    EXPECT_EQ(wait.exit_code, 0) << wait.err << Yard({"logs", job}).out;
    if (wait.exit_code != 0) return 0;
    const auto series = nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out);
    EXPECT_EQ(series.size(), 30u);
    EXPECT_THAT(
        Yard({"logs", job}).out,
        ::testing::ContainsRegex("parameter-server transfers: " + ps + ":7100: data plane"));
    return Median(series, "tokens_per_second");
  };
  const double open = train();
  if (absl::Status shaped = net_->Shape("ps", "50mbit"); !shaped.ok()) {
    GTEST_SKIP() << "trained across hosts at " << open << " tokens/s; cannot shape the link here ("
                 << shaped.message() << ")";
  }
  const double shaped = train();
  std::cout << "offload across hosts: " << open << " tokens/s over the bridge, " << shaped
            << " tokens/s with the parameter server's link at 50 Mbit/s (" << shaped / open
            << "x)\n";
  EXPECT_GT(shaped, 0);
  EXPECT_LT(shaped, open) << "the rate limit did not slow the transfers";
}

// A data-parallel job with one rank on each of two hosts: each rank's Gloo transport listens on
// its node's address (the worker's --address, or without one its address toward the
// coordinator), where the other host reaches it (on loopback, the peer would dial its own host),
// and the job trains to its end.
TEST_F(NetnsE2eTest, ADataParallelJobTrainsWithOneRankOnEachOfTwoHosts) {
  if (::access(BinPath("trainyard-trainer").c_str(), X_OK) != 0) {
    GTEST_SKIP() << "no trainyard-trainer in this build";
  }
  StartControlHost();
  if (HasFatalFailure()) return;
  const auto workers = StartTwoWorkers(1);
  if (HasFailure()) return;
  TrainGpt("ddp", 2, "{strategy: ddp}");
}

// Two ranks on each of two hosts: pipeline stages with a replica on each host (the stages' data-
// parallel groups span the hosts), and FSDP sharding over all four: their subgroups listen where
// the other host reaches them too.
TEST_F(NetnsE2eTest, PipelineReplicasAndFsdpShardsTrainAcrossTwoHosts) {
  if (::access(BinPath("trainyard-trainer").c_str(), X_OK) != 0) {
    GTEST_SKIP() << "no trainyard-trainer in this build";
  }
  StartControlHost();
  if (HasFatalFailure()) return;
  const auto workers = StartTwoWorkers(2);
  if (HasFailure()) return;
  TrainGpt("pipeline", 4, "{pipeline_stages: 2}");
  TrainGpt("fsdp", 4, "{strategy: fsdp}");
}

// A user's torch.distributed program (a command job) with one rank on each of two hosts: its Gloo
// takes the interface of its node's address (GLOO_SOCKET_IFNAME from the worker; by the host
// name, loopback here, it could not reach the other host), and the ranks all-reduce.
TEST_F(NetnsE2eTest, ACommandJobsGlooReachesItsRankOnAnotherHost) {
  const std::string python = TestBinPath("../sdk-venv/bin/python3");
  if (testing::RunCommand({python, "-c", "import torch.distributed"}).exit_code != 0) {
    GTEST_SKIP() << "no Python with torch (scripts/setup.sh makes build/sdk-venv)";
  }
  StartControlHost();
  if (HasFatalFailure()) return;
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (const std::string node : {"n1", "n2"}) {
    ASSERT_TRUE(net_->AddHost(node).ok());
    workers.push_back(StartIn(
        node,
        {BinPath("trainyard-worker"), "--coordinator", address_, "--node-id", node, "--cpu-slots",
         "1", "--work-dir", dir_.path() + "/work-" + node, "--token-file", NodeTokenFile(node),
         "--user-map", dir_.path() + "/user-map", "--tls-ca", pki_->Path("ca.pem")}));
    ASSERT_NE(workers.back(), nullptr);
  }
  ASSERT_TRUE(WaitForNodes(2).ok());
  const std::string script = dir_.path() + "/all_reduce.py";
  std::ofstream(script)
      << "import datetime, os, torch, torch.distributed as dist\n"
      << "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))\n"
      << "t = torch.ones(1) * (dist.get_rank() + 1)\n"
      << "dist.all_reduce(t)\n"
      << "print('sum', t.item(), 'over', os.environ.get('GLOO_SOCKET_IFNAME'))\n"
      << "dist.destroy_process_group()\n";
  const std::string spec = dir_.path() + "/gloo.yaml";
  std::ofstream(spec) << "name: gloo-two-hosts\n"
                      << "resources: {slots: 2}\n"
                      << "command: [" << python << ", " << script << "]\n"
                      << "max_restarts: 0\n";
  const testing::CommandResult submit = Yard({"submit", spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string job(absl::StripAsciiWhitespace(submit.out));
  const testing::CommandResult wait = Yard({"wait", job});
  const std::string logs = Yard({"logs", job}).out;
  ASSERT_EQ(wait.exit_code, 0) << wait.err << logs;
  // Both ranks have 1 + 2, each over its host's interface (not loopback's).
  EXPECT_THAT(logs, ::testing::ContainsRegex("\\[rank 0\\] sum 3.0 over [a-z]"));
  EXPECT_THAT(logs, ::testing::ContainsRegex("\\[rank 1\\] sum 3.0 over [a-z]"));
  EXPECT_THAT(logs, ::testing::Not(::testing::HasSubstr("over lo")));
}

}  // namespace
}  // namespace trainyard
