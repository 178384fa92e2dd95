// Job spec: YAML parsing with file:line errors, defaults, and validation naming the field.
#include "common/spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/spec_schema.h"

namespace trainyard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr char kValid[] = R"(name: char-gpt
priority: 50
resources: {gpus: 2}
model: {kind: gpt, n_layer: 4, n_head: 4, d_model: 256, seq_len: 128, vocab: 256}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes}
train: {steps: 300, micro_batch: 8, grad_accum: 1, lr: 3.0e-4, warmup: 30, mixed_precision: fp32, activation_checkpointing: false, seed: 1}
parallel: {strategy: ddp, sharding_strategy: FULL_SHARD, bucket_mb: 25}
checkpoint: {every_steps: 100}
max_restarts: 3
)";

v1::JobSpec ValidSpec() {
  auto parsed = ParseJobSpecYaml(kValid, "spec.yaml");
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  return spec;
}

// Validates `spec` after `mutate` and returns the error message.
template <typename F>
std::string ErrorAfter(F mutate) {
  v1::JobSpec spec = ValidSpec();
  mutate(spec);
  absl::Status s = ValidateJobSpec(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  return std::string(s.message());
}

TEST(SpecTest, ParsesTheBriefExampleIntoEveryField) {
  v1::JobSpec spec = ValidSpec();
  EXPECT_EQ(spec.name(), "char-gpt");
  EXPECT_EQ(spec.priority(), 50);
  EXPECT_EQ(spec.resources().slots(), 2);
  EXPECT_EQ(spec.model().kind(), "gpt");
  EXPECT_EQ(spec.model().n_layer(), 4);
  EXPECT_EQ(spec.model().n_head(), 4);
  EXPECT_EQ(spec.model().d_model(), 256);
  EXPECT_EQ(spec.model().seq_len(), 128);
  EXPECT_EQ(spec.model().vocab(), 256);
  EXPECT_EQ(spec.data().path(), "/usr/share/common-licenses/GPL-3");
  EXPECT_EQ(spec.train().steps(), 300);
  EXPECT_DOUBLE_EQ(spec.train().lr(), 3.0e-4);
  EXPECT_EQ(spec.train().warmup(), 30);
  EXPECT_EQ(spec.train().mixed_precision(), v1::FP32);
  EXPECT_EQ(spec.parallel().strategy(), v1::DDP);
  EXPECT_EQ(spec.parallel().sharding_strategy(), v1::FULL_SHARD);
  EXPECT_DOUBLE_EQ(spec.parallel().bucket_mb(), 25);
  EXPECT_EQ(spec.checkpoint().every_steps(), 100);
  EXPECT_EQ(spec.max_restarts(), 3);
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
}

TEST(SpecTest, ExampleFileInTheRepoIsValid) {
  auto parsed = LoadJobSpecFile(std::string(TRAINYARD_SOURCE_DIR) + "/examples/char-gpt.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
}

TEST(SpecTest, DefaultsFillOptionalFieldsOnly) {
  auto parsed = ParseJobSpecYaml(
      "name: x\nresources: {gpus: 1}\nmodel: {n_layer: 1, n_head: 1, d_model: 8, seq_len: 4}\n"
      "data: {path: /tmp/x}\ntrain: {steps: 5}\n",
      "min.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  EXPECT_EQ(spec.priority(), 50);
  EXPECT_EQ(spec.model().kind(), "gpt");
  EXPECT_EQ(spec.model().vocab(), 256);
  EXPECT_EQ(spec.data().format(), "bytes");
  EXPECT_EQ(spec.train().grad_accum(), 1);
  EXPECT_EQ(spec.train().micro_batch(), 8);
  EXPECT_EQ(spec.parallel().strategy(), v1::DDP);
  EXPECT_DOUBLE_EQ(spec.parallel().bucket_mb(), 25);
  EXPECT_EQ(spec.parallel().auto_wrap_policy(), v1::TRANSFORMER_BASED_WRAP);
  EXPECT_EQ(spec.parallel().min_num_params(), 100'000'000);
  EXPECT_EQ(spec.parallel().backward_prefetch(), v1::BACKWARD_PRE);
  EXPECT_FALSE(spec.parallel().forward_prefetch());
  EXPECT_EQ(spec.parallel().max_gathered_units(), 2);
  EXPECT_TRUE(spec.parallel().cpu_ram_efficient_loading());
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
}

TEST(SpecTest, ParsesTheFsdpKnobs) {
  auto parsed = ParseJobSpecYaml(
      "name: x\nparallel:\n  strategy: fsdp\n  sharding_strategy: HYBRID_SHARD\n"
      "  auto_wrap_policy: SIZE_BASED_WRAP\n  min_num_params: 5000\n"
      "  backward_prefetch: BACKWARD_POST\n  forward_prefetch: true\n"
      "  max_gathered_units: 3\n  cpu_ram_efficient_loading: false\n",
      "f.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  const v1::ParallelSpec& p = spec.parallel();
  EXPECT_EQ(p.strategy(), v1::FSDP);
  EXPECT_EQ(p.sharding_strategy(), v1::HYBRID_SHARD);
  EXPECT_EQ(p.auto_wrap_policy(), v1::SIZE_BASED_WRAP);
  EXPECT_EQ(p.min_num_params(), 5000);
  EXPECT_EQ(p.backward_prefetch(), v1::BACKWARD_POST);
  EXPECT_TRUE(p.forward_prefetch());
  EXPECT_EQ(p.max_gathered_units(), 3);
  EXPECT_FALSE(p.cpu_ram_efficient_loading());

  auto bad = ParseJobSpecYaml("name: x\nparallel: {backward_prefetch: SOMETIMES}\n", "b.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("parallel.backward_prefetch: unknown value 'SOMETIMES' (one of "
                        "BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH)"));
}

TEST(SpecTest, JobConfigCarriesEveryFieldTheTrainerReads) {
  auto parsed = ParseJobSpecYaml(
      "name: x\nresources: {gpus: 2}\n"
      "model: {kind: mlp, n_layer: 3, n_head: 2, d_model: 64, seq_len: 32, vocab: 300,"
      " tie_weights: true, d_hidden: 96}\n"
      "data: {path: /tmp/tokens, format: uint16}\n"
      "train: {steps: 7, micro_batch: 4, grad_accum: 3, lr: 0.01, warmup: 2,"
      " mixed_precision: bf16, activation_checkpointing: true, seed: 9, weight_decay: 0.1,"
      " grad_clip: 1.5}\n"
      "parallel: {strategy: fsdp, sharding_strategy: SHARD_GRAD_OP, bucket_mb: 4,"
      " auto_wrap_policy: SIZE_BASED_WRAP, min_num_params: 123, backward_prefetch: NO_PREFETCH,"
      " forward_prefetch: true, max_gathered_units: 5, cpu_ram_efficient_loading: false}\n"
      "checkpoint: {every_steps: 11}\n",
      "f.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  const JobConfig c = ToJobConfig(spec);
  EXPECT_EQ(c.model.kind, "mlp");
  EXPECT_EQ(c.model.n_layer, 3);
  EXPECT_EQ(c.model.n_head, 2);
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_EQ(c.model.seq_len, 32);
  EXPECT_EQ(c.model.vocab, 300);
  EXPECT_TRUE(c.model.tie_weights);
  EXPECT_EQ(c.model.d_hidden, 96);
  EXPECT_EQ(c.data.path, "/tmp/tokens");
  EXPECT_EQ(c.data.format, "uint16");
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_EQ(c.train.micro_batch, 4);
  EXPECT_EQ(c.train.grad_accum, 3);
  EXPECT_DOUBLE_EQ(c.train.lr, 0.01);
  EXPECT_EQ(c.train.warmup, 2);
  EXPECT_EQ(c.train.precision, Precision::kBf16);
  EXPECT_TRUE(c.train.activation_checkpointing);
  EXPECT_EQ(c.train.seed, 9u);
  EXPECT_DOUBLE_EQ(c.train.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 1.5);
  EXPECT_EQ(c.parallel.strategy, Strategy::kFsdp);
  EXPECT_EQ(c.parallel.sharding, Sharding::kShardGradOp);
  EXPECT_DOUBLE_EQ(c.parallel.bucket_mb, 4);
  EXPECT_EQ(c.parallel.wrap, WrapPolicy::kSizeBased);
  EXPECT_EQ(c.parallel.min_num_params, 123);
  EXPECT_EQ(c.parallel.backward_prefetch, BackwardPrefetch::kNoPrefetch);
  EXPECT_TRUE(c.parallel.forward_prefetch);
  EXPECT_EQ(c.parallel.max_gathered_units, 5);
  EXPECT_FALSE(c.parallel.cpu_ram_efficient_loading);
  EXPECT_EQ(c.checkpoint_every_steps, 11);
  EXPECT_EQ(ModelParameterCount(c.model), ModelParameterCount(spec.model()));
  EXPECT_STREQ(Name(c.parallel.sharding), "SHARD_GRAD_OP");
  EXPECT_STREQ(Name(c.parallel.backward_prefetch), "NO_PREFETCH");

  // Defaults reach the trainer as such: ddp, FULL_SHARD, BACKWARD_PRE, rank-0 loading, fp32.
  auto plain = ParseJobSpecYaml("name: y\n", "g.yaml");
  ASSERT_TRUE(plain.ok()) << plain.status();
  v1::JobSpec defaults = plain->spec;
  ApplyJobSpecDefaults(defaults);
  const JobConfig d = ToJobConfig(defaults);
  EXPECT_EQ(d.parallel.strategy, Strategy::kDdp);
  EXPECT_EQ(d.parallel.sharding, Sharding::kFullShard);
  EXPECT_EQ(d.parallel.backward_prefetch, BackwardPrefetch::kBackwardPre);
  EXPECT_TRUE(d.parallel.cpu_ram_efficient_loading);
  EXPECT_EQ(d.train.precision, Precision::kFp32);
  EXPECT_EQ(d.train.grad_accum, 1);
}

TEST(SpecTest, MalformedYamlReportsFileAndLine) {
  auto parsed = ParseJobSpecYaml("name: x\nresources: {gpus: 2\nmodel: {}\n", "bad.yaml");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  // The line where the unclosed '{' opened, not the end of the file where yaml-cpp gave up.
  EXPECT_THAT(std::string(parsed.status().message()), StartsWith("bad.yaml:2: malformed YAML"));
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("never closed"));
}

TEST(SpecTest, UnclosedFlowSequenceReportsTheLineItOpened) {
  auto parsed = ParseJobSpecYaml(
      "# a [ in a comment\nname: 'x [y'\ndata: {path: /a}\nextra: [1, 2\nmore: 3\n", "s.yaml");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()), StartsWith("s.yaml:4: malformed YAML"));
}

TEST(SpecTest, UnknownFieldReportsItsLineAndPath) {
  auto parsed = ParseJobSpecYaml("name: x\nmodel:\n  kind: gpt\n  n_heads: 4\n", "s.yaml");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()),
              StartsWith("s.yaml:4: unknown field 'model.n_heads'"));
}

TEST(SpecTest, WrongTypeReportsFieldAndLine) {
  auto parsed = ParseJobSpecYaml("name: x\npriority: high\n", "s.yaml");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()),
              StartsWith("s.yaml:2: priority: expected an integer, got 'high'"));
}

TEST(SpecTest, ExplicitZeroGpusIsRejectedAtItsLine) {
  auto parsed = ParseJobSpecYaml("name: x\nresources:\n  gpus: 0\n", "s.yaml");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()),
              StartsWith("s.yaml:3: resources.gpus: must be >= 1, got 0"));
}

TEST(SpecTest, ResourcesTakeCpusAndMemoryPerRankAndRefuseBadOnesAtTheirLine) {
  auto parsed =
      ParseJobSpecYaml("name: x\nresources:\n  gpus: 2\n  cpus: 1.5\n  memory: 16GiB\n", "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.resources().slots(), 2);
  EXPECT_DOUBLE_EQ(parsed->spec.resources().cpus(), 1.5);
  EXPECT_EQ(parsed->spec.resources().memory_bytes(), int64_t{16} << 30);
  for (const auto& [text, error] : std::vector<std::pair<std::string, std::string>>{
           {"  memory: lots\n", "s.yaml:3: resources.memory: a size per rank such as 16GiB"},
           {"  memory: 0\n", "s.yaml:3: resources.memory: a size per rank"},
           {"  memory: 65TiB\n", "s.yaml:3: resources.memory: a size per rank"},
           {"  cpus: 0\n", "s.yaml:3: resources.cpus: CPUs per rank, more than 0"},
           {"  cpus: two\n", "s.yaml:3: resources.cpus: expected a number, got 'two'"},
           {"  disk: 1\n",
            "s.yaml:3: unknown field 'resources.disk' (known: cpus, memory, nodes, ranks_per_node, "
            "slots)"}}) {
    auto bad = ParseJobSpecYaml("name: x\nresources:\n" + text, "s.yaml");
    ASSERT_FALSE(bad.ok()) << text;
    EXPECT_THAT(std::string(bad.status().message()), StartsWith(error)) << text;
  }
}

// resources.slots counts devices (GPUs, or CPU slots): its old name, gpus, reads as it.
TEST(SpecTest, SlotsIsReadUnderItsOldNameGpusToo) {
  for (const std::string key : {"slots", "gpus"}) {
    auto parsed = ParseJobSpecYaml("name: x\nresources:\n  " + key + ": 3\n", "s.yaml");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->spec.resources().slots(), 3) << key;
    EXPECT_EQ(parsed->field_lines.at("resources.slots"), 3) << key;
  }
  auto both = ParseJobSpecYaml("name: x\nresources:\n  slots: 1\n  gpus: 2\n", "s.yaml");
  ASSERT_FALSE(both.ok());
  EXPECT_THAT(std::string(both.status().message()),
              StartsWith("s.yaml:4: resources.gpus: the old name of resources.slots, which is "
                         "given too: give one"));
  // A check after parsing names the field by its name now, at the line of the old one.
  const std::string path = ::testing::TempDir() + "/old-name.yaml";
  std::ofstream(path) << "name: x\nresources:\n  gpus: 3\nmodel: {n_layer: 2, n_head: 2, "
                         "d_model: 64, seq_len: 32}\ndata: {path: /d}\ntrain: {steps: 1}\n"
                         "parallel: {pipeline_stages: 2}\n";
  auto loaded = LoadValidJobSpecFile(path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(std::string(loaded.status().message()),
              StartsWith(path + ":3: resources.slots: 3 ranks do not split into 2 pipeline"));
}

// `after`: job ids, each once, at most 64; read from YAML as a list.
TEST(SpecTest, AfterNamesJobsByIdEachOnce) {
  auto parsed = ParseJobSpecYaml(
      "name: x\nresources: {slots: 1}\ncommand: [true]\nafter: [job-3, job-12]\n", "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ApplyJobSpecDefaults(parsed->spec);
  EXPECT_TRUE(ValidateJobSpec(parsed->spec).ok());
  EXPECT_THAT(parsed->spec.after(), ElementsAre("job-3", "job-12"));
  for (const auto& [after, error] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"7"}, "after[0]: expected a job id such as job-7, got '7'"},
           {{"job-3", "job-03"}, "after[1]: expected a job id such as job-7, got 'job-03'"},
           {{"job-0"}, "after[0]: expected a job id"},
           {{"job-3", "job-3"}, "after[1]: job-3 is given twice"}}) {
    v1::JobSpec spec = parsed->spec;
    spec.clear_after();
    for (const std::string& id : after) spec.add_after(id);
    EXPECT_THAT(std::string(ValidateJobSpec(spec).message()), StartsWith(error));
  }
  v1::JobSpec many = parsed->spec;
  many.clear_after();
  for (int i = 1; i <= 65; ++i) many.add_after(absl::StrCat("job-", i));
  EXPECT_EQ(ValidateJobSpec(many).message(), "after: at most 64 jobs, got 65");
}

// `array`: one task of a job array; its name, count and limit checked.
TEST(SpecTest, AnArrayTaskHasANameACountAndALimit) {
  auto parsed = ParseJobSpecYaml(
      "name: x\nresources: {slots: 1}\ncommand: [true]\n"
      "array: {id: sweep-1a2b, index: 7, count: 16, max_running: 4}\n",
      "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ApplyJobSpecDefaults(parsed->spec);
  EXPECT_TRUE(ValidateJobSpec(parsed->spec).ok());
  EXPECT_EQ(parsed->spec.array().index(), 7);
  const std::vector<std::pair<std::function<void(v1::ArraySpec&)>, std::string>> bad = {
      {[](v1::ArraySpec& a) { a.set_id(""); }, "array.id: required"},
      {[](v1::ArraySpec& a) { a.set_id("a b"); }, "array.id: only letters"},
      {[](v1::ArraySpec& a) { a.set_count(0); }, "array.count: must be in 1..10000, got 0"},
      {[](v1::ArraySpec& a) { a.set_count(10001); }, "array.count: must be in 1..10000"},
      {[](v1::ArraySpec& a) { a.set_index(-1); }, "array.index: must be >= 0, got -1"},
      {[](v1::ArraySpec& a) { a.set_max_running(-2); }, "array.max_running: must be >= 0"}};
  for (const auto& [change, error] : bad) {
    v1::JobSpec spec = parsed->spec;
    change(*spec.mutable_array());
    EXPECT_THAT(std::string(ValidateJobSpec(spec).message()), StartsWith(error));
  }
}

// Flags over a spec (`yard submit job.yaml --gpus 2`): set as the file's fields are, lists and
// maps replaced, errors naming the field after the flags' origin, without a line.
TEST(SpecTest, OverridesSetFieldsAsTheFileWouldAndReplaceListsAndMaps) {
  auto parsed = ParseJobSpecYaml(
      "name: x\nresources: {slots: 1}\ncommand: [python3, a.py]\nenv: {A: '1', B: '2'}\n",
      "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_TRUE(OverrideJobSpecYaml(*parsed,
                                  "resources: {slots: 4, memory: 2GiB}\ncommand: [python3, b.py, "
                                  "'--lr', '3e-4']\nenv: {C: '3'}\nname: y\n",
                                  "yard submit")
                  .ok());
  const v1::JobSpec& spec = parsed->spec;
  EXPECT_EQ(spec.name(), "y");
  EXPECT_EQ(spec.resources().slots(), 4);
  EXPECT_EQ(spec.resources().memory_bytes(), int64_t{2} << 30);
  EXPECT_THAT(spec.command(), ElementsAre("python3", "b.py", "--lr", "3e-4"));
  EXPECT_EQ(spec.env_size(), 1);
  EXPECT_EQ(spec.env().at("C"), "3");
  // What the flags set has no line of the file any more; the rest keeps its own.
  EXPECT_EQ(parsed->field_lines.count("resources.slots"), 0u);
  EXPECT_EQ(parsed->field_lines.at("resources"), 2);
  // Empty overrides change nothing.
  EXPECT_TRUE(OverrideJobSpecYaml(*parsed, "", "yard submit").ok());
  EXPECT_EQ(parsed->spec.name(), "y");

  for (const auto& [yaml, error] : std::vector<std::pair<std::string, std::string>>{
           {"resources: {memory: lots}", "yard submit: resources.memory: "},
           {"resources: {slots: 0}", "yard submit: resources.slots: must be"},
           {"colour: red", "yard submit: unknown field 'colour'"},
           {"command: {a: b}", "yard submit: command: expected"}}) {
    ParsedSpec fresh;
    const absl::Status s = OverrideJobSpecYaml(fresh, yaml, "yard submit");
    EXPECT_THAT(std::string(s.message()), StartsWith(error)) << yaml;
  }
}

// The spec's table (common/spec_schema.cc): every row names a JobSpec field, its range reads,
// its default is a value of its field; and every JobSpec field is read from YAML under a name.
TEST(SpecTest, TheSchemaTableNamesRealFieldsWithReadableRangesAndDefaults) {
  v1::JobSpec filled;
  filled.mutable_train()->mutable_lora();  // the one option group with defaults
  spec_schema::ApplyDefaults(filled, spec_schema::Scope::kEveryJob);
  spec_schema::ApplyDefaults(filled, spec_schema::Scope::kTrainingJob);
  for (const spec_schema::Field& row : spec_schema::AllFields()) {
    SCOPED_TRACE(std::string(row.path));
    const std::string proto = spec_schema::ProtoPath(row.path);
    const google::protobuf::Message* at = &filled;
    const google::protobuf::FieldDescriptor* field = nullptr;
    for (absl::string_view part : absl::StrSplit(proto, '.')) {
      if (field != nullptr) at = &at->GetReflection()->GetMessage(*at, field);
      field = at->GetDescriptor()->FindFieldByName(std::string(part));
      ASSERT_NE(field, nullptr) << proto;
    }
    for (absl::string_view range : {row.range, row.given}) {
      if (range.empty()) continue;
      std::string why;
      spec_schema::InRange(range, 0, true, &why);
      EXPECT_THAT(why, Not(HasSubstr("unreadable"))) << range;
    }
    if (!row.default_value.empty()) {
      const google::protobuf::Reflection& r = *at->GetReflection();
      EXPECT_TRUE(field->is_repeated()    ? r.FieldSize(*at, field) > 0
                  : field->has_presence() ? r.HasField(*at, field)
                                          : spec_schema::NumberOf(*at, *field).value_or(1) != 0)
          << "default " << row.default_value << " not applied";
    }
  }
  EXPECT_EQ(filled.priority(), 50);
  EXPECT_EQ(filled.train().lora().target_modules_size(), 2);
  EXPECT_EQ(filled.parallel().pipeline_schedule(), v1::ONE_F_ONE_B);
  EXPECT_TRUE(filled.parallel().cpu_ram_efficient_loading());
  EXPECT_DOUBLE_EQ(filled.train().lr(), 3e-4);

  // Every field, at every depth, has its YAML name (renamed ones by their row).
  std::vector<std::pair<const google::protobuf::Descriptor*, std::string>> todo = {
      {v1::JobSpec::descriptor(), ""}};
  int named = 0;
  while (!todo.empty()) {
    auto [d, path] = todo.back();
    todo.pop_back();
    for (int i = 0; i < d->field_count(); ++i) {
      const std::string name = spec_schema::YamlName(path, *d->field(i));
      ASSERT_FALSE(name.empty()) << path << "." << d->field(i)->name();
      const std::string field = path.empty() ? name : path + "." + name;
      EXPECT_EQ(spec_schema::ProtoPath(field),
                path.empty() ? d->field(i)->name() : path + "." + d->field(i)->name());
      ++named;
      if (d->field(i)->message_type() != nullptr && !d->field(i)->is_map()) {
        todo.emplace_back(d->field(i)->message_type(), field);
      }
    }
  }
  EXPECT_GT(named, 80);
}

// The table's text ranges agree with the constants the trainer reads.
TEST(SpecTest, TableRangesAgreeWithTheTrainersLimits) {
  const spec_schema::Field* eval = spec_schema::FindField("train.eval_batches");
  ASSERT_NE(eval, nullptr);
  std::string why;
  EXPECT_TRUE(spec_schema::InRange(eval->range, kMaxEvalWindows, true, &why));
  EXPECT_FALSE(spec_schema::InRange(eval->range, kMaxEvalWindows + 1, true, &why));
}

// description, like every spec string, is at most 4096 bytes, refused naming the field.
TEST(SpecTest, DescriptionIsFreeTextWithinTheStringLimit) {
  auto parsed =
      ParseJobSpecYaml(std::string(kValid) + "description: \"a job\\tfor tests\"\n", "spec.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.description(), "a job\tfor tests");
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.set_description(std::string(4097, 'x'));
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              StartsWith("description: 4097 bytes, at most 4096"));
}

// A range written in the table is the range checked and the range the error says.
TEST(SpecTest, TableRangesReadAsWritten) {
  std::string why;
  EXPECT_TRUE(spec_schema::InRange("1..100", 100, true, &why));
  EXPECT_FALSE(spec_schema::InRange("1..100", 101, true, &why));
  EXPECT_EQ(why, "must be in 1..100, got 101");
  EXPECT_TRUE(spec_schema::InRange("(0, 10]", 10, false, &why));
  EXPECT_FALSE(spec_schema::InRange("(0, 10]", 0, false, &why));
  EXPECT_EQ(why, "must be in (0, 10], got 0");
  EXPECT_FALSE(spec_schema::InRange("[0, 1)", 1, false, &why));
  EXPECT_TRUE(spec_schema::InRange(">= 0", 0, false, &why));
  EXPECT_FALSE(spec_schema::InRange(">= 0", -0.5, false, &why));
  EXPECT_EQ(why, "must be >= 0, got -0.5");
  EXPECT_FALSE(spec_schema::InRange("> 0", 0, false, &why));
  EXPECT_FALSE(spec_schema::InRange(">= 0", std::numeric_limits<double>::infinity(), false, &why));
  EXPECT_FALSE(spec_schema::InRange("[0, 1]", std::nan(""), false, &why));
  EXPECT_FALSE(spec_schema::InRange("1 to 2", 1, true, &why));
  EXPECT_THAT(why, HasSubstr("unreadable range"));
}

// The layout-and-precision rule lives in the validator (issue 53): fp16 with a sharded or
// model-parallel layout is refused at submit, naming the field and its line, not on a rank.
TEST(SpecTest, Fp16WithFsdpIsRefusedByTheValidatorNamingTheField) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/fp16-fsdp.yaml";
  std::ofstream(path) << "name: x\nresources: {gpus: 2}\n"
                         "model: {kind: gpt, n_layer: 1, n_head: 1, d_model: 8, seq_len: 8, "
                         "vocab: 256}\n"
                         "data: {path: /etc/hostname}\n"
                         "train: {steps: 1, mixed_precision: fp16}\n"
                         "parallel: {strategy: fsdp}\n";
  auto parsed = LoadValidJobSpecFile(path);
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()),
              HasSubstr("train.mixed_precision: fp16 (dynamic loss scaling) runs with strategy "
                        "ddp"));
  std::ofstream(path) << "name: x\nresources: {gpus: 2}\n"
                         "model: {kind: gpt, n_layer: 1, n_head: 1, d_model: 8, seq_len: 8, "
                         "vocab: 256}\n"
                         "data: {path: /etc/hostname}\n"
                         "train: {steps: 1, mixed_precision: fp16}\n"
                         "parallel: {strategy: ddp}\n";
  EXPECT_TRUE(LoadValidJobSpecFile(path).ok());
}

TEST(SpecTest, UnknownStrategyIsRejectedWithTheChoices) {
  auto parsed = ParseJobSpecYaml("name: x\nparallel: {strategy: zero3}\n", "s.yaml");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()),
              HasSubstr("parallel.strategy: unknown value 'zero3' (one of ddp, fsdp, offload)"));
}

TEST(SpecTest, DurationsAcceptSecondsOrUnits) {
  auto a = ParseJobSpecYaml("max_runtime: 90\n", "s.yaml");
  auto b = ParseJobSpecYaml("max_runtime: 1h30m\n", "s.yaml");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->spec.max_runtime_seconds(), 90);
  EXPECT_EQ(b->spec.max_runtime_seconds(), 5400);
  EXPECT_FALSE(ParseJobSpecYaml("max_runtime: soon\n", "s.yaml").ok());
}

TEST(SpecTest, PreemptibleAndItsGraceAreReadAndChecked) {
  auto plain = ParseJobSpecYaml("name: x\n", "s.yaml");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->spec.has_preemptible()) << "unset: preemptible";
  auto set = ParseJobSpecYaml("preemptible: false\npreemption_grace: 5m\n", "s.yaml");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_TRUE(set->spec.has_preemptible());
  EXPECT_FALSE(set->spec.preemptible());
  EXPECT_EQ(set->spec.preemption_grace_seconds(), 300);
  auto bad = ParseJobSpecYaml("preemption_grace: 0\n", "s.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("preemption_grace: must be positive"));
  auto not_bool = ParseJobSpecYaml("preemptible: sometimes\n", "s.yaml");
  ASSERT_FALSE(not_bool.ok());
  EXPECT_THAT(std::string(not_bool.status().message()), HasSubstr("preemptible"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_preemption_grace_seconds(-1); }),
              StartsWith("preemption_grace:"));
}

TEST(SpecTest, StopGraceIsADurationOfAtMostADay) {
  auto set = ParseJobSpecYaml("stop_grace: 2m\n", "s.yaml");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->spec.stop_grace_seconds(), 120);
  for (const char* bad : {"stop_grace: 0\n", "stop_grace: 25h\n", "stop_grace: soon\n"}) {
    auto refused = ParseJobSpecYaml(bad, "s.yaml");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("stop_grace")) << bad;
  }
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_stop_grace_seconds(86401); }),
              StartsWith("stop_grace:"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_stop_grace_seconds(-1); }),
              StartsWith("stop_grace:"));
}

TEST(SpecTest, CommandJobsAreReadAndChecked) {
  auto parsed = ParseJobSpecYaml(
      "name: my-ddp\nresources: {gpus: 2}\ncommand: [python3, train.py, --epochs, \"3\"]\n"
      "workdir: /shared/alice/project\nenv: {HF_HOME: /shared/alice/hf}\nmax_restarts: 2\n",
      "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  EXPECT_TRUE(IsCommandJob(spec));
  EXPECT_THAT(spec.command(), ElementsAre("python3", "train.py", "--epochs", "3"));
  EXPECT_EQ(spec.workdir(), "/shared/alice/project");
  EXPECT_EQ(spec.env().at("HF_HOME"), "/shared/alice/hf");
  EXPECT_FALSE(spec.has_model()) << "no built-in trainer defaults for a command job";
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  EXPECT_FALSE(IsCommandJob(ValidSpec()));

  auto error = [&](auto mutate) {
    v1::JobSpec s = spec;
    mutate(s);
    absl::Status status = ValidateJobSpec(s);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    return std::string(status.message());
  };
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_model()->set_kind("gpt"); }),
              StartsWith("model: a command job runs its own program: give command or model"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_train()->set_steps(5); }), StartsWith("train:"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.set_command(0, ""); }), StartsWith("command[0]:"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.set_workdir("project"); }),
              StartsWith("workdir: must be an absolute path"));
  EXPECT_THAT(error([](v1::JobSpec& s) { (*s.mutable_env())["RANK"] = "3"; }),
              StartsWith("env.RANK: is set by trainyard"));
  EXPECT_THAT(error([](v1::JobSpec& s) { (*s.mutable_env())["TRAINYARD_JOB_CREDENTIAL"] = "x"; }),
              StartsWith("env.TRAINYARD_JOB_CREDENTIAL:"));
  EXPECT_THAT(error([](v1::JobSpec& s) { (*s.mutable_env())["1BAD"] = "x"; }),
              StartsWith("env: '1BAD' is not a variable name"));
  EXPECT_THAT(error([](v1::JobSpec& s) { (*s.mutable_env())["A-B"] = "x"; }),
              StartsWith("env: 'A-B'"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.set_max_restarts(101); }), StartsWith("max_restarts:"));
  // A built-in job has neither.
  v1::JobSpec builtin = ValidSpec();
  builtin.set_workdir("/tmp");
  EXPECT_THAT(std::string(ValidateJobSpec(builtin).message()),
              StartsWith("workdir: only a command job"));

  for (const char* yaml :
       {"command: []\n", "command: python3\n", "env: [A]\n", "command: [[a]]\n"}) {
    auto bad = ParseJobSpecYaml(yaml, "s.yaml");
    EXPECT_FALSE(bad.ok()) << yaml;
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr("s.yaml:1:")) << yaml;
  }
}

TEST(SpecTest, ARelativeWorkdirInAFileIsTheFilesFolders) {
  char tmpl[] = "/tmp/spec-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  std::filesystem::create_directories(root + "/project/sub");
  const std::string path = root + "/project/job.yaml";
  std::ofstream(path) << "name: j\nresources: {gpus: 1}\ncommand: [python3, t.py]\nworkdir: "
                         "./sub/\n";
  auto parsed = LoadValidJobSpecFile(path);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.workdir(), root + "/project/sub");
  std::ofstream(path) << "name: j\nresources: {gpus: 1}\ncommand: [python3, t.py]\nworkdir: .\n";
  EXPECT_EQ(LoadValidJobSpecFile(path)->spec.workdir(), root + "/project");
  // Sent as such (not through a file), a relative workdir is refused.
  v1::JobSpec spec = LoadValidJobSpecFile(path)->spec;
  spec.set_workdir("sub");
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              StartsWith("workdir: must be an absolute path"));
  std::filesystem::remove_all(root);
}

TEST(SpecTest, AContextIsAFolderBesideTheFileOrAnUploadsDigestAndOnlyForCommandJobs) {
  char tmpl[] = "/tmp/spec-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  std::filesystem::create_directories(root + "/project");
  const std::string path = root + "/project/job.yaml";
  std::ofstream(path) << "name: j\nresources: {gpus: 1}\ncommand: [python3, t.py]\ncontext: .\n";
  auto parsed = LoadValidJobSpecFile(path);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.context(), root + "/project");  // yard uploads it
  std::ofstream(path) << "name: j\nresources: {gpus: 1}\ncommand: [python3, t.py]\ncontext: .\n"
                         "workdir: /tmp\n";
  EXPECT_THAT(std::string(LoadValidJobSpecFile(path).status().message()),
              HasSubstr("workdir: not with context"));
  std::filesystem::remove_all(root);

  v1::JobSpec spec = parsed->spec;
  spec.set_context("sha256:" + std::string(64, 'e'));
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
  spec.set_context("relative/dir");
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()), StartsWith("context: a folder"));
  v1::JobSpec builtin = ValidSpec();
  builtin.set_context("sha256:" + std::string(64, 'e'));
  EXPECT_THAT(std::string(ValidateJobSpec(builtin).message()),
              StartsWith("context: only a command job"));
}

TEST(SpecTest, NodesAndRanksPerNodeAreTorchrunsAndOnlyForCommandJobs) {
  auto parsed = ParseJobSpecYaml(
      "name: j\nresources: {nodes: 2, ranks_per_node: 4}\ncommand: [python3, t.py]\n", "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  EXPECT_EQ(spec.resources().slots(), 2);  // a device on each node
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  EXPECT_EQ(RanksPerDevice(spec), 4);
  EXPECT_EQ(WorldSizeOf(spec), 8);
  spec.mutable_resources()->set_slots(4);  // 2 devices a node, 2 ranks on each
  EXPECT_EQ(RanksPerDevice(spec), 2);
  EXPECT_EQ(WorldSizeOf(spec), 8);
  auto error = [&](auto mutate) {
    v1::JobSpec s = spec;
    mutate(s);
    return std::string(ValidateJobSpec(s).message());
  };
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_resources()->set_slots(3); }),
              StartsWith("resources.slots: 3 devices do not split evenly over 2 nodes"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_resources()->set_ranks_per_node(3); }),
              StartsWith("resources.ranks_per_node: 3 ranks do not share 2 devices"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_resources()->set_nodes(0); }),
              StartsWith("resources.ranks_per_node: give resources.nodes too"));
  // At most kMaxRanksPerDevice share a device: one device of 65,536 ranks ran them on one node.
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_resources()->set_ranks_per_node(34); }),
              StartsWith("resources.ranks_per_node: 34 ranks on 2 devices a node: at most 16 "
                         "ranks share a device"));
  EXPECT_EQ(error([](v1::JobSpec& s) { s.mutable_resources()->set_ranks_per_node(32); }), "");
  v1::JobSpec builtin = ValidSpec();
  builtin.mutable_resources()->set_nodes(1);
  EXPECT_THAT(std::string(ValidateJobSpec(builtin).message()),
              StartsWith("resources.nodes: only a command job"));
  EXPECT_EQ(WorldSizeOf(ValidSpec()), ValidSpec().resources().slots());
  auto zero = ParseJobSpecYaml("name: j\nresources: {nodes: 0}\ncommand: [a]\n", "s.yaml");
  EXPECT_THAT(std::string(zero.status().message()), HasSubstr("resources.nodes"));
}

TEST(SpecTest, EmptyFileIsAnError) {
  auto parsed = ParseJobSpecYaml("", "empty.yaml");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()), StartsWith("empty.yaml:1:"));
}

TEST(SpecTest, MissingFileIsNotFound) {
  EXPECT_EQ(LoadJobSpecFile("/nonexistent/spec.yaml").status().code(), absl::StatusCode::kNotFound);
}

// model.activation: GPT-2's tanh GELU reaches the trainer's model config; the default is erf's.
TEST(SpecTest, ActivationChoosesTheGelu) {
  v1::JobSpec spec = ValidSpec();
  EXPECT_FALSE(ToModelConfig(spec.model()).gelu_tanh);
  for (const char* activation : {"gelu", "gelu_tanh"}) {
    spec.mutable_model()->set_activation(activation);
    EXPECT_TRUE(ValidateJobSpec(spec).ok()) << activation << ": " << ValidateJobSpec(spec);
    EXPECT_EQ(ToModelConfig(spec.model()).gelu_tanh, std::string(activation) == "gelu_tanh");
  }
  spec.mutable_model()->set_kind("mlp");
  spec.mutable_model()->set_d_hidden(64);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  auto parsed = ParseJobSpecYaml(
      "name: x\nmodel: {kind: gpt, n_layer: 1, n_head: 1, d_model: 8, seq_len: 8, vocab: 256, "
      "activation: gelu_tanh}\ndata: {path: /d}\ntrain: {steps: 1}\n",
      "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.model().activation(), "gelu_tanh");
}

TEST(SpecTest, ValidationNamesTheField) {
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_resources()->set_slots(0); }),
              StartsWith("resources.slots: required"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_model()->set_n_head(3); }),
              StartsWith("model.n_head: must divide model.d_model (256), got 3"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_priority(101); }),
              StartsWith("priority: must be in 1..100, got 101"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_priority(-1); }),
              StartsWith("priority: must be in 1..100"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) {
                s.mutable_parallel()->set_strategy(static_cast<v1::Strategy>(42));
              }),
              StartsWith("parallel.strategy: unknown value 42"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) {
                s.mutable_parallel()->set_sharding_strategy(static_cast<v1::ShardingStrategy>(9));
              }),
              StartsWith("parallel.sharding_strategy: unknown value 9"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_name(""); }), StartsWith("name: required"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_name("a b"); }), StartsWith("name: only"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_name(std::string(200, 'a')); }),
              StartsWith("name: at most 128"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_model()->set_kind("rnn"); }),
              StartsWith("model.kind: unknown value 'rnn'"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_model()->set_activation("relu"); }),
              StartsWith("model.activation: unknown value 'relu' (gelu or gelu_tanh)"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) {
                s.mutable_model()->set_kind("llama");
                s.mutable_model()->set_activation("gelu_tanh");
              }),
              StartsWith("model.activation: llama's MLP is SwiGLU, or hidden_act from"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_model()->set_vocab(100); }),
              StartsWith("model.vocab: must be >= 256 for data.format bytes"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_data()->set_path(""); }),
              StartsWith("data.path: required"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_data()->set_format("csv"); }),
              StartsWith("data.format: unknown value 'csv'"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_train()->set_steps(0); }),
              StartsWith("train.steps: required"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_train()->set_lr(-1); }),
              StartsWith("train.lr: must be in (0, 10]"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_train()->set_warmup(1000); }),
              StartsWith("train.warmup: must be in 0..300"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_parallel()->set_bucket_mb(-5); }),
              StartsWith("parallel.bucket_mb: must be in (0, 1024]"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_parallel()->set_delayed_update(true); }),
              StartsWith("parallel.delayed_update: only applies to strategy offload"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) {
                s.mutable_parallel()->set_auto_wrap_policy(static_cast<v1::WrapPolicy>(7));
              }),
              StartsWith("parallel.auto_wrap_policy: unknown value 7"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_parallel()->set_min_num_params(-3); }),
              StartsWith("parallel.min_num_params: must be in 1.."));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) {
                s.mutable_parallel()->set_backward_prefetch(static_cast<v1::BackwardPrefetch>(8));
              }),
              StartsWith("parallel.backward_prefetch: unknown value 8"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.mutable_parallel()->set_max_gathered_units(-1); }),
              StartsWith("parallel.max_gathered_units: must be in 1..1024, got -1"));
  EXPECT_THAT(ErrorAfter([](v1::JobSpec& s) { s.set_max_restarts(1000); }),
              StartsWith("max_restarts: must be in 0..100"));
}

TEST(SpecTest, ValidationErrorsPointAtTheLineOfTheField) {
  const std::string text =
      "name: x\nresources: {gpus: 1}\nmodel:\n  n_layer: 2\n  n_head: 3\n"
      "  d_model: 8\n  seq_len: 4\ndata: {path: /x}\ntrain: {steps: 5}\n";
  auto parsed = ParseJobSpecYaml(text, "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  absl::Status s = AnnotateWithLine(ValidateJobSpec(spec), *parsed, "s.yaml");
  EXPECT_THAT(std::string(s.message()), StartsWith("s.yaml:5: model.n_head: must divide"));
}

TEST(SpecTest, DataLossMaskIsRead) {
  auto parsed = ParseJobSpecYaml(R"(name: sft
resources: {gpus: 1}
model: {kind: gpt, n_layer: 2, n_head: 4, d_model: 64, seq_len: 32, vocab: 1000}
data: {path: /data/tokens.bin, format: uint16, loss_mask: /data/mask.bin}
train: {steps: 10}
)",
                                 "spec.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ApplyJobSpecDefaults(parsed->spec);
  ASSERT_TRUE(ValidateJobSpec(parsed->spec).ok()) << ValidateJobSpec(parsed->spec);
  EXPECT_EQ(ToJobConfig(parsed->spec).data.loss_mask, "/data/mask.bin");
  auto bad = ParseJobSpecYaml("name: sft\ndata: {path: /d, loss_mask: [1]}\n", "spec.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "spec.yaml:2: data.loss_mask: expected a scalar value");
}

TEST(SpecTest, LoraIsReadDefaultedLikePeftAndChecked) {
  auto parsed = ParseJobSpecYaml(R"(name: ft
resources: {gpus: 1}
model: {kind: llama, n_layer: 2, n_head: 4, d_model: 64, seq_len: 32}
data: {path: /data/tokens.bin}
train:
  steps: 10
  lora: {r: 16, alpha: 32, dropout: 0.05, target_modules: [q_proj, k_proj, down_proj]}
)",
                                 "spec.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  const JobConfig c = ToJobConfig(spec);
  EXPECT_EQ(c.train.lora.r, 16);
  EXPECT_EQ(c.train.lora.alpha, 32);
  EXPECT_EQ(c.train.lora.dropout, 0.05);
  EXPECT_EQ(c.train.lora.target_modules,
            (std::vector<std::string>{"q_proj", "k_proj", "down_proj"}));
  EXPECT_EQ(c.train.lora.scale(), 2.0);

  // `lora: {}`: PEFT's LoraConfig defaults, with its llama targets.
  auto bare = ParseJobSpecYaml(R"(name: ft
model: {kind: llama, n_layer: 2, n_head: 4, d_model: 64, seq_len: 32}
data: {path: /data/tokens.bin}
train: {steps: 10, lora: {}}
)",
                               "spec.yaml");
  ASSERT_TRUE(bare.ok()) << bare.status();
  ApplyJobSpecDefaults(bare->spec);
  const LoraConfig d = ToJobConfig(bare->spec).train.lora;
  EXPECT_EQ(d.r, 8);
  EXPECT_EQ(d.alpha, 8);
  EXPECT_EQ(d.dropout, 0);
  EXPECT_EQ(d.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  // Without train.lora every parameter trains.
  v1::JobSpec none = spec;
  none.mutable_train()->clear_lora();
  EXPECT_FALSE(ToJobConfig(none).train.lora.enabled());

  // Parse errors name the field and line.
  auto parse_error = [](const std::string& lora) {
    auto p = ParseJobSpecYaml("name: ft\nmodel: {kind: llama}\ntrain:\n  lora: " + lora + "\n",
                              "spec.yaml");
    return p.ok() ? std::string("parsed") : std::string(p.status().message());
  };
  EXPECT_EQ(parse_error("{r: 0}"), "spec.yaml:4: train.lora.r: must be >= 1, got 0");
  EXPECT_EQ(parse_error("{alpha: 0}"), "spec.yaml:4: train.lora.alpha: must be > 0, got 0");
  EXPECT_THAT(parse_error("{target_modules: q_proj}"),
              StartsWith("spec.yaml:4: train.lora.target_modules: expected a non-empty list"));
  EXPECT_THAT(parse_error("{rank: 4}"), StartsWith("spec.yaml:4: unknown field 'train.lora.rank'"));

  auto error = [&](std::function<void(v1::JobSpec&)> mutate) {
    v1::JobSpec s = spec;
    mutate(s);
    return std::string(ValidateJobSpec(s).message());
  };
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_model()->set_kind("gpt"); }),
              StartsWith("train.lora: adapts llama's projections; model.kind is gpt"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_parallel()->set_strategy(v1::OFFLOAD); }),
              StartsWith("train.lora: not with parallel.strategy offload"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_train()->mutable_lora()->set_r(5000); }),
              StartsWith("train.lora.r: must be in 1..4096, got 5000"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_train()->mutable_lora()->set_dropout(1); }),
              StartsWith("train.lora.dropout: must be in [0, 1), got 1"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_train()->mutable_lora()->add_target_modules("lm_head");
              }),
              StartsWith("train.lora.target_modules: unknown module 'lm_head' (known: q_proj, "
                         "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_train()->mutable_lora()->add_target_modules("q_proj");
              }),
              StartsWith("train.lora.target_modules: 'q_proj' is listed twice"));
}

// A small GPT spec in s.yaml whose fifth line is `train` (a "train: {...}" line).
absl::StatusOr<ParsedSpec> ParseWithTrain(const std::string& train) {
  return ParseJobSpecYaml(R"(name: o
resources: {gpus: 1}
model: {kind: gpt, n_layer: 2, n_head: 4, d_model: 64, seq_len: 32}
data: {path: /data/tokens.bin}
)" + train,
                          "s.yaml");
}

TEST(SpecTest, OptimizerIsReadDefaultedAndChecked) {
  for (const auto& [name, kind] : std::vector<std::pair<std::string, OptimizerKind>>{
           {"adamw", OptimizerKind::kAdamW},
           {"adafactor", OptimizerKind::kAdafactor},
           {"lion", OptimizerKind::kLion},
           {"adamw_8bit", OptimizerKind::kAdamW8bit}}) {
    auto parsed = ParseWithTrain("train: {steps: 10, optimizer: " + name + "}\n");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ApplyJobSpecDefaults(parsed->spec);
    ASSERT_TRUE(ValidateJobSpec(parsed->spec).ok()) << ValidateJobSpec(parsed->spec);
    EXPECT_EQ(ToJobConfig(parsed->spec).train.optimizer, kind) << name;
    EXPECT_EQ(OptimizerName(parsed->spec.train().optimizer()), name);
    EXPECT_STREQ(Name(kind), name.c_str());
  }
  auto plain = ParseWithTrain("train: {steps: 10}\n");
  ASSERT_TRUE(plain.ok()) << plain.status();
  ApplyJobSpecDefaults(plain->spec);
  EXPECT_EQ(plain->spec.train().optimizer(), v1::ADAMW);

  auto bad = ParseWithTrain("train: {steps: 10, optimizer: sgd}\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), StartsWith("s.yaml:5: train.optimizer: "));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("'sgd'"));

  v1::JobSpec spec = plain->spec;
  spec.mutable_train()->set_optimizer(static_cast<v1::Optimizer>(9));
  EXPECT_THAT(
      std::string(ValidateJobSpec(spec).message()),
      StartsWith("train.optimizer: unknown value 9 (adamw, adafactor, lion or adamw_8bit)"));
  // The parameter servers apply AdamW only.
  spec.mutable_train()->set_optimizer(v1::LION);
  spec.mutable_parallel()->set_strategy(v1::OFFLOAD);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              StartsWith("train.optimizer: lion does not run on the parameter servers"));
  spec.mutable_train()->set_optimizer(v1::ADAMW);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              ::testing::Not(HasSubstr("train.optimizer")));
}

// The optimizer's constants and weight-decay exclusions: read as given (absent ones stay unset,
// the optimizer's defaults), and checked naming the field.
TEST(SpecTest, OptimizerSettingsAreReadAndChecked) {
  auto parsed = ParseWithTrain(
      "train: {steps: 10, adam_beta1: 0.85, adam_beta2: 0.999, adam_epsilon: 1.0e-6, "
      "no_weight_decay: [bias, norm], weight_decay: 0.1}\n");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ApplyJobSpecDefaults(parsed->spec);
  ASSERT_TRUE(ValidateJobSpec(parsed->spec).ok()) << ValidateJobSpec(parsed->spec);
  const TrainConfig t = ToJobConfig(parsed->spec).train;
  EXPECT_EQ(t.adam_beta1, 0.85);
  EXPECT_EQ(t.adam_beta2, 0.999);
  EXPECT_EQ(t.adam_epsilon, 1e-6);
  EXPECT_THAT(t.no_weight_decay, ElementsAre("bias", "norm"));
  auto plain = ParseWithTrain(
      "train: {steps: 10, optimizer: adafactor, adafactor_eps: 1.0e-20, "
      "adafactor_clip_threshold: 0.5, adafactor_decay_rate: -0.6}\n");
  ASSERT_TRUE(plain.ok()) << plain.status();
  ApplyJobSpecDefaults(plain->spec);
  ASSERT_TRUE(ValidateJobSpec(plain->spec).ok()) << ValidateJobSpec(plain->spec);
  const TrainConfig a = ToJobConfig(plain->spec).train;
  EXPECT_FALSE(a.adam_beta1.has_value());
  EXPECT_EQ(a.adafactor_eps, 1e-20);
  EXPECT_EQ(a.adafactor_clip_threshold, 0.5);
  EXPECT_EQ(a.adafactor_decay_rate, -0.6);

  auto bad = ParseWithTrain("train: {steps: 10, no_weight_decay: bias}\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              StartsWith("s.yaml:5: train.no_weight_decay: expected a list"));
  auto error_of = [](v1::JobSpec spec, std::function<void(v1::TrainSpec&)> mutate) {
    mutate(*spec.mutable_train());
    return std::string(ValidateJobSpec(spec).message());
  };
  auto error = [&](std::function<void(v1::TrainSpec&)> mutate) {
    return error_of(parsed->spec, mutate);
  };
  EXPECT_THAT(error([](v1::TrainSpec& t) { t.set_adam_beta1(1); }),
              StartsWith("train.adam_beta1: must be in [0, 1), got 1"));
  EXPECT_THAT(error([](v1::TrainSpec& t) { t.set_adam_beta2(-0.1); }),
              StartsWith("train.adam_beta2: must be in [0, 1)"));
  EXPECT_THAT(error([](v1::TrainSpec& t) { t.set_adam_epsilon(0); }),
              StartsWith("train.adam_epsilon: must be in (0, 1]"));
  EXPECT_THAT(error([](v1::TrainSpec& t) { t.set_optimizer(v1::LION); }),
              StartsWith("train.adam_epsilon: lion has no epsilon"));
  EXPECT_THAT(error([](v1::TrainSpec& t) { t.set_optimizer(v1::ADAFACTOR); }),
              StartsWith("train.adam_beta1: adafactor has no betas"));
  EXPECT_THAT(error([](v1::TrainSpec& t) { t.set_adafactor_clip_threshold(1); }),
              StartsWith("train.adafactor_clip_threshold: is adafactor's; train.optimizer is "
                         "adamw"));
  EXPECT_THAT(error([](v1::TrainSpec& t) { t.add_no_weight_decay("layernorm"); }),
              StartsWith("train.no_weight_decay: unknown kind 'layernorm' (bias, norm or "
                         "embedding)"));
  EXPECT_THAT(error([](v1::TrainSpec& t) { t.add_no_weight_decay("bias"); }),
              StartsWith("train.no_weight_decay: 'bias' is listed twice"));
  v1::JobSpec offload = parsed->spec;
  offload.mutable_parallel()->set_strategy(v1::OFFLOAD);
  EXPECT_THAT(std::string(ValidateJobSpec(offload).message()),
              StartsWith("train.no_weight_decay: not with parallel.strategy offload"));
  auto adafactor_error = [&](std::function<void(v1::TrainSpec&)> mutate) {
    return error_of(plain->spec, mutate);
  };
  EXPECT_THAT(adafactor_error([](v1::TrainSpec& t) { t.set_adafactor_decay_rate(0); }),
              StartsWith("train.adafactor_decay_rate: must be in [-1, 0)"));
  EXPECT_THAT(adafactor_error([](v1::TrainSpec& t) { t.set_adafactor_eps(0.1); }),
              StartsWith("train.adafactor_eps: must be in (0, 1e-3]"));
}

// Evaluation and keep_best: read, and refused without the held-out data they need.
TEST(SpecTest, EvaluationAndKeepBestAreReadAndChecked) {
  auto parsed = ParseJobSpecYaml(R"(name: e
resources: {gpus: 1}
model: {kind: gpt, n_layer: 2, n_head: 4, d_model: 64, seq_len: 32, vocab: 1000}
data: {path: /data/train.bin, format: uint16, eval_path: /data/val.bin, eval_loss_mask: /data/val.mask}
train: {steps: 100, eval_every: 20, eval_batches: 4}
checkpoint: {every_steps: 20, keep_last: 2, keep_best: true}
)",
                                 "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ApplyJobSpecDefaults(parsed->spec);
  ASSERT_TRUE(ValidateJobSpec(parsed->spec).ok()) << ValidateJobSpec(parsed->spec);
  const JobConfig c = ToJobConfig(parsed->spec);
  EXPECT_EQ(c.data.eval_path, "/data/val.bin");
  EXPECT_EQ(c.data.eval_loss_mask, "/data/val.mask");
  EXPECT_EQ(c.train.eval_every, 20);
  EXPECT_EQ(c.train.eval_batches, 4);
  EXPECT_TRUE(c.checkpoint_keep_best);
  auto error = [&](std::function<void(v1::JobSpec&)> mutate) {
    v1::JobSpec spec = parsed->spec;
    mutate(spec);
    return std::string(ValidateJobSpec(spec).message());
  };
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_train()->set_eval_every(101); }),
              StartsWith("train.eval_every: must be in 0..100, got 101"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_train()->set_eval_batches(-1); }),
              StartsWith("train.eval_batches:"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_data()->clear_eval_path();
                s.mutable_data()->clear_eval_loss_mask();
              }),
              StartsWith("train.eval_every: needs data.eval_path"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_data()->clear_eval_path(); }),
              StartsWith("data.eval_loss_mask: needs data.eval_path"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_data()->clear_eval_path();
                s.mutable_data()->clear_eval_loss_mask();
                s.mutable_train()->set_eval_every(0);
              }),
              StartsWith("checkpoint.keep_best: needs an evaluation"));
}

TEST(SpecTest, CheckpointExportIsReadAndChecked) {
  auto parsed = ParseJobSpecYaml(R"(name: ft
resources: {gpus: 1}
model: {kind: llama, n_layer: 2, n_head: 4, d_model: 64, seq_len: 32}
data: {path: /data/tokens.bin}
train: {steps: 10, lora: {}}
checkpoint: {every_steps: 5, export: hf_merged}
)",
                                 "spec.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  EXPECT_EQ(spec.checkpoint().export_format(), v1::EXPORT_HF_MERGED);
  EXPECT_EQ(ToJobConfig(spec).export_format, ExportFormat::kHfMerged);
  spec.mutable_checkpoint()->set_export_format(v1::EXPORT_HF);
  EXPECT_EQ(ToJobConfig(spec).export_format, ExportFormat::kHf);
  spec.mutable_checkpoint()->clear_export_format();
  EXPECT_EQ(ToJobConfig(spec).export_format, ExportFormat::kNone);

  auto bad = ParseJobSpecYaml("name: ft\ncheckpoint: {export: onnx}\n", "spec.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              StartsWith("spec.yaml:2: checkpoint.export: unknown value 'onnx'"));
  auto error = [&](std::function<void(v1::JobSpec&)> mutate) {
    v1::JobSpec s = spec;
    s.mutable_checkpoint()->set_export_format(v1::EXPORT_HF_MERGED);
    mutate(s);
    return std::string(ValidateJobSpec(s).message());
  };
  EXPECT_EQ(error([](v1::JobSpec& s) { s.mutable_train()->clear_lora(); }),
            "checkpoint.export: hf_merged merges train.lora's adapters, and the job has none: "
            "use hf");
  EXPECT_EQ(error([](v1::JobSpec& s) {
              s.mutable_train()->clear_lora();
              s.mutable_model()->set_kind("gpt");
              s.mutable_checkpoint()->set_export_format(v1::EXPORT_HF);
            }),
            "checkpoint.export: writes Llama-family models (llama); model.kind is gpt");
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_checkpoint()->set_export_format(static_cast<v1::ExportFormat>(7));
              }),
              StartsWith("checkpoint.export: unknown value 7"));
}

TEST(SpecTest, LlamaFieldsAreReadDefaultedAndChecked) {
  auto parsed = ParseJobSpecYaml(R"(name: ft
resources: {gpus: 1}
model: {kind: llama, from: /models/tiny, seq_len: 64, n_kv_head: 2, head_dim: 16}
data: {path: /data/tokens.bin, format: uint32}
train: {steps: 10}
)",
                                 "spec.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  v1::JobSpec spec = parsed->spec;
  ApplyJobSpecDefaults(spec);
  // The sizes left out come from the checkpoint's config.json, in the trainer.
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  EXPECT_EQ(spec.model().n_layer(), 0);
  const JobConfig c = ToJobConfig(spec);
  EXPECT_EQ(c.model.from, "/models/tiny");
  EXPECT_EQ(c.model.n_kv_head, 2);
  EXPECT_EQ(c.model.head_dim, 16);
  // Those of the checkpoint's config.json only.
  v1::JobSpec theta = spec;
  theta.mutable_model()->set_rope_theta(500000);
  EXPECT_THAT(std::string(ValidateJobSpec(theta).message()),
              StartsWith("model.rope_theta: comes from model.from's config.json"));
  // Offload sizes its parameter servers at submit: it needs the sizes.
  v1::JobSpec offload = spec;
  offload.mutable_parallel()->set_strategy(v1::OFFLOAD);
  EXPECT_THAT(std::string(ValidateJobSpec(offload).message()),
              StartsWith("model.n_layer: required with parallel.strategy offload"));

  // Without a checkpoint: Llama's defaults for what is left out.
  v1::JobSpec random = spec;
  auto* m = random.mutable_model();
  m->clear_from();
  m->set_n_layer(2);
  m->set_d_model(96);
  m->set_n_head(6);
  m->set_vocab(1000);
  m->set_n_kv_head(0);
  m->set_head_dim(0);
  m->set_rope_theta(500000);
  ApplyJobSpecDefaults(random);
  EXPECT_TRUE(ValidateJobSpec(random).ok()) << ValidateJobSpec(random);
  EXPECT_EQ(random.model().d_hidden(), 256);  // 8/3 * 96, rounded up to a multiple of 64
  EXPECT_EQ(random.model().n_kv_head(), 6);
  EXPECT_EQ(random.model().rope_theta(), 500000);  // given

  auto error = [&](std::function<void(v1::ModelSpec&)> mutate) {
    v1::JobSpec s = random;
    mutate(*s.mutable_model());
    return std::string(ValidateJobSpec(s).message());
  };
  EXPECT_THAT(error([](v1::ModelSpec& m) { m.set_n_kv_head(4); }),
              StartsWith("model.n_kv_head: must divide model.n_head (6), got 4"));
  EXPECT_THAT(error([](v1::ModelSpec& m) { m.set_head_dim(15); }),
              StartsWith("model.head_dim: the head dimension must be even"));
  EXPECT_THAT(error([](v1::ModelSpec& m) { m.set_from("models/tiny"); }),
              StartsWith("model.from: must be an absolute path"));
  EXPECT_THAT(error([](v1::ModelSpec& m) { m.set_n_layer(0); }),
              StartsWith("model.n_layer: required"));  // no checkpoint to take it from
  EXPECT_THAT(error([](v1::ModelSpec& m) { m.set_rms_norm_eps(-1); }),
              StartsWith("model.rms_norm_eps: must be > 0"));
  EXPECT_THAT(error([](v1::ModelSpec& m) {
                m.set_kind("gpt");
                m.set_from("/models/tiny");
              }),
              StartsWith("model.from: only model.kind llama"));
}

TEST(SpecTest, PipelineIsReadDefaultedAndChecked) {
  const std::string base = R"(name: p
resources: {gpus: 4}
model: {kind: gpt, n_layer: 6, n_head: 4, d_model: 64, seq_len: 32}
data: {path: /data/tokens.bin}
train: {steps: 10}
)";
  auto parse = [&](const std::string& more) { return ParseJobSpecYaml(base + more, "s.yaml"); };
  auto parsed =
      parse("parallel: {pipeline_stages: 2, pipeline_schedule: gpipe, pipeline_split: [2, 4]}\n");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ApplyJobSpecDefaults(parsed->spec);
  ASSERT_TRUE(ValidateJobSpec(parsed->spec).ok()) << ValidateJobSpec(parsed->spec);
  JobConfig c = ToJobConfig(parsed->spec);
  EXPECT_EQ(c.parallel.pipeline_stages, 2);
  EXPECT_EQ(c.parallel.pipeline_schedule, PipelineSchedule::kGpipe);
  EXPECT_EQ(c.parallel.pipeline_split, (std::vector<int>{2, 4}));
  EXPECT_EQ(c.train.micro_batches, 4);  // default 2 x stages
  EXPECT_EQ(PipelineBoundaries(c.model, 2, c.parallel.pipeline_split), (std::vector<int>{0, 2, 6}));

  // Defaults: no pipeline; with one, 1F1B.
  auto plain = parse("");
  ASSERT_TRUE(plain.ok());
  ApplyJobSpecDefaults(plain->spec);
  EXPECT_EQ(plain->spec.parallel().pipeline_stages(), 1);
  EXPECT_EQ(ToJobConfig(plain->spec).parallel.pipeline_schedule, PipelineSchedule::kOneFOneB);
  EXPECT_EQ(plain->spec.train().micro_batches(), 0);

  auto bad = parse("parallel: {pipeline_schedule: interleaved}\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              StartsWith("s.yaml:6: parallel.pipeline_schedule: unknown value 'interleaved' "
                         "(one of gpipe, 1f1b)"));
  bad = parse("parallel: {pipeline_split: [2, x]}\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("parallel.pipeline_split: expected an integer, got 'x'"));

  auto error = [&](const std::function<void(v1::JobSpec&)>& mutate) {
    v1::JobSpec spec = parsed->spec;
    mutate(spec);
    return std::string(ValidateJobSpec(spec).message());
  };
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_resources()->set_slots(3); }),
              StartsWith("resources.slots: 3 ranks do not split into 2 pipeline stages"));
  // FSDP within the stages, every sharding strategy (NO_SHARD is ddp).
  for (v1::ShardingStrategy ss :
       {v1::FULL_SHARD, v1::SHARD_GRAD_OP, v1::NO_SHARD, v1::HYBRID_SHARD}) {
    EXPECT_EQ(error([&](v1::JobSpec& s) {
                s.mutable_parallel()->set_strategy(v1::FSDP);
                s.mutable_parallel()->set_sharding_strategy(ss);
              }),
              "")
        << v1::ShardingStrategy_Name(ss);
  }
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_parallel()->set_strategy(v1::OFFLOAD); }),
              StartsWith("parallel.pipeline_stages: pipeline stages are replicated with ddp or "
                         "fsdp; parallel.strategy is offload"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_train()->set_grad_accum(2); }),
              StartsWith("train.grad_accum: must be 1 with pipeline parallelism, got 2"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_train()->set_micro_batches(-1); }),
              StartsWith("train.micro_batches: must be in 1..65536, got -1"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_parallel()->add_pipeline_split(1); }),
              StartsWith("parallel.pipeline_split: has 3 entries for 2 pipeline stages"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_parallel()->set_pipeline_split(0, 3); }),
              StartsWith("parallel.pipeline_split: sums to 7 blocks; model.n_layer is 6"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_parallel()->set_pipeline_split(0, 0); }),
              StartsWith("parallel.pipeline_split: every stage needs at least one block, got 0"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_parallel()->clear_pipeline_split();
                s.mutable_parallel()->set_pipeline_stages(8);
                s.mutable_resources()->set_slots(8);
              }),
              StartsWith("parallel.pipeline_stages: 8 stages need at least as many blocks; "
                         "model.n_layer is 6"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_parallel()->set_pipeline_schedule(static_cast<v1::PipelineSchedule>(7));
              }),
              StartsWith("parallel.pipeline_schedule: unknown value 7 (gpipe or 1f1b)"));
  // Without a pipeline its knobs mean nothing, and are refused rather than ignored.
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_parallel()->set_pipeline_stages(1);
                s.mutable_parallel()->clear_pipeline_split();
              }),
              StartsWith("train.micro_batches: applies to pipeline parallelism"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_parallel()->set_pipeline_stages(1); }),
              StartsWith("parallel.pipeline_split: applies to parallel.pipeline_stages > 1"));
}

TEST(SpecTest, TensorParallelIsReadDefaultedAndChecked) {
  const std::string base = R"(name: t
resources: {gpus: 8}
model: {kind: gpt, n_layer: 4, n_head: 4, d_model: 64, seq_len: 32}
data: {path: /data/tokens.bin}
train: {steps: 10}
)";
  auto parsed = ParseJobSpecYaml(base +
                                     "parallel: {pipeline_stages: 2, tensor_parallel: 2, "
                                     "sequence_parallel: false}\n",
                                 "s.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ApplyJobSpecDefaults(parsed->spec);
  ASSERT_TRUE(ValidateJobSpec(parsed->spec).ok()) << ValidateJobSpec(parsed->spec);
  EXPECT_EQ(ToJobConfig(parsed->spec).parallel.tensor_parallel, 2);
  auto plain = ParseJobSpecYaml(base, "s.yaml");
  ASSERT_TRUE(plain.ok());
  ApplyJobSpecDefaults(plain->spec);
  EXPECT_EQ(plain->spec.parallel().tensor_parallel(), 1);

  auto error = [&](const std::function<void(v1::JobSpec&)>& mutate) {
    v1::JobSpec spec = parsed->spec;
    mutate(spec);
    return std::string(ValidateJobSpec(spec).message());
  };
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_resources()->set_slots(6); }),
              StartsWith("resources.slots: 6 ranks do not split into 2 pipeline stages"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_parallel()->set_pipeline_stages(1);
                s.mutable_train()->set_micro_batches(0);
                s.mutable_resources()->set_slots(6);
                s.mutable_parallel()->set_tensor_parallel(4);
              }),
              StartsWith("resources.slots: 6 ranks do not split into 1 pipeline stages x 4 "
                         "tensor-parallel ranks: use a multiple of 4"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_parallel()->set_tensor_parallel(0); }),
              StartsWith("parallel.tensor_parallel: must be in 1..1024, got 0"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_model()->set_n_head(3); }),
              HasSubstr("model.n_head"));
  EXPECT_THAT(
      error([](v1::JobSpec& s) {
        s.mutable_model()->set_n_head(2);
        s.mutable_model()->set_d_model(64);
        s.mutable_parallel()->set_tensor_parallel(4);
        s.mutable_parallel()->set_pipeline_stages(1);
        s.mutable_train()->set_micro_batches(0);
      }),
      StartsWith("model.n_head: must be a multiple of parallel.tensor_parallel (4), got 2"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_parallel()->set_sequence_parallel(true);
                s.mutable_model()->set_seq_len(33);
              }),
              StartsWith("model.seq_len: must be a multiple of parallel.tensor_parallel (2) with "
                         "parallel.sequence_parallel, got 33"));
  EXPECT_THAT(
      error([](v1::JobSpec& s) {
        s.mutable_parallel()->set_sequence_parallel(true);
        s.mutable_parallel()->set_tensor_parallel(1);
      }),
      StartsWith("parallel.sequence_parallel: splits the sequence over tensor-parallel ranks"));
  EXPECT_THAT(
      error([](v1::JobSpec& s) { s.mutable_model()->set_vocab(257); }),
      StartsWith("model.vocab: must be a multiple of parallel.tensor_parallel (2), got 257"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_model()->set_kind("mlp");
                s.mutable_model()->set_d_hidden(128);
              }),
              StartsWith("parallel.tensor_parallel: splits the layers of gpt and llama models; "
                         "model.kind is mlp"));
  EXPECT_THAT(error([](v1::JobSpec& s) { s.mutable_train()->set_optimizer(v1::ADAFACTOR); }),
              StartsWith("train.optimizer: adafactor keeps state across whole rows"));
  EXPECT_EQ(error([](v1::JobSpec& s) { s.mutable_parallel()->set_strategy(v1::FSDP); }), "");
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_parallel()->set_pipeline_stages(1);
                s.mutable_train()->set_micro_batches(0);
                s.mutable_parallel()->set_strategy(v1::OFFLOAD);
              }),
              StartsWith("parallel.tensor_parallel: tensor-parallel groups are replicated with "
                         "ddp or fsdp; parallel.strategy is offload"));
  EXPECT_EQ(error([](v1::JobSpec& s) {
              s.mutable_parallel()->set_pipeline_stages(1);
              s.mutable_train()->set_micro_batches(0);
              s.mutable_parallel()->set_strategy(v1::FSDP);
              s.mutable_parallel()->set_sharding_strategy(v1::HYBRID_SHARD);
            }),
            "");
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_model()->set_kind("llama");
                s.mutable_model()->set_n_kv_head(1);
                s.mutable_model()->set_d_hidden(192);
              }),
              StartsWith("model.n_kv_head: must be a multiple of parallel.tensor_parallel (2), "
                         "got 1"));
  EXPECT_THAT(error([](v1::JobSpec& s) {
                s.mutable_model()->set_kind("llama");
                s.mutable_model()->set_n_kv_head(2);
                s.mutable_model()->set_d_hidden(192);
                auto* lora = s.mutable_train()->mutable_lora();
                lora->set_r(8);
                lora->set_alpha(8);
                lora->add_target_modules("q_proj");
              }),
              StartsWith("train.lora: not with parallel.tensor_parallel"));
}

// The ranks the scheduler keeps on one node: a tensor-parallel group; under fsdp HYBRID_SHARD with
// model parallelism, a whole replica (its stages' tensor-parallel groups).
TEST(SpecTest, RankBlockKeepsTensorGroupsAndHybridReplicasOnOneNode) {
  v1::JobSpec spec;
  EXPECT_EQ(RankBlockOf(spec), 1);
  spec.mutable_parallel()->set_tensor_parallel(2);
  EXPECT_EQ(RankBlockOf(spec), 2);
  spec.mutable_parallel()->set_pipeline_stages(3);
  EXPECT_EQ(RankBlockOf(spec), 2);
  spec.mutable_parallel()->set_strategy(v1::FSDP);
  spec.mutable_parallel()->set_sharding_strategy(v1::FULL_SHARD);
  EXPECT_EQ(RankBlockOf(spec), 2);
  spec.mutable_parallel()->set_sharding_strategy(v1::HYBRID_SHARD);
  EXPECT_EQ(RankBlockOf(spec), 6);
  spec.mutable_parallel()->set_tensor_parallel(1);
  EXPECT_EQ(RankBlockOf(spec), 3);
  spec.mutable_parallel()->set_pipeline_stages(1);  // plain HYBRID_SHARD: any split
  EXPECT_EQ(RankBlockOf(spec), 1);
}

TEST(SpecTest, PipelineStagesAreBalancedByParameters) {
  ModelConfig m;
  m.kind = "gpt";
  m.n_layer = 8;
  m.n_head = 4;
  m.d_model = 64;
  m.seq_len = 32;
  m.vocab = 256;
  // Blocks of 12 d^2 + 13 d = 49,984 parameters; embeddings 18,432, head 16,512: even splits.
  EXPECT_EQ(PipelineBoundaries(m, 2, {}), (std::vector<int>{0, 4, 8}));
  EXPECT_EQ(PipelineBoundaries(m, 4, {}), (std::vector<int>{0, 2, 4, 6, 8}));
  EXPECT_EQ(PipelineBoundaries(m, 8, {}), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  // A large vocabulary: the first and the last stage take fewer blocks.
  m.vocab = 50304;  // embeddings and head of 3.2M parameters each, 64 blocks' worth
  m.n_layer = 130;
  const std::vector<int> b = PipelineBoundaries(m, 2, {});
  EXPECT_EQ(b, (std::vector<int>{0, 65, 130}));  // symmetric: both ends weigh the same
  m.tie_weights = false;
  m.n_layer = 6;
  m.vocab = 4096;  // embeddings 264,192 (5.3 blocks), head 262,272
  EXPECT_EQ(PipelineBoundaries(m, 3, {}), (std::vector<int>{0, 1, 5, 6}));
  // An explicit split is taken as it is.
  EXPECT_EQ(PipelineBoundaries(m, 3, {1, 1, 4}), (std::vector<int>{0, 1, 2, 6}));
}

TEST(SpecTest, ParameterCountMatchesHandComputedGpt) {
  v1::ModelSpec m;
  m.set_kind("gpt");
  m.set_n_layer(4);
  m.set_n_head(4);
  m.set_d_model(256);
  m.set_seq_len(128);
  m.set_vocab(256);
  // embeddings 256*256 + 128*256; per block 12*d^2 + 13*d; final LayerNorm 2*d; untied head.
  const int64_t d = 256;
  const int64_t expected = 256 * d + 128 * d + 4 * (12 * d * d + 13 * d) + 2 * d + 256 * d;
  EXPECT_EQ(ModelParameterCount(m), expected);
  m.set_tie_weights(true);
  EXPECT_EQ(ModelParameterCount(m), expected - 256 * d);
}

}  // namespace
}  // namespace trainyard
