// The web console of a build without cpp-httplib or dygraphs (a GPU host's kit): --web-address
// is refused with what to install.
#include "absl/status/status.h"
#include "server/web/web_console.h"

namespace trainyard::web {

struct WebConsole::Impl {
  std::string url;
};

WebConsole::WebConsole(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<WebConsole>> WebConsole::Start(const WebConsoleOptions&,
                                                              std::shared_ptr<grpc::Channel>) {
  return absl::UnimplementedError(
      "--web-address: this coordinator was built without the web console (install "
      "libcpp-httplib-dev and libjs-dygraphs, then build again)");
}

WebConsole::~WebConsole() = default;

const std::string& WebConsole::url() const { return impl_->url; }

struct WebRedirect::Impl {};

WebRedirect::WebRedirect(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<WebRedirect>> WebRedirect::Start(const WebConsoleOptions&) {
  return absl::UnimplementedError(
      "--web-address: this coordinator was built without the web console (install "
      "libcpp-httplib-dev and libjs-dygraphs, then build again)");
}

WebRedirect::~WebRedirect() = default;
void WebRedirect::SetLeader(const std::string&) {}
int WebRedirect::port() const { return 0; }

}  // namespace trainyard::web
