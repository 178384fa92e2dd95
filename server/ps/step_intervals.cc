#include "server/ps/step_intervals.h"

#include <algorithm>
#include <iterator>

#include "common/check.h"

namespace trainyard::ps {

StepIntervals::StepIntervals(int64_t begin, int64_t end, int64_t step) : begin_(begin), end_(end) {
  TY_CHECK(begin < end, "StepIntervals needs a non-empty range");
  runs_[begin] = Run{end, step, false};
}

StepIntervals::Summary StepIntervals::Summarize(int64_t a, int64_t b) const {
  TY_CHECK(begin_ <= a && a < b && b <= end_, "StepIntervals::Summarize outside the range");
  auto it = std::prev(runs_.upper_bound(a));
  Summary s{it->second.step, it->second.step, false};
  for (; it != runs_.end() && it->first < b; ++it) {
    s.min_step = std::min(s.min_step, it->second.step);
    s.max_step = std::max(s.max_step, it->second.step);
    s.updating = s.updating || it->second.updating;
  }
  return s;
}

void StepIntervals::SplitAt(int64_t pos) {
  if (pos <= begin_ || pos >= end_) return;
  auto it = std::prev(runs_.upper_bound(pos));
  if (it->first == pos) return;
  Run tail = it->second;
  it->second.end = pos;
  runs_[pos] = tail;
}

void StepIntervals::MergeAround(int64_t pos) {
  auto it = runs_.find(pos);
  if (it == runs_.end() || it == runs_.begin()) return;
  auto prev = std::prev(it);
  if (prev->second.step == it->second.step && prev->second.updating == it->second.updating) {
    prev->second.end = it->second.end;
    runs_.erase(it);
  }
}

void StepIntervals::Set(int64_t a, int64_t b, int64_t step, bool updating) {
  TY_CHECK(begin_ <= a && a < b && b <= end_, "StepIntervals::Set outside the range");
  SplitAt(a);
  SplitAt(b);
  auto first = runs_.find(a);
  auto last = runs_.lower_bound(b);
  runs_.erase(std::next(first), last);
  first->second = Run{b, step, updating};
  MergeAround(b);
  MergeAround(a);
}

}  // namespace trainyard::ps
