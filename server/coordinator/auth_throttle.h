// AuthThrottle: counts failed authentications. Each key (a token id whose secret was wrong, a
// peer address) has a bucket of `burst` failures that refills at `per_second`; once a key's
// bucket is empty, Admit says so (RESOURCE_EXHAUSTED) until it refills (about 1/per_second
// seconds per failure). The caller decides what a held key loses: the coordinator answers its
// further failures RESOURCE_EXHAUSTED, never its valid credentials (IdentityRegistry::
// AuthenticateFrom). Memory is bounded: at most `max_keys` buckets, full ones dropped first,
// then the oldest.
//
// Pure logic on an injected clock. Thread-safe.
#ifndef TRAINYARD_SERVER_COORDINATOR_AUTH_THROTTLE_H_
#define TRAINYARD_SERVER_COORDINATOR_AUTH_THROTTLE_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace trainyard::coordinator {

struct AuthThrottleOptions {
  double burst = 10;      // failures a key may have at once; <= 0 turns throttling off
  double per_second = 1;  // failures forgiven per second
  size_t max_keys = 100'000;
};

class AuthThrottle {
 public:
  AuthThrottle(const Clock& clock, AuthThrottleOptions options)
      : clock_(clock), options_(options) {}

  // OK, or RESOURCE_EXHAUSTED ("too many failed authentications for KEY; retry in N ms") while
  // `key` has no failures left.
  absl::Status Admit(const std::string& key) const;
  // Counts one failed authentication against `key`.
  void Failed(const std::string& key);

  size_t tracked_keys() const;

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time updated;
  };
  // Refills `b` up to now.
  double Level(const Bucket& b, absl::Time now) const;

  const Clock& clock_;
  const AuthThrottleOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_AUTH_THROTTLE_H_
