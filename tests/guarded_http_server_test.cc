// The web console's HTTP server (server/web/guarded_http_server.h) on real sockets: a request
// that trickles in is cut at its time however steadily it comes (plain and TLS), so that
// tricklers cannot hold every thread; one address past its connections is answered 503 at once
// while others are served, and so is a connection past the queue; a body is refused before it is
// read when it is compressed, framed twice or longer than the limit; an answer read too slowly is
// cut; a stopping server closes what waits; keep-alive and TLS serve as httplib's own server did.
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
// (POST /echo: the body's size; DELETE /count: counts its calls in `deleted`; GET /big: 64 MiB.)
class Served {
 public:
  Served(ConnectionLimits limits, int threads, std::shared_ptr<const ps::TlsConfig> tls = nullptr,
         absl::Duration write_timeout = absl::Seconds(5))
      : server_(WithThreads(std::move(limits), threads), std::move(tls)) {
    server_.set_read_timeout(30, 0);     // (so that only the request's time cuts a trickle)
    server_.set_keep_alive_timeout(30);  // (so that only a close frees a connection)
    server_.set_payload_max_length(64 << 10);
    server_.set_write_timeout(absl::ToInt64Seconds(write_timeout), 0);
    server_.Get("/hello", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("hi", "text/plain");
    });
    server_.Post("/echo", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(absl::StrCat(req.body.size()), "text/plain");
    });
    server_.Delete("/count", [this](const httplib::Request&, httplib::Response& res) {
      ++deleted;
      res.set_content("counted", "text/plain");
    });
    server_.Get("/big", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(std::string(64 << 20, 'x'), "text/plain");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    EXPECT_GT(port_, 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 10000 && !server_.is_running(); ++i) absl::SleepFor(absl::Milliseconds(1));
  }
  ~Served() { Stop(); }
  void Stop() {
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }
  int port() const { return port_; }
  GuardedHttpServer& server() { return server_; }
  // Until `n` connections are served at once (false: not within 30 s).
  bool AwaitOpen(int n) {
    for (const absl::Time until = absl::Now() + absl::Seconds(30); absl::Now() < until;) {
      if (server_.open_connections() == n) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }

  std::atomic<int> deleted{0};

 private:
  static ConnectionLimits WithThreads(ConnectionLimits limits, int threads) {
    limits.threads = threads;
    return limits;
  }

  GuardedHttpServer server_;
  int port_ = 0;
  std::thread thread_;
};

// A non-blocking TCP connection from `source` (a loopback address) to 127.0.0.1:port; with a
// receive buffer of `receive_buffer` bytes where not 0.
ps::UniqueFd ConnectFrom(const std::string& source, int port, int receive_buffer = 0) {
  ps::UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
  if (receive_buffer > 0) {
    setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
  }
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
    if (served.AwaitOpen(3)) answer = Hello("127.0.0.2", served.port());  // (threads all taken)
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

  // Two requests on one connection, verified against the CA: the second after more than the
  // request time of quiet (a request's time counts from its own first byte).
  absl::StatusOr<ps::Conn> conn =
      ps::TlsConnect(ConnectFrom("127.0.0.2", served.port()), **client_tls, "127.0.0.1",
                     ps::IoLimit::Idle(absl::Seconds(30)));
  ASSERT_TRUE(conn.ok()) << conn.status();
  for (int i = 0; i < 2; ++i) {
    if (i == 1) absl::SleepFor(absl::Milliseconds(1500));  // (the quiet under test)
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

// `request`'s bytes from 127.0.0.2: what is answered until the server closes (at most 30 s).
std::string Send(int port, const std::string& request) {
  ps::Conn conn(ConnectFrom("127.0.0.2", port));
  EXPECT_TRUE(ps::SendAll(conn, request, ps::IoLimit::Idle(absl::Seconds(30))).ok());
  return ReadAll(conn, absl::Seconds(30));
}

// httplib inflated a compressed body without a limit (a 64 KiB gzip bomb is 64 MiB, brotli's far
// more), read a POST without a length until the peer's end of file, and read a body past the
// limit to skip it: each is answered before its body is read, saying why, and runs no handler.
TEST(GuardedHttpServerTest, ABodyIsRefusedBeforeItIsReadWhenCompressedFramedTwiceOrTooLong) {
  Served served(ConnectionLimits{}, /*threads=*/4);
  const int port = served.port();
  const std::string post = "POST /echo HTTP/1.1\r\nHost: x\r\n";
  std::string answer = Send(port, post + "Content-Encoding: gzip\r\nContent-Length: 4\r\n\r\nabcd");
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 415"));
  EXPECT_THAT(answer, HasSubstr("Content-Encoding: a request's body is taken as it is"));
  answer = Send(port, "DELETE /count HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\n\r\n");
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 415"));
  EXPECT_EQ(served.deleted.load(), 0);
  // A length past the limit: none of it is sent here, and the answer comes at once.
  answer = Send(port, post + "Content-Length: 70000\r\n\r\n");
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 413"));
  EXPECT_THAT(answer, HasSubstr("body: larger than 65536 bytes (Content-Length: 70000)"));
  // Sent whole anyway: the answer is read before the close (the body is read past, not reset).
  answer = Send(port, post + "Content-Length: 70000\r\n\r\n" + std::string(70000, 'a'));
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 413"));
  answer = Send(port, post + "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\nabcd");
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 400"));
  EXPECT_THAT(answer, HasSubstr("Transfer-Encoding and Content-Length"));
  answer = Send(port, post + "Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n");
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 501"));
  for (const char* length : {"4x", "-4", "+4", "99999999999999999999999"}) {
    answer = Send(port, absl::StrCat(post, "Content-Length: ", length, "\r\n\r\nabcd"));
    EXPECT_THAT(answer, StartsWith("HTTP/1.1 400")) << length;
    EXPECT_THAT(answer, HasSubstr("Content-Length: not one decimal count of bytes")) << length;
  }
  // A POST with neither a length nor chunks has no body: answered at once (not when the peer ends
  // its sending, or the request's time does).
  const absl::Time start = absl::Now();
  answer = Send(port, post + "Connection: close\r\n\r\n");
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 200"));
  EXPECT_THAT(answer, HasSubstr("\r\n\r\n0"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));  // (not at the request's time, 10 s)
  // Taken: no encoding said as "identity", and chunks however their name is written.
  EXPECT_THAT(Send(port, post + "Connection: close\r\nContent-Encoding: identity\r\n"
                                "Content-Length: 4\r\n\r\nabcd"),
              HasSubstr("\r\n\r\n4"));
  EXPECT_THAT(Send(port, post + "Connection: close\r\nTransfer-Encoding: Chunked\r\n\r\n"
                                "4\r\nabcd\r\n0\r\n\r\n"),
              HasSubstr("\r\n\r\n4"));
  // Pipelined: a body and the next request in one send are both answered, in order.
  answer = Send(port, post + "Content-Length: 4\r\n\r\nabcd" +
                          "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(answer, HasSubstr("\r\n\r\n4HTTP/1.1 200"));
  EXPECT_THAT(answer, ::testing::EndsWith("\r\n\r\nhi"));
  // A body where httplib reads none (a GET's; a DELETE's in chunks) was the connection's next
  // request (through a proxy that reuses its connections: another client's); so was one after
  // a head httplib answered itself (a bad Range: 416). Refused, or the connection closed.
  const std::string smuggled = "DELETE /count HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";
  answer =
      Send(port, absl::StrCat("GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: ", smuggled.size(),
                              "\r\n\r\n", smuggled));
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 400"));
  EXPECT_THAT(answer, HasSubstr("Content-Length: a GET here has no body"));
  answer = Send(port, absl::StrCat("DELETE /count HTTP/1.1\r\nHost: x\r\n"
                                   "Transfer-Encoding: chunked\r\n\r\n",
                                   absl::Hex(smuggled.size()), "\r\n", smuggled, "\r\n0\r\n\r\n"));
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 400"));
  answer = Send(port, absl::StrCat("POST /echo HTTP/1.1\r\nHost: x\r\nRange: bytes=x\r\n"
                                   "Content-Length: ",
                                   smuggled.size(), "\r\n\r\n", smuggled));
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 416"));
  EXPECT_EQ(served.deleted.load(), 0);
  // (And a plain DELETE is counted: the 0 above is no handler's.)
  EXPECT_THAT(Send(port, "DELETE /count HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
              StartsWith("HTTP/1.1 200"));
  EXPECT_EQ(served.deleted.load(), 1);
}

// A client that reads a long answer slowly, but never so slowly that the write timeout (1 s of
// no progress) cuts it, is cut at the answer's least rate; one that reads it at once gets all.
TEST(GuardedHttpServerTest, AnAnswerReadTooSlowlyIsCutAtItsLeastRate) {
  ConnectionLimits limits;
  // Bytes a second: 64 MiB within 1 + 4 s (more than the socket buffers hold: a client that
  // reads nothing still has most of it to read when it is cut).
  limits.min_send_rate = 16 << 20;
  Served served(limits, /*threads=*/2, nullptr, /*write_timeout=*/absl::Seconds(1));
  const std::string get = "GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  EXPECT_GT(Send(served.port(), get).size(), size_t{64} << 20);

  ps::Conn conn(ConnectFrom("127.0.0.3", served.port(), /*receive_buffer=*/64 << 10));
  ASSERT_TRUE(ps::SendAll(conn, get, ps::IoLimit::Idle(absl::Seconds(30))).ok());
  const absl::Time start = absl::Now();
  size_t received = 0;
  char buffer[32 << 10];
  while (absl::Now() - start < absl::Seconds(60)) {
    // 32 KiB each 50 ms: 640 KiB a second, a tenth of the least rate.
    absl::StatusOr<size_t> got =
        ps::RecvSome(conn, buffer, sizeof(buffer), ps::IoLimit::Idle(absl::Seconds(30)));
    if (!got.ok()) break;
    received += *got;
    absl::SleepFor(absl::Milliseconds(50));
  }
  const absl::Duration held = absl::Now() - start;
  EXPECT_LT(received, size_t{64} << 20);
  EXPECT_GE(held, absl::Seconds(3));  // (not the write timeout: each 50 ms moved bytes)
  EXPECT_LT(held, absl::Seconds(20));
}

// A connection past the queue is answered 503 by the listener at once, while every thread is
// taken; a stopping server closes those that wait without serving them.
TEST(GuardedHttpServerTest, PastTheQueueAConnectionIsAnswered503AndAStopClosesTheQueue) {
  ConnectionLimits limits;
  limits.request_time = absl::Seconds(5);
  limits.max_queued = 2;
  Served served(limits, /*threads=*/1);
  std::vector<ps::Conn> trickler;
  trickler.emplace_back(ConnectFrom("127.0.0.3", served.port()));
  ASSERT_TRUE(ps::SendAll(trickler[0],
                          "GET /hello HTTP/1.1\r\nX-Slow: ", ps::IoLimit::Idle(absl::Seconds(30)))
                  .ok());
  ASSERT_TRUE(served.AwaitOpen(1));
  // Two wait for the thread, each with its request sent; the third (after them: the listener
  // accepts in order) is turned away.
  std::vector<ps::Conn> queued;
  for (int i = 0; i < 2; ++i) {
    queued.emplace_back(ConnectFrom("127.0.0.4", served.port()));
    ASSERT_TRUE(ps::SendAll(queued.back(), "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n",
                            ps::IoLimit::Idle(absl::Seconds(30)))
                    .ok());
  }
  const absl::Time start = absl::Now();
  {
    ps::Conn third(ConnectFrom("127.0.0.5", served.port()));
    const std::string answer = ReadAll(third, absl::Seconds(30));
    EXPECT_THAT(answer, StartsWith("HTTP/1.1 503"));
    EXPECT_THAT(answer, HasSubstr("the console is busy"));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));  // (before the trickler's time frees it)
  // Stopped: the trickler is cut at its time, and the two that waited are closed unanswered.
  std::thread stop([&] { served.Stop(); });
  for (ps::Conn& c : queued) EXPECT_EQ(ReadAll(c, absl::Seconds(30)), "");
  stop.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

TEST(GuardedHttpServerTest, AnIPv6PeerIsCountedByItsSlash64AndAZoneIsNoPartOfItsAddress) {
  EXPECT_EQ(PeerKey("2001:db8:1:2:aaaa::1"), "2001:db8:1:2::/64");
  EXPECT_EQ(PeerKey("2001:db8:1:2:bbbb:cccc:dddd:2"), "2001:db8:1:2::/64");
  EXPECT_NE(PeerKey("2001:db8:1:3::1"), PeerKey("2001:db8:1:2::1"));
  EXPECT_EQ(PeerKey("10.0.0.1"), "10.0.0.1");
  EXPECT_EQ(CanonicalAddress("fe80::1%eth0"), "fe80::1");
  EXPECT_EQ(CanonicalAddress("::ffff:10.0.0.1"), "10.0.0.1");
  EXPECT_EQ(CanonicalAddress("2001:DB8:0::0:1"), "2001:db8::1");
  EXPECT_EQ(CanonicalAddress("example.com"), std::nullopt);
}

}  // namespace
}  // namespace trainyard::web
