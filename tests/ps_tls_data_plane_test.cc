// TLS on the parameter server's TCP data plane: on by default with --tls-cert, with the gRPC
// certificate; pushes and pulls over it give the very parameters plain TCP gives; a client
// without the CA, with another CA, or dialling a name the certificate does not carry is refused
// naming why; --data-plane-insecure keeps it plain. Real PsServers on loopback, certificates
// from the openssl command.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/ps/data_plane_client.h"
#include "rpc/ps/tls_io.h"
#include "server/ps/ps_server.h"
#include "tests/testing/ps_shard.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_pki.h"
#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard {
namespace {

using ::testing::HasSubstr;
using testing::ShardHeader;

constexpr absl::Duration kTimeout = absl::Seconds(30);
constexpr int64_t kN = 50000;

class PsTlsDataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pki_ = std::make_unique<testing::TestPki>(dir_.path());
    pki_->SignWithSan("elsewhere", "ps.example", "IP:10.0.0.9,DNS:ps.example");
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0, 1);
    init_.resize(kN);
    grads_.resize(kN);
    for (float& x : init_) x = normal(rng);
    for (float& g : grads_) g = normal(rng);
  }

  // A server with `cert` (empty: no TLS) and a shard of job-1 initialised over gRPC.
  std::unique_ptr<ps::PsServer> Start(const std::string& cert, bool data_plane_insecure = false) {
    ps::PsOptions o;
    o.listen_address = "127.0.0.1:0";
    o.data_listen_address = "127.0.0.1:0";
    o.capacity_bytes = int64_t{1} << 30;
    o.threads = 2;
    o.data_plane_insecure = data_plane_insecure;
    if (!cert.empty()) {
      o.tls.cert_file = pki_->Path(cert + ".pem");
      o.tls.key_file = pki_->Path(cert + ".key");
    }
    auto s = ps::PsServer::Start(o);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return nullptr;
    auto stub = Stub(**s, !cert.empty(), cert == "elsewhere" ? "ps.example" : "");
    EXPECT_TRUE(
        testing::InitShard(*stub, ShardHeader("job-1", 1, 0, kN, kN), init_, int64_t{1} << 20)
            .ok());
    return *std::move(s);
  }

  // `name`: the name the server's certificate must carry (gRPC's target name override).
  std::unique_ptr<v1::ParameterServerService::Stub> Stub(const ps::PsServer& server, bool tls,
                                                         const std::string& name = "") {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(pki_->Path("ca.pem"));
    grpc::ChannelArguments args;
    if (!name.empty()) args.SetSslTargetNameOverride(name);
    return v1::ParameterServerService::NewStub(grpc::CreateCustomChannel(
        server.address(), tls ? grpc::SslCredentials(ssl) : grpc::InsecureChannelCredentials(),
        args));
  }

  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  v1::DataPlaneInfo Info(const ps::PsServer& server, bool tls) {
    grpc::ClientContext ctx;
    v1::DataPlaneInfo info;
    EXPECT_TRUE(Stub(server, tls)->GetDataPlane(&ctx, {}, &info).ok());
    return info;
  }

  // Step 1 of job-1 over `client`: the pushed gradients applied, the parameters pulled.
  absl::StatusOr<std::vector<float>> Step(ps::DataPlaneClient& client) {
    v1::GradientChunk h;
    h.set_job_id("job-1");
    h.set_attempt(1);
    h.set_step(1);
    h.set_format(v1::WIRE_FP32);
    v1::PushGradientsResponse pushed;
    if (absl::Status s = client.Push(h, grads_.data(), 0, kN, 4096, kTimeout, &pushed); !s.ok()) {
      return s;
    }
    v1::UpdateAndPullRequest r;
    r.set_job_id("job-1");
    r.set_attempt(1);
    r.set_step(1);
    r.set_begin(0);
    r.set_end(kN);
    r.mutable_update()->set_lr(1e-2f);
    std::vector<float> params(kN);
    if (absl::Status s = client.UpdateAndPull(r, params.data(), kTimeout); !s.ok()) return s;
    return params;
  }

  std::shared_ptr<const ps::TlsConfig> ClientTls(const std::string& ca) {
    auto tls = ps::TlsConfig::Client(pki_->Path(ca + ".pem"));
    EXPECT_TRUE(tls.ok()) << tls.status();
    return tls.ok() ? *tls : nullptr;
  }

  testing::TempDir dir_;
  std::unique_ptr<testing::TestPki> pki_;
  std::vector<float> init_, grads_;
};

TEST_F(PsTlsDataPlaneTest, WithACertificateTheDataPlaneIsTlsAndMovesTheSameBytesAsPlainTcp) {
  auto tls_server = Start("server");
  auto plain_server = Start("");
  ASSERT_TRUE(tls_server && plain_server);
  const v1::DataPlaneInfo tls_info = Info(*tls_server, true);
  EXPECT_TRUE(tls_info.tls());
  EXPECT_FALSE(Info(*plain_server, false).tls());

  ps::DataPlaneClient over_tls(tls_info.address(), "", "", ClientTls("ca"));
  ps::DataPlaneClient over_tcp(plain_server->data_plane_address(), "");
  auto a = Step(over_tls);
  auto b = Step(over_tcp);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, *b);  // bit for bit
  EXPECT_NE(*a, init_);
  tls_server->Shutdown();
  plain_server->Shutdown();
}

TEST_F(PsTlsDataPlaneTest, ClientsThatCannotVerifyTheServerAreRefusedNamingWhy) {
  auto server = Start("server");
  ASSERT_TRUE(server);
  const std::string address = server->data_plane_address();
  // Plain TCP to a TLS data plane: no answer it could read.
  ps::DataPlaneClient plain(address, "");
  auto s = Step(plain);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  // Another CA's client: the server's certificate does not verify.
  ps::DataPlaneClient stranger(address, "", "", ClientTls("other-ca"));
  s = Step(stranger);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("the peer's certificate: unable to get local issuer certificate"));
  server->Shutdown();

  // A certificate for another address: refused by name.
  auto elsewhere = Start("elsewhere");
  ASSERT_TRUE(elsewhere);
  ps::DataPlaneClient mismatch(elsewhere->data_plane_address(), "", "", ClientTls("ca"));
  s = Step(mismatch);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("IP address mismatch"));
  elsewhere->Shutdown();
}

TEST_F(PsTlsDataPlaneTest, DataPlaneInsecureKeepsItPlainBesideTlsGrpc) {
  auto server = Start("server", /*data_plane_insecure=*/true);
  ASSERT_TRUE(server);
  EXPECT_FALSE(Info(*server, true).tls());
  ps::DataPlaneClient plain(server->data_plane_address(), "");
  auto s = Step(plain);
  EXPECT_TRUE(s.ok()) << s.status();
  server->Shutdown();
}

TEST_F(PsTlsDataPlaneTest, ARenewedCertificateCountsForTheNextConnection) {
  // The server starts with a certificate for another address, then it is renewed in place.
  const std::string cert = dir_.path() + "/live.pem", key = dir_.path() + "/live.key";
  std::filesystem::copy_file(pki_->Path("elsewhere.pem"), cert);
  std::filesystem::copy_file(pki_->Path("elsewhere.key"), key);
  ps::PsOptions o;
  o.listen_address = "127.0.0.1:0";
  o.data_listen_address = "127.0.0.1:0";
  o.capacity_bytes = int64_t{1} << 30;
  o.threads = 2;
  o.tls.cert_file = cert;
  o.tls.key_file = key;
  o.tls.reload_seconds = 1;
  auto server = ps::PsServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Stub(**server, true, "ps.example");
  ASSERT_TRUE(
      testing::InitShard(*stub, ShardHeader("job-1", 1, 0, kN, kN), init_, int64_t{1} << 20).ok());
  const std::string address = (*server)->data_plane_address();
  {
    ps::DataPlaneClient before(address, "", "", ClientTls("ca"));
    auto s = Step(before);
    ASSERT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("IP address mismatch"));
  }
  for (const char* ext : {".pem", ".key"}) {
    std::filesystem::copy_file(pki_->Path(std::string("server") + ext),
                               dir_.path() + "/next" + ext);
    std::filesystem::rename(dir_.path() + "/next" + ext, dir_.path() + "/live" + ext);
  }
  // Within a reload interval, a new connection gets the renewed certificate.
  absl::StatusOr<std::vector<float>> after = absl::UnknownError("not tried");
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);
       !after.ok() && absl::Now() < deadline;) {
    ps::DataPlaneClient client(address, "", "", ClientTls("ca"));
    after = Step(client);
    if (!after.ok()) absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(after.ok()) << after.status();
  (*server)->Shutdown();
}

TEST(TlsConfigTest, UnusableFilesAreRefusedNamingTheFlag) {
  auto server = ps::TlsConfig::Server("/nonexistent.pem", "/nonexistent.key");
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("--tls-cert: cannot use"));
  auto client = ps::TlsConfig::Client("/nonexistent-ca.pem");
  ASSERT_FALSE(client.ok());
  EXPECT_THAT(std::string(client.status().message()), HasSubstr("--tls-ca: cannot use"));
}

}  // namespace
}  // namespace trainyard
