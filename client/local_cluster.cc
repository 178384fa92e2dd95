#include "client/local_cluster.h"

#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/yard_client.h"
#include "common/credentials.h"
#include "common/status_macros.h"
#include "rpc/ps/tcp_congestion.h"

namespace trainyard::client {
namespace {

namespace fs = std::filesystem;

std::string StateFile(const std::string& dir) { return dir + "/local.json"; }

// Saves `token` at `path` for later yard calls, unless the token there already works with this
// coordinator; another token there is kept as PATH.bak (PATH.bak.2, .3, ... when that is taken:
// a second local cluster must not overwrite the real login the first one moved aside).
absl::Status SaveTokenForYard(const std::string& coordinator, const std::string& token,
                              const std::string& path, const TlsClientOptions& tls) {
  auto existing = ReadSecretFile(path);
  if (existing.ok()) {
    if (*existing == token || YardClient(coordinator, *existing, tls).WhoAmI().ok()) {
      return absl::OkStatus();
    }
    std::error_code ec;
    std::string kept = path + ".bak";
    for (int n = 2; fs::exists(fs::symlink_status(kept, ec)) && n < 1000; ++n) {
      kept = absl::StrCat(path, ".bak.", n);
    }
    if (fs::exists(fs::symlink_status(kept, ec))) {
      return absl::UnavailableError(absl::StrCat(path, ": cannot keep it: ", kept, " is taken"));
    }
    fs::rename(path, kept, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat(path, ": cannot keep it as ", kept, ": ", ec.message()));
    }
    std::cerr << "yard: the token that was in " << path << " is kept as " << kept << "\n";
  }
  return WriteSecretFile(path, token);
}

bool IsTrainyardProcess(pid_t pid) {
  if (pid <= 0 || kill(pid, 0) != 0) return false;
  std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"));
  std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return cmdline.find("trainyard") != std::string::npos;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Tail(const std::string& text, size_t lines) {
  size_t pos = text.size();
  for (size_t n = 0; n <= lines && pos > 0; ++n) {
    pos = text.rfind('\n', pos - 1);
    if (pos == std::string::npos) return text;
  }
  return text.substr(pos + 1);
}

// Starts `argv` detached (own session), stdout and stderr to files; returns its pid. Each of
// `env` is set in its environment, or unset where the value is empty.
absl::StatusOr<pid_t> SpawnDaemon(
    const std::vector<std::string>& argv, const std::string& out, const std::string& err,
    const std::vector<std::pair<std::string, std::string>>& env = {}) {
  std::vector<char*> c_argv;
  std::vector<std::string> copy = argv;
  for (auto& a : copy) c_argv.push_back(a.data());
  c_argv.push_back(nullptr);
  // The child's environment, built here: after fork only async-signal-safe calls.
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    if (std::none_of(env.begin(), env.end(), [&](const auto& v) { return v.first == name; })) {
      environment.push_back(entry);
    }
  }
  for (const auto& [name, value] : env) {
    if (!value.empty()) environment.push_back(absl::StrCat(name, "=", value));
  }
  std::vector<char*> c_envp;
  for (auto& e : environment) c_envp.push_back(e.data());
  c_envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  if (pid == 0) {
    setsid();
    const int in_fd = open("/dev/null", O_RDONLY);
    const int out_fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err_fd = open(err.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (in_fd < 0 || out_fd < 0 || err_fd < 0) _exit(126);
    dup2(in_fd, STDIN_FILENO);
    dup2(out_fd, STDOUT_FILENO);
    dup2(err_fd, STDERR_FILENO);
    for (int fd = 3; fd < 1024; ++fd) close(fd);
    execve(c_argv[0], c_argv.data(), c_envp.data());
    _exit(127);
  }
  return pid;
}

absl::Status Save(const LocalCluster& c) {
  nlohmann::json j;
  j["coordinator_address"] = c.coordinator_address;
  j["admin_token_file"] = c.admin_token_file;
  j["tls_ca"] = c.tls_ca;
  j["web_url"] = c.web_url;
  for (const auto& p : c.processes) {
    j["processes"].push_back({{"name", p.name},
                              {"pid", p.pid},
                              {"address", p.address},
                              {"log", p.log},
                              {"metrics_address", p.metrics_address}});
  }
  const std::string path = StateFile(c.state_dir);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

// Complete lines of a daemon's stdout so far.
std::vector<std::string> PrintedLines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0, nl;
  while ((nl = text.find('\n', start)) != std::string::npos) {
    lines.push_back(std::string(absl::StripAsciiWhitespace(text.substr(start, nl - start))));
    start = nl + 1;
  }
  return lines;
}

// "metrics 127.0.0.1:9100" → "127.0.0.1:9100"; "" otherwise.
std::string MetricsAddressIn(const std::string& line) {
  return line.rfind("metrics ", 0) == 0 ? line.substr(8) : std::string();
}

}  // namespace

std::string SelfDir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : self.parent_path().string();
}

absl::StatusOr<LocalCluster> LocalStatus(const std::string& state_dir) {
  const std::string text = ReadFile(StateFile(state_dir));
  if (text.empty()) {
    return absl::NotFoundError(absl::StrCat("no local cluster was started from ", state_dir));
  }
  LocalCluster c;
  c.state_dir = state_dir;
  try {
    const auto j = nlohmann::json::parse(text);
    c.coordinator_address = j.at("coordinator_address").get<std::string>();
    c.admin_token_file = j.value("admin_token_file", std::string());
    c.tls_ca = j.value("tls_ca", std::string());
    c.web_url = j.value("web_url", std::string());
    for (const auto& p : j.at("processes")) {
      LocalProcess lp;
      lp.name = p.at("name").get<std::string>();
      lp.pid = p.at("pid").get<pid_t>();
      lp.address = p.at("address").get<std::string>();
      lp.log = p.at("log").get<std::string>();
      lp.metrics_address = p.value("metrics_address", "");
      lp.alive = IsTrainyardProcess(lp.pid);
      c.processes.push_back(lp);
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(StateFile(state_dir), ": unreadable: ", e.what()));
  }
  return c;
}

namespace {

// A daemon of the cluster with --metrics-address 127.0.0.1:0: waits for the line (`line` of its
// output, 0-based) that says where it serves them.
absl::Status AwaitMetricsAddress(LocalProcess& p, const std::string& out, size_t line) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (p.metrics_address.empty()) {
    const std::vector<std::string> lines = PrintedLines(ReadFile(out));
    if (lines.size() > line) p.metrics_address = MetricsAddressIn(lines[line]);
    if (!p.metrics_address.empty()) break;
    if (absl::Now() > deadline || waitpid(p.pid, nullptr, WNOHANG) == p.pid) {
      return absl::UnavailableError(absl::StrCat(p.name, " did not serve metrics; see ", p.log));
    }
    absl::SleepFor(absl::Milliseconds(20));  // a detached child: no event to wait on
  }
  return absl::OkStatus();
}

// The coordinator, started and serving (its bound address, and its metrics address, read from
// its output).
absl::StatusOr<LocalProcess> StartLocalCoordinator(const LocalUpOptions& options) {
  const std::string bin = options.bin_dir + "/trainyard-coordinator";
  if (access(bin.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot find ", bin));
  }
  LocalProcess coord;
  coord.name = "coordinator";
  coord.log = options.state_dir + "/coordinator.log";
  const std::string out = options.state_dir + "/coordinator.out";
  std::vector<std::string> coord_argv = {bin, "--listen", options.listen, "--state-dir",
                                         options.state_dir};
  coord_argv.insert(coord_argv.end(), options.coordinator_flags.begin(),
                    options.coordinator_flags.end());
  if (!options.tls_cert.empty()) {
    if (options.tls_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls-ca: a local cluster serving TLS needs the CA its clients verify it with");
    }
    coord_argv.insert(coord_argv.end(),
                      {"--tls-cert", options.tls_cert, "--tls-key", options.tls_key});
  }
  if (options.metrics) {
    coord_argv.push_back("--metrics-address");
    coord_argv.push_back("127.0.0.1:0");
  }
  const bool web = !options.web_address.empty();
  if (web) coord_argv.insert(coord_argv.end(), {"--web-address", options.web_address});
  auto pid = SpawnDaemon(coord_argv, out, coord.log);
  if (!pid.ok()) return pid.status();
  coord.pid = *pid;
  // The coordinator prints its bound address as its first line once it serves.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (true) {
    const std::string printed = ReadFile(out);
    // The bound address on the first line, then "metrics ADDRESS" when serving metrics, then
    // "web URL" when serving the web console.
    const std::vector<std::string> lines = PrintedLines(printed);
    if (lines.size() >= 1u + (options.metrics ? 1u : 0u) + (web ? 1u : 0u)) {
      coord.address = lines[0];
      if (options.metrics) coord.metrics_address = MetricsAddressIn(lines[1]);
      for (const std::string& l : lines) {
        if (web && l.rfind("web ", 0) == 0) coord.web_url = l.substr(4);
      }
      break;
    }
    int status = 0;
    if (waitpid(coord.pid, &status, WNOHANG) == coord.pid) {
      return absl::UnavailableError(absl::StrCat("the coordinator exited at start; ", coord.log,
                                                 " ends with:\n", Tail(ReadFile(coord.log), 5)));
    }
    if (absl::Now() > deadline) {
      kill(coord.pid, SIGKILL);
      return absl::DeadlineExceededError(
          absl::StrCat("the coordinator did not start within 30 s; see ", coord.log));
    }
    absl::SleepFor(absl::Milliseconds(20));  // a detached child: no event to wait on
  }
  coord.alive = true;
  return coord;
}

// The daemons' side of the cluster: node tokens made through the local admin, the user map.
class LocalDaemons {
 public:
  LocalDaemons(const LocalUpOptions& options, LocalCluster& c, YardClient& admin)
      : options_(options), c_(c), admin_(admin) {}

  // The local admin's jobs run as the account that started the cluster (workers running as root
  // run each rank as its owner's account, and there is no Unix account "admin").
  absl::Status WriteUserMap() {
    const passwd* me = getpwuid(geteuid());
    std::ofstream map(user_map(), std::ios::trunc);
    map << "# trainyard user -> Unix account (trainyard-worker --user-map)\n"
        << "admin " << (me != nullptr ? me->pw_name : "root") << "\n";
    for (const auto& [user, account] : options_.run_as) map << user << " " << account << "\n";
    if (!map) return absl::UnavailableError(absl::StrCat("cannot write ", user_map()));
    // Workers not running as root take only the jobs of the users mapped to their account
    // (admin, and the user of the account's name): their node tokens must name those owners.
    if (geteuid() != 0) {
      if (me != nullptr && std::string(me->pw_name) != "admin") {
        worker_owners_.push_back(me->pw_name);
      }
      worker_owners_.push_back("admin");
      for (const auto& [user, account] : options_.run_as) {
        if (me != nullptr && account == me->pw_name) worker_owners_.push_back(user);
      }
    }
    return absl::OkStatus();
  }

  absl::Status StartWorkers() {
    const std::string worker_bin = options_.bin_dir + "/trainyard-worker";
    if (options_.workers > 0 && access(worker_bin.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("cannot find ", worker_bin));
    }
    for (int i = 1; i <= options_.workers; ++i) {
      LocalProcess w;
      const std::string node = absl::StrCat("local-", i);
      w.name = absl::StrCat("worker ", node);
      w.address = c_.coordinator_address;
      w.log = absl::StrCat(options_.state_dir, "/worker-", i, ".log");
      std::vector<std::string> argv = {worker_bin, "--coordinator", c_.coordinator_address,
                                       "--node-id", node, "--address", "127.0.0.1", "--cpu-slots",
                                       absl::StrCat(options_.slots_per_worker), "--work-dir",
                                       absl::StrCat(options_.state_dir, "/worker-", i),
                                       // (down gives a worker 15 s: no rank outlasts it)
                                       "--max-stop-grace", "10s"};
      auto token_file = NodeTokenFile(node, worker_owners_);
      if (!token_file.ok()) return token_file.status();
      argv.insert(argv.end(), {"--token-file", *token_file, "--user-map", user_map()});
      if (!options_.tls_ca.empty()) argv.insert(argv.end(), {"--tls-ca", options_.tls_ca});
      // The workers share this machine: split its cores among all their slots.
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      const int threads = options_.threads_per_slot > 0
                              ? options_.threads_per_slot
                              : std::max(1, cores / (options_.workers * options_.slots_per_worker));
      argv.insert(argv.end(), {"--threads-per-slot", absl::StrCat(threads)});
      // Its first line says where it serves metrics.
      RETURN_IF_ERROR(StartDaemon(w, argv, absl::StrCat(options_.state_dir, "/worker-", i, ".out"),
                                  /*metrics_line=*/0));
    }
    return absl::OkStatus();
  }

  absl::Status StartParameterServers() {
    const std::string ps_bin = options_.bin_dir + "/trainyard-ps";
    if (options_.parameter_servers > 0 && access(ps_bin.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("cannot find ", ps_bin));
    }
    for (int i = 1; i <= options_.parameter_servers; ++i) {
      LocalProcess ps;
      const std::string node = absl::StrCat("local-ps-", i);
      ps.name = absl::StrCat("parameter server ", node);
      ps.address = c_.coordinator_address;
      ps.log = absl::StrCat(options_.state_dir, "/ps-", i, ".log");
      std::vector<std::string> argv = {ps_bin,
                                       "--listen",
                                       "127.0.0.1:0",
                                       "--coordinator",
                                       c_.coordinator_address,
                                       "--node-id",
                                       node,
                                       "--threads",
                                       "1"};
      auto token_file = NodeTokenFile(node);
      if (!token_file.ok()) return token_file.status();
      argv.insert(argv.end(), {"--token-file", *token_file});
      if (!options_.tls_cert.empty()) {
        argv.insert(argv.end(), {"--tls-cert", options_.tls_cert, "--tls-key", options_.tls_key,
                                 "--tls-ca", options_.tls_ca});
      }
      if (options_.ps_memory_bytes > 0) {
        argv.insert(argv.end(), {"--memory-bytes", absl::StrCat(options_.ps_memory_bytes)});
      }
      // Its second line says where it serves metrics.
      RETURN_IF_ERROR(StartDaemon(ps, argv, absl::StrCat(options_.state_dir, "/ps-", i, ".out"),
                                  /*metrics_line=*/1));
    }
    return absl::OkStatus();
  }

 private:
  std::string user_map() const { return options_.state_dir + "/user-map"; }

  // A node's token file: from an earlier `up` of this state directory, or made now.
  absl::StatusOr<std::string> NodeTokenFile(const std::string& node,
                                            const std::vector<std::string>& owners = {}) {
    const std::string path = absl::StrCat(options_.state_dir, "/", node, ".token");
    if (ReadSecretFile(path).ok()) return path;
    v1::CreateTokenRequest request;
    request.set_node(node);
    for (const std::string& owner : owners) request.add_owners(owner);
    request.set_description("yard local up");
    auto created = admin_.CreateToken(request);
    if (!created.ok()) return created.status();
    RETURN_IF_ERROR(WriteSecretFile(path, created->token()));
    return path;
  }

  // Spawns `p` with `argv` (and the metrics flag), its output in `out`; recorded in the cluster.
  absl::Status StartDaemon(LocalProcess& p, std::vector<std::string> argv, const std::string& out,
                           size_t metrics_line) {
    if (options_.metrics) argv.insert(argv.end(), {"--metrics-address", "127.0.0.1:0"});
    // Workers pass it on to their ranks.
    const std::vector<std::pair<std::string, std::string>> congestion_env = {
        {ps::kTcpCongestionEnv, options_.tcp_congestion}};
    auto pid = SpawnDaemon(argv, out, p.log, congestion_env);
    if (!pid.ok()) return pid.status();
    p.pid = *pid;
    if (options_.metrics) RETURN_IF_ERROR(AwaitMetricsAddress(p, out, metrics_line));
    p.alive = true;
    c_.processes.push_back(p);
    return Save(c_);
  }

  const LocalUpOptions& options_;
  LocalCluster& c_;
  YardClient& admin_;
  std::vector<std::string> worker_owners_;
};

// Ready once every worker and parameter server has registered; a daemon that exits fails it.
absl::Status AwaitNodes(const LocalUpOptions& options, const LocalCluster& c, YardClient& client,
                        pid_t coordinator) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  const int expected = options.workers + options.parameter_servers;
  while (expected > 0) {
    auto nodes = client.ListNodes();
    int ready = 0;
    if (nodes.ok()) {
      for (const auto& n : nodes->nodes()) ready += n.state() == v1::NODE_READY && n.connected();
    }
    if (ready >= expected) break;
    for (const auto& p : c.processes) {
      int status = 0;
      if (p.pid != coordinator && waitpid(p.pid, &status, WNOHANG) == p.pid) {
        return absl::UnavailableError(absl::StrCat(p.name, " exited at start; ", p.log,
                                                   " ends with:\n", Tail(ReadFile(p.log), 5)));
      }
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(ready, " of ", expected, " nodes registered within 30 s; see their logs in ",
                       options.state_dir));
    }
    absl::SleepFor(absl::Milliseconds(50));  // polling the coordinator's view of the nodes
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LocalCluster> LocalUp(const LocalUpOptions& given) {
  // Every path handed to the servers (and through the workers to the ranks, which run in
  // folders of their own) is absolute, and so is every path the cluster's record keeps.
  LocalUpOptions options = given;
  for (std::string* path : {&options.state_dir, &options.bin_dir, &options.save_token_to,
                            &options.tls_cert, &options.tls_key, &options.tls_ca}) {
    if (!path->empty() && path->front() != '/') *path = fs::absolute(*path).string();
  }
  RETURN_IF_ERROR(ps::CheckTcpCongestion(options.tcp_congestion, "--tcp-congestion"));
  if (auto existing = LocalStatus(options.state_dir); existing.ok()) {
    for (const auto& p : existing->processes) {
      if (p.alive) {
        return absl::FailedPreconditionError(
            absl::StrCat("a local cluster is already running from ", options.state_dir, " (",
                         p.name, " pid ", p.pid, " on ", p.address, "); `yard local down` first"));
      }
    }
  }
  std::error_code ec;
  fs::create_directories(options.state_dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state-dir: cannot create ", options.state_dir, ": ", ec.message()));
  }
  LocalCluster c;
  c.state_dir = options.state_dir;
  ASSIGN_OR_RETURN(const LocalProcess coord, StartLocalCoordinator(options));
  c.coordinator_address = coord.address;
  c.web_url = coord.web_url;
  c.processes.push_back(coord);
  RETURN_IF_ERROR(Save(c));
  // The local admin made by the coordinator at its first start; each daemon gets a node token.
  c.admin_token_file = options.state_dir + "/admin.token";
  ASSIGN_OR_RETURN(const std::string admin_token, ReadSecretFile(c.admin_token_file));
  c.tls_ca = options.tls_ca;
  const TlsClientOptions tls{options.tls_ca, "", ""};
  YardClient admin(c.coordinator_address, admin_token, tls);
  LocalDaemons daemons(options, c, admin);
  RETURN_IF_ERROR(daemons.WriteUserMap());
  RETURN_IF_ERROR(daemons.StartWorkers());
  RETURN_IF_ERROR(daemons.StartParameterServers());
  if (!options.save_token_to.empty()) {
    RETURN_IF_ERROR(
        SaveTokenForYard(c.coordinator_address, admin_token, options.save_token_to, tls));
    c.saved_token_to = options.save_token_to;
  }
  RETURN_IF_ERROR(AwaitNodes(options, c, admin, coord.pid));
  return c;
}

absl::Status LocalDown(const std::string& state_dir, int grace_seconds) {
  auto c = LocalStatus(state_dir);
  if (!c.ok()) return c.status();
  // Workers first (they stop their ranks, which may still talk to the coordinator), then the
  // coordinator.
  for (auto it = c->processes.rbegin(); it != c->processes.rend(); ++it) {
    const LocalProcess& p = *it;
    if (!p.alive) continue;
    kill(p.pid, SIGTERM);
    const absl::Time deadline = absl::Now() + absl::Seconds(grace_seconds);
    while (IsTrainyardProcess(p.pid) && absl::Now() < deadline) {
      waitpid(p.pid, nullptr, WNOHANG);  // reaps it if it happens to be our child
      absl::SleepFor(absl::Milliseconds(20));
    }
    if (IsTrainyardProcess(p.pid)) kill(p.pid, SIGKILL);
  }
  std::error_code ec;
  fs::remove(StateFile(state_dir), ec);
  return absl::OkStatus();
}

}  // namespace trainyard::client
