// A rank program for the worker daemon's tests, standing in for trainyard-trainer where a test
// needs a rank to misbehave on purpose. It takes the trainer's command line (--context FILE) and
// acts out the job's name: "succeed" (print lines, exit 0), "fail-rank-1" (rank 1 prints to stderr
// and exits 3), "hang" (print "ready", wait for SIGTERM, print "stopping on SIGTERM", exit 0),
// "ignore-term" (ignore SIGTERM, wait to be killed), "spawn-child" (start a grandchild that sleeps,
// then hang), "leave-shm" (create /dev/shm/trainyard-allreduce-PID-test, exit 9),
// "leave-user-shm" (create /dev/shm/trainyard-test-PID and a SysV segment, exit 0), "print-devices"
// (print the device it was given: the context's device, TRAINYARD_DEVICE, CUDA_VISIBLE_DEVICES,
// OMP_NUM_THREADS; exit 0), "print-credentials" (say whether the job credential of its attempt
// and the worker's node token reached its environment, never their values; exit 0),
// "print-identity" (print its uid, gid and USER), "print-binary" (print bytes that are not
// UTF-8, exit 0), "print-long-lines" (a line of "<" and 3,000,000 two-byte characters, 600 lines of
// 9000 bytes, "end"; exit 0), "print-24-mib" (24,576 lines of 1 KiB, each starting with its number;
// exit 0), "print-oom-score-adj" (print "oom_score_adj N", its own; exit 0), "read-data" (read
// data.path, exit 3 naming it when it cannot), "until-data-exists" (print "waiting", poll every 20
// ms until data.path exists, print "released", exit 0: a job that runs until the test lets it end),
// "count-until-data-exists" (until data.path exists, every 20 ms print "line N" and report step N
// through the trainer's Reporter, N = 1, 2,
// ...; then print "released after N", exit 0: a running job whose logs and metrics a test can
// count). Asked
// `--supported-devices`, it answers TEST_RANK_SUPPORTED_DEVICES (default "cpu"). Each rank writes
// its pid (and its grandchild's) to pids-rank-R in its working directory, so tests can check that
// none survive.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fstream>
#include <sstream>
#include <string>

#include "trainyard/v1/job.pb.h"
#include "worker/trainer/control/reporter.h"

int main(int argc, char** argv) {
  if (argc == 2 && !std::strcmp(argv[1], "--supported-devices")) {
    const char* devices = std::getenv("TEST_RANK_SUPPORTED_DEVICES");
    std::printf("%s\n", devices != nullptr ? devices : "cpu");
    return 0;
  }
  // The worker's RankContext (--context FILE), as trainyard-trainer reads it.
  std::string context_path;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--context")) context_path = argv[i + 1];
  }
  std::ifstream in(context_path, std::ios::binary);
  trainyard::v1::RankContext context;
  if (!context.ParseFromIstream(&in)) {
    std::fprintf(stderr, "test_rank: bad arguments\n");
    return 64;
  }
  const trainyard::v1::JobSpec& spec = context.spec();
  const int rank = context.rank(), world = context.world_size();
  const std::string device = context.device(), job_id = context.job_id(),
                    attempt = std::to_string(context.attempt());
  const std::string mode = spec.name();
  std::ofstream pids("pids-rank-" + std::to_string(rank));
  pids << getpid() << "\n" << std::flush;
  std::printf("hello from rank %d of %d (%s)\n", rank, world, mode.c_str());
  std::fflush(stdout);

  if (mode == "print-devices") {
    auto env = [](const char* name) -> std::string {
      const char* v = std::getenv(name);
      return v != nullptr ? std::string("'") + v + "'" : "unset";
    };
    std::printf(
        "rank %d: --device %s TRAINYARD_DEVICE=%s CUDA_VISIBLE_DEVICES=%s "
        "OMP_NUM_THREADS=%s\n",
        rank, device.c_str(), env("TRAINYARD_DEVICE").c_str(), env("CUDA_VISIBLE_DEVICES").c_str(),
        env("OMP_NUM_THREADS").c_str());
    return 0;
  }
  if (mode == "print-credentials") {  // what of the worker's secrets reached the rank (not them)
    const char* credential = std::getenv("TRAINYARD_JOB_CREDENTIAL");
    const std::string prefix = "tyj." + job_id + "." + attempt + ".";
    std::printf("rank %d: job credential %s; node token %s\n", rank,
                credential == nullptr                           ? "unset"
                : std::string(credential).rfind(prefix, 0) == 0 ? "of this attempt"
                                                                : "of another attempt",
                std::getenv("TRAINYARD_TOKEN") != nullptr ? "set" : "unset");
    struct stat st {};
    if (stat(context_path.c_str(), &st) == 0) {
      std::printf("rank %d: context file mode %o\n", rank, st.st_mode & 07777);
    }
    return 0;
  }
  if (mode == "print-identity") {  // the account it runs as
    const char* user = std::getenv("USER");
    std::printf("rank %d: uid %d gid %d USER=%s\n", rank, static_cast<int>(getuid()),
                static_cast<int>(getgid()), user != nullptr ? user : "unset");
    return 0;
  }
  if (mode == "read-data") {  // reads data.path as the trainer would, failing as it does
    std::ifstream data(spec.data().path(), std::ios::binary);
    char byte;
    if (!data || !data.read(&byte, 1)) {
      std::fprintf(stderr, "data.path: cannot read %s: %s\n", spec.data().path().c_str(),
                   std::strerror(errno));
      return 3;
    }
    std::printf("rank %d: read %s\n", rank, spec.data().path().c_str());
    return 0;
  }
  if (mode == "print-binary") {  // output that is not UTF-8, as a byte-level model's sample
    std::printf("rank %d: bytes \xff\xfe and \xe2\x82 end\n", rank);
    return 0;
  }
  if (mode == "print-long-lines") {  // more than a message holds, in one line and in many
    std::string line = "<";          // (so that a cut at a power of two lands inside a character)
    for (int i = 0; i < 3'000'000; ++i) line += "\xc3\xa9";
    std::printf("%s\n", line.c_str());
    for (int i = 0; i < 600; ++i) std::printf("%s\n", std::string(9000, 'a' + i % 26).c_str());
    std::printf("end\n");
    return 0;
  }
  if (mode == "print-oom-score-adj") {  // what the kernel's OOM killer adds to its score
    std::ifstream adj("/proc/self/oom_score_adj");
    std::string value;
    adj >> value;
    std::printf("oom_score_adj %s\n", value.c_str());
    return 0;
  }
  if (mode == "print-24-mib") {  // 24,576 lines of 1 KiB: "LINE-NUMBER xxx...", then exits
    std::string line(1023, 'x');
    for (int i = 0; i < 24 * 1024; ++i) {
      const std::string number = std::to_string(i) + " ";
      line.replace(0, number.size(), number);
      std::printf("%s\n", line.c_str());
    }
    return 0;
  }
  if (mode == "leave-user-shm") {  // leaves /dev/shm/trainyard-test-PID and a SysV segment
    const std::string name = "/trainyard-test-" + std::to_string(getpid());
    const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    const int segment = shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0600);
    std::printf("left /dev/shm%s %d segment %d\n", name.c_str(), fd >= 0 ? 1 : 0, segment);
    return 0;
  }
  if (mode == "leave-shm") {  // dies holding a named all-reduce segment, as rank 0 might
    const std::string name = "/trainyard-allreduce-" + std::to_string(getpid()) + "-test";
    const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    std::printf("created %s\n", fd >= 0 ? name.c_str() : "nothing");
    return 9;
  }
  if (mode == "succeed") {
    std::printf("rank %d done\n", rank);
    return 0;
  }
  if (mode == "until-data-exists") {
    std::printf("waiting\n");
    std::fflush(stdout);
    while (access(spec.data().path().c_str(), F_OK) != 0) usleep(20'000);
    std::printf("released\n");
    return 0;
  }
  if (mode == "count-until-data-exists") {
    trainyard::trainer::Reporter reporter(
        context.coordinator_address(), job_id, context.attempt(), rank,
        [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
    int64_t n = 0;
    while (access(spec.data().path().c_str(), F_OK) != 0) {
      ++n;
      std::printf("line %lld\n", static_cast<long long>(n));
      std::fflush(stdout);
      if (rank == 0) {
        trainyard::trainer::StepReport report;
        report.step = n;
        report.loss = 1.0 / static_cast<double>(n);
        reporter.ReportStep(report);
      }
      usleep(20'000);
    }
    std::printf("released after %lld\n", static_cast<long long>(n));
    return 0;
  }
  if (mode == "fail-rank-1") {
    if (rank == 1) {
      std::fprintf(stderr, "boom: rank 1 failed on purpose\n");
      return 3;
    }
    pause();  // the other ranks wait until they are stopped
    return 0;
  }
  if (mode == "ignore-term") signal(SIGTERM, SIG_IGN);
  if (mode == "hang") {  // says that SIGTERM reached it, then exits
    signal(SIGTERM, [](int) {
      const char msg[] = "stopping on SIGTERM\n";
      (void)!write(STDOUT_FILENO, msg, sizeof(msg) - 1);
      _exit(0);
    });
  }
  if (mode == "spawn-child") {
    const pid_t child = fork();
    if (child == 0) {
      for (;;) pause();
    }
    pids << child << "\n";
  }
  pids.flush();
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) pause();
}
