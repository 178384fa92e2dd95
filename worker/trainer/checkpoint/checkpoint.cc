// WriteCheckpoint / LoadLatestCheckpoint (see checkpoint.h).
#include "worker/trainer/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {
namespace {

namespace fs = std::filesystem;

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

}  // namespace

absl::Status SyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot open", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Errno("cannot fsync", path);
  return absl::OkStatus();
}

absl::Status WriteSyncedArchive(const std::string& path,
                                const std::function<bool(torch::serialize::OutputArchive&)>& fill) {
  try {
    torch::serialize::OutputArchive archive;
    if (!fill(archive)) return absl::OkStatus();
    archive.save_to(path);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("cannot save '", path, "': ", e.what_without_backtrace()));
  }
  return SyncPath(path);
}

absl::Status WriteSyncedFile(const std::string& path, const std::string& content) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << content;
  f.close();
  if (!f) return Errno("cannot write", path);
  return SyncPath(path);
}

namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Errno("cannot read", path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::pair<std::string, torch::Tensor>> SortedParameters(torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model.named_parameters()) out.emplace_back(item.key(), item.value());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

at::Generator DefaultGenerator() { return at::detail::getDefaultCPUGenerator(); }

}  // namespace

torch::Tensor SaveRngState() {
  at::Generator generator = DefaultGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void RestoreRngState(const torch::Tensor& state) {
  at::Generator generator = DefaultGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

namespace {

// The device of the optimizer's parameters (the CPU when it has none).
torch::Device ParametersDevice(torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) return p.device();
  }
  return torch::kCPU;
}

absl::Status WriteStepDirectory(const std::string& tmp, int64_t step, torch::nn::Module& model,
                                torch::optim::Optimizer& optimizer, const MetaNotes& notes,
                                const ExtraState& extra) {
  const torch::Device device = ParametersDevice(optimizer);
  try {
    torch::serialize::OutputArchive archive;
    for (const auto& [name, p] : SortedParameters(model)) {
      archive.write(name, p.detach().to(torch::kCPU));
    }
    archive.save_to(tmp + "/model.pt");
    {
      // From the CPU, so that any host reads it; the device's own tensors back after.
      std::optional<OptimizerStateOnCpu> on_cpu;
      if (!device.is_cpu()) on_cpu.emplace(optimizer);
      torch::save(optimizer, tmp + "/optimizer.pt");
    }
    torch::save(SaveRngState(), tmp + "/rng.pt");
    if (!extra.empty()) {
      torch::serialize::OutputArchive amp;
      for (const auto& [name, t] : extra) amp.write(name, t.to(torch::kCPU));
      amp.save_to(tmp + "/amp.pt");
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("cannot save the checkpoint to '", tmp, "': ", e.what_without_backtrace()));
  }
  for (const char* file : {"/model.pt", "/optimizer.pt", "/rng.pt"}) {
    RETURN_IF_ERROR(SyncPath(tmp + file));
  }
  if (!extra.empty()) RETURN_IF_ERROR(SyncPath(tmp + "/amp.pt"));
  RETURN_IF_ERROR(
      WriteSyncedFile(tmp + "/meta.json", MetaJson(step, OptimizerName(optimizer), notes)));
  return SyncPath(tmp);
}

}  // namespace

std::string MetaJson(int64_t step, const std::string& optimizer, const MetaNotes& notes,
                     int pipeline_stages) {
  return absl::StrCat(
      "{\"step\": ", step, ", \"optimizer\": \"", optimizer, "\"",
      pipeline_stages > 0 ? absl::StrCat(", \"pipeline_stages\": ", pipeline_stages) : "",
      notes.eval_loss.has_value() && std::isfinite(*notes.eval_loss)
          ? absl::StrFormat(", \"eval_loss\": %.17g", *notes.eval_loss)
          : "",
      notes.settings.empty() ? "" : absl::StrCat(", \"settings\": ", notes.settings), "}\n");
}

absl::StatusOr<std::string> CheckpointSettings(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path + "/meta.json"));
  const nlohmann::json meta = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object()) {
    return absl::DataLossError(absl::StrCat("'", path, "/meta.json' is malformed"));
  }
  auto it = meta.find("settings");
  return it == meta.end() ? std::string() : it->dump();
}

absl::StatusOr<std::string> CheckpointOptimizer(const std::string& path) {
  ASSIGN_OR_RETURN(std::string meta, ReadFile(path + "/meta.json"));
  // Written by MetaJson; checkpoints from before train.optimizer say only the step: AdamW.
  const std::string key = "\"optimizer\": \"";
  const size_t at = meta.find(key);
  if (at == std::string::npos) return std::string("adamw");
  const size_t begin = at + key.size(), end = meta.find('"', begin);
  if (end == std::string::npos) {
    return absl::DataLossError(absl::StrCat("'", path, "/meta.json' is malformed"));
  }
  return meta.substr(begin, end - begin);
}

int64_t DirectoryBytes(const std::string& path) {
  int64_t bytes = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    if (entry.is_regular_file(ec)) bytes += static_cast<int64_t>(entry.file_size(ec));
  }
  return bytes;
}

absl::Status PublishLatest(const std::string& dir, const std::string& name) {
  const std::string latest_tmp = absl::StrCat(dir, "/.latest.tmp-", ::getpid());
  RETURN_IF_ERROR(WriteSyncedFile(latest_tmp, name + "\n"));
  if (::rename(latest_tmp.c_str(), (dir + "/latest").c_str()) != 0) {
    return Errno("cannot rename", latest_tmp);
  }
  return SyncPath(dir);
}

namespace {

// Every rank learns whether any rank failed; all return the first failure they know of.
absl::Status Agree(Communicator& world, absl::Status mine) {
  torch::Tensor failed = torch::tensor({mine.ok() ? 0.0 : 1.0}, torch::kDouble);
  world.AllReduceSum({failed})->Wait();
  if (!mine.ok()) return mine;
  if (failed.item<double>() > 0) {
    return absl::InternalError("another rank failed to write its part of the checkpoint");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointInfo> WriteCollectiveCheckpoint(const std::string& dir, int64_t step,
                                                         Communicator& world,
                                                         const CheckpointPartWriter& write_part,
                                                         const CheckpointPartWriter& finish) {
  const bool rank0 = world.rank() == 0;
  const std::string name = absl::StrCat("step-", step);
  const std::string final_path = dir + "/" + name;
  const std::string tmp = absl::StrCat(dir, "/.", name, ".tmp");
  // Written before by an earlier attempt at the same step (deterministic: the same state)?
  const bool exists = fs::exists(final_path + "/meta.json");
  world.Barrier();  // nobody renames before everyone has looked
  if (!exists) {
    absl::Status s;
    if (rank0) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp, ec);
      if (ec) s = absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", ec.message()));
    }
    RETURN_IF_ERROR(Agree(world, s));
    RETURN_IF_ERROR(Agree(world, write_part(tmp)));
    if (rank0) {
      s = finish(tmp);
      if (s.ok()) s = SyncPath(tmp);
      if (s.ok()) {
        std::error_code ec;
        fs::remove_all(final_path, ec);  // an incomplete leftover (no meta.json)
        if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
          s = absl::InternalError(absl::StrCat("cannot rename '", tmp, "'"));
        }
      }
      if (s.ok()) s = SyncPath(dir);
    }
    RETURN_IF_ERROR(Agree(world, s));
  }
  RETURN_IF_ERROR(Agree(world, rank0 ? PublishLatest(dir, name) : absl::OkStatus()));
  return CheckpointInfo{step, final_path, DirectoryBytes(final_path)};
}

absl::StatusOr<std::optional<CheckpointInfo>> FindLatestCheckpoint(const std::string& dir) {
  const std::string latest = dir + "/latest";
  if (!fs::exists(latest)) return std::nullopt;
  ASSIGN_OR_RETURN(std::string content, ReadFile(latest));
  absl::string_view name = absl::StripAsciiWhitespace(content);
  const std::string path = absl::StrCat(dir, "/", name);
  int64_t step = 0;
  if (!absl::ConsumePrefix(&name, "step-") || !absl::SimpleAtoi(name, &step) || step < 0) {
    return absl::DataLossError(absl::StrCat("'", latest, "' does not name a checkpoint"));
  }
  return CheckpointInfo{step, path, DirectoryBytes(path)};
}

absl::StatusOr<CheckpointInfo> WriteCheckpoint(const std::string& dir, int64_t step,
                                               torch::nn::Module& model,
                                               torch::optim::Optimizer& optimizer,
                                               const MetaNotes& notes, const ExtraState& extra) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
  const std::string name = absl::StrCat("step-", step);
  const std::string final_path = dir + "/" + name;
  if (!fs::exists(final_path + "/meta.json")) {
    const std::string tmp = absl::StrCat(dir, "/.", name, ".tmp-", ::getpid());
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", ec.message()));
    RETURN_IF_ERROR(WriteStepDirectory(tmp, step, model, optimizer, notes, extra));
    fs::remove_all(final_path, ec);  // an incomplete leftover (no meta.json) cannot be named
    if (::rename(tmp.c_str(), final_path.c_str()) != 0) return Errno("cannot rename", tmp);
    RETURN_IF_ERROR(SyncPath(dir));
  }
  RETURN_IF_ERROR(PublishLatest(dir, name));
  return CheckpointInfo{step, final_path, DirectoryBytes(final_path)};
}

namespace {

// A DDP checkpoint (model.pt, optimizer.pt); throws c10::Error.
absl::Status LoadWhole(const std::string& path, torch::nn::Module& model,
                       torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive archive;
  archive.load_from(path + "/model.pt", torch::Device(torch::kCPU));
  torch::NoGradGuard no_grad;
  for (auto& [param_name, p] : SortedParameters(model)) {
    torch::Tensor saved;
    archive.read(param_name, saved);
    if (!saved.sizes().equals(p.sizes())) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint '", path, "' does not fit the model: ", param_name));
    }
    p.copy_(saved);
  }
  torch::load(optimizer, path + "/optimizer.pt", torch::Device(torch::kCPU));
  const torch::Device device = ParametersDevice(optimizer);
  if (!device.is_cpu()) OptimizerStateTo(optimizer, device);
  return absl::OkStatus();
}

// A pipeline checkpoint (stage-<s>.pt, see pipeline.h): every parameter and its optimizer state
// by name, from whichever stage's file holds it; throws c10::Error.
absl::Status LoadStages(const std::string& path, torch::nn::Module& model,
                        torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> missing;
  std::map<const void*, std::string> names;
  for (const auto& item : model.named_parameters()) {
    missing[item.key()] = item.value();
    names[item.value().unsafeGetTensorImpl()] = item.key();
  }
  const auto& optimized = optimizer.param_groups().at(0).params();
  std::map<std::string, size_t> index;  // of the optimizer's parameters, by name
  for (size_t i = 0; i < optimized.size(); ++i) {
    index[names.at(optimized[i].unsafeGetTensorImpl())] = i;
  }
  std::vector<std::string> keys = SlotOptimizer::StateNames();
  for (const char* adamw : {"exp_avg", "exp_avg_sq"}) {
    if (std::find(keys.begin(), keys.end(), adamw) == keys.end()) keys.push_back(adamw);
  }
  for (int s = 0; fs::exists(absl::StrCat(path, "/stage-", s, ".pt")); ++s) {
    torch::serialize::InputArchive archive;
    archive.load_from(absl::StrCat(path, "/stage-", s, ".pt"), torch::Device(torch::kCPU));
    for (auto it = missing.begin(); it != missing.end();) {
      const auto& [param_name, p] = *it;
      torch::Tensor saved;
      if (!archive.try_read("param/" + param_name, saved)) {
        ++it;
        continue;
      }
      if (!saved.sizes().equals(p.sizes())) {
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint '", path, "' does not fit the model: ", param_name));
      }
      p.copy_(saved);
      auto optimized_at = index.find(param_name);
      torch::Tensor step;
      if (optimized_at != index.end() && archive.try_read("step/" + param_name, step)) {
        std::map<std::string, torch::Tensor> state;
        for (const std::string& key : keys) {
          torch::Tensor t;
          if (archive.try_read(absl::StrCat("state/", param_name, "/", key), t)) state[key] = t;
        }
        if (absl::Status st =
                SetParameterState(optimizer, optimized_at->second, state, step.item<int64_t>());
            !st.ok()) {
          return absl::DataLossError(
              absl::StrCat("checkpoint '", path, "', parameter ", param_name, ": ", st.message()));
        }
      }
      it = missing.erase(it);
    }
  }
  if (!missing.empty()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint '", path, "' lacks parameter ", missing.begin()->first));
  }
  const torch::Device device = ParametersDevice(optimizer);
  if (!device.is_cpu()) OptimizerStateTo(optimizer, device);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::optional<CheckpointInfo>> LoadLatestCheckpoint(
    const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
    ExtraState* extra) {
  ASSIGN_OR_RETURN(std::optional<CheckpointInfo> latest, FindLatestCheckpoint(dir));
  if (!latest.has_value()) return std::nullopt;
  const std::string& path = latest->path;
  const int64_t step = latest->step;
  if (fs::exists(path + "/manifest.json")) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", path,
                     "' is sharded (written by strategy fsdp): resume it with fsdp, or "
                     "consolidate it first with trainyard-trainer --consolidate-checkpoint"));
  }
  ASSIGN_OR_RETURN(const std::string written_by, CheckpointOptimizer(path));
  if (written_by != OptimizerName(optimizer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", path, "' was written with train.optimizer ", written_by,
                     "; this job's is ", OptimizerName(optimizer)));
  }
  try {
    if (fs::exists(path + "/stage-0.pt")) {
      RETURN_IF_ERROR(LoadStages(path, model, optimizer));
    } else {
      RETURN_IF_ERROR(LoadWhole(path, model, optimizer));
    }
    torch::Tensor rng;
    torch::load(rng, path + "/rng.pt");
    RestoreRngState(rng);
    if (extra != nullptr) {
      extra->clear();
      if (fs::exists(path + "/amp.pt")) {
        torch::serialize::InputArchive amp;
        amp.load_from(path + "/amp.pt", torch::Device(torch::kCPU));
        for (const std::string& key : amp.keys()) {
          torch::Tensor t;
          amp.read(key, t);
          extra->emplace_back(key, t);
        }
      }
    }
  } catch (const c10::Error& e) {
    return absl::DataLossError(
        absl::StrCat("cannot load checkpoint '", path, "': ", e.what_without_backtrace()));
  }
  return CheckpointInfo{step, path, DirectoryBytes(path)};
}

}  // namespace trainyard::trainer
