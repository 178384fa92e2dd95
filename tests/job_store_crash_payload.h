// The job that the crash test's child (job_store_crash_child.cc) commits for each seq, and that
// the crash test (job_store_crash_test.cc) expects to find intact after killing the child. Shared
// so that the two cannot drift apart.
#ifndef TRAINYARD_TESTS_JOB_STORE_CRASH_PAYLOAD_H_
#define TRAINYARD_TESTS_JOB_STORE_CRASH_PAYLOAD_H_

#include <cstdint>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/coordinator/job_store.h"

namespace trainyard::testing {

// Pseudo-random bytes seeded by `seq`, 1 to 8192 of them, at least one of them NUL.
inline std::string CrashJobPayload(int64_t seq) {
  std::mt19937_64 rng(static_cast<uint64_t>(seq));
  const size_t size = 1 + rng() % 8192;
  std::string payload(size, '\0');
  for (char& c : payload) c = static_cast<char>(rng() & 0xff);
  payload[static_cast<size_t>(seq) % size] = '\0';
  return payload;
}

inline coordinator::StoredJob CrashJob(int64_t seq) {
  coordinator::StoredJob job;
  job.id = absl::StrCat("job-", seq);
  job.seq = seq;
  job.owner = absl::StrCat("user-", seq % 7);
  job.state = "QUEUED";
  job.payload = CrashJobPayload(seq);
  return job;
}

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_JOB_STORE_CRASH_PAYLOAD_H_
