// trainyard-ps's TCP data plane (server/ps/data_plane_*.h): the framing, pure; then a real
// in-process PsServer on loopback, spoken to by DataPlaneClient and by raw sockets that send what
// no client would: malformed headers, pushes cut off midway, pulls whose reader stalls, more
// connections than allowed. The step protocol itself (the same results as over gRPC, every error
// of the ShardManager) runs over both transports in ps_service_test.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/adam/thread_pool.h"
#include "server/ps/data_plane_client.h"
#include "server/ps/data_plane_server.h"
#include "server/ps/data_plane_wire.h"
#include "server/ps/ps_server.h"
#include "server/ps/shard_manager.h"
#include "server/ps/tcp_io.h"
#include "tests/testing/ps_shard.h"
#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard {
namespace {

using ps::DataPlaneOp;
using ps::DataPlaneRequest;
using ps::DataPlaneResponse;
using testing::Bytes;
using ::testing::HasSubstr;
using testing::ShardHeader;

constexpr absl::Duration kTimeout = absl::Seconds(30);

DataPlaneRequest FullRequest() {
  DataPlaneRequest r;
  r.op = DataPlaneOp::kUpdateAndPull;
  r.format = v1::WIRE_BF16;
  r.job_id = "job-\xff-7";
  r.attempt = 3;
  r.step = 41;
  r.begin = 1000;
  r.end = 123456789012;
  r.chunk_elements = 4096;
  r.update = true;
  r.lr = 3e-4f;
  r.grad_scale = 0.25f;
  r.wait_ms = 1500;
  r.timeout_ms = 120000;
  return r;
}

TEST(DataPlaneWireTest, RequestsRoundTrip) {
  const DataPlaneRequest in = FullRequest();
  const std::string bytes = ps::EncodeRequest(in);
  ASSERT_EQ(bytes.size(), ps::kRequestHeaderBytes + in.job_id.size());
  uint32_t job_id_bytes = 0;
  auto out = ps::DecodeRequestHeader(bytes.substr(0, ps::kRequestHeaderBytes), &job_id_bytes);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(job_id_bytes, in.job_id.size());
  EXPECT_EQ(bytes.substr(ps::kRequestHeaderBytes), in.job_id);
  EXPECT_EQ(out->op, in.op);
  EXPECT_EQ(out->format, in.format);
  EXPECT_EQ(out->attempt, in.attempt);
  EXPECT_EQ(out->step, in.step);
  EXPECT_EQ(out->begin, in.begin);
  EXPECT_EQ(out->end, in.end);
  EXPECT_EQ(out->chunk_elements, in.chunk_elements);
  EXPECT_TRUE(out->update);
  EXPECT_EQ(out->lr, in.lr);
  EXPECT_EQ(out->grad_scale, in.grad_scale);
  EXPECT_EQ(out->wait_ms, in.wait_ms);
  EXPECT_EQ(out->timeout_ms, in.timeout_ms);
  EXPECT_EQ(out->payload_bytes(), (in.end - in.begin) * 2);
  // WIRE_FORMAT_UNSPECIFIED reads as fp32, as in the gRPC calls.
  DataPlaneRequest unspecified = in;
  unspecified.format = v1::WIRE_FORMAT_UNSPECIFIED;
  out = ps::DecodeRequestHeader(ps::EncodeRequest(unspecified).substr(0, ps::kRequestHeaderBytes),
                                &job_id_bytes);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->format, v1::WIRE_FP32);
}

// Each case overwrites the bytes of one field of a good header.
struct BadHeader {
  const char* name;
  size_t offset;
  std::string bytes;
  const char* error;
};

template <typename T>
std::string Le(T value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}

TEST(DataPlaneWireTest, MalformedRequestHeadersAreRefusedNamingTheField) {
  const std::vector<BadHeader> cases = {
      {"magic", 0, "GET ", "request.magic: 0x20544547 is not a trainyard-ps data-plane request"},
      {"version", 4, Le<uint8_t>(2), "request.version: 2 is not supported"},
      {"op", 5, Le<uint8_t>(9), "request.op: unknown operation 9"},
      {"format", 6, Le<uint8_t>(7), "request.format: unknown wire format 7"},
      {"flags", 7, Le<uint8_t>(0x81), "request.flags: unknown bits in 0x81"},
      {"empty job_id", 12, Le<uint32_t>(0), "request.job_id: empty"},
      {"long job_id", 12, Le<uint32_t>(5000), "request.job_id: 5000 bytes, more than 1024"},
      {"negative begin", 24, Le<int64_t>(-1), "request.begin/end: [-1, "},
      {"end before begin", 32, Le<int64_t>(999), "request.begin/end: [1000, 999)"},
      {"huge range", 32, Le<int64_t>(int64_t{1} << 50), "more than 1099511627776 elements"},
      {"chunk", 40, Le<int64_t>(int64_t{17} << 20), "request.chunk_elements: 17825792 is not in"},
      {"negative chunk", 40, Le<int64_t>(-1), "request.chunk_elements: -1"},
      {"wait", 56, Le<int64_t>(-5), "request.wait_ms: -5 is negative"},
      {"timeout", 64, Le<int64_t>(-5), "request.timeout_ms: -5 is negative"},
  };
  const std::string good = ps::EncodeRequest(FullRequest()).substr(0, ps::kRequestHeaderBytes);
  for (const BadHeader& c : cases) {
    std::string header = good;
    header.replace(c.offset, c.bytes.size(), c.bytes);
    uint32_t job_id_bytes = 0;
    auto r = ps::DecodeRequestHeader(header, &job_id_bytes);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(r.status().message(), HasSubstr(c.error)) << c.name;
  }
  uint32_t job_id_bytes = 0;
  EXPECT_THAT(ps::DecodeRequestHeader(good.substr(0, 10), &job_id_bytes).status().message(),
              HasSubstr("request.header: 10 bytes, not 72"));
}

TEST(DataPlaneWireTest, ResponsesRoundTripAndMalformedOnesAreInternal) {
  DataPlaneResponse in{absl::FailedPreconditionError("step: not yet"), true, 12, 34};
  const std::string bytes = ps::EncodeResponse(in);
  ASSERT_EQ(bytes.size(), ps::kResponseHeaderBytes + in.status.message().size());
  uint32_t message_bytes = 0;
  auto out = ps::DecodeResponseHeader(bytes.substr(0, ps::kResponseHeaderBytes), &message_bytes);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(bytes.substr(ps::kResponseHeaderBytes), "step: not yet");
  EXPECT_EQ(message_bytes, in.status.message().size());
  EXPECT_TRUE(out->closing);
  EXPECT_EQ(out->count_a, 12);
  EXPECT_EQ(out->count_b, 34);
  // A message longer than the limit is cut to it.
  const std::string long_message(ps::kMaxStatusMessageBytes + 10, 'x');
  EXPECT_EQ(ps::EncodeResponse({absl::InternalError(long_message)}).size(),
            ps::kResponseHeaderBytes + ps::kMaxStatusMessageBytes);

  const std::string good = bytes.substr(0, ps::kResponseHeaderBytes);
  const std::vector<std::pair<std::string, const char*>> bad = {
      {std::string("HTTP") + good.substr(4), "wrong magic"},
      {good.substr(0, 4) + Le<int32_t>(17) + good.substr(8), "status code 17"},
      {good.substr(0, 8) + Le<uint32_t>(1 << 20) + good.substr(12), "a status message of"},
      {good.substr(0, 16) + Le<int64_t>(-1) + good.substr(24), "a negative count"},
  };
  for (const auto& [header, error] : bad) {
    auto r = ps::DecodeResponseHeader(header, &message_bytes);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << error;
    EXPECT_THAT(r.status().message(), HasSubstr(error));
  }
}

// Reads one response from a raw connection; its status carries the message.
DataPlaneResponse ReadResponse(int fd) {
  char header[ps::kResponseHeaderBytes];
  absl::Status s =
      ps::RecvAll(fd, header, sizeof(header), ps::IoLimit::Until(absl::Now() + kTimeout));
  EXPECT_TRUE(s.ok()) << s;
  uint32_t message_bytes = 0;
  auto r = ps::DecodeResponseHeader(absl::string_view(header, sizeof(header)), &message_bytes);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!s.ok() || !r.ok()) return {absl::InternalError("no response")};
  std::string message(message_bytes, '\0');
  EXPECT_TRUE(
      ps::RecvAll(fd, message.data(), message_bytes, ps::IoLimit::Until(absl::Now() + kTimeout))
          .ok());
  r->status = absl::Status(r->status.code(), message);
  return *r;
}

// True when the server closed `fd` (end of stream, or reset) before any further byte.
bool ClosedByServer(int fd) {
  char byte;
  size_t received = 0;
  const absl::Status s =
      ps::RecvAll(fd, &byte, 1, ps::IoLimit::Until(absl::Now() + kTimeout), &received);
  return s.code() == absl::StatusCode::kUnavailable && received == 0;
}

// A PsServer with its data plane holding [0, kN) of job-1, attempt 1.
class DataPlaneServerTest : public ::testing::Test {
 protected:
  static constexpr int64_t kN = 40000;

  void SetUp() override { StartServer("127.0.0.1:0"); }

  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  void StartServer(const std::string& data_listen, int64_t n = kN) {
    ps::PsOptions o;
    o.listen_address = "127.0.0.1:0";
    o.data_listen_address = data_listen;
    o.capacity_bytes = int64_t{1} << 30;
    o.threads = 2;
    auto s = ps::PsServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    stub_ = v1::ParameterServerService::NewStub(
        grpc::CreateCustomChannel(server_->address(), grpc::InsecureChannelCredentials(), args));
    client_ = std::make_unique<ps::DataPlaneClient>(server_->data_plane_address(), "");
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0, 1);
    init_.resize(n);
    for (float& x : init_) x = normal(rng);
    ASSERT_TRUE(
        testing::InitShard(*stub_, ShardHeader("job-1", 1, 0, n, n), init_, int64_t{1} << 20).ok());
  }

  ps::UniqueFd Connect() {
    auto fd = ps::TcpConnect(server_->data_plane_address(), "", absl::Now() + kTimeout);
    EXPECT_TRUE(fd.ok()) << fd.status();
    return fd.ok() ? *std::move(fd) : ps::UniqueFd();
  }

  static DataPlaneRequest Request(DataPlaneOp op, int64_t step, int64_t begin, int64_t end) {
    DataPlaneRequest r;
    r.op = op;
    r.job_id = "job-1";
    r.attempt = 1;
    r.step = step;
    r.begin = begin;
    r.end = end;
    return r;
  }

  static v1::GradientChunk PushHeader(int64_t step, v1::WireFormat format = v1::WIRE_FP32) {
    v1::GradientChunk h;
    h.set_job_id("job-1");
    h.set_attempt(1);
    h.set_step(step);
    h.set_format(format);
    return h;
  }

  static v1::UpdateAndPullRequest PullRequest(int64_t step, bool update, int64_t begin,
                                              int64_t end) {
    v1::UpdateAndPullRequest r;
    r.set_job_id("job-1");
    r.set_attempt(1);
    r.set_step(step);
    r.set_begin(begin);
    r.set_end(end);
    if (update) r.mutable_update()->set_lr(1e-2f);
    return r;
  }

  // Pushes `grads` for step `step` of [0, kN) and applies it; the parameters after it.
  std::vector<float> Step(int64_t step, const std::vector<float>& grads) {
    v1::PushGradientsResponse pushed;
    EXPECT_TRUE(
        client_->Push(PushHeader(step), grads.data(), 0, init_.size(), 0, kTimeout, &pushed).ok());
    std::vector<float> params(init_.size());
    const absl::Status s =
        client_->UpdateAndPull(PullRequest(step, true, 0, init_.size()), params.data(), kTimeout);
    EXPECT_TRUE(s.ok()) << s;
    return params;
  }

  std::unique_ptr<ps::PsServer> server_;
  std::unique_ptr<v1::ParameterServerService::Stub> stub_;
  std::unique_ptr<ps::DataPlaneClient> client_;
  std::vector<float> init_;
};

TEST_F(DataPlaneServerTest, GetDataPlaneNamesTheAddressTrainersDialOrNone) {
  grpc::ClientContext ctx;
  v1::DataPlaneInfo info;
  ASSERT_TRUE(stub_->GetDataPlane(&ctx, {}, &info).ok());
  EXPECT_EQ(info.address(), server_->data_plane_address());
  EXPECT_EQ(info.version(), ps::kDataPlaneVersion);
  EXPECT_THAT(info.address(), ::testing::StartsWith("127.0.0.1:"));
  EXPECT_NE(info.address(), server_->address());

  server_->Shutdown();
  server_.reset();
  StartServer("off");
  grpc::ClientContext off_ctx;
  ASSERT_TRUE(stub_->GetDataPlane(&off_ctx, {}, &info).ok());
  EXPECT_EQ(info.address(), "");
  EXPECT_EQ(server_->data_plane_address(), "");
}

TEST_F(DataPlaneServerTest, AnUnusableDataListenAddressIsRefusedNamingTheFlag) {
  ps::PsOptions o;
  o.listen_address = "127.0.0.1:0";
  o.capacity_bytes = 1 << 20;
  for (const char* bad : {"no-port", "127.0.0.1:70000", "192.0.2.1:0"}) {
    o.data_listen_address = bad;
    auto s = ps::PsServer::Start(o);
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_THAT(s.status().message(), HasSubstr("--data-listen")) << bad;
  }
}

// A header that does not decode is answered (INVALID_ARGUMENT naming the field, the closing flag
// set) and the connection closed; the server goes on serving others.
TEST_F(DataPlaneServerTest, MalformedHeadersAreAnsweredThenTheConnectionCloses) {
  const std::vector<std::pair<std::string, const char*>> cases = {
      {"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(100, ' '), "request.magic"},
      {[] {
         DataPlaneRequest r = Request(DataPlaneOp::kPush, 1, 0, 10);
         r.format = static_cast<v1::WireFormat>(9);
         return ps::EncodeRequest(r);
       }(),
       "request.format: unknown wire format 9"},
      {[] {
         std::string h = ps::EncodeRequest(Request(DataPlaneOp::kPush, 1, 0, 10));
         h[5] = 3;
         return h;
       }(),
       "request.op: unknown operation 3"},
      {ps::EncodeRequest(Request(DataPlaneOp::kUpdateAndPull, 1, 5, 5)), "request.begin/end"},
  };
  for (const auto& [bytes, error] : cases) {
    ps::UniqueFd fd = Connect();
    ASSERT_TRUE(ps::SendAll(fd.get(), bytes, ps::IoLimit::Until(absl::Now() + kTimeout)).ok());
    const DataPlaneResponse r = ReadResponse(fd.get());
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << error;
    EXPECT_THAT(r.status.message(), HasSubstr(error));
    EXPECT_TRUE(r.closing) << error;
    EXPECT_TRUE(ClosedByServer(fd.get())) << error;
  }
  // A refused push whose payload is still on its way (8 MB, more than the socket buffers hold):
  // the client reads the answer, not a reset connection.
  v1::GradientChunk h = PushHeader(1, static_cast<v1::WireFormat>(5));
  std::vector<float> big(int64_t{2} << 20, 1.0f);
  v1::PushGradientsResponse response;
  const absl::Status s = client_->Push(h, big.data(), 0, big.size(), 0, kTimeout, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("request.format: unknown wire format 5"));
  // Still serving.
  const std::vector<float> after = Step(1, std::vector<float>(kN, 0.5f));
  EXPECT_NE(after, init_);
}

// Errors of the step protocol (unknown job, stale attempt, elements outside the range) are
// answered and the connection goes on; nothing of the refused calls reaches the shard.
TEST_F(DataPlaneServerTest, ProtocolErrorsKeepTheConnectionAndTheShardUnchanged) {
  ps::UniqueFd fd = Connect();
  const ps::IoLimit limit = ps::IoLimit::Until(absl::Now() + kTimeout);
  const std::string payload = Bytes(std::vector<float>(kN + 100, 3.0f), 0, kN);
  struct Case {
    DataPlaneRequest request;
    absl::StatusCode code;
    const char* error;
  };
  std::vector<Case> cases;
  cases.push_back({Request(DataPlaneOp::kPush, 1, 0, kN), absl::StatusCode::kNotFound,
                   "job_id: no shard of job 'job-9'"});
  cases.back().request.job_id = "job-9";
  cases.push_back({Request(DataPlaneOp::kPush, 1, 0, kN), absl::StatusCode::kFailedPrecondition,
                   "attempt: 2 is not attempt 1"});
  cases.back().request.attempt = 2;
  cases.push_back({Request(DataPlaneOp::kPush, 1, 100, kN + 100), absl::StatusCode::kOutOfRange,
                   "outside this shard's range [0, 40000)"});
  cases.push_back({Request(DataPlaneOp::kPush, 0, 0, kN), absl::StatusCode::kInvalidArgument,
                   "step: must be at least 1"});
  cases.push_back({Request(DataPlaneOp::kUpdateAndPull, 1, 0, kN),
                   absl::StatusCode::kDeadlineExceeded, "did not reach step 1"});
  cases.push_back({Request(DataPlaneOp::kUpdateAndPull, 1, 0, kN),
                   absl::StatusCode::kFailedPrecondition, "gradients of 0 of the 40000 elements"});
  cases.back().request.update = true;
  for (const Case& c : cases) {
    const bool push = c.request.op == DataPlaneOp::kPush;
    ASSERT_TRUE(ps::SendAll(fd.get(), ps::EncodeRequest(c.request), limit).ok());
    if (push) {
      ASSERT_TRUE(ps::SendAll(fd.get(), payload, limit).ok());
    }
    const DataPlaneResponse r = ReadResponse(fd.get());
    EXPECT_EQ(r.status.code(), c.code) << c.error << ": " << r.status;
    EXPECT_THAT(r.status.message(), HasSubstr(c.error));
    EXPECT_FALSE(r.closing);
  }
  // The same connection: the initial parameters at step 0, then a good push.
  ASSERT_TRUE(ps::SendAll(fd.get(),
                          ps::EncodeRequest(Request(DataPlaneOp::kUpdateAndPull, 0, 0, kN)), limit)
                  .ok());
  DataPlaneResponse r = ReadResponse(fd.get());
  ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_EQ(r.count_a, kN * 4);
  std::vector<float> now(kN);
  ASSERT_TRUE(ps::RecvAll(fd.get(), reinterpret_cast<char*>(now.data()), kN * 4, limit).ok());
  EXPECT_EQ(now, init_);
  ASSERT_TRUE(
      ps::SendAll(fd.get(), ps::EncodeRequest(Request(DataPlaneOp::kPush, 1, 0, kN)), limit).ok());
  ASSERT_TRUE(ps::SendAll(fd.get(), payload, limit).ok());
  r = ReadResponse(fd.get());
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.count_a, kN);  // staged
  EXPECT_EQ(r.count_b, 0);   // duplicates
}

// A push whose sender goes away in its second chunk leaves the first chunk staged, nothing of
// the second; the retry finds the first as a duplicate, and the update equals one from a push
// that never broke.
TEST_F(DataPlaneServerTest, APushCutOffMidwayStagesOnlyItsWholeChunks) {
  constexpr int64_t kChunk = kN / 4;
  std::vector<float> grads(kN);
  for (int64_t i = 0; i < kN; ++i) grads[i] = std::sin(0.001 * i);
  {
    ps::UniqueFd fd = Connect();
    DataPlaneRequest r = Request(DataPlaneOp::kPush, 1, 0, kN);
    r.chunk_elements = kChunk;
    const ps::IoLimit limit = ps::IoLimit::Until(absl::Now() + kTimeout);
    ASSERT_TRUE(ps::SendAll(fd.get(), ps::EncodeRequest(r), limit).ok());
    ASSERT_TRUE(ps::SendAll(fd.get(), Bytes(grads, 0, kChunk + kChunk / 2), limit).ok());
    shutdown(fd.get(), SHUT_WR);
    // The server stages the first chunk, meets the end of the stream in the second and closes
    // the connection without an answer.
    EXPECT_TRUE(ClosedByServer(fd.get()));
  }
  v1::UpdateAndPullRequest update = PullRequest(1, true, 0, kN);
  std::vector<float> params(kN);
  absl::Status s = client_->UpdateAndPull(update, params.data(), kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("gradients of ", kChunk, " of the ", kN)));

  v1::PushGradientsResponse retry;
  ASSERT_TRUE(client_->Push(PushHeader(1), grads.data(), 0, kN, kChunk, kTimeout, &retry).ok());
  EXPECT_EQ(retry.elements_duplicate(), kChunk);
  EXPECT_EQ(retry.elements_staged(), kN - kChunk);
  ASSERT_TRUE(client_->UpdateAndPull(update, params.data(), kTimeout).ok());

  // The same step on a second job from the same initial weights, pushed in one go.
  ASSERT_TRUE(testing::InitShard(*stub_, ShardHeader("job-2", 1, 0, kN, kN), init_, kN).ok());
  v1::GradientChunk h = PushHeader(1);
  h.set_job_id("job-2");
  v1::PushGradientsResponse clean;
  ASSERT_TRUE(client_->Push(h, grads.data(), 0, kN, kChunk, kTimeout, &clean).ok());
  update.set_job_id("job-2");
  std::vector<float> expected(kN);
  ASSERT_TRUE(client_->UpdateAndPull(update, expected.data(), kTimeout).ok());
  EXPECT_EQ(params, expected);
}

// A pull lends its whole range until its last byte is sent: while its reader stalls, an update
// of the range waits (here past the caller's time limit, which the server honours), and every
// element the pull delivers is the step it asked for.
TEST_F(DataPlaneServerTest, AStalledPullDeliversItsStepWhileAnUpdateOfItsRangeWaits) {
  constexpr int64_t kBig = int64_t{8} << 20;  // 32 MB of fp32: far more than socket buffers
  server_->Shutdown();
  server_.reset();
  StartServer("127.0.0.1:0", kBig);
  const std::vector<float> grads(kBig, 0.25f);
  const std::vector<float> step1 = Step(1, grads);
  ASSERT_NE(step1, init_);
  v1::PushGradientsResponse pushed;
  ASSERT_TRUE(client_->Push(PushHeader(2), grads.data(), 0, kBig, 0, kTimeout, &pushed).ok());

  ps::UniqueFd stalled = Connect();
  const ps::IoLimit limit = ps::IoLimit::Until(absl::Now() + kTimeout);
  ASSERT_TRUE(ps::SendAll(stalled.get(),
                          ps::EncodeRequest(Request(DataPlaneOp::kUpdateAndPull, 1, 0, kBig)),
                          limit)
                  .ok());
  const DataPlaneResponse head = ReadResponse(stalled.get());
  ASSERT_TRUE(head.status.ok()) << head.status;
  ASSERT_EQ(head.count_a, kBig * 4);
  std::vector<float> pulled(kBig, std::nanf(""));
  char* out = reinterpret_cast<char*>(pulled.data());
  ASSERT_TRUE(ps::RecvAll(stalled.get(), out, 1 << 20, limit).ok());

  std::vector<float> step2(kBig);
  absl::Status update =
      client_->UpdateAndPull(PullRequest(2, true, 0, kBig), step2.data(), absl::Milliseconds(300));
  EXPECT_EQ(update.code(), absl::StatusCode::kDeadlineExceeded) << update;

  ASSERT_TRUE(ps::RecvAll(stalled.get(), out + (1 << 20), kBig * 4 - (1 << 20), limit).ok());
  EXPECT_EQ(pulled, step1);
  // With the range back, update 2 goes through (once: a retry is a no-op).
  ASSERT_TRUE(client_->UpdateAndPull(PullRequest(2, true, 0, kBig), step2.data(), kTimeout).ok());
  EXPECT_NE(step2, step1);
}

// The call's deadline fails it on the client; the connection, whose answer may still come, is not
// kept, so the next call gets its own answer.
TEST_F(DataPlaneServerTest, AClientDeadlineFailsTheCallAndTheNextCallIsServed) {
  std::vector<float> params(kN);
  v1::UpdateAndPullRequest waiting = PullRequest(1, false, 0, kN);
  waiting.set_wait_ms(2000);
  absl::Status s = client_->UpdateAndPull(waiting, params.data(), absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("data plane ", server_->data_plane_address(), ": recv")));
  ASSERT_TRUE(client_->UpdateAndPull(PullRequest(0, false, 0, kN), params.data(), kTimeout).ok());
  EXPECT_EQ(params, init_);
}

// A kept connection the server closed meanwhile (here: a restarted server on the same port) is
// replaced once: the call reaches the new server, which answers it (it has no such job).
TEST_F(DataPlaneServerTest, AKeptConnectionTheServerClosedIsReplacedOnce) {
  std::vector<float> params(kN);
  ASSERT_TRUE(client_->UpdateAndPull(PullRequest(0, false, 0, kN), params.data(), kTimeout).ok());
  const std::string address = server_->data_plane_address();
  auto client = std::move(client_);  // holds the kept connection
  server_->Shutdown();
  server_.reset();
  ps::PsOptions o;
  o.listen_address = "127.0.0.1:0";
  o.data_listen_address = address;
  o.capacity_bytes = 1 << 20;
  auto s = ps::PsServer::Start(o);
  ASSERT_TRUE(s.ok()) << s.status();
  server_ = std::move(*s);
  const absl::Status status =
      client->UpdateAndPull(PullRequest(0, false, 0, kN), params.data(), kTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("job_id: no shard of job 'job-1'"));
}

// Shutdown ends a call waiting for lent elements at once (UNAVAILABLE: shutting down) and closes
// a connection whose reader stalls after the grace period; nothing outlives Shutdown.
TEST_F(DataPlaneServerTest, ShutdownEndsWaitingCallsAndClosesStalledConnections) {
  constexpr int64_t kBig = int64_t{8} << 20;
  server_->Shutdown();
  server_.reset();
  StartServer("127.0.0.1:0", kBig);
  const std::vector<float> grads(kBig, 0.5f);
  Step(1, grads);
  v1::PushGradientsResponse pushed;
  ASSERT_TRUE(client_->Push(PushHeader(2), grads.data(), 0, kBig, 0, kTimeout, &pushed).ok());
  ps::UniqueFd stalled = Connect();
  const ps::IoLimit limit = ps::IoLimit::Until(absl::Now() + kTimeout);
  ASSERT_TRUE(ps::SendAll(stalled.get(),
                          ps::EncodeRequest(Request(DataPlaneOp::kUpdateAndPull, 1, 0, kBig)),
                          limit)
                  .ok());
  ASSERT_TRUE(ReadResponse(stalled.get()).status.ok());

  absl::Status update;
  std::thread updater([&] {
    std::vector<float> out(kBig);
    update = client_->UpdateAndPull(PullRequest(2, true, 0, kBig), out.data(), kTimeout);
  });
  // The update waits once new pulls of its range are refused for it.
  ps::DataPlaneClient probe(server_->data_plane_address(), "");
  std::vector<float> one(1);
  absl::Status seen;
  for (int i = 0; i < 10000; ++i) {
    seen = probe.UpdateAndPull(PullRequest(1, false, 0, 1), one.data(), kTimeout);
    if (absl::IsFailedPrecondition(seen)) break;
  }
  EXPECT_THAT(seen.message(), HasSubstr("is being updated to step 2"));
  server_->Shutdown();
  updater.join();
  EXPECT_EQ(update.code(), absl::StatusCode::kUnavailable) << update;
  EXPECT_THAT(update.message(), HasSubstr("shutting down"));
  // The stalled pull's connection is gone before all its bytes came.
  std::vector<char> rest(kBig * 4);
  size_t received = 0;
  EXPECT_EQ(ps::RecvAll(stalled.get(), rest.data(), rest.size(), limit, &received).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_LT(received, rest.size());
}

TEST(DataPlaneConnectionsTest, MoreConnectionsThanTheLimitAreRefused) {
  adam::ThreadPool pool(1);
  ps::ShardManager shards(1 << 20, pool);
  ps::DataPlaneOptions o;
  o.max_connections = 1;
  auto server = ps::DataPlaneServer::Start(o, shards, {});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*server)->port());
  const absl::Time deadline = absl::Now() + kTimeout;
  auto first = ps::TcpConnect(address, "", deadline);
  ASSERT_TRUE(first.ok()) << first.status();
  // The first is served: it gets an answer (no such job).
  ASSERT_TRUE(ps::SendAll(first->get(), ps::EncodeRequest([] {
                            DataPlaneRequest r;
                            r.op = DataPlaneOp::kUpdateAndPull;
                            r.job_id = "none";
                            r.end = 1;
                            return r;
                          }()),
                          ps::IoLimit::Until(deadline))
                  .ok());
  DataPlaneResponse r = ReadResponse(first->get());
  EXPECT_EQ(r.status.code(), absl::StatusCode::kNotFound);
  // The second is told why and closed.
  auto second = ps::TcpConnect(address, "", deadline);
  ASSERT_TRUE(second.ok()) << second.status();
  r = ReadResponse(second->get());
  EXPECT_EQ(r.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status.message(), HasSubstr("at most 1 data-plane connections"));
  EXPECT_TRUE(r.closing);
  EXPECT_TRUE(ClosedByServer(second->get()));
  (*server)->Shutdown(absl::ZeroDuration());
}

}  // namespace
}  // namespace trainyard
