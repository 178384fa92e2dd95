// YardClient: the gRPC side of `yard`. Holds the channel and stubs, attaches the user's API token
// to every call ("authorization: Bearer ..."), and turns gRPC errors into absl statuses with a
// one-line reason. One thread.
#ifndef TRAINYARD_CLIENT_YARD_CLIENT_H_
#define TRAINYARD_CLIENT_YARD_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/coordinator_endpoints.h"
#include "common/tls.h"
#include "trainyard/v1/admin.grpc.pb.h"
#include "trainyard/v1/identity.grpc.pb.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/node.grpc.pb.h"

namespace trainyard::client {

class YardClient {
 public:
  // `token`: the caller's API token; when it is an error (none found, a file others can read),
  // every call fails with that error before reaching the coordinator.
  // `tls`: the coordinator's CA (common/tls.h); none: plaintext. `coordinator_address` may list
  // several replicas ("a:7070,b:7070"): calls go to the leader, following a standby's answer or
  // moving down the list while the leader is away (common/coordinator_endpoints.h).
  YardClient(const std::string& coordinator_address, absl::StatusOr<std::string> token,
             const TlsClientOptions& tls = {});

  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec);
  // Uploads a job's context (common/context_archive.h: `archive`, named `digest`) in chunks of
  // 1 MiB, following the leader as every call does; the whole is sent again on a retry.
  absl::StatusOr<v1::UploadContextResponse> UploadContext(const std::string& digest,
                                                          const std::string& archive);
  absl::StatusOr<v1::Job> Get(const std::string& job_id);
  // Follows next_page_token until `limit` jobs (0 = all) are collected.
  absl::StatusOr<v1::ListJobsResponse> List(const v1::ListJobsRequest& request, int limit);
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, const std::string& reason);
  absl::StatusOr<v1::ListNodesResponse> ListNodes();
  absl::StatusOr<v1::Job> Checkpoint(const std::string& job_id);
  absl::StatusOr<v1::Job> Signal(const std::string& job_id, const std::string& signal);
  // Streams the job's log lines (the last `tail`, 0 = all kept) to `on_line`; with `follow`,
  // until the job ends.
  absl::Status Logs(const std::string& job_id, bool follow, int tail,
                    const std::function<void(const v1::LogLine&)>& on_line);
  // Streams the chunks of a succeeded job's export (checkpoint.export) to `on_chunk`; an error
  // from `on_chunk` cancels the stream and is returned.
  absl::Status FetchExport(const std::string& job_id,
                           const std::function<absl::Status(const v1::ExportChunk&)>& on_chunk);
  // Streams the chunks of a backup of the coordinator's state (admins) to `on_chunk`; an error
  // from `on_chunk` cancels the stream and is returned.
  absl::Status Backup(const std::function<absl::Status(const v1::BackupChunk&)>& on_chunk);
  // Streams the job's step reports to `on_step`; with `follow`, until the job ends.
  absl::Status Metrics(const std::string& job_id, bool follow,
                       const std::function<void(const v1::StepReport&)>& on_step);
  // Streams the job's events to `on_event` until the job ends or `on_event` returns true, and
  // returns the last job seen; DEADLINE_EXCEEDED once `timeout` passes (zero = no limit).
  absl::StatusOr<v1::Job> Watch(const std::string& job_id, absl::Duration timeout,
                                const std::function<bool(const v1::Job&)>& on_event);

  absl::StatusOr<v1::WhoAmIResponse> WhoAmI();
  absl::StatusOr<v1::User> CreateUser(const std::string& name, v1::Role role,
                                      const std::string& account = "");
  absl::StatusOr<v1::User> UpdateUser(const v1::UpdateUserRequest& request);
  absl::StatusOr<v1::Account> CreateAccount(const v1::Account& account);
  absl::StatusOr<v1::Account> UpdateAccount(const v1::Account& account);
  absl::StatusOr<v1::Account> DeleteAccount(const std::string& name);
  absl::StatusOr<v1::ListAccountsResponse> ListAccounts();
  absl::StatusOr<v1::QuotaReport> GetQuota(const std::string& user, bool all_accounts);
  absl::StatusOr<v1::ListUsersResponse> ListUsers();
  absl::StatusOr<v1::User> DisableUser(const std::string& name, bool enable);
  absl::StatusOr<v1::CreateTokenResponse> CreateToken(const v1::CreateTokenRequest& request);
  absl::StatusOr<v1::ListTokensResponse> ListTokens(const std::string& user, bool all);
  absl::StatusOr<v1::TokenInfo> RevokeToken(const std::string& id);
  // Admins: deny a node (allow: lift it), list the denied ones.
  // Admins: cordon, drain or uncordon a node.
  absl::StatusOr<v1::CordonNodeResponse> CordonNode(const std::string& node,
                                                    v1::CordonAction action,
                                                    const std::string& reason);
  absl::StatusOr<v1::DeniedNode> DenyNode(const std::string& node, const std::string& reason,
                                          bool allow);
  absl::StatusOr<v1::ListDeniedNodesResponse> ListDeniedNodes();

 private:
  absl::Status Prepare(grpc::ClientContext& ctx, absl::Duration timeout = absl::Seconds(30)) const;
  // One unary call: `method` of `stub` with `request`, the caller's token and Prepare's deadline.
  // Follows the leader: a call that a standby refused, or that found nobody at a listed address,
  // is made again at the leader (or the next address) for up to kFollowFor.
  template <typename Stub, typename Request, typename Response>
  absl::StatusOr<Response> Call(std::unique_ptr<Stub> YardClient::*stub,
                                grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                             Response*),
                                const Request& request) {
    const absl::Time give_up = absl::Now() + kFollowFor;
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext ctx;
      // With several replicas, a leader that does not answer in time is given up on.
      if (absl::Status s = Prepare(ctx, endpoints_.size() > 1 ? kAttemptTimeout : kCallTimeout);
          !s.ok()) {
        return s;
      }
      Response response;
      const grpc::Status status = ((this->*stub).get()->*method)(&ctx, request, &response);
      if (status.ok()) return response;
      if (!FollowLeader(status, ctx, attempt, give_up)) return Convert(status);
    }
  }
  // After a failed call: true (having switched channels and paused as needed) when it should be
  // made again at the address now in use.
  bool FollowLeader(const grpc::Status& status, const grpc::ClientContext& ctx, int attempt,
                    absl::Time give_up);
  void Connect();
  absl::Status Convert(const grpc::Status& s) const;
  // A server stream: `open` starts it on the current channel; each message goes to `on_message`,
  // whose error cancels the stream (what is in flight is drained) and is returned. A stream that
  // fails before its first message follows the leader as Call does (a dead address first in the
  // list, a standby, a leader stepping down); one that fails later returns its error, unless
  // `resume`: then it is opened again at the leader too (a failover under `yard logs -f`), or at
  // once where the coordinator ended it for falling behind (a reader slower than the job's
  // output), and `on_message` gets the stream from its start again (it drops what it had, by
  // sequence number).
  // `timeout`: the whole stream's (zero: none).
  template <typename Message>
  absl::Status Stream(
      absl::Duration timeout,
      const std::function<std::unique_ptr<grpc::ClientReader<Message>>(grpc::ClientContext*)>& open,
      const std::function<absl::Status(const Message&)>& on_message, bool resume = false) {
    absl::Time give_up = absl::Now() + kFollowFor;
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext ctx;
      if (absl::Status s = Prepare(ctx, timeout); !s.ok()) return s;
      std::unique_ptr<grpc::ClientReader<Message>> reader = open(&ctx);
      Message message;
      absl::Status mine;
      bool any = false;
      while (mine.ok() && reader->Read(&message)) {
        any = true;
        mine = on_message(message);
      }
      if (!mine.ok()) {
        ctx.TryCancel();
        while (reader->Read(&message)) {
        }
        reader->Finish();
        return mine;
      }
      const grpc::Status status = reader->Finish();
      if (status.ok()) return absl::OkStatus();
      // The leader went away under the stream (not its deadline): follow it afresh.
      const bool resumed = any && resume && status.error_code() == grpc::StatusCode::UNAVAILABLE;
      if (any && resume && FellBehind(status)) {
        // Read again (it read something: it moves on), after a second: a reader that stays
        // slower than the job prints (a stalled pipe) costs the coordinator a replay a second.
        absl::SleepFor(absl::Seconds(1));
        give_up = absl::Now() + kFollowFor;
        attempt = -1;
        continue;
      }
      if (resumed) {
        give_up = absl::Now() + kFollowFor;
        attempt = 0;
      }
      if ((any && !resumed) || !FollowLeader(status, ctx, attempt, give_up)) return Convert(status);
    }
  }

  // Whether the coordinator ended a stream because its reader fell behind (WriteQueue's
  // RESOURCE_EXHAUSTED, service_auth.h), not for a limit that reading again would meet too.
  static bool FellBehind(const grpc::Status& status) {
    return status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
           status.error_message().rfind(kFellBehind, 0) == 0;
  }

  static constexpr absl::Duration kFollowFor = absl::Seconds(30);
  static constexpr absl::Duration kCallTimeout = absl::Seconds(30);
  static constexpr absl::Duration kAttemptTimeout = absl::Seconds(8);

  CoordinatorEndpoints endpoints_;
  TlsClientOptions tls_;  // to say why TLS fails, when a call cannot reach the coordinator
  absl::StatusOr<std::string> token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::NodeService::Stub> nodes_;
  std::unique_ptr<v1::IdentityService::Stub> identity_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
};

// "job-7" for "7"; anything else unchanged.
std::string NormalizeJobId(const std::string& text);

}  // namespace trainyard::client

#endif  // TRAINYARD_CLIENT_YARD_CLIENT_H_
