#include "worker/trainer/comm/shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace trainyard::trainer {
namespace {

constexpr int kMaxRanks = 64;
constexpr int64_t kHeaderBytes = 4096;
constexpr int kSpins = 256;  // short: on a host whose cores all compute, a spinner steals time
const char kNameKey[] = "trainyard-shm-allreduce/name";

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

struct ShmAllReduce::Header {
  alignas(64) std::atomic<uint32_t> arrived;
  alignas(64) std::atomic<uint32_t> generation;
  alignas(64) std::atomic<int32_t> pids[kMaxRanks];  // 0 until the rank has mapped the segment
};
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free,
              "atomics in shared memory must be address-free");

absl::StatusOr<std::unique_ptr<ShmAllReduce>> ShmAllReduce::Create(const Rendezvous& rendezvous,
                                                                   int rank, int world_size,
                                                                   absl::Duration timeout,
                                                                   int64_t chunk_elements) {
  static_assert(sizeof(Header) <= kHeaderBytes);
  if (world_size < 2 || world_size > kMaxRanks || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory all-reduce: rank ", rank, " of ",
                                                   world_size, " (2 to ", kMaxRanks, " ranks)"));
  }
  const int64_t chunk = (std::max<int64_t>(chunk_elements, 16) + 15) / 16 * 16;  // 64-byte rows
  const int64_t bytes = kHeaderBytes + (world_size + 2) * chunk * int64_t{sizeof(float)};

  // Rank 0 creates and names the segment, or names none if it cannot; every rank then says
  // whether it mapped it, and all use it only if all did.
  std::string name;
  int fd = -1;
  std::string failure;
  if (rank == 0) {
    name = absl::StrCat("/trainyard-allreduce-", getpid(), "-", absl::ToUnixNanos(absl::Now()));
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      failure = absl::StrCat("shm_open ", name, ": ", std::strerror(errno));
    } else if (const int e = posix_fallocate(fd, 0, bytes); e != 0) {  // no SIGBUS later
      failure = absl::StrCat("cannot reserve ", bytes, " bytes in /dev/shm: ", std::strerror(e));
      close(fd);
      fd = -1;
      shm_unlink(name.c_str());
    }
    rendezvous.set(kNameKey, fd >= 0 ? name : "");
  } else {
    name = rendezvous.get(kNameKey);
    if (name.empty()) {
      failure = "rank 0 could not create the segment";
    } else {
      fd = shm_open(name.c_str(), O_RDWR, 0);
      struct stat st = {};
      if (fd < 0 || fstat(fd, &st) != 0 || st.st_size != bytes) {
        failure = absl::StrCat("cannot open ", name, " of ", bytes, " bytes");
        if (fd >= 0) close(fd);
        fd = -1;
      }
    }
  }
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) failure = absl::StrCat("mmap: ", std::strerror(errno));
  }
  if (base != MAP_FAILED) {
    static_cast<Header*>(base)->pids[rank].store(getpid(), std::memory_order_release);
  }
  bool all_mapped = true;
  try {
    rendezvous.set(absl::StrCat(kNameKey, "/mapped-", rank), base != MAP_FAILED ? "1" : "0");
    for (int r = 0; r < world_size; ++r) {
      all_mapped = rendezvous.get(absl::StrCat(kNameKey, "/mapped-", r)) == "1" && all_mapped;
    }
  } catch (...) {  // the store gave up (a rank died, the attempt ended): leave nothing behind
    if (rank == 0 && !name.empty()) shm_unlink(name.c_str());
    if (base != MAP_FAILED) munmap(base, bytes);
    throw;
  }
  if (rank == 0 && !name.empty()) shm_unlink(name.c_str());  // every rank holds it mapped now
  if (!all_mapped) {
    if (base != MAP_FAILED) munmap(base, bytes);
    return absl::UnavailableError(
        absl::StrCat("shared-memory all-reduce: ",
                     failure.empty() ? "another rank could not map the segment" : failure));
  }
  return std::unique_ptr<ShmAllReduce>(
      new ShmAllReduce(base, bytes, rank, world_size, chunk, timeout));
}

ShmAllReduce::ShmAllReduce(void* base, int64_t bytes, int rank, int world, int64_t chunk,
                           absl::Duration timeout)
    : base_(base), bytes_(bytes), rank_(rank), world_(world), chunk_(chunk), timeout_(timeout) {}

ShmAllReduce::~ShmAllReduce() { munmap(base_, bytes_); }

float* ShmAllReduce::slot(int r) const {
  return reinterpret_cast<float*>(static_cast<char*>(base_) + kHeaderBytes) + r * chunk_;
}

float* ShmAllReduce::result(int which) const { return slot(world_ + which); }

absl::Status ShmAllReduce::Barrier() {
  Header* h = static_cast<Header*>(base_);
  const uint32_t gen = h->generation.load(std::memory_order_acquire);
  if (h->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(world_)) {
    h->arrived.store(0, std::memory_order_relaxed);
    h->generation.store(gen + 1, std::memory_order_release);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->generation), FUTEX_WAKE, INT_MAX, nullptr,
            nullptr, 0);
    return absl::OkStatus();
  }
  const absl::Time deadline = absl::Now() + timeout_;
  for (int spin = 0; h->generation.load(std::memory_order_acquire) == gen; ++spin) {
    if (spin < kSpins) {
      CpuRelax();
      continue;
    }
    timespec wait = {0, 20 * 1000 * 1000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->generation), FUTEX_WAIT, gen, &wait, nullptr,
            0);
    if (h->generation.load(std::memory_order_acquire) != gen) break;
    if (aborted_.load()) {
      broken_ = true;
      return absl::CancelledError("shared-memory all-reduce: abandoned while waiting");
    }
    for (int r = 0; r < world_; ++r) {
      const pid_t pid = h->pids[r].load(std::memory_order_acquire);
      if (r != rank_ && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
        broken_ = true;
        return absl::AbortedError(absl::StrCat("shared-memory all-reduce: rank ", r,
                                               " of this host (pid ", pid, ") is gone"));
      }
    }
    if (absl::Now() > deadline) {
      broken_ = true;
      return absl::DeadlineExceededError(
          absl::StrCat("shared-memory all-reduce: the other ranks of this host did not arrive "
                       "within ",
                       absl::FormatDuration(timeout_)));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmAllReduce::SumInPlace(float* data, int64_t n) {
  if (broken_) return absl::FailedPreconditionError("shared-memory all-reduce: a barrier failed");
  for (int64_t off = 0; off < n; off += chunk_) {
    const int64_t c = std::min(chunk_, n - off);
    std::memcpy(slot(rank_), data + off, c * sizeof(float));
    if (absl::Status s = Barrier(); !s.ok()) return s;
    // This rank's part of the chunk, summed in rank order: every element gets the same sum on
    // every rank, whichever rank computed it.
    const int64_t part = (c + world_ - 1) / world_;
    const int64_t lo = std::min(c, rank_ * part), hi = std::min(c, lo + part);
    float* out = result(static_cast<int>(calls_ % 2));
    std::memcpy(out + lo, slot(0) + lo, (hi - lo) * sizeof(float));
    for (int r = 1; r < world_; ++r) {
      const float* in = slot(r);
      for (int64_t i = lo; i < hi; ++i) out[i] += in[i];
    }
    if (absl::Status s = Barrier(); !s.ok()) return s;
    std::memcpy(data + off, out, c * sizeof(float));
    ++calls_;
  }
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
