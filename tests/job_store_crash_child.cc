// Child process of job_store_crash_test: commits jobs to a JobStore as fast as it can until it is
// killed, and acknowledges each durable commit on stdout.
//
//   job_store_crash_child STORE FIRST_SEQ
//
// STORE is a SQLite file's path or a PostgreSQL URI (OpenJobStore).
//
// Four threads take seqs FIRST_SEQ, FIRST_SEQ+1, ... and commit CrashJob(seq) (see
// job_store_crash_payload.h), each keeping a few commits in flight so that group commit has
// batches to group. Once a commit's callback reports OK, "ACK <seq>" is printed and flushed: from
// then on the test may kill the process and expects the job to be in the database.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "server/coordinator/job_store.h"
#include "tests/job_store_crash_payload.h"

namespace {

using trainyard::coordinator::JobStore;
using trainyard::coordinator::WriteBatch;

constexpr int kThreads = 4;
constexpr int kInFlightPerThread = 8;

absl::Mutex print_mu;  // one ACK line at a time on stdout

// One committing thread's window of commits in flight. Called by its thread and by the store's
// callback thread.
class Committer {
 public:
  Committer(JobStore& store, std::atomic<int64_t>& next_seq) : store_(store), next_seq_(next_seq) {}

  [[noreturn]] void Run() {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Committer* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
              return c->in_flight_ < kInFlightPerThread;
            },
            this));
        ++in_flight_;
      }
      const int64_t seq = next_seq_.fetch_add(1);
      WriteBatch batch;
      batch.put_jobs.push_back(trainyard::testing::CrashJob(seq));
      store_.Commit(std::move(batch), [this, seq](absl::Status status) {
        if (!status.ok()) {
          std::fprintf(stderr, "commit of seq %lld failed: %s\n", static_cast<long long>(seq),
                       status.ToString().c_str());
          std::_Exit(3);
        }
        {
          absl::MutexLock lock(&print_mu);
          std::printf("ACK %lld\n", static_cast<long long>(seq));
          std::fflush(stdout);
        }
        absl::MutexLock lock(&mu_);
        --in_flight_;
      });
    }
  }

 private:
  JobStore& store_;
  std::atomic<int64_t>& next_seq_;
  absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t first_seq = 0;
  if (argc != 3 || !absl::SimpleAtoi(argv[2], &first_seq)) {
    std::fprintf(stderr, "usage: %s STORE FIRST_SEQ\n", argv[0]);
    return 2;
  }
  auto store = trainyard::coordinator::OpenJobStore(argv[1]);
  if (!store.ok()) {
    std::fprintf(stderr, "open %s: %s\n", argv[1], store.status().ToString().c_str());
    return 1;
  }
  std::atomic<int64_t> next_seq{first_seq};
  std::vector<std::unique_ptr<Committer>> committers;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    committers.push_back(std::make_unique<Committer>(**store, next_seq));
    threads.emplace_back([c = committers.back().get()] { c->Run(); });
  }
  for (std::thread& t : threads) t.join();  // never returns: the test kills the process
  return 0;
}
