#include "server/web/web_sessions.h"

#include <iterator>
#include <utility>

#include "common/credentials.h"

namespace trainyard::web {

WebSessions::WebSessions(WebSessionLimits limits, std::function<absl::Time()> now)
    : limits_(limits), now_(std::move(now)) {}

std::string WebSessions::Create(std::string token, std::string user, bool admin) {
  const std::string id = Base64Url(RandomBytes(32));
  WebSession s;
  s.token = std::move(token);
  s.user = std::move(user);
  s.admin = admin;
  s.csrf = Base64Url(RandomBytes(32));
  s.created = s.last_used = now_();
  absl::MutexLock lock(&mu_);
  size_t mine = 0;
  for (const auto& [key, other] : sessions_) mine += other.user == s.user ? 1 : 0;
  for (; limits_.max_sessions_per_user > 0 && mine >= limits_.max_sessions_per_user; --mine) {
    EvictLeastRecentLocked(s.user);
  }
  while (limits_.max_sessions > 0 && sessions_.size() >= limits_.max_sessions) {
    EvictLeastRecentLocked("");
  }
  sessions_.emplace(Sha256(id), std::move(s));
  return id;
}

std::optional<WebSession> WebSessions::Find(absl::string_view id) {
  if (id.empty() || id.size() > 128) return std::nullopt;
  const std::string key = Sha256(id);
  const absl::Time now = now_();
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return std::nullopt;
  WebSession& s = it->second;
  if (now - s.last_used >= limits_.idle || now - s.created >= limits_.lifetime) {
    sessions_.erase(it);
    return std::nullopt;
  }
  s.last_used = now;
  return s;
}

bool WebSessions::Alive(absl::string_view id) const {
  if (id.empty() || id.size() > 128) return false;
  const std::string key = Sha256(id);
  const absl::Time now = now_();
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key);
  return it != sessions_.end() && now - it->second.last_used < limits_.idle &&
         now - it->second.created < limits_.lifetime;
}

void WebSessions::Remove(absl::string_view id) {
  const std::string key = Sha256(id);
  absl::MutexLock lock(&mu_);
  sessions_.erase(key);
}

void WebSessions::RemoveToken(absl::string_view token) {
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (ConstantTimeEquals(it->second.token, token)) {
      it = sessions_.erase(it);
    } else {
      ++it;
    }
  }
}

std::string WebSessions::CreateCode(std::string token, std::string user, absl::Duration ttl) {
  const std::string code = Base64Url(RandomBytes(32));
  const absl::Time now = now_();
  absl::MutexLock lock(&mu_);
  size_t mine = 0;
  for (auto it = codes_.begin(); it != codes_.end();) {
    if (it->second.expires <= now) {
      it = codes_.erase(it);
    } else {
      mine += it->second.user == user ? 1 : 0;
      ++it;
    }
  }
  // The oldest code (of `user` only, when not empty) gives way.
  auto evict_oldest = [this](const std::string& of) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto oldest = codes_.end();
    for (auto it = codes_.begin(); it != codes_.end(); ++it) {
      if (!of.empty() && it->second.user != of) continue;
      if (oldest == codes_.end() || it->second.expires < oldest->second.expires) oldest = it;
    }
    if (oldest != codes_.end()) codes_.erase(oldest);
  };
  for (; limits_.max_sessions_per_user > 0 && mine >= limits_.max_sessions_per_user; --mine) {
    evict_oldest(user);
  }
  while (limits_.max_sessions > 0 && codes_.size() >= limits_.max_sessions) evict_oldest("");
  codes_.emplace(Sha256(code), Code{std::move(token), std::move(user), now + ttl});
  return code;
}

std::optional<std::string> WebSessions::TakeCode(absl::string_view code) {
  if (code.empty() || code.size() > 128) return std::nullopt;
  const std::string key = Sha256(code);
  const absl::Time now = now_();
  absl::MutexLock lock(&mu_);
  auto it = codes_.find(key);
  if (it == codes_.end()) return std::nullopt;
  Code taken = std::move(it->second);
  codes_.erase(it);
  if (taken.expires <= now) return std::nullopt;
  return std::move(taken.token);
}

size_t WebSessions::size() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

void WebSessions::EvictLeastRecentLocked(const std::string& user) {
  auto oldest = sessions_.end();
  for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
    if (!user.empty() && it->second.user != user) continue;
    if (oldest == sessions_.end() || it->second.last_used < oldest->second.last_used) oldest = it;
  }
  if (oldest != sessions_.end()) sessions_.erase(oldest);
}

}  // namespace trainyard::web
