// Failovers between two trainyard-coordinator replicas sharing a PostgreSQL store (a private
// server the test starts): the leader SIGKILLed while clients submit and a two-rank job runs, and
// the leader paused (SIGSTOP) past its lease, also inside a write transaction, and then resumed.
// The standby must lead within the bound, every acknowledged submit must be there once, the
// running job must finish on its first attempt, yard must keep working through the address list,
// and a resumed old leader must write nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
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

#ifdef TRAINYARD_TEST_WEB
#include <httplib.h>
#endif

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

// Clients that submit tiny jobs through `list` until stopped (at the latest when this goes out of
// scope, so that a failed assertion leaves no thread behind): which submits were acknowledged,
// and how many after mark() was set.
class Submitters {
 public:
  Submitters(int clients, const std::string& list, const std::string& token) {
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, c, list, token] {
        client::YardClient mine(list, token);
        for (int i = 0; !stop_.load(); ++i) {
          const bool after = mark.load();
          auto submitted = mine.Submit(testing::TinySpec("succeed", 1));
          absl::MutexLock lock(&mu_);
          if (submitted.ok()) {
            acked_.insert(submitted->id());
            if (after) ++acked_after_mark_;
          } else {
            ++failed_;
            ADD_FAILURE() << "client " << c << " submit " << i << ": " << submitted.status();
          }
        }
      });
    }
  }
  ~Submitters() { Stop(); }

  void Stop() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }
  // Waits until `n` submits were acknowledged after the mark (or, before it, in all); false when
  // `timeout` passed first.
  bool WaitForAcks(size_t n, bool after_mark, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto enough = [&] { return (after_mark ? acked_after_mark_ : acked_.size()) >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }
  std::set<std::string> acked() {
    absl::MutexLock lock(&mu_);
    return acked_;
  }
  size_t acked_after_mark() {
    absl::MutexLock lock(&mu_);
    return acked_after_mark_;
  }
  int failed() {
    absl::MutexLock lock(&mu_);
    return failed_;
  }

  std::atomic<bool> mark{false};

 private:
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  std::set<std::string> acked_ ABSL_GUARDED_BY(mu_);
  size_t acked_after_mark_ ABSL_GUARDED_BY(mu_) = 0;
  int failed_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;
};

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
    a_ = StartReplica("a", a_env_);
    ASSERT_FALSE(a_.address.empty());
    // a is the first replica: it takes the lease and, as the first leader, makes the admin.
    ASSERT_TRUE(WaitForFile(dir_.path() + "/a/admin.token")) << "replica a never led";
    // b stands by from a's start on (while a loads its jobs, in FailoverSlowStartTest).
    b_ = StartReplica("b");
    ASSERT_FALSE(b_.address.empty());
    // (The admin is made before the jobs are loaded: a serves once it answers but UNAVAILABLE.)
    for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
         Probe(a_.address, "", nullptr).error_code() == grpc::StatusCode::UNAVAILABLE;) {
      ASSERT_LT(absl::Now(), deadline) << "replica a never served";
      absl::SleepFor(absl::Milliseconds(20));
    }
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
    std::string web_url;  // with web_
  };

  Replica StartReplica(const std::string& name, const std::vector<std::string>& env = {}) {
    Replica r;
    std::vector<std::string> argv = {BinPath("trainyard-coordinator"),
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
                                     "6s"};
    if (web_) argv.insert(argv.end(), {"--web-address", "127.0.0.1:0"});
    auto p = Subprocess::Start(argv, env);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return r;
    r.process = std::move(*p);
    r.address = r.process->ReadLine(absl::Seconds(30)).value_or("");
    if (web_) {
      const std::string line = r.process->ReadLine(absl::Seconds(30)).value_or("");
      if (absl::StartsWith(line, "web ")) r.web_url = line.substr(4);
    }
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

  std::vector<std::string> a_env_;  // replica a's extra environment (set before SetUp)
  bool web_ = false;                // replicas serve the web console (set before SetUp)
  // Waits until the replica at `address` stands by, naming `leader`; the last probe's status.
  grpc::Status WaitUntilStandsBy(const std::string& address, const std::string& leader) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    std::string named;
    grpc::Status probe;
    while (absl::Now() < deadline) {
      named.clear();
      probe = Probe(address, alice_token_, &named);
      if (probe.error_code() == grpc::StatusCode::UNAVAILABLE && named == leader) return probe;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << address << " never stood by naming " << leader << ": "
                  << probe.error_message();
    return probe;
  }

  // Checks that every submit in `acked` is stored, and each logical submit once: no two jobs
  // share a request id, and the store holds no job that no client was given. Returns how many
  // jobs there are.
  size_t ExpectEachSubmitStoredOnce(const std::set<std::string>& acked) {
    auto listed = client::YardClient(list_, alice_token_).List({}, 0);
    EXPECT_TRUE(listed.ok()) << listed.status();
    if (!listed.ok()) return 0;
    std::set<std::string> present, request_ids;
    for (const v1::Job& j : listed->jobs()) {
      present.insert(j.id());
      EXPECT_FALSE(j.request_id().empty()) << j.id();
      EXPECT_TRUE(request_ids.insert(j.request_id()).second)
          << "request " << j.request_id() << " stored twice (again as " << j.id() << ")";
    }
    for (const std::string& id : acked) EXPECT_EQ(present.count(id), 1u) << id << " was lost";
    EXPECT_EQ(present.size(), acked.size()) << "a stored job that no client was given";
    EXPECT_EQ(server_->Query(database_, "SELECT count(*) FROM jobs").value_or(""),
              absl::StrCat(present.size()));
    return present.size();
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
  Submitters submitters(4, list_, alice_token_);
  ASSERT_TRUE(submitters.WaitForAcks(20, false, absl::Seconds(30)));

  a_.process->Signal(SIGKILL);
  const absl::Time death = absl::Now();
  submitters.mark = true;
  ASSERT_TRUE(a_.process->Wait(absl::Seconds(10)).has_value());
  const absl::Duration takeover = WaitUntilLeads(b_.address, death);
  EXPECT_LT(takeover, kTakeoverBound);
  std::cout << "the standby led " << absl::FormatDuration(takeover) << " after the leader died\n";
  submitters.WaitForAcks(20, true, death + absl::Seconds(40) - absl::Now());
  submitters.Stop();
  EXPECT_GE(submitters.acked_after_mark(), 20u) << "yard did not follow the new leader";
  EXPECT_EQ(submitters.failed(), 0);
  const std::set<std::string> acked = submitters.acked();

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
  const grpc::Status probe = WaitUntilStandsBy(a_.address, b_.address);
  EXPECT_EQ(probe.error_code(), grpc::StatusCode::UNAVAILABLE) << probe.error_message();
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

  // Pointed at the standby only, the streams reach the leader it names (issue 54): logs and
  // metrics answer, fetch-export gets the leader's word on a job with no export, and backup the
  // leader's store's (PostgreSQL: pg_dump), never the standby's UNAVAILABLE.
  client::YardClient at_standby(a_.address, alice_token_);
  EXPECT_TRUE(at_standby.Logs(at_b->id(), false, 0, [](const v1::LogLine&) {}).ok());
  EXPECT_TRUE(at_standby.Metrics(at_b->id(), false, [](const v1::StepReport&) {}).ok());
  const absl::Status fetched =
      at_standby.FetchExport(at_b->id(), [](const v1::ExportChunk&) { return absl::OkStatus(); });
  EXPECT_NE(fetched.code(), absl::StatusCode::kUnavailable) << fetched;
  EXPECT_FALSE(fetched.ok());
  client::YardClient admin_at_standby(a_.address, testing::AdminToken(dir_.path() + "/a"));
  const absl::Status backup =
      admin_at_standby.Backup([](const v1::BackupChunk&) { return absl::OkStatus(); });
  EXPECT_EQ(backup.code(), absl::StatusCode::kFailedPrecondition) << backup;
  EXPECT_THAT(backup.message(), HasSubstr("pg_dump"));
}

// A leader whose start takes longer than its lease (loading a large state) keeps the lease: its
// renewals start when it takes the lease, not once it serves. (They started after the start: the
// standby took the lease over during the load, and the loaded leader stepped down at once.)
class FailoverSlowStartTest : public FailoverE2eTest {
 protected:
  void SetUp() override {
    a_env_ = {"TRAINYARD_FAILPOINTS=load-jobs=sleep:7000"};  // over two leases of 3 s
    FailoverE2eTest::SetUp();
  }
};

TEST_F(FailoverSlowStartTest, ALeaderWhoseStartOutlastsItsLeaseKeepsIt) {
  if (server_ == nullptr) return;
  // b started while a was loading (a's admin token is made before the jobs are loaded), and a
  // served once loaded (SetUp).
  WaitUntilLeads(a_.address, absl::Now());
  WaitUntilStandsBy(b_.address, a_.address);
  // Nobody else ever took the lease: a's is still the first epoch, b never led.
  EXPECT_EQ(
      server_->Query(database_, "SELECT holder || ' ' || epoch FROM trainyard_leader").value_or(""),
      "a 1");
  auto submitted = Client()->Submit(testing::TinySpec("succeed", 1));
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  EXPECT_TRUE(Probe(a_.address, alice_token_, nullptr).ok());
}

// Issue 54: the logs and step metrics of a job running across a failover have every line and
// step once. The old leader had stored none of them (it saves running jobs' series every 30 s);
// the worker sends its ranks' recent lines again on its session with the new leader, and the rank
// its recent step reports on meeting a new incarnation, and the new leader keeps each once.
TEST_F(FailoverE2eTest, ARunningJobsLogsAndMetricsKeepEveryLineAndStepAcrossAFailover) {
  StartWorker();
  auto client = Client();
  const std::string release = dir_.path() + "/release";
  v1::JobSpec spec = testing::TinySpec("count-until-data-exists", 1);
  spec.mutable_data()->set_path(release);
  auto job = client->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  auto steps_at = [&](client::YardClient& at) {
    int steps = 0;
    const absl::Status s = at.Metrics(job->id(), false, [&](const v1::StepReport&) { ++steps; });
    return s.ok() ? steps : -1;
  };
  client::YardClient at_a(a_.address, alice_token_);
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (steps_at(at_a) < 50 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_GE(steps_at(at_a), 50);
  // `yard logs -f` and `yard metrics -f` through the address list, across the failover: they
  // resume at the new leader and print each line and step once.
  auto numbered = [](const std::string& text) -> std::optional<int64_t> {
    int64_t n = 0;
    if (absl::StartsWith(text, "line ") && absl::SimpleAtoi(text.substr(5), &n)) return n;
    return std::nullopt;
  };
  std::vector<int64_t> followed_lines, followed_steps;
  std::atomic<int> steps_followed{0};
  absl::Status followed_logs, followed_metrics;
  std::thread follow_logs([&] {
    client::YardClient c(list_, alice_token_);
    followed_logs = c.Logs(job->id(), true, 0, [&](const v1::LogLine& line) {
      if (auto n = numbered(line.text())) followed_lines.push_back(*n);
    });
  });
  std::thread follow_metrics([&] {
    client::YardClient c(list_, alice_token_);
    followed_metrics = c.Metrics(job->id(), true, [&](const v1::StepReport& r) {
      followed_steps.push_back(r.step());
      ++steps_followed;
    });
  });
  struct Joiner {
    std::thread& a;
    std::thread& b;
    const std::string& release;
    ~Joiner() {
      std::ofstream(release) << "go\n";  // (the follows end with the job)
      a.join();
      b.join();
    }
  } joiner{follow_logs, follow_metrics, release};
  deadline = absl::Now() + absl::Seconds(30);
  while (steps_followed.load() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }

  a_.process->Signal(SIGKILL);
  const absl::Time death = absl::Now();
  ASSERT_TRUE(a_.process->Wait(absl::Seconds(10)).has_value());
  EXPECT_LT(WaitUntilLeads(b_.address, death), kTakeoverBound);
  // The job goes on at b for a while (its worker and rank back with b) before the test lets it
  // end.
  client::YardClient at_b(b_.address, alice_token_);
  auto lines_at = [&](client::YardClient& at) {
    int lines = 0;
    const absl::Status s = at.Logs(job->id(), false, 0, [&](const v1::LogLine& line) {
      if (numbered(line.text())) ++lines;
    });
    return s.ok() ? lines : -1;
  };
  deadline = absl::Now() + absl::Seconds(60);
  while ((steps_at(at_b) < 150 || lines_at(at_b) < 150) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::ofstream(release) << "go\n";
  auto done = client->Watch(job->id(), absl::Seconds(60), [](const v1::Job&) { return false; });
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::SUCCEEDED) << done->message();
  EXPECT_EQ(done->attempt(), 1);

  // Every line the rank printed, once, in order: "line 1" .. "line N", then "released after N".
  std::vector<int64_t> numbers;
  int64_t released = -1;
  const absl::Status logs = at_b.Logs(job->id(), false, 0, [&](const v1::LogLine& line) {
    if (auto n = numbered(line.text())) {
      numbers.push_back(*n);
    } else if (absl::StartsWith(line.text(), "released after ")) {
      ASSERT_TRUE(absl::SimpleAtoi(line.text().substr(15), &released)) << line.text();
    }
  });
  ASSERT_TRUE(logs.ok()) << logs;
  ASSERT_GE(released, 150);
  std::vector<int64_t> expected(static_cast<size_t>(released));
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(numbers, expected) << "lines lost or doubled across the failover";
  // Every step the rank reported, once, in order.
  std::vector<int64_t> steps;
  const absl::Status metrics =
      at_b.Metrics(job->id(), false, [&](const v1::StepReport& r) { steps.push_back(r.step()); });
  ASSERT_TRUE(metrics.ok()) << metrics;
  EXPECT_EQ(steps, expected) << "steps lost or doubled across the failover";

  follow_logs.join();
  follow_metrics.join();
  follow_logs = std::thread([] {});  // (joined by Joiner)
  follow_metrics = std::thread([] {});
  EXPECT_TRUE(followed_logs.ok()) << followed_logs;
  EXPECT_TRUE(followed_metrics.ok()) << followed_metrics;
  EXPECT_EQ(followed_lines, expected) << "yard logs -f lost or doubled lines across the failover";
  EXPECT_EQ(followed_steps, expected)
      << "yard metrics -f lost or doubled steps across the failover";
}

// Issue 54: paused (SIGSTOP) while its write session is idle in a transaction, the leader once
// held the lease row's lock for as long as the pause lasted, and no standby could take over. Now
// the standby takes the lease within its TTL and a poll, serves, and the resumed leader commits
// nothing: every acknowledged submit is stored once (by request id), including those whose first
// try was in the paused transaction.
TEST_F(FailoverE2eTest, ALeaderPausedInsideAWriteTransactionIsTakenOverWithinItsLease) {
  Submitters submitters(4, list_, alice_token_);
  // (However this test ends, the old leader runs again before the clients are stopped.)
  struct Resume {
    Subprocess* process;
    ~Resume() { process->Signal(SIGCONT); }
  } resume{a_.process.get()};
  ASSERT_TRUE(submitters.WaitForAcks(10, false, absl::Seconds(30)));

  // Stop the leader until the database shows its write session idle inside a transaction (the
  // clients keep its commit thread busy); a stop that lands between transactions is undone at
  // once, well within the lease.
  const std::string in_transaction =
      absl::StrCat("SELECT count(*) FROM pg_stat_activity WHERE datname = '", database_,
                   "' AND state = 'idle in transaction'");
  const std::string still_busy =
      absl::StrCat("SELECT count(*) FROM pg_stat_activity WHERE datname = '", database_,
                   "' AND state = 'active' AND pid <> pg_backend_pid() AND application_name = "
                   "'trainyard-coordinator'");
  absl::Time paused;
  bool caught = false;
  for (int attempt = 0; attempt < 200 && !caught; ++attempt) {
    a_.process->Signal(SIGSTOP);
    paused = absl::Now();
    // What the session does once the statement in flight (if any) is done.
    for (int i = 0; i < 50 && server_->Query(database_, still_busy).value_or("") != "0"; ++i) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    caught = server_->Query(database_, in_transaction).value_or("") == "1";
    if (!caught) {
      a_.process->Signal(SIGCONT);
      absl::SleepFor(absl::Milliseconds(5 + attempt % 7));
    }
  }
  ASSERT_TRUE(caught) << "the leader was never stopped inside a write transaction";
  submitters.mark = true;

  // The lease passes within its TTL and one poll (a second of slack for a loaded machine), and
  // the standby serves within the bound, while the old leader is still stopped.
  const absl::Time lease_deadline = paused + absl::Seconds(20);
  std::string holder;
  while (absl::Now() < lease_deadline) {
    holder = server_->Query(database_, "SELECT holder FROM trainyard_leader").value_or("");
    if (holder == "b") break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration lease_takeover = absl::Now() - paused;
  ASSERT_EQ(holder, "b") << "the standby never took the lease from the paused leader";
  EXPECT_LT(lease_takeover, absl::Seconds(3) + absl::Milliseconds(200) + absl::Seconds(1));
  const absl::Duration takeover = WaitUntilLeads(b_.address, paused);
  EXPECT_LT(takeover, kTakeoverBound);
  std::cout << "the standby took the lease " << absl::FormatDuration(lease_takeover)
            << " and served " << absl::FormatDuration(takeover)
            << " after the leader stopped inside a transaction\n";
  // The paused transaction ends at its idle limit, on the server, so nothing waits on its rows.
  const absl::Time ended_by = paused + absl::Seconds(10);
  while (server_->Query(database_, in_transaction).value_or("") != "0" && absl::Now() < ended_by) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(server_->Query(database_, in_transaction).value_or(""), "0");
  // Clients whose submits were stuck at the paused leader give up on it and go to b.
  EXPECT_TRUE(submitters.WaitForAcks(10, true, absl::Seconds(40)))
      << "yard did not follow the new leader";
  std::cout << "10 submits acknowledged by the new leader "
            << absl::FormatDuration(absl::Now() - paused) << " after the pause\n";

  // The old leader resumes, finds its lease gone and stands by, naming b.
  a_.process->Signal(SIGCONT);
  WaitUntilStandsBy(a_.address, b_.address);
  submitters.Stop();
  EXPECT_EQ(submitters.failed(), 0);
  // Every acknowledged submit is stored, each logical submit once (the paused transaction held
  // first tries of submits that were retried at b).
  ExpectEachSubmitStoredOnce(submitters.acked());
}

// Replica a dies (as if SIGKILLed) at its 30th submit, after the job's commit and before the
// answer: the instant a retried submit could once be stored twice.
class FailoverKilledAfterCommitTest : public FailoverE2eTest {
 protected:
  void SetUp() override {
    a_env_ = {"TRAINYARD_FAILPOINTS=submit-after-commit=exit@30"};
    FailoverE2eTest::SetUp();
  }
};

TEST_F(FailoverKilledAfterCommitTest, EveryLogicalSubmitIsStoredExactlyOnce) {
  Submitters submitters(4, list_, alice_token_);
  // a exits by itself, at the failpoint, while the clients submit.
  const std::optional<int> status = a_.process->Wait(absl::Seconds(60));
  ASSERT_TRUE(status.has_value()) << "replica a never reached its 30th submit";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 137) << *status;
  const absl::Time death = absl::Now();
  submitters.mark = true;
  EXPECT_LT(WaitUntilLeads(b_.address, death), kTakeoverBound);
  EXPECT_TRUE(submitters.WaitForAcks(20, true, absl::Seconds(40)))
      << "yard did not follow the new leader";
  submitters.Stop();
  EXPECT_EQ(submitters.failed(), 0);
  // Each logical submit once: the submits that a had stored without answering were retried at b
  // with their request ids, and b answered with the jobs a had stored.
  EXPECT_GE(ExpectEachSubmitStoredOnce(submitters.acked()), 30u);
}

#ifdef TRAINYARD_TEST_WEB
// Both replicas serve the web console (issue 57).
class FailoverWebE2eTest : public FailoverE2eTest {
 protected:
  void SetUp() override {
    web_ = true;
    FailoverE2eTest::SetUp();
  }

  // The first answer of `path` at `url` whose status `want` accepts, within 30 s (a standby learns
  // the leader at its next poll; a new leader's console binds as it starts); nullptr if none.
  static httplib::Result Await(const std::string& url, const std::string& path,
                               const httplib::Headers& headers,
                               const std::function<bool(int)>& want) {
    httplib::Client client(url);
    client.set_connection_timeout(2, 0);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (true) {
      httplib::Result res = client.Get(path, headers);
      if ((res && want(res->status)) || absl::Now() > deadline) return res;
      absl::SleepFor(absl::Milliseconds(50));  // polled: nothing tells a client when
    }
  }
};

// The standby's console sends browsers (GETs and POSTs alike) to the leader's, same path and
// query; when the leader dies, the standby leads and serves the console on its own address.
TEST_F(FailoverWebE2eTest, TheStandbysConsoleRedirectsToTheLeadersAndServesItOnceItLeads) {
  ASSERT_TRUE(absl::StartsWith(a_.web_url, "http://127.0.0.1:")) << a_.web_url;
  ASSERT_TRUE(absl::StartsWith(b_.web_url, "http://127.0.0.1:")) << b_.web_url;
  ASSERT_NE(a_.web_url, b_.web_url);
  const std::string path = "/api/v1/jobs?state=RUNNING&page_size=5";
  httplib::Result redirected = Await(b_.web_url, path, {}, [](int s) { return s == 307; });
  ASSERT_TRUE(redirected) << httplib::to_string(redirected.error());
  ASSERT_EQ(redirected->status, 307) << redirected->body;
  EXPECT_EQ(redirected->get_header_value("Location"), a_.web_url + path);
  httplib::Client b(b_.web_url);
  httplib::Result post = b.Post("/api/v1/session", "{\"token\": \"x\"}", "application/json");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 307);
  EXPECT_EQ(post->get_header_value("Location"), a_.web_url + "/api/v1/session");
  // The leader answers itself: who you are, by your token.
  const httplib::Headers alice = {{"Authorization", "Bearer " + alice_token_}};
  httplib::Result at_a = Await(a_.web_url, "/api/v1/whoami", alice, [](int) { return true; });
  ASSERT_TRUE(at_a);
  EXPECT_EQ(at_a->status, 200) << at_a->body;
  EXPECT_THAT(at_a->body, ::testing::HasSubstr("\"user\":\"alice\""));

  a_.process->Signal(SIGKILL);
  const absl::Time death = absl::Now();
  ASSERT_TRUE(a_.process->Wait(absl::Seconds(10)).has_value());
  WaitUntilLeads(b_.address, death);
  httplib::Result at_b =
      Await(b_.web_url, "/api/v1/whoami", alice, [](int s) { return s != 307 && s != 503; });
  ASSERT_TRUE(at_b) << httplib::to_string(at_b.error());
  EXPECT_EQ(at_b->status, 200) << at_b->body;
  EXPECT_THAT(at_b->body, ::testing::HasSubstr("\"user\":\"alice\""));
}
#endif  // TRAINYARD_TEST_WEB

}  // namespace
}  // namespace trainyard
