// yard's verbs, one file per group: job_verbs.cc (submit, ls, describe, cancel, wait, logs,
// metrics, checkpoint, fetch, estimate-memory, nodes), identity_verbs.cc (login, whoami, quota),
// admin_verbs.cc (users, accounts, tokens, denied nodes), local_verbs.cc (yard local). main.cc
// parses the global flags and hands the app to each group's Add*Verbs.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/local_cluster.h"
#include "client/yard_client.h"
#include "common/credentials.h"
#include "common/tls.h"

namespace trainyard::client {

// The shared helpers of the verbs.
std::string DefaultTokenFile();
std::string DefaultCoordinator();
std::string DefaultLocalStateDir();
// Prints "yard: <message> (<CODE>)" on stderr, the message TerminalSafe, and returns 1.
int Fail(const absl::Status& s);
// `text` with its control characters (C0 but tab, DEL, and C1 encoded as UTF-8) written as
// escapes: text a job or its owner wrote, before it reaches a terminal.
std::string TerminalSafe(const std::string& text);
int64_t NowMs();
std::string RoleName(v1::Role role);
// "YYYY-MM-DD HH:MM:SS" local time, or "-" for 0.
std::string TimeOrDash(int64_t unix_ms);
std::string Share(double share);

struct Globals {
  std::string coordinator;
  std::string output = "table";
  std::string token_file;  // --token-file, env TRAINYARD_TOKEN_FILE
  TlsClientOptions tls;    // --tls-ca, env TRAINYARD_TLS_CA
  bool json() const { return output == "json"; }
  // --token-file, else $TRAINYARD_TOKEN, else the saved one.
  absl::StatusOr<std::string> Token() const { return FindToken(token_file, DefaultTokenFile()); }
};

struct UserSetArgs {
  std::string name, account, max_devices, max_queued;
};

struct AccountArgs {
  std::string name, quota, borrow_limit, share;
};

struct TokenCreateArgs {
  std::string user, node, ttl, description, out;
  std::vector<std::string> owners;
};

// The values of every verb's options and arguments: CLI11 writes them as it parses, after the
// Add*Verbs functions have returned, and the verbs' callbacks read them.
// `yard submit`'s flags that build or change a spec: from a spec file, over it; without one
// (a program after --), the whole spec.
struct SubmitFlags {
  std::vector<std::string> command;   // what follows `--` on yard's command line
  int slots = 0;                      // --gpus/--slots; 0: not given
  int nodes = 0, ranks_per_node = 0;  // --nodes, --ranks-per-node; 0: not given
  double cpus = 0;                    // 0: not given
  std::string memory, name, workdir, description;
  std::string context;             // --context DIR: uploaded, unpacked on each node
  std::vector<std::string> env;    // NAME=VALUE, or NAME: its value in yard's environment
  std::vector<std::string> after;  // job ids (7 or job-7)
  std::string array;               // "0-15%4", "1,3,5-7": one job per index
  int priority = 0, max_restarts = -1;
};

struct VerbArgs {
  std::string spec_path, job_id, reason, timeout, owner;
  std::vector<std::string> job_ids;  // yard cancel's
  SubmitFlags submit;
  std::string signal;
  std::string array;  // yard ls / cancel --array
  std::vector<std::string> states;
  int limit = 0;
  bool follow = false;
  int tail = 0;
  bool raw = false;  // yard logs --raw
  std::string out_dir;
  int world = 0, per_node = 0;
  std::string device_memory;
  std::string save_to = DefaultTokenFile();
  std::string quota_user;
  bool quota_all = false;
  std::string name;
  bool as_admin = false, enable = false;
  std::string user_account;
  UserSetArgs user_set_args;
  AccountArgs account_args;
  TokenCreateArgs token_args;
  std::string token_user, token_id;
  bool all_tokens = false;
  std::string node_name, node_reason;
  bool drain_wait = false;
  std::string drain_timeout = "10m";
  LocalUpOptions up_options;
  bool up_preemption = false;
  std::string up_preemption_grace, up_min_run_time;
  std::vector<std::string> up_run_as;  // yard local up --run-as USER=ACCOUNT
  std::string web_url;                 // yard web --url
  std::string web_state_dir;           // yard web --state-dir
};

struct Cli {
  Globals g;
  VerbArgs args;
  int rc = 0;  // the verb's exit code
};

// An account's QUOTA and BORROW_LIMIT cells (v1::Account and v1::AccountUsage name them alike).
template <typename A>
std::pair<std::string, std::string> QuotaCells(const A& a) {
  if (!a.has_quota_devices()) return {"-", "-"};
  return {absl::StrCat(a.quota_devices()),
          a.has_borrow_limit_devices() ? absl::StrCat(a.borrow_limit_devices()) : "any"};
}

// Each adds its group's verbs to `app`; their callbacks read `c.args` and set `c.rc`.
void AddJobVerbs(CLI::App& app, Cli& c);
void AddIdentityVerbs(CLI::App& app, Cli& c);
void AddAdminVerbs(CLI::App& app, Cli& c);
void AddLocalVerbs(CLI::App& app, Cli& c);
void AddWebVerb(CLI::App& app, Cli& c);  // web_verb.cc

}  // namespace trainyard::client
