// libFuzzer target: the parameter server's data-plane header decoders (rpc/ps/data_plane_wire),
// which read bytes straight off a TCP connection from any peer. Any header must decode or be
// refused (INVALID_ARGUMENT for a request, INTERNAL for a response), within its bounds; a request
// that decodes must encode back to the same header and decode to the same fields.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "rpc/ps/data_plane_wire.h"

namespace ps = trainyard::ps;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  // The first byte picks the decoder, so that one corpus covers both.
  const bool response = !bytes.empty() && (bytes[0] & 1);
  const std::string header = bytes.empty() ? bytes : bytes.substr(1);
  if (response) {
    uint32_t message_bytes = 0;
    auto r = ps::DecodeResponseHeader(header, &message_bytes);
    if (!r.ok()) {
      if (r.status().code() != absl::StatusCode::kInternal) std::abort();
      return 0;
    }
    if (message_bytes > ps::kMaxStatusMessageBytes || r->count_a < 0 || r->count_b < 0) {
      std::abort();
    }
    return 0;
  }
  uint32_t job_id_bytes = 0, credential_bytes = 0;
  auto request = ps::DecodeRequestHeader(header, &job_id_bytes, &credential_bytes);
  if (!request.ok()) {
    if (request.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  if (job_id_bytes == 0 || job_id_bytes > ps::kMaxJobIdBytes ||
      credential_bytes > ps::kMaxCredentialBytes) {
    std::abort();
  }
  ps::DataPlaneRequest full = *request;
  full.job_id.assign(job_id_bytes, 'j');
  full.credential.assign(credential_bytes, 'c');
  if (!ps::ValidateRequest(full, job_id_bytes).ok()) std::abort();
  if (full.payload_bytes() < 0) std::abort();
  const std::string encoded = ps::EncodeRequest(full);
  uint32_t j2 = 0, c2 = 0;
  auto again = ps::DecodeRequestHeader(encoded.substr(0, ps::kRequestHeaderBytes), &j2, &c2);
  if (!again.ok() || j2 != job_id_bytes || c2 != credential_bytes || again->op != full.op ||
      again->format != full.format || again->attempt != full.attempt || again->step != full.step ||
      again->begin != full.begin || again->end != full.end ||
      again->chunk_elements != full.chunk_elements || again->update != full.update ||
      again->wait_ms != full.wait_ms || again->timeout_ms != full.timeout_ms) {
    std::abort();
  }
  return 0;
}
