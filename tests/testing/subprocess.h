// Test helpers for multi-process tests: a child process in its own process group that is always
// killed and reaped (also when the test fails or the test binary dies: PR_SET_PDEATHSIG), a
// line reader over its stdout, a one-shot command runner, and a self-deleting temp dir.
// Not thread-safe: one test thread uses each object.
#ifndef TRAINYARD_TESTS_TESTING_SUBPROCESS_H_
#define TRAINYARD_TESTS_TESTING_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace trainyard::testing {

class Subprocess {
 public:
  // Starts argv[0] (a path) with `argv`, the parent's environment plus `extra_env` ("K=V").
  // stdout is a pipe read by ReadLine; stderr goes to the test's stderr.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(
      const std::vector<std::string>& argv, const std::vector<std::string>& extra_env = {});

  // Sends SIGKILL to the process group if still running and reaps the child.
  ~Subprocess();

  pid_t pid() const { return pid_; }

  // The next line of stdout without its newline; nullopt on EOF or when `timeout` passes first.
  std::optional<std::string> ReadLine(absl::Duration timeout);

  // Sends `signal` to the whole process group.
  void Signal(int signal);

  // Waits for the child to exit; its waitpid status, or nullopt on timeout.
  std::optional<int> Wait(absl::Duration timeout);

 private:
  Subprocess(pid_t pid, int stdout_fd) : pid_(pid), stdout_fd_(stdout_fd) {}

  pid_t pid_;
  int stdout_fd_;
  std::string buffer_;
  bool reaped_ = false;
  int wait_status_ = 0;
};

struct CommandResult {
  int exit_code = -1;  // -1 if killed by a signal or timed out
  std::string out;
  std::string err;
};

// Runs argv to completion (killed after `timeout`), capturing stdout and stderr.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::vector<std::string>& extra_env = {},
                         absl::Duration timeout = absl::Seconds(60));

// A fresh directory under $TMPDIR, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Path of a program in build/bin (from $TRAINYARD_BIN_DIR, set by ctest).
std::string BinPath(const std::string& name);
// Path of a test helper program in build/tests (from $TRAINYARD_TEST_BIN_DIR).
std::string TestBinPath(const std::string& name);

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_SUBPROCESS_H_
