// Who may call what, over the wire: every RPC of every coordinator service, called with every kind
// of credential (none, malformed, expired, revoked, a disabled user's, another user's, the
// owner's, an admin's, a node token, the job credential of another job or attempt, the attempt's
// own). Each gets the expected code; a refused call changes nothing (jobs, users, tokens, nodes and
// the rendezvous keys are compared before and after).
//
// In process: a real CoordinatorServer on a loopback port with a SQLite store, a FakeClock and no
// background threads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/context_archive.h"
#include "server/coordinator/coordinator_server.h"
#include "tests/testing/coordinator_fixture.h"
#include "tests/testing/node_session.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"
#include "trainyard/v1/admin.grpc.pb.h"
#include "trainyard/v1/identity.grpc.pb.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/node.grpc.pb.h"
#include "trainyard/v1/rendezvous.grpc.pb.h"
#include "trainyard/v1/trainer.grpc.pb.h"

namespace trainyard::coordinator {
namespace {

using grpc::StatusCode;

// The credentials every RPC is tried with.
const std::vector<std::string> kCredentials = {
    "none",  "malformed", "expired", "revoked",   "disabled",      "other_user",
    "owner", "admin",     "node",    "other_job", "other_attempt", "own_job"};

// Who an RPC admits; every other valid credential gets PERMISSION_DENIED, and "none",
// "malformed", "expired", "revoked" and "disabled" get UNAUTHENTICATED whatever the RPC.
enum class Admits {
  kUsers,       // any user: owner, other_user, admin
  kOwnerAdmin,  // the job's owner and admins
  kAdmins,      // admins only
  kNode,        // the node's own node token
  kOwnJob,      // the attempt's own job credential
  kAnyone,      // any valid credential (WhoAmI)
};

bool Admitted(Admits admits, const std::string& credential) {
  switch (admits) {
    case Admits::kUsers:
      return credential == "owner" || credential == "other_user" || credential == "admin";
    case Admits::kOwnerAdmin:
      return credential == "owner" || credential == "admin";
    case Admits::kAdmins:
      return credential == "admin";
    case Admits::kNode:
      return credential == "node";
    case Admits::kOwnJob:
      return credential == "own_job";
    case Admits::kAnyone:
      return credential == "owner" || credential == "other_user" || credential == "admin" ||
             credential == "node" || credential == "other_job" || credential == "other_attempt" ||
             credential == "own_job";
  }
  return false;
}

StatusCode Expected(Admits admits, const std::string& credential) {
  if (credential == "none" || credential == "malformed" || credential == "expired" ||
      credential == "revoked" || credential == "disabled") {
    return StatusCode::UNAUTHENTICATED;
  }
  // Another user's job (or token) answers exactly as a missing one.
  if (admits == Admits::kOwnerAdmin && credential == "other_user") return StatusCode::NOT_FOUND;
  return Admitted(admits, credential) ? StatusCode::OK : StatusCode::PERMISSION_DENIED;
}

class AuthorizationTest : public testing::CoordinatorFixture {
 protected:
  // Every RPC is tried with bad credentials from one address, far more often than the throttle
  // of failed authentications allows (hardening_test tests the throttle).
  void Configure(coordinator::CoordinatorOptions& options) override {
    options.limits.auth_per_peer.burst = 0;
    options.limits.auth_per_token.burst = 0;
  }

  void SetUp() override {
    CoordinatorFixture::SetUp();
    IdentityRegistry& ids = server_->identities();

    node_ = testing::NodeSession::Connect(channel_, tokens_->Node("n1"), "n1", 2);
    // alice's job and bob's, both running attempt 1 on n1.
    job_ = Submit(tokens_->User("alice"));
    other_job_ = Submit(tokens_->User("bob"));
    ASSERT_EQ(server_->jobs().SchedulePass(), 2);

    credentials_["none"] = "";
    credentials_["malformed"] = "tyt.not-a-token";
    auto expiring = ids.CreateToken("alice", "", 60, "expires");
    ASSERT_TRUE(expiring.ok());
    credentials_["expired"] = expiring->text;
    auto revoked = ids.CreateToken("alice", "", 0, "revoked");
    ASSERT_TRUE(revoked.ok());
    ASSERT_TRUE(ids.RevokeToken(revoked->info.id()).ok());
    credentials_["revoked"] = revoked->text;
    credentials_["disabled"] = tokens_->User("dave");
    ASSERT_TRUE(ids.SetDisabled("dave", true).ok());
    credentials_["other_user"] = tokens_->User("bob");
    credentials_["owner"] = tokens_->User("alice");
    credentials_["admin"] = tokens_->User("admin");
    credentials_["node"] = tokens_->Node("n1");
    credentials_["other_job"] = tokens_->Job(other_job_, 1);
    credentials_["other_attempt"] = tokens_->Job(job_, 2);
    credentials_["own_job"] = tokens_->Job(job_, 1);
    // A token for alice to revoke, and a user for admins to disable.
    auto spare = ids.CreateToken("alice", "", 0, "to revoke");
    ASSERT_TRUE(spare.ok());
    spare_token_id_ = spare->info.id();
    ASSERT_TRUE(ids.CreateUser("erin", v1::USER).ok());
    // Accounts for admins to change and delete.
    v1::Account account;
    account.set_name("research");
    ASSERT_TRUE(ids.CreateAccount(account).ok());
    account.set_name("retired");
    ASSERT_TRUE(ids.CreateAccount(account).ok());
    clock_.Advance(absl::Minutes(2));  // the expiring token has expired
  }

  void TearDown() override {
    node_.reset();
    CoordinatorFixture::TearDown();
  }

  std::string Submit(const std::string& token) {
    grpc::ClientContext ctx;
    Prepare(ctx, token);
    v1::SubmitJobRequest r;
    *r.mutable_spec() = testing::TinySpec("succeed", 1);
    v1::SubmitJobResponse resp;
    const grpc::Status s = jobs_->SubmitJob(&ctx, r, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.job().id();
  }

  static void Prepare(grpc::ClientContext& ctx, const std::string& token) {
    testing::Authorize(ctx, token);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  }

  template <typename Reader, typename Message>
  static grpc::Status FinishStream(grpc::ClientContext& ctx, Reader& reader, Message& m) {
    // A stream the caller may read yields a first message; one it may not ends with the refusal.
    if (reader->Read(&m)) {
      ctx.TryCancel();
      reader->Finish().IgnoreError();
      return grpc::Status::OK;
    }
    return reader->Finish();
  }

  // Everything a call could change, as bytes.
  std::string Fingerprint() {
    std::string out;
    v1::ListJobsRequest all;
    all.set_page_size(1000);
    auto jobs = server_->jobs().List(all);
    EXPECT_TRUE(jobs.ok());
    for (const auto& j : jobs->jobs) out += j.SerializeAsString();
    for (const auto& u : server_->identities().ListUsers()) out += u.SerializeAsString();
    for (const auto& t : server_->identities().ListTokens("")) out += t.SerializeAsString();
    for (const auto& a : server_->identities().ListAccounts()) out += a.SerializeAsString();
    for (const auto& d : server_->identities().ListDeniedNodes()) out += d.SerializeAsString();
    for (const auto& n : server_->nodes().List()) out += n.SerializeAsString();
    grpc::ClientContext ctx;
    Prepare(ctx, credentials_["own_job"]);
    v1::NumKeysRequest r;
    r.mutable_scope()->set_job_id(job_);
    r.mutable_scope()->set_attempt(1);
    v1::NumKeysResponse keys;
    EXPECT_TRUE(rdzv_->NumKeys(&ctx, r, &keys).ok());
    return absl::StrCat(out, "keys=", keys.num_keys());
  }

  struct Rpc {
    std::string name;
    Admits admits;
    std::function<grpc::Status(const std::string& token)> call;
    bool mutates = false;  // allowed calls change state: they run after every refusal
  };

  std::vector<Rpc> Rpcs() {
    const std::string job = job_;
    auto scope = [job](auto* request) {
      request->mutable_scope()->set_job_id(job);
      request->mutable_scope()->set_attempt(1);
    };
    std::vector<Rpc> rpcs;
    auto unary = [&](std::string name, Admits admits, bool mutates,
                     std::function<grpc::Status(grpc::ClientContext&)> f) {
      rpcs.push_back({std::move(name), admits,
                      [f](const std::string& token) {
                        grpc::ClientContext ctx;
                        Prepare(ctx, token);
                        return f(ctx);
                      },
                      mutates});
    };
    // JobService.
    unary("SubmitJob", Admits::kUsers, true, [&](grpc::ClientContext& ctx) {
      v1::SubmitJobRequest r;
      *r.mutable_spec() = testing::TinySpec("succeed", 1);
      v1::SubmitJobResponse resp;
      return jobs_->SubmitJob(&ctx, r, &resp);
    });
    unary("GetJob", Admits::kOwnerAdmin, false, [&, job](grpc::ClientContext& ctx) {
      v1::GetJobRequest r;
      r.set_job_id(job);
      v1::Job resp;
      return jobs_->GetJob(&ctx, r, &resp);
    });
    unary("ListJobs", Admits::kUsers, false, [&](grpc::ClientContext& ctx) {
      v1::ListJobsResponse resp;
      return jobs_->ListJobs(&ctx, {}, &resp);
    });
    unary("CheckpointJob", Admits::kOwnerAdmin, true, [&, job](grpc::ClientContext& ctx) {
      v1::CheckpointJobRequest r;
      r.set_job_id(job);
      v1::Job resp;
      return jobs_->CheckpointJob(&ctx, r, &resp);
    });
    rpcs.push_back({"WatchJob", Admits::kOwnerAdmin, [&, job](const std::string& token) {
                      grpc::ClientContext ctx;
                      Prepare(ctx, token);
                      v1::WatchJobRequest r;
                      r.set_job_id(job);
                      auto reader = jobs_->WatchJob(&ctx, r);
                      v1::JobEvent e;
                      return FinishStream(ctx, reader, e);
                    }});
    rpcs.push_back({"StreamLogs", Admits::kOwnerAdmin, [&, job](const std::string& token) {
                      grpc::ClientContext ctx;
                      Prepare(ctx, token);
                      v1::StreamLogsRequest r;
                      r.set_job_id(job);
                      auto reader = jobs_->StreamLogs(&ctx, r);
                      v1::LogLine l;
                      return FinishStream(ctx, reader, l);
                    }});
    rpcs.push_back({"StreamMetrics", Admits::kOwnerAdmin, [&, job](const std::string& token) {
                      grpc::ClientContext ctx;
                      Prepare(ctx, token);
                      v1::StreamMetricsRequest r;
                      r.set_job_id(job);
                      auto reader = jobs_->StreamMetrics(&ctx, r);
                      v1::StepReport m;
                      return FinishStream(ctx, reader, m);
                    }});
    rpcs.push_back({"FetchExport", Admits::kOwnerAdmin, [&, job](const std::string& token) {
                      grpc::ClientContext ctx;
                      Prepare(ctx, token);
                      v1::FetchExportRequest r;
                      r.set_job_id(job);
                      auto reader = jobs_->FetchExport(&ctx, r);
                      v1::ExportChunk c;
                      const grpc::Status s = FinishStream(ctx, reader, c);
                      // Past authorization: alice's job has no checkpoint.export.
                      return s.error_message().find("has no export") != std::string::npos
                                 ? grpc::Status::OK
                                 : s;
                    }});
    rpcs.push_back({"UploadContext", Admits::kUsers,
                    [&](const std::string& token) {
                      grpc::ClientContext ctx;
                      Prepare(ctx, token);
                      v1::UploadContextResponse resp;
                      auto writer = jobs_->UploadContext(&ctx, &resp);
                      v1::ContextChunk c;
                      c.set_data("archive bytes");
                      c.set_digest(ContextDigest(c.data()));
                      c.set_size_bytes(static_cast<int64_t>(c.data().size()));
                      writer->Write(c);
                      writer->WritesDone();
                      return writer->Finish();
                    },
                    true});
    // AdminService.
    rpcs.push_back({"Backup", Admits::kAdmins, [&](const std::string& token) {
                      grpc::ClientContext ctx;
                      Prepare(ctx, token);
                      auto admin = v1::AdminService::NewStub(channel_);
                      auto reader = admin->Backup(&ctx, v1::BackupRequest());
                      v1::BackupChunk c;
                      return FinishStream(ctx, reader, c);
                    }});
    // NodeService.
    unary("ListNodes", Admits::kUsers, false, [&](grpc::ClientContext& ctx) {
      v1::ListNodesResponse resp;
      return nodes_->ListNodes(&ctx, {}, &resp);
    });
    // (Uncordoning n1, which is not cordoned: past authorization, nothing to change.)
    unary("CordonNode", Admits::kAdmins, false, [&](grpc::ClientContext& ctx) {
      v1::CordonNodeRequest r;
      r.set_node_id("n1");
      r.set_action(v1::UNCORDON);
      v1::CordonNodeResponse resp;
      return nodes_->CordonNode(&ctx, r, &resp);
    });
    unary("RegisterNode", Admits::kNode, true, [&](grpc::ClientContext& ctx) {
      v1::RegisterNodeRequest r;
      r.set_node_id("n1");
      r.set_hostname("localhost");
      auto* d = r.add_devices();
      d->set_kind(v1::CPU_SLOT);
      v1::RegisterNodeResponse resp;
      const grpc::Status s = nodes_->RegisterNode(&ctx, r, &resp);
      // n1's session is open: its own token gets past authorization to ALREADY_EXISTS.
      return s.error_code() == StatusCode::ALREADY_EXISTS ? grpc::Status::OK : s;
    });
    rpcs.push_back({"Session", Admits::kNode, [&](const std::string& token) {
                      grpc::ClientContext ctx;
                      Prepare(ctx, token);
                      auto stream = nodes_->Session(&ctx);
                      v1::NodeMessage hello;
                      hello.mutable_hello()->set_node_id("n1");
                      stream->Write(hello);
                      stream->WritesDone();
                      v1::CoordinatorMessage m;
                      while (stream->Read(&m)) {
                      }
                      const grpc::Status s = stream->Finish();
                      return s.error_code() == StatusCode::ALREADY_EXISTS ? grpc::Status::OK : s;
                    }});
    unary("VerifyJobCredential", Admits::kNode, false, [&, job](grpc::ClientContext& ctx) {
      v1::VerifyJobCredentialRequest r;
      r.set_credential(DeriveServerCredential(tokens_->Job(job, 1), "127.0.0.1:9"));
      v1::VerifyJobCredentialResponse resp;
      const grpc::Status s = nodes_->VerifyJobCredential(&ctx, r, &resp);
      // n1 is a worker: its node token gets past authentication to "no range of the job".
      return s.error_message().find("not made for a parameter server of") != std::string::npos
                 ? grpc::Status::OK
                 : s;
    });
    rpcs.push_back({"FetchContext", Admits::kNode, [&, job](const std::string& token) {
                      grpc::ClientContext ctx;
                      Prepare(ctx, token);
                      v1::FetchContextRequest r;
                      r.set_node_id("n1");
                      r.set_job_id(job);
                      auto reader = nodes_->FetchContext(&ctx, r);
                      v1::ContextChunk c;
                      const grpc::Status s = FinishStream(ctx, reader, c);
                      // Past authorization: alice's job, on n1, has no context.
                      return s.error_message().find("has no context") != std::string::npos
                                 ? grpc::Status::OK
                                 : s;
                    }});
    // RendezvousService: the scope of alice's job, attempt 1.
    unary("Set", Admits::kOwnJob, true, [&, scope](grpc::ClientContext& ctx) {
      v1::SetRequest r;
      scope(&r);
      r.set_key("k");
      r.set_value("v");
      v1::SetResponse resp;
      return rdzv_->Set(&ctx, r, &resp);
    });
    unary("Get", Admits::kOwnJob, false, [&, scope](grpc::ClientContext& ctx) {
      v1::GetRequest r;
      scope(&r);
      r.set_key("absent");
      r.set_timeout_ms(1);
      v1::GetResponse resp;
      const grpc::Status s = rdzv_->Get(&ctx, r, &resp);
      return s.error_code() == StatusCode::DEADLINE_EXCEEDED ? grpc::Status::OK : s;
    });
    unary("Add", Admits::kOwnJob, true, [&, scope](grpc::ClientContext& ctx) {
      v1::AddRequest r;
      scope(&r);
      r.set_key("n");
      r.set_delta(1);
      v1::AddResponse resp;
      return rdzv_->Add(&ctx, r, &resp);
    });
    unary("CompareSet", Admits::kOwnJob, true, [&, scope](grpc::ClientContext& ctx) {
      v1::CompareSetRequest r;
      scope(&r);
      r.set_key("c");
      r.set_desired("x");
      v1::CompareSetResponse resp;
      return rdzv_->CompareSet(&ctx, r, &resp);
    });
    unary("Check", Admits::kOwnJob, false, [&, scope](grpc::ClientContext& ctx) {
      v1::CheckRequest r;
      scope(&r);
      r.add_keys("k");
      v1::CheckResponse resp;
      return rdzv_->Check(&ctx, r, &resp);
    });
    unary("DeleteKey", Admits::kOwnJob, true, [&, scope](grpc::ClientContext& ctx) {
      v1::DeleteKeyRequest r;
      scope(&r);
      r.set_key("absent");
      v1::DeleteKeyResponse resp;
      return rdzv_->DeleteKey(&ctx, r, &resp);
    });
    unary("NumKeys", Admits::kOwnJob, false, [&, scope](grpc::ClientContext& ctx) {
      v1::NumKeysRequest r;
      scope(&r);
      v1::NumKeysResponse resp;
      return rdzv_->NumKeys(&ctx, r, &resp);
    });
    unary("Wait", Admits::kOwnJob, false, [&, scope](grpc::ClientContext& ctx) {
      v1::WaitRequest r;
      scope(&r);
      r.add_keys("absent");
      r.set_timeout_ms(1);
      v1::WaitResponse resp;
      const grpc::Status s = rdzv_->Wait(&ctx, r, &resp);
      return s.error_code() == StatusCode::DEADLINE_EXCEEDED ? grpc::Status::OK : s;
    });
    unary("Barrier", Admits::kOwnJob, false, [&, scope](grpc::ClientContext& ctx) {
      v1::BarrierRequest r;
      scope(&r);
      r.set_name("b");
      r.set_rank(0);
      r.set_world_size(2);
      r.set_timeout_ms(1);
      v1::BarrierResponse resp;
      const grpc::Status s = rdzv_->Barrier(&ctx, r, &resp);
      return s.error_code() == StatusCode::DEADLINE_EXCEEDED ? grpc::Status::OK : s;
    });
    // TrainerService: alice's job, attempt 1.
    unary("ReportStep", Admits::kOwnJob, true, [&, job](grpc::ClientContext& ctx) {
      v1::StepReport r;
      r.set_job_id(job);
      r.set_attempt(1);
      r.set_step(1);
      r.set_total_steps(10);
      v1::TrainerCommands resp;
      return trainer_->ReportStep(&ctx, r, &resp);
    });
    unary("ReportCheckpoint", Admits::kOwnJob, true, [&, job](grpc::ClientContext& ctx) {
      v1::CheckpointReport r;
      r.set_job_id(job);
      r.set_attempt(1);
      r.set_step(1);
      r.set_path("/ckpt/step-1");
      v1::TrainerCommands resp;
      return trainer_->ReportCheckpoint(&ctx, r, &resp);
    });
    // IdentityService.
    unary("WhoAmI", Admits::kAnyone, false, [&](grpc::ClientContext& ctx) {
      v1::WhoAmIResponse resp;
      return identity_->WhoAmI(&ctx, {}, &resp);
    });
    unary("CreateUser", Admits::kAdmins, true, [&](grpc::ClientContext& ctx) {
      v1::CreateUserRequest r;
      r.set_name("frank");
      v1::User resp;
      return identity_->CreateUser(&ctx, r, &resp);
    });
    unary("ListUsers", Admits::kAdmins, false, [&](grpc::ClientContext& ctx) {
      v1::ListUsersResponse resp;
      return identity_->ListUsers(&ctx, {}, &resp);
    });
    unary("DisableUser", Admits::kAdmins, true, [&](grpc::ClientContext& ctx) {
      v1::DisableUserRequest r;
      r.set_name("erin");
      v1::User resp;
      return identity_->DisableUser(&ctx, r, &resp);
    });
    unary("CreateToken", Admits::kUsers, true, [&](grpc::ClientContext& ctx) {
      v1::CreateTokenResponse resp;
      return identity_->CreateToken(&ctx, {}, &resp);  // for the caller
    });
    unary("ListTokens", Admits::kUsers, false, [&](grpc::ClientContext& ctx) {
      v1::ListTokensResponse resp;
      return identity_->ListTokens(&ctx, {}, &resp);  // the caller's
    });
    unary("UpdateUser", Admits::kAdmins, true, [&](grpc::ClientContext& ctx) {
      v1::UpdateUserRequest r;
      r.set_name("erin");
      r.set_account("research");
      r.set_max_queued_jobs(3);
      v1::User resp;
      return identity_->UpdateUser(&ctx, r, &resp);
    });
    unary("CreateAccount", Admits::kAdmins, true, [&](grpc::ClientContext& ctx) {
      v1::CreateAccountRequest r;
      r.mutable_account()->set_name("vision");
      r.mutable_account()->set_quota_devices(2);
      v1::Account resp;
      return identity_->CreateAccount(&ctx, r, &resp);
    });
    unary("UpdateAccount", Admits::kAdmins, true, [&](grpc::ClientContext& ctx) {
      v1::UpdateAccountRequest r;
      r.mutable_account()->set_name("research");
      r.mutable_account()->set_quota_devices(4);
      v1::Account resp;
      return identity_->UpdateAccount(&ctx, r, &resp);
    });
    unary("DeleteAccount", Admits::kAdmins, true, [&](grpc::ClientContext& ctx) {
      v1::DeleteAccountRequest r;
      r.set_name("retired");
      v1::Account resp;
      return identity_->DeleteAccount(&ctx, r, &resp);
    });
    unary("ListAccounts", Admits::kUsers, false, [&](grpc::ClientContext& ctx) {
      v1::ListAccountsResponse resp;
      return identity_->ListAccounts(&ctx, {}, &resp);
    });
    unary("DenyNode", Admits::kAdmins, true, [&](grpc::ClientContext& ctx) {
      v1::DenyNodeRequest r;
      r.set_node("n9");  // not n1, whose session the other calls use
      r.set_reason("stolen");
      v1::DeniedNode resp;
      return identity_->DenyNode(&ctx, r, &resp);
    });
    unary("ListDeniedNodes", Admits::kAdmins, false, [&](grpc::ClientContext& ctx) {
      v1::ListDeniedNodesResponse resp;
      return identity_->ListDeniedNodes(&ctx, {}, &resp);
    });
    unary("GetQuota", Admits::kUsers, false, [&](grpc::ClientContext& ctx) {
      v1::QuotaReport resp;
      return jobs_->GetQuota(&ctx, {}, &resp);  // the caller's
    });
    const std::string spare = spare_token_id_;
    unary("RevokeToken", Admits::kOwnerAdmin, true, [&, spare](grpc::ClientContext& ctx) {
      v1::RevokeTokenRequest r;
      r.set_id(spare);  // alice's
      v1::TokenInfo resp;
      return identity_->RevokeToken(&ctx, r, &resp);
    });
    // Last: it ends alice's job, and with it the rendezvous scope.
    unary("CancelJob", Admits::kOwnerAdmin, true, [&, job](grpc::ClientContext& ctx) {
      v1::CancelJobRequest r;
      r.set_job_id(job);
      v1::Job resp;
      const grpc::Status s = jobs_->CancelJob(&ctx, r, &resp);
      // The second allowed caller finds it cancelled already.
      return s.error_code() == StatusCode::FAILED_PRECONDITION ? grpc::Status::OK : s;
    });
    return rpcs;
  }

  std::unique_ptr<testing::NodeSession> node_;
  std::string job_, other_job_, spare_token_id_;
  std::map<std::string, std::string> credentials_;
};

TEST_F(AuthorizationTest, EveryRpcGetsTheExpectedCodeForEveryCredentialAndRefusalsChangeNothing) {
  const std::vector<Rpc> rpcs = Rpcs();
  ASSERT_EQ(rpcs.size(), 43u) << "every RPC of JobService (11), NodeService (6), "
                                 "RendezvousService (9), TrainerService (2), IdentityService (14), "
                                 "AdminService (1)";
  // Refusals first, each checked to change nothing; then the calls that are let through (those
  // that change something last, CancelJob at the very end).
  for (const Rpc& rpc : rpcs) {
    for (const std::string& credential : kCredentials) {
      const StatusCode expected = Expected(rpc.admits, credential);
      if (expected == StatusCode::OK) continue;
      const std::string before = Fingerprint();
      const grpc::Status s = rpc.call(credentials_[credential]);
      EXPECT_EQ(s.error_code(), expected)
          << rpc.name << " with " << credential << ": " << s.error_message();
      EXPECT_FALSE(s.error_message().empty()) << rpc.name << " with " << credential;
      EXPECT_EQ(Fingerprint(), before) << rpc.name << " with " << credential << " changed state";
    }
  }
  for (bool mutating : {false, true}) {
    for (const Rpc& rpc : rpcs) {
      if (rpc.mutates != mutating) continue;
      for (const std::string& credential : kCredentials) {
        if (Expected(rpc.admits, credential) != StatusCode::OK) continue;
        const grpc::Status s = rpc.call(credentials_[credential]);
        EXPECT_TRUE(s.ok()) << rpc.name << " with " << credential << ": " << s.error_code() << " "
                            << s.error_message();
      }
    }
  }
}

TEST_F(AuthorizationTest, RefusalsSayWhatWasMissing) {
  auto get = [&](const std::string& credential) {
    grpc::ClientContext ctx;
    Prepare(ctx, credentials_[credential]);
    v1::GetJobRequest r;
    r.set_job_id(job_);
    v1::Job resp;
    return jobs_->GetJob(&ctx, r, &resp).error_message();
  };
  using ::testing::HasSubstr;
  EXPECT_THAT(get("none"), HasSubstr("no credential"));
  EXPECT_THAT(get("expired"), HasSubstr("has expired"));
  EXPECT_THAT(get("revoked"), HasSubstr("was revoked"));
  EXPECT_THAT(get("disabled"), HasSubstr("user dave is disabled"));
  EXPECT_EQ(get("other_user"), absl::StrCat("job ", job_, " not found"));  // as a missing job
  EXPECT_THAT(get("node"), HasSubstr("needs a user's API token"));
  // Never the secret of what was sent.
  const std::string expired = credentials_["expired"];
  EXPECT_THAT(get("expired"), ::testing::Not(HasSubstr(expired.substr(expired.rfind('.') + 1))));
}

TEST_F(AuthorizationTest, ListJobsShowsTheCallersOwnJobsAndEveryOwnersOnlyToAdmins) {
  auto list = [&](const std::string& credential, const std::string& owner,
                  std::vector<std::string>* ids) {
    grpc::ClientContext ctx;
    Prepare(ctx, credentials_[credential]);
    v1::ListJobsRequest r;
    r.set_owner(owner);
    v1::ListJobsResponse resp;
    const grpc::Status s = jobs_->ListJobs(&ctx, r, &resp);
    for (const auto& j : resp.jobs()) ids->push_back(j.id());
    return s.error_code();
  };
  std::vector<std::string> ids;
  EXPECT_EQ(list("owner", "", &ids), StatusCode::OK);
  EXPECT_THAT(ids, ::testing::ElementsAre(job_));
  ids.clear();
  EXPECT_EQ(list("owner", "bob", &ids), StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(list("admin", "", &ids), StatusCode::OK);
  EXPECT_THAT(ids, ::testing::ElementsAre(other_job_, job_));
  ids.clear();
  EXPECT_EQ(list("admin", "bob", &ids), StatusCode::OK);
  EXPECT_THAT(ids, ::testing::ElementsAre(other_job_));
}

TEST_F(AuthorizationTest, ANodeRegistersOnlyAsItselfAndASecondDaemonIsRefusedWhileTheFirstIsOn) {
  // n1's token cannot register n2.
  {
    grpc::ClientContext ctx;
    Prepare(ctx, credentials_["node"]);
    v1::RegisterNodeRequest r;
    r.set_node_id("n2");
    r.add_devices()->set_kind(v1::CPU_SLOT);
    v1::RegisterNodeResponse resp;
    const grpc::Status s = nodes_->RegisterNode(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("node token is for node n1, not n2"));
  }
  // A second daemon as n1 (same token) while the first holds its session.
  grpc::ClientContext ctx;
  Prepare(ctx, credentials_["node"]);
  auto stream = nodes_->Session(&ctx);
  v1::NodeMessage hello;
  hello.mutable_hello()->set_node_id("n1");
  stream->Write(hello);
  v1::CoordinatorMessage m;
  EXPECT_FALSE(stream->Read(&m));
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("already has a session open"));
  // The first is still the node's session: it gets its heartbeat acks.
  node_->Heartbeat();
}

TEST_F(AuthorizationTest, AParameterServerVerifiesOnlyCredentialsOfAttemptsWithARangeOnIt) {
  auto ps1 = testing::NodeSession::ConnectParameterServer(channel_, tokens_->Node("ps1"), "ps1",
                                                          int64_t{1} << 30, "127.0.0.1:9");
  auto ps2 = testing::NodeSession::ConnectParameterServer(channel_, tokens_->Node("ps2"), "ps2",
                                                          int64_t{1} << 30, "127.0.0.1:10");
  // An offload job: its state goes to the servers connected now.
  v1::JobSpec spec = testing::TinySpec("succeed", 1);
  spec.mutable_parallel()->set_strategy(v1::OFFLOAD);
  grpc::ClientContext submit_ctx;
  Prepare(submit_ctx, credentials_["owner"]);
  v1::SubmitJobRequest submit;
  *submit.mutable_spec() = spec;
  v1::SubmitJobResponse submitted;
  ASSERT_TRUE(jobs_->SubmitJob(&submit_ctx, submit, &submitted).ok());
  auto n2 = testing::NodeSession::Connect(channel_, tokens_->Node("n2"), "n2", 1);  // n1 is full
  ASSERT_EQ(server_->jobs().SchedulePass(), 1);
  auto job = server_->jobs().Get(submitted.job().id());
  ASSERT_TRUE(job.ok());
  ASSERT_GE(job->ps_placement_size(), 1) << job->DebugString();
  const std::string holder = job->ps_placement(0).node_id();
  // A server that joined after the placement holds nothing of it.
  const std::string other = "ps3";
  auto ps3 = testing::NodeSession::ConnectParameterServer(channel_, tokens_->Node(other), other,
                                                          int64_t{1} << 30, "127.0.0.1:11");

  auto verify = [&](const std::string& node, const std::string& credential) {
    grpc::ClientContext ctx;
    Prepare(ctx, tokens_->Node(node));
    v1::VerifyJobCredentialRequest r;
    r.set_credential(credential);
    v1::VerifyJobCredentialResponse resp;
    const grpc::Status s = nodes_->VerifyJobCredential(&ctx, r, &resp);
    if (s.ok()) {
      EXPECT_EQ(resp.job_id(), job->id());
    }
    return s.error_code();
  };
  // Ranks show each server the attempt's credential for that server's address alone.
  const std::string address = job->ps_placement(0).address();
  const std::string job_credential = tokens_->Job(job->id(), job->attempt());
  const std::string own = DeriveServerCredential(job_credential, address);
  EXPECT_EQ(verify(holder, own), StatusCode::OK);
  EXPECT_EQ(verify(other, own), StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(
      verify(holder, DeriveServerCredential(tokens_->Job(job->id(), job->attempt() + 1), address)),
      StatusCode::FAILED_PRECONDITION);
  std::string forged = own;
  forged.back() = forged.back() == 'A' ? 'B' : 'A';
  EXPECT_EQ(verify(holder, forged), StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(verify(holder, DeriveServerCredential(job_credential, "127.0.0.1:99")),
            StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(verify(holder, credentials_["owner"]), StatusCode::UNAUTHENTICATED);
  // The job credential itself is never for a parameter server: the rendezvous and the reports
  // accept it.
  EXPECT_EQ(verify(holder, job_credential), StatusCode::PERMISSION_DENIED);
  // And what a server is shown is good nowhere else: not at the rendezvous, not for reports.
  {
    grpc::ClientContext ctx;
    Prepare(ctx, own);
    v1::NumKeysRequest r;
    r.mutable_scope()->set_job_id(job->id());
    r.mutable_scope()->set_attempt(job->attempt());
    v1::NumKeysResponse keys;
    const grpc::Status s = rdzv_->NumKeys(&ctx, r, &keys);
    EXPECT_EQ(s.error_code(), StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("good only at the parameter server"));
  }
  {
    grpc::ClientContext ctx;
    Prepare(ctx, own);
    v1::StepReport r;
    r.set_job_id(job->id());
    r.set_attempt(job->attempt());
    r.set_step(1);
    v1::TrainerCommands commands;
    EXPECT_EQ(trainer_->ReportStep(&ctx, r, &commands).error_code(), StatusCode::UNAUTHENTICATED);
  }
  // A user may not ask.
  grpc::ClientContext ctx;
  Prepare(ctx, credentials_["admin"]);
  v1::VerifyJobCredentialRequest r;
  r.set_credential(own);
  v1::VerifyJobCredentialResponse resp;
  EXPECT_EQ(nodes_->VerifyJobCredential(&ctx, r, &resp).error_code(),
            StatusCode::PERMISSION_DENIED);
}

TEST_F(AuthorizationTest, ANodeTokenLimitedToSomeOwnersCannotClaimOthers) {
  auto token =
      server_->identities().CreateToken("admin", "n3", 0, "alice's workstation", {"alice"});
  ASSERT_TRUE(token.ok()) << token.status();
  auto register_with = [&](const std::vector<std::string>& owners) {
    grpc::ClientContext ctx;
    Prepare(ctx, token->text);
    v1::RegisterNodeRequest r;
    r.set_node_id("n3");
    r.add_devices()->set_kind(v1::CPU_SLOT);
    for (const std::string& o : owners) r.add_owners(o);
    v1::RegisterNodeResponse resp;
    return nodes_->RegisterNode(&ctx, r, &resp);
  };
  grpc::Status s = register_with({});  // "any user's": not for this token
  EXPECT_EQ(s.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("allows only the jobs of alice"));
  EXPECT_EQ(register_with({"alice", "bob"}).error_code(), StatusCode::PERMISSION_DENIED);
  s = register_with({"alice"});
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(AuthorizationTest, ANodeSpeaksOnlyForTheRanksItRuns) {
  // n2 reports that alice's rank on n1 failed, and sends lines in its name: both are ignored.
  auto n2 = testing::NodeSession::Connect(channel_, tokens_->Node("n2"), "n2", 1);
  v1::Assignment a;
  a.set_job_id(job_);
  a.set_attempt(1);
  n2->ReportExit(a, 0, 3);
  v1::NodeMessage lines;
  lines.mutable_logs()->set_job_id(job_);
  lines.mutable_logs()->set_attempt(1);
  lines.mutable_logs()->set_rank(0);
  lines.mutable_logs()->add_lines("forged line");
  ASSERT_TRUE(n2->Write(lines));
  // Nor does it add usage to alice's job (the current attempt's rank, or an earlier attempt's).
  for (int attempt : {1, 6}) {
    v1::NodeMessage m;
    v1::RankStatus* s = m.mutable_rank_status();
    s->set_job_id(job_);
    s->set_attempt(attempt);
    s->set_rank(0);
    s->set_phase(v1::RANK_EXITED);
    s->mutable_usage()->set_cpu_seconds(1e300);
    ASSERT_TRUE(n2->Write(m));
  }
  n2->Heartbeat();  // processed in order: all are handled once the ack arrives
  auto job = server_->jobs().Get(job_);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::RUNNING);
  EXPECT_EQ(job->rank_usage_size(), 0);
  grpc::ClientContext ctx;
  Prepare(ctx, credentials_["owner"]);
  v1::StreamLogsRequest r;
  r.set_job_id(job_);
  auto reader = jobs_->StreamLogs(&ctx, r);
  v1::LogLine line;
  while (reader->Read(&line)) EXPECT_NE(line.text(), "forged line");
  EXPECT_TRUE(reader->Finish().ok());
  // n1, which runs it, is heard.
  node_->ReportExit(a, 0, 3);
  node_->Heartbeat();
  job = server_->jobs().Get(job_);
  ASSERT_TRUE(job.ok());
  EXPECT_NE(job->state(), v1::RUNNING);
  for (const v1::RankUsage& u : job->rank_usage()) EXPECT_NE(u.node_id(), "n2");
}

}  // namespace
}  // namespace trainyard::coordinator
