// A shared library that records which account loaded it, for the worker's least-privilege tests
// (worker_e2e_test): loaded through LD_PRELOAD (its constructor) or LD_AUDIT (la_version), it
// appends "loaded euid N pid P" or "audit euid N pid P" to the file named by the environment's
// ENV_PROBE_OUT. A line with euid 0 means a process running as root took a library the
// job named.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace {

void Record(const char* how) {
  const char* out = std::getenv("ENV_PROBE_OUT");
  if (out == nullptr) return;
  const int fd = open(out, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return;
  char line[128];
  const int n = std::snprintf(line, sizeof(line), "%s euid %u pid %d\n", how,
                              static_cast<unsigned>(geteuid()), static_cast<int>(getpid()));
  if (n > 0) (void)!write(fd, line, static_cast<size_t>(n));
  close(fd);
}

__attribute__((constructor)) void Loaded() { Record("loaded"); }

}  // namespace

// The rtld-audit interface's first call (LD_AUDIT).
extern "C" unsigned int la_version(unsigned int version) {
  Record("audit");
  return version;
}
