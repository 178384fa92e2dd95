#include "server/ps/ps_service.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "rpc/ps/data_plane_wire.h"
#include "rpc/ps/ps_wire.h"

namespace trainyard::ps {
namespace {

// The generated service's methods, in the order of ps.proto (the index MarkMethodStreamed takes).
constexpr int kPushGradientsIndex = 1;
constexpr int kUpdateAndPullIndex = 2;

absl::Status CheckChunkElements(int64_t n) {
  if (n < 0 || n > kMaxChunkElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_elements: ", n, " is not in [0, ", kMaxChunkElements, "]"));
  }
  return absl::OkStatus();
}

// The call's deadline; InfiniteFuture for none.
absl::Time CallDeadline(const grpc::ServerContext& ctx) {
  const auto deadline = ctx.deadline();
  return deadline == std::chrono::system_clock::time_point::max() ? absl::InfiniteFuture()
                                                                  : absl::FromChrono(deadline);
}

// A slice that sends the lent parameters from where the shard holds them; gRPC returns them to
// the shard (destroying `lent`) once the bytes are written to the socket.
grpc::Slice LentSlice(std::unique_ptr<ShardManager::LentParams> lent) {
  ShardManager::LentParams* p = lent.release();
  return grpc::Slice(
      const_cast<char*>(p->data()), p->bytes(),
      [](void* user_data) { delete static_cast<ShardManager::LentParams*>(user_data); }, p);
}

}  // namespace

ParameterServiceImpl::ParameterServiceImpl(ShardManager& shards, PsMetrics metrics,
                                           std::string data_plane_address,
                                           JobAuthorizer* authorizer, bool data_plane_tls)
    : shards_(shards),
      metrics_(metrics),
      data_plane_address_(std::move(data_plane_address)),
      data_plane_tls_(data_plane_tls),
      authorizer_(authorizer) {
  // The two bulk methods get handlers on byte buffers instead of the generated ones (the same
  // synchronous threads serve them). "Streamed" is gRPC's name for replacing a handler: the
  // server then treats the method as bidirectional streaming, which needs no change of clients.
  MarkMethodStreamed(
      kPushGradientsIndex,
      new grpc::internal::ClientStreamingHandler<ParameterServiceImpl, grpc::ByteBuffer,
                                                 v1::PushGradientsResponse>(
          [](ParameterServiceImpl* service, grpc::ServerContext* ctx,
             grpc::ServerReader<grpc::ByteBuffer>* reader, v1::PushGradientsResponse* response) {
            return service->PushGradientBuffers(ctx, reader, response);
          },
          this));
  MarkMethodStreamed(
      kUpdateAndPullIndex,
      new grpc::internal::SplitServerStreamingHandler<v1::UpdateAndPullRequest, grpc::ByteBuffer>(
          [this](grpc::ServerContext* ctx,
                 grpc::ServerSplitStreamer<v1::UpdateAndPullRequest, grpc::ByteBuffer>* stream) {
            v1::UpdateAndPullRequest request;
            if (!stream->Read(&request)) {
              return ToGrpcStatus(absl::InvalidArgumentError(
                  "UpdateAndPullRequest: none sent, or it does not parse"));
            }
            return UpdateAndPullBuffers(ctx, request, stream);
          }));
}

absl::Status ParameterServiceImpl::Authorize(const grpc::ServerContext& ctx,
                                             const std::string& job_id, int32_t attempt) const {
  if (authorizer_ == nullptr) return absl::OkStatus();
  return authorizer_->Authorize(CallCredential(ctx), job_id, attempt);
}

grpc::Status ParameterServiceImpl::InitShard(grpc::ServerContext* ctx,
                                             grpc::ServerReader<v1::InitShardChunk>* reader,
                                             v1::InitShardResponse* response) {
  v1::InitShardChunk chunk;
  if (!reader->Read(&chunk)) {
    return ToGrpcStatus(absl::InvalidArgumentError("header: the stream carried no message"));
  }
  if (!chunk.has_header()) {
    return ToGrpcStatus(absl::InvalidArgumentError("header: missing from the first message"));
  }
  const v1::InitShardChunk::Header header = chunk.header();
  if (absl::Status s = Authorize(*ctx, header.job_id(), header.attempt()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (absl::Status s = shards_.BeginInit(header); !s.ok()) return ToGrpcStatus(s);
  do {
    if (chunk.params().empty() && chunk.m().empty() && chunk.v().empty()) continue;
    absl::Status s = shards_.InitChunk(header.job_id(), header.attempt(), chunk.offset(),
                                       chunk.params(), chunk.m(), chunk.v());
    if (!s.ok()) {
      shards_.Drop(header.job_id());  // a half-initialized shard is useless; free its memory
      return ToGrpcStatus(s);
    }
  } while (reader->Read(&chunk));
  if (absl::Status s = shards_.FinishInit(header.job_id(), header.attempt()); !s.ok()) {
    shards_.Drop(header.job_id());
    return ToGrpcStatus(s);
  }
  response->set_reserved_bytes((header.end() - header.begin()) * kBytesPerParam);
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::PushGradientBuffers(grpc::ServerContext* ctx,
                                                       grpc::ServerReader<grpc::ByteBuffer>* reader,
                                                       v1::PushGradientsResponse* response) {
  grpc::ByteBuffer message;
  std::string authorized_job;  // the (job, attempt) the stream's credential was checked for
  int32_t authorized_attempt = 0;
  while (reader->Read(&message)) {
    auto chunk = DecodeGradientChunk(message);
    if (!chunk.ok()) return ToGrpcStatus(chunk.status());
    if (chunk->job_id != authorized_job || chunk->attempt != authorized_attempt) {
      if (absl::Status s = Authorize(*ctx, chunk->job_id, chunk->attempt); !s.ok()) {
        return ToGrpcStatus(s);
      }
      authorized_job = chunk->job_id;
      authorized_attempt = chunk->attempt;
    }
    const double bytes = static_cast<double>(chunk->data.size());
    // The received slices are staged as they are: no copy.
    auto r = shards_.Push(chunk->job_id, chunk->attempt, chunk->step, chunk->offset, chunk->format,
                          std::move(chunk->data));
    if (!r.ok()) return ToGrpcStatus(r.status());
    if (metrics_.pushed_bytes != nullptr) metrics_.pushed_bytes->Increment(bytes);
    response->set_elements_staged(response->elements_staged() + r->staged);
    response->set_elements_duplicate(response->elements_duplicate() + r->duplicate);
  }
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::UpdateAndPullBuffers(
    grpc::ServerContext* ctx, const v1::UpdateAndPullRequest& request,
    grpc::ServerSplitStreamer<v1::UpdateAndPullRequest, grpc::ByteBuffer>* writer) {
  if (absl::Status s = Authorize(*ctx, request.job_id(), request.attempt()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (absl::Status s = CheckChunkElements(request.chunk_elements()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (request.begin() >= request.end()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("begin/end: [", request.begin(), ", ", request.end(), ") is empty")));
  }
  const v1::WireFormat format = NormalizedWireFormat(request.format());
  if (request.has_update()) {
    const absl::Time start = absl::Now();
    absl::Status s = shards_.Update(
        request.job_id(), request.attempt(), request.step(), request.begin(), request.end(),
        request.update().lr(), request.update().grad_scale(), LentWaitDeadline(CallDeadline(*ctx)));
    if (!s.ok()) return ToGrpcStatus(s);
    if (metrics_.adam_step_seconds != nullptr) {
      metrics_.adam_step_seconds->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    }
  }
  const int64_t chunk =
      request.chunk_elements() > 0 ? request.chunk_elements() : kDefaultChunkElements;
  const absl::Duration wait =
      request.wait_ms() > 0 ? absl::Milliseconds(request.wait_ms()) : absl::ZeroDuration();
  for (int64_t a = request.begin(); a < request.end(); a += chunk) {
    const int64_t b = std::min(request.end(), a + chunk);
    auto lent =
        shards_.LendParams(request.job_id(), request.attempt(), request.step(), a, b, format, wait);
    if (!lent.ok()) return ToGrpcStatus(lent.status());
    grpc::Slice data = LentSlice(*std::move(lent));
    if (metrics_.pulled_bytes != nullptr) metrics_.pulled_bytes->Increment(data.size());
    if (!writer->Write(EncodeParameterChunk(a, format, std::move(data)))) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
  }
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::ReadShardState(grpc::ServerContext* ctx,
                                                  const v1::ReadShardStateRequest* request,
                                                  grpc::ServerWriter<v1::ShardStateChunk>* writer) {
  if (absl::Status s = Authorize(*ctx, request->job_id(), request->attempt()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (absl::Status s = CheckChunkElements(request->chunk_elements()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  auto range = shards_.RangeOf(request->job_id(), request->attempt());
  if (!range.ok()) return ToGrpcStatus(range.status());
  const int64_t chunk =
      request->chunk_elements() > 0 ? request->chunk_elements() : kDefaultChunkElements;
  v1::ShardStateChunk out;
  for (int64_t a = range->first; a < range->second; a += chunk) {
    const int64_t b = std::min(range->second, a + chunk);
    absl::Status s =
        shards_.ReadState(request->job_id(), request->attempt(), request->step(), a, b, &out);
    if (!s.ok()) return ToGrpcStatus(s);
    if (!writer->Write(out)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::DropJob(grpc::ServerContext* ctx,
                                           const v1::DropJobRequest* request,
                                           v1::DropJobResponse* response) {
  if (request->job_id().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("job_id: empty"));
  }
  if (absl::Status s = Authorize(*ctx, request->job_id(), 0); !s.ok()) return ToGrpcStatus(s);
  response->set_dropped(shards_.Drop(request->job_id()));
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::ListShards(grpc::ServerContext* ctx,
                                              const v1::ListShardsRequest* request,
                                              v1::ListShardsResponse* response) {
  *response = shards_.List();
  return grpc::Status::OK;
}

grpc::Status ParameterServiceImpl::GetDataPlane(grpc::ServerContext* ctx,
                                                const v1::GetDataPlaneRequest* request,
                                                v1::DataPlaneInfo* response) {
  if (!data_plane_address_.empty()) {
    response->set_address(data_plane_address_);
    response->set_version(kDataPlaneVersion);
    response->set_tls(data_plane_tls_);
  }
  return grpc::Status::OK;
}

}  // namespace trainyard::ps
