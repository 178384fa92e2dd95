#include "server/web/guarded_http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/ps/tls_io.h"

namespace trainyard::web {
namespace {

// What one connection's requests are read from and answered on: the Conn's bytes, buffered
// (httplib reads a request's line and headers a byte at a time).
class ConnStream final : public httplib::Stream {
 public:
  ConnStream(ps::Conn& conn, std::string peer_ip, int peer_port, absl::Duration read_idle,
             absl::Duration write_idle)
      : conn_(conn),
        peer_ip_(std::move(peer_ip)),
        peer_port_(peer_port),
        read_idle_(read_idle),
        write_idle_(write_idle) {}

  // The reads of the request that starts now must be over by `deadline` and take at most
  // `max_bytes` (its head and body: httplib's own limit is on a Content-Length body only, not on
  // its header lines nor a chunked body).
  void StartRequest(absl::Time deadline, size_t max_bytes) {
    deadline_ = deadline;
    budget_ = max_bytes;
  }
  // Whether bytes were received that no read took yet (a request sent before the last answer).
  bool HasBuffered() const { return begin_ < end_ || ps::Pending(conn_) > 0; }
  // Whether a read or a write failed: its request's time ran out, the peer went quiet or closed.
  // The connection ends then, whatever httplib answered (a 400 to a cut request).
  bool failed() const { return failed_; }

  bool is_readable() const override {
    return HasBuffered() ||
           ps::WaitReady(conn_.fd(), POLLIN, ReadLimit(), absl::Now(), "read").ok();
  }

  // Room to send, and a peer that has not closed (an event stream learns so when it writes).
  bool is_writable() const override {
    if (!ps::WaitReady(conn_.fd(), POLLOUT, ps::IoLimit::Idle(write_idle_), absl::Now(), "write")
             .ok()) {
      return false;
    }
    pollfd p{conn_.fd(), POLLIN, 0};
    if (poll(&p, 1, 0) <= 0) return true;
    char c;
    const ssize_t r = recv(conn_.fd(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return r > 0 || (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
  }

  ssize_t read(char* ptr, size_t size) override {
    if (size == 0) return 0;
    if (begin_ == end_) {
      // (Checked before each receive too: bytes that keep coming never wait, so never time out.)
      if (absl::Now() >= deadline_ || budget_ == 0) {
        failed_ = true;
        return -1;
      }
      const bool direct = size >= sizeof(buffer_);
      const size_t want = std::min(direct ? size : sizeof(buffer_), budget_);
      absl::StatusOr<size_t> got = ps::RecvSome(conn_, direct ? ptr : buffer_, want, ReadLimit());
      if (!got.ok()) {
        // The peer closed (its end of file ends a body sent without a length) or went quiet.
        if (absl::IsUnavailable(got.status())) return 0;
        failed_ = true;
        return -1;
      }
      budget_ -= *got;
      if (direct) return static_cast<ssize_t>(*got);
      begin_ = 0;
      end_ = *got;
    }
    const size_t n = std::min(size, end_ - begin_);
    std::memcpy(ptr, buffer_ + begin_, n);
    begin_ += n;
    return static_cast<ssize_t>(n);
  }

  // Within the write timeout of silence, and at no less than kMinSendRate overall: a client that
  // reads an answer a segment every few seconds holds its thread no longer than that.
  ssize_t write(const char* ptr, size_t size) override {
    const ps::IoLimit limit{
        absl::Now() + write_idle_ + absl::Seconds(static_cast<double>(size) / kMinSendRate),
        write_idle_};
    if (failed_ || !ps::SendAll(conn_, absl::string_view(ptr, size), limit).ok()) {
      failed_ = true;
      return -1;
    }
    return static_cast<ssize_t>(size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = peer_ip_;
    port = peer_port_;
  }

  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    ip.clear();
    port = 0;
    if (getsockname(conn_.fd(), reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      AddressOf(addr, len, &ip, &port);
    }
  }

  socket_t socket() const override { return conn_.fd(); }

  // The numeric host and port of `addr` (as httplib's own stream gives them).
  static void AddressOf(const sockaddr_storage& addr, socklen_t len, std::string* ip, int* port) {
    char host[NI_MAXHOST] = {0};
    char service[NI_MAXSERV] = {0};
    if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), service,
                    sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      *ip = host;
      *port = std::atoi(service);
    }
  }

 private:
  ps::IoLimit ReadLimit() const { return ps::IoLimit{deadline_, read_idle_}; }

  ps::Conn& conn_;
  const std::string peer_ip_;
  const int peer_port_;
  const absl::Duration read_idle_;
  const absl::Duration write_idle_;
  static constexpr double kMinSendRate = 16 << 10;  // bytes a second

  absl::Time deadline_ = absl::InfiniteFuture();
  size_t budget_ = 0;
  char buffer_[4096];
  size_t begin_ = 0, end_ = 0;
  bool failed_ = false;
};

// One more connection than a peer may hold: told so in clear, closed under TLS (a handshake is
// what a flood would want this thread to spend). Never waits.
void Refuse(int fd, bool tls, int per_peer) {
  if (!tls) {
    const std::string body = absl::StrCat(
        R"({"error":{"code":"UNAVAILABLE","message":"too many connections from this address )",
        R"((at most )", per_peer, R"( at once); try again shortly"}})");
    const std::string answer = absl::StrCat(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        "Retry-After: 1\r\nConnection: close\r\nContent-Length: ",
        body.size(), "\r\n\r\n", body);
    (void)send(fd, answer.data(), answer.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    shutdown(fd, SHUT_WR);
  }
  // The request, if it comes at once, is read, so that the close sends no reset ahead of the
  // answer (some clients then drop the answer).
  pollfd p{fd, POLLIN, 0};
  char scratch[4096];
  for (int i = 0; i < 16 && poll(&p, 1, i == 0 ? 50 : 0) > 0 &&
                  recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT) > 0;
       ++i) {
  }
}

// What a peer's connections are counted under: its address, an IPv6 one's /64 (a host has a
// whole /64 to pick addresses from).
std::string PeerKey(const std::string& address) {
  in6_addr v6{};
  if (inet_pton(AF_INET6, address.c_str(), &v6) != 1) return address;
  std::memset(&v6.s6_addr[8], 0, 8);
  char out[INET6_ADDRSTRLEN] = {0};
  return absl::StrCat(inet_ntop(AF_INET6, &v6, out, sizeof(out)), "/64");
}

}  // namespace

std::optional<std::string> CanonicalAddress(const std::string& text) {
  in6_addr v6{};
  in_addr v4{};
  char out[INET6_ADDRSTRLEN] = {0};
  if (inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    return std::string(inet_ntop(AF_INET, &v4, out, sizeof(out)));
  }
  if (inet_pton(AF_INET6, text.c_str(), &v6) != 1) return std::nullopt;
  if (IN6_IS_ADDR_V4MAPPED(&v6)) {
    std::memcpy(&v4, &v6.s6_addr[12], 4);
    return std::string(inet_ntop(AF_INET, &v4, out, sizeof(out)));
  }
  return std::string(inet_ntop(AF_INET6, &v6, out, sizeof(out)));
}

GuardedHttpServer::GuardedHttpServer(ConnectionLimits limits,
                                     std::shared_ptr<const ps::TlsConfig> tls)
    : limits_(std::move(limits)), tls_(std::move(tls)) {}

GuardedHttpServer::~GuardedHttpServer() = default;

void GuardedHttpServer::WidenBacklog() {
  // (listen(2) again on a listening socket sets its backlog.)
  if (const socket_t sock = svr_sock_; sock != INVALID_SOCKET) ::listen(sock, SOMAXCONN);
}

bool GuardedHttpServer::Admit(const std::string& peer, bool counted, int* limit) {
  absl::MutexLock lock(&mu_);
  if (counted) {
    int& open = open_by_peer_[peer];
    // While many threads are taken, a peer gets fewer: a few addresses cannot take them all.
    *limit = open_ >= limits_.busy_at ? std::min(limits_.per_peer, limits_.per_peer_busy)
                                      : limits_.per_peer;
    if (open >= *limit) {
      if (open == 0) open_by_peer_.erase(peer);
      return false;
    }
    ++open;
  }
  ++open_;
  return true;
}

void GuardedHttpServer::Leave(const std::string& peer, bool counted) {
  absl::MutexLock lock(&mu_);
  --open_;
  if (!counted) return;
  if (auto it = open_by_peer_.find(peer); it != open_by_peer_.end() && --it->second <= 0) {
    open_by_peer_.erase(it);
  }
}

bool GuardedHttpServer::process_and_close_socket(socket_t sock) {
  const absl::Time start = absl::Now();
  ps::UniqueFd fd(sock);
  if (svr_sock_ == INVALID_SOCKET) return false;  // stopping: what waited in the queue goes
  // (The listener made it blocking, with a receive timeout: tls_io's calls poll instead.)
  const int flags = fcntl(sock, F_GETFL);
  if (flags < 0 || fcntl(sock, F_SETFL, flags | O_NONBLOCK) < 0) return false;
  const int one = 1;
  setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));

  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  std::string ip;
  int port = 0;
  if (getpeername(sock, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  ConnStream::AddressOf(addr, len, &ip, &port);
  const std::string address = CanonicalAddress(ip).value_or(ip);
  const bool counted = !absl::c_linear_search(limits_.exempt, address);
  const std::string peer = PeerKey(address);
  if (int limit = 0; !Admit(peer, counted, &limit)) {
    Refuse(sock, tls(), limit);
    return false;
  }
  absl::Cleanup leave = [this, counted, &peer] { Leave(peer, counted); };

  const absl::Duration read_idle =
      absl::Seconds(read_timeout_sec_) + absl::Microseconds(read_timeout_usec_);
  const absl::Duration write_idle =
      absl::Seconds(write_timeout_sec_) + absl::Microseconds(write_timeout_usec_);
  ps::Conn conn;
  if (tls_ != nullptr) {
    absl::StatusOr<ps::Conn> accepted =
        ps::TlsAccept(std::move(fd), *tls_, ps::IoLimit{start + limits_.request_time, read_idle});
    if (!accepted.ok()) return false;
    conn = *std::move(accepted);
  } else {
    conn = ps::Conn(std::move(fd));
  }
  ConnStream stream(conn, ip, port, read_idle, write_idle);

  // As httplib's own loop: up to its count of requests, each after at most its keep-alive
  // timeout of silence, while the server runs.
  const absl::Duration keep_alive = absl::Seconds(keep_alive_timeout_sec_);
  bool ok = true;
  for (size_t left = keep_alive_max_count_; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
    bool waiting = !stream.HasBuffered();
    const absl::Time quiet_until = absl::Now() + keep_alive;
    while (waiting && svr_sock_ != INVALID_SOCKET && absl::Now() < quiet_until) {
      pollfd p{conn.fd(), POLLIN, 0};
      const int r = poll(&p, 1, 100);
      if (r < 0 && errno != EINTR) break;
      waiting = r <= 0;
    }
    if (waiting) break;
    stream.StartRequest(absl::Now() + limits_.request_time, kMaxHeadBytes + payload_max_length_);
    bool closed = false;
    ok = process_request(stream, left == 1, closed, nullptr);
    if (!ok || closed || stream.failed()) break;
  }
  ps::ShutdownWrite(conn);
  if (!stream.failed() && svr_sock_ != INVALID_SOCKET) {
    // A short lingering close: a reset would take an answer the peer has not read yet with it.
    ps::DiscardUntilClosed(conn, 64 << 10, ps::IoLimit::Until(absl::Now() + absl::Seconds(1)));
  }
  return ok;
}

}  // namespace trainyard::web
