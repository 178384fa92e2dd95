#include "rpc/ps/ps_wire.h"

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

  // Passes over the next `n` bytes, appending them to `pieces` (if not null) as views into the
  // slices; false if there are fewer.
  bool Take(uint64_t n, std::vector<absl::string_view>* pieces) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& slice = slices_[slice_];
      const size_t take = std::min<uint64_t>(n, slice.size() - offset_);
      if (pieces != nullptr) {
        pieces->emplace_back(reinterpret_cast<const char*>(slice.begin()) + offset_, take);
      }
      Advance(take);
      n -= take;
    }
    return true;
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

// One field of a message as read: a varint's value, a length-delimited field's bytes (views into
// the slices); fixed-width fields are passed over.
struct Field {
  uint64_t number = 0;  // 0 while the tag is not read
  int wire_type = 0;
  uint64_t varint = 0;
  std::vector<absl::string_view> bytes;
};

// Reads the next field into `f`: nullptr, or what is wrong with it.
const char* ReadField(SliceReader& in, Field* f) {
  f->number = 0;
  f->bytes.clear();
  uint64_t tag;
  if (!in.ReadVarint(&tag)) return "truncated varint";
  if ((tag >> 3) == 0) return "field number 0";
  f->number = tag >> 3;
  f->wire_type = static_cast<int>(tag & 7);
  switch (f->wire_type) {
    case kVarint:
      return in.ReadVarint(&f->varint) ? nullptr : "truncated varint";
    case kLengthDelimited: {
      uint64_t length;
      if (!in.ReadVarint(&length)) return "truncated length";
      return in.Take(length, &f->bytes) ? nullptr : "truncated";
    }
    case kFixed64:
    case kFixed32:
      return in.Take(f->wire_type == kFixed64 ? 8 : 4, nullptr) ? nullptr : "truncated";
    default:
      return "unsupported wire type";
  }
}

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
  static constexpr const char* kNames[] = {"tag",    "job_id", "attempt", "step",
                                           "offset", "format", "data"};
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (!message.Dump(slices.get()).ok()) {
    return absl::InvalidArgumentError("GradientChunk: unreadable message");
  }
  SliceReader in(*slices);
  PushedChunk chunk;
  Field f;
  while (!in.done()) {
    const char* error = ReadField(in, &f);
    const char* name = f.number <= 6 ? kNames[f.number] : "(unknown field)";
    const bool known = f.number >= 1 && f.number <= 6;
    const int expected = f.number == 1 || f.number == 6 ? kLengthDelimited : kVarint;
    if (error == nullptr && known && f.wire_type != expected) error = "wrong wire type";
    if (error != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("GradientChunk.", name, ": ", error, " at byte ", in.position()));
    }
    switch (f.number) {
      case 1:
        chunk.job_id.clear();
        for (absl::string_view piece : f.bytes) chunk.job_id.append(piece.data(), piece.size());
        break;
      case 2:
        chunk.attempt = static_cast<int32_t>(f.varint);
        break;
      case 3:
        chunk.step = static_cast<int64_t>(f.varint);
        break;
      case 4:
        chunk.offset = static_cast<int64_t>(f.varint);
        break;
      case 5:
        if (!v1::WireFormat_IsValid(static_cast<int32_t>(f.varint))) {
          return absl::InvalidArgumentError(absl::StrCat(
              "GradientChunk.format: unknown wire format ", static_cast<int32_t>(f.varint)));
        }
        chunk.format = static_cast<v1::WireFormat>(f.varint);
        break;
      case 6:
        chunk.data.pieces = std::move(f.bytes);
        break;
      default:
        break;  // unknown: skipped
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
  uint64_t offset = 0, chunk_format = v1::WIRE_FORMAT_UNSPECIFIED;
  ReceivedBytes data;  // views into `slices`
  Field f;
  while (!in.done()) {
    if (const char* error = ReadField(in, &f)) {
      return absl::InternalError(
          absl::StrCat("ParameterChunk: ", error, " at byte ", in.position()));
    }
    if (f.wire_type == kVarint && f.number == v1::ParameterChunk::kOffsetFieldNumber) {
      offset = f.varint;
    } else if (f.wire_type == kVarint && f.number == v1::ParameterChunk::kFormatFieldNumber) {
      chunk_format = f.varint;
    } else if (f.wire_type == kLengthDelimited &&
               f.number == v1::ParameterChunk::kDataFieldNumber) {
      data.pieces = std::move(f.bytes);
    }
  }
  const int64_t element_bytes = WireElementBytes(format);
  const size_t bytes = data.size();
  const int64_t a = static_cast<int64_t>(offset), n = static_cast<int64_t>(bytes) / element_bytes;
  if (NormalizedWireFormat(static_cast<int>(chunk_format)) != NormalizedWireFormat(format) ||
      bytes % element_bytes != 0 || a < begin || a + n > end) {
    return absl::InternalError(absl::StrCat("ParameterChunk: [", a, ", ", a + n, ") in format ",
                                            chunk_format, " is not whole elements of format ",
                                            static_cast<int>(format), " inside [", begin, ", ", end,
                                            ")"));
  }
  char* dst = static_cast<char*>(out) + (a - begin) * element_bytes;
  for (absl::string_view piece : data.pieces) {
    std::memcpy(dst, piece.data(), piece.size());
    dst += piece.size();
  }
  *received += n;
  return absl::OkStatus();
}

}  // namespace trainyard::ps
