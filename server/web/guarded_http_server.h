// The web console's HTTP(S) server: cpp-httplib's parsing, routing and answers over connections
// that trainyard serves itself (rpc/ps/tls_io.h's socket I/O, TLS included), so that no client
// holds one of its threads for long without asking anything:
// - a request (its line, headers and body) must arrive whole within a time of its first byte,
//   and a connection's TLS handshake within that time of the connection's start. httplib's own
//   limit is per read: a client that trickles its headers a byte every 9 s (slowloris) held a
//   thread for ever, and some dozens of them every thread, before any sign-in was asked;
// - a request's head and its body each have a size limit, checked as they arrive; a body is
//   taken as sent (a compressed one, which httplib inflated without a limit, is refused), only
//   where httplib reads one (else its bytes were the connection's next request), and its length
//   is checked against the limit before any of it is read;
// - an answer goes out at a least rate: a client that reads it a segment at a time is cut;
// - one peer address (an IPv6 one's /64) holds at most a few connections at once: one more is
//   answered 503 at once (in clear; closed under TLS, with no handshake spent on it). Trusted
//   proxies are exempt: they carry every browser's connections;
// - connections waiting for a thread are bounded too: past that, one more is answered 503 by the
//   listener itself (closed under TLS), without waiting for its request.
// Keep-alive, its count and its timeout are httplib's settings, as its read and write timeouts
// (the longest wait for one byte to move).
#ifndef TRAINYARD_SERVER_WEB_GUARDED_HTTP_SERVER_H_
#define TRAINYARD_SERVER_WEB_GUARDED_HTTP_SERVER_H_

#include <httplib.h>

#include <atomic>
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

// What a peer's connections are counted under: its address (CanonicalAddress's form), an IPv6
// one's /64 (a host has a whole /64 to pick addresses from).
std::string PeerKey(const std::string& address);

struct ConnectionLimits {
  // Connections served at once (kept-alive ones and live streams included), and accepted ones
  // that wait for a thread (at least 1).
  int threads = 48;
  int max_queued = 192;
  // From a request's first byte until the last byte of its body; a TLS handshake's, from the
  // connection's start.
  absl::Duration request_time = absl::Seconds(10);
  // An answer's least rate, in bytes a second (after the write timeout's grace).
  double min_send_rate = 16 << 10;
  // Connections of one peer open at once (a browser opens 6 at most per host); an IPv6 peer is
  // its /64. While `busy_at` connections are open (three quarters of the threads, say),
  // `per_peer_busy`.
  int per_peer = 24;
  int per_peer_busy = 8;
  int busy_at = 36;
  // Addresses (CanonicalAddress's form) with no per-peer limit: trusted proxies.
  std::vector<std::string> exempt;
};

class GuardedHttpServer : public httplib::Server {
 public:
  // `tls`: HTTPS with that server configuration (its certificate may follow its files); null:
  // plain HTTP. (Sets httplib's new_task_queue: a pool of limits.threads.)
  GuardedHttpServer(ConnectionLimits limits, std::shared_ptr<const ps::TlsConfig> tls);
  ~GuardedHttpServer() override;

  bool tls() const { return tls_ != nullptr; }

  // After bind_to_port: a backlog of SOMAXCONN, not httplib's 5 (a page's burst of connections,
  // or a handful of clients at once, overflowed it: their SYNs were dropped and retried 1 and 3 s
  // later).
  void WidenBacklog();

  // Connections served now (exempt ones included).
  int open_connections() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  bool process_and_close_socket(socket_t sock) override;
  // Counts a connection (of `peer`, when `counted`): false when the peer has as many as it may
  // (`*limit`, as many as that).
  bool Admit(const std::string& peer, bool counted, int* limit);
  void Leave(const std::string& peer, bool counted);

  // A request's line and headers (its body: payload_max_length).
  static constexpr size_t kMaxHeadBytes = 64 << 10;
  // What a refused request's close reads of its body at most, for the peer to read the answer.
  static constexpr size_t kMaxLingerBytes = 1 << 20;

  // Refusals that wait a moment for the request before closing (so that no reset overtakes the
  // 503): a few at once, so that a flood of empty connections holds no more threads than that.
  static constexpr int kMaxLingeringRefusals = 2;

  const ConnectionLimits limits_;
  const std::shared_ptr<const ps::TlsConfig> tls_;
  absl::Mutex mu_;
  std::map<std::string, int> open_by_peer_ ABSL_GUARDED_BY(mu_);
  int open_ ABSL_GUARDED_BY(mu_) = 0;  // every connection served now, exempt ones included
  std::atomic<int> lingering_refusals_{0};
};

}  // namespace trainyard::web

#endif  // TRAINYARD_SERVER_WEB_GUARDED_HTTP_SERVER_H_
