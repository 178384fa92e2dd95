// libFuzzer target: the credential parsers (common/credentials), which the coordinator runs on
// every call's "authorization" metadata before anything else. Any text must parse or be refused
// with INVALID_ARGUMENT or UNAUTHENTICATED; an API token that parses must print back as the same
// text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/credentials.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto token = trainyard::ParseApiToken(text);
  if (token.ok()) {
    if (token->Text() != text) std::abort();
  } else if (token.status().code() != absl::StatusCode::kInvalidArgument &&
             token.status().code() != absl::StatusCode::kUnauthenticated) {
    std::abort();
  }
  auto job = trainyard::ParseJobCredential(text);
  if (job.ok()) {
    if (job->job_id.empty() || job->attempt < 1) std::abort();
  } else if (job.status().code() != absl::StatusCode::kInvalidArgument &&
             job.status().code() != absl::StatusCode::kUnauthenticated) {
    std::abort();
  }
  auto bearer = trainyard::BearerCredential(text);
  (void)bearer;
  return 0;
}
