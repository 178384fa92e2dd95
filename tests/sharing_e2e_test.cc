// Accounts, quotas and fair share over the wire: a real CoordinatorServer (SQLite store, a
// FakeClock, no background threads) and a node session playing a worker of 4 devices. Covers the
// account and user admin RPCs and their durability, the limits checked at submission, usage that
// decays and survives a restart, why a waiting job waits (GetJob.why_waiting), GetQuota, the
// lender taking borrowed devices back by preemption, and the per-job preemption grace.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include <grpcpp/grpcpp.h>

#include "common/clock.h"
#include "server/coordinator/coordinator_server.h"
#include "tests/testing/coordinator_fixture.h"
#include "tests/testing/identity.h"
#include "tests/testing/node_session.h"
#include "tests/testing/tiny_spec.h"
#include "trainyard/v1/identity.grpc.pb.h"
#include "trainyard/v1/job.grpc.pb.h"

namespace trainyard::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class SharingE2eTest : public testing::CoordinatorFixture {
 protected:
  void Configure(CoordinatorOptions& o) override {
    o.node_timeout = absl::Hours(24);  // the fake clock moves in hours
    o.preemption = true;
    o.preemption_grace = absl::Seconds(120);
    o.max_preemption_grace = absl::Seconds(300);
    o.min_run_time = absl::Minutes(1);
    o.fair_share_half_life = absl::Hours(10);
    options_ = o;
  }

  void SetUp() override {
    CoordinatorFixture::SetUp();
    admin_ = tokens_->User("admin", v1::ADMIN);
    alice_ = tokens_->User("alice");
    bob_ = tokens_->User("bob");
    node_ = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 4);
  }

  void TearDown() override {
    node_.reset();
    CoordinatorFixture::TearDown();
  }

  grpc::Status CreateAccount(const std::string& name, std::optional<int64_t> quota,
                             std::optional<int64_t> borrow, double share,
                             const std::string& token = "") {
    grpc::ClientContext ctx;
    testing::Authorize(ctx, token.empty() ? admin_ : token);
    v1::CreateAccountRequest r;
    r.mutable_account()->set_name(name);
    if (quota) r.mutable_account()->set_quota_devices(*quota);
    if (borrow) r.mutable_account()->set_borrow_limit_devices(*borrow);
    r.mutable_account()->set_share(share);
    v1::Account resp;
    return identity_->CreateAccount(&ctx, r, &resp);
  }

  grpc::Status UpdateUser(const v1::UpdateUserRequest& r) {
    grpc::ClientContext ctx;
    testing::Authorize(ctx, admin_);
    v1::User resp;
    return identity_->UpdateUser(&ctx, r, &resp);
  }

  grpc::Status MoveUser(const std::string& user, const std::string& account) {
    v1::UpdateUserRequest r;
    r.set_name(user);
    r.set_account(account);
    return UpdateUser(r);
  }

  grpc::Status Submit(const std::string& token, int devices, std::string* id,
                      const std::function<void(v1::JobSpec&)>& edit = nullptr) {
    v1::JobSpec spec = testing::TinySpec("hang", devices);
    if (edit) edit(spec);
    grpc::ClientContext ctx;
    testing::Authorize(ctx, token);
    v1::SubmitJobRequest r;
    *r.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(&ctx, r, &resp);
    if (id != nullptr) *id = resp.job().id();
    return s;
  }

  std::string MustSubmit(const std::string& token, int devices,
                         const std::function<void(v1::JobSpec&)>& edit = nullptr) {
    std::string id;
    const grpc::Status s = Submit(token, devices, &id, edit);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return id;
  }

  v1::Job GetJob(const std::string& id, const std::string& token = "") {
    grpc::ClientContext ctx;
    testing::Authorize(ctx, token.empty() ? admin_ : token);
    v1::GetJobRequest r;
    r.set_job_id(id);
    v1::Job job;
    const grpc::Status s = jobs_->GetJob(&ctx, r, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }

  grpc::Status GetQuota(const std::string& token, const std::string& user, bool all,
                        v1::QuotaReport* report) {
    grpc::ClientContext ctx;
    testing::Authorize(ctx, token);
    v1::GetQuotaRequest r;
    r.set_user(user);
    r.set_all_accounts(all);
    return jobs_->GetQuota(&ctx, r, report);
  }

  // Restarts the coordinator on the same state directory (tokens stay valid).
  void Restart() {
    node_.reset();
    server_->Shutdown();
    server_.reset();
    options_.listen_address = "127.0.0.1:0";
    auto s = CoordinatorServer::Start(options_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel_);
    identity_ = v1::IdentityService::NewStub(channel_);
  }

  CoordinatorOptions options_;
  std::string admin_, alice_, bob_;
  std::unique_ptr<testing::NodeSession> node_;
};

TEST_F(SharingE2eTest, AccountsAndUserCapsAreCheckedAndDurable) {
  // Bad input names the field and stores nothing.
  EXPECT_EQ(CreateAccount("Bad Name", 4, {}, 1).error_code(), grpc::INVALID_ARGUMENT);
  grpc::Status s = CreateAccount("research", -1, {}, 1);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("account.quota_devices"));
  s = CreateAccount("research", {}, 2, 1);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("account.borrow_limit_devices"));
  s = CreateAccount("research", 2, {}, -3);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("account.share"));
  EXPECT_EQ(CreateAccount("research", 2, 1, 3, alice_).error_code(), grpc::PERMISSION_DENIED);
  EXPECT_EQ(server_->identities().ListAccounts().size(), 1u) << "only the implicit default";

  ASSERT_TRUE(CreateAccount("research", 2, 1, 3).ok());
  EXPECT_EQ(CreateAccount("research", 2, 1, 3).error_code(), grpc::ALREADY_EXISTS);
  s = MoveUser("alice", "nowhere");
  EXPECT_EQ(s.error_code(), grpc::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("account"));
  ASSERT_TRUE(MoveUser("alice", "research").ok());
  v1::UpdateUserRequest caps;
  caps.set_name("alice");
  caps.set_max_queued_jobs(2);
  caps.set_max_running_devices(2);
  ASSERT_TRUE(UpdateUser(caps).ok());

  Restart();
  auto research = server_->identities().GetAccount("research");
  ASSERT_TRUE(research.ok());
  EXPECT_EQ(research->quota_devices(), 2);
  EXPECT_EQ(research->borrow_limit_devices(), 1);
  EXPECT_EQ(research->share(), 3);
  auto alice = server_->identities().GetUser("alice");
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ(alice->account(), "research");
  EXPECT_EQ(alice->max_queued_jobs(), 2);
  EXPECT_EQ(alice->max_running_devices(), 2);

  // Limits at submission: more devices than the cap ever allows, preemptible: false beyond
  // the quota, and the queued-jobs cap.
  std::string id;
  s = Submit(alice_, 3, &id);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("resources.slots: 3 devices exceed user alice's cap"));
  s = Submit(bob_, 1, &id, [](v1::JobSpec& spec) { spec.set_preemptible(false); });
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("preemptible: false needs a quota"));
  ASSERT_TRUE(MoveUser("bob", "research").ok());
  s = Submit(bob_, 3, &id, [](v1::JobSpec& spec) { spec.set_preemptible(false); });
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("preemptible: false is only for jobs within"));
  MustSubmit(alice_, 1);
  MustSubmit(alice_, 1);
  s = Submit(alice_, 1, &id);
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_queued_jobs: user alice has 2 jobs queued"));
  EXPECT_EQ(server_->jobs().List({}).value().jobs.size(), 2u) << "refused submissions stored";

  // An account with users cannot go; an empty one can, for good.
  grpc::ClientContext ctx;
  testing::Authorize(ctx, admin_);
  v1::DeleteAccountRequest del;
  del.set_name("research");
  v1::Account gone;
  s = identity_->DeleteAccount(&ctx, del, &gone);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("of account research has not ended"));
  const auto listed = server_->jobs().List({});
  ASSERT_TRUE(listed.ok());
  for (const v1::Job& job : listed->jobs) {
    ASSERT_TRUE(server_->jobs().UnfinishedJobOf("research") != "");
    grpc::ClientContext cancel_ctx;
    testing::Authorize(cancel_ctx, admin_);
    v1::CancelJobRequest cancel;
    cancel.set_job_id(job.id());
    v1::Job cancelled;
    ASSERT_TRUE(jobs_->CancelJob(&cancel_ctx, cancel, &cancelled).ok());
  }
  grpc::ClientContext ctx1;
  testing::Authorize(ctx1, admin_);
  s = identity_->DeleteAccount(&ctx1, del, &gone);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("user alice belongs to account research"));
  ASSERT_TRUE(CreateAccount("empty", {}, {}, 1).ok());
  grpc::ClientContext ctx2;
  testing::Authorize(ctx2, admin_);
  del.set_name("empty");
  ASSERT_TRUE(identity_->DeleteAccount(&ctx2, del, &gone).ok());
  Restart();
  EXPECT_EQ(server_->identities().GetAccount("empty").status().code(), absl::StatusCode::kNotFound);
}

// Share percentages are of the accounts that want devices: with shares 1:3 and a job each, 25%
// and 75%, not 20% and 60% (the built-in `default` account, share 1, has no jobs); an idle
// account reads as the part it would have with demand.
TEST_F(SharingE2eTest, SharePercentagesCountOnlyAccountsWithDemand) {
  ASSERT_TRUE(CreateAccount("small", {}, {}, 1).ok());
  ASSERT_TRUE(CreateAccount("large", {}, {}, 3).ok());
  ASSERT_TRUE(MoveUser("alice", "small").ok());
  ASSERT_TRUE(MoveUser("bob", "large").ok());
  MustSubmit(alice_, 1);
  MustSubmit(bob_, 1);
  v1::QuotaReport report;
  ASSERT_TRUE(GetQuota(admin_, "alice", true, &report).ok());
  std::map<std::string, double> share;
  for (const auto& a : report.accounts()) share[a.name()] = a.share_fraction();
  EXPECT_DOUBLE_EQ(share.at("small"), 0.25);
  EXPECT_DOUBLE_EQ(share.at("large"), 0.75);
  EXPECT_DOUBLE_EQ(share.at("default"), 0.2);  // 1 / (1 + 3 + its own 1)
}

TEST_F(SharingE2eTest, UsageIsChargedDecaysAndSurvivesARestart) {
  ASSERT_TRUE(CreateAccount("research", 4, {}, 1).ok());
  ASSERT_TRUE(MoveUser("alice", "research").ok());
  const std::string job = MustSubmit(alice_, 2);
  server_->jobs().ChargeUsage();  // starts the clock
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  clock_.Advance(absl::Minutes(5));
  server_->jobs().ChargeUsage();  // 2 devices x 5 min
  v1::QuotaReport report;
  ASSERT_TRUE(GetQuota(alice_, "", false, &report).ok());
  EXPECT_EQ(report.account(), "research");
  EXPECT_EQ(report.running_devices(), 2);
  EXPECT_NEAR(report.usage_device_hours(), 2.0 * 5 / 60, 1e-3);
  ASSERT_EQ(report.accounts_size(), 1);
  EXPECT_EQ(report.accounts(0).name(), "research");
  EXPECT_EQ(report.accounts(0).quota_devices(), 4);
  EXPECT_EQ(report.accounts(0).running_devices(), 2);
  EXPECT_NEAR(report.accounts(0).usage_device_hours(), 2.0 * 5 / 60, 1e-3);
  EXPECT_DOUBLE_EQ(report.accounts(0).usage_fraction(), 1.0);
  // Of the accounts with demand: research alone (default, share 1, has no jobs and no usage).
  EXPECT_DOUBLE_EQ(report.accounts(0).share_fraction(), 1.0);
  EXPECT_DOUBLE_EQ(report.half_life_hours(), 10);

  // Others' quota is for admins; every account with --all.
  EXPECT_EQ(GetQuota(bob_, "alice", false, &report).error_code(), grpc::PERMISSION_DENIED);
  EXPECT_EQ(GetQuota(bob_, "", true, &report).error_code(), grpc::PERMISSION_DENIED);
  EXPECT_EQ(GetQuota(admin_, "nobody", false, &report).error_code(), grpc::NOT_FOUND);
  ASSERT_TRUE(GetQuota(admin_, "alice", true, &report).ok());
  EXPECT_EQ(report.accounts_size(), 2);

  Restart();
  clock_.Advance(absl::Hours(10));  // one half-life while the coordinator is away
  ASSERT_TRUE(GetQuota(alice_, "", false, &report).ok());
  EXPECT_NEAR(report.accounts(0).usage_device_hours(), 2.0 * 5 / 60 / 2, 1e-3);
  EXPECT_NEAR(report.usage_device_hours(), 2.0 * 5 / 60 / 2, 1e-3);
}

TEST_F(SharingE2eTest, AWaitingJobSaysWhyItWaits) {
  ASSERT_TRUE(CreateAccount("research", 2, 1, 1).ok());
  ASSERT_TRUE(MoveUser("alice", "research").ok());
  v1::UpdateUserRequest caps;
  caps.set_name("bob");
  caps.set_max_running_devices(1);
  ASSERT_TRUE(UpdateUser(caps).ok());
  const std::string a1 = MustSubmit(alice_, 2);
  const std::string a2 = MustSubmit(alice_, 2);  // quota 2 + borrow 1 < 4
  const std::string b1 = MustSubmit(bob_, 1);
  const std::string b2 = MustSubmit(bob_, 1);  // bob's cap is 1 running device
  EXPECT_EQ(GetJob(a2).why_waiting(), "waiting for the next scheduling pass");
  ASSERT_EQ(server_->jobs().SchedulePass(), 2);
  EXPECT_EQ(GetJob(a1).state(), v1::RUNNING);
  EXPECT_TRUE(GetJob(a1).why_waiting().empty());
  EXPECT_THAT(GetJob(a2).why_waiting(),
              HasSubstr("account research holds 2 devices: its quota of 2 plus its borrow limit "
                        "of 1 leave no room for 2 more"));
  EXPECT_THAT(GetJob(a2, alice_).why_waiting(), HasSubstr("Account research: share 50%"));
  EXPECT_THAT(GetJob(b2).why_waiting(),
              HasSubstr("user bob holds 1 devices of its cap of 1 (max_running_devices)"));
  // A job too big for the free device waits first in line; one behind it says so.
  const std::string big = MustSubmit(admin_, 3);
  const std::string small = MustSubmit(admin_, 1, [](v1::JobSpec& s) { s.set_priority(40); });
  ASSERT_EQ(server_->jobs().SchedulePass(), 0);
  EXPECT_THAT(GetJob(big).why_waiting(), HasSubstr("first in line, waiting for 3 free devices"));
  EXPECT_THAT(GetJob(small).why_waiting(), HasSubstr("behind"));
  EXPECT_THAT(GetJob(small).why_waiting(), HasSubstr("first " + big));
  // A user is not told the id of another user's job ahead.
  const std::string carol = tokens_->User("carol");
  const std::string carols = MustSubmit(carol, 1, [](v1::JobSpec& s) { s.set_priority(40); });
  ASSERT_EQ(server_->jobs().SchedulePass(), 0);
  const std::string seen_by_carol = GetJob(carols, carol).why_waiting();
  EXPECT_THAT(seen_by_carol, HasSubstr("first another user's job (priority 50, 3 devices"));
  EXPECT_THAT(seen_by_carol, Not(HasSubstr(big)));
}

// A cancelled job's ranks keep their devices while they stop (saving, say): those devices are
// still its owner's. They count against the account's quota (a cancel is no way past it), show
// in GetQuota and are charged as usage, until the ranks report their exit.
TEST_F(SharingE2eTest, AStoppingJobsDevicesCountAgainstItsQuotaAndUsageUntilItsRanksExit) {
  ASSERT_TRUE(CreateAccount("research", 2, 0, 1).ok());
  ASSERT_TRUE(MoveUser("alice", "research").ok());
  const std::string first = MustSubmit(alice_, 2);
  server_->jobs().ChargeUsage();  // starts the clock
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node_->NextCommand().assignment();
  ASSERT_EQ(a.job_id(), first);
  {
    grpc::ClientContext ctx;
    testing::Authorize(ctx, alice_);
    v1::CancelJobRequest r;
    r.set_job_id(first);
    v1::Job cancelled;
    ASSERT_TRUE(jobs_->CancelJob(&ctx, r, &cancelled).ok());
  }
  ASSERT_TRUE(node_->NextCommand().has_cancel());  // its ranks are told to stop, and do not yet
  const std::string second = MustSubmit(alice_, 2);
  EXPECT_EQ(server_->jobs().SchedulePass(), 0) << "two devices are free, but research's are held";
  EXPECT_THAT(GetJob(second).why_waiting(),
              HasSubstr("account research holds 2 devices: its quota of 2 plus its borrow limit "
                        "of 0 leave no room for 2 more"));
  v1::QuotaReport report;
  ASSERT_TRUE(GetQuota(alice_, "", false, &report).ok());
  EXPECT_EQ(report.running_devices(), 2);
  EXPECT_EQ(report.accounts(0).running_devices(), 2);
  clock_.Advance(absl::Seconds(30));  // within the minute a node without a stop grace gets
  server_->jobs().ChargeUsage();
  ASSERT_TRUE(GetQuota(alice_, "", false, &report).ok());
  EXPECT_NEAR(report.usage_device_hours(), 2.0 * 30 / 3600, 1e-4);

  node_->ReportExit(a, 0, 0);
  node_->ReportExit(a, 1, 0);
  node_->Heartbeat();  // processed
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(node_->NextCommand().assignment().job_id(), second);
  clock_.Advance(absl::Seconds(30));
  server_->jobs().ChargeUsage();
  ASSERT_TRUE(GetQuota(alice_, "", false, &report).ok());
  EXPECT_EQ(report.running_devices(), 2) << "the second job's, no more";
  EXPECT_NEAR(report.usage_device_hours(), 2.0 * 60 / 3600, 1e-4);
}

// A victim killed after its grace is requeued at its first rank's exit; its other rank may still
// stop, holding its device. The head waits for that device: no second victim is asked to stop
// for room that is coming free.
TEST_F(SharingE2eTest, AKilledVictimsStoppingRankIsWaitedForNotMadeRoomForWithAnotherVictim) {
  const std::string low = MustSubmit(alice_, 2, [](v1::JobSpec& s) { s.set_priority(10); });
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  ASSERT_EQ(node_->NextCommand().assignment().job_id(), low);
  clock_.Advance(absl::Seconds(1));
  const std::string victim = MustSubmit(alice_, 2, [](v1::JobSpec& s) { s.set_priority(20); });
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::Assignment a = node_->NextCommand().assignment();
  ASSERT_EQ(a.job_id(), victim);
  clock_.Advance(absl::Minutes(2));  // both past their minimum run time
  const std::string high = MustSubmit(bob_, 2, [](v1::JobSpec& s) { s.set_priority(90); });
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  ASSERT_EQ(GetJob(victim).preempted_by(), high) << "the one with less work to lose";
  ASSERT_EQ(GetJob(low).preempt_deadline_ms(), 0);

  clock_.Advance(absl::Seconds(121));  // past its 120 s grace without stopping
  server_->jobs().EnforceRuntimeLimits();
  ASSERT_TRUE(node_->NextCommand().has_cancel());
  node_->ReportExit(a, 0, 128 + 15);  // rank 0 stops; rank 1 is still saving
  ASSERT_TRUE(node_->NextCommand().has_cancel());
  node_->Heartbeat();  // processed
  ASSERT_EQ(GetJob(victim).state(), v1::PREEMPTED);
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  EXPECT_EQ(GetJob(low).preempt_deadline_ms(), 0) << "the victim's last rank makes the room";

  node_->ReportExit(a, 1, 128 + 15);
  node_->Heartbeat();
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(node_->NextCommand().assignment().job_id(), high);
  EXPECT_EQ(GetJob(low).state(), v1::RUNNING);
}

// Tensor-parallel groups stay on one node each: a job whose groups fit no node says so, though
// the cluster has its devices in all, and it does not hold back a job behind it.
TEST_F(SharingE2eTest, AJobWhoseTensorParallelGroupsFitNoNodeSaysSo) {
  auto n2 = testing::NodeSession::Connect(channel_, tokens_->Node("n2"), "n2", 4);
  const std::string tp = MustSubmit(admin_, 8, [](v1::JobSpec& s) {
    s.mutable_model()->set_n_head(8);
    s.mutable_model()->set_d_model(64);
    s.mutable_parallel()->set_tensor_parallel(8);
  });
  const std::string plain = MustSubmit(admin_, 8, [](v1::JobSpec& s) { s.set_priority(40); });
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  EXPECT_EQ(GetJob(plain).state(), v1::RUNNING);
  EXPECT_THAT(GetJob(tp).why_waiting(),
              HasSubstr("needs 8 devices in groups of 8 on one node each "
                        "(parallel.tensor_parallel), more than the ready nodes that take its "
                        "owner's jobs hold in whole groups"));
}

// An account that arrives late goes first until its usage per share reaches the early one's:
// a waiting job of the early account says so, and when that ends at the current use.
TEST_F(SharingE2eTest, AJobHeldBackByALateAccountsDeficitSaysSoAndUntilWhen) {
  ASSERT_TRUE(CreateAccount("early", {}, {}, 1).ok());
  ASSERT_TRUE(CreateAccount("late", {}, {}, 1).ok());
  ASSERT_TRUE(MoveUser("alice", "early").ok());
  ASSERT_TRUE(MoveUser("bob", "late").ok());
  // early runs all 4 devices alone for 10 hours (one half-life here).
  const std::string a1 = MustSubmit(alice_, 4);
  server_->jobs().ChargeUsage();
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const v1::CoordinatorMessage assigned = node_->NextCommand();
  ASSERT_TRUE(assigned.has_assignment());
  for (int i = 0; i < 120; ++i) {
    clock_.Advance(absl::Minutes(5));
    server_->jobs().ChargeUsage();
  }
  for (int r = 0; r < 4; ++r) node_->ReportExit(assigned.assignment(), r, 0);
  node_->Heartbeat();  // the exits are handled
  ASSERT_EQ(GetJob(a1).state(), v1::SUCCEEDED);
  // late arrives: it runs, and its next job goes before early's.
  MustSubmit(bob_, 4);
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const std::string b2 = MustSubmit(bob_, 4);
  const std::string a2 = MustSubmit(alice_, 4);
  for (int i = 0; i < 12; ++i) {  // an hour of it
    clock_.Advance(absl::Minutes(5));
    server_->jobs().ChargeUsage();
  }
  ASSERT_EQ(server_->jobs().SchedulePass(), 0);
  const std::string why = GetJob(a2).why_waiting();
  EXPECT_THAT(why, HasSubstr("first " + b2));
  EXPECT_THAT(why, HasSubstr("account late goes first by fair share: its usage per share is 3.9 "
                             "device-hours, early's 27.0"));
  // ln((R - d0) / R) / k with k = ln 2 / 10 h, R = 4 / k = 57.7, d0 = 3.9 - 27.0: 4.86 hours.
  EXPECT_THAT(why, HasSubstr("until about 4.9 hours from now at the current use (4 devices "
                             "against 0; usage halves every 10h)"));
  // alice is not told which account.
  const std::string seen_by_alice = GetJob(a2, alice_).why_waiting();
  EXPECT_THAT(seen_by_alice, HasSubstr("another account goes first by fair share"));
  EXPECT_THAT(seen_by_alice, Not(HasSubstr("account late")));
}

TEST_F(SharingE2eTest, TheLenderTakesItsDevicesBackWithTheVictimsOwnGrace) {
  // research (quota 2) lends its devices to vision (quota 2) while idle.
  ASSERT_TRUE(CreateAccount("research", 2, {}, 1).ok());
  ASSERT_TRUE(CreateAccount("vision", 2, {}, 1).ok());
  ASSERT_TRUE(MoveUser("alice", "research").ok());
  ASSERT_TRUE(MoveUser("bob", "vision").ok());
  const std::string own = MustSubmit(bob_, 2, [](v1::JobSpec& s) { s.set_priority(90); });
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  clock_.Advance(absl::Seconds(1));
  const std::string borrowed = MustSubmit(bob_, 2, [](v1::JobSpec& s) {
    s.set_priority(90);
    s.set_preemption_grace_seconds(1000);  // capped at the cluster's 300 s
  });
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  const std::string lender = MustSubmit(alice_, 2, [](v1::JobSpec& s) { s.set_priority(10); });
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  EXPECT_EQ(GetJob(borrowed).preempt_deadline_ms(), 0) << "within its minimum run time";
  clock_.Advance(absl::Minutes(2));
  EXPECT_EQ(server_->jobs().SchedulePass(), 0);
  const v1::Job victim = GetJob(borrowed);
  EXPECT_EQ(victim.preempted_by(), lender) << "a lower-priority job within its quota reclaims";
  EXPECT_EQ(absl::FromUnixMillis(victim.preempt_deadline_ms()), clock_.Now() + absl::Seconds(300));
  EXPECT_THAT(victim.message(), HasSubstr("account research"));
  EXPECT_EQ(GetJob(own).preempt_deadline_ms(), 0) << "vision's job within its quota is kept";
}

}  // namespace
}  // namespace trainyard::coordinator
