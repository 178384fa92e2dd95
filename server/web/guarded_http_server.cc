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
#include <deque>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "rpc/ps/tls_io.h"

namespace trainyard::web {
namespace {

// Whether this thread runs a connection that the pool's queue had no room for (Pool::enqueue).
thread_local bool t_shed = false;

// A JSON answer of trainyard's form ({"error": {"code", "message"}}) that closes the connection.
std::string CloseWith(int status, absl::string_view reason, absl::string_view code,
                      absl::string_view message, bool retry) {
  const std::string body =
      absl::StrCat(R"({"error":{"code":")", code, R"(","message":")", message, R"("}})");
  return absl::StrCat("HTTP/1.1 ", status, " ", reason,
                      "\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\n"
                      "Cache-Control: no-store\r\n",
                      retry ? "Retry-After: 1\r\n" : "",
                      "Connection: close\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
}

// What one connection's requests are read from and answered on: the Conn's bytes, buffered
// (httplib reads a request's line and headers a byte at a time).
class ConnStream final : public httplib::Stream {
 public:
  ConnStream(ps::Conn& conn, std::string peer_ip, int peer_port, absl::Duration read_idle,
             absl::Duration write_idle, double min_send_rate)
      : conn_(conn),
        peer_ip_(std::move(peer_ip)),
        peer_port_(peer_port),
        read_idle_(read_idle),
        write_idle_(write_idle),
        min_send_rate_(min_send_rate) {}

  // The reads of the request that starts now must be over by `deadline`, and its line and
  // headers take at most `head_bytes` (httplib's own limit is on a Content-Length body only).
  void StartRequest(absl::Time deadline, size_t head_bytes) {
    deadline_ = deadline;
    budget_ = head_bytes;
    body_ended_ = false;
  }
  // The head is read: the body takes at most `body_bytes` more (those buffered already
  // included; a chunked body's framing included).
  void StartBody(size_t body_bytes) {
    const size_t buffered = end_ - begin_;
    budget_ = body_bytes > buffered ? body_bytes - buffered : 0;
  }
  // The request has no body (neither a length nor chunks): its reads end at once, not at the
  // peer's end of file (httplib's reading of a POST without either).
  void NoBody() { body_ended_ = true; }
  // Answers the request here, and ends the connection: httplib's reads and writes fail from
  // now on (so that its own answer goes nowhere).
  void Answer(const std::string& answer) {
    if (!failed_ && !answered_) {
      failed_ = !ps::SendAll(conn_, answer, WriteLimit(answer.size())).ok();
    }
    answered_ = true;
  }

  // Whether bytes were received that no read took yet (a request sent before the last answer).
  bool HasBuffered() const { return begin_ < end_ || ps::Pending(conn_) > 0; }
  // Whether a read or a write failed: its request's time ran out, the peer went quiet, closed
  // or reset, or sent more than it may. The connection ends then, whatever httplib answered (a
  // 400 to a cut request), without a lingering close.
  bool failed() const { return failed_; }
  // Whether the request was answered here (Answer): the connection ends after it.
  bool answered() const { return answered_; }

  bool is_readable() const override {
    return !answered_ && (HasBuffered() ||
                          ps::WaitReady(conn_.fd(), POLLIN, ReadLimit(), absl::Now(), "read").ok());
  }

  // Room to send, and a peer that has not closed (an event stream learns so when it writes).
  bool is_writable() const override {
    if (answered_ ||
        !ps::WaitReady(conn_.fd(), POLLOUT, ps::IoLimit::Idle(write_idle_), absl::Now(), "write")
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
    if (answered_ || failed_) return -1;
    if (size == 0 || body_ended_) return 0;
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
        // The peer closed, reset or went quiet, or its TLS failed: no request reads to the
        // peer's end (NoBody), so this cuts the request short whatever it was.
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

  // Within the write timeout of silence, and at no less than min_send_rate overall: a client
  // that reads an answer a segment every few seconds holds its thread no longer than that.
  ssize_t write(const char* ptr, size_t size) override {
    if (answered_ || failed_ ||
        !ps::SendAll(conn_, absl::string_view(ptr, size), WriteLimit(size)).ok()) {
      failed_ = failed_ || !answered_;
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
  ps::IoLimit WriteLimit(size_t size) const {
    return ps::IoLimit{
        absl::Now() + write_idle_ + absl::Seconds(static_cast<double>(size) / min_send_rate_),
        write_idle_};
  }

  ps::Conn& conn_;
  const std::string peer_ip_;
  const int peer_port_;
  const absl::Duration read_idle_;
  const absl::Duration write_idle_;
  const double min_send_rate_;

  absl::Time deadline_ = absl::InfiniteFuture();
  size_t budget_ = 0;
  bool body_ended_ = false;
  char buffer_[4096];
  size_t begin_ = 0, end_ = 0;
  bool failed_ = false;
  bool answered_ = false;
};

// Once a request's head is read, before httplib reads its body: a body that would be read
// without a limit (a compressed one), or ambiguously (both a length and chunks: a proxy may
// have framed it otherwise), or not at all (httplib reads one for POST, PUT, PATCH and a DELETE
// with a length only: the bytes of any other were taken for the next request on the connection,
// and a proxy's next client's), or whose length is past `payload_max`, is answered here and
// nothing of it is read; otherwise its bytes are bounded by its length (chunked: by
// payload_max), and a request with neither has none.
void CheckHead(httplib::Request& req, ConnStream& stream, size_t payload_max) {
  auto refuse = [&](int status, absl::string_view reason, absl::string_view message) {
    stream.Answer(CloseWith(status, reason, "INVALID_ARGUMENT", message, false));
    req.method.clear();  // (no handler runs: httplib routes it on, with no body, to none)
  };
  const size_t encodings = req.get_header_value_count("Content-Encoding");
  if (encodings > 1 ||
      (encodings == 1 &&
       !absl::EqualsIgnoreCase(req.get_header_value("Content-Encoding"), "identity"))) {
    return refuse(415, "Unsupported Media Type",
                  "Content-Encoding: a request's body is taken as it is, not compressed");
  }
  const size_t transfers = req.get_header_value_count("Transfer-Encoding");
  const size_t lengths = req.get_header_value_count("Content-Length");
  if (transfers > 0 && lengths > 0) {
    return refuse(400, "Bad Request",
                  "Transfer-Encoding and Content-Length: a request has one or the other");
  }
  const bool reads_body = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
                          (req.method == "DELETE" && lengths > 0);
  if (transfers > 0) {
    if (transfers > 1 ||
        !absl::EqualsIgnoreCase(req.get_header_value("Transfer-Encoding"), "chunked")) {
      return refuse(501, "Not Implemented", "Transfer-Encoding: only chunked is taken");
    }
    if (!reads_body) {
      return refuse(
          400, "Bad Request",
          absl::StrCat("Transfer-Encoding: a ", req.method, " here takes no chunked body"));
    }
    return stream.StartBody(payload_max);
  }
  if (lengths == 0) return stream.NoBody();
  const std::string text = req.get_header_value("Content-Length");
  uint64_t length = 0;
  if (lengths > 1 || text.empty() || text.size() > 19 ||
      !absl::c_all_of(text, absl::ascii_isdigit) || !absl::SimpleAtoi(text, &length)) {
    return refuse(400, "Bad Request", "Content-Length: not one decimal count of bytes");
  }
  if (length > 0 && !reads_body) {
    return refuse(400, "Bad Request",
                  absl::StrCat("Content-Length: a ", req.method, " here has no body"));
  }
  if (length > payload_max) {
    return refuse(
        413, "Payload Too Large",
        absl::StrCat("body: larger than ", payload_max, " bytes (Content-Length: ", length, ")"));
  }
  stream.StartBody(static_cast<size_t>(length));
}

// One more connection than a peer may hold, or than the queue may: told so in clear, closed
// under TLS (a handshake is what a flood would want this thread to spend). `linger`: waits up to
// 50 ms for the request to arrive, and reads it, so that the close sends no reset ahead of the
// answer (some clients then drop the answer); otherwise reads only what is there.
void Refuse(int fd, bool tls, const std::string& message, bool linger) {
  if (tls) return;
  const std::string answer = CloseWith(503, "Service Unavailable", "UNAVAILABLE", message, true);
  (void)send(fd, answer.data(), answer.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  shutdown(fd, SHUT_WR);
  pollfd p{fd, POLLIN, 0};
  char scratch[4096];
  for (int i = 0; i < 16 && poll(&p, 1, i == 0 && linger ? 50 : 0) > 0 &&
                  recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT) > 0;
       ++i) {
  }
}

// httplib's ThreadPool with a bound on its queue: a connection past it is turned away at once
// by the listener's thread (t_shed), not left waiting for a thread without end.
class Pool final : public httplib::TaskQueue {
 public:
  Pool(int threads, size_t max_queued) : max_queued_(max_queued) {
    for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Work(); });
  }
  ~Pool() override = default;

  void enqueue(std::function<void()> fn) override {
    {
      absl::MutexLock lock(&mu_);
      if (jobs_.size() < max_queued_ || shutdown_) {
        jobs_.push_back(std::move(fn));
        return;
      }
    }
    t_shed = true;
    absl::Cleanup unshed = [] { t_shed = false; };
    fn();
  }

  // As httplib's: the queue's connections are taken up (and, the server stopping, closed), then
  // the threads joined.
  void shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      shutdown_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }

 private:
  void Work() {
    while (true) {
      std::function<void()> fn;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &Pool::Ready));
        if (jobs_.empty()) return;  // (shut down)
        fn = std::move(jobs_.front());
        jobs_.pop_front();
      }
      fn();
    }
  }

  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !jobs_.empty() || shutdown_; }

  const size_t max_queued_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::string PeerKey(const std::string& address) {
  in6_addr v6{};
  if (inet_pton(AF_INET6, address.c_str(), &v6) != 1) return address;
  std::memset(&v6.s6_addr[8], 0, 8);
  char out[INET6_ADDRSTRLEN] = {0};
  return absl::StrCat(inet_ntop(AF_INET6, &v6, out, sizeof(out)), "/64");
}

std::optional<std::string> CanonicalAddress(const std::string& given) {
  in6_addr v6{};
  in_addr v4{};
  char out[INET6_ADDRSTRLEN] = {0};
  // (A link-local IPv6 address's zone, "%eth0", names the interface it came in on, not a peer.)
  const std::string text = given.substr(0, given.find('%'));
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
    : limits_(std::move(limits)), tls_(std::move(tls)) {
  new_task_queue = [threads = limits_.threads, queued = limits_.max_queued] {
    return new Pool(threads, static_cast<size_t>(std::max(queued, 1)));
  };
}

GuardedHttpServer::~GuardedHttpServer() = default;

void GuardedHttpServer::WidenBacklog() {
  // (listen(2) again on a listening socket sets its backlog.)
  if (const socket_t sock = svr_sock_; sock != INVALID_SOCKET) ::listen(sock, SOMAXCONN);
}

int GuardedHttpServer::open_connections() {
  absl::MutexLock lock(&mu_);
  return open_;
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
  if (t_shed) {
    // (On the listener's thread: never waits, and looks up nothing.)
    Refuse(sock, tls(),
           "the console is busy: every thread is taken and too many wait; try again shortly",
           false);
    return false;
  }
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
    const bool linger = lingering_refusals_.fetch_add(1) < kMaxLingeringRefusals;
    Refuse(sock, tls(),
           absl::StrCat("too many connections from this address (at most ", limit,
                        " at once); try again shortly"),
           linger);
    lingering_refusals_.fetch_sub(1);
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
  ConnStream stream(conn, ip, port, read_idle, write_idle, limits_.min_send_rate);

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
    stream.StartRequest(absl::Now() + limits_.request_time, kMaxHeadBytes);
    bool closed = false;
    bool checked = false;
    ok = process_request(stream, left == 1, closed, [&](httplib::Request& req) {
      checked = true;
      CheckHead(req, stream, payload_max_length_);
    });
    // (Not checked: httplib answered the head itself, a 400, 414 or 416, with its body unread.)
    if (!ok || closed || !checked || stream.failed() || stream.answered()) break;
  }
  ps::ShutdownWrite(conn);
  if (!stream.failed() && svr_sock_ != INVALID_SOCKET) {
    // A short lingering close: a reset would take an answer the peer has not read yet with it.
    // (After an answer of its own, the peer may still be sending the body it refused: a longer
    // one.)
    const bool answered = stream.answered();
    ps::DiscardUntilClosed(conn, answered ? kMaxLingerBytes : 64 << 10,
                           ps::IoLimit::Until(absl::Now() + absl::Seconds(answered ? 2 : 1)));
  }
  return ok;
}

}  // namespace trainyard::web
