// Decayed usage for fair share: device-seconds charged to a key (an account or a user), halved
// every `half_life` (as Slurm's PriorityDecayHalfLife), so that recent use counts more than old,
// and optionally cleared at the start of every day, week or month (as Slurm's
// PriorityUsageResetPeriod). Pure data: time comes in as arguments; no I/O, no locks (the owner
// serializes calls).
#ifndef TRAINYARD_SERVER_COORDINATOR_FAIR_SHARE_H_
#define TRAINYARD_SERVER_COORDINATOR_FAIR_SHARE_H_

#include <map>
#include <optional>
#include <string>

#include "absl/time/time.h"

namespace trainyard::coordinator {

// When all usage starts over from zero (UTC): never, or at the start of each day, week (Monday)
// or month.
enum class UsageReset { kNone, kDaily, kWeekly, kMonthly };

// "none", "daily", "weekly", "monthly"; nullopt for anything else.
std::optional<UsageReset> ParseUsageReset(const std::string& text);
std::string UsageResetName(UsageReset reset);
// The start of the reset period holding `t` (InfinitePast for kNone) and of the next one
// (InfiniteFuture for kNone).
absl::Time PeriodStart(UsageReset reset, absl::Time t);
absl::Time NextReset(UsageReset reset, absl::Time t);

// How long until an account's usage per share (`behind_*`, the higher) is no longer above
// another's (`ahead_*`), if both keep running their current devices (device-seconds per second)
// and usage halves every `half_life`: how long the one ahead goes first by fair share. Zero if it
// is not ahead; nullopt if it stays ahead at these rates. Usage in device-seconds.
std::optional<absl::Duration> TimeUntilEvenUsage(double behind_usage, double behind_share,
                                                 double behind_devices, double ahead_usage,
                                                 double ahead_share, double ahead_devices,
                                                 absl::Duration half_life);

class UsageLedger {
 public:
  struct Entry {
    double value = 0;  // device-seconds as of `as_of`
    absl::Time as_of;
  };

  // `half_life` > 0; anything else reads as 7 days.
  explicit UsageLedger(absl::Duration half_life = absl::Hours(24 * 7),
                       UsageReset reset = UsageReset::kNone);

  absl::Duration half_life() const { return half_life_; }
  UsageReset reset() const { return reset_; }
  // Decays the key's usage to `now`, then adds `device_seconds` (>= 0; less is ignored).
  void Charge(const std::string& key, double device_seconds, absl::Time now);
  // The key's usage decayed to `now` (0 for a key never charged). A `now` before the last charge
  // reads as that charge's time (the clock never runs usage back up).
  double At(const std::string& key, absl::Time now) const;
  // Every key's entry, for saving; Restore puts one back (replacing what the key had).
  const std::map<std::string, Entry>& entries() const { return entries_; }
  void Restore(const std::string& key, Entry entry);

 private:
  double Decayed(const Entry& entry, absl::Time now) const;

  absl::Duration half_life_;
  UsageReset reset_;
  std::map<std::string, Entry> entries_;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_FAIR_SHARE_H_
