#include "server/coordinator/identity.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/status_macros.h"

namespace trainyard::coordinator {
namespace {

constexpr char kUserKind[] = "user";
constexpr char kTokenKind[] = "token";

int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

bool IsNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
}

}  // namespace

std::string Principal::Describe() const {
  switch (kind) {
    case Kind::kUser:
      return absl::StrCat(role == v1::ADMIN ? "admin " : "user ", user);
    case Kind::kNode:
      return absl::StrCat("node ", node);
    case Kind::kJob:
      return absl::StrCat("job ", job_id, " attempt ", attempt);
  }
  return "unknown";
}

absl::Status CheckUserName(const std::string& field, const std::string& name) {
  const bool ok = !name.empty() && name.size() <= 32 &&
                  (absl::ascii_islower(static_cast<unsigned char>(name[0])) || name[0] == '_') &&
                  std::all_of(name.begin(), name.end(), [](char c) {
                    return IsNameChar(c) && !absl::ascii_isupper(static_cast<unsigned char>(c));
                  });
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": \"", name, "\" is not a user name ([a-z_][a-z0-9_.-]{0,31}, like a Unix account)"));
}

absl::Status CheckNodeName(const std::string& field, const std::string& name) {
  const bool ok = !name.empty() && name.size() <= 63 && name[0] != '.' && name[0] != '-' &&
                  std::all_of(name.begin(), name.end(), IsNameChar);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": \"", name, "\" is not a node name ([A-Za-z0-9_][A-Za-z0-9_.-]{0,62})"));
}

IdentityRegistry::IdentityRegistry(JobStore& store, const Clock& clock, std::string job_key)
    : store_(store), clock_(clock), job_key_(std::move(job_key)) {}

absl::Status IdentityRegistry::Load() {
  ASSIGN_OR_RETURN(std::vector<StoredRecord> users, store_.LoadRecords(kUserKind));
  ASSIGN_OR_RETURN(std::vector<StoredRecord> tokens, store_.LoadRecords(kTokenKind));
  absl::MutexLock lock(&mu_);
  for (const StoredRecord& r : users) {
    v1::User user;
    if (!user.ParseFromString(r.payload) || user.name() != r.id) {
      return absl::DataLossError(absl::StrCat("user record ", r.id, " is unreadable"));
    }
    users_[r.id] = std::move(user);
  }
  for (const StoredRecord& r : tokens) {
    v1::StoredToken token;
    if (!token.ParseFromString(r.payload) || token.info().id() != r.id) {
      return absl::DataLossError(absl::StrCat("token record ", r.id, " is unreadable"));
    }
    tokens_[r.id] = std::move(token);
  }
  return absl::OkStatus();
}

absl::Status IdentityRegistry::Persist(const std::vector<StoredRecord>& records) {
  WriteBatch batch;
  batch.put_records = records;
  return store_.CommitSync(std::move(batch));
}

absl::StatusOr<std::optional<std::string>> IdentityRegistry::BootstrapAdmin() {
  {
    absl::MutexLock lock(&mu_);
    if (!users_.empty()) return std::optional<std::string>();
  }
  RETURN_IF_ERROR(CreateUser("admin", v1::ADMIN).status());
  ASSIGN_OR_RETURN(NewToken token, CreateToken("admin", "", 0, "created at first start"));
  return std::optional<std::string>(std::move(token.text));
}

absl::StatusOr<Principal> IdentityRegistry::Authenticate(absl::string_view credential) const {
  if (absl::StartsWith(credential, "tyj.")) {
    auto parsed = ParseJobCredential(credential);
    if (!parsed.ok()) return absl::UnauthenticatedError(parsed.status().message());
    const JobCredential& job = *parsed;
    if (!VerifyJobCredential(job_key_, job)) {
      return absl::UnauthenticatedError(absl::StrCat("job credential for ", job.job_id, " attempt ",
                                                     job.attempt,
                                                     " was not issued by this coordinator"));
    }
    Principal p;
    p.kind = Principal::Kind::kJob;
    p.job_id = job.job_id;
    p.attempt = job.attempt;
    return p;
  }
  auto parsed = ParseApiToken(credential);
  if (!parsed.ok()) return absl::UnauthenticatedError(parsed.status().message());
  absl::MutexLock lock(&mu_);
  auto it = tokens_.find(parsed->id);
  if (it == tokens_.end()) {
    return absl::UnauthenticatedError(absl::StrCat("token ", parsed->id, " is unknown"));
  }
  const v1::StoredToken& stored = it->second;
  if (!ConstantTimeEquals(Sha256(parsed->secret), stored.secret_sha256())) {
    return absl::UnauthenticatedError(absl::StrCat("token ", parsed->id, ": wrong secret"));
  }
  const v1::TokenInfo& info = stored.info();
  if (info.revoked()) {
    return absl::UnauthenticatedError(absl::StrCat("token ", info.id(), " was revoked"));
  }
  if (info.expires_time_ms() != 0 && UnixMs(clock_.Now()) >= info.expires_time_ms()) {
    return absl::UnauthenticatedError(absl::StrCat("token ", info.id(), " has expired"));
  }
  auto user = users_.find(info.user());
  if (user == users_.end()) {
    return absl::UnauthenticatedError(
        absl::StrCat("token ", info.id(), ": its user ", info.user(), " no longer exists"));
  }
  if (user->second.disabled()) {
    return absl::UnauthenticatedError(
        absl::StrCat("token ", info.id(), ": user ", info.user(), " is disabled"));
  }
  Principal p;
  p.kind = info.node().empty() ? Principal::Kind::kUser : Principal::Kind::kNode;
  p.user = info.user();
  p.role = user->second.role() == v1::ADMIN ? v1::ADMIN : v1::USER;
  p.node = info.node();
  p.token_id = info.id();
  p.node_owners.assign(info.owners().begin(), info.owners().end());
  return p;
}

absl::StatusOr<v1::User> IdentityRegistry::CreateUser(const std::string& name, v1::Role role) {
  RETURN_IF_ERROR(CheckUserName("name", name));
  if (role == v1::ROLE_UNSPECIFIED) role = v1::USER;
  if (role != v1::USER && role != v1::ADMIN) {
    return absl::InvalidArgumentError(absl::StrCat("role: unknown role ", static_cast<int>(role)));
  }
  absl::MutexLock write(&write_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (users_.count(name) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("name: user ", name, " already exists"));
    }
  }
  v1::User user;
  user.set_name(name);
  user.set_role(role);
  user.set_created_time_ms(UnixMs(clock_.Now()));
  RETURN_IF_ERROR(Persist({{kUserKind, name, user.SerializeAsString()}}));
  absl::MutexLock lock(&mu_);
  users_[name] = user;
  return user;
}

std::vector<v1::User> IdentityRegistry::ListUsers() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::User> out;
  for (const auto& [name, user] : users_) out.push_back(user);
  return out;
}

absl::StatusOr<v1::User> IdentityRegistry::GetUser(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = users_.find(name);
  if (it == users_.end()) return absl::NotFoundError(absl::StrCat("no user ", name));
  return it->second;
}

absl::StatusOr<v1::User> IdentityRegistry::SetDisabled(const std::string& name, bool disabled) {
  absl::MutexLock write(&write_mu_);
  v1::User user;
  {
    absl::MutexLock lock(&mu_);
    auto it = users_.find(name);
    if (it == users_.end()) return absl::NotFoundError(absl::StrCat("name: no user ", name));
    user = it->second;
    if (disabled && user.role() == v1::ADMIN && !user.disabled()) {
      int enabled_admins = 0;
      for (const auto& [n, u] : users_) enabled_admins += u.role() == v1::ADMIN && !u.disabled();
      if (enabled_admins <= 1) {
        return absl::FailedPreconditionError(
            absl::StrCat("name: ", name, " is the last enabled admin"));
      }
    }
  }
  if (user.disabled() == disabled) return user;
  user.set_disabled(disabled);
  RETURN_IF_ERROR(Persist({{kUserKind, name, user.SerializeAsString()}}));
  absl::MutexLock lock(&mu_);
  users_[name] = user;
  return user;
}

absl::StatusOr<IdentityRegistry::NewToken> IdentityRegistry::CreateToken(
    const std::string& user, const std::string& node, int64_t ttl_seconds,
    const std::string& description, const std::vector<std::string>& node_owners) {
  if (!node.empty()) RETURN_IF_ERROR(CheckNodeName("node", node));
  if (!node_owners.empty() && node.empty()) {
    return absl::InvalidArgumentError("owners: only for a node token (with node)");
  }
  for (size_t i = 0; i < node_owners.size(); ++i) {
    RETURN_IF_ERROR(CheckUserName(absl::StrCat("owners[", i, "]"), node_owners[i]));
  }
  if (ttl_seconds < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl_seconds: must be >= 0 (0: never expires), got ", ttl_seconds));
  }
  if (description.size() > 256) {
    return absl::InvalidArgumentError("description: at most 256 bytes");
  }
  absl::MutexLock write(&write_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (users_.count(user) == 0) return absl::NotFoundError(absl::StrCat("user: no user ", user));
  }
  ApiToken token = NewApiToken();
  v1::StoredToken stored;
  v1::TokenInfo* info = stored.mutable_info();
  info->set_id(token.id);
  info->set_user(user);
  info->set_node(node);
  info->set_description(description);
  for (const std::string& owner : node_owners) info->add_owners(owner);
  const absl::Time now = clock_.Now();
  info->set_created_time_ms(UnixMs(now));
  if (ttl_seconds > 0) info->set_expires_time_ms(UnixMs(now + absl::Seconds(ttl_seconds)));
  stored.set_secret_sha256(Sha256(token.secret));
  RETURN_IF_ERROR(Persist({{kTokenKind, token.id, stored.SerializeAsString()}}));
  {
    absl::MutexLock lock(&mu_);
    tokens_[token.id] = stored;
  }
  return NewToken{token.Text(), stored.info()};
}

std::vector<v1::TokenInfo> IdentityRegistry::ListTokens(const std::string& user) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::TokenInfo> out;
  for (const auto& [id, token] : tokens_) {
    if (user.empty() || token.info().user() == user) out.push_back(token.info());
  }
  std::stable_sort(out.begin(), out.end(), [](const v1::TokenInfo& a, const v1::TokenInfo& b) {
    return a.created_time_ms() < b.created_time_ms();
  });
  return out;
}

absl::StatusOr<v1::TokenInfo> IdentityRegistry::GetToken(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = tokens_.find(id);
  if (it == tokens_.end()) return absl::NotFoundError(absl::StrCat("id: no token ", id));
  return it->second.info();
}

absl::StatusOr<v1::TokenInfo> IdentityRegistry::RevokeToken(const std::string& id) {
  absl::MutexLock write(&write_mu_);
  v1::StoredToken token;
  {
    absl::MutexLock lock(&mu_);
    auto it = tokens_.find(id);
    if (it == tokens_.end()) return absl::NotFoundError(absl::StrCat("id: no token ", id));
    token = it->second;
  }
  if (token.info().revoked()) return token.info();
  token.mutable_info()->set_revoked(true);
  token.mutable_info()->set_revoked_time_ms(UnixMs(clock_.Now()));
  RETURN_IF_ERROR(Persist({{kTokenKind, id, token.SerializeAsString()}}));
  absl::MutexLock lock(&mu_);
  tokens_[id] = token;
  return token.info();
}

std::string IdentityRegistry::JobCredentialFor(const std::string& job_id, int32_t attempt) const {
  return MakeJobCredential(job_key_, job_id, attempt);
}

}  // namespace trainyard::coordinator
