// yard's job verbs: submit, ls, describe, cancel, wait, logs, metrics, checkpoint, fetch,
// estimate-memory, nodes.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <yaml-cpp/yaml.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/local_cluster.h"
#include "client/output.h"
#include "client/verbs.h"
#include "client/yard_client.h"
#include "common/cli_checks.h"
#include "common/context_archive.h"
#include "common/credentials.h"
#include "common/memory_estimate.h"
#include "common/placement.h"
#include "common/signal_names.h"
#include "common/spec.h"

namespace trainyard::client {
namespace {

// Exit codes of `yard wait` beyond 0 (succeeded) and 1 (error).
constexpr int kExitJobFailed = 1;
constexpr int kExitJobCancelled = 2;
constexpr int kExitTimedOut = 3;

std::string Devices(const v1::Job& job) { return absl::StrCat(job.spec().resources().slots()); }

// "2; per rank 1.5 CPUs, 16.0 GiB" (what each rank asks for beside its device).
std::string ResourcesText(const v1::Job& job) {
  const v1::Resources& r = job.spec().resources();
  std::vector<std::string> per_rank;
  if (r.cpus() > 0) per_rank.push_back(absl::StrCat(r.cpus(), " CPUs"));
  if (r.memory_bytes() > 0) per_rank.push_back(HumanBytes(r.memory_bytes()));
  // resources.nodes: "2 on 2 nodes, 4 ranks each".
  std::string devices = Devices(job);
  if (r.nodes() > 0) {
    absl::StrAppend(&devices, " on ", r.nodes(), " node", r.nodes() == 1 ? "" : "s",
                    r.ranks_per_node() > 0 ? absl::StrCat(", ", r.ranks_per_node(), " ranks each")
                                           : std::string());
  }
  return per_rank.empty() ? devices
                          : absl::StrCat(devices, "; per rank ", absl::StrJoin(per_rank, ", "));
}

// What the ranks of the job's latest attempt with reports used, as sacct lists a step's tasks:
// a table, or "" when no rank has ended.
std::string RankUsageText(const v1::Job& job) {
  if (job.rank_usage().empty()) return "";
  const int attempt = job.rank_usage(job.rank_usage_size() - 1).attempt();
  std::vector<const v1::RankUsage*> ranks;
  for (const v1::RankUsage& u : job.rank_usage()) {
    if (u.attempt() == attempt) ranks.push_back(&u);
  }
  std::sort(ranks.begin(), ranks.end(),
            [](const v1::RankUsage* a, const v1::RankUsage* b) { return a->rank() < b->rank(); });
  std::vector<std::vector<std::string>> rows;
  for (const v1::RankUsage* u : ranks) {
    rows.push_back({absl::StrCat(u->rank()), u->node_id(), absl::StrCat(u->exit_code()),
                    HumanBytes(u->peak_rss_bytes()),
                    u->memory_peak_bytes() > 0 ? HumanBytes(u->memory_peak_bytes()) : "-",
                    absl::StrFormat("%.2f s", u->cpu_seconds())});
  }
  return absl::StrCat(
      "\nranks of attempt ", attempt, " that ended:\n",
      FormatTable({"RANK", "NODE", "EXIT", "PEAK RSS", "CGROUP PEAK", "CPU TIME"}, rows));
}

std::string PlacementText(const v1::Job& job) {
  std::vector<std::string> parts;
  for (const auto& p : job.placement()) {
    parts.push_back(absl::StrCat(p.node_id(), "[", absl::StrJoin(p.device_indices(), ","),
                                 "] ranks ", p.first_rank(), "-", p.first_rank() + RanksOf(p) - 1));
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, "; ");
}

// The optimizer's constants the spec sets and the kinds weight decay skips ("" when none).
std::string OptimizerSettingsText(const v1::TrainSpec& t) {
  std::string out;
  for (const auto& [name, has, value] : std::vector<std::tuple<const char*, bool, double>>{
           {"adam_beta1", t.has_adam_beta1(), t.adam_beta1()},
           {"adam_beta2", t.has_adam_beta2(), t.adam_beta2()},
           {"adam_epsilon", t.has_adam_epsilon(), t.adam_epsilon()},
           {"adafactor_eps", t.has_adafactor_eps(), t.adafactor_eps()},
           {"adafactor_clip_threshold", t.has_adafactor_clip_threshold(),
            t.adafactor_clip_threshold()},
           {"adafactor_decay_rate", t.has_adafactor_decay_rate(), t.adafactor_decay_rate()}}) {
    if (has) absl::StrAppend(&out, " ", name, "=", value);
  }
  if (t.weight_decay() > 0) absl::StrAppend(&out, " weight_decay=", t.weight_decay());
  if (t.no_weight_decay_size() > 0) {
    absl::StrAppend(&out, " no_weight_decay=", absl::StrJoin(t.no_weight_decay(), ","));
  }
  return out;
}

// The checkpoints retention keeps, oldest first: "step-N (eval_loss x), ...".
std::string KeptText(const v1::Job& job) {
  std::vector<std::string> kept;
  for (const v1::CheckpointInfo& c : job.kept_checkpoints()) {
    kept.push_back(c.has_eval_loss()
                       ? absl::StrFormat("step-%d (eval_loss %.4f)", c.step(), c.eval_loss())
                       : absl::StrCat("step-", c.step()));
  }
  return kept.empty() ? "-" : absl::StrJoin(kept, ", ");
}

void PrintJob(const v1::Job& job) {
  const auto& s = job.spec();
  const auto& m = s.model();
  const auto& t = s.train();
  std::vector<std::pair<std::string, std::string>> f = {
      {"id", job.id()},
      {"name", s.name()},
      {"description", s.description().empty() ? "-" : TerminalSafe(s.description())},
      {"owner", job.owner()},
      {"state", v1::JobState_Name(job.state())},
      {"message", job.message().empty() ? "-" : TerminalSafe(job.message())},
      {"priority", absl::StrCat(s.priority())},
      {"devices", ResourcesText(job)},
      {"attempt",
       absl::StrCat(job.attempt(), " (restarts ", job.restarts(), " of ", s.max_restarts(), ")")},
      {"placement", PlacementText(job)},
      {"submitted", Ago(job.submit_time_ms(), NowMs())},
      {"started", Ago(job.start_time_ms(), NowMs())},
      {"ended", Ago(job.end_time_ms(), NowMs())},
      {"model",
       absl::StrCat(
           m.kind(), m.from().empty() ? "" : absl::StrCat(" from=", TerminalSafe(m.from())),
           " n_layer=", m.n_layer(), " n_head=", m.n_head(), " d_model=", m.d_model(),
           " seq_len=", m.seq_len(), " vocab=", m.vocab(),
           m.n_kv_head() > 0 ? absl::StrCat(" n_kv_head=", m.n_kv_head()) : "",
           m.d_hidden() > 0 ? absl::StrCat(" d_hidden=", m.d_hidden()) : "",
           m.tie_weights() ? " tied" : "",
           m.activation().empty() ? "" : absl::StrCat(" activation=", TerminalSafe(m.activation())),
           " (", HumanCount(ModelParameterCount(m)), " params)")},
      {"data",
       absl::StrCat(TerminalSafe(s.data().path()), " (", s.data().format(), ")",
                    s.data().eval_path().empty()
                        ? ""
                        : absl::StrCat("; held out: ", TerminalSafe(s.data().eval_path())))},
      {"train",
       absl::StrCat(
           "steps=", t.steps(), " micro_batch=", t.micro_batch(), " grad_accum=", t.grad_accum(),
           " lr=", t.lr(), " ",
           LrScheduleName(t.lr_schedule() == v1::LR_SCHEDULE_UNSPECIFIED ? v1::WARMUP_COSINE
                                                                         : t.lr_schedule()),
           t.warmup_ratio() > 0 ? absl::StrCat(" warmup_ratio=", t.warmup_ratio())
                                : absl::StrCat(" warmup=", t.warmup()),
           t.has_min_lr_ratio() ? absl::StrCat(" min_lr_ratio=", t.min_lr_ratio()) : "", " ",
           MixedPrecisionName(t.mixed_precision()), " ", OptimizerName(t.optimizer()),
           OptimizerSettingsText(t),
           t.eval_every() > 0 || !s.data().eval_path().empty()
               ? absl::StrCat(" eval_every=", t.eval_every(), " eval_batches=", t.eval_batches())
               : "")},
      {"parallel", absl::StrCat(StrategyName(s.parallel().strategy()), " ",
                                ShardingStrategyName(s.parallel().sharding_strategy()),
                                " bucket_mb=", s.parallel().bucket_mb())},
      {"max_runtime", s.max_runtime_seconds() == 0
                          ? "-"
                          : absl::FormatDuration(absl::Seconds(s.max_runtime_seconds()))},
      {"stop_grace", s.stop_grace_seconds() == 0
                         ? "the worker's"
                         : absl::StrCat(absl::FormatDuration(absl::Seconds(s.stop_grace_seconds())),
                                        " (up to the node's --max-stop-grace)")},
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
    f.push_back({"command", TerminalSafe(absl::StrJoin(s.command(), " "))});
    f.push_back({"workdir", !s.context().empty()  ? "- (the context, unpacked per attempt)"
                            : s.workdir().empty() ? "- (a fresh folder per attempt)"
                                                  : TerminalSafe(s.workdir())});
    if (!s.context().empty()) f.push_back({"context", TerminalSafe(s.context())});
    f.push_back({"env", names.empty() ? "-" : TerminalSafe(absl::StrJoin(names, " "))});
  }
  // Every job's: the last checkpoint reported (a command job's through the SDK), and what
  // retention keeps (the trainer's, or the SDK's save_checkpoint under checkpoint.keep_last).
  const v1::CheckpointInfo& last = job.last_checkpoint();
  f.push_back(
      {"last checkpoint",
       last.step() == 0
           ? "-"
           : absl::StrCat("step ", last.step(), " at ", TerminalSafe(last.path()),
                          last.bytes() > 0 ? absl::StrCat(", ", HumanBytes(last.bytes())) : "",
                          ", attempt ", last.attempt(), ", ", Ago(last.time_ms(), NowMs()))});
  const int keep = s.checkpoint().keep_last();
  f.push_back({"checkpoints", absl::StrCat("kept ", KeptText(job), " (keep_last ",
                                           keep > 0 ? absl::StrCat(keep) : std::string("all"),
                                           s.checkpoint().keep_best() ? ", keep_best" : "", ")")});
  if (!IsCommandJob(s)) {
    if (job.eval_loss() > 0) {
      f.push_back({"eval_loss", absl::StrFormat("%.4f (perplexity %.2f)", job.eval_loss(),
                                                std::exp(job.eval_loss()))});
    }
  }
  if (s.after_size() > 0) f.push_back({"after", absl::StrJoin(s.after(), " ")});
  if (s.has_array()) {
    f.push_back(
        {"array",
         absl::StrCat(s.array().id(), ": task ", s.array().index(), " of ", s.array().count(),
                      s.array().max_running() > 0
                          ? absl::StrCat(", at most ", s.array().max_running(), " at once")
                          : std::string())});
  }
  if (!job.why_waiting().empty()) f.push_back({"waiting", job.why_waiting()});
  if (job.backfilled()) f.push_back({"backfilled", "yes"});
  // Rank 0 as its latest step report had it.
  if (job.cpu_seconds() > 0 || job.device_peak_bytes() > 0) {
    f.push_back({"rank 0 use",
                 absl::StrCat(absl::StrFormat("CPU %.1f s", job.cpu_seconds()),
                              job.device_peak_bytes() > 0
                                  ? absl::StrCat(", GPU peak ", HumanBytes(job.device_peak_bytes()))
                                  : "")});
  }
  std::cout << FormatFields(f) << RankUsageText(job);
}

// A llama spec with model.from: its sizes from config.json when yard can read it (see
// FillModelFromCheckpoint), checked again; a checkpoint yard cannot read is left to the trainer.
absl::Status FillFromCheckpoint(ParsedSpec& parsed, const std::string& path) {
  absl::Status s = FillModelFromCheckpoint(parsed.spec);
  if (absl::IsNotFound(s)) return absl::OkStatus();
  if (s.ok()) s = ValidateJobSpec(parsed.spec);
  return s.ok() ? s : AnnotateWithLine(s, parsed, path);
}

// Whether `command` runs a script in this folder by a relative name: its program (./train.sh) or,
// for an interpreter, its first argument ending in .py or .sh (python train.py).
bool NamesALocalScript(const std::vector<std::string>& command) {
  auto local = [](const std::string& path) {
    std::error_code ec;
    return !path.empty() && path[0] != '/' && std::filesystem::is_regular_file(path, ec);
  };
  if (command.empty()) return false;
  if (command[0][0] != '/' && command[0].find('/') != std::string::npos) return local(command[0]);
  for (size_t i = 1; i < command.size(); ++i) {
    if (absl::EndsWith(command[i], ".py") || absl::EndsWith(command[i], ".sh")) {
      return local(command[i]);
    }
  }
  return false;
}

// A spec's context folder (`context: DIR`, `--context DIR`), packed and uploaded: the spec then
// names the upload's digest. What was left out is said on stderr. A digest given is kept.
absl::Status UploadSpecContext(YardClient& client, v1::JobSpec& spec) {
  if (spec.context().empty() || IsContextDigest(spec.context())) return absl::OkStatus();
  absl::StatusOr<PackedContext> packed = PackContext(spec.context());
  if (!packed.ok()) return packed.status();
  if (!packed->skipped_links.empty()) {
    std::cerr << "context: left out " << packed->skipped_links.size()
              << " link(s) and special file(s), e.g. " << TerminalSafe(packed->skipped_links[0])
              << "\n";
  }
  auto uploaded = client.UploadContext(packed->digest, packed->archive);
  if (!uploaded.ok()) return uploaded.status();
  std::cerr << "context: " << TerminalSafe(spec.context()) << ", " << packed->files << " files, "
            << HumanBytes(packed->content_bytes) << " ("
            << HumanBytes(static_cast<int64_t>(packed->archive.size())) << " packed) uploaded as "
            << packed->digest.substr(0, 19) << "\n";
  spec.set_context(uploaded->context());
  return absl::OkStatus();
}

// The spec's fields that `f` gives, as YAML in the spec's shape (empty: none). Without a spec
// file (`inline_job`), a program after -- is the whole job: one slot, named after the script
// (else the program), run in the current folder unless --workdir says otherwise.
absl::StatusOr<std::string> SubmitFlagsYaml(const SubmitFlags& f, bool inline_job) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string name = f.name;
  if (name.empty() && inline_job) {
    std::string program = std::filesystem::path(f.command[0]).filename().string();
    for (const std::string& arg : f.command) {
      if (absl::EndsWith(arg, ".py") || absl::EndsWith(arg, ".sh")) {
        program = std::filesystem::path(arg).stem().string();
        break;
      }
    }
    for (char c : program) {
      if (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.') {
        name.push_back(c);
      }
    }
    if (name.empty() || absl::ascii_isdigit(static_cast<unsigned char>(name[0]))) {
      name = "job-" + name;
    }
    name.resize(std::min<size_t>(name.size(), 64));
  }
  if (!name.empty()) out << YAML::Key << "name" << YAML::Value << name;
  if (!f.description.empty()) out << YAML::Key << "description" << YAML::Value << f.description;
  if (f.priority != 0) out << YAML::Key << "priority" << YAML::Value << f.priority;
  if (f.max_restarts >= 0) out << YAML::Key << "max_restarts" << YAML::Value << f.max_restarts;
  // (With --nodes, slots default to one a node.)
  const int slots = f.slots > 0 ? f.slots : (inline_job && f.nodes == 0 ? 1 : 0);
  if (slots > 0 || f.cpus > 0 || !f.memory.empty() || f.nodes > 0 || f.ranks_per_node > 0) {
    out << YAML::Key << "resources" << YAML::Value << YAML::BeginMap;
    if (slots > 0) out << YAML::Key << "slots" << YAML::Value << slots;
    if (f.nodes > 0) out << YAML::Key << "nodes" << YAML::Value << f.nodes;
    if (f.ranks_per_node > 0) {
      out << YAML::Key << "ranks_per_node" << YAML::Value << f.ranks_per_node;
    }
    if (f.cpus > 0) out << YAML::Key << "cpus" << YAML::Value << f.cpus;
    if (!f.memory.empty()) out << YAML::Key << "memory" << YAML::Value << f.memory;
    out << YAML::EndMap;
  }
  if (!f.command.empty()) {
    out << YAML::Key << "command" << YAML::Value << YAML::BeginSeq;
    for (const std::string& arg : f.command) out << YAML::DoubleQuoted << arg;
    out << YAML::EndSeq;
  }
  std::string workdir = f.workdir;
  std::string context = f.context;
  // A program after -- that names a script here (./train.sh, python train.py): this folder is
  // uploaded as its context, so that no worker needs to see it. Else it runs in this folder.
  if (workdir.empty() && context.empty() && inline_job && NamesALocalScript(f.command)) {
    context = ".";
  }
  if (workdir.empty() && context.empty() && inline_job) {
    workdir = std::filesystem::current_path().string();
  }
  if (!context.empty()) {
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(context, ec);
    if (!ec) context = absolute.lexically_normal().string();
    if (context.size() > 1 && context.back() == '/') context.pop_back();
    out << YAML::Key << "context" << YAML::Value << YAML::DoubleQuoted << context;
  }
  if (!workdir.empty()) {
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(workdir, ec);
    if (!ec) workdir = absolute.lexically_normal().string();
    out << YAML::Key << "workdir" << YAML::Value << YAML::DoubleQuoted << workdir;
  }
  if (!f.after.empty()) {
    out << YAML::Key << "after" << YAML::Value << YAML::BeginSeq;
    for (const std::string& id : f.after) out << YAML::DoubleQuoted << NormalizeJobId(id);
    out << YAML::EndSeq;
  }
  if (!f.env.empty()) {
    out << YAML::Key << "env" << YAML::Value << YAML::BeginMap;
    for (const std::string& entry : f.env) {
      const size_t eq = entry.find('=');
      if (eq == 0 || entry.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("--env: expected NAME=VALUE or NAME, got '",
                                                       absl::CHexEscape(entry), "'"));
      }
      if (eq != std::string::npos) {
        out << YAML::Key << entry.substr(0, eq) << YAML::Value << YAML::DoubleQuoted
            << entry.substr(eq + 1);
        continue;
      }
      // NAME alone: docker run -e NAME, sbatch --export=NAME.
      const char* value = std::getenv(entry.c_str());
      if (value == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("--env ", absl::CHexEscape(entry), ": ", absl::CHexEscape(entry),
                         " is not set in yard's environment (NAME=VALUE gives a value)"));
      }
      out << YAML::Key << entry << YAML::Value << YAML::DoubleQuoted << value;
    }
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
  if (!out.good()) return absl::InvalidArgumentError(absl::StrCat("flags: ", out.GetLastError()));
  return std::string(out.c_str()) == "{}" ? std::string() : std::string(out.c_str());
}

bool IsTerminalState(v1::JobState state) {
  return state == v1::SUCCEEDED || state == v1::FAILED || state == v1::CANCELLED;
}

// `--array` text: indices ("0-15", "1,3,5-7"; at most 10000, each in 0..1000000) and, after
// '%', how many may run at once (0: any).
absl::StatusOr<std::pair<std::vector<int>, int>> ParseArray(const std::string& text) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--array: ", why, ", got '", text, "' (e.g. 0-15%4 or 1,3,5-7)"));
  };
  std::string indices = text;
  int max_running = 0;
  if (const size_t percent = text.find('%'); percent != std::string::npos) {
    indices = text.substr(0, percent);
    if (!absl::SimpleAtoi(text.substr(percent + 1), &max_running) || max_running < 1) {
      return bad("the number after % must be at least 1");
    }
  }
  std::vector<int> out;
  std::set<int> seen;
  for (absl::string_view part : absl::StrSplit(indices, ',')) {
    int lo = 0, hi = 0;
    const std::vector<std::string> ends = absl::StrSplit(part, '-');
    if (ends.size() > 2 || !absl::SimpleAtoi(ends[0], &lo) || !absl::SimpleAtoi(ends.back(), &hi) ||
        lo < 0 || hi < lo || hi > 1000000) {
      return bad("expected indices A or A-B, 0 <= A <= B <= 1000000");
    }
    for (int i = lo; i <= hi; ++i) {
      if (seen.insert(i).second) out.push_back(i);
      if (out.size() > 10000) return bad("at most 10000 tasks");
    }
  }
  return std::make_pair(out, max_running);
}

// An array: one job per index, each its task (ArraySpec), submitted in index order; prints the
// array's name, then each job's id.
int SubmitArray(const Globals& g, const ParsedSpec& parsed, const std::string& path,
                const std::string& array_text) {
  auto array = ParseArray(array_text);
  if (!array.ok()) return Fail(array.status());
  const auto& [indices, max_running] = *array;
  std::random_device random;
  const std::string id =
      absl::StrCat(parsed.spec.name().substr(0, 40), "-", absl::Hex(random(), absl::kZeroPad8));
  YardClient client(g.coordinator, g.Token(), g.tls);
  std::cout << "array " << id << "\n" << std::flush;
  for (size_t i = 0; i < indices.size(); ++i) {
    v1::JobSpec spec = parsed.spec;
    v1::ArraySpec* task = spec.mutable_array();
    task->set_id(id);
    task->set_index(indices[i]);
    task->set_count(static_cast<int>(indices.size()));
    task->set_max_running(max_running);
    auto job = client.Submit(spec);
    if (!job.ok()) {
      const absl::Status s =
          path.empty() ? job.status() : AnnotateWithLine(job.status(), parsed, path);
      return Fail(absl::Status(s.code(), absl::StrCat(s.message(), " (array ", id, ": ", i, " of ",
                                                      indices.size(), " tasks submitted)")));
    }
    std::cout << job->id() << "\n" << std::flush;
  }
  return 0;
}

int Submit(const Globals& g, const std::string& path, const SubmitFlags& flags) {
  if (path.empty() && flags.command.empty()) {
    return Fail(absl::InvalidArgumentError(
        "give a spec file (yard submit job.yaml) or a program after -- (yard submit --gpus 2 -- "
        "python3 train.py)"));
  }
  auto overrides = SubmitFlagsYaml(flags, path.empty());
  if (!overrides.ok()) return Fail(overrides.status());
  // The flags win over the file; what they set is checked as the file's fields are.
  ParsedSpec parsed;
  if (!path.empty()) {
    auto loaded = LoadValidJobSpecFile(path, *overrides, "yard submit");
    if (!loaded.ok()) return Fail(loaded.status());
    parsed = *std::move(loaded);
  } else {
    absl::Status s = OverrideJobSpecYaml(parsed, *overrides, "yard submit");
    if (s.ok()) {
      ApplyJobSpecDefaults(parsed.spec);
      s = ValidateJobSpec(parsed.spec);
    }
    if (!s.ok()) return Fail(s);
  }
  if (absl::Status s = FillFromCheckpoint(parsed, path); !s.ok()) return Fail(s);
  YardClient client(g.coordinator, g.Token(), g.tls);
  if (absl::Status s = UploadSpecContext(client, parsed.spec); !s.ok()) {
    return Fail(path.empty() ? s : AnnotateWithLine(s, parsed, path));
  }
  if (!flags.array.empty()) return SubmitArray(g, parsed, path, flags.array);
  auto job = client.Submit(parsed.spec);
  if (!job.ok()) {
    return Fail(path.empty() ? job.status() : AnnotateWithLine(job.status(), parsed, path));
  }
  if (g.json()) {
    std::cout << ToJson(*job);
  } else {
    std::cout << job->id() << "\n";
  }
  return 0;
}

int List(const Globals& g, const std::vector<std::string>& states, const std::string& owner,
         int limit, const std::string& array) {
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
  auto jobs = client.List(request, array.empty() ? limit : 0);
  if (!jobs.ok()) return Fail(jobs.status());
  if (!array.empty()) {  // an array's tasks, newest first
    v1::ListJobsResponse tasks;
    for (const v1::Job& j : jobs->jobs()) {
      if (j.spec().array().id() != array) continue;
      if (limit > 0 && tasks.jobs_size() == limit) break;
      *tasks.add_jobs() = j;
    }
    *jobs = std::move(tasks);
  }
  if (g.json()) {
    std::cout << ToJson(*jobs);
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& j : jobs->jobs()) {
    rows.push_back({j.id(),
                    j.spec().has_array()
                        ? absl::StrCat(j.spec().name(), "[", j.spec().array().index(), "]")
                        : j.spec().name(),
                    j.owner(), v1::JobState_Name(j.state()), absl::StrCat(j.spec().priority()),
                    Devices(j), Ago(j.submit_time_ms(), NowMs())});
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

int Cancel(const Globals& g, const std::vector<std::string>& ids, const std::string& reason,
           const std::string& array) {
  if (ids.empty() == array.empty()) {
    return Fail(absl::InvalidArgumentError("give jobs, or --array NAME (not both)"));
  }
  YardClient client(g.coordinator, g.Token(), g.tls);
  if (array.empty()) {
    if (ids.size() == 1) return PrintChangedJob(g, client.Cancel(NormalizeJobId(ids[0]), reason));
    // Each in turn, as scancel: one refused (ended, not yours) does not keep the others; with -o
    // json, one array of the cancelled jobs.
    int rc = 0;
    std::vector<std::string> cancelled;
    for (const std::string& id : ids) {
      absl::StatusOr<v1::Job> job = client.Cancel(NormalizeJobId(id), reason);
      if (!job.ok()) {
        rc = std::max(rc, Fail(job.status()));
      } else if (g.json()) {
        cancelled.push_back(ToJson(*job));
      } else {
        std::cout << job->id() << " " << v1::JobState_Name(job->state()) << "\n";
      }
    }
    if (g.json()) std::cout << "[" << absl::StrJoin(cancelled, ",") << "]\n";
    return rc;
  }
  // Every task of the caller's array that has not ended (an admin's list holds everyone's: an
  // array is its owner's); the waiting ones first, so that none starts in a slot a cancelled
  // running one frees.
  auto me = client.WhoAmI();
  if (!me.ok()) return Fail(me.status());
  v1::ListJobsRequest request;
  request.set_owner(me->user());
  auto jobs = client.List(request, 0);
  if (!jobs.ok()) return Fail(jobs.status());
  int cancelled = 0;
  for (const bool running : {false, true}) {
    for (int i = jobs->jobs_size() - 1; i >= 0; --i) {
      const v1::Job& j = jobs->jobs(i);
      if (j.spec().array().id() != array || IsTerminalState(j.state())) continue;
      if ((j.state() == v1::RUNNING || j.state() == v1::CHECKPOINTING) != running) continue;
      auto done = client.Cancel(j.id(), reason);
      if (!done.ok() && !absl::IsFailedPrecondition(done.status())) return Fail(done.status());
      if (done.ok()) {
        std::cout << done->id() << " " << v1::JobState_Name(done->state()) << "\n";
        ++cancelled;
      }
    }
  }
  if (cancelled == 0) {
    return Fail(absl::NotFoundError(absl::StrCat("array ", array, ": no task left to cancel")));
  }
  return 0;
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
                << (j.message().empty() ? "" : ": " + TerminalSafe(j.message())) << "\n";
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
  if (spec.command_size() > 0) {  // (its model is the program's: the estimate was an empty one)
    return Fail(absl::InvalidArgumentError(
        "command: a command job's model is its program's, which yard cannot see; estimate-memory "
        "estimates the built-in trainer's (a spec with model: and no command:)"));
  }
  if (world <= 0) world = spec.resources().slots();
  if (per_node <= 0) per_node = world;
  // The devices to judge against: --device-memory, else the largest device the coordinator's
  // ready nodes offer, else unknown.
  int64_t device_bytes = 0;
  std::string device_source = "unknown (no --device-memory and no coordinator reachable)";
  // Host memory: the most a ready worker offers its ranks, and its default per device.
  int64_t host_bytes = 0, host_per_device = 0;
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
        if (n.host().memory_bytes() > host_bytes) {
          host_bytes = n.host().memory_bytes();
          host_per_device = n.host().memory_per_device();
        }
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
                          {"host_memory_per_rank_bytes", spec.resources().memory_bytes()},
                          {"node_host_memory_bytes", host_bytes},
                          {"node_host_memory_per_device_bytes", host_per_device},
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
            << "\n";
  // Host memory beside it: what each rank asks for (resources.memory; a rank asking none is
  // charged its node's share per device), and the most a ready worker offers.
  std::cout << "host memory: "
            << (spec.resources().memory_bytes() > 0
                    ? absl::StrCat(HumanBytes(spec.resources().memory_bytes()),
                                   " per rank (resources.memory)")
                    : std::string("the node's share per device (no resources.memory)"))
            << (host_bytes > 0
                    ? absl::StrCat("; the largest worker offers ", HumanBytes(host_bytes), " (",
                                   HumanBytes(host_per_device), " per device)")
                    : std::string(""))
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
    std::string state = n.state() != v1::NODE_READY ? "LOST"
                        : n.connected()             ? "READY"
                                                    : "READY (reconnecting)";
    // An admin's hold: cordoned; draining until it runs no ranks, then drained.
    if (n.cordoned()) {
      absl::StrAppend(&state, ",",
                      !n.draining()                   ? "CORDONED"
                      : n.allocated_devices().empty() ? "DRAINED"
                                                      : "DRAINING");
    }
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
    // Each faulty GPU and why (a critical XID, uncorrected ECC errors, lost); "ok" otherwise.
    std::vector<std::string> faults;
    for (const v1::Device& d : n.devices()) {
      if (d.has_sample() && !d.sample().fault().empty()) {
        faults.push_back(absl::StrCat("GPU ", d.index(), ": ", d.sample().fault()));
      }
    }
    const std::string health = !faults.empty() ? absl::StrJoin(faults, "; ")
                               : sampled > 0   ? "ok"
                                               : "-";
    // Workers: the host's CPUs and memory held by running ranks / offered to them (where the
    // worker counts them; its physical memory otherwise), and how ranks are held: "v1", "v2",
    // or "none" (unconfined). Parameter servers: shard memory held by offload jobs / offered.
    const v1::HostResources& host = n.host();
    const std::string cpus =
        ps || host.cpus() <= 0 ? "-" : absl::StrFormat("%g/%g", n.allocated_cpus(), host.cpus());
    std::string memory = HumanBytes(n.memory_bytes());
    if (ps) {
      memory = absl::StrCat(HumanBytes(n.reserved_bytes()), "/", HumanBytes(n.memory_bytes()));
    } else if (host.memory_bytes() > 0) {
      memory = absl::StrCat(HumanBytes(n.allocated_memory_bytes()), "/",
                            HumanBytes(host.memory_bytes()));
    }
    std::string cgroups = "-";
    if (absl::StartsWith(host.cgroups(), "cgroup v")) {
      cgroups = host.cgroups().substr(7, 2);
    } else if (!host.cgroups().empty()) {
      cgroups = "none";
    }
    rows.push_back(
        {n.id(), ps ? "ps" : "worker", state,
         ps ? "-" : absl::StrCat(n.allocated_devices_size(), "/", n.devices_size(), " ", kind),
         cpus, memory, cgroups, gpus, health, n.address().empty() ? "-" : n.address(),
         Ago(n.last_heartbeat_ms(), NowMs())});
  }
  std::cout << FormatTable(
      {"NODE", "ROLE", "STATE", "DEVICES(USED/ALL)", "CPUS(USED/ALL)", "MEMORY(USED/ALL)",
       "CGROUPS", "GPU UTIL MEM TEMP", "GPU HEALTH", "ADDRESS", "HEARTBEAT"},
      rows);
  return 0;
}

int Signal(const Globals& g, const std::string& id, const std::string& signal) {
  if (CanonicalSignalName(signal).empty()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("signal: '", signal, "' is not one of ", SignalNamesText())));
  }
  YardClient client(g.coordinator, g.Token(), g.tls);
  return PrintChangedJob(g, client.Signal(NormalizeJobId(id), signal));
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

int Logs(const Globals& g, const std::string& id, bool follow, int tail, bool raw) {
  YardClient client(g.coordinator, g.Token(), g.tls);
  absl::Status s = client.Logs(NormalizeJobId(id), follow, tail, [&](const v1::LogLine& l) {
    if (g.json()) {
      std::cout
          << nlohmann::json{{"attempt", l.attempt()}, {"rank", l.rank()}, {"text", l.text()}}.dump()
          << "\n";
    } else {
      std::cout << "[rank " << l.rank() << "] " << (raw ? l.text() : TerminalSafe(l.text()))
                << "\n";
    }
    std::cout.flush();
  });
  return s.ok() ? 0 : Fail(s);
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
  std::deque<double> recent;          // seconds of the last steps, for the ETA
  bool pipelined = false;             // a BUBBLE column
  std::vector<std::string> extras;    // a program's own metrics (the SDK's), one entry per row
  std::vector<std::string> evals;     // train.eval_every: "loss (perplexity)" or "", per row
  std::vector<int64_t> device_peaks;  // peak GPU memory, per row (0: on CPU)
  std::vector<double> mfus;           // model FLOPs utilisation, per row (0: unknown)
  absl::Status s = client.Metrics(NormalizeJobId(id), follow, [&](const v1::StepReport& r) {
    if (g.json()) {
      series.push_back({{"attempt", r.attempt()},
                        {"step", r.step()},
                        {"total_steps", r.total_steps()},
                        {"loss", r.loss()},
                        {"lr", r.lr()},
                        {"tokens_per_second", r.tokens_per_second()},
                        {"mfu", r.mfu()},
                        {"step_seconds", r.step_seconds()},
                        {"grad_norm", r.grad_norm()},
                        {"resident_bytes", r.resident_bytes()},
                        {"model_state_peak_bytes", r.model_state_peak_bytes()},
                        {"comm_bytes", r.comm_bytes()},
                        {"device_peak_bytes", r.device_peak_bytes()},
                        {"cpu_seconds", r.cpu_seconds()},
                        {"time_ms", r.time_ms()}});
      if (r.has_eval_loss()) {
        series.back()["eval_loss"] = r.eval_loss();
        series.back()["eval_perplexity"] = std::exp(r.eval_loss());
      }
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
                      HumanBytes(r.resident_bytes()), absl::StrFormat("%.1f", r.cpu_seconds()),
                      HumanBytes(r.model_state_peak_bytes())});
      std::vector<std::string> own;
      for (const auto& [name, value] : r.metrics()) {
        own.push_back(absl::StrFormat("%s=%.4g", name, value));
      }
      std::sort(own.begin(), own.end());
      extras.push_back(absl::StrJoin(own, " "));
      device_peaks.push_back(r.device_peak_bytes());
      mfus.push_back(r.mfu());
      evals.push_back(r.has_eval_loss()
                          ? absl::StrFormat("%.4f (%.2f)", r.eval_loss(), std::exp(r.eval_loss()))
                          : "");
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
    std::vector<std::string> header = {"STEP",    "LOSS", "LR",    "GRAD_NORM",  "TOK/S",
                                       "STEP_MS", "RSS",  "CPU_S", "MODEL_STATE"};
    // Pipeline parallelism: the measured bubble (the stages' mean idle share), its theory, and
    // each stage's.
    if (pipelined) header.push_back("BUBBLE (THEORY) [PER STAGE]");
    for (auto& row : rows) row.resize(header.size(), "-");
    // GPUs: the model FLOPs utilisation, beside the tokens/s it comes from.
    if (std::any_of(mfus.begin(), mfus.end(), [](double m) { return m > 0; })) {
      header.insert(header.begin() + 5, "MFU");
      for (size_t i = 0; i < rows.size(); ++i) {
        rows[i].insert(rows[i].begin() + 5,
                       mfus[i] > 0 ? absl::StrFormat("%.1f%%", 100 * mfus[i]) : "-");
      }
    }
    // GPUs: the peak memory each step's report says rank 0 allocated so far.
    if (std::any_of(device_peaks.begin(), device_peaks.end(), [](int64_t b) { return b > 0; })) {
      header.push_back("GPU_PEAK");
      for (size_t i = 0; i < rows.size(); ++i) {
        rows[i].push_back(device_peaks[i] > 0 ? HumanBytes(device_peaks[i]) : "-");
      }
    }
    // Evaluations (train.eval_every): the held-out loss and its perplexity, on their steps.
    if (std::any_of(evals.begin(), evals.end(), [](const auto& e) { return !e.empty(); })) {
      header.push_back("EVAL_LOSS (PPL)");
      for (size_t i = 0; i < rows.size(); ++i) {
        rows[i].push_back(evals[i].empty() ? "-" : evals[i]);
      }
    }
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

}  // namespace

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

  auto& sf = a.submit;
  auto* submit = app.add_subcommand(
      "submit",
      "submit a job; prints its id. From a YAML spec, which trains a built-in model (model:, "
      "data:, train:, parallel:) or runs your own program on each rank (command: [python3, "
      "train.py], workdir: /abs/path, env: {NAME: value}) with torchrun's environment (RANK, "
      "WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...); or without one, a program after --: `yard "
      "submit --gpus 2 -- python3 train.py --lr 3e-4` (one slot unless given, named after the "
      "script; this folder is uploaded when the program is a script here, else the ranks run in "
      "it, which every worker must then see). The flags below set "
      "those fields of a spec file too, over what it says");
  submit->add_option("spec", spec_path, "job spec (YAML); optional with a program after --");
  submit->add_option("--gpus,--slots", sf.slots, "resources.slots: ranks (a GPU each on GPUs)")
      ->check(Positive());
  submit->add_option("--cpus", sf.cpus, "resources.cpus: CPUs per rank (1.5: one and a half)")
      ->check(Positive());
  submit->add_option("--memory", sf.memory, "resources.memory: memory per rank, e.g. 16GiB");
  submit
      ->add_option("--nodes,--nnodes", sf.nodes,
                   "resources.nodes: on exactly this many nodes, --gpus / N devices each "
                   "(--gpus defaults to N): torchrun's --nnodes")
      ->check(Positive());
  submit
      ->add_option("--ranks-per-node,--nproc-per-node", sf.ranks_per_node,
                   "resources.ranks_per_node: ranks on each node, sharing its devices (a "
                   "multiple of them; default one per device): torchrun's --nproc-per-node")
      ->check(Positive());
  submit->add_option("--name", sf.name, "name (default: the script's or the program's)");
  submit->add_option("--description", sf.description, "description: free text");
  // One value an --env or --after (CLI11 lets a list take every word after it, the spec file's
  // path included: `yard submit --env A=1 job.yaml`, as sbatch users write it).
  submit
      ->add_option("--env", sf.env,
                   "env: NAME=VALUE for every rank (repeatable); NAME alone: its value in yard's "
                   "environment (for a secret, which argv would show to every local user)")
      ->allow_extra_args(false);
  submit->add_option("--workdir", sf.workdir,
                     "workdir: the ranks' folder (default for a program after --: this one)");
  submit->add_option("--context", sf.context,
                     "context: a folder to upload (its .gitignore and .yardignore honoured, at "
                     "most 64 MiB), unpacked on each node as the ranks' folder (default for a "
                     "program after -- that names a script here: this folder)");
  submit->add_option("--priority", sf.priority, "priority: 1..100, higher first");
  submit->add_option("--max-restarts", sf.max_restarts, "max_restarts: attempts after a failure")
      ->check(NonNegative());
  submit
      ->add_option("--after", sf.after,
                   "after: start once these jobs (yours) have succeeded; fail at once if one "
                   "fails or is cancelled (JOB[,JOB]; sbatch --dependency=afterok)")
      ->delimiter(',')
      ->allow_extra_args(false);
  submit->add_option("--array", sf.array,
                     "a job array: one job per index, TRAINYARD_ARRAY_INDEX in its environment, "
                     "at most K running after %: 0-15%4, 1,3,5-7 (sbatch --array)");
  submit->callback([&] { rc = Submit(g, spec_path, sf); });

  auto* ls = app.add_subcommand("ls", "list jobs, newest first");
  ls->add_option("--state", states, "only jobs in these states (repeatable)");
  ls->add_option("--owner", owner, "only jobs of this user");
  ls->add_option("--limit", limit, "at most this many jobs (0 = all)")->capture_default_str();
  ls->add_option("--array", a.array, "only the tasks of this job array (its name)");
  ls->callback([&] { rc = List(g, states, owner, limit, a.array); });

  auto* describe = app.add_subcommand("describe", "show one job in full");
  describe->add_option("job", job_id, "job id (job-7 or 7)")->required();
  describe->callback([&] { rc = Describe(g, job_id); });

  auto* cancel =
      app.add_subcommand("cancel", "cancel a waiting or running job, or an array's tasks");
  auto& job_ids = a.job_ids;
  cancel->add_option("jobs", job_ids, "job ids (7 or job-7), each cancelled in turn");
  cancel->add_option("--array", a.array, "every task of this job array that has not ended");
  cancel->add_option("--reason", reason, "recorded with the job");
  cancel->callback([&] { rc = Cancel(g, job_ids, reason, a.array); });

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
  auto& raw = a.raw;
  logs->add_flag("--raw", raw,
                 "print the job's control characters as they are (terminal escapes included); "
                 "by default they are shown as escapes (\\x1b, \\r)");
  logs->callback([&] { rc = Logs(g, job_id, follow, tail, raw); });

  auto* metrics = app.add_subcommand(
      "metrics", "a job's training metrics: a table, or with -f a live progress bar and ETA");
  metrics->add_option("job", job_id, "job id")->required();
  metrics->add_flag("-f,--follow", follow, "keep updating until the job ends");
  metrics->callback([&] { rc = Metrics(g, job_id, follow); });

  auto* checkpoint = app.add_subcommand("checkpoint", "ask a running job to write a checkpoint");
  checkpoint->add_option("job", job_id, "job id")->required();
  checkpoint->callback([&] { rc = Checkpoint(g, job_id); });

  auto& signal = a.signal;
  auto* signal_verb = app.add_subcommand(
      "signal",
      absl::StrCat("send a signal to every rank of a running job, each rank's whole process tree "
                   "(scancel --signal); the job's owner and admins. Signals: ",
                   SignalNamesText()));
  signal_verb->add_option("job", job_id, "job id")->required();
  signal_verb->add_option("signal", signal, "USR1, SIGUSR1, ...")->required();
  signal_verb->callback([&] { rc = Signal(g, job_id, signal); });

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
  estimate->add_option("--world-size", world, "ranks (default: the spec's resources.slots)");
  estimate->add_option("--ranks-per-node", per_node, "ranks sharing a node (default: all)");
  estimate->add_option("--device-memory", device_memory,
                       "memory of one device, e.g. 80GiB (default: ask the coordinator)");
  estimate->callback(
      [&] { rc = EstimateMemoryVerb(g, spec_path, world, per_node, device_memory); });

  auto* nodes = app.add_subcommand("nodes", "list worker nodes and their devices");
  nodes->callback([&] { rc = Nodes(g); });
}

}  // namespace trainyard::client
