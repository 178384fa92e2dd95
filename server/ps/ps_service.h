// ParameterServiceImpl: the gRPC adapter of a parameter server: translates
// trainyard.v1.ParameterServerService calls into ShardManager calls and counts bytes for metrics.
//
// PushGradients and UpdateAndPull, the bulk transfers, take and give gRPC's byte buffers
// (ps_wire.h): pushed gradients stay in the slices they arrived in and pulled parameters are sent
// from where the shard holds them (ShardManager::LendParams), lent until gRPC has written them.
// The others use the generated classes.
//
// The synchronous API on purpose: handlers block on AdamW updates (tens of milliseconds over big
// ranges) and on pulls waiting for a step, which the callback API's reactions must not do; the
// server's thread pool bounds the concurrency instead. Thread-safe.
#ifndef TRAINYARD_SERVER_PS_PS_SERVICE_H_
#define TRAINYARD_SERVER_PS_PS_SERVICE_H_

#include <prometheus/counter.h>
#include <prometheus/histogram.h>

#include <algorithm>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/ps/job_authorizer.h"
#include "server/ps/shard_manager.h"
#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard::ps {

// The longest an update waits for pulls still sending its range (a client that stopped reading
// them), whatever the call's deadline; the data plane's updates too.
inline constexpr absl::Duration kMaxLentWait = absl::Seconds(60);

// How long an update may wait for lent elements: until the caller's deadline, kMaxLentWait at
// most.
inline absl::Time LentWaitDeadline(absl::Time caller_deadline) {
  return std::min(absl::Now() + kMaxLentWait, caller_deadline);
}

struct PsMetrics {
  prometheus::Counter* pushed_bytes = nullptr;
  prometheus::Counter* pulled_bytes = nullptr;
  prometheus::Histogram* adam_step_seconds = nullptr;
};

class ParameterServiceImpl final : public v1::ParameterServerService::Service {
 public:
  // `shards` must outlive the service; `metrics` members may be null. `data_plane_address`:
  // what GetDataPlane answers (empty: no data plane). `authorizer` (null: admit every call)
  // decides the calls on a job's shard (InitShard, PushGradients, UpdateAndPull,
  // ReadShardState, DropJob) by the caller's job credential; ListShards and GetDataPlane are
  // open. It must outlive the service.
  // `data_plane_tls`: the data plane at `data_plane_address` speaks TLS (GetDataPlane says so).
  ParameterServiceImpl(ShardManager& shards, PsMetrics metrics, std::string data_plane_address = "",
                       JobAuthorizer* authorizer = nullptr, bool data_plane_tls = false);

  grpc::Status InitShard(grpc::ServerContext* ctx, grpc::ServerReader<v1::InitShardChunk>* reader,
                         v1::InitShardResponse* response) override;
  grpc::Status ReadShardState(grpc::ServerContext* ctx, const v1::ReadShardStateRequest* request,
                              grpc::ServerWriter<v1::ShardStateChunk>* writer) override;
  grpc::Status DropJob(grpc::ServerContext* ctx, const v1::DropJobRequest* request,
                       v1::DropJobResponse* response) override;
  grpc::Status ListShards(grpc::ServerContext* ctx, const v1::ListShardsRequest* request,
                          v1::ListShardsResponse* response) override;
  grpc::Status GetDataPlane(grpc::ServerContext* ctx, const v1::GetDataPlaneRequest* request,
                            v1::DataPlaneInfo* response) override;

 private:
  // The handlers of PushGradients and UpdateAndPull, on byte buffers.
  grpc::Status PushGradientBuffers(grpc::ServerContext* ctx,
                                   grpc::ServerReader<grpc::ByteBuffer>* reader,
                                   v1::PushGradientsResponse* response);
  grpc::Status UpdateAndPullBuffers(
      grpc::ServerContext* ctx, const v1::UpdateAndPullRequest& request,
      grpc::ServerSplitStreamer<v1::UpdateAndPullRequest, grpc::ByteBuffer>* writer);

  // OK if the call's job credential admits `job_id` attempt `attempt` (0: any).
  absl::Status Authorize(const grpc::ServerContext& ctx, const std::string& job_id,
                         int32_t attempt) const;

  ShardManager& shards_;
  const PsMetrics metrics_;
  const std::string data_plane_address_;
  const bool data_plane_tls_;
  JobAuthorizer* const authorizer_;  // null: every call
};

}  // namespace trainyard::ps

#endif  // TRAINYARD_SERVER_PS_PS_SERVICE_H_
