// AdamW with bitsandbytes' block-wise 8-bit moments on CPU slots (see optimizers.h).
#include "worker/trainer/optim/slot_internal.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/adam/cpu_adam.h"

namespace trainyard::trainer {

void SlotOptimizer::StepAdamW8bit(int i, const float* grad, float scale, double lr) {
  SlotState& st = *state_[i];
  const int64_t n = slots_[i].param.numel();
  float* p = slots_[i].param.data_ptr<float>();
  const auto b1 = static_cast<float>(hyper_.beta1), b2 = static_cast<float>(hyper_.beta2);
  const auto eps = static_cast<float>(hyper_.eps), rate = static_cast<float>(lr);
  const auto decay = static_cast<float>(hyper_.weight_decay);
  // bitsandbytes' 2-state Adam kernels: the bias corrections folded into the step size.
  const float correction1 = 1.0f - std::pow(b1, static_cast<float>(step_));
  const float correction2 = std::sqrt(1.0f - std::pow(b2, static_cast<float>(step_)));
  const float step_size = -rate * correction2 / correction1;
  auto update = [&](int64_t k, float s1, float s2) {
    p[k] = p[k] + step_size * (s1 / (std::sqrt(s2) + eps * correction2));
    if (decay > 0) p[k] = p[k] * (1.0f - rate * decay);
  };
  const Pieces pieces = EightBitPieces(slots_[i].params, slots_[i].begin, n);
  const auto& smap = DynamicMap(true);
  const auto& umap = DynamicMap(false);
  for (const Piece& piece : pieces.pieces) {
    if (!piece.quantized) {  // under min_8bit_size: fp32 moments
      float* m = st.m.data_ptr<float>() + piece.packed;
      float* v = st.v.data_ptr<float>() + piece.packed;
      for (int64_t k = piece.lo; k < piece.hi; ++k) {
        const float g = grad[k] * scale;
        float& mk = m[k - piece.lo];
        float& vk = v[k - piece.lo];
        mk = mk * b1 + (1.0f - b1) * g;
        vk = vk * b2 + (1.0f - b2) * g * g;
        update(k, mk, vk);
      }
      continue;
    }
    uint8_t* c1 = st.m_codes.data_ptr<uint8_t>();
    uint8_t* c2 = st.v_codes.data_ptr<uint8_t>();
    float* a1 = st.m_absmax.data_ptr<float>();
    float* a2 = st.v_absmax.data_ptr<float>();
    std::vector<std::array<int64_t, 3>> blocks;
    ForEachBlock(piece, [&](int64_t b, int64_t lo, int64_t hi) { blocks.push_back({b, lo, hi}); });
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 64, [&](int64_t bb, int64_t be) {
      float s1[k8bitBlock], s2[k8bitBlock];
      for (int64_t x = bb; x < be; ++x) {
        const auto [b, lo, hi] = blocks[x];
        const int64_t len = hi - lo;
        for (int64_t j = 0; j < len; ++j) {
          const int64_t k = lo + j;
          const float g = grad[k] * scale;
          if (!std::isfinite(g)) {  // as the kernel: p kept, the moments reset
            s1[j] = s2[j] = 0;
            continue;
          }
          s1[j] = smap[c1[k]] * a1[b] * b1 + (1.0f - b1) * g;
          s2[j] = umap[c2[k]] * a2[b] * b2 + (1.0f - b2) * g * g;
          update(k, s1[j], s2[j]);
        }
        a1[b] = QuantizeBlock(s1, len, /*is_signed=*/true, c1 + lo);
        a2[b] = QuantizeBlock(s2, len, /*is_signed=*/false, c2 + lo);
        // The kernel keeps m's sign: a code of the other sign moves one towards it.
        for (int64_t j = 0; j < len; ++j) {
          uint8_t& c = c1[lo + j];
          if (std::signbit(smap[c]) != std::signbit(s1[j])) c = s1[j] > 0 ? c + 1 : c - 1;
        }
      }
    });
  }
}

}  // namespace trainyard::trainer
