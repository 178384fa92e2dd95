// The signals `yard signal` takes (common/signal_names.h): by name, with or without SIG, in any
// case; nothing else.
#include "common/signal_names.h"

#include <gtest/gtest.h>

#include <csignal>

namespace trainyard {
namespace {

TEST(SignalNamesTest, NamesWithOrWithoutSigInAnyCase) {
  EXPECT_EQ(SignalNumber("USR1"), SIGUSR1);
  EXPECT_EQ(SignalNumber("sigusr2"), SIGUSR2);
  EXPECT_EQ(SignalNumber("SIGKILL"), SIGKILL);
  EXPECT_EQ(CanonicalSignalName("sigterm"), "TERM");
  EXPECT_TRUE(IsUserSignal(SIGCONT));
}

TEST(SignalNamesTest, OthersAreRefused) {
  for (const char* name : {"SEGV", "SIGBUS", "10", "", "SIG", "USR1 ", "CHLD"}) {
    EXPECT_FALSE(SignalNumber(name).has_value()) << name;
    EXPECT_EQ(CanonicalSignalName(name), "") << name;
  }
  EXPECT_FALSE(IsUserSignal(SIGSEGV));
  EXPECT_FALSE(IsUserSignal(0));
  EXPECT_EQ(SignalNamesText(),
            "HUP, INT, QUIT, USR1, USR2, ALRM, TERM, CONT, STOP, TSTP, WINCH, KILL");
}

}  // namespace
}  // namespace trainyard
