// A job's context archive (common/context_archive.h): packing a folder with its ignore files,
// unpacking it, GNU tar reading and writing the same format, and archives a hostile user could
// upload instead.
#include "common/context_archive.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_format.h"
#include "tests/testing/subprocess.h"

namespace trainyard {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::RunCommand;
using testing::TempDir;

void Write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}
std::string Read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Every file and folder under `root`, relative, sorted ("dir/" for folders).
std::vector<std::string> Tree(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    std::string rel = fs::relative(e.path(), root).string();
    out.push_back(e.is_directory() ? rel + "/" : rel);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// One raw ustar entry, as a hostile client could write it (`type`: '0' file, '5' folder, '2'
// link, ...).
std::string RawEntry(const std::string& name, char type, const std::string& data = "") {
  std::string h(512, '\0');
  std::memcpy(&h[0], name.data(), std::min<size_t>(name.size(), 100));
  std::memcpy(&h[100], "0000644", 7);
  std::memcpy(&h[108], "0000000", 7);
  std::memcpy(&h[116], "0000000", 7);
  const std::string size = absl::StrFormat("%011o", data.size());
  std::memcpy(&h[124], size.data(), 11);
  std::memcpy(&h[136], "00000000000", 11);
  h[156] = type;
  if (type == '2') std::memcpy(&h[157], "/etc/passwd", 11);
  std::memcpy(&h[257], "ustar", 6);
  std::memcpy(&h[263], "00", 2);
  std::memset(&h[148], ' ', 8);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  const std::string chk = absl::StrFormat("%06o", sum);
  std::memcpy(&h[148], chk.data(), 6);
  h[154] = '\0';
  std::string out = h + data;
  out.resize((out.size() + 511) / 512 * 512, '\0');
  return out;
}

std::string GzipTar(const std::string& entries) {
  const std::string tar = entries + std::string(1024, '\0');
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, tar.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(tar.data()));
  z.avail_in = static_cast<uInt>(tar.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

TEST(ContextArchiveTest, PacksAFolderAndUnpacksItWithItsIgnoreFilesApplied) {
  TempDir src, dest;
  const fs::path s(src.path());
  Write(s / "train.py", "print('hi')\n");
  Write(s / "run.sh", "#!/bin/sh\necho run\n");
  fs::permissions(s / "run.sh", fs::perms::owner_all, fs::perm_options::add);
  Write(s / "pkg/model.py", "x = 1\n");
  Write(s / "pkg/deep/more/weights.txt", std::string(5000, 'w'));
  Write(s / "data/big.bin", std::string(100, 'd'));  // ignored folder
  Write(s / "data2/keep.txt", "kept");               // "data/" is anchored to no folder: kept
  Write(s / "notes.log", "log");                     // *.log
  Write(s / "important.log", "kept");                // !important.log
  Write(s / "pkg/__pycache__/model.pyc", "pyc");     // __pycache__/ at any depth
  Write(s / "sub/data/x.txt", "x");                  // /data/ only at the root: kept
  Write(s / ".git/config", "git");                   // never packed
  Write(s / ".gitignore", "# comment\n*.log\n!important.log\n__pycache__/\n");
  Write(s / ".yardignore", "/data/\n");
  fs::create_symlink("/etc/passwd", s / "link");

  auto packed = PackContext(src.path());
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_TRUE(IsContextDigest(packed->digest)) << packed->digest;
  EXPECT_EQ(packed->digest, ContextDigest(packed->archive));
  EXPECT_THAT(packed->skipped_links, ElementsAre("link"));
  EXPECT_EQ(packed->files, 9);

  ASSERT_TRUE(UnpackContext(packed->archive, dest.path()).ok());
  const fs::path d(dest.path());
  EXPECT_THAT(Tree(d), ElementsAre(".gitignore", ".yardignore", "data2/", "data2/keep.txt",
                                   "important.log", "pkg/", "pkg/deep/", "pkg/deep/more/",
                                   "pkg/deep/more/weights.txt", "pkg/model.py", "run.sh", "sub/",
                                   "sub/data/", "sub/data/x.txt", "train.py"));
  EXPECT_EQ(Read(d / "pkg/deep/more/weights.txt"), std::string(5000, 'w'));
  EXPECT_EQ(Read(d / "train.py"), "print('hi')\n");
  EXPECT_NE(fs::status(d / "run.sh").permissions() & fs::perms::owner_exec, fs::perms::none);
  EXPECT_EQ(fs::status(d / "train.py").permissions() & fs::perms::owner_exec, fs::perms::none);

  // The same folder packs to the same bytes: one digest, one upload and one cached copy.
  auto again = PackContext(src.path());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->digest, packed->digest);
  Write(s / "train.py", "print('changed')\n");
  EXPECT_NE(PackContext(src.path())->digest, packed->digest);
}

TEST(ContextArchiveTest, GnuTarReadsItAndWritesWhatItUnpacks) {
  TempDir src, dest, tar_dest;
  const std::string long_dir = std::string(90, 'a') + "/" + std::string(90, 'b');
  Write(fs::path(src.path()) / long_dir / "file.txt", "long names");  // ustar's prefix field
  Write(fs::path(src.path()) / "top.txt", "top");
  auto packed = PackContext(src.path());
  ASSERT_TRUE(packed.ok()) << packed.status();
  const std::string archive = tar_dest.path() + "/context.tar.gz";
  std::ofstream(archive, std::ios::binary) << packed->archive;
  auto listed = RunCommand({"/usr/bin/tar", "-xzf", archive, "-C", dest.path()});
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_EQ(Read(fs::path(dest.path()) / long_dir / "file.txt"), "long names");

  // What GNU tar writes in the ustar format, the unpacker reads.
  TempDir made;
  auto written = RunCommand(
      {"/usr/bin/tar", "--format=ustar", "-czf", made.path() + "/t.tar.gz", "-C", src.path(), "."});
  ASSERT_EQ(written.exit_code, 0) << written.err;
  TempDir out;
  ASSERT_TRUE(UnpackContext(Read(made.path() + "/t.tar.gz"), out.path()).ok());
  EXPECT_EQ(Read(fs::path(out.path()) / "top.txt"), "top");
}

TEST(ContextArchiveTest, AFolderOverTheLimitIsRefusedNamingItsLargestFiles) {
  TempDir src;
  Write(fs::path(src.path()) / "weights.bin", std::string(3000, 'x'));
  Write(fs::path(src.path()) / "train.py", "print()\n");
  auto packed = PackContext(src.path(), 2048);
  ASSERT_FALSE(packed.ok());
  EXPECT_EQ(packed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(packed.status().message(), HasSubstr("context: "));
  EXPECT_THAT(packed.status().message(), HasSubstr("weights.bin"));
  EXPECT_THAT(packed.status().message(), HasSubstr(".yardignore"));
  // Ignored, it fits.
  Write(fs::path(src.path()) / ".yardignore", "*.bin\n");
  EXPECT_TRUE(PackContext(src.path(), 2048).ok());
  EXPECT_FALSE(PackContext(src.path() + "/missing").ok());
}

TEST(ContextArchiveTest, HostileArchivesAreRefusedWithoutWritingOutside) {
  TempDir root;
  const fs::path dest = fs::path(root.path()) / "dest";
  fs::create_directories(dest);
  struct Case {
    std::string archive;
    std::string says;
  };
  const std::vector<Case> cases = {
      {GzipTar(RawEntry("../escape.txt", '0', "x")), "'../escape.txt'"},
      {GzipTar(RawEntry("a/../../escape.txt", '0', "x")), ".. part"},
      {GzipTar(RawEntry("/tmp/abs.txt", '0', "x")), "not a relative name"},
      {GzipTar(RawEntry("link", '2')), "neither a file nor a folder"},
      {GzipTar(RawEntry("hard", '1')), "neither a file nor a folder"},
      {GzipTar(RawEntry("dev", '3')), "neither a file nor a folder"},
      {GzipTar(RawEntry("twice", '0', "a") + RawEntry("twice", '0', "b")), "twice: File exists"},
      {GzipTar(RawEntry("big", '0', std::string(4096, 'b'))), "more than"},
      {"not gzip at all", "not gzip"},
      {GzipTar(RawEntry("cut", '0', "x")).substr(0, 20), "the context's archive"},
  };
  for (const Case& c : cases) {
    absl::Status s = UnpackContext(c.archive, dest.string(), 2048);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << c.says << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says));
  }
  EXPECT_FALSE(fs::exists(fs::path(root.path()) / "escape.txt"));
  EXPECT_FALSE(fs::exists("/tmp/abs.txt"));

  // A link planted in the destination is not followed.
  TempDir planted;
  fs::create_symlink(root.path(), fs::path(planted.path()) / "sub");
  absl::Status s = UnpackContext(GzipTar(RawEntry("sub/file.txt", '0', "x")), planted.path(), 2048);
  EXPECT_THAT(s.message(), HasSubstr("not a folder"));
  EXPECT_FALSE(fs::exists(fs::path(root.path()) / "file.txt"));

  EXPECT_FALSE(IsContextDigest("sha256:ABC"));
  EXPECT_FALSE(IsContextDigest(std::string("sha256:") + std::string(64, 'g')));
  EXPECT_TRUE(IsContextDigest(std::string("sha256:") + std::string(64, 'a')));
}

TEST(ContextArchiveTest, IgnoreRulesFollowGit) {
  auto rules = ParseIgnoreRules("build/\n/top.txt\n**/cache\n*.o\n!keep.o\n\\#hash\n");
  EXPECT_TRUE(Ignored(rules, "build", true));
  EXPECT_FALSE(Ignored(rules, "build", false));  // a file named build
  EXPECT_TRUE(Ignored(rules, "a/b/build", true));
  EXPECT_TRUE(Ignored(rules, "top.txt", false));
  EXPECT_FALSE(Ignored(rules, "sub/top.txt", false));
  EXPECT_TRUE(Ignored(rules, "x/y/cache", false));
  EXPECT_TRUE(Ignored(rules, "x/main.o", false));
  EXPECT_FALSE(Ignored(rules, "x/keep.o", false));
  EXPECT_TRUE(Ignored(rules, "#hash", false));
  EXPECT_FALSE(Ignored(rules, "main.cc", false));
}

}  // namespace
}  // namespace trainyard
