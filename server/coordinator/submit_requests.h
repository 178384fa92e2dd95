// SubmitRequests: JobManager's owner of submits' request ids (JobService.Submit's request_id,
// which yard and the SDK send with every submit and its retries): which job each (owner, request
// id) made, whether that job is durable yet, and when the id expires (a day after it was used).
// A retried submit is answered with the job its first copy stored, never run twice. The ids are
// stored with their jobs (record kind "submit_request") and loaded at start.
//
// State with no lock of its own: JobManager holds its mutex around every call.
#ifndef TRAINYARD_SERVER_COORDINATOR_SUBMIT_REQUESTS_H_
#define TRAINYARD_SERVER_COORDINATOR_SUBMIT_REQUESTS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/time/time.h"

namespace trainyard::coordinator {

class SubmitRequests {
 public:
  static constexpr absl::Duration kLifetime = absl::Hours(24);
  static constexpr char kRecordKind[] = "submit_request";

  // The record id of an owner's request id ('/' is in neither a request id nor needed to split).
  static std::string Key(const std::string& owner, const std::string& request_id);

  struct Known {
    std::string job_id;
    bool durable = false;  // false: its first copy is still being stored
  };
  // What `key` made, unless it expired by `now_ms` (expired ones are forgotten here).
  std::optional<Known> Find(const std::string& key, int64_t now_ms);
  bool Contains(const std::string& key) const { return requests_.count(key) > 0; }

  // A stored one (at start): durable.
  void Load(const std::string& key, std::string job_id, int64_t expires_ms);
  // A submit of `key` making `job_id` is being stored; returns when the id expires.
  int64_t Start(const std::string& key, const std::string& job_id, int64_t now_ms);
  // Its commit answered: durable, or (`stored` false) forgotten, so that a retry submits afresh.
  void Stored(const std::string& key, const std::string& job_id, bool stored);
  // Whether the store's expired ids are due to be deleted (once a minute); true marks them done.
  bool PruneStoreDue(int64_t now_ms);

 private:
  struct Request {
    std::string job_id;
    bool durable = false;
    int64_t expires_ms = 0;
  };
  std::map<std::string, Request> requests_;
  std::multimap<int64_t, std::string> expiry_;  // expires_ms → key, for pruning
  int64_t store_pruned_ms_ = 0;
};

}  // namespace trainyard::coordinator

#endif  // TRAINYARD_SERVER_COORDINATOR_SUBMIT_REQUESTS_H_
