// A real trainyard-coordinator process for end-to-end tests.
#ifndef TRAINYARD_TESTS_TESTING_COORDINATOR_PROCESS_H_
#define TRAINYARD_TESTS_TESTING_COORDINATOR_PROCESS_H_

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/testing/subprocess.h"

namespace trainyard::testing {

struct CoordinatorProcess {
  std::unique_ptr<Subprocess> process;
  std::string address;  // empty if it did not start
};

// Starts trainyard-coordinator on `listen` (default: a free loopback port) with `state_dir` and
// more `flags`, and waits for the address it prints once it serves (a test failure if none comes
// within 30 s).
inline CoordinatorProcess StartCoordinatorProcess(const std::string& state_dir,
                                                  const std::vector<std::string>& flags = {},
                                                  const std::string& listen = "127.0.0.1:0") {
  std::vector<std::string> argv = {BinPath("trainyard-coordinator"), "--listen", listen,
                                   "--state-dir", state_dir};
  argv.insert(argv.end(), flags.begin(), flags.end());
  CoordinatorProcess c;
  auto p = Subprocess::Start(argv);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return c;
  c.process = std::move(*p);
  auto line = c.process->ReadLine(absl::Seconds(30));
  EXPECT_TRUE(line.has_value()) << "the coordinator printed no address";
  c.address = line.value_or("");
  return c;
}

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_COORDINATOR_PROCESS_H_
