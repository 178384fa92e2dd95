// A Prometheus /metrics endpoint for one program's registry (text format 0.0.4), as every server
// serves it with --metrics-address HOST:PORT (port 0 picks a free one; bound_address() tells
// which). Optionally scrapes need a bearer token ("Authorization: Bearer <token>", Prometheus'
// `authorization` scrape setting) and are served over TLS (its `tls_config`). A non-loopback
// address needs a token unless the operator says --metrics-insecure: metrics name jobs, users
// and accounts.
//
// A small HTTP/1.1 server of its own (one answer per connection, requests up to 8 KiB, at most 64
// connections at once, each closed at its whole-request deadline however slowly its bytes
// trickle), so that the token check and TLS are ours.
// Thread-safe: Start and the destructor from the owner's thread; scrapes on its own threads.
#ifndef TRAINYARD_COMMON_METRICS_ENDPOINT_H_
#define TRAINYARD_COMMON_METRICS_ENDPOINT_H_

#include <prometheus/registry.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainyard {

struct MetricsEndpointOptions {
  std::string address;  // HOST:PORT
  // A file holding the token scrapes must send (mode 0600, as every secret file); empty: none.
  std::string token_file;
  // TLS: the server's certificate chain and key (PEM); empty: plain HTTP. Followed (common/tls.h
  // CertificateFollower): a renewed pair serves new connections once a handshake sees the files
  // changed (it looks at most every tls_reload).
  std::string tls_cert_file, tls_key_file;
  absl::Duration tls_reload = absl::Seconds(10);
  // Serve a non-loopback address without a token.
  bool insecure = false;
  // From accept to the last byte of the answer (TLS handshake and request included): a client
  // that takes longer loses its connection, so slow clients hold a slot this long at most.
  absl::Duration request_deadline = absl::Seconds(10);
};

class MetricsEndpoint {
 public:
  // Serves `registry`. INVALID_ARGUMENT naming the flag (--metrics-address, --metrics-token-file,
  // --tls-cert, --tls-key) for a bad address, an unreadable file or a non-loopback address
  // without a token or --metrics-insecure; UNAVAILABLE if it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const MetricsEndpointOptions& options, std::shared_ptr<prometheus::Registry> registry);
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
    MetricsEndpointOptions options;
    options.address = address;
    return Start(options, std::move(registry));
  }
  ~MetricsEndpoint();  // stops serving; returns when every connection is done

  const std::string& bound_address() const;

  struct Impl;

 private:
  explicit MetricsEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_METRICS_ENDPOINT_H_
