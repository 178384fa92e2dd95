#include "server/coordinator/submit_requests.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace trainyard::coordinator {

std::string SubmitRequests::Key(const std::string& owner, const std::string& request_id) {
  return absl::StrCat(owner, "/", request_id);
}

std::optional<SubmitRequests::Known> SubmitRequests::Find(const std::string& key, int64_t now_ms) {
  while (!expiry_.empty() && expiry_.begin()->first <= now_ms) {
    auto it = requests_.find(expiry_.begin()->second);
    if (it != requests_.end() && it->second.expires_ms <= now_ms) requests_.erase(it);
    expiry_.erase(expiry_.begin());
  }
  auto it = requests_.find(key);
  if (it == requests_.end()) return std::nullopt;
  return Known{it->second.job_id, it->second.durable};
}

void SubmitRequests::Load(const std::string& key, std::string job_id, int64_t expires_ms) {
  expiry_.emplace(expires_ms, key);
  requests_[key] = Request{std::move(job_id), true, expires_ms};
}

int64_t SubmitRequests::Start(const std::string& key, const std::string& job_id, int64_t now_ms) {
  const int64_t expires_ms = now_ms + absl::ToInt64Milliseconds(kLifetime);
  requests_[key] = Request{job_id, false, expires_ms};
  expiry_.emplace(expires_ms, key);
  return expires_ms;
}

void SubmitRequests::Stored(const std::string& key, const std::string& job_id, bool stored) {
  auto it = requests_.find(key);
  if (it == requests_.end() || it->second.job_id != job_id) return;
  if (stored) {
    it->second.durable = true;
  } else {
    requests_.erase(it);
  }
}

bool SubmitRequests::PruneStoreDue(int64_t now_ms) {
  if (now_ms - store_pruned_ms_ < 60'000) return false;
  store_pruned_ms_ = now_ms;
  return true;
}

}  // namespace trainyard::coordinator
