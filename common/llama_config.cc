// config.json of Llama-family models and PEFT's adapter_config.json (see llama_config.h).
#include "common/llama_config.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <sstream>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace trainyard {

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read"));
  std::ostringstream out;
  out << in.rdbuf();
  if (out.str().size() > (64 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": larger than 64 MiB"));
  }
  return out.str();
}

absl::StatusOr<LlamaConfig> ParseLlamaConfig(absl::string_view json, const std::string& file) {
  auto bad = [&file](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", what...));
  };
  const nlohmann::json j =
      nlohmann::json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  LlamaConfig c;
  if (auto t = j.find("model_type"); t != j.end()) {
    if (!t->is_string() || (*t != "llama" && *t != "mistral" && *t != "qwen2")) {
      return bad("model_type: ", t->dump(),
                 " is not a Llama-family model (llama, mistral or qwen2)");
    }
    c.model_type = t->get<std::string>();
  }
  const bool qwen2 = c.model_type == "qwen2";
  c.qkv_bias = qwen2;
  auto count = [&](const char* field, int64_t* out, bool required) -> absl::Status {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) {
      if (required) return bad(field, ": required");
      return absl::OkStatus();
    }
    if (!it->is_number_unsigned() || it->get<uint64_t>() < 1 ||
        it->get<uint64_t>() > (uint64_t{1} << 31)) {
      return bad(field, ": expected a count in 1..2^31, got ", it->dump());
    }
    *out = static_cast<int64_t>(it->get<uint64_t>());
    return absl::OkStatus();
  };
  auto number = [&](const nlohmann::json& obj, const char* field, double* out) -> absl::Status {
    auto it = obj.find(field);
    if (it == obj.end() || it->is_null()) return absl::OkStatus();
    if (!it->is_number() || !(it->get<double>() > 0)) {
      return bad(field, ": expected a positive number, got ", it->dump());
    }
    *out = it->get<double>();
    return absl::OkStatus();
  };
  for (const auto& [field, out, required] :
       {std::tuple<const char*, int64_t*, bool>{"vocab_size", &c.vocab_size, true},
        {"hidden_size", &c.hidden_size, true},
        {"intermediate_size", &c.intermediate_size, true},
        {"num_hidden_layers", &c.num_hidden_layers, true},
        {"num_attention_heads", &c.num_attention_heads, true},
        {"num_key_value_heads", &c.num_key_value_heads, false},
        {"head_dim", &c.head_dim, false},
        {"max_position_embeddings", &c.max_position_embeddings, false}}) {
    if (absl::Status s = count(field, out, required); !s.ok()) return s;
  }
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return bad("num_key_value_heads: ", c.num_key_value_heads,
               " does not divide num_attention_heads (", c.num_attention_heads, ")");
  }
  if (qwen2) c.head_dim = 0;  // Qwen2 has none: hidden_size / num_attention_heads
  if (c.head_dim == 0) {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return bad("num_attention_heads: ", c.num_attention_heads, " does not divide hidden_size (",
                 c.hidden_size, ")");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (absl::Status s = number(j, "rope_theta", &c.rope_theta); !s.ok()) return s;
  if (absl::Status s = number(j, "rms_norm_eps", &c.rms_norm_eps); !s.ok()) return s;
  if (auto t = j.find("tie_word_embeddings"); t != j.end() && !t->is_null()) {
    if (!t->is_boolean()) return bad("tie_word_embeddings: expected true or false");
    c.tie_word_embeddings = t->get<bool>();
  }
  // What the model computes and trainyard does not: refused, naming the field, rather than trained
  // as something else.
  if (auto t = j.find("hidden_act"); t != j.end() && !t->is_null()) {
    static const std::pair<const char*, const char*> kActivations[] = {
        {"silu", "silu"},
        {"swish", "silu"},
        {"gelu", "gelu"},
        {"gelu_pytorch_tanh", "gelu_pytorch_tanh"},
        {"gelu_new", "gelu_pytorch_tanh"},
        {"relu", "relu"}};
    auto known = std::find_if(std::begin(kActivations), std::end(kActivations),
                              [&](const auto& a) { return t->is_string() && *t == a.first; });
    if (known == std::end(kActivations)) {
      return bad("hidden_act: ", t->dump(),
                 " is not supported (silu, gelu, gelu_pytorch_tanh, gelu_new or relu)");
    }
    c.hidden_act = known->second;
  }
  if (auto t = j.find("sliding_window"); t != j.end() && !t->is_null()) {
    if (!t->is_number_unsigned() || t->get<uint64_t>() < 1 ||
        t->get<uint64_t>() > (uint64_t{1} << 31)) {
      return bad("sliding_window: expected null or a count in 1..2^31, got ", t->dump());
    }
    c.sliding_window = static_cast<int64_t>(t->get<uint64_t>());
  }
  if (qwen2) {
    // Qwen2's window applies only with use_sliding_window, and then only to the layers from
    // max_window_layers on: not implemented.
    if (auto t = j.find("use_sliding_window"); t != j.end() && !t->is_null()) {
      if (!t->is_boolean()) return bad("use_sliding_window: expected true or false");
      if (t->get<bool>()) {
        return bad("use_sliding_window: true is not supported for qwen2 (its per-layer windows)");
      }
    }
    if (auto t = j.find("max_window_layers");
        t != j.end() && t->is_number_unsigned() && t->get<uint64_t>() <= (uint64_t{1} << 31)) {
      c.max_window_layers = static_cast<int64_t>(t->get<uint64_t>());
    }
    c.sliding_window = 0;
  }
  for (const char* field : {"attention_bias", "mlp_bias"}) {
    if (auto t = j.find(field); t != j.end() && t->is_boolean() && t->get<bool>()) {
      return bad(field, ": true is not supported (biases are implemented only on Qwen2's q/k/v)");
    }
  }
  if (auto t = j.find("torch_dtype"); t != j.end() && t->is_string()) {
    c.torch_dtype = t->get<std::string>();
  }
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    if (!rs->is_object()) return bad("rope_scaling: expected an object or null");
    auto type = rs->find("rope_type");
    if (type == rs->end()) type = rs->find("type");
    if (type == rs->end() || !type->is_string()) return bad("rope_scaling: no rope_type");
    c.rope_scaling_type = type->get<std::string>();
    if (c.rope_scaling_type == "default") {
      c.rope_scaling_type.clear();
    } else if (c.rope_scaling_type != "linear" && c.rope_scaling_type != "dynamic" &&
               c.rope_scaling_type != "llama3") {
      return bad("rope_scaling.rope_type: \"", c.rope_scaling_type,
                 "\" is not supported (linear, dynamic or llama3)");
    }
    if (!c.rope_scaling_type.empty()) {
      if (rs->find("factor") == rs->end()) return bad("rope_scaling.factor: required");
      if (absl::Status s = number(*rs, "factor", &c.rope_scaling_factor); !s.ok()) return s;
    }
    if (c.rope_scaling_type == "llama3") {
      if (absl::Status s = number(*rs, "low_freq_factor", &c.rope_low_freq_factor); !s.ok()) {
        return s;
      }
      if (absl::Status s = number(*rs, "high_freq_factor", &c.rope_high_freq_factor); !s.ok()) {
        return s;
      }
      auto orig = rs->find("original_max_position_embeddings");
      if (orig == rs->end() || !orig->is_number_unsigned() || orig->get<uint64_t>() == 0) {
        return bad("rope_scaling.original_max_position_embeddings: required for llama3");
      }
      c.rope_original_max_position_embeddings = static_cast<int64_t>(orig->get<uint64_t>());
    }
  }
  return c;
}

absl::StatusOr<LlamaConfig> ReadLlamaConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  auto text = ReadSmallFile(path);
  if (!text.ok()) return text.status();
  return ParseLlamaConfig(*text, path);
}

absl::Status ResolveLlamaConfig(const LlamaConfig& c, const std::string& file, ModelConfig* m) {
  auto take = [&](const char* field, int* spec, int64_t hf, const char* hf_field) -> absl::Status {
    if (*spec == 0) {
      *spec = static_cast<int>(hf);
      return absl::OkStatus();
    }
    if (*spec != hf) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": the spec says ", *spec, " but ",
                                                     file, " has ", hf_field, " ", hf));
    }
    return absl::OkStatus();
  };
  for (const auto& [field, spec, hf, hf_field] :
       {std::tuple<const char*, int*, int64_t, const char*>{
            "model.n_layer", &m->n_layer, c.num_hidden_layers, "num_hidden_layers"},
        {"model.d_model", &m->d_model, c.hidden_size, "hidden_size"},
        {"model.n_head", &m->n_head, c.num_attention_heads, "num_attention_heads"},
        {"model.n_kv_head", &m->n_kv_head, c.num_key_value_heads, "num_key_value_heads"},
        {"model.head_dim", &m->head_dim, c.head_dim, "head_dim"},
        {"model.d_hidden", &m->d_hidden, c.intermediate_size, "intermediate_size"},
        {"model.vocab", &m->vocab, c.vocab_size, "vocab_size"}}) {
    if (absl::Status s = take(field, spec, hf, hf_field); !s.ok()) return s;
  }
  if (m->HeadDim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model.head_dim: ", file,
                                                   " gives a head dimension of ", m->HeadDim(),
                                                   "; rotary embeddings need an even one"));
  }
  for (const auto& [field, value, max] :
       {std::tuple<const char*, int, int>{"model.n_layer", m->n_layer, 1024},
        {"model.n_head", m->n_head, 1024},
        {"model.d_model", m->d_model, 65536},
        {"model.vocab", m->vocab, 1 << 24},
        {"model.d_hidden", m->d_hidden, 1 << 20}}) {
    if (value < 1 || value > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", file, " gives ", value, ", beyond what trainyard takes (1..", max, ")"));
    }
  }
  // The spec's tie_weights can only say true; a checkpoint decides it either way.
  if (m->tie_weights && !c.tie_word_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("model.tie_weights: the spec says true but ",
                                                   file, " has tie_word_embeddings false"));
  }
  m->tie_weights = c.tie_word_embeddings;
  m->rope_theta = c.rope_theta;
  m->rms_norm_eps = c.rms_norm_eps;
  m->rope_scaling = c.rope_scaling_type;
  m->rope_factor = c.rope_scaling_factor;
  m->rope_low_freq_factor = c.rope_low_freq_factor;
  m->rope_high_freq_factor = c.rope_high_freq_factor;
  m->rope_original_max_position = c.rope_original_max_position_embeddings;
  m->max_position_embeddings = c.max_position_embeddings;
  m->sliding_window = c.sliding_window;
  m->family = c.model_type;
  m->hidden_act = c.hidden_act;
  m->qkv_bias = c.qkv_bias;
  m->max_window_layers = c.max_window_layers;
  return absl::OkStatus();
}

absl::StatusOr<LlamaConfig> ResolveFromCheckpoint(ModelConfig* model) {
  absl::StatusOr<LlamaConfig> config = ReadLlamaConfig(model->from);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat("model.from: ", config.status().message()));
  }
  absl::Status s = ResolveLlamaConfig(*config, model->from + "/config.json", model);
  if (!s.ok()) return s;
  return config;
}

LlamaConfig LlamaConfigOf(const ModelConfig& m) {
  LlamaConfig c;
  c.vocab_size = m.vocab;
  c.hidden_size = m.d_model;
  c.intermediate_size = m.d_hidden;
  c.num_hidden_layers = m.n_layer;
  c.num_attention_heads = m.n_head;
  c.num_key_value_heads = m.KvHeads();
  c.head_dim = m.HeadDim();
  c.max_position_embeddings =
      m.max_position_embeddings > 0 ? m.max_position_embeddings : std::max(m.seq_len, 1);
  c.rope_theta = m.rope_theta;
  c.rms_norm_eps = m.rms_norm_eps;
  c.tie_word_embeddings = m.tie_weights;
  c.rope_scaling_type = m.rope_scaling;
  c.rope_scaling_factor = m.rope_factor;
  c.rope_low_freq_factor = m.rope_low_freq_factor;
  c.rope_high_freq_factor = m.rope_high_freq_factor;
  c.rope_original_max_position_embeddings = m.rope_original_max_position;
  c.torch_dtype = "float32";
  c.sliding_window = m.sliding_window;
  c.model_type = m.family;
  c.hidden_act = m.hidden_act;
  c.qkv_bias = m.qkv_bias;
  c.max_window_layers = m.max_window_layers;
  return c;
}

std::string LlamaConfigJson(const ModelConfig& m) {
  const LlamaConfig c = LlamaConfigOf(m);
  const char* architecture = c.model_type == "qwen2"     ? "Qwen2ForCausalLM"
                             : c.model_type == "mistral" ? "MistralForCausalLM"
                                                         : "LlamaForCausalLM";
  nlohmann::json j = {
      {"architectures", {architecture}},
      {"model_type", c.model_type},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rope_theta", c.rope_theta},
      {"rms_norm_eps", c.rms_norm_eps},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"hidden_act", c.hidden_act},
      {"torch_dtype", c.torch_dtype},
      {"rope_scaling", nullptr},
  };
  if (c.model_type == "llama") {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  } else if (c.model_type == "mistral") {
    j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nullptr;
  } else if (c.model_type == "qwen2") {
    // Qwen2Config has no head_dim: hidden_size / num_attention_heads (checked when read).
    j.erase("head_dim");
    j["use_sliding_window"] = false;
    j["max_window_layers"] = c.max_window_layers > 0 ? c.max_window_layers : c.num_hidden_layers;
  }
  if (!c.rope_scaling_type.empty()) {
    j["rope_scaling"] = {{"rope_type", c.rope_scaling_type}, {"factor", c.rope_scaling_factor}};
    if (c.rope_scaling_type == "llama3") {
      j["rope_scaling"]["low_freq_factor"] = c.rope_low_freq_factor;
      j["rope_scaling"]["high_freq_factor"] = c.rope_high_freq_factor;
      j["rope_scaling"]["original_max_position_embeddings"] =
          c.rope_original_max_position_embeddings;
    }
  }
  return j.dump(2) + "\n";
}

std::string LoraAdapterConfigJson(const LoraConfig& lora, const std::string& base_model) {
  nlohmann::json j = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"r", lora.r},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", lora.dropout},
      {"target_modules", lora.target_modules},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"use_rslora", false},
      {"use_dora", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"revision", nullptr},
      {"base_model_name_or_path",
       base_model.empty() ? nlohmann::json() : nlohmann::json(base_model)},
  };
  return j.dump(2) + "\n";
}

}  // namespace trainyard
