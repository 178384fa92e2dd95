// The web console's HTTP server (server/web/guarded_http_server.h) on real sockets: a request
// that trickles in is cut at its time however steadily it comes (plain and TLS), so that
// tricklers cannot hold every thread; one address past its connections is answered 503 at once
// while others are served; keep-alive and TLS serve as httplib's own server did.
#include "server/web/guarded_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/ps/tls_io.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_pki.h"

namespace trainyard::web {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A server with one route (GET /hello: "hi"), on 127.0.0.1 on a thread of its own, with
// `threads` threads; stopped and joined by the destructor.
class Served {
 public:
  Served(ConnectionLimits limits, int threads, std::shared_ptr<const ps::TlsConfig> tls = nullptr)
      : server_(std::move(limits), std::move(tls)) {
    server_.set_read_timeout(30, 0);     // (so that only the request's time cuts a trickle)
    server_.set_keep_alive_timeout(30);  // (so that only a close frees a connection)
    server_.set_payload_max_length(64 << 10);
    server_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    server_.Get("/hello", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("hi", "text/plain");
    });
    server_.Post("/echo", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(absl::StrCat(req.body.size()), "text/plain");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    EXPECT_GT(port_, 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 10000 && !server_.is_running(); ++i) absl::SleepFor(absl::Milliseconds(1));
  }
  ~Served() {
    server_.stop();
    thread_.join();
  }
  int port() const { return port_; }

 private:
  GuardedHttpServer server_;
  int port_ = 0;
  std::thread thread_;
};

// A non-blocking TCP connection from `source` (a loopback address) to 127.0.0.1:port.
ps::UniqueFd ConnectFrom(const std::string& source, int port) {
  ps::UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  EXPECT_EQ(bind(fd.get(), reinterpret_cast<sockaddr*>(&from), sizeof(from)), 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  EXPECT_EQ(connect(fd.get(), reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  EXPECT_TRUE(ps::PrepareTcpSocket(fd.get(), "").ok());
  return fd;
}

// Everything `conn` receives until the peer closes or `limit` passes.
std::string ReadAll(ps::Conn& conn, absl::Duration limit) {
  std::string out;
  const absl::Time deadline = absl::Now() + limit;
  char buffer[4096];
  while (true) {
    absl::StatusOr<size_t> got =
        ps::RecvSome(conn, buffer, sizeof(buffer), ps::IoLimit::Until(deadline));
    if (!got.ok()) return out;
    out.append(buffer, *got);
  }
}

// One GET /hello from `source`: the answer's bytes, the connection closed after it.
std::string Hello(const std::string& source, int port) {
  ps::Conn conn(ConnectFrom(source, port));
  EXPECT_TRUE(ps::SendAll(conn, "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                          ps::IoLimit::Idle(absl::Seconds(30)))
                  .ok());
  return ReadAll(conn, absl::Seconds(60));
}

// Sends a request's first line and then one header byte every 100 ms on each of `conns` until the
// server closes it (a write fails, or the peer's end of file or reset arrives) or `limit` passes:
// for each, how long the server kept it open.
std::vector<absl::Duration> Trickle(std::vector<ps::Conn>& conns, absl::Duration limit,
                                    bool http_line = true) {
  const absl::Time start = absl::Now();
  std::vector<absl::Duration> held(conns.size(), absl::InfiniteDuration());
  for (ps::Conn& c : conns) {
    if (http_line) {
      (void)send(c.fd(), "GET /hello HTTP/1.1\r\nX-Slow: ", 29, MSG_NOSIGNAL);
    } else {
      // A TLS record header (a handshake record of 512 bytes) whose body never arrives whole.
      (void)send(c.fd(), "\x16\x03\x01\x02\x00", 5, MSG_NOSIGNAL);
    }
  }
  while (absl::Now() - start < limit) {
    size_t open = 0;
    for (size_t i = 0; i < conns.size(); ++i) {
      if (held[i] != absl::InfiniteDuration()) continue;
      const int fd = conns[i].fd();
      pollfd p{fd, POLLIN, 0};
      char c;
      bool closed = false;
      if (poll(&p, 1, 0) > 0) {
        const ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
        closed = r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
        // (Anything sent is an answer: it ends the trickle too.)
        closed = closed || r > 0;
      }
      if (!closed && send(fd, "a", 1, MSG_NOSIGNAL) < 0) closed = true;
      if (closed) {
        held[i] = absl::Now() - start;
      } else {
        ++open;
      }
    }
    if (open == 0) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return held;
}

TEST(GuardedHttpServerTest, ATricklingRequestIsCutAtItsTimeSoThatTricklersCannotHoldEveryThread) {
  ConnectionLimits limits;
  limits.request_time = absl::Seconds(1);
  Served served(limits, /*threads=*/3);
  // As many tricklers as threads, from one address each (no per-peer limit in the way).
  std::vector<ps::Conn> tricklers;
  for (int i = 0; i < 3; ++i) {
    tricklers.emplace_back(ConnectFrom(absl::StrCat("127.0.0.", 10 + i), served.port()));
  }
  // Meanwhile another client is answered, once a thread is free again.
  std::string answer;
  std::thread other([&] {
    absl::SleepFor(absl::Milliseconds(200));  // (after the tricklers took the threads)
    answer = Hello("127.0.0.2", served.port());
  });
  const std::vector<absl::Duration> held = Trickle(tricklers, absl::Seconds(20));
  other.join();
  for (absl::Duration d : held) {
    // Cut at its time (1 s; not before: the steady bytes are not idleness), long before the
    // trickle would have ended by itself.
    EXPECT_GE(d, absl::Milliseconds(500));  // (its time counts from the server's accept)
    EXPECT_LT(d, absl::Seconds(8));
  }
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 200"));
  EXPECT_THAT(answer, HasSubstr("\r\n\r\nhi"));
}

// A kept-alive connection from `source`, answered once (so counted by the server).
ps::Conn HeldFrom(const std::string& source, int port) {
  ps::Conn conn(ConnectFrom(source, port));
  EXPECT_TRUE(ps::SendAll(conn, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n",
                          ps::IoLimit::Idle(absl::Seconds(30)))
                  .ok());
  char buffer[512];
  absl::StatusOr<size_t> got =
      ps::RecvSome(conn, buffer, sizeof(buffer), ps::IoLimit::Idle(absl::Seconds(30)));
  EXPECT_TRUE(got.ok()) << got.status();
  if (got.ok()) {
    EXPECT_THAT(std::string(buffer, *got), StartsWith("HTTP/1.1 200"));
  }
  return conn;
}

TEST(GuardedHttpServerTest, AnAddressPastItsConnectionsIsAnswered503AtOnceAndOthersAreServed) {
  ConnectionLimits limits;
  limits.per_peer = 3;
  limits.per_peer_busy = 2;
  limits.busy_at = 5;
  limits.exempt = {"127.0.0.4"};
  Served served(limits, /*threads=*/16);
  // 127.0.0.3 holds three connections, its limit; its fourth is refused at once, saying why.
  std::vector<ps::Conn> held;
  for (int i = 0; i < 3; ++i) held.push_back(HeldFrom("127.0.0.3", served.port()));
  const absl::Time start = absl::Now();
  std::string refused = Hello("127.0.0.3", served.port());
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  EXPECT_THAT(refused, StartsWith("HTTP/1.1 503"));
  EXPECT_THAT(refused, HasSubstr("too many connections from this address (at most 3 at once)"));
  // With 5 open (busy), 127.0.0.5 gets two, not three.
  std::vector<ps::Conn> five;
  for (int i = 0; i < 2; ++i) five.push_back(HeldFrom("127.0.0.5", served.port()));
  refused = Hello("127.0.0.5", served.port());
  EXPECT_THAT(refused, HasSubstr("too many connections from this address (at most 2 at once)"));
  // Another address is served, and an exempt one past any limit.
  EXPECT_THAT(Hello("127.0.0.2", served.port()), StartsWith("HTTP/1.1 200"));
  std::vector<ps::Conn> exempt;
  for (int i = 0; i < 3; ++i) exempt.push_back(HeldFrom("127.0.0.4", served.port()));
  EXPECT_THAT(Hello("127.0.0.4", served.port()), StartsWith("HTTP/1.1 200"));
  // Once connections close (no keep-alive timeout here: 30 s), the address is served again.
  exempt.clear();
  five.clear();
  held.pop_back();
  std::string again;
  for (const absl::Time until = absl::Now() + absl::Seconds(20);
       !absl::StartsWith(again, "HTTP/1.1 200") && absl::Now() < until;) {
    again = Hello("127.0.0.3", served.port());
    if (!absl::StartsWith(again, "HTTP/1.1 200")) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_THAT(again, StartsWith("HTTP/1.1 200"));
}

// A head of endless header lines, and a chunked body past the payload limit (which httplib checks
// for a Content-Length body only), are cut at the request's bytes, and hold nothing.
TEST(GuardedHttpServerTest, AnEndlessHeadOrChunkedBodyIsCutAtItsBytes) {
  Served served(ConnectionLimits{}, /*threads=*/4);
  std::string line = absl::StrCat("X-Filler: ", std::string(1000, 'a'), "\r\n");
  std::string head = "GET /hello HTTP/1.1\r\nHost: x\r\n";
  for (int i = 0; i < 1024; ++i) head += line;  // 1 MiB of headers
  std::string chunked = "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  const std::string chunk = absl::StrCat("1000\r\n", std::string(0x1000, 'b'), "\r\n");
  for (int i = 0; i < 256; ++i) chunked += chunk;  // 1 MiB of body
  chunked += "0\r\n\r\n";
  for (const std::string& request : {head, chunked}) {
    ps::Conn conn(ConnectFrom("127.0.0.2", served.port()));
    // The server stops reading and closes (what was sent meanwhile may fit in the buffers);
    // no answer says 200.
    (void)ps::SendAll(conn, request, ps::IoLimit::Idle(absl::Seconds(30)));
    const absl::Time start = absl::Now();
    EXPECT_THAT(ReadAll(conn, absl::Seconds(20)), ::testing::Not(HasSubstr("200 OK")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "not closed: " << request.substr(0, 40);
  }
  // A chunked body within the limit is read whole.
  ps::Conn conn(ConnectFrom("127.0.0.2", served.port()));
  ASSERT_TRUE(ps::SendAll(conn,
                          absl::StrCat("POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                       "Transfer-Encoding: chunked\r\n\r\n",
                                       chunk, chunk, "0\r\n\r\n"),
                          ps::IoLimit::Idle(absl::Seconds(30)))
                  .ok());
  EXPECT_THAT(ReadAll(conn, absl::Seconds(30)), HasSubstr("\r\n\r\n8192"));
}

TEST(GuardedHttpServerTest, OverTlsRequestsAreKeptAliveAndASlowHandshakeIsCut) {
  testing::TempDir dir;
  testing::TestPki pki(dir.path());
  absl::StatusOr<std::shared_ptr<const ps::TlsConfig>> server_tls =
      ps::TlsConfig::Server(pki.Path("server.pem"), pki.Path("server.key"));
  ASSERT_TRUE(server_tls.ok()) << server_tls.status();
  absl::StatusOr<std::shared_ptr<const ps::TlsConfig>> client_tls =
      ps::TlsConfig::Client(pki.Path("ca.pem"));
  ASSERT_TRUE(client_tls.ok()) << client_tls.status();
  ConnectionLimits limits;
  limits.request_time = absl::Seconds(1);
  limits.per_peer = 1;
  Served served(limits, /*threads=*/3, *server_tls);

  // Two requests on one connection, verified against the CA.
  absl::StatusOr<ps::Conn> conn =
      ps::TlsConnect(ConnectFrom("127.0.0.2", served.port()), **client_tls, "127.0.0.1",
                     ps::IoLimit::Idle(absl::Seconds(30)));
  ASSERT_TRUE(conn.ok()) << conn.status();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(ps::SendAll(*conn, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n",
                            ps::IoLimit::Idle(absl::Seconds(30)))
                    .ok());
    std::string answer;
    char buffer[512];
    while (!absl::EndsWith(answer, "hi")) {
      absl::StatusOr<size_t> got =
          ps::RecvSome(*conn, buffer, sizeof(buffer), ps::IoLimit::Idle(absl::Seconds(30)));
      ASSERT_TRUE(got.ok()) << got.status();
      answer.append(buffer, *got);
    }
    EXPECT_THAT(answer, StartsWith("HTTP/1.1 200"));
  }
  // A second connection from that address is closed before any handshake (the limit is 1);
  // another's handshake that trickles in is cut at its time.
  {
    absl::StatusOr<ps::Conn> refused =
        ps::TlsConnect(ConnectFrom("127.0.0.2", served.port()), **client_tls, "127.0.0.1",
                       ps::IoLimit::Idle(absl::Seconds(30)));
    EXPECT_FALSE(refused.ok());
  }
  conn->reset();
  std::vector<ps::Conn> tricklers;
  tricklers.emplace_back(ConnectFrom("127.0.0.3", served.port()));
  tricklers.emplace_back(ConnectFrom("127.0.0.4", served.port()));
  const std::vector<absl::Duration> held = Trickle(tricklers, absl::Seconds(20), false);
  for (absl::Duration d : held) {
    EXPECT_GE(d, absl::Milliseconds(500));
    EXPECT_LT(d, absl::Seconds(8));
  }
}

}  // namespace
}  // namespace trainyard::web
