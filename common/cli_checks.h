// Checks of command-line numbers whose errors read as the user wrote the value: "must be >= 0,
// got -1", where CLI11's NonNegativeNumber says "Value -1 not in range 0.000000 to " and the
// largest double's 309 digits; inf and nan are refused (CLI11's took nan); and integers read as
// decimal whatever their leading zeros (CLI11 reads "010" as octal 8 and refuses "08"). For the
// programs' CLI11 options (yard, the servers, the worker, the trainer); header only, as CLI11 is.
#ifndef TRAINYARD_COMMON_CLI_CHECKS_H_
#define TRAINYARD_COMMON_CLI_CHECKS_H_

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

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

// "010" → "10", "-007" → "-7", "00" → "0"; anything else as it is ("0x10" stays hex).
inline std::string WithoutLeadingZeros(std::string value) {
  const size_t digits = value.find_first_not_of("+-") == 1 ? 1 : 0;
  size_t zeros = digits;
  while (zeros + 1 < value.size() && value[zeros] == '0') ++zeros;
  if (zeros == digits || value.find_first_not_of("0123456789", digits) != std::string::npos) {
    return value;
  }
  return value.substr(0, digits) + value.substr(zeros);
}

}  // namespace cli_checks_internal

// A number >= 0 (in place of CLI::NonNegativeNumber).
inline CLI::Validator NonNegative() { return cli_checks_internal::AtLeastZero(true); }
// A number > 0 (in place of CLI::PositiveNumber).
inline CLI::Validator Positive() { return cli_checks_internal::AtLeastZero(false); }

// Makes every integer option of `app` and its subcommands (given by then) read its value as
// decimal: "--priority 010" is 10, "--gpus 08" is 8. Call once the options are added, before the
// parse; the leading zeros are dropped before any other check sees the value.
inline void DecimalIntegers(CLI::App& app) {
  for (CLI::Option* option : app.get_options()) {
    const std::string type = option->get_type_name();
    if (type.rfind("INT", 0) != 0 && type.rfind("UINT", 0) != 0) continue;
    option->transform(CLI::Validator(
        [](std::string& value) {
          value = cli_checks_internal::WithoutLeadingZeros(value);
          return std::string();
        },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    DecimalIntegers(*sub);
  }
}

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_CLI_CHECKS_H_
