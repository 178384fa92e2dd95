#!/usr/bin/env bash
# Pipeline parallelism (GPipe and 1F1B) and tensor parallelism against DDP on the same GPT, the
# same global batch and the same ranks, through the product path (a local cluster, `yard submit`, the step reports in
# `yard metrics`): tokens/s, the measured bubble (each stage's idle share of the schedule, their
# mean) against its theory (P - 1) / (m + P - 1), and the bytes rank 0 sent per step against the
# theoretical volume.
#
#   bash bench/pipeline_bench.sh [STEPS] [REPS]     # defaults 20 timed steps (+5 warm-up), 3 reps
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
bench_cluster_up pipeline-bench --workers 1 --slots 2 --threads-per-slot 1

n_layer=4 d_model=256 seq_len=128 vocab=256 world=2 batch=64

# "TOKENS_PER_S COMM_BYTES_PER_STEP BUBBLE": medians over the timed steps.
run() {
  local name=$1 train=$2 parallel=$3 spec="$state/spec-$1.yaml"
  cat >"$spec" <<SPEC
name: pipeline-bench-$name
resources: {gpus: $world}
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
printf "(1 worker x 2 slots); medians over %d timed steps, median of %d reps, runs interleaved\n\n" \
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
