// GPUs confined on cgroup v2, where there is no devices controller: a BPF_PROG_TYPE_CGROUP_DEVICE
// program attached to a rank's cgroup answers each open (and mknod) of a device file by its
// type, major and minor, as runc and systemd's DeviceAllow= do. The program trainyard loads
// denies the devices of the rank's limits (the GPUs that are not its own: "c 195:1 rwm", the v1
// devices.deny rules) and allows every other, so it narrows whatever the host's own programs on
// the cgroup's parents allow (attached with BPF_F_ALLOW_MULTI: every program on the path must
// allow). No libbpf: the program is a dozen instructions assembled here and loaded with bpf(2).
#ifndef TRAINYARD_WORKER_DAEMON_DEVICE_FILTER_H_
#define TRAINYARD_WORKER_DAEMON_DEVICE_FILTER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace trainyard::worker {

// Sets the device program of the v2 cgroup folder `dir`: its own device programs (a reused
// folder's, an earlier rank's denials) are detached first; then, when `denied` names devices
// ("c MAJOR:MINOR rwm" or "b ..."), one that denies them is attached. INVALID_ARGUMENT for a rule
// of another shape; the kernel's reason when it refuses. With nothing to deny, a kernel or
// process that cannot list the folder's programs is not an error (none of ours is there).
absl::Status SetDeviceFilter(const std::string& dir, const std::vector<std::string>& denied);

// Whether this process can load a device program (root or CAP_BPF and CAP_SYS_ADMIN, a kernel
// with CONFIG_CGROUP_BPF); the reason when not.
absl::Status CheckDeviceFilters();

}  // namespace trainyard::worker

#endif  // TRAINYARD_WORKER_DAEMON_DEVICE_FILTER_H_
