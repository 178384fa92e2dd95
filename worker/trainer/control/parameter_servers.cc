// ParameterServers (see parameter_servers.h).
#include "worker/trainer/control/parameter_servers.h"

#include <grpcpp/grpcpp.h>

#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "rpc/ps/data_plane_client.h"
#include "rpc/ps/ps_client.h"
#include "rpc/ps/tcp_congestion.h"
#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard::trainer {
namespace {

constexpr int64_t kChunkElements = int64_t{1} << 20;  // 4 MiB fp32 messages
constexpr int kMaxMessageBytes = 64 << 20;

// Runs fn(i) for each i in [0, n) on its own thread (n == 1: on this one); the first error wins.
absl::Status RunParallel(size_t n, const std::function<absl::Status(size_t)>& fn) {
  if (n == 1) return fn(0);
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i] = fn(i); });
  for (auto& t : threads) t.join();
  for (auto& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void SetDeadline(grpc::ClientContext& ctx, absl::Duration timeout) {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

struct ParameterServers::Server {
  PsRangeRef range;
  std::unique_ptr<v1::ParameterServerService::Stub> stub;
  // The same channel for the bulk calls, on byte buffers (rpc/ps/ps_client.h).
  std::unique_ptr<grpc::GenericStub> generic;
  // The server's TCP data plane, which carries pushes and pulls when set.
  std::unique_ptr<ps::DataPlaneClient> data_plane;
  std::string transport_note;  // why gRPC carries them otherwise
  std::string credential;      // the attempt's parameter-server credential for this server

  // Asks the server for its data plane (transport "tcp").
  absl::Status ConnectDataPlane(const PsClientConfig& config) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, config.rpc_timeout);
    v1::DataPlaneInfo info;
    const grpc::Status st = stub->GetDataPlane(&ctx, v1::GetDataPlaneRequest(), &info);
    if (st.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      transport_note = "the server has no data plane (an older trainyard-ps)";
      return absl::OkStatus();
    }
    if (!st.ok()) return Annotate(FromGrpcStatus(st), "data plane");
    if (info.address().empty()) {
      transport_note = "the server's data plane is off";
      return absl::OkStatus();
    }
    if (info.version() != ps::kDataPlaneVersion) {
      transport_note = absl::StrCat("the server's data plane speaks version ", info.version(),
                                    ", not ", ps::kDataPlaneVersion);
      return absl::OkStatus();
    }
    auto address = ps::DataPlaneDialAddress(info.address(), range.address);
    if (!address.ok()) return Annotate(address.status(), "data plane");
    std::shared_ptr<const ps::TlsConfig> tls;
    if (info.tls()) {
      // Verified against the cluster's CA, which the worker hands its ranks.
      const char* ca = std::getenv(kTlsCaEnv);
      if (ca == nullptr || *ca == '\0') {
        return Annotate(absl::FailedPreconditionError(
                            absl::StrCat("the data plane at ", *address,
                                         " speaks TLS, but this rank has no CA to verify it with (",
                                         kTlsCaEnv, ": the worker's --tls-ca)")),
                        "data plane");
      }
      auto config_tls = ps::TlsConfig::Client(ca);
      if (!config_tls.ok()) return Annotate(config_tls.status(), "data plane");
      tls = *std::move(config_tls);
    }
    data_plane = std::make_unique<ps::DataPlaneClient>(*address, config.tcp_congestion, credential,
                                                       std::move(tls));
    return absl::OkStatus();
  }

  absl::Status Annotate(const absl::Status& s, const char* what) const {
    if (s.ok()) return s;
    return absl::Status(
        s.code(), absl::StrCat("parameter server ", range.address, " (", what, "): ", s.message()));
  }
};

absl::StatusOr<std::vector<PsRangeRef>> ParsePsRanges(const std::string& flag) {
  std::vector<PsRangeRef> out;
  int64_t next = 0;
  for (absl::string_view item : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    std::vector<absl::string_view> be =
        kv.size() == 2 ? absl::StrSplit(kv[1], ':') : std::vector<absl::string_view>{};
    PsRangeRef r;
    if (kv.size() != 2 || kv[0].empty() || be.size() != 2 || !absl::SimpleAtoi(be[0], &r.begin) ||
        !absl::SimpleAtoi(be[1], &r.end)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ps: expected ADDRESS=BEGIN:END,..., got '", item, "'"));
    }
    if (r.begin != next || r.end <= r.begin) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ps: ranges must be non-empty and contiguous from 0; '", item,
                       "' should begin at ", next));
    }
    r.address = std::string(kv[0]);
    next = r.end;
    out.push_back(std::move(r));
  }
  if (out.empty()) return absl::InvalidArgumentError("--ps: no parameter-server ranges");
  return out;
}

absl::StatusOr<std::unique_ptr<ParameterServers>> ParameterServers::Connect(
    std::vector<PsRangeRef> ranges, PsClientConfig config) {
  if (config.transport != "tcp" && config.transport != "grpc") {
    return absl::InvalidArgumentError(
        absl::StrCat("--ps-transport: '", config.transport, "' is neither tcp nor grpc"));
  }
  if (ranges.empty()) return absl::InvalidArgumentError("--ps: no parameter-server ranges");
  RETURN_IF_ERROR(ps::CheckTcpCongestion(config.tcp_congestion, "--ps-tcp-congestion"));
  std::unique_ptr<ParameterServers> out(new ParameterServers());
  out->config_ = std::move(config);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  ps::SetTcpCongestion(&args, out->config_.tcp_congestion);
  for (PsRangeRef& r : ranges) {
    auto server = std::make_unique<Server>();
    // Every call carries the attempt's credential for this server alone, derived from the job
    // credential the worker put in the environment: the server never sees the job credential,
    // which the rendezvous and the reports accept.
    const char* job_credential = std::getenv(kJobCredentialEnv);
    server->credential =
        DeriveServerCredential(job_credential != nullptr ? job_credential : "", r.address);
    auto channel = ps::CreatePsChannel(
        r.address, args, server->credential.empty() ? "" : "Bearer " + server->credential,
        ChannelCredentialsFromEnv());
    server->stub = v1::ParameterServerService::NewStub(channel);
    server->generic = std::make_unique<grpc::GenericStub>(channel);
    server->range = std::move(r);
    if (out->config_.transport == "tcp") {
      RETURN_IF_ERROR(server->ConnectDataPlane(out->config_));
    } else {
      server->transport_note = "--ps-transport grpc";
    }
    out->servers_.push_back(std::move(server));
  }
  return out;
}

ParameterServers::~ParameterServers() = default;

int64_t ParameterServers::total() const { return servers_.back()->range.end; }

absl::Status ParameterServers::ForEachOverlap(
    int64_t lo, int64_t hi,
    const std::function<absl::Status(const Server&, int64_t, int64_t)>& fn) {
  std::vector<const Server*> targets;
  for (const auto& server : servers_) {
    if (std::max(lo, server->range.begin) < std::min(hi, server->range.end)) {
      targets.push_back(server.get());
    }
  }
  if (targets.empty()) return absl::OkStatus();
  return RunParallel(targets.size(), [&](size_t i) {
    const Server& s = *targets[i];
    return fn(s, std::max(lo, s.range.begin), std::min(hi, s.range.end));
  });
}

absl::Status ParameterServers::Push(int64_t step, const float* data, int64_t lo, int64_t hi) {
  return ForEachOverlap(lo, hi, [&](const Server& s, int64_t x0, int64_t x1) {
    v1::GradientChunk header;
    header.set_job_id(config_.job_id);
    header.set_attempt(config_.attempt);
    header.set_step(step);
    header.set_format(v1::WIRE_FP32);
    v1::PushGradientsResponse response;
    const float* from = data + (x0 - lo);
    const absl::Status st = s.data_plane ? s.data_plane->Push(header, from, x0, x1, kChunkElements,
                                                              config_.rpc_timeout, &response)
                                         : FromGrpcStatus(ps::PushGradientsZeroCopy(
                                               *s.generic, header, from, x0, x1, kChunkElements,
                                               config_.rpc_timeout, &response));
    return s.Annotate(st, "push");
  });
}

absl::Status ParameterServers::UpdateAndPull(int64_t step, double lr, double grad_scale, int64_t lo,
                                             int64_t hi, float* out) {
  return ForEachOverlap(lo, hi, [&](const Server& s, int64_t x0, int64_t x1) {
    v1::UpdateAndPullRequest request;
    request.set_job_id(config_.job_id);
    request.set_attempt(config_.attempt);
    request.set_step(step);
    request.set_begin(x0);
    request.set_end(x1);
    request.mutable_update()->set_lr(static_cast<float>(lr));
    request.mutable_update()->set_grad_scale(static_cast<float>(grad_scale));
    request.set_format(v1::WIRE_FP32);
    request.set_chunk_elements(kChunkElements);
    // Received straight into the caller's array (over gRPC: decoded from its buffers).
    float* into = out + (x0 - lo);
    const absl::Status st = s.data_plane
                                ? s.data_plane->UpdateAndPull(request, into, config_.rpc_timeout)
                                : FromGrpcStatus(ps::UpdateAndPullZeroCopy(
                                      *s.generic, request, into, config_.rpc_timeout));
    return s.Annotate(st, "update and pull");
  });
}

absl::Status ParameterServers::InitShards(int64_t step, const float* params, const float* m,
                                          const float* v) {
  const bool has_state = m != nullptr && v != nullptr;
  return RunParallel(servers_.size(), [&](size_t i) -> absl::Status {
    const Server& s = *servers_[i];
    grpc::ClientContext ctx;
    SetDeadline(ctx, config_.rpc_timeout);
    v1::InitShardResponse response;
    auto writer = s.stub->InitShard(&ctx, &response);
    v1::InitShardChunk chunk;
    auto* h = chunk.mutable_header();
    h->set_job_id(config_.job_id);
    h->set_attempt(config_.attempt);
    h->set_begin(s.range.begin);
    h->set_end(s.range.end);
    h->set_total_params(total());
    h->mutable_adamw()->set_beta1(config_.beta1);
    h->mutable_adamw()->set_beta2(config_.beta2);
    h->mutable_adamw()->set_eps(config_.eps);
    h->mutable_adamw()->set_weight_decay(config_.weight_decay);
    h->set_step(step);
    h->set_has_optimizer_state(has_state);
    bool ok = writer->Write(chunk);
    for (int64_t a = s.range.begin; ok && a < s.range.end; a += kChunkElements) {
      const int64_t n = std::min(kChunkElements, s.range.end - a);
      chunk.Clear();
      chunk.set_offset(a);
      chunk.set_params(reinterpret_cast<const char*>(params + a), n * 4);
      if (has_state) {
        chunk.set_m(reinterpret_cast<const char*>(m + a), n * 4);
        chunk.set_v(reinterpret_cast<const char*>(v + a), n * 4);
      }
      ok = writer->Write(chunk);
    }
    writer->WritesDone();
    return s.Annotate(FromGrpcStatus(writer->Finish()), "init");
  });
}

absl::Status ParameterServers::ReadState(int64_t step, float* master, float* m, float* v) {
  return RunParallel(servers_.size(), [&](size_t i) -> absl::Status {
    const Server& s = *servers_[i];
    grpc::ClientContext ctx;
    SetDeadline(ctx, config_.rpc_timeout);
    v1::ReadShardStateRequest request;
    request.set_job_id(config_.job_id);
    request.set_attempt(config_.attempt);
    request.set_step(step);
    request.set_chunk_elements(kChunkElements);
    auto reader = s.stub->ReadShardState(&ctx, request);
    v1::ShardStateChunk chunk;
    int64_t received = 0;
    while (reader->Read(&chunk)) {
      const int64_t n = static_cast<int64_t>(chunk.params().size()) / 4;
      if (chunk.offset() < s.range.begin || chunk.offset() + n > s.range.end ||
          chunk.m().size() != chunk.params().size() || chunk.v().size() != chunk.params().size()) {
        ctx.TryCancel();
        reader->Finish();
        return absl::InternalError(
            absl::StrCat("parameter server ", s.range.address, " sent a malformed state chunk"));
      }
      std::memcpy(master + chunk.offset(), chunk.params().data(), n * 4);
      std::memcpy(m + chunk.offset(), chunk.m().data(), n * 4);
      std::memcpy(v + chunk.offset(), chunk.v().data(), n * 4);
      received += n;
    }
    RETURN_IF_ERROR(s.Annotate(FromGrpcStatus(reader->Finish()), "read state"));
    if (received != s.range.end - s.range.begin) {
      return absl::InternalError(absl::StrCat("parameter server ", s.range.address, " sent ",
                                              received, " of ", s.range.end - s.range.begin,
                                              " state elements"));
    }
    return absl::OkStatus();
  });
}

std::string ParameterServers::TransportSummary() const {
  std::string out;
  for (const auto& s : servers_) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", s->range.address, ": ",
                    s->data_plane ? absl::StrCat("data plane ", s->data_plane->address(),
                                                 s->data_plane->tls() ? " over TLS" : "")
                                  : absl::StrCat("gRPC (", s->transport_note, ")"));
  }
  return out;
}

std::string ParameterServers::TcpCongestionInUse() const {
  return ps::TcpCongestionInUse(config_.tcp_congestion);
}

}  // namespace trainyard::trainer
