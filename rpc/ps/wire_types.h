// What the parameter server's wire code (ps_wire.h) and ShardManager, which knows nothing of
// gRPC, share: the size of an element in a wire format, and ReceivedBytes, the bytes of one pushed
// gradient chunk as they arrived.
#ifndef TRAINYARD_RPC_PS_WIRE_TYPES_H_
#define TRAINYARD_RPC_PS_WIRE_TYPES_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "trainyard/v1/ps.pb.h"

namespace trainyard::ps {

// What a message's `format` means: WIRE_BF16, or WIRE_FP32 for anything else (UNSPECIFIED too).
inline v1::WireFormat NormalizedWireFormat(int format) {
  return format == v1::WIRE_BF16 ? v1::WIRE_BF16 : v1::WIRE_FP32;
}

// Bytes per element on the wire: 2 for WIRE_BF16, else 4.
inline int64_t WireElementBytes(v1::WireFormat format) { return format == v1::WIRE_BF16 ? 2 : 4; }

// In pieces (the slices gRPC received them in, cut anywhere, also inside an element), kept alive
// by `owner`. No alignment is assumed.
struct ReceivedBytes {
  std::vector<absl::string_view> pieces;
  std::shared_ptr<const void> owner;

  size_t size() const {
    size_t n = 0;
    for (absl::string_view piece : pieces) n += piece.size();
    return n;
  }
  // `bytes` as one piece that owns its memory.
  static ReceivedBytes Own(std::string bytes) {
    auto owned = std::make_shared<const std::string>(std::move(bytes));
    return ReceivedBytes{{absl::string_view(*owned)}, owned};
  }
};

}  // namespace trainyard::ps

#endif  // TRAINYARD_RPC_PS_WIRE_TYPES_H_
