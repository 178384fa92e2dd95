#include "server/ps/ps_wire.h"

#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace trainyard::ps {
namespace {

// Protobuf's wire types (encoding.md).
constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLengthDelimited = 2;
constexpr int kFixed32 = 5;

// Reads a message spread over slices, front to back.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }

  bool done() const { return slice_ == slices_.size(); }
  size_t position() const { return position_; }

  bool ReadVarint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (done()) return false;
      const uint8_t byte = slices_[slice_].begin()[offset_];
      Advance(1);
      *value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }

  // Appends the next `n` bytes to `pieces` as views into the slices; false if there are fewer.
  bool ReadPieces(uint64_t n, std::vector<absl::string_view>* pieces) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& slice = slices_[slice_];
      const size_t take = std::min<uint64_t>(n, slice.size() - offset_);
      pieces->emplace_back(reinterpret_cast<const char*>(slice.begin()) + offset_, take);
      Advance(take);
      n -= take;
    }
    return true;
  }

  bool Skip(uint64_t n) {
    std::vector<absl::string_view> ignored;
    return ReadPieces(n, &ignored);
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    position_ += n;
    if (offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && slices_[slice_].size() == 0) ++slice_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
  size_t position_ = 0;
};

// The decoder below names GradientChunk's fields by number.
static_assert(v1::GradientChunk::kJobIdFieldNumber == 1 &&
              v1::GradientChunk::kAttemptFieldNumber == 2 &&
              v1::GradientChunk::kStepFieldNumber == 3 &&
              v1::GradientChunk::kOffsetFieldNumber == 4 &&
              v1::GradientChunk::kFormatFieldNumber == 5 &&
              v1::GradientChunk::kDataFieldNumber == 6);

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

}  // namespace

absl::StatusOr<PushedChunk> DecodeGradientChunk(const grpc::ByteBuffer& message) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (!message.Dump(slices.get()).ok()) {
    return absl::InvalidArgumentError("GradientChunk: unreadable message");
  }
  SliceReader in(*slices);
  PushedChunk chunk;
  const auto malformed = [&](const char* field, const char* what) {
    return absl::InvalidArgumentError(
        absl::StrCat("GradientChunk.", field, ": ", what, " at byte ", in.position()));
  };
  while (!in.done()) {
    uint64_t tag;
    if (!in.ReadVarint(&tag)) return malformed("tag", "truncated varint");
    const uint64_t field = tag >> 3;
    const int wire_type = static_cast<int>(tag & 7);
    const char* name = field == 1   ? "job_id"
                       : field == 2 ? "attempt"
                       : field == 3 ? "step"
                       : field == 4 ? "offset"
                       : field == 5 ? "format"
                       : field == 6 ? "data"
                                    : "(unknown field)";
    if (field == 0) return malformed("tag", "field number 0");
    const bool known = field <= 6;
    const int expected = field == 1 || field == 6 ? kLengthDelimited : kVarint;
    if (known && wire_type != expected) return malformed(name, "wrong wire type");
    if (wire_type == kVarint) {
      uint64_t value;
      if (!in.ReadVarint(&value)) return malformed(name, "truncated varint");
      switch (field) {
        case 2:
          chunk.attempt = static_cast<int32_t>(value);
          break;
        case 3:
          chunk.step = static_cast<int64_t>(value);
          break;
        case 4:
          chunk.offset = static_cast<int64_t>(value);
          break;
        case 5: {
          const auto format = static_cast<int32_t>(value);
          if (!v1::WireFormat_IsValid(format)) {
            return absl::InvalidArgumentError(
                absl::StrCat("GradientChunk.format: unknown wire format ", format));
          }
          chunk.format = static_cast<v1::WireFormat>(format);
          break;
        }
        default:
          break;  // unknown: skipped
      }
    } else if (wire_type == kLengthDelimited) {
      uint64_t length;
      if (!in.ReadVarint(&length)) return malformed(name, "truncated length");
      if (field == 1) {
        std::vector<absl::string_view> pieces;
        if (!in.ReadPieces(length, &pieces)) return malformed(name, "truncated");
        chunk.job_id.clear();
        for (absl::string_view piece : pieces) chunk.job_id.append(piece.data(), piece.size());
      } else if (field == 6) {
        chunk.data.pieces.clear();
        if (!in.ReadPieces(length, &chunk.data.pieces)) return malformed(name, "truncated");
      } else if (!in.Skip(length)) {
        return malformed(name, "truncated");
      }
    } else if (wire_type == kFixed64 || wire_type == kFixed32) {
      if (!in.Skip(wire_type == kFixed64 ? 8 : 4)) return malformed(name, "truncated");
    } else {
      return malformed(name, "unsupported wire type");
    }
  }
  chunk.data.owner = std::move(slices);
  return chunk;
}

grpc::ByteBuffer EncodeParameterChunk(int64_t offset, v1::WireFormat format, grpc::Slice data) {
  std::string header;
  header.reserve(24);
  if (offset != 0) {
    header.push_back(static_cast<char>((v1::ParameterChunk::kOffsetFieldNumber << 3) | kVarint));
    AppendVarint(static_cast<uint64_t>(offset), &header);
  }
  if (format != v1::WIRE_FORMAT_UNSPECIFIED) {
    header.push_back(static_cast<char>((v1::ParameterChunk::kFormatFieldNumber << 3) | kVarint));
    AppendVarint(static_cast<uint64_t>(format), &header);
  }
  if (data.size() > 0) {
    header.push_back(
        static_cast<char>((v1::ParameterChunk::kDataFieldNumber << 3) | kLengthDelimited));
    AppendVarint(data.size(), &header);
  }
  grpc::Slice slices[2] = {grpc::Slice(header), std::move(data)};
  return grpc::ByteBuffer(slices, slices[1].size() > 0 ? 2 : 1);
}

}  // namespace trainyard::ps

namespace trainyard::ps {

grpc::ByteBuffer EncodeGradientChunk(const v1::GradientChunk& header, const void* data,
                                     size_t bytes) {
  std::string prefix = header.SerializeAsString();
  prefix.push_back(
      static_cast<char>((v1::GradientChunk::kDataFieldNumber << 3) | kLengthDelimited));
  AppendVarint(bytes, &prefix);
  const grpc::Slice slices[2] = {
      grpc::Slice(prefix),
      grpc::Slice(static_cast<const char*>(data), bytes, grpc::Slice::STATIC_SLICE)};
  return grpc::ByteBuffer(slices, 2);
}

absl::Status DecodeParameterChunkInto(const grpc::ByteBuffer& message, v1::WireFormat format,
                                      int64_t begin, int64_t end, void* out, int64_t* received) {
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) return absl::InternalError("ParameterChunk: unreadable");
  SliceReader in(slices);
  const auto malformed = [&](const char* what) {
    return absl::InternalError(absl::StrCat("ParameterChunk: ", what, " at byte ", in.position()));
  };
  uint64_t offset = 0, chunk_format = v1::WIRE_FORMAT_UNSPECIFIED;
  std::vector<absl::string_view> data;
  while (!in.done()) {
    uint64_t tag, value;
    if (!in.ReadVarint(&tag)) return malformed("truncated tag");
    const uint64_t field = tag >> 3;
    switch (static_cast<int>(tag & 7)) {
      case kVarint:
        if (!in.ReadVarint(&value)) return malformed("truncated varint");
        if (field == v1::ParameterChunk::kOffsetFieldNumber) offset = value;
        if (field == v1::ParameterChunk::kFormatFieldNumber) chunk_format = value;
        break;
      case kLengthDelimited:
        if (!in.ReadVarint(&value)) return malformed("truncated length");
        if (field == v1::ParameterChunk::kDataFieldNumber) {
          data.clear();
          if (!in.ReadPieces(value, &data)) return malformed("truncated data");
        } else if (!in.Skip(value)) {
          return malformed("truncated field");
        }
        break;
      case kFixed64:
      case kFixed32:
        if (!in.Skip((tag & 7) == kFixed64 ? 8 : 4)) return malformed("truncated field");
        break;
      default:
        return malformed("unsupported wire type");
    }
  }
  const auto as_fp32 = [](uint64_t f) {
    return f == v1::WIRE_BF16 ? v1::WIRE_BF16 : v1::WIRE_FP32;
  };
  const int64_t element_bytes = WireElementBytes(format);
  size_t bytes = 0;
  for (absl::string_view piece : data) bytes += piece.size();
  const int64_t a = static_cast<int64_t>(offset), n = static_cast<int64_t>(bytes) / element_bytes;
  if (as_fp32(chunk_format) != as_fp32(format) || bytes % element_bytes != 0 || a < begin ||
      a + n > end) {
    return absl::InternalError(absl::StrCat("ParameterChunk: [", a, ", ", a + n, ") in format ",
                                            chunk_format, " is not whole elements of format ",
                                            static_cast<int>(format), " inside [", begin, ", ", end,
                                            ")"));
  }
  char* dst = static_cast<char*>(out) + (a - begin) * element_bytes;
  for (absl::string_view piece : data) {
    std::memcpy(dst, piece.data(), piece.size());
    dst += piece.size();
  }
  *received += n;
  return absl::OkStatus();
}

}  // namespace trainyard::ps
