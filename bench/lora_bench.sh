#!/usr/bin/env bash
# LoRA vs a full fine-tune of the same llama, under DDP and FSDP FULL_SHARD, through the product
# path (a local cluster, `yard submit`, the step reports in `yard metrics`): tokens/s, peak model
# state per rank as the trainer tracks it, and bytes each rank sent per step; beside them in the
# same run, the anchor: PyTorch + PEFT (transformers' LlamaForCausalLM with get_peft_model, one
# process, as many threads as the two ranks have) on the same model and global batch.
#
#   bash bench/lora_bench.sh [STEPS] [REPS]     # defaults 20 timed steps (+5 warm-up), 3 reps
#
# Needs build/hf-venv (scripts/setup.sh makes it). LoRA: r 8, alpha 16, every projection.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
reps=${2:-3}
warmup=5
yard=build/bin/yard
python=build/hf-venv/bin/python
[[ -x $python ]] || { echo "lora_bench: $python is missing; run scripts/setup.sh" >&2; exit 1; }
source scripts/lib/cluster.sh
bench_cluster_up lora-bench --workers 2 --slots 1 --threads-per-slot 1

n_layer=4 d_model=256 n_head=8 n_kv_head=4 d_hidden=704 seq_len=128 world=2 micro_batch=8
lora="lora: {r: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"

# "TOKENS_PER_S PEAK_STATE_BYTES COMM_BYTES_PER_STEP": medians over the timed steps (peak: max).
run() {
  local name=$1 parallel=$2 extra=$3 spec="$state/spec-$1.yaml"
  cat >"$spec" <<SPEC
name: lora-bench-$name
resources: {slots: $world}
model: {kind: llama, n_layer: $n_layer, n_head: $n_head, n_kv_head: $n_kv_head, d_model: $d_model, d_hidden: $d_hidden, seq_len: $seq_len, vocab: 256}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes}
train: {steps: $((steps + warmup)), micro_batch: $micro_batch, lr: 1.0e-3, warmup: 0, seed: 1 $extra}
parallel: $parallel
SPEC
  local job
  job=$($yard submit "$spec")
  $yard wait "$job" >/dev/null 2>&1 || { echo "job $job failed: $($yard describe "$job" | grep message)" >&2; exit 1; }
  job_step_summary "$yard" "$job" "$warmup"
}

printf "llama n_layer %d, d_model %d, %d heads (%d kv), MLP %d, seq_len %d, micro_batch %d per rank, fp32\n" \
  "$n_layer" "$d_model" "$n_head" "$n_kv_head" "$d_hidden" "$seq_len" "$micro_batch"
printf "trainyard: %d ranks x 1 thread (2 workers x 1 slot); PyTorch + PEFT: 1 process x %d threads, batch %d\n" \
  "$world" "$world" "$((world * micro_batch))"
printf "medians over %d timed steps, median of %d reps, runs interleaved\n\n" "$steps" "$reps"
printf "| run | tok/s | peak model state per rank | vs full | bytes sent per step |\n"
printf "|-----|-------|---------------------------|---------|---------------------|\n"
declare -A tps peak comm
configs=(ddp-full ddp-lora fsdp-full fsdp-lora peft-full peft-lora)
for ((r = 0; r < reps; r++)); do
  for c in "${configs[@]}"; do
    case $c in
      peft-*)
        read -r t p b < <($python bench/lora_reference.py "$n_layer" "$d_model" "$n_head" \
          "$n_kv_head" "$d_hidden" "$seq_len" "$((world * micro_batch))" "$steps" "$warmup" \
          "$world" "${c#peft-}" 2>/dev/null)
        b=0 ;;
      *)
        parallel="{strategy: ddp}"
        [[ $c == fsdp-* ]] && parallel="{strategy: fsdp, sharding_strategy: FULL_SHARD, backward_prefetch: BACKWARD_PRE}"
        extra=""
        [[ $c == *-lora ]] && extra=", $lora"
        read -r t p b < <(run "$c-$r" "$parallel" "$extra") ;;
    esac
    tps[$c]+="$t "; peak[$c]=$p; comm[$c]+="$b "
  done
done
for c in "${configs[@]}"; do
  t=$(printf "%s\n" ${tps[$c]} | median)
  b=$(printf "%s\n" ${comm[$c]} | median)
  full=${peak[${c%-*}-full]}
  awk -v c="$c" -v t="$t" -v p="${peak[$c]}" -v f="$full" -v b="$b" 'BEGIN {
    printf "| %s | %.0f | %.2f MiB | %.2fx | %s |\n", c, t, p / 1048576, p / f,
      (c ~ /^peft/ ? "-" : sprintf("%.2f MiB", b / 1048576)) }'
done
