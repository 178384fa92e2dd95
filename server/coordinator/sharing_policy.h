// What the scheduler needs to know of accounts and users to share the cluster: each account's
// quota, borrow limit and fair share, each user's account and caps. Made by the IdentityRegistry
// (which keeps them durably) and read by the JobManager at each scheduling pass and submission.
#ifndef TRAINYARD_SERVER_COORDINATOR_SHARING_POLICY_H_
#define TRAINYARD_SERVER_COORDINATOR_SHARING_POLICY_H_

#include <cstdint>
#include <map>
#include <string>

namespace trainyard::coordinator {

inline constexpr char kDefaultAccount[] = "default";

struct SharingPolicy {
  struct Account {
    int64_t quota = -1;         // devices guaranteed; negative: no quota
    int64_t borrow_limit = -1;  // devices beyond the quota; negative: no limit
    double share = 1;           // fair-share weight
  };
  struct User {
    std::string account = kDefaultAccount;
    int64_t max_running_devices = -1;  // negative: no cap
    int64_t max_queued_jobs = -1;      // negative: no cap
  };
  std::map<std::string, Account> accounts;  // by name; always has kDefaultAccount
  std::map<std::string, User> users;        // by name

  // A user's limits (a user not listed: the default account, no caps).
  User UserOf(const std::string& name) const {
    const auto it = users.find(name);
    return it == users.end() ? User{} : it->second;
  }
  // An account's settings (one not listed: no quota, share 1).
  Account AccountOf(const std::string& name) const {
    const auto it = accounts.find(name);
    return it == accounts.end() ? Account{} : it->second;
  }
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_SHARING_POLICY_H_
