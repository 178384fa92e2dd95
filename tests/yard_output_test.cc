// yard's printed forms (client/output.h) that carry logic: the follow mode's progress line.
#include "client/output.h"

#include <gtest/gtest.h>

namespace trainyard::client {
namespace {

v1::StepReport Report(int64_t step, int64_t total) {
  v1::StepReport r;
  r.set_step(step);
  r.set_total_steps(total);
  r.set_loss(2.31);
  r.set_tokens_per_second(12345);
  return r;
}

TEST(ProgressLineTest, ABarAndAnEtaOutOfTheTotal) {
  EXPECT_EQ(ProgressLine(Report(120, 300), 0.4),
            "step 120/300 [=========>              ]  40% ETA 1m12s loss 2.3100 tok/s 12.3K");
  EXPECT_EQ(ProgressLine(Report(300, 300), 0.4),
            "step 300/300 [========================] 100% ETA 0 loss 2.3100 tok/s 12.3K");
}

TEST(ProgressLineTest, NoBarOrEtaWithoutATotal) {
  // The SDK's report(step, loss=...) leaves the total out: "step 40/0 [>   ] 0% ETA 0" before.
  EXPECT_EQ(ProgressLine(Report(40, 0), 0.4), "step 40 loss 2.3100 tok/s 12.3K");
}

TEST(ProgressLineTest, AStepPastTheTotalFillsTheBarOnce) {
  // (A resumed job whose spec's steps were lowered reports past its total.)
  EXPECT_EQ(ProgressLine(Report(400, 300), 0.4),
            "step 400/300 [========================] 100% ETA 0 loss 2.3100 tok/s 12.3K");
}

TEST(ProgressLineTest, MfuWhereTheReportHasIt) {
  v1::StepReport r = Report(1, 0);
  r.set_mfu(0.357);
  EXPECT_EQ(ProgressLine(r, 0), "step 1 loss 2.3100 tok/s 12.3K mfu 35.7%");
}

}  // namespace
}  // namespace trainyard::client
