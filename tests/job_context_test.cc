// The worker's side of a job's context (worker/daemon/job_context.h): the cache of fetched
// archives (checked against their digest on every use, refetched when damaged, old ones removed),
// and unpacking through trainyard-worker --unpack-context as the job's owner.
#include "worker/daemon/job_context.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/time/clock.h"
#include "common/context_archive.h"
#include "tests/testing/subprocess.h"

namespace trainyard::worker {
namespace {

namespace fs = std::filesystem;
using testing::BinPath;
using ::testing::HasSubstr;
using testing::TempDir;

// An archive of one file, hello.txt.
PackedContext OneFile(const std::string& text) {
  TempDir src;
  std::ofstream(src.path() + "/hello.txt") << text;
  auto packed = PackContext(src.path());
  EXPECT_TRUE(packed.ok()) << packed.status();
  return *packed;
}

TEST(ContextCacheTest, FetchesOnceChecksEveryUseAndRefetchesADamagedCopy) {
  TempDir dir;
  const PackedContext context = OneFile("hi");
  int fetches = 0;
  std::string served = context.archive;
  ContextCache cache(dir.path() + "/cache", [&](const std::string& job) {
    EXPECT_EQ(job, "job-1");
    ++fetches;
    return absl::StatusOr<std::string>(served);
  });
  auto got = cache.Get("job-1", context.digest);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, context.archive);
  EXPECT_EQ(cache.Get("job-1", context.digest).value_or(""), context.archive);
  EXPECT_EQ(fetches, 1);
  EXPECT_EQ(fs::status(cache.dir()).permissions() & fs::perms::all, fs::perms::owner_all);
  const fs::path copy = cache.dir() + "/" + context.digest.substr(7) + ".tar.gz";
  EXPECT_EQ(fs::status(copy).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);

  // A damaged copy is not used: fetched again.
  std::ofstream(copy, std::ios::binary) << "damaged";
  EXPECT_EQ(cache.Get("job-1", context.digest).value_or(""), context.archive);
  EXPECT_EQ(fetches, 2);

  // What the coordinator sends must be what the spec names.
  served = OneFile("other").archive;
  const PackedContext wanted = OneFile("wanted");
  auto wrong = cache.Get("job-1", wanted.digest);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong.status().message(), HasSubstr("is not " + wanted.digest));
  EXPECT_FALSE(fs::exists(cache.dir() + "/" + wanted.digest.substr(7) + ".tar.gz"));
}

TEST(ContextCacheTest, ArchivesUnusedForTheirKeepAreRemovedWhenAnotherIsFetched) {
  TempDir dir;
  const PackedContext a = OneFile("a"), b = OneFile("b");
  ContextCache cache(
      dir.path(),
      [&](const std::string& job) {
        return absl::StatusOr<std::string>(job == "a" ? a.archive : b.archive);
      },
      absl::Hours(1));
  ASSERT_TRUE(cache.Get("a", a.digest).ok());
  const fs::path old = dir.path() + "/" + a.digest.substr(7) + ".tar.gz";
  fs::last_write_time(old, fs::file_time_type::clock::now() - std::chrono::hours(2));
  ASSERT_TRUE(cache.Get("b", b.digest).ok());
  EXPECT_FALSE(fs::exists(old));
  EXPECT_TRUE(fs::exists(dir.path() + "/" + b.digest.substr(7) + ".tar.gz"));
}

TEST(UnpackContextAsTest, UnpacksThroughTheWorkerBinaryAsTheOwner) {
  TempDir dir;
  const PackedContext context = OneFile("hello");
  const std::string dest = dir.path() + "/work";
  fs::create_directories(dest);
  ASSERT_TRUE(
      UnpackContextAs(BinPath("trainyard-worker"), {}, context.archive, dest, nullptr).ok());
  std::ifstream in(dest + "/hello.txt");
  std::string text;
  in >> text;
  EXPECT_EQ(text, "hello");
  // Again into the same folder (a worker that restarted before the ranks started): what was
  // there goes first.
  fs::create_directories(dest + "/stale/deeper");
  std::ofstream(dest + "/stale/deeper/left.txt") << "from before";
  ASSERT_TRUE(
      UnpackContextAs(BinPath("trainyard-worker"), {}, context.archive, dest, nullptr).ok());
  EXPECT_FALSE(fs::exists(dest + "/stale"));
  EXPECT_TRUE(fs::exists(dest + "/hello.txt"));
  EXPECT_THAT(
      std::string(
          UnpackContextAs(BinPath("trainyard-worker"), {}, "junk", dest, nullptr).message()),
      HasSubstr("not gzip"));

  if (geteuid() != 0) GTEST_SKIP() << "switching accounts needs root";
  // As root, it unpacks as the owner (nobody): into nobody's folder, files nobody's; into a folder
  // of root's it cannot write.
  UnixAccount nobody;
  nobody.uid = 65534;
  nobody.gid = 65534;
  ASSERT_EQ(chmod(dir.path().c_str(), 0755), 0);
  const std::string theirs = dir.path() + "/theirs";
  fs::create_directories(theirs);
  ASSERT_EQ(chown(theirs.c_str(), nobody.uid, nobody.gid), 0);
  ASSERT_TRUE(
      UnpackContextAs(BinPath("trainyard-worker"), {}, context.archive, theirs, &nobody).ok());
  struct stat st;
  ASSERT_EQ(stat((theirs + "/hello.txt").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, nobody.uid);
  const std::string roots = dir.path() + "/roots";
  fs::create_directories(roots);
  ASSERT_EQ(chmod(roots.c_str(), 0700), 0);
  EXPECT_THAT(
      std::string(UnpackContextAs(BinPath("trainyard-worker"), {}, context.archive, roots, &nobody)
                      .message()),
      HasSubstr("Permission denied"));
  EXPECT_FALSE(fs::exists(roots + "/hello.txt"));
}

// An ended attempt's work folder is emptied as its owner: everything in it goes, a link's target
// outside it stays; as root for nobody, a file nobody cannot remove (in a folder of root's) stays
// and the emptying says so.
TEST(EmptyFolderAsTest, EmptiesAsTheOwnerWithoutFollowingLinks) {
  TempDir dir;
  const std::string work = dir.path() + "/work", outside = dir.path() + "/outside";
  fs::create_directories(work + "/a/b");
  fs::create_directories(outside);
  std::ofstream(work + "/a/b/c.txt") << "c";
  std::ofstream(outside + "/keep.txt") << "keep";
  fs::create_directory_symlink(outside, work + "/link");
  ASSERT_TRUE(EmptyFolderAs(BinPath("trainyard-worker"), {}, work, nullptr).ok());
  EXPECT_TRUE(fs::is_empty(work));
  EXPECT_TRUE(fs::exists(outside + "/keep.txt"));

  if (geteuid() != 0) GTEST_SKIP() << "switching accounts needs root";
  UnixAccount nobody;
  nobody.uid = 65534;
  nobody.gid = 65534;
  ASSERT_EQ(chmod(dir.path().c_str(), 0755), 0);
  fs::create_directories(work + "/roots");
  std::ofstream(work + "/roots/file") << "root's";
  std::ofstream(work + "/theirs") << "nobody's";
  ASSERT_EQ(chown(work.c_str(), nobody.uid, nobody.gid), 0);
  ASSERT_EQ(chown((work + "/theirs").c_str(), nobody.uid, nobody.gid), 0);
  const absl::Status s = EmptyFolderAs(BinPath("trainyard-worker"), {}, work, &nobody);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cannot empty " + work)) << s;
  EXPECT_FALSE(fs::exists(work + "/theirs"));
  EXPECT_TRUE(fs::exists(work + "/roots/file"));
}

// The unpacker runs as the job's owner, who may stop it: the worker's launch thread, which waits
// for it, gives up within the timeout and kills it (it waited forever, and no later rank of any
// user started on the node).
TEST(UnpackContextAsTest, AnUnpackerThatStopsIsKilledAtTheTimeout) {
  TempDir dir;
  const std::string stub = dir.path() + "/stops";
  std::ofstream(stub) << "#!/bin/sh\necho $$ > " << dir.path() << "/pid\nkill -STOP $$\n";
  ASSERT_EQ(chmod(stub.c_str(), 0755), 0);
  fs::create_directories(dir.path() + "/work");
  const absl::Time start = absl::Now();
  const absl::Status s = UnpackContextAs(stub, {"PATH=/usr/bin:/bin"}, OneFile("x").archive,
                                         dir.path() + "/work", nullptr, absl::Seconds(3));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("did not finish within 3s"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  pid_t pid = 0;
  std::ifstream(dir.path() + "/pid") >> pid;  // (none if it was killed before it wrote it)
  if (pid > 0) {
    EXPECT_NE(kill(pid, 0), 0) << "the unpacker still runs (or was not reaped)";
  }
}

}  // namespace
}  // namespace trainyard::worker
