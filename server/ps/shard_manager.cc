#include "server/ps/shard_manager.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <iterator>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/adam/cpu_adam.h"

namespace trainyard::ps {

struct ShardManager::Shard {
  Shard(const v1::InitShardChunk::Header& h)
      : job_id(h.job_id()),
        attempt(h.attempt()),
        begin(h.begin()),
        end(h.end()),
        adamw(h.adamw()),
        has_optimizer_state(h.has_optimizer_state()),
        params(end - begin),
        m(end - begin),
        v(end - begin),
        params_bf16(end - begin),
        applied(begin, end, h.step()),
        next_init_offset(begin) {}

  int64_t size() const { return end - begin; }

  const std::string job_id;
  const int attempt;
  const int64_t begin, end;
  const v1::AdamWHyperparameters adamw;
  const bool has_optimizer_state;

  absl::Mutex mu;
  absl::CondVar changed;  // an update finished or a lent range came back
  // Element i of the range is at index i - begin. Written under mu, except by an update, which
  // owns the elements it marked as updating.
  std::vector<float> params, m, v;
  std::vector<uint16_t> params_bf16;
  StepIntervals applied ABSL_GUARDED_BY(mu);
  // A pushed chunk, kept as the bytes gRPC received (no copy), fp32 or bf16; the update reads
  // its gradients from there.
  struct Staged {
    int64_t size;
    int64_t step;
    v1::WireFormat format;
    ReceivedBytes data;
  };
  std::map<int64_t, Staged> staged ABSL_GUARDED_BY(mu);  // gradient chunks by first element
  bool ready ABSL_GUARDED_BY(mu) = false;
  // Dropped or replaced by a new attempt: calls waiting on it end (no step will come).
  bool dropped ABSL_GUARDED_BY(mu) = false;
  int64_t next_init_offset ABSL_GUARDED_BY(mu);
  // Ranges of params / params_bf16 lent out to pulls (first element -> end): no update writes
  // them until they come back. A few at a time (the chunks gRPC has not sent yet).
  std::multimap<int64_t, int64_t> lent ABSL_GUARDED_BY(mu);
  // Ranges an update waits to write (for lent elements to come back): no new lends of them.
  std::multimap<int64_t, int64_t> pending_updates ABSL_GUARDED_BY(mu);

  // Registers [a, b) in pending_updates for its lifetime; constructed and destroyed under mu.
  class PendingUpdate {
   public:
    PendingUpdate(Shard& s, int64_t a, int64_t b)
        : shard_(s), entry_(s.pending_updates.emplace(a, b)) {}
    ~PendingUpdate() { shard_.pending_updates.erase(entry_); }

   private:
    Shard& shard_;
    std::multimap<int64_t, int64_t>::iterator entry_;
  };

  // The staged chunks [first, last) holding the gradients of `step` for exactly [begin, end), or
  // why they do not: a chunk cut by begin or end (INVALID_ARGUMENT), elements not pushed yet
  // (FAILED_PRECONDITION).
  using StagedIt = std::map<int64_t, Staged>::iterator;
  using StagedRange = std::pair<StagedIt, StagedIt>;
  absl::StatusOr<StagedRange> StagedFor(int64_t begin, int64_t end, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

namespace {

// Whether a range of `ranges` (first element -> end) overlaps [a, b).
bool Overlaps(const std::multimap<int64_t, int64_t>& ranges, int64_t a, int64_t b) {
  for (auto it = ranges.begin(); it != ranges.end() && it->first < b; ++it) {
    if (it->second > a) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<ShardManager::Shard::StagedRange> ShardManager::Shard::StagedFor(int64_t begin,
                                                                                int64_t end,
                                                                                int64_t step) {
  int64_t pushed = 0;
  auto first = staged.lower_bound(begin);
  if (first != staged.begin()) {
    auto before = std::prev(first);
    if (before->first + before->second.size > begin) {
      return absl::InvalidArgumentError(absl::StrCat("begin: ", begin, " cuts the pushed chunk [",
                                                     before->first, ", ",
                                                     before->first + before->second.size, ")"));
    }
  }
  auto last = first;
  for (; last != staged.end() && last->first < end; ++last) {
    if (last->first + last->second.size > end) {
      return absl::InvalidArgumentError(absl::StrCat("end: ", end, " cuts the pushed chunk [",
                                                     last->first, ", ",
                                                     last->first + last->second.size, ")"));
    }
    if (last->second.step == step) pushed += last->second.size;
  }
  if (pushed != end - begin) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, ": gradients of ", pushed,
                                                      " of the ", end - begin, " elements of [",
                                                      begin, ", ", end, ") pushed"));
  }
  return StagedRange(first, last);
}

ShardManager::LentParams::~LentParams() {
  absl::MutexLock lock(&shard_->mu);
  shard_->lent.erase(entry_);
  shard_->changed.SignalAll();
}

namespace {

absl::Status CheckSubrange(const char* what, int64_t a, int64_t b, int64_t begin, int64_t end) {
  if (a >= b || a < begin || b > end) {
    return absl::OutOfRangeError(absl::StrCat(what, ": [", a, ", ", b,
                                              ") is empty or outside this shard's range [", begin,
                                              ", ", end, ")"));
  }
  return absl::OkStatus();
}

// A stretch of whole gradient elements of a pushed chunk: `n` of them, for the shard's elements
// from index `i`, read from `grad` (any alignment; fp32 or bf16 as `bf16` says).
struct GradRun {
  int64_t i;
  const char* grad;
  int64_t n;
  bool bf16;
};

// Cuts `data`, the gradients of the shard's elements from index `i`, into runs of whole elements
// of at most adam::kParallelChunk. An element split between two pieces is put together in
// `spill` (a deque: the addresses of its entries stay put).
void AppendRuns(const ReceivedBytes& data, bool bf16, int64_t i, std::vector<GradRun>* runs,
                std::deque<std::array<char, 4>>* spill) {
  const size_t element_bytes = bf16 ? 2 : 4;
  size_t partial = 0;  // bytes of an element begun in an earlier piece, at spill->back()
  for (absl::string_view piece : data.pieces) {
    const char* p = piece.data();
    size_t left = piece.size();
    if (partial > 0) {
      const size_t take = std::min(left, element_bytes - partial);
      std::memcpy(spill->back().data() + partial, p, take);
      partial += take;
      p += take;
      left -= take;
      if (partial < element_bytes) continue;
      runs->push_back({i++, spill->back().data(), 1, bf16});
      partial = 0;
    }
    for (int64_t whole = left / element_bytes; whole > 0;) {
      const int64_t n = std::min(whole, adam::kParallelChunk);
      runs->push_back({i, p, n, bf16});
      i += n;
      p += n * element_bytes;
      left -= n * element_bytes;
      whole -= n;
    }
    if (left > 0) {
      spill->emplace_back();
      std::memcpy(spill->back().data(), p, left);
      partial = left;
    }
  }
}

}  // namespace

ShardManager::ShardManager(int64_t capacity_bytes, adam::ThreadPool& pool)
    : capacity_bytes_(capacity_bytes), pool_(pool) {}

absl::Status ShardManager::BeginInit(const v1::InitShardChunk::Header& h) {
  if (h.job_id().empty()) return absl::InvalidArgumentError("header.job_id: empty");
  if (h.attempt() < 1) return absl::InvalidArgumentError("header.attempt: must be at least 1");
  if (h.begin() < 0 || h.end() <= h.begin() || h.end() > h.total_params()) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.begin/end: [", h.begin(), ", ", h.end(),
                     ") is not a non-empty range inside total_params ", h.total_params()));
  }
  if (h.step() < 0) return absl::InvalidArgumentError("header.step: negative");
  const auto& a = h.adamw();
  if (!(a.beta1() >= 0 && a.beta1() < 1) || !(a.beta2() >= 0 && a.beta2() < 1)) {
    return absl::InvalidArgumentError("header.adamw.beta1/beta2: must be in [0, 1)");
  }
  if (!(a.eps() > 0)) return absl::InvalidArgumentError("header.adamw.eps: must be positive");
  if (!(a.weight_decay() >= 0)) {
    return absl::InvalidArgumentError("header.adamw.weight_decay: negative");
  }
  const int64_t bytes = (h.end() - h.begin()) * kBytesPerParam;
  std::shared_ptr<Shard> replaced;
  {
    absl::MutexLock lock(&mu_);
    auto old = shards_.find(h.job_id());
    // A leftover rank of an earlier attempt never replaces a later attempt's state.
    if (old != shards_.end() && old->second->attempt > h.attempt()) {
      return absl::FailedPreconditionError(
          absl::StrCat("header.attempt: job ", h.job_id(), " holds attempt ", old->second->attempt,
                       " here; attempt ", h.attempt(), " is over"));
    }
    // A shard replaced frees its memory at once unless something still holds it (a pull sending
    // from it, an update running on it): then when that lets go.
    const int64_t freed = old != shards_.end() && old->second.use_count() == 1
                              ? old->second->size() * kBytesPerParam
                              : 0;
    const int64_t reserved = *reserved_bytes_;
    if (reserved - freed + bytes > capacity_bytes_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("job ", h.job_id(), " needs ", bytes, " bytes for ", h.end() - h.begin(),
                       " parameters but this parameter server has ",
                       capacity_bytes_ - reserved + freed, " of ", capacity_bytes_, " free"));
    }
    if (old != shards_.end()) {
      replaced = std::move(old->second);
      shards_.erase(old);
    }
    *reserved_bytes_ += bytes;
  }
  if (replaced) {
    MarkDropped(*replaced);
    replaced.reset();  // freed now if nothing else holds it, before the new one is allocated
  }
  // Allocate outside the lock (zero-filling gigabytes takes a while). The last holder of the
  // shard returns its bytes.
  std::shared_ptr<Shard> shard(new Shard(h), [reserved = reserved_bytes_, bytes](Shard* s) {
    delete s;
    *reserved -= bytes;
  });
  absl::MutexLock lock(&mu_);
  shards_[h.job_id()] = std::move(shard);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<ShardManager::Shard>> ShardManager::Initializing(
    const std::string& job_id, int attempt) const {
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(job_id);
  if (it == shards_.end()) {
    return absl::NotFoundError(absl::StrCat("job_id: no shard of job '", job_id, "' here"));
  }
  if (it->second->attempt != attempt) {
    return absl::FailedPreconditionError(absl::StrCat("attempt: ", attempt, " is not attempt ",
                                                      it->second->attempt, " of job ", job_id));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<ShardManager::Shard>> ShardManager::Ready(const std::string& job_id,
                                                                         int attempt) const {
  auto shard = Initializing(job_id, attempt);
  if (!shard.ok()) return shard.status();
  absl::MutexLock lock(&(*shard)->mu);
  if (!(*shard)->ready) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " attempt ", attempt, ": shard not initialized yet"));
  }
  return shard;
}

absl::Status ShardManager::InitChunk(const std::string& job_id, int attempt, int64_t offset,
                                     absl::string_view params, absl::string_view m,
                                     absl::string_view v) {
  auto found = Initializing(job_id, attempt);
  if (!found.ok()) return found.status();
  Shard& s = **found;
  absl::MutexLock lock(&s.mu);
  if (s.ready) return absl::FailedPreconditionError("shard already initialized");
  if (params.size() % 4 != 0 || params.empty()) {
    return absl::InvalidArgumentError("params: not a non-empty whole number of fp32 values");
  }
  const int64_t n = params.size() / 4;
  if (s.has_optimizer_state ? (m.size() != params.size() || v.size() != params.size())
                            : (!m.empty() || !v.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "m/v: ", s.has_optimizer_state ? "must have as many bytes as params" : "not expected"));
  }
  if (offset != s.next_init_offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset: expected ", s.next_init_offset, " (chunks in order), got ", offset));
  }
  if (offset + n > s.end) {
    return absl::OutOfRangeError(
        absl::StrCat("params: chunk at ", offset, " of ", n, " runs past the range end ", s.end));
  }
  const int64_t i = offset - s.begin;
  std::memcpy(&s.params[i], params.data(), n * 4);
  if (s.has_optimizer_state) {
    std::memcpy(&s.m[i], m.data(), n * 4);
    std::memcpy(&s.v[i], v.data(), n * 4);
  }
  adam::FloatToBf16(&s.params[i], &s.params_bf16[i], n);
  s.next_init_offset += n;
  return absl::OkStatus();
}

absl::Status ShardManager::FinishInit(const std::string& job_id, int attempt) {
  auto found = Initializing(job_id, attempt);
  if (!found.ok()) return found.status();
  Shard& s = **found;
  absl::MutexLock lock(&s.mu);
  if (s.next_init_offset != s.end) {
    return absl::InvalidArgumentError(
        absl::StrCat("params: got ", s.next_init_offset - s.begin, " of ", s.size(), " elements"));
  }
  s.ready = true;
  return absl::OkStatus();
}

absl::StatusOr<ShardManager::PushResult> ShardManager::Push(const std::string& job_id, int attempt,
                                                            int64_t step, int64_t offset,
                                                            v1::WireFormat format,
                                                            ReceivedBytes data) {
  auto found = Ready(job_id, attempt);
  if (!found.ok()) return found.status();
  Shard& s = **found;
  const int64_t element_bytes = WireElementBytes(format);
  const size_t size = data.size();
  if (size == 0 || size % element_bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data: ", size, " bytes is not a non-empty whole number of ",
                     format == v1::WIRE_BF16 ? "bf16" : "fp32", " values"));
  }
  const int64_t n = size / element_bytes;
  if (step < 1) return absl::InvalidArgumentError("step: must be at least 1");
  RETURN_IF_ERROR(CheckSubrange("offset", offset, offset + n, s.begin, s.end));

  absl::MutexLock lock(&s.mu);
  const StepIntervals::Summary at = s.applied.Summarize(offset, offset + n);
  if (at.min_step >= step) return PushResult{0, n};  // applied already: a late retry
  if (at.updating || at.min_step != step - 1 || at.max_step != step - 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("step: gradients of step ", step, " for [", offset, ", ", offset + n,
                     ") but the range is at step ", at.min_step,
                     at.min_step == at.max_step ? "" : absl::StrCat("..", at.max_step),
                     at.updating ? " (updating)" : ""));
  }
  // Chunks of this step that overlap [offset, offset + n).
  auto it = s.staged.upper_bound(offset);
  if (it != s.staged.begin()) --it;
  for (; it != s.staged.end() && it->first < offset + n; ++it) {
    const int64_t a = it->first, b = it->first + it->second.size;
    if (b <= offset) continue;
    if (a == offset && b == offset + n && it->second.step == step) return PushResult{0, n};
    return absl::InvalidArgumentError(absl::StrCat(
        "offset: chunk [", offset, ", ", offset + n, ") of step ", step, " overlaps chunk [", a,
        ", ", b, ") of step ", it->second.step, " already pushed"));
  }
  s.staged[offset] = Shard::Staged{n, step, NormalizedWireFormat(format), std::move(data)};
  return PushResult{n, 0};
}

absl::Status ShardManager::Update(const std::string& job_id, int attempt, int64_t step,
                                  int64_t begin, int64_t end, float lr, float grad_scale,
                                  absl::Time deadline) {
  auto found = Ready(job_id, attempt);
  if (!found.ok()) return found.status();
  Shard& s = **found;
  RETURN_IF_ERROR(CheckSubrange("begin/end", begin, end, s.begin, s.end));
  if (step < 1) return absl::InvalidArgumentError("step: must be at least 1");
  if (!(lr >= 0)) return absl::InvalidArgumentError("update.lr: must be non-negative");
  if (grad_scale == 0) grad_scale = 1;
  if (!(grad_scale > 0)) return absl::InvalidArgumentError("update.grad_scale: must be positive");
  std::vector<std::pair<int64_t, Shard::Staged>> chunks;  // the gradients, by first element
  {
    absl::MutexLock lock(&s.mu);
    Shard::StagedRange staged;
    std::optional<Shard::PendingUpdate> pending;  // while it waits for lent elements
    for (bool timed_out = false;;) {
      const StepIntervals::Summary at = s.applied.Summarize(begin, end);
      if (at.updating) {  // a concurrent retry of the same update: wait for its outcome
        RETURN_IF_ERROR(WaitError(s));
        s.changed.Wait(&s.mu);
        continue;
      }
      if (at.min_step == step && at.max_step == step) return absl::OkStatus();
      if (at.min_step != step - 1 || at.max_step != step - 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "step: update ", step, " of [", begin, ", ", end, ") but the range is at step ",
            at.min_step, at.min_step == at.max_step ? "" : absl::StrCat("..", at.max_step)));
      }
      ASSIGN_OR_RETURN(staged, s.StagedFor(begin, end, step));
      if (!Overlaps(s.lent, begin, end)) break;
      // A pull of step - 1 is still sending these parameters from where they lie. New pulls of
      // them are refused meanwhile (the update goes first).
      if (timed_out) {
        return absl::DeadlineExceededError(absl::StrCat("begin/end: update ", step, " of [", begin,
                                                        ", ", end, ") waited for pulls of step ",
                                                        step - 1, " still sending the range"));
      }
      RETURN_IF_ERROR(WaitError(s));
      if (!pending) pending.emplace(s, begin, end);
      timed_out = s.changed.WaitWithDeadline(&s.mu, deadline);
    }
    const auto [first, last] = staged;
    for (auto it = first; it != last; ++it) chunks.emplace_back(it->first, std::move(it->second));
    s.staged.erase(first, last);
    s.applied.Set(begin, end, step - 1, /*updating=*/true);
  }

  adam::AdamWConfig c;
  c.lr = lr;
  c.beta1 = s.adamw.beta1();
  c.beta2 = s.adamw.beta2();
  c.eps = s.adamw.eps();
  c.weight_decay = s.adamw.weight_decay();
  c.step = step;
  c.grad_scale = grad_scale;
  // The gradients are read where gRPC received them: in runs of whole elements, spread over the
  // pool (element-wise, so the result does not depend on how the bytes were cut).
  std::vector<GradRun> runs;
  std::deque<std::array<char, 4>> spill;
  for (const auto& [offset, chunk] : chunks) {
    AppendRuns(chunk.data, chunk.format == v1::WIRE_BF16, offset - s.begin, &runs, &spill);
  }
  const int64_t grain = std::max<int64_t>(
      1, adam::kParallelChunk * static_cast<int64_t>(runs.size()) / (end - begin));
  {
    absl::MutexLock compute(&compute_mu_);
    pool_.ParallelFor(static_cast<int64_t>(runs.size()), grain, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        const GradRun& run = runs[r];
        const int64_t i = run.i;
        if (run.bf16) {
          adam::AdamWStepBf16Grad(c, &s.params[i], &s.m[i], &s.v[i],
                                  reinterpret_cast<const uint16_t*>(run.grad), &s.params_bf16[i],
                                  run.n);
        } else {
          adam::AdamWStep(c, &s.params[i], &s.m[i], &s.v[i],
                          reinterpret_cast<const float*>(run.grad), &s.params_bf16[i], run.n);
        }
      }
    });
  }
  absl::MutexLock lock(&s.mu);
  s.applied.Set(begin, end, step, /*updating=*/false);
  s.changed.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShardManager::LentParams>> ShardManager::LendParams(
    const std::string& job_id, int attempt, int64_t step, int64_t begin, int64_t end,
    v1::WireFormat format, absl::Duration wait) {
  auto found = Ready(job_id, attempt);
  if (!found.ok()) return found.status();
  Shard& s = **found;
  RETURN_IF_ERROR(CheckSubrange("begin/end", begin, end, s.begin, s.end));
  const absl::Time deadline = absl::Now() + wait;
  absl::MutexLock lock(&s.mu);
  StepIntervals::Summary at = s.applied.Summarize(begin, end);
  while (at.updating || at.min_step < step) {
    // At `step` already and being updated past it: waiting could only end past `step`, so the
    // answer is the one a pending update of the range gets below.
    if (at.updating && at.min_step >= step) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step: [", begin, ", ", end, ") is being updated to step ", step + 1, ", past ", step));
    }
    RETURN_IF_ERROR(WaitError(s));
    const bool timed_out = s.changed.WaitWithDeadline(&s.mu, deadline);
    at = s.applied.Summarize(begin, end);
    if (timed_out && (at.updating || at.min_step < step)) {
      return absl::DeadlineExceededError(
          absl::StrCat("step: [", begin, ", ", end, ") did not reach step ", step, " within ",
                       absl::FormatDuration(wait), " (it is at step ", at.min_step, ")"));
    }
  }
  if (at.max_step != step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: [", begin, ", ", end, ") is already at step ", at.max_step, ", past ", step));
  }
  if (Overlaps(s.pending_updates, begin, end)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: [", begin, ", ", end, ") is being updated to step ", step + 1, ", past ", step));
  }
  const int64_t i = begin - s.begin, n = end - begin;
  const char* data = format == v1::WIRE_BF16 ? reinterpret_cast<const char*>(&s.params_bf16[i])
                                             : reinterpret_cast<const char*>(&s.params[i]);
  return std::unique_ptr<LentParams>(new LentParams(*std::move(found), s.lent.emplace(begin, end),
                                                    data, n * WireElementBytes(format)));
}

absl::Status ShardManager::ReadParams(const std::string& job_id, int attempt, int64_t step,
                                      int64_t begin, int64_t end, v1::WireFormat format,
                                      absl::Duration wait, char* out) {
  auto lent = LendParams(job_id, attempt, step, begin, end, format, wait);
  if (!lent.ok()) return lent.status();
  std::memcpy(out, (*lent)->data(), (*lent)->bytes());
  return absl::OkStatus();
}

absl::Status ShardManager::ReadState(const std::string& job_id, int attempt, int64_t step,
                                     int64_t begin, int64_t end, v1::ShardStateChunk* out) {
  auto found = Ready(job_id, attempt);
  if (!found.ok()) return found.status();
  Shard& s = **found;
  RETURN_IF_ERROR(CheckSubrange("begin/end", begin, end, s.begin, s.end));
  std::multimap<int64_t, int64_t>::iterator entry;
  {
    absl::MutexLock lock(&s.mu);
    const StepIntervals::Summary at = s.applied.Summarize(begin, end);
    if (at.updating || at.min_step != step || at.max_step != step) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step: state of [", begin, ", ", end, ") asked at step ", step, " but it is at step ",
          at.min_step, at.min_step == at.max_step ? "" : absl::StrCat("..", at.max_step)));
    }
    entry = s.lent.emplace(begin, end);
  }
  // Copied outside the lock (up to 12 bytes of a chunk's every element), the range lent
  // meanwhile: updates of it wait, pushes and other ranges go on.
  const LentParams lent(*std::move(found), entry, nullptr, 0);
  const int64_t i = begin - s.begin, n = end - begin;
  out->set_offset(begin);
  out->set_params(reinterpret_cast<const char*>(&s.params[i]), n * 4);
  out->set_m(reinterpret_cast<const char*>(&s.m[i]), n * 4);
  out->set_v(reinterpret_cast<const char*>(&s.v[i]), n * 4);
  return absl::OkStatus();
}

absl::Status ShardManager::CheckPushRange(const std::string& job_id, int attempt, int64_t begin,
                                          int64_t end) const {
  auto found = Ready(job_id, attempt);
  if (!found.ok()) return found.status();
  return CheckSubrange("offset", begin, end, (*found)->begin, (*found)->end);
}

absl::StatusOr<std::pair<int64_t, int64_t>> ShardManager::RangeOf(const std::string& job_id,
                                                                  int attempt) const {
  auto found = Ready(job_id, attempt);
  if (!found.ok()) return found.status();
  return std::make_pair((*found)->begin, (*found)->end);
}

bool ShardManager::Drop(const std::string& job_id, int up_to_attempt) {
  std::shared_ptr<Shard> dropped;
  {
    absl::MutexLock lock(&mu_);
    auto it = shards_.find(job_id);
    if (it == shards_.end() || it->second->attempt > up_to_attempt) return false;
    dropped = std::move(it->second);
    shards_.erase(it);  // its bytes are returned when nothing holds it any more
  }
  MarkDropped(*dropped);
  return true;
}

void ShardManager::MarkDropped(Shard& s) {
  absl::MutexLock lock(&s.mu);
  s.dropped = true;
  s.changed.SignalAll();
}

v1::ListShardsResponse ShardManager::List() const {
  std::vector<std::shared_ptr<Shard>> shards;
  v1::ListShardsResponse r;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : shards_) shards.push_back(s);
    r.set_capacity_bytes(capacity_bytes_);
    r.set_reserved_bytes(*reserved_bytes_);
  }
  for (const auto& s : shards) {
    v1::ShardInfo* info = r.add_shards();
    info->set_job_id(s->job_id);
    info->set_attempt(s->attempt);
    info->set_begin(s->begin);
    info->set_end(s->end);
    info->set_reserved_bytes(s->size() * kBytesPerParam);
    absl::MutexLock lock(&s->mu);
    info->set_step(s->applied.Summarize(s->begin, s->end).min_step);
  }
  return r;
}

int64_t ShardManager::reserved_bytes() const { return *reserved_bytes_; }

absl::Status ShardManager::WaitError(const Shard& s) const {
  if (closed_) return absl::UnavailableError("this parameter server is shutting down");
  if (s.dropped) {
    return absl::FailedPreconditionError(
        absl::StrCat("attempt: the shard of job ", s.job_id, " attempt ", s.attempt,
                     " was dropped or replaced while this call waited"));
  }
  return absl::OkStatus();
}

void ShardManager::Close() {
  closed_ = true;
  std::vector<std::shared_ptr<Shard>> shards;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, s] : shards_) shards.push_back(s);
  }
  // A waiter checks closed_ under its shard's lock before it waits: woken here, it sees it.
  for (const auto& s : shards) {
    absl::MutexLock lock(&s->mu);
    s->changed.SignalAll();
  }
}

}  // namespace trainyard::ps
