// yard admin: users, accounts, tokens, nodes and backups (admins only; the coordinator checks).

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/local_cluster.h"
#include "client/output.h"
#include "client/verbs.h"
#include "client/yard_client.h"
#include "common/credentials.h"
#include "common/status_macros.h"

namespace trainyard::client {
namespace {

void PrintUsers(const Globals& g, const std::vector<v1::User>& users) {
  if (g.json()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& u : users) j.push_back(nlohmann::json::parse(ToJson(u)));
    std::cout << j.dump(1) << "\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& u : users) {
    rows.push_back({u.name(), RoleName(u.role()), u.disabled() ? "disabled" : "enabled",
                    u.account().empty() ? "default" : u.account(),
                    u.has_max_running_devices() ? absl::StrCat(u.max_running_devices()) : "-",
                    u.has_max_queued_jobs() ? absl::StrCat(u.max_queued_jobs()) : "-",
                    TimeOrDash(u.created_time_ms())});
  }
  std::cout << FormatTable(
      {"USER", "ROLE", "STATE", "ACCOUNT", "MAX_DEVICES", "MAX_QUEUED", "CREATED"}, rows);
}

int UserAdd(const Globals& g, const std::string& name, bool admin, const std::string& account) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto user = client.CreateUser(name, admin ? v1::ADMIN : v1::USER, account);
  if (!user.ok()) return Fail(user.status());
  PrintUsers(g, {*user});
  return 0;
}

// A limit flag's value: a count >= 0, or "none" (-1: no limit).
absl::StatusOr<int64_t> ParseLimit(const std::string& flag, const std::string& text) {
  int64_t value = 0;
  if (text == "none") return -1;
  if (absl::SimpleAtoi(text, &value) && value >= 0) return value;
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": expected a count >= 0 or 'none', got '", text, "'"));
}

int UserSet(const Globals& g, const UserSetArgs& a) {
  v1::UpdateUserRequest request;
  request.set_name(a.name);
  if (!a.account.empty()) request.set_account(a.account);
  if (!a.max_devices.empty()) {
    auto v = ParseLimit("--max-devices", a.max_devices);
    if (!v.ok()) return Fail(v.status());
    request.set_max_running_devices(*v);
  }
  if (!a.max_queued.empty()) {
    auto v = ParseLimit("--max-queued", a.max_queued);
    if (!v.ok()) return Fail(v.status());
    request.set_max_queued_jobs(*v);
  }
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto user = client.UpdateUser(request);
  if (!user.ok()) return Fail(user.status());
  PrintUsers(g, {*user});
  return 0;
}

void PrintAccounts(const Globals& g, const std::vector<v1::Account>& accounts) {
  if (g.json()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& a : accounts) j.push_back(nlohmann::json::parse(ToJson(a)));
    std::cout << j.dump(1) << "\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& a : accounts) {
    const auto [quota, borrow] = QuotaCells(a);
    rows.push_back({a.name(), quota, borrow, Share(a.share()), TimeOrDash(a.created_time_ms())});
  }
  std::cout << FormatTable({"ACCOUNT", "QUOTA", "BORROW_LIMIT", "SHARE", "CREATED"}, rows);
}

// Applies the flags given to `account` (a limit of "none" removes it).
absl::Status ApplyAccountArgs(const AccountArgs& a, v1::Account& account) {
  account.set_name(a.name);
  if (!a.quota.empty()) {
    ASSIGN_OR_RETURN(int64_t quota, ParseLimit("--quota", a.quota));
    if (quota < 0) {
      account.clear_quota_devices();
      account.clear_borrow_limit_devices();
    } else {
      account.set_quota_devices(quota);
    }
  }
  if (!a.borrow_limit.empty()) {
    ASSIGN_OR_RETURN(int64_t limit, ParseLimit("--borrow-limit", a.borrow_limit));
    if (limit < 0) {
      account.clear_borrow_limit_devices();
    } else {
      account.set_borrow_limit_devices(limit);
    }
  }
  if (!a.share.empty()) {
    double share = 0;
    if (!absl::SimpleAtod(a.share, &share) || !(share > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--share: expected a positive number, got '", a.share, "'"));
    }
    account.set_share(share);
  }
  return absl::OkStatus();
}

int AccountAdd(const Globals& g, const AccountArgs& a) {
  v1::Account account;
  if (absl::Status s = ApplyAccountArgs(a, account); !s.ok()) return Fail(s);
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto created = client.CreateAccount(account);
  if (!created.ok()) return Fail(created.status());
  PrintAccounts(g, {*created});
  return 0;
}

int AccountSet(const Globals& g, const AccountArgs& a) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto accounts = client.ListAccounts();
  if (!accounts.ok()) return Fail(accounts.status());
  v1::Account account;
  bool found = false;
  for (const v1::Account& existing : accounts->accounts()) {
    if (existing.name() == a.name) {
      account = existing;
      found = true;
    }
  }
  if (!found) return Fail(absl::NotFoundError(absl::StrCat("no account ", a.name)));
  if (absl::Status s = ApplyAccountArgs(a, account); !s.ok()) return Fail(s);
  auto updated = client.UpdateAccount(account);
  if (!updated.ok()) return Fail(updated.status());
  PrintAccounts(g, {*updated});
  return 0;
}

int AccountList(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto accounts = client.ListAccounts();
  if (!accounts.ok()) return Fail(accounts.status());
  PrintAccounts(g, {accounts->accounts().begin(), accounts->accounts().end()});
  return 0;
}

int AccountRemove(const Globals& g, const std::string& name) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto removed = client.DeleteAccount(name);
  if (!removed.ok()) return Fail(removed.status());
  std::cout << "deleted account " << removed->name() << "\n";
  return 0;
}

int UserList(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto users = client.ListUsers();
  if (!users.ok()) return Fail(users.status());
  PrintUsers(g, {users->users().begin(), users->users().end()});
  return 0;
}

int UserDisable(const Globals& g, const std::string& name, bool enable) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto user = client.DisableUser(name, enable);
  if (!user.ok()) return Fail(user.status());
  PrintUsers(g, {*user});
  return 0;
}

// Prints the new token once (or, with --out, writes it to a 0600 file and prints its id).
int TokenCreate(const Globals& g, const TokenCreateArgs& a) {
  v1::CreateTokenRequest request;
  request.set_user(a.user);
  request.set_node(a.node);
  request.set_description(a.description);
  for (const std::string& owner : a.owners) request.add_owners(owner);
  if (!a.ttl.empty()) {
    absl::Duration ttl;
    if (!absl::ParseDuration(a.ttl, &ttl) || ttl <= absl::ZeroDuration()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--ttl: not a positive duration (e.g. 720h): ", a.ttl)));
    }
    request.set_ttl_seconds(absl::ToInt64Seconds(ttl));
  }
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto created = client.CreateToken(request);
  if (!created.ok()) return Fail(created.status());
  if (!a.out.empty()) {
    if (absl::Status s = WriteSecretFile(a.out, created->token()); !s.ok()) return Fail(s);
  }
  if (g.json()) {
    nlohmann::json j = nlohmann::json::parse(ToJson(created->info()));
    if (a.out.empty()) j["token"] = created->token();
    std::cout << j.dump(1) << "\n";
  } else if (a.out.empty()) {
    std::cout << created->token() << "\n";
    std::cerr << "token " << created->info().id() << " for "
              << (a.node.empty() ? created->info().user() : "node " + a.node)
              << ": shown this once; keep it in a file only you can read (yard login < FILE)\n";
  } else {
    std::cout << created->info().id() << "\n";
  }
  return 0;
}

int TokenList(const Globals& g, const std::string& user, bool all) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto tokens = client.ListTokens(user, all);
  if (!tokens.ok()) return Fail(tokens.status());
  if (g.json()) {
    std::cout << ToJson(*tokens);
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  const int64_t now = NowMs();
  for (const auto& t : tokens->tokens()) {
    std::string state = "valid";
    if (t.revoked()) {
      state = "revoked";
    } else if (t.expires_time_ms() != 0 && t.expires_time_ms() <= now) {
      state = "expired";
    }
    rows.push_back({t.id(), t.user(), t.node().empty() ? "-" : t.node(), state,
                    TimeOrDash(t.created_time_ms()), TimeOrDash(t.expires_time_ms()),
                    t.description().empty() ? "-" : t.description()});
  }
  std::cout << FormatTable({"ID", "USER", "NODE", "STATE", "CREATED", "EXPIRES", "DESCRIPTION"},
                           rows);
  return 0;
}

int TokenRevoke(const Globals& g, const std::string& id) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto token = client.RevokeToken(id);
  if (!token.ok()) return Fail(token.status());
  if (g.json()) {
    std::cout << ToJson(*token);
  } else {
    std::cout << "revoked " << token->id() << "\n";
  }
  return 0;
}

int NodeDeny(const Globals& g, const std::string& node, const std::string& reason, bool allow) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto denied = client.DenyNode(node, reason, allow);
  if (!denied.ok()) return Fail(denied.status());
  if (g.json()) {
    std::cout << ToJson(*denied);
  } else {
    std::cout << (allow ? "allowed " : "denied ") << node << "\n";
  }
  return 0;
}

int NodeDeniedList(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto denied = client.ListDeniedNodes();
  if (!denied.ok()) return Fail(denied.status());
  if (g.json()) {
    std::cout << ToJson(*denied);
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& n : denied->nodes()) {
    rows.push_back({n.node(), n.denied_by(), TimeOrDash(n.denied_time_ms()),
                    n.reason().empty() ? "-" : n.reason()});
  }
  std::cout << FormatTable({"NODE", "DENIED BY", "SINCE", "REASON"}, rows);
  return 0;
}

// `yard admin node cordon|uncordon|drain`; with `wait`, a drain returns once the node runs no
// ranks (exit 3 after `timeout`).
int NodeCordon(const Globals& g, const std::string& node, v1::CordonAction action,
               const std::string& reason, bool wait, const std::string& timeout_text) {
  absl::Duration timeout;
  if (!absl::ParseDuration(timeout_text, &timeout) || timeout <= absl::ZeroDuration()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--timeout: expected a duration such as 10m, got '", timeout_text, "'")));
  }
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto done = client.CordonNode(node, action, reason);
  if (!done.ok()) return Fail(done.status());
  if (g.json() && !wait) {
    std::cout << ToJson(*done);
    return 0;
  }
  if (!g.json()) {
    const char* verb = action == v1::UNCORDON ? "uncordoned"
                       : action == v1::DRAIN  ? "draining"
                                              : "cordoned";
    std::cout << verb << " " << node;
    if (action == v1::DRAIN) {
      std::cout << ": "
                << (done->moving_jobs().empty()
                        ? std::string("no running job to move")
                        : absl::StrCat("moving ", absl::StrJoin(done->moving_jobs(), ", ")));
    }
    std::cout << "\n" << std::flush;
  }
  if (!wait || action != v1::DRAIN) return 0;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    auto nodes = client.ListNodes();
    if (!nodes.ok()) return Fail(nodes.status());
    for (const v1::Node& n : nodes->nodes()) {
      if (n.id() != node) continue;
      if (n.allocated_devices().empty()) {
        if (g.json()) {
          std::cout << ToJson(n);
        } else {
          std::cout << "drained " << node << ": it runs no ranks\n";
        }
        return 0;
      }
    }
    if (absl::Now() >= deadline) {
      std::cerr << "yard: " << node << " still runs ranks after " << timeout_text
                << " (DEADLINE_EXCEEDED)\n";
      return 3;
    }
    absl::SleepFor(absl::Milliseconds(500));  // kubectl drain polls as well
  }
}

// admin node cordon, uncordon, drain.
void AddCordonVerbs(CLI::App* node_cmd, Cli& c) {
  Globals& g = c.g;
  int& rc = c.rc;
  VerbArgs& a = c.args;
  auto& node_name = a.node_name;
  auto& node_reason = a.node_reason;
  auto* cordon =
      node_cmd->add_subcommand("cordon", "take no new ranks on a node (running ones go on)");
  cordon->add_option("node", node_name, "node id")->required();
  cordon->add_option("--reason", node_reason, "shown by yard nodes");
  cordon->callback([&] { rc = NodeCordon(g, node_name, v1::CORDON, node_reason, false, "1s"); });
  auto* uncordon =
      node_cmd->add_subcommand("uncordon", "let a cordoned or drained node take ranks");
  uncordon->add_option("node", node_name, "node id")->required();
  uncordon->callback([&] { rc = NodeCordon(g, node_name, v1::UNCORDON, "", false, "1s"); });
  auto* drain = node_cmd->add_subcommand(
      "drain",
      "cordon a node and move its running jobs: each checkpoints, stops and is requeued "
      "elsewhere (as a preemption)");
  drain->add_option("node", node_name, "node id")->required();
  drain->add_option("--reason", node_reason, "shown by yard nodes");
  drain->add_flag("--wait", a.drain_wait, "return once the node runs no ranks");
  drain->add_option("--timeout", a.drain_timeout, "with --wait: how long (exit 3 after it)")
      ->capture_default_str();
  drain->callback([&] {
    rc = NodeCordon(g, node_name, v1::DRAIN, node_reason, a.drain_wait, a.drain_timeout);
  });
}

}  // namespace

// yard admin backup: the coordinator's state into `out` (which must not exist), written as
// .NAME.part beside it (mode 0600: it holds every user's token hashes), synced, then renamed.
int Backup(const Globals& g, const std::string& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(out, ec) || fs::is_symlink(out, ec)) {
    return Fail(absl::FailedPreconditionError(absl::StrCat("--out: '", out, "' exists")));
  }
  const fs::path target(out);
  const std::string part =
      (target.parent_path() / ("." + target.filename().string() + ".part")).string();
  const int fd = ::open(part.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    return Fail(absl::InternalError(
        absl::StrCat("--out: cannot create '", part, "': ", std::strerror(errno))));
  }
  int64_t written = 0, size = -1;
  YardClient client(g.coordinator, g.Token(), g.tls);
  absl::Status s = client.Backup([&](const v1::BackupChunk& c) {
    if (size < 0) size = c.total_size();
    if (c.total_size() != size || c.offset() != written ||
        written + static_cast<int64_t>(c.data().size()) > size) {
      return absl::DataLossError("the coordinator sent the backup out of order");
    }
    for (size_t done = 0; done < c.data().size();) {
      const ssize_t n = ::write(fd, c.data().data() + done, c.data().size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        return absl::InternalError(
            absl::StrCat("cannot write '", part, "': ", std::strerror(errno)));
      }
      done += static_cast<size_t>(n);
    }
    written += static_cast<int64_t>(c.data().size());
    return absl::OkStatus();
  });
  if (s.ok() && written != size) {
    s = absl::DataLossError(absl::StrCat("the backup ended at ", written, " of ", size, " bytes"));
  }
  if (s.ok() && ::fsync(fd) != 0) {
    s = absl::InternalError(absl::StrCat("cannot sync '", part, "': ", std::strerror(errno)));
  }
  ::close(fd);
  if (s.ok()) {
    fs::rename(part, out, ec);
    if (ec) s = absl::InternalError(absl::StrCat("cannot rename '", part, "': ", ec.message()));
  }
  if (!s.ok()) {
    fs::remove(part, ec);
    return Fail(s);
  }
  if (g.json()) {
    std::cout << nlohmann::json({{"file", out}, {"bytes", written}}).dump(1) << "\n";
  } else {
    std::cout << "backed up the coordinator's state, " << HumanBytes(written) << ", into " << out
              << "\n";
  }
  return 0;
}

// admin: users, accounts, tokens, nodes.
void AddAdminVerbs(CLI::App& app, Cli& c) {
  Globals& g = c.g;
  int& rc = c.rc;
  VerbArgs& a = c.args;
  auto* admin = app.add_subcommand(
      "admin", "users, accounts, tokens, nodes and backups (admins; a user: its own tokens)");
  admin->require_subcommand(1);
  auto* user_cmd = admin->add_subcommand("user", "users of the cluster (admins)");
  user_cmd->require_subcommand(1);
  auto& name = a.name;
  auto& as_admin = a.as_admin;
  auto& enable = a.enable;
  auto& user_account = a.user_account;
  auto* user_add = user_cmd->add_subcommand("add", "create a user");
  user_add->add_option("name", name, "user name, like a Unix account")->required();
  user_add->add_flag("--admin", as_admin, "an admin: sees and controls every job");
  user_add->add_option("--account", user_account, "the account its jobs are charged to")
      ->default_str("default");
  user_add->callback([&] { rc = UserAdd(g, name, as_admin, user_account); });
  auto& user_set_args = a.user_set_args;
  auto* user_set = user_cmd->add_subcommand("set", "change a user's account and caps");
  user_set->add_option("name", user_set_args.name, "user name")->required();
  user_set->add_option("--account", user_set_args.account, "move the user to this account");
  user_set->add_option("--max-devices", user_set_args.max_devices,
                       "cap on the devices its running jobs hold together ('none': no cap)");
  user_set->add_option("--max-queued", user_set_args.max_queued,
                       "cap on its queued jobs; more are refused at submit ('none': no cap)");
  user_set->callback([&] { rc = UserSet(g, user_set_args); });
  auto* user_ls = user_cmd->add_subcommand("ls", "list users");
  user_ls->callback([&] { rc = UserList(g); });
  auto* user_disable =
      user_cmd->add_subcommand("disable", "refuse every token of a user (--enable: lift it)");
  user_disable->add_option("name", name, "user name")->required();
  user_disable->add_flag("--enable", enable, "enable the user again");
  user_disable->callback([&] { rc = UserDisable(g, name, enable); });

  auto* account_cmd = admin->add_subcommand(
      "account", "accounts (teams): quotas and fair shares (admins; ls: any user)");
  account_cmd->require_subcommand(1);
  auto& account_args = a.account_args;
  auto add_account_flags = [&](CLI::App* cmd) {
    cmd->add_option("name", account_args.name, "account name, like a Unix account")->required();
    cmd->add_option("--quota", account_args.quota,
                    "devices guaranteed to the account ('none': no quota)");
    cmd->add_option("--borrow-limit", account_args.borrow_limit,
                    "devices it may borrow beyond its quota while idle ('none': any)");
    cmd->add_option("--share", account_args.share,
                    "fair-share weight: among jobs of equal priority, the account furthest below "
                    "its share goes first (default 1)");
  };
  auto* account_add = account_cmd->add_subcommand("add", "create an account");
  add_account_flags(account_add);
  account_add->callback([&] { rc = AccountAdd(g, account_args); });
  auto* account_set = account_cmd->add_subcommand("set", "change an account's quota or share");
  add_account_flags(account_set);
  account_set->callback([&] { rc = AccountSet(g, account_args); });
  auto* account_ls = account_cmd->add_subcommand("ls", "list accounts");
  account_ls->callback([&] { rc = AccountList(g); });
  auto* account_rm = account_cmd->add_subcommand("rm", "delete an account that has no users");
  account_rm->add_option("name", name, "account name")->required();
  account_rm->callback([&] { rc = AccountRemove(g, name); });

  auto* token_cmd = admin->add_subcommand("token", "API tokens and node tokens");
  token_cmd->require_subcommand(1);
  auto& token_args = a.token_args;
  auto* token_create = token_cmd->add_subcommand(
      "create", "create a token and print it once (yours; --user or --node: admins)");
  token_create->add_option("--user", token_args.user, "for this user (default: you)");
  token_create->add_option("--node", token_args.node,
                           "a node token for this node name (workers, parameter servers)");
  token_create->add_option("--ttl", token_args.ttl, "expires after this long (e.g. 720h)");
  token_create
      ->add_option("--owners", token_args.owners,
                   "with --node: the users whose jobs that node may take (a worker not "
                   "running as root); default any")
      ->delimiter(',');
  token_create->add_option("--description", token_args.description, "shown by ls");
  token_create->add_option("--out", token_args.out,
                           "write it to this file (mode 0600) instead of printing it");
  token_create->callback([&] { rc = TokenCreate(g, token_args); });
  auto& token_user = a.token_user;
  auto& token_id = a.token_id;
  auto& all_tokens = a.all_tokens;
  auto* token_ls = token_cmd->add_subcommand("ls", "list tokens (never their secrets)");
  token_ls->add_option("--user", token_user, "this user's (admins)");
  token_ls->add_flag("--all", all_tokens, "every user's (admins)");
  token_ls->callback([&] { rc = TokenList(g, token_user, all_tokens); });
  auto* token_revoke = token_cmd->add_subcommand("revoke", "revoke a token by its id");
  token_revoke->add_option("id", token_id, "token id (from ls)")->required();
  token_revoke->callback([&] { rc = TokenRevoke(g, token_id); });

  auto* node_cmd = admin->add_subcommand(
      "node",
      "cordon, drain or uncordon a node; deny a node (a token or certificate it holds no longer "
      "counts) or lift it");
  node_cmd->require_subcommand(1);
  auto& node_name = a.node_name;
  auto& node_reason = a.node_reason;
  auto* node_deny = node_cmd->add_subcommand(
      "deny", "refuse a node's calls and end its session (its ranks' jobs restart elsewhere)");
  node_deny->add_option("node", node_name, "node id")->required();
  node_deny->add_option("--reason", node_reason, "shown by ls");
  node_deny->callback([&] { rc = NodeDeny(g, node_name, node_reason, false); });
  auto* node_allow = node_cmd->add_subcommand("allow", "lift a node's denial");
  node_allow->add_option("node", node_name, "node id")->required();
  node_allow->callback([&] { rc = NodeDeny(g, node_name, "", true); });
  auto* node_ls = node_cmd->add_subcommand("ls", "list denied nodes");
  node_ls->callback([&] { rc = NodeDeniedList(g); });
  AddCordonVerbs(node_cmd, c);

  auto* backup = admin->add_subcommand(
      "backup",
      "a consistent copy of the coordinator's state, taken while it serves (admins); restore "
      "with trainyard-coordinator --restore FILE on an empty state directory");
  backup->add_option("--out", a.out_dir, "the file to write (must not exist)")->required();
  backup->callback([&] { rc = Backup(g, a.out_dir); });
}

}  // namespace trainyard::client
