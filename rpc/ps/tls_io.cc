#include "rpc/ps/tls_io.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/tls.h"

namespace trainyard::ps {
namespace {

// OpenSSL's error queue as one line (and cleared): its reasons, most recent last.

absl::Status FlagError(const char* flag, const std::string& path) {
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": cannot use ", path, ": ", OpenSslErrors()));
}

SSL_CTX* NewContext(bool server) {
  SSL_CTX* ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
  if (ctx == nullptr) return nullptr;
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  // AES-128-GCM first: as safe for this traffic and about a third cheaper than AES-256 per byte
  // (the data plane encrypts every gradient and parameter).
  SSL_CTX_set_ciphersuites(
      ctx, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256");
  // Non-blocking sockets: a write may be retried with the rest of its buffer, moved.
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  return ctx;
}

// Why the handshake of `ssl` failed: the peer certificate's verification result when that was
// it (OpenSSL's words: "certificate has expired", "hostname mismatch", ...), else the error
// queue.
std::string HandshakeFailure(SSL* ssl, int ret) {
  const long verify = SSL_get_verify_result(ssl);
  std::string errors = OpenSslErrors();
  if (verify != X509_V_OK) {
    return absl::StrCat("the peer's certificate: ", X509_verify_cert_error_string(verify));
  }
  if (errors.empty()) {
    errors =
        SSL_get_error(ssl, ret) == SSL_ERROR_SYSCALL ? "the connection closed" : "handshake failed";
  }
  return errors;
}

// Runs one OpenSSL call to completion on a non-blocking socket: `op` returns > 0 on success;
// on WANT_READ / WANT_WRITE it waits within `limit`. The result of the last call, or an error.
template <typename Op>
absl::StatusOr<int> Drive(SSL* ssl, int fd, Op op, IoLimit limit, absl::Time* last_progress,
                          const std::string& what) {
  while (true) {
    ERR_clear_error();
    const int r = op();
    if (r > 0) return r;
    const int err = SSL_get_error(ssl, r);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      RETURN_IF_ERROR(WaitReady(fd, err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, limit,
                                *last_progress, what));
      continue;
    }
    if (err == SSL_ERROR_ZERO_RETURN) {
      return absl::UnavailableError(absl::StrCat(what, ": the peer closed the connection"));
    }
    if (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) {
      return absl::UnavailableError(
          absl::StrCat(what, ": the peer closed or reset the connection"));
    }
    return absl::UnavailableError(absl::StrCat(what, ": TLS: ", OpenSslErrors()));
  }
}

// A BIO on a non-blocking socket that sends with MSG_NOSIGNAL: a peer that closed is an error,
// not a SIGPIPE that kills the process (OpenSSL's socket BIO uses write(2)).
int SocketWrite(BIO* bio, const char* data, int n) {
  BIO_clear_retry_flags(bio);
  const ssize_t r = ::send(static_cast<int>(BIO_get_fd(bio, nullptr)), data, n, MSG_NOSIGNAL);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    BIO_set_retry_write(bio);
  }
  return static_cast<int>(r);
}

int SocketRead(BIO* bio, char* data, int n) {
  BIO_clear_retry_flags(bio);
  const ssize_t r = ::recv(static_cast<int>(BIO_get_fd(bio, nullptr)), data, n, 0);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    BIO_set_retry_read(bio);
  }
  return static_cast<int>(r);
}

const BIO_METHOD* NoSignalSocketMethod() {
  static const BIO_METHOD* method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK | BIO_TYPE_DESCRIPTOR,
                                 "socket without SIGPIPE");
    const BIO_METHOD* socket = BIO_s_socket();
    BIO_meth_set_write(m, SocketWrite);
    BIO_meth_set_read(m, SocketRead);
    BIO_meth_set_ctrl(m, BIO_meth_get_ctrl(socket));
    BIO_meth_set_create(m, BIO_meth_get_create(socket));
    BIO_meth_set_destroy(m, BIO_meth_get_destroy(socket));
    return m;
  }();
  return method;
}

absl::StatusOr<Conn> Handshake(UniqueFd fd, const TlsConfig& config, const std::string& host,
                               IoLimit limit) {
  SSL* ssl = SSL_new(config.ctx());
  if (ssl == nullptr) return absl::InternalError(absl::StrCat("TLS: ", OpenSslErrors()));
  Conn conn(std::move(fd));
  conn.set_ssl(ssl);
  BIO* bio = BIO_new(NoSignalSocketMethod());
  if (bio == nullptr) return absl::InternalError(absl::StrCat("TLS: ", OpenSslErrors()));
  BIO_set_fd(bio, conn.fd(), BIO_NOCLOSE);
  SSL_set_bio(ssl, bio, bio);
  if (config.is_server()) {
    SSL_set_accept_state(ssl);
  } else {
    SSL_set_connect_state(ssl);
    SSL_set_verify(ssl, SSL_VERIFY_PEER, nullptr);
    // The certificate must name what was dialled: an IP address, or a host name (also sent as
    // the server name indication).
    in6_addr ip6;
    in_addr ip4;
    const bool is_ip =
        inet_pton(AF_INET, host.c_str(), &ip4) == 1 || inet_pton(AF_INET6, host.c_str(), &ip6) == 1;
    if (is_ip) {
      X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), host.c_str());
    } else {
      SSL_set_tlsext_host_name(ssl, host.c_str());
      SSL_set1_host(ssl, host.c_str());
    }
  }
  absl::Time last_progress = absl::Now();
  while (true) {
    ERR_clear_error();
    const int r = SSL_do_handshake(ssl);
    if (r == 1) return conn;
    const int err = SSL_get_error(ssl, r);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      RETURN_IF_ERROR(WaitReady(conn.fd(), err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, limit,
                                last_progress, "TLS handshake"));
      continue;
    }
    return absl::UnavailableError(absl::StrCat("TLS handshake",
                                               host.empty() ? "" : absl::StrCat(" with ", host),
                                               ": ", HandshakeFailure(ssl, r)));
  }
}

}  // namespace

TlsConfig::TlsConfig(SSL_CTX* ctx, bool server) : ctx_(ctx), server_(server) {}

absl::StatusOr<std::shared_ptr<const TlsConfig>> TlsConfig::Server(
    const std::string& cert_file, const std::string& key_file,
    std::optional<absl::Duration> follow_every) {
  SSL_CTX* ctx = NewContext(true);
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("TLS: ", OpenSslErrors()));
  std::shared_ptr<TlsConfig> config(new TlsConfig(ctx, true));
  if (SSL_CTX_use_certificate_chain_file(ctx, cert_file.c_str()) != 1) {
    return FlagError("--tls-cert", cert_file);
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return FlagError("--tls-key", key_file);
  }
  if (SSL_CTX_check_private_key(ctx) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: ", key_file, " is not the key of ", cert_file));
  }
  if (follow_every.has_value()) {
    config->follower_ = CertificateFollower::Install(ctx, cert_file, key_file, *follow_every);
  }
  return config;
}

absl::StatusOr<std::shared_ptr<const TlsConfig>> TlsConfig::Client(const std::string& ca_file,
                                                                   const std::string& cert_file,
                                                                   const std::string& key_file) {
  SSL_CTX* ctx = NewContext(false);
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("TLS: ", OpenSslErrors()));
  std::shared_ptr<const TlsConfig> config(new TlsConfig(ctx, false));
  if (SSL_CTX_load_verify_locations(ctx, ca_file.c_str(), nullptr) != 1) {
    return FlagError("--tls-ca", ca_file);
  }
  if (!cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, cert_file.c_str()) != 1) {
      return FlagError("--tls-cert", cert_file);
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
      return FlagError("--tls-key", key_file);
    }
  }
  return config;
}

TlsConfig::~TlsConfig() { SSL_CTX_free(ctx_); }

Conn::Conn(Conn&& other) noexcept : fd_(std::move(other.fd_)), ssl_(other.ssl_) {
  other.ssl_ = nullptr;
}

Conn& Conn::operator=(Conn&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::move(other.fd_);
    ssl_ = other.ssl_;
    other.ssl_ = nullptr;
  }
  return *this;
}

Conn::~Conn() { reset(); }

void Conn::reset() {
  if (ssl_ != nullptr) SSL_free(ssl_);
  ssl_ = nullptr;
  fd_.reset();
}

absl::StatusOr<Conn> TlsAccept(UniqueFd fd, const TlsConfig& config, IoLimit limit) {
  return Handshake(std::move(fd), config, "", limit);
}

absl::StatusOr<Conn> TlsConnect(UniqueFd fd, const TlsConfig& config, const std::string& host,
                                IoLimit limit) {
  return Handshake(std::move(fd), config, host, limit);
}

absl::Status SendAll(Conn& conn, absl::Span<const iovec> pieces, IoLimit limit) {
  if (!conn.tls()) return SendAll(conn.fd(), pieces, limit);
  size_t total = 0, sent = 0;
  for (const iovec& v : pieces) total += v.iov_len;
  absl::Time last_progress = absl::Now();
  for (const iovec& v : pieces) {
    const char* p = static_cast<const char*>(v.iov_base);
    for (size_t done = 0; done < v.iov_len;) {
      // At most 1 GiB a call (SSL_write takes an int).
      const int want = static_cast<int>(std::min<size_t>(v.iov_len - done, size_t{1} << 30));
      ASSIGN_OR_RETURN(
          const int n,
          Drive(
              conn.ssl(), conn.fd(), [&] { return SSL_write(conn.ssl(), p + done, want); }, limit,
              &last_progress, absl::StrCat("send (", sent, " of ", total, " bytes sent)")));
      done += n;
      sent += n;
      last_progress = absl::Now();
    }
  }
  return absl::OkStatus();
}

absl::Status RecvAll(Conn& conn, char* out, size_t n, IoLimit limit, size_t* received) {
  if (!conn.tls()) return RecvAll(conn.fd(), out, n, limit, received);
  size_t got = 0;
  if (received != nullptr) *received = 0;
  absl::Time last_progress = absl::Now();
  while (got < n) {
    const int want = static_cast<int>(std::min<size_t>(n - got, size_t{1} << 30));
    auto r = Drive(
        conn.ssl(), conn.fd(), [&] { return SSL_read(conn.ssl(), out + got, want); }, limit,
        &last_progress, absl::StrCat("recv (", got, " of ", n, " bytes received)"));
    if (!r.ok()) {
      if (absl::IsUnavailable(r.status()) && got == 0) {
        return absl::UnavailableError(
            absl::StrCat("recv: the peer closed the connection after 0 of ", n, " bytes (",
                         r.status().message(), ")"));
      }
      return r.status();
    }
    got += *r;
    if (received != nullptr) *received = got;
    last_progress = absl::Now();
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> RecvSome(Conn& conn, char* out, size_t n, IoLimit limit) {
  if (!conn.tls()) return RecvSome(conn.fd(), out, n, limit);
  absl::Time start = absl::Now();
  const int want = static_cast<int>(std::min<size_t>(n, size_t{1} << 30));
  ASSIGN_OR_RETURN(const int got,
                   Drive(
                       conn.ssl(), conn.fd(), [&] { return SSL_read(conn.ssl(), out, want); },
                       limit, &start, "recv"));
  return static_cast<size_t>(got);
}

size_t Pending(const Conn& conn) {
  return conn.tls() ? static_cast<size_t>(std::max(SSL_pending(conn.ssl()), 0)) : 0;
}

absl::Status Discard(Conn& conn, size_t n, IoLimit limit) {
  if (!conn.tls()) return Discard(conn.fd(), n, limit);
  std::vector<char> scratch(std::min<size_t>(n, size_t{1} << 20));
  for (size_t left = n; left > 0;) {
    const size_t take = std::min(left, scratch.size());
    RETURN_IF_ERROR(RecvAll(conn, scratch.data(), take, limit));
    left -= take;
  }
  return absl::OkStatus();
}

void DiscardUntilClosed(Conn& conn, size_t max_bytes, IoLimit limit) {
  if (!conn.tls()) {
    DiscardUntilClosed(conn.fd(), max_bytes, limit);
    return;
  }
  std::vector<char> scratch(64 << 10);
  absl::Time last_progress = absl::Now();
  for (size_t dropped = 0; dropped < max_bytes;) {
    const int want = static_cast<int>(std::min(scratch.size(), max_bytes - dropped));
    auto r = Drive(
        conn.ssl(), conn.fd(), [&] { return SSL_read(conn.ssl(), scratch.data(), want); }, limit,
        &last_progress, "linger");
    if (!r.ok()) return;
    dropped += *r;
    last_progress = absl::Now();
  }
}

void ShutdownWrite(Conn& conn) {
  if (conn.tls()) {
    ERR_clear_error();
    SSL_shutdown(conn.ssl());  // sends close_notify; the peer's is not awaited
  }
  if (conn.valid()) shutdown(conn.fd(), SHUT_WR);
}

}  // namespace trainyard::ps
