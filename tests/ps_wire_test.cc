// The parameter server's hand-written wire code (rpc/ps/ps_wire.h) against protobuf's generated
// classes, with messages cut into slices anywhere; and AdamW updates reading pushed gradients from
// such pieces (ShardManager), bit for bit those from one contiguous buffer.
#include "rpc/ps/ps_wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/adam/thread_pool.h"
#include "server/ps/shard_manager.h"

namespace trainyard::ps {
namespace {

using ::testing::HasSubstr;

// `bytes` as a byte buffer of slices cut at `cuts` (increasing positions).
grpc::ByteBuffer Cut(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t from = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + from, cut - from);
    from = cut;
  }
  slices.emplace_back(bytes.data() + from, bytes.size() - from);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Flat(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(message.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes;
}

std::string Joined(const ReceivedBytes& data) {
  std::string out;
  for (absl::string_view piece : data.pieces) out.append(piece.data(), piece.size());
  return out;
}

v1::GradientChunk SampleChunk() {
  v1::GradientChunk c;
  c.set_job_id("job-7");
  c.set_attempt(3);
  c.set_step(123456789012);
  c.set_offset(4096);
  c.set_format(v1::WIRE_BF16);
  std::string data(37 * 2, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
  c.set_data(data);
  return c;
}

void ExpectSame(const PushedChunk& got, const v1::GradientChunk& want) {
  EXPECT_EQ(got.job_id, want.job_id());
  EXPECT_EQ(got.attempt, want.attempt());
  EXPECT_EQ(got.step, want.step());
  EXPECT_EQ(got.offset, want.offset());
  EXPECT_EQ(got.format, want.format());
  EXPECT_EQ(Joined(got.data), want.data());
}

TEST(PsWireTest, GradientChunkDecodesLikeProtobufWhereverTheSlicesAreCut) {
  const v1::GradientChunk want = SampleChunk();
  const std::string bytes = want.SerializeAsString();
  for (size_t a = 1; a < bytes.size(); ++a) {
    auto one_cut = DecodeGradientChunk(Cut(bytes, {a}));
    ASSERT_TRUE(one_cut.ok()) << one_cut.status() << " cut at " << a;
    ExpectSame(*one_cut, want);
    const size_t b = std::min(bytes.size() - 1, a + 3);
    if (b <= a) continue;
    auto two_cuts = DecodeGradientChunk(Cut(bytes, {a, b}));
    ASSERT_TRUE(two_cuts.ok()) << two_cuts.status() << " cuts at " << a << ", " << b;
    ExpectSame(*two_cuts, want);
  }
}

TEST(PsWireTest, DecodedDataPointsIntoTheReceivedSlicesAndKeepsThemAlive) {
  const std::string bytes = SampleChunk().SerializeAsString();
  PushedChunk chunk;
  {
    // 60 bytes: a refcounted slice (gRPC copies slices of up to 23 bytes by value).
    grpc::ByteBuffer message = Cut(bytes, {bytes.size() - 60});
    auto decoded = DecodeGradientChunk(message);
    ASSERT_TRUE(decoded.ok());
    chunk = *std::move(decoded);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(message.Dump(&slices).ok());
    ASSERT_EQ(chunk.data.pieces.size(), 2u);
    // Views into the buffer's own slices, not copies.
    EXPECT_EQ(chunk.data.pieces[1].data(), reinterpret_cast<const char*>(slices[1].begin()));
  }  // the message is gone; the chunk's owner keeps the slices
  EXPECT_EQ(Joined(chunk.data), SampleChunk().data());
}

TEST(PsWireTest, FieldsInAnyOrderRepeatedAndUnknownAreReadAsProtobufReadsThem) {
  v1::GradientChunk first = SampleChunk();
  v1::GradientChunk second;
  second.set_step(5);
  second.set_data(std::string(8, 'x'));
  // Protobuf merges concatenated messages: the last scalar and the last bytes field count.
  std::string bytes = first.SerializeAsString() + second.SerializeAsString();
  // Unknown fields of every wire type: 9 varint, 10 fixed64, 11 length-delimited, 12 fixed32.
  bytes += std::string("\x48\x96\x01", 3) + std::string("\x51", 1) + std::string(8, '\x01') +
           std::string(
               "\x5a\x03"
               "abc",
               5) +
           std::string("\x65", 1) + std::string(4, '\x02');
  v1::GradientChunk want;
  ASSERT_TRUE(want.ParseFromString(bytes));
  auto got = DecodeGradientChunk(Cut(bytes, {7, 30}));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSame(*got, want);
  EXPECT_EQ(got->step, 5);
  EXPECT_EQ(Joined(got->data), std::string(8, 'x'));
}

TEST(PsWireTest, MalformedGradientChunksGetErrorsNamingTheField) {
  const std::string good = SampleChunk().SerializeAsString();
  const struct {
    std::string bytes;
    const char* error;
  } cases[] = {
      {good.substr(0, good.size() - 5), "GradientChunk.data: truncated"},  // cut inside the data
      {std::string("\x18\xff\xff", 3), "GradientChunk.step: truncated varint"},
      {std::string("\x1a\x01\x00", 3), "GradientChunk.step: wrong wire type"},  // as bytes
      {std::string("\x28\x07", 2), "GradientChunk.format: unknown wire format 7"},
      {std::string("\x4b\x4c", 2), "unsupported wire type"},  // a group of an unknown field
      {std::string("\x00\x01", 2), "field number 0"},
  };
  for (const auto& c : cases) {
    const absl::Status s = DecodeGradientChunk(Cut(c.bytes, {c.bytes.size() / 2})).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.error;
    EXPECT_THAT(s.message(), HasSubstr(c.error));
  }
}

TEST(PsWireTest, EncodedGradientChunkIsWhatProtobufSerializes) {
  const v1::GradientChunk want = SampleChunk();
  v1::GradientChunk header = want;
  header.clear_data();
  grpc::ByteBuffer message = EncodeGradientChunk(header, want.data().data(), want.data().size());
  EXPECT_EQ(Flat(message), want.SerializeAsString());
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(message.Dump(&slices).ok());
  // The data slice is the caller's memory, not a copy.
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), want.data().data());
}

TEST(PsWireTest, ParameterChunkRoundTripsThroughProtobufAndIntoPlace) {
  std::string data(12, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(100 + i);
  const std::string bytes =
      Flat(EncodeParameterChunk(1002, v1::WIRE_FP32, grpc::Slice(data.data(), data.size())));
  v1::ParameterChunk parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  EXPECT_EQ(parsed.offset(), 1002);
  EXPECT_EQ(parsed.format(), v1::WIRE_FP32);
  EXPECT_EQ(parsed.data(), data);

  // Decoded into [1000, 1010) of fp32 from slices cut anywhere: elements 2..4 of `out`.
  for (size_t cut = 1; cut < bytes.size(); ++cut) {
    std::vector<float> out(10, -1.0f);
    int64_t received = 0;
    ASSERT_TRUE(DecodeParameterChunkInto(Cut(bytes, {cut}), v1::WIRE_FP32, 1000, 1010, out.data(),
                                         &received)
                    .ok());
    EXPECT_EQ(received, 3);
    EXPECT_EQ(std::memcmp(&out[2], data.data(), 12), 0);
    EXPECT_EQ(out[1], -1.0f);
    EXPECT_EQ(out[5], -1.0f);
  }
}

TEST(PsWireTest, ParameterChunksOutsideTheRangeOrInAnotherFormatAreRefusedUnwritten) {
  const std::string data(12, '\x11');
  std::vector<float> out(4, -1.0f);
  int64_t received = 0;
  const auto decode = [&](int64_t offset, v1::WireFormat sent, v1::WireFormat asked) {
    return DecodeParameterChunkInto(
        EncodeParameterChunk(offset, sent, grpc::Slice(data.data(), data.size())), asked, 0, 4,
        out.data(), &received);
  };
  absl::Status s = decode(2, v1::WIRE_FP32, v1::WIRE_FP32);  // [2, 5) past 4
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("inside [0, 4)"));
  s = decode(0, v1::WIRE_BF16, v1::WIRE_FP32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  s = decode(0, v1::WIRE_FP32, v1::WIRE_BF16);  // 12 bytes = 6 bf16 > 4
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(received, 0);
  EXPECT_THAT(out, ::testing::Each(-1.0f));
  // UNSPECIFIED means fp32.
  EXPECT_TRUE(decode(1, v1::WIRE_FORMAT_UNSPECIFIED, v1::WIRE_FP32).ok());
  EXPECT_EQ(received, 3);
}

// ---- AdamW on gradients in pieces. ----

v1::InitShardChunk::Header ShardHeader(int64_t n) {
  v1::InitShardChunk::Header h;
  h.set_job_id("job-1");
  h.set_attempt(1);
  h.set_begin(0);
  h.set_end(n);
  h.set_total_params(n);
  h.mutable_adamw()->set_beta1(0.9f);
  h.mutable_adamw()->set_beta2(0.999f);
  h.mutable_adamw()->set_eps(1e-8f);
  h.mutable_adamw()->set_weight_decay(0.01f);
  return h;
}

// `bytes` cut into pieces of 1, 2, 3, ... bytes, cycling (most cut inside an element).
ReceivedBytes Pieces(const std::string& bytes, size_t longest) {
  auto owned = std::make_shared<const std::string>(bytes);
  ReceivedBytes r;
  r.owner = owned;
  size_t len = 1;
  for (size_t at = 0; at < owned->size(); at += len, len = len % longest + 1) {
    r.pieces.emplace_back(owned->data() + at, std::min(len, owned->size() - at));
  }
  return r;
}

TEST(PsWireTest, UpdatesFromGradientsInPiecesMatchContiguousOnesBitForBit) {
  constexpr int64_t kN = 70000;  // more than one parallel chunk
  adam::ThreadPool pool(2);
  ShardManager contiguous(int64_t{1} << 30, pool), pieces(int64_t{1} << 30, pool);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> init(kN);
  for (float& x : init) x = normal(rng);
  const std::string init_bytes(reinterpret_cast<const char*>(init.data()), kN * 4);
  for (ShardManager* m : {&contiguous, &pieces}) {
    ASSERT_TRUE(m->BeginInit(ShardHeader(kN)).ok());
    ASSERT_TRUE(m->InitChunk("job-1", 1, 0, init_bytes, "", "").ok());
    ASSERT_TRUE(m->FinishInit("job-1", 1).ok());
  }
  for (int64_t step = 1; step <= 3; ++step) {
    // Two chunks per step: fp32 for [0, 40000), bf16 for [40000, kN) (odd steps) or fp32.
    std::vector<float> g(kN);
    for (float& x : g) x = normal(rng);
    const std::string fp32(reinterpret_cast<const char*>(g.data()), kN * 4);
    std::string bf16;
    for (int64_t i = 40000; i < kN; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &g[i], 4);
      const uint16_t half = static_cast<uint16_t>(bits >> 16);
      bf16.append(reinterpret_cast<const char*>(&half), 2);
    }
    const v1::WireFormat tail_format = step % 2 == 1 ? v1::WIRE_BF16 : v1::WIRE_FP32;
    const std::string head = fp32.substr(0, 40000 * 4);
    const std::string tail = step % 2 == 1 ? bf16 : fp32.substr(40000 * 4);
    ASSERT_TRUE(contiguous.Push("job-1", 1, step, 0, v1::WIRE_FP32, ReceivedBytes::Own(head)).ok());
    ASSERT_TRUE(
        contiguous.Push("job-1", 1, step, 40000, tail_format, ReceivedBytes::Own(tail)).ok());
    ASSERT_TRUE(pieces.Push("job-1", 1, step, 0, v1::WIRE_FP32, Pieces(head, 11)).ok());
    ASSERT_TRUE(pieces.Push("job-1", 1, step, 40000, tail_format, Pieces(tail, 7)).ok());
    for (ShardManager* m : {&contiguous, &pieces}) {
      ASSERT_TRUE(m->Update("job-1", 1, step, 0, kN, 1e-3f, 0.5f).ok());
    }
    for (v1::WireFormat format : {v1::WIRE_FP32, v1::WIRE_BF16}) {
      std::string a(kN * WireElementBytes(format), '\0'), b = a;
      ASSERT_TRUE(
          contiguous.ReadParams("job-1", 1, step, 0, kN, format, absl::ZeroDuration(), a.data())
              .ok());
      ASSERT_TRUE(
          pieces.ReadParams("job-1", 1, step, 0, kN, format, absl::ZeroDuration(), b.data()).ok());
      EXPECT_EQ(a, b) << "step " << step << " format " << format;
      EXPECT_NE(a.substr(0, 400), std::string(400, '\0'));
    }
  }
  // The update moved the parameters.
  std::vector<float> after(kN);
  ASSERT_TRUE(pieces
                  .ReadParams("job-1", 1, 3, 0, kN, v1::WIRE_FP32, absl::ZeroDuration(),
                              reinterpret_cast<char*>(after.data()))
                  .ok());
  EXPECT_NE(std::memcmp(after.data(), init.data(), kN * 4), 0);
}

}  // namespace
}  // namespace trainyard::ps
