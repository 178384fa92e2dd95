// The programs' command-line checks (common/cli_checks.h): integers read as decimal whatever
// their leading zeros, on options of the app and of its subcommands, before their other checks.
#include "common/cli_checks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace trainyard {
namespace {

void Parse(CLI::App& app, std::vector<std::string> args) {
  std::reverse(args.begin(), args.end());  // (CLI11 takes a vector last argument first)
  app.parse(args);
}

TEST(DecimalIntegersTest, LeadingZerosAreDecimalNotOctal) {
  CLI::App app;
  int priority = 0, gpus = 0, tail = 0;
  int64_t bytes = 0;
  unsigned seed = 0;
  double lr = 0;
  std::vector<int> split;
  app.add_option("--priority", priority);
  app.add_option("--gpus", gpus)->check(Positive());
  app.add_option("--bytes", bytes);
  app.add_option("--seed", seed);
  app.add_option("--lr", lr);
  app.add_option("--split", split);
  CLI::App* logs = app.add_subcommand("logs");
  logs->add_option("--tail", tail)->check(CLI::Range(0, 100));
  DecimalIntegers(app);
  Parse(app, {"--priority", "010", "--gpus", "08", "--bytes", "-007", "--seed", "0009", "--lr",
              "0.010", "--split", "03", "--split", "10", "logs", "--tail", "099"});
  EXPECT_EQ(priority, 10);
  EXPECT_EQ(gpus, 8);
  EXPECT_EQ(bytes, -7);
  EXPECT_EQ(seed, 9u);
  EXPECT_DOUBLE_EQ(lr, 0.01);
  EXPECT_EQ(split, (std::vector<int>{3, 10}));
  EXPECT_EQ(tail, 99);
}

TEST(DecimalIntegersTest, OtherValuesAreAsTheyWere) {
  CLI::App app;
  int a = -1, b = -1, c = -1;
  app.add_option("-a", a);
  app.add_option("-b", b);
  app.add_option("-c", c);
  DecimalIntegers(app);
  Parse(app, {"-a", "0", "-b", "0x10", "-c", "00"});
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 16);  // hex, as CLI11 reads it
  EXPECT_EQ(c, 0);
}

TEST(DecimalIntegersTest, TheOptionsOtherChecksSeeTheDecimalValue) {
  CLI::App app;
  int gpus = 0;
  app.add_option("--gpus", gpus)->check(Positive());
  DecimalIntegers(app);
  try {
    Parse(app, {"--gpus", "000"});
    FAIL() << "000 accepted as a positive number";
  } catch (const CLI::ValidationError& e) {
    EXPECT_NE(std::string(e.what()).find("must be > 0, got 0"), std::string::npos) << e.what();
  }
  CLI::App other;
  other.add_option("--n", gpus);
  DecimalIntegers(other);
  EXPECT_THROW(Parse(other, {"--n", "01x"}), CLI::ConversionError);
}

}  // namespace
}  // namespace trainyard
