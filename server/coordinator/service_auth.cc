#include "server/coordinator/service_auth.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/field_limits.h"
#include "common/grpc_status.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "server/coordinator/audit.h"

namespace trainyard::coordinator {

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

namespace {

// The key failed authentications of the call count under: its peer's client (an IPv4 address or
// an IPv6 network, by default a /64: IdentityRegistry::ClientOf), or for the web console's
// in-process calls (which show the key it was given) the browser's it names, so that one browser's
// wrong tokens do not throttle every other's.
std::string ThrottledPeer(grpc::CallbackServerContext* ctx, const IdentityRegistry& identities) {
  const auto& md = ctx->client_metadata();
  const auto key = md.find(kConsoleKeyMetadata), client = md.find(kConsoleClientMetadata);
  if (key != md.end() && client != md.end() &&
      identities.IsConsoleKey(absl::string_view(key->second.data(), key->second.size()))) {
    // (An address: at most 64 bytes are read.)
    return absl::StrCat("web ",
                        identities.ClientOf(absl::string_view(
                            client->second.data(), std::min<size_t>(client->second.size(), 64))));
  }
  return identities.ClientOf(ctx->peer());
}

}  // namespace

// The principal of the call's "authorization: Bearer <credential>" metadata.
absl::StatusOr<Principal> Authenticate(grpc::CallbackServerContext* ctx,
                                       const IdentityRegistry& identities) {
  const auto& md = ctx->client_metadata();
  auto it = md.find(kAuthorizationMetadata);
  if (it == md.end()) {
    return absl::UnauthenticatedError(
        "no credential: send call metadata \"authorization: Bearer <token>\" (yard: "
        "--token-file, TRAINYARD_TOKEN or yard login)");
  }
  ASSIGN_OR_RETURN(std::string credential,
                   BearerCredential(absl::string_view(it->second.data(), it->second.size())));
  return identities.AuthenticateFrom(credential, ThrottledPeer(ctx, identities));
}

// Audits a refusal and passes it on.
absl::Status Refused(const char* method, const std::string& who, absl::Status status,
                     const std::string& target) {
  WriteAudit({who, method, target, status, ""});
  return status;
}

// Every field of a request within the default FieldLimits (strings 4096 bytes, lists 1024
// entries, 256 KiB in all): INVALID_ARGUMENT naming the field.
bool ReadAt(int fd, int64_t offset, int64_t n, std::string* out) {
  out->resize(static_cast<size_t>(n));
  for (int64_t got = 0; got < n;) {
    const ssize_t r = ::pread(fd, out->data() + got, static_cast<size_t>(n - got),
                              static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += r;
  }
  return true;
}

absl::Status CheckRequest(const google::protobuf::Message& request) {
  return CheckFieldSizes(request, FieldLimits{});
}

// A user's (or admin's) API token: node tokens and job credentials may not make user calls.
absl::StatusOr<Principal> AuthenticateUser(grpc::CallbackServerContext* ctx,
                                           const IdentityRegistry& identities, const char* method) {
  auto p = Authenticate(ctx, identities);
  if (!p.ok()) return Refused(method, "anonymous", p.status());
  if (p->kind != Principal::Kind::kUser) {
    return Refused(method, p->Describe(),
                   absl::PermissionDeniedError(absl::StrCat(
                       method, " needs a user's API token; the call carried a ",
                       p->kind == Principal::Kind::kNode ? "node token" : "job credential")));
  }
  return p;
}

absl::StatusOr<Principal> AuthenticateAdmin(grpc::CallbackServerContext* ctx,
                                            const IdentityRegistry& identities,
                                            const char* method) {
  ASSIGN_OR_RETURN(Principal p, AuthenticateUser(ctx, identities, method));
  if (!p.IsAdmin()) {
    return Refused(method, p.Describe(),
                   absl::PermissionDeniedError(
                       absl::StrCat(method, " is for admins; ", p.user, " is not one")));
  }
  return p;
}

// The ranks of one attempt, with that attempt's job credential.
absl::Status AuthenticateRank(grpc::CallbackServerContext* ctx, const IdentityRegistry& identities,
                              const char* method, const std::string& job_id, int32_t attempt) {
  auto p = Authenticate(ctx, identities);
  if (!p.ok()) return Refused(method, "anonymous", p.status());
  if (p->kind != Principal::Kind::kJob) {
    return Refused(method, p->Describe(),
                   absl::PermissionDeniedError(absl::StrCat(
                       method, " is for a job's ranks, with the job credential of its attempt")));
  }
  if (p->job_id != job_id || p->attempt != attempt) {
    return Refused(method, p->Describe(),
                   absl::PermissionDeniedError(absl::StrCat("the job credential is for ", p->job_id,
                                                            " attempt ", p->attempt, ", not for ",
                                                            job_id, " attempt ", attempt)));
  }
  return absl::OkStatus();
}

// A node: by its node token, or with `certificates` (mutual TLS) by its verified client
// certificate, whose common name is the node id (a token, if also sent, must name the same
// node). For `node_id` (when not empty) only if that is the node.
absl::StatusOr<Principal> AuthenticateNode(grpc::CallbackServerContext* ctx,
                                           const IdentityRegistry& identities, const char* method,
                                           const std::string& node_id, bool certificates) {
  const bool has_token = ctx->client_metadata().count(kAuthorizationMetadata) != 0;
  Principal p;
  if (certificates) {
    const std::string name = PeerCertificateName(*ctx);
    if (name.empty()) {
      return Refused(method, "anonymous",
                     absl::UnauthenticatedError(absl::StrCat(
                         method,
                         " needs a client certificate whose common name is the node id "
                         "(this coordinator asks nodes for mutual TLS)")));
    }
    p.kind = Principal::Kind::kNode;
    p.node = name;
  }
  if (has_token || !certificates) {
    auto token = Authenticate(ctx, identities);
    if (!token.ok()) return Refused(method, "anonymous", token.status());
    if (token->kind != Principal::Kind::kNode) {
      return Refused(method, token->Describe(),
                     absl::PermissionDeniedError(absl::StrCat(
                         method, " needs a node token (yard admin token create --node NAME)")));
    }
    if (certificates && token->node != p.node) {
      return Refused(
          method, token->Describe(),
          absl::PermissionDeniedError(absl::StrCat("the node token is for node ", token->node,
                                                   ", the client certificate for ", p.node)));
    }
    p = *token;
  }
  if (identities.IsNodeDenied(p.node)) {
    return Refused(method, p.Describe(),
                   absl::PermissionDeniedError(absl::StrCat(
                       "node ", p.node, " is denied by an admin (yard admin node allow ", p.node,
                       " lifts it)")));
  }
  if (!node_id.empty() && p.node != node_id) {
    return Refused(method, p.Describe(),
                   absl::PermissionDeniedError(absl::StrCat(
                       "node_id: the node's ", certificates ? "certificate" : "node token",
                       " is for node ", p.node, ", not ", node_id)));
  }
  return p;
}

// What a call that changes something did, and for whom.
void Audit(const Principal& who, const char* method, const std::string& target,
           const absl::Status& result) {
  WriteAudit({who.Describe(), method, target, result, ""});
}

}  // namespace trainyard::coordinator
