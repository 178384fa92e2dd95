// yard: the trainyard command line. Parses the verb and its flags, calls the coordinator through
// YardClient, prints tables for people or JSON (-o json) for scripts. Exit code 0 on success,
// non-zero with a one-line reason on stderr.
#include <unistd.h>

#include <grpc/support/log.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/local_cluster.h"
#include "client/output.h"
#include "client/yard_client.h"
#include "common/credentials.h"
#include "common/memory_estimate.h"
#include "common/spec.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "rpc/ps/tcp_congestion.h"

namespace trainyard::client {
namespace {

// Exit codes of `yard wait` beyond 0 (succeeded) and 1 (error).
constexpr int kExitJobFailed = 1;
constexpr int kExitJobCancelled = 2;
constexpr int kExitTimedOut = 3;

// Where `yard login` and `yard local up` save a token, and where yard looks last:
// $XDG_CONFIG_HOME/trainyard/token, else ~/.config/trainyard/token.
std::string DefaultTokenFile() {
  if (const char* xdg = std::getenv("XDG_CONFIG_HOME"); xdg != nullptr && *xdg != '\0') {
    return absl::StrCat(xdg, "/trainyard/token");
  }
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr ? home : ".", "/.config/trainyard/token");
}

struct Globals {
  std::string coordinator;
  std::string output = "table";
  std::string token_file;  // --token-file, env TRAINYARD_TOKEN_FILE
  TlsClientOptions tls;    // --tls-ca, env TRAINYARD_TLS_CA
  bool json() const { return output == "json"; }
  // --token-file, else $TRAINYARD_TOKEN, else the saved one.
  absl::StatusOr<std::string> Token() const { return FindToken(token_file, DefaultTokenFile()); }
};

std::string DefaultCoordinator() {
  const char* env = std::getenv("TRAINYARD_COORDINATOR");
  return env != nullptr && *env != '\0' ? env : "127.0.0.1:7070";
}

std::string DefaultLocalStateDir() {
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr ? home : ".", "/.trainyard/local");
}

int Fail(const absl::Status& s) {
  std::string message(s.message());
  std::replace(message.begin(), message.end(), '\n', ' ');
  std::cerr << "yard: " << message << " (" << absl::StatusCodeToString(s.code()) << ")\n";
  return 1;
}

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

std::string Devices(const v1::Job& job) { return absl::StrCat(job.spec().resources().gpus()); }

std::string PlacementText(const v1::Job& job) {
  std::vector<std::string> parts;
  for (const auto& p : job.placement()) {
    parts.push_back(absl::StrCat(p.node_id(), "[", absl::StrJoin(p.device_indices(), ","),
                                 "] ranks ", p.first_rank(), "-",
                                 p.first_rank() + p.device_indices_size() - 1));
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, "; ");
}

void PrintJob(const v1::Job& job) {
  const auto& s = job.spec();
  const auto& m = s.model();
  const auto& t = s.train();
  std::vector<std::pair<std::string, std::string>> f = {
      {"id", job.id()},
      {"name", s.name()},
      {"owner", job.owner()},
      {"state", v1::JobState_Name(job.state())},
      {"message", job.message().empty() ? "-" : job.message()},
      {"priority", absl::StrCat(s.priority())},
      {"devices", Devices(job)},
      {"attempt",
       absl::StrCat(job.attempt(), " (restarts ", job.restarts(), " of ", s.max_restarts(), ")")},
      {"placement", PlacementText(job)},
      {"submitted", Ago(job.submit_time_ms(), NowMs())},
      {"started", Ago(job.start_time_ms(), NowMs())},
      {"ended", Ago(job.end_time_ms(), NowMs())},
      {"model", absl::StrCat(m.kind(), " n_layer=", m.n_layer(), " n_head=", m.n_head(),
                             " d_model=", m.d_model(), " seq_len=", m.seq_len(), " vocab=",
                             m.vocab(), " (", HumanCount(ModelParameterCount(m)), " params)")},
      {"data", absl::StrCat(s.data().path(), " (", s.data().format(), ")")},
      {"train",
       absl::StrCat("steps=", t.steps(), " micro_batch=", t.micro_batch(),
                    " grad_accum=", t.grad_accum(), " lr=", t.lr(), " warmup=", t.warmup(), " ",
                    MixedPrecisionName(t.mixed_precision()), " ", OptimizerName(t.optimizer()))},
      {"parallel", absl::StrCat(StrategyName(s.parallel().strategy()), " ",
                                ShardingStrategyName(s.parallel().sharding_strategy()),
                                " bucket_mb=", s.parallel().bucket_mb())},
      {"max_runtime", s.max_runtime_seconds() == 0
                          ? "-"
                          : absl::FormatDuration(absl::Seconds(s.max_runtime_seconds()))},
      {"account", job.account().empty() ? "default" : job.account()},
      {"preemptible",
       absl::StrCat(!s.has_preemptible() || s.preemptible() ? "yes" : "no", " (grace ",
                    s.preemption_grace_seconds() == 0
                        ? "the cluster's"
                        : absl::FormatDuration(absl::Seconds(s.preemption_grace_seconds())),
                    ", preempted ", job.preemptions(), " times)")},
  };
  if (IsCommandJob(s)) {
    // The user's own program: its command line, folder and the names its env sets (values may be
    // secrets the program needs; they stay in the spec).
    f.erase(std::remove_if(f.begin(), f.end(),
                           [](const auto& field) {
                             return field.first == "model" || field.first == "data" ||
                                    field.first == "train" || field.first == "parallel";
                           }),
            f.end());
    std::vector<std::string> names;
    for (const auto& [name, value] : s.env()) names.push_back(name);
    std::sort(names.begin(), names.end());
    f.push_back({"command", absl::StrJoin(s.command(), " ")});
    f.push_back({"workdir", s.workdir().empty() ? "- (a fresh folder per attempt)" : s.workdir()});
    f.push_back({"env", names.empty() ? "-" : absl::StrJoin(names, " ")});
  }
  if (!job.why_waiting().empty()) f.push_back({"waiting", job.why_waiting()});
  if (job.backfilled()) f.push_back({"backfilled", "yes"});
  std::cout << FormatFields(f);
}

// A llama spec with model.from: its sizes from config.json when yard can read it (see
// FillModelFromCheckpoint), checked again; a checkpoint yard cannot read is left to the trainer.
absl::Status FillFromCheckpoint(ParsedSpec& parsed, const std::string& path) {
  absl::Status s = FillModelFromCheckpoint(parsed.spec);
  if (absl::IsNotFound(s)) return absl::OkStatus();
  if (s.ok()) s = ValidateJobSpec(parsed.spec);
  return s.ok() ? s : AnnotateWithLine(s, parsed, path);
}

int Submit(const Globals& g, const std::string& path) {
  auto parsed = LoadValidJobSpecFile(path);
  if (!parsed.ok()) return Fail(parsed.status());
  if (absl::Status s = FillFromCheckpoint(*parsed, path); !s.ok()) return Fail(s);
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto job = client.Submit(parsed->spec);
  if (!job.ok()) return Fail(AnnotateWithLine(job.status(), *parsed, path));
  if (g.json()) {
    std::cout << ToJson(*job);
  } else {
    std::cout << job->id() << "\n";
  }
  return 0;
}

int List(const Globals& g, const std::vector<std::string>& states, const std::string& owner,
         int limit) {
  v1::ListJobsRequest request;
  for (const auto& name : states) {
    v1::JobState state;
    std::string upper = name;
    std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
    if (!v1::JobState_Parse(upper, &state) || state == v1::JOB_STATE_UNSPECIFIED) {
      return Fail(
          absl::InvalidArgumentError(absl::StrCat("--state: unknown job state '", name, "'")));
    }
    request.add_states(state);
  }
  request.set_owner(owner);
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto jobs = client.List(request, limit);
  if (!jobs.ok()) return Fail(jobs.status());
  if (g.json()) {
    std::cout << ToJson(*jobs);
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& j : jobs->jobs()) {
    rows.push_back({j.id(), j.spec().name(), j.owner(), v1::JobState_Name(j.state()),
                    absl::StrCat(j.spec().priority()), Devices(j),
                    Ago(j.submit_time_ms(), NowMs())});
  }
  std::cout << FormatTable({"ID", "NAME", "OWNER", "STATE", "PRIO", "DEVICES", "SUBMITTED"}, rows);
  return 0;
}

int Describe(const Globals& g, const std::string& id) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto job = client.Get(NormalizeJobId(id));
  if (!job.ok()) return Fail(job.status());
  if (g.json()) {
    std::cout << ToJson(*job);
  } else {
    PrintJob(*job);
  }
  return 0;
}

// Prints a job that a verb changed ("job-7 CANCELLED"), or its JSON; or fails with the error.
int PrintChangedJob(const Globals& g, const absl::StatusOr<v1::Job>& job) {
  if (!job.ok()) return Fail(job.status());
  if (g.json()) {
    std::cout << ToJson(*job);
  } else {
    std::cout << job->id() << " " << v1::JobState_Name(job->state()) << "\n";
  }
  return 0;
}

int Cancel(const Globals& g, const std::string& id, const std::string& reason) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  return PrintChangedJob(g, client.Cancel(NormalizeJobId(id), reason));
}

int Wait(const Globals& g, const std::string& id, const std::string& timeout_text) {
  absl::Duration timeout = absl::ZeroDuration();
  if (!timeout_text.empty() && !absl::ParseDuration(timeout_text, &timeout)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--timeout: expected a duration such as 90s or 1h, got '", timeout_text, "'")));
  }
  YardClient client(g.coordinator, g.Token(), g.tls);
  v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
  auto job = client.Watch(NormalizeJobId(id), timeout, [&](const v1::Job& j) {
    if (j.state() != last && !g.json()) {
      std::cerr << j.id() << " " << v1::JobState_Name(j.state())
                << (j.message().empty() ? "" : ": " + j.message()) << "\n";
    }
    last = j.state();
    return false;
  });
  if (!job.ok()) {
    Fail(job.status());
    return job.status().code() == absl::StatusCode::kDeadlineExceeded ? kExitTimedOut : 1;
  }
  if (g.json()) std::cout << ToJson(*job);
  switch (job->state()) {
    case v1::SUCCEEDED:
      return 0;
    case v1::CANCELLED:
      return kExitJobCancelled;
    default:
      return kExitJobFailed;
  }
}

int EstimateMemoryVerb(const Globals& g, const std::string& path, int world, int per_node,
                       const std::string& device_memory) {
  auto parsed = LoadValidJobSpecFile(path);
  if (!parsed.ok()) return Fail(parsed.status());
  if (absl::Status s = FillFromCheckpoint(*parsed, path); !s.ok()) return Fail(s);
  const v1::JobSpec& spec = parsed->spec;
  if (world <= 0) world = spec.resources().gpus();
  if (per_node <= 0) per_node = world;
  // The devices to judge against: --device-memory, else the largest device the coordinator's
  // ready nodes offer, else unknown.
  int64_t device_bytes = 0;
  std::string device_source = "unknown (no --device-memory and no coordinator reachable)";
  if (!device_memory.empty()) {
    auto bytes = ParseBytes(device_memory);
    if (!bytes.has_value() || *bytes <= 0) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "--device-memory: expected a size such as 16GiB or 80G, got '", device_memory, "'")));
    }
    device_bytes = *bytes;
    device_source = "--device-memory";
  } else {
    YardClient client(g.coordinator, g.Token(), g.tls);
    if (auto nodes = client.ListNodes(); nodes.ok()) {
      for (const auto& n : nodes->nodes()) {
        if (n.state() != v1::NODE_READY || n.devices().empty()) continue;
        int64_t smallest = std::numeric_limits<int64_t>::max();
        for (const auto& d : n.devices()) smallest = std::min(smallest, d.memory_bytes());
        device_bytes = std::max(device_bytes, smallest);
      }
      if (device_bytes > 0) device_source = "the largest device of the cluster's ready nodes";
    }
  }
  const auto estimates = EstimateAllStrategies(spec, world, per_node);
  // LoRA: only the adapters train (and are counted beside the base).
  const JobConfig config = ToJobConfig(spec);
  const int64_t adapters = LoraParameterCount(config.model, config.train.lora);
  const int64_t trainable =
      config.train.lora.enabled() ? adapters : ModelParameterCount(spec.model());
  if (g.json()) {
    nlohmann::json out = {{"parameters", ModelParameterCount(spec.model()) + adapters},
                          {"trainable_parameters", trainable},
                          {"optimizer", OptimizerName(spec.train().optimizer())},
                          {"largest_unit_parameters", LargestUnitParameters(spec.model())},
                          {"world_size", world},
                          {"device_memory_bytes", device_bytes},
                          {"estimates", nlohmann::json::array()}};
    for (const auto& e : estimates) {
      out["estimates"].push_back({{"strategy", e.Name()},
                                  {"precision", MixedPrecisionName(e.precision)},
                                  {"parameters_bytes", e.parameters},
                                  {"gradients_bytes", e.gradients},
                                  {"optimizer_bytes", e.optimizer},
                                  {"activations_bytes", e.activations},
                                  {"total_bytes", e.total()},
                                  {"offloaded_bytes", e.offloaded},
                                  {"fits", device_bytes > 0 && e.total() <= device_bytes}});
    }
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  const MemoryEstimate mine = EstimateMemory(spec, world, per_node);
  std::cout << spec.name() << ": " << spec.model().kind() << ", "
            << HumanCount(ModelParameterCount(spec.model()) + adapters) << " parameters"
            << (config.train.lora.enabled()
                    ? absl::StrCat(" (", HumanCount(trainable), " trainable: LoRA r ",
                                   config.train.lora.r, ")")
                    : "")
            << ", largest unit " << HumanCount(LargestUnitParameters(spec.model())) << "; " << world
            << " rank(s), " << per_node << " per node; micro_batch " << spec.train().micro_batch()
            << ", seq_len " << spec.model().seq_len() << "; optimizer "
            << OptimizerName(spec.train().optimizer()) << "\n";
  std::cout << "device memory: "
            << (device_bytes > 0 ? absl::StrCat(HumanBytes(device_bytes), " (", device_source, ")")
                                 : device_source)
            << "\n\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& e : estimates) {
    const bool is_spec = e.Name() == mine.Name() && e.precision == mine.precision;
    rows.push_back({absl::StrCat(e.Name(), is_spec ? " *" : ""), MixedPrecisionName(e.precision),
                    HumanBytes(e.parameters), HumanBytes(e.gradients), HumanBytes(e.optimizer),
                    HumanBytes(e.activations), HumanBytes(e.total()),
                    e.offloaded > 0 ? HumanBytes(e.offloaded) : "-",
                    device_bytes == 0 ? "?" : (e.total() <= device_bytes ? "yes" : "no")});
  }
  std::cout << FormatTable({"STRATEGY", "PRECISION", "PARAMETERS", "GRADIENTS", "OPTIMIZER",
                            "ACTIVATIONS", "TOTAL/RANK", "ON PS", "FITS"},
                           rows);
  std::cout << "\n* the spec's own strategy. Bytes per rank; ON PS: optimizer state held by "
               "parameter servers.\n";
  return 0;
}

int Nodes(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto nodes = client.ListNodes();
  if (!nodes.ok()) return Fail(nodes.status());
  if (g.json()) {
    std::cout << ToJson(*nodes);
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& n : nodes->nodes()) {
    const std::string kind =
        n.devices().empty() ? "-" : (n.devices(0).kind() == v1::CUDA_GPU ? "gpu" : "cpu-slot");
    const std::string state = n.state() != v1::NODE_READY ? "LOST"
                              : n.connected()             ? "READY"
                                                          : "READY (reconnecting)";
    const bool ps = n.role() == v1::PARAMETER_SERVER;
    // GPUs as their worker last read them (NVML): mean utilization, memory in use / in all, the
    // hottest one. JSON has every GPU's sample.
    std::string gpus = "-";
    int sampled = 0;
    double utilization = 0, hottest = 0;
    int64_t used = 0, total = 0;
    for (const v1::Device& d : n.devices()) {
      if (!d.has_sample()) continue;
      ++sampled;
      utilization += d.sample().utilization();
      used += d.sample().memory_used_bytes();
      total += d.sample().memory_total_bytes();
      hottest = std::max<double>(hottest, d.sample().temperature_celsius());
    }
    if (sampled > 0) {
      gpus = absl::StrFormat("%.0f%% %s/%s %.0fC", 100 * utilization / sampled, HumanBytes(used),
                             HumanBytes(total), hottest);
    }
    // Parameter servers: shard memory held by running offload jobs / offered.
    rows.push_back(
        {n.id(), ps ? "ps" : "worker", state,
         ps ? "-" : absl::StrCat(n.allocated_devices_size(), "/", n.devices_size(), " ", kind),
         ps ? absl::StrCat(HumanBytes(n.reserved_bytes()), "/", HumanBytes(n.memory_bytes()))
            : HumanBytes(n.memory_bytes()),
         gpus, n.address().empty() ? "-" : n.address(), Ago(n.last_heartbeat_ms(), NowMs())});
  }
  std::cout << FormatTable({"NODE", "ROLE", "STATE", "DEVICES(USED/ALL)", "MEMORY",
                            "GPU UTIL MEM TEMP", "ADDRESS", "HEARTBEAT"},
                           rows);
  return 0;
}

int Checkpoint(const Globals& g, const std::string& id) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  return PrintChangedJob(g, client.Checkpoint(NormalizeJobId(id)));
}

// yard fetch: the job's export into `out_dir` (created; it must not hold anything yet). Each file
// arrives as OUT/.NAME.part and is renamed once complete; on failure what was written goes.
int Fetch(const Globals& g, const std::string& id, const std::string& out_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(out_dir, ec) && !(fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec))) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("--out: '", out_dir, "' exists and is not an empty folder")));
  }
  const bool created = !fs::exists(out_dir, ec);
  fs::create_directories(out_dir, ec);
  if (ec) {
    return Fail(
        absl::InternalError(absl::StrCat("--out: cannot create '", out_dir, "': ", ec.message())));
  }
  std::vector<std::pair<std::string, int64_t>> files;  // done: name, bytes
  std::string current;
  int64_t written = 0, size = 0;
  std::ofstream part;
  auto part_path = [&](const std::string& name) { return out_dir + "/." + name + ".part"; };
  YardClient client(g.coordinator, g.Token(), g.tls);
  absl::Status s = client.FetchExport(NormalizeJobId(id), [&](const v1::ExportChunk& c) {
    if (c.file() != current) {  // a new file: the previous one must be complete
      if (!current.empty()) {
        return absl::DataLossError(absl::StrCat("the coordinator stopped sending ", current, " at ",
                                                written, " of ", size, " bytes"));
      }
      const std::string& name = c.file();
      // A plain name of the folder, not hidden (the parts being written are ".NAME.part").
      if (name.empty() || name[0] == '.' ||
          name.find_first_of(std::string("/\0", 2)) != std::string::npos) {
        return absl::DataLossError(
            absl::StrCat("the coordinator sent a bad file name '", name, "'"));
      }
      for (const auto& [done, bytes] : files) {
        if (done == name) return absl::DataLossError(absl::StrCat(name, " was sent twice"));
      }
      current = name;
      written = 0;
      size = c.file_size();
      part.open(part_path(name), std::ios::binary | std::ios::trunc);
      if (!part) return absl::InternalError(absl::StrCat("cannot write ", part_path(name)));
    }
    if (c.offset() != written || c.file_size() != size ||
        written + static_cast<int64_t>(c.data().size()) > size) {
      return absl::DataLossError(absl::StrCat("the coordinator sent ", current, " out of order"));
    }
    part.write(c.data().data(), static_cast<std::streamsize>(c.data().size()));
    written += static_cast<int64_t>(c.data().size());
    if (written == size) {
      part.close();
      if (!part) return absl::InternalError(absl::StrCat("cannot write ", part_path(current)));
      fs::rename(part_path(current), out_dir + "/" + current, ec);
      if (ec) return absl::InternalError(absl::StrCat("cannot rename ", part_path(current)));
      files.emplace_back(current, size);
      current.clear();
    }
    return absl::OkStatus();
  });
  if (s.ok() && !current.empty()) {
    s = absl::DataLossError(absl::StrCat("the stream ended inside ", current));
  }
  if (!s.ok()) {
    if (part.is_open()) part.close();
    if (!current.empty()) fs::remove(part_path(current), ec);
    for (const auto& [name, bytes] : files) fs::remove(out_dir + "/" + name, ec);
    if (created) fs::remove(out_dir, ec);  // empty now
    return Fail(s);
  }
  int64_t total = 0;
  for (const auto& [name, bytes] : files) total += bytes;
  if (g.json()) {
    nlohmann::json out = {{"job", NormalizeJobId(id)},
                          {"dir", out_dir},
                          {"bytes", total},
                          {"files", nlohmann::json::array()}};
    for (const auto& [name, bytes] : files)
      out["files"].push_back({{"name", name}, {"bytes", bytes}});
    std::cout << out.dump(1) << "\n";
  } else {
    std::cout << "fetched " << files.size() << " file(s), " << HumanBytes(total) << ", of "
              << NormalizeJobId(id) << "'s export into " << out_dir << "\n";
  }
  return 0;
}

int Logs(const Globals& g, const std::string& id, bool follow, int tail) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  absl::Status s = client.Logs(NormalizeJobId(id), follow, tail, [&](const v1::LogLine& l) {
    if (g.json()) {
      std::cout
          << nlohmann::json{{"attempt", l.attempt()}, {"rank", l.rank()}, {"text", l.text()}}.dump()
          << "\n";
    } else {
      std::cout << "[rank " << l.rank() << "] " << l.text() << "\n";
    }
    std::cout.flush();
  });
  return s.ok() ? 0 : Fail(s);
}

// One status line: "step 120/300 [=======>       ] 40% ETA 1m12s loss 2.3100 tok/s 12.3K".
std::string ProgressLine(const v1::StepReport& r, double seconds_per_step) {
  const int width = 24;
  const double frac = r.total_steps() > 0 ? double(r.step()) / r.total_steps() : 0;
  const int filled = static_cast<int>(frac * width);
  std::string bar(width, ' ');
  for (int i = 0; i < filled && i < width; ++i) bar[i] = '=';
  if (filled < width) bar[filled] = '>';
  const double eta_s = std::max<double>(0, (r.total_steps() - r.step()) * seconds_per_step);
  return absl::StrFormat("step %d/%d [%s] %3.0f%% ETA %s loss %.4f tok/s %s", r.step(),
                         r.total_steps(), bar, 100 * frac,
                         absl::FormatDuration(absl::Seconds(static_cast<int64_t>(eta_s))), r.loss(),
                         HumanCount(static_cast<int64_t>(r.tokens_per_second())));
}

// The mean of a step's per-stage idle shares: the measured pipeline bubble.
double MeanIdle(const v1::StepReport& r) {
  double sum = 0;
  for (double idle : r.pipeline_stage_idle()) sum += idle;
  return r.pipeline_stage_idle_size() > 0 ? sum / r.pipeline_stage_idle_size() : 0;
}

int Metrics(const Globals& g, const std::string& id, bool follow) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  const bool tty = isatty(STDOUT_FILENO);
  nlohmann::json series = nlohmann::json::array();
  std::vector<std::vector<std::string>> rows;
  std::deque<double> recent;        // seconds of the last steps, for the ETA
  bool pipelined = false;           // a BUBBLE column
  std::vector<std::string> extras;  // a program's own metrics (the SDK's), one entry per row
  absl::Status s = client.Metrics(NormalizeJobId(id), follow, [&](const v1::StepReport& r) {
    if (g.json()) {
      series.push_back({{"attempt", r.attempt()},
                        {"step", r.step()},
                        {"total_steps", r.total_steps()},
                        {"loss", r.loss()},
                        {"lr", r.lr()},
                        {"tokens_per_second", r.tokens_per_second()},
                        {"step_seconds", r.step_seconds()},
                        {"grad_norm", r.grad_norm()},
                        {"resident_bytes", r.resident_bytes()},
                        {"model_state_peak_bytes", r.model_state_peak_bytes()},
                        {"comm_bytes", r.comm_bytes()},
                        {"time_ms", r.time_ms()}});
      if (r.metrics_size() > 0) {  // a program's own, reported through the Python SDK
        series.back()["metrics"] =
            std::map<std::string, double>(r.metrics().begin(), r.metrics().end());
      }
      if (r.pipeline_stage_idle_size() > 0) {
        series.back()["pipeline_stage_idle"] =
            std::vector<double>(r.pipeline_stage_idle().begin(), r.pipeline_stage_idle().end());
        series.back()["pipeline_bubble"] = MeanIdle(r);
        series.back()["pipeline_bubble_theory"] = r.pipeline_bubble_theory();
      }
      return;
    }
    if (!follow) {
      rows.push_back({absl::StrCat(r.step()), absl::StrFormat("%.4f", r.loss()),
                      absl::StrFormat("%.2e", r.lr()), absl::StrFormat("%.3f", r.grad_norm()),
                      HumanCount(static_cast<int64_t>(r.tokens_per_second())),
                      absl::StrFormat("%.0f", 1000 * r.step_seconds()),
                      HumanBytes(r.resident_bytes()), HumanBytes(r.model_state_peak_bytes())});
      std::vector<std::string> own;
      for (const auto& [name, value] : r.metrics()) {
        own.push_back(absl::StrFormat("%s=%.4g", name, value));
      }
      std::sort(own.begin(), own.end());
      extras.push_back(absl::StrJoin(own, " "));
      if (r.pipeline_stage_idle_size() > 0) {
        pipelined = true;
        std::vector<std::string> stages;
        for (double idle : r.pipeline_stage_idle()) stages.push_back(absl::StrFormat("%.2f", idle));
        rows.back().push_back(absl::StrFormat("%.2f (%.2f) [%s]", MeanIdle(r),
                                              r.pipeline_bubble_theory(),
                                              absl::StrJoin(stages, " ")));
      }
      return;
    }
    recent.push_back(r.step_seconds());
    if (recent.size() > 20) recent.pop_front();
    double mean = 0;
    for (double x : recent) mean += x / recent.size();
    if (tty) {
      std::cout << "\r\033[K" << ProgressLine(r, mean) << std::flush;
    } else {
      std::cout << ProgressLine(r, mean) << "\n" << std::flush;
    }
  });
  if (follow && tty && !g.json()) std::cout << "\n";
  if (!s.ok()) return Fail(s);
  if (g.json()) {
    std::cout << series.dump(1) << "\n";
  } else if (!follow) {
    std::vector<std::string> header = {"STEP",  "LOSS",    "LR",  "GRAD_NORM",
                                       "TOK/S", "STEP_MS", "RSS", "MODEL_STATE"};
    // Pipeline parallelism: the measured bubble (the stages' mean idle share), its theory, and
    // each stage's.
    if (pipelined) header.push_back("BUBBLE (THEORY) [PER STAGE]");
    for (auto& row : rows) row.resize(header.size(), "-");
    // A program's own metrics (trainyard.init().report(step, accuracy=...)), by name.
    if (std::any_of(extras.begin(), extras.end(), [](const auto& e) { return !e.empty(); })) {
      header.push_back("METRICS");
      for (size_t i = 0; i < rows.size(); ++i) {
        rows[i].push_back(extras[i].empty() ? "-" : extras[i]);
      }
    }
    std::cout << FormatTable(header, rows);
  }
  return 0;
}

std::string RoleName(v1::Role role) { return role == v1::ADMIN ? "admin" : "user"; }

std::string TimeOrDash(int64_t unix_ms) {
  return unix_ms == 0 ? "-"
                      : absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(unix_ms),
                                         absl::LocalTimeZone());
}

// `yard login`: reads a token from standard input (never from argv), checks it with the
// coordinator and saves it (mode 0600) where yard looks for it.
int Login(const Globals& g, const std::string& save_to) {
  if (isatty(STDIN_FILENO)) std::cerr << "paste your token and press Enter: " << std::flush;
  std::string line;
  std::getline(std::cin, line);
  const std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) return Fail(absl::InvalidArgumentError("no token on standard input"));
  YardClient client(g.coordinator, token, g.tls);
  auto me = client.WhoAmI();
  if (!me.ok()) return Fail(me.status());
  if (me->user().empty() || !me->node().empty()) {
    return Fail(absl::InvalidArgumentError("that is not a user's API token"));
  }
  if (absl::Status s = WriteSecretFile(save_to, token); !s.ok()) return Fail(s);
  std::cout << "logged in to " << g.coordinator << " as " << me->user() << " ("
            << RoleName(me->role()) << "); token saved to " << save_to << "\n";
  return 0;
}

int WhoAmI(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto me = client.WhoAmI();
  if (!me.ok()) return Fail(me.status());
  if (g.json()) {
    std::cout << ToJson(*me);
  } else if (!me->node().empty()) {
    std::cout << "node " << me->node() << " (token " << me->token_id() << " of " << me->user()
              << ")\n";
  } else {
    std::cout << me->user() << " (" << RoleName(me->role()) << ", token " << me->token_id()
              << ")\n";
  }
  return 0;
}

void PrintUsers(const Globals& g, const std::vector<v1::User>& users) {
  if (g.json()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& u : users) j.push_back(nlohmann::json::parse(ToJson(u)));
    std::cout << j.dump(1) << "\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& u : users) {
    rows.push_back({u.name(), RoleName(u.role()), u.disabled() ? "disabled" : "enabled",
                    u.account().empty() ? "default" : u.account(),
                    u.has_max_running_devices() ? absl::StrCat(u.max_running_devices()) : "-",
                    u.has_max_queued_jobs() ? absl::StrCat(u.max_queued_jobs()) : "-",
                    TimeOrDash(u.created_time_ms())});
  }
  std::cout << FormatTable(
      {"USER", "ROLE", "STATE", "ACCOUNT", "MAX_DEVICES", "MAX_QUEUED", "CREATED"}, rows);
}

int UserAdd(const Globals& g, const std::string& name, bool admin, const std::string& account) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto user = client.CreateUser(name, admin ? v1::ADMIN : v1::USER, account);
  if (!user.ok()) return Fail(user.status());
  PrintUsers(g, {*user});
  return 0;
}

// A limit flag's value: a count >= 0, or "none" (-1: no limit).
absl::StatusOr<int64_t> ParseLimit(const std::string& flag, const std::string& text) {
  int64_t value = 0;
  if (text == "none") return -1;
  if (absl::SimpleAtoi(text, &value) && value >= 0) return value;
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": expected a count >= 0 or 'none', got '", text, "'"));
}

struct UserSetArgs {
  std::string name, account, max_devices, max_queued;
};

int UserSet(const Globals& g, const UserSetArgs& a) {
  v1::UpdateUserRequest request;
  request.set_name(a.name);
  if (!a.account.empty()) request.set_account(a.account);
  if (!a.max_devices.empty()) {
    auto v = ParseLimit("--max-devices", a.max_devices);
    if (!v.ok()) return Fail(v.status());
    request.set_max_running_devices(*v);
  }
  if (!a.max_queued.empty()) {
    auto v = ParseLimit("--max-queued", a.max_queued);
    if (!v.ok()) return Fail(v.status());
    request.set_max_queued_jobs(*v);
  }
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto user = client.UpdateUser(request);
  if (!user.ok()) return Fail(user.status());
  PrintUsers(g, {*user});
  return 0;
}

std::string Share(double share) { return absl::StrFormat("%g", share); }

// An account's QUOTA and BORROW_LIMIT cells (v1::Account and v1::AccountUsage name them alike).
template <typename A>
std::pair<std::string, std::string> QuotaCells(const A& a) {
  if (!a.has_quota_devices()) return {"-", "-"};
  return {absl::StrCat(a.quota_devices()),
          a.has_borrow_limit_devices() ? absl::StrCat(a.borrow_limit_devices()) : "any"};
}

void PrintAccounts(const Globals& g, const std::vector<v1::Account>& accounts) {
  if (g.json()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& a : accounts) j.push_back(nlohmann::json::parse(ToJson(a)));
    std::cout << j.dump(1) << "\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& a : accounts) {
    const auto [quota, borrow] = QuotaCells(a);
    rows.push_back({a.name(), quota, borrow, Share(a.share()), TimeOrDash(a.created_time_ms())});
  }
  std::cout << FormatTable({"ACCOUNT", "QUOTA", "BORROW_LIMIT", "SHARE", "CREATED"}, rows);
}

struct AccountArgs {
  std::string name, quota, borrow_limit, share;
};

// Applies the flags given to `account` (a limit of "none" removes it).
absl::Status ApplyAccountArgs(const AccountArgs& a, v1::Account& account) {
  account.set_name(a.name);
  if (!a.quota.empty()) {
    ASSIGN_OR_RETURN(int64_t quota, ParseLimit("--quota", a.quota));
    if (quota < 0) {
      account.clear_quota_devices();
      account.clear_borrow_limit_devices();
    } else {
      account.set_quota_devices(quota);
    }
  }
  if (!a.borrow_limit.empty()) {
    ASSIGN_OR_RETURN(int64_t limit, ParseLimit("--borrow-limit", a.borrow_limit));
    if (limit < 0) {
      account.clear_borrow_limit_devices();
    } else {
      account.set_borrow_limit_devices(limit);
    }
  }
  if (!a.share.empty()) {
    double share = 0;
    if (!absl::SimpleAtod(a.share, &share) || !(share > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--share: expected a positive number, got '", a.share, "'"));
    }
    account.set_share(share);
  }
  return absl::OkStatus();
}

int AccountAdd(const Globals& g, const AccountArgs& a) {
  v1::Account account;
  if (absl::Status s = ApplyAccountArgs(a, account); !s.ok()) return Fail(s);
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto created = client.CreateAccount(account);
  if (!created.ok()) return Fail(created.status());
  PrintAccounts(g, {*created});
  return 0;
}

int AccountSet(const Globals& g, const AccountArgs& a) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto accounts = client.ListAccounts();
  if (!accounts.ok()) return Fail(accounts.status());
  v1::Account account;
  bool found = false;
  for (const v1::Account& existing : accounts->accounts()) {
    if (existing.name() == a.name) {
      account = existing;
      found = true;
    }
  }
  if (!found) return Fail(absl::NotFoundError(absl::StrCat("no account ", a.name)));
  if (absl::Status s = ApplyAccountArgs(a, account); !s.ok()) return Fail(s);
  auto updated = client.UpdateAccount(account);
  if (!updated.ok()) return Fail(updated.status());
  PrintAccounts(g, {*updated});
  return 0;
}

int AccountList(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto accounts = client.ListAccounts();
  if (!accounts.ok()) return Fail(accounts.status());
  PrintAccounts(g, {accounts->accounts().begin(), accounts->accounts().end()});
  return 0;
}

int AccountRemove(const Globals& g, const std::string& name) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto removed = client.DeleteAccount(name);
  if (!removed.ok()) return Fail(removed.status());
  std::cout << "deleted account " << removed->name() << "\n";
  return 0;
}

// `yard quota`: the user's use and caps, and its account's (every account's with --all).
int Quota(const Globals& g, const std::string& user, bool all) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto report = client.GetQuota(user, all);
  if (!report.ok()) return Fail(report.status());
  if (g.json()) {
    std::cout << ToJson(*report);
    return 0;
  }
  auto cap = [](bool has, int64_t value) { return has ? absl::StrCat(value) : "no cap"; };
  std::cout << FormatFields({
      {"user", report->user()},
      {"account", report->account()},
      {"running devices",
       absl::StrCat(report->running_devices(), " (",
                    cap(report->has_max_running_devices(), report->max_running_devices()), ")")},
      {"queued jobs",
       absl::StrCat(report->queued_jobs(), " (",
                    cap(report->has_max_queued_jobs(), report->max_queued_jobs()), ")")},
      {"usage", absl::StrFormat("%.2f device-hours (decayed, half-life %gh)",
                                report->usage_device_hours(), report->half_life_hours())},
  });
  std::vector<std::vector<std::string>> rows;
  for (const v1::AccountUsage& a : report->accounts()) {
    const auto [quota, borrow] = QuotaCells(a);
    rows.push_back(
        {a.name(), quota, borrow, absl::StrCat(a.running_devices()),
         absl::StrCat(a.queued_devices(), " (", a.queued_jobs(), " jobs)"),
         absl::StrFormat("%s (%.0f%%)", Share(a.share()), 100 * a.share_fraction()),
         absl::StrFormat("%.2f (%.0f%%)", a.usage_device_hours(), 100 * a.usage_fraction())});
  }
  std::cout << "\n"
            << FormatTable({"ACCOUNT", "QUOTA", "BORROW_LIMIT", "RUNNING", "QUEUED", "SHARE",
                            "USAGE_DEVICE_HOURS"},
                           rows);
  return 0;
}

int UserList(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto users = client.ListUsers();
  if (!users.ok()) return Fail(users.status());
  PrintUsers(g, {users->users().begin(), users->users().end()});
  return 0;
}

int UserDisable(const Globals& g, const std::string& name, bool enable) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto user = client.DisableUser(name, enable);
  if (!user.ok()) return Fail(user.status());
  PrintUsers(g, {*user});
  return 0;
}

struct TokenCreateArgs {
  std::string user, node, ttl, description, out;
  std::vector<std::string> owners;
};

// Prints the new token once (or, with --out, writes it to a 0600 file and prints its id).
int TokenCreate(const Globals& g, const TokenCreateArgs& a) {
  v1::CreateTokenRequest request;
  request.set_user(a.user);
  request.set_node(a.node);
  request.set_description(a.description);
  for (const std::string& owner : a.owners) request.add_owners(owner);
  if (!a.ttl.empty()) {
    absl::Duration ttl;
    if (!absl::ParseDuration(a.ttl, &ttl) || ttl <= absl::ZeroDuration()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--ttl: not a positive duration (e.g. 720h): ", a.ttl)));
    }
    request.set_ttl_seconds(absl::ToInt64Seconds(ttl));
  }
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto created = client.CreateToken(request);
  if (!created.ok()) return Fail(created.status());
  if (!a.out.empty()) {
    if (absl::Status s = WriteSecretFile(a.out, created->token()); !s.ok()) return Fail(s);
  }
  if (g.json()) {
    nlohmann::json j = nlohmann::json::parse(ToJson(created->info()));
    if (a.out.empty()) j["token"] = created->token();
    std::cout << j.dump(1) << "\n";
  } else if (a.out.empty()) {
    std::cout << created->token() << "\n";
    std::cerr << "token " << created->info().id() << " for "
              << (a.node.empty() ? created->info().user() : "node " + a.node)
              << ": shown this once; keep it in a file only you can read (yard login < FILE)\n";
  } else {
    std::cout << created->info().id() << "\n";
  }
  return 0;
}

int TokenList(const Globals& g, const std::string& user, bool all) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto tokens = client.ListTokens(user, all);
  if (!tokens.ok()) return Fail(tokens.status());
  if (g.json()) {
    std::cout << ToJson(*tokens);
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  const int64_t now = NowMs();
  for (const auto& t : tokens->tokens()) {
    std::string state = "valid";
    if (t.revoked()) {
      state = "revoked";
    } else if (t.expires_time_ms() != 0 && t.expires_time_ms() <= now) {
      state = "expired";
    }
    rows.push_back({t.id(), t.user(), t.node().empty() ? "-" : t.node(), state,
                    TimeOrDash(t.created_time_ms()), TimeOrDash(t.expires_time_ms()),
                    t.description().empty() ? "-" : t.description()});
  }
  std::cout << FormatTable({"ID", "USER", "NODE", "STATE", "CREATED", "EXPIRES", "DESCRIPTION"},
                           rows);
  return 0;
}

int TokenRevoke(const Globals& g, const std::string& id) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto token = client.RevokeToken(id);
  if (!token.ok()) return Fail(token.status());
  if (g.json()) {
    std::cout << ToJson(*token);
  } else {
    std::cout << "revoked " << token->id() << "\n";
  }
  return 0;
}

int NodeDeny(const Globals& g, const std::string& node, const std::string& reason, bool allow) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto denied = client.DenyNode(node, reason, allow);
  if (!denied.ok()) return Fail(denied.status());
  if (g.json()) {
    std::cout << ToJson(*denied);
  } else {
    std::cout << (allow ? "allowed " : "denied ") << node << "\n";
  }
  return 0;
}

int NodeDeniedList(const Globals& g) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  auto denied = client.ListDeniedNodes();
  if (!denied.ok()) return Fail(denied.status());
  if (g.json()) {
    std::cout << ToJson(*denied);
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& n : denied->nodes()) {
    rows.push_back({n.node(), n.denied_by(), TimeOrDash(n.denied_time_ms()),
                    n.reason().empty() ? "-" : n.reason()});
  }
  std::cout << FormatTable({"NODE", "DENIED BY", "SINCE", "REASON"}, rows);
  return 0;
}

void PrintCluster(const Globals& g, const LocalCluster& c) {
  if (g.json()) {
    nlohmann::json j = {{"state_dir", c.state_dir},
                        {"coordinator_address", c.coordinator_address},
                        {"admin_token_file", c.admin_token_file},
                        {"saved_token_to", c.saved_token_to},
                        {"tls_ca", c.tls_ca},
                        {"processes", nlohmann::json::array()}};
    for (const auto& p : c.processes) {
      j["processes"].push_back({{"name", p.name},
                                {"pid", p.pid},
                                {"address", p.address},
                                {"alive", p.alive},
                                {"log", p.log},
                                {"metrics_address", p.metrics_address}});
    }
    std::cout << j.dump(1) << "\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& p : c.processes) {
    rows.push_back({p.name, absl::StrCat(p.pid), p.alive ? "running" : "stopped", p.address,
                    p.metrics_address.empty() ? "-" : p.metrics_address, p.log});
  }
  std::cout << FormatTable({"PROCESS", "PID", "STATUS", "ADDRESS", "METRICS", "LOG"}, rows);
  if (!c.admin_token_file.empty()) {
    std::cout << "\nlocal admin's token: " << c.admin_token_file;
    if (!c.saved_token_to.empty()) std::cout << " (yard uses it: " << c.saved_token_to << ")";
    std::cout << "\n";
  }
}

}  // namespace
}  // namespace trainyard::client

namespace trainyard::client {
namespace {

// The values of every verb's options and arguments: CLI11 writes them as it parses, after the
// Add*Verbs functions have returned, and the verbs' callbacks read them.
struct VerbArgs {
  std::string spec_path, job_id, reason, timeout, owner;
  std::vector<std::string> states;
  int limit = 0;
  bool follow = false;
  int tail = 0;
  std::string out_dir;
  int world = 0, per_node = 0;
  std::string device_memory;
  std::string save_to = DefaultTokenFile();
  std::string quota_user;
  bool quota_all = false;
  std::string name;
  bool as_admin = false, enable = false;
  std::string user_account;
  UserSetArgs user_set_args;
  AccountArgs account_args;
  TokenCreateArgs token_args;
  std::string token_user, token_id;
  bool all_tokens = false;
  std::string node_name, node_reason;
  LocalUpOptions up_options;
  bool up_preemption = false;
  std::string up_preemption_grace, up_min_run_time;
};

struct Cli {
  Globals g;
  VerbArgs args;
  int rc = 0;  // the verb's exit code
};

// Jobs: submit, ls, describe, cancel, wait, logs, metrics, checkpoint, fetch, estimate-memory,
// nodes.
void AddJobVerbs(CLI::App& app, Cli& c) {
  Globals& g = c.g;
  int& rc = c.rc;
  VerbArgs& a = c.args;
  auto& spec_path = a.spec_path;
  auto& job_id = a.job_id;
  auto& reason = a.reason;
  auto& timeout = a.timeout;
  auto& owner = a.owner;
  auto& states = a.states;
  auto& limit = a.limit;

  auto* submit = app.add_subcommand(
      "submit",
      "submit a job from a YAML spec; prints its id. The spec trains a built-in model (model:, "
      "data:, train:, parallel:) or runs your own program on each rank (command: [python3, "
      "train.py], workdir: /abs/path, env: {NAME: value}) with torchrun's environment (RANK, "
      "WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...)");
  submit->add_option("spec", spec_path, "job spec (YAML)")->required();
  submit->callback([&] { rc = Submit(g, spec_path); });

  auto* ls = app.add_subcommand("ls", "list jobs, newest first");
  ls->add_option("--state", states, "only jobs in these states (repeatable)");
  ls->add_option("--owner", owner, "only jobs of this user");
  ls->add_option("--limit", limit, "at most this many jobs (0 = all)")->capture_default_str();
  ls->callback([&] { rc = List(g, states, owner, limit); });

  auto* describe = app.add_subcommand("describe", "show one job in full");
  describe->add_option("job", job_id, "job id (job-7 or 7)")->required();
  describe->callback([&] { rc = Describe(g, job_id); });

  auto* cancel = app.add_subcommand("cancel", "cancel a waiting or running job");
  cancel->add_option("job", job_id, "job id")->required();
  cancel->add_option("--reason", reason, "recorded with the job");
  cancel->callback([&] { rc = Cancel(g, job_id, reason); });

  auto* wait = app.add_subcommand(
      "wait", "wait until a job ends; exit 0 succeeded, 1 failed, 2 cancelled, 3 timed out");
  wait->add_option("job", job_id, "job id")->required();
  wait->add_option("--timeout", timeout, "give up after this long (e.g. 10m)");
  wait->callback([&] { rc = Wait(g, job_id, timeout); });

  auto& follow = a.follow;
  auto& tail = a.tail;
  auto* logs = app.add_subcommand("logs", "print a job's output, every rank prefixed");
  logs->add_option("job", job_id, "job id")->required();
  logs->add_flag("-f,--follow", follow, "keep printing until the job ends");
  logs->add_option("--tail", tail, "only the last N lines (0 = all kept)")->capture_default_str();
  logs->callback([&] { rc = Logs(g, job_id, follow, tail); });

  auto* metrics = app.add_subcommand(
      "metrics", "a job's training metrics: a table, or with -f a live progress bar and ETA");
  metrics->add_option("job", job_id, "job id")->required();
  metrics->add_flag("-f,--follow", follow, "keep updating until the job ends");
  metrics->callback([&] { rc = Metrics(g, job_id, follow); });

  auto* checkpoint = app.add_subcommand("checkpoint", "ask a running job to write a checkpoint");
  checkpoint->add_option("job", job_id, "job id")->required();
  checkpoint->callback([&] { rc = Checkpoint(g, job_id); });

  auto& out_dir = a.out_dir;
  auto* fetch = app.add_subcommand(
      "fetch", "download a succeeded job's export (its spec's checkpoint.export) into a folder");
  fetch->add_option("job", job_id, "job id")->required();
  fetch->add_option("--out", out_dir, "folder to create (or an empty one)")->required();
  fetch->callback([&] { rc = Fetch(g, job_id, out_dir); });

  auto& world = a.world;
  auto& per_node = a.per_node;
  auto& device_memory = a.device_memory;
  auto* estimate = app.add_subcommand(
      "estimate-memory", "memory per rank of a spec under every strategy and precision");
  estimate->add_option("spec", spec_path, "job spec (YAML)")->required();
  estimate->add_option("--world-size", world, "ranks (default: the spec's resources.gpus)");
  estimate->add_option("--ranks-per-node", per_node, "ranks sharing a node (default: all)");
  estimate->add_option("--device-memory", device_memory,
                       "memory of one device, e.g. 80GiB (default: ask the coordinator)");
  estimate->callback(
      [&] { rc = EstimateMemoryVerb(g, spec_path, world, per_node, device_memory); });

  auto* nodes = app.add_subcommand("nodes", "list worker nodes and their devices");
  nodes->callback([&] { rc = Nodes(g); });
}

// Who you are: login, whoami, quota.
void AddIdentityVerbs(CLI::App& app, Cli& c) {
  Globals& g = c.g;
  int& rc = c.rc;
  VerbArgs& a = c.args;
  auto* login = app.add_subcommand(
      "login", "check a token read from standard input and save it where yard looks for it");
  auto& save_to = a.save_to;
  login->add_option("--save-to", save_to, "where to save it")->capture_default_str();
  login->callback([&] { rc = Login(g, save_to); });

  auto* whoami = app.add_subcommand("whoami", "the user (or node) of your token");
  whoami->callback([&] { rc = WhoAmI(g); });

  auto& quota_user = a.quota_user;
  auto& quota_all = a.quota_all;
  auto* quota = app.add_subcommand(
      "quota", "your use, caps and share, and your account's quota and usage (-o json)");
  quota->add_option("--user", quota_user, "this user's (admins)");
  quota->add_flag("--all", quota_all, "every account (admins)");
  quota->callback([&] { rc = Quota(g, quota_user, quota_all); });
}

// admin: users, accounts, tokens, nodes.
void AddAdminVerbs(CLI::App& app, Cli& c) {
  Globals& g = c.g;
  int& rc = c.rc;
  VerbArgs& a = c.args;
  auto* admin =
      app.add_subcommand("admin", "users, accounts and tokens (admins; a user: its own tokens)");
  admin->require_subcommand(1);
  auto* user_cmd = admin->add_subcommand("user", "users of the cluster (admins)");
  user_cmd->require_subcommand(1);
  auto& name = a.name;
  auto& as_admin = a.as_admin;
  auto& enable = a.enable;
  auto& user_account = a.user_account;
  auto* user_add = user_cmd->add_subcommand("add", "create a user");
  user_add->add_option("name", name, "user name, like a Unix account")->required();
  user_add->add_flag("--admin", as_admin, "an admin: sees and controls every job");
  user_add->add_option("--account", user_account, "the account its jobs are charged to")
      ->default_str("default");
  user_add->callback([&] { rc = UserAdd(g, name, as_admin, user_account); });
  auto& user_set_args = a.user_set_args;
  auto* user_set = user_cmd->add_subcommand("set", "change a user's account and caps");
  user_set->add_option("name", user_set_args.name, "user name")->required();
  user_set->add_option("--account", user_set_args.account, "move the user to this account");
  user_set->add_option("--max-devices", user_set_args.max_devices,
                       "cap on the devices its running jobs hold together ('none': no cap)");
  user_set->add_option("--max-queued", user_set_args.max_queued,
                       "cap on its queued jobs; more are refused at submit ('none': no cap)");
  user_set->callback([&] { rc = UserSet(g, user_set_args); });
  auto* user_ls = user_cmd->add_subcommand("ls", "list users");
  user_ls->callback([&] { rc = UserList(g); });
  auto* user_disable =
      user_cmd->add_subcommand("disable", "refuse every token of a user (--enable: lift it)");
  user_disable->add_option("name", name, "user name")->required();
  user_disable->add_flag("--enable", enable, "enable the user again");
  user_disable->callback([&] { rc = UserDisable(g, name, enable); });

  auto* account_cmd = admin->add_subcommand(
      "account", "accounts (teams): quotas and fair shares (admins; ls: any user)");
  account_cmd->require_subcommand(1);
  auto& account_args = a.account_args;
  auto add_account_flags = [&](CLI::App* cmd) {
    cmd->add_option("name", account_args.name, "account name, like a Unix account")->required();
    cmd->add_option("--quota", account_args.quota,
                    "devices guaranteed to the account ('none': no quota)");
    cmd->add_option("--borrow-limit", account_args.borrow_limit,
                    "devices it may borrow beyond its quota while idle ('none': any)");
    cmd->add_option("--share", account_args.share,
                    "fair-share weight: among jobs of equal priority, the account furthest below "
                    "its share goes first (default 1)");
  };
  auto* account_add = account_cmd->add_subcommand("add", "create an account");
  add_account_flags(account_add);
  account_add->callback([&] { rc = AccountAdd(g, account_args); });
  auto* account_set = account_cmd->add_subcommand("set", "change an account's quota or share");
  add_account_flags(account_set);
  account_set->callback([&] { rc = AccountSet(g, account_args); });
  auto* account_ls = account_cmd->add_subcommand("ls", "list accounts");
  account_ls->callback([&] { rc = AccountList(g); });
  auto* account_rm = account_cmd->add_subcommand("rm", "delete an account that has no users");
  account_rm->add_option("name", name, "account name")->required();
  account_rm->callback([&] { rc = AccountRemove(g, name); });

  auto* token_cmd = admin->add_subcommand("token", "API tokens and node tokens");
  token_cmd->require_subcommand(1);
  auto& token_args = a.token_args;
  auto* token_create = token_cmd->add_subcommand(
      "create", "create a token and print it once (yours; --user or --node: admins)");
  token_create->add_option("--user", token_args.user, "for this user (default: you)");
  token_create->add_option("--node", token_args.node,
                           "a node token for this node name (workers, parameter servers)");
  token_create->add_option("--ttl", token_args.ttl, "expires after this long (e.g. 720h)");
  token_create
      ->add_option("--owners", token_args.owners,
                   "with --node: the users whose jobs that node may take (a worker not "
                   "running as root); default any")
      ->delimiter(',');
  token_create->add_option("--description", token_args.description, "shown by ls");
  token_create->add_option("--out", token_args.out,
                           "write it to this file (mode 0600) instead of printing it");
  token_create->callback([&] { rc = TokenCreate(g, token_args); });
  auto& token_user = a.token_user;
  auto& token_id = a.token_id;
  auto& all_tokens = a.all_tokens;
  auto* token_ls = token_cmd->add_subcommand("ls", "list tokens (never their secrets)");
  token_ls->add_option("--user", token_user, "this user's (admins)");
  token_ls->add_flag("--all", all_tokens, "every user's (admins)");
  token_ls->callback([&] { rc = TokenList(g, token_user, all_tokens); });
  auto* token_revoke = token_cmd->add_subcommand("revoke", "revoke a token by its id");
  token_revoke->add_option("id", token_id, "token id (from ls)")->required();
  token_revoke->callback([&] { rc = TokenRevoke(g, token_id); });

  auto* node_cmd = admin->add_subcommand(
      "node", "deny a node (a token or certificate it holds no longer counts) or lift it");
  node_cmd->require_subcommand(1);
  auto& node_name = a.node_name;
  auto& node_reason = a.node_reason;
  auto* node_deny = node_cmd->add_subcommand(
      "deny", "refuse a node's calls and end its session (its ranks' jobs restart elsewhere)");
  node_deny->add_option("node", node_name, "node id")->required();
  node_deny->add_option("--reason", node_reason, "shown by ls");
  node_deny->callback([&] { rc = NodeDeny(g, node_name, node_reason, false); });
  auto* node_allow = node_cmd->add_subcommand("allow", "lift a node's denial");
  node_allow->add_option("node", node_name, "node id")->required();
  node_allow->callback([&] { rc = NodeDeny(g, node_name, "", true); });
  auto* node_ls = node_cmd->add_subcommand("ls", "list denied nodes");
  node_ls->callback([&] { rc = NodeDeniedList(g); });
}

// local: a cluster on this machine.
void AddLocalVerbs(CLI::App& app, Cli& c) {
  Globals& g = c.g;
  int& rc = c.rc;
  VerbArgs& a = c.args;
  auto* local = app.add_subcommand("local", "run a cluster on this machine, on loopback");
  local->require_subcommand(1);
  auto& up_options = a.up_options;
  up_options.state_dir = DefaultLocalStateDir();
  up_options.bin_dir = SelfDir();
  up_options.save_token_to = DefaultTokenFile();
  local->add_option("--state-dir", up_options.state_dir, "state and logs of the local cluster")
      ->capture_default_str();
  auto* up = local->add_subcommand("up", "start a coordinator in the background");
  up->add_option("--listen", up_options.listen, "coordinator HOST:PORT")->capture_default_str();
  up->add_option("--workers", up_options.workers, "worker daemons to start")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  up->add_option("--slots", up_options.slots_per_worker, "CPU slots of each worker")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  auto& up_preemption = a.up_preemption;
  auto& up_preemption_grace = a.up_preemption_grace;
  auto& up_min_run_time = a.up_min_run_time;
  up->add_flag("--preemption", up_preemption,
               "jobs may preempt lower-priority ones, which checkpoint first (coordinator "
               "--preemption)");
  up->add_option("--preemption-grace", up_preemption_grace,
                 "coordinator --preemption-grace (default 120s)");
  up->add_option("--min-run-time", up_min_run_time, "coordinator --min-run-time (default 5m)");
  up->add_option("--tls-cert", up_options.tls_cert,
                 "serve the coordinator and parameter servers over TLS with this certificate "
                 "(PEM, valid for 127.0.0.1; clients verify it with the global --tls-ca)");
  up->add_option("--tls-key", up_options.tls_key, "its private key (PEM)");
  up->add_flag("--metrics", up_options.metrics,
               "every process serves Prometheus /metrics on a free loopback port (see status)");
  up->add_option("--threads-per-slot", up_options.threads_per_slot,
                 "threads of each rank (0: cores / (workers * slots))")
      ->capture_default_str();
  up->add_option("--ps", up_options.parameter_servers,
                 "parameter servers to start (for parallel.strategy: offload)")
      ->check(CLI::Range(0, 16))
      ->capture_default_str();
  up->add_option("--ps-memory-bytes", up_options.ps_memory_bytes,
                 "memory each parameter server offers (0: half this machine's)")
      ->check(CLI::NonNegativeNumber);
  // On loopback, pacing (BBR without fq, say) only costs: reno unless the environment says.
  const char* congestion_env = std::getenv(trainyard::ps::kTcpCongestionEnv);  // (static storage)
  up_options.tcp_congestion = congestion_env != nullptr ? congestion_env : "reno";
  up->add_option("--tcp-congestion", up_options.tcp_congestion,
                 "TCP congestion control of the parameter-server connections (\"\": the host's; "
                 "default $TRAINYARD_TCP_CONGESTION, else reno)")
      ->capture_default_str();
  up->callback([&] {
    // The default falls back to the host's where reno cannot be set (a sandbox's network stack);
    // a name the user chose is checked by LocalUp and refused.
    if (congestion_env == nullptr && up->count("--tcp-congestion") == 0 &&
        !trainyard::ps::CheckTcpCongestion(up_options.tcp_congestion, "").ok()) {
      up_options.tcp_congestion.clear();
    }
    up_options.tls_ca = g.tls.ca_file;
    if (up_preemption) up_options.coordinator_flags.push_back("--preemption");
    if (!up_preemption_grace.empty()) {
      up_options.coordinator_flags.insert(up_options.coordinator_flags.end(),
                                          {"--preemption-grace", up_preemption_grace});
    }
    if (!up_min_run_time.empty()) {
      up_options.coordinator_flags.insert(up_options.coordinator_flags.end(),
                                          {"--min-run-time", up_min_run_time});
    }
    auto c = LocalUp(up_options);
    if (!c.ok()) {
      rc = Fail(c.status());
      return;
    }
    PrintCluster(g, *c);
    if (!g.json()) {
      std::cout << "\nexport TRAINYARD_COORDINATOR=" << c->coordinator_address << "\n";
      if (!c->tls_ca.empty()) std::cout << "export TRAINYARD_TLS_CA=" << c->tls_ca << "\n";
    }
  });
  auto* down = local->add_subcommand("down", "stop the local cluster");
  down->callback([&] {
    if (absl::Status s = LocalDown(up_options.state_dir); !s.ok()) {
      rc = Fail(s);
    } else if (!g.json()) {
      std::cout << "stopped\n";
    }
  });
  auto* status = local->add_subcommand("status", "show the local cluster's processes");
  status->callback([&] {
    auto c = LocalStatus(up_options.state_dir);
    if (!c.ok()) {
      rc = Fail(c.status());
      return;
    }
    PrintCluster(g, *c);
    for (const auto& p : c->processes) {
      if (!p.alive && rc == 0) {
        rc = Fail(absl::UnavailableError(
            absl::StrCat(p.name, " (pid ", p.pid, ") is not running; see ", p.log)));
      }
    }
  });
}

}  // namespace
}  // namespace trainyard::client

int main(int argc, char** argv) {
  using namespace trainyard::client;
  // gRPC's own log lines (a failed TLS handshake, ...) would break yard's one-line errors, which
  // say the same in its words; GRPC_VERBOSITY brings them back for debugging.
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function([](gpr_log_func_args*) {});
  Cli c;
  Globals& g = c.g;
  g.coordinator = DefaultCoordinator();

  CLI::App app{"yard: submit and watch training jobs on a trainyard cluster"};
  app.set_version_flag("--version", std::string("yard ") + trainyard::kVersion);
  app.require_subcommand(1);
  app.fallthrough();
  app.add_option("--coordinator", g.coordinator,
                 "coordinator HOST:PORT (env TRAINYARD_COORDINATOR)")
      ->capture_default_str();
  app.add_option("-o,--output", g.output, "output format")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();
  app.add_option("--token-file", g.token_file,
                 "file holding your API token (mode 0600; env TRAINYARD_TOKEN_FILE); else env "
                 "TRAINYARD_TOKEN, else " +
                     DefaultTokenFile())
      ->envname("TRAINYARD_TOKEN_FILE");
  app.add_option("--tls-ca", g.tls.ca_file,
                 "CA (PEM) to verify a coordinator that serves TLS with (env TRAINYARD_TLS_CA)")
      ->envname(trainyard::kTlsCaEnv);

  AddJobVerbs(app, c);
  AddIdentityVerbs(app, c);
  AddAdminVerbs(app, c);
  AddLocalVerbs(app, c);
  CLI11_PARSE(app, argc, argv);
  return c.rc;
}
