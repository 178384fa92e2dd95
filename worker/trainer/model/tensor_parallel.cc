// Tensor-parallel layers' collectives and shard layout (see tensor_parallel.h).
#include "worker/trainer/model/tensor_parallel.h"

namespace trainyard::trainer {
namespace {

// The communicator travels through autograd as an integer (saved_data holds IValues).
int64_t Pointer(Communicator* comm) { return reinterpret_cast<int64_t>(comm); }
Communicator* CommOf(const torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<Communicator*>(ctx->saved_data.at("comm").toInt());
}

torch::Tensor AllReduced(const torch::Tensor& x, Communicator& comm) {
  torch::Tensor y = x.contiguous().clone();
  comm.AllReduceSum({y})->Wait();
  return y;
}

// [b, t/T, ...] of every rank -> [b, t, ...], rank order along the sequence.
torch::Tensor GatheredSequence(const torch::Tensor& x, Communicator& comm) {
  return torch::cat(comm.AllGather(x.contiguous()), 1);
}

// [b, t, ...] partial sums -> this rank's [b, t/T, ...] of their sum (a ring reduce-scatter of
// the sequence-major copy, whose rank chunks are consecutive).
torch::Tensor ScatteredSequence(const torch::Tensor& x, Communicator& comm) {
  const int n = comm.world_size();
  torch::Tensor moved = x.transpose(0, 1).contiguous();  // [t, b, ...]
  torch::Tensor flat = moved.view({-1});
  const std::vector<int64_t> counts(n, flat.numel() / n);
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] /= n;
  return comm.ReduceScatterSum(flat, counts).view(shape).transpose(0, 1).contiguous();
}

torch::Tensor Cloned(const torch::Tensor& x, Communicator&) { return x.clone(); }
torch::Tensor Passed(const torch::Tensor& x, Communicator&) { return x; }

// A collective whose backward is another: the four conjugate pairs of tensor parallelism
// (f and g, and their sequence-parallel forms).
using CommOp = torch::Tensor (*)(const torch::Tensor&, Communicator&);
template <CommOp Forward, CommOp Backward>
class Conjugate : public torch::autograd::Function<Conjugate<Forward, Backward>> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return Forward(x, *reinterpret_cast<Communicator*>(comm));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {Backward(grads[0], *CommOf(ctx)), torch::Tensor()};
  }
};

using CopyTo = Conjugate<Cloned, AllReduced>;
using ReduceFrom = Conjugate<AllReduced, Passed>;
using GatherSequence = Conjugate<GatheredSequence, ScatteredSequence>;
using ScatterSequence = Conjugate<ScatteredSequence, GatheredSequence>;

// loss_i = log(sum_v exp(z_iv - max_i)) - (z_i,target - max_i), over the whole vocabulary: the max
// all-gathered, the sum and the target's shifted logit all-reduced. Backward: softmax - one-hot,
// on this rank's columns.
class VocabCrossEntropy : public torch::autograd::Function<VocabCrossEntropy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor logits,
                               torch::Tensor targets, int64_t comm_pointer, int64_t rank) {
    Communicator& comm = *reinterpret_cast<Communicator*>(comm_pointer);
    const int64_t part = logits.size(1), first = rank * part;
    const torch::Tensor local_max = std::get<0>(logits.max(1)).contiguous();
    const torch::Tensor max = torch::stack(comm.AllGather(local_max)).amax(0);
    const torch::Tensor shifted = logits - max.unsqueeze(1);
    const torch::Tensor exp = shifted.exp();
    const torch::Tensor in_range = targets.ge(first).logical_and(targets.lt(first + part));
    const torch::Tensor local = (targets - first).clamp(0, part - 1);
    const torch::Tensor target_logit =
        shifted.gather(1, local.unsqueeze(1)).squeeze(1) * in_range.to(logits.scalar_type());
    torch::Tensor sums = torch::stack({exp.sum(1), target_logit}).contiguous();
    comm.AllReduceSum({sums})->Wait();
    ctx->save_for_backward({exp / sums[0].unsqueeze(1), local, in_range});
    return sums[0].log() - sums[1];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    torch::Tensor grad = saved[0].clone();
    grad.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(grads[0].unsqueeze(1));
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor TensorParallelShard(const torch::Tensor& full, TensorParallelSplit split, int rank,
                                  int size) {
  if (split.dim < 0 || size == 1) return full.clone();
  const int64_t chunk = full.size(split.dim) / split.chunks, part = chunk / size;
  std::vector<torch::Tensor> parts;
  for (int c = 0; c < split.chunks; ++c) {
    parts.push_back(full.narrow(split.dim, c * chunk + rank * part, part));
  }
  return torch::cat(parts, split.dim).contiguous();
}

torch::Tensor TensorParallelUnshard(const std::vector<torch::Tensor>& shards,
                                    TensorParallelSplit split) {
  if (split.dim < 0 || shards.size() == 1) return shards.at(0).clone();
  const int64_t part = shards[0].size(split.dim) / split.chunks;
  std::vector<torch::Tensor> parts;
  for (int c = 0; c < split.chunks; ++c) {
    for (const torch::Tensor& s : shards) parts.push_back(s.narrow(split.dim, c * part, part));
  }
  return torch::cat(parts, split.dim).contiguous();
}

torch::Tensor CopyToTensorParallel(const torch::Tensor& x, const TensorParallel& tp) {
  if (tp.sequence) return GatherSequence::apply(x, Pointer(tp.comm));
  return CopyTo::apply(x, Pointer(tp.comm));
}

torch::Tensor ReduceFromTensorParallel(const torch::Tensor& x, const TensorParallel& tp) {
  if (tp.sequence) return ScatterSequence::apply(x, Pointer(tp.comm));
  return ReduceFrom::apply(x, Pointer(tp.comm));
}

torch::Tensor VocabParallelEmbedding(const torch::Tensor& tokens, const torch::Tensor& weight,
                                     const TensorParallel& tp) {
  const int64_t part = weight.size(0), first = tp.rank * part;
  const torch::Tensor in_range = tokens.ge(first).logical_and(tokens.lt(first + part));
  const torch::Tensor local = (tokens - first) * in_range;
  const torch::Tensor rows =
      torch::embedding(weight, local) * in_range.unsqueeze(-1).to(weight.scalar_type());
  return ReduceFromTensorParallel(rows, tp);
}

torch::Tensor VocabParallelCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                        const TensorParallel& tp) {
  return VocabCrossEntropy::apply(logits, targets, Pointer(tp.comm), int64_t{tp.rank});
}

}  // namespace trainyard::trainer
