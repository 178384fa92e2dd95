// What the parameter-server tests share: a shard header with the tests' AdamW hyperparameters,
// fp32 vectors as bytes and back, and a whole InitShard call over gRPC.
#ifndef TRAINYARD_TESTS_TESTING_PS_SHARD_H_
#define TRAINYARD_TESTS_TESTING_PS_SHARD_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard::testing {

inline constexpr float kBeta1 = 0.9f, kBeta2 = 0.95f, kEps = 1e-8f, kWeightDecay = 0.1f;

// The header of [begin, end) of a `total`-parameter job, with the hyperparameters above.
inline v1::InitShardChunk::Header ShardHeader(const std::string& job, int attempt, int64_t begin,
                                              int64_t end, int64_t total) {
  v1::InitShardChunk::Header h;
  h.set_job_id(job);
  h.set_attempt(attempt);
  h.set_begin(begin);
  h.set_end(end);
  h.set_total_params(total);
  h.mutable_adamw()->set_beta1(kBeta1);
  h.mutable_adamw()->set_beta2(kBeta2);
  h.mutable_adamw()->set_eps(kEps);
  h.mutable_adamw()->set_weight_decay(kWeightDecay);
  return h;
}

// A stub of the ParameterServerService at `address` that takes replies up to 64 MiB.
inline std::unique_ptr<v1::ParameterServerService::Stub> PsStub(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  return v1::ParameterServerService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

// Elements [begin, end) of `v` as fp32 bytes.
inline std::string Bytes(const std::vector<float>& v, size_t begin, size_t end) {
  return std::string(reinterpret_cast<const char*>(v.data() + begin), (end - begin) * 4);
}

inline std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

// InitShard of `header`'s range from `params` (the whole job's vector), in chunks of `chunk`
// elements.
inline grpc::Status InitShard(v1::ParameterServerService::Stub& stub,
                              const v1::InitShardChunk::Header& header,
                              const std::vector<float>& params, int64_t chunk) {
  grpc::ClientContext ctx;
  v1::InitShardResponse r;
  auto w = stub.InitShard(&ctx, &r);
  v1::InitShardChunk c;
  *c.mutable_header() = header;
  bool ok = w->Write(c);
  for (int64_t a = header.begin(); ok && a < header.end(); a += chunk) {
    c.Clear();
    c.set_offset(a);
    c.set_params(Bytes(params, a, std::min(header.end(), a + chunk)));
    ok = w->Write(c);
  }
  w->WritesDone();
  return w->Finish();
}

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_PS_SHARD_H_
