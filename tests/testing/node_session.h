// A worker node as a test plays it, over a real channel: registered, its session stream open.
// Commands read while waiting for a heartbeat ack are kept for NextCommand. Failures fail the
// test (gtest). One test thread uses each object.
#ifndef TRAINYARD_TESTS_TESTING_NODE_SESSION_H_
#define TRAINYARD_TESTS_TESTING_NODE_SESSION_H_

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "tests/testing/identity.h"
#include "trainyard/v1/node.grpc.pb.h"

namespace trainyard::testing {

class NodeSession {
 public:
  // Registers `node_id` with `devices` CPU slots (of unknown memory), opens its session with a
  // hello and returns once the coordinator acknowledged a first heartbeat, i.e. the session is
  // attached and the node can get ranks. `running`: the ranks its hello says it runs.
  // `token`: the node's node token.
  static std::unique_ptr<NodeSession> Connect(const std::shared_ptr<grpc::Channel>& channel,
                                              const std::string& token, const std::string& node_id,
                                              int devices,
                                              const std::vector<v1::RankStatus>& running = {}) {
    v1::RegisterNodeRequest r;
    r.set_node_id(node_id);
    r.set_hostname("localhost");
    r.set_memory_bytes(int64_t{8} << 30);
    for (int i = 0; i < devices; ++i) {
      v1::Device* d = r.add_devices();
      d->set_index(i);
      d->set_kind(v1::CPU_SLOT);
    }
    return ConnectWith(channel, token, r, running);
  }

  // A parameter server offering `memory_bytes` for shards at `address`.
  static std::unique_ptr<NodeSession> ConnectParameterServer(
      const std::shared_ptr<grpc::Channel>& channel, const std::string& token,
      const std::string& node_id, int64_t memory_bytes, const std::string& address) {
    v1::RegisterNodeRequest r;
    r.set_node_id(node_id);
    r.set_hostname("localhost");
    r.set_address(address);
    r.set_memory_bytes(memory_bytes);
    r.set_role(v1::PARAMETER_SERVER);
    return ConnectWith(channel, token, r);
  }

  static std::unique_ptr<NodeSession> ConnectWith(const std::shared_ptr<grpc::Channel>& channel,
                                                  const std::string& token,
                                                  const v1::RegisterNodeRequest& r,
                                                  const std::vector<v1::RankStatus>& running = {}) {
    auto stub = v1::NodeService::NewStub(channel);
    const std::string& node_id = r.node_id();
    {
      grpc::ClientContext ctx;
      Prepare(ctx, token, absl::Seconds(20));
      v1::RegisterNodeResponse resp;
      const grpc::Status s = stub->RegisterNode(&ctx, r, &resp);
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    std::unique_ptr<NodeSession> session(new NodeSession());
    Prepare(session->ctx_, token, absl::Minutes(10));
    session->stream_ = stub->Session(&session->ctx_);
    v1::NodeMessage hello;
    hello.mutable_hello()->set_node_id(node_id);
    for (const v1::RankStatus& rank : running) *hello.mutable_hello()->add_running() = rank;
    EXPECT_TRUE(session->stream_->Write(hello));
    session->Heartbeat();
    return session;
  }

  ~NodeSession() { ctx_.TryCancel(); }

  // The next message from the coordinator that is not a heartbeat ack.
  v1::CoordinatorMessage NextCommand() {
    v1::CoordinatorMessage m;
    if (!pending_.empty()) {
      m = pending_.front();
      pending_.pop_front();
      return m;
    }
    while (stream_->Read(&m)) {
      if (!m.has_heartbeat_ack()) return m;
    }
    ADD_FAILURE() << "the session ended";
    return m;
  }

  // Sends a heartbeat and returns once the coordinator acknowledged (so processed) it.
  void Heartbeat() {
    v1::NodeMessage hb;
    hb.mutable_heartbeat()->set_seq(++heartbeat_seq_);
    ASSERT_TRUE(stream_->Write(hb));
    v1::CoordinatorMessage m;
    while (stream_->Read(&m)) {
      if (!m.has_heartbeat_ack()) {
        pending_.push_back(m);
      } else if (m.heartbeat_ack().seq() == heartbeat_seq_) {
        return;
      }
    }
    FAIL() << "no heartbeat ack";
  }

  void ReportExit(const v1::Assignment& a, int rank, int exit_code,
                  const v1::RankUsage* usage = nullptr) {
    v1::NodeMessage m;
    v1::RankStatus* rs = m.mutable_rank_status();
    rs->set_job_id(a.job_id());
    rs->set_attempt(a.attempt());
    rs->set_rank(rank);
    rs->set_phase(v1::RANK_EXITED);
    rs->set_exit_code(exit_code);
    if (usage != nullptr) *rs->mutable_usage() = *usage;
    ASSERT_TRUE(stream_->Write(m));
  }

  bool Write(const v1::NodeMessage& m) { return stream_->Write(m); }

  // Messages (not heartbeat acks) read while waiting for an ack and not yet taken.
  size_t pending() const { return pending_.size(); }

  // Reads until the coordinator ends the session; its final status.
  grpc::Status Finish() {
    v1::CoordinatorMessage m;
    while (stream_->Read(&m)) {
    }
    return stream_->Finish();
  }

 private:
  NodeSession() = default;

  static void Prepare(grpc::ClientContext& ctx, const std::string& token, absl::Duration timeout) {
    Authorize(ctx, token);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }

  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::NodeMessage, v1::CoordinatorMessage>> stream_;
  int64_t heartbeat_seq_ = 0;
  std::deque<v1::CoordinatorMessage> pending_;
};

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_NODE_SESSION_H_
