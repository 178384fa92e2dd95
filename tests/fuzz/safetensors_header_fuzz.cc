// libFuzzer target: the safetensors header parser (worker/trainer/safetensors), which reads a
// Hugging Face checkpoint a user points model.from at. Any bytes must parse or be refused with
// INVALID_ARGUMENT; every accepted header describes tensors inside the file. (The ASan/UBSan
// test tests/safetensors_fuzz_test.cc runs a fixed million mutations in ctest; this target lets
// libFuzzer's coverage guidance search beyond them.)
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "worker/trainer/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  // The file is as long as the input, or longer by what its last byte says (tensors whose data
  // lies past the bytes at hand).
  const uint64_t file_size = size + (size > 0 ? static_cast<uint8_t>(bytes.back()) : 0);
  auto header = trainyard::trainer::ParseSafetensorsHeader(bytes, file_size, "fuzz.safetensors");
  if (!header.ok()) {
    if (header.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  for (const auto& t : header->tensors) {
    if (t.begin < header->data_start || t.begin > t.end || t.end > file_size) std::abort();
  }
  return 0;
}
