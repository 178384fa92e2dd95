// Credentials shared by the coordinator, the daemons, the trainer's gRPC side and yard: the token
// formats, their hashing, the per-attempt job credential, and the files that hold secrets.
//
//   API / node token:  "tyt.<id>.<secret>"            id: 16 hex digits (public, names the token)
//                                                     secret: 43 base64url chars (256 random bits)
//   job credential:    "tyj.<job_id>.<attempt>.<mac>" mac: base64url HMAC-SHA256 under the
//                                                     coordinator's key of "<job_id>\n<attempt>"
//
// Calls carry one as gRPC metadata "authorization: Bearer <credential>". Pure functions and file
// I/O; thread-safe.
#ifndef TRAINYARD_COMMON_CREDENTIALS_H_
#define TRAINYARD_COMMON_CREDENTIALS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace trainyard {

inline constexpr char kAuthorizationMetadata[] = "authorization";
// The web console's in-process calls on a browser's behalf: the key the coordinator gave it at
// start, and the browser's address, under which failed authentications are then counted.
inline constexpr char kConsoleKeyMetadata[] = "x-trainyard-console-key";
inline constexpr char kConsoleClientMetadata[] = "x-trainyard-console-client";
// The environment variables a credential may come from: yard and the daemons read
// kTokenEnv; ranks read kJobCredentialEnv (set by their worker, which keeps kTokenEnv from them).
inline constexpr char kTokenEnv[] = "TRAINYARD_TOKEN";
inline constexpr char kJobCredentialEnv[] = "TRAINYARD_JOB_CREDENTIAL";

// `n` bytes from the operating system's CSPRNG.
std::string RandomBytes(size_t n);
std::string Sha256(absl::string_view data);
std::string HmacSha256(absl::string_view key, absl::string_view data);
// Compares in time independent of where the strings differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);
std::string Base64Url(absl::string_view bytes);  // no padding

struct ApiToken {
  std::string id;
  std::string secret;
  std::string Text() const { return "tyt." + id + "." + secret; }
};
// A new random token.
ApiToken NewApiToken();
// Splits "tyt.<id>.<secret>"; INVALID_ARGUMENT (without echoing the text) if malformed.
absl::StatusOr<ApiToken> ParseApiToken(absl::string_view text);

struct JobCredential {
  std::string job_id;
  int32_t attempt = 0;
  std::string mac;
};
std::string MakeJobCredential(absl::string_view key, absl::string_view job_id, int32_t attempt);
absl::StatusOr<JobCredential> ParseJobCredential(absl::string_view text);
// True if `credential` was made by MakeJobCredential(key, its job, its attempt).
bool VerifyJobCredential(absl::string_view key, const JobCredential& credential);

// What a rank shows one parameter server: "tys.<job>.<attempt>.<mac>", the mac an HMAC-SHA256
// keyed with the job credential's own mac over "parameter-server\n<server address>". Only the
// attempt's ranks (which hold the job credential) and the coordinator (which signs it) can make
// it; the server cannot turn it into anything else: the coordinator refuses it for the
// rendezvous and reports, and accepts it (VerifyJobCredential) only from the node holding the
// range at that address. Empty if `job_credential` is not one.
std::string DeriveServerCredential(absl::string_view job_credential,
                                   absl::string_view server_address);
// Splits a parameter-server credential (its mac in JobCredential::mac); INVALID_ARGUMENT if
// malformed.
absl::StatusOr<JobCredential> ParseServerCredential(absl::string_view text);

// The credential in an "authorization" metadata value ("Bearer <credential>").
absl::StatusOr<std::string> BearerCredential(absl::string_view header);

// "Bearer <value>" of environment variable `name` (for an "authorization" metadata value); empty
// when it is unset or empty.
std::string BearerFromEnv(const char* name);

// Reads a secret file (a token, a key), trimming surrounding whitespace. Like ssh with a private
// key, refuses a file that its group or others may read or write (PERMISSION_DENIED, naming the
// file and the mode), and an empty one.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);
// Writes `secret` to `path` readable and writable by its owner only (0600), atomically (temp file,
// fsync, rename); creates the parent directory (0700) if missing.
absl::Status WriteSecretFile(const std::string& path, absl::string_view secret);

// A token for a client: from `token_file` if set, else $TRAINYARD_TOKEN, else `default_file` if
// it exists; UNAUTHENTICATED (saying where it looked) when none.
absl::StatusOr<std::string> FindToken(const std::string& token_file,
                                      const std::string& default_file);

// A daemon's node token: from `token_file` if set, else $TRAINYARD_TOKEN. With a client
// certificate (mutual TLS names the node) a token is optional: empty when none is given.
absl::StatusOr<std::string> FindNodeToken(const std::string& token_file, bool has_certificate);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_CREDENTIALS_H_
