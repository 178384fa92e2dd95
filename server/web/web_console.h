// The coordinator's web console: a browser's view of the cluster (jobs, a job's logs and charts,
// nodes, fair share) and the HTTP/JSON API under it, on a listener of its own
// (trainyard-coordinator --web-address; off unless given). docs/web-console.md.
//
// The API (/api/v1/...) answers in protobuf's JSON mapping of the gRPC messages, and every call is
// made as a gRPC call to the coordinator's own services over an in-process channel, with the
// caller's token: authorization, limits and audit are exactly the gRPC API's. A caller is either
//   - a program: "Authorization: Bearer <API token>" (curl; no cookie, no CSRF token), or
//   - a browser: the HttpOnly session cookie from POST /api/v1/session, where every request that
//     changes something also sends the session's CSRF token (X-CSRF-Token) and, when the browser
//     says where it came from (Origin, Sec-Fetch-Site), came from this origin.
// Pages and assets are built into the binary; every answer carries a Content-Security-Policy
// without inline scripts or external sources.
//
// Thread-safe: Start and the destructor from the owner's thread; requests on the server's pool.
#ifndef TRAINYARD_SERVER_WEB_WEB_CONSOLE_H_
#define TRAINYARD_SERVER_WEB_WEB_CONSOLE_H_

#include <memory>
#include <string>

#include <grpcpp/channel.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/web/web_sessions.h"

namespace trainyard::web {

struct WebConsoleOptions {
  std::string address;  // HOST:PORT; port 0 picks a free one
  // HTTPS with this certificate chain and key (PEM), both or neither: the coordinator's own. The
  // session cookie is then Secure.
  std::string tls_cert_file, tls_key_file;
  // How often the files are looked at: a renewed pair serves new connections without a restart,
  // as the gRPC listener's does (--tls-reload).
  absl::Duration tls_reload = absl::Seconds(10);
  // Behind a proxy (one that terminates TLS, say): the URL browsers reach the console at,
  // "http(s)://HOST[:PORT]" (--web-public-url). Its origin is this console's own too (sign-in and
  // actions check Origin against it), an https one makes the session cookie Secure, and it is
  // the URL printed and handed to `yard web`. Empty: the console's own address.
  std::string public_url;
  // Peers whose X-Forwarded-For is believed (--web-trusted-proxies: the proxy's addresses): a
  // request from one counts its failed sign-ins under the address the proxy saw (the header's
  // last entry), not under the proxy's own for every browser. Anyone else's header is ignored.
  std::vector<std::string> trusted_proxies;
  // Shown with each call it makes for a browser, beside the browser's address: the coordinator
  // counts failed authentications per browser, not per console (empty: it does not).
  std::string console_key;
  WebSessionLimits sessions;
  int threads = 48;  // connections served at once (live streams and kept-alive ones included)
  // Connections one address (an IPv6 one's /64) may hold at once, 8 while three quarters of the
  // threads are taken (a browser opens 6 at most; trusted proxies have no limit): one more is
  // answered 503, so that a few clients cannot take every thread.
  int max_connections_per_peer = 24;
  // A request's line, headers and body must arrive within this of its first byte (a connection's
  // TLS handshake within this of its start), however steadily they trickle in.
  absl::Duration request_time = absl::Seconds(10);
  int max_streams = 32;  // live streams (server-sent events) open at once; more get 503
  // How often a live job list looks for changes.
  absl::Duration list_poll = absl::Seconds(1);
  // How often a job's live stream asks again whether its caller may read the job (a revoked
  // token, a disabled user or a demoted admin ends it then; a signed-out session at once).
  absl::Duration stream_recheck = absl::Seconds(10);
};

// --web-public-url as a browser's Origin header names it: scheme, host and port (a default one
// left out, no leading zeros, an IPv6 address in one form), lower case; "" for none.
// INVALID_ARGUMENT naming the flag for anything else (a path, a query, credentials).
absl::StatusOr<std::string> WebPublicOrigin(const std::string& url);

class WebConsole {
 public:
  // Serves on options.address, calling the coordinator through `coordinator` (an in-process
  // channel of its gRPC server). INVALID_ARGUMENT naming the flag (--web-address, --tls-cert)
  // for a bad address or certificate; UNAVAILABLE if it cannot bind.
  static absl::StatusOr<std::unique_ptr<WebConsole>> Start(
      const WebConsoleOptions& options, std::shared_ptr<grpc::Channel> coordinator);
  ~WebConsole();  // stops serving; returns when every request and stream is done

  // "http://HOST:PORT" or "https://HOST:PORT", the port the bound one.
  const std::string& url() const;

  struct Impl;

 private:
  explicit WebConsole(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A standby replica's console (server/coordinator/replica.h): every request is answered with
// 307 Temporary Redirect to the same path and query at the leader's console, or 503 while no
// replica leads (or the leader serves no console). Thread-safe.
class WebRedirect {
 public:
  // Listens on options.address (port 0: a free one), as WebConsole::Start does.
  static absl::StatusOr<std::unique_ptr<WebRedirect>> Start(const WebConsoleOptions& options);
  ~WebRedirect();  // stops listening; returns when every request is answered

  // "http(s)://HOST:PORT" of the leader's console; empty while there is none.
  void SetLeader(const std::string& url);
  int port() const;

  struct Impl;

 private:
  explicit WebRedirect(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainyard::web

#endif  // TRAINYARD_SERVER_WEB_WEB_CONSOLE_H_
