// SlotOptimizer's parts shared by its files (optimizers.cc and one per optimizer: adamw.cc,
// lion.cc, adafactor.cc, adamw_8bit.cc; the 8-bit codebook in codebook_8bit.cc). Internal to
// optim/; the interface is optimizers.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "worker/trainer/optim/optimizers.h"

namespace trainyard::trainer {

inline int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Adafactor's factors of one parameter: [lead, rows] then [lead, cols] for a matrix (lead: the
// product of the leading dimensions), its own size for a vector.
struct Factored {
  bool matrix = false;
  int64_t lead = 1, rows = 1, cols = 1;
  int64_t numel() const { return matrix ? lead * (rows + cols) : cols; }
};

inline Factored FactorsOf(const std::vector<int64_t>& shape) {
  Factored f;
  if (shape.size() >= 2) {
    f.matrix = true;
    f.rows = shape[shape.size() - 2];
    f.cols = shape.back();
    f.lead = Numel(shape) / std::max<int64_t>(1, f.rows * f.cols);
  } else {
    f.cols = Numel(shape);
  }
  return f;
}

struct SlotOptimizer::SlotState {
  torch::Tensor m, v;  // fp32: [n] adamw, lion (m); 8-bit: [Pieces::fp32] (small parameters)
  torch::Tensor m_codes, v_codes;    // uint8 [n]: 8-bit, when a piece is quantized
  torch::Tensor m_absmax, v_absmax;  // fp32 [Pieces::blocks]: 8-bit
  torch::Tensor factors;             // fp32 [FactorNumel]: adafactor
};

// 8-bit AdamW's view of a slot: each parameter's part, [lo, hi) of the slot from element e0 of
// the parameter. A parameter under min_8bit_size keeps fp32 moments (at `packed` in the slot's
// fp32 arrays); a larger one's codes are the slot's [lo, hi) and its blocks, 256 of its elements
// each from its first (so a slot that holds it whole has bitsandbytes' blocks), `blocks` of them
// from `packed` in the absmax arrays.
struct Piece {
  int64_t lo = 0, hi = 0, e0 = 0;
  bool quantized = false;
  int64_t packed = 0, first_block = 0, blocks = 0;
};
struct Pieces {
  std::vector<Piece> pieces;
  int64_t fp32 = 0, blocks = 0;  // sizes of the fp32 and absmax arrays
};

Pieces EightBitPieces(const std::vector<OptimizerSlot::Param>& params, int64_t begin, int64_t n);

// Calls f(block's index in the absmax arrays, its first and end slot positions) for every block
// of a quantized piece.
template <typename F>
void ForEachBlock(const Piece& piece, F&& f) {
  for (int64_t b = 0; b < piece.blocks; ++b) {
    const int64_t first = std::max(piece.e0, (piece.first_block + b) * k8bitBlock);
    const int64_t end =
        std::min(piece.e0 + (piece.hi - piece.lo), (piece.first_block + b + 1) * k8bitBlock);
    f(piece.packed + b, piece.lo + first - piece.e0, piece.lo + end - piece.e0);
  }
}

// Quantizes x[0, len), one block, with the signed or the unsigned dynamic map: returns its
// absmax.
float QuantizeBlock(const float* x, int64_t len, bool is_signed, uint8_t* codes);

}  // namespace trainyard::trainer
