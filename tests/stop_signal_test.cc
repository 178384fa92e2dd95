// SIGTERM as a stop request held by the kernel (worker/trainer/control/stop_signal.h): taken once,
// from the main thread, whichever thread it landed on. ctest runs each test in a process of its
// own (gtest_discover_tests), so each starts with SIGTERM unblocked and nothing pending.
#include "worker/trainer/control/stop_signal.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <future>
#include <thread>

namespace trainyard::trainer {
namespace {

TEST(StopSignalTest, NothingToTakeWithoutASignal) {
  HoldStopSignal();
  EXPECT_FALSE(TakeStopSignal());
}

TEST(StopSignalTest, ASigtermToTheProcessIsTakenOnce) {
  HoldStopSignal();
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);  // blocked: the process lives on, the signal waits
  EXPECT_TRUE(TakeStopSignal());
  EXPECT_FALSE(TakeStopSignal());
}

TEST(StopSignalTest, SeveralSigtermsBeforeATakeCountOnce) {
  HoldStopSignal();
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  EXPECT_TRUE(TakeStopSignal());
  EXPECT_FALSE(TakeStopSignal());
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);  // a later one is a new request
  EXPECT_TRUE(TakeStopSignal());
}

// As a thread that LibTorch starts before main: it does not block SIGTERM. A SIGTERM that lands
// on it is passed on to the main thread (raise() delivers to the calling thread before it
// returns, so the join is the event to wait for) instead of ending the process.
TEST(StopSignalTest, ASigtermOnAThreadStartedBeforeIsPassedToTheMainThread) {
  sigset_t unblocked;
  sigemptyset(&unblocked);
  sigaddset(&unblocked, SIGTERM);
  pthread_sigmask(SIG_UNBLOCK, &unblocked, nullptr);
  std::promise<void> go;
  std::thread early([f = go.get_future()]() mutable {
    f.wait();
    raise(SIGTERM);
  });
  HoldStopSignal();
  go.set_value();
  early.join();
  EXPECT_TRUE(TakeStopSignal());
  EXPECT_FALSE(TakeStopSignal());
}

// Threads started after HoldStopSignal (Gloo's, gRPC's) inherit the block, so a SIGTERM to the
// process waits for the main thread's take, whichever thread is running.
TEST(StopSignalTest, ThreadsStartedAfterInheritTheBlock) {
  HoldStopSignal();
  bool blocked = false;
  std::thread later([&blocked] {
    sigset_t mask;
    sigemptyset(&mask);
    pthread_sigmask(SIG_BLOCK, nullptr, &mask);
    blocked = sigismember(&mask, SIGTERM) == 1;
  });
  later.join();
  EXPECT_TRUE(blocked);
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  EXPECT_TRUE(TakeStopSignal());
}

}  // namespace
}  // namespace trainyard::trainer
