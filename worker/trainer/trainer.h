// The training rank (LibTorch side; no gRPC or protobuf in this header or its .cc, which reach
// the coordinator through reporter.h and rendezvous_client.h): RunTrainer is everything
// `trainyard-trainer` does after parsing its flags, done by a Trainer (trainer.cc): Setup checks
// the layout once (ParallelDims), loads the data (failing fast on bad input, before any
// rendezvous), joins the job attempt's process groups through the coordinator's rendezvous,
// builds the model and its strategy and resumes from DIR/latest; then each Step runs forward and
// backward, the update, the ranks' agreement on the loss and on stopping, rank 0's report to the
// coordinator, and a checkpoint when the spec, the coordinator, SIGTERM or --stop-after-steps
// ask. Strategies: ddp (and fsdp NO_SHARD, which behaves as DDP), fsdp (FsdpModel, sharded
// checkpoints), offload (OffloadOptimizer, parameter servers), pipeline and tensor parallelism
// (PipelineStage).
//
// Called once, from main's thread. SIGTERM waits as pending on that thread (HoldStopSignal,
// control/stop_signal.h, which main calls first); the loop takes it between steps, so the ranks
// agree on it, finish the step, checkpoint and exit 0.
#ifndef TRAINYARD_WORKER_TRAINER_TRAINER_H_
#define TRAINYARD_WORKER_TRAINER_TRAINER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "common/job_config.h"

namespace trainyard::trainer {

struct TrainerOptions {
  JobConfig job;  // from a spec with defaults applied and validated (common/spec.h ToJobConfig)
  std::string job_id;
  int attempt = 1;
  int rank = 0;
  int world_size = 1;
  std::string coordinator;       // host:port of the coordinator
  std::string checkpoint_dir;    // shared by all ranks
  int threads = 1;               // torch intra-op threads
  std::string metrics_file;      // rank 0 appends one JSON line per step; empty = none
  std::string dump_params;       // parameters written here at the end; empty = none
  int64_t stop_after_steps = 0;  // > 0: checkpoint and exit 0 after this many steps of this run
  std::string gloo_hostname = "127.0.0.1";  // address the Gloo transport listens on
  std::string ps_ranges;  // offload: "ADDRESS=BEGIN:END,..." (parameter-server ranges)
  // Offload: deadline of each call to a parameter server; below the collectives' 5-minute
  // timeout, so that a hung server fails its ranks by name before their peers time out.
  double ps_rpc_timeout_s = 120;
  std::string ps_tcp_congestion;     // empty: the host's
  std::string ps_transport = "tcp";  // OffloadConfig::transport
  // Ranks of the job on this rank's node (consecutive ranks share a node); 0 = all of them.
  // HYBRID_SHARD shards within a node and replicates across nodes.
  int local_world_size = 0;
  // "cpu" or "cuda" (the worker's --device: its own GPU, seen as cuda:0).
  std::string device = "cpu";
  // Tests: under fp16, rank 0 scales this step's loss (1-based) by inf, an overflow the loss
  // scaler must skip. 0: none.
  int64_t inject_overflow_step = 0;
  // "auto": the head and its cross-entropy fused on CUDA (model.h FusedLoss); "off": the plain
  // head everywhere (benchmarks measure what the fusion buys).
  std::string fused_loss = "auto";
  // "auto": on a GPU the GPT block's LayerNorms and the Llama layer's RMSNorms run fused with the
  // residual add and the cast (ModelOptions::fused_norms); "off": torch's (benchmarks).
  std::string fused_norm = "auto";
  // "auto": on a GPU under autocast the dense layers' weight and bias gradients come from one
  // cuBLASLt product (kernels/dense.h); "off": autocast's linear (benchmarks).
  std::string fused_linear = "auto";
  // "auto": AdamW's update of CUDA parameters is the project's multi-tensor kernel where the
  // build has it (kernels/adamw_cuda.h); "torch": LibTorch's _fused_adamw_ (benchmarks).
  std::string adamw_kernel = "auto";
  // "auto": each cuBLASLt product takes the fastest of the heuristic's first algorithms, timed at
  // its first call (kernels/dense.h, SetGemmTuning); "off": the heuristic's first, the same in
  // every run.
  std::string gemm_tune = "auto";
  // The fused head's chunk of logits in MiB (kernels/fused_loss.h; 0: its default, 256).
  int64_t loss_chunk_mib = 0;
  // "auto": on a GPU the step is captured as a CUDA graph and replayed where its layout allows
  // (runtime/step_graph.h; the rank's log says whether, and why not); "off": eager (benchmarks).
  std::string cuda_graphs = "auto";
  // A GPU's peak TFLOP/s for the steps' MFU, in place of common/mfu.h's table (0: the table's).
  double peak_tflops = 0;
  // Rank 0 traces steps FIRST:COUNT into profile_out (runtime/profiler.h); empty: none.
  std::string profile_steps;
  std::string profile_out;
};

// Runs training to the end (or to a graceful stop). INVALID_ARGUMENT / NOT_FOUND for bad spec or
// data; other codes for failures of the run itself. Messages are one line, fit for users.
absl::Status RunTrainer(const TrainerOptions& options);

// `trainyard-trainer --consolidate-checkpoint DIR/step-N --out OUT`: a sharded FSDP checkpoint as
// a DDP one in OUT (see fsdp_checkpoint.h).
absl::Status RunConsolidate(const std::string& sharded, const std::string& out_dir);

// `trainyard-trainer --export-hf DIR --spec SPEC --out OUT`: the latest checkpoint in DIR (a DDP
// one, or a sharded FSDP one, consolidated on the way) of a job with llama `job.model` as a Hugging
// Face model directory OUT (config.json, model.safetensors in fp32). The model's sizes come from
// the spec, and from model.from's config.json when it has one (which must still be readable).
// A LoRA job (train.lora) exports its adapter alone in PEFT's layout (adapter_config.json,
// adapter_model.safetensors), or with `merge_lora` the model with the adapters merged in.
absl::Status RunExportHf(const JobConfig& job, const std::string& checkpoint_dir,
                         const std::string& out_dir, bool merge_lora = false);

// What computes: the LibTorch version, the BLAS and the matmul kernels (for --version and the
// rank's log), one line each.
std::string DescribeCompute();

// The devices this rank can train on, as `trainyard-trainer --supported-devices` tells the
// worker: "cpu", and "cuda" after it when this LibTorch was built with CUDA and sees a GPU.
std::string SupportedDevices();

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_TRAINER_H_
