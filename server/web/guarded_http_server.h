// The web console's HTTP(S) server: cpp-httplib's parsing, routing and answers over connections
// that trainyard serves itself (rpc/ps/tls_io.h's socket I/O, TLS included), so that no client
// holds one of its threads for long without asking anything:
// - a request (its line, headers and body) must arrive whole within a time of its first byte,
//   and a connection's TLS handshake within that time of its start. httplib's own limit is per
//   read: a client that trickles its headers a byte every 9 s (slowloris) held a thread for
//   ever, and some dozens of them every thread, before any sign-in was asked;
// - one peer address holds at most a few connections at once: one more is answered 503 at once
//   (in clear; closed under TLS, with no handshake spent on it). Trusted proxies are exempt: they
//   carry every browser's connections.
// Keep-alive, its count and its timeout are httplib's settings, as its read and write timeouts
// (the longest wait for one byte to move).
#ifndef TRAINYARD_SERVER_WEB_GUARDED_HTTP_SERVER_H_
#define TRAINYARD_SERVER_WEB_GUARDED_HTTP_SERVER_H_

#include <httplib.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace trainyard::ps {
class TlsConfig;  // rpc/ps/tls_io.h
}  // namespace trainyard::ps

namespace trainyard::web {

// An IPv4 or IPv6 address in one form (inet_ntop's; an IPv4-mapped IPv6 one as IPv4); none for
// anything else.
std::optional<std::string> CanonicalAddress(const std::string& text);

struct ConnectionLimits {
  // From a request's first byte (a connection's first: from its start, TLS handshake included)
  // until the last byte of its body.
  absl::Duration request_time = absl::Seconds(10);
  // Connections of one peer open at once (a browser opens 6 at most per host); an IPv6 peer is
  // its /64. While `busy_at` connections are open (half the threads, say), `per_peer_busy`.
  int per_peer = 24;
  int per_peer_busy = 8;
  int busy_at = 24;
  // Addresses (CanonicalAddress's form) with no per-peer limit: trusted proxies.
  std::vector<std::string> exempt;
};

class GuardedHttpServer : public httplib::Server {
 public:
  // `tls`: HTTPS with that server configuration (its certificate may follow its files); null:
  // plain HTTP.
  GuardedHttpServer(ConnectionLimits limits, std::shared_ptr<const ps::TlsConfig> tls);
  ~GuardedHttpServer() override;

  bool tls() const { return tls_ != nullptr; }

  // After bind_to_port: a backlog of SOMAXCONN, not httplib's 5 (a page's burst of connections,
  // or a handful of clients at once, overflowed it: their SYNs were dropped and retried 1 and 3 s
  // later).
  void WidenBacklog();

 private:
  bool process_and_close_socket(socket_t sock) override;
  // Counts a connection (of `peer`, when `counted`): false when the peer has as many as it may
  // (`*limit`, as many as that).
  bool Admit(const std::string& peer, bool counted, int* limit);
  void Leave(const std::string& peer, bool counted);

  // A request's line and headers (its body: payload_max_length).
  static constexpr size_t kMaxHeadBytes = 64 << 10;

  const ConnectionLimits limits_;
  const std::shared_ptr<const ps::TlsConfig> tls_;
  absl::Mutex mu_;
  std::map<std::string, int> open_by_peer_ ABSL_GUARDED_BY(mu_);
  int open_ ABSL_GUARDED_BY(mu_) = 0;  // every connection served now, exempt ones included
};

}  // namespace trainyard::web

#endif  // TRAINYARD_SERVER_WEB_GUARDED_HTTP_SERVER_H_
