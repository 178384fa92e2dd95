// The whole product on one machine: `yard local up --workers 2 --slots 1` (a coordinator and two
// worker daemons on loopback), a small character-level GPT submitted with `yard submit`, trained
// by two real trainyard-trainer ranks over Gloo. Checks that the loss falls, that logs and
// metrics reach `yard`, that `yard cancel` stops a running job's ranks, and that `yard local down`
// leaves no process behind.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <dirent.h>
#include <signal.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "tests/testing/expect_cli.h"
#include "tests/testing/subprocess.h"

namespace trainyard {
namespace {

using testing::BinPath;
using testing::CommandResult;
using ::testing::ContainsRegex;
using testing::ExpectOneLineFailure;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using testing::RunCommand;
using testing::TempDir;
using testing::TestBinPath;

// Pids of live processes whose command line contains every one of `needles`.
std::vector<pid_t> ProcessesWith(const std::vector<std::string>& needles) {
  std::vector<pid_t> out;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return out;
  while (dirent* e = readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(atoi(e->d_name));
    if (pid <= 0) continue;
    std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"));
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    bool all = !cmdline.empty();
    for (const auto& n : needles) all = all && cmdline.find(n) != std::string::npos;
    // A rank's shepherd (trainyard-worker --shepherd ... -- RANK ARGS) names its rank: it is
    // matched only by a needle of its own.
    if (cmdline.find(" --shepherd ") != std::string::npos &&
        std::find(needles.begin(), needles.end(), "--shepherd") == needles.end()) {
      all = false;
    }
    if (all) out.push_back(pid);
  }
  closedir(proc);
  return out;
}

// Waits (bounded) until no process matches; exits of unrelated processes give no event.
bool NoneLeft(const std::vector<std::string>& needles, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (ProcessesWith(needles).empty()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return ProcessesWith(needles).empty();
}

class ClusterE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_ = dir_.path() + "/cluster";
    std::vector<std::string> args = {
        "local",     "--state-dir", state_,    "up", "--listen",           "127.0.0.1:0",
        "--workers", "2",           "--slots", "1",  "--threads-per-slot", "1",
        "-o",        "json"};
    const std::vector<std::string> extra = ExtraUpFlags();
    args.insert(args.end(), extra.begin(), extra.end());
    CommandResult up = Yard(args);
    ASSERT_EQ(up.exit_code, 0) << up.err;
    address_ = nlohmann::json::parse(up.out).at("coordinator_address").get<std::string>();
  }

  virtual std::vector<std::string> ExtraUpFlags() const { return {}; }

  void TearDown() override {
    Yard({"local", "--state-dir", state_, "down"});
    // Parameter servers carry the coordinator's address, not the state dir.
    const auto servers = ProcessesWith({"trainyard-ps", address_});
    EXPECT_TRUE(servers.empty()) << servers.size() << " parameter servers left behind";
    for (pid_t p : servers) kill(p, SIGKILL);
    // Anything still running from this cluster would be a leak: fail, then clean up.
    const auto left = ProcessesWith({state_});
    EXPECT_TRUE(left.empty()) << left.size() << " processes left behind";
    for (pid_t p : left) kill(p, SIGKILL);
  }

  CommandResult Yard(std::vector<std::string> args, absl::Duration timeout = absl::Seconds(60)) {
    std::vector<std::string> argv = {BinPath("yard")};
    if (!address_.empty()) {
      argv.push_back("--coordinator");
      argv.push_back(address_);
    }
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, YardEnv(), timeout);
  }

  // A HOME of its own: `yard local up` saves the local admin's token there, where the later
  // calls find it, as they would after the README's command.
  std::vector<std::string> YardEnv() const {
    std::vector<std::string> env = {
        "HOME=" + dir_.path(), "XDG_CONFIG_HOME=", "TRAINYARD_TOKEN=", "TRAINYARD_TOKEN_FILE="};
    env.insert(env.end(), extra_env_.begin(), extra_env_.end());
    return env;
  }

  std::string WriteSpec(const std::string& name, int steps, const std::string& strategy = "ddp") {
    const std::string path = dir_.path() + "/" + name + ".yaml";
    std::ofstream(path) << "name: " << name << "\n"
                        << "resources: {gpus: 2}\n"
                        << "model: {kind: gpt, n_layer: 2, n_head: 2, d_model: 64, seq_len: 32, "
                           "vocab: 256}\n"
                        << "data: {path: /usr/share/common-licenses/GPL-3, format: bytes}\n"
                        << "train: {steps: " << steps
                        << ", micro_batch: 8, lr: 3.0e-3, warmup: 5, seed: 1}\n"
                        << "parallel: {strategy: " << strategy << "}\n"
                        << "checkpoint: {every_steps: 0}\n";
    return path;
  }

  // Submits `spec` and waits for the job to succeed; returns its id, or "" after a failure.
  std::string SubmitAndWait(const std::string& spec) {
    CommandResult submit = Yard({"submit", spec});
    EXPECT_EQ(submit.exit_code, 0) << submit.err;
    if (submit.exit_code != 0) return "";
    std::string job(absl::StripAsciiWhitespace(submit.out));
    CommandResult wait = Yard({"wait", job}, absl::Seconds(600));
    EXPECT_EQ(wait.exit_code, 0) << wait.err << Yard({"describe", job}).out;
    return wait.exit_code == 0 ? job : "";
  }

  // `yard metrics -o json` of a finished job of `steps` steps, checking that the mean loss of the
  // last five steps is below 0.75 of the first five's.
  nlohmann::json ExpectLossFell(const std::string& job, size_t steps) {
    CommandResult metrics = Yard({"metrics", job, "-o", "json"});
    EXPECT_EQ(metrics.exit_code, 0) << metrics.err;
    const auto series = nlohmann::json::parse(metrics.out);
    EXPECT_EQ(series.size(), steps) << metrics.out;
    if (series.size() != steps || steps < 10) return series;
    const int n = static_cast<int>(steps);
    const double first = MeanLoss(series, 0, 5), last = MeanLoss(series, n - 5, n);
    EXPECT_LT(last, 0.75 * first) << "loss did not fall: " << first << " -> " << last;
    return series;
  }

  // The mean loss of steps [begin, end) of a `yard metrics -o json` series.
  static double MeanLoss(const nlohmann::json& series, int begin, int end) {
    double sum = 0;
    for (int i = begin; i < end; ++i) sum += series[i]["loss"].get<double>();
    return sum / (end - begin);
  }

  TempDir dir_;
  std::string state_;
  std::string address_;
  std::vector<std::string> extra_env_;  // for yard, and the cluster `yard local up` starts
};

// The PyTorch example as its comment tells a user to run it, `yard submit
// examples/pytorch-ddp.yaml`: a plain Gloo DDP script, its two ranks on two nodes (MASTER_ADDR and
// MASTER_PORT from the coordinator), python3 being the SDK's venv (over Debian's python3-torch),
// so that the loss shows in `yard metrics`.
class PytorchExampleE2eTest : public ClusterE2eTest {
 protected:
  PytorchExampleE2eTest() { extra_env_ = {"PATH=" + SdkBin() + ":/usr/local/bin:/usr/bin:/bin"}; }
  static std::string SdkBin() { return TestBinPath("../sdk-venv/bin"); }
};

TEST_F(PytorchExampleE2eTest, TheExampleTrainsThroughYardOnTwoNodesWithFallingLoss) {
  if (RunCommand({SdkBin() + "/python3", "-c", "import torch, trainyard"}).exit_code != 0) {
    GTEST_SKIP() << "no SDK venv over python3-torch (scripts/setup.sh makes build/sdk-venv)";
  }
  const std::string job =
      SubmitAndWait(std::string(TRAINYARD_SOURCE_DIR) + "/examples/pytorch-ddp.yaml");
  ASSERT_FALSE(job.empty());
  ExpectLossFell(job, 40);
  const std::string logs = Yard({"logs", job}).out;
  EXPECT_THAT(logs, HasSubstr("[rank 0] env RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 "
                              "GROUP_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500"));
  EXPECT_THAT(logs, HasSubstr("[rank 1] env RANK=1 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 "
                              "GROUP_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500"));
  const CommandResult described = Yard({"describe", job});
  EXPECT_THAT(described.out, HasSubstr("python3 pytorch-ddp.py --steps 40"));
  EXPECT_THAT(described.out, HasSubstr(std::string(TRAINYARD_SOURCE_DIR) + "/examples"));
}

TEST_F(ClusterE2eTest, TrainsACharGptWithFallingLossAndStreamsLogsAndMetrics) {
  const std::string job = SubmitAndWait(WriteSpec("char-gpt", 60));
  ASSERT_FALSE(job.empty());

  const auto series = ExpectLossFell(job, 60);
  ASSERT_EQ(series.size(), 60u);
  EXPECT_GT(series[59]["tokens_per_second"].get<double>(), 0);

  CommandResult logs = Yard({"logs", job});
  ASSERT_EQ(logs.exit_code, 0) << logs.err;
  EXPECT_THAT(logs.out, HasSubstr("[rank 0] "));
  EXPECT_THAT(logs.out, HasSubstr("[rank 1] "));
  EXPECT_THAT(logs.out, HasSubstr("step 60/60"));

  CommandResult nodes = Yard({"nodes", "-o", "json"});
  EXPECT_EQ(nlohmann::json::parse(nodes.out).at("nodes").size(), 2u);

  // Its spec asks for no export: nothing to fetch, and nothing written.
  CommandResult fetch = Yard({"fetch", job, "--out", dir_.path() + "/nothing"});
  ExpectOneLineFailure(fetch);
  EXPECT_THAT(fetch.err, HasSubstr(job + " has no export"));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/nothing")) << "the folder it made is gone";

  // Secrets stay in their 0600 files: no log (the coordinator's, the workers', the ranks' output
  // relayed into them), no database page, no checkpoint and no `yard describe` holds a token's
  // secret or a job credential.
  std::vector<std::string> secrets = {"tyj."};
  for (const char* name : {"admin.token", "local-1.token", "local-2.token"}) {
    auto token = ReadSecretFile(state_ + "/" + name);
    ASSERT_TRUE(token.ok()) << token.status();
    secrets.push_back(token->substr(token->rfind('.') + 1));
  }
  CommandResult describe = Yard({"describe", job, "-o", "json"});
  for (const std::string& secret : secrets) {
    EXPECT_THAT(describe.out, Not(HasSubstr(secret)));
  }
  int files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(state_)) {
    const std::string path = entry.path().string();
    if (!entry.is_regular_file() || absl::EndsWith(path, ".token") ||
        absl::EndsWith(path, "/job-credential.key")) {
      continue;
    }
    std::ifstream in(path, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const std::string& secret : secrets) {
      EXPECT_EQ(bytes.find(secret), std::string::npos) << path << " holds a secret";
    }
    ++files;
  }
  EXPECT_GT(files, 5);  // coordinator.log, worker logs, coordinator.db, checkpoints, ...
}

// The LoRA example as its comment tells a user to run it: examples/make_tiny_llama.py writes the
// checkpoint, `yard estimate-memory` and `yard submit` take examples/llama-lora.yaml (its
// model.from pointed at that checkpoint), the loss falls, and the adapter comes out of the job's
// checkpoint in PEFT's layout.
TEST_F(ClusterE2eTest, TheLlamaLoraExampleFineTunesThroughYardAndExportsItsAdapter) {
  const std::string model_dir = dir_.path() + "/tiny-llama";
  CommandResult made =
      RunCommand({"/usr/bin/python3",
                  std::string(TRAINYARD_SOURCE_DIR) + "/examples/make_tiny_llama.py", model_dir},
                 {}, absl::Seconds(120));
  ASSERT_EQ(made.exit_code, 0) << made.out << made.err;
  std::ifstream in(std::string(TRAINYARD_SOURCE_DIR) + "/examples/llama-lora.yaml");
  std::string spec((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_THAT(spec, HasSubstr("from: /tmp/trainyard-tiny-llama"));
  for (size_t at; (at = spec.find("/tmp/trainyard-tiny-llama")) != std::string::npos;) {
    spec.replace(at, 25, model_dir);
  }
  const std::string spec_path = dir_.path() + "/llama-lora.yaml";
  std::ofstream(spec_path) << spec;

  CommandResult estimate = Yard({"estimate-memory", spec_path});
  EXPECT_EQ(estimate.exit_code, 0) << estimate.err;
  EXPECT_THAT(estimate.out, HasSubstr("trainable: LoRA r 8"));

  const std::string job = SubmitAndWait(spec_path);
  ASSERT_FALSE(job.empty());
  ExpectLossFell(job, 60);
  CommandResult logs = Yard({"logs", job});
  EXPECT_THAT(logs.out, HasSubstr("(37376 trainable: LoRA r 8 on q_proj,k_proj,v_proj,o_proj,"));
  EXPECT_THAT(logs.out, HasSubstr("fsdp FULL_SHARD"));

  const auto described = nlohmann::json::parse(Yard({"describe", job, "-o", "json"}).out);
  ASSERT_TRUE(described.contains("last_checkpoint")) << described.dump();
  const std::string checkpoint = described["last_checkpoint"].value("path", "");
  ASSERT_FALSE(checkpoint.empty()) << described.dump();
  const std::string adapter = dir_.path() + "/adapter";
  CommandResult exported = RunCommand({BinPath("trainyard-trainer"), "--export-hf",
                                       std::filesystem::path(checkpoint).parent_path().string(),
                                       "--spec", spec_path, "--out", adapter},
                                      {}, absl::Seconds(120));
  ASSERT_EQ(exported.exit_code, 0) << exported.out << exported.err;
  EXPECT_THAT(exported.out + exported.err, HasSubstr("exported the LoRA adapter of step 60"));
  EXPECT_TRUE(std::filesystem::exists(adapter + "/adapter_model.safetensors"));
  const auto config = nlohmann::json::parse(std::ifstream(adapter + "/adapter_config.json"));
  EXPECT_EQ(config.value("peft_type", ""), "LORA");
  EXPECT_EQ(config.value("base_model_name_or_path", ""), model_dir);

  // The job's own export (checkpoint.export: hf), fetched through the coordinator: the same
  // adapter, byte for byte, as the one made from its last checkpoint.
  const std::string fetched = dir_.path() + "/fetched";
  CommandResult fetch = Yard({"fetch", job, "--out", fetched, "-o", "json"});
  ASSERT_EQ(fetch.exit_code, 0) << fetch.err;
  const auto listed = nlohmann::json::parse(fetch.out);
  ASSERT_EQ(listed["files"].size(), 2u) << fetch.out;
  EXPECT_EQ(listed["files"][0].value("name", ""), "adapter_config.json");
  EXPECT_EQ(listed["files"][1].value("name", ""), "adapter_model.safetensors");
  auto bytes = [](const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  for (const char* file : {"/adapter_config.json", "/adapter_model.safetensors"}) {
    EXPECT_FALSE(bytes(fetched + file).empty()) << file;
    EXPECT_EQ(bytes(fetched + file), bytes(adapter + file)) << file;
  }
  EXPECT_EQ(
      listed["bytes"].get<int64_t>(),
      static_cast<int64_t>(std::filesystem::file_size(fetched + "/adapter_model.safetensors") +
                           std::filesystem::file_size(fetched + "/adapter_config.json")));
  // A folder that holds something already is left alone.
  CommandResult again = Yard({"fetch", job, "--out", fetched});
  ExpectOneLineFailure(again);
  EXPECT_THAT(again.err, HasSubstr("exists and is not an empty folder"));

  // The checkpoint folder is the job owner's: a link they put in it is never followed. A link
  // among the files is not served; the export folder replaced by a link is not found.
  const std::string export_dir =
      std::filesystem::path(checkpoint).parent_path().string() + "/export";
  std::filesystem::create_symlink("/etc/passwd", export_dir + "/passwd");
  CommandResult linked = Yard({"fetch", job, "--out", dir_.path() + "/linked", "-o", "json"});
  ASSERT_EQ(linked.exit_code, 0) << linked.err;
  EXPECT_EQ(nlohmann::json::parse(linked.out)["files"].size(), 2u) << linked.out;
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/linked/passwd"));
  std::filesystem::rename(export_dir, export_dir + ".real");
  std::filesystem::create_directory_symlink(export_dir + ".real", export_dir);
  CommandResult moved = Yard({"fetch", job, "--out", dir_.path() + "/moved"});
  ExpectOneLineFailure(moved);
  EXPECT_THAT(moved.err, HasSubstr("export is not in"));
}

// Code upload (issue 55): `yard submit --gpus 2 -- sh run.sh` in a folder that exists nowhere
// else (removed once submitted) uploads it (the script is here: --context . by default), and both
// ranks, on two workers with work roots of their own, run in its unpacked copy; what .yardignore
// and .git hold stays behind. Once the ranks have ended, each worker removes its copy (the cached
// archive stays). A folder over the limit is refused before anything is sent; another user cannot
// name the upload, nor read its copies on the workers.
TEST_F(ClusterE2eTest, AFolderUploadedAsTheContextRunsOnTwoWorkersThatNeverSawIt) {
  namespace fs = std::filesystem;
  const fs::path project = fs::path(dir_.path()) / "project";
  fs::create_directories(project / "data");
  fs::create_directories(project / ".git");
  std::ofstream(project / "run.sh") << "set -e\n"
                                       "echo \"rank $RANK in $(pwd): $(cat data/greeting.txt) "
                                       "[$(ls -A | tr '\\n' ' ')]\"\n";
  std::ofstream(project / "data/greeting.txt") << "hello from the context";
  std::ofstream(project / ".git/HEAD") << "ref: refs/heads/main\n";
  std::ofstream(project / ".yardignore") << "*.bin\n";
  std::ofstream(project / "weights.bin").close();
  fs::resize_file(project / "weights.bin", int64_t{100} << 20);  // sparse; ignored
  const std::string in_project =
      absl::StrCat("cd '", project.string(), "' && exec '", BinPath("yard"), "' --coordinator ",
                   address_, " submit --gpus 2 --name ctx -- sh run.sh");
  CommandResult submit = RunCommand({"/bin/sh", "-c", in_project}, YardEnv());
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  EXPECT_THAT(submit.err, HasSubstr("uploaded as sha256:"));
  const std::string job(absl::StripAsciiWhitespace(submit.out));
  fs::remove_all(project);

  CommandResult wait = Yard({"wait", job}, absl::Seconds(120));
  ASSERT_EQ(wait.exit_code, 0) << wait.err << Yard({"describe", job}).out;
  const std::string logs = Yard({"logs", job}).out;
  for (int worker : {1, 2}) {
    // Each rank in its own worker's copy (which rank lands where is the scheduler's).
    const std::string work = absl::StrCat(state_, "/worker-", worker, "/", job, "/attempt-1/work");
    EXPECT_THAT(logs, HasSubstr(absl::StrCat(
                          " in ", work, ": hello from the context [.yardignore data run.sh ]")))
        << logs;
    // Its copy goes once its rank has ended (within a few seconds of the job's end); the
    // attempt's spec and the rank's log stay. The cached archive is its owner's alone.
    for (const absl::Time deadline = absl::Now() + absl::Seconds(30); fs::exists(work);) {
      ASSERT_LT(absl::Now(), deadline) << work << " stays";
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_TRUE(fs::exists(fs::path(work).parent_path() / "spec.pb"));
    const fs::path cache = absl::StrCat(state_, "/worker-", worker, "/.contexts");
    EXPECT_EQ(fs::status(cache).permissions() & fs::perms::all, fs::perms::owner_all);
    int archives = 0;
    for (const auto& e : fs::directory_iterator(cache)) {
      ++archives;
      EXPECT_EQ(e.status().permissions() & fs::perms::all,
                fs::perms::owner_read | fs::perms::owner_write);
    }
    EXPECT_EQ(archives, 1);
  }
  const auto described = nlohmann::json::parse(Yard({"describe", job, "-o", "json"}).out);
  const std::string digest = described["spec"]["context"].get<std::string>();
  EXPECT_EQ(digest.rfind("sha256:", 0), 0u) << digest;
  ASSERT_EQ(described["placement"].size(), 2u);
  EXPECT_NE(described["placement"][0]["node_id"], described["placement"][1]["node_id"]);

  // Over the limit: refused by yard before it connects (this coordinator address answers
  // nothing, and the error is the folder's).
  const fs::path big = fs::path(dir_.path()) / "big";
  fs::create_directories(big);
  std::ofstream(big / "train.py") << "print('hi')\n";
  std::ofstream(big / "weights.bin").close();
  fs::resize_file(big / "weights.bin", int64_t{65} << 20);
  CommandResult over = RunCommand({BinPath("yard"), "--coordinator", "127.0.0.1:1", "submit",
                                   "--context", big.string(), "--", "python3", "train.py"},
                                  YardEnv());
  ExpectOneLineFailure(over);
  EXPECT_THAT(over.err, HasSubstr("context: "));
  EXPECT_THAT(over.err, HasSubstr("65.0 MiB of files, at most 64.0 MiB (largest: weights.bin"));
  EXPECT_THAT(over.err, Not(HasSubstr("reach")));

  // Another user cannot run it by its digest.
  ASSERT_EQ(Yard({"admin", "user", "add", "bob"}).exit_code, 0);
  const std::string bob = dir_.path() + "/bob.token";
  ASSERT_EQ(Yard({"admin", "token", "create", "--user", "bob", "--out", bob}).exit_code, 0);
  const std::string spec = dir_.path() + "/bob.yaml";
  std::ofstream(spec) << "name: borrowed\nresources: {gpus: 1}\ncommand: [sh, run.sh]\ncontext: "
                      << digest << "\n";
  CommandResult borrowed = RunCommand(
      {BinPath("yard"), "--coordinator", address_, "--token-file", bob, "submit", spec}, YardEnv());
  ExpectOneLineFailure(borrowed);
  EXPECT_THAT(borrowed.err, HasSubstr("is not a context you uploaded"));
}

// torchrun's --nnodes 2 --nproc-per-node 3 (issue 55): `yard submit --nodes 2 --ranks-per-node 3`
// runs six ranks, three on each of the two workers sharing its one CPU slot, with torchrun's
// numbering, and a Gloo all-reduce over all six agrees.
TEST_F(ClusterE2eTest, RanksPerNodeRunsSeveralRanksOnEachNodeAsTorchrunWould) {
  if (RunCommand({"/usr/bin/python3", "-c", "import torch"}).exit_code != 0) {
    GTEST_SKIP() << "no python3-torch";
  }
  namespace fs = std::filesystem;
  const fs::path project = fs::path(dir_.path()) / "ddp";
  fs::create_directories(project);
  std::ofstream(project / "ddp.py")
      << "import os, torch, torch.distributed as dist\n"
         "dist.init_process_group('gloo')\n"
         "t = torch.tensor([float(dist.get_rank())])\n"
         "dist.all_reduce(t)\n"
         "e = os.environ\n"
         "print(f\"rank {e['RANK']} local {e['LOCAL_RANK']}/{e['LOCAL_WORLD_SIZE']} group \"\n"
         "      f\"{e['GROUP_RANK']}/{e['GROUP_WORLD_SIZE']} world {e['WORLD_SIZE']} sum \"\n"
         "      f\"{t.item():.0f}\")\n"
         "dist.destroy_process_group()\n";
  CommandResult submit =
      Yard({"submit", "--nodes", "2", "--nproc-per-node", "3", "--context", project.string(),
            "--env", "PYTHONDONTWRITEBYTECODE=1", "--", "/usr/bin/python3", "ddp.py"});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string job(absl::StripAsciiWhitespace(submit.out));
  CommandResult wait = Yard({"wait", job}, absl::Seconds(300));
  ASSERT_EQ(wait.exit_code, 0) << wait.err << Yard({"describe", job}).out
                               << Yard({"logs", job}).out;
  const std::string logs = Yard({"logs", job}).out;
  for (int rank = 0; rank < 6; ++rank) {
    EXPECT_THAT(logs, HasSubstr(absl::StrCat("[rank ", rank, "] rank ", rank, " local ", rank % 3,
                                             "/3 group ", rank / 3, "/2 world 6 sum 15")))
        << logs;
  }
  const std::string described = Yard({"describe", job}).out;
  EXPECT_THAT(described, HasSubstr("2 on 2 nodes, 3 ranks each"));
  EXPECT_THAT(described, ContainsRegex("local-[12]\\[0\\] ranks 0-2; local-[12]\\[0\\] ranks 3-5"));
  // Both workers' slots are free again: a job on both runs.
  CommandResult again = Yard({"submit", "--nodes", "2", "--", "/bin/true"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(Yard({"wait", std::string(absl::StripAsciiWhitespace(again.out))}, absl::Seconds(120))
                .exit_code,
            0);
}

TEST_F(ClusterE2eTest, CheckpointsOnRequestResumesAfterAKilledRankAndCancelStopsTheRanks) {
  const std::string spec = WriteSpec("long", 100000);
  {  // one restart allowed
    std::ofstream(spec, std::ios::app) << "max_restarts: 1\n";
  }
  CommandResult submit = Yard({"submit", spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string job(absl::StripAsciiWhitespace(submit.out));
  // `yard metrics -f` prints a line per step when stdout is not a terminal: the first one
  // means both ranks are training.
  {
    auto follow = testing::Subprocess::Start(
        {BinPath("yard"), "--coordinator", address_, "metrics", "-f", job}, YardEnv());
    ASSERT_TRUE(follow.ok());
    auto line = (*follow)->ReadLine(absl::Seconds(300));
    ASSERT_TRUE(line.has_value()) << Yard({"describe", job}).out;
    EXPECT_THAT(*line, HasSubstr("step 1/100000"));
  }
  // The job id alone is not unique across tests running in parallel; the state dir is.
  const std::string job_arg = "/" + job + "/attempt-";  // its ranks' --context files
  EXPECT_EQ(ProcessesWith({"trainyard-trainer", job_arg, state_}).size(), 2u);
  // The ranks got their job credential in the environment: no command line on this machine
  // holds a credential.
  EXPECT_THAT(ProcessesWith({"tyj."}), IsEmpty());
  EXPECT_THAT(ProcessesWith({"tyt."}), IsEmpty());

  // A checkpoint on request is written by the ranks and recorded by the coordinator.
  CommandResult ckpt = Yard({"checkpoint", job});
  ASSERT_EQ(ckpt.exit_code, 0) << ckpt.err;
  EXPECT_EQ(ckpt.out, job + " CHECKPOINTING\n");
  int64_t checkpoint_step = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (checkpoint_step == 0 && absl::Now() < deadline) {
    const auto described = nlohmann::json::parse(Yard({"describe", job, "-o", "json"}).out);
    if (described.contains("last_checkpoint")) {
      checkpoint_step = std::stoll(described["last_checkpoint"]["step"].get<std::string>());
    }
    if (checkpoint_step == 0) absl::SleepFor(absl::Milliseconds(100));  // no event for this
  }
  ASSERT_GT(checkpoint_step, 0) << "no checkpoint recorded";

  // Killing one rank fails the attempt; the next one resumes after the checkpoint.
  const auto rank1 = ProcessesWith({"trainyard-trainer", job_arg, "/rank-1.pb", state_});
  ASSERT_EQ(rank1.size(), 1u);
  kill(rank1[0], SIGKILL);
  int64_t first_step_of_attempt2 = 0;
  const absl::Time resume_deadline = absl::Now() + absl::Seconds(300);
  while (first_step_of_attempt2 == 0 && absl::Now() < resume_deadline) {
    for (const auto& s : nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out)) {
      if (s["attempt"].get<int>() == 2) {
        first_step_of_attempt2 = s["step"].get<int64_t>();
        break;
      }
    }
    if (first_step_of_attempt2 == 0) absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(first_step_of_attempt2, checkpoint_step + 1);
  const auto described = nlohmann::json::parse(Yard({"describe", job, "-o", "json"}).out);
  EXPECT_EQ(described["attempt"].get<int>(), 2);
  EXPECT_THAT(described["message"].get<std::string>(), HasSubstr("exited with code 137"));

  CommandResult cancel = Yard({"cancel", job});
  ASSERT_EQ(cancel.exit_code, 0) << cancel.err;
  EXPECT_EQ(cancel.out, job + " CANCELLED\n");
  EXPECT_TRUE(NoneLeft({"trainyard-trainer", job_arg, state_}, absl::Seconds(30)));
  // The ranks got the cancel's SIGTERM (not only the SIGKILL after the grace): they finished
  // their step, checkpointed and stopped. Their last lines may still be on the way.
  std::string logs;
  const absl::Time logs_deadline = absl::Now() + absl::Seconds(30);
  while (logs.find("(SIGTERM)") == std::string::npos && absl::Now() < logs_deadline) {
    logs = Yard({"logs", job}).out;
    if (logs.find("(SIGTERM)") == std::string::npos) absl::SleepFor(absl::Milliseconds(100));
  }
  const size_t stop = logs.find(" (SIGTERM)");
  ASSERT_NE(stop, std::string::npos) << logs;
  const size_t step_at = logs.rfind("stopping after step ", stop);
  ASSERT_NE(step_at, std::string::npos);
  const std::string stop_step = logs.substr(step_at + 20, stop - step_at - 20);
  EXPECT_THAT(logs, HasSubstr(absl::StrCat("checkpoint step ", stop_step, " path ")));
}

// FSDP through the product path: the workers tell each rank how many of the job's ranks share its
// node, which HYBRID_SHARD shards within (here one rank per worker: replicas across the two).
TEST_F(ClusterE2eTest, TrainsWithFsdpFullAndHybridShardAndReportsModelState) {
  for (const auto& [sharding, group] :
       std::vector<std::pair<std::string, int>>{{"FULL_SHARD", 2}, {"HYBRID_SHARD", 1}}) {
    const std::string name = absl::AsciiStrToLower(sharding);
    const std::string job =
        SubmitAndWait(WriteSpec(name, 30, "fsdp, sharding_strategy: " + sharding));
    ASSERT_FALSE(job.empty()) << sharding;
    const std::string logs = Yard({"logs", job}).out;
    EXPECT_THAT(logs, HasSubstr(absl::StrCat("fsdp ", sharding, ": 3 units, shard group ", group)));
    EXPECT_THAT(logs, HasSubstr("(sharded)"));  // the final checkpoint

    const auto series = nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out);
    ASSERT_EQ(series.size(), 30u);
    const double first = MeanLoss(series, 0, 5), last = MeanLoss(series, 25, 30);
    EXPECT_LT(last, 0.8 * first) << sharding << " loss did not fall: " << first << " -> " << last;
    EXPECT_GT(series[29]["model_state_peak_bytes"].get<int64_t>(), 0);
    EXPECT_GT(series[29]["comm_bytes"].get<int64_t>(), 0);
    EXPECT_THAT(Yard({"metrics", job}).out, HasSubstr("MODEL_STATE"));
  }
}

// MFU through the product path: the worker's TRAINYARD_PEAK_TFLOPS reaches its ranks, whose
// reports carry the MFU; `yard metrics` shows it beside TOK/S (a column, -o json, and -f's line).
class PeakClusterE2eTest : public ClusterE2eTest {
 protected:
  PeakClusterE2eTest() { extra_env_ = {"TRAINYARD_PEAK_TFLOPS=0.002"}; }
};

TEST_F(PeakClusterE2eTest, YardMetricsShowsTheMfuBesideTheTokensPerSecond) {
  const std::string job = SubmitAndWait(WriteSpec("mfu", 6));
  ASSERT_FALSE(job.empty());
  const auto series = nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out);
  ASSERT_EQ(series.size(), 6u);
  for (const auto& step : series) EXPECT_GT(step["mfu"].get<double>(), 0) << step.dump();
  const std::string table = Yard({"metrics", job}).out;
  EXPECT_THAT(table, ::testing::ContainsRegex("TOK/S +MFU +STEP_MS"));
  EXPECT_THAT(table, ::testing::ContainsRegex("\n6 .* [0-9.]+% "));
  EXPECT_THAT(Yard({"metrics", "-f", job}).out,
              ::testing::ContainsRegex("step 6/6 .* mfu [0-9.]+%"));
}

// Pipeline parallelism through the product path: two stages, whose measured bubble `yard
// metrics` shows next to the theory, (P - 1) / (m + P - 1) = 1/5 for 4 micro-batches.
TEST_F(ClusterE2eTest, TrainsAPipelineAndShowsItsBubble) {
  const std::string job =
      SubmitAndWait(WriteSpec("pipeline", 30, "ddp, pipeline_stages: 2, pipeline_schedule: gpipe"));
  ASSERT_FALSE(job.empty());
  const std::string logs = Yard({"logs", job}).out;
  EXPECT_THAT(logs, HasSubstr("pipeline stage 0/2 (blocks 0..0"));
  EXPECT_THAT(logs, HasSubstr(", gpipe, 4 micro-batches, 1 replicas (ddp)"));
  EXPECT_THAT(logs, HasSubstr("(2 pipeline stages)"));  // the final checkpoint

  const auto series = nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out);
  ASSERT_EQ(series.size(), 30u);
  const double first = MeanLoss(series, 0, 5), last = MeanLoss(series, 25, 30);
  EXPECT_LT(last, 0.8 * first) << "loss did not fall: " << first << " -> " << last;
  const auto& step = series[29];
  EXPECT_DOUBLE_EQ(step["pipeline_bubble_theory"].get<double>(), 0.2);
  ASSERT_EQ(step["pipeline_stage_idle"].size(), 2u);
  for (const auto& idle : step["pipeline_stage_idle"]) {
    EXPECT_GT(idle.get<double>(), 0.0);
    EXPECT_LT(idle.get<double>(), 1.0);
  }
  const double bubble = step["pipeline_bubble"].get<double>();
  EXPECT_DOUBLE_EQ(bubble, (step["pipeline_stage_idle"][0].get<double>() +
                            step["pipeline_stage_idle"][1].get<double>()) /
                               2);
  const std::string table = Yard({"metrics", job}).out;
  EXPECT_THAT(table, HasSubstr("BUBBLE (THEORY) [PER STAGE]"));
  EXPECT_THAT(table, HasSubstr(" (0.20) ["));
}

// The product path of an offload job: `yard local up --ps 2` starts two parameter servers, the
// coordinator splits the job's optimizer state over them, the ranks train through them, and the
// servers' memory is free again once the job ends.
class OffloadClusterE2eTest : public ClusterE2eTest {
 protected:
  void SetUp() override {
    unsetenv("TRAINYARD_TCP_CONGESTION");  // the cluster's default, whatever this shell exports
    ClusterE2eTest::SetUp();
  }
  std::vector<std::string> ExtraUpFlags() const override {
    return {"--ps", "2", "--ps-memory-bytes", "268435456"};
  }
};

TEST_F(OffloadClusterE2eTest, TrainsThroughTwoParameterServersAndFreesThemAfterwards) {
  CommandResult nodes = Yard({"nodes"});
  EXPECT_THAT(nodes.out, ::testing::ContainsRegex("local-ps-1 +ps +READY"));
  EXPECT_THAT(nodes.out, ::testing::ContainsRegex("local-ps-2 +ps +READY"));
  const std::string job = SubmitAndWait(WriteSpec("offload", 40, "offload"));
  ASSERT_FALSE(job.empty());

  const auto series = nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out);
  ASSERT_EQ(series.size(), 40u);
  const double first = MeanLoss(series, 0, 5), last = MeanLoss(series, 35, 40);
  EXPECT_LT(last, 0.8 * first) << "loss did not fall: " << first << " -> " << last;
  const std::string logs = Yard({"logs", job}).out;
  EXPECT_THAT(logs, HasSubstr("ps_push_bytes"));
  // A local cluster's parameter-server connections use reno (no pacing on loopback): the servers
  // and the ranks (through their worker's environment) say so.
  EXPECT_THAT(logs, HasSubstr("parameter-server connections: TCP congestion control reno"));
  // Both servers' shares go through their TCP data planes.
  EXPECT_THAT(logs, ::testing::ContainsRegex("parameter-server transfers: [0-9.:]+: data plane "
                                             "[0-9.:]+, [0-9.:]+: data plane [0-9.:]+"));
  for (int i : {1, 2}) {
    std::ifstream log(absl::StrCat(state_, "/ps-", i, ".log"));
    std::stringstream text;
    text << log.rdbuf();
    EXPECT_THAT(text.str(), HasSubstr("TCP congestion control reno"));
  }

  const auto listed = nlohmann::json::parse(Yard({"nodes", "-o", "json"}).out).at("nodes");
  int servers = 0;
  for (const auto& n : listed) {
    if (n.value("role", "") != "PARAMETER_SERVER") continue;
    ++servers;
    EXPECT_TRUE(!n.contains("reserved_bytes") || n["reserved_bytes"] == "0")
        << "shard memory still held: " << n.dump();
  }
  EXPECT_EQ(servers, 2);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A cluster whose coordinator preempts at once (a minimum run time of 1 ms).
class PreemptionClusterE2eTest : public ClusterE2eTest {
 protected:
  std::vector<std::string> ExtraUpFlags() const override {
    return {"--preemption", "--min-run-time", "1ms", "--preemption-grace", "120s"};
  }

  // Loss by step of a `yard metrics -o json` series, the latest attempt's where steps repeat.
  std::map<int64_t, double> LossByStep(const std::string& job) {
    std::map<int64_t, double> out;
    for (const auto& s : nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out)) {
      out[s["step"].get<int64_t>()] = s["loss"].get<double>();
    }
    return out;
  }
};

TEST_F(PreemptionClusterE2eTest, AHigherPriorityJobPreemptsAndTheVictimResumesWithTheSameLosses) {
  const std::string low_spec = WriteSpec("low", 60);
  std::ofstream(low_spec, std::ios::app) << "priority: 10\n";
  CommandResult submit = Yard({"submit", low_spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string low(absl::StripAsciiWhitespace(submit.out));
  {  // both ranks train (the first step is reported)
    auto follow = testing::Subprocess::Start(
        {BinPath("yard"), "--coordinator", address_, "metrics", "-f", low}, YardEnv());
    ASSERT_TRUE(follow.ok());
    ASSERT_TRUE((*follow)->ReadLine(absl::Seconds(120)).has_value())
        << Yard({"describe", low}).out << Yard({"logs", low}).out;
  }
  const std::string high_spec = WriteSpec("high", 10);
  std::ofstream(high_spec, std::ios::app) << "priority: 90\n";
  submit = Yard({"submit", high_spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string high(absl::StripAsciiWhitespace(submit.out));

  // The victim checkpoints, stops and waits: PREEMPTED, its checkpoint recorded.
  nlohmann::json victim;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    victim = nlohmann::json::parse(Yard({"describe", low, "-o", "json"}).out);
    if (victim.value("state", "") == "PREEMPTED" || victim.value("state", "") == "SUCCEEDED") break;
    absl::SleepFor(absl::Milliseconds(100));  // no verb waits for a given state
  }
  ASSERT_EQ(victim.value("state", ""), "PREEMPTED") << victim.dump() << Yard({"logs", low}).out;
  // int64 fields are strings in protobuf's JSON.
  const int64_t checkpoint_step =
      std::stoll(victim["last_checkpoint"].value("step", std::string("0")));
  EXPECT_GT(checkpoint_step, 0);
  EXPECT_THAT(victim.value("message", ""),
              HasSubstr(absl::StrCat("preempted by ", high, " at step ", checkpoint_step,
                                     "; resumes from the checkpoint of step ", checkpoint_step)));

  CommandResult high_done = Yard({"wait", high, "--timeout", "60s"}, absl::Seconds(90));
  ASSERT_EQ(high_done.exit_code, 0)
      << high_done.err << Yard({"describe", high}).out << Yard({"logs", high}).out
      << Yard({"logs", low}).out << Slurp(state_ + "/worker-1.log")
      << Slurp(state_ + "/worker-2.log");
  CommandResult low_done = Yard({"wait", low, "--timeout", "60s"}, absl::Seconds(90));
  ASSERT_EQ(low_done.exit_code, 0) << low_done.err << Yard({"describe", low}).out;
  const auto finished = nlohmann::json::parse(Yard({"describe", low, "-o", "json"}).out);
  EXPECT_EQ(finished.value("attempt", 0), 2);
  EXPECT_EQ(finished.value("restarts", 0), 0);
  EXPECT_EQ(finished.value("preemptions", 0), 1);
  int64_t first_of_attempt2 = 0;
  for (const auto& s : nlohmann::json::parse(Yard({"metrics", low, "-o", "json"}).out)) {
    if (s["attempt"].get<int>() == 2) {
      first_of_attempt2 = s["step"].get<int64_t>();
      break;
    }
  }
  EXPECT_EQ(first_of_attempt2, checkpoint_step + 1) << "no step lost beyond the checkpoint";

  // The same job run without interruption has the same losses, step for step.
  const std::string reference = SubmitAndWait(low_spec);
  ASSERT_FALSE(reference.empty());
  const std::map<int64_t, double> got = LossByStep(low), want = LossByStep(reference);
  ASSERT_EQ(got.size(), 60u);
  ASSERT_EQ(want.size(), 60u);
  for (const auto& [step, loss] : want) {
    EXPECT_NEAR(got.at(step), loss, 1e-4 * std::abs(loss)) << "step " << step;
  }
}

// An operator's maintenance: `yard admin node cordon` keeps new ranks off a node, `drain --wait`
// moves the job running there (it checkpoints, stops and resumes on the other node, losing no
// step and training the same losses as a run never moved) and returns once the node is empty.
// No --preemption needed: a drain is an admin's act, not the scheduler's.
TEST_F(PreemptionClusterE2eTest, CordonKeepsRanksOffAndDrainMovesAJobWithTheSameLosses) {
  // Long enough (several seconds) to be still running when the drain comes, even on a busy host.
  const std::string spec = WriteSpec("moved", 300);
  {
    std::string text = Slurp(spec);
    text.replace(text.find("gpus: 2"), 7, "gpus: 1");
    std::ofstream(spec) << text;
  }
  CommandResult cordon = Yard({"admin", "node", "cordon", "local-1", "--reason", "firmware"});
  ASSERT_EQ(cordon.exit_code, 0) << cordon.err;
  EXPECT_THAT(Yard({"nodes"}).out, HasSubstr("READY,CORDONED"));
  CommandResult submit = Yard({"submit", spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string job(absl::StripAsciiWhitespace(submit.out));
  {  // it trains (its first step is reported)
    auto follow = testing::Subprocess::Start(
        {BinPath("yard"), "--coordinator", address_, "metrics", "-f", job}, YardEnv());
    ASSERT_TRUE(follow.ok());
    ASSERT_TRUE((*follow)->ReadLine(absl::Seconds(120)).has_value())
        << Yard({"describe", job}).out << Yard({"logs", job}).out;
  }
  auto placed_on = [&] {
    const auto j = nlohmann::json::parse(Yard({"describe", job, "-o", "json"}).out);
    return j.contains("placement") ? j["placement"][0].value("node_id", "") : std::string();
  };
  EXPECT_EQ(placed_on(), "local-2") << "local-1 is cordoned";

  ASSERT_EQ(Yard({"admin", "node", "uncordon", "local-1"}).exit_code, 0);
  CommandResult drain = Yard({"admin", "node", "drain", "local-2", "--wait", "--timeout", "120s"},
                             absl::Seconds(150));
  ASSERT_EQ(drain.exit_code, 0) << drain.err << Yard({"describe", job}).out;
  EXPECT_THAT(drain.out, HasSubstr("draining local-2: moving " + job));
  EXPECT_THAT(drain.out, HasSubstr("drained local-2: it runs no ranks"));
  EXPECT_THAT(Yard({"nodes"}).out, HasSubstr("READY,DRAINED"));

  CommandResult done = Yard({"wait", job, "--timeout", "120s"}, absl::Seconds(150));
  ASSERT_EQ(done.exit_code, 0) << done.err << Yard({"describe", job}).out
                               << Yard({"logs", job}).out;
  const auto finished = nlohmann::json::parse(Yard({"describe", job, "-o", "json"}).out);
  EXPECT_EQ(finished.value("attempt", 0), 2);
  EXPECT_EQ(finished.value("preemptions", 0), 1);
  EXPECT_EQ(finished.value("restarts", 0), 0);
  const int64_t checkpoint_step =
      std::stoll(finished["last_checkpoint"].value("step", std::string("0")));
  int64_t first_of_attempt2 = 0;
  for (const auto& s : nlohmann::json::parse(Yard({"metrics", job, "-o", "json"}).out)) {
    if (s["attempt"].get<int>() == 2) {
      first_of_attempt2 = s["step"].get<int64_t>();
      break;
    }
  }
  EXPECT_GT(first_of_attempt2, 1) << "it resumed from a checkpoint, not from the start";
  EXPECT_LE(first_of_attempt2, checkpoint_step + 1);

  // The same job never moved (on local-1: local-2 stays drained) has the same losses.
  const std::string reference = SubmitAndWait(spec);
  ASSERT_FALSE(reference.empty());
  const std::map<int64_t, double> got = LossByStep(job), want = LossByStep(reference);
  ASSERT_EQ(got.size(), 300u);
  ASSERT_EQ(want.size(), 300u);
  for (const auto& [step, loss] : want) {
    EXPECT_NEAR(got.at(step), loss, 1e-4 * std::abs(loss)) << "step " << step;
  }
}

TEST_F(PreemptionClusterE2eTest, AVictimThatDoesNotStopIsKilledAfterItsGraceAndResumes) {
  // A victim with a periodic checkpoint and a grace of its own (1 s) whose ranks hang (stopped
  // with SIGSTOP, as a rank stuck in a collective would): it is killed after its grace and the
  // worker's stop grace, shows PREEMPTED, and resumes from its last periodic checkpoint.
  const std::string low_spec = WriteSpec("stuck", 200);
  {
    std::string text = Slurp(low_spec);
    text.replace(text.find("every_steps: 0"), 14, "every_steps: 5");
    std::ofstream(low_spec) << text << "priority: 10\npreemption_grace: 1s\n";
  }
  CommandResult submit = Yard({"submit", low_spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string low(absl::StripAsciiWhitespace(submit.out));
  auto json = [&](const std::string& job) {
    return nlohmann::json::parse(Yard({"describe", job, "-o", "json"}).out);
  };
  auto checkpoint_step = [](const nlohmann::json& j) {
    return j.contains("last_checkpoint")
               ? std::stoll(j["last_checkpoint"].value("step", std::string("0")))
               : int64_t{0};
  };
  absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (absl::Now() < deadline && checkpoint_step(json(low)) < 5) {
    absl::SleepFor(absl::Milliseconds(50));  // no verb waits for a checkpoint
  }
  ASSERT_GE(checkpoint_step(json(low)), 5) << Yard({"describe", low}).out;
  // Its ranks stop answering (the rank processes' command lines hold the attempt's folder; their
  // shepherds' name it too, after trainyard-worker --shepherd).
  const std::string ranks = absl::StrCat("^[^ ]*trainyard-trainer .*/", low, "/attempt-1/");
  ASSERT_EQ(testing::RunCommand({"/usr/bin/pkill", "-STOP", "-f", ranks}).exit_code, 0);

  const std::string high_spec = WriteSpec("urgent", 10);
  std::ofstream(high_spec, std::ios::app) << "priority: 90\n";
  submit = Yard({"submit", high_spec});
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  const std::string high(absl::StripAsciiWhitespace(submit.out));
  nlohmann::json victim;
  deadline = absl::Now() + absl::Seconds(90);
  while (absl::Now() < deadline) {
    victim = json(low);
    if (victim.value("state", "") == "PREEMPTED") break;
    absl::SleepFor(absl::Milliseconds(100));  // no verb waits for a given state
  }
  // A stopped process ignores SIGTERM: the worker's SIGKILL ended it.
  testing::RunCommand({"/usr/bin/pkill", "-CONT", "-f", ranks});
  ASSERT_EQ(victim.value("state", ""), "PREEMPTED") << victim.dump();
  // The last checkpoint on disk is where it resumes: a periodic one, the coordinator's record of
  // it or a later one whose report the stopped ranks never sent.
  const std::string latest_file =
      std::filesystem::path(victim["last_checkpoint"].value("path", "")).parent_path().string() +
      "/latest";
  const std::string latest_text = Slurp(latest_file);
  absl::string_view latest_name = absl::StripAsciiWhitespace(latest_text);
  int64_t periodic = 0;
  ASSERT_TRUE(absl::ConsumePrefix(&latest_name, "step-") &&
              absl::SimpleAtoi(latest_name, &periodic))
      << latest_file << ": " << latest_text;
  EXPECT_GE(periodic, checkpoint_step(victim));
  EXPECT_EQ(periodic % 5, 0) << "the last checkpoint is a periodic one";

  CommandResult high_done = Yard({"wait", high, "--timeout", "120s"}, absl::Seconds(150));
  ASSERT_EQ(high_done.exit_code, 0) << high_done.err << Yard({"describe", high}).out;
  CommandResult low_done = Yard({"wait", low, "--timeout", "120s"}, absl::Seconds(150));
  ASSERT_EQ(low_done.exit_code, 0) << low_done.err << Yard({"describe", low}).out;
  const nlohmann::json finished = json(low);
  EXPECT_EQ(finished.value("preemptions", 0), 1);
  EXPECT_EQ(finished.value("restarts", 0), 0);
  int64_t first_of_attempt2 = 0;
  for (const auto& step : nlohmann::json::parse(Yard({"metrics", low, "-o", "json"}).out)) {
    if (step["attempt"].get<int>() == 2) {
      first_of_attempt2 = step["step"].get<int64_t>();
      break;
    }
  }
  EXPECT_EQ(first_of_attempt2, periodic + 1) << "resumed from the last periodic checkpoint";
  const std::string logs = Yard({"logs", low}).out;
  EXPECT_THAT(logs, Not(HasSubstr("stopping after step"))) << "it never heard the request";
  // (Not its "checkpoint step N" line: the ranks may have been stopped between publishing the
  // checkpoint and logging it, as a CI run once saw.)
  EXPECT_THAT(logs, HasSubstr(absl::StrCat(
                        "resumed from ", std::filesystem::path(latest_file).parent_path().string(),
                        "/step-", periodic, " at step ", periodic)));
}

}  // namespace
}  // namespace trainyard
