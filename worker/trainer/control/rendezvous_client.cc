// RendezvousClient (see rendezvous_client.h): each call is one RendezvousService RPC.
#include "worker/trainer/control/rendezvous_client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/coordinator_channel.h"
#include "common/coordinator_endpoints.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "common/tls.h"
#include "trainyard/v1/rendezvous.grpc.pb.h"

namespace trainyard::trainer {
namespace {

// Non-blocking calls: a generous bound so a dead coordinator does not hang a rank forever.
constexpr std::chrono::milliseconds kUnaryTimeout = std::chrono::seconds(30);

// A context whose deadline is the call's own timeout plus a margin for the round trip. Ranks may
// start before the coordinator's port accepts: wait for the channel, within the deadline.
// Each call carries the attempt's job credential, which the worker put in the environment.
void Prepare(grpc::ClientContext& ctx, std::chrono::milliseconds timeout) {
  static const std::string bearer = BearerFromEnv(kJobCredentialEnv);
  if (!bearer.empty()) ctx.AddMetadata(kAuthorizationMetadata, bearer);
  ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
  ctx.set_wait_for_ready(true);
}

}  // namespace

struct RendezvousClient::Stub {
  explicit Stub(const std::string& coordinator) : endpoints(coordinator) { Connect(); }

  void Connect() {
    auto next = std::shared_ptr<v1::RendezvousService::Stub>(
        v1::RendezvousService::NewStub(grpc::CreateCustomChannel(
            endpoints.current(), ChannelCredentialsFromEnv(), CoordinatorChannelArguments())));
    absl::MutexLock lock(&mu);
    stub = std::move(next);
  }

  // One RPC (`call` on a stub and a prepared context), made again at the leader a standby named
  // or at the next replica (a few times at most); its status as Check says.
  template <typename F>
  absl::Status Call(std::chrono::milliseconds timeout, const F& call, const char* name,
                    const std::string& key) {
    for (int attempt = 0;; ++attempt) {
      std::shared_ptr<v1::RendezvousService::Stub> current;
      {
        absl::MutexLock lock(&mu);
        current = stub;
      }
      grpc::ClientContext ctx;
      Prepare(ctx, timeout);
      const grpc::Status s = call(*current, ctx);
      if (s.ok() || attempt >= 3 || !endpoints.Follow(s, ctx)) return Check(s, name, key);
      Connect();
    }
  }

  CoordinatorEndpoints endpoints;
  absl::Mutex mu;
  std::shared_ptr<v1::RendezvousService::Stub> stub ABSL_GUARDED_BY(mu);
  v1::RendezvousScope scope;

  // OK, or the call's status with a message naming the call, key, job and attempt.
  absl::Status Check(const grpc::Status& s, const char* call, const std::string& key) const {
    if (s.ok()) return absl::OkStatus();
    return absl::Status(
        FromGrpcStatus(s).code(),
        absl::StrCat("rendezvous ", call, "('", key, "') for ", scope.job_id(), " attempt ",
                     scope.attempt(), " failed: ", s.error_code(), ": ", s.error_message()));
  }
};

RendezvousClient::RendezvousClient(const std::string& coordinator, const std::string& job_id,
                                   int attempt)
    : stub_(std::make_unique<Stub>(coordinator)) {
  stub_->scope.set_job_id(job_id);
  stub_->scope.set_attempt(attempt);
}

RendezvousClient::~RendezvousClient() = default;

absl::Status RendezvousClient::Set(const std::string& key, const std::string& value) {
  v1::SetRequest r;
  *r.mutable_scope() = stub_->scope;
  r.set_key(key);
  r.set_value(value);
  v1::SetResponse resp;
  return stub_->Call(
      kUnaryTimeout,
      [&](v1::RendezvousService::Stub& stub, grpc::ClientContext& ctx) {
        return stub.Set(&ctx, r, &resp);
      },
      "Set", key);
}

absl::StatusOr<std::string> RendezvousClient::CompareSet(const std::string& key,
                                                         const std::string& expected,
                                                         const std::string& desired) {
  v1::CompareSetRequest r;
  *r.mutable_scope() = stub_->scope;
  r.set_key(key);
  r.set_expected(expected);
  r.set_desired(desired);
  v1::CompareSetResponse resp;
  absl::Status s = stub_->Call(
      kUnaryTimeout,
      [&](v1::RendezvousService::Stub& stub, grpc::ClientContext& ctx) {
        return stub.CompareSet(&ctx, r, &resp);
      },
      "CompareSet", key);
  if (!s.ok()) return s;
  return std::move(*resp.mutable_value());
}

absl::StatusOr<std::string> RendezvousClient::Get(const std::string& key,
                                                  std::chrono::milliseconds timeout) {
  v1::GetRequest r;
  *r.mutable_scope() = stub_->scope;
  r.set_key(key);
  r.set_timeout_ms(timeout.count());
  v1::GetResponse resp;
  absl::Status s = stub_->Call(
      timeout,
      [&](v1::RendezvousService::Stub& stub, grpc::ClientContext& ctx) {
        return stub.Get(&ctx, r, &resp);
      },
      "Get", key);
  if (!s.ok()) return s;
  return std::move(*resp.mutable_value());
}

absl::StatusOr<int64_t> RendezvousClient::Add(const std::string& key, int64_t delta) {
  v1::AddRequest r;
  *r.mutable_scope() = stub_->scope;
  r.set_key(key);
  r.set_delta(delta);
  v1::AddResponse resp;
  absl::Status s = stub_->Call(
      kUnaryTimeout,
      [&](v1::RendezvousService::Stub& stub, grpc::ClientContext& ctx) {
        return stub.Add(&ctx, r, &resp);
      },
      "Add", key);
  if (!s.ok()) return s;
  return resp.value();
}

absl::StatusOr<bool> RendezvousClient::DeleteKey(const std::string& key) {
  v1::DeleteKeyRequest r;
  *r.mutable_scope() = stub_->scope;
  r.set_key(key);
  v1::DeleteKeyResponse resp;
  absl::Status s = stub_->Call(
      kUnaryTimeout,
      [&](v1::RendezvousService::Stub& stub, grpc::ClientContext& ctx) {
        return stub.DeleteKey(&ctx, r, &resp);
      },
      "DeleteKey", key);
  if (!s.ok()) return s;
  return resp.deleted();
}

absl::StatusOr<bool> RendezvousClient::Check(const std::vector<std::string>& keys) {
  v1::CheckRequest r;
  *r.mutable_scope() = stub_->scope;
  for (const auto& k : keys) r.add_keys(k);
  v1::CheckResponse resp;
  absl::Status s = stub_->Call(
      kUnaryTimeout,
      [&](v1::RendezvousService::Stub& stub, grpc::ClientContext& ctx) {
        return stub.Check(&ctx, r, &resp);
      },
      "Check", keys.empty() ? "" : keys.front());
  if (!s.ok()) return s;
  return resp.all_present();
}

absl::StatusOr<int64_t> RendezvousClient::NumKeys() {
  v1::NumKeysRequest r;
  *r.mutable_scope() = stub_->scope;
  v1::NumKeysResponse resp;
  absl::Status s = stub_->Call(
      kUnaryTimeout,
      [&](v1::RendezvousService::Stub& stub, grpc::ClientContext& ctx) {
        return stub.NumKeys(&ctx, r, &resp);
      },
      "NumKeys", "");
  if (!s.ok()) return s;
  return resp.num_keys();
}

absl::Status RendezvousClient::Wait(const std::vector<std::string>& keys,
                                    std::chrono::milliseconds timeout) {
  v1::WaitRequest r;
  *r.mutable_scope() = stub_->scope;
  for (const auto& k : keys) r.add_keys(k);
  r.set_timeout_ms(timeout.count());
  v1::WaitResponse resp;
  return stub_->Call(
      timeout,
      [&](v1::RendezvousService::Stub& stub, grpc::ClientContext& ctx) {
        return stub.Wait(&ctx, r, &resp);
      },
      "Wait", keys.empty() ? "" : keys.front());
}

}  // namespace trainyard::trainer
