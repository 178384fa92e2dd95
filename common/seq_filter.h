// SeqFilter: keeps each record of a rank's sequenced stream once. Log lines and step reports carry
// a seq that grows per attempt and rank (LogLine.seq, StepReport.seq); after a failover or a
// restart they are sent, or streamed, again from an earlier point, and a record whose seq is not
// past the last one taken of its attempt and rank is such a copy. Records without a seq (0, from
// older senders) are always taken. Used by the coordinator's JobSeries and by yard's resumed
// streams. Not thread-safe.
#ifndef TRAINYARD_COMMON_SEQ_FILTER_H_
#define TRAINYARD_COMMON_SEQ_FILTER_H_

#include <cstdint>
#include <map>
#include <utility>

namespace trainyard {

class SeqFilter {
 public:
  // Whether Take would take `record` now. T has attempt(), rank() and seq().
  template <typename T>
  bool Fresh(const T& record) const {
    if (record.seq() <= 0) return true;
    auto it = last_.find({record.attempt(), record.rank()});
    return it == last_.end() || record.seq() > it->second;
  }

  // Takes `record` (true) unless it is a copy of one taken before (false).
  template <typename T>
  bool Take(const T& record) {
    if (record.seq() <= 0) return true;
    int64_t& last = last_[{record.attempt(), record.rank()}];
    if (record.seq() <= last) return false;
    last = record.seq();
    return true;
  }

  // (attempt, rank) -> the last seq taken.
  using Last = std::map<std::pair<int32_t, int32_t>, int64_t>;
  const Last& last() const { return last_; }

 private:
  Last last_;
};

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_SEQ_FILTER_H_
