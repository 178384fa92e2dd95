#include "server/coordinator/identity.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
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
constexpr char kAccountKind[] = "account";
constexpr char kDeniedNodeKind[] = "denied_node";
// Bounds of quotas and caps: far beyond any cluster, far from overflowing sums.
constexpr int64_t kMaxDevices = int64_t{1} << 40;

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
    : store_(store), clock_(clock), job_key_(std::move(job_key)) {
  SetAuthThrottle(AuthThrottleOptions{10, 1}, AuthThrottleOptions{30, 1});
}

void IdentityRegistry::SetAuthThrottle(AuthThrottleOptions per_token, AuthThrottleOptions per_peer,
                                       int peer_ipv6_prefix) {
  peer_ipv6_prefix_ = peer_ipv6_prefix;
  token_throttle_ = std::make_unique<AuthThrottle>(clock_, per_token);
  peer_throttle_ = std::make_unique<AuthThrottle>(clock_, per_peer);
}

absl::StatusOr<Principal> IdentityRegistry::AuthenticateFrom(absl::string_view credential,
                                                             const std::string& peer) const {
  // The credential is checked first, whatever others sent: a valid one is never refused for the
  // failures of another client at the same address or of a guesser at the same token id. That
  // costs one SHA-256 (or HMAC) a call; guessing stays hopeless because a secret is 256 random
  // bits, and a guesser past its burst is answered RESOURCE_EXHAUSTED, uncounted, so a flood
  // neither fills the failure counters nor tells it more than "wrong".
  bool guess = false;
  auto p = Authenticate(credential, &guess);
  if (p.ok()) return p;
  if (!guess) {
    if (on_auth_failure_) on_auth_failure_("stale");
    return p;
  }
  const std::string peer_key = absl::StrCat("peer ", peer);
  std::string token_key;
  if (auto token = ParseApiToken(credential); token.ok()) {
    token_key = absl::StrCat("token ", token->id);
  }
  absl::Status held = peer_throttle_->Admit(peer_key);
  if (held.ok() && !token_key.empty()) held = token_throttle_->Admit(token_key);
  if (!held.ok()) {
    if (on_auth_failure_) on_auth_failure_("throttled");
    return held;
  }
  peer_throttle_->Failed(peer_key);
  // Only a known token id has a secret to guess (unknown ids are counted per peer).
  if (!token_key.empty() && absl::StrContains(p.status().message(), "wrong secret")) {
    token_throttle_->Failed(token_key);
  }
  if (on_auth_failure_) on_auth_failure_("guess");
  return p;
}

absl::Status IdentityRegistry::Load() {
  ASSIGN_OR_RETURN(std::vector<StoredRecord> users, store_.LoadRecords(kUserKind));
  ASSIGN_OR_RETURN(std::vector<StoredRecord> tokens, store_.LoadRecords(kTokenKind));
  ASSIGN_OR_RETURN(std::vector<StoredRecord> accounts, store_.LoadRecords(kAccountKind));
  ASSIGN_OR_RETURN(std::vector<StoredRecord> denied, store_.LoadRecords(kDeniedNodeKind));
  absl::MutexLock lock(&mu_);
  for (const StoredRecord& r : denied) {
    v1::DeniedNode node;
    if (!node.ParseFromString(r.payload) || node.node() != r.id) {
      return absl::DataLossError(absl::StrCat("denied_node record ", r.id, " is unreadable"));
    }
    denied_nodes_[r.id] = std::move(node);
  }
  for (const StoredRecord& r : accounts) {
    v1::Account account;
    if (!account.ParseFromString(r.payload) || account.name() != r.id) {
      return absl::DataLossError(absl::StrCat("account record ", r.id, " is unreadable"));
    }
    accounts_[r.id] = std::move(account);
  }
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

absl::StatusOr<v1::DeniedNode> IdentityRegistry::DenyNode(const std::string& node,
                                                          const std::string& reason,
                                                          const std::string& by) {
  RETURN_IF_ERROR(CheckNodeName("node", node));
  if (reason.size() > 1024) return absl::InvalidArgumentError("reason: at most 1024 bytes");
  v1::DeniedNode denied;
  denied.set_node(node);
  denied.set_reason(reason);
  denied.set_denied_by(by);
  denied.set_denied_time_ms(UnixMs(clock_.Now()));
  absl::MutexLock write(&write_mu_);
  RETURN_IF_ERROR(Persist({{kDeniedNodeKind, node, denied.SerializeAsString()}}));
  absl::MutexLock lock(&mu_);
  denied_nodes_[node] = denied;
  return denied;
}

absl::Status IdentityRegistry::AllowNode(const std::string& node) {
  RETURN_IF_ERROR(CheckNodeName("node", node));
  absl::MutexLock write(&write_mu_);
  WriteBatch batch;
  batch.delete_records.push_back({kDeniedNodeKind, node});
  RETURN_IF_ERROR(store_.CommitSync(std::move(batch)));
  absl::MutexLock lock(&mu_);
  denied_nodes_.erase(node);
  return absl::OkStatus();
}

bool IdentityRegistry::IsNodeDenied(const std::string& node) const {
  absl::MutexLock lock(&mu_);
  return denied_nodes_.count(node) != 0;
}

std::vector<v1::DeniedNode> IdentityRegistry::ListDeniedNodes() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::DeniedNode> out;
  for (const auto& [name, node] : denied_nodes_) out.push_back(node);
  return out;
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

absl::StatusOr<Principal> IdentityRegistry::Authenticate(absl::string_view credential,
                                                         bool* guess) const {
  bool ignored = false;
  bool& guessed = guess != nullptr ? *guess : ignored;
  guessed = true;
  if (absl::StartsWith(credential, "tys.")) {
    return absl::UnauthenticatedError(
        "a parameter-server credential (tys.) is good only at the parameter server it was made "
        "for");
  }
  if (absl::StartsWith(credential, "tyj.")) {
    auto parsed = ParseJobCredential(credential);
    if (!parsed.ok()) return absl::UnauthenticatedError(parsed.status().message());
    const JobCredential& job = *parsed;
    if (!VerifyJobCredential(job_key_, job)) {
      return absl::UnauthenticatedError(absl::StrCat("job credential for ", job.job_id, " attempt ",
                                                     job.attempt,
                                                     " was not issued by this coordinator"));
    }
    guessed = false;
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
  guessed = false;
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

absl::StatusOr<v1::User> IdentityRegistry::CreateUser(const std::string& name, v1::Role role,
                                                      const std::string& account) {
  RETURN_IF_ERROR(CheckUserName("name", name));
  if (!account.empty()) RETURN_IF_ERROR(CheckUserName("account", account));
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
    if (!account.empty() && account != kDefaultAccount && accounts_.count(account) == 0) {
      return absl::NotFoundError(absl::StrCat("account: no account ", account));
    }
  }
  v1::User user;
  user.set_name(name);
  user.set_role(role);
  if (!account.empty() && account != kDefaultAccount) user.set_account(account);
  user.set_created_time_ms(UnixMs(clock_.Now()));
  RETURN_IF_ERROR(Persist({{kUserKind, name, user.SerializeAsString()}}));
  absl::MutexLock lock(&mu_);
  users_[name] = user;
  sharing_.reset();
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
    // Node tokens (one per node, made by admins) are not capped: a cluster has as many as nodes.
    if (max_tokens_per_user_ >= 0 && node.empty()) {
      const int64_t now_ms = UnixMs(clock_.Now());
      int64_t live = 0;
      for (const auto& [id, t] : tokens_) {
        const v1::TokenInfo& i = t.info();
        live += i.user() == user && i.node().empty() && !i.revoked() &&
                (i.expires_time_ms() == 0 || i.expires_time_ms() > now_ms);
      }
      if (live >= max_tokens_per_user_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "user: ", user, " holds ", live, " API tokens, the cap (--max-tokens-per-user) is ",
            max_tokens_per_user_, "; revoke some (yard admin token revoke ID) first"));
      }
    }
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

absl::StatusOr<v1::User> IdentityRegistry::UpdateUser(const v1::UpdateUserRequest& request) {
  if (request.has_account()) RETURN_IF_ERROR(CheckUserName("account", request.account()));
  // The caps given: a negative one removes it.
  struct Cap {
    const char* field;
    bool given;
    int64_t value;
    void (v1::User::*clear)();
    void (v1::User::*set)(int64_t);
  };
  const Cap caps[] = {
      {"max_running_devices", request.has_max_running_devices(), request.max_running_devices(),
       &v1::User::clear_max_running_devices, &v1::User::set_max_running_devices},
      {"max_queued_jobs", request.has_max_queued_jobs(), request.max_queued_jobs(),
       &v1::User::clear_max_queued_jobs, &v1::User::set_max_queued_jobs},
  };
  for (const Cap& cap : caps) {
    if (cap.value > kMaxDevices) {
      return absl::InvalidArgumentError(
          absl::StrCat(cap.field, ": must be at most ", kMaxDevices, " (negative: no cap)"));
    }
  }
  absl::MutexLock write(&write_mu_);
  v1::User user;
  {
    absl::MutexLock lock(&mu_);
    auto it = users_.find(request.name());
    if (it == users_.end()) {
      return absl::NotFoundError(absl::StrCat("name: no user ", request.name()));
    }
    user = it->second;
    if (request.has_account() && request.account() != kDefaultAccount &&
        accounts_.count(request.account()) == 0) {
      return absl::NotFoundError(absl::StrCat("account: no account ", request.account()));
    }
  }
  if (request.has_account()) {
    if (request.account() == kDefaultAccount) {
      user.clear_account();
    } else {
      user.set_account(request.account());
    }
  }
  for (const Cap& cap : caps) {
    if (!cap.given) continue;
    if (cap.value < 0) {
      (user.*cap.clear)();
    } else {
      (user.*cap.set)(cap.value);
    }
  }
  RETURN_IF_ERROR(Persist({{kUserKind, user.name(), user.SerializeAsString()}}));
  absl::MutexLock lock(&mu_);
  users_[user.name()] = user;
  sharing_.reset();
  return user;
}

namespace {

absl::Status CheckAccount(const v1::Account& account) {
  RETURN_IF_ERROR(CheckUserName("account.name", account.name()));
  if (account.has_quota_devices() &&
      (account.quota_devices() < 0 || account.quota_devices() > kMaxDevices)) {
    return absl::InvalidArgumentError(absl::StrCat("account.quota_devices: must be in 0..",
                                                   kMaxDevices, " (unset for no quota), got ",
                                                   account.quota_devices()));
  }
  if (account.has_borrow_limit_devices()) {
    if (!account.has_quota_devices()) {
      return absl::InvalidArgumentError(
          "account.borrow_limit_devices: only an account with a quota has a borrow limit");
    }
    if (account.borrow_limit_devices() < 0 || account.borrow_limit_devices() > kMaxDevices) {
      return absl::InvalidArgumentError(absl::StrCat("account.borrow_limit_devices: must be in 0..",
                                                     kMaxDevices, " (unset for no limit), got ",
                                                     account.borrow_limit_devices()));
    }
  }
  if (!std::isfinite(account.share()) || account.share() < 0 || account.share() > 1e9) {
    return absl::InvalidArgumentError(
        absl::StrCat("account.share: must be a positive number (0: 1), got ", account.share()));
  }
  return absl::OkStatus();
}

v1::Account ImplicitDefaultAccount() {
  v1::Account account;
  account.set_name(kDefaultAccount);
  account.set_share(1);
  return account;
}

}  // namespace

absl::StatusOr<v1::Account> IdentityRegistry::CreateAccount(v1::Account account) {
  RETURN_IF_ERROR(CheckAccount(account));
  if (account.share() == 0) account.set_share(1);
  absl::MutexLock write(&write_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (accounts_.count(account.name()) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("account.name: account ", account.name(), " already exists"));
    }
  }
  account.set_created_time_ms(UnixMs(clock_.Now()));
  RETURN_IF_ERROR(Persist({{kAccountKind, account.name(), account.SerializeAsString()}}));
  absl::MutexLock lock(&mu_);
  accounts_[account.name()] = account;
  sharing_.reset();
  return account;
}

absl::StatusOr<v1::Account> IdentityRegistry::UpdateAccount(v1::Account account) {
  RETURN_IF_ERROR(CheckAccount(account));
  if (account.share() == 0) account.set_share(1);
  absl::MutexLock write(&write_mu_);
  {
    absl::MutexLock lock(&mu_);
    auto it = accounts_.find(account.name());
    if (it != accounts_.end()) {
      account.set_created_time_ms(it->second.created_time_ms());
    } else if (account.name() == kDefaultAccount) {
      account.set_created_time_ms(UnixMs(clock_.Now()));  // the implicit one becomes explicit
    } else {
      return absl::NotFoundError(absl::StrCat("account.name: no account ", account.name()));
    }
  }
  RETURN_IF_ERROR(Persist({{kAccountKind, account.name(), account.SerializeAsString()}}));
  absl::MutexLock lock(&mu_);
  accounts_[account.name()] = account;
  sharing_.reset();
  return account;
}

absl::StatusOr<v1::Account> IdentityRegistry::DeleteAccount(const std::string& name) {
  if (name == kDefaultAccount) {
    return absl::FailedPreconditionError("name: the default account cannot be deleted");
  }
  absl::MutexLock write(&write_mu_);
  if (account_in_use_) {  // outside mu_: the job manager's lock is taken
    if (const std::string job = account_in_use_(name); !job.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("name: job ", job, " of account ", name,
                                                        " has not ended; wait for its jobs first"));
    }
  }
  v1::Account account;
  {
    absl::MutexLock lock(&mu_);
    auto it = accounts_.find(name);
    if (it == accounts_.end()) return absl::NotFoundError(absl::StrCat("name: no account ", name));
    account = it->second;
    for (const auto& [user_name, user] : users_) {
      if (user.account() == name) {
        return absl::FailedPreconditionError(absl::StrCat(
            "name: user ", user_name, " belongs to account ", name, "; move its users first"));
      }
    }
  }
  WriteBatch batch;
  batch.delete_records.push_back({kAccountKind, name});
  RETURN_IF_ERROR(store_.CommitSync(std::move(batch)));
  absl::MutexLock lock(&mu_);
  accounts_.erase(name);
  sharing_.reset();
  return account;
}

std::vector<v1::Account> IdentityRegistry::ListAccounts() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Account> out;
  if (accounts_.count(kDefaultAccount) == 0) out.push_back(ImplicitDefaultAccount());
  for (const auto& [name, account] : accounts_) out.push_back(account);
  std::sort(out.begin(), out.end(),
            [](const v1::Account& a, const v1::Account& b) { return a.name() < b.name(); });
  return out;
}

absl::StatusOr<v1::Account> IdentityRegistry::GetAccount(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = accounts_.find(name);
  if (it != accounts_.end()) return it->second;
  if (name == kDefaultAccount) return ImplicitDefaultAccount();
  return absl::NotFoundError(absl::StrCat("no account ", name));
}

std::shared_ptr<const SharingPolicy> IdentityRegistry::Sharing() const {
  absl::MutexLock lock(&mu_);
  if (sharing_ != nullptr) return sharing_;
  auto built = std::make_shared<SharingPolicy>();
  SharingPolicy& policy = *built;
  policy.accounts[kDefaultAccount] = {};
  for (const auto& [name, a] : accounts_) {
    SharingPolicy::Account& out = policy.accounts[name];
    out.quota = a.has_quota_devices() ? a.quota_devices() : -1;
    out.borrow_limit = a.has_borrow_limit_devices() ? a.borrow_limit_devices() : -1;
    out.share = a.share() > 0 ? a.share() : 1;
  }
  for (const auto& [name, u] : users_) {
    SharingPolicy::User& out = policy.users[name];
    if (!u.account().empty()) out.account = u.account();
    out.max_running_devices = u.has_max_running_devices() ? u.max_running_devices() : -1;
    out.max_queued_jobs = u.has_max_queued_jobs() ? u.max_queued_jobs() : -1;
  }
  sharing_ = std::move(built);
  return sharing_;
}

}  // namespace trainyard::coordinator
