// What a worker's ended attempts leave on its disk (worker/daemon/attempt_folders.h): their work
// and errors folders emptied as their owner off the launch thread, their whole folder gone once
// unchanged for the keep, and what is live, recent, a shepherd's or not the worker's left alone.
// Real folders; ages set with utimensat, never waited for.
#include "worker/daemon/attempt_folders.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tests/testing/subprocess.h"
#include "worker/daemon/private_tmp.h"

namespace trainyard::worker {
namespace {

namespace fs = std::filesystem;
using testing::BinPath;
using testing::TempDir;

// Sets the modification time of `path` and of everything under it to `age` ago (links not
// followed).
void Age(const std::string& path, absl::Duration age) {
  const timespec when = absl::ToTimespec(absl::Now() - age);
  const timespec times[2] = {when, when};
  std::vector<std::string> paths;
  if (fs::is_directory(fs::symlink_status(path))) {
    for (const auto& e : fs::recursive_directory_iterator(path)) paths.push_back(e.path());
  }
  paths.push_back(path);
  for (const std::string& p : paths) {
    ASSERT_EQ(utimensat(AT_FDCWD, p.c_str(), times, AT_SYMLINK_NOFOLLOW), 0) << p;
  }
}

// An attempt's folder as a worker leaves it once its ranks have ended: spec, logs, a work folder
// with what the ranks wrote (a nested folder), an errors folder.
std::string MakeAttempt(const std::string& work_dir, const std::string& job, int attempt) {
  const std::string dir = work_dir + "/" + job + "/attempt-" + std::to_string(attempt);
  fs::create_directories(dir + "/work/out/deep");
  fs::create_directories(dir + "/errors");
  std::ofstream(dir + "/spec.pb") << "spec";
  std::ofstream(dir + "/rank-0.log") << "line\n";
  std::ofstream(dir + "/work/out/deep/weights.bin") << "weights";
  std::ofstream(dir + "/errors/rank-0.json") << "{}";
  return dir;
}

class AttemptFoldersTest : public ::testing::Test {
 protected:
  AttemptFolderOptions Options(absl::Duration keep) {
    AttemptFolderOptions options;
    options.work_dir = work_dir_;
    options.namespaces = NamespaceFolder(work_dir_);
    options.unpacker = BinPath("trainyard-worker");
    options.unpacker_env = {"PATH=/usr/bin:/bin"};
    options.keep_ended_for = keep;
    return options;
  }
  // The attempts (and jobs: attempt 0) the fake supervisor runs; what it was asked.
  AttemptFolders::IfIdle IfIdle() {
    return [this](const std::string& job, int attempt, const std::function<void()>& then) {
      asked_.emplace(job, attempt);
      if (live_.count({job, attempt}) > 0) return false;
      for (const auto& [j, a] : live_) {
        if (attempt == 0 && j == job) return false;
      }
      if (then) then();
      return true;
    };
  }

  TempDir dir_;
  const std::string work_dir_ = dir_.path() + "/work";
  std::set<std::pair<std::string, int>> live_, asked_;
};

// Unchanged for longer than the keep: the whole attempt's folder goes (its work folder emptied
// first), and its job's folder once nothing is left in it; a job's checkpoints stay, and their
// job's folder with them.
TEST_F(AttemptFoldersTest, AnAttemptUnchangedForTheKeepGoesWholeWithItsEmptyJobFolder) {
  const std::string one = MakeAttempt(work_dir_, "job-1", 1);
  const std::string two = MakeAttempt(work_dir_, "job-2", 3);
  fs::create_directories(work_dir_ + "/job-2/checkpoints/step-10");
  std::ofstream(work_dir_ + "/job-2/checkpoints/step-10/model.pt") << "model";
  if (geteuid() == 0) {  // a rank's folder is its owner's: emptied as them, not as root
    ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
    for (const auto& e : fs::recursive_directory_iterator(one + "/work")) {
      ASSERT_EQ(lchown(e.path().c_str(), 65534, 65534), 0);
    }
    ASSERT_EQ(lchown((one + "/work").c_str(), 65534, 65534), 0);
  }
  Age(work_dir_, absl::Hours(2));
  AttemptFolders folders(Options(absl::Hours(1)), IfIdle());
  EXPECT_EQ(folders.RemoveExpired(), 2);
  EXPECT_FALSE(fs::exists(work_dir_ + "/job-1"));
  EXPECT_FALSE(fs::exists(two));
  EXPECT_TRUE(fs::exists(work_dir_ + "/job-2/checkpoints/step-10/model.pt"));
  EXPECT_TRUE(asked_.count({"job-1", 1}) && asked_.count({"job-1", 0}));
  EXPECT_EQ(folders.RemoveExpired(), 0);
}

// A live attempt, one changed within the keep, one with a shepherd's socket (its rank runs, or
// waits for a worker to collect its exit) and one holding a folder that is not the worker's all
// stay; so does a job folder whose job has an attempt starting; nothing at all with keep.
TEST_F(AttemptFoldersTest, WhatIsLiveRecentAShepherdsOrUnknownStays) {
  const std::string live = MakeAttempt(work_dir_, "job-1", 1);
  const std::string recent = MakeAttempt(work_dir_, "job-1", 2);
  const std::string sock = MakeAttempt(work_dir_, "job-2", 1);
  std::ofstream(sock + "/rank-0.sock") << "";
  const std::string unknown = MakeAttempt(work_dir_, "job-3", 1);
  fs::create_directories(unknown + "/other");
  const std::string old = MakeAttempt(work_dir_, "job-4", 1);
  fs::create_directories(work_dir_ + "/job-4/attempt-2");  // being prepared: its job stays
  live_ = {{"job-1", 1}, {"job-4", 2}};
  Age(work_dir_, absl::Hours(2));
  std::ofstream(recent + "/rank-0.log", std::ios::app) << "more\n";
  AttemptFolders folders(Options(absl::Hours(1)), IfIdle());
  EXPECT_EQ(folders.RemoveExpired(), 1);
  for (const std::string& stays : {live, recent, sock, unknown}) {
    EXPECT_TRUE(fs::exists(stays + "/spec.pb")) << stays;
    EXPECT_TRUE(fs::exists(stays + "/work/out/deep/weights.bin")) << stays;
  }
  EXPECT_FALSE(fs::exists(old));
  EXPECT_TRUE(fs::exists(work_dir_ + "/job-4/attempt-2"));

  // The times of what a rank's owner owns (the work folder, the spec) do not count: set to a
  // future date, they kept the worker's folder for good.
  if (geteuid() == 0) {
    const std::string pinned = MakeAttempt(work_dir_, "job-5", 1);
    for (const auto& e : fs::recursive_directory_iterator(pinned + "/work")) {
      ASSERT_EQ(lchown(e.path().c_str(), 65534, 65534), 0);
    }
    ASSERT_EQ(lchown((pinned + "/work").c_str(), 65534, 65534), 0);
    ASSERT_EQ(lchown((pinned + "/spec.pb").c_str(), 65534, 65534), 0);
    Age(pinned, absl::Hours(2));
    const timespec later = absl::ToTimespec(absl::Now() + absl::Hours(24 * 365));
    const timespec times[2] = {later, later};
    for (const char* theirs : {"/work", "/spec.pb"}) {
      ASSERT_EQ(utimensat(AT_FDCWD, (pinned + theirs).c_str(), times, AT_SYMLINK_NOFOLLOW), 0);
    }
    ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);  // (nobody empties its work folder)
    EXPECT_EQ(folders.RemoveExpired(), 1);
    EXPECT_FALSE(fs::exists(pinned));
  }

  live_.clear();
  AttemptFolderOptions kept = Options(absl::Hours(1));
  kept.keep = true;
  AttemptFolders keep(kept, IfIdle());
  EXPECT_EQ(keep.RemoveExpired(), 0);
  keep.Ended("job-1", 1, std::nullopt);
  keep.Drain();
  EXPECT_TRUE(fs::exists(live + "/work/out/deep/weights.bin"));
  EXPECT_TRUE(fs::exists(recent + "/spec.pb"));
}

// An ended attempt's work and errors folders are emptied and removed on the object's own thread
// (a launch no longer waits on it); its spec and logs stay until the keep.
TEST_F(AttemptFoldersTest, AnEndedAttemptsWorkAndErrorsGoSpecAndLogsStay) {
  const std::string dir = MakeAttempt(work_dir_, "job-1", 1);
  AttemptFolders folders(Options(absl::Hours(1)), IfIdle());
  folders.Ended("job-1", 1, std::nullopt);
  folders.Drain();
  EXPECT_FALSE(fs::exists(dir + "/work"));
  EXPECT_FALSE(fs::exists(dir + "/errors"));
  EXPECT_TRUE(fs::exists(dir + "/spec.pb"));
  EXPECT_TRUE(fs::exists(dir + "/rank-0.log"));
  EXPECT_EQ(folders.RemoveExpired(), 0);  // (changed just now)
  // A rank of it here again (a shepherd's socket: one a restarted worker is adopting, or
  // if_idle says so) keeps it; its own end queues it again.
  const std::string adopting = MakeAttempt(work_dir_, "job-1", 3);
  std::ofstream(adopting + "/rank-1.sock") << "";
  folders.Ended("job-1", 3, std::nullopt);
  const std::string starting = MakeAttempt(work_dir_, "job-1", 4);
  live_ = {{"job-1", 4}};
  folders.Ended("job-1", 4, std::nullopt);
  folders.Drain();
  EXPECT_TRUE(fs::exists(adopting + "/work/out/deep/weights.bin"));
  EXPECT_TRUE(fs::exists(starting + "/work/out/deep/weights.bin"));
  fs::remove(adopting + "/rank-1.sock");
  folders.Ended("job-1", 3, std::nullopt);
  folders.Drain();
  EXPECT_FALSE(fs::exists(adopting + "/work"));
  // Stopped (a worker that detaches), it removes nothing more.
  const std::string next = MakeAttempt(work_dir_, "job-1", 2);
  folders.Stop();
  folders.Ended("job-1", 2, std::nullopt);
  folders.Drain();
  EXPECT_TRUE(fs::exists(next + "/work/out/deep/weights.bin"));
}

// An attempt's namespaces under --private-tmp (private_tmp.h) hold memory (its /dev/shm): a scan
// removes an idle attempt's at once, not when its folder expires (an attempt that ended while no
// worker was there), and leaves a live one's; an ended attempt's go with its tmp folder, and also
// where folders are kept.
TEST_F(AttemptFoldersTest, AnIdleAttemptsNamespacesGoAtOnceAndALiveOnesStay) {
  if (geteuid() != 0) GTEST_SKIP() << "making namespaces needs root";
  if (absl::Status s = CheckMountNamespaces(); !s.ok()) GTEST_SKIP() << s;
  const std::string folder = NamespaceFolder(work_dir_);
  fs::create_directories(work_dir_);
  absl::Cleanup unmount = [&] {
    for (const char* job : {"job-1", "job-2", "job-3"}) {
      RemoveAttemptNamespaces(NamespacesOf(folder, job, 1));
    }
    umount2(folder.c_str(), MNT_DETACH);
  };
  ASSERT_TRUE(PrepareNamespaceFolder(folder).ok());
  const std::string idle = MakeAttempt(work_dir_, "job-1", 1);
  const std::string live = MakeAttempt(work_dir_, "job-2", 1);
  const std::string kept = MakeAttempt(work_dir_, "job-3", 1);
  live_ = {{"job-2", 1}, {"job-3", 1}};
  for (const std::string& dir : {idle, live, kept}) {
    fs::create_directories(dir + "/tmp/out");
    std::ofstream(dir + "/tmp/out/scratch") << "scratch";
  }
  for (const char* job : {"job-1", "job-2", "job-3"}) {
    const absl::Status made = MakeAttemptNamespaces(
        NamespacesOf(folder, job, 1), folder, absl::StrCat(work_dir_, "/", job, "/attempt-1/tmp"),
        65534, 65534, int64_t{1} << 20);
    ASSERT_TRUE(made.ok()) << made;
  }
  auto held = [&folder](const char* job) {
    const AttemptNamespaces ns = NamespacesOf(folder, job, 1);
    return fs::exists(ns.mnt) && fs::exists(ns.ipc);
  };
  AttemptFolders folders(Options(absl::Hours(1)), IfIdle());
  EXPECT_EQ(folders.RemoveExpired(), 0);  // (changed just now)
  EXPECT_FALSE(held("job-1"));
  EXPECT_TRUE(fs::exists(idle + "/tmp/out/scratch"));
  EXPECT_TRUE(held("job-2"));
  // Once expired, the tmp folder goes with the attempt's folder.
  Age(idle, absl::Hours(2));
  EXPECT_EQ(folders.RemoveExpired(), 1);
  EXPECT_FALSE(fs::exists(idle));
  // An ended attempt: its tmp folder emptied and removed, its namespaces gone, at once.
  live_ = {{"job-3", 1}};
  folders.Ended("job-2", 1, std::nullopt);
  folders.Drain();
  EXPECT_FALSE(held("job-2"));
  EXPECT_FALSE(fs::exists(live + "/tmp"));
  EXPECT_TRUE(fs::exists(live + "/rank-0.log"));
  // Kept folders (--keep-work-folders) keep all but the namespaces.
  AttemptFolderOptions keep_options = Options(absl::Hours(1));
  keep_options.keep = true;
  AttemptFolders keeping(keep_options, IfIdle());
  EXPECT_TRUE(held("job-3"));
  live_.clear();
  keeping.Ended("job-3", 1, std::nullopt);
  keeping.Drain();
  EXPECT_FALSE(held("job-3"));
  EXPECT_TRUE(fs::exists(kept + "/tmp/out/scratch"));
}

// The worker's start under --private-tmp makes a trial attempt's namespaces, joins them as a rank
// would and removes them: nothing is left of the trial, and an earlier trial's leftovers (a
// worker killed during one) do not stop it.
TEST_F(AttemptFoldersTest, TheStartsTrialAttemptMakesJoinsAndRemovesItsNamespaces) {
  if (geteuid() != 0) GTEST_SKIP() << "making namespaces needs root";
  if (absl::Status s = CheckMountNamespaces(); !s.ok()) GTEST_SKIP() << s;
  const std::string folder = NamespaceFolder(work_dir_);
  fs::create_directories(work_dir_);
  absl::Cleanup unmount = [&] {
    RemoveAttemptNamespaces(NamespacesOf(folder, "start-check", 0));
    umount2(folder.c_str(), MNT_DETACH);
  };
  ASSERT_TRUE(PrepareNamespaceFolder(folder).ok());
  // Leftovers: the trial's tmp folder with a file in it, its namespace files made and mounted.
  fs::create_directories(work_dir_ + "/.private-tmp-check/old");
  ASSERT_TRUE(MakeAttemptNamespaces(NamespacesOf(folder, "start-check", 0), folder,
                                    work_dir_ + "/.private-tmp-check", 0, 0, 1 << 20)
                  .ok());
  for (int i = 0; i < 2; ++i) {
    const absl::Status tried = TryAttemptNamespaces(work_dir_);
    ASSERT_TRUE(tried.ok()) << tried;
    EXPECT_FALSE(fs::exists(work_dir_ + "/.private-tmp-check"));
    EXPECT_TRUE(fs::is_empty(folder)) << "a trial's namespace file is left in " << folder;
  }
}

// The thread removes expired folders by itself, every quarter of the keep.
TEST_F(AttemptFoldersTest, TheThreadRemovesExpiredFoldersByItself) {
  const std::string dir = MakeAttempt(work_dir_, "job-1", 1);
  Age(work_dir_, absl::Hours(2));
  AttemptFolders folders(Options(absl::Seconds(4)), IfIdle());
  for (const absl::Time deadline = absl::Now() + absl::Seconds(60); fs::exists(dir);) {
    ASSERT_LT(absl::Now(), deadline) << "the expired folder stays";
    absl::SleepFor(absl::Milliseconds(50));
  }
}

// The thread's scan that has many folders to empty (the first after an upgrade may expire every
// old attempt, each up to a minute) lets an attempt that ends meanwhile go first: its folders and
// namespaces waited for the whole scan.
TEST_F(AttemptFoldersTest, TheThreadsScanLetsAnAttemptThatEndsMeanwhileGoFirst) {
  for (int job = 1; job <= 3; ++job) MakeAttempt(work_dir_, "job-" + std::to_string(job), 1);
  Age(work_dir_, absl::Hours(2));
  const std::string ended = MakeAttempt(work_dir_, "job-9", 1);  // recent: not the scan's
  absl::Mutex mu;
  std::vector<std::string> asked;  // "JOB ATTEMPT" (" then": an ended attempt's, or a job's)
  bool triggered = false;
  AttemptFolders* folders_ptr = nullptr;
  AttemptFolders::IfIdle if_idle = [&](const std::string& job, int attempt,
                                       const std::function<void()>& then) {
    bool first = false;
    {
      absl::MutexLock lock(&mu);
      first = !triggered && job != "job-9" && attempt == 1;
      triggered = triggered || first;
      asked.push_back(absl::StrCat(job, " ", attempt, then ? " then" : ""));
    }
    // The scan's first expired attempt: job-9's ends now, while the scan has two more to empty.
    if (first) folders_ptr->Ended("job-9", 1, std::nullopt);
    if (then) then();
    return true;
  };
  AttemptFolders folders(Options(absl::Seconds(4)), if_idle);  // (a scan each second)
  folders_ptr = &folders;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(60);
       fs::exists(work_dir_ + "/job-1") || fs::exists(work_dir_ + "/job-2") ||
       fs::exists(work_dir_ + "/job-3") || fs::exists(ended + "/work");) {
    ASSERT_LT(absl::Now(), deadline) << "the expired folders or the ended attempt's stay";
    absl::SleepFor(absl::Milliseconds(50));
  }
  folders.Stop();
  absl::MutexLock lock(&mu);
  const auto at = [&](const std::string& what) {
    return std::find(asked.begin(), asked.end(), what) - asked.begin();
  };
  const auto first = std::find_if(asked.begin(), asked.end(), [](const std::string& a) {
    return !absl::StartsWith(a, "job-9") && absl::EndsWith(a, " 1");
  });
  ASSERT_NE(first, asked.end()) << absl::StrJoin(asked, ", ");
  const std::string first_job = first->substr(0, first->find(' '));
  const auto i = first - asked.begin();
  // The first expired attempt, its job's folder, then the ended attempt, then the other two.
  EXPECT_EQ(at(first_job + " 0 then"), i + 1) << absl::StrJoin(asked, ", ");
  EXPECT_EQ(at("job-9 1 then"), i + 2) << absl::StrJoin(asked, ", ");
  for (const std::string job : {"job-1", "job-2", "job-3"}) {
    if (job != first_job) {
      EXPECT_GT(at(job + " 1"), i + 2) << absl::StrJoin(asked, ", ");
    }
  }
}

TEST(AttemptShmBytesTest, TheRanksMemoryAtMostHalfTheHostsAndNoneWithoutALimit) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  // Two ranks of 4 GiB on a 64 GiB host: 8 GiB.
  EXPECT_EQ(AttemptShmBytes(4 * kGiB, 2, 64 * kGiB), 8 * kGiB);
  // Ten ranks of 3 GiB on a 24 GiB host (30 GiB between them): the host's half, 12.
  EXPECT_EQ(AttemptShmBytes(3 * kGiB, 10, 24 * kGiB), 12 * kGiB);
  // No memory limit: the kernel's default (half the memory).
  EXPECT_EQ(AttemptShmBytes(0, 4, 24 * kGiB), 0);
  // No overflow; an unknown host size leaves the ranks' memory alone.
  EXPECT_EQ(AttemptShmBytes(std::numeric_limits<int64_t>::max() / 2, 3, 24 * kGiB), 12 * kGiB);
  EXPECT_EQ(AttemptShmBytes(kGiB, 3, 0), 3 * kGiB);
}

}  // namespace
}  // namespace trainyard::worker
