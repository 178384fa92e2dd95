#include "common/mfu.h"

#include <algorithm>

#include "absl/strings/ascii.h"

namespace trainyard {
namespace {

struct GpuPeak {
  const char* name;  // a word or words of CUDA's name for it; the first match wins
  double half_tflops, fp32_tflops;
};

// NVIDIA's data sheets, dense (without sparsity), SXM boards unless named: the longer names first
// ("H100 PCIe" before "H100"). A name matches as whole words: "A100" is not "RTX A1000", "A10" not
// "A10G" (AWS's, not in the table), "L4" not "L40".
constexpr GpuPeak kPeaks[] = {
    {"GH200", 989, 67},    {"H200 NVL", 835, 60}, {"H200", 989, 67},      {"H100 PCIe", 756, 51},
    {"H100 NVL", 835, 60}, {"H100", 989, 67},     {"H800 PCIe", 756, 51}, {"H800", 989, 67},
    {"A100", 312, 19.5},   {"A800", 312, 19.5},   {"L40S", 362, 91.6},    {"L40", 181, 90.5},
    {"L4", 121, 30.3},     {"A10", 125, 31.2},    {"V100", 125, 15.7},
};

// Whether `word` occurs in `name` with no letter or digit just before or after it.
bool HasWord(absl::string_view name, absl::string_view word) {
  for (size_t at = name.find(word); at != absl::string_view::npos; at = name.find(word, at + 1)) {
    const size_t end = at + word.size();
    if ((at == 0 || !absl::ascii_isalnum(name[at - 1])) &&
        (end == name.size() || !absl::ascii_isalnum(name[end]))) {
      return true;
    }
  }
  return false;
}

}  // namespace

double ModelFlopsPerToken(int64_t parameters, int64_t layers, int64_t d_model, int64_t seq_len,
                          int64_t frozen) {
  const double fixed = static_cast<double>(std::clamp<int64_t>(frozen, 0, parameters));
  return 6.0 * (static_cast<double>(parameters) - fixed) + 4.0 * fixed +
         12.0 * static_cast<double>(layers) * static_cast<double>(d_model) *
             static_cast<double>(seq_len);
}

double PeakFlops(absl::string_view gpu_name, bool half, double override_tflops) {
  if (override_tflops > 0) return override_tflops * 1e12;
  for (const GpuPeak& p : kPeaks) {
    if (HasWord(gpu_name, p.name)) return (half ? p.half_tflops : p.fp32_tflops) * 1e12;
  }
  return 0;
}

double Mfu(double tokens_per_second, double flops_per_token, double peak_flops, int devices) {
  if (peak_flops <= 0 || devices <= 0) return 0;
  return tokens_per_second * flops_per_token / (peak_flops * devices);
}

}  // namespace trainyard
