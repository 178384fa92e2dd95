#include "kernels/adam/thread_pool.h"

#include <algorithm>

namespace trainyard::adam {

ThreadPool::ThreadPool(int threads)
    : threads_(threads > 0 ? threads
                           : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))) {
  workers_.reserve(threads_ - 1);
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { WorkerMain(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    work_cv_.SignalAll();
  }
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::RunChunks(Loop& loop) {
  // Relaxed is enough to claim chunks: the results are published through mu_ (a worker leaves
  // RunChunks before it takes mu_ to decrement busy_, which the caller waits for under mu_).
  for (int64_t chunk = loop.next_chunk.fetch_add(1, std::memory_order_relaxed); chunk < loop.chunks;
       chunk = loop.next_chunk.fetch_add(1, std::memory_order_relaxed)) {
    const int64_t begin = chunk * loop.grain;
    (*loop.fn)(begin, begin + std::min(loop.grain, loop.n - begin));
  }
}

void ThreadPool::WorkerMain() {
  uint64_t seen_generation = 0;
  mu_.Lock();
  while (true) {
    while (!stop_ && (loop_ == nullptr || generation_ == seen_generation)) work_cv_.Wait(&mu_);
    if (stop_) break;
    seen_generation = generation_;
    Loop* loop = loop_;
    ++busy_;
    mu_.Unlock();
    RunChunks(*loop);
    mu_.Lock();
    if (--busy_ == 0) idle_cv_.SignalAll();
  }
  mu_.Unlock();
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = n / grain + (n % grain != 0 ? 1 : 0);
  if (workers_.empty() || chunks == 1) {
    for (int64_t begin = 0; begin < n; begin += std::min(grain, n - begin)) {
      fn(begin, begin + std::min(grain, n - begin));
    }
    return;
  }
  absl::MutexLock call(&call_mu_);
  Loop loop{&fn, n, grain, chunks};
  {
    absl::MutexLock lock(&mu_);
    loop_ = &loop;
    ++generation_;
    work_cv_.SignalAll();
  }
  RunChunks(loop);
  // Every chunk is claimed. Workers that have not joined yet must not see `loop` any more; the
  // ones that did are finishing their last chunk.
  absl::MutexLock lock(&mu_);
  loop_ = nullptr;
  while (busy_ > 0) idle_cv_.Wait(&mu_);
}

}  // namespace trainyard::adam
