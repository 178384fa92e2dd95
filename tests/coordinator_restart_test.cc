// Kills a real trainyard-coordinator process with SIGKILL after jobs were submitted, cancelled and
// placed, restarts it on the same state (its SQLite file, or a PostgreSQL database on a private
// server the test starts), and checks that every job is back exactly as acknowledged, and that
// the restarted coordinator carries on (node timeouts, new submissions); and, with a real worker,
// that the logs and metrics of a job that just ended and of one still running are whole.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <pwd.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <numeric>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/yard_client.h"
#include "common/credentials.h"
#include "tests/testing/coordinator_process.h"
#include "tests/testing/identity.h"
#include "tests/testing/node_session.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"
#include "trainyard/v1/job.grpc.pb.h"

namespace trainyard {
namespace {

using testing::BinPath;
using testing::CoordinatorProcess;
using ::testing::HasSubstr;
using testing::TempDir;

CoordinatorProcess StartCoordinator(const std::string& state_dir, const std::string& node_timeout,
                                    const std::string& store) {
  std::vector<std::string> flags = {"--node-timeout", node_timeout, "--heartbeat-interval", "0.25"};
  if (!store.empty()) flags.insert(flags.end(), {"--store", store});
  return testing::StartCoordinatorProcess(state_dir, flags);
}

v1::JobSpec Spec(const std::string& name, int devices, int priority) {
  v1::JobSpec s;
  s.set_name(name);
  s.set_priority(priority);
  s.mutable_resources()->set_slots(devices);
  auto* m = s.mutable_model();
  m->set_n_layer(2);
  m->set_n_head(2);
  m->set_d_model(32 * (1 + devices));
  m->set_seq_len(16);
  s.mutable_data()->set_path("/usr/share/common-licenses/GPL-3");
  s.mutable_train()->set_steps(100 + priority);
  s.set_max_restarts(1);
  return s;
}

std::map<std::string, v1::Job> AllJobs(client::YardClient& client) {
  auto list = client.List({}, 0);
  EXPECT_TRUE(list.ok()) << list.status();
  std::map<std::string, v1::Job> out;
  if (list.ok()) {
    for (const auto& j : list->jobs()) out[j.id()] = j;
  }
  return out;
}

// Waits until the coordinator at `address` (its state in `state`) serves as the leader: its
// admin token exists and a call with it on `channel` succeeds. (A PostgreSQL replica prints its
// address as it stands by; while it takes over, calls may meet the standby's listener, which
// answers UNAVAILABLE and then closes.)
void WaitUntilServing(const std::string& state, const std::shared_ptr<grpc::Channel>& channel) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (::access((state + "/admin.token").c_str(), F_OK) != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  auto stub = v1::JobService::NewStub(channel);
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    testing::Authorize(ctx, testing::AdminToken(state));
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListJobsRequest request;
    request.set_page_size(1);
    v1::ListJobsResponse response;
    if (stub->ListJobs(&ctx, request, &response).ok()) return;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ADD_FAILURE() << "the coordinator never served";
}

class CoordinatorRestartTest : public ::testing::TestWithParam<const char*> {
 protected:
  // The --store flag's value for this run: empty for the SQLite file in the state directory.
  std::string Store(const std::string& database = "restart") {
    if (std::string(GetParam()) != "Postgres") return "";
    std::string why;
    testing::PostgresServer* server = testing::SharedPostgresServer(&why);
    if (server == nullptr) {
      ADD_FAILURE() << "no PostgreSQL: " << why;
      return "";
    }
    EXPECT_TRUE(server->CreateDatabase(database).ok());
    return server->Uri(database);
  }
};

TEST_P(CoordinatorRestartTest, EveryAcknowledgedJobAndStateSurvivesSigkill) {
  if (std::string(GetParam()) == "Postgres") {
    std::string why;
    if (testing::SharedPostgresServer(&why) == nullptr) GTEST_SKIP() << "no PostgreSQL: " << why;
  }
  TempDir dir;
  const std::string state = dir.path() + "/state";
  const std::string store = Store();
  CoordinatorProcess c = StartCoordinator(state, "30s", store);
  ASSERT_FALSE(c.address.empty());
  // Users and their tokens are durable too: alice's token still works after the restart.
  const auto channel = grpc::CreateChannel(c.address, grpc::InsecureChannelCredentials());
  WaitUntilServing(state, channel);
  const std::string admin_token = testing::AdminToken(state);
  const std::string alice_token = testing::CreateToken(channel, admin_token, "alice");
  client::YardClient admin(c.address, admin_token), alice(c.address, alice_token),
      bob(c.address, testing::CreateToken(channel, admin_token, "bob"));

  auto first = alice.Submit(Spec("first", 2, 90));
  auto second = bob.Submit(Spec("second", 2, 80));
  ASSERT_TRUE(first.ok() && second.ok());
  for (int i = 0; i < 20; ++i) {
    auto& who = i % 3 == 0 ? bob : alice;
    ASSERT_TRUE(who.Submit(Spec(absl::StrCat("j", i), 1 + i % 3, 10 + i)).ok());
  }
  for (const char* id : {"job-5", "job-9", "job-13"}) ASSERT_TRUE(admin.Cancel(id, "test").ok());

  // A node with 4 devices joins (only nodes with an open session get ranks): the two
  // high-priority jobs start on it.
  auto node = testing::NodeSession::Connect(
      channel, testing::CreateToken(channel, admin_token, "admin", "n1"), "n1", 4);
  // Watch events are sent once a change is durable, so RUNNING here is on disk.
  for (const auto& job : {*first, *second}) {
    auto seen = admin.Watch(job.id(), absl::Seconds(30),
                            [](const v1::Job& j) { return j.state() == v1::RUNNING; });
    ASSERT_TRUE(seen.ok()) << seen.status();
  }
  std::map<std::string, v1::Job> before = AllJobs(admin);
  ASSERT_EQ(before.size(), 22u);
  ASSERT_EQ(before["job-1"].state(), v1::RUNNING);
  ASSERT_EQ(before["job-2"].state(), v1::RUNNING);
  ASSERT_EQ(before["job-5"].state(), v1::CANCELLED);

  c.process->Signal(SIGKILL);
  ASSERT_TRUE(c.process->Wait(absl::Seconds(10)).has_value());

  // Restarted with a short node timeout: the node does not come back.
  CoordinatorProcess r = StartCoordinator(state, "3s", store);
  ASSERT_FALSE(r.address.empty());
  WaitUntilServing(state, grpc::CreateChannel(r.address, grpc::InsecureChannelCredentials()));
  client::YardClient again(r.address, alice_token);
  client::YardClient admin_again(r.address, testing::AdminToken(state));
  std::map<std::string, v1::Job> after = AllJobs(admin_again);
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [id, job] : before) {
    ASSERT_EQ(after.count(id), 1u) << id << " is missing after the restart";
    EXPECT_EQ(after[id].SerializeAsString(), job.SerializeAsString())
        << id << " changed:\n"
        << job.DebugString() << "\nvs\n"
        << after[id].DebugString();
  }
  // The running jobs' node never re-registers: they restart (max_restarts 1).
  auto j1 = again.Watch("job-1", absl::Seconds(30),
                        [](const v1::Job& j) { return j.state() != v1::RUNNING; });
  ASSERT_TRUE(j1.ok()) << j1.status();
  EXPECT_EQ(j1->state(), v1::RESTARTING);
  EXPECT_THAT(j1->message(), HasSubstr("node n1 lost"));
  // Ids continue after the highest stored one.
  auto next = again.Submit(Spec("after", 1, 50));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->id(), "job-23");
  r.process->Signal(SIGTERM);
  auto status = r.process->Wait(absl::Seconds(20));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
}

// Issue 54: a coordinator SIGKILLed right after one job ended and while another runs, and started
// again on the same address and store: `yard logs` and `yard metrics` of both have every line and
// step once. The ended job's were stored with its end; the running job's (never saved: the kill
// comes well within the 30 s save interval) come back from its worker, which sends its ranks'
// recent lines again on its new session, and from its rank, which sends its recent reports again
// to the new incarnation.
TEST_P(CoordinatorRestartTest, LogsAndMetricsOfEndedAndRunningJobsSurviveSigkill) {
  if (std::string(GetParam()) == "Postgres") {
    std::string why;
    if (testing::SharedPostgresServer(&why) == nullptr) GTEST_SKIP() << "no PostgreSQL: " << why;
  }
  TempDir dir;
  const std::string state = dir.path() + "/state";
  const std::string store = Store("restart_logs");
  auto start = [&](const std::string& listen) {
    std::vector<std::string> flags = {"--node-timeout", "30s", "--heartbeat-interval", "0.25"};
    if (!store.empty()) flags.insert(flags.end(), {"--store", store});
    return testing::StartCoordinatorProcess(state, flags, listen);
  };
  CoordinatorProcess c = start("127.0.0.1:0");
  ASSERT_FALSE(c.address.empty());
  const auto channel = grpc::CreateChannel(c.address, grpc::InsecureChannelCredentials());
  WaitUntilServing(state, channel);
  const std::string admin_token = testing::AdminToken(state);
  const std::string alice_token = testing::CreateToken(channel, admin_token, "alice");
  ASSERT_TRUE(WriteSecretFile(dir.path() + "/w1.token",
                              testing::CreateToken(channel, admin_token, "admin", "w1"))
                  .ok());
  std::ofstream(dir.path() + "/user-map") << "alice " << getpwuid(geteuid())->pw_name << "\n";
  auto worker = testing::Subprocess::Start(
      {BinPath("trainyard-worker"), "--coordinator", c.address, "--node-id", "w1", "--cpu-slots",
       "2", "--trainer", testing::TestBinPath("test_rank"), "--work-dir", dir.path() + "/work",
       "--stop-grace", "1s", "--token-file", dir.path() + "/w1.token", "--user-map",
       dir.path() + "/user-map"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto alice_at = std::make_unique<client::YardClient>(c.address, alice_token);
  client::YardClient* alice = alice_at.get();

  // Each job prints "line N" and reports step N every 20 ms until its release file exists.
  auto counting = [&](const std::string& release) {
    v1::JobSpec spec = testing::TinySpec("count-until-data-exists", 1);
    spec.mutable_data()->set_path(release);
    return alice->Submit(spec);
  };
  auto lines_of = [&](const std::string& id, int64_t* released = nullptr) {
    std::vector<int64_t> out;
    const absl::Status s = alice->Logs(id, false, 0, [&](const v1::LogLine& line) {
      int64_t n = 0;
      if (absl::StartsWith(line.text(), "line ") && absl::SimpleAtoi(line.text().substr(5), &n)) {
        out.push_back(n);
      } else if (released != nullptr && absl::StartsWith(line.text(), "released after ")) {
        EXPECT_TRUE(absl::SimpleAtoi(line.text().substr(15), released)) << line.text();
      }
    });
    EXPECT_TRUE(s.ok()) << s;
    return out;
  };
  auto steps_of = [&](const std::string& id) {
    std::vector<int64_t> out;
    const absl::Status s =
        alice->Metrics(id, false, [&](const v1::StepReport& r) { out.push_back(r.step()); });
    EXPECT_TRUE(s.ok()) << s;
    return out;
  };
  auto wait_for = [&](const std::string& id, size_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while ((lines_of(id).size() < n || steps_of(id).size() < n) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    return lines_of(id).size() >= n && steps_of(id).size() >= n;
  };
  auto one_to = [](int64_t n) {
    std::vector<int64_t> v(static_cast<size_t>(std::max<int64_t>(n, 0)));
    std::iota(v.begin(), v.end(), 1);
    return v;
  };

  auto ended = counting(dir.path() + "/release-ended");
  ASSERT_TRUE(ended.ok()) << ended.status();
  auto running = counting(dir.path() + "/release-running");
  ASSERT_TRUE(running.ok()) << running.status();
  ASSERT_TRUE(wait_for(ended->id(), 30));
  std::ofstream(dir.path() + "/release-ended") << "go\n";
  auto done = alice->Watch(ended->id(), absl::Seconds(60),
                           [](const v1::Job& j) { return j.state() == v1::SUCCEEDED; });
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::SUCCEEDED);
  ASSERT_TRUE(wait_for(running->id(), 30));

  // Killed at once (the job's end is durable: watches hear of it after its commit).
  c.process->Signal(SIGKILL);
  ASSERT_TRUE(c.process->Wait(absl::Seconds(10)).has_value());
  CoordinatorProcess r = start(c.address);
  ASSERT_EQ(r.address, c.address);
  WaitUntilServing(state, grpc::CreateChannel(r.address, grpc::InsecureChannelCredentials()));
  alice_at = std::make_unique<client::YardClient>(r.address, alice_token);  // a new connection
  alice = alice_at.get();

  int64_t ended_after = -1;
  const std::vector<int64_t> ended_lines = lines_of(ended->id(), &ended_after);
  ASSERT_GE(ended_after, 30);
  EXPECT_EQ(ended_lines, one_to(ended_after)) << "the ended job's lines";
  EXPECT_EQ(steps_of(ended->id()), one_to(ended_after)) << "the ended job's steps";

  // The running job goes on with the restarted coordinator, then ends.
  const size_t before = lines_of(running->id()).size();
  ASSERT_TRUE(wait_for(running->id(), before + 100));
  std::ofstream(dir.path() + "/release-running") << "go\n";
  done = alice->Watch(running->id(), absl::Seconds(60), [](const v1::Job&) { return false; });
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::SUCCEEDED) << done->message();
  EXPECT_EQ(done->attempt(), 1);
  int64_t running_after = -1;
  const std::vector<int64_t> running_lines = lines_of(running->id(), &running_after);
  EXPECT_EQ(running_lines, one_to(running_after)) << "the running job's lines";
  EXPECT_EQ(steps_of(running->id()), one_to(running_after)) << "the running job's steps";
}

INSTANTIATE_TEST_SUITE_P(Stores, CoordinatorRestartTest, ::testing::Values("Sqlite", "Postgres"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace trainyard
