#include "server/coordinator/service_auth.h"
#include "server/coordinator/services.h"

#include "absl/strings/str_cat.h"

namespace trainyard::coordinator {
namespace {

// An admin's audited change, the shape of most Identity RPCs: the request's limits, an admin
// caller (refused and audited otherwise, by `method`), the change itself, its audit line
// (`action` on `subject`, with the outcome), then the answer.
template <typename Request, typename Result, typename Change>
grpc::ServerUnaryReactor* AdminChange(grpc::CallbackServerContext* ctx,
                                      const IdentityRegistry& identities, const Request& request,
                                      const char* method, const char* action,
                                      const std::string& subject, Result* response,
                                      Change&& change) {
  if (absl::Status s = CheckRequest(request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities, method);
  if (!caller.ok()) return Done(ctx, caller.status());
  absl::StatusOr<Result> result = change(*caller);
  Audit(*caller, action, subject, result.status());
  if (result.ok()) *response = *std::move(result);
  return Done(ctx, result.status());
}

}  // namespace

grpc::ServerUnaryReactor* IdentityServiceImpl::WhoAmI(grpc::CallbackServerContext* ctx,
                                                      const v1::WhoAmIRequest*,
                                                      v1::WhoAmIResponse* response) {
  auto p = Authenticate(ctx, identities_);
  if (!p.ok()) return Done(ctx, Refused("WhoAmI", "anonymous", p.status()));
  response->set_user(p->user);
  response->set_role(p->kind == Principal::Kind::kJob ? v1::ROLE_UNSPECIFIED : p->role);
  response->set_node(p->node);
  response->set_job_id(p->job_id);
  response->set_attempt(p->attempt);
  response->set_token_id(p->token_id);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::CreateUser(grpc::CallbackServerContext* ctx,
                                                          const v1::CreateUserRequest* request,
                                                          v1::User* response) {
  return AdminChange(ctx, identities_, *request, "CreateUser", "CreateUser", request->name(),
                     response, [&](const Principal&) {
                       return identities_.CreateUser(request->name(), request->role(),
                                                     request->account());
                     });
}

grpc::ServerUnaryReactor* IdentityServiceImpl::ListUsers(grpc::CallbackServerContext* ctx,
                                                         const v1::ListUsersRequest*,
                                                         v1::ListUsersResponse* response) {
  auto caller = AuthenticateAdmin(ctx, identities_, "ListUsers");
  if (!caller.ok()) return Done(ctx, caller.status());
  for (v1::User& u : identities_.ListUsers()) *response->add_users() = std::move(u);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::DisableUser(grpc::CallbackServerContext* ctx,
                                                           const v1::DisableUserRequest* request,
                                                           v1::User* response) {
  return AdminChange(ctx, identities_, *request, "DisableUser",
                     request->enable() ? "EnableUser" : "DisableUser", request->name(), response,
                     [&](const Principal&) {
                       return identities_.SetDisabled(request->name(), !request->enable());
                     });
}

grpc::ServerUnaryReactor* IdentityServiceImpl::CreateToken(grpc::CallbackServerContext* ctx,
                                                           const v1::CreateTokenRequest* request,
                                                           v1::CreateTokenResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateUser(ctx, identities_, "CreateToken");
  if (!caller.ok()) return Done(ctx, caller.status());
  const std::string user = request->user().empty() ? caller->user : request->user();
  if (!caller->IsAdmin() && (user != caller->user || !request->node().empty())) {
    return Done(ctx, Refused("CreateToken", caller->Describe(),
                             absl::PermissionDeniedError(
                                 request->node().empty()
                                     ? absl::StrCat("user: only admins may create tokens for "
                                                    "another user (",
                                                    user, ")")
                                     : std::string("node: only admins may create node tokens"))));
  }
  auto token =
      identities_.CreateToken(user, request->node(), request->ttl_seconds(), request->description(),
                              {request->owners().begin(), request->owners().end()});
  // The token's id only: its secret goes to the caller and nowhere else.
  Audit(*caller, "CreateToken",
        absl::StrCat(user, request->node().empty() ? "" : " node " + request->node(), " ",
                     token.ok() ? token->info.id() : "-"),
        token.status());
  if (token.ok()) {
    response->set_token(token->text);
    *response->mutable_info() = token->info;
  }
  return Done(ctx, token.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::ListTokens(grpc::CallbackServerContext* ctx,
                                                          const v1::ListTokensRequest* request,
                                                          v1::ListTokensResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateUser(ctx, identities_, "ListTokens");
  if (!caller.ok()) return Done(ctx, caller.status());
  std::string user = request->user().empty() ? caller->user : request->user();
  if (request->all()) user.clear();
  if (!caller->IsAdmin() && user != caller->user) {
    return Done(
        ctx,
        Refused("ListTokens", caller->Describe(),
                absl::PermissionDeniedError("user: only admins may list other users' tokens")));
  }
  for (v1::TokenInfo& t : identities_.ListTokens(user)) *response->add_tokens() = std::move(t);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::RevokeToken(grpc::CallbackServerContext* ctx,
                                                           const v1::RevokeTokenRequest* request,
                                                           v1::TokenInfo* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateUser(ctx, identities_, "RevokeToken");
  if (!caller.ok()) return Done(ctx, caller.status());
  if (request->id().empty()) return Done(ctx, absl::InvalidArgumentError("id: required"));
  auto existing = identities_.GetToken(request->id());
  if (!existing.ok()) return Done(ctx, existing.status());
  if (!caller->IsAdmin() && existing->user() != caller->user) {
    // As for a token that does not exist: token ids are not to be found out by trying.
    Refused("RevokeToken", caller->Describe(),
            absl::PermissionDeniedError(absl::StrCat("the token belongs to ", existing->user())),
            request->id())
        .IgnoreError();
    return Done(ctx, absl::NotFoundError(absl::StrCat("id: no token ", request->id())));
  }
  auto token = identities_.RevokeToken(request->id());
  Audit(*caller, "RevokeToken", request->id(), token.status());
  if (token.ok()) *response = *std::move(token);
  return Done(ctx, token.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::UpdateUser(grpc::CallbackServerContext* ctx,
                                                          const v1::UpdateUserRequest* request,
                                                          v1::User* response) {
  return AdminChange(ctx, identities_, *request, "UpdateUser", "UpdateUser", request->name(),
                     response, [&](const Principal&) { return identities_.UpdateUser(*request); });
}

grpc::ServerUnaryReactor* IdentityServiceImpl::CreateAccount(
    grpc::CallbackServerContext* ctx, const v1::CreateAccountRequest* request,
    v1::Account* response) {
  return AdminChange(
      ctx, identities_, *request, "CreateAccount", "CreateAccount", request->account().name(),
      response, [&](const Principal&) { return identities_.CreateAccount(request->account()); });
}

grpc::ServerUnaryReactor* IdentityServiceImpl::UpdateAccount(
    grpc::CallbackServerContext* ctx, const v1::UpdateAccountRequest* request,
    v1::Account* response) {
  return AdminChange(
      ctx, identities_, *request, "UpdateAccount", "UpdateAccount", request->account().name(),
      response, [&](const Principal&) { return identities_.UpdateAccount(request->account()); });
}

grpc::ServerUnaryReactor* IdentityServiceImpl::DeleteAccount(
    grpc::CallbackServerContext* ctx, const v1::DeleteAccountRequest* request,
    v1::Account* response) {
  return AdminChange(ctx, identities_, *request, "DeleteAccount", "DeleteAccount", request->name(),
                     response,
                     [&](const Principal&) { return identities_.DeleteAccount(request->name()); });
}

grpc::ServerUnaryReactor* IdentityServiceImpl::ListAccounts(grpc::CallbackServerContext* ctx,
                                                            const v1::ListAccountsRequest*,
                                                            v1::ListAccountsResponse* response) {
  auto caller = AuthenticateUser(ctx, identities_, "ListAccounts");
  if (!caller.ok()) return Done(ctx, caller.status());
  for (v1::Account& a : identities_.ListAccounts()) *response->add_accounts() = std::move(a);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::DenyNode(grpc::CallbackServerContext* ctx,
                                                        const v1::DenyNodeRequest* request,
                                                        v1::DeniedNode* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateAdmin(ctx, identities_, "DenyNode");
  if (!caller.ok()) return Done(ctx, caller.status());
  if (request->allow()) {
    const absl::Status allowed = identities_.AllowNode(request->node());
    Audit(*caller, "AllowNode", request->node(), allowed);
    if (allowed.ok()) response->set_node(request->node());
    return Done(ctx, allowed);
  }
  auto denied = identities_.DenyNode(request->node(), request->reason(), caller->user);
  Audit(*caller, "DenyNode", request->node(), denied.status());
  if (denied.ok()) *response = *std::move(denied);
  return Done(ctx, denied.status());
}

grpc::ServerUnaryReactor* IdentityServiceImpl::ListDeniedNodes(
    grpc::CallbackServerContext* ctx, const v1::ListDeniedNodesRequest*,
    v1::ListDeniedNodesResponse* response) {
  auto caller = AuthenticateAdmin(ctx, identities_, "ListDeniedNodes");
  if (!caller.ok()) return Done(ctx, caller.status());
  for (v1::DeniedNode& n : identities_.ListDeniedNodes()) *response->add_nodes() = std::move(n);
  return Done(ctx, absl::OkStatus());
}

}  // namespace trainyard::coordinator
