#include "server/coordinator/fair_share.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/time/time.h"

namespace trainyard::coordinator {

UsageLedger::UsageLedger(absl::Duration half_life)
    : half_life_(half_life > absl::ZeroDuration() ? half_life : absl::Hours(24 * 7)) {}

double UsageLedger::Decayed(const Entry& entry, absl::Time now) const {
  if (now <= entry.as_of) return entry.value;
  return entry.value * std::exp2(-absl::FDivDuration(now - entry.as_of, half_life_));
}

void UsageLedger::Charge(const std::string& key, double device_seconds, absl::Time now) {
  Entry& entry = entries_.try_emplace(key, Entry{0, now}).first->second;
  entry.value = Decayed(entry, now);
  entry.as_of = std::max(entry.as_of, now);
  if (device_seconds > 0 && std::isfinite(device_seconds)) entry.value += device_seconds;
}

double UsageLedger::At(const std::string& key, absl::Time now) const {
  const auto it = entries_.find(key);
  return it == entries_.end() ? 0 : Decayed(it->second, now);
}

void UsageLedger::Restore(const std::string& key, Entry entry) {
  if (!(entry.value >= 0) || !std::isfinite(entry.value)) entry.value = 0;
  entries_[key] = entry;
}

}  // namespace trainyard::coordinator
