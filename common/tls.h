// TLS for trainyard's gRPC servers and clients, from the flags every program shares:
//   servers  --tls-cert FILE --tls-key FILE [--tls-client-ca FILE] [--insecure]
//   clients  --tls-ca FILE [--tls-cert FILE --tls-key FILE] (a client certificate: nodes)
// A server asked to listen beyond loopback without TLS refuses to start unless --insecure: tokens
// and job credentials must not cross a network in clear by accident. With --tls-client-ca a
// server asks for client certificates and verifies those it gets against that CA (mutual TLS);
// clients without one (yard) still connect. Thread-safe (pure functions and file reads).
#ifndef TRAINYARD_COMMON_TLS_H_
#define TRAINYARD_COMMON_TLS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

typedef struct ssl_ctx_st SSL_CTX;

namespace trainyard {

// The environment variable clients read the CA from when --tls-ca is not given.
inline constexpr char kTlsCaEnv[] = "TRAINYARD_TLS_CA";

struct TlsServerOptions {
  std::string cert_file;       // PEM certificate chain; empty: no TLS
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // PEM CA of client certificates (mutual TLS); empty: none asked
  bool insecure = false;       // allow plaintext on a non-loopback address
  // The three files are read again this often and a change takes effect for new connections:
  // a renewed certificate or key, a new client CA, without a restart.
  int reload_seconds = 10;
  // With a client CA: told of every client certificate refused, with the reason ("client
  // certificate CN=w1: certificate has expired (valid ... to ...)"); for the audit log. Runs on
  // gRPC's threads; may be empty.
  std::function<void(const std::string&)> on_refused_certificate;
};

struct TlsClientOptions {
  std::string ca_file;    // PEM roots to verify the server with; empty: plaintext
  std::string cert_file;  // a client certificate (mutual TLS), with its key
  std::string key_file;
  // yard: a bearer token may go in clear to a coordinator that is not on this host (`--insecure`,
  // env TRAINYARD_INSECURE); without TLS it otherwise goes to loopback addresses only.
  bool plaintext_token_ok = false;
  bool enabled() const { return !ca_file.empty(); }
};

// Whether HOST:PORT's host is a loopback address or name (127.0.0.0/8, ::1, localhost).
bool IsLoopback(const std::string& address);

// The server credentials for `listen_address`. INVALID_ARGUMENT naming the flag for a cert
// without a key (or the reverse), an unreadable file, or a non-loopback address without TLS or
// --insecure.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsServerOptions& options, const std::string& listen_address);

// The channel credentials: TLS verified against ca_file (with the client certificate, if any),
// else plaintext. INVALID_ARGUMENT naming the flag for an unreadable file or a half pair.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsClientOptions& options);

// A rank's channel credentials: TLS verified against $TRAINYARD_TLS_CA (which its worker sets),
// else plaintext. A CA file that cannot be read is reported on stderr and the channel fails
// closed (TLS it cannot verify: its calls fail, nothing is sent in clear).
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFromEnv();

// OpenSSL's error queue as one line of reasons, most recent last (and the queue cleared).
std::string OpenSslErrors();

// Why a connection to the server at `address` (HOST:PORT) fails at the TLS layer, as one line
// naming the cause, found by a handshake of its own (OpenSSL, within `timeout`): the server
// speaks TLS and `options` has no CA; it does not speak TLS and `options` has one; its
// certificate does not verify (expired or not yet valid, unknown CA, a name or address it does
// not carry: OpenSSL's words, with the certificate's dates); it refused this client's
// certificate; this client's certificate has expired. Empty when the handshake goes through, or
// nothing answers at all (the caller's own message says so). For the message of a call that
// failed with UNAVAILABLE.
std::string DiagnoseTls(const std::string& address, const TlsClientOptions& options,
                        absl::Duration timeout = absl::Seconds(3));

// The common name of the call's verified client certificate; empty if none.
std::string PeerCertificateName(const grpc::ServerContextBase& ctx);

// Keeps an OpenSSL server context's certificate current with its files, as gRPC's listeners keep
// theirs (TlsServerOptions::reload_seconds): each handshake looks at the files (at most every
// `check_every`) and, when their stamp changed, loads them again; a pair that does not load or
// match is left aside (the last good one stays, until the next change). For the servers whose TLS
// is OpenSSL's own: the web console's HTTPS, the metrics endpoint, the parameter server's data
// plane (rpc/ps/tls_io.h). Lives as long as the context's handshakes may run.
class CertificateFollower {
 public:
  // Installs itself on `ctx`, which holds cert_file and key_file already (loaded at start).
  static std::unique_ptr<CertificateFollower> Install(SSL_CTX* ctx, std::string cert_file,
                                                      std::string key_file,
                                                      absl::Duration check_every);
  ~CertificateFollower();
  CertificateFollower(const CertificateFollower&) = delete;
  CertificateFollower& operator=(const CertificateFollower&) = delete;

 private:
  struct Impl;
  explicit CertificateFollower(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_TLS_H_
