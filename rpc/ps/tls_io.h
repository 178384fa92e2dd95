// TLS on the parameter server's data plane (OpenSSL), with the same certificates as its gRPC
// service: the server presents --tls-cert/--tls-key; a trainer verifies it against the cluster's
// CA (TRAINYARD_TLS_CA) and the address it dials, and may show a client certificate. A Conn is a
// connected socket with, when TLS is on, an OpenSSL session over it; the whole-buffer I/O of
// tcp_io.h works on either, with the same time limits and errors (a TLS failure is UNAVAILABLE,
// naming OpenSSL's reason: "certificate has expired", "unable to get local issuer certificate",
// "hostname mismatch", ...).
//
// Thread-safe: a TlsConfig is shared by every connection; one thread uses a Conn at a time.
#ifndef TRAINYARD_RPC_PS_TLS_IO_H_
#define TRAINYARD_RPC_PS_TLS_IO_H_

#include <sys/uio.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "rpc/ps/tcp_io.h"

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

namespace trainyard {
class CertificateFollower;  // common/tls.h
}  // namespace trainyard

namespace trainyard::ps {

// An OpenSSL context: a server's (certificate and key) or a client's (CA, optional client
// certificate). Immutable once made, save for a following server's certificate.
class TlsConfig {
 public:
  // INVALID_ARGUMENT naming the flag for an unreadable or mismatched file. With `follow_every`,
  // the certificate follows its files (common/tls.h CertificateFollower): a handshake looks at
  // them at most that often, and a renewed pair counts for the next connection without a restart;
  // a pair that does not load or match leaves the last good one in place.
  static absl::StatusOr<std::shared_ptr<const TlsConfig>> Server(
      const std::string& cert_file, const std::string& key_file,
      std::optional<absl::Duration> follow_every = std::nullopt);
  static absl::StatusOr<std::shared_ptr<const TlsConfig>> Client(const std::string& ca_file,
                                                                 const std::string& cert_file = "",
                                                                 const std::string& key_file = "");
  ~TlsConfig();
  TlsConfig(const TlsConfig&) = delete;
  TlsConfig& operator=(const TlsConfig&) = delete;

  SSL_CTX* ctx() const { return ctx_; }
  bool is_server() const { return server_; }

 private:
  TlsConfig(SSL_CTX* ctx, bool server);
  SSL_CTX* ctx_;
  bool server_;
  std::unique_ptr<CertificateFollower> follower_;  // a following server's; after ctx_'s free
};

// A connected socket, and over it a TLS session when `ssl` is set. Movable; frees both.
class Conn {
 public:
  Conn() = default;
  explicit Conn(UniqueFd fd) : fd_(std::move(fd)) {}
  Conn(Conn&& other) noexcept;
  Conn& operator=(Conn&& other) noexcept;
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;
  ~Conn();

  int fd() const { return fd_.get(); }
  bool valid() const { return fd_.valid(); }
  bool tls() const { return ssl_ != nullptr; }
  SSL* ssl() const { return ssl_; }

  // Takes over `ssl` (a session on fd()).
  void set_ssl(SSL* ssl) { ssl_ = ssl; }
  void reset();

 private:
  UniqueFd fd_;
  SSL* ssl_ = nullptr;
};

// The TLS handshake on a connected, non-blocking socket: as the server (TlsAccept) or as a
// client of `host` (TlsConnect: the certificate must be for that name or IP address). UNAVAILABLE
// naming what failed, DEADLINE_EXCEEDED past `limit`.
absl::StatusOr<Conn> TlsAccept(UniqueFd fd, const TlsConfig& config, IoLimit limit);
absl::StatusOr<Conn> TlsConnect(UniqueFd fd, const TlsConfig& config, const std::string& host,
                                IoLimit limit);

// tcp_io.h's whole-buffer I/O on a Conn: the socket's own without TLS, else through OpenSSL.
absl::Status SendAll(Conn& conn, absl::Span<const iovec> pieces, IoLimit limit);
inline absl::Status SendAll(Conn& conn, absl::string_view bytes, IoLimit limit) {
  const iovec piece{const_cast<char*>(bytes.data()), bytes.size()};
  return SendAll(conn, absl::MakeConstSpan(&piece, 1), limit);
}
absl::Status RecvAll(Conn& conn, char* out, size_t n, IoLimit limit, size_t* received = nullptr);
// tcp_io.h's RecvSome on a Conn. (A TLS record's bytes arrive whole or not at all: a record that
// trickles in a byte at a time still ends at `limit`.)
absl::StatusOr<size_t> RecvSome(Conn& conn, char* out, size_t n, IoLimit limit);
// Bytes received and decrypted that no call has read yet (0 without TLS).
size_t Pending(const Conn& conn);
absl::Status Discard(Conn& conn, size_t n, IoLimit limit);
void DiscardUntilClosed(Conn& conn, size_t max_bytes, IoLimit limit);
// Ends the sending side: a TLS close_notify (without waiting for the peer's), then shutdown(2).
void ShutdownWrite(Conn& conn);

}  // namespace trainyard::ps

#endif  // TRAINYARD_RPC_PS_TLS_IO_H_
