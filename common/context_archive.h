// A job's context: the user's folder that `yard submit --context DIR` uploads and every worker
// unpacks into the attempt's working folder before its ranks start (Determined's model definition,
// Ray's working_dir). The archive is a gzip-compressed POSIX ustar archive of regular files and
// folders only, named by the SHA-256 of its bytes ("sha256:<64 hex>").
//
// yard packs (PackContext), the coordinator checks the name of what it stores (ContextDigest),
// and the worker's unpacker, running as the job's owner, unpacks (UnpackContext): it trusts
// nothing in the archive (no absolute names, no "..", no links or devices, sizes within limits).
// Pure functions over files and bytes; thread-safe.
#ifndef TRAINYARD_COMMON_CONTEXT_ARCHIVE_H_
#define TRAINYARD_COMMON_CONTEXT_ARCHIVE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace trainyard {

// The most a context may hold: its files' bytes together (as Determined's 96 MB), and its files
// and folders. The archive is smaller (compressed) or a little larger (headers) than the first.
inline constexpr int64_t kMaxContextBytes = int64_t{64} << 20;
inline constexpr int kMaxContextEntries = 100000;
// The largest archive accepted anywhere: gzip makes 64 MiB of files that do not compress a little
// larger, and headers (which compress well) come on top.
inline constexpr int64_t kMaxContextArchiveBytes = int64_t{80} << 20;

// One rule of a .gitignore / .yardignore file (a subset of git's: '#' comments, '!' negation, a
// trailing '/' for folders only, a '/' elsewhere anchors the pattern at the context's root,
// '*', '?' and '[...]' within a name, a leading "**/" matches in any folder).
struct IgnoreRule {
  std::string pattern;
  bool negate = false;
  bool folders_only = false;
  bool anchored = false;
};
// The rules of an ignore file's text, in order (the last that matches a path decides).
std::vector<IgnoreRule> ParseIgnoreRules(absl::string_view text);
// Whether `rules` ignore `path` (relative to the root, '/'-separated; `folder`: it is a folder).
bool Ignored(const std::vector<IgnoreRule>& rules, const std::string& path, bool folder);

struct PackedContext {
  std::string archive;        // the .tar.gz bytes
  std::string digest;         // "sha256:" + hex of `archive`
  int64_t content_bytes = 0;  // the files' bytes
  int files = 0;
  std::vector<std::string> skipped_links;  // symbolic links and other non-files, not packed
};

// Packs folder `dir`: every regular file and folder under it but ".git" and what the root's
// .gitignore and .yardignore ignore (in that order; a folder ignored is not entered). Files keep
// whether they are executable. INVALID_ARGUMENT naming "context" when `dir` is not a readable
// folder, when its files hold more than `max_bytes` (checked before anything is compressed: the
// message names the largest files) or more than kMaxContextEntries entries, or a name longer
// that ustar cannot hold (over 255 bytes, or over 100 after the last '/' of the first 155).
absl::StatusOr<PackedContext> PackContext(const std::string& dir,
                                          int64_t max_bytes = kMaxContextBytes);

// "sha256:<hex>" of `archive`.
std::string ContextDigest(absl::string_view archive);
// Whether `digest` is of that form (64 lowercase hex digits).
bool IsContextDigest(absl::string_view digest);

// Unpacks `archive` (PackContext's format) into folder `dest`, which must exist; entries are
// created below it without following any link ("./" before a name is dropped) (files O_EXCL, mode
// 0755 or 0644). FAILED_PRECONDITION naming the entry for an archive that is not one PackContext
// could have made: a name that is absolute, has "." or ".." parts or is empty; an entry neither a
// file nor a folder; a file that exists already; more than `max_bytes` of files or
// kMaxContextEntries entries; bad gzip or tar.
absl::Status UnpackContext(absl::string_view archive, const std::string& dest,
                           int64_t max_bytes = kMaxContextBytes);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_CONTEXT_ARCHIVE_H_
