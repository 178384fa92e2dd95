#include "server/coordinator/auth_throttle.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/log_text.h"

namespace trainyard::coordinator {

double AuthThrottle::Level(const Bucket& b, absl::Time now) const {
  const double refill = absl::ToDoubleSeconds(now - b.updated) * options_.per_second;
  return std::min(options_.burst, b.tokens + std::max(0.0, refill));
}

absl::Status AuthThrottle::Admit(const std::string& key) const {
  if (options_.burst <= 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  auto it = buckets_.find(key);
  if (it == buckets_.end()) return absl::OkStatus();
  const double level = Level(it->second, clock_.Now());
  if (level >= 1) return absl::OkStatus();
  const int64_t retry_ms =
      static_cast<int64_t>(std::ceil((1 - level) / options_.per_second * 1000));
  return absl::ResourceExhaustedError(absl::StrCat("too many failed authentications for ",
                                                   Quoted(key), "; retry in ", retry_ms, " ms"));
}

void AuthThrottle::Failed(const std::string& key) {
  if (options_.burst <= 0) return;
  const absl::Time now = clock_.Now();
  absl::MutexLock lock(&mu_);
  auto it = buckets_.find(key);
  if (it == buckets_.end()) {
    if (buckets_.size() >= options_.max_keys) {
      // Forget the buckets that have refilled; if none has, the one updated longest ago.
      for (auto b = buckets_.begin(); b != buckets_.end();) {
        b = Level(b->second, now) >= options_.burst ? buckets_.erase(b) : std::next(b);
      }
      if (buckets_.size() >= options_.max_keys) {
        buckets_.erase(std::min_element(
            buckets_.begin(), buckets_.end(),
            [](const auto& a, const auto& b) { return a.second.updated < b.second.updated; }));
      }
    }
    it = buckets_.emplace(key, Bucket{options_.burst, now}).first;
  }
  Bucket& b = it->second;
  b.tokens = std::max(0.0, Level(b, now) - 1);
  b.updated = now;
}

size_t AuthThrottle::tracked_keys() const {
  absl::MutexLock lock(&mu_);
  return buckets_.size();
}

}  // namespace trainyard::coordinator
