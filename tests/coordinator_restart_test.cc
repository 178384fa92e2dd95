// Kills a real trainyard-coordinator process with SIGKILL after jobs were submitted, cancelled and
// placed, restarts it on the same state (its SQLite file, or a PostgreSQL database on a private
// server the test starts), and checks that every job is back exactly as acknowledged, and that
// the restarted coordinator carries on (node timeouts, new submissions).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/yard_client.h"
#include "tests/testing/coordinator_process.h"
#include "tests/testing/identity.h"
#include "tests/testing/node_session.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/subprocess.h"

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
  s.mutable_resources()->set_gpus(devices);
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

class CoordinatorRestartTest : public ::testing::TestWithParam<const char*> {
 protected:
  // The --store flag's value for this run: empty for the SQLite file in the state directory.
  std::string Store() {
    if (std::string(GetParam()) != "Postgres") return "";
    std::string why;
    testing::PostgresServer* server = testing::SharedPostgresServer(&why);
    if (server == nullptr) {
      ADD_FAILURE() << "no PostgreSQL: " << why;
      return "";
    }
    EXPECT_TRUE(server->CreateDatabase("restart").ok());
    return server->Uri("restart");
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
  // (With PostgreSQL the address is printed as the replica stands by, just before it leads and
  // makes the admin.)
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       ::access((state + "/admin.token").c_str(), F_OK) != 0 && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  // Users and their tokens are durable too: alice's token still works after the restart.
  const auto channel = grpc::CreateChannel(c.address, grpc::InsecureChannelCredentials());
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

INSTANTIATE_TEST_SUITE_P(Stores, CoordinatorRestartTest, ::testing::Values("Sqlite", "Postgres"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace trainyard
