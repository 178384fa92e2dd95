// Sharded FSDP checkpoints (see fsdp_checkpoint.h).
#include "worker/trainer/checkpoint/fsdp_checkpoint.h"
#include "worker/trainer/runtime/torch_compat.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/trainer/checkpoint/retention.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kFormat[] = "trainyard-fsdp-v1";

std::string ShardFile(const std::string& dir, int rank, int count) {
  return absl::StrCat(dir, "/shard-", rank, "-of-", count, ".pt");
}

json ManifestJson(const FsdpModel& fsdp, int64_t step, double lr) {
  const OptimizerHyper& hyper = fsdp.optimizer();
  json units = json::array();
  for (const FsdpLayout::Unit& u : fsdp.layout().units) {
    json params = json::array();
    for (const FsdpLayout::Param& p : u.params) {
      params.push_back(
          {{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}, {"index", p.index}});
    }
    json unit = {{"numel", u.numel}, {"params", params}};
    if (u.frozen) unit["frozen"] = true;  // LoRA's base weights: no optimizer state
    units.push_back(std::move(unit));
  }
  return {{"format", kFormat},
          {"step", step},
          {"shard_count", fsdp.shard_count()},
          {"optimizer", Name(hyper.kind)},
          {"adam",  // the optimizer's hyper-parameters (named so before train.optimizer)
           {{"lr", lr},
            {"beta1", hyper.beta1},
            {"beta2", hyper.beta2},
            {"eps", hyper.eps},
            {"weight_decay", hyper.weight_decay}}},
          {"units", units}};
}

struct Manifest {
  int64_t step = 0;
  int shard_count = 0;
  OptimizerHyper optimizer;  // checkpoints before train.optimizer: AdamW
  double lr = 0;
  FsdpLayout layout;
};

absl::StatusOr<Manifest> ReadManifest(const std::string& path) {
  const std::string file = path + "/manifest.json";
  std::ifstream f(file);
  if (!f) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", path, "' has no manifest.json: it is not a sharded (fsdp) checkpoint"));
  }
  try {
    json j = json::parse(f);
    if (j.at("format").get<std::string>() != kFormat) {
      return absl::DataLossError(absl::StrCat("'", file, "': unknown format"));
    }
    Manifest m;
    m.step = j.at("step").get<int64_t>();
    m.shard_count = j.at("shard_count").get<int>();
    if (m.shard_count < 1) return absl::DataLossError(absl::StrCat("'", file, "': shard_count"));
    const std::string optimizer = j.value("optimizer", "adamw");
    bool known = false;
    for (OptimizerKind k : {OptimizerKind::kAdamW, OptimizerKind::kAdafactor, OptimizerKind::kLion,
                            OptimizerKind::kAdamW8bit}) {
      if (optimizer == Name(k)) {
        m.optimizer.kind = k;
        known = true;
      }
    }
    if (!known) {
      return absl::DataLossError(absl::StrCat("'", file, "': unknown optimizer ", optimizer));
    }
    const json& a = j.at("adam");
    m.lr = a.at("lr").get<double>();
    m.optimizer.beta1 = a.at("beta1").get<double>();
    m.optimizer.beta2 = a.at("beta2").get<double>();
    m.optimizer.eps = a.at("eps").get<double>();
    m.optimizer.weight_decay = a.at("weight_decay").get<double>();
    for (const json& ju : j.at("units")) {
      FsdpLayout::Unit u;
      u.numel = ju.at("numel").get<int64_t>();
      u.frozen = ju.value("frozen", false);
      for (const json& jp : ju.at("params")) {
        FsdpLayout::Param p;
        p.name = jp.at("name").get<std::string>();
        p.shape = jp.at("shape").get<std::vector<int64_t>>();
        p.offset = jp.at("offset").get<int64_t>();
        p.index = jp.at("index").get<int>();
        u.params.push_back(std::move(p));
      }
      m.layout.units.push_back(std::move(u));
    }
    return m;
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("'", file, "': ", e.what()));
  }
}

// The first difference between a checkpoint's layout and the model's, or "".
std::string LayoutDifference(const FsdpLayout& saved, const FsdpLayout& model) {
  auto frozen = [](const FsdpLayout& l) {
    for (const auto& u : l.units) {
      if (u.frozen) return true;
    }
    return false;
  };
  if (frozen(saved) != frozen(model)) {
    return frozen(saved) ? "it was written with train.lora (frozen base weights), the job has none"
                         : "it was written without train.lora, the job has it";
  }
  if (saved.units.size() != model.units.size()) {
    return absl::StrCat(saved.units.size(), " units saved, the model has ", model.units.size());
  }
  for (size_t u = 0; u < saved.units.size(); ++u) {
    const auto& a = saved.units[u];
    const auto& b = model.units[u];
    if (a.params.size() != b.params.size() || a.numel != b.numel) {
      return absl::StrCat("unit ", u, " differs (", a.numel, " vs ", b.numel, " elements)");
    }
    if (a.frozen != b.frozen) {
      return absl::StrCat("unit ", u, " is ", a.frozen ? "frozen" : "trained",
                          " in the checkpoint, ", b.frozen ? "frozen" : "trained",
                          " in the model (train.lora differs)");
    }
    for (size_t k = 0; k < a.params.size(); ++k) {
      if (a.params[k].name != b.params[k].name || a.params[k].shape != b.params[k].shape ||
          a.params[k].offset != b.params[k].offset) {
        return absl::StrCat("parameter ", b.params[k].name, " differs");
      }
    }
  }
  return "";
}

// The optimizer state of flat buffer `u` in a shard file, by name (SlotOptimizer::State).
std::map<std::string, torch::Tensor> ReadOptimizerState(torch::serialize::InputArchive& archive,
                                                        size_t u) {
  std::map<std::string, torch::Tensor> state;
  for (const std::string& name : SlotOptimizer::StateNames()) {
    torch::Tensor t;
    if (archive.try_read(absl::StrCat("u", u, ".", name), t)) state[name] = t;
  }
  return state;
}

// Copies the elements of `old_shard` (shard `k` of `old_count` over a unit of `numel`) that fall
// into `new_shard` (shard `me` of `new_count`).
void CopyOverlap(const torch::Tensor& old_shard, int k, int old_count, torch::Tensor& new_shard,
                 int me, int new_count, int64_t numel) {
  const int64_t os = (numel + old_count - 1) / old_count;
  const int64_t ns = (numel + new_count - 1) / new_count;
  const int64_t begin = std::max(k * os, me * ns);
  const int64_t end = std::min({(k + 1) * os, (me + 1) * ns, numel});
  if (begin >= end) return;
  new_shard.narrow(0, begin - me * ns, end - begin)
      .copy_(old_shard.narrow(0, begin - k * os, end - begin));
}

}  // namespace

absl::StatusOr<CheckpointInfo> WriteShardedCheckpoint(const std::string& dir, int64_t step,
                                                      FsdpModel& fsdp, Communicator& world,
                                                      double lr, const MetaNotes& notes) {
  const bool rank0 = world.rank() == 0;
  auto write_shard = [&](const std::string& tmp) -> absl::Status {
    if (!fsdp.writes_shards()) return absl::OkStatus();
    return WriteSyncedArchive(ShardFile(tmp, fsdp.shard_rank(), fsdp.shard_count()),
                              [&](torch::serialize::OutputArchive& archive) {
                                FsdpShardState state = fsdp.ExportState();
                                for (size_t u = 0; u < state.params.size(); ++u) {
                                  archive.write(absl::StrCat("u", u, ".param"), state.params[u]);
                                  for (const auto& [key, t] : state.optimizer[u]) {
                                    archive.write(absl::StrCat("u", u, ".", key), t);
                                  }
                                }
                                archive.write("adam_step",
                                              torch::tensor({state.step}, torch::kLong));
                                if (rank0) archive.write("rng", SaveRngState());
                                return true;
                              });
  };
  auto finish = [&](const std::string& tmp) -> absl::Status {
    RETURN_IF_ERROR(
        WriteSyncedFile(tmp + "/manifest.json", ManifestJson(fsdp, step, lr).dump(1) + "\n"));
    return WriteSyncedFile(tmp + "/meta.json", MetaJson(step, Name(fsdp.optimizer().kind), notes));
  };
  return WriteCollectiveCheckpoint(dir, step, world, write_shard, finish);
}

absl::StatusOr<std::optional<CheckpointInfo>> LoadLatestShardedCheckpoint(const std::string& dir,
                                                                          FsdpModel& fsdp) {
  ASSIGN_OR_RETURN(std::optional<CheckpointInfo> latest, FindLatestCheckpoint(dir));
  if (!latest.has_value()) return std::nullopt;
  const std::string& path = latest->path;
  ASSIGN_OR_RETURN(Manifest m, ReadManifest(path));
  const std::string diff = LayoutDifference(m.layout, fsdp.layout());
  if (!diff.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", path, "' does not fit the model: ", diff));
  }
  if (m.optimizer.kind != fsdp.optimizer().kind) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", path, "' was written with train.optimizer ",
                     Name(m.optimizer.kind), "; this job's is ", Name(fsdp.optimizer().kind)));
  }
  const int me = fsdp.shard_rank(), count = fsdp.shard_count();
  const int units = fsdp.num_flats();
  FsdpShardState state;
  for (int u = 0; u < units; ++u) state.params.push_back(torch::zeros({fsdp.shard_numel(u)}));
  state.optimizer.resize(units);
  try {
    for (int k = 0; k < m.shard_count; ++k) {
      // Same shard count: only this rank's own file overlaps, and its state is taken as it is.
      if (m.shard_count == count && k != me) continue;
      torch::serialize::InputArchive archive;
      archive.load_from(ShardFile(path, k, m.shard_count));
      torch::Tensor step_t;
      archive.read("adam_step", step_t);
      state.step = step_t.item<int64_t>();
      torch::Tensor rng;
      if (k == 0 && archive.try_read("rng", rng)) RestoreRngState(rng);
      for (int u = 0; u < units; ++u) {
        const int64_t numel = fsdp.layout().units[u].numel;
        torch::Tensor t;
        archive.read(absl::StrCat("u", u, ".param"), t);
        CopyOverlap(t, k, m.shard_count, state.params[u], me, count, numel);
        std::map<std::string, torch::Tensor> saved = ReadOptimizerState(archive, u);
        if (m.shard_count == count) {
          state.optimizer[u] = std::move(saved);
          continue;
        }
        // Another shard count: elementwise moments (8-bit ones dequantized, to be quantized in
        // the new blocks) copied where the shards overlap; Adafactor's factors are whole.
        const int64_t old_shard = (numel + m.shard_count - 1) / m.shard_count;
        absl::StatusOr<std::map<std::string, torch::Tensor>> elementwise =
            SlotOptimizer::Elementwise(m.optimizer.kind, OptimizerParams(m.layout.units[u]),
                                       k * old_shard, old_shard, saved);
        if (!elementwise.ok()) {
          return absl::DataLossError(absl::StrCat("cannot load checkpoint '", path, "': unit ", u,
                                                  " of shard ", k, ": ",
                                                  elementwise.status().message()));
        }
        for (const auto& [key, old] : *elementwise) {
          torch::Tensor& mine = state.optimizer[u][key];
          if (key == "factors") {
            mine = old;
            continue;
          }
          if (!mine.defined()) mine = torch::zeros({fsdp.shard_numel(u)});
          CopyOverlap(old, k, m.shard_count, mine, me, count, numel);
        }
      }
    }
  } catch (const c10::Error& e) {
    return absl::DataLossError(
        absl::StrCat("cannot load checkpoint '", path, "': ", e.what_without_backtrace()));
  }
  const absl::Status imported = fsdp.ImportState(state);
  if (!imported.ok()) {
    return absl::DataLossError(
        absl::StrCat("cannot load checkpoint '", path, "': ", imported.message()));
  }
  return latest;
}

absl::StatusOr<WholeModel> Unflatten(const FsdpLayout& layout,
                                     const std::vector<torch::Tensor>& flat,
                                     const std::vector<std::map<std::string, torch::Tensor>>& state,
                                     const OptimizerHyper& hyper, double lr, int64_t step) {
  // Parameters in model registration order (the layout's indices), as the DDP trainer's
  // optimizer lists them, and the state of each (its slice of the elementwise moments, its own
  // factors).
  int total = 0;
  for (const auto& u : layout.units) total += static_cast<int>(u.params.size());
  WholeModel out;
  out.params.resize(total);
  std::vector<std::map<std::string, torch::Tensor>> param_state(total);
  std::vector<bool> trained(total, false);
  for (size_t u = 0; u < layout.units.size(); ++u) {
    int64_t factor_offset = 0;
    for (const FsdpLayout::Param& p : layout.units[u].params) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      out.params.at(p.index) = {
          p.name, flat[u].narrow(0, p.offset, n).view(p.shape).clone().set_requires_grad(true)};
      trained.at(p.index) = !layout.units[u].frozen;
      for (const auto& [key, whole] : state[u]) {
        if (key == "factors") {
          const int64_t f = SlotOptimizer::FactorNumel({{p.shape, 0}});
          param_state.at(p.index)[key] = whole.narrow(0, factor_offset, f).clone();
          factor_offset += f;
        } else {
          param_state.at(p.index)[key] = whole.narrow(0, p.offset, n).view(p.shape).clone();
        }
      }
    }
  }
  // Over the parameters that train, in registration order, as the DDP trainer's (LoRA: the
  // adapters).
  std::vector<torch::Tensor> optimized;
  std::vector<int> optimized_index;
  for (int i = 0; i < total; ++i) {
    if (!trained[i]) continue;
    optimized.push_back(out.params[i].second);
    optimized_index.push_back(i);
  }
  out.optimizer = MakeOptimizer(optimized, hyper, lr);
  if (step == 0) return out;
  for (size_t j = 0; j < optimized.size(); ++j) {
    const std::string& name = out.params[optimized_index[j]].first;
    if (param_state[optimized_index[j]].empty()) {
      return absl::DataLossError(absl::StrCat(name, " has no optimizer state"));
    }
    const absl::Status s =
        SetParameterState(*out.optimizer, j, param_state[optimized_index[j]], step);
    if (!s.ok()) return absl::DataLossError(absl::StrCat(name, ": ", s.message()));
  }
  return out;
}

absl::StatusOr<WholeModel> GatherWhole(FsdpModel& fsdp, double lr) {
  torch::NoGradGuard no_grad;
  const FsdpShardState shards = fsdp.ExportState();
  Communicator& group = fsdp.shard_group();
  const FsdpLayout& layout = fsdp.layout();
  // Every rank's shard of a flat buffer, put together and cut to its unpadded length (an empty
  // buffer, the same on every rank, sends nothing: Gloo divides by the size).
  auto whole = [&](const torch::Tensor& shard, int64_t numel) {
    if (shard.numel() == 0) return torch::zeros({0}, torch::kFloat);
    return torch::cat(group.AllGather(shard.contiguous())).narrow(0, 0, numel);
  };
  std::vector<torch::Tensor> flat;
  std::vector<std::map<std::string, torch::Tensor>> state(layout.units.size());
  for (int i = 0; i < fsdp.num_flats(); ++i) {
    const int64_t numel = layout.units[i].numel;
    flat.push_back(whole(shards.params[i], numel));
    // (Decided by what every rank of the group knows alike: an 8-bit shard of padding alone has
    // no state of its own, but takes part in the gathers, with Elementwise's zeros.)
    if (layout.units[i].frozen || shards.step == 0) continue;
    ASSIGN_OR_RETURN(auto elementwise, SlotOptimizer::Elementwise(
                                           fsdp.optimizer().kind, OptimizerParams(layout.units[i]),
                                           int64_t{fsdp.shard_rank()} * fsdp.shard_numel(i),
                                           fsdp.shard_numel(i), shards.optimizer[i]));
    for (auto& [key, t] : elementwise) {
      // Adafactor's factors are whole in every shard already.
      state[i][key] = key == "factors" ? t : whole(t.reshape({-1}), numel);
    }
  }
  return Unflatten(layout, flat, state, fsdp.optimizer(), lr, shards.step);
}

absl::Status ImportParameterStates(
    FsdpModel& fsdp, const std::map<std::string, std::map<std::string, torch::Tensor>>& states,
    int64_t step) {
  torch::NoGradGuard no_grad;
  if (step == 0) return absl::OkStatus();
  FsdpShardState shards = fsdp.ExportState();
  shards.step = step;
  const FsdpLayout& layout = fsdp.layout();
  for (int i = 0; i < fsdp.num_flats(); ++i) {
    const FsdpLayout::Unit& unit = layout.units[i];
    if (unit.frozen) continue;
    // The buffer's elementwise state laid out as its parameters are, and its factors in order.
    std::map<std::string, torch::Tensor> flat;
    std::vector<torch::Tensor> factors;
    for (const FsdpLayout::Param& p : unit.params) {
      auto it = states.find(p.name);
      if (it == states.end() || it->second.empty()) {
        return absl::DataLossError(absl::StrCat("no optimizer state for ", p.name));
      }
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      ASSIGN_OR_RETURN(
          auto elementwise,
          SlotOptimizer::Elementwise(fsdp.optimizer().kind, {{p.shape, 0}}, 0, n, it->second));
      for (auto& [key, t] : elementwise) {
        if (key == "factors") {
          factors.push_back(t.reshape({-1}));
          continue;
        }
        torch::Tensor& whole = flat[key];
        if (!whole.defined()) whole = torch::zeros({fsdp.padded_numel(i)}, torch::kFloat);
        whole.narrow(0, p.offset, n).copy_(t.reshape({-1}));
      }
    }
    std::map<std::string, torch::Tensor>& mine = shards.optimizer[i];
    mine.clear();
    for (const auto& [key, whole] : flat) {
      mine[key] =
          whole.narrow(0, int64_t{fsdp.shard_rank()} * fsdp.shard_numel(i), fsdp.shard_numel(i))
              .clone();
    }
    if (!factors.empty()) mine["factors"] = torch::cat(factors);
  }
  return fsdp.ImportState(shards);
}

absl::StatusOr<CheckpointInfo> ConsolidateShardedCheckpoint(const std::string& sharded,
                                                            const std::string& out_dir) {
  ASSIGN_OR_RETURN(Manifest m, ReadManifest(sharded));
  const size_t units = m.layout.units.size();
  // Per flat buffer: the parameters, the elementwise moments (8-bit ones dequantized) and
  // Adafactor's factors (whole in every shard).
  std::vector<torch::Tensor> flat(units);
  std::vector<std::map<std::string, torch::Tensor>> flat_state(units);
  for (size_t u = 0; u < units; ++u) flat[u] = torch::zeros({m.layout.units[u].numel});
  int64_t optimizer_step = 0;
  torch::Tensor rng;
  const std::string name = absl::StrCat("step-", m.step);
  const std::string tmp = absl::StrCat(out_dir, "/.", name, ".tmp-", ::getpid());
  const std::string final_path = out_dir + "/" + name;
  try {
    for (int k = 0; k < m.shard_count; ++k) {
      torch::serialize::InputArchive archive;
      archive.load_from(ShardFile(sharded, k, m.shard_count));
      torch::Tensor step_t;
      archive.read("adam_step", step_t);
      optimizer_step = step_t.item<int64_t>();
      if (k == 0) archive.read("rng", rng);
      for (size_t u = 0; u < units; ++u) {
        const int64_t numel = m.layout.units[u].numel;
        torch::Tensor t;
        archive.read(absl::StrCat("u", u, ".param"), t);
        CopyOverlap(t, k, m.shard_count, flat[u], 0, 1, numel);
        const int64_t old_shard = (numel + m.shard_count - 1) / m.shard_count;
        absl::StatusOr<std::map<std::string, torch::Tensor>> elementwise =
            SlotOptimizer::Elementwise(m.optimizer.kind, OptimizerParams(m.layout.units[u]),
                                       k * old_shard, old_shard, ReadOptimizerState(archive, u));
        if (!elementwise.ok()) {
          return absl::DataLossError(absl::StrCat("cannot consolidate '", sharded, "': unit ", u,
                                                  " of shard ", k, ": ",
                                                  elementwise.status().message()));
        }
        for (const auto& [key, old] : *elementwise) {
          torch::Tensor& whole = flat_state[u][key];
          if (key == "factors") {
            whole = old;
            continue;
          }
          if (!whole.defined()) whole = torch::zeros({numel});
          CopyOverlap(old, k, m.shard_count, whole, 0, 1, numel);
        }
      }
    }
    absl::StatusOr<WholeModel> whole =
        Unflatten(m.layout, flat, flat_state, m.optimizer, m.lr, optimizer_step);
    if (!whole.ok()) {
      return absl::DataLossError(
          absl::StrCat("cannot consolidate '", sharded, "': ", whole.status().message()));
    }
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", ec.message()));
    torch::serialize::OutputArchive model;
    for (const auto& [param_name, p] : whole->params) model.write(param_name, p.detach());
    model.save_to(tmp + "/model.pt");
    torch::save(*whole->optimizer, tmp + "/optimizer.pt");
    torch::save(rng, tmp + "/rng.pt");
  } catch (const c10::Error& e) {
    return absl::DataLossError(
        absl::StrCat("cannot consolidate '", sharded, "': ", e.what_without_backtrace()));
  }
  for (const char* file : {"/model.pt", "/optimizer.pt", "/rng.pt"}) {
    RETURN_IF_ERROR(SyncPath(tmp + file));
  }
  // (A copy without meta.json records none; the manifest decides whether it consolidates.)
  MetaNotes notes;
  if (fs::exists(sharded + "/meta.json")) {
    ASSIGN_OR_RETURN(notes.settings, CheckpointSettings(sharded));
    notes.eval_loss = CheckpointEvalLoss(sharded);
  }
  RETURN_IF_ERROR(
      WriteSyncedFile(tmp + "/meta.json", MetaJson(m.step, Name(m.optimizer.kind), notes)));
  RETURN_IF_ERROR(SyncPath(tmp));
  std::error_code ec;
  fs::remove_all(final_path, ec);
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename '", tmp, "'"));
  }
  RETURN_IF_ERROR(SyncPath(out_dir));
  RETURN_IF_ERROR(PublishLatest(out_dir, name));
  return CheckpointInfo{m.step, final_path, DirectoryBytes(final_path)};
}

}  // namespace trainyard::trainer
