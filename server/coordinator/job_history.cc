#include "server/coordinator/job_history.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace trainyard::coordinator {
namespace {

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Reads a varint of at most 10 bytes at `*pos`, advancing it; false when malformed or cut.
bool ReadVarint(const std::string& in, size_t* pos, uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 64 && *pos < in.size(); shift += 7) {
    const uint8_t byte = static_cast<uint8_t>(in[(*pos)++]);
    *v |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// Which records to keep so that their encoding fits `max_bytes`.
std::vector<bool> Kept(const std::vector<size_t>& sizes, size_t max_bytes, bool thin) {
  const size_t n = sizes.size();
  size_t total = 0;
  for (size_t s : sizes) total += s;
  std::vector<bool> keep(n, true);
  if (total <= max_bytes || n == 0) return keep;
  if (!thin) {  // the newest that fit
    size_t bytes = 0;
    for (size_t i = n; i-- > 0;) {
      bytes += sizes[i];
      keep[i] = bytes <= max_bytes;
    }
    return keep;
  }
  // Every stride-th record and the last, with the smallest stride that fits.
  for (size_t stride = std::max<size_t>(2, total / std::max<size_t>(max_bytes, 1));; ++stride) {
    size_t bytes = 0;
    for (size_t i = 0; i < n; ++i) {
      keep[i] = i % stride == 0 || i == n - 1;
      if (keep[i]) bytes += sizes[i];
    }
    if (bytes <= max_bytes || stride >= n) return keep;
  }
}

}  // namespace

template <typename T>
std::string EncodeSeries(const std::vector<T>& records, size_t max_bytes, bool thin) {
  std::vector<size_t> sizes;
  sizes.reserve(records.size());
  for (const T& r : records) {
    const size_t size = r.ByteSizeLong();
    sizes.push_back(size + VarintSize(size));
  }
  const std::vector<bool> keep = Kept(sizes, max_bytes, thin);
  std::string out;
  for (size_t i = 0; i < records.size(); ++i) {
    if (!keep[i]) continue;
    AppendVarint(&out, records[i].ByteSizeLong());
    records[i].AppendToString(&out);
  }
  return out;
}

template <typename T>
absl::StatusOr<std::vector<T>> DecodeSeries(const std::string& payload, int* unreadable) {
  std::vector<T> records;
  int skipped = 0;
  size_t pos = 0;
  while (pos < payload.size()) {
    uint64_t size = 0;
    if (!ReadVarint(payload, &pos, &size) || size > payload.size() - pos) {
      return absl::DataLossError(
          absl::StrCat("record ", records.size() + skipped, " is cut short"));
    }
    T record;
    if (record.ParseFromArray(payload.data() + pos, static_cast<int>(size))) {
      records.push_back(std::move(record));
    } else {
      ++skipped;
    }
    pos += size;
  }
  if (unreadable != nullptr) *unreadable = skipped;
  return records;
}

template std::string EncodeSeries(const std::vector<v1::LogLine>&, size_t, bool);
template std::string EncodeSeries(const std::vector<v1::StepReport>&, size_t, bool);
template absl::StatusOr<std::vector<v1::LogLine>> DecodeSeries(const std::string&, int*);
template absl::StatusOr<std::vector<v1::StepReport>> DecodeSeries(const std::string&, int*);

absl::StatusOr<int> JobHistory::EvictFinished(size_t max_jobs) {
  const std::vector<v1::Job> candidates = jobs_.TakeEvictionCandidates(max_jobs);
  if (candidates.empty()) return 0;
  WriteBatch batch;
  std::vector<std::string> evicting, later;
  size_t bytes = 0;
  for (const v1::Job& job : candidates) {
    if (!evicting.empty() && bytes >= options_.max_batch_bytes) {
      later.push_back(job.id());
      continue;
    }
    const int64_t expires_ms =
        options_.retention == absl::InfiniteDuration()
            ? 0
            : absl::ToUnixMillis(absl::FromUnixMillis(job.end_time_ms()) + options_.retention);
    // Nothing kept, nothing written: a job loaded back after a restart must not overwrite the
    // history an earlier eviction wrote.
    if (std::vector<v1::LogLine> lines = logs_.Snapshot(job.id()); !lines.empty()) {
      batch.put_records.push_back({kJobLogsRecord, job.id(),
                                   EncodeSeries(lines, options_.max_log_bytes_per_job, false),
                                   expires_ms});
      bytes += batch.put_records.back().payload.size();
    }
    if (std::vector<v1::StepReport> steps = metrics_.Snapshot(job.id()); !steps.empty()) {
      batch.put_records.push_back({kJobMetricsRecord, job.id(),
                                   EncodeSeries(steps, options_.max_metric_bytes_per_job, true),
                                   expires_ms});
      bytes += batch.put_records.back().payload.size();
    }
    evicting.push_back(job.id());
  }
  jobs_.EvictionFailed(later);
  if (absl::Status s = store_.CommitSync(std::move(batch)); !s.ok()) {
    jobs_.EvictionFailed(evicting);
    return s;
  }
  // The job leaves memory before its records do: a reader that finds no records in memory and
  // no job there reads the store, which has both.
  jobs_.Evict(evicting);
  for (const std::string& id : evicting) {
    logs_.Erase(id);
    metrics_.Erase(id);
  }
  return static_cast<int>(evicting.size());
}

absl::Status JobHistory::PurgeExpired() {
  WriteBatch batch;
  batch.delete_records_expired_at_ms = absl::ToUnixMillis(clock_.Now());
  return store_.CommitSync(std::move(batch));
}

namespace {

// `broken` (when given) is set where the record itself cannot be decoded (its framing), as
// against the store's own failures.
template <typename T>
absl::StatusOr<std::vector<T>> ReadSeries(JobStore& store, const char* kind,
                                          const std::string& job_id, bool* broken = nullptr) {
  absl::StatusOr<StoredRecord> record = store.GetRecord(kind, job_id);
  if (absl::IsNotFound(record.status())) return std::vector<T>{};
  if (!record.ok()) return record.status();
  int unreadable = 0;
  absl::StatusOr<std::vector<T>> records = DecodeSeries<T>(record->payload, &unreadable);
  if (!records.ok()) {
    if (broken != nullptr) *broken = true;
    return absl::DataLossError(
        absl::StrCat(kind, " of ", job_id, " in the store: ", records.status().message()));
  }
  if (unreadable > 0) {
    spdlog::warn("{} of {} in the store: {} unreadable record(s) left out", kind, job_id,
                 unreadable);
  }
  return records;
}

}  // namespace

std::vector<StoredRecord> SeriesRecords(const JobLogs& logs, const JobMetrics& metrics,
                                        const JobHistoryOptions& options, const std::string& id,
                                        int64_t end_ms) {
  const int64_t expires_ms =
      end_ms == 0 || options.retention == absl::InfiniteDuration()
          ? 0
          : absl::ToUnixMillis(absl::FromUnixMillis(end_ms) + options.retention);
  std::vector<StoredRecord> records;
  const std::vector<v1::LogLine> lines = logs.Snapshot(id);
  const std::vector<v1::StepReport> steps = metrics.Snapshot(id);
  if (!lines.empty()) {
    records.push_back({kJobLogsRecord, id,
                       EncodeSeries(lines, options.max_log_bytes_per_job, false), expires_ms});
  }
  if (!steps.empty()) {
    records.push_back({kJobMetricsRecord, id,
                       EncodeSeries(steps, options.max_metric_bytes_per_job, true), expires_ms});
  }
  return records;
}

absl::StatusOr<int> JobHistory::SaveUnfinished(bool changed_only) {
  absl::MutexLock lock(&save_mu_);
  WriteBatch batch;
  std::map<std::string, std::pair<uint64_t, uint64_t>> saved;
  int jobs = 0;
  for (const auto& [id, end_ms] : jobs_.ResidentJobEnds()) {
    // (Read before the snapshots: an append in between is written again next time.)
    const std::pair<uint64_t, uint64_t> now = {logs_.Appends(id), metrics_.Appends(id)};
    auto last = saved_.find(id);
    saved[id] = now;
    if (changed_only && last != saved_.end() && last->second == now) continue;
    std::vector<StoredRecord> records = SeriesRecords(logs_, metrics_, options_, id, end_ms);
    jobs += !records.empty();
    for (StoredRecord& r : records) batch.put_records.push_back(std::move(r));
  }
  if (!batch.empty()) RETURN_IF_ERROR(store_.CommitSync(std::move(batch)));
  saved_ = std::move(saved);  // (finished jobs drop out)
  return jobs;
}

absl::StatusOr<int> JobHistory::LoadUnfinished() {
  int jobs = 0;
  // A job's history the store holds but cannot be decoded (a broken record) is left out, said:
  // it must not keep the coordinator from starting. The store's own failures stop the start.
  auto readable = [this](auto tag, const char* kind, const std::string& id) {
    using T = decltype(tag);
    bool broken = false;
    absl::StatusOr<std::vector<T>> series = ReadSeries<T>(store_, kind, id, &broken);
    if (broken) {
      spdlog::error("{}: the coordinator starts without it",
                    std::string(series.status().message()));
      return absl::StatusOr<std::vector<T>>(std::vector<T>{});
    }
    return series;
  };
  for (const auto& [id, end_ms] : jobs_.ResidentJobEnds()) {
    ASSIGN_OR_RETURN(std::vector<v1::LogLine> lines, readable(v1::LogLine(), kJobLogsRecord, id));
    ASSIGN_OR_RETURN(std::vector<v1::StepReport> steps,
                     readable(v1::StepReport(), kJobMetricsRecord, id));
    jobs += !lines.empty() || !steps.empty();
    if (!lines.empty()) logs_.Append(id, std::move(lines));
    if (!steps.empty()) metrics_.Append(id, std::move(steps));
  }
  return jobs;
}

absl::StatusOr<std::vector<v1::LogLine>> JobHistory::Logs(const std::string& job_id) const {
  return ReadSeries<v1::LogLine>(store_, kJobLogsRecord, job_id);
}

absl::StatusOr<std::vector<v1::StepReport>> JobHistory::Metrics(const std::string& job_id) const {
  return ReadSeries<v1::StepReport>(store_, kJobMetricsRecord, job_id);
}

}  // namespace trainyard::coordinator
