#!/usr/bin/env bash
# GPU throughput of trainyard-trainer (one rank on one GPU, run as the worker runs it: --device
# cuda) beside PyTorch on the same GPU (bench/gpu_reference.py, eager and torch.compile), for the
# example GPT and a GPT-2-small-sized one (12 layers, d768, 12 heads, T1024, batch 16, vocab 50304,
# tied head), bf16 autocast, SDPA, fused AdamW, clipping at 1.0. Prints tokens/s (median over the
# timed steps), step time, MFU and peak GPU memory, and the ratios, as Markdown rows.
#
#   bash bench/gpu_bench.sh [BUILD_DIR] [STEPS]   # defaults build-gpu, 30 (the first 5 untimed)
# Needs the CUDA build (scripts/test-gpu.sh builds it) and python3 with torch (the GPU host's).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
steps=${2:-30}
warmup=5
trainer=$build/bin/trainyard-trainer
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# bf16 dense peak of the GPU, for MFU (H100 / H200 SXM: 989 TFLOP/s).
peak_tflops=${TRAINYARD_PEAK_TFLOPS:-989}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

# Random tokens, as many as 8 batches of the large model need.
python3 -c "
import array, random
r = random.Random(1)
array.array('H', (r.randrange(50304) for _ in range(16 * 1025 * 8))).tofile(open('$work/tokens.u16', 'wb'))"

# NAME LAYERS HEADS D T VOCAB BATCH TIE DATA FORMAT
run_case() {
  local name=$1 layers=$2 heads=$3 d=$4 t=$5 vocab=$6 batch=$7 tie=$8 data=$9 format=${10}
  cat >"$work/$name.yaml" <<SPEC
name: $name
resources: {gpus: 1}
model: {kind: gpt, n_layer: $layers, n_head: $heads, d_model: $d, seq_len: $t, vocab: $vocab, tie_weights: $tie}
data: {path: $data, format: $format}
train: {steps: $steps, micro_batch: $batch, lr: 3.0e-4, warmup: 2, mixed_precision: bf16, weight_decay: 0.1, grad_clip: 1.0, seed: 1}
parallel: {strategy: ddp}
SPEC
  rm -f "$work/$name.jsonl"
  "$trainer" --spec "$work/$name.yaml" --job-id "" --attempt 1 --rank 0 --world-size 1 \
    --coordinator 127.0.0.1:1 --checkpoint-dir "" --device cuda --threads 4 --metrics-file "$work/$name.jsonl" \
    >"$work/$name.log" 2>&1 || { tail -20 "$work/$name.log"; echo "gpu_bench: $name failed" >&2; exit 1; }
  local tie_flag=""
  [ "$tie" = true ] && tie_flag=--tie
  local args=(--n-layer "$layers" --n-head "$heads" --d-model "$d" --seq-len "$t" --vocab "$vocab"
    --batch "$batch" --steps "$steps" --warmup-steps "$warmup" $tie_flag)
  python3 bench/gpu_reference.py "${args[@]}" >"$work/$name.eager.json"
  python3 bench/gpu_reference.py "${args[@]}" --compile >"$work/$name.compile.json" 2>"$work/$name.compile.err" ||
    echo '{"tokens_per_second": 0, "step_ms": 0, "peak_bytes": 0}' >"$work/$name.compile.json"
  python3 - "$work" "$name" "$warmup" "$layers" "$d" "$t" "$peak_tflops" "$gpu" <<'PY'
import json, statistics, sys
work, name, warmup, layers, d, t, peak, gpu = sys.argv[1:]
warmup, layers, d, t, peak = int(warmup), int(layers), int(d), int(t), float(peak)
rows = [json.loads(l) for l in open(f"{work}/{name}.jsonl")]
timed = [r for r in rows if r["step"] > warmup]
tps = statistics.median(r["tokens_per_second"] for r in timed)
peak_bytes = max(r.get("device_peak_bytes", 0) for r in rows)
params = next(int(l.split()[5]) for l in open(f"{work}/{name}.log", errors="replace") if "parameters," in l and "model," in l)
flops_per_token = 6 * params + 12 * layers * d * t  # forward + backward, attention included (causal counted whole)
def mfu(x): return 100 * x * flops_per_token / (peak * 1e12)
eager = json.load(open(f"{work}/{name}.eager.json"))
comp = json.load(open(f"{work}/{name}.compile.json"))
print(f"| {name} | {gpu} | trainyard | {tps:,.0f} | {1e3 * timed[-1]['step_seconds']:.1f} | {mfu(tps):.1f}% | {peak_bytes / 2**30:.2f} GiB | |")
print(f"| {name} | {gpu} | PyTorch eager | {eager['tokens_per_second']:,.0f} | {eager['step_ms']:.1f} | {mfu(eager['tokens_per_second']):.1f}% | {eager['peak_bytes'] / 2**30:.2f} GiB | trainyard {tps / eager['tokens_per_second']:.2f}x |")
if comp["tokens_per_second"] > 0:
    print(f"| {name} | {gpu} | PyTorch torch.compile | {comp['tokens_per_second']:,.0f} | {comp['step_ms']:.1f} | {mfu(comp['tokens_per_second']):.1f}% | {comp['peak_bytes'] / 2**30:.2f} GiB | trainyard {tps / comp['tokens_per_second']:.2f}x |")
else:
    print(f"| {name} | {gpu} | PyTorch torch.compile | failed (see its stderr) | | | | |")
print(f"losses {name}: " + " ".join(f"{r['loss']:.3f}" for r in rows[:3]) + " ... " + f"{rows[-1]['loss']:.3f}", file=sys.stderr)
PY
}

echo "| model | GPU | run | tokens/s | step ms | MFU | peak memory | ratio |"
echo "|---|---|---|---|---|---|---|---|"
run_case example-gpt 4 4 256 128 256 8 false /usr/share/common-licenses/GPL-3 bytes
run_case gpt2-small 12 12 768 1024 50304 16 true "$work/tokens.u16" uint16
