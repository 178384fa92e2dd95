// A Prometheus /metrics endpoint (prometheus-cpp pull) for one program's registry. Every server
// takes --metrics-address HOST:PORT; port 0 picks a free one (bound_address() tells which).
#ifndef TRAINYARD_COMMON_METRICS_ENDPOINT_H_
#define TRAINYARD_COMMON_METRICS_ENDPOINT_H_

#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace trainyard {

class MetricsEndpoint {
 public:
  // Serves `registry` on `address` ("127.0.0.1:9100"). UNAVAILABLE if it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
    std::unique_ptr<prometheus::Exposer> exposer;
    try {
      exposer = std::make_unique<prometheus::Exposer>(address);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("--metrics-address: cannot serve on ", address, ": ", e.what()));
    }
    exposer->RegisterCollectable(registry);
    const auto ports = exposer->GetListeningPorts();
    const std::string host = address.substr(0, address.rfind(':'));
    std::string bound = ports.empty() ? address : absl::StrCat(host, ":", ports.front());
    return std::unique_ptr<MetricsEndpoint>(
        new MetricsEndpoint(std::move(exposer), std::move(registry), std::move(bound)));
  }

  const std::string& bound_address() const { return bound_; }

 private:
  MetricsEndpoint(std::unique_ptr<prometheus::Exposer> exposer,
                  std::shared_ptr<prometheus::Registry> registry, std::string bound)
      : exposer_(std::move(exposer)), registry_(std::move(registry)), bound_(std::move(bound)) {}

  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::string bound_;
};

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_METRICS_ENDPOINT_H_
