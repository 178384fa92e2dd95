// bitsandbytes' dynamic 8-bit codebook (signed and unsigned), block quantization, and how a
// slot's parameters split into quantized and fp32 pieces (see optimizers.h, slot_internal.h).
#include "worker/trainer/optim/slot_internal.h"

#include <array>
#include <cmath>

namespace trainyard::trainer {

namespace {

std::array<float, 256> BuildDynamicMap(bool is_signed) {
  // bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), with
  // the same fp32 tensor arithmetic, so the values are the same bits.
  constexpr int kMaxExponentBits = 7, kNonSignBits = 7;
  std::vector<float> data;
  for (int i = 0; i < kMaxExponentBits; ++i) {
    const int64_t fraction_items =
        is_signed ? (int64_t{1} << (i + kNonSignBits - kMaxExponentBits)) + 1
                  : (int64_t{1} << (i + kNonSignBits - kMaxExponentBits + 1)) + 1;
    const torch::Tensor boundaries = torch::linspace(0.1, 1, fraction_items);
    const torch::Tensor means =
        (boundaries.slice(0, 0, fraction_items - 1) + boundaries.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, -(kMaxExponentBits - 1) + i);
    const torch::Tensor pos = (scale * means).contiguous();
    for (int64_t k = 0; k < pos.numel(); ++k) data.push_back(pos.data_ptr<float>()[k]);
    if (is_signed) {
      const torch::Tensor neg = (-scale * means).contiguous();
      for (int64_t k = 0; k < neg.numel(); ++k) data.push_back(neg.data_ptr<float>()[k]);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  while (data.size() < 256) data.push_back(0.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> map{};
  std::copy_n(data.begin(), 256, map.begin());
  return map;
}

// The index of a sorted 256-value map's value nearest v (the lower one of two as near, as
// argmin). A binary search per value was most of 8-bit AdamW's time, so a table narrows it: every
// float whose top 15 bits (sign, exponent, 6 mantissa bits) are `key` has its lower bound in the
// map at most `steps_` codes (one or two, for these maps) above lo_[key].
class CodeIndex {
 public:
  explicit CodeIndex(const std::array<float, 256>& map) : map_(map) {
    // ext_[1 + c] is code c's value; the infinities at either end make the search branch-free.
    ext_[0] = -std::numeric_limits<float>::infinity();
    std::copy(map.begin(), map.end(), ext_.begin() + 1);
    ext_[257] = std::numeric_limits<float>::infinity();
    for (int c = 1; c < 256; ++c)
      TORCH_CHECK(map[c - 1] < map[c], "CodeIndex: a map of distinct values");
    for (uint32_t key = 0; key < kKeys; ++key) {
      const float a = FromBits(key << kShift), b = FromBits((key << kShift) | kLowBits);
      if (!std::isfinite(a) || !std::isfinite(b)) {  // never asked: values are finite
        lo_[key] = 1;
        continue;
      }
      lo_[key] = LowerBound(std::min(a, b));
      steps_ = std::max(steps_, LowerBound(std::max(a, b)) - lo_[key]);
    }
  }

  uint8_t Nearest(float v) const {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    int i = lo_[bits >> kShift];
    for (int s = 0; s < steps_; ++s) i += ext_[i] < v;  // now the lower bound of v
    i -= (v - ext_[i - 1]) <= (ext_[i] - v);            // the nearer (the lower of two as near)
    return static_cast<uint8_t>(i - 1);
  }

  const std::array<float, 256>& map() const { return map_; }

 private:
  static constexpr int kShift = 17;
  static constexpr uint32_t kKeys = uint32_t{1} << (32 - kShift);
  static constexpr uint32_t kLowBits = (uint32_t{1} << kShift) - 1;

  static float FromBits(uint32_t bits) {
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  // In ext_'s indices.
  int LowerBound(float v) const {
    return static_cast<int>(std::lower_bound(ext_.begin() + 1, ext_.begin() + 257, v) -
                            ext_.begin());
  }

  std::array<float, 256> map_;
  std::array<float, 258> ext_{};
  std::array<uint16_t, kKeys> lo_{};
  int steps_ = 0;  // the most codes a key's range spans
};

const CodeIndex& Codes(bool is_signed) {
  static const auto* const kSigned = new CodeIndex(BuildDynamicMap(true));
  static const auto* const kUnsigned = new CodeIndex(BuildDynamicMap(false));
  return is_signed ? *kSigned : *kUnsigned;
}

}  // namespace

Pieces EightBitPieces(const std::vector<OptimizerSlot::Param>& params, int64_t begin, int64_t n) {
  Pieces out;
  for (const auto& prm : params) {
    const int64_t pn = Numel(prm.shape);
    const int64_t lo = std::max(prm.offset, begin), hi = std::min(prm.offset + pn, begin + n);
    if (lo >= hi) continue;
    Piece piece;
    piece.lo = lo - begin;
    piece.hi = hi - begin;
    piece.e0 = lo - prm.offset;
    piece.quantized = pn >= k8bitMinSize;
    if (piece.quantized) {
      piece.first_block = piece.e0 / k8bitBlock;
      piece.blocks = (hi - prm.offset - 1) / k8bitBlock - piece.first_block + 1;
      piece.packed = out.blocks;
      out.blocks += piece.blocks;
    } else {
      piece.packed = out.fp32;
      out.fp32 += hi - lo;
    }
    out.pieces.push_back(piece);
  }
  return out;
}

float QuantizeBlock(const float* x, int64_t len, bool is_signed, uint8_t* codes) {
  const CodeIndex& index = Codes(is_signed);
  float m = 0;
  for (int64_t i = 0; i < len; ++i) m = std::max(m, std::abs(x[i]));
  for (int64_t i = 0; i < len; ++i) codes[i] = index.Nearest(m > 0 ? x[i] / m : 0.0f);
  return m;
}

uint8_t NearestCode(float v, bool is_signed) { return Codes(is_signed).Nearest(v); }

const std::array<float, 256>& DynamicMap(bool is_signed) { return Codes(is_signed).map(); }

}  // namespace trainyard::trainer
