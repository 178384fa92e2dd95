// The two bulk messages of trainyard.v1.ParameterServerService, decoded and encoded by hand on
// gRPC's byte buffers so that protobuf never copies their payload: a pushed GradientChunk's `data`
// stays in the slices gRPC received it in (the update reads the gradients there), and a
// ParameterChunk is a few header bytes plus a slice pointing at the shard's parameters. The
// bytes on the wire are exactly those of the generated classes, so clients may use either.
#ifndef TRAINYARD_RPC_PS_PS_WIRE_H_
#define TRAINYARD_RPC_PS_PS_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "rpc/ps/wire_types.h"
#include "trainyard/v1/ps.pb.h"

namespace trainyard::ps {

// A decoded trainyard.v1.GradientChunk; `data` points into the received slices and keeps them.
struct PushedChunk {
  std::string job_id;
  int32_t attempt = 0;
  int64_t step = 0;
  int64_t offset = 0;
  v1::WireFormat format = v1::WIRE_FORMAT_UNSPECIFIED;
  ReceivedBytes data;
};

// Decodes a serialized GradientChunk without copying `data` (the buffer's slices are shared, not
// copied; `message` is left as it was). Fields may come in any order and repeat (the last one
// counts), unknown fields are skipped, as protobuf does. INVALID_ARGUMENT naming the field for a
// malformed message, a field of the wrong wire type or an unknown `format`.
absl::StatusOr<PushedChunk> DecodeGradientChunk(const grpc::ByteBuffer& message);

// A serialized ParameterChunk{offset, format, data} whose `data` is `data` itself (not copied).
grpc::ByteBuffer EncodeParameterChunk(int64_t offset, v1::WireFormat format, grpc::Slice data);

// Client side.

// A serialized GradientChunk: `header` (every field but data, which must be empty) followed by
// `bytes` bytes at `data` as a slice pointing there, not a copy: the memory must stay put and
// unchanged until gRPC has sent the message (its write completed).
grpc::ByteBuffer EncodeGradientChunk(const v1::GradientChunk& header, const void* data,
                                     size_t bytes);

// Copies the data of a serialized ParameterChunk straight from gRPC's slices into `out`, which
// holds the elements [begin, end) of `format` (element `begin` at `out`), and adds its elements
// to `received`. INTERNAL for a malformed message, another format or a chunk that is not whole
// elements inside [begin, end); nothing is written then.
absl::Status DecodeParameterChunkInto(const grpc::ByteBuffer& message, v1::WireFormat format,
                                      int64_t begin, int64_t end, void* out, int64_t* received);

}  // namespace trainyard::ps

#endif  // TRAINYARD_RPC_PS_PS_WIRE_H_
