#include "client/yard_client.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/coordinator_channel.h"
#include "common/credentials.h"
#include "common/seq_filter.h"

namespace trainyard::client {

std::string NormalizeJobId(const std::string& text) {
  if (!text.empty() && std::all_of(text.begin(), text.end(),
                                   [](unsigned char c) { return absl::ascii_isdigit(c); })) {
    return absl::StrCat("job-", text);
  }
  return text;
}

YardClient::YardClient(const std::string& coordinator_address, absl::StatusOr<std::string> token,
                       const TlsClientOptions& tls)
    : endpoints_(coordinator_address), tls_(tls), token_(std::move(token)) {
  Connect();
}

void YardClient::Connect() {
  grpc::ChannelArguments args = CoordinatorChannelArguments();
  args.SetMaxReceiveMessageSize(64 << 20);
  auto credentials = MakeChannelCredentials(tls_);
  if (!credentials.ok() && token_.ok()) token_ = credentials.status();  // every call fails so
  // A token is a bearer credential: never in clear to another host unless told so.
  if (token_.ok() && !tls_.enabled() && !tls_.plaintext_token_ok &&
      !IsLoopback(endpoints_.current())) {
    token_ = absl::FailedPreconditionError(absl::StrCat(
        "refusing to send your API token in clear to ", endpoints_.current(),
        ", which is not this host: give the coordinator's CA with --tls-ca (env "
        "TRAINYARD_TLS_CA), or --insecure (env TRAINYARD_INSECURE=1) on a network you trust"));
  }
  channel_ = grpc::CreateCustomChannel(
      endpoints_.current(), credentials.ok() ? *credentials : grpc::InsecureChannelCredentials(),
      args);
  jobs_ = v1::JobService::NewStub(channel_);
  nodes_ = v1::NodeService::NewStub(channel_);
  identity_ = v1::IdentityService::NewStub(channel_);
  admin_ = v1::AdminService::NewStub(channel_);
}

bool YardClient::FollowLeader(const grpc::Status& status, const grpc::ClientContext& ctx,
                              int attempt, absl::Time give_up) {
  if (absl::Now() >= give_up) return false;
  // A server that shut down under the call (a standby handing its address to the new leader, or
  // a leader stepping down) cancels it: the same address is tried again, until give_up like any
  // failover (the attempts count those made while the old leader was unreachable too, so a
  // count of its own would give up on the first cancel after a slow takeover).
  if (status.error_code() == grpc::StatusCode::CANCELLED) {
    absl::SleepFor(
        std::min(absl::Milliseconds(50) * (1 << std::min(attempt, 4)), absl::Milliseconds(500)));
    return true;
  }
  const bool named = ctx.GetServerTrailingMetadata().count(kLeaderMetadata) > 0;
  if (!endpoints_.Follow(status, ctx)) {
    // A standby that knows no leader yet (one is taking over): ask it again shortly.
    if (!named) return false;
  } else {
    Connect();
  }
  // Straight to a named leader; a pause that grows while nobody answers.
  if (!named || attempt > 0) {
    absl::SleepFor(
        std::min(absl::Milliseconds(100) * (1 << std::min(attempt, 4)), absl::Seconds(1)));
  }
  return true;
}

absl::Status YardClient::Prepare(grpc::ClientContext& ctx, absl::Duration timeout) const {
  if (!token_.ok()) return token_.status();
  ctx.AddMetadata(kAuthorizationMetadata, absl::StrCat("Bearer ", *token_));
  if (timeout != absl::ZeroDuration()) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  return absl::OkStatus();
}

absl::Status YardClient::Convert(const grpc::Status& s) const {
  if (s.ok()) return absl::OkStatus();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    // A TLS mismatch looks like a closed socket to gRPC: say which it is when it is one.
    const std::string address = endpoints_.current();
    if (const std::string tls = DiagnoseTls(address, tls_); !tls.empty()) {
      return absl::UnavailableError(
          absl::StrCat("cannot reach the coordinator at ", address, ": ", tls));
    }
    return absl::UnavailableError(absl::StrCat(
        "cannot reach the coordinator at ", endpoints_.size() > 1 ? endpoints_.all() : address,
        " (", s.error_message(), "); is it running? try `yard local up`"));
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::StatusOr<v1::Job> YardClient::Submit(const v1::JobSpec& spec) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  // One id for this submit, sent again by every retry (Call re-sends the same request after
  // UNAVAILABLE or a deadline): the coordinator stores the job once.
  std::random_device random;
  request.set_request_id(
      absl::StrCat(absl::Hex(random(), absl::kZeroPad8), absl::Hex(random(), absl::kZeroPad8),
                   absl::Hex(random(), absl::kZeroPad8), absl::Hex(random(), absl::kZeroPad8)));
  auto response = Call(&YardClient::jobs_, &v1::JobService::Stub::SubmitJob, request);
  if (!response.ok()) return response.status();
  return response->job();
}

absl::StatusOr<v1::UploadContextResponse> YardClient::UploadContext(const std::string& digest,
                                                                    const std::string& archive) {
  constexpr size_t kChunkBytes = size_t{1} << 20;
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext ctx;
    if (absl::Status s = Prepare(ctx, absl::Minutes(10)); !s.ok()) return s;
    v1::UploadContextResponse response;
    auto writer = jobs_->UploadContext(&ctx, &response);
    bool ok = true;
    size_t at = 0;
    do {
      v1::ContextChunk chunk;
      if (at == 0) {
        chunk.set_digest(digest);
        chunk.set_size_bytes(static_cast<int64_t>(archive.size()));
      }
      const size_t n = std::min(kChunkBytes, archive.size() - at);
      chunk.set_data(archive.substr(at, n));
      at += n;
      ok = writer->Write(chunk);
    } while (ok && at < archive.size());
    if (ok) writer->WritesDone();
    const grpc::Status s = writer->Finish();
    if (s.ok()) return response;
    if (!FollowLeader(s, ctx, attempt, give_up)) return Convert(s);
  }
}

absl::StatusOr<v1::Job> YardClient::Get(const std::string& job_id) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  return Call(&YardClient::jobs_, &v1::JobService::Stub::GetJob, request);
}

absl::StatusOr<v1::ListJobsResponse> YardClient::List(const v1::ListJobsRequest& request_in,
                                                      int limit) {
  v1::ListJobsRequest request = request_in;
  v1::ListJobsResponse all;
  while (true) {
    if (limit > 0) request.set_page_size(std::min(1000, limit - all.jobs_size()));
    absl::StatusOr<v1::ListJobsResponse> listed =
        Call(&YardClient::jobs_, &v1::JobService::Stub::ListJobs, request);
    if (!listed.ok()) return listed.status();
    v1::ListJobsResponse& page = *listed;
    for (auto& job : *page.mutable_jobs()) *all.add_jobs() = std::move(job);
    if (page.next_page_token().empty() || (limit > 0 && all.jobs_size() >= limit)) {
      all.set_next_page_token(page.next_page_token());
      return all;
    }
    request.set_page_token(page.next_page_token());
  }
}

absl::StatusOr<v1::Job> YardClient::Cancel(const std::string& job_id, const std::string& reason) {
  v1::CancelJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(reason);
  return Call(&YardClient::jobs_, &v1::JobService::Stub::CancelJob, request);
}

absl::StatusOr<v1::ListNodesResponse> YardClient::ListNodes() {
  return Call(&YardClient::nodes_, &v1::NodeService::Stub::ListNodes, v1::ListNodesRequest());
}

absl::StatusOr<v1::Job> YardClient::Watch(const std::string& job_id, absl::Duration timeout,
                                          const std::function<bool(const v1::Job&)>& on_event) {
  absl::Time give_up = absl::Now() + kFollowFor;
  const absl::Time end =
      timeout == absl::ZeroDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  v1::Job last;
  bool stopped = false;
  grpc::Status status;
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext ctx;
    const absl::Duration left = end == absl::InfiniteFuture()
                                    ? absl::ZeroDuration()
                                    : std::max(end - absl::Now(), absl::Milliseconds(1));
    if (absl::Status s = Prepare(ctx, left); !s.ok()) return s;
    auto reader = jobs_->WatchJob(&ctx, request);
    v1::JobEvent event;
    bool any = false;
    while (reader->Read(&event)) {
      any = true;
      last = event.job();
      if (on_event(last)) {
        stopped = true;
        ctx.TryCancel();
        break;
      }
    }
    status = reader->Finish();
    // A watch the leader's end broke starts again at the next leader, which sends the job as it
    // is first (on_event sees that state once more).
    if (any && status.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    if (any) {
      give_up = absl::Now() + kFollowFor;
      attempt = 0;
    }
    if (stopped || status.ok() || !FollowLeader(status, ctx, attempt, give_up)) break;
  }
  if (stopped) return last;
  if (!status.ok()) {
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::DeadlineExceededError(absl::StrCat("job ", job_id, " still ",
                                                      v1::JobState_Name(last.state()), " after ",
                                                      absl::FormatDuration(timeout)));
    }
    return Convert(status);
  }
  return last;
}

absl::StatusOr<v1::Job> YardClient::Checkpoint(const std::string& job_id) {
  v1::CheckpointJobRequest request;
  request.set_job_id(job_id);
  return Call(&YardClient::jobs_, &v1::JobService::Stub::CheckpointJob, request);
}

absl::StatusOr<v1::Job> YardClient::Signal(const std::string& job_id, const std::string& signal) {
  v1::SignalJobRequest request;
  request.set_job_id(job_id);
  request.set_signal(signal);
  return Call(&YardClient::jobs_, &v1::JobService::Stub::SignalJob, request);
}

absl::Status YardClient::Logs(const std::string& job_id, bool follow, int tail,
                              const std::function<void(const v1::LogLine&)>& on_line) {
  v1::StreamLogsRequest request;
  request.set_job_id(job_id);
  request.set_follow(follow);
  request.set_tail(tail);
  request.set_positions(tail > 0);
  // Across a failover, or after falling behind, the stream starts again from the first line kept:
  // what was printed already is dropped by seq (per attempt and rank), and so is what a tail left
  // out, by the positions that came after it (each rank's last line kept when it opened).
  SeqFilter printed;
  // A line came: a stream opened again resumes (one that failed first, or among the positions,
  // is opened as it was).
  bool got = false;
  return Stream<v1::LogLine>(
      follow ? absl::ZeroDuration() : absl::Seconds(60),
      [&](grpc::ClientContext* ctx) {
        if (got) {  // resumed: from the first line
          request.set_tail(0);
          request.set_positions(false);
        }
        return jobs_->StreamLogs(ctx, request);
      },
      [&](const v1::LogLine& line) {
        // (Not a position: a stream that breaks among them is opened again with them.)
        got = got || !line.position();
        if (printed.Take(line) && !line.position()) on_line(line);
        return absl::OkStatus();
      },
      /*resume=*/true);
}

absl::Status YardClient::FetchExport(
    const std::string& job_id,
    const std::function<absl::Status(const v1::ExportChunk&)>& on_chunk) {
  v1::FetchExportRequest request;
  request.set_job_id(job_id);
  // No deadline: a model's export may take long to move; a stalled stream is the user's to stop.
  return Stream<v1::ExportChunk>(
      absl::ZeroDuration(),
      [&](grpc::ClientContext* ctx) { return jobs_->FetchExport(ctx, request); }, on_chunk);
}

absl::Status YardClient::Backup(
    const std::function<absl::Status(const v1::BackupChunk&)>& on_chunk) {
  // No deadline: a large state takes long to move; a stalled stream is the admin's to stop.
  return Stream<v1::BackupChunk>(
      absl::ZeroDuration(),
      [&](grpc::ClientContext* ctx) { return admin_->Backup(ctx, v1::BackupRequest()); }, on_chunk);
}

absl::Status YardClient::Metrics(const std::string& job_id, bool follow,
                                 const std::function<void(const v1::StepReport&)>& on_step) {
  v1::StreamMetricsRequest request;
  request.set_job_id(job_id);
  request.set_follow(follow);
  SeqFilter printed;  // as Logs
  return Stream<v1::StepReport>(
      follow ? absl::ZeroDuration() : absl::Seconds(60),
      [&](grpc::ClientContext* ctx) { return jobs_->StreamMetrics(ctx, request); },
      [&](const v1::StepReport& step) {
        if (printed.Take(step)) on_step(step);
        return absl::OkStatus();
      },
      /*resume=*/true);
}

// ---- IdentityService ----

absl::StatusOr<v1::WhoAmIResponse> YardClient::WhoAmI() {
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::WhoAmI, v1::WhoAmIRequest());
}

absl::StatusOr<v1::User> YardClient::CreateUser(const std::string& name, v1::Role role,
                                                const std::string& account) {
  v1::CreateUserRequest request;
  request.set_name(name);
  request.set_role(role);
  request.set_account(account);
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::CreateUser, request);
}

absl::StatusOr<v1::User> YardClient::UpdateUser(const v1::UpdateUserRequest& request) {
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::UpdateUser, request);
}

absl::StatusOr<v1::Account> YardClient::CreateAccount(const v1::Account& account) {
  v1::CreateAccountRequest request;
  *request.mutable_account() = account;
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::CreateAccount, request);
}

absl::StatusOr<v1::Account> YardClient::UpdateAccount(const v1::Account& account) {
  v1::UpdateAccountRequest request;
  *request.mutable_account() = account;
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::UpdateAccount, request);
}

absl::StatusOr<v1::Account> YardClient::DeleteAccount(const std::string& name) {
  v1::DeleteAccountRequest request;
  request.set_name(name);
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::DeleteAccount, request);
}

absl::StatusOr<v1::ListAccountsResponse> YardClient::ListAccounts() {
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::ListAccounts,
              v1::ListAccountsRequest());
}

absl::StatusOr<v1::QuotaReport> YardClient::GetQuota(const std::string& user, bool all_accounts) {
  v1::GetQuotaRequest request;
  request.set_user(user);
  request.set_all_accounts(all_accounts);
  return Call(&YardClient::jobs_, &v1::JobService::Stub::GetQuota, request);
}

absl::StatusOr<v1::ListUsersResponse> YardClient::ListUsers() {
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::ListUsers,
              v1::ListUsersRequest());
}

absl::StatusOr<v1::User> YardClient::DisableUser(const std::string& name, bool enable) {
  v1::DisableUserRequest request;
  request.set_name(name);
  request.set_enable(enable);
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::DisableUser, request);
}

absl::StatusOr<v1::CreateTokenResponse> YardClient::CreateToken(
    const v1::CreateTokenRequest& request) {
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::CreateToken, request);
}

absl::StatusOr<v1::ListTokensResponse> YardClient::ListTokens(const std::string& user, bool all) {
  v1::ListTokensRequest request;
  request.set_user(user);
  request.set_all(all);
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::ListTokens, request);
}

absl::StatusOr<v1::CordonNodeResponse> YardClient::CordonNode(const std::string& node,
                                                              v1::CordonAction action,
                                                              const std::string& reason) {
  v1::CordonNodeRequest request;
  request.set_node_id(node);
  request.set_action(action);
  request.set_reason(reason);
  return Call(&YardClient::nodes_, &v1::NodeService::Stub::CordonNode, request);
}

absl::StatusOr<v1::DeniedNode> YardClient::DenyNode(const std::string& node,
                                                    const std::string& reason, bool allow) {
  v1::DenyNodeRequest request;
  request.set_node(node);
  request.set_reason(reason);
  request.set_allow(allow);
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::DenyNode, request);
}

absl::StatusOr<v1::ListDeniedNodesResponse> YardClient::ListDeniedNodes() {
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::ListDeniedNodes,
              v1::ListDeniedNodesRequest());
}

absl::StatusOr<v1::TokenInfo> YardClient::RevokeToken(const std::string& id) {
  v1::RevokeTokenRequest request;
  request.set_id(id);
  return Call(&YardClient::identity_, &v1::IdentityService::Stub::RevokeToken, request);
}

}  // namespace trainyard::client
