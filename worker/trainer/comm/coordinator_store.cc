// CoordinatorStore (see coordinator_store.h): each c10d::Store call is one RendezvousClient call.
#include "worker/trainer/comm/coordinator_store.h"

#include <c10/util/Exception.h>

#include "absl/status/statusor.h"

namespace trainyard::trainer {
namespace {

std::string ToString(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> ToBytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// c10d reports store failures as exceptions.
void ThrowIfError(const absl::Status& s) { TORCH_CHECK(s.ok(), std::string(s.message())); }
template <typename T>
T ValueOrThrow(absl::StatusOr<T> s) {
  ThrowIfError(s.status());
  return *std::move(s);
}

// The timeout to send: the store's, or 30 s when it has none.
std::chrono::milliseconds Effective(std::chrono::milliseconds timeout) {
  return timeout == c10d::Store::kNoTimeout ? std::chrono::milliseconds(std::chrono::seconds(30))
                                            : timeout;
}

}  // namespace

CoordinatorStore::CoordinatorStore(std::shared_ptr<RendezvousClient> client,
                                   std::chrono::milliseconds timeout)
    : c10d::Store(timeout), client_(std::move(client)) {}

#if TRAINYARD_TORCH2
c10::intrusive_ptr<c10d::Store> CoordinatorStore::clone() {
  return c10::make_intrusive<CoordinatorStore>(client_, timeout_);
}
#endif

void CoordinatorStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  ThrowIfError(client_->Set(key, ToString(value)));
}

std::vector<uint8_t> CoordinatorStore::compareSet(const std::string& key,
                                                  const std::vector<uint8_t>& expected,
                                                  const std::vector<uint8_t>& desired) {
  return ToBytes(ValueOrThrow(client_->CompareSet(key, ToString(expected), ToString(desired))));
}

std::vector<uint8_t> CoordinatorStore::get(const std::string& key) {
  return ToBytes(ValueOrThrow(client_->Get(key, Effective(timeout_))));
}

int64_t CoordinatorStore::add(const std::string& key, int64_t value) {
  return ValueOrThrow(client_->Add(key, value));
}

bool CoordinatorStore::deleteKey(const std::string& key) {
  return ValueOrThrow(client_->DeleteKey(key));
}

bool CoordinatorStore::check(const std::vector<std::string>& keys) {
  return ValueOrThrow(client_->Check(keys));
}

int64_t CoordinatorStore::getNumKeys() { return ValueOrThrow(client_->NumKeys()); }

void CoordinatorStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void CoordinatorStore::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  ThrowIfError(client_->Wait(keys, Effective(timeout)));
}

}  // namespace trainyard::trainer
