// Checks of command-line numbers whose errors read as the user wrote the value: "must be >= 0,
// got -1", where CLI11's NonNegativeNumber says "Value -1 not in range 0.000000 to " and the
// largest double's 309 digits; inf and nan are refused (CLI11's took nan). For the programs' CLI11
// options (yard, the servers, the worker,
// the trainer); header only, as CLI11 is.
#ifndef TRAINYARD_COMMON_CLI_CHECKS_H_
#define TRAINYARD_COMMON_CLI_CHECKS_H_

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

namespace trainyard {

namespace cli_checks_internal {

inline CLI::Validator AtLeastZero(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& value) -> std::string {
        const char* begin = value.c_str();
        char* end = nullptr;
        errno = 0;
        const double x = std::strtod(begin, &end);
        if (value.empty() || end != begin + value.size()) return "not a number: " + value;
        if (errno == ERANGE || !std::isfinite(x)) return "out of range: " + value;
        if (zero_allowed ? x >= 0 : x > 0) return std::string();
        return std::string(zero_allowed ? "must be >= 0" : "must be > 0") + ", got " + value;
      },
      zero_allowed ? "NONNEGATIVE" : "POSITIVE");
}

}  // namespace cli_checks_internal

// A number >= 0 (in place of CLI::NonNegativeNumber).
inline CLI::Validator NonNegative() { return cli_checks_internal::AtLeastZero(true); }
// A number > 0 (in place of CLI::PositiveNumber).
inline CLI::Validator Positive() { return cli_checks_internal::AtLeastZero(false); }

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_CLI_CHECKS_H_
