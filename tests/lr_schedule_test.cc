// train.lr_schedule: each of Hugging Face's schedules against transformers' get_scheduler itself
// (tests/lr_schedule_reference.py in build/hf-venv, which scripts/setup.sh makes), step by step
// for the same settings, warmup_ratio as TrainingArguments resolves it; trainyard's warmup_cosine
// as before; and the spec's checks of the new fields.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/lr_schedule.h"
#include "common/spec.h"
#include "tests/testing/subprocess.h"

namespace trainyard {
namespace {

using ::testing::HasSubstr;

struct Case {
  v1::LrSchedule schedule;
  int64_t steps;
  int64_t warmup;
  double warmup_ratio;
  std::optional<double> min_lr_ratio;
};

v1::JobSpec SpecOf(const Case& c) {
  v1::JobSpec spec;
  auto& t = *spec.mutable_train();
  t.set_steps(c.steps);
  t.set_lr(3e-4);
  t.set_warmup(c.warmup);
  t.set_warmup_ratio(c.warmup_ratio);
  t.set_lr_schedule(c.schedule);
  if (c.min_lr_ratio.has_value()) t.set_min_lr_ratio(*c.min_lr_ratio);
  return spec;
}

TEST(LrScheduleTest, EachScheduleMatchesTransformersStepByStep) {
  const std::string python = testing::TestBinPath("../hf-venv/bin/python");
  ASSERT_TRUE(std::filesystem::exists(python))
      << python << " is missing: scripts/setup.sh creates it (transformers from PyPI)";
  const std::vector<Case> cases = {
      {v1::CONSTANT, 20, 0, 0, std::nullopt},  {v1::CONSTANT_WITH_WARMUP, 20, 4, 0, std::nullopt},
      {v1::LINEAR, 30, 5, 0, std::nullopt},    {v1::LINEAR, 30, 0, 0, std::nullopt},
      {v1::COSINE, 40, 0, 0.1, std::nullopt},   // warmup ceil(40 x 0.1) = 4
      {v1::COSINE, 33, 0, 0.07, std::nullopt},  // ceil(2.31) = 3
      {v1::COSINE_WITH_MIN_LR, 40, 6, 0, 0.1}, {v1::COSINE_WITH_MIN_LR, 25, 0, 0.2, 0.35},
  };
  nlohmann::json request = nlohmann::json::array();
  std::vector<std::vector<double>> ours;
  for (const Case& c : cases) {
    const JobConfig config = ToJobConfig(SpecOf(c));
    nlohmann::json one = {
        {"name", LrScheduleName(c.schedule)},
        {"steps", c.steps},
        // TrainingArguments.get_warmup_steps: ceil(steps x warmup_ratio).
        {"warmup",
         c.warmup > 0 ? c.warmup : static_cast<int64_t>(std::ceil(c.steps * c.warmup_ratio))},
        {"lr", 3e-4}};
    if (c.min_lr_ratio.has_value()) one["min_lr_rate"] = *c.min_lr_ratio;
    request.push_back(one);
    std::vector<double> lrs;
    for (int64_t s = 0; s < c.steps; ++s) lrs.push_back(ScheduledLearningRate(s, config.train));
    ours.push_back(std::move(lrs));
  }
  testing::TempDir dir;
  const std::string out = dir.path() + "/lrs.json";
  const auto r = testing::RunCommand(
      {python, std::string(TRAINYARD_SOURCE_DIR) + "/tests/lr_schedule_reference.py", out,
       request.dump()},
      {"TRANSFORMERS_VERBOSITY=error", "HF_HUB_OFFLINE=1"}, absl::Seconds(240));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream in(out);
  const nlohmann::json theirs = nlohmann::json::parse(in);
  ASSERT_EQ(theirs.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_EQ(theirs[i].size(), ours[i].size()) << i;
    for (size_t s = 0; s < ours[i].size(); ++s) {
      EXPECT_NEAR(ours[i][s], theirs[i][s].get<double>(), 1e-15)
          << LrScheduleName(cases[i].schedule) << " case " << i << " step " << s;
    }
  }
}

TEST(LrScheduleTest, WarmupCosineIsTodaysDefault) {
  // An old spec (no lr_schedule): warmup from lr / warmup, then a cosine to 0.1 x lr.
  const JobConfig c = ToJobConfig(SpecOf({v1::LR_SCHEDULE_UNSPECIFIED, 100, 10, 0, std::nullopt}));
  EXPECT_EQ(c.train.lr_schedule, LrSchedule::kWarmupCosine);
  EXPECT_DOUBLE_EQ(ScheduledLearningRate(0, c.train), 3e-5);
  EXPECT_DOUBLE_EQ(ScheduledLearningRate(9, c.train), 3e-4);
  EXPECT_NEAR(ScheduledLearningRate(55, c.train), 0.55 * 3e-4, 1e-15);
  EXPECT_NEAR(ScheduledLearningRate(100, c.train), 3e-5, 1e-15);
  // min_lr_ratio moves where it ends.
  const JobConfig low = ToJobConfig(SpecOf({v1::WARMUP_COSINE, 100, 10, 0, 0.0}));
  EXPECT_NEAR(ScheduledLearningRate(100, low.train), 0, 1e-15);
}

TEST(LrScheduleTest, TheSpecRefusesSettingsThatDoNotFitNamingTheField) {
  auto yaml = [](const std::string& train) {
    return "name: schedule\nresources: {gpus: 1}\n"
           "model: {kind: gpt, n_layer: 1, n_head: 1, d_model: 8, seq_len: 4, vocab: 256}\n"
           "data: {path: /usr/share/common-licenses/GPL-3}\n"
           "train: {steps: 10, micro_batch: 1, lr: 0.001, " +
           train + "}\n";
  };
  auto check = [&](const std::string& train) -> absl::Status {
    auto parsed = ParseJobSpecYaml(yaml(train), "spec.yaml");
    if (!parsed.ok()) return parsed.status();
    ApplyJobSpecDefaults(parsed->spec);
    return ValidateJobSpec(parsed->spec);
  };
  EXPECT_TRUE(check("lr_schedule: cosine, warmup_ratio: 0.1").ok());
  EXPECT_TRUE(check("lr_schedule: cosine_with_min_lr, min_lr_ratio: 0.1").ok());
  EXPECT_THAT(std::string(check("lr_schedule: cosine_annealing").message()),
              HasSubstr("train.lr_schedule"));
  EXPECT_THAT(std::string(check("warmup: 2, warmup_ratio: 0.1").message()),
              HasSubstr("train.warmup_ratio: give train.warmup (steps) or train.warmup_ratio"));
  EXPECT_THAT(std::string(check("warmup_ratio: 1.5").message()),
              HasSubstr("train.warmup_ratio: must be in [0, 1]"));
  EXPECT_THAT(std::string(check("lr_schedule: cosine_with_min_lr").message()),
              HasSubstr("train.min_lr_ratio: cosine_with_min_lr needs it"));
  EXPECT_THAT(std::string(check("lr_schedule: linear, min_lr_ratio: 0.1").message()),
              HasSubstr("train.min_lr_ratio: only warmup_cosine and cosine_with_min_lr"));
  EXPECT_THAT(std::string(check("lr_schedule: constant, warmup: 3").message()),
              HasSubstr("train.lr_schedule: constant has no warmup"));
  // The default is written into the spec at submit.
  auto parsed = ParseJobSpecYaml(yaml("warmup: 2"), "spec.yaml");
  ASSERT_TRUE(parsed.ok());
  ApplyJobSpecDefaults(parsed->spec);
  EXPECT_EQ(parsed->spec.train().lr_schedule(), v1::WARMUP_COSINE);
}

}  // namespace
}  // namespace trainyard
