// Failovers between two trainyard-coordinator replicas sharing a PostgreSQL store (a private
// server the test starts): the leader SIGKILLed while clients submit and a two-rank job runs, and
// the leader paused (SIGSTOP) past its lease and then resumed. The standby must lead within the
// bound, every acknowledged submit must be there, the running job must finish on its first
// attempt, yard must keep working through the address list, and a resumed old leader must write
// nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/yard_client.h"
#include "common/coordinator_endpoints.h"
#include "common/credentials.h"
#include "tests/testing/identity.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"
#include "trainyard/v1/job.grpc.pb.h"

namespace trainyard {
namespace {

using testing::BinPath;
using ::testing::HasSubstr;
using testing::Subprocess;
using testing::TempDir;
using testing::TestBinPath;

constexpr char kLeaseTtl[] = "3s";
// What a takeover may take after the leader's death: the lease's 3 s, a standby's poll, the new
// leader's start, a client's backoff.
constexpr absl::Duration kTakeoverBound = absl::Seconds(8);

class FailoverE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    server_ = testing::SharedPostgresServer(&why);
    if (server_ == nullptr) GTEST_SKIP() << "no PostgreSQL here: " << why;
    database_ =
        absl::StrCat("failover_", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_TRUE(server_->CreateDatabase(database_).ok());
    store_ = server_->Uri(database_);
    key_file_ = dir_.path() + "/job-credential.key";
    ASSERT_TRUE(WriteSecretFile(key_file_, std::string(44, 'k')).ok());
    a_ = StartReplica("a");
    ASSERT_FALSE(a_.address.empty());
    // a is the first replica: it takes the lease and, as the first leader, makes the admin.
    ASSERT_TRUE(WaitForFile(dir_.path() + "/a/admin.token")) << "replica a never led";
    b_ = StartReplica("b");
    ASSERT_FALSE(b_.address.empty());
    list_ = absl::StrCat(b_.address, ",", a_.address);  // the standby first, on purpose
    const auto channel = grpc::CreateChannel(a_.address, grpc::InsecureChannelCredentials());
    const std::string admin = testing::AdminToken(dir_.path() + "/a");
    alice_token_ = testing::CreateToken(channel, admin, "alice");
    ASSERT_TRUE(WriteSecretFile(dir_.path() + "/w1.token",
                                testing::CreateToken(channel, admin, "admin", "w1"))
                    .ok());
  }

  struct Replica {
    std::unique_ptr<Subprocess> process;
    std::string address;
  };

  Replica StartReplica(const std::string& name) {
    Replica r;
    auto p = Subprocess::Start({BinPath("trainyard-coordinator"),
                                "--listen",
                                "127.0.0.1:0",
                                "--state-dir",
                                dir_.path() + "/" + name,
                                "--store",
                                store_,
                                "--job-credential-key",
                                key_file_,
                                "--replica-id",
                                name,
                                "--lease-ttl",
                                kLeaseTtl,
                                "--lease-renew-interval",
                                "0.5s",
                                "--lease-poll-interval",
                                "0.2s",
                                "--heartbeat-interval",
                                "0.25",
                                "--node-timeout",
                                "6s"});
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return r;
    r.process = std::move(*p);
    r.address = r.process->ReadLine(absl::Seconds(30)).value_or("");
    return r;
  }

  static bool WaitForFile(const std::string& path) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (::access(path.c_str(), F_OK) != 0) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }

  void StartWorker() {
    std::ofstream(dir_.path() + "/user-map") << "alice " << getpwuid(geteuid())->pw_name << "\n";
    auto p = Subprocess::Start(
        {BinPath("trainyard-worker"), "--coordinator", list_, "--node-id", "w1", "--cpu-slots", "2",
         "--trainer", TestBinPath("test_rank"), "--work-dir", dir_.path() + "/work", "--stop-grace",
         "1s", "--token-file", dir_.path() + "/w1.token", "--user-map", dir_.path() + "/user-map"});
    ASSERT_TRUE(p.ok()) << p.status();
    worker_ = std::move(*p);
  }

  std::unique_ptr<client::YardClient> Client() {
    return std::make_unique<client::YardClient>(list_, alice_token_);
  }

  // What the replica at `address` answers now: OK (it leads), or the standby's UNAVAILABLE.
  static grpc::Status Probe(const std::string& address, const std::string& token,
                            std::string* leader) {
    auto stub =
        v1::JobService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    testing::Authorize(ctx, token);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListJobsRequest request;
    request.set_page_size(1);
    v1::ListJobsResponse response;
    const grpc::Status status = stub->ListJobs(&ctx, request, &response);
    const auto& trailers = ctx.GetServerTrailingMetadata();
    if (auto it = trailers.find(kLeaderMetadata); it != trailers.end() && leader != nullptr) {
      leader->assign(it->second.data(), it->second.size());
    }
    return status;
  }

  // Waits until the replica at `address` leads; how long that took.
  absl::Duration WaitUntilLeads(const std::string& address, absl::Time since) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      if (Probe(address, alice_token_, nullptr).ok()) return absl::Now() - since;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << address << " never led";
    return absl::InfiniteDuration();
  }

  TempDir dir_;
  testing::PostgresServer* server_ = nullptr;
  std::string database_, store_, key_file_, list_, alice_token_;
  Replica a_, b_;
  std::unique_ptr<Subprocess> worker_;
};

TEST_F(FailoverE2eTest, AKilledLeadersStandbyLeadsWithEveryAckedSubmitAndTheRunningJobGoesOn) {
  StartWorker();
  auto client = Client();
  // A two-rank job that runs until the test creates its data file.
  const std::string release = dir_.path() + "/release";
  v1::JobSpec spec = testing::TinySpec("until-data-exists", 2);
  spec.mutable_data()->set_path(release);
  auto job = client->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  auto running = client->Watch(job->id(), absl::Seconds(60),
                               [](const v1::Job& j) { return j.state() == v1::RUNNING; });
  ASSERT_TRUE(running.ok()) << running.status();
  ASSERT_EQ(running->state(), v1::RUNNING);

  // Four clients submit through the address list, before, during and after the failover.
  constexpr int kClients = 4;
  absl::Mutex mu;
  std::set<std::string> acked;
  int failed = 0;
  std::atomic<bool> killed{false}, stop{false};
  std::atomic<int> acked_after_kill{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto mine = Client();
      for (int i = 0; !stop.load(); ++i) {
        const bool after = killed.load();
        auto submitted = mine->Submit(testing::TinySpec("succeed", 1));
        absl::MutexLock lock(&mu);
        if (submitted.ok()) {
          acked.insert(submitted->id());
          if (after) ++acked_after_kill;
        } else {
          ++failed;
          ADD_FAILURE() << "client " << c << " submit " << i << ": " << submitted.status();
        }
      }
    });
  }
  auto acks = [&] {
    absl::MutexLock lock(&mu);
    return acked.size();
  };
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (acks() < 20 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_GE(acks(), 20u);

  a_.process->Signal(SIGKILL);
  const absl::Time death = absl::Now();
  killed = true;
  ASSERT_TRUE(a_.process->Wait(absl::Seconds(10)).has_value());
  const absl::Duration takeover = WaitUntilLeads(b_.address, death);
  EXPECT_LT(takeover, kTakeoverBound);
  std::cout << "the standby led " << absl::FormatDuration(takeover) << " after the leader died\n";
  while (acked_after_kill.load() < 20 && absl::Now() < death + absl::Seconds(40)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  stop = true;
  for (std::thread& t : clients) t.join();
  EXPECT_GE(acked_after_kill.load(), 20) << "yard did not follow the new leader";
  EXPECT_EQ(failed, 0);

  // Every acknowledged submit is at the new leader.
  auto listed = client->List({}, 0);
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::set<std::string> present;
  for (const v1::Job& j : listed->jobs()) present.insert(j.id());
  for (const std::string& id : acked) EXPECT_EQ(present.count(id), 1u) << id << " was lost";

  // The running job never restarted: the worker came to the new leader with its ranks, and the
  // job ends on its first attempt.
  auto now = client->Get(job->id());
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->state(), v1::RUNNING);
  EXPECT_EQ(now->attempt(), 1);
  std::ofstream(release) << "go\n";
  auto done = client->Watch(job->id(), absl::Seconds(60), [](const v1::Job&) { return false; });
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::SUCCEEDED) << done->message();
  EXPECT_EQ(done->attempt(), 1);
  EXPECT_EQ(done->restarts(), 0);

  // The streams follow the leader as the unary calls do (issue 54): the dead replica is first in
  // the list, and yard logs and yard metrics of the job are answered by the new leader.
  client::YardClient dead_first(absl::StrCat(a_.address, ",", b_.address), alice_token_);
  int lines = 0, steps = 0;
  const absl::Status logs =
      dead_first.Logs(job->id(), false, 0, [&](const v1::LogLine&) { ++lines; });
  EXPECT_TRUE(logs.ok()) << logs;
  const absl::Status metrics =
      dead_first.Metrics(job->id(), false, [&](const v1::StepReport&) { ++steps; });
  EXPECT_TRUE(metrics.ok()) << metrics;
  EXPECT_GT(lines + steps, 0) << "the job's logs and metrics are empty at the new leader";
}

TEST_F(FailoverE2eTest, APausedLeaderThatResumesAfterTheTakeoverWritesNothing) {
  auto client = Client();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client->Submit(testing::TinySpec("succeed", 1)).ok());

  a_.process->Signal(SIGSTOP);
  const absl::Time paused = absl::Now();
  const absl::Duration takeover = WaitUntilLeads(b_.address, paused);
  EXPECT_LT(takeover, kTakeoverBound);
  auto at_b = client->Submit(testing::TinySpec("succeed", 1));
  ASSERT_TRUE(at_b.ok()) << at_b.status();

  // The old leader resumes and is called directly (no list): whatever it answers, nothing it
  // might still accept as the leader reaches the store.
  a_.process->Signal(SIGCONT);
  auto direct = client::YardClient(a_.address, alice_token_).Submit(testing::TinySpec("late", 1));
  // It stands by now (within a renewal or two), naming the new leader.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::string leader;
  grpc::Status probe;
  while (absl::Now() < deadline) {
    leader.clear();
    probe = Probe(a_.address, alice_token_, &leader);
    if (probe.error_code() == grpc::StatusCode::UNAVAILABLE && leader == b_.address) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(probe.error_code(), grpc::StatusCode::UNAVAILABLE) << probe.error_message();
  EXPECT_EQ(leader, b_.address);
  EXPECT_THAT(probe.error_message(), HasSubstr("standby"));

  // The store holds what b acknowledged and, of the direct submit, only what b itself took (the
  // client follows a standby's answer to b): never a job written by a.
  auto listed = client->List({}, 0);
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::set<std::string> ids;
  for (const v1::Job& j : listed->jobs()) ids.insert(j.id());
  const size_t expected = 4 + (direct.ok() ? 1 : 0);
  EXPECT_EQ(ids.size(), expected);
  EXPECT_EQ(ids.count(at_b->id()), 1u);
  auto rows = server_->Query(database_, "SELECT count(*) FROM jobs");
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(*rows, absl::StrCat(expected));
  std::cout << "the direct submit to the resumed leader: "
            << (direct.ok() ? "taken by the new leader" : direct.status().ToString()) << "\n";
}

}  // namespace
}  // namespace trainyard
