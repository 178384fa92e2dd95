// One thread that runs posted tasks in order. The coordinator's node sessions hand it what may
// wait on the job manager's lock (hellos, rank status, log lines, and each heartbeat's ack, which
// must follow what the node sent before it), so that gRPC's callback threads never block behind a
// scheduling pass or a submit and every heartbeat is counted as it arrives. Thread-safe.
#ifndef TRAINYARD_SERVER_COORDINATOR_SERIAL_EXECUTOR_H_
#define TRAINYARD_SERVER_COORDINATOR_SERIAL_EXECUTOR_H_

#include <pthread.h>

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace trainyard::coordinator {

class SerialExecutor {
 public:
  // `name`: the thread's name (at most 15 characters), for top -H and /proc.
  explicit SerialExecutor(std::string name) : name_(std::move(name)), thread_([this] { Loop(); }) {}
  // Runs what was posted, then joins.
  ~SerialExecutor() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }

 private:
  void Loop() {
    pthread_setname_np(pthread_self(), name_.c_str());
    absl::MutexLock lock(&mu_);
    while (true) {
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !tasks_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (tasks_.empty()) return;  // stopping, and drained
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      mu_.Unlock();
      task();
      mu_.Lock();
    }
  }

  const std::string name_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_SERIAL_EXECUTOR_H_
