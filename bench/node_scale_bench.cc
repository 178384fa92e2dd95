// The coordinator at node scale, measured from outside: a real trainyard-coordinator process (its
// defaults: heartbeats every 2 s, nodes lost after 10 s without one; SQLite in a temp dir) and, in
// this process, N simulated worker nodes speaking the real node protocol over real gRPC (node
// tokens, RegisterNode, a Session stream with hello and heartbeats, assignments answered as a
// worker answers them: each rank reported running, then exited 0). For each N it reports the
// coordinator's RSS, CPU and threads and the heartbeat round trip (p50/p99) idle and during a
// burst of concurrent submits, the nodes falsely declared LOST, the burst's submits/s and
// submit-to-assignment latency, sustained submits/s (32 in flight), and where the coordinator's
// CPU went (its threads by name).
//
//   build/bin/node_scale_bench [--nodes 1000,5000,10000] [--burst 1000] [--idle-s 10]
//       [--coordinator build/bin/trainyard-coordinator] [--dir /var/tmp]
// Exit code 1 when a node was falsely declared lost (the check ctest runs at a small scale).
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "trainyard/v1/identity.grpc.pb.h"
#include "trainyard/v1/job.grpc.pb.h"
#include "trainyard/v1/node.grpc.pb.h"

namespace trainyard {
namespace {

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

// Heartbeat round trips (ms) and submit-to-assignment latencies, collected from every node.
struct Samples {
  std::mutex mu;
  std::vector<double> rtt_ms;
  std::vector<double> assign_ms;
  std::map<std::string, absl::Time> submitted;  // job id -> when its submit was answered
  std::atomic<int64_t> sessions_ended{0};
  std::atomic<int64_t> ranks_run{0};

  std::vector<double> TakeRtt() {
    std::lock_guard<std::mutex> lock(mu);
    return std::exchange(rtt_ms, {});
  }
};

class FakeNode : public grpc::ClientBidiReactor<v1::NodeMessage, v1::CoordinatorMessage> {
 public:
  FakeNode(std::string id, std::string token, Samples* samples)
      : id_(std::move(id)), token_(std::move(token)), samples_(samples) {}

  void Start(v1::NodeService::Stub* stub) {
    ctx_.AddMetadata(kAuthorizationMetadata, "Bearer " + token_);
    stub->async()->Session(&ctx_, this);
    StartRead(&in_);
    v1::NodeMessage hello;
    hello.mutable_hello()->set_node_id(id_);
    Push(std::move(hello));
    StartCall();
  }

  void Heartbeat() {
    v1::NodeMessage m;
    const absl::Time now = absl::Now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      m.mutable_heartbeat()->set_seq(++seq_);
      in_flight_[seq_] = now;
    }
    m.mutable_heartbeat()->set_sent_time_ms(absl::ToUnixMillis(now));
    Push(std::move(m));
  }

  void Stop() { ctx_.TryCancel(); }
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    if (in_.has_heartbeat_ack()) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = in_flight_.find(in_.heartbeat_ack().seq());
      if (it != in_flight_.end()) {
        const double ms = absl::ToDoubleMilliseconds(absl::Now() - it->second);
        in_flight_.erase(in_flight_.begin(), std::next(it));
        std::lock_guard<std::mutex> s(samples_->mu);
        samples_->rtt_ms.push_back(ms);
      }
    } else if (in_.has_assignment()) {
      const v1::Assignment& a = in_.assignment();
      {
        std::lock_guard<std::mutex> s(samples_->mu);
        auto it = samples_->submitted.find(a.job_id());
        if (it != samples_->submitted.end()) {
          samples_->assign_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - it->second));
        }
      }
      for (int i = 0; i < a.device_indices_size(); ++i) {
        for (v1::RankPhase phase : {v1::RANK_RUNNING, v1::RANK_EXITED}) {
          v1::NodeMessage m;
          v1::RankStatus* r = m.mutable_rank_status();
          r->set_job_id(a.job_id());
          r->set_attempt(a.attempt());
          r->set_rank(a.first_rank() + i);
          r->set_phase(phase);
          r->set_exit_code(0);
          r->set_device(a.device_indices(i));
          Push(std::move(m));
        }
        ++samples_->ranks_run;
      }
    } else if (in_.has_cancel()) {
      // Nothing runs: the ranks already reported their exit.
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.pop_front();
    if (!ok || done_) {
      writing_ = false;
      return;
    }
    if (!queue_.empty()) {
      StartWrite(&queue_.front());
    } else {
      writing_ = false;
    }
  }

  void OnDone(const grpc::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = s;
    ++samples_->sessions_ended;
  }

 private:
  void Push(v1::NodeMessage m) {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    queue_.push_back(std::move(m));
    if (!writing_) {
      writing_ = true;
      StartWrite(&queue_.front());
    }
  }

  const std::string id_, token_;
  Samples* samples_;
  grpc::ClientContext ctx_;
  v1::CoordinatorMessage in_;
  std::mutex mu_;
  std::deque<v1::NodeMessage> queue_;
  bool writing_ = false;
  bool done_ = false;
  grpc::Status status_;
  int64_t seq_ = 0;
  std::map<int64_t, absl::Time> in_flight_;
};

// Runs `n` calls of `call(i, done)` with at most `window` in flight; waits for all.
void Windowed(int n, int window, const std::function<void(int, std::function<void()>)>& call) {
  std::mutex mu;
  std::condition_variable cv;
  int started = 0, finished = 0;
  std::unique_lock<std::mutex> lock(mu);
  while (finished < n) {
    while (started < n && started - finished < window) {
      const int i = started++;
      lock.unlock();
      call(i, [&] {
        std::lock_guard<std::mutex> l(mu);
        ++finished;
        cv.notify_all();
      });
      lock.lock();
    }
    cv.wait(lock);
  }
}

// The coordinator child process.
struct Coordinator {
  pid_t pid = -1;
  std::string address;
  std::string metrics;  // HOST:PORT of its /metrics
  std::string state_dir;
};

// GET http://HOST:PORT/metrics (loopback, no TLS); "" on error.
std::string ScrapeMetrics(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) return "";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::atoi(host_port.c_str() + colon + 1)));
  inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &addr.sin_addr);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

// The cumulative buckets (le -> count) of a histogram without labels in a /metrics page.
std::map<double, double> Buckets(const std::string& page, const std::string& name) {
  std::map<double, double> out;
  const std::string prefix = name + "_bucket{le=\"";
  for (absl::string_view line : absl::StrSplit(page, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    line.remove_prefix(prefix.size());
    const size_t q = line.find('"');
    const size_t space = line.rfind(' ');
    if (q == absl::string_view::npos || space == absl::string_view::npos) continue;
    const std::string le(line.substr(0, q));
    double count = 0;
    if (!absl::SimpleAtod(line.substr(space + 1), &count)) continue;
    out[le == "+Inf" ? std::numeric_limits<double>::infinity() : std::atof(le.c_str())] = count;
  }
  return out;
}

// The bucket bound below which a fraction `p` of the observations made between two scrapes fell.
double BucketQuantile(const std::map<double, double>& before, const std::map<double, double>& after,
                      double p) {
  if (after.empty()) return 0;
  const double total = after.rbegin()->second - (before.empty() ? 0 : before.rbegin()->second);
  if (total <= 0) return 0;
  for (const auto& [le, count] : after) {
    const auto b = before.find(le);
    if (count - (b == before.end() ? 0 : b->second) >= p * total) return le;
  }
  return std::numeric_limits<double>::infinity();
}

Coordinator StartCoordinator(const std::string& binary, const std::string& dir) {
  Coordinator c;
  c.state_dir = dir + "/state";
  int out[2];
  if (pipe(out) != 0) return c;
  c.pid = fork();
  if (c.pid == 0) {
    dup2(out[1], 1);
    close(out[0]);
    // Its log (an audit line per submit) to a file, not into the report.
    const std::string log = dir + "/coordinator.log";
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) dup2(fd, 2);
    execl(binary.c_str(), binary.c_str(), "--listen", "127.0.0.1:0", "--state-dir",
          c.state_dir.c_str(), "--max-tokens-per-user", "-1", "--max-queued-jobs-per-user", "-1",
          "--metrics-address", "127.0.0.1:0", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  std::string line, metrics;
  char ch;
  while (read(out[0], &ch, 1) == 1 && ch != '\n') line.push_back(ch);
  while (read(out[0], &ch, 1) == 1 && ch != '\n') metrics.push_back(ch);
  if (absl::StartsWith(metrics, "metrics ")) c.metrics = metrics.substr(8);
  // Keep draining its stdout so that it never blocks on a full pipe.
  std::thread([fd = out[0]] {
    char buf[4096];
    while (read(fd, buf, sizeof buf) > 0) {
    }
    close(fd);
  }).detach();
  c.address = line;
  return c;
}

// From /proc: resident bytes, threads, CPU seconds; and CPU seconds by thread name.
struct ProcStats {
  int64_t rss_bytes = 0;
  int threads = 0;
  double cpu_s = 0;
  std::map<std::string, double> by_thread;
};

double StatCpuSeconds(const std::string& stat_path, std::string* comm) {
  std::ifstream f(stat_path);
  std::string line;
  if (!std::getline(f, line)) return 0;
  const size_t open = line.find('('), close = line.rfind(')');
  if (comm != nullptr && open != std::string::npos) *comm = line.substr(open + 1, close - open - 1);
  std::vector<std::string> fields = absl::StrSplit(line.substr(close + 2), ' ');
  double utime = 0, stime = 0;
  if (fields.size() > 13) {
    (void)absl::SimpleAtod(fields[11], &utime);
    (void)absl::SimpleAtod(fields[12], &stime);
  }
  return (utime + stime) / sysconf(_SC_CLK_TCK);
}

ProcStats ReadProc(pid_t pid) {
  ProcStats s;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    int64_t v = 0;
    if (line.rfind("VmRSS:", 0) == 0 &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(6, line.size() - 9)), &v)) {
      s.rss_bytes = v * 1024;
    }
    if (line.rfind("Threads:", 0) == 0) {
      (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(8)), &s.threads);
    }
  }
  s.cpu_s = StatCpuSeconds(absl::StrCat("/proc/", pid, "/stat"), nullptr);
  for (const auto& e : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"))) {
    std::string comm;
    const double cpu = StatCpuSeconds(e.path().string() + "/stat", &comm);
    s.by_thread[comm] += cpu;
  }
  return s;
}

v1::JobSpec Spec(int i) {
  v1::JobSpec s;
  s.set_name(absl::StrFormat("burst-%d", i));
  s.set_priority(50);
  s.mutable_resources()->set_slots(1);
  auto* m = s.mutable_model();
  m->set_kind("gpt");
  m->set_n_layer(2);
  m->set_n_head(2);
  m->set_d_model(64);
  m->set_seq_len(32);
  m->set_vocab(256);
  s.mutable_data()->set_path("/usr/share/common-licenses/GPL-3");
  s.mutable_data()->set_format("bytes");
  s.mutable_train()->set_steps(10);
  s.mutable_train()->set_micro_batch(4);
  return s;
}

struct Row {
  int nodes = 0;
  double connect_s = 0;
  ProcStats idle;
  double idle_cpu_share = 0;
  double idle_p50 = 0, idle_p99 = 0;
  double burst_p50 = 0, burst_p99 = 0, burst_max = 0;
  double event_delay_p99_ms = 0;  // the coordinator's own share: its node-events queue
  double burst_submits_per_s = 0;
  int64_t burst_errors = 0;
  double assign_p50 = 0, assign_p99 = 0;
  int64_t assigned = 0;
  double sustained_per_s = 0;
  int64_t lost = 0;
  int64_t sessions_ended = 0;
  ProcStats after;
  std::vector<std::pair<double, std::string>> burst_threads;
};

std::string Call(const grpc::Status& s) {
  return s.ok() ? "ok" : absl::StrCat(s.error_code(), ": ", s.error_message());
}

bool RunScale(const std::string& coordinator_bin, const std::string& base, int n, int burst,
              double idle_s, Row* row) {
  const std::string dir = absl::StrFormat("%s/trainyard-node-scale-%d-%d", base, getpid(), n);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  Coordinator c = StartCoordinator(coordinator_bin, dir);
  if (c.address.empty()) {
    std::fprintf(stderr, "node_scale_bench: the coordinator did not start\n");
    return false;
  }
  auto cleanup = [&] {
    kill(c.pid, SIGTERM);
    waitpid(c.pid, nullptr, 0);
    std::filesystem::remove_all(dir);
  };
  std::string admin;
  {
    std::ifstream f(c.state_dir + "/admin.token");
    std::getline(f, admin);
  }
  // Channels: the nodes' sessions spread over 16 connections, as many hosts' would be over many.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < 16; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("trainyard.bench.channel", i);  // a connection of its own
    args.SetMaxReceiveMessageSize(64 << 20);
    channels.push_back(
        grpc::CreateCustomChannel(c.address, grpc::InsecureChannelCredentials(), args));
  }
  auto identity = v1::IdentityService::NewStub(channels[0]);
  auto authorize = [](grpc::ClientContext* ctx, const std::string& token) {
    ctx->AddMetadata(kAuthorizationMetadata, "Bearer " + token);
  };
  std::string user_token;
  {
    grpc::ClientContext ctx;
    authorize(&ctx, admin);
    v1::CreateUserRequest r;
    r.set_name("alice");
    v1::User u;
    identity->CreateUser(&ctx, r, &u);
    grpc::ClientContext ctx2;
    authorize(&ctx2, admin);
    v1::CreateTokenRequest t;
    t.set_user("alice");
    v1::CreateTokenResponse resp;
    const grpc::Status s = identity->CreateToken(&ctx2, t, &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "node_scale_bench: user token: %s\n", Call(s).c_str());
      cleanup();
      return false;
    }
    user_token = resp.token();
  }
  // Node tokens and registrations, 64 at a time.
  std::vector<std::string> tokens(n);
  std::atomic<int> failures{0};
  Windowed(n, 64, [&](int i, std::function<void()> done) {
    auto ctx = std::make_shared<grpc::ClientContext>();
    authorize(ctx.get(), admin);
    auto req = std::make_shared<v1::CreateTokenRequest>();
    req->set_user("admin");
    req->set_node(absl::StrFormat("node-%05d", i));
    auto resp = std::make_shared<v1::CreateTokenResponse>();
    identity->async()->CreateToken(ctx.get(), req.get(), resp.get(),
                                   [&, i, ctx, req, resp, done](grpc::Status s) {
                                     if (s.ok()) {
                                       tokens[i] = resp->token();
                                     } else if (failures++ == 0) {
                                       std::fprintf(stderr, "token: %s\n", Call(s).c_str());
                                     }
                                     done();
                                   });
  });
  std::vector<std::unique_ptr<v1::NodeService::Stub>> node_stubs;
  for (auto& ch : channels) node_stubs.push_back(v1::NodeService::NewStub(ch));
  Samples samples;
  std::vector<std::unique_ptr<FakeNode>> nodes;
  for (int i = 0; i < n; ++i) {
    nodes.push_back(
        std::make_unique<FakeNode>(absl::StrFormat("node-%05d", i), tokens[i], &samples));
  }
  std::vector<std::atomic<bool>> started(n);
  // Heartbeats every 2 s per node once its session is open, spread evenly over the period (as
  // independent hosts are).
  std::atomic<bool> stop{false};
  std::thread ticker([&] {
    const absl::Duration period = absl::Seconds(2);
    const int batch = std::max(1, n / 200);
    while (!stop) {
      const absl::Time start = absl::Now();
      for (int i = 0; i < n && !stop; i += batch) {
        for (int j = i; j < std::min(n, i + batch); ++j) {
          if (started[j]) nodes[j]->Heartbeat();
        }
        absl::SleepFor(start + period * (double(i + batch) / n) - absl::Now());
      }
    }
  });
  // Each node opens its session as soon as it is registered, as a worker does.
  const absl::Time t_register = absl::Now();
  Windowed(n, 64, [&](int i, std::function<void()> done) {
    auto ctx = std::make_shared<grpc::ClientContext>();
    authorize(ctx.get(), tokens[i]);
    auto req = std::make_shared<v1::RegisterNodeRequest>();
    req->set_node_id(absl::StrFormat("node-%05d", i));
    req->set_hostname(req->node_id());
    req->set_memory_bytes(int64_t{512} << 30);
    for (int d = 0; d < 8; ++d) {
      v1::Device* dev = req->add_devices();
      dev->set_index(d);
      dev->set_kind(v1::CUDA_GPU);
      dev->set_name("Simulated H100");
      dev->set_memory_bytes(int64_t{80} << 30);
    }
    auto resp = std::make_shared<v1::RegisterNodeResponse>();
    node_stubs[i % node_stubs.size()]->async()->RegisterNode(
        ctx.get(), req.get(), resp.get(), [&, i, ctx, req, resp, done](grpc::Status s) {
          if (!s.ok()) {
            if (failures++ == 0) std::fprintf(stderr, "register: %s\n", Call(s).c_str());
          } else {
            nodes[i]->Start(node_stubs[i % node_stubs.size()].get());
            started[i] = true;
          }
          done();
        });
  });
  if (failures > 0) {
    std::fprintf(stderr, "node_scale_bench: %d token or registration failures\n", failures.load());
    stop = true;
    ticker.join();
    for (int i = 0; i < n; ++i) {
      if (started[i]) nodes[i]->Stop();
    }
    for (int i = 0; i < n; ++i) {
      while (started[i] && !nodes[i]->done()) absl::SleepFor(absl::Milliseconds(1));
    }
    cleanup();
    return false;
  }
  auto node_stub = v1::NodeService::NewStub(channels[1]);
  auto count_nodes = [&](int64_t* ready, int64_t* lost) {
    grpc::ClientContext ctx;
    authorize(&ctx, admin);
    v1::ListNodesResponse resp;
    const grpc::Status s = node_stub->ListNodes(&ctx, v1::ListNodesRequest(), &resp);
    *ready = *lost = 0;
    for (const v1::Node& nd : resp.nodes()) {
      *ready += nd.state() == v1::NODE_READY && nd.connected();
      *lost += nd.state() == v1::NODE_LOST;
    }
    return s.ok();
  };
  int64_t ready = 0, lost = 0;
  while (absl::Now() - t_register < absl::Minutes(2)) {
    if (count_nodes(&ready, &lost) && ready == n) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  row->nodes = n;
  row->connect_s = absl::ToDoubleSeconds(absl::Now() - t_register);
  if (ready != n) {
    std::fprintf(stderr, "node_scale_bench: only %lld of %d nodes connected\n",
                 static_cast<long long>(ready), n);
  }

  // Idle.
  absl::SleepFor(absl::Seconds(2));
  samples.TakeRtt();
  const ProcStats idle_start = ReadProc(c.pid);
  absl::SleepFor(absl::Seconds(idle_s));
  row->idle = ReadProc(c.pid);
  row->idle_cpu_share = (row->idle.cpu_s - idle_start.cpu_s) / idle_s;
  std::vector<double> rtt = samples.TakeRtt();
  row->idle_p50 = Percentile(rtt, 0.5);
  row->idle_p99 = Percentile(rtt, 0.99);

  // The burst: `burst` submits at once.
  std::vector<std::unique_ptr<v1::JobService::Stub>> job_stubs;
  for (auto& ch : channels) job_stubs.push_back(v1::JobService::NewStub(ch));
  const ProcStats burst_start = ReadProc(c.pid);
  const auto delay_before = Buckets(ScrapeMetrics(c.metrics), "trainyard_node_event_delay_seconds");
  std::atomic<int64_t> errors{0};
  const absl::Time b0 = absl::Now();
  Windowed(burst, burst, [&](int i, std::function<void()> done) {
    auto ctx = std::make_shared<grpc::ClientContext>();
    authorize(ctx.get(), user_token);
    auto req = std::make_shared<v1::SubmitJobRequest>();
    *req->mutable_spec() = Spec(i);
    auto resp = std::make_shared<v1::SubmitJobResponse>();
    job_stubs[i % job_stubs.size()]->async()->SubmitJob(
        ctx.get(), req.get(), resp.get(), [&, ctx, req, resp, done](grpc::Status s) {
          if (s.ok()) {
            std::lock_guard<std::mutex> lock(samples.mu);
            samples.submitted[resp->job().id()] = absl::Now();
          } else if (errors++ == 0) {
            std::fprintf(stderr, "submit: %s\n", Call(s).c_str());
          }
          done();
        });
  });
  const double burst_s = absl::ToDoubleSeconds(absl::Now() - b0);
  row->burst_submits_per_s = burst / burst_s;
  row->burst_errors = errors;
  // Until every accepted job has been placed (or 60 s), then the heartbeats of the whole window.
  const int64_t accepted = burst - errors;
  while (absl::Now() - b0 < absl::Seconds(60)) {
    {
      std::lock_guard<std::mutex> lock(samples.mu);
      if (static_cast<int64_t>(samples.assign_ms.size()) >= accepted) break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  const ProcStats burst_end = ReadProc(c.pid);
  for (const auto& [name, cpu] : burst_end.by_thread) {
    const double before = burst_start.by_thread.count(name) ? burst_start.by_thread.at(name) : 0;
    if (cpu - before > 0.005) row->burst_threads.push_back({cpu - before, name});
  }
  std::sort(row->burst_threads.rbegin(), row->burst_threads.rend());
  absl::SleepFor(absl::Seconds(2));  // the heartbeats sent during the burst come back
  row->event_delay_p99_ms =
      1e3 * BucketQuantile(delay_before,
                           Buckets(ScrapeMetrics(c.metrics), "trainyard_node_event_delay_seconds"),
                           0.99);
  rtt = samples.TakeRtt();
  row->burst_p50 = Percentile(rtt, 0.5);
  row->burst_p99 = Percentile(rtt, 0.99);
  row->burst_max = rtt.empty() ? 0 : *std::max_element(rtt.begin(), rtt.end());
  {
    std::lock_guard<std::mutex> lock(samples.mu);
    row->assigned = static_cast<int64_t>(samples.assign_ms.size());
    row->assign_p50 = Percentile(samples.assign_ms, 0.5);
    row->assign_p99 = Percentile(samples.assign_ms, 0.99);
  }

  // Sustained: 32 submits in flight for 5 s.
  std::atomic<int64_t> done_submits{0};
  {
    std::atomic<bool> over{false};
    std::mutex mu;
    std::condition_variable cv;
    int in_flight = 0;
    std::function<void(int)> issue = [&](int i) {
      auto ctx = std::make_shared<grpc::ClientContext>();
      authorize(ctx.get(), user_token);
      auto req = std::make_shared<v1::SubmitJobRequest>();
      *req->mutable_spec() = Spec(i);
      auto resp = std::make_shared<v1::SubmitJobResponse>();
      job_stubs[i % job_stubs.size()]->async()->SubmitJob(ctx.get(), req.get(), resp.get(),
                                                          [&, i, ctx, req, resp](grpc::Status s) {
                                                            if (s.ok()) ++done_submits;
                                                            if (!over) {
                                                              issue(i + 32);
                                                              return;
                                                            }
                                                            std::lock_guard<std::mutex> lock(mu);
                                                            --in_flight;
                                                            cv.notify_all();
                                                          });
    };
    in_flight = 32;
    const absl::Time s0 = absl::Now();
    for (int i = 0; i < 32; ++i) issue(burst + i);
    absl::SleepFor(absl::Seconds(5));
    const int64_t counted = done_submits;
    const double secs = absl::ToDoubleSeconds(absl::Now() - s0);
    over = true;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return in_flight == 0; });
    row->sustained_per_s = counted / secs;
  }

  // Past the node timeout, every node must still be there.
  absl::SleepFor(absl::Seconds(11));
  count_nodes(&ready, &lost);
  row->lost = lost;
  row->sessions_ended = samples.sessions_ended;
  row->after = ReadProc(c.pid);
  stop = true;
  ticker.join();
  for (auto& nd : nodes) nd->Stop();
  for (auto& nd : nodes) {
    while (!nd->done()) absl::SleepFor(absl::Milliseconds(1));
  }
  cleanup();
  return true;
}

}  // namespace
}  // namespace trainyard

int main(int argc, char** argv) {
  using namespace trainyard;
  std::vector<int> scales = {1000, 5000, 10000};
  int burst = 1000;
  double idle_s = 10;
  std::string coordinator = "build/bin/trainyard-coordinator";
  std::string dir = "/var/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--nodes") {
      scales.clear();
      for (absl::string_view v : absl::StrSplit(value, ',')) {
        int x = 0;
        if (absl::SimpleAtoi(v, &x)) scales.push_back(x);
      }
    } else if (flag == "--burst") {
      burst = std::atoi(value.c_str());
    } else if (flag == "--idle-s") {
      idle_s = std::atof(value.c_str());
    } else if (flag == "--coordinator") {
      coordinator = value;
    } else if (flag == "--dir") {
      dir = value;
    } else {
      std::fprintf(stderr, "node_scale_bench: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  signal(SIGPIPE, SIG_IGN);
  std::printf(
      "| nodes | register+connect s | RSS MiB (idle / after) | threads | CPU idle | hb p50/p99 ms "
      "idle | "
      "hb p50/p99/max ms burst | of which queued in the coordinator, p99 ms (bucket bound) | false "
      "LOST | sessions ended | burst submits/s (errors) | "
      "submit->assigned p50/p99 ms | sustained submits/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  bool ok = true;
  std::vector<Row> rows;
  for (int n : scales) {
    Row r;
    if (!RunScale(coordinator, dir, n, burst, idle_s, &r)) return 1;
    std::printf(
        "| %d | %.1f | %.0f / %.0f | %d | %.0f%% | %.1f / %.1f | %.1f / %.1f / %.0f | %g | %lld | "
        "%lld "
        "| %.0f (%lld) | %.0f / %.0f | %.0f |\n",
        r.nodes, r.connect_s, r.idle.rss_bytes / 1048576.0, r.after.rss_bytes / 1048576.0,
        r.idle.threads, 100 * r.idle_cpu_share, r.idle_p50, r.idle_p99, r.burst_p50, r.burst_p99,
        r.burst_max, r.event_delay_p99_ms, static_cast<long long>(r.lost),
        static_cast<long long>(r.sessions_ended), r.burst_submits_per_s,
        static_cast<long long>(r.burst_errors), r.assign_p50, r.assign_p99, r.sustained_per_s);
    std::fflush(stdout);
    ok = ok && r.lost == 0 && r.sessions_ended == 0;
    rows.push_back(std::move(r));
  }
  std::printf("\nWhere the coordinator's CPU went during the burst (seconds, by thread name):\n");
  for (const Row& r : rows) {
    std::printf("- %d nodes:", r.nodes);
    for (size_t i = 0; i < std::min<size_t>(6, r.burst_threads.size()); ++i) {
      std::printf(" %s %.2f;", r.burst_threads[i].second.c_str(), r.burst_threads[i].first);
    }
    std::printf("\n");
  }
  return ok ? 0 : 1;
}
