#include "server/coordinator/fair_share.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/time/civil_time.h"
#include "absl/time/time.h"

namespace trainyard::coordinator {

std::optional<UsageReset> ParseUsageReset(const std::string& text) {
  if (text == "none") return UsageReset::kNone;
  if (text == "daily") return UsageReset::kDaily;
  if (text == "weekly") return UsageReset::kWeekly;
  if (text == "monthly") return UsageReset::kMonthly;
  return std::nullopt;
}

std::string UsageResetName(UsageReset reset) {
  switch (reset) {
    case UsageReset::kDaily:
      return "daily";
    case UsageReset::kWeekly:
      return "weekly";
    case UsageReset::kMonthly:
      return "monthly";
    case UsageReset::kNone:
      break;
  }
  return "none";
}

absl::Time PeriodStart(UsageReset reset, absl::Time t) {
  const absl::TimeZone utc = absl::UTCTimeZone();
  const absl::CivilDay day = absl::ToCivilDay(t, utc);
  switch (reset) {
    case UsageReset::kDaily:
      return absl::FromCivil(day, utc);
    case UsageReset::kWeekly:
      return absl::FromCivil(absl::PrevWeekday(day + 1, absl::Weekday::monday), utc);
    case UsageReset::kMonthly:
      return absl::FromCivil(absl::CivilMonth(day), utc);
    case UsageReset::kNone:
      break;
  }
  return absl::InfinitePast();
}

absl::Time NextReset(UsageReset reset, absl::Time t) {
  const absl::TimeZone utc = absl::UTCTimeZone();
  const absl::CivilDay day = absl::ToCivilDay(t, utc);
  switch (reset) {
    case UsageReset::kDaily:
      return absl::FromCivil(day + 1, utc);
    case UsageReset::kWeekly:
      return absl::FromCivil(absl::NextWeekday(day, absl::Weekday::monday), utc);
    case UsageReset::kMonthly:
      return absl::FromCivil(absl::CivilMonth(day) + 1, utc);
    case UsageReset::kNone:
      break;
  }
  return absl::InfiniteFuture();
}

std::optional<absl::Duration> TimeUntilEvenUsage(double behind_usage, double behind_share,
                                                 double behind_devices, double ahead_usage,
                                                 double ahead_share, double ahead_devices,
                                                 absl::Duration half_life) {
  if (!(behind_share > 0) || !(ahead_share > 0) || half_life <= absl::ZeroDuration()) {
    return std::nullopt;
  }
  // Per share, each usage goes u(t) = u0 e^(-kt) + (r/k)(1 - e^(-kt)) with k = ln 2 / half-life;
  // their difference d(t) = ahead - behind = (d0 - R) e^(-kt) + R, R = (r_ahead - r_behind)/k,
  // reaches 0 at t = ln((R - d0) / R) / k when R > 0.
  const double k = std::log(2.0) / absl::ToDoubleSeconds(half_life);
  const double d0 = ahead_usage / ahead_share - behind_usage / behind_share;
  if (d0 >= 0) return absl::ZeroDuration();
  const double r = (ahead_devices / ahead_share - behind_devices / behind_share) / k;
  if (!(r > 0)) return std::nullopt;
  const double seconds = std::log((r - d0) / r) / k;
  if (!std::isfinite(seconds)) return std::nullopt;
  return absl::Seconds(seconds);
}

UsageLedger::UsageLedger(absl::Duration half_life, UsageReset reset)
    : half_life_(half_life > absl::ZeroDuration() ? half_life : absl::Hours(24 * 7)),
      reset_(reset) {}

double UsageLedger::Decayed(const Entry& entry, absl::Time now) const {
  // A reset since the entry's time: it starts over (what was charged since is not in it).
  if (reset_ != UsageReset::kNone && PeriodStart(reset_, now) > entry.as_of) return 0;
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
