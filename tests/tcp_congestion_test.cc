// The TCP congestion control of parameter-server connections (rpc/ps/tcp_congestion.h): a
// real trainyard-ps server (in process) and a real client channel on loopback, each told to use a
// congestion control other than the host's default, and the kernel asked what every socket of the
// connection actually uses. Bad names get INVALID_ARGUMENT naming the flag.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "rpc/ps/tcp_congestion.h"
#include "server/ps/ps_server.h"
#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard {
namespace {

using ::testing::HasSubstr;

// A congestion control this process may set that differs from the host's default, so that a
// socket reporting it shows the setting took effect. Reno is allowed to every process; where the
// host's default is reno, cubic (allowed to root, which CI is).
std::string OtherThanHost() {
  const std::string host = ps::HostTcpCongestion().value_or("");
  for (const char* name : {"reno", "cubic", "bbr"}) {
    if (name != host && ps::CheckTcpCongestion(name, "test").ok()) return name;
  }
  return "";
}

int PortOf(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return -1;
}

struct Ends {
  std::vector<std::string> server;  // accepted by the server: local port == its port
  std::vector<std::string> client;  // dialled by the client: peer port == the server's
};

// The congestion control of every connected TCP socket of this process to or from `port`.
Ends ConnectionsOf(int port) {
  Ends ends;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return ends;
  while (dirent* e = readdir(dir)) {
    const int fd = std::atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dirfd(dir)) continue;
    sockaddr_storage local{}, peer{};
    socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
      continue;  // not a socket, or not connected (the listener)
    }
    auto congestion = ps::SocketTcpCongestion(fd);
    if (!congestion.ok()) continue;  // not TCP
    if (PortOf(local) == port) ends.server.push_back(*congestion);
    if (PortOf(peer) == port) ends.client.push_back(*congestion);
  }
  closedir(dir);
  return ends;
}

TEST(TcpCongestionTest, ServerAndClientConnectionsUseTheChosenOne) {
  const std::string chosen = OtherThanHost();
  ASSERT_FALSE(chosen.empty()) << "no congestion control other than the host's "
                               << ps::HostTcpCongestion().value_or("?") << " may be set here";
  ps::PsOptions o;
  o.listen_address = "127.0.0.1:0";
  o.capacity_bytes = 1 << 20;
  o.threads = 1;
  o.tcp_congestion = chosen;
  auto server = ps::PsServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string& address = (*server)->address();
  const int port = std::atoi(address.substr(address.rfind(':') + 1).c_str());

  grpc::ChannelArguments args;
  ps::SetTcpCongestion(&args, chosen);
  auto stub = v1::ParameterServerService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  // A call opens the connection.
  grpc::ClientContext ctx;
  v1::ListShardsResponse shards;
  const grpc::Status status = stub->ListShards(&ctx, v1::ListShardsRequest(), &shards);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(shards.shards_size(), 0);

  const Ends ends = ConnectionsOf(port);
  ASSERT_FALSE(ends.server.empty()) << "no accepted connection found";
  ASSERT_FALSE(ends.client.empty()) << "no client connection found";
  for (const std::string& c : ends.server) EXPECT_EQ(c, chosen) << "server end";
  for (const std::string& c : ends.client) EXPECT_EQ(c, chosen) << "client end";
  (*server)->Shutdown();
}

TEST(TcpCongestionTest, WithoutOneAChannelKeepsTheHostDefault) {
  const auto host = ps::HostTcpCongestion();
  ASSERT_TRUE(host.ok()) << host.status();
  ps::PsOptions o;
  o.listen_address = "127.0.0.1:0";
  o.capacity_bytes = 1 << 20;
  o.threads = 1;
  auto server = ps::PsServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string& address = (*server)->address();
  const int port = std::atoi(address.substr(address.rfind(':') + 1).c_str());
  grpc::ChannelArguments args;
  ps::SetTcpCongestion(&args, "");
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  ASSERT_TRUE(
      channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  const Ends ends = ConnectionsOf(port);
  ASSERT_FALSE(ends.client.empty());
  for (const std::string& c : ends.client) EXPECT_EQ(c, *host);
  for (const std::string& c : ends.server) EXPECT_EQ(c, *host);
  (*server)->Shutdown();
}

TEST(TcpCongestionTest, BadNamesAreRefusedNamingTheFlag) {
  absl::Status s = ps::CheckTcpCongestion("no-such-cc", "--tcp-congestion");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("--tcp-congestion: \"no-such-cc\""));
  EXPECT_THAT(s.message(), HasSubstr("available:"));
  s = ps::CheckTcpCongestion("a-name-far-too-long-for-the-kernel", "--ps-tcp-congestion");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("--ps-tcp-congestion"));
  EXPECT_TRUE(ps::CheckTcpCongestion("", "--tcp-congestion").ok());
  EXPECT_TRUE(ps::CheckTcpCongestion("reno", "--tcp-congestion").ok());  // every process may

  ps::PsOptions o;
  o.listen_address = "127.0.0.1:0";
  o.capacity_bytes = 1 << 20;
  o.tcp_congestion = "no-such-cc";
  auto server = ps::PsServer::Start(o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("--tcp-congestion"));
}

}  // namespace
}  // namespace trainyard
