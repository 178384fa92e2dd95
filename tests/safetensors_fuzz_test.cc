// Fuzz test of the safetensors header parser (worker/trainer/io/safetensors.h), built with
// AddressSanitizer and UndefinedBehaviorSanitizer: a million inputs mutated from valid and
// invalid files (bit flips, byte insertions and deletions, truncations, lengths and numbers
// swapped for extreme ones), each parsed from an exactly-sized heap buffer so that any read past
// it is caught. Every accepted header must describe tensors inside the file that tile its data.
// Deterministic (a fixed seed). Usage: safetensors_fuzz_test [EXECUTIONS]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tests/testing/safetensors_bytes.h"
#include "worker/trainer/io/safetensors.h"

namespace trainyard::trainer {
namespace {

using testing::WithSafetensorsLength;

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  auto ok = SerializeSafetensors(
      {{"model.embed_tokens.weight", SafetensorsDtype::kBF16, {4, 2}, std::string(16, '\1')},
       {"model.norm.weight", SafetensorsDtype::kF32, {2}, std::string(8, '\2')},
       {"empty", SafetensorsDtype::kF16, {0, 3}, ""}},
      {{"format", "pt"}});
  if (ok.ok()) seeds.push_back(*ok);
  seeds.push_back(
      WithSafetensorsLength(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{}})") +
      std::string(8, '\0'));
  seeds.push_back(
      WithSafetensorsLength(R"({"a":{"dtype":"U8","shape":[3,1],"data_offsets":[0,3]},)"
                            R"("b":{"dtype":"I64","shape":[],"data_offsets":[3,11]}})") +
      std::string(11, '\0'));
  seeds.push_back(WithSafetensorsLength("{}"));
  seeds.push_back(
      WithSafetensorsLength(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})"));
  return seeds;
}

const char* const kTokens[] = {"18446744073709551615",
                               "9223372036854775807",
                               "-1",
                               "0",
                               "4294967296",
                               "1e308",
                               "\"",
                               "{",
                               "[",
                               "]",
                               "}",
                               "\\u0000",
                               "\"F32\"",
                               "\"BF16\"",
                               "null",
                               ","};

std::string Mutate(std::string s, std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
    switch (rng() % 7) {
      case 0:  // flip a bit
        if (!s.empty()) s[pos % s.size()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:  // insert a random byte
        s.insert(pos, 1, static_cast<char>(rng() & 0xff));
        break;
      case 2:  // delete a run
        if (!s.empty()) s.erase(pos % s.size(), 1 + rng() % 8);
        break;
      case 3:  // truncate
        s.resize(pos);
        break;
      case 4: {  // replace the length with an extreme or off-by-some one
        if (s.size() < 8) break;
        uint64_t n = 0;
        std::memcpy(&n, s.data(), 8);
        const uint64_t choices[] = {
            0,          1, n - 1, n + 1, s.size(), s.size() - 8, ~uint64_t{0}, uint64_t{1} << 63,
            100'000'001};
        n = choices[rng() % (sizeof(choices) / sizeof(choices[0]))];
        std::memcpy(s.data(), &n, 8);
        break;
      }
      case 5:  // splice a JSON token in
        s.insert(pos, kTokens[rng() % (sizeof(kTokens) / sizeof(kTokens[0]))]);
        break;
      case 6:  // duplicate a run
        if (!s.empty()) {
          const size_t from = rng() % s.size();
          s.insert(pos, s.substr(from, 1 + rng() % 16));
        }
        break;
    }
  }
  return s;
}

int Main(int argc, char** argv) {
  const long executions = argc > 1 ? std::atol(argv[1]) : 1'000'000;
  const std::vector<std::string> seeds = Seeds();
  if (seeds.size() != 5) {
    std::fprintf(stderr, "seed files could not be made\n");
    return 1;
  }
  std::mt19937_64 rng(20261125);
  std::vector<std::string> corpus = seeds;  // grows with inputs that parse
  long accepted = 0;
  for (long i = 0; i < executions; ++i) {
    const std::string input = Mutate(corpus[rng() % corpus.size()], rng);
    // An exactly-sized heap copy: ASan catches any byte read past it.
    std::unique_ptr<char[]> buffer(new char[input.size() + 1]);
    std::memcpy(buffer.get(), input.data(), input.size());
    const absl::string_view view(buffer.get(), input.size());
    auto header = ParseSafetensorsHeader(view, input.size(), "fuzz.safetensors");
    if (!header.ok()) continue;
    ++accepted;
    uint64_t covered = header->data_start;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const SafetensorsTensor& t : header->tensors) {
      if (t.begin < header->data_start || t.end > input.size() || t.begin > t.end ||
          t.end - t.begin != static_cast<uint64_t>(t.numel()) * SafetensorsDtypeSize(t.dtype)) {
        std::fprintf(stderr, "accepted a tensor outside the file or of the wrong size: %s\n",
                     t.name.c_str());
        return 1;
      }
      ranges.emplace_back(t.begin, t.end);
    }
    std::sort(ranges.begin(), ranges.end());
    for (const auto& [b, e] : ranges) {
      if (b != covered) {
        std::fprintf(stderr, "accepted tensors that do not tile the data\n");
        return 1;
      }
      covered = e;
    }
    if (covered != input.size()) {
      std::fprintf(stderr, "accepted tensors that do not reach the end of the file\n");
      return 1;
    }
    if (corpus.size() < 256) corpus.push_back(input);
  }
  std::printf("%ld executions, %ld accepted, no crash\n", executions, accepted);
  return 0;
}

}  // namespace
}  // namespace trainyard::trainer

int main(int argc, char** argv) { return trainyard::trainer::Main(argc, argv); }
