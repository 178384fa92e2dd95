#include "rpc/ps/data_plane_wire.h"

#include <cstring>
#include <type_traits>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "rpc/ps/wire_types.h"

namespace trainyard::ps {
namespace {

static_assert(ABSL_IS_LITTLE_ENDIAN, "the data plane's integers are little-endian in memory too");

constexpr char kRequestMagic[4] = {'T', 'Y', 'P', 'S'};
constexpr char kResponseMagic[4] = {'T', 'Y', 'P', 'R'};
constexpr uint8_t kUpdateFlag = 1;
constexpr uint32_t kClosingFlag = 1;

// Field offsets of the request header.
constexpr size_t kReqVersion = 4, kReqOp = 5, kReqFormat = 6, kReqFlags = 7, kReqAttempt = 8,
                 kReqJobIdBytes = 12, kReqStep = 16, kReqBegin = 24, kReqEnd = 32,
                 kReqChunkElements = 40, kReqLr = 48, kReqGradScale = 52, kReqWaitMs = 56,
                 kReqTimeoutMs = 64, kReqCredentialBytes = 72;
// Field offsets of the response header.
constexpr size_t kRespCode = 4, kRespMessageBytes = 8, kRespFlags = 12, kRespCountA = 16,
                 kRespCountB = 24;

template <typename T>
void Put(std::string& out, size_t offset, T value) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::memcpy(out.data() + offset, &value, sizeof(T));
}

template <typename T>
T Get(absl::string_view in, size_t offset) {
  T value;
  std::memcpy(&value, in.data() + offset, sizeof(T));
  return value;
}

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("request.", field, ": ", what));
}

}  // namespace

int64_t DataPlaneRequest::payload_bytes() const {
  return (end - begin) * WireElementBytes(NormalizedWireFormat(format));
}

std::string EncodeRequest(const DataPlaneRequest& r) {
  std::string out(kRequestHeaderBytes, '\0');
  std::memcpy(out.data(), kRequestMagic, 4);
  Put<uint8_t>(out, kReqVersion, kDataPlaneVersion);
  Put<uint8_t>(out, kReqOp, static_cast<uint8_t>(r.op));
  Put<uint8_t>(out, kReqFormat, static_cast<uint8_t>(r.format));
  Put<uint8_t>(out, kReqFlags, r.update ? kUpdateFlag : 0);
  Put<int32_t>(out, kReqAttempt, r.attempt);
  Put<uint32_t>(out, kReqJobIdBytes, static_cast<uint32_t>(r.job_id.size()));
  Put<int64_t>(out, kReqStep, r.step);
  Put<int64_t>(out, kReqBegin, r.begin);
  Put<int64_t>(out, kReqEnd, r.end);
  Put<int64_t>(out, kReqChunkElements, r.chunk_elements);
  Put<float>(out, kReqLr, r.lr);
  Put<float>(out, kReqGradScale, r.grad_scale);
  Put<int64_t>(out, kReqWaitMs, r.wait_ms);
  Put<int64_t>(out, kReqTimeoutMs, r.timeout_ms);
  Put<uint32_t>(out, kReqCredentialBytes, static_cast<uint32_t>(r.credential.size()));
  out += r.job_id;
  out += r.credential;
  return out;
}

absl::Status ValidateRequest(const DataPlaneRequest& r, size_t job_id_bytes) {
  if (r.op != DataPlaneOp::kPush && r.op != DataPlaneOp::kUpdateAndPull) {
    return Invalid("op", absl::StrCat("unknown operation ", static_cast<int>(r.op)));
  }
  if (!v1::WireFormat_IsValid(r.format)) {
    return Invalid("format", absl::StrCat("unknown wire format ", static_cast<int>(r.format)));
  }
  if (job_id_bytes == 0) return Invalid("job_id", "empty");
  if (job_id_bytes > kMaxJobIdBytes) {
    return Invalid("job_id", absl::StrCat(job_id_bytes, " bytes, more than ", kMaxJobIdBytes));
  }
  if (r.begin < 0 || r.end <= r.begin || r.end - r.begin > kMaxRequestElements) {
    return Invalid("begin/end",
                   absl::StrCat("[", r.begin, ", ", r.end, ") is empty, negative or more than ",
                                kMaxRequestElements, " elements"));
  }
  if (r.chunk_elements < 0 || r.chunk_elements > kMaxChunkElements) {
    return Invalid("chunk_elements",
                   absl::StrCat(r.chunk_elements, " is not in [0, ", kMaxChunkElements, "]"));
  }
  if (r.wait_ms < 0) return Invalid("wait_ms", absl::StrCat(r.wait_ms, " is negative"));
  if (r.timeout_ms < 0) return Invalid("timeout_ms", absl::StrCat(r.timeout_ms, " is negative"));
  return absl::OkStatus();
}

absl::StatusOr<DataPlaneRequest> DecodeRequestHeader(absl::string_view h, uint32_t* job_id_bytes,
                                                     uint32_t* credential_bytes) {
  if (h.size() != kRequestHeaderBytes) {
    return Invalid("header", absl::StrCat(h.size(), " bytes, not ", kRequestHeaderBytes));
  }
  if (std::memcmp(h.data(), kRequestMagic, 4) != 0) {
    return Invalid("magic", absl::StrCat("0x", absl::Hex(Get<uint32_t>(h, 0)),
                                         " is not a trainyard-ps data-plane request"));
  }
  if (const uint8_t version = Get<uint8_t>(h, kReqVersion); version != kDataPlaneVersion) {
    return Invalid("version", absl::StrCat(version, " is not supported (this server speaks ",
                                           kDataPlaneVersion, ")"));
  }
  const uint8_t flags = Get<uint8_t>(h, kReqFlags);
  if ((flags & ~kUpdateFlag) != 0) {
    return Invalid("flags", absl::StrCat("unknown bits in 0x", absl::Hex(flags)));
  }
  DataPlaneRequest r;
  r.op = static_cast<DataPlaneOp>(Get<uint8_t>(h, kReqOp));
  r.format = static_cast<v1::WireFormat>(Get<uint8_t>(h, kReqFormat));
  r.update = (flags & kUpdateFlag) != 0;
  r.attempt = Get<int32_t>(h, kReqAttempt);
  *job_id_bytes = Get<uint32_t>(h, kReqJobIdBytes);
  r.step = Get<int64_t>(h, kReqStep);
  r.begin = Get<int64_t>(h, kReqBegin);
  r.end = Get<int64_t>(h, kReqEnd);
  r.chunk_elements = Get<int64_t>(h, kReqChunkElements);
  r.lr = Get<float>(h, kReqLr);
  r.grad_scale = Get<float>(h, kReqGradScale);
  r.wait_ms = Get<int64_t>(h, kReqWaitMs);
  r.timeout_ms = Get<int64_t>(h, kReqTimeoutMs);
  *credential_bytes = Get<uint32_t>(h, kReqCredentialBytes);
  if (*credential_bytes > kMaxCredentialBytes) {
    return Invalid("credential",
                   absl::StrCat(*credential_bytes, " bytes, more than ", kMaxCredentialBytes));
  }
  if (absl::Status s = ValidateRequest(r, *job_id_bytes); !s.ok()) return s;
  r.format = NormalizedWireFormat(r.format);
  return r;
}

std::string EncodeResponse(const DataPlaneResponse& r) {
  const absl::string_view message = r.status.message().substr(0, kMaxStatusMessageBytes);
  std::string out(kResponseHeaderBytes, '\0');
  std::memcpy(out.data(), kResponseMagic, 4);
  Put<int32_t>(out, kRespCode, static_cast<int32_t>(r.status.code()));
  Put<uint32_t>(out, kRespMessageBytes, static_cast<uint32_t>(message.size()));
  Put<uint32_t>(out, kRespFlags, r.closing ? kClosingFlag : 0);
  Put<int64_t>(out, kRespCountA, r.count_a);
  Put<int64_t>(out, kRespCountB, r.count_b);
  out.append(message.data(), message.size());
  return out;
}

absl::StatusOr<DataPlaneResponse> DecodeResponseHeader(absl::string_view h,
                                                       uint32_t* message_bytes) {
  auto malformed = [](absl::string_view what) {
    return absl::InternalError(absl::StrCat("a malformed data-plane response: ", what));
  };
  if (h.size() != kResponseHeaderBytes || std::memcmp(h.data(), kResponseMagic, 4) != 0) {
    return malformed("wrong magic");
  }
  const int32_t code = Get<int32_t>(h, kRespCode);
  if (code < 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return malformed(absl::StrCat("status code ", code));
  }
  *message_bytes = Get<uint32_t>(h, kRespMessageBytes);
  if (*message_bytes > kMaxStatusMessageBytes) {
    return malformed(absl::StrCat("a status message of ", *message_bytes, " bytes"));
  }
  DataPlaneResponse r;
  r.status = absl::Status(static_cast<absl::StatusCode>(code), "");
  r.closing = (Get<uint32_t>(h, kRespFlags) & kClosingFlag) != 0;
  r.count_a = Get<int64_t>(h, kRespCountA);
  r.count_b = Get<int64_t>(h, kRespCountB);
  if (r.count_a < 0 || r.count_b < 0) return malformed("a negative count");
  return r;
}

}  // namespace trainyard::ps
