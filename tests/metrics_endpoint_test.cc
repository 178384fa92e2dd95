// The servers' /metrics endpoint: Prometheus text over plain HTTP or TLS, with an optional bearer
// token (401 without it, constant-time compared), only GET /metrics, and no non-loopback address
// without a token unless --metrics-insecure; trickling clients lose their connection at the
// whole-request deadline. A real endpoint on loopback; TLS certificates from
// the openssl command; the clients are raw sockets and OpenSSL, as a scraper is.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/metrics_endpoint.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_pki.h"

namespace trainyard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// A connected socket to HOST:PORT, or -1.
int Dial(const std::string& address) {
  const size_t colon = address.rfind(':');
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(address.substr(0, colon).c_str(), address.substr(colon + 1).c_str(), &hints,
                  &found) != 0) {
    return -1;
  }
  const int fd = socket(found->ai_family, found->ai_socktype, 0);
  const bool ok = fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0;
  freeaddrinfo(found);
  if (!ok && fd >= 0) close(fd);
  return ok ? fd : -1;
}

std::string Request(const std::string& method, const std::string& path, const std::string& token) {
  return absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: scraper\r\n",
                      token.empty() ? "" : absl::StrCat("Authorization: Bearer ", token, "\r\n"),
                      "Accept: text/plain\r\n\r\n");
}

// The whole response (status line, headers, body) to a plain HTTP request.
std::string Get(const std::string& address, const std::string& path, const std::string& token = "",
                const std::string& method = "GET") {
  const int fd = Dial(address);
  if (fd < 0) return "cannot connect";
  const std::string request = Request(method, path, token);
  EXPECT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
  close(fd);
  return out;
}

// The same over TLS, verifying the server against `ca_file` and 127.0.0.1.
std::string GetTls(const std::string& address, const std::string& ca_file,
                   const std::string& token) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL_CTX_load_verify_locations(ctx, ca_file.c_str(), nullptr);
  SSL* ssl = SSL_new(ctx);
  SSL_set_verify(ssl, SSL_VERIFY_PEER, nullptr);
  X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), "127.0.0.1");
  const int fd = Dial(address);
  std::string out;
  SSL_set_fd(ssl, fd);
  if (fd >= 0 && SSL_connect(ssl) == 1) {
    const std::string request = Request("GET", "/metrics", token);
    SSL_write(ssl, request.data(), static_cast<int>(request.size()));
    char buf[4096];
    for (int n; (n = SSL_read(ssl, buf, sizeof(buf))) > 0;) out.append(buf, n);
  } else {
    out = "handshake failed";
  }
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  if (fd >= 0) close(fd);
  return out;
}

class MetricsEndpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_ = std::make_shared<prometheus::Registry>();
    prometheus::BuildCounter()
        .Name("trainyard_test_total")
        .Help("a counter")
        .Register(*registry_)
        .Add({{"kind", "a"}})
        .Increment(3);
    token_file_ = dir_.path() + "/metrics.token";
    ASSERT_TRUE(WriteSecretFile(token_file_, "s3cret-token").ok());
  }

  testing::TempDir dir_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::string token_file_;
};

TEST_F(MetricsEndpointTest, ServesTheRegistryAsPrometheusTextOnlyAtMetrics) {
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", registry_);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const std::string address = (*endpoint)->bound_address();
  EXPECT_THAT(address, StartsWith("127.0.0.1:"));
  const std::string ok = Get(address, "/metrics");
  EXPECT_THAT(ok, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(ok, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(ok, HasSubstr("trainyard_test_total{kind=\"a\"} 3"));
  EXPECT_THAT(Get(address, "/"), StartsWith("HTTP/1.1 404 "));
  EXPECT_THAT(Get(address, "/metrics", "", "POST"), StartsWith("HTTP/1.1 405 "));
  const std::string head = Get(address, "/metrics", "", "HEAD");
  EXPECT_THAT(head, StartsWith("HTTP/1.1 200 OK"));
  EXPECT_THAT(head, Not(HasSubstr("trainyard_test_total")));
  // An oversized request is refused, not buffered without end.
  const int fd = Dial(address);
  ASSERT_GE(fd, 0);
  const std::string huge = "GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'x');
  send(fd, huge.data(), huge.size(), MSG_NOSIGNAL);
  char buf[256] = {};
  const ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
  close(fd);
  EXPECT_THAT(std::string(buf, n > 0 ? n : 0), StartsWith("HTTP/1.1 431 "));
}

// Slow clients (issue 52): twenty clients that trickle bytes of a request that never ends keep a
// byte arriving far more often than the 5 s a single read may wait, yet each loses its
// connection at the whole-request deadline, and a scrape beside them is answered meanwhile.
TEST_F(MetricsEndpointTest, TricklingClientsLoseTheirConnectionAtTheDeadlineAndScrapesGoOn) {
  MetricsEndpointOptions options;
  options.address = "127.0.0.1:0";
  options.request_deadline = absl::Seconds(1);
  auto endpoint = MetricsEndpoint::Start(options, registry_);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const std::string address = (*endpoint)->bound_address();
  const absl::Time start = absl::Now();
  std::vector<int> slow;
  for (int i = 0; i < 20; ++i) {
    const int fd = Dial(address);
    ASSERT_GE(fd, 0);
    slow.push_back(fd);
  }
  EXPECT_THAT(Get(address, "/metrics"), StartsWith("HTTP/1.1 200 OK"));

  std::vector<pollfd> fds;
  for (int fd : slow) fds.push_back({fd, POLLIN, 0});
  size_t open = fds.size();
  absl::Duration last_closed;
  while (open > 0 && absl::Now() - start < absl::Seconds(8)) {
    for (pollfd& p : fds) {
      if (p.fd >= 0) send(p.fd, "X", 1, MSG_NOSIGNAL);  // header bytes, never a blank line
    }
    if (poll(fds.data(), fds.size(), 100) <= 0) continue;
    for (pollfd& p : fds) {
      if (p.fd < 0 || p.revents == 0) continue;
      char buf[64];
      EXPECT_LE(recv(p.fd, buf, sizeof(buf), 0), 0) << "a trickled request got an answer";
      close(p.fd);
      p.fd = -1;
      --open;
      last_closed = absl::Now() - start;
    }
  }
  EXPECT_EQ(open, 0u) << "slow clients still connected after 8 s";
  EXPECT_LT(last_closed, absl::Seconds(4.5)) << "closed by the 5 s read timeout, not the deadline";
  for (const pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);
  }
  EXPECT_THAT(Get(address, "/metrics"), StartsWith("HTTP/1.1 200 OK"));
}

TEST_F(MetricsEndpointTest, WithATokenFileScrapesNeedItsBearerToken) {
  MetricsEndpointOptions o;
  o.address = "127.0.0.1:0";
  o.token_file = token_file_;
  auto endpoint = MetricsEndpoint::Start(o, registry_);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const std::string address = (*endpoint)->bound_address();
  const std::string none = Get(address, "/metrics");
  EXPECT_THAT(none, StartsWith("HTTP/1.1 401 Unauthorized\r\n"));
  EXPECT_THAT(none, HasSubstr("WWW-Authenticate: Bearer"));
  EXPECT_THAT(none, Not(HasSubstr("trainyard_test_total")));
  EXPECT_THAT(Get(address, "/metrics", "s3cret-tokeN"), StartsWith("HTTP/1.1 401 "));
  EXPECT_THAT(Get(address, "/metrics", "s3cret-token"), HasSubstr("trainyard_test_total"));
}

TEST_F(MetricsEndpointTest, OverTlsWithTheServersCertificate) {
  testing::TestPki pki(dir_.path());
  MetricsEndpointOptions o;
  o.address = "127.0.0.1:0";
  o.token_file = token_file_;
  o.tls_cert_file = pki.Path("server.pem");
  o.tls_key_file = pki.Path("server.key");
  auto endpoint = MetricsEndpoint::Start(o, registry_);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const std::string address = (*endpoint)->bound_address();
  EXPECT_THAT(GetTls(address, pki.Path("ca.pem"), "s3cret-token"),
              HasSubstr("trainyard_test_total{kind=\"a\"} 3"));
  EXPECT_THAT(GetTls(address, pki.Path("ca.pem"), ""), StartsWith("HTTP/1.1 401 "));
  EXPECT_EQ(GetTls(address, pki.Path("other-ca.pem"), "s3cret-token"), "handshake failed");
  // Plain HTTP to it gets nothing.
  EXPECT_THAT(Get(address, "/metrics", "s3cret-token"), Not(HasSubstr("trainyard_test_total")));
}

TEST_F(MetricsEndpointTest, ARenewedCertificateCountsForTheNextScrape) {
  testing::TestPki pki(dir_.path());
  pki.SignWithSan("elsewhere", "elsewhere", "IP:10.0.0.9");
  const std::string cert = dir_.path() + "/live.pem", key = dir_.path() + "/live.key";
  std::filesystem::copy_file(pki.Path("elsewhere.pem"), cert);
  std::filesystem::copy_file(pki.Path("elsewhere.key"), key);
  MetricsEndpointOptions o;
  o.address = "127.0.0.1:0";
  o.tls_cert_file = cert;
  o.tls_key_file = key;
  o.tls_reload = absl::ZeroDuration();  // looked at by every connection
  auto endpoint = MetricsEndpoint::Start(o, registry_);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const std::string address = (*endpoint)->bound_address();
  EXPECT_EQ(GetTls(address, pki.Path("ca.pem"), ""), "handshake failed");  // not for 127.0.0.1
  for (const char* ext : {".pem", ".key"}) {
    std::filesystem::copy_file(pki.Path(std::string("server") + ext), dir_.path() + "/next" + ext);
    std::filesystem::rename(dir_.path() + "/next" + ext, dir_.path() + "/live" + ext);
  }
  EXPECT_THAT(GetTls(address, pki.Path("ca.pem"), ""), HasSubstr("trainyard_test_total"));
}

TEST_F(MetricsEndpointTest, ANonLoopbackAddressNeedsATokenOrMetricsInsecure) {
  MetricsEndpointOptions o;
  o.address = "0.0.0.0:0";
  auto refused = MetricsEndpoint::Start(o, registry_);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("--metrics-address: 0.0.0.0:0 is not a loopback address"));
  o.token_file = token_file_;
  EXPECT_TRUE(MetricsEndpoint::Start(o, registry_).ok());
  o.token_file.clear();
  o.insecure = true;
  EXPECT_TRUE(MetricsEndpoint::Start(o, registry_).ok());
  o.address = "nonsense";
  auto bad = MetricsEndpoint::Start(o, registry_);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("--metrics-address: expected"));
}

}  // namespace
}  // namespace trainyard
