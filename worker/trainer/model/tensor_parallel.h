// Megatron-LM tensor parallelism (parallel.tensor_parallel: T ranks share each layer): the layers
// the models use when their TensorParallel group is set (model.h), model building blocks as
// Megatron's tensor_parallel/layers.py are. Cutting a model into them (KeepTensorParallelShards)
// and the groups are parallel/'s.
//  - Column-parallel linear: each rank holds 1/T of the output features (attention heads, the
//    MLP's hidden units, the vocabulary of the head); its input passes CopyToTensorParallel
//    (identity forward, all-reduce of the gradient backward).
//  - Row-parallel linear: each rank holds 1/T of the input features and computes a partial
//    product, summed by ReduceFromTensorParallel (all-reduce forward, identity backward); the
//    bias is added once, after the sum.
//  - Vocabulary-parallel embedding (each rank 1/T of the rows, the others' tokens looked up as
//    zeros, then summed) and cross-entropy over vocabulary-parallel logits (the softmax's max and
//    sum and the target's logit all-reduced; no rank holds the whole logits).
// So one all-reduce forward and one backward per attention and per MLP, as in the paper (Shoeybi
// et al. 2019). Norms, position embeddings and row-parallel biases are replicated, and their
// gradients are the same on every rank of the group.
//
// Sequence parallelism (Korthikanti et al. 2022), when `sequence` is set: between the
// tensor-parallel regions (the norms, the residual stream, the position embedding) each rank
// holds 1/T of the sequence ([b, t/T, d]); f becomes an all-gather along the sequence (its
// backward a reduce-scatter) and g a reduce-scatter (its backward an all-gather), which moves the
// same bytes as the all-reduce and keeps 1/T of those activations. The replicated parameters'
// gradients are then partial on each rank, and are summed over the group after backward.
//
// Every rank of the group must run the same forward and backward (the same micro-batches in the
// same order); the collectives are blocking, on the training thread.
#ifndef TRAINYARD_WORKER_TRAINER_MODEL_TENSOR_PARALLEL_H_
#define TRAINYARD_WORKER_TRAINER_MODEL_TENSOR_PARALLEL_H_

#include <torch/torch.h>

#include <vector>

#include "worker/trainer/comm/communicator.h"

namespace trainyard::trainer {

struct TensorParallel {
  Communicator* comm = nullptr;  // the group's; not owned. nullptr: no tensor parallelism
  int rank = 0;
  int size = 1;
  bool sequence = false;  // sequence parallelism
  bool on() const { return size > 1; }
};

// How a parameter is cut over the group: along `dim` (-1: replicated on every rank), in `chunks`
// equal consecutive parts that are each cut in T (a fused q/k/v weight: each of q, k and v by
// heads), rank r keeping part r of every chunk.
struct TensorParallelSplit {
  int dim = -1;
  int chunks = 1;
};

// Rank `rank`'s shard of `full` (a copy).
torch::Tensor TensorParallelShard(const torch::Tensor& full, TensorParallelSplit split, int rank,
                                  int size);
// The whole tensor from every rank's shard (in rank order).
torch::Tensor TensorParallelUnshard(const std::vector<torch::Tensor>& shards,
                                    TensorParallelSplit split);

// f: identity forward, the gradient all-reduced over the group backward. Under sequence
// parallelism: this rank's [b, t/T, ...] gathered into [b, t, ...] (backward: reduce-scatter).
torch::Tensor CopyToTensorParallel(const torch::Tensor& x, const TensorParallel& tp);
// g: the partial results all-reduced forward, identity backward. Under sequence parallelism:
// reduce-scattered along the sequence into this rank's [b, t/T, ...] (backward: all-gather).
torch::Tensor ReduceFromTensorParallel(const torch::Tensor& x, const TensorParallel& tp);
// Embedding lookup of `tokens` in this rank's rows of the vocabulary (`weight`: [V/T, d], rows
// rank * V/T ...), summed over the group.
torch::Tensor VocabParallelEmbedding(const torch::Tensor& tokens, const torch::Tensor& weight,
                                     const TensorParallel& tp);
// Per-row cross-entropy of `logits` ([N, V/T], this rank's part of the vocabulary) against
// `targets` ([N] int64, whole-vocabulary ids): [N], the same on every rank.
torch::Tensor VocabParallelCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                        const TensorParallel& tp);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_MODEL_TENSOR_PARALLEL_H_
