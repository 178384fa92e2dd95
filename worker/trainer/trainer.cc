// RunTrainer (see trainer.h): setup, the step loop, and the rank-0 reporter that talks to the
// coordinator's TrainerService from its own thread so that a slow or missing coordinator never
// stalls training.
#include "worker/trainer/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "worker/trainer/checkpoint/checkpoint.h"
#include "worker/trainer/checkpoint/fsdp_checkpoint.h"
#include "worker/trainer/checkpoint/hf_weights.h"
#include "worker/trainer/comm/communicator.h"
#include "worker/trainer/comm/coordinator_store.h"
#include "worker/trainer/comm/cuda_support.h"
#include "worker/trainer/control/reporter.h"
#include "worker/trainer/io/data.h"
#include "worker/trainer/io/hf_checkpoint.h"
#include "worker/trainer/io/param_dump.h"
#include "worker/trainer/kernels/blas.h"
#include "worker/trainer/kernels/onednn_matmul.h"
#include "worker/trainer/model/model.h"
#include "worker/trainer/optim/optimizers.h"
#include "worker/trainer/parallel/ddp.h"
#include "worker/trainer/parallel/fsdp.h"
#include "worker/trainer/parallel/offload.h"
#include "worker/trainer/parallel/pipeline.h"
#include "worker/trainer/runtime/device.h"
#include "worker/trainer/runtime/torch_compat.h"

namespace trainyard::trainer {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

void Log(const std::string& line) {
  std::cout << line << std::endl;  // flushed: the worker ships lines as they come
}

volatile std::sig_atomic_t sigterm_received = 0;

void OnSigterm(int) { sigterm_received = 1; }

// True once SIGTERM arrived (see InstallSigtermHandler). Consumes it.
bool TakeSigterm() {
  if (sigterm_received == 0) return false;
  sigterm_received = 0;
  return true;
}

int64_t ResidentBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The windows of `samples` as a [batch, seq_len + 1] int64 tensor.
torch::Tensor MakeBatch(const TokenData& data, const std::vector<int64_t>& samples, int seq_len) {
  torch::Tensor batch =
      torch::empty({static_cast<int64_t>(samples.size()), seq_len + 1}, torch::kLong);
  auto acc = batch.accessor<int64_t, 2>();
  const std::vector<int32_t>& tokens = data.tokens();
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t start = samples[i] * seq_len;
    for (int j = 0; j <= seq_len; ++j) acc[i][j] = tokens[start + j];
  }
  return batch;
}

// The loss weights of `samples`' targets ([batch, seq_len] float, see TargetWeights).
torch::Tensor MaskWeights(const std::vector<uint8_t>& mask, const std::vector<int64_t>& samples,
                          int seq_len) {
  std::vector<float> w = TargetWeights(mask, samples, seq_len);
  return torch::from_blob(w.data(), {static_cast<int64_t>(samples.size()), seq_len}, torch::kFloat)
      .clone();
}

absl::Status WriteDump(const std::string& path, torch::nn::Module& model) {
  std::vector<DumpedParam> params;
  for (const auto& item : model.named_parameters()) {
    torch::Tensor t = item.value().detach().to(torch::kCPU, torch::kFloat).contiguous();
    DumpedParam p;
    p.name = item.key();
    p.shape.assign(t.sizes().begin(), t.sizes().end());
    p.values.assign(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    params.push_back(std::move(p));
  }
  return WriteParamDump(path, std::move(params));
}

// A llama job's model as Hugging Face files in `out_dir`: under LoRA the adapter alone in PEFT's
// layout, or with `merge_lora` the model with it merged in; otherwise the model.
absl::Status ExportModel(const ModelConfig& m, const LoraConfig& lora, LanguageModel& model,
                         bool merge_lora, const std::string& out_dir) {
  if (lora.enabled() && !merge_lora) return ExportLoraAdapter(lora, model, m.from, out_dir);
  return ExportHfModel(m, lora, model, out_dir);
}

// checkpoint.export at the end of a run: written into DIR/.export.tmp-PID, every file fsynced, then
// renamed to DIR/export (replacing an earlier attempt's), which `yard fetch` serves.
absl::Status WriteJobExport(const ModelConfig& m, const LoraConfig& lora, LanguageModel& model,
                            ExportFormat format, const std::string& checkpoint_dir) {
  namespace fs = std::filesystem;
  // Of this process: an earlier attempt's rank 0 may still be writing its own.
  const std::string tmp = absl::StrCat(checkpoint_dir, "/.export.tmp-", ::getpid());
  const std::string final_dir = checkpoint_dir + "/export";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", ec.message()));
  RETURN_IF_ERROR(ExportModel(m, lora, model, format == ExportFormat::kHfMerged, tmp));
  for (fs::directory_iterator it(tmp, ec), end; !ec && it != end; it.increment(ec)) {
    RETURN_IF_ERROR(SyncPath(it->path().string()));
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot list '", tmp, "': ", ec.message()));
  RETURN_IF_ERROR(SyncPath(tmp));
  fs::remove_all(final_dir, ec);
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename '", tmp, "' to '", final_dir, "'"));
  }
  return SyncPath(checkpoint_dir);
}

absl::Status Train(const TrainerOptions& o) {
  const JobConfig& spec = o.job;
  ModelConfig m = spec.model;
  const TrainConfig& t = spec.train;
  const bool rank0 = o.rank == 0;
  if (spec.export_format != ExportFormat::kNone && o.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("checkpoint.export: the trainer has no --checkpoint-dir");
  }

  // A Hugging Face checkpoint: its config.json gives the sizes the spec left out, and every
  // tensor is checked (names, shapes, dtypes; headers only) before any rank waits for another.
  std::unique_ptr<HfCheckpoint> hf_checkpoint;
  if (!m.from.empty()) {
    auto prefixed = [](const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("model.from: ", s.message()));
    };
    ASSIGN_OR_RETURN(const LlamaConfig config, ResolveFromCheckpoint(&m));
    auto opened = HfCheckpoint::Open(m.from);
    if (!opened.ok()) return prefixed(opened.status());
    hf_checkpoint = *std::move(opened);
    if (absl::Status s = hf_checkpoint->Check(LlamaTensors(config)); !s.ok()) return prefixed(s);
  }

  // Bad input fails here, before this rank makes the others wait at the rendezvous.
  const ParallelConfig& par = spec.parallel;
  const bool offload = par.strategy == Strategy::kOffload;
  // FSDP's NO_SHARD keeps whole parameters, gradients and optimizer state on every rank and
  // all-reduces the gradients: DDP, which runs it.
  const bool fsdp_on = par.strategy == Strategy::kFsdp && par.sharding != Sharding::kNoShard;
  const bool hybrid = fsdp_on && par.sharding == Sharding::kHybridShard;
  const int local_world = o.local_world_size > 0 ? o.local_world_size : o.world_size;
  // Model parallelism (pipeline stages, tensor parallelism or both): the ranks run PipelineStage.
  const int stages = par.pipeline_stages, tensor = par.tensor_parallel;
  const bool pipelined = stages > 1;
  const bool model_parallel = pipelined || tensor > 1;
  std::vector<int> stage_bounds;
  if (model_parallel) {
    // The sizes the layout cuts, model.from's config.json read by now.
    if (const std::string misfit = ModelParallelMisfit(m, par); !misfit.empty()) {
      return absl::InvalidArgumentError(misfit);
    }
    if (o.world_size % (stages * tensor) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parallel.pipeline_stages: ", o.world_size, " ranks do not split into ",
                       stages, " stages of ", tensor, " tensor-parallel ranks"));
    }
    stage_bounds = PipelineBoundaries(m, stages, par.pipeline_split);
  }
  if (hybrid && (local_world > o.world_size || o.world_size % local_world != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel.sharding_strategy: HYBRID_SHARD needs the same number of ranks on every node; ",
        o.world_size, " ranks do not split into nodes of ", local_world));
  }
  if (hybrid && model_parallel && local_world % (stages * tensor) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel.sharding_strategy: HYBRID_SHARD shards each part of the model over its "
        "replicas on one node, so every node needs whole replicas of ",
        stages * tensor, " ranks (pipeline stages x tensor-parallel ranks); this node runs ",
        local_world));
  }
  ASSIGN_OR_RETURN(const torch::Device device, ResolveDevice(o.device));
  if (t.precision == Precision::kFp16 && (model_parallel || offload || fsdp_on)) {
    return absl::UnimplementedError(
        "train.mixed_precision: fp16 (dynamic loss scaling) runs with strategy ddp only so far; "
        "use bf16");
  }
  if (device.is_cuda()) {
    // What runs on a GPU so far: DDP and FSDP (every sharding strategy) with AdamW or Lion. The
    // rest refuses here, by field, before any rank waits for another.
    if (model_parallel) {
      return absl::UnimplementedError(
          "parallel.pipeline_stages / parallel.tensor_parallel: model parallelism does not run "
          "on GPUs yet; use strategy ddp or fsdp, or CPU slots");
    }
    if (offload) {
      return absl::UnimplementedError(
          "parallel.strategy: offload does not run on GPUs yet; use ddp or fsdp, or CPU slots");
    }
    if (t.optimizer != OptimizerKind::kAdamW && t.optimizer != OptimizerKind::kLion) {
      return absl::UnimplementedError(
          absl::StrCat("train.optimizer: ", Name(t.optimizer),
                       " runs on CPU slots only; on GPUs use adamw (LibTorch's fused kernel) or "
                       "lion"));
    }
  }
  std::vector<PsRangeRef> ps_ranges;
  if (offload) {
    if (o.ps_ranges.empty()) {
      return absl::InvalidArgumentError(
          "parallel.strategy: offload needs parameter-server ranges (--ps), which the "
          "coordinator assigns");
    }
    ASSIGN_OR_RETURN(ps_ranges, ParsePsRanges(o.ps_ranges));
  }
  ASSIGN_OR_RETURN(TokenData data, TokenData::Load(spec.data.path, spec.data.format, m.vocab));
  std::vector<uint8_t> loss_mask;
  if (!spec.data.loss_mask.empty()) {
    ASSIGN_OR_RETURN(loss_mask, LoadLossMask(spec.data.loss_mask, data.size()));
  }
  const int64_t num_samples = NumSamples(data.size(), m.seq_len);
  if (num_samples < 1) {
    return absl::InvalidArgumentError(absl::StrCat("model.seq_len: ", m.seq_len, " needs at least ",
                                                   m.seq_len + 1, " tokens, but data.path '",
                                                   spec.data.path, "' has only ", data.size()));
  }

  torch::set_num_threads(o.threads);
  std::unique_ptr<Communicator> comm;
  // FSDP: the ranks a shard is spread over and the ranks that hold the same shard.
  std::unique_ptr<Communicator> shard_comm, replica_comm;
  // Pipeline: the ranks that run this rank's stage (one per replica).
  std::unique_ptr<Communicator> stage_comm;
  // Tensor parallelism: the ranks that split this rank's layers.
  std::unique_ptr<Communicator> tensor_comm;
  // Tests: one rank that still sends its gradients through NCCL (an in-process store), so that a
  // machine with one GPU runs the NCCL path: buckets, streams and events.
  const bool nccl_one_rank =
      device.is_cuda() && o.world_size == 1 && std::getenv("TRAINYARD_NCCL_ONE_RANK") != nullptr;
  // A GPU rank's collectives are NCCL's, unless TRAINYARD_COLLECTIVES=gloo: Gloo through host
  // copies, for ranks that share one GPU (NCCL refuses two ranks on one device), as on a test
  // machine with one GPU.
  const char* collectives = std::getenv("TRAINYARD_COLLECTIVES");
  const bool use_nccl =
      device.is_cuda() && !(collectives != nullptr && std::string_view(collectives) == "gloo");
  if (nccl_one_rank) {
    ASSIGN_OR_RETURN(comm, MakeNcclCommunicator(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                                std::chrono::minutes(5)));
  } else if (o.world_size == 1) {
    comm = MakeLocalCommunicator();
  } else {
    auto store = c10::make_intrusive<CoordinatorStore>(
        std::make_shared<RendezvousClient>(o.coordinator, o.job_id, o.attempt),
        std::chrono::minutes(5));
    if (use_nccl) {
      // NCCL's unique id travels through the coordinator's rendezvous, as Gloo's addresses do.
      ASSIGN_OR_RETURN(comm,
                       MakeNcclCommunicator(store, o.rank, o.world_size, std::chrono::minutes(5)));
    } else {
      // All ranks on this host (the worker says how many of the job's ranks it runs): gradients
      // are summed through shared memory instead of loopback TCP.
      ASSIGN_OR_RETURN(comm, MakeGlooCommunicator(store, o.rank, o.world_size, o.gloo_hostname,
                                                  std::chrono::minutes(5),
                                                  /*same_host=*/local_world == o.world_size));
    }
    // A group of some of the ranks, with its keys under `name`: NCCL's or Gloo's, as `comm`.
    auto make_group = [&](const std::string& name, int group_rank,
                          int group_size) -> absl::StatusOr<std::unique_ptr<Communicator>> {
      if (group_size == 1) return MakeLocalCommunicator();
      if (use_nccl) {
        return MakeNcclCommunicator(c10::make_intrusive<c10d::PrefixStore>(name, store), group_rank,
                                    group_size, std::chrono::minutes(5));
      }
      return MakeSubgroupCommunicator(store, name, group_rank, group_size, o.gloo_hostname,
                                      std::chrono::minutes(5));
    };
    // Model parallelism: the ranks holding the same shards (one per replica; under fsdp its
    // group below), and the tensor-parallel group (consecutive ranks).
    const int group = stages * tensor;
    if (model_parallel && o.world_size > group && (!fsdp_on || hybrid)) {
      ASSIGN_OR_RETURN(stage_comm, make_group(absl::StrCat("data-parallel-", o.rank % group),
                                              o.rank / group, o.world_size / group));
    }
    if (tensor > 1) {
      ASSIGN_OR_RETURN(tensor_comm, make_group(absl::StrCat("tensor-parallel-", o.rank / tensor),
                                               o.rank % tensor, tensor));
    }
    if (fsdp_on && model_parallel) {
      // FSDP within each part of the model: its replicas shard it (a group of their own, as
      // below); under HYBRID_SHARD its replicas on one node, the nodes' shards replicated.
      const int replica = o.rank / group, replicas = o.world_size / group;
      const int per_node = hybrid ? local_world / group : replicas;
      ASSIGN_OR_RETURN(shard_comm, make_group(absl::StrCat("fsdp-stage-", o.rank % group, "-shard-",
                                                           replica / per_node),
                                              replica % per_node, per_node));
      if (hybrid) {
        ASSIGN_OR_RETURN(replica_comm, make_group(absl::StrCat("fsdp-stage-", o.rank % group,
                                                               "-replica-", replica % per_node),
                                                  replica / per_node, replicas / per_node));
      }
    } else if (fsdp_on) {
      // Every rank builds its own groups, also without HYBRID_SHARD: the FSDP communication
      // thread must not share a process group with the training thread's collectives.
      const int group = hybrid ? local_world : o.world_size;
      ASSIGN_OR_RETURN(shard_comm, make_group(absl::StrCat("fsdp-shard-", o.rank / group),
                                              o.rank % group, group));
      if (hybrid) {
        ASSIGN_OR_RETURN(replica_comm, make_group(absl::StrCat("fsdp-replica-", o.rank % group),
                                                  o.rank / group, o.world_size / group));
      }
    }
  }
  if (fsdp_on && !shard_comm) shard_comm = MakeLocalCommunicator();
  if (hybrid && model_parallel && !stage_comm) stage_comm = MakeLocalCommunicator();
  if (hybrid) {
    // Every node must hold the same number of ranks (consecutive ones).
    torch::Tensor sizes =
        torch::tensor({double(local_world), double(local_world) * local_world}, torch::kDouble);
    comm->AllReduceSum({sizes})->Wait();
    const double sum = sizes[0].item<double>(), sum_sq = sizes[1].item<double>();
    if (std::abs(sum * sum - sum_sq * o.world_size) > 0.5) {
      return absl::InvalidArgumentError(
          "parallel.sharding_strategy: HYBRID_SHARD needs the same number of ranks on every "
          "node, and the ranks of this job are spread unevenly");
    }
  }

  ModelOptions model_options;
  // On a GPU autocast picks each operation's precision; on the CPU the model runs its Linear
  // layers in bf16 itself. fp16 on the CPU scales the loss as on a GPU but computes in fp32
  // (Debian's LibTorch has no fp16 CPU matmuls).
  model_options.bf16 = t.precision == Precision::kBf16 && !device.is_cuda();
  model_options.activation_checkpointing = t.activation_checkpointing;
  model_options.lora = t.lora;
  // FSDP with cpu_ram_efficient_loading: only rank 0 holds the whole model, the others receive
  // their shards from it. (Not under model parallelism, where every rank keeps its part of the
  // model it built.)
  const bool from_rank0 =
      fsdp_on && par.cpu_ram_efficient_loading && o.world_size > 1 && !model_parallel;
  model_options.materialize = !from_rank0 || rank0;
  std::shared_ptr<LanguageModel> model = BuildModel(m, model_options, t.seed);
  // The checkpoint's weights, on the ranks whose parameters are not sent to them from rank 0
  // (model parallelism broadcasts nothing: every rank keeps its part of what it loaded).
  if (hf_checkpoint != nullptr && model_options.materialize &&
      (rank0 || fsdp_on || model_parallel)) {
    RETURN_IF_ERROR(LoadHfWeights(*hf_checkpoint, *model));
    if (rank0) Log(absl::StrCat("loaded ", hf_checkpoint->size(), " tensors from ", m.from));
  }
  hf_checkpoint.reset();  // unmapped
  // In place: the parameters keep their identity (the optimizer's state keys). Parameters this
  // rank did not materialize (FSDP's from rank 0) get an empty storage on the device, as they had
  // on the CPU: nothing to copy.
  if (device.is_cuda()) {
    torch::NoGradGuard no_grad;
    for (torch::Tensor p : model->parameters()) {
      if (p.numel() > 0 && p.storage().nbytes() == 0) {
        torch::Tensor empty = torch::empty(p.sizes(), p.options().device(device));
        FreeStorage(empty);
        p.set_data(empty);
      } else {
        p.set_data(p.to(device));
      }
    }
    for (torch::Tensor b : model->buffers()) b.set_data(b.to(device));
  }
  std::vector<torch::Tensor> params = model->parameters();
  // What the optimizer updates and the ranks average: every parameter, or the LoRA adapters.
  const std::vector<torch::Tensor> trainable = TrainableParameters(*model);
  // train.optimizer (AdamW's betas (0.9, 0.95) as in GPT-3 / nanoGPT); weight decay on every
  // parameter that trains.
  const OptimizerHyper hyper = HyperFor(t.optimizer, t.weight_decay);
  // Pipeline: the parameters this rank's stage holds, and of them those that train (what its
  // optimizer steps and its replicas average).
  std::optional<PipelineLayout> layout;
  std::vector<std::pair<std::string, torch::Tensor>> stage_params;
  std::vector<torch::Tensor> optimized = trainable;
  if (model_parallel) {
    layout = MakePipelineLayout(o.rank, o.world_size, stages, tensor, stage_bounds);
    stage_params = StageParameters(*model, *layout);
    optimized.clear();
    for (const auto& [name, p] : stage_params) {
      if (p.requires_grad()) optimized.push_back(p);
    }
  }
  std::unique_ptr<FsdpModel> fsdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer_holder;
  ExtraState extra_state;  // amp.pt of the checkpoint resumed from
  int64_t step = 0;
  FsdpConfig fsdp_config;
  fsdp_config.sharding = par.sharding;
  fsdp_config.wrap = par.wrap;
  fsdp_config.min_num_params = par.min_num_params;
  fsdp_config.backward_prefetch = par.backward_prefetch;
  fsdp_config.forward_prefetch = par.forward_prefetch;
  fsdp_config.max_gathered_units = par.max_gathered_units;
  fsdp_config.optimizer = hyper;
  if (fsdp_on && !model_parallel) {
    ASSIGN_OR_RETURN(fsdp, FsdpModel::Create(*model, *comm, *shard_comm, replica_comm.get(),
                                             fsdp_config, from_rank0));
    if (!o.checkpoint_dir.empty()) {
      ASSIGN_OR_RETURN(auto loaded, LoadLatestShardedCheckpoint(o.checkpoint_dir, *fsdp));
      if (loaded.has_value()) {
        step = loaded->step;
        Log(absl::StrCat("resumed from ", loaded->path, " at step ", step));
      }
    }
  } else {
    if (!fsdp_on) optimizer_holder = MakeOptimizer(optimized, hyper, t.lr);
    // Model parallelism: the checkpoint (of any layout) is read into the whole model and an
    // optimizer of every parameter that trains; the stage keeps its part of both.
    std::unique_ptr<torch::optim::Optimizer> whole;
    if (model_parallel) whole = MakeOptimizer(trainable, hyper, t.lr);
    std::optional<CheckpointInfo> loaded;
    if (!o.checkpoint_dir.empty()) {
      ASSIGN_OR_RETURN(
          loaded, LoadLatestCheckpoint(o.checkpoint_dir, *model, whole ? *whole : *optimizer_holder,
                                       &extra_state));
      if (loaded.has_value()) {
        step = loaded->step;
        Log(absl::StrCat("resumed from ", loaded->path, " at step ", step));
      }
    }
    if (model_parallel) {
      if (tensor > 1) KeepTensorParallelShards(*model, stage_params, *layout);
      if (fsdp_on) {
        // The stage's replicas shard its parameters (an FsdpModel over their group, or under
        // HYBRID_SHARD over those on this node), which averages the gradients too.
        fsdp_config.holds = [&model, &layout](const std::string& name) {
          return StageHolds(*model, *layout, name);
        };
        // (`world`: the part's replicas, over which the gradients are averaged.)
        ASSIGN_OR_RETURN(fsdp, FsdpModel::Create(*model, hybrid ? *stage_comm : *shard_comm,
                                                 *shard_comm, replica_comm.get(), fsdp_config,
                                                 /*from_rank0=*/false));
        if (loaded.has_value()) {
          int64_t state_step = 0;
          const auto states = StageStates(*model, *whole, *layout, &state_step);
          RETURN_IF_ERROR(ImportParameterStates(*fsdp, states, state_step));
        }
      } else if (loaded.has_value()) {
        RETURN_IF_ERROR(KeepStageState(*model, *whole, *optimizer_holder, *layout));
      }
      whole.reset();
      if (tensor > 1) {
        model->SetTensorParallel(
            {tensor_comm.get(), layout->tp_rank, tensor, par.sequence_parallel});
      }
      // Every rank built the same model from the seed and loaded the same checkpoint; a stage
      // keeps only its parameters.
      for (const auto& item : model->named_parameters()) {
        if (!StageHolds(*model, *layout, item.key())) FreeStorage(item.value());
      }
    } else {
      // Like DDP: every rank starts from rank 0's parameters.
      comm->Broadcast(params, 0);
    }
  }
  // Offload: the optimizer lives on the parameter servers; `optimizer` only carries its state
  // into and out of checkpoints.
  std::unique_ptr<OffloadOptimizer> offloaded;
  if (offload) {
    OffloadConfig config;
    config.servers.job_id = o.job_id;
    config.servers.attempt = o.attempt;
    config.servers.beta1 = hyper.beta1;
    config.servers.beta2 = hyper.beta2;
    config.servers.eps = hyper.eps;
    config.servers.weight_decay = hyper.weight_decay;
    config.servers.rpc_timeout = absl::Seconds(o.ps_rpc_timeout_s);
    config.servers.tcp_congestion = o.ps_tcp_congestion;
    config.servers.transport = o.ps_transport;
    config.delayed_update = par.delayed_update;
    ASSIGN_OR_RETURN(offloaded, OffloadOptimizer::Create(params, *comm, std::move(ps_ranges),
                                                         config, par.bucket_mb));
    if (o.rank == 0) {
      Log(absl::StrCat("parameter-server connections: TCP congestion control ",
                       offloaded->servers().TcpCongestionInUse()));
      Log(absl::StrCat("parameter-server transfers: ", offloaded->servers().TransportSummary()));
    }
    RETURN_IF_ERROR(offloaded->Initialize(step, *optimizer_holder));
  }

  // fp16: dynamic loss scaling, its state carried by checkpoints (amp.pt).
  std::optional<LossScaler> scaler;
  if (t.precision == Precision::kFp16) {
    scaler.emplace();
    if (!extra_state.empty()) RETURN_IF_ERROR(scaler->SetState(extra_state));
  }
  std::unique_ptr<GradientReducer> reducer;
  std::unique_ptr<PipelineStage> pipeline;
  if (model_parallel) {
    if (stage_comm && !fsdp) {
      reducer = std::make_unique<GradientReducer>(optimized, *stage_comm, par.bucket_mb,
                                                  std::min(1.0, par.bucket_mb));
    }
    pipeline = std::make_unique<PipelineStage>(*model, *comm, *layout, par.pipeline_schedule,
                                               t.micro_batch, reducer.get(), fsdp.get(),
                                               tensor_comm.get());
  } else if ((o.world_size > 1 || nccl_one_rank) && !offload && !fsdp) {
    // The first bucket is 1 MiB like PyTorch's, or smaller when the buckets are.
    const double bucket_mb = par.bucket_mb;
    reducer =
        std::make_unique<GradientReducer>(trainable, *comm, bucket_mb, std::min(1.0, bucket_mb));
  }
  std::unique_ptr<Reporter> reporter;
  if (rank0 && !o.job_id.empty()) {
    reporter = std::make_unique<Reporter>(o.coordinator, o.job_id, o.attempt, o.rank, &Log);
  }
  std::ofstream metrics;
  if (rank0 && !o.metrics_file.empty()) {
    metrics.open(o.metrics_file, std::ios::app);
    if (!metrics) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics-file: cannot open '", o.metrics_file, "'"));
    }
  }

  const int64_t total_steps = t.steps;
  // Pipeline: the micro-batches flow through the stages; the replicas split the batch.
  const int grad_accum = pipelined ? t.micro_batches : t.grad_accum;
  const int replicas = model_parallel ? layout->replicas : o.world_size;
  DistributedSampler sampler(num_samples, t.seed, t.micro_batch, grad_accum, replicas,
                             model_parallel ? layout->replica : o.rank);
  auto count = [](const std::vector<torch::Tensor>& tensors) {
    int64_t n = 0;
    for (const auto& p : tensors) n += p.numel();
    return n;
  };
  const int64_t params_count = count(params), trainable_count = count(trainable);
  // Model parallelism: what this rank's stage holds (its tensor-parallel shards).
  int64_t held_count = params_count;
  if (model_parallel) {
    held_count = 0;
    for (const auto& [name, p] : stage_params) held_count += p.numel();
  }
  Log(absl::StrFormat(
      "trainer rank %d/%d: %s model, %d parameters%s, %d tokens (%d samples), global batch %d, "
      "%d buckets, %s, optimizer %s, steps %d..%d",
      o.rank, o.world_size, m.kind, params_count,
      t.lora.enabled() ? absl::StrFormat(" (%d trainable: LoRA r %d on %s)", trainable_count,
                                         t.lora.r, absl::StrJoin(t.lora.target_modules, ","))
                       : "",
      data.size(), num_samples, sampler.global_batch(),
      reducer ? reducer->num_buckets() : (offloaded ? offloaded->num_buckets() : 0),
      model_parallel
          ? absl::StrFormat(
                "pipeline stage %d/%d (blocks %d..%d, %d parameters), tensor-parallel rank "
                "%d/%d, %s, %d micro-batches, %d replicas (%s)",
                layout->stage, stages, stage_bounds[layout->stage],
                stage_bounds[layout->stage + 1] - 1, held_count, layout->tp_rank, tensor,
                Name(par.pipeline_schedule), grad_accum, replicas,
                fsdp ? absl::StrFormat("fsdp %s: %d units, shard group %d", Name(par.sharding),
                                       fsdp->num_units(), fsdp->shard_count())
                     : "ddp")
      : fsdp ? absl::StrFormat("fsdp %s: %d units, shard group %d", Name(par.sharding),
                               fsdp->num_units(), fsdp->shard_count())
             : std::string(Name(par.strategy)),
      Name(t.optimizer), step, total_steps));
  Log(absl::StrCat("collectives: ", comm->Describe()));
  Log(absl::StrCat(
      "device: ", DescribeDevice(device), "; precision ", Name(t.precision),
      device.is_cuda() && t.precision != Precision::kFp32 ? " (autocast, fp32 master weights)" : "",
      scaler ? absl::StrCat(", dynamic loss scale from ", scaler->scale()) : ""));
  if (device.is_cuda()) CudaResetPeak();
  // A tensor-parallel group is consecutive ranks; the scheduler gives each node whole groups, but
  // ranks started otherwise may split one.
  if (tensor > 1 && o.local_world_size > 0 && o.local_world_size % tensor != 0) {
    Log(absl::StrCat("warning: this node runs ", o.local_world_size,
                     " of the job's ranks, not a multiple of parallel.tensor_parallel (", tensor,
                     "): a tensor-parallel group spans nodes, and its all-reduces cross the "
                     "network"));
  }

  // Model-state bytes of DDP (and offload's device side): weights, and of the parameters that
  // train gradients, and the optimizer's state on the device unless offloaded.
  // Model parallelism: of the stage's parameters.
  std::vector<std::vector<int64_t>> trainable_shapes;
  for (const auto& p : optimized) trainable_shapes.push_back(p.sizes().vec());
  const int64_t dense_state_bytes =
      held_count * int64_t{4} + count(optimized) * int64_t{4} +
      (offload ? 0 : OptimizerStateBytes(t.optimizer, trainable_shapes, 1));
  const int64_t run_start_step = step;
  // Bytes this rank sent for gradients and parameters so far (model parallelism: activations,
  // and over its data- and tensor-parallel groups too).
  auto bytes_sent = [&] {
    if (fsdp && !model_parallel) return fsdp->bytes_sent();
    return comm->bytes_sent() + (stage_comm ? stage_comm->bytes_sent() : 0) +
           (tensor_comm ? tensor_comm->bytes_sent() : 0) + (fsdp ? fsdp->bytes_sent() : 0);
  };
  while (step < total_steps) {
    const auto step_start = Clock::now();
    const int64_t bytes_before = bytes_sent();
    double loss_sum = 0, backward_s = 0, comm_wait_s = 0;
    // fp16: the loss is scaled before backward (an injected overflow scales it by inf on rank 0:
    // every gradient becomes inf or NaN, as a real fp16 overflow makes them).
    const bool inject_overflow = scaler && o.inject_overflow_step == step + 1 && rank0;
    const double loss_scale = !scaler           ? 1.0
                              : inject_overflow ? std::numeric_limits<double>::infinity()
                                                : scaler->scale();
    // data.loss_mask: the targets the whole global batch counts (every rank knows the batch), so
    // that the step's loss is their mean however they fall on ranks and micro-batches.
    const int64_t counted =
        loss_mask.empty()
            ? 0
            : std::max<int64_t>(1, CountedTargets(loss_mask, sampler.GlobalBatch(step), m.seq_len,
                                                  /*last_only=*/m.kind == "mlp"));
    if (pipeline) {
      // The stage runs every micro-batch by the schedule; the reducer syncs in its last backward.
      if (t.lora.dropout > 0) torch::manual_seed(DropoutSeed(t.seed, o.rank, step, 0));
      auto windows = [&](int micro) {
        return MakeBatch(data, sampler.MicroBatch(step, micro), m.seq_len);
      };
      auto loss_of = [&](int micro, const torch::Tensor& logits, const torch::Tensor& w) {
        if (loss_mask.empty()) return model->LossOf(logits, w) / grad_accum;
        return model->MaskedLossSumOf(
                   logits, w, MaskWeights(loss_mask, sampler.MicroBatch(step, micro), m.seq_len)) *
               (static_cast<double>(replicas) / static_cast<double>(counted));
      };
      loss_sum = pipeline->Step(grad_accum, windows, loss_of);
      backward_s = pipeline->last_step().seconds;
      comm_wait_s = pipeline->last_step().comm_wait_seconds;
    }
    for (int micro = 0; !pipeline && micro < grad_accum; ++micro) {
      if (reducer) reducer->Prepare(micro == grad_accum - 1);
      if (offloaded) offloaded->Prepare(micro == grad_accum - 1, step + 1);
      if (fsdp) fsdp->BeginForward(micro == grad_accum - 1);
      const std::vector<int64_t> samples = sampler.MicroBatch(step, micro);
      if (t.lora.dropout > 0) torch::manual_seed(DropoutSeed(t.seed, o.rank, step, micro));
      torch::Tensor batch = ToDevice(MakeBatch(data, samples, m.seq_len), device);
      // Gradients are averaged over the ranks: the masked sum is scaled by world / counted.
      torch::Tensor loss;
      {
        AutocastScope autocast(device, t.precision);
        loss = loss_mask.empty()
                   ? model->Loss(batch) / grad_accum
                   : model->MaskedLossSum(
                         batch, ToDevice(MaskWeights(loss_mask, samples, m.seq_len), device)) *
                         (static_cast<double>(o.world_size) / static_cast<double>(counted));
      }
      if (fsdp) fsdp->WatchLoss(loss);
      const auto backward_start = Clock::now();
      if (scaler) {
        (loss * loss_scale).backward();
      } else {
        loss.backward();
      }
      if (fsdp) comm_wait_s += fsdp->FinishBackward();
      backward_s += Seconds(backward_start);
      loss_sum += loss.item<double>();
    }
    if (reducer) comm_wait_s = reducer->Finish();
    if (pipeline) {
      pipeline->SyncTiedGradient();
      pipeline->SyncSequenceParallelGradients();
    }

    // fp16: the gradients divided by the loss scale; an inf or NaN among them (the same on every
    // rank: they were summed) skips this step's update.
    const bool overflow = scaler && scaler->Unscale(params);
    const double scale_used = scaler ? scaler->scale() : 1.0;
    if (scaler) scaler->Update(overflow);
    double grad_norm = 0;
    if (overflow) {
      grad_norm = std::numeric_limits<double>::quiet_NaN();
    } else if (pipeline) {
      grad_norm = std::sqrt(pipeline->GradNormSquared(optimized));
    } else if (offloaded) {
      ASSIGN_OR_RETURN(grad_norm, offloaded->FinishBackward(&comm_wait_s));
    } else if (fsdp) {
      grad_norm = fsdp->GradNorm();
    } else {
      grad_norm = GradNorm(params);
    }
    const double clip_scale =
        t.grad_clip > 0 && grad_norm > t.grad_clip ? t.grad_clip / (grad_norm + 1e-6) : 1.0;
    const double lr = LearningRate(step, total_steps, t.warmup, t.lr);
    if (overflow) {
      // Skipped, as GradScaler skips optimizer.step(): parameters and optimizer state stay.
      for (auto& p : params) p.mutable_grad() = torch::Tensor();
      Log(absl::StrFormat("step %d skipped: inf or NaN gradients in fp16%s; loss scale %g -> %g",
                          step + 1, inject_overflow ? " (injected)" : "", scale_used,
                          scaler->scale()));
    } else if (offloaded) {
      // The parameter servers scale the gradients (clipping) as they apply AdamW.
      RETURN_IF_ERROR(offloaded->Step(lr, clip_scale));
    } else if (fsdp) {
      fsdp->Step(lr, clip_scale);
    } else {
      OptimizerStep(*optimizer_holder, lr, clip_scale);
      // zero_grad(set_to_none=True): the next backward hands its gradients over instead of
      // adding them to zeros (and the reducer's bucket views are dropped).
      for (auto& p : params) p.mutable_grad() = torch::Tensor();
    }
    ++step;
    const int64_t comm_bytes = bytes_sent() - bytes_before;  // before the flags' all-reduce

    // One tiny all-reduce per step: the global mean loss, and the flags every rank must agree on
    // (coordinator commands reach rank 0 only; SIGTERM may reach any rank).
    TrainerCommands commands;
    if (reporter) commands = reporter->TakeCommands();
    // Pipeline: also each stage's idle share of the schedule (from the first replica).
    // Tensor parallelism: the group's ranks all compute the loss; rank 0 of it counts it.
    if (layout && layout->tp_rank != 0) loss_sum = 0;
    std::vector<double> flags = {loss_sum, commands.checkpoint_requested ? 1.0 : 0.0,
                                 commands.stop_requested ? 1.0 : 0.0, TakeSigterm() ? 1.0 : 0.0};
    if (pipelined) {
      flags.resize(4 + stages, 0.0);
      const PipelineStepStats& ps = pipeline->last_step();
      if (layout->replica == 0 && layout->tp_rank == 0) {
        flags[4 + layout->stage] = ps.idle_seconds / ps.seconds;
      }
    }
    torch::Tensor agree = torch::tensor(flags, torch::kDouble);
    comm->AllReduceSum({agree})->Wait();
    // The loss is the last stages' under pipeline parallelism (one per replica).
    const double loss = agree[0].item<double>() / replicas;
    const bool checkpoint_requested = agree[1].item<double>() > 0;
    const bool stop_requested = agree[2].item<double>() > 0;
    const bool sigterm = agree[3].item<double>() > 0;
    const double step_s = Seconds(step_start);
    const double tokens_per_s =
        sampler.global_batch() * model->TokensPerWindow() / std::max(step_s, 1e-9);
    const int64_t model_state_bytes = fsdp ? fsdp->peak_bytes() : dense_state_bytes;
    // The measured bubble (the stages' mean idle share) and its theory, (P - 1) / (m + P - 1).
    double bubble = 0;
    for (int s = 0; pipelined && s < stages; ++s) bubble += agree[4 + s].item<double>() / stages;
    const double bubble_theory =
        pipelined ? double(stages - 1) / double(grad_accum + stages - 1) : 0.0;

    if (rank0) {
      Log(absl::StrFormat(
          "step %d/%d loss %.4f lr %.2e grad_norm %.2f tok/s %.0f step_ms %.0f backward_ms %.0f "
          "comm_wait_ms %.1f allreduce_bytes %d comm_bytes %d model_state_peak_bytes %d%s%s",
          step, total_steps, loss, lr, grad_norm, tokens_per_s, step_s * 1e3, backward_s * 1e3,
          comm_wait_s * 1e3, reducer ? reducer->bytes_per_step() : 0, comm_bytes, model_state_bytes,
          offloaded  ? absl::StrFormat(" ps_push_bytes %d ps_pull_bytes %d",
                                       offloaded->pushed_bytes(), offloaded->pulled_bytes())
          : pipeline ? absl::StrFormat(" pipeline_bubble %.3f (theory %.3f) in_flight_peak %d "
                                       "activation_peak_bytes %d",
                                       bubble, bubble_theory, pipeline->last_step().peak_in_flight,
                                       pipeline->last_step().peak_activation_bytes)
                     : "",
          absl::StrCat(scaler ? absl::StrFormat(" loss_scale %g skipped_steps %d", scaler->scale(),
                                                scaler->skipped_steps())
                              : "",
                       device.is_cuda()
                           ? absl::StrCat(" device_peak_bytes ", CudaPeakAllocatedBytes())
                           : "")));
      if (metrics.is_open()) {
        nlohmann::json line = {
            {"step", step},
            {"loss", loss},
            {"lr", lr},
            {"grad_norm", grad_norm},
            {"tokens_per_second", tokens_per_s},
            {"step_seconds", step_s},
            {"backward_seconds", backward_s},
            {"comm_wait_seconds", comm_wait_s},
            {"allreduce_bytes", reducer ? reducer->bytes_per_step() : 0},
            {"comm_bytes", comm_bytes},
            {"pipeline_bubble", bubble},
            {"pipeline_bubble_theory", bubble_theory},
            {"pipeline_in_flight_peak", pipeline ? pipeline->last_step().peak_in_flight : 0},
            {"pipeline_activation_peak_bytes",
             pipeline ? pipeline->last_step().peak_activation_bytes : 0},
            {"model_state_peak_bytes", model_state_bytes}};
        if (scaler) {
          line["loss_scale"] = scaler->scale();
          line["skipped"] = overflow;
          line["skipped_steps"] = scaler->skipped_steps();
        }
        if (device.is_cuda()) line["device_peak_bytes"] = CudaPeakAllocatedBytes();
        metrics << line.dump() << std::endl;
      }
      if (reporter) {
        StepReport r;
        r.step = step;
        r.total_steps = total_steps;
        r.loss = loss;
        r.lr = lr;
        r.tokens_per_second = tokens_per_s;
        r.step_seconds = step_s;
        r.grad_norm = grad_norm;
        r.resident_bytes = ResidentBytes();
        r.model_state_peak_bytes = model_state_bytes;
        r.comm_bytes = comm_bytes;
        r.time_ms = UnixMillis();
        for (int s = 0; pipelined && s < stages; ++s) {
          r.pipeline_stage_idle.push_back(agree[4 + s].item<double>());
        }
        r.pipeline_bubble_theory = bubble_theory;
        reporter->ReportStep(r);
      }
    }

    const bool stop_after = o.stop_after_steps > 0 && step - run_start_step >= o.stop_after_steps;
    const bool stop = stop_requested || sigterm || stop_after;
    const int64_t every = spec.checkpoint_every_steps;
    const bool checkpoint =
        !o.checkpoint_dir.empty() &&
        (stop || checkpoint_requested || step == total_steps || (every > 0 && step % every == 0));
    if (checkpoint && pipeline) {
      // Each stage's first replica writes its part; rank 0 meta.json. Under fsdp, the stage's
      // shards put together whole first (by all of its replicas).
      WholeModel gathered;
      if (fsdp) {
        ASSIGN_OR_RETURN(gathered, GatherWhole(*fsdp, t.lr));
      }
      ASSIGN_OR_RETURN(CheckpointInfo info,
                       WriteStagedCheckpoint(o.checkpoint_dir, step, *layout, *model,
                                             fsdp ? gathered.params : stage_params,
                                             fsdp ? *gathered.optimizer : *optimizer_holder, *comm,
                                             tensor_comm.get()));
      if (rank0) {
        Log(absl::StrCat("checkpoint step ", info.step, " path ", info.path, " bytes ", info.bytes,
                         " (", stages, " pipeline stages)"));
        if (reporter) reporter->ReportCheckpoint({info.step, info.path, info.bytes});
      }
    } else if (checkpoint && fsdp) {
      // Every rank writes its shard; rank 0 the manifest.
      ASSIGN_OR_RETURN(CheckpointInfo info,
                       WriteShardedCheckpoint(o.checkpoint_dir, step, *fsdp, *comm, t.lr));
      if (rank0) {
        Log(absl::StrCat("checkpoint step ", info.step, " path ", info.path, " bytes ", info.bytes,
                         " (sharded)"));
        if (reporter) {
          reporter->ReportCheckpoint({info.step, info.path, info.bytes});
        }
      }
    } else if (checkpoint) {
      torch::optim::Optimizer& optimizer = *optimizer_holder;
      // delayed_update: the checkpoint holds the parameters after `step`'s update (every rank).
      if (offloaded) RETURN_IF_ERROR(offloaded->Flush());
      if (rank0) {
        // Offload: the servers hold the optimizer state; bring it into the DDP-format files.
        if (offloaded) RETURN_IF_ERROR(offloaded->ReadIntoShadow(step, optimizer));
        ASSIGN_OR_RETURN(CheckpointInfo info,
                         WriteCheckpoint(o.checkpoint_dir, step, *model, optimizer,
                                         scaler ? scaler->State() : ExtraState{}));
        Log(absl::StrCat("checkpoint step ", info.step, " path ", info.path, " bytes ",
                         info.bytes));
        if (reporter) {
          reporter->ReportCheckpoint({info.step, info.path, info.bytes});
        }
      }
      comm->Barrier();  // no rank runs ahead of (or exits before) a durable checkpoint
    }
    if (stop) {
      Log(absl::StrCat("stopping after step ", step, " (",
                       sigterm          ? "SIGTERM"
                       : stop_requested ? "stop requested"
                                        : "--stop-after-steps",
                       ")"));
      break;
    }
  }

  if (offloaded) RETURN_IF_ERROR(offloaded->Flush());
  // What follows (the dump, the sample, the export) reads the parameters on the CPU.
  // FSDP: every rank takes part in gathering the whole model for the dump and the sample (on a
  // GPU before the move, which copies what the gathered views show).
  if (fsdp) fsdp->GatherFullParameters();
  if (device.is_cuda()) model->to(torch::kCPU);
  // Pipeline: rank 0 gathers the stages' parameters; the other ranks hold only their stage's.
  if (pipeline) pipeline->GatherToRankZero();
  if (!o.dump_params.empty() && (!pipeline || rank0)) {
    RETURN_IF_ERROR(WriteDump(o.dump_params, *model));
  }
  // What the model learned, for people: rank 0 of a finished byte-level run writes a sample.
  if (rank0 && step == total_steps && spec.data.format == "bytes") {
    const std::string prompt = "The ";
    model->eval();
    const std::vector<int64_t> sampled =
        Generate(*model, std::vector<int64_t>(prompt.begin(), prompt.end()), 240,
                 /*temperature=*/0.8, t.seed, m.seq_len);
    std::string text = prompt;
    for (int64_t token : sampled) text.push_back(static_cast<char>(token & 0xff));
    Log("sample (temperature 0.8):");
    for (absl::string_view line : absl::StrSplit(text, '\n')) Log(absl::StrCat("| ", line));
  }
  if (rank0 && step == total_steps && spec.export_format != ExportFormat::kNone) {
    RETURN_IF_ERROR(WriteJobExport(m, t.lora, *model, spec.export_format, o.checkpoint_dir));
    Log(absl::StrCat("exported the ",
                     t.lora.enabled() && spec.export_format == ExportFormat::kHf
                         ? "LoRA adapter (PEFT)"
                         : "model (Hugging Face)",
                     " to ", o.checkpoint_dir, "/export"));
  }
  Log(absl::StrCat("trainer rank ", o.rank, " done at step ", step));
  return absl::OkStatus();
}

}  // namespace

absl::Status RunConsolidate(const std::string& sharded, const std::string& out_dir) {
  try {
    ASSIGN_OR_RETURN(CheckpointInfo info, ConsolidateShardedCheckpoint(sharded, out_dir));
    Log(absl::StrCat("consolidated step ", info.step, " into ", info.path, " (", info.bytes,
                     " bytes)"));
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

absl::Status RunExportHf(const JobConfig& job, const std::string& checkpoint_dir,
                         const std::string& out_dir, bool merge_lora) {
  ModelConfig m = job.model;
  const LoraConfig& lora = job.train.lora;
  if (m.kind != "llama") {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.kind: --export-hf writes Llama-family models (llama), this job trains ", m.kind));
  }
  if (merge_lora && !lora.enabled()) {
    return absl::InvalidArgumentError(
        "--merge-lora: the job has no train.lora; its export is the whole model already");
  }
  if (!m.from.empty()) RETURN_IF_ERROR(ResolveFromCheckpoint(&m).status());
  try {
    ASSIGN_OR_RETURN(std::optional<CheckpointInfo> latest, FindLatestCheckpoint(checkpoint_dir));
    if (!latest.has_value()) {
      return absl::NotFoundError(
          absl::StrCat("--export-hf: no checkpoint in '", checkpoint_dir, "' (no 'latest')"));
    }
    std::string source = checkpoint_dir;
    const std::string consolidated = out_dir + "/.consolidated";
    // Removed however this ends.
    const std::unique_ptr<const std::string, void (*)(const std::string*)> cleanup(
        &consolidated, [](const std::string* path) {
          std::error_code ec;
          std::filesystem::remove_all(*path, ec);
        });
    if (std::filesystem::exists(latest->path + "/manifest.json")) {  // sharded (fsdp)
      ASSIGN_OR_RETURN(CheckpointInfo info,
                       ConsolidateShardedCheckpoint(latest->path, consolidated));
      (void)info;
      source = consolidated;
    }
    ModelOptions options;
    options.lora = lora;
    std::shared_ptr<LanguageModel> model = BuildModel(m, options, job.train.seed);
    // The checkpoint holds the optimizer's state too (of the parameters that train).
    const std::unique_ptr<torch::optim::Optimizer> optimizer =
        MakeOptimizer(TrainableParameters(*model),
                      HyperFor(job.train.optimizer, job.train.weight_decay), job.train.lr);
    absl::StatusOr<std::optional<CheckpointInfo>> loaded =
        LoadLatestCheckpoint(source, *model, *optimizer);
    if (!loaded.ok()) return loaded.status();
    RETURN_IF_ERROR(ExportModel(m, lora, *model, merge_lora, out_dir));
    Log(absl::StrCat("exported ", lora.enabled() && !merge_lora ? "the LoRA adapter of " : "",
                     "step ", latest->step, " of ", checkpoint_dir, " to ", out_dir,
                     lora.enabled() && merge_lora ? " (LoRA merged)" : ""));
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

std::string DescribeCompute() {
  return absl::StrCat("LibTorch ", TorchVersionString(), CudaBuild() ? " (CUDA)" : "", "\n",
                      DescribeBlas(), "\n", DescribeMatmuls());
}

std::string SupportedDevices() { return CudaUsable() ? "cpu cuda" : "cpu"; }

void InstallSigtermHandler() {
  struct sigaction action = {};
  action.sa_handler = OnSigterm;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
}

absl::Status RunTrainer(const TrainerOptions& options) {
  try {
    return Train(options);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    std::replace(what.begin(), what.end(), '\n', ' ');
    return absl::InternalError(absl::StrCat("rank ", options.rank, ": LibTorch: ", what));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("rank ", options.rank, ": ", e.what()));
  }
}

}  // namespace trainyard::trainer
