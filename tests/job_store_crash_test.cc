// Crash test of the durable JobStores (SQLite, and PostgreSQL on a private server the test
// starts): a child process (job_store_crash_child.cc) commits jobs from four threads and
// acknowledges each durable commit; the test SIGKILLs it at a seeded-random point, reopens the
// store, and checks that every acknowledged job is there and that no job is torn. Several rounds
// run on one database, so recovery of a WAL left by a killed process (SQLite) or of transactions
// cut off mid-flight (PostgreSQL) is itself followed by new writes and another kill.
#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/coordinator/job_store.h"
#include "tests/job_store_crash_payload.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/subprocess.h"

namespace trainyard::coordinator {
namespace {

using ::trainyard::testing::CrashJob;
using ::trainyard::testing::Subprocess;
using ::trainyard::testing::TempDir;
using ::trainyard::testing::TestBinPath;

constexpr int kRounds = 6;
constexpr uint32_t kSeed = 20240611;
constexpr int kMinAcksBeforeKill = 1;
constexpr int kMaxAcksBeforeKill = 400;

// The child binary: TestBinPath when ctest says where test binaries are, else the directory of
// this test binary (the two are built side by side). The fallback matters because ctest does not
// currently receive TRAINYARD_TEST_BIN_DIR: tests/CMakeLists.txt passes two ENVIRONMENT entries
// through gtest_discover_tests unescaped, and only the first one arrives.
std::string ChildPath() {
  if (getenv("TRAINYARD_TEST_BIN_DIR") != nullptr) return TestBinPath("job_store_crash_child");
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return TestBinPath("job_store_crash_child");
  return (self.parent_path() / "job_store_crash_child").string();
}

// The rows of PRAGMA integrity_check, joined ("ok" for a sound database), or an error message.
std::string IntegrityCheck(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK) {
    std::string error = absl::StrCat("cannot open ", path, ": ", sqlite3_errmsg(db));
    sqlite3_close_v2(db);
    return error;
  }
  std::vector<std::string> rows;
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &stmt, nullptr) != SQLITE_OK) {
    rows.push_back(absl::StrCat("prepare: ", sqlite3_errmsg(db)));
  } else {
    int rc;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
      rows.push_back(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0)));
    }
    if (rc != SQLITE_DONE) rows.push_back(absl::StrCat("step: ", sqlite3_errmsg(db)));
  }
  sqlite3_finalize(stmt);
  sqlite3_close_v2(db);
  return absl::StrJoin(rows, "; ");
}

// Describes how `actual` differs from the job the child commits for its seq; empty if it does not.
std::string DescribeCorruption(const StoredJob& actual) {
  const StoredJob expected = CrashJob(actual.seq);
  if (actual == expected) return "";
  std::vector<std::string> diffs;
  if (actual.id != expected.id) diffs.push_back(absl::StrCat("id '", actual.id, "'"));
  if (actual.owner != expected.owner) diffs.push_back(absl::StrCat("owner '", actual.owner, "'"));
  if (actual.state != expected.state) diffs.push_back(absl::StrCat("state '", actual.state, "'"));
  if (actual.payload != expected.payload) {
    const auto mismatch = std::mismatch(actual.payload.begin(), actual.payload.end(),
                                        expected.payload.begin(), expected.payload.end());
    diffs.push_back(absl::StrCat("payload of ", actual.payload.size(), " bytes (want ",
                                 expected.payload.size(), "), first difference at byte ",
                                 mismatch.first - actual.payload.begin()));
  }
  return absl::StrJoin(diffs, ", ");
}

// Kills the child committing to `location` kRounds times; checks after each kill with
// `integrity_check` (empty when the store has none of its own to run) and a reopened store.
void CrashRounds(const std::string& location, const std::function<std::string()>& integrity_check) {
  std::mt19937 rng(kSeed);
  std::uniform_int_distribution<int> acks_before_kill(kMinAcksBeforeKill, kMaxAcksBeforeKill);

  std::set<int64_t> acked;  // over all rounds
  int64_t max_seq_in_db = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    const int64_t first_seq = max_seq_in_db + 1;
    const int kill_after = acks_before_kill(rng);
    auto child = Subprocess::Start({ChildPath(), location, absl::StrCat(first_seq)});
    ASSERT_TRUE(child.ok()) << child.status();

    for (int acks = 0; acks < kill_after; ++acks) {
      std::optional<std::string> line = (*child)->ReadLine(absl::Seconds(30));
      ASSERT_TRUE(line.has_value())
          << "child exited or went silent after " << acks << " of " << kill_after << " acks";
      absl::string_view rest = *line;
      int64_t seq = 0;
      ASSERT_TRUE(absl::ConsumePrefix(&rest, "ACK ") && absl::SimpleAtoi(rest, &seq))
          << "unexpected line from child: '" << *line << "'";
      ASSERT_GE(seq, first_seq) << "child acknowledged a seq below FIRST_SEQ";
      ASSERT_TRUE(acked.insert(seq).second) << "seq " << seq << " acknowledged twice";
    }
    (*child)->Signal(SIGKILL);
    std::optional<int> wait_status = (*child)->Wait(absl::Seconds(10));
    ASSERT_TRUE(wait_status.has_value()) << "child did not die after SIGKILL";
    EXPECT_TRUE(WIFSIGNALED(*wait_status) && WTERMSIG(*wait_status) == SIGKILL)
        << "child ended otherwise than by SIGKILL, status " << *wait_status;

    if (integrity_check) EXPECT_EQ(integrity_check(), "ok");

    auto store = OpenJobStore(location);
    ASSERT_TRUE(store.ok()) << store.status();
    auto jobs = (*store)->LoadJobs();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    std::set<int64_t> present;
    for (const StoredJob& job : *jobs) {
      const std::string corruption = DescribeCorruption(job);
      EXPECT_TRUE(corruption.empty()) << "job seq " << job.seq << " is corrupt: " << corruption;
      present.insert(job.seq);
    }
    int missing = 0;
    for (int64_t seq : acked) {
      if (present.count(seq) == 0) {
        ++missing;
        ADD_FAILURE() << "acknowledged job seq " << seq << " is missing";
      }
    }
    ASSERT_EQ(missing, 0) << missing << " acknowledged jobs missing";
    ASSERT_FALSE(present.empty());
    max_seq_in_db = *present.rbegin();
    // Committed but killed before its callback ran: allowed, and must be intact (checked above).
    std::cout << "round " << round << ": killed after " << kill_after << " acks; " << present.size()
              << " jobs in the database, " << present.size() - acked.size()
              << " of them never acknowledged\n";
  }
}

TEST(JobStoreCrashTest, AcknowledgedJobsSurviveSigkillAndNoJobIsTornOnSqlite) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string db_path = dir.path() + "/jobs.db";
  CrashRounds(db_path, [&] { return IntegrityCheck(db_path); });
}

TEST(JobStoreCrashTest, AcknowledgedJobsSurviveSigkillAndNoJobIsTornOnPostgres) {
  std::string why;
  testing::PostgresServer* server = testing::SharedPostgresServer(&why);
  if (server == nullptr) GTEST_SKIP() << "no PostgreSQL here: " << why;
  ASSERT_TRUE(server->CreateDatabase("crash").ok());
  CrashRounds(server->Uri("crash"), nullptr);
}

}  // namespace
}  // namespace trainyard::coordinator
