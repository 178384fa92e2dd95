// The safetensors format (Hugging Face's checkpoint files), without LibTorch: an 8-byte
// little-endian header length N, N bytes of a JSON object, then the raw little-endian tensor
// bytes. The JSON names each tensor with its dtype, shape and [begin, end) byte offsets into the
// data that follows the header; "__metadata__" maps strings to strings.
//
// The header comes from files users bring, so it is untrusted: ParseSafetensorsHeader checks
// everything it reads (the length against the file, the JSON's shape and nesting, every dtype,
// shape and offset, that the offsets tile the data exactly) and never reads past the bytes it is
// given. Errors are INVALID_ARGUMENT naming the file and, where there is one, the tensor.
//
// Thread-safe: the functions are pure; a SafetensorsFile is immutable once open.
#ifndef TRAINYARD_WORKER_TRAINER_IO_SAFETENSORS_H_
#define TRAINYARD_WORKER_TRAINER_IO_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace trainyard::trainer {

enum class SafetensorsDtype {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64
};

// "F32" and so on, as the format spells them; bytes of one element.
const char* SafetensorsDtypeName(SafetensorsDtype dtype);
int SafetensorsDtypeSize(SafetensorsDtype dtype);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the file (the header's offsets + the data's start)
  uint64_t end = 0;

  int64_t numel() const;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                 // 8 + header length
  std::vector<SafetensorsTensor> tensors;  // by name
  std::map<std::string, std::string> metadata;

  const SafetensorsTensor* Find(absl::string_view name) const;
};

// The most header bytes accepted (as the reference implementation: 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Parses the header of a file of `file_size` bytes from its first bytes `prefix` (at least the
// 8-byte length and the header; more is ignored). `file` names the file in errors.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view prefix,
                                                         uint64_t file_size,
                                                         const std::string& file);

// A safetensors file mapped read-only; its tensors' bytes are views into the mapping.
class SafetensorsFile {
 public:
  // NOT_FOUND if it cannot be opened; INVALID_ARGUMENT for a bad header (see above).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // The tensor's raw little-endian bytes (end - begin of them).
  absl::Span<const uint8_t> Bytes(const SafetensorsTensor& tensor) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  SafetensorsHeader header_;
  const uint8_t* data_ = nullptr;  // the mapping
  uint64_t size_ = 0;
};

// A sharded checkpoint's index (model.safetensors.index.json): tensor name -> file name (relative
// to the index's folder). INVALID_ARGUMENT naming the index for a malformed one, or a file name
// that leaves the folder.
absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(absl::string_view json,
                                                                         const std::string& index);

// One tensor to write: its name, dtype, shape and raw little-endian bytes.
struct SafetensorsEntry {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  std::string bytes;
};

// The whole file: header (tensors sorted by name, offsets in that order, padded with spaces to a
// multiple of 8 as the reference writer does) and data. INVALID_ARGUMENT for an entry whose bytes
// do not match its dtype and shape, or a repeated name.
absl::StatusOr<std::string> SerializeSafetensors(
    std::vector<SafetensorsEntry> entries, const std::map<std::string, std::string>& metadata);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_IO_SAFETENSORS_H_
