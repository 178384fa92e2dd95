// trainyard-ps's TCP data plane (server/ps/data_plane_*.h): the framing, pure; then a real
// in-process PsServer on loopback, spoken to by DataPlaneClient and by raw sockets that send what
// no client would: malformed headers, pushes cut off midway, pulls whose reader stalls, more
// connections than allowed. The step protocol itself (the same results as over gRPC, every error
// of the ShardManager) runs over both transports in ps_service_test.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <poll.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/adam/thread_pool.h"
#include "rpc/ps/data_plane_client.h"
#include "rpc/ps/data_plane_wire.h"
#include "rpc/ps/tcp_io.h"
#include "server/ps/data_plane_server.h"
#include "server/ps/ps_server.h"
#include "server/ps/shard_manager.h"
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
  r.credential = "tyj.job-7.3.credential";
  return r;
}

TEST(DataPlaneWireTest, RequestsRoundTrip) {
  const DataPlaneRequest in = FullRequest();
  const std::string bytes = ps::EncodeRequest(in);
  ASSERT_EQ(bytes.size(), ps::kRequestHeaderBytes + in.job_id.size() + in.credential.size());
  uint32_t job_id_bytes = 0, credential_bytes = 0;
  auto out = ps::DecodeRequestHeader(bytes.substr(0, ps::kRequestHeaderBytes), &job_id_bytes,
                                     &credential_bytes);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(job_id_bytes, in.job_id.size());
  EXPECT_EQ(credential_bytes, in.credential.size());
  EXPECT_EQ(bytes.substr(ps::kRequestHeaderBytes), in.job_id + in.credential);
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
                                &job_id_bytes, &credential_bytes);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->format, v1::WIRE_FP32);
}

TEST(DataPlaneWireTest, AWildcardDataPlaneHostIsDialledAtTheGrpcHost) {
  EXPECT_EQ(*ps::DataPlaneDialAddress("10.0.0.5:7081", "ps-1.example:7080"), "10.0.0.5:7081");
  EXPECT_EQ(*ps::DataPlaneDialAddress("0.0.0.0:7081", "ps-1.example:7080"), "ps-1.example:7081");
  EXPECT_EQ(*ps::DataPlaneDialAddress("[::]:7081", "[fd00::5]:7080"), "[fd00::5]:7081");
  auto bad = ps::DataPlaneDialAddress("no-port", "ps-1.example:7080");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("GetDataPlane.address"));
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
      {"version", 4, Le<uint8_t>(1), "request.version: 1 is not supported"},
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
      {"credential", 72, Le<uint32_t>(4096), "request.credential: 4096 bytes, more than 2048"},
  };
  const std::string good = ps::EncodeRequest(FullRequest()).substr(0, ps::kRequestHeaderBytes);
  for (const BadHeader& c : cases) {
    std::string header = good;
    header.replace(c.offset, c.bytes.size(), c.bytes);
    uint32_t job_id_bytes = 0, credential_bytes = 0;
    auto r = ps::DecodeRequestHeader(header, &job_id_bytes, &credential_bytes);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(r.status().message(), HasSubstr(c.error)) << c.name;
  }
  uint32_t job_id_bytes = 0, credential_bytes = 0;
  EXPECT_THAT(ps::DecodeRequestHeader(good.substr(0, 10), &job_id_bytes, &credential_bytes)
                  .status()
                  .message(),
              HasSubstr("request.header: 10 bytes, not 80"));
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

// Elements of a range whose pull cannot sit whole in a connection's buffers while its reader
// stalls: twice what the server's send buffer may grow to (tcp_wmem's maximum), 8 Mi at least.
// The stalled reader keeps its receive buffer small (SO_RCVBUF).
int64_t StallingRangeElements() {
  std::ifstream f("/proc/sys/net/ipv4/tcp_wmem");
  int64_t min_bytes = 0, default_bytes = 0, max_bytes = 0;
  f >> min_bytes >> default_bytes >> max_bytes;
  return std::max<int64_t>(int64_t{8} << 20, 2 * max_bytes / 4);
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
    stub_ = testing::PsStub(server_->address());
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

  // Restarts the server with a job of `n` elements, applies step 1 and pushes step 2's
  // gradients; then starts a pull of step 1 on a raw connection whose reader stalls after the
  // answer's header (its receive buffer small). `*step1`: the parameters after step 1.
  ps::UniqueFd StallAPullOfStep1(int64_t n, std::vector<float>* step1) {
    server_->Shutdown();
    server_.reset();
    StartServer("127.0.0.1:0", n);
    const std::vector<float> grads(n, 0.25f);
    *step1 = Step(1, grads);
    EXPECT_NE(*step1, init_);
    v1::PushGradientsResponse pushed;
    EXPECT_TRUE(client_->Push(PushHeader(2), grads.data(), 0, n, 0, kTimeout, &pushed).ok());
    ps::UniqueFd fd = Connect();
    const int small = 64 << 10;
    EXPECT_EQ(setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
    EXPECT_TRUE(ps::SendAll(fd.get(),
                            ps::EncodeRequest(Request(DataPlaneOp::kUpdateAndPull, 1, 0, n)),
                            ps::IoLimit::Until(absl::Now() + kTimeout))
                    .ok());
    const DataPlaneResponse head = ReadResponse(fd.get());
    EXPECT_TRUE(head.status.ok()) << head.status;
    EXPECT_EQ(head.count_a, n * 4);
    return fd;
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
  // the sender gets through all of it and reads the answer, not a reset connection.
  {
    DataPlaneRequest r = Request(DataPlaneOp::kPush, 1, 0, int64_t{2} << 20);
    std::string bytes = ps::EncodeRequest(r);
    bytes[6] = 5;  // format
    bytes += std::string((int64_t{2} << 20) * 4, '\1');
    ps::UniqueFd fd = Connect();
    ASSERT_TRUE(ps::SendAll(fd.get(), bytes, ps::IoLimit::Until(absl::Now() + kTimeout)).ok());
    const DataPlaneResponse answer = ReadResponse(fd.get());
    EXPECT_EQ(answer.status.code(), absl::StatusCode::kInvalidArgument) << answer.status;
    EXPECT_THAT(answer.status.message(), HasSubstr("request.format: unknown wire format 5"));
    EXPECT_TRUE(ClosedByServer(fd.get()));
  }
  // Still serving.
  const std::vector<float> after = Step(1, std::vector<float>(kN, 0.5f));
  EXPECT_NE(after, init_);
}

// What the server would refuse, the client refuses before sending a byte: a format that would
// not survive the one-byte encoding (258 would read as bf16 and desynchronise the connection), a
// range whose size would come out negative; the connection it keeps still serves.
TEST_F(DataPlaneServerTest, TheClientRefusesWhatTheServerWouldNamingTheField) {
  std::vector<float> params(kN);
  ASSERT_TRUE(client_->UpdateAndPull(PullRequest(0, false, 0, kN), params.data(), kTimeout).ok());
  v1::PushGradientsResponse pushed;
  absl::Status s = client_->Push(PushHeader(1, static_cast<v1::WireFormat>(258)), params.data(), 0,
                                 kN, 0, kTimeout, &pushed);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("request.format: unknown wire format 258"));
  s = client_->Push(PushHeader(1), params.data(), 10, 5, 0, kTimeout, &pushed);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("request.begin/end: [10, 5)"));
  v1::UpdateAndPullRequest pull = PullRequest(0, false, 0, kN);
  pull.set_chunk_elements(int64_t{1} << 30);
  s = client_->UpdateAndPull(pull, params.data(), kTimeout);
  EXPECT_THAT(s.message(), HasSubstr("request.chunk_elements"));
  pull = PullRequest(0, false, 0, kN);
  pull.set_job_id("");
  s = client_->UpdateAndPull(pull, params.data(), kTimeout);
  EXPECT_THAT(s.message(), HasSubstr("request.job_id: empty"));
  // Nothing reached the shard; the kept connection answers the next call.
  ASSERT_TRUE(client_->UpdateAndPull(PullRequest(0, false, 0, kN), params.data(), kTimeout).ok());
  EXPECT_EQ(params, init_);
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
// of the range waits (here until the caller's time limit, which the server honours), and every
// element the pull delivers is the step it asked for.
TEST_F(DataPlaneServerTest, AStalledPullDeliversItsStepWhileAnUpdateOfItsRangeWaits) {
  const int64_t n = StallingRangeElements();
  std::vector<float> step1;
  ps::UniqueFd stalled = StallAPullOfStep1(n, &step1);
  const ps::IoLimit limit = ps::IoLimit::Until(absl::Now() + kTimeout);
  std::vector<float> pulled(n, std::nanf(""));
  char* out = reinterpret_cast<char*>(pulled.data());
  ASSERT_TRUE(ps::RecvAll(stalled.get(), out, 1 << 20, limit).ok());

  // Update 2 of the range with a 300 ms limit, its answer awaited far longer: the server gives
  // up at the caller's limit, saying why.
  {
    ps::UniqueFd fd = Connect();
    DataPlaneRequest update = Request(DataPlaneOp::kUpdateAndPull, 2, 0, n);
    update.update = true;
    update.lr = 1e-2f;
    update.timeout_ms = 300;
    ASSERT_TRUE(ps::SendAll(fd.get(), ps::EncodeRequest(update), limit).ok());
    const DataPlaneResponse r = ReadResponse(fd.get());
    EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
    EXPECT_THAT(r.status.message(), HasSubstr("waited for pulls of step 1 still sending"));
  }

  ASSERT_TRUE(ps::RecvAll(stalled.get(), out + (1 << 20), n * 4 - (1 << 20), limit).ok());
  EXPECT_EQ(pulled, step1);
  // With the range back, update 2 goes through.
  std::vector<float> step2(n);
  ASSERT_TRUE(client_->UpdateAndPull(PullRequest(2, true, 0, n), step2.data(), kTimeout).ok());
  EXPECT_NE(step2, step1);
}

// A peer that answers as scripted, on a listening socket of its own: the client's connection
// handling, seen from the other end.
class ScriptedPeer {
 public:
  struct Answer {
    DataPlaneResponse response;
    std::string data;                             // after the response (count_a bytes, for a pull)
    absl::Duration delay = absl::ZeroDuration();  // before it
  };
  // An answer with `status` and, for a pull, `data`, sent after `delay`.
  static Answer Answering(absl::Status status, std::string data = "",
                          absl::Duration delay = absl::ZeroDuration()) {
    Answer a;
    a.response.status = std::move(status);
    a.response.count_a = static_cast<int64_t>(data.size());
    a.data = std::move(data);
    a.delay = delay;
    return a;
  }
  // `answers[i]` answers the single call of the i-th connection, which is then closed; a
  // connection beyond the script is closed unanswered.
  explicit ScriptedPeer(std::vector<Answer> answers) : answers_(std::move(answers)) {
    int port = 0;
    auto listener = ps::TcpListen("127.0.0.1:0", "", "peer", &port);
    EXPECT_TRUE(listener.ok()) << listener.status();
    listener_ = *std::move(listener);
    address_ = absl::StrCat("127.0.0.1:", port);
    thread_ = std::thread([this] { Run(); });
  }
  ~ScriptedPeer() {
    stop_ = true;
    thread_.join();
  }
  const std::string& address() const { return address_; }
  int connections() const { return connections_; }

 private:
  void Run() {
    while (!stop_) {
      pollfd p{listener_.get(), POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      ps::UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!fd.valid()) continue;
      const int i = connections_++;
      if (i >= static_cast<int>(answers_.size())) continue;
      const ps::IoLimit limit = ps::IoLimit::Until(absl::Now() + kTimeout);
      char header[ps::kRequestHeaderBytes];
      uint32_t job_id_bytes = 0, credential_bytes = 0;
      if (!ps::RecvAll(fd.get(), header, sizeof(header), limit).ok()) continue;
      auto request = ps::DecodeRequestHeader(absl::string_view(header, sizeof(header)),
                                             &job_id_bytes, &credential_bytes);
      if (!request.ok() || !ps::Discard(fd.get(), job_id_bytes + credential_bytes, limit).ok()) {
        continue;
      }
      absl::SleepFor(answers_[i].delay);
      ps::SendAll(fd.get(), ps::EncodeResponse(answers_[i].response) + answers_[i].data, limit)
          .IgnoreError();
      // Closed only once the client has the answer and sent its next call (or left): then the
      // client meets a connection the peer closed, as after a server restart.
      char next;
      ps::RecvAll(fd.get(), &next, 1, limit).IgnoreError();
    }
  }

  const std::vector<Answer> answers_;
  ps::UniqueFd listener_;
  std::string address_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
};

// The call's deadline fails it on the client, and the connection, whose answer may still come,
// is not kept: the next call goes to a new connection and gets its own answer.
TEST(DataPlaneClientTest, AClientDeadlineFailsTheCallAndItsConnectionIsNotKept) {
  const float late = 1.0f, fresh = 2.0f;
  ScriptedPeer peer({ScriptedPeer::Answering(absl::OkStatus(),
                                             std::string(reinterpret_cast<const char*>(&late), 4),
                                             absl::Milliseconds(500)),
                     ScriptedPeer::Answering(
                         absl::OkStatus(), std::string(reinterpret_cast<const char*>(&fresh), 4))});
  ps::DataPlaneClient client(peer.address(), "");
  v1::UpdateAndPullRequest pull;
  pull.set_job_id("job-1");
  pull.set_end(1);
  float value = 0;
  absl::Status s = client.UpdateAndPull(pull, &value, absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("data plane ", peer.address(),
                                     ": recv (0 of 32 bytes received): deadline exceeded")));
  ASSERT_TRUE(client.UpdateAndPull(pull, &value, kTimeout).ok());
  EXPECT_EQ(value, fresh);
  EXPECT_EQ(peer.connections(), 2);
}

// A kept connection that the server closed meanwhile is replaced once: the call is tried again on
// a new connection, which answers it. A call that got an answer, even UNAVAILABLE, is not tried
// again.
TEST(DataPlaneClientTest, AKeptConnectionTheServerClosedIsReplacedOnce) {
  ScriptedPeer peer(
      {ScriptedPeer::Answering(absl::OkStatus(), std::string(4, '\0')),
       ScriptedPeer::Answering(absl::NotFoundError("job_id: no shard of job 'job-1' here")),
       ScriptedPeer::Answering(absl::UnavailableError("this parameter server is shutting down"))});
  ps::DataPlaneClient client(peer.address(), "");
  v1::UpdateAndPullRequest pull;
  pull.set_job_id("job-1");
  pull.set_end(1);
  float value = 0;
  ASSERT_TRUE(client.UpdateAndPull(pull, &value, kTimeout).ok());
  EXPECT_EQ(peer.connections(), 1);
  // The kept connection is closed under it: the call goes to a second connection.
  absl::Status s = client.UpdateAndPull(pull, &value, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(peer.connections(), 2);
  // The second connection was kept (NOT_FOUND does not close it) and is closed too; the third
  // answers UNAVAILABLE, which the client returns as it is, without a fourth try.
  s = client.UpdateAndPull(pull, &value, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("shutting down"));
  EXPECT_EQ(peer.connections(), 3);
}

// Shutdown ends a call waiting for lent elements at once (UNAVAILABLE: shutting down) and closes
// a connection whose reader stalls after the grace period; nothing outlives Shutdown.
TEST_F(DataPlaneServerTest, ShutdownEndsWaitingCallsAndClosesStalledConnections) {
  const int64_t n = StallingRangeElements();
  std::vector<float> step1;
  ps::UniqueFd stalled = StallAPullOfStep1(n, &step1);

  absl::Status update;
  std::thread updater([&] {
    std::vector<float> out(n);
    update = client_->UpdateAndPull(PullRequest(2, true, 0, n), out.data(), kTimeout);
  });
  // The update waits once new pulls of its range are refused for it.
  ps::DataPlaneClient probe(server_->data_plane_address(), "");
  std::vector<float> one(1);
  absl::Status seen;
  for (const absl::Time deadline = absl::Now() + kTimeout; absl::Now() < deadline;) {
    seen = probe.UpdateAndPull(PullRequest(1, false, 0, 1), one.data(), kTimeout);
    if (absl::IsFailedPrecondition(seen)) break;
  }
  EXPECT_THAT(seen.message(), HasSubstr("is being updated to step 2"));
  server_->Shutdown();
  updater.join();
  EXPECT_EQ(update.code(), absl::StatusCode::kUnavailable) << update;
  EXPECT_THAT(update.message(), HasSubstr("shutting down"));
  // The stalled pull's connection is gone before all its bytes came.
  std::vector<char> rest(n * 4);
  size_t received = 0;
  EXPECT_EQ(ps::RecvAll(stalled.get(), rest.data(), rest.size(),
                        ps::IoLimit::Until(absl::Now() + kTimeout), &received)
                .code(),
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
  (*server)->Shutdown(absl::Now());
}

}  // namespace
}  // namespace trainyard
