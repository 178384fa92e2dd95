#!/usr/bin/env bash
# Pipeline parallelism (GPipe and 1F1B) and tensor parallelism against DDP on the same GPT, the
# same global batch and the same ranks, through the product path (a local cluster, `yard submit`, the step reports in
# `yard metrics`): tokens/s, the measured bubble (each stage's idle share of the schedule, their
# mean) against its theory (P - 1) / (m + P - 1), and the bytes rank 0 sent per step against the
# theoretical volume.
#
#   bash bench/pipeline_bench.sh [STEPS] [REPS]     # defaults 20 timed steps (+5 warm-up), 3 reps
#
# A second table: 2 stages x 2 replicas (4 ranks), the replicas of each stage averaging its
# gradients (ddp) or sharding it (fsdp FULL_SHARD, SHARD_GRAD_OP), 1F1B with m = 4.
#
# 2 ranks on 1 worker of 2 slots, 1 thread each; 64 windows per step in every layout. DDP: 2
# replicas, micro_batch 8, grad_accum 4. Pipeline: 2 stages of 2 blocks, m micro-batches of 64/m.
# Tensor: 2 tensor-parallel ranks (Megatron-LM's layers), micro_batch 16, grad_accum 4. PyTorch's
# pipelining and DTensor tensor parallelism are not run beside it: Debian's torch 1.13 has
# neither (torch.distributed.pipelining came in 2.4, tensor_parallel's parallelize_module in 2.0).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
reps=${2:-3}
warmup=5
yard=build/bin/yard
source scripts/lib/cluster.sh
bench_cluster_up pipeline-bench --workers 1 --slots 4 --threads-per-slot 1

n_layer=4 d_model=256 seq_len=128 vocab=256 world=2 batch=64

# "TOKENS_PER_S COMM_BYTES_PER_STEP BUBBLE": medians over the timed steps.
run() {
  local name=$1 train=$2 parallel=$3 spec="$state/spec-$1.yaml"
  cat >"$spec" <<SPEC
name: pipeline-bench-$name
resources: {slots: ${4:-$world}}
model: {kind: gpt, n_layer: $n_layer, n_head: 4, d_model: $d_model, seq_len: $seq_len, vocab: $vocab}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes}
train: {steps: $((steps + warmup)), lr: 3.0e-4, warmup: 0, seed: 1, $train}
parallel: $parallel
SPEC
  local job
  job=$($yard submit "$spec")
  $yard wait "$job" >/dev/null 2>&1 || { echo "job $job failed: $($yard describe "$job" | grep message)" >&2; exit 1; }
  $yard metrics "$job" -o json | /usr/bin/python3 -c "
import json, statistics, sys
rows = [s for s in json.load(sys.stdin) if s['step'] > $warmup]
print(statistics.median(s['tokens_per_second'] for s in rows),
      statistics.median(s['comm_bytes'] for s in rows),
      statistics.median(s.get('pipeline_bubble', 0) for s in rows))"
}

# Theoretical bytes rank 0 sends per step: DDP all-reduces the gradients (ring, 2(n-1)/n of them);
# stage 0 sends each micro-batch's activations (micro_batch x seq_len x d_model fp32) and its part
# of the gradient norm's all-reduce (8 bytes). Tensor parallelism all-reduces a [tokens, d_model]
# activation 4 times per block (attention and MLP, forward and backward) and twice more (the
# vocabulary-parallel embedding forward, the head's input backward), and for the cross-entropy
# all-gathers each token's max and all-reduces its sum and target logit.
theory() {
  /usr/bin/python3 - "$1" "$2" <<PY
import sys
L, d, s, v, n, batch = $n_layer, $d_model, $seq_len, $vocab, $world, $batch
total = v * d + s * d + L * (12 * d * d + 13 * d) + 2 * d + d * v   # untied head
kind, m = sys.argv[1], int(sys.argv[2])
ring = 2 * (n - 1) / n
if kind == "ddp":
    print(int(ring * 4 * total))
elif kind == "tensor":
    tokens = batch * s
    print(int(ring * (4 * L + 2) * tokens * d * 4 + (n - 1) * tokens * 4 + ring * 2 * tokens * 4
              + ring * 8))
else:
    print(int(m * (batch // m) * s * d * 4 + 2 * 8 * (n - 1) / n))
PY
}

printf "GPT n_layer %d, d_model %d, seq_len %d, %d windows per step, fp32, %d ranks x 1 thread\n" \
  "$n_layer" "$d_model" "$seq_len" "$batch" "$world"
printf "(1 worker x 4 slots); medians over %d timed steps, median of %d reps, runs interleaved\n\n" \
  "$steps" "$reps"
printf "| layout | tok/s | vs DDP | bubble measured | bubble theory | bytes sent per step (rank 0) | theory | measured / theory |\n"
printf "|--------|-------|--------|-----------------|---------------|------------------------------|--------|-------------------|\n"
declare -A tps comm bubble
configs=(ddp gpipe-4 1f1b-4 gpipe-8 1f1b-8 tensor)
for ((r = 0; r < reps; r++)); do
  for c in "${configs[@]}"; do
    if [[ $c == ddp ]]; then
      read -r t b u < <(run "$c-$r" "micro_batch: $((batch / world / 4)), grad_accum: 4" "{strategy: ddp}")
    elif [[ $c == tensor ]]; then
      read -r t b u < <(run "$c-$r" "micro_batch: $((batch / 4)), grad_accum: 4" "{tensor_parallel: 2}")
    else
      schedule=${c%-*} m=${c#*-}
      read -r t b u < <(run "$c-$r" "micro_batch: $((batch / m)), micro_batches: $m" \
        "{pipeline_stages: 2, pipeline_schedule: $schedule}")
    fi
    tps[$c]+="$t "; comm[$c]+="$b "; bubble[$c]+="$u "
  done
done
for c in "${configs[@]}"; do
  t=$(printf "%s\n" ${tps[$c]} | median)
  b=$(printf "%s\n" ${comm[$c]} | median)
  u=$(printf "%s\n" ${bubble[$c]} | median)
  if [[ $c == ddp ]]; then
    base_t=$t; th=$(theory ddp 0); label="ddp (2 replicas)"; ut="-"
  elif [[ $c == tensor ]]; then
    th=$(theory tensor 0); label="tensor 2"; ut="-"
  else
    m=${c#*-}; th=$(theory pipeline "$m"); label="${c%-*}, 2 stages, m=$m"
    ut=$(awk -v m="$m" 'BEGIN { printf "%.3f", 1 / (m + 1) }')
  fi
  awk -v c="$label" -v t="$t" -v bt="$base_t" -v u="$u" -v ut="$ut" -v b="$b" -v th="$th" 'BEGIN {
    printf "| %s | %.0f | %.2fx | %s | %s | %.2f MiB | %.2f MiB | %.3f |\n",
      c, t, t / bt, (c ~ /^(ddp|tensor)/ ? "-" : sprintf("%.3f", u)), ut, b / 1048576, th / 1048576, b / th }'
done

# 2 stages x 2 replicas: 4 ranks on the 2 cores, 64 windows per step (m = 4 micro-batches of 8 on
# each replica), stages of 2 blocks.
# Theory for rank 0 (stage 0, replica 0): its activations, m x 8 x seq_len x d_model fp32; the
# gradient norm's all-reduce over the 4 ranks (12 bytes); and the stage's data parallelism over
# its 2 replicas. ddp: one ring all-reduce of the stage's gradients. fsdp: gathers send (n - 1)
# shards (Gloo's ring), reduce-scatters (n - 1) / n of the unit: the root (the embeddings, kept
# gathered from the step's first forward to its last backward) once a step, each block unit
# m times in forward and m in backward (FULL_SHARD) or m times (SHARD_GRAD_OP keeps it from a
# forward to its backward; stage 0's 1F1B order gathers it m times), and every unit's gradient
# reduce-scattered after each of the m backwards.
fsdp_theory() {
  /usr/bin/python3 - "$1" <<PY
import sys
L, d, s, v, m, mb, n = $n_layer, $d_model, $seq_len, $vocab, 4, 8, 2
pad = lambda x: (x + n - 1) // n * n
root, blocks = pad(v * d + s * d), pad(2 * (12 * d * d + 13 * d))
kind = sys.argv[1]
sent = m * mb * s * d * 4 + 2 * 8 * 3 / 4
if kind == "ddp":
    sent += 2 * (n - 1) / n * 4 * (v * d + s * d + 2 * (12 * d * d + 13 * d))
else:
    gathers = 2 * m if kind == "FULL_SHARD" else m
    sent += 4 * ((n - 1) * root / n + gathers * (n - 1) * blocks / n + m * (n - 1) / n * (root + blocks))
print(int(sent))
PY
}

printf "\n2 stages x 2 replicas (4 ranks x 1 thread on the 2 cores), 1f1b, m=4 of 8 windows per replica\n\n"
printf "| data parallelism over the replicas | tok/s | vs ddp | bubble measured | bytes sent per step (rank 0) | theory | measured / theory |\n"
printf "|------------------------------------|-------|--------|-----------------|------------------------------|--------|-------------------|\n"
declare -A ftps fcomm fbubble
fconfigs=(ddp FULL_SHARD SHARD_GRAD_OP)
for ((r = 0; r < reps; r++)); do
  for c in "${fconfigs[@]}"; do
    if [[ $c == ddp ]]; then par="{strategy: ddp,"; else par="{strategy: fsdp, sharding_strategy: $c,"; fi
    read -r t b u < <(run "stages-$c-$r" "micro_batch: 8, micro_batches: 4" \
      "$par pipeline_stages: 2, pipeline_schedule: 1f1b, pipeline_split: [2, 2]}" 4)
    ftps[$c]+="$t "; fcomm[$c]+="$b "; fbubble[$c]+="$u "
  done
done
for c in "${fconfigs[@]}"; do
  t=$(printf "%s\n" ${ftps[$c]} | median)
  b=$(printf "%s\n" ${fcomm[$c]} | median)
  u=$(printf "%s\n" ${fbubble[$c]} | median)
  [[ $c == ddp ]] && base_t=$t
  th=$(fsdp_theory "$c")
  label=$([[ $c == ddp ]] && echo "ddp" || echo "fsdp $c")
  awk -v c="$label" -v t="$t" -v bt="$base_t" -v u="$u" -v b="$b" -v th="$th" 'BEGIN {
    printf "| %s | %.0f | %.2fx | %.3f | %.2f MiB | %.2f MiB | %.3f |\n",
      c, t, t / bt, u, b / 1048576, th / 1048576, b / th }'
done
