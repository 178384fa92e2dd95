// Model FLOPs utilisation (common/mfu.h): the FLOPs a token, the peak table by CUDA's names, and
// the ratio, against hand-computed values (bench/RESULTS.md's GPT-2 small on an H200).
#include "common/mfu.h"

#include <gtest/gtest.h>

namespace trainyard {
namespace {

TEST(MfuTest, FlopsPerTokenAreSixPerParameterPlusAttention) {
  // GPT-2 small as bench/gpu_bench.sh runs it: 124,475,904 parameters, 12 layers, d768, T1024.
  EXPECT_DOUBLE_EQ(ModelFlopsPerToken(124475904, 12, 768, 1024),
                   6.0 * 124475904 + 12.0 * 12 * 768 * 1024);
  EXPECT_DOUBLE_EQ(ModelFlopsPerToken(0, 0, 0, 0), 0);
}

TEST(MfuTest, FrozenParametersCountFourFlopsNotSix) {
  // A LoRA fine-tune: the base weights compute forward and the input's gradient, no weight
  // gradient; the adapters train.
  EXPECT_DOUBLE_EQ(ModelFlopsPerToken(1000, 2, 8, 16, 900),
                   6.0 * 100 + 4.0 * 900 + 12.0 * 2 * 8 * 16);
  EXPECT_DOUBLE_EQ(ModelFlopsPerToken(1000, 0, 0, 0, 1000), 4000);
  EXPECT_DOUBLE_EQ(ModelFlopsPerToken(1000, 0, 0, 0, 0), 6000);
  // A count beyond the parameters' (none below zero) is held to them.
  EXPECT_DOUBLE_EQ(ModelFlopsPerToken(1000, 0, 0, 0, 5000), 4000);
  EXPECT_DOUBLE_EQ(ModelFlopsPerToken(1000, 0, 0, 0, -3), 6000);
}

TEST(MfuTest, PeaksByCudaNameTheLongerNamesFirst) {
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA H100 80GB HBM3", true), 989e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA H100 80GB HBM3", false), 67e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA H100 PCIe", true), 756e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA H200", true), 989e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA GH200 480GB", true), 989e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA A100-SXM4-80GB", true), 312e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA A10", true), 125e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA L40S", true), 362e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA L40", true), 181e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA L4", true), 121e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA H200 NVL", true), 835e12);
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA H800 PCIe", true), 756e12);
  // Names match as whole words. Not known: none (not a guess): AWS's A10G is not the A10, an
  // RTX A1000 not an A100.
  EXPECT_EQ(PeakFlops("NVIDIA A10G", true), 0);
  EXPECT_EQ(PeakFlops("NVIDIA RTX A1000", true), 0);
  EXPECT_EQ(PeakFlops("NVIDIA RTX A4000", true), 0);
  EXPECT_EQ(PeakFlops("NVIDIA GeForce RTX 3060", true), 0);
  EXPECT_EQ(PeakFlops("", true), 0);
  // The operator's figure replaces the table's.
  EXPECT_DOUBLE_EQ(PeakFlops("NVIDIA H100 80GB HBM3", true, 700), 700e12);
  EXPECT_DOUBLE_EQ(PeakFlops("", false, 1.5), 1.5e12);
}

TEST(MfuTest, TheRatioOverEveryGpuOfTheJob) {
  // RESULTS.md's H200 row: 410,537 tokens/s, 35.7%.
  const double flops = ModelFlopsPerToken(124475904, 12, 768, 1024);
  EXPECT_NEAR(Mfu(410537, flops, PeakFlops("NVIDIA H200", true), 1), 0.357, 5e-4);
  EXPECT_NEAR(Mfu(2 * 410537, flops, PeakFlops("NVIDIA H200", true), 2), 0.357, 5e-4);
  EXPECT_EQ(Mfu(410537, flops, 0, 1), 0);
  EXPECT_EQ(Mfu(410537, flops, 989e12, 0), 0);
}

}  // namespace
}  // namespace trainyard
