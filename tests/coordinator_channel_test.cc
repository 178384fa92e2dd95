// The coordinator's clients' channels (common/coordinator_channel.h) connect over a slow link: a
// TLS handshake that takes seconds (a busy coordinator host, a long path) completes, where gRPC's
// connect timeout had been cut to 100 ms and every attempt was abandoned. Real gRPC over TLS,
// through a proxy on loopback that delays every chunk it passes on.
#include "common/coordinator_channel.h"

#include <arpa/inet.h>
#include <grpcpp/generic/async_generic_service.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_pki.h"

namespace trainyard {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Listens on loopback; each connection is passed on to `port`, every chunk in either direction
// held `delay` first (a link with that one-way latency).
class SlowLink {
 public:
  SlowLink(int port, absl::Duration delay) : port_(port), delay_(delay) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(::listen(listener_, 8), 0);
    EXPECT_EQ(::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    listen_port_ = ntohs(a.sin_port);
    threads_.emplace_back([this] { Accept(); });
  }
  ~SlowLink() {
    stopping_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    for (std::thread& t : threads_) t.join();
    for (int fd : fds_) ::close(fd);
    ::close(listener_);
  }
  int port() const { return listen_port_; }

 private:
  void Accept() {
    while (!stopping_) {
      const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) return;
      const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(port_);
      if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        ::close(client);
        ::close(server);
        continue;
      }
      fds_.push_back(client);
      fds_.push_back(server);
      threads_.emplace_back([this, client, server] { Pass(client, server); });
      threads_.emplace_back([this, client, server] { Pass(server, client); });
    }
  }
  // (The delay is the link's latency, not a wait for an event.)
  void Pass(int from, int to) {
    char buf[65536];
    while (true) {
      const ssize_t n = ::read(from, buf, sizeof(buf));
      if (n <= 0) break;
      absl::SleepFor(delay_);
      if (::send(to, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
    }
    ::shutdown(to, SHUT_WR);
  }

  const int port_;
  const absl::Duration delay_;
  int listener_ = -1;
  int listen_port_ = 0;
  std::atomic<bool> stopping_{false};
  std::vector<int> fds_;  // (the accept thread's until the destructor joins it)
  std::vector<std::thread> threads_;
};

TEST(CoordinatorChannelTest, ATlsHandshakeThatTakesSecondsCompletes) {
  testing::TempDir dir;
  testing::TestPki pki(dir.path());
  grpc::SslServerCredentialsOptions tls;
  tls.pem_key_cert_pairs.push_back(
      {ReadFile(pki.Path("server.key")), ReadFile(pki.Path("server.pem"))});
  int port = 0;
  grpc::CallbackGenericService service;  // (a server needs one; no call is made)
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&service);
  builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(tls), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  // 400 ms each way: TCP, TLS 1.3 and HTTP/2's settings take two round trips at least, 1.6 s,
  // longer than the 1 s an attempt was given at most.
  SlowLink link(port, absl::Milliseconds(400));
  grpc::SslCredentialsOptions ca;
  ca.pem_root_certs = ReadFile(pki.Path("ca.pem"));
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", link.port()),
                                           grpc::SslCredentials(ca), CoordinatorChannelArguments());
  const absl::Time start = absl::Now();
  EXPECT_TRUE(channel->WaitForConnected(absl::ToChronoTime(start + absl::Seconds(20))))
      << "not connected after " << absl::Now() - start;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1600));  // (the link was that slow)
  server->Shutdown(absl::ToChronoTime(absl::Now()));
}

}  // namespace
}  // namespace trainyard
