// trainyard-ps's ParameterServerService over real gRPC on loopback (an in-process PsServer with
// no coordinator): the step protocol (push, update-and-pull, reads), its idempotence, every
// bad-input path with the shard left unchanged, and the AdamW results against a double-precision
// reference. Each PsServiceTest runs twice: pushes and pulls over the gRPC calls, and over the
// server's TCP data plane (DataPlaneClient), which must behave the same. Also the pure pieces:
// StepIntervals and the coordinator's range placement.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "kernels/adam/thread_pool.h"
#include "rpc/ps/data_plane_client.h"
#include "server/coordinator/ps_placement.h"
#include "server/ps/ps_server.h"
#include "server/ps/shard_manager.h"
#include "server/ps/step_intervals.h"
#include "tests/testing/ps_shard.h"
#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard {
namespace {

using ::testing::HasSubstr;

using testing::Bytes;
using testing::Floats;
using testing::kBeta1;
using testing::kBeta2;
using testing::kEps;
using testing::kWeightDecay;
using testing::ShardHeader;

// torch.optim.AdamW's update of one element, in double.
struct RefAdamW {
  std::vector<double> p, m, v;
  void Step(const std::vector<float>& g, int64_t step, double lr, double scale) {
    const double bc1 = 1 - std::pow(double{kBeta1}, step), bc2 = 1 - std::pow(double{kBeta2}, step);
    for (size_t i = 0; i < p.size(); ++i) {
      const double gi = double{g[i]} * scale;
      p[i] *= 1 - lr * kWeightDecay;
      m[i] = kBeta1 * m[i] + (1 - kBeta1) * gi;
      v[i] = kBeta2 * v[i] + (1 - kBeta2) * gi * gi;
      p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + kEps);
    }
  }
};

// How PsServiceTest pushes and pulls.
enum class Transport { kGrpc, kDataPlane };

std::string TransportName(const ::testing::TestParamInfo<Transport>& info) {
  return info.param == Transport::kGrpc ? "Grpc" : "DataPlane";
}

// bf16 bit patterns widened to the floats they stand for.
std::vector<float> WidenBf16(const char* data, size_t bytes) {
  std::vector<float> out;
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    uint16_t hi;
    std::memcpy(&hi, data + i, 2);
    const uint32_t bits = uint32_t{hi} << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    out.push_back(f);
  }
  return out;
}

class PsServiceTest : public ::testing::TestWithParam<Transport> {
 protected:
  static constexpr int64_t kTotal = 10000;
  // The server holds [kBegin, kEnd) of a kTotal-parameter job.
  static constexpr int64_t kBegin = 1000, kEnd = 7001;

  void SetUp() override {
    ps::PsOptions o;
    o.listen_address = "127.0.0.1:0";
    o.capacity_bytes = 1 << 20;  // room for ~58k parameters
    o.threads = 2;
    auto s = ps::PsServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    stub_ = testing::PsStub(server_->address());
    ASSERT_FALSE(server_->data_plane_address().empty());
    data_plane_ = std::make_unique<ps::DataPlaneClient>(server_->data_plane_address(), "");
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0, 1);
    init_.resize(kTotal);
    for (float& x : init_) x = normal(rng);
    ref_.p.assign(init_.begin() + kBegin, init_.begin() + kEnd);
    ref_.m.assign(kEnd - kBegin, 0);
    ref_.v.assign(kEnd - kBegin, 0);
  }

  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  static v1::InitShardChunk::Header Header(const std::string& job, int attempt) {
    return ShardHeader(job, attempt, kBegin, kEnd, kTotal);
  }

  // Sends the header, then `chunks` of the initial weights in order.
  grpc::Status Init(const v1::InitShardChunk::Header& h, int64_t chunk = 1500) {
    grpc::ClientContext ctx;
    v1::InitShardResponse r;
    auto w = stub_->InitShard(&ctx, &r);
    v1::InitShardChunk c;
    *c.mutable_header() = h;
    w->Write(c);
    // Headers the server must refuse may name ranges beyond the test's weights: no chunks then.
    const int64_t end = std::min<int64_t>(h.end(), init_.size());
    for (int64_t a = h.begin(); a < end; a += chunk) {
      c.Clear();
      c.set_offset(a);
      c.set_params(Bytes(init_, a, std::min(end, a + chunk)));
      if (!w->Write(c)) break;
    }
    w->WritesDone();
    return w->Finish();
  }

  // Pushes the gradients of [a, b) (grads[0] is element kBegin's) in one chunk.
  grpc::Status Push(const std::string& job, int attempt, int64_t step, int64_t a, int64_t b,
                    const std::vector<float>& grads, v1::PushGradientsResponse* r = nullptr,
                    v1::WireFormat format = v1::WIRE_FP32) {
    v1::PushGradientsResponse local;
    if (r == nullptr) r = &local;
    v1::GradientChunk c;
    c.set_job_id(job);
    c.set_attempt(attempt);
    c.set_step(step);
    c.set_offset(a);
    c.set_format(format);
    if (format == v1::WIRE_BF16) {
      std::string data;
      for (int64_t i = a; i < b; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &grads[i - kBegin], 4);
        const uint16_t hi = static_cast<uint16_t>(bits >> 16);  // exact: the test's grads are bf16
        data.append(reinterpret_cast<const char*>(&hi), 2);
      }
      c.set_data(data);
    } else {
      c.set_data(std::string(reinterpret_cast<const char*>(&grads[a - kBegin]), (b - a) * 4));
    }
    if (GetParam() == Transport::kDataPlane) {
      return ToGrpcStatus(
          data_plane_->Push(c, c.data().data(), a, b, /*chunk_elements=*/0, absl::Seconds(30), r));
    }
    grpc::ClientContext ctx;
    auto w = stub_->PushGradients(&ctx, r);
    w->Write(c);
    w->WritesDone();
    return w->Finish();
  }

  // UpdateAndPull; the pulled fp32 values (or bf16 bit patterns widened) in `out`.
  grpc::Status UpdateAndPull(const std::string& job, int attempt, int64_t step, int64_t a,
                             int64_t b, std::optional<float> lr, std::vector<float>* out,
                             v1::WireFormat format = v1::WIRE_FP32, int64_t wait_ms = 0) {
    grpc::ClientContext ctx;
    v1::UpdateAndPullRequest r;
    r.set_job_id(job);
    r.set_attempt(attempt);
    r.set_step(step);
    r.set_begin(a);
    r.set_end(b);
    r.set_format(format);
    r.set_chunk_elements(1000);
    r.set_wait_ms(wait_ms);
    if (lr) {
      r.mutable_update()->set_lr(*lr);
      r.mutable_update()->set_grad_scale(0.5f);
    }
    if (out) out->clear();
    if (GetParam() == Transport::kDataPlane) {
      std::string data((b - a) * (format == v1::WIRE_BF16 ? 2 : 4), '\0');
      const absl::Status status = data_plane_->UpdateAndPull(
          r, data.data(), absl::Seconds(30) + absl::Milliseconds(wait_ms));
      if (status.ok() && out) {
        *out = format == v1::WIRE_BF16 ? WidenBf16(data.data(), data.size()) : Floats(data);
      }
      return ToGrpcStatus(status);
    }
    auto reader = stub_->UpdateAndPull(&ctx, r);
    v1::ParameterChunk c;
    while (reader->Read(&c)) {
      if (!out) continue;
      if (c.format() == v1::WIRE_BF16) {
        auto f = WidenBf16(c.data().data(), c.data().size());
        out->insert(out->end(), f.begin(), f.end());
      } else {
        auto f = Floats(c.data());
        out->insert(out->end(), f.begin(), f.end());
      }
    }
    return reader->Finish();
  }

  std::vector<float> Gradients(int seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> g(kEnd - kBegin);
    for (float& x : g) {
      // Values exactly representable in bf16, so fp32 and bf16 pushes carry the same numbers.
      uint32_t bits;
      const float f = normal(rng);
      std::memcpy(&bits, &f, 4);
      bits &= 0xffff0000u;
      std::memcpy(&x, &bits, 4);
    }
    return g;
  }

  // max |got - want| / max(|want|, 1): relative for weights of magnitude 1 and more, absolute
  // below, where fp32 rounding of values near zero would make a relative measure meaningless.
  static double MaxRelativeError(const std::vector<float>& got, const std::vector<double>& want,
                                 size_t offset = 0) {
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double w = want[offset + i];
      worst = std::max(worst, std::abs(got[i] - w) / std::max(std::abs(w), 1.0));
    }
    return worst;
  }

  std::unique_ptr<ps::PsServer> server_;
  std::unique_ptr<v1::ParameterServerService::Stub> stub_;
  std::unique_ptr<ps::DataPlaneClient> data_plane_;
  std::vector<float> init_;
  RefAdamW ref_;
};

TEST_P(PsServiceTest, TenStepsFromTwoPushersMatchDoublePrecisionAdamW) {
  ASSERT_TRUE(Init(Header("job-1", 1)).ok());
  const int64_t mid = 4000;  // two "ranks" own [kBegin, mid) and [mid, kEnd)
  for (int64_t step = 1; step <= 10; ++step) {
    const std::vector<float> g = Gradients(static_cast<int>(step));
    const float lr = 1e-2f * step;
    // Rank 1 pushes in two chunks (one in bf16), rank 0 in one.
    ASSERT_TRUE(Push("job-1", 1, step, mid, 5500, g).ok());
    ASSERT_TRUE(Push("job-1", 1, step, 5500, kEnd, g, nullptr, v1::WIRE_BF16).ok());
    ASSERT_TRUE(Push("job-1", 1, step, kBegin, mid, g).ok());
    std::vector<float> lo, hi;
    ASSERT_TRUE(UpdateAndPull("job-1", 1, step, kBegin, mid, lr, &lo).ok());
    ASSERT_TRUE(UpdateAndPull("job-1", 1, step, mid, kEnd, lr, &hi).ok());
    ref_.Step(g, step, lr, 0.5);
    ASSERT_EQ(lo.size(), size_t(mid - kBegin));
    ASSERT_EQ(hi.size(), size_t(kEnd - mid));
    EXPECT_LE(MaxRelativeError(lo, ref_.p, 0), 1e-5) << "step " << step;
    EXPECT_LE(MaxRelativeError(hi, ref_.p, mid - kBegin), 1e-5) << "step " << step;
  }
  // bf16 pulls are the fp32 parameters rounded to nearest even.
  std::vector<float> fp32, bf16;
  ASSERT_TRUE(UpdateAndPull("job-1", 1, 10, kBegin, kEnd, std::nullopt, &fp32).ok());
  ASSERT_TRUE(UpdateAndPull("job-1", 1, 10, kBegin, kEnd, std::nullopt, &bf16, v1::WIRE_BF16).ok());
  ASSERT_EQ(fp32.size(), bf16.size());
  for (size_t i = 0; i < fp32.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &fp32[i], 4);
    const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
    float want;
    std::memcpy(&want, &rounded, 4);
    ASSERT_EQ(bf16[i], want) << i;
  }
}

TEST_P(PsServiceTest, RetriedPushesAndUpdatesChangeNothing) {
  ASSERT_TRUE(Init(Header("job-1", 1)).ok());
  const std::vector<float> g = Gradients(1);
  v1::PushGradientsResponse first, again;
  ASSERT_TRUE(Push("job-1", 1, 1, kBegin, kEnd, g, &first).ok());
  ASSERT_TRUE(Push("job-1", 1, 1, kBegin, kEnd, g, &again).ok());
  EXPECT_EQ(first.elements_staged(), kEnd - kBegin);
  EXPECT_EQ(again.elements_staged(), 0);
  EXPECT_EQ(again.elements_duplicate(), kEnd - kBegin);
  std::vector<float> once, twice;
  ASSERT_TRUE(UpdateAndPull("job-1", 1, 1, kBegin, kEnd, 1e-2f, &once).ok());
  ASSERT_TRUE(UpdateAndPull("job-1", 1, 1, kBegin, kEnd, 1e-2f, &twice).ok());
  EXPECT_EQ(once, twice);
  // A push of step 1 arriving late, after its update: counted as a duplicate, nothing changes.
  v1::PushGradientsResponse late;
  ASSERT_TRUE(Push("job-1", 1, 1, kBegin, kEnd, Gradients(99), &late).ok());
  EXPECT_EQ(late.elements_duplicate(), kEnd - kBegin);
  std::vector<float> after;
  ASSERT_TRUE(UpdateAndPull("job-1", 1, 1, kBegin, kEnd, std::nullopt, &after).ok());
  EXPECT_EQ(after, once);
}

TEST_P(PsServiceTest, APullWaitsForItsStepAndNeverSeesAHalfUpdatedRange) {
  ASSERT_TRUE(Init(Header("job-1", 1)).ok());
  const std::vector<float> g = Gradients(3);
  std::vector<float> pulled;
  grpc::Status pull_status;
  std::thread reader([&] {
    pull_status = UpdateAndPull("job-1", 1, 1, kBegin, kEnd, std::nullopt, &pulled, v1::WIRE_FP32,
                                /*wait_ms=*/30000);
  });
  ASSERT_TRUE(Push("job-1", 1, 1, kBegin, kEnd, g).ok());
  std::vector<float> updated;
  ASSERT_TRUE(UpdateAndPull("job-1", 1, 1, kBegin, kEnd, 1e-2f, &updated).ok());
  reader.join();
  ASSERT_TRUE(pull_status.ok()) << pull_status.error_message();
  EXPECT_EQ(pulled, updated);
  // Without waiting, a step not reached yet is DEADLINE_EXCEEDED; a step already passed is
  // FAILED_PRECONDITION.
  grpc::Status s = UpdateAndPull("job-1", 1, 2, kBegin, kEnd, std::nullopt, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), HasSubstr("did not reach step 2"));
  ASSERT_TRUE(Push("job-1", 1, 2, kBegin, kEnd, g).ok());
  ASSERT_TRUE(UpdateAndPull("job-1", 1, 2, kBegin, kEnd, 1e-2f, nullptr).ok());
  s = UpdateAndPull("job-1", 1, 1, kBegin, kEnd, std::nullopt, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("already at step 2"));
}

TEST_P(PsServiceTest, BadRequestsGetPreciseErrorsAndLeaveTheShardUnchanged) {
  ASSERT_TRUE(Init(Header("job-1", 2)).ok());
  const std::vector<float> g = Gradients(5);
  auto expect = [](const grpc::Status& s, grpc::StatusCode code, const std::string& text) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(text));
  };
  expect(Push("job-9", 2, 1, kBegin, kEnd, g), grpc::StatusCode::NOT_FOUND, "job_id");
  expect(Push("job-1", 1, 1, kBegin, kEnd, g), grpc::StatusCode::FAILED_PRECONDITION,
         "attempt: 1 is not attempt 2");
  expect(Push("job-1", 2, 1, kEnd - 10, kEnd + 10, std::vector<float>(g.size() + 10)),
         grpc::StatusCode::OUT_OF_RANGE, "outside this shard's range");
  expect(Push("job-1", 2, 3, kBegin, kEnd, g), grpc::StatusCode::FAILED_PRECONDITION,
         "gradients of step 3");
  expect(Push("job-1", 2, 1, kBegin, kEnd, g, nullptr, static_cast<v1::WireFormat>(7)),
         grpc::StatusCode::INVALID_ARGUMENT, "format: unknown wire format 7");
  expect(UpdateAndPull("job-1", 2, 1, kBegin, kEnd, 1e-2f, nullptr),
         grpc::StatusCode::FAILED_PRECONDITION, "gradients of 0 of the 6001 elements");
  ASSERT_TRUE(Push("job-1", 2, 1, kBegin, 3000, g).ok());
  expect(Push("job-1", 2, 1, 2000, 4000, g), grpc::StatusCode::INVALID_ARGUMENT,
         "overlaps chunk [1000, 3000)");
  expect(UpdateAndPull("job-1", 2, 1, kBegin, 2000, 1e-2f, nullptr),
         grpc::StatusCode::INVALID_ARGUMENT, "cuts the pushed chunk");
  expect(UpdateAndPull("job-1", 2, 1, kBegin, kEnd, -1.0f, nullptr),
         grpc::StatusCode::INVALID_ARGUMENT, "update.lr");
  // A push whose bytes are not whole values: gRPC only (a data-plane push's size follows from
  // its range; tests/ps_data_plane_test.cc has its malformed requests).
  if (GetParam() == Transport::kGrpc) {
    grpc::ClientContext ctx;
    v1::PushGradientsResponse r;
    auto w = stub_->PushGradients(&ctx, &r);
    v1::GradientChunk c;
    c.set_job_id("job-1");
    c.set_attempt(2);
    c.set_step(1);
    c.set_offset(kBegin);
    c.set_data("abc");
    w->Write(c);
    w->WritesDone();
    expect(w->Finish(), grpc::StatusCode::INVALID_ARGUMENT, "data: 3 bytes");
  }
  // Nothing above changed the weights: they are still the initial ones at step 0.
  std::vector<float> now;
  ASSERT_TRUE(UpdateAndPull("job-1", 2, 0, kBegin, kEnd, std::nullopt, &now).ok());
  EXPECT_EQ(now, std::vector<float>(init_.begin() + kBegin, init_.begin() + kEnd));
  // The pushed half plus the rest make step 1 complete.
  ASSERT_TRUE(Push("job-1", 2, 1, 3000, kEnd, g).ok());
  ASSERT_TRUE(UpdateAndPull("job-1", 2, 1, kBegin, kEnd, 1e-2f, nullptr).ok());
}

TEST_P(PsServiceTest, InitRejectsBadHeadersChunksAndJobsThatDoNotFit) {
  auto h = Header("job-1", 1);
  h.set_end(kTotal + 1);
  grpc::Status s = Init(h);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("header.begin/end"));
  h = Header("job-1", 1);
  h.mutable_adamw()->set_beta1(1.5f);
  s = Init(h);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("header.adamw.beta1"));
  {  // chunks out of order
    grpc::ClientContext ctx;
    v1::InitShardResponse r;
    auto w = stub_->InitShard(&ctx, &r);
    v1::InitShardChunk c;
    *c.mutable_header() = Header("job-2", 1);
    w->Write(c);
    c.Clear();
    c.set_offset(kBegin + 8);
    c.set_params(Bytes(init_, kBegin + 8, kBegin + 16));
    w->Write(c);
    w->WritesDone();
    s = w->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("offset: expected 1000"));
  }
  // A range beyond the server's capacity (1 MiB / 18 bytes).
  h = Header("big", 1);
  h.set_begin(0);
  h.set_end(kTotal * 10);
  h.set_total_params(kTotal * 10);
  s = Init(h);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("bytes"));
  // Nothing failed above stays reserved; a good init works.
  grpc::ClientContext ctx;
  v1::ListShardsResponse list;
  ASSERT_TRUE(stub_->ListShards(&ctx, {}, &list).ok());
  EXPECT_EQ(list.shards_size(), 0);
  EXPECT_EQ(list.reserved_bytes(), 0);
  ASSERT_TRUE(Init(Header("job-1", 1)).ok());
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub_->ListShards(&ctx2, {}, &list).ok());
  EXPECT_EQ(list.reserved_bytes(), (kEnd - kBegin) * kPsBytesPerParam);
}

TEST_P(PsServiceTest, StateReadsBackAndAResumedShardContinuesIdentically) {
  ASSERT_TRUE(Init(Header("job-1", 1)).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_TRUE(Push("job-1", 1, step, kBegin, kEnd, Gradients(step)).ok());
    ASSERT_TRUE(UpdateAndPull("job-1", 1, step, kBegin, kEnd, 1e-2f, nullptr).ok());
  }
  // Read the state at step 3 (as a checkpoint does), then restore it as attempt 2.
  grpc::ClientContext ctx;
  v1::ReadShardStateRequest r;
  r.set_job_id("job-1");
  r.set_attempt(1);
  r.set_step(3);
  r.set_chunk_elements(2500);
  auto reader = stub_->ReadShardState(&ctx, r);
  std::vector<v1::ShardStateChunk> state;
  v1::ShardStateChunk c;
  while (reader->Read(&c)) state.push_back(c);
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(state.size(), 3u);

  // Step 4 on the original.
  std::vector<float> original;
  ASSERT_TRUE(Push("job-1", 1, 4, kBegin, kEnd, Gradients(4)).ok());
  ASSERT_TRUE(UpdateAndPull("job-1", 1, 4, kBegin, kEnd, 1e-2f, &original).ok());

  {
    grpc::ClientContext init_ctx;
    v1::InitShardResponse resp;
    auto w = stub_->InitShard(&init_ctx, &resp);
    v1::InitShardChunk chunk;
    auto h = Header("job-1", 2);
    h.set_step(3);
    h.set_has_optimizer_state(true);
    *chunk.mutable_header() = h;
    w->Write(chunk);
    for (const auto& s : state) {
      chunk.Clear();
      chunk.set_offset(s.offset());
      chunk.set_params(s.params());
      chunk.set_m(s.m());
      chunk.set_v(s.v());
      w->Write(chunk);
    }
    w->WritesDone();
    ASSERT_TRUE(w->Finish().ok());
  }
  // The old attempt is gone; the new one redoes step 4 to the same bits.
  EXPECT_EQ(Push("job-1", 1, 5, kBegin, kEnd, Gradients(5)).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  std::vector<float> resumed;
  ASSERT_TRUE(Push("job-1", 2, 4, kBegin, kEnd, Gradients(4)).ok());
  ASSERT_TRUE(UpdateAndPull("job-1", 2, 4, kBegin, kEnd, 1e-2f, &resumed).ok());
  EXPECT_EQ(resumed, original);
}

INSTANTIATE_TEST_SUITE_P(Transports, PsServiceTest,
                         ::testing::Values(Transport::kGrpc, Transport::kDataPlane), TransportName);

std::string Filled(int64_t n, float value) { return Bytes(std::vector<float>(n, value), 0, n); }

// job-1 attempt 1 holding [0, n) of n parameters, all 1.0, with step 1's gradients (all 0.5)
// pushed.
absl::Status InitAndPushStep1(ps::ShardManager& shards, int64_t n) {
  RETURN_IF_ERROR(shards.BeginInit(ShardHeader("job-1", 1, 0, n, n)));
  RETURN_IF_ERROR(shards.InitChunk("job-1", 1, 0, Filled(n, 1.0f), "", ""));
  RETURN_IF_ERROR(shards.FinishInit("job-1", 1));
  return shards.Push("job-1", 1, 1, 0, v1::WIRE_FP32, ps::ReceivedBytes::Own(Filled(n, 0.5f)))
      .status();
}

// Pulls send parameters from where the shard holds them (LendParams): an update of lent elements
// waits until they are returned, so no pull sends a value of the next step.
TEST(ShardManagerTest, LentParametersHoldBackUpdatesOfTheirElementsAndOutliveADrop) {
  constexpr int64_t kN = 1000;
  adam::ThreadPool pool(1);
  ps::ShardManager shards(1 << 20, pool);
  ASSERT_TRUE(InitAndPushStep1(shards, kN).ok());

  auto lent = shards.LendParams("job-1", 1, 0, 100, 200, v1::WIRE_FP32, absl::ZeroDuration());
  ASSERT_TRUE(lent.ok()) << lent.status();
  ASSERT_EQ((*lent)->bytes(), 400u);
  EXPECT_EQ(std::string((*lent)->data(), 400), Filled(100, 1.0f));
  // An update of a range holding lent elements waits for them; at its deadline it gives up and
  // leaves the shard as it was (the lent values, the range's step, the staged gradients).
  absl::Status s =
      shards.Update("job-1", 1, 1, 0, kN, 1e-2f, 1.0f, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("[0, 1000)"));
  EXPECT_THAT(s.message(), HasSubstr("still sending"));
  EXPECT_EQ(std::string((*lent)->data(), 400), Filled(100, 1.0f));
  std::string params(kN * 4, '\0');
  ASSERT_TRUE(
      shards.ReadParams("job-1", 1, 0, 0, kN, v1::WIRE_FP32, absl::ZeroDuration(), params.data())
          .ok());
  EXPECT_EQ(params, Filled(kN, 1.0f));
  // What is wrong with an update's gradients is reported at once, lent elements or not.
  s = shards.Update("job-1", 1, 1, 0, 500, 1e-2f, 1.0f, absl::InfiniteFuture());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("end: 500 cuts the pushed chunk [0, 1000)"));
  // While an update waits for lent elements, new pulls of its range are refused (it goes first);
  // returning the lent ones lets it go on, with the gradients it was refused with before.
  std::thread update([&] { s = shards.Update("job-1", 1, 1, 0, kN, 1e-2f, 1.0f); });
  for (;;) {  // until the update waits
    auto r = shards.LendParams("job-1", 1, 0, 150, 160, v1::WIRE_FP32, absl::ZeroDuration());
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      EXPECT_THAT(r.status().message(), HasSubstr("[150, 160) is being updated to step 1"));
      break;
    }
    std::this_thread::yield();
  }
  lent->reset();
  update.join();
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(
      shards.ReadParams("job-1", 1, 1, 0, kN, v1::WIRE_FP32, absl::ZeroDuration(), params.data())
          .ok());
  EXPECT_EQ(Floats(params), std::vector<float>(kN, Floats(params)[0]));
  EXPECT_LT(Floats(params)[0], 1.0f);

  // Lent elements hold back only updates that would write them.
  for (int64_t a : {0, 100}) {
    const int64_t b = a == 0 ? 100 : kN;
    ASSERT_TRUE(
        shards.Push("job-1", 1, 2, a, v1::WIRE_FP32, ps::ReceivedBytes::Own(Filled(b - a, 0.5f)))
            .ok());
  }
  lent = shards.LendParams("job-1", 1, 1, 0, 100, v1::WIRE_BF16, absl::ZeroDuration());
  ASSERT_TRUE(lent.ok()) << lent.status();
  EXPECT_EQ((*lent)->bytes(), 200u);
  EXPECT_TRUE(shards.Update("job-1", 1, 2, 100, kN, 1e-2f, 1.0f, absl::Now()).ok());
  EXPECT_EQ(shards.Update("job-1", 1, 2, 0, 100, 1e-2f, 1.0f, absl::Now()).code(),
            absl::StatusCode::kDeadlineExceeded);
  // A dropped job's lent elements stay readable until they are returned, and its memory stays
  // reserved until then.
  const std::string sent((*lent)->data(), 200);
  EXPECT_TRUE(shards.Drop("job-1"));
  EXPECT_EQ(shards.reserved_bytes(), kN * ps::kBytesPerParam);
  EXPECT_EQ(std::string((*lent)->data(), 200), sent);
  lent->reset();
  EXPECT_EQ(shards.reserved_bytes(), 0);
}

// Until an update of a range holding [a, b) waits for lent elements: new pulls of [a, b) at step 0
// are refused then ("being updated"). False if that did not happen within 30 s.
bool WaitUntilUpdatePending(ps::ShardManager& shards, const std::string& job, int64_t a,
                            int64_t b) {
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30); absl::Now() < deadline;) {
    auto r = shards.LendParams(job, 1, 0, a, b, v1::WIRE_FP32, absl::ZeroDuration());
    if (!r.ok()) return absl::StrContains(r.status().message(), "is being updated");
    std::this_thread::yield();
  }
  return false;
}

// A shard dropped (the job cancelled) or replaced (a new attempt's init) ends the calls waiting
// on it at once, FAILED_PRECONDITION naming what happened, instead of leaving them to their
// deadline.
TEST(ShardManagerTest, DroppingOrReplacingAShardEndsTheCallsWaitingOnIt) {
  constexpr int64_t kN = 1000;
  adam::ThreadPool pool(1);
  ps::ShardManager shards(1 << 20, pool);
  for (const bool replace : {false, true}) {
    ASSERT_TRUE(InitAndPushStep1(shards, kN).ok());
    auto lent = shards.LendParams("job-1", 1, 0, 0, 10, v1::WIRE_FP32, absl::ZeroDuration());
    ASSERT_TRUE(lent.ok()) << lent.status();
    absl::Status update;
    std::thread updater([&] { update = shards.Update("job-1", 1, 1, 0, kN, 1e-2f, 1.0f); });
    ASSERT_TRUE(WaitUntilUpdatePending(shards, "job-1", 500, 510));
    if (replace) {
      ASSERT_TRUE(shards.BeginInit(ShardHeader("job-1", 2, 0, kN, kN)).ok());
    } else {
      ASSERT_TRUE(shards.Drop("job-1"));
    }
    updater.join();
    EXPECT_EQ(update.code(), absl::StatusCode::kFailedPrecondition) << update;
    EXPECT_THAT(update.message(), HasSubstr("job-1 attempt 1 was dropped or replaced"));
    lent->reset();
    shards.Drop("job-1");
  }
  EXPECT_EQ(shards.reserved_bytes(), 0);
}

// Close (a stopping server) ends the waits of calls at once with UNAVAILABLE: an update waiting
// for lent elements, a pull waiting for its step, now and later; calls that need no wait go on.
TEST(ShardManagerTest, CloseEndsEveryWaitOfACall) {
  constexpr int64_t kN = 1000;
  adam::ThreadPool pool(1);
  ps::ShardManager shards(1 << 20, pool);
  ASSERT_TRUE(InitAndPushStep1(shards, kN).ok());
  auto lent = shards.LendParams("job-1", 1, 0, 0, 10, v1::WIRE_FP32, absl::ZeroDuration());
  ASSERT_TRUE(lent.ok()) << lent.status();
  absl::Status update;
  std::thread updater([&] { update = shards.Update("job-1", 1, 1, 0, kN, 1e-2f, 1.0f); });
  ASSERT_TRUE(WaitUntilUpdatePending(shards, "job-1", 500, 510));
  shards.Close();
  updater.join();
  EXPECT_EQ(update.code(), absl::StatusCode::kUnavailable) << update;
  EXPECT_THAT(update.message(), HasSubstr("shutting down"));
  // A pull of a step not reached would wait: it ends at once instead.
  std::string params(kN * 4, '\0');
  absl::Status pull =
      shards.ReadParams("job-1", 1, 1, 0, kN, v1::WIRE_FP32, absl::Hours(1), params.data());
  EXPECT_EQ(pull.code(), absl::StatusCode::kUnavailable) << pull;
  // Nothing changed, and what needs no wait still works.
  lent->reset();
  ASSERT_TRUE(
      shards.ReadParams("job-1", 1, 0, 0, kN, v1::WIRE_FP32, absl::Hours(1), params.data()).ok());
  EXPECT_EQ(params, Filled(kN, 1.0f));
}

// The same over gRPC: a pull whose reader stops keeps the chunks gRPC has not sent lent. An
// update of the range meanwhile waits (here past its deadline) or, if it came between two chunks,
// ends the pull with FAILED_PRECONDITION: either way every chunk the pull delivers holds the
// parameters of the step it asked for.
TEST(PsLentPullTest, AStalledPullDeliversItsStepEvenWhenAnUpdateOfItsRangeArrives) {
  constexpr int64_t kN = int64_t{8} << 20;  // 32 MB of fp32: far more than the connection buffers
  constexpr int64_t kChunk = int64_t{1} << 18;
  ps::PsOptions o;
  o.listen_address = "127.0.0.1:0";
  o.capacity_bytes = int64_t{256} << 20;
  o.threads = 2;
  auto server = ps::PsServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);  // the stream window stays small
  auto stub = v1::ParameterServerService::NewStub(
      grpc::CreateCustomChannel((*server)->address(), grpc::InsecureChannelCredentials(), args));

  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> init(kN);
  for (float& x : init) x = normal(rng);
  {
    grpc::ClientContext ctx;
    v1::InitShardResponse r;
    auto w = stub->InitShard(&ctx, &r);
    v1::InitShardChunk c;
    *c.mutable_header() = ShardHeader("job-1", 1, 0, kN, kN);
    ASSERT_TRUE(w->Write(c));
    for (int64_t a = 0; a < kN; a += kChunk * 8) {
      c.Clear();
      c.set_offset(a);
      c.set_params(Bytes(init, a, std::min(kN, a + kChunk * 8)));
      ASSERT_TRUE(w->Write(c));
    }
    w->WritesDone();
    ASSERT_TRUE(w->Finish().ok());
  }
  auto push = [&](int64_t step) {
    grpc::ClientContext ctx;
    v1::PushGradientsResponse r;
    auto w = stub->PushGradients(&ctx, &r);
    for (int64_t a = 0; a < kN; a += kChunk * 8) {
      v1::GradientChunk c;
      c.set_job_id("job-1");
      c.set_attempt(1);
      c.set_step(step);
      c.set_offset(a);
      c.set_data(Bytes(init, a, std::min(kN, a + kChunk * 8)));  // any gradients will do
      EXPECT_TRUE(w->Write(c));
    }
    w->WritesDone();
    return w->Finish();
  };
  auto request = [](int64_t step, bool update) {
    v1::UpdateAndPullRequest r;
    r.set_job_id("job-1");
    r.set_attempt(1);
    r.set_step(step);
    r.set_begin(0);
    r.set_end(kN);
    r.set_chunk_elements(kChunk);
    if (update) r.mutable_update()->set_lr(1e-2f);
    return r;
  };
  // Reads a pull's chunks into `params`; how many elements came.
  auto read = [](grpc::ClientReader<v1::ParameterChunk>* reader, std::vector<float>* params) {
    int64_t n = 0;
    for (v1::ParameterChunk c; reader->Read(&c);) {
      std::memcpy(&(*params)[c.offset()], c.data().data(), c.data().size());
      n += c.data().size() / 4;
    }
    return n;
  };

  ASSERT_TRUE(push(1).ok());
  std::vector<float> step1(kN);
  {
    grpc::ClientContext ctx;
    auto reader = stub->UpdateAndPull(&ctx, request(1, true));
    ASSERT_EQ(read(reader.get(), &step1), kN);
    ASSERT_TRUE(reader->Finish().ok());
  }
  ASSERT_NE(step1, init);
  ASSERT_TRUE(push(2).ok());

  // A pull of step 1 whose reader takes one chunk, then stops while update 2 of the range comes.
  grpc::ClientContext pull_ctx;
  auto pull = stub->UpdateAndPull(&pull_ctx, request(1, false));
  std::vector<float> pulled(kN, std::nanf(""));
  v1::ParameterChunk first;
  ASSERT_TRUE(pull->Read(&first));
  ASSERT_EQ(first.offset(), 0);
  std::memcpy(pulled.data(), first.data().data(), first.data().size());
  grpc::Status update;
  std::vector<float> step2(kN);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    auto reader = stub->UpdateAndPull(&ctx, request(2, true));
    read(reader.get(), &step2);
    update = reader->Finish();
  }
  const int64_t received = first.data().size() / 4 + read(pull.get(), &pulled);
  const grpc::Status pull_status = pull->Finish();
  if (update.ok()) {
    EXPECT_EQ(pull_status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << pull_status.error_message();
  } else {
    EXPECT_EQ(update.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << update.error_message();
    EXPECT_TRUE(pull_status.ok() ||
                pull_status.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
        << pull_status.error_message();
  }
  int64_t wrong = 0;
  for (int64_t i = 0; i < kN; ++i) {
    if (!std::isnan(pulled[i]) && pulled[i] != step1[i]) ++wrong;
  }
  EXPECT_EQ(wrong, 0) << "of " << received << " elements pulled for step 1";
  EXPECT_GE(received, kChunk);

  // Update 2 happens, once.
  {
    grpc::ClientContext ctx;
    auto reader = stub->UpdateAndPull(&ctx, request(2, true));
    ASSERT_EQ(read(reader.get(), &step2), kN);
    ASSERT_TRUE(reader->Finish().ok());
  }
  EXPECT_NE(step2, step1);
  (*server)->Shutdown();
}

TEST(StepIntervalsTest, TracksRunsAndMergesEqualNeighbours) {
  ps::StepIntervals s(10, 100, 0);
  s.Set(20, 30, 1, false);
  s.Set(40, 50, 1, true);
  EXPECT_EQ(s.runs(), 5);
  auto sum = s.Summarize(15, 45);
  EXPECT_EQ(sum.min_step, 0);
  EXPECT_EQ(sum.max_step, 1);
  EXPECT_TRUE(sum.updating);
  sum = s.Summarize(20, 30);
  EXPECT_EQ(sum.min_step, 1);
  EXPECT_FALSE(sum.updating);
  s.Set(40, 50, 1, false);
  s.Set(30, 40, 1, false);
  EXPECT_EQ(s.runs(), 3);  // [10,20) 0, [20,50) 1, [50,100) 0
  s.Set(10, 100, 2, false);
  EXPECT_EQ(s.runs(), 1);
  EXPECT_EQ(s.Summarize(99, 100).min_step, 2);
}

TEST(PsPlacementTest, SplitsEvenlyWhenEveryServerHasRoom) {
  auto r = coordinator::PlaceOnParameterServers(
      1000, 18, {{"a", "a:1", 1 << 20}, {"b", "b:1", 1 << 20}, {"c", "c:1", 1 << 20}});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].begin(), 0);
  EXPECT_EQ((*r)[0].end(), 334);
  EXPECT_EQ((*r)[1].begin(), 334);
  EXPECT_EQ((*r)[2].end(), 1000);
  for (const auto& x : *r) EXPECT_LE(x.end() - x.begin(), 334);
}

TEST(PsPlacementTest, ASmallServerTakesWhatItHoldsAndTheOthersShareTheRest) {
  auto r = coordinator::PlaceOnParameterServers(
      1000, 10, {{"small", "s:1", 1000}, {"big1", "b:1", 100000}, {"big2", "c:1", 100000}});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].end() - (*r)[0].begin(), 100);
  EXPECT_EQ((*r)[1].end() - (*r)[1].begin(), 450);
  EXPECT_EQ((*r)[2].end() - (*r)[2].begin(), 450);
  EXPECT_EQ((*r)[2].end(), 1000);
}

TEST(PsPlacementTest, RandomCapacitiesAlwaysTileTheWholeVector) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<coordinator::PsCapacity> servers;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      servers.push_back({absl::StrCat("s", i), "x:1", static_cast<int64_t>(rng() % 20000)});
    }
    const int64_t total = 1 + rng() % 5000;
    auto r = coordinator::PlaceOnParameterServers(total, 18, servers);
    int64_t capacity = 0;
    for (const auto& s : servers) capacity += s.free_bytes / 18;
    if (capacity < total) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
      continue;
    }
    ASSERT_TRUE(r.ok()) << r.status();
    int64_t next = 0;
    for (const auto& x : *r) {
      EXPECT_EQ(x.begin(), next);
      EXPECT_GT(x.end(), x.begin());
      for (const auto& s : servers) {
        if (s.node_id == x.node_id()) {
          EXPECT_LE((x.end() - x.begin()) * 18, s.free_bytes);
        }
      }
      next = x.end();
    }
    EXPECT_EQ(next, total);
  }
}

TEST(PsPlacementTest, RefusesWhenTheServersAreTooSmall) {
  auto r = coordinator::PlaceOnParameterServers(1000, 18, {{"a", "a:1", 9000}, {"b", "b:1", 8999}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("18000 bytes"));
}

}  // namespace
}  // namespace trainyard
