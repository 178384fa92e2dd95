// Tokens of an in-process coordinator, made directly in its IdentityRegistry and cached by name:
// users (created on first use), node tokens (issued by the first admin) and job credentials.
#ifndef TRAINYARD_TESTS_TESTING_COORDINATOR_TOKENS_H_
#define TRAINYARD_TESTS_TESTING_COORDINATOR_TOKENS_H_

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "server/coordinator/identity.h"

namespace trainyard::testing {

class CoordinatorTokens {
 public:
  explicit CoordinatorTokens(coordinator::IdentityRegistry& identities) : identities_(identities) {}

  // A token of user `name` (an ADMIN when `role` says so; the role counts on first use only).
  const std::string& User(const std::string& name, v1::Role role = v1::USER) {
    auto it = users_.find(name);
    if (it != users_.end()) return it->second;
    if (!identities_.GetUser(name).ok()) {
      auto created = identities_.CreateUser(name, role);
      EXPECT_TRUE(created.ok()) << created.status();
    }
    auto token = identities_.CreateToken(name, "", 0, "test");
    EXPECT_TRUE(token.ok()) << token.status();
    return users_[name] = token.ok() ? token->text : std::string();
  }

  // A node token for `node`, issued by the user "admin".
  const std::string& Node(const std::string& node) {
    auto it = nodes_.find(node);
    if (it != nodes_.end()) return it->second;
    auto token = identities_.CreateToken("admin", node, 0, "test node");
    EXPECT_TRUE(token.ok()) << token.status();
    return nodes_[node] = token.ok() ? token->text : std::string();
  }

  std::string Job(const std::string& job_id, int attempt) const {
    return identities_.JobCredentialFor(job_id, attempt);
  }

 private:
  coordinator::IdentityRegistry& identities_;
  std::map<std::string, std::string> users_;
  std::map<std::string, std::string> nodes_;
};

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_COORDINATOR_TOKENS_H_
