// RunAs: which Unix account runs a job's ranks on this worker. A worker running as root runs each
// rank as the account of the job's owner: the account named in the user map, else the account
// with the owner's name (as Slurm runs a job as the submitting uid), unless that is root or a
// system account (uid below 1000), which only the map may name. A worker not running as root
// can only run ranks as itself: it takes the jobs of the users mapped to its own account and of
// the user with its account's name, and says so when it registers (the scheduler places nothing
// else on it).
//
// The user map: one "USER ACCOUNT" pair per line; '#' starts a comment. Immutable once created;
// thread-safe.
#ifndef TRAINYARD_WORKER_DAEMON_RUN_AS_H_
#define TRAINYARD_WORKER_DAEMON_RUN_AS_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trainyard::worker {

struct UnixAccount {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary, as initgroups would set them
  std::string home;
  std::string shell;  // the login shell (passwd), "/bin/sh" when it names none
};

class RunAs {
 public:
  // `map_file` (empty: none); `as_root`: whether this process may switch accounts (geteuid() == 0;
  // a parameter for tests). INVALID_ARGUMENT naming --user-map and the line for a bad map.
  static absl::StatusOr<RunAs> Create(const std::string& map_file, bool as_root);

  // Whether ranks switch to their owner's account (a worker running as root).
  bool switches() const { return as_root_; }
  // Users whose jobs this worker takes; empty: any user's.
  std::vector<std::string> Owners() const;
  // The account that runs `user`'s ranks. FAILED_PRECONDITION, saying why, when there is none on
  // this host or this worker cannot run as it.
  absl::StatusOr<UnixAccount> AccountFor(const std::string& user) const;

 private:
  std::map<std::string, std::string> map_;  // trainyard user -> Unix account
  bool as_root_ = false;
  std::string self_;  // this process's account
};

// The account named `name` from the system's user database, with its groups; NOT_FOUND.
absl::StatusOr<UnixAccount> LookUpAccount(const std::string& name);

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_RUN_AS_H_
