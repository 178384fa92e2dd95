// ThreadPool: a fixed set of threads for data-parallel loops over big arrays (the AdamW updates
// of trainyard-ps, see cpu_adam.h). ParallelFor hands out fixed-size chunks of an index range to
// the workers and to the calling thread, and returns when every chunk has run.
//
// Threading: any thread may call ParallelFor; concurrent calls run one after the other. The
// workers only run chunks of the loop in progress. The pool owns its threads.
#ifndef TRAINYARD_KERNELS_ADAM_THREAD_POOL_H_
#define TRAINYARD_KERNELS_ADAM_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace trainyard::adam {

class ThreadPool {
 public:
  // `threads` run each loop, the caller of ParallelFor included (threads - 1 workers are
  // started); 1 runs every loop inline; 0 or less means one per hardware thread.
  explicit ThreadPool(int threads);
  // Joins the workers. No ParallelFor may be running.
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }

  // Calls fn(begin, end) once for every chunk [k * grain, min((k + 1) * grain, n)) of [0, n),
  // k = 0, 1, ..., on the pool's threads and the calling one, and returns when all calls have
  // returned. grain < 1 counts as 1. A loop of a single chunk runs inline. `fn` must be safe to
  // call from several threads at once and must not call ParallelFor on this pool.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  // One ParallelFor call; lives on its caller's stack.
  struct Loop {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n;
    int64_t grain;
    int64_t chunks;
    std::atomic<int64_t> next_chunk{0};
  };

  // Claims and runs chunks of `loop` until none are left.
  static void RunChunks(Loop& loop);
  void WorkerMain();

  const int threads_;
  absl::Mutex call_mu_;  // held by the caller for a whole multi-threaded ParallelFor
  absl::Mutex mu_;
  absl::CondVar work_cv_;                         // a loop was posted, or stop_
  absl::CondVar idle_cv_;                         // busy_ fell to 0
  Loop* loop_ ABSL_GUARDED_BY(mu_) = nullptr;     // the loop workers may join; nullptr after it
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // loops posted so far
  int busy_ ABSL_GUARDED_BY(mu_) = 0;             // workers inside RunChunks
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace trainyard::adam

#endif  // TRAINYARD_KERNELS_ADAM_THREAD_POOL_H_
