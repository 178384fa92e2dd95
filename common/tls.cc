#include "common/tls.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/host_port.h"

namespace trainyard {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  }
  return text.str();
}

std::string AsnTime(const ASN1_TIME* t);

// Verifies a client's certificate chain against the client CA file (read at each handshake that
// shows a certificate, so a replaced CA counts at once) and names the reason of a refusal.
class ClientCertificateVerifier final : public grpc::experimental::ExternalCertificateVerifier {
 public:
  ClientCertificateVerifier(std::string ca_file, std::function<void(const std::string&)> on_refused)
      : ca_file_(std::move(ca_file)), on_refused_(std::move(on_refused)) {}

  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request,
              std::function<void(grpc::Status)>, grpc::Status* sync_status) override {
    // The leaf, then the chain (which on a server may hold only the certificates after it).
    const grpc::string_ref leaf = request->peer_cert();
    const grpc::string_ref chain = request->peer_cert_full_chain();
    if (leaf.empty()) {  // no client certificate: a user's yard; the services decide
      *sync_status = grpc::Status::OK;
      return true;
    }
    const std::string why = Check(absl::StrCat(absl::string_view(leaf.data(), leaf.size()),
                                               absl::string_view(chain.data(), chain.size())));
    if (why.empty()) {
      *sync_status = grpc::Status::OK;
    } else {
      if (on_refused_) on_refused_(why);
      *sync_status = grpc::Status(grpc::StatusCode::UNAUTHENTICATED, why);
    }
    return true;
  }
  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest*) override {}

 private:
  // Empty when the chain verifies; else why not.
  std::string Check(const std::string& chain_pem) const {
    BIO* bio = BIO_new_mem_buf(chain_pem.data(), static_cast<int>(chain_pem.size()));
    X509* leaf = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
    STACK_OF(X509)* rest = sk_X509_new_null();
    while (X509* more = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) sk_X509_push(rest, more);
    BIO_free(bio);
    ERR_clear_error();
    std::string why;
    X509_STORE* store = X509_STORE_new();
    X509_STORE_CTX* ctx = X509_STORE_CTX_new();
    if (leaf == nullptr) {
      why = "client certificate: unreadable";
    } else if (X509_STORE_load_file(store, ca_file_.c_str()) != 1) {
      why = absl::StrCat("client certificate: the client CA ", ca_file_, " cannot be read");
    } else {
      X509_STORE_CTX_init(ctx, store, leaf, rest);
      X509_STORE_CTX_set_purpose(ctx, X509_PURPOSE_SSL_CLIENT);
      if (X509_verify_cert(ctx) != 1) {
        const int error = X509_STORE_CTX_get_error(ctx);
        char cn[256] = "?";
        X509_NAME_get_text_by_NID(X509_get_subject_name(leaf), NID_commonName, cn, sizeof(cn));
        why =
            absl::StrCat("client certificate CN=", cn, ": ", X509_verify_cert_error_string(error));
        if (error == X509_V_ERR_CERT_HAS_EXPIRED || error == X509_V_ERR_CERT_NOT_YET_VALID) {
          absl::StrAppend(&why, " (valid ", AsnTime(X509_get0_notBefore(leaf)), " to ",
                          AsnTime(X509_get0_notAfter(leaf)), ")");
        }
      }
    }
    ERR_clear_error();
    X509_STORE_CTX_free(ctx);
    X509_STORE_free(store);
    sk_X509_pop_free(rest, X509_free);
    if (leaf != nullptr) X509_free(leaf);
    return why;
  }

  const std::string ca_file_;
  const std::function<void(const std::string&)> on_refused_;
};

std::string AsnTime(const ASN1_TIME* t) {
  BIO* bio = BIO_new(BIO_s_mem());
  ASN1_TIME_print(bio, t);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(bio);
  return out;
}

}  // namespace

bool IsLoopback(const std::string& address) {
  const std::string host = HostOfAddress(address);
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsServerOptions& options, const std::string& listen_address) {
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert, --tls-key: give both (the certificate and its private key) or neither");
  }
  if (options.cert_file.empty()) {
    if (!options.client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca: needs --tls-cert and --tls-key");
    }
    if (!IsLoopback(listen_address) && !options.insecure) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen: ", listen_address,
          " is not a loopback address: give --tls-cert and --tls-key, or --insecure to serve "
          "tokens and job credentials in clear"));
    }
    return grpc::InsecureServerCredentials();
  }
  // Checked here so that a bad file is refused at start, naming its flag; the provider reads
  // them again every reload_seconds.
  auto cert = ReadPem(options.cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(options.key_file, "--tls-key");
  if (!key.ok()) return key.status();
  if (!options.client_ca_file.empty()) {
    auto ca = ReadPem(options.client_ca_file, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.key_file, options.cert_file, options.client_ca_file,
      static_cast<unsigned int>(std::max(1, options.reload_seconds)));
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (!options.client_ca_file.empty()) {
    // Client certificates are verified here, against the client CA as it is now, so that a
    // refusal can say why and be audited (gRPC's own check only logs a line).
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_BUT_DONT_VERIFY);
    tls.set_certificate_verifier(
        grpc::experimental::ExternalCertificateVerifier::Create<ClientCertificateVerifier>(
            options.client_ca_file, options.on_refused_certificate));
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsClientOptions& options) {
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert, --tls-key: give both (a client certificate and its key) or neither");
  }
  if (!options.enabled()) {
    if (!options.cert_file.empty()) {
      return absl::InvalidArgumentError("--tls-cert: needs --tls-ca");
    }
    return grpc::InsecureChannelCredentials();
  }
  // Checked here so that a bad file is refused naming its flag; the provider reads them again
  // every kClientReloadSeconds, so a renewed node certificate (or CA) counts for the next
  // connection without a restart.
  auto ca = ReadPem(options.ca_file, "--tls-ca");
  if (!ca.ok()) return ca.status();
  if (!options.cert_file.empty()) {
    auto cert = ReadPem(options.cert_file, "--tls-cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(options.key_file, "--tls-key");
    if (!key.ok()) return key.status();
  }
  constexpr unsigned int kClientReloadSeconds = 10;
  auto provider =
      options.cert_file.empty()
          ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                options.ca_file, kClientReloadSeconds)
          : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                options.key_file, options.cert_file, options.ca_file, kClientReloadSeconds);
  grpc::experimental::TlsChannelCredentialsOptions tls;
  tls.set_certificate_provider(provider);
  tls.watch_root_certs();
  if (!options.cert_file.empty()) tls.watch_identity_key_cert_pairs();
  tls.set_verify_server_certs(true);
  // The server's certificate must name the host dialled, as with SslCredentials.
  tls.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(tls);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFromEnv() {
  const char* ca = std::getenv(kTlsCaEnv);
  TlsClientOptions options;
  if (ca != nullptr) options.ca_file = ca;
  auto credentials = MakeChannelCredentials(options);
  if (credentials.ok()) return *credentials;
  std::fprintf(stderr, "%s: %s\n", kTlsCaEnv, std::string(credentials.status().message()).c_str());
  // Fail closed: TLS with the system's roots, which do not know the cluster's CA, so no call
  // (and no credential) goes out in clear.
  return grpc::SslCredentials(grpc::SslCredentialsOptions());
}

std::string PeerCertificateName(const grpc::ServerContextBase& ctx) {
  const auto auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return std::string();
  const std::vector<grpc::string_ref> names = auth->FindPropertyValues("x509_common_name");
  if (names.empty()) return std::string();
  return std::string(names.front().data(), names.front().size());
}

}  // namespace trainyard

namespace trainyard {
namespace {

// A TCP connection to HOST:PORT within `timeout`, blocking afterwards with `timeout` on each send
// and receive; -1 if nothing answers.
int DialWithin(const std::string& host, const std::string& port, absl::Duration timeout) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    int error = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (error == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      error =
          poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) == 1 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof(error);
      if (error == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
    }
    if (error != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return -1;
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

}  // namespace

std::string OpenSslErrors() {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(e);
    absl::StrAppend(&out, out.empty() ? "" : "; ", reason != nullptr ? reason : "TLS error");
  }
  return out;
}

std::string DiagnoseTls(const std::string& address, const TlsClientOptions& options,
                        absl::Duration timeout) {
  std::string target = address;
  if (const size_t scheme = target.find(":///"); scheme != std::string::npos) {
    target = target.substr(scheme + 4);
  }
  const std::string host = HostOfAddress(target);
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos) return "";
  const std::string port = target.substr(colon + 1);
  // This client's own certificate first: no server can accept an expired one.
  if (!options.cert_file.empty()) {
    if (FILE* f = std::fopen(options.cert_file.c_str(), "r")) {
      X509* cert = PEM_read_X509(f, nullptr, nullptr, nullptr);
      std::fclose(f);
      if (cert != nullptr) {
        std::string why;
        if (X509_cmp_current_time(X509_get0_notAfter(cert)) < 0) {
          why = absl::StrCat("this client's certificate ", options.cert_file,
                             " (--tls-cert) expired ", AsnTime(X509_get0_notAfter(cert)));
        } else if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0) {
          why = absl::StrCat("this client's certificate ", options.cert_file,
                             " (--tls-cert) is not valid before ",
                             AsnTime(X509_get0_notBefore(cert)));
        }
        X509_free(cert);
        if (!why.empty()) return why;
      }
    }
  }
  const int fd = DialWithin(host, port, timeout);
  if (fd < 0) return "";
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL* ssl = ctx != nullptr ? SSL_new(ctx) : nullptr;
  std::string why;
  if (ssl == nullptr) {
    close(fd);
    if (ctx != nullptr) SSL_CTX_free(ctx);
    return "";
  }
  // gRPC speaks HTTP/2 over TLS: offer it, as gRPC does.
  static const unsigned char kAlpn[] = {2, 'h', '2'};
  SSL_set_alpn_protos(ssl, kAlpn, sizeof(kAlpn));
  if (options.enabled()) {
    SSL_CTX_load_verify_locations(ctx, options.ca_file.c_str(), nullptr);
    if (!options.cert_file.empty()) {
      SSL_use_certificate_chain_file(ssl, options.cert_file.c_str());
      SSL_use_PrivateKey_file(ssl, options.key_file.c_str(), SSL_FILETYPE_PEM);
    }
    SSL_set_verify(ssl, SSL_VERIFY_PEER, nullptr);
    in6_addr v6;
    in_addr v4;
    if (inet_pton(AF_INET, host.c_str(), &v4) == 1 || inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
      X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), host.c_str());
    } else {
      SSL_set_tlsext_host_name(ssl, host.c_str());
      SSL_set1_host(ssl, host.c_str());
    }
  } else {
    SSL_set_verify(ssl, SSL_VERIFY_NONE, nullptr);
  }
  // The probe may write to a server that closes: SIGPIPE stays pending on this thread instead.
  sigset_t pipe, old;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, &old);
  SSL_set_fd(ssl, fd);
  ERR_clear_error();
  const int shaken = SSL_connect(ssl);
  if (!options.enabled()) {
    if (shaken == 1) {
      why = absl::StrCat("the server at ", address,
                         " speaks TLS: give its CA with --tls-ca FILE (or TRAINYARD_TLS_CA)");
    }
  } else if (shaken != 1) {
    const long verify = SSL_get_verify_result(ssl);
    const std::string reasons = OpenSslErrors();
    X509* peer = SSL_get1_peer_certificate(ssl);
    if (verify != X509_V_OK) {
      why = absl::StrCat("the server's certificate does not verify: ",
                         X509_verify_cert_error_string(verify));
      if (peer != nullptr &&
          (verify == X509_V_ERR_CERT_HAS_EXPIRED || verify == X509_V_ERR_CERT_NOT_YET_VALID)) {
        absl::StrAppend(&why, " (valid ", AsnTime(X509_get0_notBefore(peer)), " to ",
                        AsnTime(X509_get0_notAfter(peer)), ")");
      }
      if (verify == X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY ||
          verify == X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT ||
          verify == X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN) {
        absl::StrAppend(&why, " (not signed by the CA in ", options.ca_file, ")");
      }
      if (verify == X509_V_ERR_HOSTNAME_MISMATCH || verify == X509_V_ERR_IP_ADDRESS_MISMATCH) {
        absl::StrAppend(&why, " (it is not for ", host, ")");
      }
    } else if (absl::StrContains(reasons, "wrong version number") ||
               absl::StrContains(reasons, "packet length too long") ||
               absl::StrContains(reasons, "record layer failure")) {
      why = absl::StrCat("the server at ", address,
                         " does not speak TLS: drop --tls-ca (and TRAINYARD_TLS_CA)");
    } else if (absl::StrContains(reasons, "alert")) {
      why = absl::StrCat("the server refused this client's certificate: ", reasons);
    } else if (!reasons.empty()) {
      why = absl::StrCat("TLS with ", address, ": ", reasons);
    }
    if (peer != nullptr) X509_free(peer);
  } else {
    // TLS 1.3 tells a client whose certificate the server refused after the handshake: a read
    // brings the alert.
    const timeval brief = absl::ToTimeval(absl::Milliseconds(300));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &brief, sizeof(brief));
    char byte;
    ERR_clear_error();
    const int r = SSL_read(ssl, &byte, 1);
    const int err = r <= 0 ? SSL_get_error(ssl, r) : SSL_ERROR_NONE;
    const std::string reasons = OpenSslErrors();
    const bool timed_out = err == SSL_ERROR_WANT_READ ||
                           (err == SSL_ERROR_SYSCALL && (errno == EAGAIN || errno == EWOULDBLOCK));
    // A gRPC server waits for the client's first bytes; one that closes at once (with an alert,
    // or without: gRPC's) refused the client's certificate.
    if (r <= 0 && !timed_out) {
      why = absl::StrCat(
          "the server closed the connection right after the TLS handshake: it refused this "
          "client's certificate",
          options.cert_file.empty() ? " (none was given: --tls-cert)"
                                    : absl::StrCat(" (", options.cert_file, ")"),
          reasons.empty() ? "" : absl::StrCat(": ", reasons));
    }
  }
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  close(fd);
  sigset_t pending;
  sigpending(&pending);
  if (sigismember(&pending, SIGPIPE) == 1) {
    int sig = 0;
    sigwait(&pipe, &sig);  // consumed before the mask is restored
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return why;
}

namespace {

// The certificate and key files' identities and modification times as one string ("" when one
// cannot be read): what a server compares to learn that its pair was renewed.
std::string CertificateFilesStamp(const std::string& cert_file, const std::string& key_file) {
  std::string out;
  for (const std::string* path : {&cert_file, &key_file}) {
    struct stat st;
    if (::stat(path->c_str(), &st) != 0) return "";
    absl::StrAppend(&out, st.st_ino, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, ";");
  }
  return out;
}

}  // namespace

struct CertificateFollower::Impl {
  std::string cert_file, key_file;
  absl::Duration check_every;
  absl::Mutex mu;
  absl::Time checked ABSL_GUARDED_BY(mu);
  std::string stamp ABSL_GUARDED_BY(mu);
  // The pair loaded since start (null until a renewal loads: the context's own serves).
  X509* cert ABSL_GUARDED_BY(mu) = nullptr;
  STACK_OF(X509) * chain ABSL_GUARDED_BY(mu) = nullptr;
  EVP_PKEY* key ABSL_GUARDED_BY(mu) = nullptr;

  ~Impl() {
    absl::MutexLock lock(&mu);
    Release();
  }
  void Release() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    X509_free(cert);
    sk_X509_pop_free(chain, X509_free);
    EVP_PKEY_free(key);
    cert = nullptr;
    chain = nullptr;
    key = nullptr;
  }

  // The files' pair, if they load and match; else nothing changes.
  void Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    BIO* cert_bio = BIO_new_file(cert_file.c_str(), "r");
    BIO* key_bio = BIO_new_file(key_file.c_str(), "r");
    X509* leaf =
        cert_bio != nullptr ? PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr) : nullptr;
    STACK_OF(X509)* rest = sk_X509_new_null();
    while (leaf != nullptr && rest != nullptr) {
      X509* next = PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr);
      if (next == nullptr) break;
      sk_X509_push(rest, next);
    }
    EVP_PKEY* pkey =
        key_bio != nullptr ? PEM_read_bio_PrivateKey(key_bio, nullptr, nullptr, nullptr) : nullptr;
    BIO_free(cert_bio);
    BIO_free(key_bio);
    const char* wrong = leaf == nullptr || rest == nullptr ? "no certificate in the first"
                        : pkey == nullptr                  ? "no private key in the second"
                        : X509_check_private_key(leaf, pkey) != 1
                            ? "the key is not the certificate's"
                            : nullptr;
    ERR_clear_error();  // (the end of the chain reads as an error too)
    if (wrong != nullptr) {
      spdlog::warn(
          "TLS: {} and {} changed but do not load as a matching pair ({}); serving the last good "
          "certificate until they change again",
          cert_file, key_file, wrong);
      X509_free(leaf);
      sk_X509_pop_free(rest, X509_free);
      EVP_PKEY_free(pkey);
      return;
    }
    Release();
    cert = leaf;
    chain = rest;
    key = pkey;
    spdlog::info("TLS: serving the renewed certificate of {}", cert_file);
  }

  // OpenSSL's certificate callback, at each handshake before the certificate is chosen.
  static int Select(SSL* ssl, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    absl::MutexLock lock(&self->mu);
    const absl::Time now = absl::Now();
    if (now - self->checked >= self->check_every) {
      self->checked = now;
      const std::string stamp = CertificateFilesStamp(self->cert_file, self->key_file);
      if (!stamp.empty() && stamp != self->stamp) {
        self->stamp = stamp;
        self->Load();
      }
    }
    if (self->cert == nullptr) return 1;  // the context's own pair
    // (Cleared first: a renewal of another key type would otherwise leave the old pair in the
    // slot of its type, for clients that prefer it.)
    SSL_certs_clear(ssl);
    return SSL_use_cert_and_key(ssl, self->cert, self->key, self->chain, /*override=*/1) == 1 ? 1
                                                                                              : 0;
  }
};

std::unique_ptr<CertificateFollower> CertificateFollower::Install(SSL_CTX* ctx,
                                                                  std::string cert_file,
                                                                  std::string key_file,
                                                                  absl::Duration check_every) {
  auto impl = std::make_unique<Impl>();
  impl->cert_file = std::move(cert_file);
  impl->key_file = std::move(key_file);
  impl->check_every = check_every;
  {
    absl::MutexLock lock(&impl->mu);
    impl->checked = absl::Now();
    impl->stamp = CertificateFilesStamp(impl->cert_file, impl->key_file);
  }
  SSL_CTX_set_cert_cb(ctx, &Impl::Select, impl.get());
  return std::unique_ptr<CertificateFollower>(new CertificateFollower(std::move(impl)));
}

CertificateFollower::CertificateFollower(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CertificateFollower::~CertificateFollower() = default;

}  // namespace trainyard
