#include "common/credentials.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/check.h"

namespace trainyard {
namespace {

bool IsBase64Url(absl::string_view s) {
  for (char c : s) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
  }
  return true;
}

bool IsHex(absl::string_view s) {
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  TY_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) == 1,
           "RAND_bytes failed");
  return out;
}

std::string Sha256(absl::string_view data) {
  std::string out(SHA256_DIGEST_LENGTH, '\0');
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(),
         reinterpret_cast<unsigned char*>(out.data()));
  return out;
}

std::string HmacSha256(absl::string_view key, absl::string_view data) {
  std::string out(EVP_MAX_MD_SIZE, '\0');
  unsigned int len = 0;
  TY_CHECK(HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                reinterpret_cast<const unsigned char*>(data.data()), data.size(),
                reinterpret_cast<unsigned char*>(out.data()), &len) != nullptr,
           "HMAC failed");
  out.resize(len);
  return out;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string Base64Url(absl::string_view bytes) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  out.reserve((bytes.size() * 4 + 2) / 3);
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : bytes) {
    acc = (acc << 8) | c;
    bits += 8;
    while (bits >= 6) {
      bits -= 6;
      out.push_back(kAlphabet[(acc >> bits) & 63]);
    }
  }
  if (bits > 0) out.push_back(kAlphabet[(acc << (6 - bits)) & 63]);
  return out;
}

ApiToken NewApiToken() {
  ApiToken t;
  const std::string id = RandomBytes(8);
  for (unsigned char c : id) absl::StrAppendFormat(&t.id, "%02x", c);
  t.secret = Base64Url(RandomBytes(32));
  return t;
}

absl::StatusOr<ApiToken> ParseApiToken(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, '.');
  if (parts.size() != 3 || parts[0] != "tyt" || parts[1].size() != 16 || !IsHex(parts[1]) ||
      parts[2].size() != 43 || !IsBase64Url(parts[2])) {
    return absl::InvalidArgumentError("not an API token of the form tyt.<id>.<secret>");
  }
  return ApiToken{std::string(parts[1]), std::string(parts[2])};
}

std::string MakeJobCredential(absl::string_view key, absl::string_view job_id, int32_t attempt) {
  const std::string mac = HmacSha256(key, absl::StrCat(job_id, "\n", attempt));
  return absl::StrCat("tyj.", job_id, ".", attempt, ".", Base64Url(mac));
}

namespace {

// "<prefix><job>.<attempt>.<mac>", as job credentials and parameter-server credentials are.
absl::StatusOr<JobCredential> ParseAttemptCredential(absl::string_view text,
                                                     absl::string_view prefix,
                                                     absl::string_view what) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("not a ", what, " of the form ", prefix, "<job>.<attempt>.<mac>"));
  };
  if (!absl::StartsWith(text, prefix)) return bad();
  text.remove_prefix(prefix.size());
  const size_t mac_dot = text.rfind('.');
  if (mac_dot == absl::string_view::npos) return bad();
  const size_t attempt_dot = text.rfind('.', mac_dot - 1);
  if (attempt_dot == absl::string_view::npos || attempt_dot == 0 || mac_dot == 0) return bad();
  JobCredential c;
  c.job_id = std::string(text.substr(0, attempt_dot));
  // Plain decimal, no sign or leading zero: one text per credential.
  const absl::string_view attempt = text.substr(attempt_dot + 1, mac_dot - attempt_dot - 1);
  if (attempt.empty() || attempt.size() > 9 || attempt[0] == '0' ||
      !std::all_of(attempt.begin(), attempt.end(),
                   [](char ch) { return absl::ascii_isdigit(static_cast<unsigned char>(ch)); }) ||
      !absl::SimpleAtoi(attempt, &c.attempt)) {
    return bad();
  }
  c.mac = std::string(text.substr(mac_dot + 1));
  if (c.mac.size() != 43 || !IsBase64Url(c.mac)) return bad();
  return c;
}

}  // namespace

absl::StatusOr<JobCredential> ParseJobCredential(absl::string_view text) {
  return ParseAttemptCredential(text, "tyj.", "job credential");
}

absl::StatusOr<JobCredential> ParseServerCredential(absl::string_view text) {
  return ParseAttemptCredential(text, "tys.", "parameter-server credential");
}

std::string DeriveServerCredential(absl::string_view job_credential,
                                   absl::string_view server_address) {
  auto job = ParseJobCredential(job_credential);
  if (!job.ok()) return std::string();
  const std::string mac = HmacSha256(job->mac, absl::StrCat("parameter-server\n", server_address));
  return absl::StrCat("tys.", job->job_id, ".", job->attempt, ".", Base64Url(mac));
}

bool VerifyJobCredential(absl::string_view key, const JobCredential& credential) {
  const std::string expected =
      Base64Url(HmacSha256(key, absl::StrCat(credential.job_id, "\n", credential.attempt)));
  return ConstantTimeEquals(expected, credential.mac);
}

absl::StatusOr<std::string> BearerCredential(absl::string_view header) {
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(header, kBearer)) {
    return absl::UnauthenticatedError("authorization: expected \"Bearer <token>\"");
  }
  absl::string_view value = absl::StripAsciiWhitespace(header.substr(kBearer.size()));
  if (value.empty()) return absl::UnauthenticatedError("authorization: empty token");
  return std::string(value);
}

std::string BearerFromEnv(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::string();
  return absl::StrCat("Bearer ", absl::StripAsciiWhitespace(value));
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string message = absl::StrCat(path, ": ", strerror(err));
    return err == ENOENT ? absl::NotFoundError(message) : absl::PermissionDeniedError(message);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  if ((st.st_mode & 077) != 0) {
    close(fd);
    return absl::PermissionDeniedError(
        absl::StrFormat("%s: mode %04o lets others read or change it; chmod 600 %s", path,
                        st.st_mode & 07777, path));
  }
  std::string content;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) content.append(buf, static_cast<size_t>(n));
  close(fd);
  std::string trimmed(absl::StripAsciiWhitespace(content));
  if (trimmed.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": empty"));
  return trimmed;
}

absl::Status WriteSecretFile(const std::string& path, absl::string_view secret) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) return absl::UnavailableError(absl::StrCat(dir.string(), ": ", ec.message()));
    fs::permissions(dir, fs::perms::owner_all, ec);
  }
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat(tmp, ": ", strerror(errno)));
  const std::string content = absl::StrCat(secret, "\n");
  bool ok = fchmod(fd, 0600) == 0 &&
            write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size());
  ok = fsync(fd) == 0 && ok;
  close(fd);
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat(path, ": ", strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FindToken(const std::string& token_file,
                                      const std::string& default_file) {
  if (!token_file.empty()) return ReadSecretFile(token_file);
  if (const char* env = std::getenv(kTokenEnv); env != nullptr && *env != '\0') {
    return std::string(absl::StripAsciiWhitespace(env));
  }
  if (!default_file.empty()) {
    auto token = ReadSecretFile(default_file);
    if (token.ok() || !absl::IsNotFound(token.status())) return token;
  }
  return absl::UnauthenticatedError(absl::StrCat(
      "no token: give --token-file, set ", kTokenEnv,
      default_file.empty() ? std::string()
                           : absl::StrCat(", or save one in ", default_file, " (yard login)")));
}

absl::StatusOr<std::string> FindNodeToken(const std::string& token_file, bool has_certificate) {
  auto token = FindToken(token_file, "");
  if (!token.ok() && absl::IsUnauthenticated(token.status()) && has_certificate) {
    return std::string();
  }
  return token;
}

}  // namespace trainyard
