// Hugging Face Llama-family model directories (worker/trainer/io/hf_checkpoint.h): config.json read
// as transformers writes it, the tensors a LlamaForCausalLM has, and sharded or single-file
// checkpoints checked against them, each bad one refused naming the file and the tensor.
#include "worker/trainer/io/hf_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/testing/subprocess.h"

namespace trainyard::trainer {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// As transformers 4.4x saves a small GQA Llama (with Llama 3's rope scaling).
constexpr char kConfig[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
  "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
  "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
  "attention_bias": false, "torch_dtype": "float32",
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})";

std::string ErrorOf(const std::string& json) {
  auto c = ParseLlamaConfig(json, "config.json");
  EXPECT_FALSE(c.ok());
  return std::string(c.status().message());
}

TEST(HfCheckpointTest, ReadsALlamaConfigAsTransformersWritesIt) {
  auto c = ParseLlamaConfig(kConfig, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 32);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->rope_scaling_type, "llama3");
  EXPECT_EQ(c->rope_scaling_factor, 8.0);
  EXPECT_EQ(c->rope_original_max_position_embeddings, 64);
  auto mha = ParseLlamaConfig(
      R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
          "num_attention_heads": 2, "rope_scaling": null})",
      "config.json");
  ASSERT_TRUE(mha.ok()) << mha.status();
  EXPECT_EQ(mha->num_key_value_heads, 2) << "absent: multi-head attention";
  EXPECT_EQ(mha->rope_theta, 10000);
}

TEST(HfCheckpointTest, TheSpecTakesTheSizesItLeftOutAndMustAgreeOnTheOthers) {
  auto c = ParseLlamaConfig(kConfig, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  ModelConfig m;
  m.kind = "llama";
  m.n_layer = 2;  // agrees
  ASSERT_TRUE(ResolveLlamaConfig(*c, "m/config.json", &m).ok());
  EXPECT_EQ(m.d_model, 32);
  EXPECT_EQ(m.n_kv_head, 2);
  EXPECT_EQ(m.d_hidden, 64);
  EXPECT_EQ(m.vocab, 96);
  EXPECT_EQ(m.rope_theta, 500000.0);
  EXPECT_EQ(m.rope_scaling, "llama3");
  // The round trip: the config.json of the resolved model reads back the same.
  auto again = ParseLlamaConfig(LlamaConfigJson(m), "exported/config.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->num_key_value_heads, 2);
  EXPECT_EQ(again->rope_original_max_position_embeddings, 64);

  ModelConfig disagrees;
  disagrees.d_hidden = 128;
  EXPECT_EQ(ResolveLlamaConfig(*c, "m/config.json", &disagrees).message(),
            "model.d_hidden: the spec says 128 but m/config.json has intermediate_size 64");
  LlamaConfig odd = *c;
  odd.head_dim = 7;
  ModelConfig any;
  EXPECT_THAT(std::string(ResolveLlamaConfig(odd, "m/config.json", &any).message()),
              ::testing::StartsWith("model.head_dim: m/config.json gives a head dimension of 7"));
}

TEST(HfCheckpointTest, ABadConfigNamesTheField) {
  EXPECT_THAT(ErrorOf(R"({"model_type": "gpt2"})"),
              HasSubstr("config.json: model_type: \"gpt2\" is not a Llama-family model"));
  EXPECT_THAT(ErrorOf(R"({"vocab_size": 10})"), HasSubstr("hidden_size: required"));
  EXPECT_THAT(ErrorOf(R"({"vocab_size": 10, "hidden_size": 10, "intermediate_size": 16,
                         "num_hidden_layers": 1, "num_attention_heads": 4})"),
              HasSubstr("num_attention_heads: 4 does not divide hidden_size (10)"));
  EXPECT_THAT(ErrorOf(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                         "num_hidden_layers": 1, "num_attention_heads": 4,
                         "num_key_value_heads": 3})"),
              HasSubstr("num_key_value_heads: 3 does not divide num_attention_heads (4)"));
  EXPECT_THAT(ErrorOf(R"({"vocab_size": -1})"), HasSubstr("vocab_size: expected a count"));
  EXPECT_THAT(ErrorOf(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                         "num_hidden_layers": 1, "num_attention_heads": 2,
                         "rope_scaling": {"rope_type": "yarn", "factor": 4}})"),
              HasSubstr("rope_scaling.rope_type: \"yarn\" is not supported"));
  EXPECT_THAT(ErrorOf(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                         "num_hidden_layers": 1, "num_attention_heads": 2,
                         "attention_bias": true})"),
              HasSubstr("attention_bias: true is not supported"));
  EXPECT_THAT(ErrorOf(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                         "num_hidden_layers": 1, "num_attention_heads": 2,
                         "mlp_bias": true})"),
              HasSubstr("mlp_bias: true is not supported"));
  EXPECT_THAT(ErrorOf(R"({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
                         "intermediate_size": 16, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "use_sliding_window": true})"),
              HasSubstr("use_sliding_window: true is not supported for qwen2"));
  EXPECT_THAT(ErrorOf(R"({"model_type": "gemma", "vocab_size": 10})"),
              HasSubstr("model_type: \"gemma\" is not a Llama-family model"));
  EXPECT_THAT(ErrorOf("{not json"), HasSubstr("not a JSON object"));
  // What changes the computation and is not implemented is refused, not trained as something else.
  EXPECT_THAT(ErrorOf(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                         "num_hidden_layers": 1, "num_attention_heads": 2,
                         "hidden_act": "quick_gelu"})"),
              HasSubstr("hidden_act: \"quick_gelu\" is not supported (silu, gelu"));
  EXPECT_THAT(ErrorOf(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                         "num_hidden_layers": 1, "num_attention_heads": 2,
                         "sliding_window": 0})"),
              HasSubstr("sliding_window: expected null or a count"));
}

// Mistral's sliding window is taken whatever model.seq_len (the model masks beyond it; see
// LlamaReferenceTest's mistral variant) and kept by the export, as a Mistral model.
TEST(LlamaConfigTest, ASlidingWindowIsTakenAndExported) {
  auto c = ParseLlamaConfig(R"({"model_type": "mistral", "vocab_size": 10, "hidden_size": 8,
                               "intermediate_size": 16, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "hidden_act": "silu",
                               "sliding_window": 8})",
                            "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sliding_window, 8);
  EXPECT_EQ(c->model_type, "mistral");
  ModelConfig wide;
  wide.kind = "llama";
  wide.seq_len = 16;
  ASSERT_TRUE(ResolveLlamaConfig(*c, "config.json", &wide).ok());
  EXPECT_EQ(wide.sliding_window, 8);
  EXPECT_EQ(wide.family, "mistral");
  const std::string exported = LlamaConfigJson(wide);
  EXPECT_THAT(exported, HasSubstr("\"model_type\": \"mistral\""));
  EXPECT_THAT(exported, HasSubstr("\"sliding_window\": 8"));
  EXPECT_THAT(exported, HasSubstr("MistralForCausalLM"));
  auto again = ParseLlamaConfig(exported, "exported/config.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->sliding_window, 8);
  // A Mistral without a window stays a Mistral.
  ModelConfig plain = wide;
  plain.sliding_window = 0;
  EXPECT_THAT(LlamaConfigJson(plain), HasSubstr("\"sliding_window\": null"));
  EXPECT_THAT(LlamaConfigJson(plain), HasSubstr("\"model_type\": \"mistral\""));
}

// hidden_act's names as transformers' ACT2FN has them, gelu_new and swish by what they compute;
// written back by the export.
TEST(LlamaConfigTest, ActivationsAreReadByNameAndExported) {
  for (const auto& [given, taken] :
       std::vector<std::pair<std::string, std::string>>{{"silu", "silu"},
                                                        {"swish", "silu"},
                                                        {"gelu", "gelu"},
                                                        {"gelu_pytorch_tanh", "gelu_pytorch_tanh"},
                                                        {"gelu_new", "gelu_pytorch_tanh"},
                                                        {"relu", "relu"}}) {
    SCOPED_TRACE(given);
    auto c = ParseLlamaConfig(absl::StrCat(R"({"vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "hidden_act": ")",
                                           given, "\"}"),
                              "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->hidden_act, taken);
    ModelConfig m;
    m.kind = "llama";
    m.seq_len = 8;
    ASSERT_TRUE(ResolveLlamaConfig(*c, "config.json", &m).ok());
    EXPECT_THAT(LlamaConfigJson(m), HasSubstr(absl::StrCat("\"hidden_act\": \"", taken, "\"")));
  }
}

// Qwen2: Llama with q/k/v biases; its head size is always hidden_size / num_attention_heads, its
// window off; exported as a Qwen2 model.
TEST(LlamaConfigTest, Qwen2HasQkvBiasesAndIsExportedAsQwen2) {
  auto c = ParseLlamaConfig(R"({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
                               "intermediate_size": 16, "num_hidden_layers": 3,
                               "num_attention_heads": 2, "num_key_value_heads": 1,
                               "use_sliding_window": false, "sliding_window": 4,
                               "max_window_layers": 2, "tie_word_embeddings": true})",
                            "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_EQ(c->head_dim, 4);
  const std::vector<ExpectedTensor> tensors = LlamaTensors(*c);
  EXPECT_EQ(std::count_if(tensors.begin(), tensors.end(),
                          [](const ExpectedTensor& t) { return absl::EndsWith(t.name, ".bias"); }),
            3 * 3);
  ModelConfig m;
  m.kind = "llama";
  m.seq_len = 8;
  ASSERT_TRUE(ResolveLlamaConfig(*c, "config.json", &m).ok());
  EXPECT_TRUE(m.qkv_bias);
  // The biases are counted: 2*8 + 8*8 + 2*8*4 + 8*8 + 3*8*16 + (8 + 2*4) per block.
  EXPECT_EQ(BlockParameterCount(m), 16 + 64 + 64 + 64 + 384 + 16);
  const std::string exported = LlamaConfigJson(m);
  EXPECT_THAT(exported, HasSubstr("Qwen2ForCausalLM"));
  EXPECT_THAT(exported, HasSubstr("\"use_sliding_window\": false"));
  EXPECT_THAT(exported, HasSubstr("\"max_window_layers\": 2"));
  EXPECT_THAT(exported, Not(HasSubstr("head_dim")));
  auto again = ParseLlamaConfig(exported, "exported/config.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->qkv_bias);
  EXPECT_EQ(again->model_type, "qwen2");
}

class ModelDir : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = ParseLlamaConfig(kConfig, "config.json");
    ASSERT_TRUE(c.ok());
    config_ = *c;
  }

  // The model's tensors in BF16 (zeros), with `edit` applied, in `shards` files and an index.
  void Write(int shards, const std::function<void(std::vector<SafetensorsEntry>&)>& edit = {}) {
    std::vector<SafetensorsEntry> entries;
    for (const ExpectedTensor& t : LlamaTensors(config_)) {
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      entries.push_back({t.name, SafetensorsDtype::kBF16, t.shape, std::string(2 * n, '\0')});
    }
    if (edit) edit(entries);
    if (shards == 1) {
      auto bytes = SerializeSafetensors(entries, {{"format", "pt"}});
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      std::ofstream(dir_.path() + "/model.safetensors", std::ios::binary) << *bytes;
      return;
    }
    std::string weight_map;
    std::vector<std::vector<SafetensorsEntry>> parts(shards);
    for (size_t i = 0; i < entries.size(); ++i) {
      const int s = static_cast<int>(i * shards / entries.size());
      const std::string file =
          absl::StrCat("model-0000", s + 1, "-of-0000", shards, ".safetensors");
      absl::StrAppend(&weight_map, weight_map.empty() ? "" : ",", "\"", entries[i].name, "\":\"",
                      file, "\"");
      parts[s].push_back(entries[i]);
    }
    for (int s = 0; s < shards; ++s) {
      auto bytes = SerializeSafetensors(parts[s], {{"format", "pt"}});
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      std::ofstream(
          absl::StrCat(dir_.path(), "/model-0000", s + 1, "-of-0000", shards, ".safetensors"),
          std::ios::binary)
          << *bytes;
    }
    std::ofstream(dir_.path() + "/model.safetensors.index.json")
        << "{\"metadata\":{},\"weight_map\":{" << weight_map << "}}";
  }

  std::string CheckError() {
    auto ckpt = HfCheckpoint::Open(dir_.path());
    if (!ckpt.ok()) return std::string(ckpt.status().message());
    absl::Status s = (*ckpt)->Check(LlamaTensors(config_));
    EXPECT_FALSE(s.ok());
    return std::string(s.message());
  }

  testing::TempDir dir_;
  LlamaConfig config_;
};

TEST_F(ModelDir, ShardedAndSingleFileCheckpointsOfTheModelAreAccepted) {
  Write(2);
  auto ckpt = HfCheckpoint::Open(dir_.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->size(), LlamaTensors(config_).size());
  EXPECT_TRUE((*ckpt)->Check(LlamaTensors(config_)).ok());
  const auto head = (*ckpt)->Find("lm_head.weight");
  ASSERT_NE(head.tensor, nullptr);
  EXPECT_THAT(head.file->path(), HasSubstr("model-00002-of-00002.safetensors"));

  testing::TempDir single;
  config_.tie_word_embeddings = true;  // no lm_head
  dir_ = std::move(single);
  Write(1);
  auto tied = HfCheckpoint::Open(dir_.path());
  ASSERT_TRUE(tied.ok()) << tied.status();
  EXPECT_TRUE((*tied)->Check(LlamaTensors(config_)).ok());
  EXPECT_EQ(LlamaTensors(config_).size(), 1 + 2 * 9 + 1u);
}

TEST_F(ModelDir, AMissingTensorIsNamed) {
  Write(2, [](auto& e) { e.erase(e.begin() + 4); });  // layer 0's v_proj
  EXPECT_THAT(CheckError(), HasSubstr("tensor model.layers.0.self_attn.v_proj.weight [16, 32] "
                                      "is missing"));
}

TEST_F(ModelDir, AWrongShapeIsNamedWithItsFile) {
  Write(2, [](auto& e) {
    e[3].shape = {32, 16};  // layer 0's k_proj, transposed
  });
  EXPECT_THAT(CheckError(),
              HasSubstr("model-00001-of-00002.safetensors: tensor "
                        "model.layers.0.self_attn.k_proj.weight has shape [32, 16], the model "
                        "needs [16, 32]"));
}

TEST_F(ModelDir, AnIntegerTensorOrAForeignOneIsRefused) {
  Write(1, [](auto& e) {
    e[0].dtype = SafetensorsDtype::kI16;  // same bytes per element as BF16
  });
  EXPECT_THAT(CheckError(), HasSubstr("tensor model.embed_tokens.weight is I16, not F32, F16 or "
                                      "BF16"));
  Write(1, [](auto& e) {
    e.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq",
                 SafetensorsDtype::kF32,
                 {4},
                 std::string(16, '\0')});
  });
  EXPECT_THAT(CheckError(), HasSubstr("tensor model.layers.0.self_attn.rotary_emb.inv_freq is not "
                                      "part of the model"));
}

TEST_F(ModelDir, AnIndexThatDisagreesWithItsShardsIsRefused) {
  Write(2);
  std::remove((dir_.path() + "/model-00002-of-00002.safetensors").c_str());
  auto gone = HfCheckpoint::Open(dir_.path());
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(gone.status().message()), HasSubstr("model-00002-of-00002.safetensors"));

  testing::TempDir empty;
  auto none = HfCheckpoint::Open(empty.path());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("neither model.safetensors"));
}

TEST_F(ModelDir, ATruncatedShardIsRefusedNamingIt) {
  Write(2);
  const std::string shard = dir_.path() + "/model-00001-of-00002.safetensors";
  std::string bytes;
  {
    std::ifstream in(shard, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 10);
  const std::string error = CheckError();
  EXPECT_THAT(error, HasSubstr(shard + ": tensor "));
  EXPECT_THAT(error, HasSubstr("lie outside"));
}

}  // namespace
}  // namespace trainyard::trainer
