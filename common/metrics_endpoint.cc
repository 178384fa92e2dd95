#include "common/metrics_endpoint.h"

#include <netdb.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/tls.h"

namespace trainyard {
namespace {

constexpr size_t kMaxRequestBytes = 8 << 10;
constexpr int kIoTimeoutSeconds = 5;
constexpr int kMaxConnections = 64;

// "HOST:PORT" ("[v6]:PORT" too) into its parts; false if it is not that.
bool SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (absl::StartsWith(*host, "[") && absl::EndsWith(*host, "]")) {
    *host = host->substr(1, host->size() - 2);
  }
  int n = 0;
  return absl::SimpleAtoi(*port, &n) && n >= 0 && n <= 65535 && !host->empty();
}

// One connection's stream, plain or TLS, on a blocking socket with send and receive timeouts.
struct Stream {
  int fd = -1;
  SSL* ssl = nullptr;

  ssize_t Read(char* buf, size_t n) {
    if (ssl == nullptr) return ::recv(fd, buf, n, 0);
    const int r = SSL_read(ssl, buf, static_cast<int>(n));
    return r > 0 ? r : (SSL_get_error(ssl, r) == SSL_ERROR_ZERO_RETURN ? 0 : -1);
  }
  bool WriteAll(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const size_t want = std::min<size_t>(bytes.size() - done, 1 << 20);
      ssize_t n;
      if (ssl == nullptr) {
        n = ::send(fd, bytes.data() + done, want, MSG_NOSIGNAL);
      } else {
        n = SSL_write(ssl, bytes.data() + done, static_cast<int>(want));
      }
      if (n <= 0) {
        if (ssl == nullptr && n < 0 && errno == EINTR) continue;
        return false;
      }
      done += static_cast<size_t>(n);
    }
    return true;
  }
};

}  // namespace

struct MetricsEndpoint::Impl {
  std::shared_ptr<prometheus::Registry> registry;
  std::string token;  // empty: none needed
  // TLS: the context (null: plain HTTP), whose certificate follows its files (looked at most
  // every tls_reload by a handshake). Set before the accept loop starts.
  SSL_CTX* tls = nullptr;
  std::unique_ptr<CertificateFollower> follower;
  int listener = -1;
  int wakeup = -1;  // an eventfd written to stop the accept loop
  std::string bound;
  std::thread accept_thread;
  absl::Duration request_deadline;

  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  struct Connection {
    int fd = -1;
    std::thread thread;
    bool done = false;
    // The whole exchange (TLS handshake, request, answer) must end by then; past it the accept
    // loop shuts the socket down under the connection's blocked read or write.
    absl::Time deadline;
    bool expired = false;
  };
  std::list<Connection> connections ABSL_GUARDED_BY(mu);

  ~Impl() {
    {
      absl::MutexLock lock(&mu);
      stopping = true;
    }
    if (wakeup >= 0) {
      const uint64_t one = 1;
      if (::write(wakeup, &one, sizeof(one)) != sizeof(one)) {
        // The accept loop also ends when its listener closes below.
      }
    }
    if (accept_thread.joinable()) accept_thread.join();
    std::list<Connection> left;
    {
      absl::MutexLock lock(&mu);
      for (Connection& c : connections) {
        if (!c.done) ::shutdown(c.fd, SHUT_RDWR);
      }
      left.swap(connections);
    }
    for (Connection& c : left) {
      if (c.thread.joinable()) c.thread.join();
    }
    if (listener >= 0) ::close(listener);
    if (wakeup >= 0) ::close(wakeup);
    if (tls != nullptr) SSL_CTX_free(tls);  // (the follower, after: no handshake is left)
  }

  // A context with the files' certificate and key; null (the queue cleared) if they do not load.
  static SSL_CTX* NewContext(const std::string& cert_file, const std::string& key_file,
                             std::string* error) {
    SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
    if (ctx == nullptr) {
      *error = absl::StrCat("TLS: ", OpenSslErrors());
      return nullptr;
    }
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    if (SSL_CTX_use_certificate_chain_file(ctx, cert_file.c_str()) != 1) {
      *error = absl::StrCat("--tls-cert: cannot use ", cert_file, ": ", OpenSslErrors());
    } else if (SSL_CTX_use_PrivateKey_file(ctx, key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
               SSL_CTX_check_private_key(ctx) != 1) {
      *error = absl::StrCat("--tls-key: cannot use ", key_file, ": ", OpenSslErrors());
    } else {
      return ctx;
    }
    SSL_CTX_free(ctx);
    return nullptr;
  }

  // Shuts down the sockets of connections past their deadline; the milliseconds until the next
  // deadline (-1: none).
  int ExpireConnections() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    for (Connection& c : connections) {
      if (c.done || c.expired) continue;
      if (c.deadline <= now) {
        ::shutdown(c.fd, SHUT_RDWR);
        c.expired = true;
      } else {
        next = std::min(next, c.deadline);
      }
    }
    if (next == absl::InfiniteFuture()) return -1;
    return static_cast<int>(
        absl::ToInt64Milliseconds(absl::Ceil(next - now, absl::Milliseconds(1))));
  }

  void AcceptLoop() {
    int wait_ms = -1;
    while (true) {
      pollfd fds[2] = {{listener, POLLIN, 0}, {wakeup, POLLIN, 0}};
      const int r = ::poll(fds, 2, wait_ms);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 || fds[1].revents != 0) return;
      if (r == 0) {
        absl::MutexLock lock(&mu);
        wait_ms = ExpireConnections();
        continue;
      }
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      absl::MutexLock lock(&mu);
      // Threads of connections that ended are joined here, under the lock they never take
      // again once done.
      for (auto it = connections.begin(); it != connections.end();) {
        if (it->done) {
          it->thread.join();
          it = connections.erase(it);
        } else {
          ++it;
        }
      }
      wait_ms = ExpireConnections();
      if (stopping || static_cast<int>(connections.size()) >= kMaxConnections) {
        ::close(fd);
        continue;
      }
      Connection& c = connections.emplace_back();
      c.fd = fd;
      c.deadline = absl::Now() + request_deadline;
      c.thread = std::thread([this, &c] { Serve(&c); });
      if (wait_ms < 0) wait_ms = static_cast<int>(absl::ToInt64Milliseconds(request_deadline)) + 1;
    }
  }

  void Serve(Connection* c) {
    // A peer that closed early must not kill the process: SIGPIPE stays pending on this thread.
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    const timeval timeout{kIoTimeoutSeconds, 0};
    ::setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    ::setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    Stream stream{c->fd, nullptr};
    if (tls != nullptr) {
      stream.ssl = SSL_new(tls);
      if (stream.ssl == nullptr || SSL_set_fd(stream.ssl, c->fd) != 1 ||
          SSL_accept(stream.ssl) != 1) {
        ERR_clear_error();
        Finish(c, stream);
        return;
      }
    }
    std::string request;
    char buf[2048];
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
      const ssize_t n = stream.Read(buf, sizeof(buf));
      if (n <= 0) {
        Finish(c, stream);
        return;
      }
      request.append(buf, static_cast<size_t>(n));
    }
    stream.WriteAll(Answer(request));
    Finish(c, stream);
  }

  void Finish(Connection* c, Stream& stream) {
    if (stream.ssl != nullptr) {
      SSL_shutdown(stream.ssl);
      SSL_free(stream.ssl);
      ERR_clear_error();
    }
    absl::MutexLock lock(&mu);
    ::close(c->fd);
    c->done = true;
  }

  static std::string Response(const std::string& status, const std::string& body,
                              const std::string& extra_headers = "") {
    return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ",
                        status == "200 OK" ? "text/plain; version=0.0.4; charset=utf-8"
                                           : "text/plain; charset=utf-8",
                        "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                        "Connection: close\r\n\r\n", body);
  }

  std::string Answer(const std::string& request) const {
    const size_t end = request.find("\r\n\r\n");
    if (end == std::string::npos) return Response("431 Request Header Fields Too Large", "");
    std::vector<absl::string_view> lines =
        absl::StrSplit(absl::string_view(request).substr(0, end), "\r\n");
    std::vector<absl::string_view> first = absl::StrSplit(lines[0], ' ');
    if (first.size() != 3 || (first[0] != "GET" && first[0] != "HEAD")) {
      return Response("405 Method Not Allowed", "only GET /metrics\n", "Allow: GET, HEAD\r\n");
    }
    const absl::string_view path = first[1].substr(0, first[1].find('?'));
    if (path != "/metrics") return Response("404 Not Found", "only /metrics\n");
    if (!token.empty()) {
      bool authorized = false;
      for (size_t i = 1; i < lines.size(); ++i) {
        const size_t colon = lines[i].find(':');
        if (colon == absl::string_view::npos) continue;
        if (!absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(lines[i].substr(0, colon)),
                                    "authorization")) {
          continue;
        }
        const absl::string_view value = absl::StripAsciiWhitespace(lines[i].substr(colon + 1));
        absl::string_view credential = value;
        authorized = absl::ConsumePrefix(&credential, "Bearer ") &&
                     ConstantTimeEquals(absl::StripAsciiWhitespace(credential), token);
      }
      if (!authorized) {
        return Response("401 Unauthorized",
                        "send \"Authorization: Bearer <token>\" (--metrics-token-file)\n",
                        "WWW-Authenticate: Bearer realm=\"trainyard metrics\"\r\n");
      }
    }
    const std::string body = prometheus::TextSerializer().Serialize(registry->Collect());
    std::string answer = Response("200 OK", body);
    if (first[0] == "HEAD") answer.resize(answer.size() - body.size());
    return answer;
  }
};

MetricsEndpoint::MetricsEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsEndpoint::~MetricsEndpoint() = default;

const std::string& MetricsEndpoint::bound_address() const { return impl_->bound; }

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const MetricsEndpointOptions& options, std::shared_ptr<prometheus::Registry> registry) {
  std::string host, port;
  if (!SplitAddress(options.address, &host, &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-address: expected HOST:PORT with a port in 0..65535, got '",
                     options.address, "'"));
  }
  auto impl = std::make_unique<Impl>();
  impl->registry = std::move(registry);
  impl->request_deadline = options.request_deadline;
  if (!options.token_file.empty()) {
    auto token = ReadSecretFile(options.token_file);
    if (!token.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics-token-file: ", token.status().message()));
    }
    impl->token = *std::move(token);
  }
  if (!IsLoopback(options.address) && impl->token.empty() && !options.insecure) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-address: ", options.address,
        " is not a loopback address: give --metrics-token-file (scrapes then need that bearer "
        "token), or --metrics-insecure to let anyone who can reach it read the metrics"));
  }
  if (!options.tls_cert_file.empty()) {
    std::string error;
    impl->tls = Impl::NewContext(options.tls_cert_file, options.tls_key_file, &error);
    if (impl->tls == nullptr) return absl::InvalidArgumentError(error);
    impl->follower = CertificateFollower::Install(impl->tls, options.tls_cert_file,
                                                  options.tls_key_file, options.tls_reload);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int r = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); r != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-address: ", options.address, ": ", gai_strerror(r)));
  }
  int bound_port = 0;
  for (addrinfo* a = found; a != nullptr && impl->listener < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 64) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      ::close(fd);
      continue;
    }
    bound_port =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    impl->listener = fd;
  }
  ::freeaddrinfo(found);
  if (impl->listener < 0) {
    return absl::UnavailableError(absl::StrCat("--metrics-address: cannot serve on ",
                                               options.address, ": ", std::strerror(errno)));
  }
  impl->wakeup = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl->wakeup < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  impl->bound =
      absl::StrCat(options.address.substr(0, options.address.rfind(':')), ":", bound_port);
  Impl* raw = impl.get();
  impl->accept_thread = std::thread([raw] { raw->AcceptLoop(); });
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::move(impl)));
}

}  // namespace trainyard
