// JobManager: usage accounting (the ledger, quotas, fair share, QuotaReport, why_waiting) (see
// job_manager.h).
#include "server/coordinator/job_manager.h"
#include "server/coordinator/job_manager_internal.h"
#include "server/coordinator/job_state.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/check.h"
#include "common/ps_layout.h"
#include "common/spec.h"
#include "common/status_macros.h"

namespace trainyard::coordinator {

void JobManager::CountUse(std::map<std::string, Use>* by_account,
                          std::map<std::string, Use>* by_owner) const {
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    const std::string& account = AccountOf(job);
    const int64_t devices = job.spec().resources().slots();
    for (Use* use : {&(*by_account)[account], by_owner ? &(*by_owner)[job.owner()] : nullptr}) {
      if (use == nullptr) continue;
      if (IsActive(job.state())) use->running_devices += devices;
      if (IsPending(job.state())) {
        use->queued_devices += devices;
        ++use->queued_jobs;
      }
    }
  }
  // Ranks still stopping hold their devices for their job (as the scheduler counts them).
  for (const auto& [id, stopping] : Stopping(clock_.Now())) {
    const v1::Job& job = jobs_.at(id);
    (*by_account)[AccountOf(job)].running_devices += stopping.DeviceCount();
    if (by_owner != nullptr) (*by_owner)[job.owner()].running_devices += stopping.DeviceCount();
  }
}

std::shared_ptr<const SharingPolicy> JobManager::CurrentPolicy() const {
  if (policy_) return policy_();
  static const std::shared_ptr<const SharingPolicy> kNone = [] {
    auto policy = std::make_shared<SharingPolicy>();
    policy->accounts[kDefaultAccount] = {};
    return policy;
  }();
  return kNone;
}

bool JobManager::HasDemand(const std::string& account, const std::map<std::string, Use>& use,
                           absl::Time now) const {
  if (auto it = use.find(account); it != use.end()) {
    if (it->second.running_devices > 0 || it->second.queued_jobs > 0) return true;
  }
  return usage_.At(AccountKey(account), now) > 0;
}

JobManager::ShareTotals JobManager::TotalsOf(const SharingPolicy& policy,
                                             const std::map<std::string, Use>& use,
                                             absl::Time now) const {
  ShareTotals totals;
  for (const auto& [name, a] : policy.accounts) {
    // Shares count among the accounts that want devices (an empty account, such as an unused
    // `default`, would otherwise take a part of every percentage).
    if (HasDemand(name, use, now)) totals.shares += a.share;
    totals.usage += usage_.At(AccountKey(name), now);
  }
  return totals;
}

v1::AccountUsage JobManager::AccountUsageOf(const std::string& name, const SharingPolicy& policy,
                                            const ShareTotals& totals,
                                            const std::map<std::string, Use>& use,
                                            absl::Time now) const {
  const SharingPolicy::Account account = policy.AccountOf(name);
  // An account without demand: its part if it had some.
  const double shares = totals.shares + (HasDemand(name, use, now) ? 0 : account.share);
  const double usage = totals.usage;
  v1::AccountUsage out;
  out.set_name(name);
  if (account.quota >= 0) out.set_quota_devices(account.quota);
  if (account.borrow_limit >= 0) out.set_borrow_limit_devices(account.borrow_limit);
  out.set_share(account.share);
  out.set_share_fraction(shares > 0 ? account.share / shares : 0);
  const double mine = usage_.At(AccountKey(name), now);
  out.set_usage_device_hours(mine / 3600);
  out.set_usage_fraction(usage > 0 ? mine / usage : 0);
  if (auto it = use.find(name); it != use.end()) {
    out.set_running_devices(it->second.running_devices);
    out.set_queued_devices(it->second.queued_devices);
    out.set_queued_jobs(it->second.queued_jobs);
  }
  return out;
}

v1::QuotaReport JobManager::Quota(const std::string& user, bool all_accounts) const {
  const std::shared_ptr<const SharingPolicy> current = CurrentPolicy();
  const SharingPolicy& policy = *current;
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  std::map<std::string, Use> by_account, by_owner;
  CountUse(&by_account, &by_owner);
  const SharingPolicy::User limits = policy.UserOf(user);
  v1::QuotaReport report;
  report.set_user(user);
  report.set_account(limits.account);
  if (limits.max_running_devices >= 0) report.set_max_running_devices(limits.max_running_devices);
  if (limits.max_queued_jobs >= 0) {
    report.set_max_queued_jobs(limits.max_queued_jobs);
  } else if (default_max_queued_jobs_ >= 0) {
    report.set_max_queued_jobs(default_max_queued_jobs_);
  }
  if (auto it = by_owner.find(user); it != by_owner.end()) {
    report.set_running_devices(it->second.running_devices);
    report.set_queued_jobs(it->second.queued_jobs);
  }
  report.set_usage_device_hours(usage_.At(UserKey(user), now) / 3600);
  report.set_half_life_hours(absl::ToDoubleHours(usage_.half_life()));
  const ShareTotals totals = TotalsOf(policy, by_account, now);
  *report.add_accounts() = AccountUsageOf(limits.account, policy, totals, by_account, now);
  if (all_accounts) {
    for (const auto& [name, a] : policy.accounts) {
      if (name != limits.account)
        *report.add_accounts() = AccountUsageOf(name, policy, totals, by_account, now);
    }
  }
  return report;
}

std::string JobManager::UnfinishedJobOf(const std::string& account) const {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : unfinished_) {
    if (AccountOf(jobs_.at(id)) == account) return id;
  }
  return "";
}

std::vector<v1::AccountUsage> JobManager::AccountUsages() const {
  const std::shared_ptr<const SharingPolicy> current = CurrentPolicy();
  const SharingPolicy& policy = *current;
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  std::map<std::string, Use> by_account;
  CountUse(&by_account, nullptr);
  const ShareTotals totals = TotalsOf(policy, by_account, now);
  std::vector<v1::AccountUsage> out;
  for (const auto& [name, a] : policy.accounts) {
    out.push_back(AccountUsageOf(name, policy, totals, by_account, now));
  }
  return out;
}

std::string JobManager::WhyWaiting(const std::string& job_id, const std::string& viewer,
                                   bool viewer_is_admin) const {
  const std::shared_ptr<const SharingPolicy> current = CurrentPolicy();
  const SharingPolicy& policy = *current;
  absl::MutexLock lock(&mu_);
  const auto found = jobs_.find(job_id);
  if (found == jobs_.end() || !IsPending(found->second.state())) return "";
  const v1::Job& job = found->second;
  if (job.spec().after_size() > 0) {
    if (const auto unmet = UnmetDependency(job); unmet.has_value()) {
      return absl::StrCat("waiting for job ", unmet->job_id, " (", v1::JobState_Name(unmet->state),
                          ") to succeed (after)");
    }
  }
  if (const int limit = job.spec().array().max_running();
      limit > 0 && ArrayTasksToConsider().count(job.id()) == 0) {
    int stopping = 0;
    const int running = RunningArrayTasks(job, &stopping);
    return absl::StrCat("waiting: ", running, " tasks of array ", job.spec().array().id(),
                        stopping > 0 ? absl::StrCat(" run (", stopping, " stopping)") : " run",
                        ", at most ", limit, " at once",
                        running < limit ? "; its older tasks go first" : "");
  }
  if (!last_pass_.has_value()) return "waiting for the next scheduling pass";
  const auto it = last_pass_->waits.find(job.id());
  if (it == last_pass_->waits.end()) return "waiting for the next scheduling pass";
  const JobWait& wait = it->second;
  const int64_t devices = job.spec().resources().slots();
  const std::string& account = AccountOf(job);
  const SharingPolicy::Account limits = policy.AccountOf(account);
  std::map<std::string, Use> by_account, by_owner;
  CountUse(&by_account, &by_owner);
  const absl::Time now = clock_.Now();
  std::string why;
  auto head_text = [&] {
    std::string text = last_pass_->head;
    if (auto h = jobs_.find(last_pass_->head); h != jobs_.end()) {
      // Another user's job is not named to users who may not see it.
      if (!viewer_is_admin && h->second.owner() != viewer) text = "another user's job";
      absl::StrAppend(&text, " (priority ", h->second.spec().priority(), ", ",
                      h->second.spec().resources().slots(), " devices, ",
                      StartText(last_pass_->head_start, now), ")");
    }
    return text;
  };
  switch (wait.reason) {
    case WaitReason::kPlaced:
      why = "placed in the latest pass; waiting for parameter-server memory or its start";
      if (!job.message().empty()) why = job.message();
      break;
    case WaitReason::kDevices:
      // "free devices" counts, on nodes that count them, the CPUs and memory its ranks take.
      why = absl::StrCat("first in line, waiting for ", devices,
                         " free devices (with the CPUs and memory of its ranks, where nodes "
                         "count them); ",
                         StartText(last_pass_->head_start, now));
      break;
    case WaitReason::kBehindHead:
    case WaitReason::kHeadStartUnknown:
      why = absl::StrCat("waiting for ", devices, " devices behind ", wait.position,
                         " jobs ahead in line, first ", head_text());
      if (wait.reason == WaitReason::kBehindHead) {
        absl::StrAppend(&why, "; starting it now would delay that job (no backfill)");
      }
      break;
    case WaitReason::kAccountLimit:
      why = absl::StrCat("account ", account, " holds ", by_account[account].running_devices,
                         " devices: its quota of ", limits.quota, " plus its borrow limit of ",
                         limits.borrow_limit, " leave no room for ", devices, " more");
      break;
    case WaitReason::kUserLimit:
      why = absl::StrCat("user ", job.owner(), " holds ", by_owner[job.owner()].running_devices,
                         " devices of its cap of ", policy.UserOf(job.owner()).max_running_devices,
                         " (max_running_devices)");
      break;
    case WaitReason::kNotPreemptibleBeyondQuota:
      why = absl::StrCat("not preemptible, so it runs only within account ", account,
                         "'s quota of ", limits.quota, " devices; ",
                         by_account[account].running_devices, " are in use");
      break;
    case WaitReason::kUnplaceable:
      if (const int block = RankBlockOf(job.spec()); block > 1) {
        // Its groups stay on one node each: a node counts only its whole groups.
        const bool tensor = job.spec().parallel().tensor_parallel() == block;
        why = absl::StrCat(
            "needs ", devices, " devices in groups of ", block, " on one node each (",
            tensor ? "parallel.tensor_parallel" : "HYBRID_SHARD's replica of stages x tensor ranks",
            "), more than the ready nodes that take its owner's jobs hold in whole groups");
      } else {
        why = absl::StrCat("needs ", devices,
                           " devices, more than the ready nodes that take its owner's jobs have");
      }
      if (job.spec().resources().cpus() > 0 || job.spec().resources().memory_bytes() > 0) {
        absl::StrAppend(&why, " (a node counts only the ranks its CPUs and memory hold)");
      }
      break;
  }
  // Behind another account's job of the same priority: that account goes first by fair share (or
  // by its quota). Say so, and when, at the current use, it stops going first: an account that
  // arrives late takes back its whole deficit, which with a long half-life takes a while.
  const auto head = jobs_.find(last_pass_->head);
  if ((wait.reason == WaitReason::kBehindHead || wait.reason == WaitReason::kHeadStartUnknown) &&
      head != jobs_.end() && AccountOf(head->second) != account &&
      head->second.spec().priority() == job.spec().priority()) {
    const std::string& other = AccountOf(head->second);
    const SharingPolicy::Account other_limits = policy.AccountOf(other);
    const std::string other_text =
        viewer_is_admin ? absl::StrCat("account ", other) : std::string("another account");
    const Use& mine = by_account[account];
    const Use& theirs = by_account[other];
    if (other_limits.quota > 0 &&
        theirs.running_devices + head->second.spec().resources().slots() <= other_limits.quota) {
      absl::StrAppend(&why, "; ", other_text, " goes first: that job is within its quota");
    } else if (limits.share > 0 && other_limits.share > 0) {
      const double my_usage = usage_.At(AccountKey(account), now);
      const double their_usage = usage_.At(AccountKey(other), now);
      const double mine_per_share = my_usage / limits.share / 3600;
      const double theirs_per_share = their_usage / other_limits.share / 3600;
      if (theirs_per_share < mine_per_share) {
        absl::StrAppend(&why,
                        absl::StrFormat("; %s goes first by fair share: its usage per share is "
                                        "%.1f device-hours, %s's %.1f",
                                        other_text, theirs_per_share, account, mine_per_share));
        const auto even =
            TimeUntilEvenUsage(my_usage, limits.share, mine.running_devices, their_usage,
                               other_limits.share, theirs.running_devices, usage_.half_life());
        const absl::Time reset = NextReset(usage_.reset(), now);
        if (even.has_value() && now + *even < reset) {
          absl::StrAppend(
              &why, absl::StrFormat(
                        ", until about %s from now at the current use (%d devices against %d; "
                        "usage halves every %s)",
                        HumanDuration(*even), theirs.running_devices, mine.running_devices,
                        absl::FormatDuration(usage_.half_life())));
        } else if (reset != absl::InfiniteFuture()) {
          absl::StrAppend(
              &why, absl::StrFormat(", until usage starts over in %s (%s reset)",
                                    HumanDuration(reset - now), UsageResetName(usage_.reset())));
        } else {
          absl::StrAppend(&why, absl::StrFormat(", for as long as it uses %d devices against %d",
                                                theirs.running_devices, mine.running_devices));
        }
      }
    }
  }
  const v1::AccountUsage usage =
      AccountUsageOf(account, policy, TotalsOf(policy, by_account, now), by_account, now);
  absl::StrAppend(
      &why, absl::StrFormat(". Account %s: share %.0f%%, usage %.0f%% (%.1f device-hours, decayed)",
                            account, 100 * usage.share_fraction(), 100 * usage.usage_fraction(),
                            usage.usage_device_hours()));
  if (usage.has_quota_devices()) {
    absl::StrAppend(&why, absl::StrFormat(", quota %d devices, %d in use", usage.quota_devices(),
                                          usage.running_devices()));
  }
  return why;
}

void JobManager::ChargeUsage() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_.Now();
  const absl::Duration since = last_charge_.has_value()
                                   ? std::min(now - *last_charge_, absl::Minutes(5))
                                   : absl::ZeroDuration();
  last_charge_ = now;
  if (since <= absl::ZeroDuration()) return;
  const double seconds = absl::ToDoubleSeconds(since);
  for (const std::string& id : unfinished_) {
    const v1::Job& job = jobs_.at(id);
    if (!IsActive(job.state())) continue;
    int64_t devices = 0;
    for (const auto& p : job.placement()) devices += p.device_indices_size();
    const std::string& account = AccountOf(job);
    usage_.Charge(AccountKey(account), devices * seconds, now);
    usage_.Charge(UserKey(job.owner()), devices * seconds, now);
  }
  // A stopping rank's device is its job's until it exits (saving, say): charged as running.
  for (const auto& [id, stopping] : Stopping(now)) {
    const v1::Job& job = jobs_.at(id);
    const double device_seconds = static_cast<double>(stopping.DeviceCount()) * seconds;
    usage_.Charge(AccountKey(AccountOf(job)), device_seconds, now);
    usage_.Charge(UserKey(job.owner()), device_seconds, now);
  }
}

namespace {

constexpr char kUsageKind[] = "usage";

}  // namespace

absl::Status JobManager::SaveUsage() {
  WriteBatch batch;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, entry] : usage_.entries()) {
      batch.put_records.push_back({kUsageKind, key,
                                   absl::StrCat(absl::StrFormat("%.17g", entry.value), " ",
                                                absl::ToUnixMillis(entry.as_of))});
    }
  }
  if (batch.put_records.empty()) return absl::OkStatus();
  return store_.CommitSync(std::move(batch));
}

absl::Status JobManager::LoadUsage() {
  ASSIGN_OR_RETURN(std::vector<StoredRecord> records, store_.LoadRecords(kUsageKind));
  absl::MutexLock lock(&mu_);
  for (const StoredRecord& r : records) {
    const std::vector<std::string> parts = absl::StrSplit(r.payload, ' ');
    double value = 0;
    int64_t ms = 0;
    if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &value) ||
        !absl::SimpleAtoi(parts[1], &ms)) {
      // Usage is an estimate that decays anyway: a bad record restarts that key from zero.
      spdlog::warn("usage record {} is unreadable; its usage starts from zero", r.id);
      continue;
    }
    usage_.Restore(r.id, {value, absl::FromUnixMillis(ms)});
  }
  return absl::OkStatus();
}

}  // namespace trainyard::coordinator
