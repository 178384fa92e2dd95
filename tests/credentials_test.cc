// Token formats, job credentials and secret files (common/credentials.h).
#include "common/credentials.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <vector>

#include "tests/testing/subprocess.h"

namespace trainyard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(CredentialsTest, Sha256AndHmacMatchKnownVectors) {
  auto hex = [](const std::string& bytes) {
    std::string out;
    for (unsigned char c : bytes) {
      static const char* digits = "0123456789abcdef";
      out += digits[c >> 4];
      out += digits[c & 15];
    }
    return out;
  };
  EXPECT_EQ(hex(Sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // RFC 4231, test case 2.
  EXPECT_EQ(hex(HmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(Base64Url(std::string("\xfb\xff", 2)), "-_8");
}

TEST(CredentialsTest, ApiTokensAreRandomAndParseBack) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const ApiToken t = NewApiToken();
    EXPECT_EQ(t.id.size(), 16u);
    EXPECT_EQ(t.secret.size(), 43u);  // 256 bits
    auto parsed = ParseApiToken(t.Text());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->id, t.id);
    EXPECT_EQ(parsed->secret, t.secret);
    EXPECT_TRUE(seen.insert(t.secret).second);
  }
}

TEST(CredentialsTest, MalformedTokensAreRefusedWithoutEchoingThem) {
  const ApiToken t = NewApiToken();
  for (const std::string& bad : std::vector<std::string>{
           "", "tyt", "tyt." + t.id, "xyz." + t.id + "." + t.secret,
           "tyt." + t.id + "." + t.secret + "x", "tyt." + t.id.substr(1) + "g." + t.secret,
           "tyt." + t.id + "." + t.secret.substr(0, 42) + "!"}) {
    auto parsed = ParseApiToken(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    if (bad.size() > 16) EXPECT_THAT(parsed.status().message(), Not(HasSubstr(bad)));
  }
}

TEST(CredentialsTest, JobCredentialsVerifyOnlyForTheirJobAttemptAndKey) {
  const std::string key = "k1";
  const std::string text = MakeJobCredential(key, "job-7", 3);
  auto c = ParseJobCredential(text);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->job_id, "job-7");
  EXPECT_EQ(c->attempt, 3);
  EXPECT_TRUE(VerifyJobCredential(key, *c));
  EXPECT_FALSE(VerifyJobCredential("k2", *c));
  JobCredential other = *c;
  other.attempt = 4;
  EXPECT_FALSE(VerifyJobCredential(key, other));
  other = *c;
  other.job_id = "job-8";
  EXPECT_FALSE(VerifyJobCredential(key, other));
  // Job ids with dots still parse (the attempt and mac are read from the end).
  auto dotted = ParseJobCredential(MakeJobCredential(key, "a.b", 1));
  ASSERT_TRUE(dotted.ok());
  EXPECT_EQ(dotted->job_id, "a.b");
  for (const std::string& bad : std::vector<std::string>{
           "tyj.", "tyj.job-7.0." + c->mac, "tyj.job-7.x." + c->mac, "tyj.job-7.+3." + c->mac,
           "tyj.job-7.03." + c->mac, "tyj.job-7.3.short"}) {
    EXPECT_FALSE(ParseJobCredential(bad).ok()) << bad;
  }
}

TEST(CredentialsTest, ParameterServerCredentialsAreBoundToTheirServerAndAttempt) {
  const std::string job = MakeJobCredential("key", "job-3", 2);
  const std::string a = DeriveServerCredential(job, "10.0.0.1:7080");
  const std::string b = DeriveServerCredential(job, "10.0.0.2:7080");
  EXPECT_EQ(a.rfind("tys.job-3.2.", 0), 0u);
  EXPECT_NE(a, b);
  EXPECT_EQ(a, DeriveServerCredential(job, "10.0.0.1:7080"));  // deterministic
  EXPECT_NE(a, DeriveServerCredential(MakeJobCredential("key", "job-3", 3), "10.0.0.1:7080"));
  EXPECT_NE(a, DeriveServerCredential(MakeJobCredential("other", "job-3", 2), "10.0.0.1:7080"));
  // It reveals neither the job credential nor its mac.
  const std::string job_mac = job.substr(job.rfind('.') + 1);
  EXPECT_EQ(a.find(job_mac), std::string::npos);
  auto parsed = ParseServerCredential(a);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->job_id, "job-3");
  EXPECT_EQ(parsed->attempt, 2);
  EXPECT_FALSE(ParseServerCredential(job).ok());  // a job credential is not one
  EXPECT_FALSE(ParseJobCredential(a).ok());       // nor the reverse
  EXPECT_EQ(DeriveServerCredential("tyt.not.a-job-credential", "x:1"), "");
}

TEST(CredentialsTest, BearerHeaderIsParsed) {
  EXPECT_EQ(*BearerCredential("Bearer abc"), "abc");
  EXPECT_EQ(BearerCredential("Basic abc").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(BearerCredential("Bearer  ").status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(CredentialsTest, SecretFilesAreWrittenOwnerOnlyAndRefusedWhenOthersCanRead) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/sub/token";
  ASSERT_TRUE(WriteSecretFile(path, "tyt.secret").ok());
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat((dir.path() + "/sub").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(*ReadSecretFile(path), "tyt.secret");

  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  auto refused = ReadSecretFile(path);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(refused.status().message(), HasSubstr("chmod 600"));
  EXPECT_EQ(ReadSecretFile(dir.path() + "/none").status().code(), absl::StatusCode::kNotFound);
}

TEST(CredentialsTest, FindTokenPrefersTheFlagThenTheEnvironmentThenTheSavedFile) {
  testing::TempDir dir;
  const std::string flag = dir.path() + "/flag", saved = dir.path() + "/saved";
  ASSERT_TRUE(WriteSecretFile(flag, "from-flag").ok());
  ASSERT_TRUE(WriteSecretFile(saved, "from-saved").ok());
  unsetenv(kTokenEnv);
  EXPECT_EQ(*FindToken(flag, saved), "from-flag");
  EXPECT_EQ(*FindToken("", saved), "from-saved");
  setenv(kTokenEnv, "from-env", 1);
  EXPECT_EQ(*FindToken("", saved), "from-env");
  unsetenv(kTokenEnv);
  auto none = FindToken("", dir.path() + "/missing");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(none.status().message(), HasSubstr("--token-file"));
}

}  // namespace
}  // namespace trainyard
