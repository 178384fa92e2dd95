#include "worker/trainer/io/hf_checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace trainyard::trainer {
namespace {

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool IsFile(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

std::vector<ExpectedTensor> LlamaTensors(const LlamaConfig& c) {
  const int64_t d = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim, f = c.intermediate_size;
  std::vector<ExpectedTensor> out = {{"model.embed_tokens.weight", {c.vocab_size, d}}};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = absl::StrCat("model.layers.", i, ".");
    out.push_back({l + "input_layernorm.weight", {d}});
    out.push_back({l + "self_attn.q_proj.weight", {q, d}});
    out.push_back({l + "self_attn.k_proj.weight", {kv, d}});
    out.push_back({l + "self_attn.v_proj.weight", {kv, d}});
    if (c.qkv_bias) {
      out.push_back({l + "self_attn.q_proj.bias", {q}});
      out.push_back({l + "self_attn.k_proj.bias", {kv}});
      out.push_back({l + "self_attn.v_proj.bias", {kv}});
    }
    out.push_back({l + "self_attn.o_proj.weight", {d, q}});
    out.push_back({l + "post_attention_layernorm.weight", {d}});
    out.push_back({l + "mlp.gate_proj.weight", {f, d}});
    out.push_back({l + "mlp.up_proj.weight", {f, d}});
    out.push_back({l + "mlp.down_proj.weight", {d, f}});
  }
  out.push_back({"model.norm.weight", {d}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, d}});
  return out;
}

absl::StatusOr<std::unique_ptr<HfCheckpoint>> HfCheckpoint::Open(const std::string& dir) {
  std::unique_ptr<HfCheckpoint> ckpt(new HfCheckpoint());
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::vector<std::string> shards;
  std::map<std::string, std::string> placed;  // tensor -> shard, from the index
  if (IsFile(index_path)) {
    auto text = ReadSmallFile(index_path);
    if (!text.ok()) return text.status();
    auto index = ParseSafetensorsIndex(*text, index_path);
    if (!index.ok()) return index.status();
    placed = *std::move(index);
    std::set<std::string> names;
    for (const auto& [tensor, shard] : placed) names.insert(shard);
    shards.assign(names.begin(), names.end());
  } else if (IsFile(dir + "/model.safetensors")) {
    shards = {"model.safetensors"};
  } else {
    return absl::NotFoundError(
        absl::StrCat(dir, ": neither model.safetensors nor ", "model.safetensors.index.json"));
  }
  for (const std::string& shard : shards) {
    auto file = SafetensorsFile::Open(dir + "/" + shard);
    if (!file.ok()) return file.status();
    const SafetensorsFile* f = file->get();
    for (const SafetensorsTensor& t : f->header().tensors) {
      auto [it, added] = ckpt->where_.try_emplace(t.name, Located{f, &t});
      if (!added) {
        return absl::InvalidArgumentError(
            absl::StrCat(f->path(), ": tensor ", t.name, " is also in ", it->second.file->path()));
      }
      if (!placed.empty()) {
        auto p = placed.find(t.name);
        if (p == placed.end() || p->second != shard) {
          return absl::InvalidArgumentError(
              absl::StrCat(f->path(), ": tensor ", t.name, " is not where ", index_path,
                           " puts it (", p == placed.end() ? "nowhere" : p->second, ")"));
        }
      }
    }
    ckpt->files_.push_back(*std::move(file));
  }
  for (const auto& [tensor, shard] : placed) {
    if (ckpt->where_.count(tensor) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir, "/", shard, ": tensor ", tensor, " is missing (", index_path, " puts it there)"));
    }
  }
  return ckpt;
}

HfCheckpoint::Located HfCheckpoint::Find(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? Located{} : it->second;
}

absl::Status HfCheckpoint::Check(const std::vector<ExpectedTensor>& expected) const {
  std::set<std::string> known;
  for (const ExpectedTensor& e : expected) {
    known.insert(e.name);
    const Located at = Find(e.name);
    if (at.tensor == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", e.name, " ", ShapeText(e.shape),
                       " is missing from the checkpoint (", files_.size(), " file(s), first ",
                       files_.empty() ? std::string("none") : files_[0]->path(), ")"));
    }
    if (at.tensor->shape != e.shape) {
      return absl::InvalidArgumentError(absl::StrCat(at.file->path(), ": tensor ", e.name,
                                                     " has shape ", ShapeText(at.tensor->shape),
                                                     ", the model needs ", ShapeText(e.shape)));
    }
    const SafetensorsDtype dt = at.tensor->dtype;
    if (dt != SafetensorsDtype::kF32 && dt != SafetensorsDtype::kF16 &&
        dt != SafetensorsDtype::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat(at.file->path(), ": tensor ", e.name, " is ",
                                                     SafetensorsDtypeName(dt),
                                                     ", not F32, F16 or BF16"));
    }
  }
  for (const auto& [name, at] : where_) {
    // A tied model saved with its head too (some exporters do) is still the same model.
    if (known.count(name) == 0 && name != "lm_head.weight") {
      return absl::InvalidArgumentError(absl::StrCat(
          at.file->path(), ": tensor ", name, " is not part of the model (another architecture?)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace trainyard::trainer
