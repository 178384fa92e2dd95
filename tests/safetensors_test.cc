// The project's own safetensors reader and writer (worker/trainer/io/safetensors.h): a round trip,
// a file written byte for byte as the format's specification shows, and every kind of bad file
// refused with the file's and the tensor's names. The header parser's fuzz test is
// safetensors_fuzz_test.
#include "worker/trainer/io/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "tests/testing/safetensors_bytes.h"
#include "tests/testing/subprocess.h"

namespace trainyard::trainer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::WithSafetensorsLength;

std::string Floats(const std::vector<float>& v) {
  std::string out(v.size() * 4, '\0');
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::string ErrorOf(const std::string& file) {
  auto header = ParseSafetensorsHeader(file, file.size(), "model.safetensors");
  EXPECT_FALSE(header.ok());
  EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(header.status().message());
}

TEST(SafetensorsTest, WhatItWritesItReadsBackThroughAMapping) {
  testing::TempDir dir;
  std::vector<SafetensorsEntry> entries = {
      {"model.norm.weight", SafetensorsDtype::kF32, {3}, Floats({1, 2, 3})},
      {"lm_head.weight",
       SafetensorsDtype::kBF16,
       {2, 2},
       std::string("\x80\x3f\x00\x40\x40\x40\x80\x40", 8)},
      {"step", SafetensorsDtype::kI64, {}, std::string("\x07\0\0\0\0\0\0\0", 8)},
  };
  auto bytes = SerializeSafetensors(entries, {{"format", "pt"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const uint64_t header_len = static_cast<uint8_t>((*bytes)[0]);
  EXPECT_EQ((8 + header_len) % 8, 0u) << "the header is padded to 8 bytes";
  const std::string path = dir.path() + "/model.safetensors";
  std::ofstream(path, std::ios::binary) << *bytes;

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsHeader& h = (*file)->header();
  EXPECT_EQ(h.metadata.at("format"), "pt");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "lm_head.weight");  // by name
  const SafetensorsTensor* norm = h.Find("model.norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->dtype, SafetensorsDtype::kF32);
  EXPECT_THAT(norm->shape, ElementsAre(3));
  auto data = (*file)->Bytes(*norm);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(data.data()), data.size()),
            Floats({1, 2, 3}));
  const SafetensorsTensor* step = h.Find("step");
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->numel(), 1) << "a scalar";
  EXPECT_EQ(h.Find("missing"), nullptr);

  EXPECT_EQ(SafetensorsFile::Open(dir.path() + "/nope").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, ReadsAFileLaidOutAsTheSpecificationShows) {
  // Keys in any order, offsets relative to the end of the header, little-endian data.
  const std::string header =
      R"({"b":{"shape":[1,2],"data_offsets":[8,16],"dtype":"F32"},)"
      R"("a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]},"__metadata__":{"k":"v"}})";
  const std::string file =
      WithSafetensorsLength(header) + std::string(8, '\x11') + Floats({0.5f, -2});
  auto h = ParseSafetensorsHeader(file, file.size(), "x.safetensors");
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->data_start, 8 + header.size());
  EXPECT_EQ(h->tensors[0].begin, h->data_start);
  EXPECT_EQ(h->tensors[1].begin, h->data_start + 8);
  EXPECT_EQ(h->tensors[1].end, file.size());
}

TEST(SafetensorsTest, BadFilesAreRefusedNamingTheFileAndTheTensor) {
  const std::string ok_data = std::string(8, '\0');
  auto with = [&](const std::string& tensors) {
    return WithSafetensorsLength("{" + tensors + "}") + ok_data;
  };
  EXPECT_THAT(ErrorOf("abc"), HasSubstr("model.safetensors: shorter than the 8-byte header"));
  EXPECT_THAT(ErrorOf(WithSafetensorsLength(std::string(40, ' ')).substr(0, 20)),
              HasSubstr("the header claims 40 bytes but the file has 12"));
  EXPECT_THAT(ErrorOf(WithSafetensorsLength("not json")), HasSubstr("not a JSON object"));
  EXPECT_THAT(ErrorOf(WithSafetensorsLength("[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]")),
              HasSubstr("nests JSON deeper"));
  EXPECT_THAT(ErrorOf(with(R"("w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]})")),
              HasSubstr("tensor w: unknown dtype \"F33\""));
  EXPECT_THAT(ErrorOf(with(R"("w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]})")),
              HasSubstr("tensor w: data_offsets [0, 8] hold 8 bytes but dtype F32 and shape [3] "
                        "need 12"));
  EXPECT_THAT(ErrorOf(with(R"("w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]})")),
              HasSubstr("tensor w: data_offsets [0, 16] lie outside the 8 bytes of data"));
  EXPECT_THAT(ErrorOf(with(R"("w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]})")),
              HasSubstr("tensor w: a shape entry is not a count"));
  EXPECT_THAT(
      ErrorOf(with(R"("w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,8]})")),
      HasSubstr("tensor w: shape overflows"));
  EXPECT_THAT(ErrorOf(with(R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]})")),
              HasSubstr("tensor w: data_offsets [8, 0] lie outside"));
  EXPECT_THAT(ErrorOf(with(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})")),
              HasSubstr("tensor b: data_offsets [4, 8] overlap another tensor's"));
  EXPECT_THAT(ErrorOf(with(R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})")),
              HasSubstr("bytes [0, 4) of the data belong to no tensor (before a)"));
  EXPECT_THAT(ErrorOf(with(R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})")),
              HasSubstr("the data has 8 bytes but its tensors end at 4: trailing bytes"));
  EXPECT_THAT(ErrorOf(with(R"("w":{"dtype":"F32","data_offsets":[0,8]})")),
              HasSubstr("tensor w: no shape array"));
  EXPECT_THAT(ErrorOf(with(R"("__metadata__":{"k":1})")), HasSubstr("__metadata__.k is not"));
}

TEST(SafetensorsTest, AnIndexMapsTensorsToFilesInItsFolderOnly) {
  auto index = ParseSafetensorsIndex(
      R"({"metadata":{"total_size":16},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
      R"("b":"model-00002-of-00002.safetensors"}})",
      "model.safetensors.index.json");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->at("b"), "model-00002-of-00002.safetensors");
  auto escape = ParseSafetensorsIndex(R"({"weight_map":{"a":"../../etc/passwd"}})", "i.json");
  ASSERT_FALSE(escape.ok());
  EXPECT_THAT(std::string(escape.status().message()),
              HasSubstr("i.json: weight_map.a: \"../../etc/passwd\" is not a file in the index's"));
  EXPECT_FALSE(ParseSafetensorsIndex(R"({"metadata":{}})", "i.json").ok());
}

TEST(SafetensorsTest, TheWriterRefusesEntriesThatDoNotMatchTheirShape) {
  auto bad = SerializeSafetensors({{"w", SafetensorsDtype::kF32, {3}, Floats({1, 2})}}, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("tensor w: 8 bytes for dtype F32 and shape [3] that need 12"));
  EXPECT_FALSE(SerializeSafetensors({{"w", SafetensorsDtype::kF32, {1}, Floats({1})},
                                     {"w", SafetensorsDtype::kF32, {1}, Floats({1})}},
                                    {})
                   .ok());
}

}  // namespace
}  // namespace trainyard::trainer
