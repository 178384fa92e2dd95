// CoordinatorEndpoints (common/coordinator_endpoints.h): the address lists clients take, and
// where a client goes after a failed call. Pure logic.
#include "common/coordinator_endpoints.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace trainyard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CoordinatorEndpointsTest, ParsesAListAndNamesTheFlagOfABadOne) {
  auto list = CoordinatorEndpoints::ParseList("--coordinator", "a:7070, 10.0.0.2:7070,[::1]:7070");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(*list, ElementsAre("a:7070", "10.0.0.2:7070", "[::1]:7070"));
  for (const char* bad : {"", "a:7070,", "a", "a:", ":7070", "a:1,,b:2"}) {
    auto parsed = CoordinatorEndpoints::ParseList("--coordinator", bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("--coordinator"));
  }
  std::string seventeen = "a:1";
  for (int i = 0; i < 16; ++i) seventeen += ",a:1";
  EXPECT_THAT(CoordinatorEndpoints::ParseList("--coordinators", seventeen).status().message(),
              HasSubstr("more than 16"));
}

TEST(CoordinatorEndpointsTest, GoesToTheNamedLeaderElseDownTheList) {
  CoordinatorEndpoints endpoints("a:1,b:2,c:3");
  EXPECT_EQ(endpoints.current(), "a:1");
  EXPECT_TRUE(endpoints.Follow("c:3"));  // a standby named the leader
  EXPECT_EQ(endpoints.current(), "c:3");
  EXPECT_FALSE(endpoints.Follow("c:3"));  // already there
  EXPECT_TRUE(endpoints.Follow(""));      // nobody: the next one, round the list
  EXPECT_EQ(endpoints.current(), "a:1");
  EXPECT_TRUE(endpoints.Follow("ctl-9:7070"));  // a leader outside the list is added
  EXPECT_EQ(endpoints.current(), "ctl-9:7070");
  EXPECT_EQ(endpoints.all(), "a:1,b:2,c:3,ctl-9:7070");
}

TEST(CoordinatorEndpointsTest, ANameThatIsNotOneHostAndPortIsTakenAsNone) {
  CoordinatorEndpoints endpoints("a:1,b:2");
  for (const std::string& bad :
       std::vector<std::string>{"c:3\nforged log line", "c:3,d:4", "no-port", std::string(400, 'x'),
                                std::string("c:3\0", 4)}) {
    EXPECT_TRUE(endpoints.Follow(bad)) << "moves down the list instead";
  }
  EXPECT_EQ(endpoints.all(), "a:1,b:2");
}

TEST(CoordinatorEndpointsTest, OneAddressMovesOnlyToANamedLeader) {
  CoordinatorEndpoints endpoints("a:1");
  EXPECT_FALSE(endpoints.Follow(""));
  EXPECT_EQ(endpoints.current(), "a:1");
  EXPECT_TRUE(endpoints.Follow("b:2"));
  EXPECT_EQ(endpoints.current(), "b:2");
}

TEST(CoordinatorEndpointsTest, OnlyUnavailableAndDeadlineExceededMove) {
  CoordinatorEndpoints endpoints("a:1,b:2");
  grpc::ClientContext ctx;
  EXPECT_FALSE(endpoints.Follow(grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "no"), ctx));
  EXPECT_FALSE(endpoints.Follow(grpc::Status(grpc::StatusCode::NOT_FOUND, "no"), ctx));
  EXPECT_EQ(endpoints.current(), "a:1");
  EXPECT_TRUE(endpoints.Follow(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone"), ctx));
  EXPECT_EQ(endpoints.current(), "b:2");
  EXPECT_TRUE(endpoints.Follow(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "late"), ctx));
  EXPECT_EQ(endpoints.current(), "a:1");
}

}  // namespace
}  // namespace trainyard
