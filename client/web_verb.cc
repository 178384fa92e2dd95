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

// --url, else $TRAINYARD_WEB_URL, else the local cluster's when yard talks to its coordinator.
absl::StatusOr<std::string> ConsoleUrl(const Globals& g, const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("TRAINYARD_WEB_URL"); env != nullptr && *env != '\0') {
    return std::string(env);
  }
  auto local = LocalStatus(DefaultLocalStateDir());
  if (local.ok() && !local->web_url.empty() && local->coordinator_address == g.coordinator) {
    return local->web_url;
  }
  return absl::InvalidArgumentError(
      "--url: where is the web console? give --url URL (or TRAINYARD_WEB_URL); the "
      "coordinator serves it with --web-address, yard local up with --web");
}

int Web(const Globals& g, const std::string& url_flag) {
  auto url = ConsoleUrl(g, url_flag);
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
  httplib::Client client(*url);
  client.set_connection_timeout(10, 0);
  client.set_read_timeout(30, 0);
  if (https) {
    if (!g.tls.ca_file.empty()) client.set_ca_cert_path(g.tls.ca_file.c_str());
    client.enable_server_certificate_verification(true);
  }
  auto res = client.Post("/api/v1/session/link", {{"Authorization", "Bearer " + *token}}, "",
                         "application/json");
  if (!res) {
    return Fail(absl::UnavailableError(absl::StrCat("cannot reach the web console at ", *url, ": ",
                                                    httplib::to_string(res.error()))));
  }
  const nlohmann::json body = nlohmann::json::parse(res->body, nullptr, false);
  if (res->status != 200 || !body.is_object() || !body.contains("url")) {
    std::string message = absl::StrCat("the web console answered HTTP ", res->status);
    if (body.is_object() && body.contains("error") && body["error"].contains("message")) {
      message = body["error"]["message"].get<std::string>();
    }
    return Fail(res->status == 401 ? absl::UnauthenticatedError(message)
                                   : absl::FailedPreconditionError(message));
  }
  if (g.json()) {
    std::cout << body.dump(1) << "\n";
  } else {
    std::cout << body["url"].get<std::string>() << "\n(signs a browser in as "
              << body.value("user", "you") << "; works once, within a minute)\n";
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
  web->callback([&c] { c.rc = Web(c.g, c.args.web_url); });
}

}  // namespace trainyard::client
