// CoordinatorStore (see coordinator_store.h): each c10d::Store call is one RendezvousService RPC.
#include "worker/trainer/coordinator_store.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace trainyard::trainer {
namespace {

std::string ToString(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> ToBytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// Non-blocking calls: a generous bound so a dead coordinator does not hang a rank forever.
constexpr std::chrono::milliseconds kUnaryTimeout = std::chrono::seconds(30);

}  // namespace

CoordinatorStore::CoordinatorStore(std::shared_ptr<grpc::Channel> channel, std::string job_id,
                                   int attempt, std::chrono::milliseconds timeout)
    : c10d::Store(timeout), stub_(v1::RendezvousService::NewStub(channel)) {
  scope_.set_job_id(std::move(job_id));
  scope_.set_attempt(attempt);
}

void CoordinatorStore::Prepare(grpc::ClientContext& ctx, std::chrono::milliseconds timeout) const {
  ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
  // Ranks may start before the coordinator's port accepts: wait for the channel, within the
  // deadline, instead of failing at once.
  ctx.set_wait_for_ready(true);
}

void CoordinatorStore::Check(const grpc::Status& s, const char* call,
                             const std::string& key) const {
  if (s.ok()) return;
  TORCH_CHECK(false, "rendezvous ", call, "('", key, "') for ", scope_.job_id(), " attempt ",
              scope_.attempt(), " failed: ", s.error_code(), ": ", s.error_message());
}

std::chrono::milliseconds CoordinatorStore::EffectiveTimeout(
    std::chrono::milliseconds timeout) const {
  return timeout == kNoTimeout ? std::chrono::milliseconds(std::chrono::seconds(30)) : timeout;
}

void CoordinatorStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  grpc::ClientContext ctx;
  Prepare(ctx, kUnaryTimeout);
  v1::SetRequest r;
  *r.mutable_scope() = scope_;
  r.set_key(key);
  r.set_value(ToString(value));
  v1::SetResponse resp;
  Check(stub_->Set(&ctx, r, &resp), "Set", key);
}

std::vector<uint8_t> CoordinatorStore::compareSet(const std::string& key,
                                                  const std::vector<uint8_t>& expected,
                                                  const std::vector<uint8_t>& desired) {
  grpc::ClientContext ctx;
  Prepare(ctx, kUnaryTimeout);
  v1::CompareSetRequest r;
  *r.mutable_scope() = scope_;
  r.set_key(key);
  r.set_expected(ToString(expected));
  r.set_desired(ToString(desired));
  v1::CompareSetResponse resp;
  Check(stub_->CompareSet(&ctx, r, &resp), "CompareSet", key);
  return ToBytes(resp.value());
}

std::vector<uint8_t> CoordinatorStore::get(const std::string& key) {
  const std::chrono::milliseconds timeout = EffectiveTimeout(timeout_);
  grpc::ClientContext ctx;
  Prepare(ctx, timeout);
  v1::GetRequest r;
  *r.mutable_scope() = scope_;
  r.set_key(key);
  r.set_timeout_ms(timeout.count());
  v1::GetResponse resp;
  Check(stub_->Get(&ctx, r, &resp), "Get", key);
  return ToBytes(resp.value());
}

int64_t CoordinatorStore::add(const std::string& key, int64_t value) {
  grpc::ClientContext ctx;
  Prepare(ctx, kUnaryTimeout);
  v1::AddRequest r;
  *r.mutable_scope() = scope_;
  r.set_key(key);
  r.set_delta(value);
  v1::AddResponse resp;
  Check(stub_->Add(&ctx, r, &resp), "Add", key);
  return resp.value();
}

bool CoordinatorStore::deleteKey(const std::string& key) {
  grpc::ClientContext ctx;
  Prepare(ctx, kUnaryTimeout);
  v1::DeleteKeyRequest r;
  *r.mutable_scope() = scope_;
  r.set_key(key);
  v1::DeleteKeyResponse resp;
  Check(stub_->DeleteKey(&ctx, r, &resp), "DeleteKey", key);
  return resp.deleted();
}

bool CoordinatorStore::check(const std::vector<std::string>& keys) {
  grpc::ClientContext ctx;
  Prepare(ctx, kUnaryTimeout);
  v1::CheckRequest r;
  *r.mutable_scope() = scope_;
  for (const auto& k : keys) r.add_keys(k);
  v1::CheckResponse resp;
  Check(stub_->Check(&ctx, r, &resp), "Check", keys.empty() ? "" : keys.front());
  return resp.all_present();
}

int64_t CoordinatorStore::getNumKeys() {
  grpc::ClientContext ctx;
  Prepare(ctx, kUnaryTimeout);
  v1::NumKeysRequest r;
  *r.mutable_scope() = scope_;
  v1::NumKeysResponse resp;
  Check(stub_->NumKeys(&ctx, r, &resp), "NumKeys", "");
  return resp.num_keys();
}

void CoordinatorStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void CoordinatorStore::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  const std::chrono::milliseconds t = EffectiveTimeout(timeout);
  grpc::ClientContext ctx;
  Prepare(ctx, t);
  v1::WaitRequest r;
  *r.mutable_scope() = scope_;
  for (const auto& k : keys) r.add_keys(k);
  r.set_timeout_ms(t.count());
  v1::WaitResponse resp;
  Check(stub_->Wait(&ctx, r, &resp), "Wait", keys.empty() ? "" : keys.front());
}

void CoordinatorStore::Barrier(const std::string& name, int rank, int world_size) {
  const std::chrono::milliseconds t = EffectiveTimeout(timeout_);
  grpc::ClientContext ctx;
  Prepare(ctx, t);
  v1::BarrierRequest r;
  *r.mutable_scope() = scope_;
  r.set_name(name);
  r.set_rank(rank);
  r.set_world_size(world_size);
  r.set_timeout_ms(t.count());
  v1::BarrierResponse resp;
  Check(stub_->Barrier(&ctx, r, &resp), "Barrier", name);
}

}  // namespace trainyard::trainer
