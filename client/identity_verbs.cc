// yard's verbs about the caller: login, whoami, quota.
#include <unistd.h>

#include <iostream>

#include <CLI/CLI.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/local_cluster.h"
#include "client/output.h"
#include "client/verbs.h"
#include "client/yard_client.h"
#include "common/credentials.h"

namespace trainyard::client {
namespace {

// `yard login`: reads a token from standard input (never from argv), checks it with the
// coordinator and saves it (mode 0600) where yard looks for it.
int Login(const Globals& g, const std::string& save_to) {
  if (isatty(STDIN_FILENO)) std::cerr << "paste your token and press Enter: " << std::flush;
  std::string line;
  std::getline(std::cin, line);
  const std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) return Fail(absl::InvalidArgumentError("no token on standard input"));
  YardClient client(g.coordinator, token, g.tls);
  auto me = client.WhoAmI();
  if (!me.ok()) return Fail(me.status());
  if (me->user().empty() || !me->node().empty()) {
    return Fail(absl::InvalidArgumentError("that is not a user's API token"));
  }
  if (absl::Status s = WriteSecretFile(save_to, token); !s.ok()) return Fail(s);
  std::cout << "logged in to " << g.coordinator << " as " << me->user() << " ("
            << RoleName(me->role()) << "); token saved to " << save_to << "\n";
  return 0;
}

int WhoAmI(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto me = client.WhoAmI();
  if (!me.ok()) return Fail(me.status());
  if (g.json()) {
    std::cout << ToJson(*me);
  } else if (!me->node().empty()) {
    std::cout << "node " << me->node() << " (token " << me->token_id() << " of " << me->user()
              << ")\n";
  } else {
    std::cout << me->user() << " (" << RoleName(me->role()) << ", token " << me->token_id()
              << ")\n";
  }
  return 0;
}

// `yard quota`: the user's use and caps, and its account's (every account's with --all).
int Quota(const Globals& g, const std::string& user, bool all) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto report = client.GetQuota(user, all);
  if (!report.ok()) return Fail(report.status());
  if (g.json()) {
    std::cout << ToJson(*report);
    return 0;
  }
  auto cap = [](bool has, int64_t value) { return has ? absl::StrCat(value) : "no cap"; };
  std::cout << FormatFields({
      {"user", report->user()},
      {"account", report->account()},
      {"running devices",
       absl::StrCat(report->running_devices(), " (",
                    cap(report->has_max_running_devices(), report->max_running_devices()), ")")},
      {"queued jobs",
       absl::StrCat(report->queued_jobs(), " (",
                    cap(report->has_max_queued_jobs(), report->max_queued_jobs()), ")")},
      {"usage", absl::StrFormat("%.2f device-hours (decayed, half-life %gh)",
                                report->usage_device_hours(), report->half_life_hours())},
  });
  std::vector<std::vector<std::string>> rows;
  for (const v1::AccountUsage& a : report->accounts()) {
    const auto [quota, borrow] = QuotaCells(a);
    rows.push_back(
        {a.name(), quota, borrow, absl::StrCat(a.running_devices()),
         absl::StrCat(a.queued_devices(), " (", a.queued_jobs(), " jobs)"),
         absl::StrFormat("%s (%.0f%%)", Share(a.share()), 100 * a.share_fraction()),
         absl::StrFormat("%.2f (%.0f%%)", a.usage_device_hours(), 100 * a.usage_fraction())});
  }
  std::cout << "\n"
            << FormatTable({"ACCOUNT", "QUOTA", "BORROW_LIMIT", "RUNNING", "QUEUED", "SHARE",
                            "USAGE_DEVICE_HOURS"},
                           rows);
  return 0;
}

}  // namespace

// Who you are: login, whoami, quota.
void AddIdentityVerbs(CLI::App& app, Cli& c) {
  Globals& g = c.g;
  int& rc = c.rc;
  VerbArgs& a = c.args;
  auto* login = app.add_subcommand(
      "login", "check a token read from standard input and save it where yard looks for it");
  auto& save_to = a.save_to;
  login->add_option("--save-to", save_to, "where to save it")->capture_default_str();
  login->callback([&] { rc = Login(g, save_to); });

  auto* whoami = app.add_subcommand("whoami", "the user (or node) of your token");
  whoami->callback([&] { rc = WhoAmI(g); });

  auto& quota_user = a.quota_user;
  auto& quota_all = a.quota_all;
  auto* quota = app.add_subcommand(
      "quota", "your use, caps and share, and your account's quota and usage (-o json)");
  quota->add_option("--user", quota_user, "this user's (admins)");
  quota->add_flag("--all", quota_all, "every account (admins)");
  quota->callback([&] { rc = Quota(g, quota_user, quota_all); });
}

}  // namespace trainyard::client
