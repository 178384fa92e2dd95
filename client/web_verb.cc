// `yard web`: a link that signs a browser in to the web console once, within a minute, as you
// (POST /api/v1/session/link with your token; docs/web-console.md). The token itself never goes
// into the link, a URL or the browser's history.
#include <cstdlib>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/verbs.h"

#ifdef TRAINYARD_YARD_WEB
#include <httplib.h>
#endif

namespace trainyard::client {
namespace {

// --url, else $TRAINYARD_WEB_URL, else the local cluster's (in `state_dir`, default yard local's)
// when yard talks to its coordinator.
absl::StatusOr<std::string> ConsoleUrl(const Globals& g, const std::string& flag,
                                       const std::string& state_dir) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("TRAINYARD_WEB_URL"); env != nullptr && *env != '\0') {
    return std::string(env);
  }
  auto local = LocalStatus(state_dir.empty() ? DefaultLocalStateDir() : state_dir);
  if (local.ok() && !local->web_url.empty() && local->coordinator_address == g.coordinator) {
    return local->web_url;
  }
  return absl::InvalidArgumentError(
      "--url: where is the web console? give --url URL (or TRAINYARD_WEB_URL); the "
      "coordinator serves it with --web-address, yard local up with --web");
}

int Web(const Globals& g, const std::string& url_flag, const std::string& state_dir) {
  auto url = ConsoleUrl(g, url_flag, state_dir);
  if (!url.ok()) return Fail(url.status());
  const bool https = absl::StartsWith(*url, "https://");
  if (!https && !absl::StartsWith(*url, "http://")) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--url: expected http://HOST:PORT or https://HOST:PORT, got '", *url, "'")));
  }
  auto token = g.Token();
  if (!token.ok()) return Fail(token.status());
  const std::string host = url->substr(https ? 8 : 7);
  if (!https && !g.tls.plaintext_token_ok && !IsLoopback(host.substr(0, host.find('/')))) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "refusing to send your API token in clear to ", *url,
        ", which is not this host: use the console's https:// address, or --insecure on a "
        "network you trust")));
  }
#ifdef TRAINYARD_YARD_WEB
  // A standby replica answers 307 with the leader's console: followed once, if the token would
  // still go only over TLS or to this host.
  auto post = [&](const std::string& at) {
    httplib::Client client(at);
    client.set_connection_timeout(10, 0);
    client.set_read_timeout(30, 0);
    if (absl::StartsWith(at, "https://")) {
      if (!g.tls.ca_file.empty()) client.set_ca_cert_path(g.tls.ca_file.c_str());
      client.enable_server_certificate_verification(true);
    }
    return client.Post("/api/v1/session/link", {{"Authorization", "Bearer " + *token}}, "",
                       "application/json");
  };
  std::string base = *url;
  httplib::Result res = post(base);
  if (res && res->status == 307) {
    const std::string location = res->get_header_value("Location");
    const size_t scheme = location.find("//");
    const std::string leader =
        scheme == std::string::npos ? "" : location.substr(0, location.find('/', scheme + 2));
    const bool tls_or_here = absl::StartsWith(leader, "https://") ||
                             (absl::StartsWith(leader, "http://") &&
                              (g.tls.plaintext_token_ok || IsLoopback(leader.substr(7))));
    if (!leader.empty() && tls_or_here) {
      base = leader;
      res = post(base);
    }
  }
  if (!res) {
    return Fail(absl::UnavailableError(absl::StrCat("cannot reach the web console at ", base, ": ",
                                                    httplib::to_string(res.error()))));
  }
  const nlohmann::json body = nlohmann::json::parse(res->body, nullptr, false);
  auto text = [&body](const char* key) -> std::string {
    return body.is_object() && body.contains(key) && body[key].is_string()
               ? body[key].get<std::string>()
               : std::string();
  };
  if (res->status != 200 || text("url").empty()) {
    std::string message = absl::StrCat("the web console at ", base, " answered HTTP ", res->status);
    if (body.is_object() && body.contains("error") && body["error"].is_object() &&
        body["error"].contains("message") && body["error"]["message"].is_string()) {
      message = body["error"]["message"].get<std::string>();
    }
    return Fail(res->status == 401 ? absl::UnauthenticatedError(message)
                                   : absl::FailedPreconditionError(message));
  }
  if (g.json()) {
    std::cout << body.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::cout << text("url") << "\n(signs a browser in as "
              << (text("user").empty() ? "you" : text("user"))
              << "; works once, within a minute)\n";
  }
  return 0;
#else
  return Fail(absl::UnimplementedError(
      "this yard was built without an HTTP client (install libcpp-httplib-dev and build again)"));
#endif
}

}  // namespace

void AddWebVerb(CLI::App& app, Cli& c) {
  auto* web = app.add_subcommand(
      "web", "print a link that signs a browser in to the web console (once, within a minute)");
  web->add_option("--url", c.args.web_url,
                  "the console's address (default: $TRAINYARD_WEB_URL, or the local cluster's)");
  web->add_option("--state-dir", c.args.web_state_dir,
                  "the local cluster's state (yard local --state-dir) whose console to use "
                  "without --url");
  web->callback([&c] { c.rc = Web(c.g, c.args.web_url, c.args.web_state_dir); });
}

}  // namespace trainyard::client
