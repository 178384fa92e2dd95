#include "server/coordinator/job_watchers.h"

#include <algorithm>
#include <utility>

namespace trainyard::coordinator {

int64_t JobWatchers::Add(const std::string& job_id, Callback on_change) {
  const int64_t handle = next_handle_++;
  by_handle_[handle] = Watch{job_id, std::make_shared<Callback>(std::move(on_change))};
  by_job_[job_id].insert(handle);
  return handle;
}

void JobWatchers::Remove(int64_t handle) {
  auto it = by_handle_.find(handle);
  if (it == by_handle_.end()) return;
  auto handles = by_job_.find(it->second.job_id);
  if (handles != by_job_.end()) {
    handles->second.erase(handle);
    if (handles->second.empty()) by_job_.erase(handles);
  }
  by_handle_.erase(it);
}

std::vector<std::shared_ptr<JobWatchers::Callback>> JobWatchers::Durable(const std::string& job_id,
                                                                         int64_t version) {
  SetDurable(job_id, version);
  std::vector<std::shared_ptr<Callback>> callbacks;
  auto handles = by_job_.find(job_id);
  if (handles == by_job_.end()) return callbacks;
  for (int64_t handle : handles->second) callbacks.push_back(by_handle_.at(handle).callback);
  return callbacks;
}

void JobWatchers::SetDurable(const std::string& job_id, int64_t version) {
  int64_t& durable = durable_[job_id];
  durable = std::max(durable, version);
}

bool JobWatchers::IsDurable(const std::string& job_id, int64_t version) const {
  auto it = durable_.find(job_id);
  return it != durable_.end() && version <= it->second;
}

}  // namespace trainyard::coordinator
