// The coordinator's audit trail: every call that changes something, and every refusal, as one
// log line ("audit: PRINCIPAL METHOD "TARGET" -> RESULT", user-supplied fields quoted and
// escaped) and, when an operator asked for it (--audit-log FILE), as one JSON object per line in
// that file for log shippers: {"time":..., "principal":..., "method":..., "target":...,
// "result":"OK"|"PERMISSION_DENIED"..., "message":..., "peer":...}.
//
// Process-wide, like spdlog's default logger: main() opens the JSON file once; services.cc
// writes. Thread-safe.
#ifndef TRAINYARD_SERVER_COORDINATOR_AUDIT_H_
#define TRAINYARD_SERVER_COORDINATOR_AUDIT_H_

#include <string>

#include "absl/status/status.h"

namespace trainyard::coordinator {

struct AuditEvent {
  std::string principal;  // Principal::Describe(), or "anonymous"
  std::string method;     // the RPC
  std::string target;     // what it acted on (a job, user or token id); may be empty
  absl::Status result;
  std::string peer;  // the caller's address, when known
};

// Writes `event` to the log and, if open, to the JSON-lines file.
void WriteAudit(const AuditEvent& event);

// Appends JSON lines to `path` from now on (created 0600 if missing; refused when others may
// read it, as secret files are). INVALID_ARGUMENT naming the flag when it cannot be opened.
absl::Status OpenAuditJsonLog(const std::string& path);
// Closes the JSON-lines file; audit lines go to the log only.
void CloseAuditJsonLog();

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_AUDIT_H_
