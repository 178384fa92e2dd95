// The ranks of one node's placement (v1::RankPlacement, v1::Assignment): R = `ranks`, or one per
// device when it is 0; R is a multiple of the devices, which the node's ranks share in order (local
// ranks 0..R/D-1 on the first device, and so on: torchrun's --nproc-per-node with several
// processes per GPU or CPU slot). Header-only; pure.
#ifndef TRAINYARD_COMMON_PLACEMENT_H_
#define TRAINYARD_COMMON_PLACEMENT_H_

namespace trainyard {

// Ranks on the node of `p` (a RankPlacement or an Assignment).
template <typename P>
int RanksOf(const P& p) {
  return p.ranks() > 0 ? p.ranks() : p.device_indices_size();
}

// The device index of local rank `local` (0 <= local < RanksOf(p)).
template <typename P>
int DeviceOfRank(const P& p, int local) {
  const int devices = p.device_indices_size();
  if (devices == 0) return 0;
  const int per_device = RanksOf(p) / devices;
  return p.device_indices(per_device > 0 ? local / per_device : local);
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_PLACEMENT_H_
