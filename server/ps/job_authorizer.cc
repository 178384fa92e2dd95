#include "server/ps/job_authorizer.h"

#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/coordinator_endpoints.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "trainyard/v1/node.grpc.pb.h"

namespace trainyard::ps {
namespace {

class OpenJobAuthorizer final : public JobAuthorizer {
 public:
  absl::Status Authorize(absl::string_view, const std::string&, int32_t) override {
    return absl::OkStatus();
  }
};

class CoordinatorJobAuthorizer final : public JobAuthorizer {
 public:
  CoordinatorJobAuthorizer(const std::string& coordinator, ChannelFactory make_channel,
                           std::string node_token)
      : endpoints_(coordinator),
        make_channel_(std::move(make_channel)),
        bearer_(node_token.empty() ? std::string() : "Bearer " + node_token) {
    stub_ = v1::NodeService::NewStub(make_channel_(endpoints_.current()));
  }

  absl::Status Authorize(absl::string_view credential, const std::string& job_id,
                         int32_t attempt) override {
    if (credential.empty()) {
      return absl::UnauthenticatedError(
          "no credential: a rank sends its attempt's parameter-server credential (derived from "
          "TRAINYARD_JOB_CREDENTIAL for this server)");
    }
    if (ParseJobCredential(credential).ok()) {
      // Never passed on: it is good at the coordinator, and this server has no use for it.
      return absl::PermissionDeniedError(
          "a job credential (tyj.): a rank shows a parameter server only its parameter-server "
          "credential (tys.)");
    }
    auto parsed = ParseServerCredential(credential);
    if (!parsed.ok()) return absl::UnauthenticatedError(parsed.status().message());
    if (parsed->job_id != job_id || (attempt != 0 && parsed->attempt != attempt)) {
      return absl::PermissionDeniedError(absl::StrCat("the credential is for ", parsed->job_id,
                                                      " attempt ", parsed->attempt, ", not for ",
                                                      job_id, " attempt ", attempt));
    }
    const absl::Time now = absl::Now();
    {
      absl::MutexLock lock(&mu_);
      auto it = accepted_.find(parsed->job_id);
      if (it != accepted_.end() && now < it->second.until &&
          ConstantTimeEquals(it->second.credential, credential)) {
        return absl::OkStatus();
      }
    }
    grpc::ClientContext ctx;
    if (!bearer_.empty()) ctx.AddMetadata(kAuthorizationMetadata, bearer_);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::VerifyJobCredentialRequest request;
    request.set_credential(std::string(credential));
    v1::VerifyJobCredentialResponse response;
    std::shared_ptr<v1::NodeService::Stub> stub;
    {
      absl::MutexLock lock(&mu_);
      stub = stub_;
    }
    const grpc::Status s = stub->VerifyJobCredential(&ctx, request, &response);
    if (!s.ok()) {
      // The next call goes to the leader a standby named, or to the next replica.
      if (endpoints_.Follow(s, ctx)) {
        auto next = std::shared_ptr<v1::NodeService::Stub>(
            v1::NodeService::NewStub(make_channel_(endpoints_.current())));
        absl::MutexLock lock(&mu_);
        stub_ = std::move(next);
      }
      const absl::Status status = FromGrpcStatus(s);
      // An attempt that is not running (any more) is denied like another job's.
      const absl::StatusCode code =
          absl::IsFailedPrecondition(status) ? absl::StatusCode::kPermissionDenied : status.code();
      return absl::Status(code, absl::StrCat("the coordinator refused the credential for ", job_id,
                                             " attempt ", parsed->attempt, ": ", status.message()));
    }
    absl::MutexLock lock(&mu_);
    if (accepted_.size() >= kMaxRemembered) accepted_.clear();
    Accepted& entry = accepted_[parsed->job_id];
    if (parsed->attempt >= entry.attempt) {
      entry = {parsed->attempt, std::string(credential), now + kRecheckAfter};
    }
    return absl::OkStatus();
  }

 private:
  static constexpr size_t kMaxRemembered = 4096;
  // An accepted credential is asked about again after this long: an attempt that ended (or whose
  // ranges moved) is refused within it.
  static constexpr absl::Duration kRecheckAfter = absl::Seconds(30);

  struct Accepted {
    int32_t attempt = 0;
    std::string credential;
    absl::Time until;
  };

  CoordinatorEndpoints endpoints_;
  const ChannelFactory make_channel_;
  const std::string bearer_;
  absl::Mutex mu_;
  std::shared_ptr<v1::NodeService::Stub> stub_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Accepted> accepted_ ABSL_GUARDED_BY(mu_);  // by job: its newest attempt
};

}  // namespace

std::unique_ptr<JobAuthorizer> NewOpenJobAuthorizer() {
  return std::make_unique<OpenJobAuthorizer>();
}

std::unique_ptr<JobAuthorizer> NewCoordinatorJobAuthorizer(const std::string& coordinator,
                                                           ChannelFactory make_channel,
                                                           std::string node_token) {
  return std::make_unique<CoordinatorJobAuthorizer>(coordinator, std::move(make_channel),
                                                    std::move(node_token));
}

std::string CallCredential(const grpc::ServerContext& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(kAuthorizationMetadata);
  if (it == md.end()) return std::string();
  auto credential = BearerCredential(absl::string_view(it->second.data(), it->second.size()));
  return credential.ok() ? *credential : std::string();
}

}  // namespace trainyard::ps
