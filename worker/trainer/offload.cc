// OffloadOptimizer (see offload.h).
#include "worker/trainer/offload.h"

#include <grpcpp/grpcpp.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/ps/data_plane_client.h"
#include "server/ps/ps_client.h"
#include "server/ps/tcp_congestion.h"
#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard::trainer {
namespace {

constexpr int64_t kChunkElements = int64_t{1} << 20;  // 4 MiB fp32 messages
constexpr int kMaxMessageBytes = 64 << 20;

std::string StateKey(const torch::Tensor& p) {
  return c10::guts::to_string(p.unsafeGetTensorImpl());
}

// Runs fn(i) for each i in [0, n) on its own thread; the first error wins.
absl::Status RunParallel(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i] = fn(i); });
  for (auto& t : threads) t.join();
  for (auto& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Every call to a parameter server has a deadline (OffloadConfig::rpc_timeout).
void SetDeadline(grpc::ClientContext& ctx, absl::Duration timeout) {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

struct OffloadOptimizer::Server {
  PsRangeRef range;
  std::unique_ptr<v1::ParameterServerService::Stub> stub;
  // The same channel for the bulk calls, on byte buffers (server/ps/ps_client.h).
  std::unique_ptr<grpc::GenericStub> generic;
  // The server's TCP data plane, which carries pushes and pulls when set.
  std::unique_ptr<ps::DataPlaneClient> data_plane;
  std::string transport_note;  // why gRPC carries them otherwise

  // Asks the server for its data plane (OffloadConfig::transport "tcp").
  absl::Status ConnectDataPlane(const OffloadConfig& config) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, config.rpc_timeout);
    v1::DataPlaneInfo info;
    const grpc::Status st = stub->GetDataPlane(&ctx, v1::GetDataPlaneRequest(), &info);
    if (st.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      transport_note = "the server has no data plane (an older trainyard-ps)";
      return absl::OkStatus();
    }
    if (!st.ok()) return Annotate(st, "data plane");
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
    data_plane = std::make_unique<ps::DataPlaneClient>(*address, config.tcp_congestion);
    return absl::OkStatus();
  }

  // The two bulk calls, over the data plane when there is one, else gRPC; `data` / `out` hold
  // the elements of the call's range.
  absl::Status Push(const v1::GradientChunk& header, const float* data, int64_t begin, int64_t end,
                    absl::Duration timeout) const {
    v1::PushGradientsResponse response;
    const absl::Status st =
        data_plane ? data_plane->Push(header, data, begin, end, kChunkElements, timeout, &response)
                   : FromGrpcStatus(ps::PushGradientsZeroCopy(*generic, header, data, begin, end,
                                                              kChunkElements, timeout, &response));
    return st.ok() ? st : Annotate(st, "push");
  }
  absl::Status UpdateAndPull(const v1::UpdateAndPullRequest& request, float* out,
                             absl::Duration timeout) const {
    const absl::Status st =
        data_plane ? data_plane->UpdateAndPull(request, out, timeout)
                   : FromGrpcStatus(ps::UpdateAndPullZeroCopy(*generic, request, out, timeout));
    return st.ok() ? st : Annotate(st, "update and pull");
  }

  absl::Status Annotate(const absl::Status& s, const char* what) const {
    return absl::Status(
        s.code(), absl::StrCat("parameter server ", range.address, " (", what, "): ", s.message()));
  }

  absl::Status Annotate(const grpc::Status& s, const char* what) const {
    return Annotate(FromGrpcStatus(s), what);
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

class OffloadOptimizer::Hook : public torch::autograd::FunctionPostHook {
 public:
  Hook(OffloadOptimizer* owner, int param) : owner_(owner), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    owner_->MarkReady(param_);
    return outputs;
  }

 private:
  OffloadOptimizer* owner_;
  int param_;
};

OffloadOptimizer::OffloadOptimizer(std::vector<torch::Tensor> params, Communicator& comm,
                                   OffloadConfig config)
    : params_(std::move(params)), comm_(comm), config_(std::move(config)) {}

OffloadOptimizer::~OffloadOptimizer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (pusher_.joinable()) pusher_.join();
}

absl::StatusOr<std::unique_ptr<OffloadOptimizer>> OffloadOptimizer::Create(
    std::vector<torch::Tensor> params, Communicator& comm, std::vector<PsRangeRef> ranges,
    OffloadConfig config, double bucket_mb) {
  std::unique_ptr<OffloadOptimizer> o(
      new OffloadOptimizer(std::move(params), comm, std::move(config)));
  for (const auto& p : o->params_) {
    o->offsets_.push_back(o->total_);
    o->total_ += p.numel();
  }
  if (ranges.empty() || ranges.back().end != o->total_) {
    return absl::InvalidArgumentError(absl::StrCat("--ps: the ranges cover ",
                                                   ranges.empty() ? 0 : ranges.back().end,
                                                   " parameters but the model has ", o->total_));
  }
  if (o->config_.transport != "tcp" && o->config_.transport != "grpc") {
    return absl::InvalidArgumentError(
        absl::StrCat("--ps-transport: '", o->config_.transport, "' is neither tcp nor grpc"));
  }
  const int world = comm.world_size();
  o->slice_ = (o->total_ + world - 1) / world;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  RETURN_IF_ERROR(ps::CheckTcpCongestion(o->config_.tcp_congestion, "--ps-tcp-congestion"));
  ps::SetTcpCongestion(&args, o->config_.tcp_congestion);
  for (PsRangeRef& r : ranges) {
    auto server = std::make_unique<Server>();
    auto channel = grpc::CreateCustomChannel(r.address, grpc::InsecureChannelCredentials(), args);
    server->stub = v1::ParameterServerService::NewStub(channel);
    server->generic = std::make_unique<grpc::GenericStub>(channel);
    server->range = std::move(r);
    if (o->config_.transport == "tcp") {
      RETURN_IF_ERROR(server->ConnectDataPlane(o->config_));
    } else {
      server->transport_note = "--ps-transport grpc";
    }
    o->servers_.push_back(std::move(server));
  }
  // Buckets in reverse registration order (the order backward produces gradients), as DDP's:
  // each a contiguous range of the flat vector of about bucket_mb.
  const int n = static_cast<int>(o->params_.size());
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20)) / 4);
  o->bucket_of_.assign(n, 0);
  for (int i = n - 1; i >= 0; --i) {
    const int64_t numel = o->params_[i].numel();
    if (o->buckets_.empty() || (o->buckets_.back().end - o->buckets_.back().begin > 0 &&
                                o->buckets_.back().end - o->buckets_.back().begin + numel > cap)) {
      Bucket b;
      b.end = o->offsets_[i] + numel;
      b.begin = b.end;
      b.last_param = i;
      o->buckets_.push_back(b);
    }
    Bucket& b = o->buckets_.back();
    b.begin = o->offsets_[i];
    b.first_param = i;
    o->bucket_of_[i] = static_cast<int>(o->buckets_.size()) - 1;
  }
  o->grads_ = torch::zeros({o->total_}, torch::kFloat);
  o->ready_.assign(n, false);
  for (int i = 0; i < n; ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(o->params_[i]);
    o->hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<Hook>(o.get(), i)));
    o->accumulators_.push_back(std::move(accumulator));
  }
  o->pusher_ = std::thread([raw = o.get()] { raw->PusherLoop(); });
  return o;
}

void OffloadOptimizer::Prepare(bool sync, int64_t step) {
  sync_ = sync;
  step_ = step;
  if (!sync) return;
  std::fill(ready_.begin(), ready_.end(), false);
  for (Bucket& b : buckets_) b.pending = b.last_param - b.first_param + 1;
  next_launch_ = 0;
  pushed_bytes_ = 0;
}

void OffloadOptimizer::MarkReady(int param) {
  if (!sync_ || ready_[param]) return;
  ready_[param] = true;
  const torch::Tensor& grad = params_[param].grad();
  torch::NoGradGuard no_grad;
  grads_.narrow(0, offsets_[param], grad.numel()).copy_(grad.reshape({-1}));
  --buckets_[bucket_of_[param]].pending;
  LaunchReady();
}

void OffloadOptimizer::LaunchReady() {
  while (next_launch_ < num_buckets() && buckets_[next_launch_].pending == 0) {
    Task task;
    task.bucket = next_launch_;
    task.step = step_;
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
    ++tasks_queued_;
    ++next_launch_;
  }
}

void OffloadOptimizer::PusherLoop() {
  while (true) {
    Task task;
    bool failed;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](OffloadOptimizer* o)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(o->mu_) { return o->stop_ || !o->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());
      queue_.pop_front();
      failed = !push_status_.ok();
    }
    absl::Status s;
    try {
      if (failed) {
        // The step has failed already: another call to a server that timed out would only add
        // its deadline to the time until the rank reports the failure.
      } else if (task.update) {
        s = UpdateAndPull(task.step, task.lr, task.grad_scale, pending_slice_);
      } else {
        ReduceBucket(buckets_[task.bucket]);
        s = PushBucket(buckets_[task.bucket], task.step);
      }
    } catch (const std::exception& e) {
      s = absl::UnavailableError(absl::StrCat("gradient all-reduce failed: ", e.what()));
    }
    absl::MutexLock lock(&mu_);
    if (push_status_.ok()) push_status_ = s;
    ++tasks_done_;
  }
}

void OffloadOptimizer::ReduceBucket(const Bucket& bucket) {
  const int world = comm_.world_size();
  if (world == 1) return;
  // Each rank's part of the bucket, in rank order (the slices are consecutive).
  std::vector<int64_t> counts(world, 0);
  for (int r = 0; r < world; ++r) {
    const int64_t a = std::min(total_, r * slice_), b = std::min(total_, a + slice_);
    counts[r] = std::max<int64_t>(0, std::min(b, bucket.end) - std::max(a, bucket.begin));
  }
  torch::Tensor flat = grads_.narrow(0, bucket.begin, bucket.end - bucket.begin);
  torch::Tensor mine = comm_.ReduceScatterSum(flat, counts);  // a view into grads_
  mine.div_(world);
}

absl::Status OffloadOptimizer::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](OffloadOptimizer* o)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(o->mu_) { return o->tasks_done_ == o->tasks_queued_; },
      this));
  return push_status_;
}

void OffloadOptimizer::GatherIntoModel(const torch::Tensor& slice) {
  Unflatten(torch::cat(comm_.AllGather(slice)).narrow(0, 0, total_));
}

absl::Status OffloadOptimizer::PushBucket(const Bucket& bucket, int64_t step) {
  const auto [a, b] = OwnedSlice();
  const int64_t lo = std::max(a, bucket.begin), hi = std::min(b, bucket.end);
  std::vector<const Server*> targets;  // the servers holding part of [lo, hi)
  for (const auto& server : servers_) {
    if (std::max(lo, server->range.begin) < std::min(hi, server->range.end)) {
      targets.push_back(server.get());
    }
  }
  const auto push = [&](size_t i) -> absl::Status {
    const Server& s = *targets[i];
    const int64_t x0 = std::max(lo, s.range.begin), x1 = std::min(hi, s.range.end);
    // Sent from grads_ itself: it does not change until the push returns.
    v1::GradientChunk header;
    header.set_job_id(config_.job_id);
    header.set_attempt(config_.attempt);
    header.set_step(step);
    header.set_format(v1::WIRE_FP32);
    RETURN_IF_ERROR(s.Push(header, grads_.data_ptr<float>() + x0, x0, x1, config_.rpc_timeout));
    pushed_bytes_ += (x1 - x0) * 4;
    return absl::OkStatus();
  };
  // A bucket spanning several servers is pushed to them at once.
  return targets.size() == 1 ? push(0) : RunParallel(targets.size(), push);
}

absl::StatusOr<double> OffloadOptimizer::FinishBackward(double* waited_s) {
  {
    torch::NoGradGuard no_grad;
    for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
      if (ready_[i]) continue;
      torch::Tensor dst = grads_.narrow(0, offsets_[i], params_[i].numel());
      if (params_[i].grad().defined()) {
        dst.copy_(params_[i].grad().reshape({-1}));
      } else {
        dst.zero_();
      }
      ready_[i] = true;
      --buckets_[bucket_of_[i]].pending;
    }
  }
  LaunchReady();
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = Drain();
  if (waited_s != nullptr) {
    *waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  sync_ = false;
  // delayed_update: the previous step's parameters, pulled during this backward, join the model.
  if (status.ok() && pending_) {
    GatherIntoModel(pending_slice_);
    pending_ = false;
  }
  if (!status.ok()) return status;
  // Each rank has the mean gradients of its slice only: sum the squares over the ranks.
  const auto [a, b] = OwnedSlice();
  torch::Tensor sq =
      torch::full({1}, grads_.narrow(0, a, b - a).pow(2).sum().item<double>(), torch::kDouble);
  comm_.AllReduceSum({sq})->Wait();
  return std::sqrt(sq.item<double>());
}

std::string OffloadOptimizer::TransportSummary() const {
  std::string out;
  for (const auto& s : servers_) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", s->range.address, ": ",
                    s->data_plane ? absl::StrCat("data plane ", s->data_plane->address())
                                  : absl::StrCat("gRPC (", s->transport_note, ")"));
  }
  return out;
}

std::pair<int64_t, int64_t> OffloadOptimizer::OwnedSlice() const {
  const int64_t a = std::min(total_, comm_.rank() * slice_);
  return {a, std::min(total_, a + slice_)};
}

torch::Tensor OffloadOptimizer::Flatten() const {
  std::vector<torch::Tensor> parts;
  for (const auto& p : params_) parts.push_back(p.detach().reshape(-1));
  return torch::cat(parts).to(torch::kFloat).contiguous();
}

void OffloadOptimizer::Unflatten(const torch::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : params_) {
    p.copy_(flat.narrow(0, offset, p.numel()).view_as(p));
    offset += p.numel();
  }
}

absl::Status OffloadOptimizer::Initialize(int64_t step, torch::optim::Optimizer& shadow) {
  if (comm_.rank() == 0) {
    const torch::Tensor flat = Flatten();
    // After a resume the shadow optimizer holds m and v (a fresh one has no state).
    torch::Tensor m, v;
    bool has_state = !shadow.state().empty();
    if (has_state) {
      std::vector<torch::Tensor> ms, vs;
      for (const auto& p : params_) {
        auto it = shadow.state().find(StateKey(p));
        if (it == shadow.state().end()) {
          ms.push_back(torch::zeros({p.numel()}));
          vs.push_back(torch::zeros({p.numel()}));
          continue;
        }
        auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
        ms.push_back(st.exp_avg().reshape(-1));
        vs.push_back(st.exp_avg_sq().reshape(-1));
      }
      m = torch::cat(ms).contiguous();
      v = torch::cat(vs).contiguous();
    }
    RETURN_IF_ERROR(RunParallel(servers_.size(), [&](size_t i) -> absl::Status {
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
      h->set_total_params(total_);
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
        chunk.set_params(reinterpret_cast<const char*>(flat.data_ptr<float>() + a), n * 4);
        if (has_state) {
          chunk.set_m(reinterpret_cast<const char*>(m.data_ptr<float>() + a), n * 4);
          chunk.set_v(reinterpret_cast<const char*>(v.data_ptr<float>() + a), n * 4);
        }
        ok = writer->Write(chunk);
      }
      writer->WritesDone();
      const grpc::Status st = writer->Finish();
      return st.ok() ? absl::OkStatus() : s.Annotate(st, "init");
    }));
  }
  comm_.Barrier();  // no rank pushes before every shard is initialized
  return absl::OkStatus();
}

absl::Status OffloadOptimizer::UpdateAndPull(int64_t step, double lr, double grad_scale,
                                             torch::Tensor& mine) {
  const auto [a, b] = OwnedSlice();
  std::vector<int64_t> pulled(servers_.size(), 0);
  RETURN_IF_ERROR(RunParallel(servers_.size(), [&](size_t i) -> absl::Status {
    const Server& s = *servers_[i];
    const int64_t lo = std::max(a, s.range.begin), hi = std::min(b, s.range.end);
    if (lo >= hi) return absl::OkStatus();
    v1::UpdateAndPullRequest request;
    request.set_job_id(config_.job_id);
    request.set_attempt(config_.attempt);
    request.set_step(step);
    request.set_begin(lo);
    request.set_end(hi);
    request.mutable_update()->set_lr(static_cast<float>(lr));
    request.mutable_update()->set_grad_scale(static_cast<float>(grad_scale));
    request.set_format(v1::WIRE_FP32);
    request.set_chunk_elements(kChunkElements);
    // Received straight into this rank's slice (over gRPC: decoded from its buffers).
    RETURN_IF_ERROR(
        s.UpdateAndPull(request, mine.data_ptr<float>() + (lo - a), config_.rpc_timeout));
    pulled[i] = (hi - lo) * 4;
    return absl::OkStatus();
  }));
  int64_t total = 0;
  for (int64_t p : pulled) total += p;
  pulled_bytes_ = total;
  return absl::OkStatus();
}

absl::Status OffloadOptimizer::Step(double lr, double grad_scale) {
  if (!pending_slice_.defined()) pending_slice_ = torch::zeros({slice_});
  for (auto& p : params_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  if (config_.delayed_update) {
    Task task;
    task.update = true;
    task.step = step_;
    task.lr = lr;
    task.grad_scale = grad_scale;
    pending_ = true;
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
    ++tasks_queued_;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(UpdateAndPull(step_, lr, grad_scale, pending_slice_));
  GatherIntoModel(pending_slice_);
  return absl::OkStatus();
}

absl::Status OffloadOptimizer::Flush() {
  if (!pending_) return absl::OkStatus();
  RETURN_IF_ERROR(Drain());
  GatherIntoModel(pending_slice_);
  pending_ = false;
  return absl::OkStatus();
}

absl::Status OffloadOptimizer::ReadIntoShadow(int64_t step, torch::optim::Optimizer& shadow) {
  torch::Tensor master = torch::empty({total_}), m = torch::empty({total_}),
                v = torch::empty({total_});
  RETURN_IF_ERROR(RunParallel(servers_.size(), [&](size_t i) -> absl::Status {
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
      std::memcpy(master.data_ptr<float>() + chunk.offset(), chunk.params().data(), n * 4);
      std::memcpy(m.data_ptr<float>() + chunk.offset(), chunk.m().data(), n * 4);
      std::memcpy(v.data_ptr<float>() + chunk.offset(), chunk.v().data(), n * 4);
      received += n;
    }
    const grpc::Status st = reader->Finish();
    if (!st.ok()) return s.Annotate(st, "read state");
    if (received != s.range.end - s.range.begin) {
      return absl::InternalError(absl::StrCat("parameter server ", s.range.address, " sent ",
                                              received, " of ", s.range.end - s.range.begin,
                                              " state elements"));
    }
    return absl::OkStatus();
  }));
  Unflatten(master);
  int64_t offset = 0;
  for (const auto& p : params_) {
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(step);
    state->exp_avg(m.narrow(0, offset, p.numel()).view_as(p).clone());
    state->exp_avg_sq(v.narrow(0, offset, p.numel()).view_as(p).clone());
    shadow.state()[StateKey(p)] = std::move(state);
    offset += p.numel();
  }
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
