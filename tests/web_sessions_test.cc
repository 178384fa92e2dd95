// The web console's session table (server/web/web_sessions.h): pure logic on a fake clock.
#include "server/web/web_sessions.h"

#include <set>
#include <string>

#include <gtest/gtest.h>

namespace trainyard::web {
namespace {

class WebSessionsTest : public ::testing::Test {
 protected:
  absl::Time now_ = absl::FromUnixSeconds(1'800'000'000);
  WebSessionLimits limits_{absl::Hours(1), absl::Hours(8), 3};
  WebSessions sessions_{limits_, [this] { return now_; }};
};

TEST_F(WebSessionsTest, ASessionIsFoundByItsIdAndCarriesItsTokenAndACsrfTokenOfItsOwn) {
  const std::string a = sessions_.Create("tyt.a.secret", "alice", false);
  const std::string b = sessions_.Create("tyt.b.secret", "bob", true);
  EXPECT_NE(a, b);
  EXPECT_GE(a.size(), 40u);  // 256 random bits
  auto sa = sessions_.Find(a);
  auto sb = sessions_.Find(b);
  ASSERT_TRUE(sa.has_value());
  ASSERT_TRUE(sb.has_value());
  EXPECT_EQ(sa->token, "tyt.a.secret");
  EXPECT_EQ(sa->user, "alice");
  EXPECT_FALSE(sa->admin);
  EXPECT_TRUE(sb->admin);
  EXPECT_NE(sa->csrf, sb->csrf);
  EXPECT_NE(sa->csrf, a);
  EXPECT_FALSE(sessions_.Find("").has_value());
  EXPECT_FALSE(sessions_.Find(a + "x").has_value());
  EXPECT_FALSE(sessions_.Find(std::string(4096, 'a')).has_value());
}

TEST_F(WebSessionsTest, ASessionEndsAfterItsIdleTimeAndItsLifetimeWhateverItsUse) {
  const std::string id = sessions_.Create("t", "alice", false);
  now_ += absl::Minutes(59);
  ASSERT_TRUE(sessions_.Find(id).has_value());  // used: its idle clock starts again
  now_ += absl::Minutes(59);
  ASSERT_TRUE(sessions_.Find(id).has_value());
  now_ += absl::Minutes(61);
  EXPECT_FALSE(sessions_.Find(id).has_value());
  EXPECT_EQ(sessions_.size(), 0u);

  const std::string busy = sessions_.Create("t", "alice", false);
  for (int i = 0; i < 8 * 2 - 1; ++i) {
    now_ += absl::Minutes(30);
    ASSERT_TRUE(sessions_.Find(busy).has_value()) << i;
  }
  now_ += absl::Minutes(30);  // 8 hours after sign-in
  EXPECT_FALSE(sessions_.Find(busy).has_value());
}

TEST_F(WebSessionsTest, SignOutAndARevokedTokenEndTheirSessionsOnly) {
  const std::string a1 = sessions_.Create("tok-a", "alice", false);
  const std::string a2 = sessions_.Create("tok-a", "alice", false);
  const std::string b = sessions_.Create("tok-b", "bob", false);
  sessions_.Remove(a1);
  EXPECT_FALSE(sessions_.Find(a1).has_value());
  EXPECT_TRUE(sessions_.Find(a2).has_value());
  sessions_.Create("tok-a", "alice", false);
  sessions_.RemoveToken("tok-a");
  EXPECT_FALSE(sessions_.Find(a2).has_value());
  EXPECT_TRUE(sessions_.Find(b).has_value());
  EXPECT_EQ(sessions_.size(), 1u);
}

TEST_F(WebSessionsTest, AFullTableGivesWayByTheLeastRecentlyUsed) {
  const std::string a = sessions_.Create("ta", "a", false);
  now_ += absl::Seconds(1);
  const std::string b = sessions_.Create("tb", "b", false);
  now_ += absl::Seconds(1);
  const std::string c = sessions_.Create("tc", "c", false);
  now_ += absl::Seconds(1);
  ASSERT_TRUE(sessions_.Find(a).has_value());  // a is now the most recent; b the least
  const std::string d = sessions_.Create("td", "d", false);
  EXPECT_EQ(sessions_.size(), 3u);
  EXPECT_TRUE(sessions_.Find(a).has_value());
  EXPECT_FALSE(sessions_.Find(b).has_value());
  EXPECT_TRUE(sessions_.Find(c).has_value());
  EXPECT_TRUE(sessions_.Find(d).has_value());
}

TEST_F(WebSessionsTest, AUserSigningInOverAndOverEndsOnlyTheirOwnOldestSessions) {
  WebSessions sessions({absl::Hours(1), absl::Hours(8), 10, 2}, [this] { return now_; });
  const std::string bob = sessions.Create("tb", "bob", false);
  std::string alice[4];
  for (std::string& id : alice) {
    now_ += absl::Seconds(1);
    id = sessions.Create("ta", "alice", false);
  }
  EXPECT_EQ(sessions.size(), 3u);  // bob's and alice's latest two
  EXPECT_TRUE(sessions.Find(bob).has_value());
  EXPECT_FALSE(sessions.Find(alice[0]).has_value());
  EXPECT_FALSE(sessions.Find(alice[1]).has_value());
  EXPECT_TRUE(sessions.Find(alice[2]).has_value());
  EXPECT_TRUE(sessions.Find(alice[3]).has_value());
}

TEST_F(WebSessionsTest, ASignInCodeIsGoodOnceWithinItsTime) {
  const std::string code = sessions_.CreateCode("tok", "alice", absl::Minutes(1));
  const std::string other = sessions_.CreateCode("tok2", "bob", absl::Minutes(1));
  EXPECT_NE(code, other);
  EXPECT_EQ(sessions_.TakeCode(code), "tok");
  EXPECT_EQ(sessions_.TakeCode(code), std::nullopt);  // spent
  now_ += absl::Seconds(61);
  EXPECT_EQ(sessions_.TakeCode(other), std::nullopt);  // expired
  EXPECT_EQ(sessions_.TakeCode(""), std::nullopt);
  // At most max_sessions (3) wait at once: the oldest gives way.
  const std::string first = sessions_.CreateCode("a", "alice", absl::Minutes(1));
  now_ += absl::Seconds(1);
  for (const char* t : {"b", "c", "d"}) sessions_.CreateCode(t, t, absl::Minutes(1));
  EXPECT_EQ(sessions_.TakeCode(first), std::nullopt);
}

// A user making links over and over ends only their own oldest (one user's requests pushed every
// other user's pending link out of the table).
TEST_F(WebSessionsTest, AUserMakingLinksOverAndOverEndsOnlyTheirOwnOldest) {
  WebSessions sessions({absl::Hours(1), absl::Hours(8), 10, 2}, [this] { return now_; });
  const std::string bob = sessions.CreateCode("tb", "bob", absl::Minutes(1));
  std::string alice[20];
  for (std::string& code : alice) {
    now_ += absl::Milliseconds(100);
    code = sessions.CreateCode("ta", "alice", absl::Minutes(1));
  }
  EXPECT_EQ(sessions.TakeCode(bob), "tb");
  EXPECT_EQ(sessions.TakeCode(alice[17]), std::nullopt);
  EXPECT_EQ(sessions.TakeCode(alice[18]), "ta");
  EXPECT_EQ(sessions.TakeCode(alice[19]), "ta");
}

// A live stream asks whether its session is still on without keeping it on: a page left open
// is not a use, and its session ends at sign-out or when it expires.
TEST_F(WebSessionsTest, AliveSaysWhetherASessionIsOnWithoutRestartingItsIdleClock) {
  const std::string id = sessions_.Create("t", "alice", false);
  EXPECT_TRUE(sessions_.Alive(id));
  EXPECT_FALSE(sessions_.Alive(id + "x"));
  EXPECT_FALSE(sessions_.Alive(""));
  now_ += absl::Minutes(59);
  EXPECT_TRUE(sessions_.Alive(id));
  now_ += absl::Minutes(1);  // an hour idle: Alive did not count as a use
  EXPECT_FALSE(sessions_.Alive(id));
  const std::string other = sessions_.Create("u", "bob", false);
  sessions_.Remove(other);
  EXPECT_FALSE(sessions_.Alive(other));
}

}  // namespace
}  // namespace trainyard::web
