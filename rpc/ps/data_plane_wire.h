// The framing of trainyard-ps's data plane: PushGradients and UpdateAndPull, the two bulk calls
// of trainyard.v1.ParameterServerService, carried on plain TCP connections instead of gRPC, as
// Gloo, NCCL and BytePS carry tensors. gRPC stays the control plane: trainers learn a server's
// data-plane address from its GetDataPlane call and fall back to the gRPC calls where there is
// none. Why: over gRPC a transfer costs ~1.6-2x the CPU of the socket under it, which on hosts
// where the client and servers share cores kept push and pull at 25-80% of a plain socket
// (bench/RESULTS.md); on the data plane the gradients go from the trainer's array into the
// socket and the parameters from the shard's memory into the socket and on into the trainer's
// array, nothing copied in between.
//
// A connection carries one call at a time, each answered before the next, all integers
// little-endian:
//
//   request   kRequestHeaderBytes: magic "TYPS", version, op, format, flags (bit 0: update),
//             attempt, job_id bytes, step, begin, end, chunk_elements, lr, grad_scale, wait_ms,
//             timeout_ms, credential bytes, 4 reserved;
//             then the job_id; then the caller's parameter-server credential (tys.,
//             common/credentials.h: good for this server and attempt alone; the server
//             accepts a request only for the job and attempt it was issued for); then, for a
//             push, the gradients of [begin, end) in `format`.
//   response  kResponseHeaderBytes: magic "TYPR", status code, message bytes, flags (bit 0: the
//             server closes the connection after this response), then two counts: for a push
//             the elements staged and the duplicates, for a pull the bytes of data that follow;
//             then the status message; then, for a pull that succeeded, the parameters of
//             [begin, end) in `format`.
//
// The semantics are those of the gRPC calls (proto/trainyard/v1/ps.proto): a push stages its
// gradients in chunks of chunk_elements (0: 1 Mi), each of which a retry finds as a duplicate;
// a pull sends [begin, end) at step `step` whole or not at all. A request whose header does not
// decode gets INVALID_ARGUMENT naming the field and the connection is closed (the answer's
// closing flag says so); so is a connection beyond the server's limit (RESOURCE_EXHAUSTED) and
// one whose transfer broke off. Errors of the step protocol (unknown job, stale attempt, wrong
// step, ...) leave it usable.
#ifndef TRAINYARD_RPC_PS_DATA_PLANE_WIRE_H_
#define TRAINYARD_RPC_PS_DATA_PLANE_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "trainyard/v1/ps.pb.h"

namespace trainyard::ps {

inline constexpr uint8_t kDataPlaneVersion = 2;  // 2: the job credential
inline constexpr size_t kRequestHeaderBytes = 80;
inline constexpr size_t kResponseHeaderBytes = 32;
inline constexpr uint32_t kMaxJobIdBytes = 1024;
inline constexpr uint32_t kMaxCredentialBytes = 2048;
inline constexpr uint32_t kMaxStatusMessageBytes = 64 << 10;
// Largest [begin, end) of one request (2^40 elements: no job comes near, and the byte counts
// stay far from overflowing).
inline constexpr int64_t kMaxRequestElements = int64_t{1} << 40;
// chunk_elements' bounds, as the gRPC calls'.
inline constexpr int64_t kDefaultChunkElements = int64_t{1} << 20;
inline constexpr int64_t kMaxChunkElements = int64_t{16} << 20;

enum class DataPlaneOp : uint8_t { kPush = 1, kUpdateAndPull = 2 };

// One call. For a push, `update`, `lr`, `grad_scale` and `wait_ms` are unused.
struct DataPlaneRequest {
  DataPlaneOp op = DataPlaneOp::kPush;
  v1::WireFormat format = v1::WIRE_FP32;  // WIRE_FORMAT_UNSPECIFIED means fp32
  std::string job_id;
  int32_t attempt = 0;
  int64_t step = 0;
  int64_t begin = 0, end = 0;
  int64_t chunk_elements = 0;
  bool update = false;
  float lr = 0, grad_scale = 0;
  int64_t wait_ms = 0;
  // The caller's time limit (0: none): an update waits for lent elements no longer, as a gRPC
  // call's deadline bounds it.
  int64_t timeout_ms = 0;
  // The caller's job credential ("tyj...."); never logged.
  std::string credential;

  // Bytes of [begin, end) in `format`: a push's payload, a successful pull's data.
  int64_t payload_bytes() const;
};

// What the server accepts of a request whose job_id has `job_id_bytes` bytes: INVALID_ARGUMENT
// naming the field ("request.format: ...") for an unknown op or format, an empty or too long
// job_id, an empty, negative or too large [begin, end), a chunk_elements outside [0,
// kMaxChunkElements], a negative wait_ms or timeout_ms. Clients check before they send.
absl::Status ValidateRequest(const DataPlaneRequest& request, size_t job_id_bytes);

// The header, job_id and credential of `request` (kRequestHeaderBytes + job_id.size() +
// credential.size() bytes). `request`
// must pass ValidateRequest (a format or op above 255 would not survive the encoding).
std::string EncodeRequest(const DataPlaneRequest& request);

// Decodes a request header (exactly kRequestHeaderBytes); the caller then reads `*job_id_bytes`
// of job_id and `*credential_bytes` of credential
// bytes into the result's job_id. INVALID_ARGUMENT naming the field for a wrong size, magic or
// version, unknown flag bits, and whatever ValidateRequest refuses.
absl::StatusOr<DataPlaneRequest> DecodeRequestHeader(absl::string_view header,
                                                     uint32_t* job_id_bytes,
                                                     uint32_t* credential_bytes);

struct DataPlaneResponse {
  absl::Status status;
  bool closing = false;  // the server closes the connection after this response
  // Push: elements staged, elements duplicate. Pull: bytes of data that follow, 0.
  int64_t count_a = 0, count_b = 0;
};

// The header and status message of `response` (the message cut to kMaxStatusMessageBytes).
std::string EncodeResponse(const DataPlaneResponse& response);

// Decodes a response header (exactly kResponseHeaderBytes); the caller then reads
// `*message_bytes` bytes, the status message. INTERNAL for a wrong magic, a status code outside
// absl's or a message or count out of bounds.
absl::StatusOr<DataPlaneResponse> DecodeResponseHeader(absl::string_view header,
                                                       uint32_t* message_bytes);

}  // namespace trainyard::ps

#endif  // TRAINYARD_RPC_PS_DATA_PLANE_WIRE_H_
