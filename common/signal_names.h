// The signals a user may send to a job's ranks (`yard signal`, JobService.SignalJob), by name:
// names travel between hosts, numbers differ between architectures. scancel --signal's set, less
// those that would only corrupt a rank (SEGV, BUS, ...).
#ifndef TRAINYARD_COMMON_SIGNAL_NAMES_H_
#define TRAINYARD_COMMON_SIGNAL_NAMES_H_

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace trainyard {

// The signal's number on this host, for "USR1", "SIGUSR1" or "usr1"; nullopt for any other.
std::optional<int> SignalNumber(absl::string_view name);

// The canonical name ("USR1") of a name SignalNumber takes; empty for any other.
std::string CanonicalSignalName(absl::string_view name);

// Whether `number` is one of those signals on this host.
bool IsUserSignal(int number);

// "HUP, INT, ...": the names taken, for errors and help.
std::string SignalNamesText();

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_SIGNAL_NAMES_H_
