// Token files without LibTorch (worker/trainer/io/data.h): uint32 tokens, as a Hugging Face
// tokenizer's ids beyond 65,536 need, and files that are not whole tokens. (uint16 and bytes are
// covered in trainer_unit_test.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "tests/testing/subprocess.h"
#include "worker/trainer/io/data.h"

namespace trainyard::trainer {
namespace {

using ::testing::HasSubstr;

std::string WriteTokens(const testing::TempDir& dir, const std::vector<uint32_t>& tokens,
                        size_t extra_bytes = 0) {
  const std::string path = dir.path() + "/tokens.bin";
  std::ofstream f(path, std::ios::binary);
  for (uint32_t t : tokens) {
    const char le[4] = {static_cast<char>(t & 0xff), static_cast<char>((t >> 8) & 0xff),
                        static_cast<char>((t >> 16) & 0xff), static_cast<char>(t >> 24)};
    f.write(le, 4);
  }
  f << std::string(extra_bytes, '\0');
  return path;
}

TEST(TokenDataTest, Uint32TokensAreReadLittleEndianAndCheckedAgainstTheVocabulary) {
  testing::TempDir dir;
  const std::string path = WriteTokens(dir, {0, 70000, 128255, 5});
  auto ok = TokenData::Load(path, "uint32", 128256);  // Llama 3's vocabulary
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tokens(), (std::vector<int32_t>{0, 70000, 128255, 5}));
  auto bad = TokenData::Load(path, "uint32", 128255);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("token 128255 at index 2 of '" + path + "' is >= model.vocab (128255)"));
  auto huge = TokenData::Load(WriteTokens(dir, {4000000000u}), "uint32", 1 << 30);
  ASSERT_FALSE(huge.ok());
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("token 4000000000 at index 0"));
}

TEST(TokenDataTest, AFileThatIsNotWholeTokensIsRefused) {
  testing::TempDir dir;
  const std::string path = WriteTokens(dir, {1, 2}, 2);
  auto bad = TokenData::Load(path, "uint32", 100);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("has 10 bytes, not a whole number of uint32 tokens"));
  EXPECT_TRUE(TokenData::Load(path, "uint16", 100).ok()) << "10 bytes are 5 uint16 tokens";
  auto unknown = TokenData::Load(path, "int8", 100);
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("(bytes, uint16 or uint32)"));
}

// data.loss_mask: one 0/1 byte per token, and the targets a batch counts.
TEST(TokenDataTest, ALossMaskIsOneZeroOrOneBytePerTokenAndCountsTargets) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/mask.bin";
  // 9 tokens: windows of seq_len 4 start at 0 and 4 (targets 1..4 and 5..8).
  std::ofstream(path, std::ios::binary) << std::string("\0\0\1\1\0\1\0\0\1", 9);
  auto mask = LoadLossMask(path, 9);
  ASSERT_TRUE(mask.ok()) << mask.status();
  EXPECT_EQ(CountedTargets(*mask, {0}, 4, false), 2);  // tokens 2, 3 (4 is 0)
  EXPECT_EQ(CountedTargets(*mask, {1}, 4, false), 2);  // tokens 5 and 8
  EXPECT_EQ(CountedTargets(*mask, {0, 1, 1}, 4, false), 6);
  EXPECT_EQ(CountedTargets(*mask, {0, 1}, 4, /*last_only=*/true), 1);  // token 4: 0, token 8: 1
  // Weight j of a window is the mask of the token position j predicts (token j + 1).
  EXPECT_EQ(TargetWeights(*mask, {1, 0}, 4), (std::vector<float>{1, 0, 0, 1, /**/ 0, 1, 1, 0}));

  auto short_mask = LoadLossMask(path, 10);
  ASSERT_FALSE(short_mask.ok());
  EXPECT_THAT(std::string(short_mask.status().message()),
              HasSubstr("data.loss_mask: '" + path +
                        "' has 9 bytes; it needs one per token of "
                        "data.path (10)"));
  std::ofstream(path, std::ios::binary) << std::string("\0\1\2", 3);
  auto two = LoadLossMask(path, 3);
  ASSERT_FALSE(two.ok());
  EXPECT_THAT(std::string(two.status().message()), HasSubstr("byte 2 is 2; only 0 and 1"));
  EXPECT_EQ(LoadLossMask(dir.path() + "/none", 3).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace trainyard::trainer
