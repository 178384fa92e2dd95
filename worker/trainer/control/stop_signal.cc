#include "worker/trainer/control/stop_signal.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <ctime>

namespace trainyard::trainer {
namespace {

// Runs only on a thread that does not block SIGTERM, one started before HoldStopSignal: pass it
// on to the main thread (thread id = process id), which blocks it. Async-signal-safe: two
// system calls, no state.
void PassToMainThread(int) {
  const int saved_errno = errno;
  const pid_t pid = getpid();
  syscall(SYS_tgkill, pid, pid, SIGTERM);
  errno = saved_errno;
}

sigset_t OnlySigterm() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  return set;
}

}  // namespace

void HoldStopSignal() {
  const sigset_t set = OnlySigterm();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  struct sigaction action = {};
  action.sa_handler = PassToMainThread;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
}

bool TakeStopSignal() {
  sigset_t pending;
  sigemptyset(&pending);
  if (sigpending(&pending) != 0 || sigismember(&pending, SIGTERM) != 1) return false;
  const sigset_t set = OnlySigterm();
  const timespec now = {0, 0};
  return sigtimedwait(&set, nullptr, &now) == SIGTERM;
}

}  // namespace trainyard::trainer
