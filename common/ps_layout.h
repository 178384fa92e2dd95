// What a parameter server holds per parameter of an offload job, shared by the coordinator (which
// reserves it) and trainyard-ps (which allocates it): fp32 master weight, AdamW m and v, a fp32
// gradient staging slot (4 bytes each) and a bfloat16 copy of the weight for bf16 pulls.
#ifndef TRAINYARD_COMMON_PS_LAYOUT_H_
#define TRAINYARD_COMMON_PS_LAYOUT_H_

#include <cstdint>

namespace trainyard {

inline constexpr int64_t kPsBytesPerParam = 4 + 4 + 4 + 4 + 2;

}  // namespace trainyard

#endif  // TRAINYARD_COMMON_PS_LAYOUT_H_
