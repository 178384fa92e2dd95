#include "server/coordinator/audit.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log_text.h"

namespace trainyard::coordinator {
namespace {

absl::Mutex json_mu;
int json_fd ABSL_GUARDED_BY(json_mu) = -1;

// JSON strings must be valid UTF-8; the dump replaces invalid bytes instead of throwing.
std::string ToJsonLine(const AuditEvent& e) {
  nlohmann::json j;
  j["time"] = absl::FormatTime(absl::RFC3339_full, absl::Now(), absl::UTCTimeZone());
  j["principal"] = e.principal;
  j["method"] = e.method;
  j["target"] = e.target;
  j["result"] = e.result.ok() ? "OK" : absl::StatusCodeToString(e.result.code());
  if (!e.result.ok()) j["message"] = std::string(e.result.message());
  if (!e.peer.empty()) j["peer"] = e.peer;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace

void WriteAudit(const AuditEvent& e) {
  const std::string result = e.result.ok() ? std::string("OK")
                                           : absl::StrCat(absl::StatusCodeToString(e.result.code()),
                                                          ": ", Quoted(e.result.message()));
  if (e.result.ok()) {
    spdlog::info("audit: {} {} {} -> {}", e.principal, e.method, Quoted(e.target), result);
  } else {
    spdlog::warn("audit: {} {} {} -> {}", e.principal, e.method, Quoted(e.target), result);
  }
  absl::MutexLock lock(&json_mu);
  if (json_fd < 0) return;
  const std::string line = ToJsonLine(e);
  // O_APPEND: one write per event, so concurrent writers (and log rotation by copy) keep lines
  // whole.
  if (::write(json_fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    spdlog::error("audit log: write failed: {}", strerror(errno));
  }
}

absl::Status OpenAuditJsonLog(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--audit-log: cannot open ", path, ": ", strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (st.st_mode & 077) != 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "--audit-log: ", path, " must be a plain file that only its owner may read (chmod 600)"));
  }
  absl::MutexLock lock(&json_mu);
  if (json_fd >= 0) ::close(json_fd);
  json_fd = fd;
  return absl::OkStatus();
}

void CloseAuditJsonLog() {
  absl::MutexLock lock(&json_mu);
  if (json_fd >= 0) ::close(json_fd);
  json_fd = -1;
}

}  // namespace trainyard::coordinator
