// The worker daemon end to end: real trainyard-coordinator and trainyard-worker processes on
// loopback, the worker running test_rank (tests/test_rank.cc) as its rank program so each test can
// make ranks succeed, crash, hang or ignore SIGTERM. Checks launch, log relay, exit reporting,
// restarts, cancel (SIGTERM, then SIGKILL), worker shutdown without orphans, and reconnection
// after a coordinator restart.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "absl/algorithm/container.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/yard_client.h"
#include "tests/testing/http_get.h"
#include "tests/testing/identity.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/tiny_spec.h"
#include "trainyard/v1/node.grpc.pb.h"
#include "worker/daemon/cgroups.h"
#include "worker/daemon/private_tmp.h"

namespace trainyard {
namespace {

using ::testing::AllOf;
using testing::BinPath;
using ::testing::Contains;
using ::testing::ContainsRegex;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::Subprocess;
using testing::TempDir;
using testing::TestBinPath;

bool Alive(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

// Waits (bounded) until none of `pids` runs; a process exit has no event we can wait on here.
bool AllGone(const std::vector<pid_t>& pids, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    bool any = false;
    for (pid_t p : pids) any = any || Alive(p);
    if (!any) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

class WorkerE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StartCoordinator("127.0.0.1:0");
    ASSERT_FALSE(address_.empty());
    StartWorker({"--gpus", "none"});  // the same on hosts with GPUs
    WaitForReadyNodes(1);
  }

  void StartCoordinator(const std::string& listen) {
    std::vector<std::string> argv = {BinPath("trainyard-coordinator"),
                                     "--listen",
                                     listen,
                                     "--state-dir",
                                     dir_.path() + "/state",
                                     "--heartbeat-interval",
                                     "0.2",
                                     "--node-timeout",
                                     "5s"};
    argv.insert(argv.end(), coordinator_args_.begin(), coordinator_args_.end());
    auto p = Subprocess::Start(argv);
    ASSERT_TRUE(p.ok()) << p.status();
    coordinator_ = std::move(*p);
    address_ = coordinator_->ReadLine(absl::Seconds(30)).value_or("");
    // Tokens made once: they outlive coordinator restarts on the same state directory.
    if (alice_token_.empty()) {
      const auto channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
      const std::string admin = testing::AdminToken(dir_.path() + "/state");
      alice_token_ = testing::CreateToken(channel, admin, "alice");
      ASSERT_TRUE(
          WriteSecretFile(node_token_file(), testing::CreateToken(channel, admin, "admin", "w1"))
              .ok());
    }
    client_ = std::make_unique<client::YardClient>(address_, alice_token_);
  }

  std::string node_token_file() const { return dir_.path() + "/w1.token"; }

  // alice's ranks run as `alice_account_` (default: this test's own account; as root, the
  // worker switches to it).
  std::string UserMap() const {
    const std::string path = dir_.path() + "/user-map";
    std::ofstream(path) << "alice "
                        << (alice_account_.empty() ? getpwuid(geteuid())->pw_name : alice_account_)
                        << "\n"
                        << extra_user_map_;
    return path;
  }

  // Stops the worker of SetUp (its session ends with it).
  void StopWorker() {
    worker_->Signal(SIGTERM);
    ASSERT_TRUE(worker_->Wait(absl::Seconds(30)).has_value());
  }

  // Submits `spec` through `client` and returns the job once it has ended (empty on error).
  static v1::Job RunToEnd(client::YardClient& client, const v1::JobSpec& spec) {
    auto job = client.Submit(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return v1::Job();
    auto end = client.Watch(job->id(), absl::Seconds(60), [](const v1::Job&) { return false; });
    EXPECT_TRUE(end.ok()) << end.status();
    return end.value_or(v1::Job());
  }

  std::unique_ptr<client::YardClient> ClientOf(const std::string& user) {
    const auto channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    return std::make_unique<client::YardClient>(
        address_, testing::CreateToken(channel, testing::AdminToken(dir_.path() + "/state"), user));
  }

  // RegisterNode of w1 with the node token in `token_file`, asking for `owners`' jobs.
  grpc::Status RegisterAs(const std::string& token_file, const std::vector<std::string>& owners) {
    auto token = ReadSecretFile(token_file);
    EXPECT_TRUE(token.ok()) << token.status();
    auto stub =
        v1::NodeService::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    testing::Authorize(ctx, token.ok() ? *token : "");
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::RegisterNodeRequest r;
    r.set_node_id("w1");
    r.set_hostname("localhost");
    r.add_devices()->set_kind(v1::CPU_SLOT);
    for (const std::string& owner : owners) r.add_owners(owner);
    v1::RegisterNodeResponse resp;
    return stub->RegisterNode(&ctx, r, &resp);
  }

  // A worker with 2 CPU slots running test_rank, plus `args`, with `env` added to its environment.
  // `prefix`: a command that starts the worker (e.g. setpriv as another account).
  void StartWorker(const std::vector<std::string>& args = {},
                   const std::vector<std::string>& env = {}, const std::string& stop_grace = "1s",
                   const std::vector<std::string>& prefix = {}) {
    std::vector<std::string> argv = {BinPath("trainyard-worker"),
                                     "--coordinator",
                                     address_,
                                     "--node-id",
                                     "w1",
                                     "--cpu-slots",
                                     "2",
                                     "--trainer",
                                     trainer_.empty() ? TestBinPath("test_rank") : trainer_,
                                     "--work-dir",
                                     work_dir(),
                                     "--stop-grace",
                                     stop_grace,
                                     "--token-file",
                                     node_token_file(),
                                     "--user-map",
                                     UserMap()};
    // (what ranks leave in their work folder: pids, owners)
    if (keep_work_folders_) argv.push_back("--keep-work-folders");
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.begin(), prefix.begin(), prefix.end());
    auto p = Subprocess::Start(argv, env);
    ASSERT_TRUE(p.ok()) << p.status();
    worker_ = std::move(*p);
  }

  std::string work_dir() const { return work_dir_.empty() ? dir_.path() + "/work" : work_dir_; }

  // The devices node w1 registered.
  std::vector<v1::Device> Devices() {
    auto nodes = client_->ListNodes();
    EXPECT_TRUE(nodes.ok()) << nodes.status();
    if (!nodes.ok()) return {};
    for (const auto& node : nodes->nodes()) {
      if (node.id() == "w1") return {node.devices().begin(), node.devices().end()};
    }
    return {};
  }

  void WaitForReadyNodes(int n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      auto nodes = client_->ListNodes();
      int ready = 0;
      if (nodes.ok()) {
        for (const auto& node : nodes->nodes()) {
          ready += node.state() == v1::NODE_READY && node.connected();
        }
      }
      if (ready >= n) return;
      absl::SleepFor(absl::Milliseconds(20));  // no watch API for nodes
    }
    FAIL() << "worker did not register";
  }

  v1::Job WaitFor(const std::string& id, std::function<bool(const v1::Job&)> done) {
    auto job = client_->Watch(id, absl::Seconds(60), std::move(done));
    EXPECT_TRUE(job.ok()) << job.status();
    return job.value_or(v1::Job());
  }

  std::vector<std::string> Logs(const std::string& id) {
    std::vector<std::string> lines;
    EXPECT_TRUE(client_
                    ->Logs(id, false, 0,
                           [&](const v1::LogLine& l) {
                             lines.push_back(absl::StrCat(l.rank(), ": ", l.text()));
                           })
                    .ok());
    return lines;
  }

  // Follows the job's logs until `want` lines that read "ready" arrived.
  void WaitForReadyLines(const std::string& id, int want) { WaitForLines(id, "ready", want); }

  // Follows the job's logs until `want` lines that read `text` arrived.
  void WaitForLines(const std::string& id, const std::string& text, int want) {
    int seen = 0;
    grpc::ClientContext ctx;
    testing::Authorize(ctx, alice_token_);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    auto channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    auto stub = v1::JobService::NewStub(channel);
    v1::StreamLogsRequest r;
    r.set_job_id(id);
    r.set_follow(true);
    auto reader = stub->StreamLogs(&ctx, r);
    v1::LogLine line;
    while (seen < want && reader->Read(&line)) seen += line.text() == text;
    ctx.TryCancel();
    reader->Finish();
    ASSERT_EQ(seen, want);
  }

  // Pids that ranks (and their children) of `job` attempt `attempt` recorded.
  std::vector<pid_t> RankPids(const std::string& job, int attempt) {
    std::vector<pid_t> pids;
    const std::string dir = absl::StrCat(work_dir(), "/", job, "/attempt-", attempt, "/work");
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().filename().string().rfind("pids-rank-", 0) != 0) continue;
      std::ifstream in(entry.path());
      pid_t p;
      while (in >> p) pids.push_back(p);
    }
    return pids;
  }

  TempDir dir_;
  std::unique_ptr<Subprocess> coordinator_;
  std::unique_ptr<Subprocess> worker_;
  std::string address_;
  std::string alice_token_;
  std::string alice_account_;                  // empty: this test's own
  std::string extra_user_map_;                 // more "USER ACCOUNT" lines
  std::string work_dir_;                       // the worker's --work-dir; empty: work in dir_
  std::vector<std::string> coordinator_args_;  // more flags of the coordinator
  std::string trainer_;                        // the worker's --trainer; empty: test_rank
  bool keep_work_folders_ = true;
  std::unique_ptr<client::YardClient> client_;
};

TEST_F(WorkerE2eTest, RanksRunTheirLogsReachTheCoordinatorAndTheJobSucceeds) {
  auto job = client_->Submit(testing::TinySpec("succeed", 2));
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job done = WaitFor(job->id(), [](const v1::Job& j) { return false; });
  EXPECT_EQ(done.state(), v1::SUCCEEDED) << done.message();
  const std::vector<std::string> logs = Logs(job->id());
  EXPECT_THAT(logs, ::testing::Contains("0: hello from rank 0 of 2 (succeed)"));
  EXPECT_THAT(logs, ::testing::Contains("1: hello from rank 1 of 2 (succeed)"));
  EXPECT_THAT(logs, ::testing::Contains("1: rank 1 done"));
  // Each rank's full log also stays on the worker.
  std::ifstream log(work_dir() + "/" + job->id() + "/attempt-1/rank-1.log");
  std::string first;
  std::getline(log, first);
  EXPECT_EQ(first, "hello from rank 1 of 2 (succeed)");
}

// A command job (issue 35): the user's own program, here a plain PyTorch DDP script on Debian's
// python3-torch, gets torchrun's environment on each rank and trains with Gloo, unmodified.
v1::JobSpec CommandSpec(const std::string& name, int ranks, std::vector<std::string> command) {
  v1::JobSpec s;
  s.set_name(name);
  s.mutable_resources()->set_slots(ranks);
  for (std::string& arg : command) s.add_command(std::move(arg));
  return s;
}

bool SystemTorch() {
  return testing::RunCommand({"/usr/bin/python3", "-c", "import torch"}).exit_code == 0;
}

// The SDK's venv (scripts/setup.sh: over Debian's python3-torch, with python/ installed), when
// there is one; else Debian's python3, and the example trains without reporting.
std::string ExamplePython(bool* with_sdk) {
  const std::string venv = TestBinPath("../sdk-venv/bin/python");
  *with_sdk = testing::RunCommand({venv, "-c", "import torch, trainyard"}).exit_code == 0;
  return *with_sdk ? venv : "/usr/bin/python3";
}

TEST_F(WorkerE2eTest, ACommandJobsRanksGetTorchrunsEnvironmentAndTrainWithGloo) {
  if (!SystemTorch()) GTEST_SKIP() << "no python3-torch";
  bool with_sdk = false;
  v1::JobSpec spec =
      CommandSpec("pytorch-ddp", 2, {ExamplePython(&with_sdk), "pytorch-ddp.py", "--steps", "30"});
  spec.set_workdir(std::string(TRAINYARD_SOURCE_DIR) + "/examples");
  (*spec.mutable_env())["PYTHONDONTWRITEBYTECODE"] = "1";
  v1::Job done = RunToEnd(*client_, spec);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.message();
  const std::vector<std::string> logs = Logs(done.id());
  // Both ranks agree on rank 0's address (its node's) and the attempt's port.
  const std::regex env_line(
      "([01]): env RANK=([01]) LOCAL_RANK=([01]) WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 "
      "MASTER_ADDR=(\\S+) MASTER_PORT=([0-9]+) TORCHELASTIC_RESTART_COUNT=0 "
      "TORCHELASTIC_RUN_ID=(\\S+)");
  std::set<std::string> masters;
  int env_lines = 0;
  for (const std::string& line : logs) {
    std::smatch m;
    if (!std::regex_match(line, m, env_line)) continue;
    ++env_lines;
    EXPECT_EQ(m[1], m[2]);
    EXPECT_EQ(m[1], m[3]);
    EXPECT_EQ(m[6], done.id());
    masters.insert(absl::StrCat(m[4].str(), ":", m[5].str()));
  }
  EXPECT_EQ(env_lines, 2) << absl::StrJoin(logs, "\n");
  EXPECT_EQ(masters.size(), 1u);
  // Rank 0's loss falls.
  std::vector<double> losses;
  for (const std::string& line : logs) {
    double loss = 0;
    std::vector<std::string> words = absl::StrSplit(line, ' ');
    if (words.size() == 5 && words[0] == "0:" && words[1] == "step" && words[3] == "loss" &&
        absl::SimpleAtod(words[4], &loss)) {
      losses.push_back(loss);
    }
  }
  ASSERT_EQ(losses.size(), 30u) << absl::StrJoin(logs, "\n");
  EXPECT_LT(losses.back(), 0.5 * losses.front());
  if (with_sdk) {  // reported through the SDK: `yard metrics` has every step, and the checkpoints
    std::vector<v1::StepReport> steps;
    ASSERT_TRUE(
        client_->Metrics(done.id(), false, [&](const v1::StepReport& r) { steps.push_back(r); })
            .ok());
    ASSERT_EQ(steps.size(), 30u);
    EXPECT_EQ(steps.back().step(), 30);
    EXPECT_NEAR(steps.front().loss(), losses.front(), 1e-5);
    EXPECT_LT(steps.back().loss(), 0.5 * steps.front().loss());
    EXPECT_EQ(done.last_checkpoint().step(), 30);
  }
  // Its checkpoint went to the job's checkpoint folder (TRAINYARD_CHECKPOINT_DIR).
  EXPECT_TRUE(
      std::filesystem::exists(dir_.path() + "/state/checkpoints/" + done.id() + "/pytorch-ddp.pt"));
}

// A job's own stop_grace (a program whose checkpoint takes longer than the worker's 1 s grace)
// is the time its ranks get between SIGTERM and SIGKILL; without it, the worker's.
TEST_F(WorkerE2eTest, AJobsStopGraceIsTheTimeItsRanksGetToSaveWhenStopped) {
  const std::string saves_slowly =
      "trap 'sleep 5; echo saved; exit 0' TERM; echo ready; while :; do sleep 0.05; done";
  for (const int grace : {30, 0}) {
    v1::JobSpec spec = CommandSpec(absl::StrCat("grace-", grace), 1, {"sh", "-c", saves_slowly});
    spec.set_stop_grace_seconds(grace);
    auto job = client_->Submit(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    WaitForReadyLines(job->id(), 1);
    ASSERT_TRUE(client_->Cancel(job->id(), "test").ok());
    // Its rank has exited once the node's device is free again.
    auto next = RunToEnd(*client_, CommandSpec("after", 2, {"true"}));
    EXPECT_EQ(next.state(), v1::SUCCEEDED) << next.message();
    if (grace > 0) {
      EXPECT_THAT(Logs(job->id()), Contains("0: saved")) << "killed within its own grace";
    } else {
      EXPECT_THAT(Logs(job->id()), Not(Contains("0: saved"))) << "the worker's 1 s grace";
    }
  }
}

TEST_F(WorkerE2eTest, ACommandJobRunsInItsWorkdirWithItsEnvAndANonZeroExitFailsIt) {
  const std::string workdir = dir_.path() + "/project";
  std::filesystem::create_directories(workdir);
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
  ASSERT_EQ(chmod(workdir.c_str(), 0777), 0);
  v1::JobSpec spec =
      CommandSpec("shell", 1, {"sh", "-c", "echo \"in $(pwd) with $GREETING\"; exit 0"});
  spec.set_workdir(workdir);
  (*spec.mutable_env())["GREETING"] = "hello";
  v1::Job done = RunToEnd(*client_, spec);
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.message();
  EXPECT_THAT(Logs(done.id()), Contains(absl::StrCat("0: in ", workdir, " with hello")));

  v1::Job failed = RunToEnd(*client_, CommandSpec("fails", 2,
                                                  {"/bin/sh", "-c",
                                                   "echo \"error: bad input on rank $RANK\" >&2; "
                                                   "[ \"$RANK\" = 1 ] && exit 3; exit 0"}));
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_THAT(failed.message(), AllOf(HasSubstr("rank 1"), HasSubstr("code 3"),
                                      HasSubstr("error: bad input on rank 1")));

  v1::Job missing = RunToEnd(*client_, CommandSpec("missing", 1, {"no-such-program-here"}));
  EXPECT_EQ(missing.state(), v1::FAILED);
  EXPECT_THAT(missing.message(), HasSubstr("'no-such-program-here' is not in the PATH"));

  // Output without a final newline still reaches the logs.
  v1::Job unterminated =
      RunToEnd(*client_, CommandSpec("unterminated", 1, {"/usr/bin/printf", "first\nno newline"}));
  EXPECT_EQ(unterminated.state(), v1::SUCCEEDED) << unterminated.message();
  EXPECT_THAT(Logs(unterminated.id()), ElementsAre("0: first", "0: no newline"));

  // A job larger than the whole cluster says so instead of waiting in silence.
  auto huge = client_->Submit(CommandSpec("huge", 5, {"/bin/true"}));
  ASSERT_TRUE(huge.ok()) << huge.status();
  std::string why;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (why.empty() && absl::Now() < deadline) {
    auto job = client_->Get(huge->id());
    ASSERT_TRUE(job.ok()) << job.status();
    if (absl::StrContains(job->why_waiting(), "needs")) why = job->why_waiting();
    absl::SleepFor(absl::Milliseconds(50));  // the scheduler's next pass (at least once a second)
  }
  EXPECT_THAT(why, HasSubstr("needs 5 devices, more than the ready nodes"));
}

// Waits until `path` holds a pid; 0 after 30 s.
pid_t PidIn(const std::string& path) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    std::ifstream in(path);
    pid_t pid = 0;
    if (in >> pid && pid > 0) return pid;
    absl::SleepFor(absl::Milliseconds(20));  // the program writes it when it likes
  }
  return 0;
}

// Whether `pid` is gone within 10 s (or a zombie: dead, its parent not yet told).
bool GoneSoon(pid_t pid) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
    std::string line;
    if (!std::getline(stat, line)) return true;
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && line.size() > paren + 2 && line[paren + 2] == 'Z') {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

TEST_F(WorkerE2eTest, NoProcessOfACommandJobOutlivesItEvenOneThatLeftItsSession) {
  const std::string workdir = dir_.path() + "/hygiene";
  std::filesystem::create_directories(workdir);
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
  ASSERT_EQ(chmod(workdir.c_str(), 0777), 0);
  // A daemon that closed its output (so the rank's pipe ends), in a session of its own; the rank
  // runs until cancelled.
  v1::JobSpec cancelled = CommandSpec(
      "daemonizes", 1,
      {"/bin/sh", "-c",
       "setsid /bin/sh -c 'echo $$ > daemon-1.pid; exec sleep 600' </dev/null >/dev/null 2>&1 & "
       "echo started; exec sleep 600"});
  cancelled.set_workdir(workdir);
  auto job = client_->Submit(cancelled);
  ASSERT_TRUE(job.ok()) << job.status();
  const pid_t daemon = PidIn(workdir + "/daemon-1.pid");
  ASSERT_GT(daemon, 0);
  ASSERT_TRUE(client_->Cancel(job->id(), "").ok());
  EXPECT_TRUE(GoneSoon(daemon)) << "the cancelled job's daemon " << daemon << " still runs";

  // A child in its own session that keeps the rank's output open after the rank exits 0: the job
  // still ends (the child is stopped), and it succeeds. (The rank waits for the child's pid file,
  // or the child could be stopped before it wrote one.)
  v1::JobSpec leaves = CommandSpec("leaves-a-child", 1,
                                   {"/bin/sh", "-c",
                                    "setsid /bin/sh -c 'echo $$ > daemon-2.pid; exec sleep 600' & "
                                    "until [ -s daemon-2.pid ]; do sleep 0.01; done; echo done"});
  leaves.set_workdir(workdir);
  v1::Job done = RunToEnd(*client_, leaves);
  EXPECT_EQ(done.state(), v1::SUCCEEDED) << done.message();
  const pid_t child = PidIn(workdir + "/daemon-2.pid");
  ASSERT_GT(child, 0);
  EXPECT_TRUE(GoneSoon(child)) << "the ended job's child " << child << " still runs";

  // One that cleared its environment cannot be found; the rank's end is still reported, and the
  // test stops it.
  v1::JobSpec hidden =
      CommandSpec("hides", 1,
                  {"/bin/sh", "-c",
                   "setsid /usr/bin/env -i /bin/sh -c 'echo $$ > daemon-3.pid; exec sleep 600' & "
                   "until [ -s daemon-3.pid ]; do sleep 0.01; done; echo done"});
  hidden.set_workdir(workdir);
  v1::Job ended = RunToEnd(*client_, hidden);
  EXPECT_EQ(ended.state(), v1::SUCCEEDED) << ended.message();
  if (const pid_t escaped = PidIn(workdir + "/daemon-3.pid"); escaped > 0) kill(escaped, SIGKILL);
}

TEST_F(WorkerE2eTest, YardPrintsLogsPrefixedByRankAndRefusesToCheckpointAnEndedJob) {
  auto job = client_->Submit(testing::TinySpec("succeed", 2));
  ASSERT_TRUE(job.ok());
  ASSERT_EQ(WaitFor(job->id(), [](const v1::Job&) { return false; }).state(), v1::SUCCEEDED);
  const std::vector<std::string> env = {"TRAINYARD_TOKEN=" + alice_token_};  // never argv
  auto logs =
      testing::RunCommand({BinPath("yard"), "--coordinator", address_, "logs", job->id()}, env);
  EXPECT_EQ(logs.exit_code, 0) << logs.err;
  EXPECT_THAT(logs.out, HasSubstr("[rank 0] hello from rank 0 of 2 (succeed)\n"));
  EXPECT_THAT(logs.out, HasSubstr("[rank 1] rank 1 done\n"));
  auto tail = testing::RunCommand(
      {BinPath("yard"), "--coordinator", address_, "logs", job->id(), "--tail", "1", "-f"}, env);
  EXPECT_EQ(tail.exit_code, 0) << tail.err;  // -f on an ended job returns at once
  EXPECT_EQ(std::count(tail.out.begin(), tail.out.end(), '\n'), 1);
  auto metrics = testing::RunCommand(
      {BinPath("yard"), "--coordinator", address_, "metrics", job->id(), "-o", "json"}, env);
  EXPECT_EQ(metrics.exit_code, 0) << metrics.err;
  EXPECT_EQ(metrics.out, "[]\n");  // test_rank reports no steps
  auto ckpt = testing::RunCommand(
      {BinPath("yard"), "--coordinator", address_, "checkpoint", job->id()}, env);
  EXPECT_NE(ckpt.exit_code, 0);
  EXPECT_THAT(ckpt.err, HasSubstr("FAILED_PRECONDITION"));
}

// A job's terminal escapes (window title, clear screen, OSC 52 clipboard, a carriage return, an
// 8-bit CSI) reach `yard logs` as escapes, not as commands to the reader's terminal; --raw gives
// them as they are; tabs and UTF-8 stay.
TEST_F(WorkerE2eTest, YardLogsShowsAJobsTerminalEscapesAsText) {
  const v1::Job done =
      RunToEnd(*client_, CommandSpec("escapes", 1,
                                     {"/usr/bin/printf",
                                      "\\033]0;owned\\007\\033[2J\\033]52;c;ZXZpbA==\\007a\\tb "
                                      "\\302\\233\\303\\251t\\303\\251\\rZ\\n"}));
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.message();
  const std::vector<std::string> env = {"TRAINYARD_TOKEN=" + alice_token_};
  auto logs =
      testing::RunCommand({BinPath("yard"), "--coordinator", address_, "logs", done.id()}, env);
  ASSERT_EQ(logs.exit_code, 0) << logs.err;
  EXPECT_EQ(logs.out,
            "[rank 0] \\x1b]0;owned\\x07\\x1b[2J\\x1b]52;c;ZXZpbA==\\x07a\tb "
            "\\u009b\xc3\xa9t\xc3\xa9\\rZ\n");
  auto raw = testing::RunCommand(
      {BinPath("yard"), "--coordinator", address_, "logs", done.id(), "--raw"}, env);
  ASSERT_EQ(raw.exit_code, 0) << raw.err;
  EXPECT_EQ(raw.out,
            "[rank 0] \x1b]0;owned\x07\x1b[2J\x1b]52;c;ZXZpbA==\x07"
            "a\tb \xc2\x9b\xc3\xa9t\xc3\xa9\rZ\n");
}

TEST_F(WorkerE2eTest, RanksGetTheirAttemptsJobCredentialButNotTheWorkersNodeToken) {
  // This worker has its node token in the environment, where ranks would inherit it.
  worker_->Signal(SIGTERM);
  ASSERT_TRUE(worker_->Wait(absl::Seconds(30)).has_value());
  auto token = ReadSecretFile(node_token_file());
  ASSERT_TRUE(token.ok()) << token.status();
  std::vector<std::string> args = {"--gpus", "none"};
  StartWorker(args, {"TRAINYARD_TOKEN=" + *token});
  WaitForReadyNodes(1);

  auto job = client_->Submit(testing::TinySpec("print-credentials", 2));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(WaitFor(job->id(), [](const v1::Job&) { return false; }).state(), v1::SUCCEEDED);
  const std::vector<std::string> lines = Logs(job->id());
  for (int rank : {0, 1}) {
    EXPECT_THAT(lines,
                Contains(absl::StrCat(rank, ": rank ", rank,
                                      ": job credential of this attempt; node token unset")));
    // Its context (the spec, the job, the servers) is readable by the rank's account only.
    EXPECT_THAT(lines, Contains(absl::StrCat(rank, ": rank ", rank, ": context file mode 600")));
  }
  for (const std::string& line : lines) EXPECT_THAT(line, Not(HasSubstr("tyj.")));
}

// As root, the worker runs each rank as its owner's Unix account (here alice -> nobody): the rank
// has that uid, reads only what that account may, and a user without an account gets no rank.
TEST_F(WorkerE2eTest, RanksRunAsTheirOwnersAccountAndReadOnlyWhatItMay) {
  if (geteuid() != 0) GTEST_SKIP() << "switching ranks to another account needs root";
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);  // the ranks' folders are below it
  StopWorker();
  // Two accounts every Debian system has: alice's ranks run as nobody, bob's as daemon.
  alice_account_ = "nobody";
  extra_user_map_ = "bob daemon\n";
  StartWorker({"--gpus", "none"});
  WaitForReadyNodes(1);
  auto bob = ClientOf("bob");

  auto identity = client_->Submit(testing::TinySpec("print-identity", 2));
  ASSERT_TRUE(identity.ok()) << identity.status();
  ASSERT_EQ(WaitFor(identity->id(), [](const v1::Job&) { return false; }).state(), v1::SUCCEEDED);
  const std::vector<std::string> lines = Logs(identity->id());
  for (int rank : {0, 1}) {
    EXPECT_THAT(lines,
                Contains(absl::StrCat(rank, ": rank ", rank, ": uid 65534 gid 65534 USER=nobody")));
  }
  struct stat st {};
  const std::string attempt_dir = work_dir() + "/" + identity->id() + "/attempt-1";
  ASSERT_EQ(stat((attempt_dir + "/work").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 65534u) << "the rank's folder is its owner's";
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  // The worker's own files stay where the rank cannot put a link in their place.
  ASSERT_EQ(stat(attempt_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 0u);
  EXPECT_EQ(st.st_mode & 0777, 0711u);
  // Nor can another user list a job's attempts.
  ASSERT_EQ(stat((work_dir() + "/" + identity->id()).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0711u);
  ASSERT_EQ(stat((attempt_dir + "/rank-0.log").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const v1::Job bobs = RunToEnd(*bob, testing::TinySpec("print-identity", 1));
  EXPECT_EQ(bobs.state(), v1::SUCCEEDED);
  std::vector<std::string> bob_lines;
  ASSERT_TRUE(
      bob->Logs(bobs.id(), false, 0, [&](const v1::LogLine& l) { bob_lines.push_back(l.text()); })
          .ok());
  EXPECT_THAT(bob_lines, Contains("rank 0: uid 1 gid 1 USER=daemon"));

  // bob can neither stop, watch nor read alice's running job.
  auto running = client_->Submit(testing::TinySpec("hang", 1));
  ASSERT_TRUE(running.ok()) << running.status();
  WaitForReadyLines(running->id(), 1);
  // (Answered as for a job that does not exist.)
  EXPECT_TRUE(absl::IsNotFound(bob->Cancel(running->id(), "mine now").status()));
  EXPECT_TRUE(absl::IsNotFound(
      bob->Watch(running->id(), absl::Seconds(5), [](const v1::Job&) { return true; }).status()));
  EXPECT_TRUE(absl::IsNotFound(bob->Logs(running->id(), false, 0, [](const v1::LogLine&) {})));
  ASSERT_TRUE(client_->Cancel(running->id(), "done").ok());

  v1::JobSpec secret = testing::TinySpec("read-data", 1);
  secret.mutable_data()->set_path("/etc/shadow");
  auto reader = client_->Submit(secret);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const v1::Job failed = WaitFor(reader->id(), [](const v1::Job&) { return false; });
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_THAT(failed.message(),
              AllOf(HasSubstr("cannot read /etc/shadow"), HasSubstr("Permission denied")));

  // carol has no Unix account here and no mapping.
  const v1::Job orphan = RunToEnd(*ClientOf("carol"), testing::TinySpec("print-identity", 1));
  EXPECT_EQ(orphan.state(), v1::FAILED);
  EXPECT_THAT(orphan.message(), HasSubstr("no Unix account carol for user carol"));

  // A user named like a system account does not get it by name: only the map may give it.
  const v1::Job system = RunToEnd(*ClientOf("daemon"), testing::TinySpec("print-identity", 1));
  EXPECT_EQ(system.state(), v1::FAILED);
  EXPECT_THAT(system.message(), HasSubstr("has uid 1, a system account"));
}

// A worker that is not root runs every rank as itself, so it takes only the jobs of the users
// mapped to its account: the scheduler places nothing else on it.
// As root, a command job's ranks run as its owner's account too, in a folder of that account's.
TEST_F(WorkerE2eTest, ACommandJobsRanksRunAsTheirOwnersAccount) {
  if (geteuid() != 0) GTEST_SKIP() << "switching ranks to another account needs root";
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);  // the ranks' folders are below it
  StopWorker();
  alice_account_ = "nobody";
  StartWorker({"--gpus", "none"});
  WaitForReadyNodes(1);
  v1::Job done = RunToEnd(
      *client_,
      CommandSpec("whoami", 2, {"/bin/sh", "-c", "echo \"$(id -un) $(id -u) $USER in $(pwd)\""}));
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << done.message();
  const std::string work = work_dir() + "/" + done.id() + "/attempt-1/work";
  for (int rank : {0, 1}) {
    EXPECT_THAT(Logs(done.id()), Contains(absl::StrCat(rank, ": nobody 65534 nobody in ", work)));
  }
}

// Least privilege (issue 52): nothing a job's env names runs as root. The worker (root) hands the
// rank's environment to its shepherd in a memfd; the shepherd runs with a fixed environment, and
// only its child, once it is the owner's account, reads that environment, looks command[0] up
// and executes it. A library that records its loader's euid, named by LD_PRELOAD, LD_AUDIT or
// LD_LIBRARY_PATH (with a bare LD_PRELOAD name), is loaded by the owner's processes only; a PATH
// into a folder only root can read says no more than a PATH to nowhere; and a variable of the
// worker's own environment that --rank-env does not name never reaches the rank.
TEST_F(WorkerE2eTest, NothingAJobsEnvNamesRunsAsRootAndTheWorkersEnvironmentStaysWithIt) {
  if (geteuid() != 0) GTEST_SKIP() << "switching ranks to another account needs root";
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);  // the ranks' folders are below it
  StopWorker();
  alice_account_ = "nobody";
  StartWorker({"--gpus", "none"},
              {"WORKER_PRIVATE_SETTING=only-for-the-worker", "TRAINYARD_OPERATOR_SETTING=passed"});
  WaitForReadyNodes(1);

  const std::string probe = TRAINYARD_ENV_PROBE;
  const std::string probe_dir = std::filesystem::path(probe).parent_path().string();
  const std::string probe_name = std::filesystem::path(probe).filename().string();
  const std::string records = dir_.path() + "/probe.txt";
  { std::ofstream(records).flush(); }
  ASSERT_EQ(chmod(records.c_str(), 0666), 0);
  const std::string show =
      "echo \"uid $(id -u) worker=${WORKER_PRIVATE_SETTING:-unset} "
      "operator=${TRAINYARD_OPERATOR_SETTING:-unset} path=$PATH shell=$SHELL home=$HOME\"";
  struct Case {
    std::string name;
    std::map<std::string, std::string> env;
  };
  const std::vector<Case> cases = {
      {"preload", {{"LD_PRELOAD", probe}}},
      {"audit", {{"LD_AUDIT", probe}}},
      {"library-path", {{"LD_LIBRARY_PATH", probe_dir}, {"LD_PRELOAD", probe_name}}},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = CommandSpec(c.name, 1, {"sh", "-c", show});
    for (const auto& [name, value] : c.env) (*spec.mutable_env())[name] = value;
    (*spec.mutable_env())["ENV_PROBE_OUT"] = records;
    const v1::Job done = RunToEnd(*client_, spec);
    ASSERT_EQ(done.state(), v1::SUCCEEDED) << c.name << ": " << done.message();
    // PATH is the worker's (the operator's), the rest of the base the owner's.
    EXPECT_THAT(
        Logs(done.id()),
        Contains(absl::StrCat("0: uid 65534 worker=unset operator=passed path=", getenv("PATH"),
                              " shell=/usr/sbin/nologin home=/nonexistent")))
        << c.name;
  }
  // Every process that loaded the library ran as nobody, and some did (the rank's shell).
  std::ifstream in(records);
  std::string line;
  int loads = 0;
  while (std::getline(in, line)) {
    ++loads;
    EXPECT_THAT(line, HasSubstr(" euid 65534 ")) << "loaded by another account: " << line;
  }
  EXPECT_GE(loads, 3) << "the probe never ran: the test would show nothing";

  // A program in a folder only root can read: the owner hears what it would of a missing one.
  const std::string secret = dir_.path() + "/root-only";
  std::filesystem::create_directories(secret);
  ASSERT_EQ(chmod(secret.c_str(), 0700), 0);
  {
    std::ofstream program(secret + "/secret-tool");
    program << "#!/bin/sh\necho should not run\n";
  }
  ASSERT_EQ(chmod((secret + "/secret-tool").c_str(), 0755), 0);
  v1::JobSpec hidden = CommandSpec("hidden", 1, {"secret-tool"});
  (*hidden.mutable_env())["PATH"] = secret;
  v1::JobSpec missing = CommandSpec("missing", 1, {"no-such-tool"});
  (*missing.mutable_env())["PATH"] = secret;
  const v1::Job hidden_done = RunToEnd(*client_, hidden);
  const v1::Job missing_done = RunToEnd(*client_, missing);
  EXPECT_EQ(hidden_done.state(), v1::FAILED);
  EXPECT_EQ(missing_done.state(), v1::FAILED);
  EXPECT_THAT(hidden_done.message(),
              HasSubstr(absl::StrCat("'secret-tool' is not in the PATH (", secret, ")")));
  // What each rank said, the program's name aside: the same.
  std::vector<std::string> said_hidden = Logs(hidden_done.id()),
                           said_missing = Logs(missing_done.id());
  for (std::string& l : said_hidden) l = absl::StrReplaceAll(l, {{"secret-tool", "X"}});
  for (std::string& l : said_missing) l = absl::StrReplaceAll(l, {{"no-such-tool", "X"}});
  EXPECT_EQ(said_hidden, said_missing);
  EXPECT_THAT(said_hidden, Not(Contains(HasSubstr("should not run"))));
}

// Whether this host's cgroups can hold ranks (root, and v1 or a delegated v2).
bool CgroupsUsable() { return geteuid() == 0 && trainyard::worker::DetectCgroups().version != 0; }

// A rank that makes its log 1 TiB long (a hole: bytes it never wrote) has its lines on both sides
// of the hole read, and its job ends as soon as it exits: the worker skips the hole (it read the
// zeros, for hours, and sent them on as lines). The hole starts and ends inside blocks: the
// NULs there (the rest of the first line's block, the start of the last's) are the hole's too
// (they went on as lines of NULs), and so are those of a log extended past its last line.
TEST_F(WorkerE2eTest, ARanksLogIsReadAcrossAHoleWithoutReadingIt) {
  const v1::Job job =
      RunToEnd(*client_, CommandSpec("hole", 1,
                                     {"/usr/bin/python3", "-c",
                                      "import os\n"
                                      "os.write(1, b'before the hole\\n')\n"
                                      "os.ftruncate(1, (1 << 40) + 100)\n"
                                      "os.write(1, b'after the hole\\n')\n"
                                      "os.write(1, b'no newline')\n"
                                      "os.ftruncate(1, os.fstat(1).st_size + 9)\n"}));
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.message();
  const std::vector<std::string> lines = Logs(job.id());
  EXPECT_THAT(lines, Contains(HasSubstr("before the hole")));
  EXPECT_THAT(lines, Contains(EndsWith("after the hole")));
  EXPECT_THAT(lines, Contains(EndsWith("no newline")));
  EXPECT_THAT(lines, Each(Not(HasSubstr(std::string(1, '\0')))));
  size_t bytes = 0;
  for (const std::string& line : lines) bytes += line.size();
  EXPECT_LT(bytes, size_t{64} << 10) << "the hole was read";
}

// Without --memory-per-slot a rank is held to each device's share of the host's memory: what the
// scheduler charges a job that asks for none. (It had no limit: one such job could take the
// host's memory, and the kernel's OOM killer then chose among every user's ranks.)
TEST_F(WorkerE2eTest, WithoutAPerSlotLimitARankIsHeldToItsDevicesShareOfTheMemory) {
  if (!CgroupsUsable()) GTEST_SKIP() << "needs root and usable cgroups";
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
  StopWorker();
  alice_account_ = "nobody";
  StartWorker({"--gpus", "none", "--cgroups", "require"});
  WaitForReadyNodes(1);
  auto nodes = client_->ListNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->nodes_size(), 1);
  const v1::HostResources& host = nodes->nodes(0).host();
  ASSERT_GT(host.memory_bytes(), 0);
  EXPECT_EQ(host.memory_per_device(), host.memory_bytes() / 2);  // 2 slots
  // The rank reads its own limit (v1: memory.limit_in_bytes, in whole pages; v2: memory.max).
  const v1::Job job =
      RunToEnd(*client_, CommandSpec("limit", 1,
                                     {"/usr/bin/python3", "-c",
                                      "for line in open('/proc/self/cgroup'):\n"
                                      "    h, ctl, path = line.rstrip('\\n').split(':', 2)\n"
                                      "    for f in ('/sys/fs/cgroup/memory' + path + "
                                      "'/memory.limit_in_bytes', '/sys/fs/cgroup' + path + "
                                      "'/memory.max'):\n"
                                      "        if ('memory' in ctl.split(',') or h == '0'):\n"
                                      "            try: print('limit', open(f).read().strip())\n"
                                      "            except OSError: pass\n"}));
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.message();
  std::vector<int64_t> limits;
  for (const std::string& line : Logs(job.id())) {
    const size_t at = line.find("limit ");
    int64_t limit = 0;
    if (at != std::string::npos && absl::SimpleAtoi(line.substr(at + 6), &limit)) {
      limits.push_back(limit);
    }
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  EXPECT_THAT(limits, Contains(host.memory_per_device() / page * page)) << job.id();
}

// Containment (issue 52): each rank in a cgroup of its own, held to the worker's per-slot limits.
// A rank that allocates past its memory is OOM-killed and its job FAILED naming the limit, while
// a job beside it on the same worker finishes; four spinning processes under `cpus 1` get at most
// 1.1 CPU-seconds a second; a fork bomb stops at the pids limit; a daemon that left the rank's
// session and cleared its environment (env -i) dies when the job is cancelled.
TEST_F(WorkerE2eTest, RanksAreHeldToTheirMemoryCpusAndPidsAndEndWhole) {
  if (!CgroupsUsable()) GTEST_SKIP() << "needs root and usable cgroups";
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
  StopWorker();
  alice_account_ = "nobody";
  StartWorker({"--gpus", "none", "--cgroups", "require", "--memory-per-slot", "96MiB",
               "--cpus-per-slot", "0.5", "--pids-per-rank", "48"});
  WaitForReadyNodes(1);
  // The node reports its host: the slots' defaults, and its cgroups.
  auto nodes = client_->ListNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->nodes_size(), 1);
  const v1::HostResources& host = nodes->nodes(0).host();
  EXPECT_DOUBLE_EQ(host.cpus_per_device(), 0.5);
  EXPECT_EQ(host.memory_per_device(), 96 << 20);
  EXPECT_TRUE(absl::StartsWith(host.cgroups(), "cgroup v")) << host.cgroups();
  EXPECT_GT(host.memory_bytes(), 0);
  auto table = testing::RunCommand({BinPath("yard"), "--coordinator", address_, "nodes"},
                                   {"TRAINYARD_TOKEN=" + alice_token_});
  EXPECT_THAT(table.out, HasSubstr("CPUS(USED/ALL)"));
  EXPECT_THAT(table.out, ContainsRegex(" v[12] ")) << table.out;

  // Beside it, a job held to the slot's 96 MiB that finishes while the other one, asking for
  // 64 MiB (resources.memory), is killed at that.
  auto beside = client_->Submit(CommandSpec("beside", 1, {"/bin/sh", "-c", "sleep 2; echo fine"}));
  ASSERT_TRUE(beside.ok()) << beside.status();
  v1::JobSpec hog_spec = CommandSpec(
      "hog", 1, {"/usr/bin/python3", "-c", "b = b'x' * (512 << 20)\nprint('allocated', len(b))"});
  hog_spec.mutable_resources()->set_memory_bytes(64 << 20);
  const v1::Job hog = RunToEnd(*client_, hog_spec);
  EXPECT_EQ(hog.state(), v1::FAILED);
  EXPECT_THAT(hog.message(),
              HasSubstr("out of memory: the rank reached its memory limit (64.0 MiB"));
  EXPECT_THAT(Logs(hog.id()), Not(Contains(HasSubstr("allocated"))));
  const auto beside_end =
      client_->Watch(beside->id(), absl::Seconds(60), [](const v1::Job&) { return false; });
  ASSERT_TRUE(beside_end.ok()) << beside_end.status();
  EXPECT_EQ(beside_end->state(), v1::SUCCEEDED) << beside_end->message();

  // CPU: four processes spin for 2 s of wall-clock time in a rank asking for 1 CPU
  // (resources.cpus, over the slot's 0.5); their CPU time is what they got.
  v1::JobSpec spin_spec =
      CommandSpec("spin", 1,
                  {"/usr/bin/python3", "-c",
                   "import os, resource, time\n"
                   "start = time.monotonic()\n"
                   "kids = []\n"
                   "for _ in range(4):\n"
                   "    pid = os.fork()\n"
                   "    if pid == 0:\n"
                   "        while time.monotonic() - start < 2: pass\n"
                   "        os._exit(0)\n"
                   "    kids.append(pid)\n"
                   "for pid in kids: os.waitpid(pid, 0)\n"
                   "wall = time.monotonic() - start\n"
                   "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
                   "print('cpu per second %.3f' % ((u.ru_utime + u.ru_stime) / wall))\n"});
  spin_spec.mutable_resources()->set_cpus(1);
  const v1::Job spin = RunToEnd(*client_, spin_spec);
  ASSERT_EQ(spin.state(), v1::SUCCEEDED) << spin.message();
  double per_second = -1;
  for (const std::string& line : Logs(spin.id())) {
    const size_t at = line.find("cpu per second ");
    if (at != std::string::npos) {
      ASSERT_TRUE(absl::SimpleAtod(line.substr(at + 15), &per_second)) << line;
    }
  }
  EXPECT_LE(per_second, 1.1);
  // (A loose floor, for a loaded machine: only that the spinning ran at all.)
  EXPECT_GT(per_second, 0.2) << "the spinning processes hardly ran: the test would show nothing";

  // A fork bomb (of sleeping processes) stops at 48 processes.
  const v1::Job bomb =
      RunToEnd(*client_, CommandSpec("bomb", 1,
                                     {"/usr/bin/python3", "-c",
                                      "import os, time\n"
                                      "n = 0\n"
                                      "try:\n"
                                      "    for _ in range(500):\n"
                                      "        if os.fork() == 0:\n"
                                      "            time.sleep(30)\n"
                                      "            os._exit(0)\n"
                                      "        n += 1\n"
                                      "except OSError as e:\n"
                                      "    print('stopped after', n, 'forks:', e.strerror)\n"}));
  ASSERT_EQ(bomb.state(), v1::SUCCEEDED) << bomb.message();
  bool stopped = false;
  for (const std::string& line : Logs(bomb.id())) {
    int forks = 0;
    if (absl::StrContains(line, "stopped after ")) {
      const std::vector<std::string> words = absl::StrSplit(line, ' ');
      ASSERT_GE(words.size(), 4u) << line;
      ASSERT_TRUE(absl::SimpleAtoi(words[3], &forks)) << line;
      EXPECT_LT(forks, 48) << line;
      stopped = true;
    }
  }
  EXPECT_TRUE(stopped) << "the fork bomb was not stopped";

  // A daemon with an empty environment, in a session of its own: gone once the job is cancelled.
  const std::string run = dir_.path() + "/daemons";
  std::filesystem::create_directories(run);
  ASSERT_EQ(chmod(run.c_str(), 0777), 0);
  auto daemon = client_->Submit(
      CommandSpec("daemon", 1,
                  {"/bin/sh", "-c",
                   absl::StrCat("/usr/bin/setsid /usr/bin/env -i /bin/sh -c 'echo $$ > ", run,
                                "/daemon.pid; exec sleep 600' & sleep 600")}));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t hidden = PidIn(run + "/daemon.pid");
  ASSERT_GT(hidden, 0);
  ASSERT_TRUE(client_->Cancel(daemon->id(), "").ok());
  EXPECT_TRUE(GoneSoon(hidden)) << "the env -i daemon outlived its job";
}

// Accounting (issue 52), as sacct's MaxRSS and TotalCPU: a rank that allocates 200 MiB and spins
// a CPU for a second ends with a peak RSS within 10% of 200 MiB and at least that second of CPU
// time, kept with its job and shown by yard describe.
TEST_F(WorkerE2eTest, DescribeShowsEachRanksPeakRssAndCpuTime) {
  const v1::Job job = RunToEnd(*client_, CommandSpec("alloc", 1,
                                                     {"/usr/bin/python3", "-c",
                                                      "import time\n"
                                                      "b = b'x' * (200 << 20)\n"
                                                      "end = time.process_time() + 1\n"
                                                      "while time.process_time() < end: pass\n"
                                                      "print('held', len(b))\n"}));
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.message();
  ASSERT_EQ(job.rank_usage_size(), 1);
  const v1::RankUsage& used = job.rank_usage(0);
  EXPECT_EQ(used.rank(), 0);
  EXPECT_EQ(used.node_id(), "w1");
  EXPECT_NEAR(static_cast<double>(used.peak_rss_bytes()), 200 << 20, 0.1 * (200 << 20));
  EXPECT_GE(used.cpu_seconds(), 0.95);
  EXPECT_LT(used.cpu_seconds(), 30);
  auto described =
      testing::RunCommand({BinPath("yard"), "--coordinator", address_, "describe", job.id()},
                          {"TRAINYARD_TOKEN=" + alice_token_});
  EXPECT_EQ(described.exit_code, 0) << described.err;
  EXPECT_THAT(described.out, HasSubstr("ranks of attempt 1 that ended:"));
  EXPECT_THAT(described.out, HasSubstr("PEAK RSS"));
  EXPECT_THAT(described.out, ContainsRegex("0 +w1 +0 +2[01][0-9]\\.[0-9] MiB"));
}

TEST_F(WorkerE2eTest, AWorkerWithoutRootTakesOnlyItsAccountsJobs) {
  if (geteuid() != 0) GTEST_SKIP() << "starting the worker as another account needs root";
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
  StopWorker();
  // As nobody: its token (naming the owners it takes, as a node token of a worker that is not
  // root must) and its folder are nobody's; alice is mapped to it.
  {
    auto channel = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    auto admin = testing::AdminToken(dir_.path() + "/state");
    // With a token for any user's jobs, it is refused.
    EXPECT_THAT(RegisterAs(node_token_file(), {"nobody", "alice"}).error_message(),
                HasSubstr("its node token names no owners"));
    ASSERT_TRUE(
        WriteSecretFile(node_token_file(), testing::CreateToken(channel, admin, "admin", "w1",
                                                                v1::USER, {"nobody", "alice"}))
            .ok());
  }
  ASSERT_EQ(chown(node_token_file().c_str(), 65534, 65534), 0);
  std::filesystem::create_directories(work_dir());
  ASSERT_EQ(chown(work_dir().c_str(), 65534, 65534), 0);
  alice_account_ = "nobody";
  StartWorker({"--gpus", "none"}, {}, "1s",
              {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"});
  WaitForReadyNodes(1);
  auto nodes = client_->ListNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->nodes_size(), 1);
  EXPECT_THAT(nodes->nodes(0).owners(), ElementsAre("nobody", "alice"));

  auto bob = ClientOf("bob");
  auto bobs = bob->Submit(testing::TinySpec("print-identity", 1));
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  auto alices = client_->Submit(testing::TinySpec("print-identity", 1));
  ASSERT_TRUE(alices.ok()) << alices.status();
  // alice's job, submitted after bob's, runs (as nobody) and ends: the scheduler passed bob's by.
  ASSERT_EQ(WaitFor(alices->id(), [](const v1::Job&) { return false; }).state(), v1::SUCCEEDED);
  EXPECT_THAT(Logs(alices->id()), Contains(HasSubstr("0: rank 0: uid 65534 gid 65534 ")));
  auto still = bob->Get(bobs->id());
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(still->state(), v1::QUEUED);
  EXPECT_EQ(still->attempt(), 0) << "never placed";
}

TEST_F(WorkerE2eTest, OutputThatIsNotUtf8IsRelayedWithReplacementsAndTheJobEnds) {
  // One such line used to fail the session's stream: the job never heard its ranks' exits.
  auto job = client_->Submit(testing::TinySpec("print-binary", 2));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(WaitFor(job->id(), [](const v1::Job&) { return false; }).state(), v1::SUCCEEDED);
  EXPECT_THAT(
      Logs(job->id()),
      Contains("0: rank 0: bytes \xef\xbf\xbd\xef\xbf\xbd and \xef\xbf\xbd\xef\xbf\xbd end"));
  // The rank's own log keeps its bytes.
  std::ifstream log(work_dir() + "/" + job->id() + "/attempt-1/rank-0.log");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("bytes \xff\xfe and \xe2\x82 end"));
}

TEST_F(WorkerE2eTest, CrashingRankRestartsTheJobThenFailsItWithTheExitCodeAndLastLines) {
  auto job = client_->Submit(testing::TinySpec("fail-rank-1", 2, /*max_restarts=*/1));
  ASSERT_TRUE(job.ok());
  v1::Job failed = WaitFor(job->id(), [](const v1::Job& j) { return false; });
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_EQ(failed.attempt(), 2);
  EXPECT_EQ(failed.restarts(), 1);
  EXPECT_THAT(failed.message(), HasSubstr("rank 1 on node w1 exited with code 3"));
  EXPECT_THAT(failed.message(), HasSubstr("boom: rank 1 failed on purpose"));
  // The surviving rank 0 of each attempt was stopped.
  EXPECT_TRUE(AllGone(RankPids(job->id(), 1), absl::Seconds(10)));
  EXPECT_TRUE(AllGone(RankPids(job->id(), 2), absl::Seconds(10)));
}

// A trainer that dies between creating its all-reduce segment and its peers mapping it (when the
// name is removed) would leave the name in /dev/shm; the worker removes it when the rank exits.
TEST_F(WorkerE2eTest, ARankThatDiesLeavesNoSharedMemoryBehind) {
  auto job = client_->Submit(testing::TinySpec("leave-shm", 1));
  ASSERT_TRUE(job.ok());
  const v1::Job failed = WaitFor(job->id(), [](const v1::Job&) { return false; });
  EXPECT_EQ(failed.state(), v1::FAILED);
  EXPECT_THAT(failed.message(), HasSubstr("exited with code 9"));
  const std::vector<std::string> logs = Logs(job->id());
  ASSERT_EQ(RankPids(job->id(), 1).size(), 1u);
  const std::string name =
      absl::StrCat("/trainyard-allreduce-", RankPids(job->id(), 1)[0], "-test");
  EXPECT_THAT(logs, ::testing::Contains("0: created " + name));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + name));
}

TEST_F(WorkerE2eTest, CancelStopsRanksEvenThoseIgnoringSigterm) {
  auto polite = client_->Submit(testing::TinySpec("hang", 1));
  auto stubborn = client_->Submit(testing::TinySpec("ignore-term", 1));
  ASSERT_TRUE(polite.ok() && stubborn.ok());
  WaitForReadyLines(polite->id(), 1);
  WaitForReadyLines(stubborn->id(), 1);
  const std::vector<pid_t> polite_pids = RankPids(polite->id(), 1);
  const std::vector<pid_t> stubborn_pids = RankPids(stubborn->id(), 1);
  ASSERT_EQ(polite_pids.size(), 1u);
  ASSERT_EQ(stubborn_pids.size(), 1u);
  ASSERT_TRUE(client_->Cancel(polite->id(), "test").ok());
  ASSERT_TRUE(client_->Cancel(stubborn->id(), "test").ok());
  EXPECT_TRUE(AllGone(polite_pids, absl::Seconds(10)));
  EXPECT_TRUE(AllGone(stubborn_pids, absl::Seconds(10)));  // SIGKILL after the 1 s grace
  // The freed slots take the next job.
  auto next = client_->Submit(testing::TinySpec("succeed", 2));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(WaitFor(next->id(), [](const v1::Job&) { return false; }).state(), v1::SUCCEEDED);
  // The polite rank got SIGTERM itself (not only the SIGKILL after the grace): the worker's
  // blocked signals do not carry over into its ranks. Its log is complete once its slot was
  // given to the next job (the worker reports an exit after the rank's last output).
  std::ifstream log(work_dir() + "/" + polite->id() + "/attempt-1/rank-0.log");
  std::stringstream polite_log;
  polite_log << log.rdbuf();
  EXPECT_THAT(polite_log.str(), HasSubstr("ready\nstopping on SIGTERM\n"));
}

TEST_F(WorkerE2eTest, StoppingTheWorkerLeavesNoRankOrGrandchildBehind) {
  auto job = client_->Submit(testing::TinySpec("spawn-child", 2));
  ASSERT_TRUE(job.ok());
  WaitForReadyLines(job->id(), 2);
  const std::vector<pid_t> pids = RankPids(job->id(), 1);
  ASSERT_EQ(pids.size(), 4u);  // two ranks, a grandchild each
  worker_->Signal(SIGTERM);
  auto status = worker_->Wait(absl::Seconds(20));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  EXPECT_TRUE(AllGone(pids, absl::Seconds(10)));
}

// A worker killed for good: its ranks keep running for the node timeout (5 s here; a worker back
// by then adopts them), then their shepherds stop them.
TEST_F(WorkerE2eTest, AKilledWorkerThatStaysAwayLeavesNoRankBehindAfterTheNodeTimeout) {
  auto job = client_->Submit(testing::TinySpec("hang", 2));
  ASSERT_TRUE(job.ok());
  WaitForReadyLines(job->id(), 2);
  const std::vector<pid_t> pids = RankPids(job->id(), 1);
  ASSERT_EQ(pids.size(), 2u);
  kill(worker_->pid(), SIGKILL);
  ASSERT_TRUE(worker_->Wait(absl::Seconds(10)).has_value());
  const absl::Time killed = absl::Now();
  EXPECT_FALSE(AllGone(pids, absl::Seconds(2))) << "the ranks went with their worker at once";
  EXPECT_TRUE(AllGone(pids, absl::Seconds(15)));
  // SIGTERM, which "hang" answers at once, after 5 s with nobody holding them.
  EXPECT_GE(absl::Now() - killed, absl::Seconds(4));
  const std::string log = absl::StrCat(work_dir(), "/", job->id(), "/attempt-1/rank-0.log");
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, ::testing::HasSubstr("no worker has held this rank for 5s: stopping it"));
  EXPECT_THAT(text, ::testing::HasSubstr("stopping on SIGTERM"));
}

// An upgrade: the worker exits on SIGUSR2 leaving its ranks, and a new one on the same work
// directory adopts them. The job keeps its attempt past a node timeout, the ranks are the same
// processes, what they print after the restart reaches the coordinator, and a cancel through the
// new worker stops them.
TEST_F(WorkerE2eTest, ARestartedWorkerAdoptsItsRunningRanksAndTheJobKeepsItsAttempt) {
  auto job = client_->Submit(testing::TinySpec("hang", 2));
  ASSERT_TRUE(job.ok());
  WaitForReadyLines(job->id(), 2);
  const std::vector<pid_t> pids = RankPids(job->id(), 1);
  ASSERT_EQ(pids.size(), 2u);
  worker_->Signal(SIGUSR2);
  auto status = worker_->Wait(absl::Seconds(20));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  for (pid_t p : pids) EXPECT_TRUE(Alive(p)) << p;
  StartWorker({"--gpus", "none"});
  WaitForReadyNodes(1);
  // A node timeout (5 s) and more: nothing changes.
  auto changed = client_->Watch(job->id(), absl::Seconds(7), [](const v1::Job& j) {
    return j.state() != v1::RUNNING || j.attempt() != 1;
  });
  EXPECT_EQ(changed.status().code(), absl::StatusCode::kDeadlineExceeded)
      << (changed.ok() ? changed->DebugString() : changed.status().ToString());
  for (pid_t p : pids) EXPECT_TRUE(Alive(p)) << p;
  EXPECT_EQ(RankPids(job->id(), 1), pids);
  ASSERT_TRUE(client_->Cancel(job->id(), "done").ok());
  const v1::Job end = WaitFor(job->id(), [](const v1::Job&) { return false; });
  EXPECT_EQ(end.state(), v1::CANCELLED);
  EXPECT_EQ(end.attempt(), 1);
  EXPECT_TRUE(AllGone(pids, absl::Seconds(10)));
  // The job is CANCELLED at once; its ranks' last lines follow their exits.
  std::vector<std::string> logs;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto said = [&logs](const std::string& line) { return absl::c_linear_search(logs, line); };
  do {
    logs = Logs(job->id());
    if (said("0: stopping on SIGTERM") && said("1: stopping on SIGTERM")) break;
    absl::SleepFor(absl::Milliseconds(50));  // no watch API for logs of an ended job
  } while (absl::Now() < deadline);
  EXPECT_THAT(logs, ::testing::Contains("0: stopping on SIGTERM"));
  EXPECT_THAT(logs, ::testing::Contains("1: stopping on SIGTERM"));
}

// A rank whose shepherd is killed while no worker runs dies with it. The next worker cannot
// adopt it: it reports the rank gone, so the attempt fails and the job restarts (attempt 2),
// rather than the rank being started again into an attempt whose other ranks moved on.
TEST_F(WorkerE2eTest, ARankWhoseShepherdDiedWhileItsWorkerWasAwayRestartsItsJob) {
  auto job = client_->Submit(testing::TinySpec("hang", 1, /*max_restarts=*/1));
  ASSERT_TRUE(job.ok());
  WaitForReadyLines(job->id(), 1);
  const std::vector<pid_t> pids = RankPids(job->id(), 1);
  ASSERT_EQ(pids.size(), 1u);
  worker_->Signal(SIGUSR2);
  ASSERT_TRUE(worker_->Wait(absl::Seconds(20)).has_value());
  // The rank's parent is its shepherd.
  std::ifstream stat(absl::StrCat("/proc/", pids[0], "/stat"));
  std::string line;
  ASSERT_TRUE(std::getline(stat, line));
  const std::vector<std::string> fields =
      absl::StrSplit(line.substr(line.rfind(')') + 2), ' ');  // state, ppid, ...
  pid_t shepherd = 0;
  ASSERT_TRUE(absl::SimpleAtoi(fields.at(1), &shepherd));
  ASSERT_GT(shepherd, 1);
  ASSERT_EQ(kill(shepherd, SIGKILL), 0);
  EXPECT_TRUE(AllGone(pids, absl::Seconds(10))) << "the rank outlived its shepherd";
  StartWorker({"--gpus", "none"});
  const v1::Job restarted = WaitFor(
      job->id(), [](const v1::Job& j) { return j.attempt() >= 2 && j.state() == v1::RUNNING; });
  EXPECT_EQ(restarted.attempt(), 2);
  EXPECT_EQ(restarted.restarts(), 1);
  ASSERT_TRUE(client_->Cancel(job->id(), "done").ok());
}

// The same with cgroups: what the rank started (here a sleeping grandchild, which no death signal
// reaches) is killed with the rank's cgroup by the next worker (it ran on, holding the device the
// coordinator gave to the next job).
TEST_F(WorkerE2eTest, ARankWhoseShepherdDiedLeavesNoChildBehind) {
  if (!CgroupsUsable()) GTEST_SKIP() << "needs root and usable cgroups";
  StopWorker();
  StartWorker({"--gpus", "none", "--cgroups", "require"});
  auto job = client_->Submit(testing::TinySpec("spawn-child", 1));
  ASSERT_TRUE(job.ok());
  WaitForReadyLines(job->id(), 1);
  const std::vector<pid_t> pids = RankPids(job->id(), 1);
  absl::Cleanup kill_left = [&pids] {  // (should the test fail)
    for (pid_t pid : pids) kill(pid, SIGKILL);
  };
  ASSERT_EQ(pids.size(), 2u) << "the rank and its grandchild";
  worker_->Signal(SIGUSR2);
  ASSERT_TRUE(worker_->Wait(absl::Seconds(20)).has_value());
  std::ifstream stat(absl::StrCat("/proc/", pids[0], "/stat"));
  std::string line;
  ASSERT_TRUE(std::getline(stat, line));
  const std::vector<std::string> fields = absl::StrSplit(line.substr(line.rfind(')') + 2), ' ');
  pid_t shepherd = 0;
  ASSERT_TRUE(absl::SimpleAtoi(fields.at(1), &shepherd));
  ASSERT_GT(shepherd, 1);
  ASSERT_EQ(kill(shepherd, SIGKILL), 0);
  EXPECT_TRUE(AllGone({pids[0]}, absl::Seconds(10))) << "the rank outlived its shepherd";
  StartWorker({"--gpus", "none", "--cgroups", "require"});
  EXPECT_TRUE(AllGone(pids, absl::Seconds(20))) << "the grandchild outlived the adoption";
}

// A rank that ends while its worker is away (here crashed: SIGKILL): the next worker collects its
// exit, so the job succeeds on its first attempt, with the lines the rank printed meanwhile, and
// the lines from before the crash sent once.
TEST_F(WorkerE2eTest, ARankThatEndsWhileItsWorkerIsAwayIsReportedByTheNextOne) {
  v1::JobSpec spec = testing::TinySpec("until-data-exists", 1);
  const std::string release = dir_.path() + "/release";
  spec.mutable_data()->set_path(release);
  auto job = client_->Submit(spec);
  ASSERT_TRUE(job.ok());
  WaitForLines(job->id(), "waiting", 1);
  const std::vector<pid_t> pids = RankPids(job->id(), 1);
  ASSERT_EQ(pids.size(), 1u);
  absl::SleepFor(absl::Milliseconds(1500));  // the worker tells its shepherd what it has sent
  kill(worker_->pid(), SIGKILL);
  ASSERT_TRUE(worker_->Wait(absl::Seconds(10)).has_value());
  std::ofstream(release) << "go\n";
  EXPECT_TRUE(AllGone(pids, absl::Seconds(10)));
  StartWorker({"--gpus", "none"});
  const v1::Job end = WaitFor(job->id(), [](const v1::Job&) { return false; });
  EXPECT_EQ(end.state(), v1::SUCCEEDED) << end.message();
  EXPECT_EQ(end.attempt(), 1);
  const std::vector<std::string> logs = Logs(job->id());
  EXPECT_EQ(std::count(logs.begin(), logs.end(), "0: waiting"), 1)
      << ::testing::PrintToString(logs);
  EXPECT_EQ(std::count(logs.begin(), logs.end(), "0: released"), 1)
      << ::testing::PrintToString(logs);
}

TEST_F(WorkerE2eTest, WorkerReconnectsAfterTheCoordinatorRestarts) {
  const std::string listen = address_;
  coordinator_->Signal(SIGTERM);
  ASSERT_TRUE(coordinator_->Wait(absl::Seconds(20)).has_value());
  StartCoordinator(listen);  // same address and state
  ASSERT_EQ(address_, listen);
  WaitForReadyNodes(1);
  auto job = client_->Submit(testing::TinySpec("succeed", 2));
  ASSERT_TRUE(job.ok());
  const v1::Job done = WaitFor(job->id(), [](const v1::Job&) { return false; });
  EXPECT_EQ(done.state(), v1::SUCCEEDED) << done.message();
}

// A coordinator away for 8 s (a restart, an upgrade) while a job runs: the worker is back well
// within the node timeout (5 s here), so the job keeps its attempt and nothing restarts. (With
// gRPC's default reconnect backoff a worker was seen coming back 20 s after such a pause, and the
// job lost an attempt; issue 39.)
// A two-rank job: no restart, and its logs from before the restart are still shown.
TEST_F(WorkerE2eTest, ARunningJobKeepsItsAttemptWhenTheCoordinatorIsAwayEightSeconds) {
  auto job = client_->Submit(testing::TinySpec("hang", 2));
  ASSERT_TRUE(job.ok()) << job.status();
  WaitForReadyLines(job->id(), 2);
  const std::vector<std::string> before = Logs(job->id());
  ASSERT_THAT(before, ::testing::Contains("0: ready"));
  ASSERT_THAT(before, ::testing::Contains("1: ready"));
  const std::string listen = address_;
  coordinator_->Signal(SIGTERM);
  ASSERT_TRUE(coordinator_->Wait(absl::Seconds(20)).has_value());
  absl::SleepFor(absl::Seconds(8));  // the coordinator's absence is what is tested
  StartCoordinator(listen);
  ASSERT_EQ(address_, listen);
  const absl::Time back = absl::Now();
  WaitForReadyNodes(1);
  EXPECT_LT(absl::Now() - back, absl::Seconds(4)) << "the worker took long to come back";
  // A node timeout and more pass without the job changing: it runs on, attempt 1.
  auto changed = client_->Watch(job->id(), absl::Seconds(7), [](const v1::Job& j) {
    return j.state() != v1::RUNNING || j.attempt() != 1;
  });
  EXPECT_EQ(changed.status().code(), absl::StatusCode::kDeadlineExceeded)
      << (changed.ok() ? changed->DebugString() : changed.status().ToString());
  auto now = client_->Get(job->id());
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->state(), v1::RUNNING);
  EXPECT_EQ(now->attempt(), 1);
  const std::vector<std::string> after = Logs(job->id());
  ASSERT_GE(after.size(), before.size());
  EXPECT_EQ(std::vector<std::string>(after.begin(), after.begin() + before.size()), before)
      << "the logs from before the restart are gone";
  ASSERT_TRUE(client_->Cancel(job->id(), "done").ok());
}

// Tests that start their own worker.
// A folder under /var/tmp, where a worker with --private-tmp may work (its ranks get a /tmp of
// their own), removed at the end with whatever is mounted in it.
class FolderOutsideTmp {
 public:
  FolderOutsideTmp() {
    char path[] = "/var/tmp/trainyard-test-XXXXXX";
    if (mkdtemp(path) != nullptr && chmod(path, 0755) == 0) path_ = path;
  }
  ~FolderOutsideTmp() {
    if (path_.empty()) return;
    std::ifstream mounts("/proc/self/mountinfo");
    std::vector<std::string> points;
    for (std::string line; std::getline(mounts, line);) {
      const std::vector<std::string> fields = absl::StrSplit(line, ' ');
      if (fields.size() > 4 && absl::StartsWith(fields[4], path_ + "/"))
        points.push_back(fields[4]);
    }
    for (const std::string& point : points) umount2(point.c_str(), MNT_DETACH);
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Whether anything is mounted at `path` (this process's mount namespace: the host's).
bool Mounted(const std::string& path) {
  std::ifstream mounts("/proc/self/mountinfo");
  for (std::string line; std::getline(mounts, line);) {
    const std::vector<std::string> fields = absl::StrSplit(line, ' ');
    if (fields.size() > 4 && fields[4] == path) return true;
  }
  return false;
}

// Containment (--private-tmp, as Slurm's job_container/tmpfs): the ranks of an attempt on a node
// share a /tmp, a /dev/shm and an IPC namespace that no other job sees, that hide the host's, and
// that go when they end (the namespaces' files unmounted, the tmp folder removed). A job that
// hands its ranks a path under /tmp fails to start, naming the field.
class PrivateTmpE2eTest : public WorkerE2eTest {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "private mounts and switching accounts need root";
    if (absl::Status s = worker::CheckMountNamespaces(); !s.ok()) GTEST_SKIP() << s;
    if (!std::filesystem::exists("/usr/bin/ipcmk")) GTEST_SKIP() << "no ipcmk (util-linux)";
    ASSERT_FALSE(outside_.path().empty()) << "cannot make a folder in /var/tmp";
    // What the worker hands its ranks is outside /tmp: its folders, the jobs' checkpoints.
    coordinator_args_ = {"--checkpoint-root", outside_.path() + "/checkpoints"};
    work_dir_ = outside_.path() + "/work";
    trainer_ = "/bin/true";  // (command jobs only: a build tree may be under /tmp)
    alice_account_ = "nobody";
    keep_work_folders_ = false;
    StartCoordinator("127.0.0.1:0");
    ASSERT_FALSE(address_.empty());
    StartWorker({"--gpus", "none", "--private-tmp"});
    WaitForReadyNodes(1);
  }
  // The worker and coordinator go before the folder they work in (a member of this class, which
  // goes before the base's).
  void TearDown() override {
    if (worker_ != nullptr) {  // (stops its ranks, removes their namespaces)
      worker_->Signal(SIGTERM);
      worker_->Wait(absl::Seconds(30));
    }
    worker_.reset();
    coordinator_.reset();
  }

  FolderOutsideTmp outside_;
};

TEST_F(PrivateTmpE2eTest, AnAttemptsRanksShareATmpDevShmAndIpcOfTheirOwnThatGoWhenTheyEnd) {
  // What the host has in /tmp and /dev/shm, readable by every account.
  const std::string marker = absl::StrCat("trainyard-host-marker-", getpid());
  for (const std::string folder : {"/tmp/", "/dev/shm/"}) {
    std::ofstream(folder + marker) << "host\n";
    chmod((folder + marker).c_str(), 0644);
  }
  absl::Cleanup remove_markers = [&marker] {
    for (const std::string folder : {"/tmp/", "/dev/shm/"}) unlink((folder + marker).c_str());
  };
  const std::string note = absl::StrCat("note-", getpid()), seg = absl::StrCat("seg-", getpid());
  // Rank 0 makes a SysV segment and writes a file into each folder; rank 1 waits for them there.
  const std::string script = absl::StrCat(
      "if [ \"$RANK\" = 0 ]; then ipcmk -M 12305 > /dev/null && echo from-rank-0 > /tmp/.n && mv "
      "/tmp/.n /tmp/",
      note, " && echo seg > /dev/shm/.s && mv /dev/shm/.s /dev/shm/", seg,
      "; fi; i=0; while [ ! -e /tmp/", note, " ] || [ ! -e /dev/shm/", seg,
      " ]; do i=$((i+1)); [ $i -lt 1200 ] || exit 3; sleep 0.05; done; "
      "echo \"tmp: $(cat /tmp/",
      note, ") $(stat -c %U:%a /tmp) shm: $(cat /dev/shm/", seg,
      ") $(stat -c %U:%a /dev/shm) sysv: $(awk '$4 == 12305' /proc/sysvipc/shm | wc -l) "
      "kept: $(grep -c /.namespaces /proc/self/mountinfo) in "
      "$(readlink /proc/self/ns/ipc)\"; [ -e /tmp/",
      marker, " ] && echo sees the host tmp; [ -e /dev/shm/", marker,
      " ] && echo sees the host shm; echo waiting; i=0; while [ ! -e /tmp/go ]; do i=$((i+1)); "
      "[ $i -lt 1200 ] || exit 4; sleep 0.05; done");
  auto submitted = client_->Submit(CommandSpec("private-tmp", 2, {"/bin/sh", "-c", script}));
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  WaitForLines(submitted->id(), "waiting", 2);
  // While the ranks run, something holds their namespaces (as a process of the owner's that
  // opened a rank's /proc/PID/ns files could): here this test, by their files.
  const std::string attempt = absl::StrCat(work_dir(), "/", submitted->id(), "/attempt-1");
  const std::string kept_by = absl::StrCat(work_dir(), "/.namespaces/", submitted->id(), "@1");
  const int held_ipc = open((kept_by + ".ipc").c_str(), O_RDONLY | O_CLOEXEC);
  const int held_mnt = open((kept_by + ".mnt").c_str(), O_RDONLY | O_CLOEXEC);
  absl::Cleanup close_held = [&] {
    close(held_ipc);
    close(held_mnt);
  };
  ASSERT_GE(held_ipc, 0);
  ASSERT_GE(held_mnt, 0);
  std::ofstream(attempt + "/tmp/go") << "go";  // (the ranks' /tmp/go)
  const v1::Job shared = WaitFor(submitted->id(), [](const v1::Job&) { return false; });
  ASSERT_EQ(shared.state(), v1::SUCCEEDED) << shared.message();
  const std::vector<std::string> lines = Logs(shared.id());
  // Both ranks in one IPC namespace, not the host's; no namespace's file mounted in theirs (a
  // copy would keep another attempt's namespace, its /dev/shm, while theirs lives).
  char host_ipc[64] = {0};
  ASSERT_GT(readlink("/proc/self/ns/ipc", host_ipc, sizeof(host_ipc) - 1), 0);
  std::set<std::string> namespaces;
  const std::regex line(
      R"(([01]): tmp: from-rank-0 nobody:700 shm: seg nobody:700 sysv: 1 kept: 0 in (.*))");
  for (const std::string& l : lines) {
    std::smatch m;
    if (std::regex_match(l, m, line)) namespaces.insert(m[2]);
  }
  EXPECT_EQ(namespaces.size(), 1u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(namespaces.count(host_ipc), 0u);
  for (int rank : {0, 1}) {
    EXPECT_THAT(
        lines, Contains(HasSubstr(absl::StrCat(
                   rank, ": tmp: from-rank-0 nobody:700 shm: seg nobody:700 sysv: 1 kept: 0 in "))))
        << absl::StrJoin(lines, "\n");
  }
  EXPECT_THAT(lines, Not(Contains(HasSubstr("sees the host"))));
  EXPECT_FALSE(std::filesystem::exists("/tmp/" + note));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + seg));
  // All go once the attempt's ranks have ended: the folder emptied as its owner, the tmpfs and
  // the IPC namespace unmounted (a file system's state has no event to wait on: bounded polling).
  auto gone = [&] {
    for (const std::string& path : {attempt + "/tmp", kept_by + ".mnt", kept_by + ".ipc"}) {
      if (std::filesystem::exists(path) || Mounted(path)) return false;
    }
    return true;
  };
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       absl::Now() < deadline && !gone();) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(gone()) << "the attempt's tmp, shm or ipc stays";
  // What was held was emptied first: no segment in the IPC namespace, no tmpfs at its /dev/shm.
  // (Bit 0: the segment is there, bit 1: rank 0's file; 8: cannot join.)
  const std::string seg_path = "/dev/shm/" + seg;
  const pid_t child = fork();
  if (child == 0) {
    if (setns(held_ipc, CLONE_NEWIPC) != 0) _exit(8);
    const int sysv = open("/proc/sysvipc/shm", O_RDONLY);
    char text[4096];
    const ssize_t n = sysv < 0 ? -1 : read(sysv, text, sizeof(text));
    int lines = 0;
    for (ssize_t i = 0; i < n; ++i) lines += text[i] == '\n';
    if (setns(held_mnt, CLONE_NEWNS) != 0) _exit(8);
    _exit((lines > 1 ? 1 : 0) | (access(seg_path.c_str(), F_OK) == 0 ? 2 : 0));
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "what the held namespaces keep: " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);

  // The owner's next job starts with all of them empty.
  const v1::Job next = RunToEnd(
      *client_, CommandSpec("private-tmp-next", 1,
                            {"/bin/sh", "-c",
                             "echo \"tmp holds $(ls -A /tmp | wc -l), shm holds $(ls -A /dev/shm | "
                             "wc -l), sysv holds $(tail -n +2 /proc/sysvipc/shm | wc -l)\""}));
  ASSERT_EQ(next.state(), v1::SUCCEEDED) << next.message();
  EXPECT_THAT(Logs(next.id()), Contains("0: tmp holds 0, shm holds 0, sysv holds 0"));

  // A workdir under /tmp would be out of its ranks' sight: refused, naming the field.
  v1::JobSpec in_tmp = CommandSpec("workdir-in-tmp", 1, {"/bin/true"});
  in_tmp.set_workdir("/tmp");
  const v1::Job refused = RunToEnd(*client_, in_tmp);
  EXPECT_EQ(refused.state(), v1::FAILED);
  EXPECT_THAT(refused.message(), HasSubstr("workdir: \"/tmp\" is under /tmp"));
}

class OwnWorkerE2eTest : public WorkerE2eTest {
 protected:
  void SetUp() override {
    StartCoordinator("127.0.0.1:0");
    ASSERT_FALSE(address_.empty());
  }

  // Waits until node w1 holds `n` devices (allocated to ranks, or kept for ranks still stopping);
  // false if it does not within 30 s.
  bool HoldsDevices(int n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    int held = -1;
    while (absl::Now() < deadline) {
      auto nodes = client_->ListNodes();
      if (nodes.ok()) {
        for (const auto& node : nodes->nodes()) {
          if (node.id() == "w1" && node.connected()) held = node.allocated_devices_size();
        }
      }
      if (held == n) return true;
      absl::SleepFor(absl::Milliseconds(20));  // no watch API for nodes
    }
    return false;
  }
};

// A stop grace is a duration of at most a day (the coordinator holds a stopping rank's device
// that long); anything else is refused at start, naming the flag.
TEST(WorkerFlagsTest, ABadStopGraceIsRefusedNamingTheFlag) {
  testing::TempDir dir;
  for (const char* grace : {"25h", "abc", "-1s"}) {
    testing::CommandResult r =
        testing::RunCommand({BinPath("trainyard-worker"), "--coordinator", "127.0.0.1:1",
                             "--work-dir", dir.path() + "/work", "--stop-grace", grace},
                            {}, absl::Seconds(30));
    EXPECT_NE(r.exit_code, 0) << grace;
    EXPECT_THAT(r.err, HasSubstr("--stop-grace: ")) << grace;
  }
  // The most a job's own grace gets: at least --stop-grace, at most a day.
  for (const char* max : {"25h", "5s", "abc"}) {
    testing::CommandResult r = testing::RunCommand(
        {BinPath("trainyard-worker"), "--coordinator", "127.0.0.1:1", "--work-dir",
         dir.path() + "/work", "--stop-grace", "10s", "--max-stop-grace", max},
        {}, absl::Seconds(30));
    EXPECT_NE(r.exit_code, 0) << max;
    EXPECT_THAT(r.err, HasSubstr("--max-stop-grace: ")) << max;
  }
}

// --private-tmp refuses a worker whose ranks would not see what it hands them (its work
// directory under /tmp), and one that cannot give them their own mounts (not root).
TEST(WorkerFlagsTest, PrivateTmpIsRefusedWithAWorkDirUnderTmpOrWithoutRoot) {
  const std::string dir = absl::StrCat("/tmp/trainyard-private-tmp-flag-", getpid());
  absl::Cleanup remove = [&dir] {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  };
  testing::CommandResult r =
      testing::RunCommand({BinPath("trainyard-worker"), "--coordinator", "127.0.0.1:1", "--gpus",
                           "none", "--work-dir", dir + "/work", "--private-tmp"},
                          {"TRAINYARD_TOKEN=not-a-real-token"}, absl::Seconds(30));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr(geteuid() == 0
                                   ? "--private-tmp: --work-dir " + dir + "/work is under /tmp"
                                   : std::string("--private-tmp: takes a worker running as root")));
}

TEST_F(OwnWorkerE2eTest, RestartedCoordinatorKeepsTheDeviceOfARankStillStopping) {
  StartWorker({"--gpus", "none"}, {}, /*stop_grace=*/"120s");
  WaitForReadyNodes(1);
  // The worker told the coordinator its grace, which holds a stopping rank's device that long.
  auto nodes = client_->ListNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->nodes_size(), 1);
  EXPECT_EQ(nodes->nodes(0).host().stop_grace_ms(), 120000);
  auto job = client_->Submit(testing::TinySpec("ignore-term", 1));
  ASSERT_TRUE(job.ok());
  WaitForReadyLines(job->id(), 1);
  const std::vector<pid_t> pids = RankPids(job->id(), 1);
  ASSERT_EQ(pids.size(), 1u);
  ASSERT_TRUE(client_->Cancel(job->id(), "test").ok());  // SIGTERM, which it ignores
  ASSERT_TRUE(HoldsDevices(1)) << "the stopping rank's device was freed before the restart";

  // The coordinator restarts while the rank is still stopping: the worker's hello lists the rank
  // with its device, and the new coordinator keeps that device taken.
  const std::string listen = address_;
  coordinator_->Signal(SIGTERM);
  ASSERT_TRUE(coordinator_->Wait(absl::Seconds(20)).has_value());
  StartCoordinator(listen);
  ASSERT_EQ(address_, listen);
  WaitForReadyNodes(1);
  ASSERT_TRUE(HoldsDevices(1)) << "the restarted coordinator freed the stopping rank's device";

  // Once the rank is gone the device is free: a job needing both slots runs.
  kill(pids[0], SIGKILL);
  ASSERT_TRUE(HoldsDevices(0)) << "the device stayed taken after the rank exited";
  auto next = client_->Submit(testing::TinySpec("succeed", 2));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(WaitFor(next->id(), [](const v1::Job&) { return false; }).state(), v1::SUCCEEDED);
}

// A worker that stopped answering (here: stopped by SIGSTOP past the node timeout) is declared
// LOST and its session closed by the coordinator; once it runs again it finds its session gone,
// reconnects, and its node is READY and takes jobs again.
TEST_F(WorkerE2eTest, AWorkerDeclaredLostReconnectsAndItsNodeIsReadyAgain) {
  auto node_state = [&]() -> std::pair<v1::NodeState, bool> {
    auto nodes = client_->ListNodes();
    if (!nodes.ok() || nodes->nodes().empty()) return {v1::NODE_STATE_UNSPECIFIED, false};
    return {nodes->nodes(0).state(), nodes->nodes(0).connected()};
  };
  auto wait_for = [&](v1::NodeState state, bool connected) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      if (node_state() == std::make_pair(state, connected)) return true;
      absl::SleepFor(absl::Milliseconds(50));  // no watch API for nodes
    }
    return false;
  };
  ASSERT_EQ(kill(worker_->pid(), SIGSTOP), 0);
  // LOST, and its session closed by the coordinator (not by the stopped worker).
  const bool lost = wait_for(v1::NODE_LOST, false);
  ASSERT_EQ(kill(worker_->pid(), SIGCONT), 0);
  ASSERT_TRUE(lost) << "the stopped worker's node was not declared lost and cut off";
  ASSERT_TRUE(wait_for(v1::NODE_READY, true)) << "the worker did not come back";
  auto job = client_->Submit(testing::TinySpec("succeed", 2));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(WaitFor(job->id(), [](const v1::Job&) { return false; }).state(), v1::SUCCEEDED);
}

// GPU hosts, with tests/fake_cuda_driver.cc standing in for libcuda.so.1 (these hosts have no GPU).
class WorkerGpuE2eTest : public OwnWorkerE2eTest {
 protected:
  static std::string FakeDriver() { return TestBinPath("libfake_cuda.so"); }

  static std::string FakeUuid(int device) {
    return absl::StrCat("GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae0", device);
  }

  // Waits until node w1 is connected with `n` devices of `kind`.
  std::vector<v1::Device> WaitForDevices(v1::DeviceKind kind, int n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    std::vector<v1::Device> devices;
    while (absl::Now() < deadline) {
      devices = Devices();
      if (static_cast<int>(devices.size()) == n &&
          std::all_of(devices.begin(), devices.end(),
                      [&](const v1::Device& d) { return d.kind() == kind; })) {
        return devices;
      }
      absl::SleepFor(absl::Milliseconds(20));  // no watch API for nodes
    }
    ADD_FAILURE() << "node w1 did not register " << n << " devices of kind " << kind;
    return devices;
  }

  void ExpectEachRankOpensOnlyItsGpusFile(const std::vector<int>& minor_of,
                                          const std::vector<std::string>& args,
                                          const std::vector<std::string>& env);

  // The lines the ranks of a print-devices job over `ranks` devices printed.
  std::vector<std::string> PrintedDevices(int ranks) {
    auto job = client_->Submit(testing::TinySpec("print-devices", ranks));
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return {};
    const v1::Job done = WaitFor(job->id(), [](const v1::Job&) { return false; });
    EXPECT_EQ(done.state(), v1::SUCCEEDED) << done.message();
    std::vector<std::string> lines;
    for (const std::string& l : Logs(job->id())) {
      if (l.find(": --device ") != std::string::npos) lines.push_back(l);
    }
    std::sort(lines.begin(), lines.end());
    return lines;
  }
};

TEST_F(WorkerGpuE2eTest, OffersEachGpuAndGivesEachRankOnlyItsOwn) {
  // --gpus all: the GPUs whatever the trainer says; the worker's own OMP_NUM_THREADS must not
  // reach the ranks.
  StartWorker({"--gpus", "all", "--cuda-library", FakeDriver(), "--threads-per-slot", "3"},
              {"FAKE_CUDA_DEVICES=2", "OMP_NUM_THREADS=7"});
  const std::vector<v1::Device> devices = WaitForDevices(v1::CUDA_GPU, 2);
  ASSERT_EQ(devices.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(devices[i].index(), i);
    EXPECT_EQ(devices[i].name(), absl::StrCat("Fake GPU ", i, " (", FakeUuid(i), ")"));
    EXPECT_EQ(devices[i].memory_bytes(), int64_t{81559} << 20);
  }
  auto nodes = testing::RunCommand({BinPath("yard"), "--coordinator", address_, "nodes"},
                                   {"TRAINYARD_TOKEN=" + alice_token_});
  EXPECT_THAT(nodes.out, HasSubstr("0/2 gpu"));

  // Two ranks, one per GPU, in either order: each sees its own GPU only, by UUID.
  const std::vector<std::string> lines = PrintedDevices(2);
  ASSERT_EQ(lines.size(), 2u);
  std::vector<std::string> devices_seen;
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(lines[r], HasSubstr(absl::StrCat(r, ": rank ", r, ": --device cuda ")));
    EXPECT_THAT(lines[r], HasSubstr("OMP_NUM_THREADS='3'"));
    for (int d = 0; d < 2; ++d) {
      const std::string want =
          absl::StrCat("TRAINYARD_DEVICE='", d, "' CUDA_VISIBLE_DEVICES='", FakeUuid(d), "'");
      if (lines[r].find(want) != std::string::npos) devices_seen.push_back(want);
    }
  }
  std::sort(devices_seen.begin(), devices_seen.end());
  EXPECT_EQ(devices_seen.size(), 2u);
  EXPECT_EQ(std::unique(devices_seen.begin(), devices_seen.end()), devices_seen.end())
      << "two ranks on one GPU";
}

// Devices (issue 52): on cgroup v1 a rank's devices cgroup denies the GPUs it was not given, so a
// rank that ignores CUDA_VISIBLE_DEVICES still cannot open them. Stand-in device nodes with the
// NVIDIA major (195) and minors 0 and 1, mode 0666, no driver behind them: a rank's own gets past
// the cgroup to the missing driver (ENXIO or ENODEV), the other GPU's is refused (EPERM), and so
// is a third (minor 2) that this worker was not given, another worker's say. `minor_of`: each CUDA
// ordinal's device file; `args` and `env` added to the worker's.
void WorkerGpuE2eTest::ExpectEachRankOpensOnlyItsGpusFile(const std::vector<int>& minor_of,
                                                          const std::vector<std::string>& args,
                                                          const std::vector<std::string>& env) {
  if (!CgroupsUsable()) GTEST_SKIP() << "needs root and usable cgroups";
  const trainyard::worker::CgroupHost host = trainyard::worker::DetectCgroups();
  if (host.version != 1 || host.parents.count("devices") == 0) {
    GTEST_SKIP() << "needs the cgroup v1 devices controller";
  }
  ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
  const std::string dev = dir_.path() + "/dev";
  std::filesystem::create_directories(dev);
  ASSERT_EQ(chmod(dev.c_str(), 0755), 0);
  for (int i = 0; i < 3; ++i) {  // nvidia2: a GPU of the host's that this worker does not have
    const std::string node = absl::StrCat(dev, "/nvidia", i);
    ASSERT_EQ(mknod(node.c_str(), S_IFCHR | 0666, makedev(195, i)), 0) << strerror(errno);
    ASSERT_EQ(chmod(node.c_str(), 0666), 0);
  }
  alice_account_ = "nobody";
  std::vector<std::string> worker_args = {
      "--gpus",    "all",     "--cuda-library",     FakeDriver(),
      "--cgroups", "require", "--gpu-device-files", dev + "/nvidia%d"};
  worker_args.insert(worker_args.end(), args.begin(), args.end());
  std::vector<std::string> worker_env = {"FAKE_CUDA_DEVICES=2"};
  worker_env.insert(worker_env.end(), env.begin(), env.end());
  StartWorker(worker_args, worker_env);
  ASSERT_EQ(WaitForDevices(v1::CUDA_GPU, 2).size(), 2u);
  const v1::Job job = RunToEnd(
      *client_,
      CommandSpec("open-gpus", 2,
                  {"/usr/bin/python3", "-c",
                   absl::StrCat("import errno, os\n"
                                "for i in (0, 1, 2):\n"
                                "    try:\n"
                                "        os.close(os.open('",
                                dev,
                                "/nvidia%d' % i, os.O_RDWR))\n"
                                "        got = 'opened'\n"
                                "    except OSError as e:\n"
                                "        got = errno.errorcode[e.errno]\n"
                                "    print('device', os.environ['TRAINYARD_DEVICE'], 'opens', i, "
                                "got, flush=True)\n")}));
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.message();
  int checked = 0;
  for (const std::string& line : Logs(job.id())) {
    for (int own = 0; own < 2; ++own) {
      for (int file = 0; file < 3; ++file) {
        if (!absl::StrContains(line, absl::StrCat("device ", own, " opens ", file, " "))) {
          continue;
        }
        ++checked;
        if (minor_of[own] == file) {
          EXPECT_THAT(line, Not(HasSubstr("EPERM"))) << "a rank could not open its own GPU";
        } else {
          EXPECT_THAT(line, HasSubstr("EPERM")) << "a rank opened another rank's GPU";
        }
      }
    }
  }
  EXPECT_EQ(checked, 6);
}

TEST_F(WorkerGpuE2eTest, ARankCannotOpenTheDeviceFileOfAGpuItWasNotGiven) {
  ExpectEachRankOpensOnlyItsGpusFile({0, 1}, {}, {});
}

// The device file is the GPU's minor number by NVML, not its CUDA ordinal (which
// CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER renumber): here CUDA's GPU 0 is /dev/nvidia1.
TEST_F(WorkerGpuE2eTest, AGpusDeviceFileIsItsMinorByNvml) {
  ExpectEachRankOpensOnlyItsGpusFile({1, 0}, {"--nvml-library", TestBinPath("libfake_nvml.so")},
                                     {"FAKE_NVML_MINORS=1,0"});
}

TEST_F(WorkerGpuE2eTest, AutoOffersGpusOnlyToATrainerThatTrainsOnThem) {
  // The trainer answers --supported-devices: "cpu cuda" gets the GPUs.
  StartWorker({"--cuda-library", FakeDriver()},
              {"FAKE_CUDA_DEVICES=3", "TEST_RANK_SUPPORTED_DEVICES=cpu cuda"});
  EXPECT_EQ(WaitForDevices(v1::CUDA_GPU, 3).size(), 3u);
  worker_->Signal(SIGTERM);
  ASSERT_TRUE(worker_->Wait(absl::Seconds(20)).has_value());

  // A CPU-only trainer (test_rank's default answer, and trainyard-trainer's today): CPU slots, and
  // their ranks see no GPU even where the worker's environment names one.
  StartWorker({"--cuda-library", FakeDriver(), "--threads-per-slot", "3"},
              {"FAKE_CUDA_DEVICES=3", "CUDA_VISIBLE_DEVICES=0"});
  EXPECT_EQ(WaitForDevices(v1::CPU_SLOT, 2).size(), 2u);
  const std::vector<std::string> lines = PrintedDevices(2);
  ASSERT_EQ(lines.size(), 2u);
  for (const std::string& line : lines) {
    EXPECT_THAT(line, HasSubstr("--device cpu "));  // the context names the device
    EXPECT_THAT(line, HasSubstr("CUDA_VISIBLE_DEVICES='' OMP_NUM_THREADS='3'"));
  }
}

TEST_F(WorkerGpuE2eTest, AutoUsesCpuSlotsWhenTheDriverFails) {
  StartWorker({"--cuda-library", FakeDriver()},
              {"FAKE_CUDA_INIT_ERROR=1", "TEST_RANK_SUPPORTED_DEVICES=cpu cuda"});
  EXPECT_EQ(WaitForDevices(v1::CPU_SLOT, 2).size(), 2u);
}

TEST_F(WorkerGpuE2eTest, GpusAllRefusesToStartWithoutGpus) {
  const std::vector<std::string> base = {
      BinPath("trainyard-worker"), "--coordinator", address_,   "--trainer",
      TestBinPath("test_rank"),    "--work-dir",    work_dir(), "--gpus"};
  auto with = [&](std::vector<std::string> extra, std::vector<std::string> env) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    return testing::RunCommand(argv, env, absl::Seconds(30));
  };
  auto no_driver = with({"all", "--cuda-library", dir_.path() + "/no-such-libcuda.so.1"}, {});
  EXPECT_EQ(no_driver.exit_code, 2);
  EXPECT_THAT(no_driver.err, HasSubstr("--gpus all: no CUDA driver: "));
  EXPECT_THAT(no_driver.err, HasSubstr("no-such-libcuda.so.1"));
  auto no_gpu = with({"all", "--cuda-library", FakeDriver()}, {"FAKE_CUDA_DEVICES=0"});
  EXPECT_EQ(no_gpu.exit_code, 2);
  EXPECT_THAT(no_gpu.err, HasSubstr("--gpus all: the CUDA driver shows no GPU"));
  auto failing = with({"all", "--cuda-library", FakeDriver()}, {"FAKE_CUDA_INIT_ERROR=1"});
  EXPECT_EQ(failing.exit_code, 2);
  EXPECT_THAT(failing.err,
              HasSubstr("--gpus all: CUDA driver: cuInit: no CUDA-capable device is detected"));
  auto bad = with({"some"}, {});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--gpus"));
}

// Each GPU's utilization, memory and temperature, read through NVML (tests/fake_nvml.cc standing
// in for libnvidia-ml.so.1) at every heartbeat: on the worker's /metrics, on the coordinator's
// nodes (Device.sample) and in `yard nodes`.
TEST_F(WorkerGpuE2eTest, ExportsEachGpusUtilizationMemoryAndTemperature) {
  StartWorker({"--gpus", "all", "--cuda-library", FakeDriver(), "--nvml-library",
               TestBinPath("libfake_nvml.so"), "--metrics-address", "127.0.0.1:0"},
              {"FAKE_CUDA_DEVICES=2", "FAKE_NVML_UTILIZATION=40", "FAKE_NVML_MEMORY_USED_MIB=2048",
               "FAKE_NVML_TEMPERATURE=60"});
  const std::string line = worker_->ReadLine(absl::Seconds(30)).value_or("");
  ASSERT_TRUE(absl::StartsWith(line, "metrics ")) << line;
  const std::string endpoint = line.substr(8);
  WaitForDevices(v1::CUDA_GPU, 2);
  std::vector<v1::Device> devices;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    devices = Devices();
    if (devices.size() == 2 && devices[0].has_sample() && devices[1].has_sample()) break;
    absl::SleepFor(absl::Milliseconds(50));  // the next heartbeat carries them
  }
  ASSERT_EQ(devices.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(devices[i].has_sample()) << i;
    const v1::DeviceSample& s = devices[i].sample();
    EXPECT_EQ(s.index(), i);
    EXPECT_FLOAT_EQ(s.utilization(), (40 + 2 * i) / 100.0f);
    EXPECT_EQ(s.memory_used_bytes(), int64_t{2048} << 20);
    EXPECT_EQ(s.memory_total_bytes(), int64_t{81559} << 20);
    EXPECT_FLOAT_EQ(s.temperature_celsius(), 60 + i);
    EXPECT_FLOAT_EQ(s.power_watts(), 250);
    EXPECT_GT(s.time_ms(), 0);
  }
  auto nodes = testing::RunCommand({BinPath("yard"), "--coordinator", address_, "nodes"},
                                   {"TRAINYARD_TOKEN=" + alice_token_});
  EXPECT_THAT(nodes.out, HasSubstr("GPU UTIL MEM TEMP"));
  EXPECT_THAT(nodes.out, HasSubstr("41% 4.0 GiB/159.3 GiB 61C"));  // mean, sums, hottest
  auto page = testing::HttpGet(endpoint, "/metrics");
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_THAT(*page,
              HasSubstr(absl::StrCat("trainyard_worker_gpu_utilization_ratio{gpu=\"1\",uuid=\"",
                                     FakeUuid(1), "\"} 0.42")));
  EXPECT_THAT(*page, HasSubstr("trainyard_worker_gpu_memory_used_bytes{gpu=\"0\""));
  EXPECT_THAT(*page, HasSubstr("trainyard_worker_gpu_temperature_celsius{gpu=\"0\""));
  EXPECT_THAT(*page, HasSubstr("trainyard_worker_gpu_power_watts{gpu=\"0\""));
}

// GPU health (tests/fake_nvml.cc's faults): an application's XID is shown but changes nothing; a
// critical XID cordons the node (by "trainyard", naming the GPU and the XID), shows in `yard
// nodes` and the worker's metrics; an admin's uncordon holds while the fault stays the same; a new
// fault (uncorrected ECC errors) cordons it again.
TEST_F(WorkerGpuE2eTest, AGpuFaultCordonsTheNodeAndShowsInYardNodes) {
  const std::string faults = dir_.path() + "/nvml-faults";
  std::ofstream(faults).close();
  StartWorker({"--gpus", "all", "--cuda-library", FakeDriver(), "--nvml-library",
               TestBinPath("libfake_nvml.so"), "--metrics-address", "127.0.0.1:0"},
              {"FAKE_CUDA_DEVICES=2", "FAKE_NVML_FAULT_FILE=" + faults});
  const std::string line = worker_->ReadLine(absl::Seconds(30)).value_or("");
  ASSERT_TRUE(absl::StartsWith(line, "metrics ")) << line;
  const std::string endpoint = line.substr(8);
  WaitForDevices(v1::CUDA_GPU, 2);
  // Node w1 once `done` holds of it (polled: heartbeats every 0.2 s bring the samples).
  auto node_when = [&](std::function<bool(const v1::Node&)> done) {
    v1::Node last;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      auto nodes = client_->ListNodes();
      if (nodes.ok()) {
        for (const auto& n : nodes->nodes()) {
          if (n.id() == "w1") last = n;
        }
        if (last.devices_size() == 2 && done(last)) return last;
      }
      absl::SleepFor(absl::Milliseconds(50));  // no watch API for nodes
    }
    ADD_FAILURE() << "node w1 never got there: " << last.DebugString();
    return last;
  };
  std::ofstream(faults, std::ios::app) << "0 xid 13\n";  // a kernel's illegal access: the app's
  v1::Node n = node_when([](const v1::Node& n) { return n.devices(0).sample().last_xid() == 13; });
  EXPECT_FALSE(n.cordoned());
  EXPECT_EQ(n.devices(0).sample().fault(), "");
  EXPECT_EQ(n.devices(0).sample().ecc_uncorrected_errors(), 0);

  std::ofstream(faults, std::ios::app) << "1 xid 79\n";
  n = node_when([](const v1::Node& n) { return n.cordoned(); });
  EXPECT_EQ(n.cordoned_by(), "trainyard");
  EXPECT_THAT(n.cordon_reason(), HasSubstr("GPU 1 ("));
  EXPECT_THAT(n.cordon_reason(), HasSubstr("XID 79 (the GPU has fallen off the bus)"));
  EXPECT_EQ(n.devices(1).sample().fault(), "XID 79 (the GPU has fallen off the bus)");
  EXPECT_EQ(n.devices(0).sample().fault(), "");
  auto nodes = testing::RunCommand({BinPath("yard"), "--coordinator", address_, "nodes"},
                                   {"TRAINYARD_TOKEN=" + alice_token_});
  EXPECT_THAT(nodes.out, HasSubstr("READY,CORDONED"));
  EXPECT_THAT(nodes.out, HasSubstr("GPU HEALTH"));
  EXPECT_THAT(nodes.out, HasSubstr("GPU 1: XID 79"));
  auto page = testing::HttpGet(endpoint, "/metrics");
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_THAT(*page, HasSubstr(absl::StrCat("trainyard_worker_gpu_healthy{gpu=\"1\",uuid=\"",
                                            FakeUuid(1), "\"} 0")));
  EXPECT_THAT(*page, HasSubstr(absl::StrCat("trainyard_worker_gpu_healthy{gpu=\"0\",uuid=\"",
                                            FakeUuid(0), "\"} 1")));
  EXPECT_THAT(*page, HasSubstr("trainyard_worker_gpu_xid_events_total{gpu=\"1\""));
  EXPECT_THAT(*page, HasSubstr("xid=\"79\"} 1"));

  // An admin puts it back: the same fault does not cordon it again.
  auto admin = ClientOf("admin");
  ASSERT_TRUE(admin->CordonNode("w1", v1::UNCORDON, "").ok());
  const int64_t uncordoned_ms = absl::ToUnixMillis(absl::Now());
  n = node_when([&](const v1::Node& n) {
    return n.devices(1).sample().time_ms() > uncordoned_ms + 1000;  // five heartbeats later
  });
  EXPECT_FALSE(n.cordoned()) << n.cordon_reason();
  // A new fault does.
  std::ofstream(faults, std::ios::app) << "0 ecc 2\n";
  n = node_when([](const v1::Node& n) { return n.cordoned(); });
  EXPECT_THAT(n.cordon_reason(), HasSubstr("GPU 0 (Fake GPU 0"));
  EXPECT_THAT(n.cordon_reason(), HasSubstr("2 uncorrected ECC error(s) since the driver loaded"));
  EXPECT_EQ(n.devices(0).sample().ecc_uncorrected_errors(), 2);
}

// Without NVML (a driver without it, or none at the path given) the GPUs still train; only the
// samples are missing.
TEST_F(WorkerGpuE2eTest, GpusWithoutNvmlHaveNoSamples) {
  StartWorker({"--gpus", "all", "--cuda-library", FakeDriver(), "--nvml-library",
               TestBinPath("libfake_nvml.so")},
              {"FAKE_CUDA_DEVICES=1", "FAKE_NVML_INIT_ERROR=1"});
  const std::vector<v1::Device> devices = WaitForDevices(v1::CUDA_GPU, 1);
  ASSERT_EQ(devices.size(), 1u);
  EXPECT_FALSE(devices[0].has_sample());
  const std::vector<std::string> lines = PrintedDevices(1);
  EXPECT_EQ(lines.size(), 1u);
}

TEST_F(WorkerGpuE2eTest, JobLargerThanTheGpusMemoryIsRefusedAtSubmit) {
  StartWorker({"--gpus", "all", "--cuda-library", FakeDriver()},
              {"FAKE_CUDA_DEVICES=2", "FAKE_CUDA_MEMORY_MIB=64"});
  WaitForDevices(v1::CUDA_GPU, 2);
  v1::JobSpec spec = testing::TinySpec("print-devices", 2);
  spec.mutable_model()->set_n_layer(8);
  spec.mutable_model()->set_d_model(512);
  spec.mutable_model()->set_n_head(8);
  auto job = client_->Submit(spec);
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << job.status();
  EXPECT_THAT(std::string(job.status().message()),
              HasSubstr("but the largest device of any node has 0.06 GiB"));
}

}  // namespace
}  // namespace trainyard
