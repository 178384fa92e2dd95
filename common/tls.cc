#include "common/tls.h"

#include <arpa/inet.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

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

std::string HostOf(const std::string& address) {
  std::string host = address;
  if (absl::StartsWith(host, "[")) {  // [::1]:port
    const size_t end = host.find(']');
    return end == std::string::npos ? host : host.substr(1, end - 1);
  }
  const size_t colon = host.rfind(':');
  return colon == std::string::npos ? host : host.substr(0, colon);
}

}  // namespace

bool IsLoopback(const std::string& address) {
  const std::string host = HostOf(address);
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
  grpc::SslServerCredentialsOptions ssl;
  auto cert = ReadPem(options.cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(options.key_file, "--tls-key");
  if (!key.ok()) return key.status();
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.client_ca_file.empty()) {
    auto ca = ReadPem(options.client_ca_file, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
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
  grpc::SslCredentialsOptions ssl;
  auto ca = ReadPem(options.ca_file, "--tls-ca");
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *ca;
  if (!options.cert_file.empty()) {
    auto cert = ReadPem(options.cert_file, "--tls-cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(options.key_file, "--tls-key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
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
