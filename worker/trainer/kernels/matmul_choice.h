// Choosing the fp32 CPU matmul path, oneDNN or the BLAS (onednn_matmul.h), by timing the model's
// own GEMM shapes at start, as cudnn.benchmark times convolution algorithms: the faster depends on
// the CPU (its instruction set, OpenBLAS's kernels for it or OPENBLAS_CORETYPE's) and on the
// shapes, and either can lose by a large factor on some machine (bench/RESULTS.md).
//
// Each shape runs forward and backward on both paths, in alternating order, the median of a few
// repetitions taken; shapes too large to time quickly are timed on fewer rows and scaled.
// oneDNN is kept unless the BLAS is faster by more than a margin: timings that differ by
// noise alone do not flip a choice whose rounding is otherwise the same from run to run.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_MATMUL_CHOICE_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_MATMUL_CHOICE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "worker/trainer/kernels/onednn_matmul.h"

namespace trainyard::trainer {

// `count` Linear layers of one shape: x [rows, in] times weight [out, in]^T (+ bias [out]).
struct LinearWork {
  int64_t rows = 0, in = 0, out = 0;
  bool bias = false;
  int64_t count = 1;
};
// `count` causal attentions: q, k, v [batch_heads, seq_len, head_dim]; scores = q k^T + mask,
// y = softmax(scores) v, both through BatchedMatmul.
struct AttentionWork {
  int64_t batch_heads = 0, seq_len = 0, head_dim = 0;
  int64_t count = 1;
};
// The GEMMs of one micro-batch's forward (each also runs backward when timed).
struct MatmulWork {
  std::vector<LinearWork> linear;
  std::vector<AttentionWork> attention;
  bool empty() const { return linear.empty() && attention.empty(); }
};

struct MatmulTiming {
  // Forward and backward of the whole work, one micro-batch, on each path (ms, estimated from the
  // timed rows).
  double onednn_ms = 0, blas_ms = 0;
  MatmulPath path = MatmulPath::kOneDnn;
  // Why, for the log: "oneDNN: 12.3 ms a micro-batch's GEMMs (forward and backward), the BLAS
  // 15.1 ms (timed at start)".
  std::string Describe() const;
};

// The BLAS when it is faster than oneDNN by more than `margin` (a fraction of oneDNN's time),
// oneDNN otherwise.
inline constexpr double kKeepOneDnnMargin = 0.05;
MatmulPath FasterPath(double onednn_ms, double blas_ms, double margin = kKeepOneDnnMargin);

// Times `work` on both paths (`reps` timed repetitions after one warm-up each) and returns the
// result with the faster path (FasterPath). Runs on torch's intra-op threads, as training does;
// leaves the process's path as it found it (the caller sets the chosen one). Needs
// OneDnnMatmulsAvailable().
MatmulTiming TimeMatmulPaths(const MatmulWork& work, int reps = 3);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_MATMUL_CHOICE_H_
