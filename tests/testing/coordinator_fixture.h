// The fixture of the coordinator's in-process integration tests: a real CoordinatorServer on a
// free loopback port with a SQLite store in a temp dir, a FakeClock and no background threads (each
// test decides when scheduling passes and ticks happen), tokens made in its registry, and a stub
// of each service on one channel. A test fixture derives from it and may adjust the options in
// Configure; its own SetUp calls CoordinatorFixture::SetUp first.
#ifndef TRAINYARD_TESTS_TESTING_COORDINATOR_FIXTURE_H_
#define TRAINYARD_TESTS_TESTING_COORDINATOR_FIXTURE_H_

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>

#include "common/clock.h"
#include "server/coordinator/coordinator_server.h"
#include "tests/testing/coordinator_tokens.h"
#include "tests/testing/subprocess.h"
#include "trainyard/v1/identity.grpc.pb.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/node.grpc.pb.h"
#include "trainyard/v1/rendezvous.grpc.pb.h"
#include "trainyard/v1/trainer.grpc.pb.h"

namespace trainyard::testing {

class CoordinatorFixture : public ::testing::Test {
 protected:
  // Options beyond the fixture's (listen, state dir, clock, no background threads).
  virtual void Configure(coordinator::CoordinatorOptions& options) {}

  void SetUp() override { StartServer(); }

  // Shuts the coordinator down (SIGTERM's path) and starts it again on the same state directory,
  // with new channels and stubs (its port changes).
  void Restart() {
    server_->Shutdown();
    server_.reset();
    StartServer();
  }

  void StartServer() {
    coordinator::CoordinatorOptions o;
    o.listen_address = "127.0.0.1:0";
    o.state_dir = dir_.path() + "/state";
    o.clock = &clock_;
    o.background_threads = false;
    Configure(o);
    auto s = coordinator::CoordinatorServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    tokens_ = std::make_unique<CoordinatorTokens>(server_->identities());
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel_);
    nodes_ = v1::NodeService::NewStub(channel_);
    rdzv_ = v1::RendezvousService::NewStub(channel_);
    trainer_ = v1::TrainerService::NewStub(channel_);
    identity_ = v1::IdentityService::NewStub(channel_);
  }

  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  TempDir dir_;
  FakeClock clock_;
  std::unique_ptr<coordinator::CoordinatorServer> server_;
  std::unique_ptr<CoordinatorTokens> tokens_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::NodeService::Stub> nodes_;
  std::unique_ptr<v1::RendezvousService::Stub> rdzv_;
  std::unique_ptr<v1::TrainerService::Stub> trainer_;
  std::unique_ptr<v1::IdentityService::Stub> identity_;
};

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_COORDINATOR_FIXTURE_H_
