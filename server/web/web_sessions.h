// The web console's sign-in sessions: a browser that signed in with an API token holds a random
// session id in an HttpOnly cookie; the coordinator keeps the token (in memory only, never in the
// store or a log) and a per-session CSRF token that every action must send back in a header.
//
// A session ends at sign-out, after `idle` without a request, `lifetime` after sign-in, when the
// table (or its user's share of it) is full and it is the least recently used, or when its token
// stops authenticating (the
// console removes it on the first UNAUTHENTICATED answer: a revoked token ends its sessions).
// Sessions live in the coordinator's memory: a restart or failover signs everyone out.
// Thread-safe.
#ifndef TRAINYARD_SERVER_WEB_WEB_SESSIONS_H_
#define TRAINYARD_SERVER_WEB_WEB_SESSIONS_H_

#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace trainyard::web {

struct WebSession {
  std::string token;  // the API token it signed in with
  std::string user;
  bool admin = false;
  std::string csrf;  // what the X-CSRF-Token header of its actions must be
  absl::Time created;
  absl::Time last_used;
};

struct WebSessionLimits {
  absl::Duration idle = absl::Hours(12);
  absl::Duration lifetime = absl::Hours(24 * 7);
  size_t max_sessions = 10000;
  // A user's sessions at once: one more ends that user's least recently used, so that signing
  // in over and over never pushes other users' sessions out of the table.
  size_t max_sessions_per_user = 32;
};

class WebSessions {
 public:
  explicit WebSessions(
      WebSessionLimits limits, std::function<absl::Time()> now = [] { return absl::Now(); });

  // A new session for `token` (already authenticated as `user`): its id, for the cookie.
  std::string Create(std::string token, std::string user, bool admin);

  // The session of cookie value `id`, its idle clock restarted; nullopt for an unknown, ended or
  // expired one.
  std::optional<WebSession> Find(absl::string_view id);

  // Whether the session of cookie value `id` is still on (not ended or expired), without
  // restarting its idle clock: a page left open is not a use (its live streams ask this).
  bool Alive(absl::string_view id) const;

  // Ends the session `id` (sign-out); nothing if there is none.
  void Remove(absl::string_view id);
  // Ends every session signed in with `token` (it no longer authenticates).
  void RemoveToken(absl::string_view token);

  // A one-time sign-in code standing for `token` of `user` (`yard web`'s link), good once within
  // `ttl`. At most max_sessions_per_user of a user's codes wait at once, and max_sessions in all:
  // the oldest (of the user's, first) gives way, so that a user making links over and over
  // never ends another user's.
  std::string CreateCode(std::string token, std::string user, absl::Duration ttl);
  // The token of `code`, which is spent by this; nullopt for an unknown, spent or expired one.
  std::optional<std::string> TakeCode(absl::string_view code);

  size_t size() const;

 private:
  struct Code {
    std::string token;
    std::string user;
    absl::Time expires;
  };

  // Keyed by the SHA-256 of the id: the table never holds what a cookie carries. Ends the least
  // recently used session (of `user` only, when not empty).
  void EvictLeastRecentLocked(const std::string& user) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WebSessionLimits limits_;
  const std::function<absl::Time()> now_;
  mutable absl::Mutex mu_;
  std::map<std::string, WebSession> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Code> codes_ ABSL_GUARDED_BY(mu_);  // by the SHA-256 of the code
};

}  // namespace trainyard::web

#endif  // TRAINYARD_SERVER_WEB_WEB_SESSIONS_H_
