#include "worker/daemon/run_as.h"

#include <grp.h>
#include <pwd.h>
#include <unistd.h>

#include <fstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace trainyard::worker {
namespace {

// Debian's UID_MIN: below it, root and system accounts.
constexpr uid_t kFirstUserUid = 1000;

}  // namespace

absl::StatusOr<UnixAccount> LookUpAccount(const std::string& name) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    return absl::NotFoundError(absl::StrCat("no Unix account ", name));
  }
  UnixAccount a;
  a.name = name;
  a.uid = pw.pw_uid;
  a.gid = pw.pw_gid;
  a.home = pw.pw_dir != nullptr ? pw.pw_dir : "/";
  a.shell = pw.pw_shell != nullptr && pw.pw_shell[0] != '\0' ? pw.pw_shell : "/bin/sh";
  int count = 64;
  a.groups.resize(count);
  while (getgrouplist(name.c_str(), a.gid, a.groups.data(), &count) < 0) {
    a.groups.resize(count);
  }
  a.groups.resize(count);
  return a;
}

absl::StatusOr<RunAs> RunAs::Create(const std::string& map_file, bool as_root) {
  RunAs r;
  r.as_root_ = as_root;
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwuid_r(geteuid(), &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    r.self_ = pw.pw_name;
  }
  if (map_file.empty()) return r;
  std::ifstream in(map_file);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--user-map: cannot read ", map_file));
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    absl::string_view text = line;
    text = text.substr(0, text.find('#'));
    std::vector<absl::string_view> fields =
        absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipWhitespace());
    if (fields.empty()) continue;
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("--user-map: ", map_file, ":", number, ": expected \"USER ACCOUNT\""));
    }
    r.map_[std::string(fields[0])] = std::string(fields[1]);
  }
  return r;
}

std::vector<std::string> RunAs::Owners() const {
  if (as_root_) return {};
  std::vector<std::string> owners;
  if (!map_.count(self_) || map_.at(self_) == self_) owners.push_back(self_);
  for (const auto& [user, account] : map_) {
    if (account == self_ && user != self_) owners.push_back(user);
  }
  return owners;
}

absl::StatusOr<UnixAccount> RunAs::AccountFor(const std::string& user) const {
  auto mapped = map_.find(user);
  const std::string name = mapped != map_.end() ? mapped->second : user;
  if (!as_root_) {
    if (name != self_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this worker runs as ", self_, ", not as root, and runs only its own account's jobs; ",
          user, "'s would run as ", name));
    }
    return LookUpAccount(self_);
  }
  auto account = LookUpAccount(name);
  if (!account.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no Unix account ", name, " for user ", user,
                     " on this worker (map the user to one with trainyard-worker --user-map)"));
  }
  // A name alone never leads to root or a system account (a trainyard user called "root" or
  // "daemon"): only the user map may.
  if (mapped == map_.end() && account->uid < kFirstUserUid) {
    return absl::FailedPreconditionError(
        absl::StrCat("the Unix account ", name, " of user ", user, " has uid ", account->uid,
                     ", a system account: ranks run as one only when --user-map names it"));
  }
  return account;
}

}  // namespace trainyard::worker
