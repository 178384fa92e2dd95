// TLS end to end, with certificates made by the openssl command for this test: servers refuse a
// non-loopback address without TLS; clients without the CA (or with another) cannot connect;
// with mutual TLS, nodes authenticate by their certificate's common name and a node without one
// is refused; a whole local cluster (coordinator, two workers, a parameter server, their ranks)
// trains over TLS.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/tls.h"
#include "tests/testing/identity.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/test_pki.h"
#include "trainyard/v1/node.grpc.pb.h"

namespace trainyard {
namespace {

using testing::TestPki;

using ::testing::AllOf;
using testing::BinPath;
using testing::CommandResult;
using ::testing::HasSubstr;
using testing::RunCommand;
using testing::Subprocess;
using testing::TempDir;

constexpr absl::Duration kTimeout = absl::Seconds(60);

class TlsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override { pki_ = std::make_unique<TestPki>(dir_.path()); }

  // A coordinator serving TLS (with `extra` flags); its address.
  std::string StartCoordinator(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {BinPath("trainyard-coordinator"),
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--state-dir",
                                     dir_.path() + "/state",
                                     "--tls-cert",
                                     pki_->Path("server.pem"),
                                     "--tls-key",
                                     pki_->Path("server.key")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = Subprocess::Start(argv);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return "";
    coordinator_ = std::move(*p);
    return coordinator_->ReadLine(kTimeout).value_or("");
  }

  CommandResult Yard(const std::vector<std::string>& args,
                     absl::Duration timeout = absl::Seconds(60)) {
    std::vector<std::string> argv = {BinPath("yard")};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv,
                      {"HOME=" + dir_.path(), "XDG_CONFIG_HOME=", "TRAINYARD_TOKEN=",
                       "TRAINYARD_TOKEN_FILE=", "TRAINYARD_TLS_CA="},
                      timeout);
  }

  TempDir dir_;
  std::unique_ptr<TestPki> pki_;
  std::unique_ptr<Subprocess> coordinator_;
};

TEST_F(TlsE2eTest, ServersRefuseANonLoopbackAddressWithoutTlsUnlessInsecure) {
  for (const std::string program : {"trainyard-coordinator", "trainyard-ps"}) {
    std::vector<std::string> argv = {BinPath(program), "--listen", "0.0.0.0:0"};
    if (program == "trainyard-coordinator") {
      argv.insert(argv.end(), {"--state-dir", dir_.path() + "/refused"});
    }
    CommandResult r = RunCommand(argv, {}, kTimeout);
    EXPECT_NE(r.exit_code, 0) << program;
    EXPECT_THAT(r.err, AllOf(HasSubstr("--listen: 0.0.0.0:0 is not a loopback address"),
                             HasSubstr("--insecure")))
        << program;
  }
  // --insecure: it serves (and stops cleanly on SIGTERM).
  auto p = Subprocess::Start({BinPath("trainyard-coordinator"), "--listen", "0.0.0.0:0",
                              "--state-dir", dir_.path() + "/insecure", "--insecure"});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE((*p)->ReadLine(kTimeout).has_value());
  (*p)->Signal(SIGTERM);
  auto status = (*p)->Wait(absl::Seconds(20));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
}

TEST_F(TlsE2eTest, AClientWithoutTheServersCaCannotConnect) {
  const std::string address = StartCoordinator();
  ASSERT_FALSE(address.empty());
  const std::string token = dir_.path() + "/state/admin.token";
  CommandResult ok = Yard({"--coordinator", address, "--tls-ca", pki_->Path("ca.pem"),
                           "--token-file", token, "whoami"});
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("admin (admin"));
  // Each refusal names its cause, as one line.
  CommandResult plain = Yard({"--coordinator", address, "--token-file", token, "whoami"});
  EXPECT_NE(plain.exit_code, 0);
  EXPECT_THAT(plain.err, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(plain.err, HasSubstr("speaks TLS: give its CA with --tls-ca FILE"));
  CommandResult other = Yard({"--coordinator", address, "--tls-ca", pki_->Path("other-ca.pem"),
                              "--token-file", token, "whoami"});
  EXPECT_NE(other.exit_code, 0);
  EXPECT_THAT(other.err, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(other.err, HasSubstr("the server's certificate does not verify: unable to get local "
                                   "issuer certificate (not signed by the CA in"));
  EXPECT_EQ(std::count(other.err.begin(), other.err.end(), '\n'), 1) << other.err;
}

TEST_F(TlsE2eTest, ARenewedCertificateTakesEffectWithoutARestart) {
  // The coordinator starts with a certificate of the other CA, which clients of "ca" refuse.
  pki_->SignBy("other-ca", "live", "127.0.0.1", "subjectAltName=IP:127.0.0.1\n");
  auto p =
      Subprocess::Start({BinPath("trainyard-coordinator"), "--listen", "127.0.0.1:0", "--state-dir",
                         dir_.path() + "/state", "--tls-cert", dir_.path() + "/live.pem",
                         "--tls-key", dir_.path() + "/live.key", "--tls-reload", "1"});
  ASSERT_TRUE(p.ok()) << p.status();
  const std::string address = (*p)->ReadLine(kTimeout).value_or("");
  const TlsClientOptions client{pki_->Path("ca.pem"), "", ""};
  EXPECT_THAT(DiagnoseTls(address, client), HasSubstr("unable to get local issuer certificate"));
  // Renewed in place (a new file renamed over the old, as certificate tools do).
  for (const char* ext : {".pem", ".key"}) {
    std::filesystem::copy_file(pki_->Path(std::string("server") + ext),
                               dir_.path() + "/next" + ext);
    std::filesystem::rename(dir_.path() + "/next" + ext, dir_.path() + "/live" + ext);
  }
  std::string now = "not yet";
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       !now.empty() && absl::Now() < deadline;) {
    now = DiagnoseTls(address, client);
    if (!now.empty()) absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(now, "") << "the renewed certificate never took effect";
  const std::string token = dir_.path() + "/state/admin.token";
  CommandResult who = Yard({"--coordinator", address, "--tls-ca", pki_->Path("ca.pem"),
                            "--token-file", token, "whoami"});
  EXPECT_EQ(who.exit_code, 0) << who.err;
  (*p)->Signal(SIGTERM);
  (*p)->Wait(absl::Seconds(20));
}

TEST_F(TlsE2eTest, ARefusedClientCertificateIsAuditedWithItsCause) {
  const std::string audit = dir_.path() + "/audit.jsonl";
  const std::string address =
      StartCoordinator({"--tls-client-ca", pki_->Path("ca.pem"), "--audit-log", audit});
  ASSERT_FALSE(address.empty());
  // A node certificate of another CA: refused at the handshake.
  pki_->SignBy("other-ca", "w9", "w9", "extendedKeyUsage=clientAuth\n");
  const TlsClientOptions stranger{pki_->Path("ca.pem"), dir_.path() + "/w9.pem",
                                  dir_.path() + "/w9.key"};
  EXPECT_THAT(DiagnoseTls(address, stranger), HasSubstr("it refused this client's certificate"));
  // The coordinator's audit log says who was refused, and why.
  std::string found;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);
       found.empty() && absl::Now() < deadline;) {
    std::ifstream in(audit);
    for (std::string line; std::getline(in, line);) {
      if (line.find("TLS handshake") != std::string::npos) found = line;
    }
    if (found.empty()) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_THAT(found, HasSubstr("\"result\":\"UNAUTHENTICATED\""));
  EXPECT_THAT(found, HasSubstr("client certificate CN=w9: unable to get local issuer certificate"));
  // A node with a certificate of the cluster's CA still gets through.
  pki_->Sign("n1", "n1");
  EXPECT_EQ(
      DiagnoseTls(address, {pki_->Path("ca.pem"), pki_->Path("n1.pem"), pki_->Path("n1.key")}), "");
}

TEST_F(TlsE2eTest, DiagnoseTlsNamesTheCauseOfAFailedHandshake) {
  const std::string address = StartCoordinator({"--tls-client-ca", pki_->Path("ca.pem")});
  ASSERT_FALSE(address.empty());
  const std::string ca = pki_->Path("ca.pem");
  EXPECT_EQ(DiagnoseTls(address, {ca, "", ""}), "");  // verifies; no client certificate asked
  pki_->Sign("n1", "n1");
  EXPECT_EQ(DiagnoseTls(address, {ca, pki_->Path("n1.pem"), pki_->Path("n1.key")}), "");
  EXPECT_THAT(DiagnoseTls(address, {}), HasSubstr("speaks TLS"));
  // A certificate for another address.
  pki_->SignWithSan("elsewhere", "ps.example", "IP:10.0.0.9");
  auto other =
      Subprocess::Start({BinPath("trainyard-coordinator"), "--listen", "127.0.0.1:0", "--state-dir",
                         dir_.path() + "/elsewhere", "--tls-cert", pki_->Path("elsewhere.pem"),
                         "--tls-key", pki_->Path("elsewhere.key")});
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string other_address = (*other)->ReadLine(kTimeout).value_or("");
  EXPECT_THAT(DiagnoseTls(other_address, {ca, "", ""}),
              AllOf(HasSubstr("IP address mismatch"), HasSubstr("(it is not for 127.0.0.1)")));
  // gRPC clients refuse it too (the server's certificate must name what they dial).
  CommandResult who = Yard({"--coordinator", other_address, "--tls-ca", ca, "--token-file",
                            dir_.path() + "/elsewhere/admin.token", "whoami"});
  EXPECT_NE(who.exit_code, 0);
  EXPECT_THAT(who.err, HasSubstr("IP address mismatch"));
  // A client certificate of another CA, which the coordinator refuses.
  pki_->SignBy("other-ca", "stranger", "n1", "extendedKeyUsage=clientAuth\n");
  EXPECT_THAT(
      DiagnoseTls(address, {ca, dir_.path() + "/stranger.pem", dir_.path() + "/stranger.key"}),
      HasSubstr("it refused this client's certificate"));
  // Nothing listening: nothing to say (the caller says it cannot connect).
  EXPECT_EQ(DiagnoseTls("127.0.0.1:1", {ca, "", ""}), "");
  (*other)->Signal(SIGTERM);
  (*other)->Wait(absl::Seconds(20));
}

TEST_F(TlsE2eTest, WithMutualTlsANodeIsItsCertificatesCommonNameAndNoneIsRefused) {
  const std::string address = StartCoordinator({"--tls-client-ca", pki_->Path("ca.pem")});
  ASSERT_FALSE(address.empty());
  pki_->Sign("n1", "n1");
  auto register_as = [&](const std::string& node, const std::string& cert_file,
                         const std::string& token) {
    TlsClientOptions tls{pki_->Path("ca.pem"),
                         cert_file.empty() ? "" : pki_->Path(cert_file + ".pem"),
                         cert_file.empty() ? "" : pki_->Path(cert_file + ".key")};
    auto credentials = MakeChannelCredentials(tls);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    auto stub = v1::NodeService::NewStub(grpc::CreateChannel(address, *credentials));
    grpc::ClientContext ctx;
    testing::Authorize(ctx, token);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kTimeout));
    v1::RegisterNodeRequest r;
    r.set_node_id(node);
    r.set_hostname("localhost");
    r.add_devices()->set_kind(v1::CPU_SLOT);
    v1::RegisterNodeResponse resp;
    return stub->RegisterNode(&ctx, r, &resp);
  };
  // Its certificate alone names n1.
  grpc::Status s = register_as("n1", "n1", "");
  EXPECT_TRUE(s.ok()) << s.error_message();
  // Not another node.
  s = register_as("n2", "n1", "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("certificate is for node n1, not n2"));
  // Without a client certificate, a node token is not enough here.
  auto admin = ReadSecretFile(dir_.path() + "/state/admin.token");
  ASSERT_TRUE(admin.ok());
  auto ca = MakeChannelCredentials({pki_->Path("ca.pem"), "", ""});
  ASSERT_TRUE(ca.ok());
  const std::string n2_token =
      testing::CreateToken(grpc::CreateChannel(address, *ca), *admin, "admin", "n2");
  s = register_as("n2", "", n2_token);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("needs a client certificate"));
  // Users need no certificate: yard works.
  CommandResult who = Yard({"--coordinator", address, "--tls-ca", pki_->Path("ca.pem"),
                            "--token-file", dir_.path() + "/state/admin.token", "whoami"});
  EXPECT_EQ(who.exit_code, 0) << who.err;
}

TEST_F(TlsE2eTest, TheWholeLocalClusterTrainsOverTls) {
  const std::string state = dir_.path() + "/cluster";
  const std::string ca = pki_->Path("ca.pem");
  // Run from the test's folder with relative paths, as an operator types them: every program
  // (and each rank, in a folder of its own) must still find the files.
  const std::string command = absl::StrCat(
      "cd ", dir_.path(), " && exec ", BinPath("yard"),
      " --tls-ca ca.pem local --state-dir cluster up --listen 127.0.0.1:0 --workers 2 --ps 1"
      " --ps-memory-bytes 268435456 --threads-per-slot 1 --tls-cert server.pem"
      " --tls-key server.key -o json");
  CommandResult up = RunCommand({"/bin/sh", "-c", command},
                                {"HOME=" + dir_.path(), "XDG_CONFIG_HOME=", "TRAINYARD_TOKEN=",
                                 "TRAINYARD_TOKEN_FILE=", "TRAINYARD_TLS_CA="},
                                absl::Seconds(120));
  ASSERT_EQ(up.exit_code, 0) << up.err;
  const auto cluster = nlohmann::json::parse(up.out);
  const std::string address = cluster.at("coordinator_address").get<std::string>();
  EXPECT_EQ(cluster.at("tls_ca").get<std::string>(), ca);
  // Stopped even when an assertion below fails.
  std::unique_ptr<void, std::function<void(void*)>> down(this, [&](void*) {
    Yard({"local", "--state-dir", state, "down"});
  });

  const std::string spec = dir_.path() + "/offload.yaml";
  std::ofstream(spec) << "name: over-tls\n"
                         "resources: {gpus: 2}\n"
                         "model: {kind: gpt, n_layer: 2, n_head: 2, d_model: 64, seq_len: 32, "
                         "vocab: 256}\n"
                         "data: {path: /usr/share/common-licenses/GPL-3, format: bytes}\n"
                         "train: {steps: 40, micro_batch: 8, lr: 3.0e-3, warmup: 5, seed: 1}\n"
                         "parallel: {strategy: offload}\n"
                         "checkpoint: {every_steps: 0}\n";
  const std::vector<std::string> to = {"--coordinator", address, "--tls-ca", ca};
  auto yard = [&](std::vector<std::string> args, absl::Duration timeout = absl::Seconds(60)) {
    args.insert(args.begin(), to.begin(), to.end());
    return Yard(args, timeout);
  };
  CommandResult submit = yard({"submit", spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string job(absl::StripAsciiWhitespace(submit.out));
  CommandResult wait = yard({"wait", job}, absl::Seconds(600));
  ASSERT_EQ(wait.exit_code, 0) << wait.err << yard({"describe", job}).out
                               << yard({"logs", job}).out;
  CommandResult metrics = yard({"metrics", job, "-o", "json"});
  ASSERT_EQ(metrics.exit_code, 0) << metrics.err;
  const auto series = nlohmann::json::parse(metrics.out);
  ASSERT_EQ(series.size(), 40u) << yard({"logs", job}).out;  // (the rank says what it did not send)
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += series[i]["loss"].get<double>() / 5;
  for (int i = 35; i < 40; ++i) last += series[i]["loss"].get<double>() / 5;
  EXPECT_LT(last, 0.85 * first) << first << " -> " << last;
  // The gradients and parameters crossed the parameter server's data plane over TLS too.
  int tls_data_planes = 0;
  for (const auto& p : cluster.at("processes")) {
    if (p.at("name").get<std::string>().rfind("parameter server", 0) != 0) continue;
    std::ifstream log(p.at("log").get<std::string>());
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    tls_data_planes += text.find(" (TLS); TCP congestion control") != std::string::npos;
  }
  EXPECT_EQ(tls_data_planes, 1);
  CommandResult logs = yard({"logs", job});
  EXPECT_THAT(logs.out, ::testing::ContainsRegex("parameter-server transfers: .*data plane "
                                                 "[0-9.:]+ over TLS"));
  // The plaintext client is turned away by the same cluster.
  CommandResult plain = Yard({"--coordinator", address, "nodes"});
  EXPECT_NE(plain.exit_code, 0);
}

}  // namespace
}  // namespace trainyard
