// Model FLOPs utilisation (MFU, PaLM's appendix B): the FLOP/s a step's model arithmetic needs at
// the measured throughput, over the devices' peak. No protobuf: the trainer's side uses it.
#ifndef TRAINYARD_COMMON_MFU_H_
#define TRAINYARD_COMMON_MFU_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace trainyard {

// Forward and backward FLOPs per trained token: 6 per parameter (a multiply-add forward, two
// backward), plus attention's scores and weighted sum, 12 x layers x d_model x seq_len (the causal
// mask's skipped half counted, as PaLM and bench/gpu_bench.sh count it). `frozen` of the
// parameters do not train (LoRA's base weights): 4 each, the backward's input gradient without
// the weight's.
double ModelFlopsPerToken(int64_t parameters, int64_t layers, int64_t d_model, int64_t seq_len,
                          int64_t frozen = 0);

// A GPU's dense peak FLOP/s, by the name CUDA gives it ("NVIDIA H100 80GB HBM3"): tensor cores in
// bf16/fp16 when `half`, else fp32 without TF32 (the trainer leaves TF32 off). 0 for a GPU the
// table does not know. `override_tflops` > 0 (TRAINYARD_PEAK_TFLOPS) replaces the table.
double PeakFlops(absl::string_view gpu_name, bool half, double override_tflops = 0);

// tokens_per_second x flops_per_token / (peak_flops x devices); 0 when the peak is unknown.
double Mfu(double tokens_per_second, double flops_per_token, double peak_flops, int devices);

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_MFU_H_
