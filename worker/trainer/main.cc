// trainyard-trainer: one training rank. The worker daemon starts one per assigned device with the
// job spec (binary trainyard.v1.JobSpec; a .yaml/.yml file is accepted for manual runs), the
// rank's place in the job and the coordinator's address. Exit codes: 0 done (or stopped
// gracefully), 2 bad spec or data, 1 anything else; the reason is one line on stderr and stdout.
// Control side: flags and the protobuf spec are read here; the training runs behind trainer.h,
// whose plain header is all this file sees of the LibTorch side.
#include <malloc.h>

#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include <CLI/CLI.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cli_checks.h"
#include "common/spec.h"
#include "common/version.h"
#include "rpc/ps/tcp_congestion.h"
#include "worker/trainer/control/stop_signal.h"
#include "worker/trainer/trainer.h"

namespace trainyard::trainer {
namespace {

absl::StatusOr<v1::JobSpec> LoadSpec(const std::string& path) {
  v1::JobSpec spec;
  if (absl::EndsWith(path, ".yaml") || absl::EndsWith(path, ".yml")) {
    auto parsed = LoadValidJobSpecFile(path);
    if (!parsed.ok()) return parsed.status();
    return parsed->spec;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--spec: cannot read '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (!spec.ParseFromString(buffer.str())) {
    return absl::InvalidArgumentError(
        absl::StrCat("--spec: '", path, "' is not a binary trainyard.v1.JobSpec"));
  }
  // Given by hand (or by a test), a binary spec gets the coordinator's defaults and checks, as a
  // YAML one gets yard's. Only --context's spec, which the worker writes from the coordinator's
  // assignment (defaults filled and validated there, once), is taken as it is.
  ApplyJobSpecDefaults(spec);
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--spec: '", path, "': ", s.message()));
  }
  return spec;
}

// Without --context, the flags that make up a rank's context are required.
absl::Status CheckContextFlags(const CLI::App& app) {
  for (const char* flag : {"--spec", "--job-id", "--attempt", "--rank", "--world-size",
                           "--coordinator", "--checkpoint-dir", "--threads"}) {
    if (app.count(flag) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": required (or --context FILE)"));
    }
  }
  return absl::OkStatus();
}

// Fills `o` from the RankContext in `path` (written by the worker; its spec is the
// coordinator's, defaults filled and validated) and returns the spec. The context flags may not
// be given beside it: one source of truth.
absl::StatusOr<v1::JobSpec> ApplyContext(const std::string& path, const CLI::App& app,
                                         TrainerOptions& o) {
  for (const char* flag :
       {"--spec", "--job-id", "--attempt", "--rank", "--world-size", "--coordinator",
        "--checkpoint-dir", "--threads", "--ps", "--local-world-size", "--device"}) {
    if (app.count(flag) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": not with --context (the context holds it)"));
    }
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--context: cannot read '", path, "'"));
  v1::RankContext c;
  if (!c.ParseFromIstream(&in)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--context: '", path, "' is not a binary trainyard.v1.RankContext"));
  }
  if (c.job_id().empty()) return absl::InvalidArgumentError("--context: job_id: required");
  if (c.world_size() < 1 || c.rank() < 0 || c.threads() < 1 || c.attempt() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--context: rank ", c.rank(), ", world_size ",
                                                   c.world_size(), ", attempt ", c.attempt(),
                                                   ", threads ", c.threads(), ": out of range"));
  }
  if (c.device() != "cpu" && c.device() != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--context: device: '", c.device(), "', expected cpu or cuda"));
  }
  o.job_id = c.job_id();
  o.attempt = c.attempt();
  o.rank = c.rank();
  o.world_size = c.world_size();
  o.local_world_size = c.local_world_size();
  o.device = c.device();
  o.coordinator = c.coordinator_address();
  o.checkpoint_dir = c.checkpoint_dir();
  o.threads = c.threads();
  // Gloo listens where the job's ranks on other nodes reach this one; ranks of a job on one node
  // keep loopback (and shared memory). --gloo-host, given, wins.
  if (app.count("--gloo-host") == 0 && !c.node_address().empty() && c.local_world_size() > 0 &&
      c.local_world_size() < c.world_size()) {
    o.gloo_hostname = c.node_address();
  }
  std::vector<std::string> ranges;
  for (const v1::PsRange& r : c.ps_ranges()) {
    ranges.push_back(absl::StrCat(r.address(), "=", r.begin(), ":", r.end()));
  }
  o.ps_ranges = absl::StrJoin(ranges, ",");
  return std::move(*c.mutable_spec());
}

int Fail(const absl::Status& s) {
  std::string message(s.message());
  std::replace(message.begin(), message.end(), '\n', ' ');
  const std::string line = absl::StrCat("trainyard-trainer: error: ", message);
  std::cout << line << std::endl;
  std::cerr << line << std::endl;
  const bool bad_input =
      s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kNotFound;
  return bad_input ? 2 : 1;
}

// Allocator settings, before any other thread allocates (glibc reads them once).
void SetUpAllocator(int argc, char** argv) {
  // Multi-MiB gradient and parameter messages: keep freed buffers in the heap instead of handing
  // them back to the kernel, or every message touches fresh pages (page faults dominated the
  // push/pull time in bench/ps_transfer_bench: 2-5x slower).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // An offload rank (--ps) receives pulled parameters on gRPC's threads: one arena, or glibc unmaps
  // each thread arena's heap as soon as it empties and every message faults in fresh pages (see
  // server/ps/main.cc). Set before any other thread allocates (glibc reads it once); other
  // strategies keep glibc's per-thread arenas.
  for (int i = 1; i < argc; ++i) {
    if (absl::StartsWith(argv[i], "--ps=") || std::string(argv[i]) == "--ps") {
      mallopt(M_ARENA_MAX, 1);
      break;
    }
  }
}

// The modes without a job (--supported-devices, --consolidate-checkpoint, --export-hf): their
// exit code, or nothing when argv asks for a rank.
std::optional<int> RunToolMode(int argc, char** argv) {
  // What the worker asks before offering GPUs: the devices this trainer can train on.
  if (argc == 2 && std::string(argv[1]) == "--supported-devices") {
    std::cout << SupportedDevices() << std::endl;
    return 0;
  }
  // A tool mode without a job: a sharded FSDP checkpoint as a DDP one.
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) != "--consolidate-checkpoint") continue;
    CLI::App tool{
        "trainyard-trainer --consolidate-checkpoint: a sharded (fsdp) checkpoint as a "
        "consolidated (ddp) one"};
    std::string sharded, out;
    tool.add_option("--consolidate-checkpoint", sharded, "the sharded checkpoint: DIR/step-N")
        ->required();
    tool.add_option("--out", out, "checkpoint directory to write step-N and latest into")
        ->required();
    CLI11_PARSE(tool, argc, argv);
    absl::Status s = RunConsolidate(sharded, out);
    return s.ok() ? 0 : Fail(s);
  }

  // A tool mode without a job: a job's latest checkpoint as a Hugging Face model directory.
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) != "--export-hf") continue;
    CLI::App tool{
        "trainyard-trainer --export-hf: a llama job's latest checkpoint as a Hugging Face model "
        "directory (config.json, model.safetensors), or a LoRA job's adapter in PEFT's layout "
        "(adapter_config.json, adapter_model.safetensors)"};
    std::string checkpoint_dir, out, spec_path;
    bool merge_lora = false;
    tool.add_option("--export-hf", checkpoint_dir, "the job's checkpoint directory (its latest)")
        ->required();
    tool.add_option("--spec", spec_path, "the job's spec (.yaml or binary JobSpec)")->required();
    tool.add_option("--out", out, "the model directory to write")->required();
    tool.add_flag("--merge-lora", merge_lora,
                  "a LoRA job: the whole model with the adapters merged in, not the adapter");
    CLI11_PARSE(tool, argc, argv);
    auto spec = LoadSpec(spec_path);
    if (!spec.ok()) return Fail(spec.status());
    absl::Status s = RunExportHf(ToJobConfig(*spec), checkpoint_dir, out, merge_lora);
    return s.ok() ? 0 : Fail(s);
  }

  return std::nullopt;
}

// A hidden option (group ""; tests, benchmarks, developers), settable from `env` when one is
// given. CLI11 leaves a hidden option's name out of its validation errors ("Value -1 not in
// range ..."), so its check is wrapped to name the option; the name is written once, here.
template <typename T>
CLI::Option* AddHidden(CLI::App& app, const std::string& flag, T& value, const std::string& help,
                       std::optional<CLI::Validator> check = std::nullopt,
                       const std::string& env = "") {
  CLI::Option* option = app.add_option(flag, value, help)->group("");
  if (check.has_value()) {
    std::string description = check->get_description();
    option->check(CLI::Validator(
        [flag, check = *std::move(check)](std::string& text) {
          std::string error = check(text);
          return error.empty() ? error : flag + ": " + error;
        },
        std::move(description)));
  }
  if (!env.empty()) option->envname(env);
  return option;
}

// app.exit(e), except that a hidden option's error, which CLI11 prints with an empty name
// (": --loss-chunk-mib: ..."; AddHidden named it), loses the empty name's ": ".
int ParseFailed(CLI::App& app, const CLI::ParseError& e) {
  const std::string what = e.what();
  if (e.get_exit_code() != 0 && what.rfind(": ", 0) == 0) {
    std::cerr << what.substr(2) << "\nRun with --help for more information." << std::endl;
    return e.get_exit_code();
  }
  return app.exit(e);
}

// The rank's flags into `o` (and the two files it may be given as).
void AddRankFlags(CLI::App& app, TrainerOptions& o, std::string& spec_path,
                  std::string& context_path) {
  app.add_option("--context", context_path,
                 "the rank's context: a binary trainyard.v1.RankContext (the spec, job, attempt, "
                 "rank, world, device, coordinator, checkpoint folder, threads, parameter "
                 "servers), as a worker writes it; else the flags below");
  // A rank run by hand (or a test) gives its context as flags instead.
  app.add_option("--spec", spec_path, "job spec: binary trainyard.v1.JobSpec, or .yaml/.yml");
  app.add_option("--job-id", o.job_id, "job id (rendezvous scope)");
  app.add_option("--attempt", o.attempt, "job attempt (rendezvous scope)");
  app.add_option("--rank", o.rank, "this rank")->check(NonNegative());
  app.add_option("--world-size", o.world_size, "number of ranks")->check(Positive());
  app.add_option("--coordinator", o.coordinator, "coordinator HOST:PORT");
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "checkpoint directory shared by all ranks");
  app.add_option("--threads", o.threads, "torch intra-op threads")->check(Positive());
  app.add_option("--metrics-file", o.metrics_file, "rank 0 appends a JSON line per step");
  app.add_option("--dump-params", o.dump_params, "write all parameters here at the end");
  app.add_option("--stop-after-steps", o.stop_after_steps,
                 "checkpoint and exit 0 after this many steps of this run");
  app.add_option("--gloo-host", o.gloo_hostname,
                 "address of this host that Gloo listens on (default 127.0.0.1; with --context, "
                 "the worker's node address when the job has ranks on other nodes)");
  app.add_option("--ps", o.ps_ranges,
                 "offload: parameter-server ranges ADDRESS=BEGIN:END,... (from the coordinator)");
  app.add_option("--ps-rpc-timeout", o.ps_rpc_timeout_s,
                 "offload: seconds one call to a parameter server may take (a push, an update and "
                 "pull) before the rank fails naming the server (default 120)")
      ->check(Positive());
  app.add_option("--ps-tcp-congestion", o.ps_tcp_congestion,
                 "offload: TCP congestion control of the connections to parameter servers, e.g. "
                 "reno or cubic (default: the host's; see trainyard-ps --tcp-congestion)")
      ->envname(trainyard::ps::kTcpCongestionEnv);
  app.add_option("--ps-transport", o.ps_transport,
                 "offload: how gradients and parameters travel: tcp (each parameter server's "
                 "TCP data plane where it has one, else gRPC) or grpc (always gRPC)")
      ->check(CLI::IsMember({"tcp", "grpc"}))
      ->envname("TRAINYARD_PS_TRANSPORT")
      ->capture_default_str();
  app.add_option("--local-world-size", o.local_world_size,
                 "ranks of this job on this node (consecutive ranks share a node; default: all)")
      ->check(NonNegative());
  app.add_option("--device", o.device, "the device the worker gave this rank: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  AddHidden(app, "--inject-overflow-at-step", o.inject_overflow_step,
            "tests: under fp16, make this step's gradients overflow on rank 0",
            CLI::Range(int64_t{0}, std::numeric_limits<int64_t>::max()));
  AddHidden(app, "--fused-loss", o.fused_loss,
            "auto: on a GPU the LM head and its cross-entropy run fused, in chunks of rows; "
            "off: the plain head (benchmarks)",
            CLI::IsMember({"auto", "off"}), "TRAINYARD_FUSED_LOSS");
  AddHidden(app, "--fused-norm", o.fused_norm,
            "auto: on a GPU the GPT block's LayerNorms (the Llama layer's RMSNorms) run fused "
            "with the residual add and the cast; off: torch's (benchmarks)",
            CLI::IsMember({"auto", "off"}), "TRAINYARD_FUSED_NORM");
  AddHidden(app, "--fused-linear", o.fused_linear,
            "auto: on a GPU under autocast a dense layer's weight and bias gradients come from "
            "one cuBLASLt product in fp32; off: autocast's linear (benchmarks)",
            CLI::IsMember({"auto", "off"}), "TRAINYARD_FUSED_LINEAR");
  AddHidden(app, "--gemm-tune", o.gemm_tune,
            "auto: on a GPU each cuBLASLt product of the dense layers and the fused head takes "
            "the fastest of the heuristic's first algorithms, timed at its first call; off: the "
            "heuristic's first, the same in every run",
            CLI::IsMember({"auto", "off"}), "TRAINYARD_GEMM_TUNE");
  AddHidden(app, "--adamw-kernel", o.adamw_kernel,
            "auto: on a GPU AdamW's update is trainyard's multi-tensor kernel (CUDA build); "
            "torch: LibTorch's fused AdamW (benchmarks)",
            CLI::IsMember({"auto", "torch"}), "TRAINYARD_ADAMW_KERNEL");
  AddHidden(app, "--loss-chunk-mib", o.loss_chunk_mib,
            "the fused head's logits are computed this many MiB at a time (0: 256); larger "
            "chunks, larger products and a higher peak (benchmarks)",
            CLI::Range(int64_t{0}, int64_t{1} << 16), "TRAINYARD_LOSS_CHUNK_MIB");
  AddHidden(app, "--cuda-graphs", o.cuda_graphs,
            "auto: on a GPU the step is captured as a CUDA graph after a few eager steps and "
            "replayed, where its layout allows (the log says); off: eager (benchmarks)",
            CLI::IsMember({"auto", "off"}), "TRAINYARD_CUDA_GRAPHS");
  AddHidden(app, "--peak-tflops", o.peak_tflops,
            "the GPU's dense peak TFLOP/s in the training's precision, for the MFU of each "
            "step (default: a table of known GPUs)",
            NonNegative(), "TRAINYARD_PEAK_TFLOPS");
  AddHidden(app, "--profile-steps", o.profile_steps,
            "FIRST:COUNT: rank 0 traces these steps (operators, and kernels on a GPU) into "
            "--profile-out as a Chrome trace (benchmarks, developers)");
  AddHidden(app, "--profile-out", o.profile_out, "where --profile-steps' trace goes");
}

int Main(int argc, char** argv) {
  HoldStopSignal();  // first, before threads start: graceful stop (finish the step, checkpoint)
  const std::string blas = DescribeCompute();
  SetUpAllocator(argc, argv);
  if (const std::optional<int> code = RunToolMode(argc, argv); code.has_value()) return *code;

  CLI::App app{"trainyard-trainer: one rank of a trainyard training job (LibTorch, DDP over Gloo)"};
  app.set_version_flag("--version", absl::StrCat("trainyard-trainer ", kVersion, "\n", blas));
  // The tool modes parse their own flags (each one's --help lists them).
  app.footer(
      "Tool modes (no job):\n"
      "  trainyard-trainer --export-hf CHECKPOINT_DIR --spec SPEC --out DIR [--merge-lora]\n"
      "      a job's latest checkpoint as a Hugging Face model directory (a LoRA job: its adapter\n"
      "      in PEFT's layout, or with --merge-lora the model with the adapters merged in)\n"
      "  trainyard-trainer --consolidate-checkpoint DIR/step-N --out DIR\n"
      "      a sharded (fsdp) checkpoint as a consolidated (ddp) one\n"
      "  trainyard-trainer --supported-devices\n"
      "      the devices this build trains on (cpu, cuda)");
  std::string spec_path, context_path;
  TrainerOptions o;
  AddRankFlags(app, o, spec_path, context_path);
  DecimalIntegers(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return ParseFailed(app, e);
  }
  absl::StatusOr<v1::JobSpec> spec;
  if (!context_path.empty()) {
    spec = ApplyContext(context_path, app, o);
  } else if (absl::Status s = CheckContextFlags(app); !s.ok()) {
    return Fail(s);
  } else {
    spec = LoadSpec(spec_path);
  }
  if (!spec.ok()) return Fail(spec.status());
  if (o.rank >= o.world_size) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--rank ", o.rank, " must be below --world-size ", o.world_size)));
  }
  o.job = ToJobConfig(*spec);
  std::cout << blas << std::endl;
  absl::Status s = RunTrainer(o);
  if (!s.ok()) return Fail(s);
  return 0;
}

}  // namespace
}  // namespace trainyard::trainer

int main(int argc, char** argv) { return trainyard::trainer::Main(argc, argv); }
