// Credentials for tests: the "authorization" metadata, tokens made directly in an in-process
// coordinator's IdentityRegistry, and tokens made over gRPC with the admin's token for a
// coordinator in another process. One test thread uses each object.
#ifndef TRAINYARD_TESTS_TESTING_IDENTITY_H_
#define TRAINYARD_TESTS_TESTING_IDENTITY_H_

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/credentials.h"
#include "trainyard/v1/identity.grpc.pb.h"

namespace trainyard::testing {

inline void Authorize(grpc::ClientContext& ctx, const std::string& token) {
  if (!token.empty()) ctx.AddMetadata(kAuthorizationMetadata, "Bearer " + token);
}

// A token made over gRPC by the holder of `admin_token`: a user's (created if missing, with
// `role`), or with `node`, a node token. Empty (and a test failure) on error.
inline std::string CreateToken(const std::shared_ptr<grpc::Channel>& channel,
                               const std::string& admin_token, const std::string& user,
                               const std::string& node = "", v1::Role role = v1::USER,
                               const std::vector<std::string>& owners = {}) {
  auto stub = v1::IdentityService::NewStub(channel);
  if (!user.empty()) {
    grpc::ClientContext ctx;
    Authorize(ctx, admin_token);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::CreateUserRequest r;
    r.set_name(user);
    r.set_role(role);
    v1::User created;
    const grpc::Status s = stub->CreateUser(&ctx, r, &created);
    EXPECT_TRUE(s.ok() || s.error_code() == grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  }
  grpc::ClientContext ctx;
  Authorize(ctx, admin_token);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  v1::CreateTokenRequest r;
  r.set_user(user);
  r.set_node(node);
  for (const std::string& owner : owners) r.add_owners(owner);
  v1::CreateTokenResponse resp;
  const grpc::Status s = stub->CreateToken(&ctx, r, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.token();
}

// The admin token a coordinator wrote at its first start into `state_dir`.
inline std::string AdminToken(const std::string& state_dir) {
  auto token = ReadSecretFile(state_dir + "/admin.token");
  EXPECT_TRUE(token.ok()) << token.status();
  return token.ok() ? *token : std::string();
}

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_IDENTITY_H_
