// End-to-end tests of the `yard` command line: the real `yard` binary against a real
// trainyard-coordinator on a free loopback port with its state in a temp dir, one coordinator per
// test. Checks what scripts rely on: exit codes, stdout (tables and -o json), and the one-line
// reason on stderr. Also drives `yard local up|status|down`, whose daemon leaves the test's
// process group, so a guard stops it even when an assertion fails.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/version.h"
#include "tests/testing/expect_cli.h"
#include "tests/testing/identity.h"
#include "tests/testing/subprocess.h"

namespace trainyard {
namespace {

using ::testing::AllOf;
using testing::BinPath;
using testing::CommandResult;
using ::testing::ContainsRegex;
using ::testing::ElementsAre;
using testing::ExpectOneLineFailure;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using testing::RunCommand;
using ::testing::SizeIs;
using ::testing::StartsWith;
using testing::Subprocess;
using testing::TempDir;
using json = nlohmann::json;

constexpr absl::Duration kCommandTimeout = absl::Seconds(30);

std::string CharGptSpec() { return absl::StrCat(TRAINYARD_SOURCE_DIR, "/examples/char-gpt.yaml"); }

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// What every failing yard call must look like: non-zero exit, nothing on stdout, and exactly one
// line on stderr.
json ParseJson(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << text;
  return j;
}

// Ids of the jobs in `yard ls -o json` output, in the printed order.
std::vector<std::string> JobIds(const json& list) {
  std::vector<std::string> ids;
  if (!list.is_object() || !list.contains("jobs")) return ids;
  for (const auto& job : list["jobs"]) ids.push_back(job.value("id", ""));
  return ids;
}

bool IsTrainyardProcess(pid_t pid) {
  if (pid <= 0 || kill(pid, 0) != 0) return false;
  std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"));
  std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return cmdline.find("trainyard") != std::string::npos;  // empty for a zombie
}

// Waits up to `timeout` for `pid` to stop being a live trainyard process. The `yard local`
// daemon is not our child (it was reparented), so there is no exit to wait on: poll.
bool WaitUntilGone(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (IsTrainyardProcess(pid)) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// Stops whatever `yard local up` started from `state_dir` when it goes out of scope: first
// `yard local down`, then SIGKILL to every pid still recorded in STATE_DIR/local.json.
class LocalClusterGuard {
 public:
  explicit LocalClusterGuard(std::string state_dir) : state_dir_(std::move(state_dir)) {}
  LocalClusterGuard(const LocalClusterGuard&) = delete;
  LocalClusterGuard& operator=(const LocalClusterGuard&) = delete;

  ~LocalClusterGuard() {
    const std::vector<pid_t> pids = RecordedPids();  // `down` deletes the record
    RunCommand({BinPath("yard"), "local", "--state-dir", state_dir_, "down"}, {}, kCommandTimeout);
    for (pid_t pid : pids) {
      if (!WaitUntilGone(pid, absl::Seconds(5))) kill(pid, SIGKILL);
    }
  }

 private:
  std::vector<pid_t> RecordedPids() const {
    std::ifstream in(state_dir_ + "/local.json");
    std::stringstream text;
    text << in.rdbuf();
    std::vector<pid_t> pids;
    json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("processes")) return pids;
    for (const auto& p : j["processes"]) {
      if (p.contains("pid") && p["pid"].is_number_integer()) pids.push_back(p["pid"].get<pid_t>());
    }
    return pids;
  }

  std::string state_dir_;
};

// The HOME of every yard this test process runs (where `yard local up` saves the local admin's
// token and yard looks for one): never the real one.
const std::string& YardHome() {
  static TempDir* home = new TempDir();
  return home->path();
}

// `yard` with no coordinator: for the calls that do not need one.
CommandResult YardAlone(const std::vector<std::string>& args,
                        const std::vector<std::string>& extra_env = {}) {
  std::vector<std::string> argv = {BinPath("yard")};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::string> env = {"HOME=" + YardHome(),
                                  "XDG_CONFIG_HOME=", "TRAINYARD_TOKEN=", "TRAINYARD_TOKEN_FILE="};
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  return RunCommand(argv, env, kCommandTimeout);
}

class YardE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto p = Subprocess::Start({BinPath("trainyard-coordinator"), "--listen", "127.0.0.1:0",
                                "--state-dir", dir_.path() + "/state"});
    ASSERT_TRUE(p.ok()) << p.status();
    coordinator_ = std::move(*p);
    auto line = coordinator_->ReadLine(absl::Seconds(30));
    ASSERT_TRUE(line.has_value()) << "the coordinator printed no address";
    address_ = *line;
    ASSERT_THAT(address_, StartsWith("127.0.0.1:"));
  }

  // A file (mode 0600) holding a token of `user`, created with the admin's token on first use.
  std::string TokenFile(const std::string& user) {
    const std::string path = dir_.path() + "/" + user + ".token";
    if (!std::filesystem::exists(path)) {
      const auto channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
      EXPECT_TRUE(WriteSecretFile(path, testing::CreateToken(channel, AdminToken(), user)).ok());
    }
    return path;
  }
  std::string AdminToken() const { return testing::AdminToken(dir_.path() + "/state"); }

  // `yard --coordinator ADDRESS --token-file USER.token ARGS...`.
  CommandResult YardAs(const std::string& user, const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"--coordinator", address_, "--token-file", TokenFile(user)};
    argv.insert(argv.end(), args.begin(), args.end());
    return YardAlone(argv);
  }
  CommandResult Yard(const std::vector<std::string>& args) { return YardAs("alice", args); }

  // `yard ARGS...` with TRAINYARD_COORDINATOR=ADDRESS and alice's TRAINYARD_TOKEN_FILE.
  CommandResult YardViaEnv(const std::vector<std::string>& args) {
    return YardAlone(
        args, {"TRAINYARD_COORDINATOR=" + address_, "TRAINYARD_TOKEN_FILE=" + TokenFile("alice")});
  }

  // Submits examples/char-gpt.yaml as `user`; its job id.
  std::string SubmitCharGpt(const std::string& user = "alice") {
    CommandResult r = YardAs(user, {"submit", CharGptSpec()});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.out.empty() ? "" : r.out.substr(0, r.out.find('\n'));
  }

  std::vector<std::string> ListedIds(const std::vector<std::string>& ls_args = {},
                                     const std::string& user = "alice") {
    std::vector<std::string> args = {"ls", "-o", "json"};
    args.insert(args.end(), ls_args.begin(), ls_args.end());
    CommandResult r = YardAs(user, args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return JobIds(ParseJson(r.out));
  }

  std::string WriteSpec(const std::string& name, const std::string& text) {
    const std::string path = dir_.path() + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  TempDir dir_;
  std::unique_ptr<Subprocess> coordinator_;
  std::string address_;
};

// A complete valid spec in block style, one field per line, so errors have known lines; `model`
// fields start on line 5.
std::string BlockSpec(const std::string& model_fields) {
  return absl::StrCat(
      "name: e2e\n"   // 1
      "resources:\n"  // 2
      "  gpus: 1\n"   // 3
      "model:\n",     // 4
      model_fields,   // 5...
      "data:\n"       //
      "  path: /usr/share/common-licenses/GPL-3\n"
      "train:\n"
      "  steps: 10\n");
}

TEST(YardCliTest, VersionPrintsNameAndVersion) {
  CommandResult r = YardAlone({"--version"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, absl::StrCat("yard ", kVersion, "\n"));
}

TEST(YardCliTest, HelpListsEveryVerb) {
  CommandResult r = YardAlone({"--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* verb : {"submit", "ls", "describe", "cancel", "wait", "nodes", "local"}) {
    EXPECT_THAT(r.out, ContainsRegex(absl::StrCat("\n  ", verb, " "))) << verb;
  }
  EXPECT_THAT(r.out, HasSubstr("--coordinator"));
}

TEST(YardCliTest, NoVerbFails) {
  CommandResult r = YardAlone({});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("subcommand"));
}

TEST(YardCliTest, UnreachableCoordinatorFailsWithOneLineReason) {
  CommandResult r =
      YardAlone({"--coordinator", "127.0.0.1:1", "ls"}, {"TRAINYARD_TOKEN=tyt.any.token"});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, AllOf(StartsWith("yard: "), HasSubstr("cannot reach the coordinator"),
                           HasSubstr("127.0.0.1:1")));
}

TEST_F(YardE2eTest, SubmitPrintsSequentialJobIdsWithFlagOrEnvironment) {
  CommandResult first = Yard({"submit", CharGptSpec()});
  EXPECT_EQ(first.exit_code, 0) << first.err;
  EXPECT_EQ(first.out, "job-1\n");
  CommandResult second = YardViaEnv({"submit", CharGptSpec()});
  EXPECT_EQ(second.exit_code, 0) << second.err;
  EXPECT_EQ(second.out, "job-2\n");
  EXPECT_THAT(ListedIds(), ElementsAre("job-2", "job-1"));
}

TEST_F(YardE2eTest, CoordinatorFlagOverridesEnvironment) {
  CommandResult r =
      YardAlone({"--coordinator", address_, "--token-file", TokenFile("alice"), "nodes"},
                {"TRAINYARD_COORDINATOR=127.0.0.1:1"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, StartsWith("NODE"));
}

TEST_F(YardE2eTest, SubmitWithJsonOutputPrintsTheQueuedJob) {
  CommandResult r = Yard({"submit", CharGptSpec(), "-o", "json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json job = ParseJson(r.out);
  EXPECT_EQ(job.value("id", ""), "job-1");
  EXPECT_EQ(job.value("state", ""), "QUEUED");
  EXPECT_EQ(job.value("owner", ""), "alice");
  EXPECT_EQ(job["spec"].value("name", ""), "char-gpt");
  EXPECT_EQ(job["spec"]["model"].value("n_head", 0), 4);
}

TEST_F(YardE2eTest, MalformedYamlNamesFileAndLineAndStoresNothing) {
  const std::string path = WriteSpec("malformed.yaml",
                                     "name: broken\n"
                                     "priority: 50\n"
                                     "resources: {gpus: 2\n"
                                     "model: {kind: gpt, n_layer: 2}\n");
  CommandResult r = Yard({"submit", path});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, StartsWith(absl::StrCat("yard: ", path, ":3: malformed YAML")));
  EXPECT_THAT(ListedIds(), IsEmpty());
}

TEST_F(YardE2eTest, HeadsNotDividingModelWidthNamesFieldAndLineAndStoresNothing) {
  const std::string path = WriteSpec("heads.yaml", BlockSpec("  n_layer: 2\n"   // 5
                                                             "  n_head: 3\n"    // 6
                                                             "  d_model: 64\n"  // 7
                                                             "  seq_len: 16\n"));
  CommandResult r = Yard({"submit", path});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, StartsWith(absl::StrCat("yard: ", path, ":6: model.n_head: must divide")));
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(ListedIds(), IsEmpty());
}

TEST_F(YardE2eTest, ZeroGpusNamesResourcesGpusAndStoresNothing) {
  const std::string path =
      WriteSpec("gpus.yaml",
                "name: e2e\nresources:\n  gpus: 0\nmodel: {n_layer: 2, n_head: 2, d_model: 64, "
                "seq_len: 16}\ndata: {path: /usr/share/common-licenses/GPL-3}\n"
                "train: {steps: 10}\n");
  CommandResult r = Yard({"submit", path});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, StartsWith(absl::StrCat("yard: ", path, ":3: resources.gpus")));
  EXPECT_THAT(ListedIds(), IsEmpty());
}

// The layout and precision rules are the one validator's, which yard calls before sending: fp16
// with FSDP is refused by `yard submit` naming the field, not by a rank after placement.
TEST_F(YardE2eTest, Fp16WithFsdpIsRefusedAtSubmitNamingTheFieldAndStoresNothing) {
  const std::string path =
      WriteSpec("fp16.yaml",
                "name: e2e\nresources: {gpus: 2}\nmodel: {n_layer: 2, n_head: 2, d_model: 64, "
                "seq_len: 16}\ndata: {path: /usr/share/common-licenses/GPL-3}\n"
                "train: {steps: 10, mixed_precision: fp16}\nparallel: {strategy: fsdp}\n");
  CommandResult r = Yard({"submit", path});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, HasSubstr("train.mixed_precision: fp16 (dynamic loss scaling) runs with "
                               "strategy ddp"));
  EXPECT_THAT(ListedIds(), IsEmpty());
}

TEST_F(YardE2eTest, UnknownFieldNamesItAndItsLineAndStoresNothing) {
  const std::string path = WriteSpec("unknown.yaml", BlockSpec("  n_layer: 2\n"   // 5
                                                               "  n_heads: 2\n"   // 6
                                                               "  d_model: 64\n"  // 7
                                                               "  seq_len: 16\n"));
  CommandResult r = Yard({"submit", path});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, StartsWith(absl::StrCat("yard: ", path, ":6: unknown field 'model.n_heads'")));
  EXPECT_THAT(ListedIds(), IsEmpty());
}

// A bearer token never goes in clear to another host: without --tls-ca yard refuses before any
// call (the documentation addresses below are never dialled) and names both ways out. With
// --insecure it sends it: here to an address yard cannot tell is this host's (an IPv4-mapped
// IPv6 loopback, which reaches the coordinator's 127.0.0.1 listener), so nothing leaves it.
TEST_F(YardE2eTest, RefusesToSendItsTokenInClearToAnotherHostUnlessInsecure) {
  for (const std::string remote : {"192.0.2.1:7070", "coordinator.example:7070"}) {
    CommandResult r =
        YardAlone({"--coordinator", remote, "--token-file", TokenFile("alice"), "ls"});
    ExpectOneLineFailure(r);
    EXPECT_THAT(r.err, AllOf(HasSubstr("refusing to send your API token in clear to " + remote),
                             HasSubstr("--tls-ca"), HasSubstr("--insecure")));
  }
  const std::string port = address_.substr(address_.rfind(':') + 1);
  const std::string mapped = "[::ffff:127.0.0.1]:" + port;
  CommandResult refused =
      YardAlone({"--coordinator", mapped, "--token-file", TokenFile("alice"), "ls"});
  ExpectOneLineFailure(refused);
  EXPECT_THAT(refused.err, HasSubstr("refusing to send your API token in clear"));
  const std::string id = SubmitCharGpt();
  CommandResult insecure =
      YardAlone({"--insecure", "--coordinator", mapped, "--token-file", TokenFile("alice"), "ls"});
  EXPECT_EQ(insecure.exit_code, 0) << insecure.err;
  EXPECT_THAT(insecure.out, HasSubstr(id));
  CommandResult via_env =
      YardAlone({"--coordinator", mapped, "--token-file", TokenFile("alice"), "ls"},
                {"TRAINYARD_INSECURE=1"});
  EXPECT_EQ(via_env.exit_code, 0) << via_env.err;
}

TEST_F(YardE2eTest, MissingSpecFileNamesThePathAndStoresNothing) {
  const std::string path = dir_.path() + "/no-such-spec.yaml";
  CommandResult r = Yard({"submit", path});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, AllOf(HasSubstr(path), HasSubstr("NOT_FOUND")));
  EXPECT_THAT(ListedIds(), IsEmpty());
}

TEST_F(YardE2eTest, ValidBlockSpecIsAccepted) {
  // The block-style base of the rejection tests above is itself valid.
  const std::string path = WriteSpec("ok.yaml", BlockSpec("  n_layer: 2\n"
                                                          "  n_head: 2\n"
                                                          "  d_model: 64\n"
                                                          "  seq_len: 16\n"));
  CommandResult r = Yard({"submit", path});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "job-1\n");
}

TEST_F(YardE2eTest, LsPrintsHeaderAndOneRowPerJobNewestFirst) {
  for (int i = 0; i < 3; ++i) SubmitCharGpt();
  CommandResult r = Yard({"ls"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;
  EXPECT_THAT(lines[0], ContainsRegex("^ID +NAME +OWNER +STATE "));
  EXPECT_THAT(lines[1], ContainsRegex("^job-3 +char-gpt +alice +QUEUED "));
  EXPECT_THAT(lines[2], StartsWith("job-2 "));
  EXPECT_THAT(lines[3], StartsWith("job-1 "));
}

TEST_F(YardE2eTest, LsJsonListsEveryJobNewestFirst) {
  EXPECT_THAT(ListedIds(), IsEmpty());
  SubmitCharGpt();
  SubmitCharGpt();
  CommandResult r = YardViaEnv({"ls", "-o", "json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json list = ParseJson(r.out);
  EXPECT_THAT(JobIds(list), ElementsAre("job-2", "job-1"));
  ASSERT_TRUE(list["jobs"].is_array());
  EXPECT_EQ(list["jobs"][0].value("state", ""), "QUEUED");
  EXPECT_EQ(list["jobs"][0]["spec"].value("name", ""), "char-gpt");
}

TEST_F(YardE2eTest, LsFiltersByStateCaseInsensitively) {
  SubmitCharGpt();
  SubmitCharGpt();
  ASSERT_EQ(Yard({"cancel", "job-1"}).exit_code, 0);
  EXPECT_THAT(ListedIds({"--state", "QUEUED"}), ElementsAre("job-2"));
  EXPECT_THAT(ListedIds({"--state", "cancelled"}), ElementsAre("job-1"));
  EXPECT_THAT(ListedIds({"--state", "queued", "--state", "CANCELLED"}),
              ElementsAre("job-2", "job-1"));
  EXPECT_THAT(ListedIds({"--state", "RUNNING"}), IsEmpty());
}

TEST_F(YardE2eTest, LsFiltersByOwner) {
  SubmitCharGpt("alice");
  SubmitCharGpt("bob");
  SubmitCharGpt("alice");
  // An admin lists any owner's jobs.
  EXPECT_THAT(ListedIds({"--owner", "bob"}, "admin"), ElementsAre("job-2"));
  EXPECT_THAT(ListedIds({"--owner", "alice"}, "admin"), ElementsAre("job-3", "job-1"));
  EXPECT_THAT(ListedIds({"--owner", "carol"}, "admin"), IsEmpty());
  CommandResult table = YardAs("admin", {"ls", "--owner", "bob"});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  ASSERT_EQ(Lines(table.out).size(), 2u) << table.out;
  EXPECT_THAT(Lines(table.out)[1], ContainsRegex("^job-2 +char-gpt +bob +QUEUED "));
}

TEST_F(YardE2eTest, LsLimitReturnsTheNewestJobs) {
  for (int i = 0; i < 3; ++i) SubmitCharGpt();
  EXPECT_THAT(ListedIds({"--limit", "1"}), ElementsAre("job-3"));
  EXPECT_THAT(ListedIds({"--limit", "2"}), ElementsAre("job-3", "job-2"));
}

TEST_F(YardE2eTest, LsRejectsUnknownState) {
  CommandResult r = Yard({"ls", "--state", "bogus"});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, AllOf(HasSubstr("--state"), HasSubstr("bogus")));
}

TEST_F(YardE2eTest, DescribeAcceptsNumericAndPrefixedIds) {
  ASSERT_EQ(SubmitCharGpt(), "job-1");
  for (const char* id : {"1", "job-1"}) {
    CommandResult r = Yard({"describe", id});
    ASSERT_EQ(r.exit_code, 0) << id << ": " << r.err;
    EXPECT_THAT(r.out, ContainsRegex("(^|\n)id: +job-1\n")) << id;
    EXPECT_THAT(r.out, ContainsRegex("\nstate: +QUEUED\n")) << id;
    EXPECT_THAT(r.out, ContainsRegex("\nowner: +alice\n")) << id;
    EXPECT_THAT(r.out, ContainsRegex("\nmodel: +gpt n_layer=4 n_head=4 d_model=256 seq_len=128 "
                                     "vocab=256 \\(3\\.3M params\\)\n"))
        << id;
  }
}

// The model's line names the shape's optional fields where the spec sets them: the tied head and
// the GELU (model.activation).
TEST_F(YardE2eTest, DescribeNamesTheModelsTiedHeadAndActivation) {
  std::ifstream in(CharGptSpec());
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string shape = "vocab: 256}";
  ASSERT_NE(text.find(shape), std::string::npos);
  text.replace(text.find(shape), shape.size(),
               "vocab: 256, tie_weights: true, activation: gelu_tanh}");
  CommandResult submit = Yard({"submit", WriteSpec("tied.yaml", text)});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  CommandResult r = Yard({"describe", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, ContainsRegex("\nmodel: +gpt n_layer=4 n_head=4 d_model=256 seq_len=128 "
                                   "vocab=256 tied activation=gelu_tanh \\([0-9.]+M params\\)\n"));
}

// spec.description, the first field added after the spec became one schema (issue 53): its
// protobuf field, the line of `yard describe` that shows it and docs/job-spec.md; no parser,
// default or check of its own. A job's text reaches the terminal with its controls escaped.
TEST_F(YardE2eTest, DescribeShowsTheDescriptionWithItsControlsEscaped) {
  std::ifstream in(CharGptSpec());
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  text.replace(text.find("\npriority:"), 0,
               "\ndescription: \"char model \\e]0;owned\\a for the GPL\"");
  CommandResult submit = Yard({"submit", WriteSpec("described.yaml", text)});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  CommandResult r = Yard({"describe", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, ContainsRegex("\ndescription: +char model "));
  EXPECT_THAT(r.out, HasSubstr(" char model \\x1b]0;owned\\x07 for the GPL\n"));
  EXPECT_EQ(ParseJson(Yard({"-o", "json", "describe", "1"}).out)["spec"].value("description", ""),
            "char model \x1b]0;owned\x07 for the GPL");
}

// The spec's paths (model.from, data.path, data.eval_path) are its owner's text too: escaped on the
// terminal, kept as written in the JSON; and a coordinator's or a check's error that quotes one
// is escaped as well.
TEST_F(YardE2eTest, DescribeAndErrorsEscapeTheSpecsPaths) {
  std::ifstream in(CharGptSpec());
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t model = text.find("\nmodel:"), train = text.find("\ntrain:");
  ASSERT_NE(model, std::string::npos);
  ASSERT_NE(train, std::string::npos);
  auto with_model = [&](const std::string& from) {
    return text.substr(0, model) + "\nmodel: {kind: llama, from: \"" + from +
           "\", n_layer: 2, n_head: 4, d_model: 64, seq_len: 32, vocab: 256}\n" +
           "data: {path: \"/data/\\e[2Jtokens\", format: bytes, eval_path: "
           "\"/data/\\e]52;c;eA==\\a\"}" +
           text.substr(train);
  };
  CommandResult submit =
      Yard({"submit", WriteSpec("hostile.yaml", with_model("/m/\\e]0;owned\\a/tiny"))});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  CommandResult r = Yard({"describe", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\nmodel: "));
  EXPECT_THAT(r.out, HasSubstr(" llama from=/m/\\x1b]0;owned\\x07/tiny n_layer=2 "));
  EXPECT_THAT(r.out,
              HasSubstr(" /data/\\x1b[2Jtokens (bytes); held out: /data/\\x1b]52;c;eA==\\x07\n"));
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\x07'), std::string::npos) << r.out;
  const json spec = ParseJson(Yard({"-o", "json", "describe", "1"}).out)["spec"];
  EXPECT_EQ(spec["model"].value("from", ""), "/m/\x1b]0;owned\x07/tiny");
  EXPECT_EQ(spec["data"].value("path", ""), "/data/\x1b[2Jtokens");
  // A relative from is refused by a message that quotes it.
  CommandResult refused =
      Yard({"submit", WriteSpec("relative.yaml", with_model("m\\e]0;owned\\a"))});
  ExpectOneLineFailure(refused);
  EXPECT_THAT(refused.err, AllOf(HasSubstr("model.from"), HasSubstr("got 'm\\x1b]0;owned\\x07'")));
  EXPECT_EQ(refused.err.find('\x1b'), std::string::npos) << refused.err;
}

TEST_F(YardE2eTest, DescribeJsonIncludesTheSpec) {
  SubmitCharGpt();
  CommandResult r = YardViaEnv({"-o", "json", "describe", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json job = ParseJson(r.out);
  EXPECT_EQ(job.value("id", ""), "job-1");
  EXPECT_EQ(job.value("state", ""), "QUEUED");
  const json& spec = job["spec"];
  EXPECT_EQ(spec.value("name", ""), "char-gpt");
  EXPECT_EQ(spec.value("priority", 0), 50);
  EXPECT_EQ(spec["resources"].value("slots", 0), 2);
  EXPECT_EQ(spec["model"].value("d_model", 0), 256);
  EXPECT_EQ(spec["data"].value("path", ""), "/usr/share/common-licenses/GPL-3");
}

// Flags before the spec file, as sbatch users write them: a list option takes one value a flag
// (CLI11 let --env and --after take the spec's path too). `--env NAME` takes yard's own value.
TEST_F(YardE2eTest, SubmitTakesFlagsBeforeTheSpecAndEnvNamesFromYardsEnvironment) {
  SubmitCharGpt();
  const std::string spec =
      WriteSpec("cmd.yaml", "name: cmd\nresources: {slots: 1}\ncommand: [/bin/true]\n");
  const std::vector<std::string> as_alice = {"--coordinator", address_, "--token-file",
                                             TokenFile("alice"), "submit"};
  auto submit = [&](const std::vector<std::string>& args) {
    std::vector<std::string> argv = as_alice;
    argv.insert(argv.end(), args.begin(), args.end());
    return YardAlone(argv, {"HF_TOKEN=hf_s3cret"});
  };
  CommandResult r =
      submit({"--name", "x", "--env", "A=1", "--env", "HF_TOKEN", "--after", "1", spec});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "job-2\n");
  r = submit({"--env", "B=2", spec});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "job-3\n");
  r = Yard({"-o", "json", "describe", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json stored = ParseJson(r.out)["spec"];
  EXPECT_EQ(stored["env"].value("A", ""), "1");
  EXPECT_EQ(stored["env"].value("HF_TOKEN", ""), "hf_s3cret");
  EXPECT_EQ(stored["after"], json::array({"job-1"}));
  EXPECT_EQ(stored.value("name", ""), "x");
  r = Yard({"-o", "json", "describe", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(ParseJson(r.out)["spec"]["env"].value("B", ""), "2");

  // A name yard's environment does not have: refused, naming it; nothing stored.
  r = submit({"--env", "WANDB_API_KEY", spec});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, HasSubstr("--env WANDB_API_KEY: WANDB_API_KEY is not set in yard's"));
  r = submit({"--env", "=1", spec});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, HasSubstr("--env: expected NAME=VALUE or NAME, got '=1'"));
  EXPECT_THAT(ListedIds(), ElementsAre("job-3", "job-2", "job-1"));
}

TEST_F(YardE2eTest, DescribeUnknownJobFailsWithNotFound) {
  SubmitCharGpt();
  CommandResult r = Yard({"describe", "42"});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, AllOf(StartsWith("yard: "), HasSubstr("job-42"), HasSubstr("NOT_FOUND")));
}

TEST_F(YardE2eTest, AnotherUsersJobIsPrivateButAdminsSeeIt) {
  const std::string job = SubmitCharGpt("alice");
  for (const std::vector<std::string>& verb :
       std::vector<std::vector<std::string>>{{"describe", job},
                                             {"cancel", job},
                                             {"logs", job},
                                             {"metrics", job},
                                             {"checkpoint", job},
                                             {"wait", job, "--timeout", "1s"}}) {
    CommandResult r = YardAs("bob", verb);
    ExpectOneLineFailure(r);
    // Answered exactly as a job that does not exist.
    EXPECT_EQ(r.err, absl::StrCat("yard: job ", job, " not found (NOT_FOUND)\n")) << verb[0];
  }
  EXPECT_THAT(ListedIds({}, "bob"), IsEmpty());
  CommandResult others = YardAs("bob", {"ls", "--owner", "alice"});
  ExpectOneLineFailure(others);
  EXPECT_THAT(others.err, HasSubstr("PERMISSION_DENIED"));
  // Nothing changed; the owner and an admin see it.
  CommandResult mine = Yard({"describe", job, "-o", "json"});
  ASSERT_EQ(mine.exit_code, 0) << mine.err;
  EXPECT_EQ(ParseJson(mine.out).value("state", ""), "QUEUED");
  EXPECT_EQ(YardAs("admin", {"describe", job}).exit_code, 0);
  EXPECT_THAT(ListedIds({}, "admin"), ElementsAre(job));
}

TEST_F(YardE2eTest, AdminsDenyAndAllowNodes) {
  CommandResult denied =
      YardAs("admin", {"admin", "node", "deny", "gpu-7", "--reason", "stolen cert"});
  ASSERT_EQ(denied.exit_code, 0) << denied.err;
  EXPECT_EQ(denied.out, "denied gpu-7\n");
  CommandResult listed = YardAs("admin", {"admin", "node", "ls"});
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_THAT(listed.out, ContainsRegex("\ngpu-7 +admin +.* stolen cert\n"));
  CommandResult as_json = YardAs("admin", {"admin", "node", "ls", "-o", "json"});
  ASSERT_EQ(as_json.exit_code, 0) << as_json.err;
  EXPECT_EQ(nlohmann::json::parse(as_json.out)["nodes"][0]["node"], "gpu-7");
  CommandResult not_admin = Yard({"admin", "node", "deny", "gpu-8"});
  ExpectOneLineFailure(not_admin);
  EXPECT_THAT(not_admin.err, HasSubstr("PERMISSION_DENIED"));
  ASSERT_EQ(YardAs("admin", {"admin", "node", "allow", "gpu-7"}).exit_code, 0);
  EXPECT_THAT(Lines(YardAs("admin", {"admin", "node", "ls"}).out), SizeIs(1));  // the header
}

TEST_F(YardE2eTest, AdminsManageUsersAndTokensAndRevokedOrDisabledTokensStopWorking) {
  CommandResult add = YardAs("admin", {"admin", "user", "add", "carol"});
  ASSERT_EQ(add.exit_code, 0) << add.err;
  EXPECT_THAT(Lines(add.out).back(), ContainsRegex("^carol +user +enabled "));
  CommandResult not_admin = Yard({"admin", "user", "add", "mallory"});
  ExpectOneLineFailure(not_admin);
  EXPECT_THAT(not_admin.err, AllOf(HasSubstr("for admins"), HasSubstr("PERMISSION_DENIED")));
  CommandResult bad_name = YardAs("admin", {"admin", "user", "add", "Carol!"});
  ExpectOneLineFailure(bad_name);
  EXPECT_THAT(bad_name.err, AllOf(StartsWith("yard: name:"), HasSubstr("INVALID_ARGUMENT")));

  const std::string carol = dir_.path() + "/carol.token";
  CommandResult created =
      YardAs("admin", {"admin", "token", "create", "--user", "carol", "--out", carol});
  ASSERT_EQ(created.exit_code, 0) << created.err;
  const std::string id(absl::StripAsciiWhitespace(created.out));
  auto secret = ReadSecretFile(carol);  // refuses a file others can read: it was written 0600
  ASSERT_TRUE(secret.ok()) << secret.status();
  auto as_carol = [&](const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"--coordinator", address_, "--token-file", carol};
    argv.insert(argv.end(), args.begin(), args.end());
    return YardAlone(argv);
  };
  CommandResult who = as_carol({"whoami"});
  ASSERT_EQ(who.exit_code, 0) << who.err;
  EXPECT_EQ(who.out, absl::StrCat("carol (user, token ", id, ")\n"));
  CommandResult listed = as_carol({"admin", "token", "ls"});
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_THAT(listed.out, ContainsRegex(absl::StrCat("\n", id, " +carol +- +valid ")));
  EXPECT_THAT(listed.out, Not(HasSubstr(secret->substr(secret->rfind('.') + 1))));

  // Disabled, then enabled again; revoked for good.
  ASSERT_EQ(YardAs("admin", {"admin", "user", "disable", "carol"}).exit_code, 0);
  CommandResult disabled = as_carol({"ls"});
  ExpectOneLineFailure(disabled);
  EXPECT_THAT(disabled.err, AllOf(HasSubstr("carol is disabled"), HasSubstr("UNAUTHENTICATED")));
  ASSERT_EQ(YardAs("admin", {"admin", "user", "disable", "carol", "--enable"}).exit_code, 0);
  EXPECT_EQ(as_carol({"ls"}).exit_code, 0);
  CommandResult revoke = as_carol({"admin", "token", "revoke", id});  // her own
  ASSERT_EQ(revoke.exit_code, 0) << revoke.err;
  CommandResult revoked = as_carol({"ls"});
  ExpectOneLineFailure(revoked);
  EXPECT_THAT(revoked.err, AllOf(HasSubstr("was revoked"), HasSubstr("UNAUTHENTICATED")));
}

TEST_F(YardE2eTest, AdminsSetAccountsAndCapsAndUsersSeeTheirQuotaAndWhyTheyWait) {
  CommandResult add = YardAs("admin", {"admin", "account", "add", "research", "--quota", "4",
                                       "--borrow-limit", "2", "--share", "3"});
  ASSERT_EQ(add.exit_code, 0) << add.err;
  EXPECT_THAT(Lines(add.out).back(), ContainsRegex("^research +4 +2 +3 "));
  CommandResult bad = YardAs("admin", {"admin", "account", "add", "x", "--quota", "lots"});
  ExpectOneLineFailure(bad);
  EXPECT_THAT(bad.err, HasSubstr("--quota: expected a count >= 0 or 'none', got 'lots'"));
  CommandResult not_admin = Yard({"admin", "account", "add", "mine", "--quota", "100"});
  ExpectOneLineFailure(not_admin);
  EXPECT_THAT(not_admin.err, HasSubstr("PERMISSION_DENIED"));
  CommandResult unset = YardAs("admin", {"admin", "account", "set", "research", "--quota", "none"});
  ASSERT_EQ(unset.exit_code, 0) << unset.err;
  EXPECT_THAT(Lines(unset.out).back(), ContainsRegex("^research +- +- +3 "));
  ASSERT_EQ(YardAs("admin", {"admin", "account", "set", "research", "--quota", "4"}).exit_code, 0);
  CommandResult listed = Yard({"admin", "account", "ls"});  // any user may list
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_THAT(listed.out, ContainsRegex("\ndefault +- +- +1 +- *\n"));
  EXPECT_THAT(listed.out, ContainsRegex("\nresearch +4 +any +3 "));

  CommandResult moved = YardAs(
      "admin", {"admin", "user", "set", "alice", "--account", "research", "--max-queued", "1"});
  ASSERT_EQ(moved.exit_code, 0) << moved.err;
  EXPECT_THAT(Lines(moved.out).back(), ContainsRegex("^alice +user +enabled +research +- +1 "));
  const std::string job = SubmitCharGpt();
  CommandResult second = Yard({"submit", CharGptSpec()});
  ExpectOneLineFailure(second);
  EXPECT_THAT(second.err, AllOf(HasSubstr("max_queued_jobs: user alice has 1 jobs queued"),
                                HasSubstr("RESOURCE_EXHAUSTED")));

  CommandResult quota = Yard({"quota"});
  ASSERT_EQ(quota.exit_code, 0) << quota.err;
  EXPECT_THAT(quota.out, ContainsRegex("account: +research"));
  EXPECT_THAT(quota.out, ContainsRegex("queued jobs: +1 \\(1\\)"));
  // 100%: research is the only account that wants devices (default has no jobs).
  EXPECT_THAT(quota.out, ContainsRegex("\nresearch +4 +any +0 +2 \\(1 jobs\\) +3 \\(100%\\) "));
  const auto report = nlohmann::json::parse(Yard({"-o", "json", "quota"}).out);
  EXPECT_EQ(report.value("account", ""), "research");
  EXPECT_EQ(report["accounts"][0].value("quota_devices", ""), "4");  // int64: a JSON string
  CommandResult others = Yard({"quota", "--user", "admin"});
  ExpectOneLineFailure(others);
  EXPECT_THAT(others.err, HasSubstr("PERMISSION_DENIED"));
  CommandResult all = YardAs("admin", {"quota", "--all"});
  ASSERT_EQ(all.exit_code, 0) << all.err;
  EXPECT_THAT(all.out, ContainsRegex("\ndefault "));

  // No worker: the job waits, and says why once a scheduling pass has seen it.
  std::string waiting;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    waiting =
        nlohmann::json::parse(Yard({"describe", job, "-o", "json"}).out).value("why_waiting", "");
    if (absl::StrContains(waiting, "devices")) break;
    absl::SleepFor(absl::Milliseconds(100));  // the scheduler passes once a second
  }
  EXPECT_THAT(waiting, HasSubstr("more than the ready nodes that take its owner's jobs have"));
  EXPECT_THAT(Yard({"describe", job}).out, ContainsRegex("waiting: +needs 2 devices"));

  CommandResult rm = YardAs("admin", {"admin", "account", "rm", "research"});
  ExpectOneLineFailure(rm);
  EXPECT_THAT(rm.err, AllOf(HasSubstr(absl::StrCat("job ", job,
                                                   " of account research has not "
                                                   "ended")),
                            HasSubstr("FAILED_PRECONDITION")));
}

TEST_F(YardE2eTest, LoginSavesOnlyAVerifiedUserTokenAndTokenFilesOthersCanReadAreRefused) {
  const std::string saved = dir_.path() + "/saved/token";
  auto login = [&](const std::string& input) {
    const std::string in = dir_.path() + "/login-input";
    std::ofstream(in) << input << "\n";
    return testing::RunCommand(
        {"/bin/sh", "-c",
         absl::StrCat("exec \"$0\" --coordinator ", address_, " login --save-to \"$1\" < \"$2\""),
         BinPath("yard"), saved, in},
        {"HOME=" + YardHome()}, kCommandTimeout);
  };
  CommandResult garbage = login("tyt.0123456789abcdef.not-the-secret");
  ExpectOneLineFailure(garbage);
  EXPECT_THAT(garbage.err, HasSubstr("UNAUTHENTICATED"));
  EXPECT_FALSE(std::filesystem::exists(saved));

  auto alice = ReadSecretFile(TokenFile("alice"));
  ASSERT_TRUE(alice.ok());
  CommandResult ok = login(*alice);
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("as alice (user)"));
  EXPECT_EQ(*ReadSecretFile(saved), *alice);
  EXPECT_EQ(YardAlone({"--coordinator", address_, "--token-file", saved, "ls"}).exit_code, 0);

  ASSERT_EQ(chmod(saved.c_str(), 0644), 0);
  CommandResult open_file = YardAlone({"--coordinator", address_, "--token-file", saved, "ls"});
  ExpectOneLineFailure(open_file);
  EXPECT_THAT(open_file.err, AllOf(HasSubstr("chmod 600"), HasSubstr("PERMISSION_DENIED")));
  // Without any token, the reason says where yard looked.
  CommandResult none = YardAlone({"--coordinator", address_, "ls"},
                                 {"XDG_CONFIG_HOME=" + dir_.path() + "/nothing-saved"});
  ExpectOneLineFailure(none);
  EXPECT_THAT(none.err, AllOf(HasSubstr("no token"), HasSubstr("yard login")));
}

TEST_F(YardE2eTest, CancelPrintsIdAndNewState) {
  SubmitCharGpt();
  CommandResult r = Yard({"cancel", "job-1"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "job-1 CANCELLED\n");
  EXPECT_THAT(ListedIds({"--state", "CANCELLED"}), ElementsAre("job-1"));
}

// Several at once, as scancel: each in turn, a refused one said and the rest cancelled.
TEST_F(YardE2eTest, CancelTakesSeveralJobs) {
  for (int i = 0; i < 3; ++i) SubmitCharGpt();
  CommandResult r = Yard({"cancel", "1", "job-2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "job-1 CANCELLED\njob-2 CANCELLED\n");
  r = Yard({"cancel", "42", "3"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.out, "job-3 CANCELLED\n");
  EXPECT_THAT(r.err, AllOf(HasSubstr("job-42"), HasSubstr("NOT_FOUND")));
  EXPECT_THAT(ListedIds({"--state", "CANCELLED"}), ElementsAre("job-3", "job-2", "job-1"));
  // -o json: one array of the cancelled jobs.
  SubmitCharGpt();
  SubmitCharGpt();
  r = Yard({"-o", "json", "cancel", "4", "5"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json cancelled = ParseJson(r.out);
  ASSERT_TRUE(cancelled.is_array()) << r.out;
  ASSERT_EQ(cancelled.size(), 2u);
  EXPECT_EQ(cancelled[1].value("id", ""), "job-5");
}

TEST_F(YardE2eTest, CancellingAnEndedJobFailsWithFailedPrecondition) {
  SubmitCharGpt();
  ASSERT_EQ(Yard({"cancel", "1"}).exit_code, 0);
  CommandResult r = Yard({"cancel", "1"});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, AllOf(HasSubstr("job-1"), HasSubstr("FAILED_PRECONDITION")));
}

TEST_F(YardE2eTest, WaitOnCancelledJobExitsTwo) {
  SubmitCharGpt();
  ASSERT_EQ(Yard({"cancel", "job-1"}).exit_code, 0);
  CommandResult r = Yard({"wait", "job-1"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("job-1 CANCELLED"));
}

TEST_F(YardE2eTest, WaitOnQueuedJobTimesOutWithExitThree) {
  SubmitCharGpt();
  SubmitCharGpt();
  const absl::Time start = absl::Now();
  CommandResult r = Yard({"wait", "job-2", "--timeout", "300ms"});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(absl::Now() - start, kCommandTimeout);
  EXPECT_THAT(r.err, AllOf(HasSubstr("job-2"), HasSubstr("DEADLINE_EXCEEDED")));
}

TEST_F(YardE2eTest, WaitWithJsonOutputPrintsTheFinalJob) {
  SubmitCharGpt();
  ASSERT_EQ(Yard({"cancel", "job-1", "--reason", "e2e test"}).exit_code, 0);
  CommandResult r = Yard({"-o", "json", "wait", "1"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  json job = ParseJson(r.out);
  EXPECT_EQ(job.value("id", ""), "job-1");
  EXPECT_EQ(job.value("state", ""), "CANCELLED");
  EXPECT_THAT(job.value("message", ""), HasSubstr("e2e test"));
}

TEST_F(YardE2eTest, WaitRejectsMalformedTimeout) {
  SubmitCharGpt();
  CommandResult r = Yard({"wait", "job-1", "--timeout", "soon"});
  ExpectOneLineFailure(r);
  EXPECT_THAT(r.err, AllOf(HasSubstr("--timeout"), HasSubstr("soon")));
}

TEST_F(YardE2eTest, NodesPrintsHeaderAndEmptyJsonWithoutWorkers) {
  CommandResult table = Yard({"nodes"});
  EXPECT_EQ(table.exit_code, 0) << table.err;
  ASSERT_EQ(Lines(table.out).size(), 1u) << table.out;
  EXPECT_THAT(table.out, ContainsRegex("^NODE +ROLE +STATE +DEVICES"));
  CommandResult js = YardViaEnv({"nodes", "-o", "json"});
  EXPECT_EQ(js.exit_code, 0) << js.err;
  json nodes = ParseJson(js.out);
  ASSERT_TRUE(nodes.is_object()) << js.out;
  EXPECT_TRUE(!nodes.contains("nodes") || nodes["nodes"].empty()) << js.out;
}

TEST_F(YardE2eTest, EstimateMemoryTabulatesEveryStrategyAndSaysWhichFit) {
  CommandResult table =
      Yard({"estimate-memory", CharGptSpec(), "--device-memory", "130MiB", "--world-size", "2"});
  EXPECT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("3.3M parameters"));
  EXPECT_THAT(table.out, HasSubstr("host memory: the node's share per device"));
  EXPECT_THAT(table.out, ContainsRegex("ddp \\* +fp32 .* no\n"));  // 140.7 MiB per rank
  EXPECT_THAT(table.out, ContainsRegex("fsdp FULL_SHARD +fp32 .* yes\n"));
  EXPECT_THAT(table.out, ContainsRegex("offload +bf16 .* yes\n"));

  CommandResult js =
      Yard({"estimate-memory", CharGptSpec(), "--device-memory", "1MiB", "-o", "json"});
  EXPECT_EQ(js.exit_code, 0) << js.err;
  json out = ParseJson(js.out);
  // 12 strategies, and for each precision the 2-rank layouts: tensor 2, pipeline 2.
  ASSERT_EQ(out["estimates"].size(), 16u) << js.out;
  EXPECT_EQ(out["estimates"][12]["strategy"], "tensor 2");
  EXPECT_EQ(out["estimates"][13]["strategy"], "pipeline 2 (1f1b)");
  // 256*256 + 128*256 (embeddings) + 4 * (12*256^2 + 13*256) + 2*256 + 256*256 (head)
  EXPECT_EQ(out["parameters"].get<int64_t>(), 3'323'392);
  for (const auto& e : out["estimates"]) EXPECT_FALSE(e["fits"].get<bool>()) << e;

  CommandResult bad = Yard({"estimate-memory", CharGptSpec(), "--device-memory", "lots"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--device-memory"));

  // A command job's model is its program's: refused, naming the field (it estimated an empty
  // model, "0 parameters", fitting everywhere).
  const std::string command = dir_.path() + "/command.yaml";
  std::ofstream(command) << "name: mine\nresources: {slots: 2}\ncommand: [python3, train.py]\n";
  CommandResult theirs = Yard({"estimate-memory", command, "--device-memory", "80GiB"});
  ExpectOneLineFailure(theirs);
  EXPECT_THAT(theirs.err, HasSubstr("command: a command job's model is its program's"));
}

// A llama spec with model.from: yard fills the sizes it leaves out from config.json when it can
// read it (so the estimate and the coordinator's memory check see the model), refuses a size that
// disagrees with it naming the field, and leaves a checkpoint it cannot read to the trainer.
TEST_F(YardE2eTest, ALlamaSpecsSizesComeFromItsCheckpointsConfig) {
  const std::string model = dir_.path() + "/tiny-llama";
  std::filesystem::create_directories(model);
  std::ofstream(model + "/config.json")
      << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
             "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 128})";
  auto spec = [&](const std::string& from, const std::string& extra) {
    return WriteSpec("llama", "name: ft\nresources: {gpus: 1}\nmodel: {kind: llama, from: " + from +
                                  ", seq_len: 64" + extra +
                                  "}\ndata: {path: /usr/share/common-licenses/GPL-3}\n"
                                  "train: {steps: 10}\n");
  };
  CommandResult js = Yard({"estimate-memory", spec(model, ""), "-o", "json"});
  ASSERT_EQ(js.exit_code, 0) << js.err;
  // 2 * 256 * 64 (embedding, untied head) + 2 * (2*64 + 64*64 + 2*64*32 + 64*64 + 3*64*176) + 64
  EXPECT_EQ(ParseJson(js.out)["parameters"].get<int64_t>(), 125'248);

  CommandResult bad = Yard({"estimate-memory", spec(model, ", n_layer: 3")});
  ExpectOneLineFailure(bad);
  EXPECT_THAT(bad.err, HasSubstr("model.n_layer: the spec says 3 but " + model +
                                 "/config.json has num_hidden_layers 2"));
  CommandResult submit = Yard({"submit", spec(model, ", n_layer: 3")});
  ExpectOneLineFailure(submit);
  EXPECT_THAT(submit.err, HasSubstr("model.n_layer: the spec says 3"));

  CommandResult elsewhere = Yard({"estimate-memory", spec("/nonexistent/model", ""), "-o", "json"});
  ASSERT_EQ(elsewhere.exit_code, 0) << elsewhere.err;
  EXPECT_EQ(ParseJson(elsewhere.out)["parameters"].get<int64_t>(), 0);  // the trainer's to read
}

TEST(YardLocalTest, UpStatusDownLifecycle) {
  TempDir dir;
  const std::string state_dir = dir.path() + "/local";
  LocalClusterGuard guard(state_dir);  // destroyed before `dir`
  auto local = [&](const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"local", "--state-dir", state_dir};
    argv.insert(argv.end(), args.begin(), args.end());
    return YardAlone(argv);
  };

  // By default a coordinator and one worker: a job submitted to a new local cluster runs.
  CommandResult up = local({"up", "--listen", "127.0.0.1:0", "-o", "json"});
  ASSERT_EQ(up.exit_code, 0) << up.err;
  json cluster = ParseJson(up.out);
  ASSERT_TRUE(cluster.is_object()) << up.out;
  const std::string address = cluster.value("coordinator_address", "");
  ASSERT_THAT(address, StartsWith("127.0.0.1:"));
  EXPECT_NE(address, "127.0.0.1:0");
  EXPECT_EQ(cluster.value("state_dir", ""), state_dir);
  ASSERT_EQ(cluster["processes"].size(), 2u) << up.out;
  const json& coordinator = cluster["processes"][0];
  EXPECT_EQ(coordinator.value("name", ""), "coordinator");
  EXPECT_EQ(coordinator.value("address", ""), address);
  EXPECT_TRUE(coordinator.value("alive", false));
  const pid_t pid = coordinator.value("pid", 0);
  ASSERT_GT(pid, 0);
  EXPECT_TRUE(IsTrainyardProcess(pid));
  const json& worker = cluster["processes"][1];
  EXPECT_EQ(worker.value("name", ""), "worker local-1");
  EXPECT_TRUE(worker.value("alive", false));
  const pid_t worker_pid = worker.value("pid", 0);
  ASSERT_GT(worker_pid, 0);
  EXPECT_TRUE(IsTrainyardProcess(worker_pid));

  CommandResult ls = YardAlone({"--coordinator", address, "ls"});
  EXPECT_EQ(ls.exit_code, 0) << ls.err;
  EXPECT_THAT(ls.out, StartsWith("ID "));

  CommandResult status = local({"status"});
  EXPECT_EQ(status.exit_code, 0) << status.err;
  EXPECT_THAT(status.out,
              ContainsRegex(absl::StrCat("\ncoordinator +", pid, " +running +", address)));

  CommandResult again = local({"up", "--listen", "127.0.0.1:0"});
  ExpectOneLineFailure(again);
  EXPECT_THAT(again.err, AllOf(HasSubstr("already running"), HasSubstr(absl::StrCat(pid))));
  EXPECT_TRUE(IsTrainyardProcess(pid)) << "a refused `up` must leave the running one alone";

  CommandResult down = local({"down"});
  EXPECT_EQ(down.exit_code, 0) << down.err;
  EXPECT_EQ(down.out, "stopped\n");
  EXPECT_TRUE(WaitUntilGone(pid, absl::Seconds(10))) << "coordinator pid " << pid << " survived";
  EXPECT_TRUE(WaitUntilGone(worker_pid, absl::Seconds(10)))
      << "worker pid " << worker_pid << " survived";

  CommandResult after = local({"status"});
  ExpectOneLineFailure(after);
  EXPECT_THAT(after.err, HasSubstr(state_dir));
}

// `yard local up` saves its admin's token where yard looks; a login already there that the
// cluster does not take is kept aside, and a second cluster keeps it too (it overwrote token.bak
// with the first cluster's token: the real login was gone).
TEST(YardLocalTest, UpKeepsTheLoginItReplacesAndASecondClusterKeepsItToo) {
  TempDir dir;
  const std::string home = dir.path() + "/home";
  const std::string saved = home + "/.config/trainyard/token";
  ASSERT_TRUE(WriteSecretFile(saved, "tyu.the-real-login").ok());
  auto yard = [&](const std::vector<std::string>& args) {
    std::vector<std::string> argv = {BinPath("yard")};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(
        argv, {"HOME=" + home, "XDG_CONFIG_HOME=", "TRAINYARD_TOKEN=", "TRAINYARD_TOKEN_FILE="},
        kCommandTimeout);
  };
  for (const std::string state : {"a", "b"}) {
    const std::string state_dir = dir.path() + "/" + state;
    LocalClusterGuard guard(state_dir);
    CommandResult up = yard(
        {"local", "--state-dir", state_dir, "up", "--listen", "127.0.0.1:0", "--workers", "0"});
    ASSERT_EQ(up.exit_code, 0) << up.err;
    EXPECT_THAT(up.err, HasSubstr(state == "a" ? "kept as " + saved + ".bak"
                                               : "kept as " + saved + ".bak.2"));
    EXPECT_EQ(yard({"local", "--state-dir", state_dir, "down"}).exit_code, 0);
  }
  auto text = [](const std::string& path) {
    std::ifstream in(path);
    std::string t;
    in >> t;
    return t;
  };
  EXPECT_EQ(text(saved + ".bak"), "tyu.the-real-login");
  EXPECT_THAT(text(saved + ".bak.2"), StartsWith("tyt."));  // the first cluster's admin's
  EXPECT_NE(text(saved + ".bak.2"), "tyu.the-real-login");
}

TEST(YardLocalTest, StatusFailsWithOneLineReasonWhenTheCoordinatorDied) {
  TempDir dir;
  const std::string state_dir = dir.path() + "/local";
  LocalClusterGuard guard(state_dir);
  CommandResult up = YardAlone({"-o", "json", "local", "--state-dir", state_dir, "up", "--listen",
                                "127.0.0.1:0", "--workers", "0"});
  ASSERT_EQ(up.exit_code, 0) << up.err;
  const json cluster = ParseJson(up.out);
  ASSERT_TRUE(cluster.is_object() && cluster.contains("processes")) << up.out;
  ASSERT_EQ(cluster["processes"].size(), 1u) << up.out;
  const pid_t pid = cluster["processes"][0].value("pid", 0);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_TRUE(WaitUntilGone(pid, absl::Seconds(10)));

  CommandResult status = YardAlone({"local", "--state-dir", state_dir, "status"});
  ExpectOneLineFailure(status);
  EXPECT_THAT(status.err, AllOf(HasSubstr("not running"), HasSubstr(absl::StrCat(pid))));
  EXPECT_THAT(status.out, ContainsRegex(absl::StrCat("\ncoordinator +", pid, " +stopped ")));

  // A dead cluster can be restarted after `down`.
  CommandResult down = YardAlone({"local", "--state-dir", state_dir, "down"});
  EXPECT_EQ(down.exit_code, 0) << down.err;
  CommandResult restarted = YardAlone(
      {"local", "--state-dir", state_dir, "up", "--listen", "127.0.0.1:0", "--workers", "0"});
  EXPECT_EQ(restarted.exit_code, 0) << restarted.err;
  EXPECT_THAT(restarted.out, HasSubstr("export TRAINYARD_COORDINATOR=127.0.0.1:"));
}

TEST(YardLocalTest, UpRefusesAnUnknownTcpCongestionControlAndStartsNothing) {
  TempDir dir;
  const std::string state_dir = dir.path() + "/local";
  LocalClusterGuard guard(state_dir);
  CommandResult up = YardAlone({"local", "--state-dir", state_dir, "up", "--listen", "127.0.0.1:0",
                                "--tcp-congestion", "no-such-cc"});
  ExpectOneLineFailure(up);
  EXPECT_THAT(up.err, AllOf(HasSubstr("--tcp-congestion: \"no-such-cc\" is not a congestion"),
                            HasSubstr("INVALID_ARGUMENT")));
  EXPECT_FALSE(std::filesystem::exists(state_dir)) << "nothing may start";
}

TEST(YardLocalTest, JsonOutputStaysValidForStateDirsWithQuotes) {
  TempDir dir;
  const std::string state_dir = dir.path() + "/odd \"name\" \\ dir";
  LocalClusterGuard guard(state_dir);
  CommandResult up = YardAlone({"local", "--state-dir", state_dir, "up", "--listen", "127.0.0.1:0",
                                "--workers", "0", "-o", "json"});
  ASSERT_EQ(up.exit_code, 0) << up.err;
  const json cluster = ParseJson(up.out);
  ASSERT_TRUE(cluster.is_object()) << up.out;
  EXPECT_EQ(cluster.value("state_dir", ""), state_dir);
  CommandResult status = YardAlone({"local", "--state-dir", state_dir, "status", "-o", "json"});
  EXPECT_EQ(status.exit_code, 0) << status.err;
  EXPECT_EQ(ParseJson(status.out).value("state_dir", ""), state_dir);
}

}  // namespace
}  // namespace trainyard
