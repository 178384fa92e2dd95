// Raw safetensors bytes for tests: a header with its 8-byte little-endian length in front.
#ifndef TRAINYARD_TESTS_TESTING_SAFETENSORS_BYTES_H_
#define TRAINYARD_TESTS_TESTING_SAFETENSORS_BYTES_H_

#include <string>

namespace trainyard::testing {

inline std::string WithSafetensorsLength(const std::string& header) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header;
}

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_SAFETENSORS_BYTES_H_
