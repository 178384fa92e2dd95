#include "server/coordinator/service_auth.h"
#include "server/coordinator/services.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace trainyard::coordinator {
namespace {

absl::StatusOr<ScopeId> ParseScope(const v1::RendezvousScope& scope) {
  if (scope.job_id().empty()) return absl::InvalidArgumentError("scope.job_id: required");
  if (scope.job_id().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("scope.job_id: ", scope.job_id().size(), " bytes, at most 128"));
  }
  if (scope.attempt() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("scope.attempt: must be >= 1, got ", scope.attempt()));
  }
  return ScopeId{scope.job_id(), scope.attempt()};
}

absl::StatusOr<absl::Duration> ParseTimeout(int64_t timeout_ms) {
  if (timeout_ms < 0 || timeout_ms > 3'600'000) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: must be in 0..3600000, got ", timeout_ms));
  }
  return timeout_ms == 0 ? absl::Seconds(30) : absl::Milliseconds(timeout_ms);
}

absl::Status CheckKey(const Rendezvous& rdzv, const std::string& key,
                      const std::string& field = "key") {
  if (key.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  if (static_cast<int64_t>(key.size()) > rdzv.limits().max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", key.size(), " bytes, at most ", rdzv.limits().max_key_bytes));
  }
  return absl::OkStatus();
}

// The keys of a Wait or Check: at most 1024, each a valid key.
absl::Status CheckKeys(const Rendezvous& rdzv,
                       const google::protobuf::RepeatedPtrField<std::string>& keys) {
  if (keys.size() > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("keys: ", keys.size(), " keys, at most 1024"));
  }
  for (int i = 0; i < keys.size(); ++i) {
    RETURN_IF_ERROR(CheckKey(rdzv, keys[i], absl::StrCat("keys[", i, "]")));
  }
  return absl::OkStatus();
}

}  // namespace

// ---- RendezvousService ----

// Parses the scope and checks that the caller holds the job credential of that attempt.
#define TY_SCOPE_OR_FINISH(var, scope_msg)                                                       \
  auto var##_or = ParseScope(scope_msg);                                                         \
  if (!var##_or.ok()) return Done(ctx, var##_or.status());                                       \
  const ScopeId var = *var##_or;                                                                 \
  if (absl::Status auth = AuthenticateRank(ctx, identities_, __func__, var.job_id, var.attempt); \
      !auth.ok()) {                                                                              \
    return Done(ctx, auth);                                                                      \
  }

grpc::ServerUnaryReactor* RendezvousServiceImpl::Set(grpc::CallbackServerContext* ctx,
                                                     const v1::SetRequest* r, v1::SetResponse*) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
  return Done(ctx, rdzv_.Set(scope, r->key(), r->value()));
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Get(grpc::CallbackServerContext* ctx,
                                                     const v1::GetRequest* r,
                                                     v1::GetResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
  auto timeout = ParseTimeout(r->timeout_ms());
  if (!timeout.ok()) return Done(ctx, timeout.status());
  auto* reactor = ctx->DefaultReactor();
  rdzv_.Get(scope, r->key(), *timeout, [reactor, response](absl::StatusOr<std::string> v) {
    if (v.ok()) response->set_value(*std::move(v));
    reactor->Finish(ToGrpcStatus(v.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Add(grpc::CallbackServerContext* ctx,
                                                     const v1::AddRequest* r,
                                                     v1::AddResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.Add(scope, r->key(), r->delta());
  if (v.ok()) response->set_value(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::CompareSet(grpc::CallbackServerContext* ctx,
                                                            const v1::CompareSetRequest* r,
                                                            v1::CompareSetResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.CompareSet(scope, r->key(), r->expected(), r->desired());
  if (v.ok()) response->set_value(*std::move(v));
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Check(grpc::CallbackServerContext* ctx,
                                                       const v1::CheckRequest* r,
                                                       v1::CheckResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKeys(rdzv_, r->keys()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.Check(scope, {r->keys().begin(), r->keys().end()});
  if (v.ok()) response->set_all_present(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::DeleteKey(grpc::CallbackServerContext* ctx,
                                                           const v1::DeleteKeyRequest* r,
                                                           v1::DeleteKeyResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->key()); !s.ok()) return Done(ctx, s);
  auto v = rdzv_.DeleteKey(scope, r->key());
  if (v.ok()) response->set_deleted(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::NumKeys(grpc::CallbackServerContext* ctx,
                                                         const v1::NumKeysRequest* r,
                                                         v1::NumKeysResponse* response) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  auto v = rdzv_.NumKeys(scope);
  if (v.ok()) response->set_num_keys(*v);
  return Done(ctx, v.status());
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Wait(grpc::CallbackServerContext* ctx,
                                                      const v1::WaitRequest* r, v1::WaitResponse*) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (r->keys().empty()) return Done(ctx, absl::InvalidArgumentError("keys: at least one key"));
  if (absl::Status s = CheckKeys(rdzv_, r->keys()); !s.ok()) return Done(ctx, s);
  auto timeout = ParseTimeout(r->timeout_ms());
  if (!timeout.ok()) return Done(ctx, timeout.status());
  auto* reactor = ctx->DefaultReactor();
  rdzv_.Wait(scope, {r->keys().begin(), r->keys().end()}, *timeout,
             [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); });
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousServiceImpl::Barrier(grpc::CallbackServerContext* ctx,
                                                         const v1::BarrierRequest* r,
                                                         v1::BarrierResponse*) {
  TY_SCOPE_OR_FINISH(scope, r->scope());
  if (absl::Status s = CheckKey(rdzv_, r->name(), "name"); !s.ok()) return Done(ctx, s);
  auto timeout = ParseTimeout(r->timeout_ms());
  if (!timeout.ok()) return Done(ctx, timeout.status());
  auto* reactor = ctx->DefaultReactor();
  rdzv_.Barrier(scope, r->name(), r->rank(), r->world_size(), *timeout,
                [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); });
  return reactor;
}

#undef TY_SCOPE_OR_FINISH

}  // namespace trainyard::coordinator
