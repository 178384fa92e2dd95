#include "common/context_archive.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/credentials.h"
#include "common/status_macros.h"

namespace trainyard {
namespace {

namespace fs = std::filesystem;

constexpr size_t kBlock = 512;

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

absl::Status PackError(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("context: ", message));
}
absl::Status UnpackError(const std::string& message) {
  return absl::FailedPreconditionError(absl::StrCat("the context's archive: ", message));
}

// ---- ignore rules ----

bool MatchName(const std::string& pattern, const std::string& text) {
  return fnmatch(pattern.c_str(), text.c_str(), FNM_PATHNAME) == 0;
}

bool RuleMatches(const IgnoreRule& rule, const std::string& path, bool folder) {
  if (rule.folders_only && !folder) return false;
  if (rule.anchored) return MatchName(rule.pattern, path);
  const size_t slash = path.rfind('/');
  return MatchName(rule.pattern, slash == std::string::npos ? path : path.substr(slash + 1));
}

// ---- packing ----

// `path` as ustar's prefix and name (at most 155 and 100 bytes, split at a '/'); false when it
// cannot be.
bool SplitUstarName(const std::string& path, std::string* prefix, std::string* name) {
  if (path.size() <= 100) {
    prefix->clear();
    *name = path;
    return true;
  }
  // The rightmost '/' within the prefix's 155 bytes leaves the shortest name.
  const size_t split = path.rfind('/', 155);
  if (split == std::string::npos || split == 0 || path.size() - split - 1 > 100) return false;
  *prefix = path.substr(0, split);
  *name = path.substr(split + 1);
  return true;
}

struct Entry {
  std::string path;  // relative, '/'-separated
  bool folder = false;
  bool executable = false;
  int64_t size = 0;
};

absl::Status Walk(const fs::path& root, const std::string& rel,
                  const std::vector<IgnoreRule>& rules, std::vector<Entry>& out,
                  std::vector<std::string>& skipped) {
  std::error_code ec;
  std::vector<fs::directory_entry> children;
  for (fs::directory_iterator it(rel.empty() ? root : root / rel, ec), end; !ec && it != end;
       it.increment(ec)) {
    children.push_back(*it);
  }
  if (ec) return PackError(absl::StrCat("cannot list ", (root / rel).string(), ": ", ec.message()));
  std::sort(children.begin(), children.end(),
            [](const auto& a, const auto& b) { return a.path().filename() < b.path().filename(); });
  for (const fs::directory_entry& child : children) {
    const std::string name = child.path().filename().string();
    if (name == ".git") continue;
    const std::string path = rel.empty() ? name : absl::StrCat(rel, "/", name);
    const fs::file_status st = child.symlink_status(ec);
    if (ec)
      return PackError(absl::StrCat("cannot read ", child.path().string(), ": ", ec.message()));
    const bool folder = fs::is_directory(st);
    if (Ignored(rules, path, folder)) continue;
    if (!folder && !fs::is_regular_file(st)) {
      skipped.push_back(path);
      continue;
    }
    if (out.size() >= static_cast<size_t>(kMaxContextEntries)) {
      return PackError(absl::StrCat(root.string(), " holds more than ", kMaxContextEntries,
                                    " files and folders; leave some out with a .yardignore"));
    }
    std::string prefix, ustar_name;
    if (!SplitUstarName(path, &prefix, &ustar_name)) {
      return PackError(absl::StrCat(path.substr(0, 80),
                                    "...: too long a name to pack (ustar: at most 100 bytes after "
                                    "the last '/' within the first 155)"));
    }
    Entry e;
    e.path = path;
    e.folder = folder;
    if (!folder) {
      e.size = static_cast<int64_t>(child.file_size(ec));
      if (ec)
        return PackError(absl::StrCat("cannot read ", child.path().string(), ": ", ec.message()));
      e.executable = (st.permissions() & fs::perms::owner_exec) != fs::perms::none;
    }
    out.push_back(e);
    if (folder) RETURN_IF_ERROR(Walk(root, path, rules, out, skipped));
  }
  return absl::OkStatus();
}

void Octal(char* field, size_t width, uint64_t value) {
  // width - 1 digits and a NUL.
  const std::string digits = absl::StrFormat("%0*o", static_cast<int>(width - 1), value);
  std::memcpy(field, digits.data(), width - 1);
  field[width - 1] = '\0';
}

// A ustar header for `e` (a folder's name without a trailing '/': its type says it).
std::string Header(const Entry& e) {
  std::string h(kBlock, '\0');
  std::string prefix, name;
  SplitUstarName(e.path, &prefix, &name);  // Walk refused what cannot be split
  std::memcpy(&h[0], name.data(), std::min<size_t>(name.size(), 100));
  Octal(&h[100], 8, e.folder ? 0755 : (e.executable ? 0755 : 0644));
  Octal(&h[108], 8, 0);
  Octal(&h[116], 8, 0);
  Octal(&h[124], 12, static_cast<uint64_t>(e.folder ? 0 : e.size));
  Octal(&h[136], 12, 0);  // mtime 0: the same folder packs to the same bytes, the same digest
  h[156] = e.folder ? '5' : '0';
  std::memcpy(&h[257], "ustar", 6);
  std::memcpy(&h[263], "00", 2);
  std::memcpy(&h[345], prefix.data(), std::min<size_t>(prefix.size(), 155));
  std::memset(&h[148], ' ', 8);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  const std::string chk = absl::StrFormat("%06o", sum);
  std::memcpy(&h[148], chk.data(), 6);
  h[154] = '\0';
  h[155] = ' ';
  return h;
}

absl::StatusOr<std::string> Gzip(const std::string& data) {
  z_stream z{};
  if (deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    return absl::InternalError("context: zlib's deflateInit2 failed");
  }
  std::string out(deflateBound(&z, data.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  if (rc != Z_STREAM_END) return absl::InternalError("context: gzip compression failed");
  return out;
}

// ---- unpacking ----

absl::StatusOr<std::string> Gunzip(absl::string_view archive, size_t max_out) {
  z_stream z{};
  if (inflateInit2(&z, 15 + 16) != Z_OK) return absl::InternalError("zlib's inflateInit2 failed");
  std::string out;
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(archive.data()));
  z.avail_in = static_cast<uInt>(archive.size());
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    if (out.size() >= max_out) {
      inflateEnd(&z);
      return UnpackError("it unpacks to more than the limit");
    }
    const size_t have = out.size();
    out.resize(std::min(max_out, have + (size_t{1} << 20)));
    z.next_out = reinterpret_cast<Bytef*>(out.data() + have);
    z.avail_out = static_cast<uInt>(out.size() - have);
    rc = inflate(&z, Z_NO_FLUSH);
    out.resize(out.size() - z.avail_out);
    if (rc != Z_OK && rc != Z_STREAM_END) {
      inflateEnd(&z);
      return UnpackError(absl::StrCat("not gzip data (", z.msg != nullptr ? z.msg : "zlib", ")"));
    }
    if (rc == Z_OK && z.avail_in == 0 && z.avail_out != 0) {
      inflateEnd(&z);
      return UnpackError("the gzip data ends early");
    }
  }
  inflateEnd(&z);
  return out;
}

absl::StatusOr<uint64_t> ParseOctal(const char* field, size_t width, const std::string& what) {
  uint64_t value = 0;
  size_t i = 0;
  while (i < width && field[i] == ' ') ++i;
  bool any = false;
  for (; i < width && field[i] >= '0' && field[i] <= '7'; ++i) {
    if (value > (uint64_t{1} << 60)) return UnpackError(absl::StrCat(what, ": too large"));
    value = value * 8 + static_cast<uint64_t>(field[i] - '0');
    any = true;
  }
  if (!any || (i < width && field[i] != '\0' && field[i] != ' ')) {
    return UnpackError(absl::StrCat(what, ": not an octal number"));
  }
  return value;
}

std::string FieldText(const char* field, size_t width) {
  return std::string(field, strnlen(field, width));
}

// The folder `parts` name below `dest_fd` (made when missing), opened without following links.
absl::StatusOr<int> OpenFolder(int dest_fd, const std::vector<std::string>& parts, size_t count,
                               const std::string& path) {
  int fd = dup(dest_fd);
  if (fd < 0) return UnpackError(absl::StrCat(path, ": ", strerror(errno)));
  for (size_t i = 0; i < count; ++i) {
    if (mkdirat(fd, parts[i].c_str(), 0755) != 0 && errno != EEXIST) {
      const int err = errno;
      close(fd);
      return UnpackError(absl::StrCat(path, ": ", strerror(err)));
    }
    const int next = openat(fd, parts[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    const int err = errno;
    close(fd);
    if (next < 0) {
      return UnpackError(
          absl::StrCat(path, ": ", parts[i], " is not a folder (", strerror(err), ")"));
    }
    fd = next;
  }
  return fd;
}

bool WriteAllTo(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

}  // namespace

std::vector<IgnoreRule> ParseIgnoreRules(absl::string_view text) {
  std::vector<IgnoreRule> rules;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::string p(absl::StripTrailingAsciiWhitespace(line));
    if (p.empty() || p[0] == '#') continue;
    IgnoreRule rule;
    if (p[0] == '!') {
      rule.negate = true;
      p.erase(0, 1);
    } else if (absl::StartsWith(p, "\\!") || absl::StartsWith(p, "\\#")) {
      p.erase(0, 1);
    }
    if (!p.empty() && p.back() == '/') {
      rule.folders_only = true;
      p.pop_back();
    }
    while (absl::StartsWith(p, "**/")) p.erase(0, 3);
    if (absl::StrContains(p, '/')) {
      rule.anchored = true;
      if (p[0] == '/') p.erase(0, 1);
    }
    if (p.empty()) continue;
    rule.pattern = p;
    rules.push_back(std::move(rule));
  }
  return rules;
}

bool Ignored(const std::vector<IgnoreRule>& rules, const std::string& path, bool folder) {
  bool ignored = false;
  for (const IgnoreRule& rule : rules) {
    if (RuleMatches(rule, path, folder)) ignored = !rule.negate;
  }
  return ignored;
}

std::string ContextDigest(absl::string_view archive) {
  const std::string sum = Sha256(archive);
  std::string hex;
  for (unsigned char c : sum) absl::StrAppendFormat(&hex, "%02x", c);
  return "sha256:" + hex;
}

bool IsContextDigest(absl::string_view digest) {
  if (!absl::ConsumePrefix(&digest, "sha256:") || digest.size() != 64) return false;
  return std::all_of(digest.begin(), digest.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

absl::StatusOr<PackedContext> PackContext(const std::string& dir, int64_t max_bytes) {
  std::error_code ec;
  const fs::path root = fs::absolute(dir, ec);
  if (ec || !fs::is_directory(root, ec)) {
    return PackError(absl::StrCat(dir, " is not a folder"));
  }
  std::vector<IgnoreRule> rules;
  for (const char* name : {".gitignore", ".yardignore"}) {
    std::ifstream in(root / name, std::ios::binary);
    if (!in) continue;
    std::string text(1 << 20, '\0');  // an ignore file's first MiB
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(in.gcount()));
    for (IgnoreRule& r : ParseIgnoreRules(text)) rules.push_back(std::move(r));
  }
  PackedContext packed;
  std::vector<Entry> entries;
  RETURN_IF_ERROR(Walk(root, "", rules, entries, packed.skipped_links));
  for (const Entry& e : entries) {
    packed.content_bytes += e.size;
    if (!e.folder) ++packed.files;
  }
  if (packed.content_bytes > max_bytes) {
    std::vector<const Entry*> largest;
    for (const Entry& e : entries) largest.push_back(&e);
    std::sort(largest.begin(), largest.end(),
              [](const Entry* a, const Entry* b) { return a->size > b->size; });
    largest.resize(std::min<size_t>(3, largest.size()));
    std::vector<std::string> named;
    for (const Entry* e : largest) named.push_back(absl::StrCat(e->path, " ", Mib(e->size)));
    return PackError(absl::StrCat(root.string(), " holds ", Mib(packed.content_bytes),
                                  " of files, at most ", Mib(max_bytes),
                                  " (largest: ", absl::StrJoin(named, ", "),
                                  "); leave data out with a .yardignore and read it from storage"));
  }
  std::string tar;
  tar.reserve(static_cast<size_t>(packed.content_bytes) + entries.size() * 2 * kBlock + 2 * kBlock);
  for (const Entry& e : entries) {
    tar += Header(e);
    if (e.folder) continue;
    std::ifstream in(root / e.path, std::ios::binary);
    const size_t at = tar.size();
    tar.resize(at + static_cast<size_t>(e.size));
    if (!in || !in.read(tar.data() + at, e.size) || in.gcount() != e.size) {
      return PackError(absl::StrCat("cannot read ", e.path, " (did it change while packed?)"));
    }
    tar.resize(tar.size() + (kBlock - tar.size() % kBlock) % kBlock, '\0');
  }
  tar.resize(tar.size() + 2 * kBlock, '\0');
  ASSIGN_OR_RETURN(packed.archive, Gzip(tar));
  if (static_cast<int64_t>(packed.archive.size()) > kMaxContextArchiveBytes) {
    return PackError(absl::StrCat(root.string(), " packs to ", Mib(packed.archive.size()),
                                  ", at most ", Mib(kMaxContextArchiveBytes),
                                  " (its many small files' headers); leave some out"));
  }
  packed.digest = ContextDigest(packed.archive);
  return packed;
}

absl::Status UnpackContext(absl::string_view archive, const std::string& dest, int64_t max_bytes) {
  const size_t max_tar = static_cast<size_t>(max_bytes) +
                         static_cast<size_t>(kMaxContextEntries) * 2 * kBlock + 2 * kBlock;
  ASSIGN_OR_RETURN(const std::string tar, Gunzip(archive, max_tar + 1));
  const int dest_fd = open(dest.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dest_fd < 0) return UnpackError(absl::StrCat(dest, ": ", strerror(errno)));
  auto result = [&]() -> absl::Status {
    int64_t bytes = 0;
    int entries = 0;
    size_t at = 0;
    while (true) {
      if (at + kBlock > tar.size()) return UnpackError("it ends without its end blocks");
      const char* h = tar.data() + at;
      if (std::all_of(h, h + kBlock, [](char c) { return c == '\0'; })) return absl::OkStatus();
      const std::string where = absl::StrCat("the entry at byte ", at);
      if (std::memcmp(h + 257, "ustar", 5) != 0) return UnpackError(where + ": not a ustar header");
      ASSIGN_OR_RETURN(const uint64_t chk, ParseOctal(h + 148, 8, where + "'s checksum"));
      unsigned sum = 0;
      for (size_t i = 0; i < kBlock; ++i) {
        sum += (i >= 148 && i < 156) ? ' ' : static_cast<unsigned char>(h[i]);
      }
      if (sum != chk) return UnpackError(where + ": its header's checksum is wrong");
      const std::string name = FieldText(h, 100);
      const std::string prefix = FieldText(h + 345, 155);
      std::string path = prefix.empty() ? name : absl::StrCat(prefix, "/", name);
      const char type = h[156];
      ASSIGN_OR_RETURN(const uint64_t size, ParseOctal(h + 124, 12, path + "'s size"));
      ASSIGN_OR_RETURN(const uint64_t mode, ParseOctal(h + 100, 8, path + "'s mode"));
      const bool folder = type == '5';
      if (!folder && type != '0' && type != '\0') {
        return UnpackError(absl::StrCat(path, ": neither a file nor a folder (type '",
                                        std::string(1, type), "')"));
      }
      if (folder && !path.empty() && path.back() == '/') path.pop_back();
      // "./name", as tar writes a folder given as ".", is "name"; "." itself is the destination.
      while (absl::StartsWith(path, "./")) path.erase(0, 2);
      if (folder && (path == "." || path.empty()) && size == 0) {
        at += kBlock;
        continue;
      }
      if (path.empty() || path[0] == '/')
        return UnpackError(absl::StrCat("'", path, "': not a relative name"));
      const std::vector<std::string> parts = absl::StrSplit(path, '/');
      for (const std::string& p : parts) {
        if (p.empty() || p == "." || p == "..") {
          return UnpackError(absl::StrCat("'", path, "': a name with an empty, . or .. part"));
        }
      }
      if (++entries > kMaxContextEntries) {
        return UnpackError(absl::StrCat("more than ", kMaxContextEntries, " entries"));
      }
      at += kBlock;
      if (folder) {
        ASSIGN_OR_RETURN(const int fd, OpenFolder(dest_fd, parts, parts.size(), path));
        close(fd);
        continue;
      }
      bytes += static_cast<int64_t>(size);
      if (bytes > max_bytes) {
        return UnpackError(absl::StrCat("its files hold more than ", Mib(max_bytes)));
      }
      if (size > tar.size() - at) return UnpackError(absl::StrCat(path, ": cut short"));
      ASSIGN_OR_RETURN(const int parent, OpenFolder(dest_fd, parts, parts.size() - 1, path));
      const int fd =
          openat(parent, parts.back().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                 (mode & 0111) != 0 ? 0755 : 0644);
      const int err = errno;
      close(parent);
      if (fd < 0) return UnpackError(absl::StrCat(path, ": ", strerror(err)));
      const bool written = WriteAllTo(fd, absl::string_view(tar.data() + at, size));
      const int werr = errno;
      close(fd);
      if (!written) return UnpackError(absl::StrCat(path, ": ", strerror(werr)));
      at += (size + kBlock - 1) / kBlock * kBlock;
    }
  }();
  close(dest_fd);
  return result;
}

}  // namespace trainyard
