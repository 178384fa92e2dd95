// Pure pieces of the input hardening: escaping untrusted text for logs, the reflection walk that
// caps every field of a request, the throttle of failed authentications (on a FakeClock), the
// rendezvous' caps, and the job spec's size limits.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/field_limits.h"
#include "common/log_text.h"
#include "common/spec.h"
#include "server/coordinator/auth_throttle.h"
#include "server/coordinator/rendezvous.h"
#include "trainyard/v1/identity.pb.h"
#include "trainyard/v1/job.pb.h"

namespace trainyard {
namespace {

using ::testing::HasSubstr;

TEST(LogTextTest, ControlCharactersAreEscapedAndPrintableTextIsKept) {
  EXPECT_EQ(EscapeControl("plain text, café"), "plain text, café");
  EXPECT_EQ(EscapeControl("a\nb\rc\td\x1b[2K\x7f"), "a\\nb\\rc\\td\\x1b[2K\\x7f");
  EXPECT_EQ(EscapeControl("C:\\dir"), "C:\\dir");
}

TEST(LogTextTest, QuotedFieldsReadAsOneToken) {
  EXPECT_EQ(Quoted("alice"), "\"alice\"");
  EXPECT_EQ(Quoted("a\" b\\c\nd"), "\"a\\\" b\\\\c\\nd\"");
  // Quoted, a literal backslash-n and a newline differ.
  EXPECT_NE(Quoted("a\\nb"), Quoted("a\nb"));
  EXPECT_EQ(Quoted(""), "\"\"");
}

TEST(FieldLimitsTest, NamesTheFieldThatIsTooLong) {
  v1::JobSpec spec;
  spec.set_name("ok");
  spec.mutable_data()->set_path(std::string(5000, 'p'));
  absl::Status s = CheckFieldSizes(spec, FieldLimits{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "data.path: 5000 bytes, at most 4096");
  EXPECT_EQ(CheckFieldSizes(spec, FieldLimits{}, "spec").message(),
            "spec.data.path: 5000 bytes, at most 4096");

  spec.mutable_data()->set_path("/data");
  auto* lora = spec.mutable_train()->mutable_lora();
  for (int i = 0; i < 3; ++i) lora->add_target_modules("q_proj");
  lora->add_target_modules(std::string(5000, 'm'));
  EXPECT_EQ(CheckFieldSizes(spec, FieldLimits{}).message(),
            "train.lora.target_modules[3]: 5000 bytes, at most 4096");
  EXPECT_EQ(CheckFieldSizes(spec, FieldLimits{4096, 3, 1 << 20}).message(),
            "train.lora.target_modules: 4 entries, at most 3");
  EXPECT_EQ(CheckFieldSizes(spec, FieldLimits{1 << 20, 1024, 1000}).message(),
            absl::StrCat("request: ", spec.ByteSizeLong(), " bytes serialized, at most 1000"));
  lora->mutable_target_modules()->RemoveLast();
  EXPECT_TRUE(CheckFieldSizes(spec, FieldLimits{}).ok());
}

TEST(FieldLimitsTest, AStringFieldMustBeUtf8) {
  v1::JobSpec spec;
  spec.mutable_model()->set_from("caf\xc3\xa9 \xf0\x9f\x9a\x82");  // é and a train: fine
  EXPECT_TRUE(CheckFieldSizes(spec, FieldLimits{}).ok());
  // Found by tests/fuzz/spec_yaml_fuzz: such a spec passed validation, then failed to parse on
  // the coordinator (INTERNAL).
  for (const char* bad : {"\xff", "a\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80"}) {
    spec.mutable_model()->set_from(bad);
    EXPECT_EQ(CheckFieldSizes(spec, FieldLimits{}).message(), "model.from: not valid UTF-8") << bad;
  }
}

TEST(FieldLimitsTest, WalksRepeatedMessagesAndMaps) {
  v1::User user;
  user.set_name("alice");
  EXPECT_TRUE(CheckFieldSizes(user, FieldLimits{}).ok());
  v1::ListUsersResponse users;
  *users.add_users() = user;
  users.add_users()->set_account(std::string(70, 'a'));
  EXPECT_EQ(CheckFieldSizes(users, FieldLimits{64, 10, 1 << 20}).message(),
            "users[1].account: 70 bytes, at most 64");
}

TEST(SpecLimitsTest, ASpecIsRefusedWhenItsFieldsOrItsYamlAreTooLarge) {
  v1::JobSpec spec;
  spec.set_name("big");
  spec.mutable_resources()->set_slots(1);
  spec.mutable_data()->set_path(std::string(1 << 20, 'a'));
  absl::Status s = ValidateJobSpec(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("data.path: 1048576 bytes"));
  auto parsed = ParseJobSpecYaml(std::string(kMaxSpecYamlBytes + 1, '#'), "huge.yaml");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()),
              HasSubstr("huge.yaml: 1048577 bytes; a job spec is at most 1048576"));
}

TEST(AuthThrottleTest, AKeyIsHeldAfterItsBurstAndForgivenAtTheRefillRate) {
  FakeClock clock;
  coordinator::AuthThrottle throttle(clock, {3, 0.5});
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(throttle.Admit("token t1").ok());
    throttle.Failed("token t1");
  }
  absl::Status held = throttle.Admit("token t1");
  EXPECT_EQ(held.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(held.message()), HasSubstr("retry in 2000 ms"));
  EXPECT_TRUE(throttle.Admit("token t2").ok());  // keys are apart
  clock.Advance(absl::Seconds(1));
  EXPECT_FALSE(throttle.Admit("token t1").ok());
  clock.Advance(absl::Seconds(1));
  EXPECT_TRUE(throttle.Admit("token t1").ok());  // one failure forgiven
  throttle.Failed("token t1");
  EXPECT_FALSE(throttle.Admit("token t1").ok());
  clock.Advance(absl::Hours(1));  // never more than the burst
  for (int i = 0; i < 3; ++i) throttle.Failed("token t1");
  EXPECT_FALSE(throttle.Admit("token t1").ok());
}

TEST(AuthThrottleTest, MemoryIsBoundedByTheNumberOfKeys) {
  FakeClock clock;
  coordinator::AuthThrottle throttle(clock, {2, 1, 100});
  for (int i = 0; i < 1000; ++i) {
    throttle.Failed(absl::StrCat("peer ", i));
    throttle.Failed(absl::StrCat("peer ", i));
  }
  EXPECT_LE(throttle.tracked_keys(), 100u);
  EXPECT_FALSE(throttle.Admit("peer 999").ok());  // the newest are kept
}

TEST(AuthThrottleTest, ZeroBurstTurnsItOff) {
  FakeClock clock;
  coordinator::AuthThrottle throttle(clock, {0, 1});
  for (int i = 0; i < 100; ++i) throttle.Failed("peer x");
  EXPECT_TRUE(throttle.Admit("peer x").ok());
}

TEST(RendezvousLimitsTest, WaitersAndBarriersAreCappedToo) {
  coordinator::RendezvousLimits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  limits.max_keys = 2;
  limits.max_bytes = 64;
  limits.max_waiters = 2;
  coordinator::Rendezvous rdzv(limits);
  const coordinator::ScopeId scope{"job-1", 1};
  rdzv.OpenScope(scope);
  absl::Status last;
  for (int i = 0; i < 3; ++i) {
    rdzv.Get(scope, absl::StrCat("w", i), absl::Minutes(1),
             [&last](absl::StatusOr<std::string> v) { last = v.status(); });
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted);
  absl::Status barrier;
  rdzv.Barrier(scope, "a-very-long-barrier-name", 0, 2, absl::Minutes(1),
               [&barrier](absl::Status s) { barrier = s; });
  EXPECT_EQ(barrier.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(barrier.message()), HasSubstr("name: 24 bytes, at most 8"));
  // The waiters end when their keys arrive; the two keys fill the scope.
  EXPECT_TRUE(rdzv.Set(scope, "w0", "v").ok());
  EXPECT_TRUE(rdzv.Set(scope, "w1", "v").ok());
  EXPECT_EQ(rdzv.Set(scope, "w2", "v").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(rdzv.Add(scope, "n", 1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(rdzv.CompareSet(scope, "w0", "v", std::string(17, 'x')).status().code(),
            absl::StatusCode::kInvalidArgument);
  rdzv.CloseScope(scope);
}

}  // namespace
}  // namespace trainyard
