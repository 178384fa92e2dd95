// Benchmark of the parameter server's transfer path (issue #5): gradients pushed and parameters
// pulled between a client and k trainyard-ps processes on loopback, over each server's TCP data
// plane or over gRPC, against a plain TCP socket moving the same bytes over k connections, in one
// run.
//
// For each k in --shards: (a) the anchor: k TCP connections on 127.0.0.1 to a peer process (this
// binary, --anchor-peer), opened once and used every round, a sender and a receiver thread each,
// moving the job's fp32 bytes split in k
// contiguous parts with 4 MiB send/recv calls from and into big arrays, one way, and "push +
// pull" (the same bytes sent, then sent back), with the TCP congestion control trainyard's
// connections use (--tcp-congestion, default $TRAINYARD_TCP_CONGESTION, else the host's); (b)
// trainyard: k trainyard-ps processes (--threads 1) holding contiguous ranges of a job of
// --params parameters, each range initialized once; then per step, as the offload trainer does it
// (worker/trainer/parallel/offload.cc): a push of every range (all shards at once from threads), an
// update-and-pull of every range, then a pure pull (no update, wait_ms 0, of the step just
// applied), which is the transfer without the AdamW update. Steps in WIRE_FP32 and in WIRE_BF16
// (half the bytes). The anchor and the steps alternate round by round; the table shows medians
// after --warmup rounds.
//
// Three clients: `--client tcp` is the offload trainer's default, each server's TCP data plane
// (rpc/ps/data_plane_client.h: gradients sent from the gradient array, parameters received
// into the parameter array, no copy in between); `--client zero-copy` is the trainer's gRPC path
// (rpc/ps/ps_client.h: a generic stub, the gradient bytes sent as a slice pointing into the
// gradient array, pulled chunks decoded straight into the parameter array); `--client stub`
// sends the same messages through the generated stub and protobuf classes (4 MiB chunks), as
// offload.cc did before. `--tune-malloc` sets glibc malloc in this process as the offload
// trainer sets it (worker/trainer/main.cc); the trainyard-ps children always run as shipped
// (server/ps/main.cc sets theirs).
//
// Run through bench/ps_transfer_bench.sh, or: ps_transfer_bench [--params N] [--reps N]
// [--warmup N] [--shards 1,2,3,4] [--ps PATH] [--client stub|zero-copy|tcp] [--tune-malloc]
// [--chunk-elements N] [--lookahead-bytes N] [--bdp-probe 0|1] [--no-bf16] [--label TEXT]
// [--rows-only] [--ps-logs] [--tcp-congestion NAME]. The trainyard-ps processes die with this
// process (PR_SET_PDEATHSIG) and are otherwise always stopped with SIGTERM (SIGKILL after 20 s) and
// reaped.
#include <arpa/inet.h>
#include <fcntl.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/grpc_status.h"
#include "common/ps_layout.h"
#include "common/status_macros.h"
#include "kernels/adam/cpu_adam.h"
#include "rpc/ps/data_plane_client.h"
#include "rpc/ps/ps_client.h"
#include "rpc/ps/tcp_congestion.h"
#include "rpc/ps/wire_types.h"
#include "trainyard/v1/ps.grpc.pb.h"

namespace trainyard::bench {
namespace {

constexpr int64_t kSocketIoBytes = int64_t{4} << 20;  // per send/recv call of the anchor
constexpr int kMaxMessageBytes = 64 << 20;            // as the offload trainer's channel
constexpr double kGoalOfSocket = 0.7;
constexpr double kStopTimeoutSeconds = 20;
constexpr char kJobId[] = "ps-transfer-bench";
// --tune-malloc: glibc malloc keeps freed memory for reuse instead of handing it back to the
// kernel (a fixed mmap threshold at its 32 MiB maximum, trimming only above 1 GiB, one arena), so
// that the buffers gRPC allocates for every received message stop costing a page fault per 4 KiB
// page. What an offload trainer rank and trainyard-ps set.
constexpr int kMmapThresholdBytes = 32 << 20;
constexpr int kTrimThresholdBytes = 1 << 30;

struct Flags {
  int64_t params = int64_t{64} << 20;
  int reps = 5;
  int warmup = 1;
  std::vector<int> shards = {1, 2, 3, 4};
  std::string ps_binary;  // default: trainyard-ps next to this binary
  enum class Client { kStub, kZeroCopy, kDataPlane };
  Client client = Client::kStub;
  bool tune_malloc = false;
  int64_t chunk_elements = int64_t{1} << 20;  // offload.cc's: 4 MiB fp32 messages
  int lookahead_bytes = 0;                    // 0: gRPC's default
  int bdp_probe = -1;                         // -1: gRPC's default
  bool bf16 = true;
  std::string label;  // the table's first column; default: the client and malloc settings
  bool rows_only = false;
  bool ps_logs = false;
  // TCP congestion control of every connection, the anchor's and trainyard's (client, shards);
  // empty: the host's. Default: $TRAINYARD_TCP_CONGESTION, as trainyard-ps and the trainer.
  std::string tcp_congestion;
  // The anchor's receivers recv into a bounce buffer and copy out, as a receiver that cannot
  // receive in place (any RPC library's client) must: a diagnostic anchor, not the goal's.
  bool anchor_copies = false;
  // Both ends of the anchor's connections in this process instead of a peer process: a
  // diagnostic (the anchor before this flag existed).
  bool anchor_in_process = false;
  // --anchor-peer FD,FD,...: run as the anchor's peer process (AnchorPeer) on these inherited
  // connections, with --anchor-bytes.
  std::vector<int> anchor_peer_fds;
  int64_t anchor_bytes = 0;
  // --tls-dir DIR: the servers serve TLS with DIR/server.pem and DIR/server.key (their data plane
  // too) and the client verifies them with DIR/ca.pem; empty: plain TCP.
  std::string tls_dir;
};

// This binary's path; empty if /proc does not tell.
std::string SelfPath() {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  return n > 0 ? std::string(self, n) : std::string();
}

std::string DefaultPsBinary() {
  const std::string path = SelfPath();
  if (path.empty()) return "trainyard-ps";
  return path.substr(0, path.rfind('/') + 1) + "trainyard-ps";
}

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  if (const char* env = std::getenv(ps::kTcpCongestionEnv)) flags.tcp_congestion = env;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    bool ok = true;
    if (arg == "--tune-malloc") {
      flags.tune_malloc = true;
    } else if (arg == "--no-bf16") {
      flags.bf16 = false;
    } else if (arg == "--rows-only") {
      flags.rows_only = true;
    } else if (arg == "--ps-logs") {
      flags.ps_logs = true;
    } else if (arg == "--anchor-copies") {
      flags.anchor_copies = true;
    } else if (arg == "--anchor-in-process") {
      flags.anchor_in_process = true;
    } else if (arg == "--anchor-peer" && has_value) {
      for (absl::string_view fd : absl::StrSplit(argv[++i], ',')) {
        int n = -1;
        ok = ok && absl::SimpleAtoi(fd, &n) && n >= 0;
        flags.anchor_peer_fds.push_back(n);
      }
    } else if (arg == "--anchor-bytes" && has_value) {
      ok = absl::SimpleAtoi(argv[++i], &flags.anchor_bytes) && flags.anchor_bytes > 0;
    } else if (!has_value) {
      ok = false;
    } else if (arg == "--params") {
      ok = absl::SimpleAtoi(argv[++i], &flags.params) && flags.params > 0;
    } else if (arg == "--reps") {
      ok = absl::SimpleAtoi(argv[++i], &flags.reps) && flags.reps > 0;
    } else if (arg == "--warmup") {
      ok = absl::SimpleAtoi(argv[++i], &flags.warmup) && flags.warmup >= 0;
    } else if (arg == "--shards") {
      flags.shards.clear();
      for (absl::string_view s : absl::StrSplit(argv[++i], ',')) {
        int k = 0;
        ok = ok && absl::SimpleAtoi(s, &k) && k > 0;
        flags.shards.push_back(k);
      }
    } else if (arg == "--ps") {
      flags.ps_binary = argv[++i];
    } else if (arg == "--client") {
      const std::string client = argv[++i];
      ok = client == "stub" || client == "zero-copy" || client == "tcp";
      flags.client = client == "tcp"         ? Flags::Client::kDataPlane
                     : client == "zero-copy" ? Flags::Client::kZeroCopy
                                             : Flags::Client::kStub;
    } else if (arg == "--chunk-elements") {
      ok = absl::SimpleAtoi(argv[++i], &flags.chunk_elements) && flags.chunk_elements > 0 &&
           flags.chunk_elements <= (int64_t{16} << 20);
    } else if (arg == "--lookahead-bytes") {
      ok = absl::SimpleAtoi(argv[++i], &flags.lookahead_bytes) && flags.lookahead_bytes >= 0;
    } else if (arg == "--bdp-probe") {
      ok = absl::SimpleAtoi(argv[++i], &flags.bdp_probe) &&
           (flags.bdp_probe == 0 || flags.bdp_probe == 1);
    } else if (arg == "--label") {
      flags.label = argv[++i];
    } else if (arg == "--tcp-congestion") {
      flags.tcp_congestion = argv[++i];
    } else if (arg == "--tls-dir") {
      flags.tls_dir = argv[++i];
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: %s [--params N] [--reps N] [--warmup N] [--shards 1,2,3,4] [--ps PATH] "
                   "[--client stub|zero-copy|tcp] [--tune-malloc] [--chunk-elements N] "
                   "[--lookahead-bytes N] [--bdp-probe 0|1] [--no-bf16] [--label TEXT] "
                   "[--rows-only] [--ps-logs] [--tcp-congestion NAME] [--anchor-copies] "
                   "[--anchor-in-process] [--tls-dir DIR]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  if (flags.ps_binary.empty()) flags.ps_binary = DefaultPsBinary();
  if (flags.label.empty()) {
    flags.label = absl::StrCat(flags.client == Flags::Client::kDataPlane  ? "data plane"
                               : flags.client == Flags::Client::kZeroCopy ? "zero-copy client"
                                                                          : "stub client",
                               flags.tune_malloc ? ", malloc tuned" : "");
  }
  return flags;
}

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> x) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  const size_t mid = x.size() / 2;
  return x.size() % 2 ? x[mid] : 0.5 * (x[mid - 1] + x[mid]);
}

absl::Status ErrnoError(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Runs fn(i) for each i in [0, n) on its own thread; the first error wins.
absl::Status RunParallel(int n, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i] = fn(i); });
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// The first element of part i of [0, total) cut into k contiguous parts.
int64_t PartBegin(int64_t total, int k, int i) { return total * i / k; }

// ---- The anchor: plain TCP on loopback. ----

// A connected socket pair (client end, server end) over 127.0.0.1, closed on destruction.
class TcpConnection {
 public:
  // `congestion`: the TCP congestion control of both ends; empty: the host's.
  static absl::StatusOr<std::unique_ptr<TcpConnection>> Open(const std::string& congestion) {
    const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener < 0) return ErrnoError("socket");
    std::unique_ptr<TcpConnection> c(new TcpConnection);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    auto connect_pair = [&]() -> absl::Status {
      RETURN_IF_ERROR(ps::SetSocketTcpCongestion(listener, congestion));
      if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
          listen(listener, 1) != 0 ||
          getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
        return ErrnoError("bind/listen");
      }
      if ((c->client_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0) {
        return ErrnoError("socket");
      }
      RETURN_IF_ERROR(ps::SetSocketTcpCongestion(c->client_fd_, congestion));
      if (connect(c->client_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        return ErrnoError("connect");
      }
      if ((c->server_fd_ = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC)) < 0) {
        return ErrnoError("accept");
      }
      return absl::OkStatus();
    };
    const absl::Status status = connect_pair();
    close(listener);
    RETURN_IF_ERROR(status);
    return c;
  }
  ~TcpConnection() {
    if (client_fd_ >= 0) close(client_fd_);
    if (server_fd_ >= 0) close(server_fd_);
  }
  int client_fd() const { return client_fd_; }
  int server_fd() const { return server_fd_; }
  void CloseServerEnd() {
    if (server_fd_ >= 0) close(server_fd_);
    server_fd_ = -1;
  }

 private:
  TcpConnection() = default;
  int client_fd_ = -1;
  int server_fd_ = -1;
};

absl::Status SendAll(int fd, const char* p, int64_t bytes) {
  while (bytes > 0) {
    const ssize_t n = send(fd, p, std::min(bytes, kSocketIoBytes), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoError("send");
    p += n;
    bytes -= n;
  }
  return absl::OkStatus();
}

// With `bounce` (kSocketIoBytes), receives there and copies each piece to `p`.
absl::Status RecvAll(int fd, char* p, int64_t bytes, char* bounce = nullptr) {
  while (bytes > 0) {
    const ssize_t n = recv(fd, bounce != nullptr ? bounce : p, std::min(bytes, kSocketIoBytes), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n == 0 ? absl::InternalError("recv: peer closed") : ErrnoError("recv");
    if (bounce != nullptr) std::memcpy(p, bounce, n);
    p += n;
    bytes -= n;
  }
  return absl::OkStatus();
}

// A round's command to the peer, one byte on each connection before its part: receive the part
// and acknowledge it with one byte, or receive it and send it back.
constexpr char kOneWay = 'o', kRoundTrip = 'r';

// The anchor's receiving side (the "parameter server" end of each connection) in a process of its
// own, as trainyard-ps is: this binary run with --anchor-peer. Without it (--anchor-in-process)
// both ends are threads of the bench process, which on the 2-core VM kept a single connection
// at about one busy core. Used by the main thread only.
class AnchorPeer {
 public:
  // Opens k connections with `congestion`, hands their server ends to a new peer process that
  // receives parts of `bytes` (with `copies`, through a bounce buffer) and keeps the client ends.
  static absl::StatusOr<std::unique_ptr<AnchorPeer>> Start(int k, int64_t bytes,
                                                           const std::string& congestion,
                                                           bool copies) {
    std::unique_ptr<AnchorPeer> p(new AnchorPeer);
    for (int i = 0; i < k; ++i) {
      ASSIGN_OR_RETURN(auto c, TcpConnection::Open(congestion));
      p->connections_.push_back(std::move(c));
    }
    const std::string self = SelfPath();
    if (self.empty()) return ErrnoError("readlink /proc/self/exe");
    std::string fds;
    for (const auto& c : p->connections_)
      absl::StrAppend(&fds, fds.empty() ? "" : ",", c->server_fd());
    std::vector<std::string> args = {self, "--anchor-peer", fds, "--anchor-bytes",
                                     absl::StrCat(bytes)};
    if (copies) args.push_back("--anchor-copies");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) return ErrnoError("fork");
    if (pid == 0) {  // only async-signal-safe calls until exec
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      // The server ends survive the exec; every other fd closes there (all are CLOEXEC).
      for (const auto& c : p->connections_) fcntl(c->server_fd(), F_SETFD, 0);
      execv(argv[0], argv.data());
      _exit(127);
    }
    p->pid_ = pid;
    for (auto& c : p->connections_) c->CloseServerEnd();
    return p;
  }

  ~AnchorPeer() {
    connections_.clear();  // the peer reads the end of every stream and exits
    int status = 0;
    if (pid_ > 0) waitpid(pid_, &status, 0);
  }

  pid_t pid() const { return pid_; }

  // Seconds to move `bytes` from `src` to the peer over the k connections (part i over
  // connection i, each on its own thread) and, with `round_trip`, back into `back`. With `bounce`
  // buffers (kSocketIoBytes each, one per connection), this side receives through them.
  absl::StatusOr<double> Transfer(const char* src, char* back, int64_t bytes, bool round_trip,
                                  std::vector<std::vector<char>>* bounce) {
    const int k = static_cast<int>(connections_.size());
    const auto start = Clock::now();
    RETURN_IF_ERROR(RunParallel(k, [&](int i) -> absl::Status {
      const int64_t a = PartBegin(bytes, k, i), n = PartBegin(bytes, k, i + 1) - a;
      const int fd = connections_[i]->client_fd();
      const char command = round_trip ? kRoundTrip : kOneWay;
      RETURN_IF_ERROR(SendAll(fd, &command, 1));
      RETURN_IF_ERROR(SendAll(fd, src + a, n));
      char ack;
      return round_trip ? RecvAll(fd, back + a, n, bounce->empty() ? nullptr : (*bounce)[i].data())
                        : RecvAll(fd, &ack, 1);
    }));
    return Seconds(start);
  }

 private:
  AnchorPeer() = default;
  std::vector<std::unique_ptr<TcpConnection>> connections_;
  pid_t pid_ = -1;
};

// --anchor-peer FDS: the peer process of AnchorPeer. Serves the connections on `fds`
// until each reaches its end: per round, one command byte, then the part into its own array
// (touched before the first round), acknowledged or sent back.
int AnchorPeerMain(const std::vector<int>& fds, int64_t bytes, bool copies) {
  const int k = static_cast<int>(fds.size());
  std::vector<char> dst(bytes, 1);
  std::vector<std::vector<char>> bounce(copies ? k : 0, std::vector<char>(kSocketIoBytes, 1));
  const absl::Status s = RunParallel(k, [&](int i) -> absl::Status {
    const int fd = fds[i];
    const int64_t a = PartBegin(bytes, k, i), n = PartBegin(bytes, k, i + 1) - a;
    char* const b = copies ? bounce[i].data() : nullptr;
    for (char command; recv(fd, &command, 1, MSG_WAITALL) == 1;) {
      RETURN_IF_ERROR(RecvAll(fd, dst.data() + a, n, b));
      const char ack = 'k';
      RETURN_IF_ERROR(command == kRoundTrip ? SendAll(fd, dst.data() + a, n)
                                            : SendAll(fd, &ack, 1));
    }
    return absl::OkStatus();
  });
  if (!s.ok()) std::fprintf(stderr, "anchor peer: %s\n", std::string(s.message()).c_str());
  return s.ok() ? 0 : 1;
}

// --anchor-in-process: seconds to move `bytes` from `src` to `dst` over the k `connections`,
// both ends in this process (part i over connection i, its sender and receiver on their own
// threads), and, with `round_trip`, back from `dst` into `back`. With `receiver_copies`, every
// receiver copies out of a bounce buffer (Flags::anchor_copies).
absl::StatusOr<double> InProcessTransfer(
    const std::vector<std::unique_ptr<TcpConnection>>& connections, const char* src, char* dst,
    char* back, int64_t bytes, bool round_trip, bool receiver_copies) {
  const int k = static_cast<int>(connections.size());
  std::vector<std::vector<char>> bounce(receiver_copies ? 2 * k : 0,
                                        std::vector<char>(kSocketIoBytes, 1));
  const auto start = Clock::now();
  RETURN_IF_ERROR(RunParallel(2 * k, [&](int t) -> absl::Status {
    const int i = t / 2;
    const int64_t a = PartBegin(bytes, k, i), n = PartBegin(bytes, k, i + 1) - a;
    const TcpConnection& c = *connections[i];
    char* const b = receiver_copies ? bounce[t].data() : nullptr;
    if (t % 2 == 0) {  // the "trainer"
      RETURN_IF_ERROR(SendAll(c.client_fd(), src + a, n));
      if (round_trip) RETURN_IF_ERROR(RecvAll(c.client_fd(), back + a, n, b));
    } else {  // the "parameter server"
      RETURN_IF_ERROR(RecvAll(c.server_fd(), dst + a, n, b));
      if (round_trip) RETURN_IF_ERROR(SendAll(c.server_fd(), dst + a, n));
    }
    return absl::OkStatus();
  }));
  return Seconds(start);
}

// ---- trainyard-ps processes. ----

// A trainyard-ps child process in its own process group that dies with this process
// (PR_SET_PDEATHSIG). Stopped with SIGTERM (SIGKILL after kStopTimeoutSeconds) and reaped on
// destruction. Used by the main thread only.
class PsProcess {
 public:
  // The child inherits this process's environment; its stderr goes to ours with `show_logs`.
  // `tcp_congestion` is passed as its --tcp-congestion (empty: the host's).
  static absl::StatusOr<std::unique_ptr<PsProcess>> Start(const std::string& binary,
                                                          int64_t memory_bytes,
                                                          const std::string& tcp_congestion,
                                                          bool show_logs,
                                                          const std::string& tls_dir = "") {
    if (access(binary.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("--ps: cannot run ", binary));
    }
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return ErrnoError("pipe");
    std::vector<std::string> args = {binary,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--threads",
                                     "1",
                                     "--memory-bytes",
                                     absl::StrCat(memory_bytes),
                                     "--tcp-congestion",
                                     tcp_congestion};
    if (!tls_dir.empty()) {
      for (const char* a : {"--tls-cert", "/server.pem", "--tls-key", "/server.key"}) {
        args.push_back(a[0] == '/' ? tls_dir + a : a);
      }
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
      close(out[0]);
      close(out[1]);
      return ErrnoError("fork");
    }
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      dup2(out[1], STDOUT_FILENO);
      const int devnull = open("/dev/null", O_RDWR);
      dup2(devnull, STDIN_FILENO);
      if (!show_logs) dup2(devnull, STDERR_FILENO);
      execv(argv[0], argv.data());
      _exit(127);
    }
    setpgid(pid, pid);
    close(out[1]);
    std::unique_ptr<PsProcess> p(new PsProcess(pid, out[0]));
    ASSIGN_OR_RETURN(p->address_, p->ReadFirstLine(/*timeout_ms=*/20000));
    return p;
  }

  ~PsProcess() {
    Terminate();
    int status = 0;
    const auto start = Clock::now();
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (Seconds(start) > kStopTimeoutSeconds) {
        std::fprintf(stderr, "trainyard-ps %d still running %.0f s after SIGTERM: SIGKILL\n", pid_,
                     kStopTimeoutSeconds);
        kill(-pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      usleep(10000);
    }
    close(stdout_fd_);
  }

  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

  // Sends SIGTERM (once); the destructor waits for the exit.
  void Terminate() {
    if (!terminated_) kill(-pid_, SIGTERM);
    terminated_ = true;
  }

 private:
  PsProcess(pid_t pid, int stdout_fd) : pid_(pid), stdout_fd_(stdout_fd) {}

  // The bound address: the first line of its stdout.
  absl::StatusOr<std::string> ReadFirstLine(int timeout_ms) {
    std::string line;
    const auto start = Clock::now();
    while (true) {
      const int left_ms = timeout_ms - static_cast<int>(Seconds(start) * 1000);
      pollfd pfd{stdout_fd_, POLLIN, 0};
      const int r = left_ms > 0 ? poll(&pfd, 1, left_ms) : 0;
      if (r < 0 && errno == EINTR) continue;
      char c = 0;
      if (r <= 0 || read(stdout_fd_, &c, 1) != 1) {
        return absl::UnavailableError(absl::StrCat(
            "trainyard-ps (pid ", pid_, ") printed no address; --ps-logs shows its stderr"));
      }
      if (c == '\n') return line;
      line.push_back(c);
    }
  }

  const pid_t pid_;
  const int stdout_fd_;
  bool terminated_ = false;
  std::string address_;
};

// trainyard-ps processes that all get SIGTERM before any is waited for: one takes up to ~10 s to
// exit after SIGTERM once it has served calls (gRPC 1.51's grpc_shutdown joins an executor thread
// sleeping in epoll_wait), so stopping them one by one would cost that many times over.
// Used by the main thread only.
class PsFleet {
 public:
  ~PsFleet() { TerminateAll(); }  // then each member waits for its process
  void Add(std::unique_ptr<PsProcess> p) { processes_.push_back(std::move(p)); }
  void TerminateAll() {
    for (auto& p : processes_) p->Terminate();
  }

 private:
  std::vector<std::unique_ptr<PsProcess>> processes_;
};

// ---- The client. ----

// One range of the job on one trainyard-ps, spoken to as the offload trainer does (--client tcp:
// the data plane; --client zero-copy: its gRPC path) or through the generated stub (--client
// stub). Each method is called by one thread at a time.
class ShardClient {
 public:
  ShardClient(const std::string& address, int64_t begin, int64_t end, const Flags& flags)
      : begin_(begin),
        end_(end),
        chunk_elements_(flags.chunk_elements),
        client_(flags.client),
        tcp_congestion_(flags.tcp_congestion),
        tls_dir_(flags.tls_dir) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    if (flags.lookahead_bytes > 0) {
      args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, flags.lookahead_bytes);
    }
    if (flags.bdp_probe >= 0) args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, flags.bdp_probe);
    ps::SetTcpCongestion(&args, flags.tcp_congestion);
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (!tls_dir_.empty()) {
      grpc::SslCredentialsOptions ssl;
      std::ifstream ca(tls_dir_ + "/ca.pem");
      ssl.pem_root_certs.assign(std::istreambuf_iterator<char>(ca), {});
      credentials = grpc::SslCredentials(ssl);
    }
    auto channel = grpc::CreateCustomChannel(address, credentials, args);
    stub_ = v1::ParameterServerService::NewStub(channel);
    generic_ = std::make_unique<grpc::GenericStub>(channel);
  }

  // Initializes the range at step 0 from `params` (the whole job's fp32 vector).
  absl::Status Init(int64_t total, const float* params) {
    grpc::ClientContext ctx;
    v1::InitShardResponse response;
    auto writer = stub_->InitShard(&ctx, &response);
    v1::InitShardChunk chunk;
    auto* h = chunk.mutable_header();
    h->set_job_id(kJobId);
    h->set_attempt(1);
    h->set_begin(begin_);
    h->set_end(end_);
    h->set_total_params(total);
    h->mutable_adamw()->set_beta1(0.9f);
    h->mutable_adamw()->set_beta2(0.999f);
    h->mutable_adamw()->set_eps(1e-8f);
    h->mutable_adamw()->set_weight_decay(0.01f);
    bool ok = writer->Write(chunk);
    for (int64_t a = begin_; ok && a < end_; a += chunk_elements_) {
      const int64_t n = std::min(chunk_elements_, end_ - a);
      chunk.Clear();
      chunk.set_offset(a);
      chunk.set_params(reinterpret_cast<const char*>(params + a), n * 4);
      ok = writer->Write(chunk);
    }
    writer->WritesDone();
    RETURN_IF_ERROR(Check(writer->Finish(), "init"));
    if (client_ != Flags::Client::kDataPlane) return absl::OkStatus();
    grpc::ClientContext info_ctx;
    v1::DataPlaneInfo info;
    RETURN_IF_ERROR(Check(stub_->GetDataPlane(&info_ctx, {}, &info), "get data plane"));
    if (info.address().empty()) return absl::FailedPreconditionError("no data plane");
    std::shared_ptr<const ps::TlsConfig> tls;
    if (info.tls()) {
      ASSIGN_OR_RETURN(tls, ps::TlsConfig::Client(tls_dir_ + "/ca.pem"));
    }
    data_plane_ =
        std::make_unique<ps::DataPlaneClient>(info.address(), tcp_congestion_, "", std::move(tls));
    return absl::OkStatus();
  }

  // PushGradients of step `step` for the whole range from `grads` (the job's vector of fp32 or
  // bf16 elements, as `format` says).
  absl::Status Push(int64_t step, v1::WireFormat format, const void* grads) {
    switch (client_) {
      case Flags::Client::kDataPlane:
        return PushDataPlane(step, format, grads);
      case Flags::Client::kZeroCopy:
        return PushZeroCopy(step, format, grads);
      case Flags::Client::kStub:
        break;
    }
    return PushStub(step, format, grads);
  }

  // UpdateAndPull of step `step` (with `update`: apply it first) of the whole range into `params`
  // (the job's vector of fp32 or bf16 elements, as `format` says). Sets `first_chunk` to when
  // the first chunk arrived (after the update, when there is one).
  absl::Status Pull(int64_t step, bool update, v1::WireFormat format, void* params,
                    Clock::time_point* first_chunk) {
    switch (client_) {
      case Flags::Client::kDataPlane:
        return PullDataPlane(step, update, format, params, first_chunk);
      case Flags::Client::kZeroCopy:
        return PullZeroCopy(step, update, format, params, first_chunk);
      case Flags::Client::kStub:
        break;
    }
    return PullStub(step, update, format, params, first_chunk);
  }

  // Pulls step `step` (already applied) in fp32 through the stub into `a` and through this
  // client's path into `b` (the job's vectors) and compares the range: a check of the
  // hand-written decoding and of the data plane.
  absl::Status CheckPullAgainstStub(int64_t step, float* a, float* b) {
    Clock::time_point first_chunk;
    RETURN_IF_ERROR(PullStub(step, false, v1::WIRE_FP32, a, &first_chunk));
    RETURN_IF_ERROR(Pull(step, false, v1::WIRE_FP32, b, &first_chunk));
    if (std::memcmp(a + begin_, b + begin_, (end_ - begin_) * sizeof(float)) == 0) {
      return absl::OkStatus();
    }
    return absl::InternalError(
        absl::StrCat("the pull of [", begin_, ", ", end_, ") differs from the stub's"));
  }

 private:
  v1::UpdateAndPullRequest PullRequest(int64_t step, bool update, v1::WireFormat format) const {
    v1::UpdateAndPullRequest request;
    request.set_job_id(kJobId);
    request.set_attempt(1);
    request.set_step(step);
    request.set_begin(begin_);
    request.set_end(end_);
    if (update) request.mutable_update()->set_lr(1e-4f);
    request.set_format(format);
    request.set_chunk_elements(chunk_elements_);
    request.set_wait_ms(0);
    return request;
  }

  // Every field of a push but its data and offset.
  static v1::GradientChunk PushHeader(int64_t step, v1::WireFormat format) {
    v1::GradientChunk header;
    header.set_job_id(kJobId);
    header.set_attempt(1);
    header.set_step(step);
    header.set_format(format);
    return header;
  }

  absl::Status CheckCount(const char* what, int64_t elements) const {
    if (elements == end_ - begin_) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(what, ": ", elements, " of ", end_ - begin_,
                                            " elements of [", begin_, ", ", end_, ")"));
  }

  // One GradientChunk reused, its data copied in by set_data.
  absl::Status PushStub(int64_t step, v1::WireFormat format, const void* grads) {
    const int64_t element_bytes = ps::WireElementBytes(format);
    grpc::ClientContext ctx;
    v1::PushGradientsResponse response;
    auto writer = stub_->PushGradients(&ctx, &response);
    v1::GradientChunk chunk;
    chunk.set_job_id(kJobId);
    chunk.set_attempt(1);
    chunk.set_step(step);
    chunk.set_format(format);
    bool ok = true;
    for (int64_t a = begin_; ok && a < end_; a += chunk_elements_) {
      const int64_t n = std::min(chunk_elements_, end_ - a);
      chunk.set_offset(a);
      chunk.set_data(static_cast<const char*>(grads) + a * element_bytes, n * element_bytes);
      ok = writer->Write(chunk);
    }
    writer->WritesDone();
    RETURN_IF_ERROR(Check(writer->Finish(), "push"));
    return CheckCount("push: staged", response.elements_staged());
  }

  // As offload.cc: rpc/ps/ps_client.h.
  absl::Status PushZeroCopy(int64_t step, v1::WireFormat format, const void* grads) {
    const v1::GradientChunk header = PushHeader(step, format);
    v1::PushGradientsResponse response;
    RETURN_IF_ERROR(
        Check(ps::PushGradientsZeroCopy(
                  *generic_, header,
                  static_cast<const char*>(grads) + begin_ * ps::WireElementBytes(format), begin_,
                  end_, chunk_elements_, absl::InfiniteDuration(), &response),
              "push"));
    return CheckCount("push: staged", response.elements_staged());
  }

  // As offload.cc by default: rpc/ps/data_plane_client.h.
  absl::Status PushDataPlane(int64_t step, v1::WireFormat format, const void* grads) {
    const v1::GradientChunk header = PushHeader(step, format);
    v1::PushGradientsResponse response;
    RETURN_IF_ERROR(Annotate(
        data_plane_->Push(header,
                          static_cast<const char*>(grads) + begin_ * ps::WireElementBytes(format),
                          begin_, end_, chunk_elements_, absl::InfiniteDuration(), &response),
        "push"));
    return CheckCount("push: staged", response.elements_staged());
  }

  absl::Status PullDataPlane(int64_t step, bool update, v1::WireFormat format, void* params,
                             Clock::time_point* first_chunk) {
    return Annotate(data_plane_->UpdateAndPull(
                        PullRequest(step, update, format),
                        static_cast<char*>(params) + begin_ * ps::WireElementBytes(format),
                        absl::InfiniteDuration(), [&] { *first_chunk = Clock::now(); }),
                    "pull");
  }

  // Each ParameterChunk parsed by protobuf, then copied into place.
  absl::Status PullStub(int64_t step, bool update, v1::WireFormat format, void* params,
                        Clock::time_point* first_chunk) {
    const int64_t element_bytes = ps::WireElementBytes(format);
    grpc::ClientContext ctx;
    auto reader = stub_->UpdateAndPull(&ctx, PullRequest(step, update, format));
    v1::ParameterChunk chunk;
    int64_t received = 0;
    while (reader->Read(&chunk)) {
      if (received == 0) *first_chunk = Clock::now();
      const int64_t n = static_cast<int64_t>(chunk.data().size()) / element_bytes;
      if (chunk.offset() < begin_ || chunk.offset() + n > end_ || chunk.format() != format) {
        ctx.TryCancel();
        reader->Finish();
        return absl::InternalError("pull: a chunk outside the range or in another format");
      }
      std::memcpy(static_cast<char*>(params) + chunk.offset() * element_bytes, chunk.data().data(),
                  chunk.data().size());
      received += n;
    }
    RETURN_IF_ERROR(Check(reader->Finish(), "pull"));
    return CheckCount("pull", received);
  }

  // As offload.cc: rpc/ps/ps_client.h.
  absl::Status PullZeroCopy(int64_t step, bool update, v1::WireFormat format, void* params,
                            Clock::time_point* first_chunk) {
    return Check(ps::UpdateAndPullZeroCopy(
                     *generic_, PullRequest(step, update, format),
                     static_cast<char*>(params) + begin_ * ps::WireElementBytes(format),
                     absl::InfiniteDuration(), [&] { *first_chunk = Clock::now(); }),
                 "pull");
  }

  absl::Status Check(const grpc::Status& s, absl::string_view what) const {
    return Annotate(FromGrpcStatus(s), what);
  }
  absl::Status Annotate(const absl::Status& s, absl::string_view what) const {
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat(what, " [", begin_, ", ", end_, "): ", s.message()));
  }

  const int64_t begin_, end_, chunk_elements_;
  const Flags::Client client_;
  const std::string tcp_congestion_;
  const std::string tls_dir_;                        // --tls-dir; empty: plain TCP
  std::unique_ptr<ps::DataPlaneClient> data_plane_;  // --client tcp, after Init
  std::unique_ptr<v1::ParameterServerService::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_;  // on the same channel
};

// ---- The benchmark. ----

// Per timed round, seconds.
// CPU time of this process and of `pids` (user + system, all threads), seconds.
double CpuSeconds(const std::vector<pid_t>& pids) {
  static const double ticks_per_second = static_cast<double>(sysconf(_SC_CLK_TCK));
  double ticks = 0;
  auto add = [&](const std::string& path) {
    FILE* f = std::fopen(path.c_str(), "r");
    if (f == nullptr) return;
    char buf[1024];
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = 0;
    // Fields 14 and 15 (utime, stime) follow the command, which ends at the last ')'.
    const char* p = std::strrchr(buf, ')');
    unsigned long long utime = 0, stime = 0;
    if (p != nullptr && std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                                    &utime, &stime) == 2) {
      ticks += static_cast<double>(utime + stime);
    }
  };
  add("/proc/self/stat");
  for (pid_t pid : pids) add(absl::StrCat("/proc/", pid, "/stat"));
  return ticks / ticks_per_second;
}

// Seconds of wall time and of CPU time (this process and the shards) of a kind of phase, summed
// over the timed rounds: CPU / wall is how many cores it kept busy.
struct Busy {
  double wall = 0, cpu = 0;
  double cores() const { return wall > 0 ? cpu / wall : 0; }
};

// Per timed round, seconds.
struct FormatTimes {
  std::vector<double> push, update_pull, pull, adam;
  Busy push_busy, pull_busy;
};

struct ShardCountResult {
  int k = 0;
  std::vector<double> socket_one_way, socket_round_trip;
  Busy socket_busy;
  FormatTimes fp32, bf16;
};

struct Buffers {
  std::vector<float> params, grads, pulled;
  std::vector<uint16_t> grads_bf16, pulled_bf16;
  std::vector<char> socket_dst;
};

// Starts k trainyard-ps processes (added to `fleet`, which stops them) and measures.
absl::StatusOr<ShardCountResult> RunShardCount(const Flags& flags, int k, Buffers& b,
                                               PsFleet& fleet) {
  const int64_t total = flags.params;
  ShardCountResult result;
  result.k = k;
  std::vector<std::unique_ptr<ShardClient>> clients;
  std::vector<pid_t> pids;
  for (int i = 0; i < k; ++i) {
    const int64_t begin = PartBegin(total, k, i), end = PartBegin(total, k, i + 1);
    ASSIGN_OR_RETURN(auto server,
                     PsProcess::Start(flags.ps_binary, (end - begin) * kPsBytesPerParam + (1 << 20),
                                      flags.tcp_congestion, flags.ps_logs, flags.tls_dir));
    clients.push_back(std::make_unique<ShardClient>(server->address(), begin, end, flags));
    pids.push_back(server->pid());
    fleet.Add(std::move(server));
  }
  RETURN_IF_ERROR(RunParallel(k, [&](int i) { return clients[i]->Init(total, b.params.data()); }));

  int64_t step = 0;
  // One optimizer step: push, update and pull, pure pull; each phase on k threads at once.
  auto run_step = [&](v1::WireFormat format, FormatTimes* times) -> absl::Status {
    const bool bf16 = format == v1::WIRE_BF16;
    const void* grads = bf16 ? static_cast<const void*>(b.grads_bf16.data()) : b.grads.data();
    void* pulled = bf16 ? static_cast<void*>(b.pulled_bf16.data()) : b.pulled.data();
    ++step;
    std::vector<Clock::time_point> first_chunk(k);
    // Seconds to the end of the phase, and to the last shard's first pulled chunk.
    auto phase = [&](const std::function<absl::Status(int)>& fn) -> absl::StatusOr<double> {
      const auto start = Clock::now();
      RETURN_IF_ERROR(RunParallel(k, fn));
      return Seconds(start);
    };
    auto latest_first_chunk = [&](Clock::time_point start) {
      return std::chrono::duration<double>(
                 *std::max_element(first_chunk.begin(), first_chunk.end()) - start)
          .count();
    };
    double cpu = CpuSeconds(pids);
    ASSIGN_OR_RETURN(const double push,
                     phase([&](int i) { return clients[i]->Push(step, format, grads); }));
    const double push_cpu = CpuSeconds(pids) - cpu;
    auto start = Clock::now();
    ASSIGN_OR_RETURN(const double update_pull, phase([&](int i) {
                       return clients[i]->Pull(step, true, format, pulled, &first_chunk[i]);
                     }));
    const double update_first = latest_first_chunk(start);
    start = Clock::now();
    cpu = CpuSeconds(pids);
    ASSIGN_OR_RETURN(const double pull, phase([&](int i) {
                       return clients[i]->Pull(step, false, format, pulled, &first_chunk[i]);
                     }));
    const double pull_cpu = CpuSeconds(pids) - cpu;
    const double pull_first = latest_first_chunk(start);
    if (times != nullptr) {
      times->push_busy.wall += push;
      times->push_busy.cpu += push_cpu;
      times->pull_busy.wall += pull;
      times->pull_busy.cpu += pull_cpu;
      times->push.push_back(push);
      times->update_pull.push_back(update_pull);
      times->pull.push_back(pull);
      times->adam.push_back(update_first - pull_first);
    }
    return absl::OkStatus();
  };

  const int64_t fp32_bytes = total * 4;
  char* src = reinterpret_cast<char*>(b.grads.data());
  char* back = reinterpret_cast<char*>(b.pulled.data());
  // The anchor's connections, opened once and warm in every round: to a peer process, or (as a
  // diagnostic) with both ends here.
  std::unique_ptr<AnchorPeer> peer;
  std::vector<std::unique_ptr<TcpConnection>> in_process;
  std::vector<std::vector<char>> bounce(flags.anchor_copies ? k : 0,
                                        std::vector<char>(kSocketIoBytes, 1));
  if (flags.anchor_in_process) {
    for (int i = 0; i < k; ++i) {
      ASSIGN_OR_RETURN(auto c, TcpConnection::Open(flags.tcp_congestion));
      in_process.push_back(std::move(c));
    }
  } else {
    ASSIGN_OR_RETURN(peer,
                     AnchorPeer::Start(k, fp32_bytes, flags.tcp_congestion, flags.anchor_copies));
  }
  const std::vector<pid_t> anchor_pids =
      peer ? std::vector<pid_t>{peer->pid()} : std::vector<pid_t>{};
  auto socket_transfer = [&](bool round_trip) -> absl::StatusOr<double> {
    if (peer) return peer->Transfer(src, back, fp32_bytes, round_trip, &bounce);
    return InProcessTransfer(in_process, src, b.socket_dst.data(), back, fp32_bytes, round_trip,
                             flags.anchor_copies);
  };
  for (int round = 0; round < flags.warmup + flags.reps; ++round) {
    const bool timed = round >= flags.warmup;
    const double cpu = CpuSeconds(anchor_pids);
    ASSIGN_OR_RETURN(const double one_way, socket_transfer(false));
    const double socket_cpu = CpuSeconds(anchor_pids) - cpu;
    ASSIGN_OR_RETURN(const double round_trip, socket_transfer(true));
    RETURN_IF_ERROR(run_step(v1::WIRE_FP32, timed ? &result.fp32 : nullptr));
    if (flags.bf16) RETURN_IF_ERROR(run_step(v1::WIRE_BF16, timed ? &result.bf16 : nullptr));
    if (timed) {
      result.socket_one_way.push_back(one_way);
      result.socket_busy.wall += one_way;
      result.socket_busy.cpu += socket_cpu;
      result.socket_round_trip.push_back(round_trip);
    }
  }
  if (flags.client != Flags::Client::kStub) {
    float* check = reinterpret_cast<float*>(b.socket_dst.data());
    RETURN_IF_ERROR(RunParallel(
        k, [&](int i) { return clients[i]->CheckPullAgainstStub(step, b.pulled.data(), check); }));
  }
  return result;
}

void PrintTable(const Flags& flags, const std::vector<ShardCountResult>& results) {
  if (!flags.rows_only) {
    std::printf(
        "| setup | TCP | shards | wire | socket GB/s | push GB/s | push / socket | pull GB/s | "
        "pull / "
        "socket | socket push+pull GB/s | push+pull GB/s | / socket | cores busy: socket, push, "
        "pull | AdamW ms | step ms | goal: push and pull >= 70%% of socket |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  }
  // The congestion control every connection of the run used.
  const std::string tcp = flags.tcp_congestion.empty()
                              ? ps::HostTcpCongestion().value_or("unknown") + " (host)"
                              : flags.tcp_congestion;
  const double fp32_bytes = 4.0 * static_cast<double>(flags.params);
  for (const ShardCountResult& r : results) {
    const double socket = fp32_bytes / Median(r.socket_one_way) / 1e9;
    const double socket_round_trip = 2 * fp32_bytes / Median(r.socket_round_trip) / 1e9;
    for (const bool bf16 : {false, true}) {
      if (bf16 && !flags.bf16) continue;
      const FormatTimes& t = bf16 ? r.bf16 : r.fp32;
      const double bytes = bf16 ? fp32_bytes / 2 : fp32_bytes;
      std::vector<double> push_pull, step;
      for (size_t i = 0; i < t.push.size(); ++i) {
        push_pull.push_back(t.push[i] + t.pull[i]);
        step.push_back(t.push[i] + t.update_pull[i]);
      }
      const double push = bytes / Median(t.push) / 1e9;
      const double pull = bytes / Median(t.pull) / 1e9;
      const double both = 2 * bytes / Median(push_pull) / 1e9;
      const bool met = push >= kGoalOfSocket * socket && pull >= kGoalOfSocket * socket;
      std::printf(
          "| %s | %s | %d | %s | %.2f | %.2f | %.0f%% | %.2f | %.0f%% | %.2f | %.2f | %.0f%% | "
          "%.1f, "
          "%.1f, %.1f | %.0f | %.0f | %s |\n",
          flags.label.c_str(), tcp.c_str(), r.k, bf16 ? "bf16" : "fp32", socket, push,
          100 * push / socket, pull, 100 * pull / socket, socket_round_trip, both,
          100 * both / socket_round_trip, r.socket_busy.cores(), t.push_busy.cores(),
          t.pull_busy.cores(), 1e3 * Median(t.adam), 1e3 * Median(step),
          flags.anchor_copies ? "n/a (socket copies on receive)"
          : met               ? "met"
                              : "NOT met");
    }
  }
  if (flags.rows_only) return;
  std::printf(
      "\nGB/s: bytes on the wire (fp32 4, bf16 2 per parameter, %.0f MB fp32 each way; 1 GB = "
      "1e9 B) / median seconds. socket: the fp32 bytes over k plain TCP connections, one way, "
      "sender and receiver on their own threads, the connections opened once and warm (with "
      "--anchor-copies, rows marked n/a: each receiver recv()s into a 4 MiB buffer and copies "
      "out; a diagnostic, not the goal's anchor). TCP: the congestion control of every "
      "connection in the row, the socket's and trainyard's alike. push: every range's gradients "
      "pushed (PushGradients, or a data-plane push); pull: every range's parameters pulled "
      "without an update (the transfer alone); push+pull: their sum, against the socket sending "
      "the bytes and receiving them back. cores busy: CPU seconds (this process and the shards, "
      "from /proc) / wall seconds over the rounds (%u cores here). AdamW ms: time to the last "
      "shard's first pulled byte with update minus without (k processes, 1 AdamW thread each). "
      "step ms: push + update-and-pull.\n",
      fp32_bytes / 1e6, std::thread::hardware_concurrency());
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  if (!flags.anchor_peer_fds.empty()) {
    return AnchorPeerMain(flags.anchor_peer_fds, flags.anchor_bytes, flags.anchor_copies);
  }
  if (absl::Status s = ps::CheckTcpCongestion(flags.tcp_congestion, "--tcp-congestion"); !s.ok()) {
    std::fprintf(stderr, "ps_transfer_bench: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (flags.tune_malloc) {
    mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
    mallopt(M_TRIM_THRESHOLD, kTrimThresholdBytes);
    mallopt(M_ARENA_MAX, 1);  // before any other thread allocates
  }
  if (!flags.rows_only) {
    std::string shard_list;
    for (int k : flags.shards) absl::StrAppend(&shard_list, shard_list.empty() ? "" : ",", k);
    std::printf(
        "parameter server push/pull vs plain TCP on loopback: %lld params (%.0f MiB fp32), shards "
        "%s, %lld-element chunks, median of %d rounds after %d warm-up\n\n",
        static_cast<long long>(flags.params), 4.0 * flags.params / (1 << 20), shard_list.c_str(),
        static_cast<long long>(flags.chunk_elements), flags.reps, flags.warmup);
    std::fflush(stdout);
  }

  const int64_t n = flags.params;
  Buffers b;
  b.params.resize(n);
  b.grads.resize(n);
  b.pulled.resize(n);
  b.grads_bf16.resize(n);
  b.pulled_bf16.resize(n);
  b.socket_dst.resize(n * 4);
  uint32_t state = 12345;
  for (int64_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    const float r = static_cast<float>(state >> 8) / static_cast<float>(1 << 24) - 0.5f;
    b.params[i] = r;
    b.grads[i] = 0.01f * r + 1e-3f;
  }
  adam::FloatToBf16(b.grads.data(), b.grads_bf16.data(), n);

  PsFleet fleet;  // after the buffers: stopped and reaped first, on every return
  std::vector<ShardCountResult> results;
  for (int k : flags.shards) {
    const auto start = Clock::now();
    auto r = RunShardCount(flags, k, b, fleet);
    fleet.TerminateAll();  // they exit while the next shard count runs
    if (!r.ok()) {
      std::fprintf(stderr, "%d shard(s): %s\n", k, r.status().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "%s: %d shard(s) measured in %.1f s\n", flags.label.c_str(), k,
                 Seconds(start));
    results.push_back(*std::move(r));
  }
  PrintTable(flags, results);
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace trainyard::bench

int main(int argc, char** argv) { return trainyard::bench::Main(argc, argv); }
