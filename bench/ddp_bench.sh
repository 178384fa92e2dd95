#!/usr/bin/env bash
# tokens/s of trainyard's DDP (1 and 2 ranks, through the real product path: a local cluster,
# `yard submit`, the step reports in `yard metrics`) against PyTorch DDP (Gloo,
# bench/ddp_reference.py) with the same GPT, batch, sequence length and threads, in one run:
# Debian's python3-torch (1.13), and PyPI's torch 2.11 (scripts/lib/torch211.sh, made on first
# use) eager with SDPA and fused AdamW, and with torch.compile. TRAINYARD_BENCH_TORCH211=0 leaves
# 2.11 out.
#
#   bash bench/ddp_bench.sh [STEPS] [REPS]     # defaults 30 timed steps (+5 warm-up), 3 reps
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
reps=${2:-3}
warmup=5
yard=build/bin/yard
source scripts/lib/cluster.sh
source scripts/lib/torch211.sh
torch211=${TRAINYARD_BENCH_TORCH211:-1}
[ "$torch211" = 1 ] && torch211_setup
bench_cluster_up ddp-bench --workers 1 --slots 2 --threads-per-slot 1

# trainyard: median tokens/s over the timed steps of one job.
trainyard_run() {
  local ranks=$1 spec="$state/spec-$ranks.yaml"
  cat >"$spec" <<SPEC
name: ddp-bench-$ranks
resources: {slots: $ranks}
model: {kind: gpt, n_layer: 4, n_head: 4, d_model: 256, seq_len: 128, vocab: 256}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes}
train: {steps: $((steps + warmup)), micro_batch: 8, lr: 3.0e-4, warmup: 0, seed: 1}
parallel: {strategy: ddp, bucket_mb: 25}
SPEC
  local job
  job=$($yard submit "$spec")
  $yard wait "$job" >/dev/null 2>&1 || { echo "job $job failed: $($yard describe "$job" | grep message)" >&2; exit 1; }
  # "TOKENS_PER_S BACKWARD_MS COMM_WAIT_MS", medians over the timed steps (rank 0's log lines).
  local tps
  tps=$(job_tokens_per_second "$yard" "$job" "$warmup")
  # The matmul path the trainer chose at start, and why (rank 0's log).
  $yard logs "$job" | grep -m1 '^\[rank 0\] matmuls: ' | sed 's/^\[rank 0\] //' \
    >>"$state/matmuls-$ranks" || true
  $yard logs "$job" | /usr/bin/python3 -c "
import re, statistics, sys
rows = [m.groups() for m in (re.search(r'step (\d+)/\d+ .*backward_ms ([\d.]+) comm_wait_ms ([\d.]+)', l)
                             for l in sys.stdin if l.startswith('[rank 0]')) if m]
rows = [(float(b), float(c)) for s, b, c in rows if int(s) > $warmup]
print($tps, statistics.median(b for b, _ in rows), statistics.median(c for _, c in rows))"
}

pytorch_run() {
  /usr/bin/python3 bench/ddp_reference.py --world-size "$1" --threads 1 --steps "$steps" \
    --warmup "$warmup" --micro-batch 8 --seq-len 128 --d-model 256 --n-layer 4 --n-head 4 \
    | awk '/tokens_per_second/ {print $2}'
}

# RANKS eager|compile: PyTorch 2.11, SDPA and fused AdamW (and torch.compile).
torch211_run() {
  local flags=(--sdpa --fused-adamw)
  [ "$2" = compile ] && flags+=(--compile)
  torch211_python bench/ddp_reference.py --world-size "$1" --threads 1 --steps "$steps" \
    --warmup "$warmup" --micro-batch 8 --seq-len 128 --d-model 256 --n-layer 4 --n-head 4 \
    "${flags[@]}" 2>/dev/null | awk '/tokens_per_second/ {print $2}'
}

printf "GPT n_layer 4, d_model 256, seq_len 128, micro_batch 8 per rank, fp32, 1 thread per rank;\n"
printf "median tokens/s over %d timed steps, median of %d reps, runs interleaved\n" "$steps" "$reps"
# The matmuls decide most of a step's time. PyTorch 1.13 does them all in OpenBLAS, with the kernels
# it picked for the CPU (or OPENBLAS_CORETYPE forced); trainyard does them (Linear layers and
# attention) in oneDNN or OpenBLAS, whichever it timed faster on the model's GEMMs at start
# (TRAINYARD_MATMUL=onednn or =blas pins one); each run's choice is listed under the table.
version=$(build/bin/trainyard-trainer --version)
printf "%s; OPENBLAS_CORETYPE=%s\n%s; TRAINYARD_MATMUL=%s\n\n" "$(grep '^BLAS' <<<"$version")" \
  "${OPENBLAS_CORETYPE-(unset)}" "$(grep '^Matmuls' <<<"$version")" "${TRAINYARD_MATMUL-(unset)}"
printf "| ranks | trainyard tok/s | PyTorch DDP tok/s | trainyard / PyTorch | goal | backward ms | comm wait after backward ms |\n"
printf "|-------|-----------------|-------------------|---------------------|------|-------------|------------------------------|\n"
rows211=()
for ranks in 1 2; do
  ours=(); theirs=(); backward=(); wait_ms=(); eager=(); compiled=()
  for ((r = 0; r < reps; r++)); do
    read -r tps bwd cw < <(trainyard_run "$ranks")
    ours+=("$tps"); backward+=("$bwd"); wait_ms+=("$cw")
    theirs+=("$(pytorch_run "$ranks")")
    if [ "$torch211" = 1 ]; then
      eager+=("$(torch211_run "$ranks" eager)")
      compiled+=("$(torch211_run "$ranks" compile)")
    fi
  done
  o=$(printf "%s\n" "${ours[@]}" | median)
  t=$(printf "%s\n" "${theirs[@]}" | median)
  b=$(printf "%s\n" "${backward[@]}" | median)
  c=$(printf "%s\n" "${wait_ms[@]}" | median)
  ratio=$(awk -v o="$o" -v t="$t" 'BEGIN {printf "%.2f", o / t}')
  goal=$(awk -v r="$ratio" 'BEGIN {print (r >= 1.1 ? "met (>= 1.1x)" : "NOT met (< 1.1x)")}')
  printf "| %5d | %15.0f | %17.0f | %19s | %s | %11.0f | %28.1f |\n" "$ranks" "$o" "$t" "${ratio}x" "$goal" "$b" "$c"
  if [ "$torch211" = 1 ]; then
    e=$(printf "%s\n" "${eager[@]}" | median)
    k=$(printf "%s\n" "${compiled[@]}" | median)
    rows211+=("$(awk -v n="$ranks" -v o="$o" -v e="$e" -v k="$k" 'BEGIN {
      re = o / e; rk = (k > 0 ? o / k : 0)
      printf "| %5d | %15.0f | %18.0f | %9.2fx | %20.0f | %11.2fx | %s |", n, o, e, re, k, rk,
        (re >= 1.0 ? "met (>= 1.0x eager)" : "NOT met (< 1.0x eager)") }')")
  fi
done
printf "\ntrainyard's matmul path, each run (rank 0's log):\n"
for ranks in 1 2; do
  sort "$state/matmuls-$ranks" 2>/dev/null | sed -E 's/[0-9.]+ ms/N ms/g' | uniq -c |
    sed "s/^ */  $ranks rank(s): /" || true
  sed "s/^/    /" "$state/matmuls-$ranks" 2>/dev/null || true
done
printf "\nbackward ms: rank 0's backward pass, all-reduces of full buckets running meanwhile (1 rank:\n"
printf "no communication). comm wait: time after backward spent waiting for the last all-reduces.\n"
if [ "$torch211" = 1 ]; then
  printf "\nPyTorch %s (PyPI; %s), SDPA attention and AdamW(fused=True), eager and torch.compile:\n\n" \
    "$(torch211_python -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
    "$(torch211_python -c 'import torch; print(torch.__config__.show())' 2>/dev/null | grep -o 'CPU capability usage: [A-Z0-9_]*')"
  printf "| ranks | trainyard tok/s | 2.11 eager tok/s | vs eager | 2.11 compile tok/s | vs compile | goal (issue 56) |\n"
  printf "|-------|-----------------|------------------|----------|--------------------|------------|-----------------|\n"
  printf "%s\n" "${rows211[@]}"
fi
