// Memory estimates checked against figures computed by hand for a BERT-base-sized GPT.
#include "common/memory_estimate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "common/spec.h"

namespace trainyard {
namespace {

// 12 layers, d_model 768, 12 heads, seq_len 512, vocab 30522, tied head: 108,890,112 parameters
// = 30522*768 + 512*768 (embeddings) + 12 * (12*768^2 + 13*768) (blocks) + 2*768 (final norm).
constexpr int64_t kParams = 108'890'112;

v1::JobSpec BertBaseSized(v1::Strategy strategy, v1::ShardingStrategy sharding,
                          v1::MixedPrecision precision) {
  v1::JobSpec s;
  auto* m = s.mutable_model();
  m->set_kind("gpt");
  m->set_n_layer(12);
  m->set_n_head(12);
  m->set_d_model(768);
  m->set_seq_len(512);
  m->set_vocab(30522);
  m->set_tie_weights(true);
  s.mutable_train()->set_micro_batch(8);
  s.mutable_train()->set_mixed_precision(precision);
  s.mutable_parallel()->set_strategy(strategy);
  s.mutable_parallel()->set_sharding_strategy(sharding);
  return s;
}

TEST(MemoryEstimateTest, BertBaseSizedModelHasTheHandCountedParameters) {
  EXPECT_EQ(ModelParameterCount(BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP32).model()), kParams);
  // The largest FSDP unit is the embedding (30522 + 512) * 768, larger than a block.
  EXPECT_EQ(LargestUnitParameters(BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP32).model()),
            23'834'112);
}

TEST(MemoryEstimateTest, DdpKeepsSixteenBytesPerParameterOnEveryRank) {
  const MemoryEstimate e = EstimateMemory(BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP32), 4, 4);
  EXPECT_EQ(e.parameters, 4 * kParams);  // 435,560,448
  EXPECT_EQ(e.gradients, 4 * kParams);
  EXPECT_EQ(e.optimizer, 8 * kParams);  // Adam m and v
  EXPECT_EQ(e.parameters + e.gradients + e.optimizer, 1'742'241'792);
  EXPECT_EQ(e.Name(), "ddp");
}

TEST(MemoryEstimateTest, Bf16MixedPrecisionUsesTwoTwoTwelve) {
  const MemoryEstimate e = EstimateMemory(BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::BF16), 4, 4);
  EXPECT_EQ(e.parameters, 2 * kParams);
  EXPECT_EQ(e.gradients, 2 * kParams);
  EXPECT_EQ(e.optimizer, 12 * kParams);  // fp32 master weights + m + v
}

// fp16 (autocast with dynamic loss scaling) keeps what bf16 keeps: 2-byte weights, gradients and
// activations, fp32 master weights and moments; the loss scale is one number.
TEST(MemoryEstimateTest, Fp16CountsAsBf16) {
  const MemoryEstimate h = EstimateMemory(BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP16), 4, 4);
  const MemoryEstimate b = EstimateMemory(BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::BF16), 4, 4);
  EXPECT_EQ(h.precision, v1::FP16);
  EXPECT_EQ(h.parameters, b.parameters);
  EXPECT_EQ(h.gradients, b.gradients);
  EXPECT_EQ(h.optimizer, b.optimizer);
  EXPECT_EQ(h.activations, b.activations);
  EXPECT_LT(h.activations,
            EstimateMemory(BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP32), 4, 4).activations);
}

TEST(MemoryEstimateTest, FullShardDividesStateByWorldSizeAndAddsOneGatheredUnit) {
  const MemoryEstimate e = EstimateMemory(BertBaseSized(v1::FSDP, v1::FULL_SHARD, v1::FP32), 4, 4);
  const int64_t shard = 27'222'528;  // kParams / 4
  const int64_t unit = 23'834'112;
  EXPECT_EQ(e.parameters, 4 * shard + 4 * unit);  // 204,226,560
  EXPECT_EQ(e.gradients, 4 * shard + 4 * unit);
  EXPECT_EQ(e.optimizer, 8 * shard);  // 217,780,224
  EXPECT_EQ(e.Name(), "fsdp FULL_SHARD");
}

// Llama-2-7B's shape (32 layers, d_model 4096, 32 heads, MLP 11008, vocab 32000, untied):
// 6,738,415,616 parameters, as transformers counts them. LoRA r 16 on q and v adds per layer
// 16 * (4096 + 4096) twice: 8,388,608 in all (PEFT prints "trainable params: 8,388,608").
v1::JobSpec Llama7bLora(v1::Strategy strategy, v1::ShardingStrategy sharding) {
  v1::JobSpec s;
  auto* m = s.mutable_model();
  m->set_kind("llama");
  m->set_n_layer(32);
  m->set_n_head(32);
  m->set_n_kv_head(32);
  m->set_d_model(4096);
  m->set_d_hidden(11008);
  m->set_seq_len(512);
  m->set_vocab(32000);
  s.mutable_train()->set_micro_batch(1);
  s.mutable_train()->set_mixed_precision(v1::FP32);
  auto* lora = s.mutable_train()->mutable_lora();
  lora->set_r(16);
  lora->set_alpha(32);
  lora->add_target_modules("q_proj");
  lora->add_target_modules("v_proj");
  s.mutable_parallel()->set_strategy(strategy);
  s.mutable_parallel()->set_sharding_strategy(sharding);
  return s;
}

TEST(MemoryEstimateTest, LoraFrozenWeightsNeedNoGradientsNorOptimizerState) {
  constexpr int64_t kBase = 6'738'415'616, kLora = 8'388'608;
  const v1::JobSpec ddp = Llama7bLora(v1::DDP, v1::FULL_SHARD);
  EXPECT_EQ(ModelParameterCount(ddp.model()), kBase);
  EXPECT_EQ(LoraParameterCount(ToModelConfig(ddp.model()), ToJobConfig(ddp).train.lora), kLora);
  const MemoryEstimate e = EstimateMemory(ddp, 2, 2);
  EXPECT_EQ(e.parameters, 4 * (kBase + kLora));
  EXPECT_EQ(e.gradients, 4 * kLora);
  EXPECT_EQ(e.optimizer, 8 * kLora);
  // A full fine-tune keeps 16 bytes a parameter; LoRA about 4.
  v1::JobSpec full = ddp;
  full.mutable_train()->clear_lora();
  EXPECT_EQ(EstimateMemory(full, 2, 2).gradients, 4 * kBase);

  // FULL_SHARD on 2: the frozen base is sharded like any weight; the trained state is the
  // adapters' share.
  const MemoryEstimate f = EstimateMemory(Llama7bLora(v1::FSDP, v1::FULL_SHARD), 2, 2);
  const int64_t unit = LargestUnitParameters(ddp.model());
  // Two units gathered at once (with their adapters): a frozen unit is freed after its input's
  // gradient, when the next is gathered already.
  EXPECT_EQ(f.parameters, 4 * ((kBase + kLora) / 2) + 2 * 4 * (unit + kLora / 32));
  EXPECT_EQ(f.optimizer, 8 * (kLora / 2));
  EXPECT_EQ(f.gradients, 4 * (kLora / 2) + 4 * (kLora / 32));  // plus one layer's adapters
}

// train.optimizer on Llama-2-7B (full fine-tune, fp32): AdamW 8 bytes a parameter, Lion 4,
// 8-bit AdamW 2 and an fp32 absmax per 256 (every tensor has 4096 elements or more, bitsandbytes'
// min_8bit_size), Adafactor a row and a column per matrix.
TEST(MemoryEstimateTest, EachOptimizerCountsItsOwnState) {
  constexpr int64_t kParams = 6'738'415'616;
  // Embedding and head 32000 + 4096 each; per layer two norms, q/k/v/o 2 * 4096 each, gate/up/
  // down 11008 + 4096 each; the final norm.
  constexpr int64_t kFactors = 2 * 36096 + 32 * (2 * 4096 + 4 * 8192 + 3 * 15104) + 4096;
  v1::JobSpec spec = Llama7bLora(v1::DDP, v1::FULL_SHARD);
  spec.mutable_train()->clear_lora();
  auto optimizer_bytes = [&](v1::Optimizer o, v1::Strategy strategy, int world) {
    v1::JobSpec s = spec;
    s.mutable_train()->set_optimizer(o);
    s.mutable_parallel()->set_strategy(strategy);
    return EstimateMemory(s, world, world).optimizer;
  };
  int64_t counted = 0;
  for (const auto& shape : TrainedParameterShapes(ToModelConfig(spec.model()), LoraConfig{})) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    counted += n;
  }
  EXPECT_EQ(counted, kParams);
  EXPECT_EQ(optimizer_bytes(v1::ADAMW, v1::DDP, 1), 8 * kParams);
  EXPECT_EQ(optimizer_bytes(v1::LION, v1::DDP, 1), 4 * kParams);
  EXPECT_EQ(optimizer_bytes(v1::ADAMW_8BIT, v1::DDP, 1), 2 * kParams + 8 * (kParams / 256));
  EXPECT_EQ(optimizer_bytes(v1::ADAFACTOR, v1::DDP, 1), 4 * kFactors);  // 11.3 MB
  // FULL_SHARD on 8 ranks: elementwise state is sharded, Adafactor's factors are not.
  EXPECT_EQ(optimizer_bytes(v1::LION, v1::FSDP, 8), 4 * (kParams / 8));
  EXPECT_EQ(optimizer_bytes(v1::ADAMW_8BIT, v1::FSDP, 8),
            2 * (kParams / 8) + 8 * (kParams / 256 / 8));
  EXPECT_EQ(optimizer_bytes(v1::ADAFACTOR, v1::FSDP, 8), 4 * kFactors);
  // bf16 mixed precision adds the fp32 master weights.
  spec.mutable_train()->set_mixed_precision(v1::BF16);
  EXPECT_EQ(optimizer_bytes(v1::LION, v1::DDP, 1), 4 * kParams + 4 * kParams);
  // The parameter servers run AdamW only: no offload row for another optimizer.
  spec.mutable_train()->set_optimizer(v1::LION);
  for (const MemoryEstimate& e : EstimateAllStrategies(spec, 2, 2)) {
    EXPECT_NE(e.strategy, v1::OFFLOAD);
  }
}

// The shapes the estimate sizes optimizer state by cover every parameter that trains.
TEST(MemoryEstimateTest, TrainedParameterShapesAddUpToTheParameterCount) {
  for (const char* kind : {"gpt", "mlp", "llama"}) {
    ModelConfig m;
    m.kind = kind;
    m.n_layer = 3;
    m.n_head = 4;
    m.n_kv_head = 2;
    m.d_model = 64;
    m.d_hidden = 96;
    m.seq_len = 32;
    m.vocab = 300;
    for (bool tie : {false, true}) {
      m.tie_weights = tie && m.kind != "mlp";
      LoraConfig lora;
      for (bool with_lora : {false, true}) {
        if (with_lora) {
          if (m.kind != "llama") continue;
          lora.r = 4;
          lora.target_modules = {"k_proj", "o_proj", "up_proj"};
        }
        int64_t total = 0;
        for (const auto& shape : TrainedParameterShapes(m, lora)) {
          int64_t n = 1;
          for (int64_t d : shape) n *= d;
          total += n;
        }
        EXPECT_EQ(total, with_lora ? LoraParameterCount(m, lora) : ModelParameterCount(m))
            << kind << (tie ? " tied" : "") << (with_lora ? " lora" : "");
      }
    }
  }
}

TEST(MemoryEstimateTest, ShardGradOpKeepsFullParametersButShardsTheRest) {
  const MemoryEstimate e =
      EstimateMemory(BertBaseSized(v1::FSDP, v1::SHARD_GRAD_OP, v1::FP32), 4, 4);
  EXPECT_EQ(e.parameters, 4 * kParams);
  EXPECT_EQ(e.optimizer, 8 * 27'222'528);
}

TEST(MemoryEstimateTest, NoShardIsDdpAndHybridShardsWithinTheNode) {
  const MemoryEstimate no_shard =
      EstimateMemory(BertBaseSized(v1::FSDP, v1::NO_SHARD, v1::FP32), 4, 4);
  EXPECT_EQ(no_shard.optimizer, 8 * kParams);
  const MemoryEstimate hybrid =
      EstimateMemory(BertBaseSized(v1::FSDP, v1::HYBRID_SHARD, v1::FP32), 8, 2);
  EXPECT_EQ(hybrid.optimizer, 8 * (kParams / 2));  // sharded over the 2 ranks of a node
}

TEST(MemoryEstimateTest, OffloadMovesOptimizerStateOffTheDevice) {
  const MemoryEstimate e =
      EstimateMemory(BertBaseSized(v1::OFFLOAD, v1::FULL_SHARD, v1::FP32), 4, 4);
  EXPECT_EQ(e.optimizer, 0);
  EXPECT_EQ(e.offloaded, 16 * kParams);  // fp32 master, m, v and gradient staging on the PS
}

TEST(MemoryEstimateTest, ActivationsFollowKorthikantiAndShrinkWithCheckpointing) {
  v1::JobSpec spec = BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP32);
  // Per layer s*b*h*(34 + 5*a*s/h) = 512*8*768*(34 + 40) = 232,783,872 bytes at 2 bytes a value,
  // doubled for fp32; plus fp32 logits and their gradient, 512*8*30522*8.
  const int64_t per_layer = 232'783'872 * 2;
  const int64_t logits = 1'000'144'896;
  EXPECT_EQ(EstimateMemory(spec, 1, 1).activations, 12 * per_layer + logits);
  spec.mutable_train()->set_activation_checkpointing(true);
  EXPECT_EQ(EstimateMemory(spec, 1, 1).activations, 12 * 512 * 8 * 768 * 4 + per_layer + logits);
}

TEST(MemoryEstimateTest, AllStrategiesCoverEveryStrategyForBothPrecisions) {
  const auto all = EstimateAllStrategies(BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP32), 4, 4);
  // 12 strategies, then for each precision the model-parallel layouts of 4 ranks: pipeline 2, 4;
  // tensor 2 (not 4: the vocabulary, 30,522, is not a multiple of 4); pipeline 2 x tensor 2;
  // and those with replicas (pipeline 2, tensor 2) with fsdp over them too.
  ASSERT_EQ(all.size(), 24u);
  EXPECT_EQ(all[0].Name(), "ddp");
  EXPECT_EQ(all[5].Name(), "offload");
  EXPECT_EQ(all[6].precision, v1::BF16);
  // FULL_SHARD needs less per rank than DDP.
  EXPECT_LT(all[1].total(), all[0].total());
  std::vector<std::string> layouts;
  for (size_t i = 12; i < 18; ++i) layouts.push_back(all[i].Name());
  EXPECT_THAT(layouts,
              ::testing::ElementsAre("tensor 2", "tensor 2 + fsdp FULL_SHARD", "pipeline 2 (1f1b)",
                                     "pipeline 2 (1f1b) + fsdp FULL_SHARD",
                                     "pipeline 2 (1f1b) x tensor 2", "pipeline 4 (1f1b)"));
  EXPECT_EQ(all[17].precision, v1::FP32);
  EXPECT_EQ(all[18].precision, v1::BF16);
}

// A stage holds its blocks' share (the first also the embeddings, the last the head), split over
// the tensor-parallel ranks; its activations are its layers' for each micro-batch alive at once:
// all m under GPipe, P - stage under 1F1B.
TEST(MemoryEstimateTest, ModelParallelLayoutsCountTheBusiestStage) {
  v1::JobSpec spec = BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP32);
  spec.mutable_model()->set_vocab(30528);  // a multiple of 2 and 4
  const ModelConfig model = ToModelConfig(spec.model());
  const MemoryEstimate ddp = EstimateMemory(spec, 4, 4);
  spec.mutable_parallel()->set_pipeline_stages(4);
  spec.mutable_train()->set_micro_batches(8);
  const std::vector<int64_t> held = StageParameterCounts(model, PipelineBoundaries(model, 4, {}));
  ASSERT_EQ(held.size(), 4u);
  int64_t sum = 0;
  for (int64_t n : held) sum += n;
  // The tied embedding lives on the first and the last stage.
  EXPECT_EQ(sum, ModelParameterCount(model) + 30528 * 768);
  const MemoryEstimate f1b = EstimateMemory(spec, 4, 4);
  EXPECT_EQ(f1b.Name(), "pipeline 4 (1f1b)");
  spec.mutable_parallel()->set_pipeline_schedule(v1::GPIPE);
  const MemoryEstimate gpipe = EstimateMemory(spec, 4, 4);
  EXPECT_EQ(gpipe.Name(), "pipeline 4 (gpipe)");
  // Parameters: the busiest stage's, a quarter of the model or so; 16 bytes each with AdamW.
  const int64_t most = *std::max_element(held.begin(), held.end());
  EXPECT_LE(f1b.parameters, 4 * most);
  EXPECT_LT(f1b.parameters + f1b.gradients + f1b.optimizer,
            (ddp.parameters + ddp.gradients + ddp.optimizer) / 2);
  // Activations: GPipe keeps all 8 micro-batches of its layers, 1F1B at most 4.
  EXPECT_GT(gpipe.activations, f1b.activations);
  // Tensor parallelism halves the parameters again and shrinks each layer's activations.
  spec.mutable_parallel()->set_pipeline_stages(2);
  spec.mutable_parallel()->set_pipeline_schedule(v1::ONE_F_ONE_B);
  const MemoryEstimate p2 = EstimateMemory(spec, 4, 4);
  spec.mutable_parallel()->set_tensor_parallel(2);
  const MemoryEstimate p2t2 = EstimateMemory(spec, 4, 4);
  EXPECT_EQ(p2t2.Name(), "pipeline 2 (1f1b) x tensor 2");
  EXPECT_LT(double(p2t2.parameters), 0.6 * double(p2.parameters));
  EXPECT_LT(p2t2.activations, p2.activations);
  // Sequence parallelism splits the norms' and dropouts' activations too.
  spec.mutable_parallel()->set_sequence_parallel(true);
  const MemoryEstimate sequence = EstimateMemory(spec, 4, 4);
  EXPECT_LT(sequence.activations, p2t2.activations);
  EXPECT_EQ(sequence.parameters, p2t2.parameters);
}

// FSDP within the stages: 2 stages x 4 replicas shard each stage's gradients and optimizer state 4
// ways; FULL_SHARD its parameters too (plus the largest unit while gathered), SHARD_GRAD_OP keeps
// them whole from forward to backward. Activations are the stage's as under ddp.
TEST(MemoryEstimateTest, FsdpWithinStagesShardsEachStageOverItsReplicas) {
  v1::JobSpec spec = BertBaseSized(v1::DDP, v1::FULL_SHARD, v1::FP32);
  spec.mutable_parallel()->set_pipeline_stages(2);
  spec.mutable_train()->set_micro_batches(4);
  const MemoryEstimate ddp = EstimateMemory(spec, 8, 8);
  spec.mutable_parallel()->set_strategy(v1::FSDP);
  const MemoryEstimate full = EstimateMemory(spec, 8, 8);
  spec.mutable_parallel()->set_sharding_strategy(v1::SHARD_GRAD_OP);
  const MemoryEstimate grad_op = EstimateMemory(spec, 8, 8);
  EXPECT_EQ(full.Name(), "pipeline 2 (1f1b) + fsdp FULL_SHARD");
  EXPECT_EQ(grad_op.Name(), "pipeline 2 (1f1b) + fsdp SHARD_GRAD_OP");
  // (The busiest stage may be another one than ddp's: the two ends hold about as much.) The
  // shards are a quarter of ddp's; FULL_SHARD adds the stage's root (its embeddings, kept for the
  // step) and one block while gathered, and their unsharded gradients.
  EXPECT_NEAR(double(full.optimizer) / double(ddp.optimizer), 0.25, 0.02);
  EXPECT_GT(full.parameters, ddp.parameters / 4 + 4 * 30522 * 768);
  EXPECT_LT(full.parameters, ddp.parameters);
  EXPECT_GT(full.gradients, ddp.gradients / 4);
  EXPECT_LT(full.gradients, ddp.gradients);
  EXPECT_NEAR(double(grad_op.parameters) / double(ddp.parameters), 1.0, 0.08);
  EXPECT_NEAR(double(grad_op.optimizer) / double(full.optimizer), 1.0, 0.08);
  EXPECT_LT(full.total(), grad_op.total());
  EXPECT_LT(grad_op.total(), ddp.total());
  // NO_SHARD is ddp.
  spec.mutable_parallel()->set_sharding_strategy(v1::NO_SHARD);
  EXPECT_EQ(EstimateMemory(spec, 8, 8).total(), ddp.total());
  // HYBRID_SHARD on nodes of 4 ranks: each stage sharded over the 2 replicas on a node.
  spec.mutable_parallel()->set_sharding_strategy(v1::HYBRID_SHARD);
  const MemoryEstimate hybrid = EstimateMemory(spec, 8, 4);
  EXPECT_EQ(hybrid.Name(), "pipeline 2 (1f1b) + fsdp HYBRID_SHARD");
  EXPECT_NEAR(double(hybrid.optimizer) / double(ddp.optimizer), 0.5, 0.02);
  EXPECT_GT(hybrid.parameters, full.parameters);
  EXPECT_LT(hybrid.parameters, ddp.parameters + 4 * 30522 * 768);
  // On nodes of all 8 ranks it is FULL_SHARD's.
  EXPECT_EQ(EstimateMemory(spec, 8, 8).total(), full.total());
}

}  // namespace
}  // namespace trainyard
