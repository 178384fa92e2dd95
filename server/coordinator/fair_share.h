// Decayed usage for fair share: device-seconds charged to a key (an account or a user), halved
// every `half_life` (as Slurm's PriorityDecayHalfLife), so that recent use counts more than old.
// Pure data: time comes in as arguments; no I/O, no locks (the owner serializes calls).
#ifndef TRAINYARD_SERVER_COORDINATOR_FAIR_SHARE_H_
#define TRAINYARD_SERVER_COORDINATOR_FAIR_SHARE_H_

#include <map>
#include <string>

#include "absl/time/time.h"

namespace trainyard::coordinator {

class UsageLedger {
 public:
  struct Entry {
    double value = 0;  // device-seconds as of `as_of`
    absl::Time as_of;
  };

  // `half_life` > 0; anything else reads as 7 days.
  explicit UsageLedger(absl::Duration half_life = absl::Hours(24 * 7));

  absl::Duration half_life() const { return half_life_; }
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
  std::map<std::string, Entry> entries_;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_FAIR_SHARE_H_
