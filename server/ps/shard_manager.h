// ShardManager: the optimizer state a parameter server holds. For each offload job placed on this
// shard, one contiguous range [begin, end) of the job's flat parameter vector: fp32 master
// weights, AdamW's m and v, the pushed gradients until their update (kept in the buffers gRPC
// received them in: the update reads them there) and a bfloat16 copy of the weights (written by the
// same pass as the update, for bf16 pulls): 18 bytes per parameter, reserved against the server's
// capacity.
//
// The protocol of one optimizer step (see proto/trainyard/v1/ps.proto): Push stages gradient
// chunks (each element once per step; an identical retry is counted as a duplicate and ignored);
// Update applies AdamW to a sub-range whose gradients are all staged, once (a repeated Update is a
// no-op); LendParams / ReadParams return a chunk only when every element of it is exactly at the
// asked step, and an update waits while a lent chunk (a pull gRPC is still sending) overlaps it.
// Every call names the attempt: calls from another attempt than the shard's are refused, the
// shard unchanged. Knows nothing of gRPC.
//
// Thread-safe: called from the gRPC server's threads. Each job's shard has its own lock; AdamW runs
// outside it (the range is marked as updating meanwhile) on the shared thread pool, one update at
// a time.
#ifndef TRAINYARD_SERVER_PS_SHARD_MANAGER_H_
#define TRAINYARD_SERVER_PS_SHARD_MANAGER_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/ps_layout.h"
#include "kernels/adam/thread_pool.h"
#include "rpc/ps/wire_types.h"
#include "server/ps/step_intervals.h"
#include "trainyard/v1/ps.pb.h"

namespace trainyard::ps {

inline constexpr int64_t kBytesPerParam = kPsBytesPerParam;

class ShardManager {
 public:
  // `pool` runs the AdamW updates and must outlive the manager.
  ShardManager(int64_t capacity_bytes, adam::ThreadPool& pool);

  // Starts (re)initializing a job's range from `header`, replacing any state of the job. The
  // range is not usable until every element arrived through InitChunk and FinishInit.
  // INVALID_ARGUMENT names a bad header field; RESOURCE_EXHAUSTED when it does not fit;
  // FAILED_PRECONDITION for an attempt older than the one held.
  absl::Status BeginInit(const v1::InitShardChunk::Header& header);
  // Chunks must come in order from `begin`. `m` and `v` are empty unless the header said
  // has_optimizer_state; all sizes are multiples of 4 bytes and equal.
  absl::Status InitChunk(const std::string& job_id, int attempt, int64_t offset,
                         absl::string_view params, absl::string_view m, absl::string_view v);
  absl::Status FinishInit(const std::string& job_id, int attempt);

  struct PushResult {
    int64_t staged = 0;
    int64_t duplicate = 0;
  };
  // Stages gradients of `step` for [offset, offset + n). NOT_FOUND for an unknown job;
  // FAILED_PRECONDITION for a stale attempt, a range not initialized, or a step that does not
  // follow the range's; OUT_OF_RANGE for elements outside the range; INVALID_ARGUMENT for a size
  // that is not whole elements or a chunk overlapping a different one of the same step.
  // `data` is kept as it is until the update, which reads the gradients from its pieces (no
  // copy).
  absl::StatusOr<PushResult> Push(const std::string& job_id, int attempt, int64_t step,
                                  int64_t offset, v1::WireFormat format, ReceivedBytes data);

  // Applies step `step` to [begin, end): every element's gradients must be staged (else
  // FAILED_PRECONDITION saying how many are), and the range must be at step - 1, or already at
  // `step` (then nothing happens). grad_scale multiplies the gradients (clipping). Then waits
  // until no element of the range is lent out (LendParams), refusing new lends of it meanwhile,
  // until `deadline`: DEADLINE_EXCEEDED after it, the shard unchanged.
  absl::Status Update(const std::string& job_id, int attempt, int64_t step, int64_t begin,
                      int64_t end, float lr, float grad_scale,
                      absl::Time deadline = absl::InfiniteFuture());

  // The parameters of [begin, end) after update `step`, in `format`, lent out read-only where the
  // shard holds them (no copy) until the LentParams is destroyed: an update that would write any
  // of these elements waits until then. Keeps the shard's memory alive even if the job is dropped
  // meanwhile. Waits up to `wait` for the range to reach the step; DEADLINE_EXCEEDED after that,
  // FAILED_PRECONDITION if some element is already past it or an update of some element to the
  // next step is waiting for lent elements to come back (updates go first).
  class LentParams;
  absl::StatusOr<std::unique_ptr<LentParams>> LendParams(const std::string& job_id, int attempt,
                                                         int64_t step, int64_t begin, int64_t end,
                                                         v1::WireFormat format,
                                                         absl::Duration wait);
  // LendParams, copied to `out` (room for (end - begin) * WireElementBytes(format) bytes).
  absl::Status ReadParams(const std::string& job_id, int attempt, int64_t step, int64_t begin,
                          int64_t end, v1::WireFormat format, absl::Duration wait, char* out);

  // The full state of [begin, end) (for checkpoints): params, m, v as fp32 bytes. The range
  // must be at exactly `step`. Copied outside the shard's lock, the range lent meanwhile (updates
  // of it wait).
  absl::Status ReadState(const std::string& job_id, int attempt, int64_t step, int64_t begin,
                         int64_t end, v1::ShardStateChunk* out);

  // OK when the job's shard is ready for `attempt` and holds [begin, end): the checks Push makes
  // first (NOT_FOUND, FAILED_PRECONDITION; OUT_OF_RANGE naming offset), nothing staged.
  absl::Status CheckPushRange(const std::string& job_id, int attempt, int64_t begin,
                              int64_t end) const;

  // Where the job's range lies: FAILED_PRECONDITION for a stale attempt or a shard not ready.
  absl::StatusOr<std::pair<int64_t, int64_t>> RangeOf(const std::string& job_id, int attempt) const;

  // Frees a job's state if its attempt is at most `up_to_attempt`; false if there was none. Its
  // bytes stay reserved while something still holds it (a pull sending from it: LendParams).
  // Calls waiting on it (for a step, for lent elements) end with FAILED_PRECONDITION, as they do
  // when a new attempt's BeginInit replaces it.
  bool Drop(const std::string& job_id, int up_to_attempt = std::numeric_limits<int>::max());
  v1::ListShardsResponse List() const;

  // Ends every wait of a call (a pull waiting for its step, an update waiting for lent elements
  // or for a concurrent retry of itself) with UNAVAILABLE, now and from then on: what a stopping
  // server does so that no call outlives it by a wait. Everything else goes on working.
  void Close();

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t reserved_bytes() const;

 private:
  struct Shard;
  // The job's shard if it belongs to `attempt` and is initialized.
  absl::StatusOr<std::shared_ptr<Shard>> Ready(const std::string& job_id, int attempt) const;
  absl::StatusOr<std::shared_ptr<Shard>> Initializing(const std::string& job_id, int attempt) const;
  // Why a call must stop waiting on `s`: UNAVAILABLE once Close() was called,
  // FAILED_PRECONDITION once `s` was dropped or replaced. Called with s.mu held.
  absl::Status WaitError(const Shard& s) const;
  // Marks a shard taken out of shards_ as dropped and wakes the calls waiting on it.
  static void MarkDropped(Shard& s);

  const int64_t capacity_bytes_;
  adam::ThreadPool& pool_;
  absl::Mutex compute_mu_;           // one AdamW update at a time: each already uses every thread
  std::atomic<bool> closed_{false};  // Close() was called

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Shard>> shards_ ABSL_GUARDED_BY(mu_);
  // The bytes of every shard not yet freed, those dropped but still held (by a pull sending from
  // one, say) included; shared with each shard's deleter, which returns its bytes.
  const std::shared_ptr<std::atomic<int64_t>> reserved_bytes_ =
      std::make_shared<std::atomic<int64_t>>(0);
};

class ShardManager::LentParams {
 public:
  LentParams(const LentParams&) = delete;
  LentParams& operator=(const LentParams&) = delete;
  ~LentParams();  // returns the range: updates of it may go on

  const char* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  friend class ShardManager;
  LentParams(std::shared_ptr<Shard> shard, std::multimap<int64_t, int64_t>::iterator entry,
             const char* data, size_t bytes)
      : shard_(std::move(shard)), entry_(entry), data_(data), bytes_(bytes) {}

  std::shared_ptr<Shard> shard_;
  std::multimap<int64_t, int64_t>::iterator entry_;  // in shard_->lent
  const char* data_;
  size_t bytes_;
};

}  // namespace trainyard::ps

#endif  // TRAINYARD_SERVER_PS_SHARD_MANAGER_H_
