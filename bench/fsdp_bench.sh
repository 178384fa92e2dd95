#!/usr/bin/env bash
# DDP vs FSDP (each sharding strategy) on the same GPT and world size, through the product path
# (a local cluster, `yard submit`, the step reports in `yard metrics`): tokens/s, peak model-state
# bytes per rank (parameters + gradients + optimizer state, as the trainer tracks them) and bytes
# each rank sent per step against the theoretical volume of the strategy's collectives.
#
#   bash bench/fsdp_bench.sh [STEPS] [REPS]     # defaults 20 timed steps (+5 warm-up), 3 reps
#
# 2 ranks on 2 workers of 1 slot each, so HYBRID_SHARD's nodes hold one rank each: shard group
# of 1, replicated across the 2 nodes (on one node it would be FULL_SHARD). PyTorch's FSDP is not
# run beside it: Debian's torch 1.13 FSDP needs CUDA and a reduce_scatter that its Gloo lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
reps=${2:-3}
warmup=5
yard=build/bin/yard
source scripts/lib/cluster.sh
bench_cluster_up fsdp-bench --workers 2 --slots 1 --threads-per-slot 1

n_layer=4 d_model=256 seq_len=128 vocab=256 world=2

# "TOKENS_PER_S PEAK_STATE_BYTES COMM_BYTES_PER_STEP": medians over the timed steps (peak: max).
run() {
  local name=$1 parallel=$2 spec="$state/spec-$1.yaml"
  cat >"$spec" <<SPEC
name: fsdp-bench-$name
resources: {slots: $world}
model: {kind: gpt, n_layer: $n_layer, n_head: 4, d_model: $d_model, seq_len: $seq_len, vocab: $vocab}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes}
train: {steps: $((steps + warmup)), micro_batch: 8, lr: 3.0e-4, warmup: 0, seed: 1}
parallel: $parallel
SPEC
  local job
  job=$($yard submit "$spec")
  $yard wait "$job" >/dev/null 2>&1 || { echo "job $job failed: $($yard describe "$job" | grep message)" >&2; exit 1; }
  job_step_summary "$yard" "$job" "$warmup"
}

# Theoretical bytes one rank sends per step (ring collectives, fp32): all-reduce 2(n-1)/n of the
# data, all-gather and reduce-scatter (n-1)/n each; units padded to a multiple of the group.
theory() {
  /usr/bin/python3 - "$1" <<PY
import sys
L, d, s, v, n = $n_layer, $d_model, $seq_len, $vocab, $world
pad = lambda x, g: (x + g - 1) // g * g
root, block = v * d + s * d + 2 * d + d * v, 12 * d * d + 13 * d   # untied head
total = root + L * block
f = 4 * (n - 1) / n
volume = {
    "ddp": 2 * f * total,
    "NO_SHARD": 2 * f * total,
    # root gathered once per step, blocks before forward and again before backward; all reduce-scattered
    "FULL_SHARD": f * (pad(root, n) + 2 * L * pad(block, n)) + f * (pad(root, n) + L * pad(block, n)),
    "SHARD_GRAD_OP": 2 * f * (pad(root, n) + L * pad(block, n)),
    "HYBRID_SHARD": 2 * f * total,   # shard group of 1: the gradient shard all-reduced over 2 nodes
}[sys.argv[1]]
print(int(volume + 2 * 8 * (n - 1) / n))   # + the gradient-norm all-reduce (8 bytes)
PY
}

printf "GPT n_layer %d, d_model %d, seq_len %d, micro_batch 8 per rank, fp32, %d ranks x 1 thread\n" \
  "$n_layer" "$d_model" "$seq_len" "$world"
printf "(2 workers x 1 slot); medians over %d timed steps, median of %d reps, runs interleaved\n\n" \
  "$steps" "$reps"
printf "| strategy | tok/s | vs DDP | peak model state per rank | vs DDP | bytes sent per step | theory | measured / theory |\n"
printf "|----------|-------|--------|---------------------------|--------|---------------------|--------|-------------------|\n"
declare -A tps peak comm
configs=(ddp NO_SHARD FULL_SHARD SHARD_GRAD_OP HYBRID_SHARD)
for ((r = 0; r < reps; r++)); do
  for c in "${configs[@]}"; do
    if [[ $c == ddp ]]; then
      parallel="{strategy: ddp}"
    else
      parallel="{strategy: fsdp, sharding_strategy: $c, backward_prefetch: BACKWARD_PRE, forward_prefetch: true}"
    fi
    read -r t p b < <(run "$c-$r" "$parallel")
    tps[$c]+="$t "; peak[$c]=$p; comm[$c]+="$b "
  done
done
for c in "${configs[@]}"; do
  t=$(printf "%s\n" ${tps[$c]} | median)
  b=$(printf "%s\n" ${comm[$c]} | median)
  th=$(theory "$c")
  [[ $c == ddp ]] && { base_t=$t; base_p=${peak[$c]}; }
  awk -v c="$c" -v t="$t" -v bt="$base_t" -v p="${peak[$c]}" -v bp="$base_p" -v b="$b" -v th="$th" 'BEGIN {
    printf "| %s | %.0f | %.2fx | %.2f MiB | %.2fx | %.2f MiB | %.2f MiB | %.3f |\n",
      (c == "ddp" ? "ddp" : "fsdp " c), t, t / bt, p / 1048576, p / bp, b / 1048576, th / 1048576, b / th }'
done
