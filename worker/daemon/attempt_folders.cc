#include "worker/daemon/attempt_folders.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log_text.h"
#include "worker/daemon/job_context.h"
#include "worker/daemon/private_tmp.h"

namespace trainyard::worker {
namespace {

absl::Time ModifiedAt(const struct stat& st) { return absl::TimeFromTimespec(st.st_mtim); }

// The names in folder `dir` (without . and ..); empty when it cannot be read.
std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  return names;
}

// Whether folder `dir` holds a shepherd's socket (rank-R.sock): its rank runs, or its exit waits
// for a worker to collect it.
bool HoldsShepherdSocket(const std::string& dir) {
  for (const std::string& name : Names(dir)) {
    if (absl::StartsWith(name, "rank-") && absl::EndsWith(name, ".sock")) return true;
  }
  return false;
}

}  // namespace

std::optional<UnixAccount> FolderOwner(const struct stat& st) {
  if (st.st_uid == geteuid()) return std::nullopt;
  UnixAccount owner;
  owner.name = absl::StrCat("uid ", st.st_uid);
  owner.uid = st.st_uid;
  owner.gid = st.st_gid;
  return owner;
}

AttemptFolders::AttemptFolders(AttemptFolderOptions options, IfIdle if_idle)
    : options_(std::move(options)), if_idle_(std::move(if_idle)), thread_([this] { Loop(); }) {}

AttemptFolders::~AttemptFolders() { Stop(); }

void AttemptFolders::Ended(const std::string& job_id, int attempt,
                           std::optional<UnixAccount> owner) {
  // (Kept folders or not, an attempt's namespaces go: they hold memory.)
  if (options_.keep && options_.namespaces.empty()) return;
  absl::MutexLock lock(&mu_);
  if (stop_) return;
  pending_.push_back(Pending{job_id, attempt, std::move(owner), options_.keep});
}

void AttemptFolders::RemoveNamespaces(const std::string& job_id, int attempt) {
  if (options_.namespaces.empty()) return;
  if (!RemoveAttemptNamespaces(NamespacesOf(options_.namespaces, job_id, attempt))) {
    spdlog::warn("the namespaces of attempt {} of job {} stay mounted in {}: {}", attempt,
                 Quoted(job_id), options_.namespaces, strerror(errno));
  }
}

void AttemptFolders::RemoveIdleNamespaces() {
  if (options_.namespaces.empty()) return;
  std::set<std::pair<std::string, int>> attempts;
  for (const std::string& name : Names(options_.namespaces)) {
    std::string job_id;
    int attempt = 0;
    if (ParseNamespaceName(name, &job_id, &attempt)) attempts.emplace(job_id, attempt);
  }
  for (const auto& [job_id, attempt] : attempts) {
    if (stopping_) return;
    const std::string dir = absl::StrCat(options_.work_dir, "/", job_id, "/attempt-", attempt);
    if (HoldsShepherdSocket(dir)) continue;
    if_idle_(job_id, attempt, [&] { RemoveNamespaces(job_id, attempt); });
  }
}

void AttemptFolders::Drain() {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || (pending_.empty() && !busy_);
  };
  mu_.Await(absl::Condition(&done));
}

void AttemptFolders::Stop() {
  stopping_ = true;  // (a scan under way ends at its next folder)
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    pending_.clear();
  }
  if (thread_.joinable()) thread_.join();
}

void AttemptFolders::Loop() {
  // (Kept folders still have their idle namespaces removed, every ten minutes.)
  const bool scans = !options_.keep && options_.keep_ended_for != absl::InfiniteDuration();
  const absl::Duration period =
      scans ? std::clamp(options_.keep_ended_for / 4, absl::Seconds(1), absl::Minutes(10))
            : (options_.namespaces.empty() ? absl::InfiniteDuration() : absl::Minutes(10));
  absl::Time next_scan = absl::Now() + period;
  absl::MutexLock lock(&mu_);
  while (true) {
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !pending_.empty(); };
    mu_.AwaitWithDeadline(absl::Condition(&ready), next_scan);
    if (stop_) return;
    if (!pending_.empty()) {
      const Pending p = std::move(pending_.front());
      pending_.pop_front();
      busy_ = true;
      mu_.Unlock();
      const std::string dir =
          absl::StrCat(options_.work_dir, "/", p.job_id, "/attempt-", p.attempt);
      // A rank of it still here (one a restarted worker is adopting) keeps it; its own end
      // queues the attempt again. Its namespaces (private_tmp.h) go as the supervisor says it is
      // idle, under its lock: no rank of it can start meanwhile and find them going.
      const bool idle = !HoldsShepherdSocket(dir) && if_idle_(p.job_id, p.attempt, [&] {
        RemoveNamespaces(p.job_id, p.attempt);
      });
      for (const std::string& folder : {dir + "/work", dir + "/errors", dir + "/tmp"}) {
        struct stat st {};
        if (!idle || p.namespaces_only || stopping_ || lstat(folder.c_str(), &st) != 0 ||
            !S_ISDIR(st.st_mode)) {
          continue;
        }
        EmptyAndRemove(folder, p.owner.has_value() ? &*p.owner : nullptr);
      }
      mu_.Lock();
      busy_ = false;
      continue;
    }
    if (absl::Now() >= next_scan) {
      mu_.Unlock();
      bool cut = false;
      Scan(/*yield=*/true, &cut);
      mu_.Lock();
      // (A scan that yielded to an ended attempt goes on once it is done.)
      next_scan = cut ? absl::Now() : absl::Now() + period;
    }
  }
}

bool AttemptFolders::EmptyAndRemove(const std::string& folder, const UnixAccount* owner) {
  absl::Status emptied = EmptyFolderAs(options_.unpacker, options_.unpacker_env, folder, owner,
                                       options_.empty_timeout);
  if (emptied.ok() && rmdir(folder.c_str()) != 0) {
    emptied = absl::InternalError(absl::StrCat("rmdir ", folder, ": ", strerror(errno)));
  }
  if (!emptied.ok()) {
    spdlog::warn("an ended attempt's folder stays: {}", EscapeControl(emptied.message()));
  }
  return emptied.ok();
}

int AttemptFolders::RemoveExpired() { return Scan(/*yield=*/false, nullptr); }

int AttemptFolders::Scan(bool yield, bool* cut) {
  absl::MutexLock scan(&scan_mu_);
  // An idle attempt's namespaces go at once, not when its folder expires, and also where folders
  // are kept: they are memory (an attempt that ended while no worker was here, or whose clean-up
  // a crash cut short).
  RemoveIdleNamespaces();
  if (options_.keep || options_.keep_ended_for == absl::InfiniteDuration()) return 0;
  int removed = 0;
  // Whether an ended attempt waits for this thread: a scan that empties many folders (the first
  // after an upgrade may expire every old attempt, each up to a minute) lets it go first.
  auto yielding = [&] {
    if (!yield) return false;
    absl::MutexLock lock(&mu_);
    return !pending_.empty();
  };
  bool yielded = false;
  bool emptied = false;  // a folder emptied (or tried) by this scan
  for (const std::string& job_id : Names(options_.work_dir)) {
    if (stopping_ || yielded) break;
    if (absl::StartsWith(job_id, ".")) continue;  // (the namespace folder)
    const std::string job_dir = absl::StrCat(options_.work_dir, "/", job_id);
    struct stat job_st {};
    if (lstat(job_dir.c_str(), &job_st) != 0 || !S_ISDIR(job_st.st_mode) ||
        job_st.st_uid != geteuid()) {
      continue;  // (the worker's own folders only: not a link, nor the context cache's)
    }
    bool removed_here = false;
    for (const std::string& name : Names(job_dir)) {
      if (stopping_ || (emptied && (yielded = yielding()))) break;
      int attempt = 0;
      if (!absl::StartsWith(name, "attempt-") || !absl::SimpleAtoi(name.substr(8), &attempt) ||
          attempt <= 0) {
        continue;
      }
      const std::string dir = absl::StrCat(job_dir, "/", name);
      struct stat st {};
      if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) continue;
      if (!if_idle_(job_id, attempt, nullptr)) continue;
      // What changed last in it: a log written, the work folder removed (the folder's own
      // time). Only what the worker owns counts: a rank's owner may set the times of theirs (the
      // work folder, the spec) to any date, and keep the folder for good.
      absl::Time newest = ModifiedAt(st);
      bool removable = true;
      std::vector<std::string> files;
      std::vector<std::pair<std::string, struct stat>> folders;
      for (const std::string& entry : Names(dir)) {
        struct stat est {};
        if (lstat(absl::StrCat(dir, "/", entry).c_str(), &est) != 0) continue;
        if (est.st_uid == geteuid()) newest = std::max(newest, ModifiedAt(est));
        if (absl::EndsWith(entry, ".sock")) {
          removable = false;  // a shepherd's: its rank runs, or its exit waits for a worker
        } else if (S_ISDIR(est.st_mode)) {
          if (entry == "work" || entry == "errors" || entry == "tmp") {
            folders.emplace_back(entry, est);
          } else {
            removable = false;  // (nothing of ours: not the worker's to remove)
          }
        } else {
          files.push_back(entry);
        }
      }
      if (!removable || absl::Now() - newest < options_.keep_ended_for) continue;
      emptied = true;
      for (const auto& [entry, est] : folders) {
        const std::optional<UnixAccount> owner = FolderOwner(est);
        removable =
            EmptyAndRemove(absl::StrCat(dir, "/", entry), owner ? &*owner : nullptr) && removable;
      }
      // The files are the worker's (the spec, the logs) in its own folder, which no rank can
      // write: unlinked, never followed.
      for (const std::string& file : files) {
        if (unlink(absl::StrCat(dir, "/", file).c_str()) != 0 && errno != ENOENT) removable = false;
      }
      if (!removable || rmdir(dir.c_str()) != 0) {
        spdlog::warn("the folder of attempt {} of job {} stays: not all of it could be removed",
                     attempt, Quoted(job_id));
        continue;
      }
      ++removed;
      removed_here = true;
      spdlog::info("removed the folder of attempt {} of job {}: unchanged for {}", attempt,
                   Quoted(job_id), absl::FormatDuration(options_.keep_ended_for));
    }
    if (removed_here) {
      // Once no other attempt of the job is left (a job's checkpoints folder stays, and it with
      // it), while no attempt of the job can start meanwhile.
      if_idle_(job_id, 0, [&job_dir] { rmdir(job_dir.c_str()); });
    }
  }
  if (cut != nullptr) *cut = yielded;
  return removed;
}

}  // namespace trainyard::worker
