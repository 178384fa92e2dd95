#include "worker/trainer/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace trainyard::trainer {
namespace {

struct DtypeInfo {
  SafetensorsDtype dtype;
  const char* name;
  int size;
};

constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::kBool, "BOOL", 1}, {SafetensorsDtype::kU8, "U8", 1},
    {SafetensorsDtype::kI8, "I8", 1},     {SafetensorsDtype::kI16, "I16", 2},
    {SafetensorsDtype::kU16, "U16", 2},   {SafetensorsDtype::kF16, "F16", 2},
    {SafetensorsDtype::kBF16, "BF16", 2}, {SafetensorsDtype::kI32, "I32", 4},
    {SafetensorsDtype::kU32, "U32", 4},   {SafetensorsDtype::kF32, "F32", 4},
    {SafetensorsDtype::kF64, "F64", 8},   {SafetensorsDtype::kI64, "I64", 8},
    {SafetensorsDtype::kU64, "U64", 8},
};

// JSON nesting the format needs: the object, a tensor's object, its shape array.
constexpr int kMaxNesting = 4;

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Whether `text` nests objects and arrays deeper than `limit` (strings skipped): checked before
// the JSON parser sees it, so that no input can make parsing or freeing the tree recurse deeply.
bool NestsDeeperThan(absl::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

}  // namespace

const char* SafetensorsDtypeName(SafetensorsDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

int SafetensorsDtypeSize(SafetensorsDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const SafetensorsTensor* SafetensorsHeader::Find(absl::string_view name) const {
  auto it =
      std::lower_bound(tensors.begin(), tensors.end(), name,
                       [](const SafetensorsTensor& t, absl::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view prefix,
                                                         uint64_t file_size,
                                                         const std::string& file) {
  auto bad = [&file](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", what...));
  };
  if (file_size < 8 || prefix.size() < 8) {
    return bad("shorter than the 8-byte header length (", file_size, " bytes): truncated?");
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(prefix[i])} << (8 * i);
  if (n == 0) return bad("the header is empty");
  if (n > kMaxSafetensorsHeaderBytes) {
    return bad("a header of ", n, " bytes is more than the ", kMaxSafetensorsHeaderBytes,
               " accepted");
  }
  if (n > file_size - 8) {
    return bad("the header claims ", n, " bytes but the file has ", file_size - 8,
               " after its length: truncated, or not a safetensors file");
  }
  if (prefix.size() - 8 < n) {
    return bad("only ", prefix.size() - 8, " bytes of the ", n, "-byte header were read");
  }
  const absl::string_view text = prefix.substr(8, n);
  if (NestsDeeperThan(text, kMaxNesting)) {
    return bad("the header nests JSON deeper than a safetensors header does");
  }
  const nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                                 /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("the header is not a JSON object");

  SafetensorsHeader header;
  header.data_start = 8 + n;
  const uint64_t data_size = file_size - header.data_start;
  for (const auto& item : j.items()) {
    // (Not a structured binding: the lambda below captures the name, which clang refuses for a
    // binding before C++20.)
    const std::string& name = item.key();
    const nlohmann::json& value = item.value();
    if (name == "__metadata__") {
      if (!value.is_object()) return bad("__metadata__ is not an object");
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string()) return bad("__metadata__.", key, " is not a string");
        header.metadata[key] = v.get<std::string>();
      }
      continue;
    }
    auto bad_tensor = [&](auto&&... what) { return bad("tensor ", name, ": ", what...); };
    if (!value.is_object()) return bad_tensor("not an object");
    const auto dtype = value.find("dtype");
    const auto shape = value.find("shape");
    const auto offsets = value.find("data_offsets");
    if (dtype == value.end() || !dtype->is_string()) return bad_tensor("no dtype string");
    if (shape == value.end() || !shape->is_array()) return bad_tensor("no shape array");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      return bad_tensor("data_offsets is not [begin, end] of unsigned integers");
    }
    SafetensorsTensor t;
    t.name = name;
    const std::string& dtype_name = dtype->get_ref<const std::string&>();
    const DtypeInfo* info = nullptr;
    for (const DtypeInfo& d : kDtypes) {
      if (dtype_name == d.name) info = &d;
    }
    if (info == nullptr) return bad_tensor("unknown dtype \"", dtype_name, "\"");
    t.dtype = info->dtype;
    uint64_t elements = 1;
    for (const auto& dim : *shape) {
      if (!dim.is_number_unsigned()) return bad_tensor("a shape entry is not a count >= 0");
      const uint64_t d = dim.get<uint64_t>();
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(elements, d, &elements)) {
        return bad_tensor("shape overflows");
      }
      t.shape.push_back(static_cast<int64_t>(d));
    }
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(info->size), &bytes)) {
      return bad_tensor("shape overflows");
    }
    const uint64_t begin = (*offsets)[0].get<uint64_t>(), end = (*offsets)[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return bad_tensor("data_offsets [", begin, ", ", end, "] lie outside the ", data_size,
                        " bytes of data in the file");
    }
    if (end - begin != bytes) {
      return bad_tensor("data_offsets [", begin, ", ", end, "] hold ", end - begin,
                        " bytes but dtype ", info->name, " and shape ", ShapeText(t.shape),
                        " need ", bytes);
    }
    t.begin = begin;
    t.end = end;
    header.tensors.push_back(std::move(t));
  }
  // The tensors tile the data exactly, in offset order (as the reference reader requires).
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  uint64_t covered = 0;
  for (const SafetensorsTensor& t : header.tensors) {
    if (t.begin < covered) {
      return bad("tensor ", t.name, ": data_offsets [", t.begin, ", ", t.end,
                 "] overlap another tensor's");
    }
    if (t.begin > covered) {
      return bad("bytes [", covered, ", ", t.begin, ") of the data belong to no tensor (before ",
                 t.name, ")");
    }
    covered = t.end;
  }
  if (covered != data_size) {
    return bad("the data has ", data_size, " bytes but its tensors end at ", covered,
               covered < data_size ? ": trailing bytes" : "");
  }
  for (SafetensorsTensor& t : header.tensors) {
    t.begin += header.data_start;
    t.end += header.data_start;
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) { return a.name < b.name; });
  return header;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->size_ = static_cast<uint64_t>(st.st_size);
  if (file->size_ > 0) {
    void* map = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      close(fd);
      return absl::UnavailableError(absl::StrCat(path, ": mmap: ", std::strerror(errno)));
    }
    file->data_ = static_cast<const uint8_t*>(map);
  }
  close(fd);
  const absl::string_view bytes(reinterpret_cast<const char*>(file->data_), file->size_);
  auto header = ParseSafetensorsHeader(bytes, file->size_, path);
  if (!header.ok()) return header.status();
  file->header_ = *std::move(header);
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
}

absl::Span<const uint8_t> SafetensorsFile::Bytes(const SafetensorsTensor& tensor) const {
  return absl::Span<const uint8_t>(data_ + tensor.begin, tensor.end - tensor.begin);
}

absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(absl::string_view json,
                                                                         const std::string& index) {
  auto bad = [&index](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat(index, ": ", what...));
  };
  if (NestsDeeperThan(json, kMaxNesting)) return bad("nests JSON deeper than an index does");
  const nlohmann::json j =
      nlohmann::json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  const auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object()) return bad("no weight_map object");
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string()) return bad("weight_map.", name, " is not a file name");
    const std::string& f = file.get_ref<const std::string&>();
    if (f.empty() || f[0] == '.' || f.find('/') != std::string::npos) {
      return bad("weight_map.", name, ": \"", f, "\" is not a file in the index's folder");
    }
    out[name] = f;
  }
  return out;
}

absl::StatusOr<std::string> SerializeSafetensors(
    std::vector<SafetensorsEntry> entries, const std::map<std::string, std::string>& metadata) {
  std::sort(entries.begin(), entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.name < b.name; });
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsEntry& e = entries[i];
    if (e.name.empty() || e.name == "__metadata__" || (i > 0 && entries[i - 1].name == e.name)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name \"", e.name,
                                                     "\" is empty, "
                                                     "reserved or repeated"));
    }
    uint64_t bytes = static_cast<uint64_t>(SafetensorsDtypeSize(e.dtype));
    for (int64_t d : e.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat("tensor ", e.name, ": shape < 0"));
      bytes *= static_cast<uint64_t>(d);
    }
    if (bytes != e.bytes.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", e.name, ": ", e.bytes.size(), " bytes for dtype ",
          SafetensorsDtypeName(e.dtype), " and shape ", ShapeText(e.shape), " that need ", bytes));
    }
    header[e.name] = {{"dtype", SafetensorsDtypeName(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - (text.size() % 8)) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  out += text;
  for (const SafetensorsEntry& e : entries) out += e.bytes;
  return out;
}

}  // namespace trainyard::trainer
