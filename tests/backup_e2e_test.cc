// yard admin backup and trainyard-coordinator --restore, with real processes: an admin backs up a
// serving coordinator's state (users, accounts, tokens, jobs), a coordinator started from that
// backup on an empty state directory lists every one of them as they were and accepts the old
// tokens, and what must be refused is: a backup by a non-admin, over an existing file, and a
// restore over existing state or from a file that is not a backup.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "client/yard_client.h"
#include "tests/testing/coordinator_process.h"
#include "tests/testing/identity.h"
#include "tests/testing/subprocess.h"

namespace trainyard {
namespace {

using testing::BinPath;
using testing::CoordinatorProcess;
using ::testing::HasSubstr;
using testing::TempDir;

CoordinatorProcess StartCoordinator(const std::string& state_dir, const std::string& restore = "") {
  if (restore.empty()) return testing::StartCoordinatorProcess(state_dir);
  return testing::StartCoordinatorProcess(state_dir, {"--restore", restore});
}

v1::JobSpec Spec(const std::string& name, int devices) {
  v1::JobSpec s;
  s.set_name(name);
  s.mutable_resources()->set_slots(devices);
  auto* m = s.mutable_model();
  m->set_n_layer(2);
  m->set_n_head(2);
  m->set_d_model(64);
  m->set_seq_len(16);
  s.mutable_data()->set_path("/usr/share/common-licenses/GPL-3");
  s.mutable_train()->set_steps(100);
  return s;
}

// Everything a backup must carry, as the coordinator lists it.
struct State {
  std::map<std::string, std::string> jobs, users, tokens, accounts;  // id -> serialized
};

State Read(client::YardClient& admin) {
  State s;
  auto jobs = admin.List({}, 0);
  EXPECT_TRUE(jobs.ok()) << jobs.status();
  if (jobs.ok()) {
    for (const auto& j : jobs->jobs()) s.jobs[j.id()] = j.SerializeAsString();
  }
  auto users = admin.ListUsers();
  EXPECT_TRUE(users.ok()) << users.status();
  if (users.ok()) {
    for (const auto& u : users->users()) s.users[u.name()] = u.SerializeAsString();
  }
  auto tokens = admin.ListTokens("", /*all=*/true);
  EXPECT_TRUE(tokens.ok()) << tokens.status();
  if (tokens.ok()) {
    for (const auto& t : tokens->tokens()) s.tokens[t.id()] = t.SerializeAsString();
  }
  auto accounts = admin.ListAccounts();
  EXPECT_TRUE(accounts.ok()) << accounts.status();
  if (accounts.ok()) {
    for (const auto& a : accounts->accounts()) s.accounts[a.name()] = a.SerializeAsString();
  }
  return s;
}

testing::CommandResult Yard(const std::string& address, const std::string& token,
                            const std::vector<std::string>& args) {
  std::vector<std::string> argv = {BinPath("yard")};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::RunCommand(argv,
                             {"TRAINYARD_COORDINATOR=" + address, "TRAINYARD_TOKEN=" + token});
}

TEST(BackupE2eTest, ARestoredCoordinatorHasEveryJobUserAccountAndTokenOfTheBackup) {
  TempDir dir;
  const std::string state = dir.path() + "/state";
  CoordinatorProcess c = StartCoordinator(state);
  ASSERT_FALSE(c.address.empty());
  const auto channel = grpc::CreateChannel(c.address, grpc::InsecureChannelCredentials());
  const std::string admin_token = testing::AdminToken(state);
  client::YardClient admin(c.address, admin_token);
  v1::Account research;
  research.set_name("research");
  research.set_quota_devices(8);
  ASSERT_TRUE(admin.CreateAccount(research).ok());
  ASSERT_TRUE(admin.CreateUser("alice", v1::USER, "research").ok());
  const std::string alice_token = testing::CreateToken(channel, admin_token, "alice");
  const std::string bob_token = testing::CreateToken(channel, admin_token, "bob");
  client::YardClient alice(c.address, alice_token), bob(c.address, bob_token);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE((i % 2 == 0 ? alice : bob).Submit(Spec(absl::StrCat("j", i), 1 + i % 2)).ok());
  }
  ASSERT_TRUE(admin.Cancel("job-2", "test").ok());
  const State before = Read(admin);
  ASSERT_EQ(before.jobs.size(), 5u);
  ASSERT_EQ(before.users.size(), 3u);  // admin, alice, bob
  ASSERT_GE(before.tokens.size(), 3u);

  // Admins only, audited; nothing is written for a refused call.
  const std::string backup = dir.path() + "/state.backup";
  testing::CommandResult refused =
      Yard(c.address, alice_token, {"admin", "backup", "--out", backup});
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.err, HasSubstr("Backup is for admins; alice is not one"));
  struct stat st {};
  EXPECT_NE(::stat(backup.c_str(), &st), 0);
  testing::CommandResult made = Yard(c.address, admin_token, {"admin", "backup", "--out", backup});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  EXPECT_THAT(made.out, HasSubstr("backed up the coordinator's state"));
  ASSERT_EQ(::stat(backup.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);  // it holds every token's hash
  testing::CommandResult again = Yard(c.address, admin_token, {"admin", "backup", "--out", backup});
  EXPECT_NE(again.exit_code, 0);
  EXPECT_THAT(again.err, HasSubstr("exists"));
  // The coordinator served on (the backup is online) and left nothing in its state directory.
  ASSERT_TRUE(alice.Submit(Spec("after-the-backup", 1)).ok());
  for (const auto& entry : std::filesystem::directory_iterator(state)) {
    EXPECT_THAT(entry.path().filename().string(), ::testing::Not(HasSubstr("backup")));
  }
  c.process->Signal(SIGTERM);
  ASSERT_TRUE(c.process->Wait(absl::Seconds(20)).has_value());

  // A new coordinator on an empty state directory, from the backup: the backup's state, not the
  // job submitted after it; the old tokens work.
  const std::string restored_state = dir.path() + "/restored";
  CoordinatorProcess r = StartCoordinator(restored_state, backup);
  ASSERT_FALSE(r.address.empty());
  client::YardClient admin_r(r.address, admin_token), alice_r(r.address, alice_token);
  const State after = Read(admin_r);
  EXPECT_EQ(after.jobs, before.jobs);
  EXPECT_EQ(after.users, before.users);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.accounts, before.accounts);
  auto me = alice_r.WhoAmI();
  ASSERT_TRUE(me.ok()) << me.status();
  EXPECT_EQ(me->user(), "alice");
  // Ids go on after the restored ones.
  auto next = alice_r.Submit(Spec("next", 1));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->id(), "job-6");
  r.process->Signal(SIGTERM);
  ASSERT_TRUE(r.process->Wait(absl::Seconds(20)).has_value());

  // A restore never overwrites state, and takes only a backup.
  testing::CommandResult over =
      testing::RunCommand({BinPath("trainyard-coordinator"), "--listen", "127.0.0.1:0",
                           "--state-dir", restored_state, "--restore", backup});
  EXPECT_NE(over.exit_code, 0);
  EXPECT_THAT(over.err, HasSubstr("coordinator.db exists; restore into a state directory"));
  const std::string junk = dir.path() + "/junk";
  std::ofstream(junk) << std::string(8192, 'x');
  testing::CommandResult bad =
      testing::RunCommand({BinPath("trainyard-coordinator"), "--listen", "127.0.0.1:0",
                           "--state-dir", dir.path() + "/third", "--restore", junk});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr(junk + " is not a trainyard coordinator's database"));
  EXPECT_NE(::stat((dir.path() + "/third/coordinator.db").c_str(), &st), 0);

  // A database that looks like a backup (a schema version, a table named jobs) but holds another
  // schema: refused, and the state directory is left as it was, so a retry with the real backup
  // works.
  const std::string foreign = dir.path() + "/foreign.db";
  ASSERT_EQ(testing::RunCommand({"/usr/bin/sqlite3", foreign,
                                 "PRAGMA user_version = 1; CREATE TABLE jobs (x TEXT); "
                                 "INSERT INTO jobs VALUES ('not a job');"})
                .exit_code,
            0);
  const std::string fourth = dir.path() + "/fourth";
  testing::CommandResult wrong =
      testing::RunCommand({BinPath("trainyard-coordinator"), "--listen", "127.0.0.1:0",
                           "--state-dir", fourth, "--restore", foreign});
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_THAT(wrong.err, HasSubstr("restore_from: "));
  for (const char* left : {"/coordinator.db", "/coordinator.db.restoring",
                           "/coordinator.db.restoring-wal", "/coordinator.db.restoring-shm"}) {
    EXPECT_NE(::stat((fourth + left).c_str(), &st), 0) << left << " left behind";
  }
  CoordinatorProcess retry = StartCoordinator(fourth, backup);
  ASSERT_NE(retry.process, nullptr);
  EXPECT_FALSE(retry.address.empty()) << "the retry with the real backup did not start";
  retry.process->Signal(SIGTERM);
  ASSERT_TRUE(retry.process->Wait(absl::Seconds(20)).has_value());
  EXPECT_EQ(::stat((fourth + "/coordinator.db").c_str(), &st), 0);
}

}  // namespace
}  // namespace trainyard
