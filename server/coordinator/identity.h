// IdentityRegistry: the coordinator's users, accounts and API tokens (durable, in the JobStore as
// "user", "account" and "token" records), and the key that signs job credentials (a file in the
// state directory). It
// turns the credential of a call into a Principal; the gRPC adapters decide what that principal
// may do (services.cc). Tokens are kept only as the SHA-256 of their secret.
//
// Thread-safe. Mutations are written to the store before they take effect (CommitSync, so never
// call them on the store's commit thread); a failed write changes nothing.
#ifndef TRAINYARD_SERVER_COORDINATOR_IDENTITY_H_
#define TRAINYARD_SERVER_COORDINATOR_IDENTITY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/credentials.h"
#include "common/host_port.h"
#include "server/coordinator/auth_throttle.h"
#include "server/coordinator/job_store.h"
#include "server/coordinator/sharing_policy.h"
#include "trainyard/v1/identity.pb.h"

namespace trainyard::coordinator {

// Who makes a call.
struct Principal {
  enum class Kind { kUser, kNode, kJob };
  Kind kind = Kind::kUser;
  std::string user;  // kUser: the user; kNode: the user the node token was issued by
  v1::Role role = v1::USER;
  std::string node;                      // kNode
  std::string job_id;                    // kJob
  int32_t attempt = 0;                   // kJob
  std::string token_id;                  // kUser, kNode
  std::vector<std::string> node_owners;  // kNode: whose jobs it may take (empty: any)

  bool IsAdmin() const { return kind == Kind::kUser && role == v1::ADMIN; }
  // "user alice", "admin root", "node w1", "job job-3 attempt 1": for messages and the audit log.
  std::string Describe() const;
};

class IdentityRegistry {
 public:
  // `job_key` signs job credentials (MakeJobCredential).
  IdentityRegistry(JobStore& store, const Clock& clock, std::string job_key);

  // Loads users and tokens saved by an earlier run (before serving). DATA_LOSS for an
  // unreadable record.
  absl::Status Load();
  // With no user at all, creates the user "admin" (ADMIN) and a token for it, and returns the
  // token's text (to be written where only the coordinator's account can read it); nullopt when
  // users exist.
  absl::StatusOr<std::optional<std::string>> BootstrapAdmin();

  // The principal of `credential` (a token's text or a job credential). UNAUTHENTICATED, with
  // what was wrong (malformed, unknown, wrong secret, expired, revoked, user disabled or gone),
  // never echoing the secret.
  // `guess`, when given, is set to whether the failure looks like guessing (a malformed
  // credential, an unknown token id, a wrong secret, a job credential this coordinator did not
  // sign) rather than a stale credential (expired, revoked, user disabled or gone).
  absl::StatusOr<Principal> Authenticate(absl::string_view credential, bool* guess = nullptr) const;
  // Authenticate for a call from `peer` (an address without its port), with failures throttled:
  // a valid credential is always taken; a guess is counted against the peer and, for a wrong
  // secret, against the token id (SetAuthThrottle), and once either has used up its failures
  // the guesses are answered RESOURCE_EXHAUSTED instead of UNAUTHENTICATED. `on_failure` (if
  // set) hears of every refusal: "throttled", "guess" or "stale".
  absl::StatusOr<Principal> AuthenticateFrom(absl::string_view credential,
                                             const std::string& peer) const;
  // Before serving. Burst <= 0 turns that throttle off. `peer_ipv6_prefix`: the bits of an IPv6
  // peer's address that name its client (ClientOf).
  void SetAuthThrottle(AuthThrottleOptions per_token, AuthThrottleOptions per_peer,
                       int peer_ipv6_prefix = 64);
  // The client an address stands for, the peer AuthenticateFrom counts its failures under: its
  // IPv4 address, or its IPv6 network of SetAuthThrottle's prefix (common/host_port.h).
  std::string ClientOf(absl::string_view address) const {
    return ClientOfAddress(address, peer_ipv6_prefix_);
  }
  // The web console's key (before serving; empty: no console): a call that shows it names the
  // browser it is made for, whose address AuthenticateFrom's peer is then.
  void SetConsoleKey(std::string key) { console_key_ = std::move(key); }
  bool IsConsoleKey(absl::string_view key) const {
    return !console_key_.empty() && ConstantTimeEquals(key, console_key_);
  }
  void SetAuthFailureObserver(std::function<void(const char* reason)> on_failure) {
    on_auth_failure_ = std::move(on_failure);
  }
  // API tokens a user may hold at once (unrevoked, unexpired; node tokens are not counted);
  // CreateToken refuses more with
  // RESOURCE_EXHAUSTED naming the cap. Negative: no cap. Before serving.
  void SetMaxTokensPerUser(int64_t max_tokens) { max_tokens_per_user_ = max_tokens; }

  // INVALID_ARGUMENT for a bad name or role, ALREADY_EXISTS for a taken name, NOT_FOUND for an
  // unknown account (empty: the default account).
  absl::StatusOr<v1::User> CreateUser(const std::string& name, v1::Role role,
                                      const std::string& account = "");
  // Sets the account and caps given in `request` (a negative cap removes it). NOT_FOUND for an
  // unknown user or account, INVALID_ARGUMENT for a bad account name.
  absl::StatusOr<v1::User> UpdateUser(const v1::UpdateUserRequest& request);

  // Accounts. INVALID_ARGUMENT naming the field (name, negative quota or borrow limit, a borrow
  // limit without quota, share not positive and finite), ALREADY_EXISTS, NOT_FOUND.
  absl::StatusOr<v1::Account> CreateAccount(v1::Account account);
  absl::StatusOr<v1::Account> UpdateAccount(v1::Account account);  // replaces its settings
  // FAILED_PRECONDITION while users belong to it, or for the default account.
  absl::StatusOr<v1::Account> DeleteAccount(const std::string& name);
  std::vector<v1::Account> ListAccounts() const;  // by name, "default" included
  absl::StatusOr<v1::Account> GetAccount(const std::string& name) const;  // NOT_FOUND
  // Every account's and user's sharing settings, for the scheduler: built once after each change
  // of users or accounts and shared (read at every submission, scheduling pass and tick).
  std::shared_ptr<const SharingPolicy> Sharing() const;
  // Says which unfinished job (if any, else "") is charged to an account: DeleteAccount refuses
  // such an account (set once, before serving; called without the registry's read lock).
  void SetAccountInUse(std::function<std::string(const std::string&)> in_use) {
    account_in_use_ = std::move(in_use);
  }
  std::vector<v1::User> ListUsers() const;  // by name
  // NOT_FOUND; FAILED_PRECONDITION when it would disable the last enabled admin.
  absl::StatusOr<v1::User> SetDisabled(const std::string& name, bool disabled);
  absl::StatusOr<v1::User> GetUser(const std::string& name) const;

  struct NewToken {
    std::string text;  // the whole secret, shown once
    v1::TokenInfo info;
  };
  // A token of `user` (node tokens: bound to `node`, limited to `node_owners`' jobs when not
  // empty). NOT_FOUND for an unknown user, INVALID_ARGUMENT for a bad node name, owner or ttl.
  absl::StatusOr<NewToken> CreateToken(const std::string& user, const std::string& node,
                                       int64_t ttl_seconds, const std::string& description,
                                       const std::vector<std::string>& node_owners = {});
  // Every token of `user` (empty: every user's), by creation time.
  std::vector<v1::TokenInfo> ListTokens(const std::string& user) const;
  absl::StatusOr<v1::TokenInfo> GetToken(const std::string& id) const;  // NOT_FOUND
  // Revokes it (revoking twice is not an error); NOT_FOUND.
  absl::StatusOr<v1::TokenInfo> RevokeToken(const std::string& id);

  // Node denials ("denied_node" records). DenyNode replaces an earlier denial's reason; allowing
  // a node that is not denied is not an error. INVALID_ARGUMENT for a malformed node name.
  absl::StatusOr<v1::DeniedNode> DenyNode(const std::string& node, const std::string& reason,
                                          const std::string& by);
  absl::Status AllowNode(const std::string& node);
  bool IsNodeDenied(const std::string& node) const;
  std::vector<v1::DeniedNode> ListDeniedNodes() const;

  // The credential of one attempt of a job, for its ranks.
  std::string JobCredentialFor(const std::string& job_id, int32_t attempt) const;

 private:
  absl::Status Persist(const std::vector<StoredRecord>& records);

  JobStore& store_;
  const Clock& clock_;
  const std::string job_key_;
  std::function<std::string(const std::string&)> account_in_use_;  // set before serving
  std::function<void(const char*)> on_auth_failure_;               // set before serving
  std::string console_key_;                                        // set before serving
  std::unique_ptr<AuthThrottle> token_throttle_;                   // set before serving
  std::unique_ptr<AuthThrottle> peer_throttle_;                    // set before serving
  int peer_ipv6_prefix_ = 64;                                      // set before serving
  int64_t max_tokens_per_user_ = 100;

  absl::Mutex write_mu_;  // serializes mutations: check, write to the store, apply
  mutable absl::Mutex mu_;
  std::map<std::string, v1::User> users_ ABSL_GUARDED_BY(mu_);                 // by name
  std::map<std::string, v1::Account> accounts_ ABSL_GUARDED_BY(mu_);           // by name
  mutable std::shared_ptr<const SharingPolicy> sharing_ ABSL_GUARDED_BY(mu_);  // null: stale
  std::map<std::string, v1::StoredToken> tokens_ ABSL_GUARDED_BY(mu_);         // by id
  std::map<std::string, v1::DeniedNode> denied_nodes_ ABSL_GUARDED_BY(mu_);    // by node
};

// A user name has a Unix account name's shape, "[a-z_][a-z0-9_.-]{0,31}"; a node name a
// hostname's, "[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}". INVALID_ARGUMENT naming `field`.
absl::Status CheckUserName(const std::string& field, const std::string& name);
absl::Status CheckNodeName(const std::string& field, const std::string& name);

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_IDENTITY_H_
