// What every command-line failure must look like: a non-zero exit and one line on stderr.
#ifndef TRAINYARD_TESTS_TESTING_EXPECT_CLI_H_
#define TRAINYARD_TESTS_TESTING_EXPECT_CLI_H_

#include <gtest/gtest.h>

#include <algorithm>

#include "tests/testing/subprocess.h"

namespace trainyard::testing {

inline void ExpectOneLineFailure(const CommandResult& r) {
  EXPECT_NE(r.exit_code, 0) << "stdout: " << r.out;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr: " << r.err;
  EXPECT_FALSE(r.err.empty() || r.err.back() != '\n') << "stderr: " << r.err;
}

}  // namespace trainyard::testing

#endif  // TRAINYARD_TESTS_TESTING_EXPECT_CLI_H_
