// StepIntervals: which optimizer step each element of a range [begin, end) has reached, kept as
// maximal runs of equal state, plus whether a run is being updated right now. Pure logic for the
// parameter-server shard; not thread-safe (the shard's lock guards it).
#ifndef TRAINYARD_SERVER_PS_STEP_INTERVALS_H_
#define TRAINYARD_SERVER_PS_STEP_INTERVALS_H_

#include <cstdint>
#include <map>

namespace trainyard::ps {

class StepIntervals {
 public:
  // Every element of [begin, end) starts at `step`.
  StepIntervals(int64_t begin, int64_t end, int64_t step);

  struct Summary {
    int64_t min_step = 0;
    int64_t max_step = 0;
    bool updating = false;  // some element of the range is being updated
  };
  // Over [a, b), which must lie inside the range and be non-empty.
  Summary Summarize(int64_t a, int64_t b) const;
  // Sets [a, b) to `step` (and `updating`), merging equal neighbours.
  void Set(int64_t a, int64_t b, int64_t step, bool updating);
  // Number of maximal runs (for tests: merging works).
  int runs() const { return static_cast<int>(runs_.size()); }

 private:
  struct Run {
    int64_t end;
    int64_t step;
    bool updating;
  };
  // Makes a run start at `pos` (begin < pos < end).
  void SplitAt(int64_t pos);
  void MergeAround(int64_t pos);

  int64_t begin_, end_;
  std::map<int64_t, Run> runs_;  // keyed by run start; runs tile [begin_, end_)
};

}  // namespace trainyard::ps

#endif  // TRAINYARD_SERVER_PS_STEP_INTERVALS_H_
