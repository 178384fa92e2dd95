#include "server/coordinator/ps_placement.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace trainyard::coordinator {

absl::StatusOr<std::vector<v1::PsRange>> PlaceOnParameterServers(
    int64_t total_params, int64_t bytes_per_param, const std::vector<PsCapacity>& servers) {
  if (total_params <= 0 || bytes_per_param <= 0) {
    return absl::InvalidArgumentError("nothing to place");
  }
  std::vector<int64_t> cap(servers.size());
  int64_t free_params = 0;
  for (size_t i = 0; i < servers.size(); ++i) {
    cap[i] = std::max<int64_t>(0, servers[i].free_bytes) / bytes_per_param;
    free_params += cap[i];
  }
  if (free_params < total_params) {
    return absl::ResourceExhaustedError(
        absl::StrCat(total_params, " parameters need ", total_params * bytes_per_param,
                     " bytes on parameter servers; ", servers.size(), " server(s) have ",
                     free_params * bytes_per_param, " free"));
  }
  // Water-filling: visit servers from the smallest capacity up; each takes an equal share of
  // what is left, or everything it can hold if that is less.
  std::vector<size_t> order(servers.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cap[a] < cap[b]; });
  std::vector<int64_t> share(servers.size(), 0);
  int64_t left = total_params;
  for (size_t k = 0; k < order.size(); ++k) {
    const int64_t servers_left = static_cast<int64_t>(order.size() - k);
    const int64_t even = (left + servers_left - 1) / servers_left;
    share[order[k]] = std::min(cap[order[k]], std::min(even, left));
    left -= share[order[k]];
  }
  std::vector<v1::PsRange> ranges;
  int64_t next = 0;
  for (size_t i = 0; i < servers.size(); ++i) {
    if (share[i] == 0) continue;
    v1::PsRange r;
    r.set_node_id(servers[i].node_id);
    r.set_address(servers[i].address);
    r.set_begin(next);
    r.set_end(next + share[i]);
    next += share[i];
    ranges.push_back(std::move(r));
  }
  return ranges;
}

}  // namespace trainyard::coordinator
