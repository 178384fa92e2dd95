#include "server/coordinator/context_store.h"

#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace trainyard::coordinator {

std::string ContextStore::Key(const std::string& owner, const std::string& digest) {
  return absl::StrCat(owner, "/", digest);  // no '/' in a user name or a digest
}

absl::StatusOr<int64_t> ContextStore::Write(const std::string& owner, const std::string& digest,
                                            const std::string& archive, int64_t expires_ms) {
  WriteBatch batch;
  batch.put_records.push_back({kRecordKind, Key(owner, digest), archive, expires_ms});
  batch.put_records.push_back(
      {kInfoKind, Key(owner, digest), absl::StrCat(archive.size()), expires_ms});
  RETURN_IF_ERROR(store_.CommitSync(std::move(batch)));
  return expires_ms;
}

absl::StatusOr<int64_t> ContextStore::Put(const std::string& owner, const std::string& digest,
                                          const std::string& archive) {
  // One at a time: two uploads' sums of what their owner keeps would each leave out the other.
  absl::MutexLock lock(&put_mu_);
  const int64_t now_ms = absl::ToUnixMillis(clock_.Now());
  // The owner's other contexts, by their small info records.
  ASSIGN_OR_RETURN(const std::vector<StoredRecord> infos, store_.LoadRecords(kInfoKind));
  int64_t kept = 0;
  const std::string mine = owner + "/";
  for (const StoredRecord& info : infos) {
    int64_t bytes = 0;
    if (info.id.rfind(mine, 0) != 0 || info.id == Key(owner, digest) ||
        (info.expires_ms > 0 && info.expires_ms <= now_ms) ||
        !absl::SimpleAtoi(info.payload, &bytes)) {
      continue;
    }
    kept += bytes;
  }
  if (kept + static_cast<int64_t>(archive.size()) > options_.max_bytes_per_user) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "context: you keep ", kept >> 20, " MiB of uploaded contexts; with this one's ",
        archive.size() >> 20, " MiB that is over ", options_.max_bytes_per_user >> 20,
        " MiB (an upload no job names goes after a day, one a job names with the job's logs)"));
  }
  int64_t expires_ms = now_ms + absl::ToInt64Milliseconds(options_.unclaimed);
  // Uploaded again (the same folder): kept at least as long as before.
  if (auto info = store_.GetRecord(kInfoKind, Key(owner, digest)); info.ok()) {
    expires_ms = std::max(expires_ms, info->expires_ms);
  }
  return Write(owner, digest, archive, expires_ms);
}

absl::Status ContextStore::Claim(const std::string& owner, const std::string& digest) {
  const int64_t now_ms = absl::ToUnixMillis(clock_.Now());
  auto info = store_.GetRecord(kInfoKind, Key(owner, digest));
  if (absl::IsNotFound(info.status()) || (info.ok() && info->expires_ms <= now_ms)) {
    return absl::NotFoundError(
        absl::StrCat("context: ", digest,
                     " is not a context you uploaded (or it expired: an upload no job "
                     "names is kept for a day); yard submit --context DIR uploads it"));
  }
  if (!info.ok()) return info.status();
  const int64_t keep_ms = absl::ToInt64Milliseconds(options_.claimed);
  if (info->expires_ms - now_ms >= keep_ms / 2) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::string archive, Read(owner, digest));
  return Write(owner, digest, archive, now_ms + keep_ms).status();
}

absl::StatusOr<std::string> ContextStore::Read(const std::string& owner,
                                               const std::string& digest) {
  int64_t expires_ms = 0;
  return Read(owner, digest, &expires_ms);
}

absl::StatusOr<std::string> ContextStore::Read(const std::string& owner, const std::string& digest,
                                               int64_t* expires_ms) {
  auto record = store_.GetRecord(kRecordKind, Key(owner, digest));
  if (absl::IsNotFound(record.status()) ||
      (record.ok() && record->expires_ms <= absl::ToUnixMillis(clock_.Now()))) {
    return absl::NotFoundError(
        absl::StrCat("context ", digest, " of ", owner, " is not stored (it expired?)"));
  }
  if (!record.ok()) return record.status();
  *expires_ms = record->expires_ms;
  return std::move(record->payload);
}

absl::StatusOr<std::shared_ptr<const std::string>> ContextStore::ReadShared(
    const std::string& owner, const std::string& digest) {
  absl::MutexLock lock(&shared_mu_);
  for (auto it = shared_.begin(); it != shared_.end();) {
    it = it->second.archive.expired() ? shared_.erase(it) : std::next(it);
  }
  const std::string key = Key(owner, digest);
  if (auto it = shared_.find(key);
      it != shared_.end() && it->second.expires_ms > absl::ToUnixMillis(clock_.Now())) {
    if (std::shared_ptr<const std::string> held = it->second.archive.lock()) return held;
  }
  int64_t expires_ms = 0;
  ASSIGN_OR_RETURN(std::string archive, Read(owner, digest, &expires_ms));
  auto shared = std::make_shared<const std::string>(std::move(archive));
  shared_[key] = {shared, expires_ms};
  return shared;
}

}  // namespace trainyard::coordinator
