// The coordinator replicas a client may call (`--coordinator a:7070,b:7070`, or the same in
// TRAINYARD_COORDINATOR): the address in use, and where to go after a call failed. A standby
// answers every call with UNAVAILABLE and the leader's address in the trailing metadata
// kLeaderMetadata; a client moves there. A call that found nobody (UNAVAILABLE without it, the
// leader gone) or no answer in time (DEADLINE_EXCEEDED: a leader paused or cut off) moves to the
// next address of the list. With one address nothing ever moves but to a leader a standby named.
//
// Used by yard, worker daemons, parameter servers and ranks. Thread-safe.
#ifndef TRAINYARD_COMMON_COORDINATOR_ENDPOINTS_H_
#define TRAINYARD_COMMON_COORDINATOR_ENDPOINTS_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

namespace trainyard {

// Trailing metadata of a standby's UNAVAILABLE: the leader's HOST:PORT (empty: none known yet).
inline constexpr char kLeaderMetadata[] = "trainyard-leader";
// How the message of a stream the coordinator ended for falling behind begins
// (RESOURCE_EXHAUSTED): a follower reads it again from the start, dropping what it had by seq.
inline constexpr char kFellBehind[] = "the stream's reader fell more than ";
// Addresses in one list, at most.
inline constexpr size_t kMaxCoordinatorAddresses = 16;

class CoordinatorEndpoints {
 public:
  // "a:7070" or "a:7070,b:7070" (spaces around commas allowed). INVALID_ARGUMENT naming `flag`
  // for an empty list, an empty entry, an entry without a port, or more than 16 entries.
  static absl::StatusOr<std::vector<std::string>> ParseList(const std::string& flag,
                                                            const std::string& list) {
    std::vector<std::string> addresses;
    for (absl::string_view part : absl::StrSplit(list, ',')) {
      const std::string address(absl::StripAsciiWhitespace(part));
      const size_t colon = address.rfind(':');
      if (address.empty() || colon == std::string::npos || colon == 0 ||
          colon + 1 == address.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            flag, ": '", address, "' is not HOST:PORT (a list is HOST:PORT,HOST:PORT,...)"));
      }
      addresses.push_back(address);
    }
    if (addresses.size() > kMaxCoordinatorAddresses) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": more than ", kMaxCoordinatorAddresses, " addresses"));
    }
    return addresses;
  }

  // `list` as ParseList takes it; an unparsable list is used as one address (the caller checked
  // it, or the calls say why it does not work).
  explicit CoordinatorEndpoints(const std::string& list) {
    auto parsed = ParseList("coordinator", list);
    addresses_ = parsed.ok() ? *parsed : std::vector<std::string>{list};
  }

  std::string current() const {
    absl::MutexLock lock(&mu_);
    return addresses_[index_];
  }
  size_t size() const {
    absl::MutexLock lock(&mu_);
    return addresses_.size();
  }
  // The list as given, for messages.
  std::string all() const {
    absl::MutexLock lock(&mu_);
    return absl::StrJoin(addresses_, ",");
  }

  // After a call on current() failed with `status` (its context `ctx`, finished): moves to the
  // leader a standby named, or on UNAVAILABLE without a name to the next address. True when the
  // address in use changed (the caller makes a new channel and tries again).
  bool Follow(const grpc::Status& status, const grpc::ClientContext& ctx) {
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE &&
        status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return false;
    }
    std::string leader;
    const auto& trailers = ctx.GetServerTrailingMetadata();
    if (auto it = trailers.find(kLeaderMetadata); it != trailers.end()) {
      leader.assign(it->second.data(), it->second.size());
    }
    return Follow(leader);
  }

  // The same with the leader's address (empty: not named) already read.
  bool Follow(const std::string& leader) {
    absl::MutexLock lock(&mu_);
    // A name that is not one HOST:PORT of printable characters is taken as none: it comes from
    // the server and reaches logs and channels.
    const bool usable = !leader.empty() && leader.size() <= 300 &&
                        std::all_of(leader.begin(), leader.end(),
                                    [](char c) { return c > ' ' && c < 127 && c != ','; }) &&
                        ParseList("leader", leader).ok();
    if (usable) {
      if (leader == addresses_[index_]) return false;
      for (size_t i = 0; i < addresses_.size(); ++i) {
        if (addresses_[i] == leader) {
          index_ = i;
          return true;
        }
      }
      // A leader outside the list (its advertised address): tried next, kept for later moves.
      if (addresses_.size() < kMaxCoordinatorAddresses) {
        addresses_.push_back(leader);
        index_ = addresses_.size() - 1;
        return true;
      }
    }
    if (addresses_.size() < 2) return false;
    index_ = (index_ + 1) % addresses_.size();
    return true;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> addresses_ ABSL_GUARDED_BY(mu_);
  size_t index_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_COORDINATOR_ENDPOINTS_H_
