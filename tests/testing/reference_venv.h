// The Python reference implementations tests compare with: scripts in tests/ run by the virtual
// environment scripts/setup.sh creates at build/hf-venv (transformers, PEFT, lion-pytorch and
// bitsandbytes from PyPI over Debian's python3-torch), and the safetensors files they write.
#ifndef TRAINYARD_TESTS_TESTING_REFERENCE_VENV_H_
#define TRAINYARD_TESTS_TESTING_REFERENCE_VENV_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tests/testing/subprocess.h"
#include "worker/trainer/io/safetensors.h"

namespace trainyard::testing {

inline std::string VenvPython() { return TestBinPath("../hf-venv/bin/python"); }

// Runs tests/<script> with `args`; fails the test with its output when it fails.
inline void RunReferenceScript(const std::string& script, const std::vector<std::string>& args) {
  ASSERT_TRUE(std::filesystem::exists(VenvPython()))
      << VenvPython() << " is missing: scripts/setup.sh creates it (transformers from PyPI)";
  std::vector<std::string> argv = {VenvPython(),
                                   std::string(TRAINYARD_SOURCE_DIR) + "/tests/" + script};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = RunCommand(
      argv, {"HF_HUB_DISABLE_PROGRESS_BARS=1", "TRANSFORMERS_VERBOSITY=error", "HF_HUB_OFFLINE=1"},
      absl::Seconds(240));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
}

// Every tensor of a safetensors file (F32, F64, I64 or U8), as torch tensors (copies).
inline std::map<std::string, torch::Tensor> ReadSafetensorsTensors(const std::string& path) {
  using trainer::SafetensorsDtype;
  auto file = trainer::SafetensorsFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  std::map<std::string, torch::Tensor> out;
  if (!file.ok()) return out;
  for (const trainer::SafetensorsTensor& t : (*file)->header().tensors) {
    const torch::ScalarType type = t.dtype == SafetensorsDtype::kI64   ? torch::kLong
                                   : t.dtype == SafetensorsDtype::kU8  ? torch::kUInt8
                                   : t.dtype == SafetensorsDtype::kF64 ? torch::kDouble
                                                                       : torch::kFloat;
    EXPECT_TRUE(t.dtype == SafetensorsDtype::kI64 || t.dtype == SafetensorsDtype::kF32 ||
                t.dtype == SafetensorsDtype::kU8 || t.dtype == SafetensorsDtype::kF64)
        << t.name;
    auto bytes = (*file)->Bytes(t);
    out[t.name] = torch::from_blob(const_cast<uint8_t*>(bytes.data()), t.shape, type).clone();
  }
  return out;
}

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_REFERENCE_VENV_H_
