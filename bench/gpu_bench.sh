#!/usr/bin/env bash
# GPU throughput of trainyard-trainer (one rank on one GPU, run as the worker runs it: --device
# cuda) beside PyTorch on the same GPU (bench/gpu_reference.py, eager and torch.compile), for the
# example GPT, a GPT-2-small-sized one (12 layers, d768, 12 heads, T1024, batch 16, vocab 50304,
# tied head, GPT-2's own tanh GELU on both sides: model.activation gelu_tanh) and, with --llama, a Llama with Llama 3.2 1B's shapes (16 layers, d2048, 32 heads, 8
# key-value heads, SwiGLU 8192, vocab 128256, tied, rope_theta 500000; T2048, batch 4), bf16
# autocast, SDPA, fused AdamW, clipping at 1.0. Each model also runs with the plain LM head
# (--fused-loss off: what the fused head + cross-entropy buys), eagerly (--cuda-graphs off: what
# replaying the step as a CUDA graph buys), with torch's norms (--fused-norm off: what the
# fused residual add + LayerNorm or RMSNorm + cast buys) and with autocast's linear
# (--fused-linear off: what the weight and bias gradients from one cuBLASLt product buy, and with
# them the MLP's GELU and residual epilogues, which are the dense layers' path), with the fused
# head's logits 1 GiB a chunk instead of 256 MiB (--loss-chunk-mib 1024: fewer, larger products,
# a higher peak) and with LibTorch's fused AdamW (--adamw-kernel torch: what the project's
# multi-tensor kernel buys); a GPT
# with GPT-2's tanh GELU also runs with the exact GELU (activation: gelu, which has no cuBLASLt
# epilogue: what the GELU in the products' epilogues buys; the PyTorch runs keep tanh's). Prints
# tokens/s (median over the timed steps), step time, MFU and peak GPU memory, and the ratios, as
# Markdown rows.
#
# With --profile DIR, 3 steps of each run are traced too (trainyard's in a run of its own, eager's
# and compile's after their timed steps) and bench/trace_summary.py's tables of where the GPU
# time goes land in DIR/NAME.md, the traces gzipped beside them. TRAINYARD_PROFILE_FLAGS adds
# trainer flags to the traced run: "--cuda-graphs off" traces it eagerly, so that each kernel
# can be traced to the operation that launched it (a replayed graph's kernels trace to
# cudaGraphLaunch only).
#
#   bash bench/gpu_bench.sh [--llama] [--only NAME] [--profile DIR] [BUILD_DIR] [STEPS]
#     # defaults build-gpu, 30 (the first 5 untimed)
# Needs the CUDA build (scripts/test-gpu.sh builds it) and python3 with torch (the GPU host's).
set -euo pipefail
cd "$(dirname "$0")/.."
llama=0
only=""
profile=""
while [ $# -gt 0 ]; do
  case "$1" in
    --llama) llama=1 ;;
    --only) only=$2; shift ;;
    --profile) profile=$2; mkdir -p "$profile"; shift ;;
    *) break ;;
  esac
  shift
done
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
array.array('H', (r.randrange(50304) for _ in range(16 * 1025 * 8))).tofile(open('$work/tokens.u16', 'wb'))
# Llama 3's vocabulary does not fit uint16: uint32 tokens.
array.array('I', (r.randrange(128256) for _ in range(4 * 2049 * 8))).tofile(open('$work/tokens.u32', 'wb'))"

# trainyard's runs of each model, one a line: VARIANT|WHAT|FLAGS. auto is the fused run; each
# other one changes one thing (its trainer flags; erf-gelu the model's GELU instead, where the
# model has GPT-2's) and is labelled "trainyard, WHAT (FLAGS)" in its row.
declare -A variant_what variant_flags
variants=()
while IFS='|' read -r variant what flags; do
  variants+=("$variant")
  variant_what[$variant]=$what
  variant_flags[$variant]=$flags
done <<'VARIANTS'
auto||
eager-step|eager step|--cuda-graphs off
plain-head|plain head|--fused-loss off
plain-norm|torch's norms|--fused-norm off
plain-linear|autocast's linear|--fused-linear off
erf-gelu|exact GELU (activation: gelu; no epilogue)|
big-chunks|1 GiB loss chunks|--loss-chunk-mib 1024
torch-adamw|LibTorch's fused AdamW|--adamw-kernel torch
no-tune|the heuristic's first cuBLASLt algorithms|--gemm-tune off
VARIANTS

# NAME: trainyard's trace of 3 steps after the untimed ones (run_case's spec; eager's and
# compile's were taken after their timed steps), and the summary in $profile/NAME.md. A failed
# trace is said and skipped, not the bench's end.
profile_case() {
  local name=$1 traces=()
  "$trainer" --spec "$work/$name-auto.yaml" --job-id "" --attempt 1 --rank 0 --world-size 1 \
    --coordinator 127.0.0.1:1 --checkpoint-dir "" --device cuda --threads 4 \
    --profile-steps $((warmup + 1)):3 --profile-out "$profile/$name-trainyard.json" \
    ${TRAINYARD_PROFILE_FLAGS:-} \
    >"$profile/$name-trainyard.log" 2>&1 || echo "gpu_bench: $name: the traced run failed" >&2
  local run
  for run in trainyard eager compile; do
    [ -s "$profile/$name-$run.json" ] && traces+=("$run=$profile/$name-$run.json")
  done
  python3 bench/trace_summary.py --steps 3 "${traces[@]}" >"$profile/$name.md" 2>&1 ||
    echo "gpu_bench: $name: no trace summary (see $profile/$name.md)" >&2
  gzip -f "$profile/$name"-*.json 2>/dev/null || true
}

# NAME BATCH DATA FORMAT MODEL_YAML REFERENCE_ARGS...: PyTorch eager and torch.compile, then
# trainyard (the fused run, then each comparison variant) on one model; Markdown rows on stdout,
# each as its run ends.
run_case() {
  local name=$1 batch=$2 data=$3 format=$4 model=$5
  shift 5
  local ref=("$@")
  [ -n "$only" ] && [ "$only" != "$name" ] && return 0
  # PyTorch's runs first: each of trainyard's rows is printed as its run ends, its ratios beside
  # it, so a case cut short (a device session's time) keeps the rows it finished.
  local args=("${ref[@]}" --batch "$batch" --steps "$steps" --warmup-steps "$warmup")
  local eager_trace=() compile_trace=()
  if [ -n "$profile" ]; then
    eager_trace=(--profile "$profile/$name-eager.json")
    compile_trace=(--profile "$profile/$name-compile.json")
  fi
  python3 bench/gpu_reference.py "${args[@]}" ${eager_trace[@]+"${eager_trace[@]}"} >"$work/$name.eager.json"
  python3 bench/gpu_reference.py "${args[@]}" --compile ${compile_trace[@]+"${compile_trace[@]}"} \
    >"$work/$name.compile.json" 2>"$work/$name.compile.err" ||
    echo '{"tokens_per_second": 0, "step_ms": 0, "peak_bytes": 0}' >"$work/$name.compile.json"
  local variant flags
  # (TRAINYARD_BENCH_VARIANTS=auto: only the fused run, for a short GPU session.)
  for variant in ${TRAINYARD_BENCH_VARIANTS:-${variants[*]}}; do
    if [ -z "${variant_what[$variant]+set}" ]; then
      echo "gpu_bench: unknown variant '$variant' (TRAINYARD_BENCH_VARIANTS; one of: ${variants[*]})" >&2
      exit 2
    fi
    local spec_model=$model
    read -r -a flags <<<"${variant_flags[$variant]}"
    if [ "$variant" = erf-gelu ]; then
      [[ $model == *"activation: gelu_tanh"* ]] || continue
      spec_model=${model/activation: gelu_tanh/activation: gelu}
    fi
    cat >"$work/$name-$variant.yaml" <<SPEC
name: $name
resources: {slots: 1}
model: $spec_model
data: {path: $data, format: $format}
train: {steps: $steps, micro_batch: $batch, lr: 3.0e-4, warmup: 2, mixed_precision: bf16, weight_decay: 0.1, grad_clip: 1.0, seed: 1}
parallel: {strategy: ddp}
SPEC
    rm -f "$work/$name-$variant.jsonl"
    "$trainer" --spec "$work/$name-$variant.yaml" --job-id "" --attempt 1 --rank 0 --world-size 1 \
      --coordinator 127.0.0.1:1 --checkpoint-dir "" --device cuda --threads 4 \
      ${flags[@]+"${flags[@]}"} --metrics-file "$work/$name-$variant.jsonl" \
      >"$work/$name-$variant.log" 2>&1 || {
      tail -20 "$work/$name-$variant.log" >&2
      echo "gpu_bench: $name ($variant) failed" >&2
      # (A comparison variant's failure costs its row only; the fused run's is the case's end.)
      [ "$variant" = auto ] && exit 1
      rm -f "$work/$name-$variant.jsonl"
      continue
    }
    local what=${variant_what[$variant]} flagtext=${variant_flags[$variant]}
    row "$name" "$variant" "trainyard${what:+, $what}${flagtext:+ ($flagtext)}"
  done
  [ -n "$profile" ] && profile_case "$name"
  return 0
}

# NAME VARIANT LABEL: trainyard's row for the run (auto's with PyTorch's two rows after it), its MFU
# from the parameter count its log states, its ratios against PyTorch's runs of the case.
row() {
  python3 - "$work" "$1" "$2" "$3" "$warmup" "$peak_tflops" "$gpu" "${ref[@]}" <<'PY'
import json, statistics, sys
work, name, variant, label, warmup, peak, gpu = sys.argv[1:8]
ref = sys.argv[8:]
warmup, peak = int(warmup), float(peak)
arg = lambda flag: int(ref[ref.index(flag) + 1])
layers, d, t = arg("--n-layer"), arg("--d-model"), arg("--seq-len")
log = f"{work}/{name}-{variant}.log"
rows = [json.loads(l) for l in open(f"{work}/{name}-{variant}.jsonl")]
timed = [r for r in rows if r["step"] > warmup]
tps = statistics.median(r["tokens_per_second"] for r in timed)
step_s = statistics.median(r["step_seconds"] for r in timed)
peak_bytes = max(r.get("device_peak_bytes", 0) for r in rows)
params = next(int(l.split()[5]) for l in open(log, errors="replace") if "parameters," in l and "model," in l)
flops_per_token = 6 * params + 12 * layers * d * t  # forward + backward, attention included (causal counted whole)
def mfu(x): return 100 * x * flops_per_token / (peak * 1e12)
eager = json.load(open(f"{work}/{name}.eager.json"))
comp = json.load(open(f"{work}/{name}.compile.json"))
def vs(x):
    out = f"{x / eager['tokens_per_second']:.2f}x eager"
    if comp["tokens_per_second"] > 0:
        out += f", {x / comp['tokens_per_second']:.2f}x compile"
    return out
print(f"| {name} | {gpu} | {label} | {tps:,.0f} | {1e3 * step_s:.1f} | {mfu(tps):.1f}% | {peak_bytes / 2**30:.2f} GiB | {vs(tps)} |")
if variant == "auto":
    print(f"| {name} | {gpu} | PyTorch eager | {eager['tokens_per_second']:,.0f} | {eager['step_ms']:.1f} | {mfu(eager['tokens_per_second']):.1f}% | {eager['peak_bytes'] / 2**30:.2f} GiB | |")
    if comp["tokens_per_second"] > 0:
        print(f"| {name} | {gpu} | PyTorch torch.compile | {comp['tokens_per_second']:,.0f} | {comp['step_ms']:.1f} | {mfu(comp['tokens_per_second']):.1f}% | {comp['peak_bytes'] / 2**30:.2f} GiB | |")
    else:
        print(f"| {name} | {gpu} | PyTorch torch.compile | failed (see its stderr) | | | | |")
    print(f"{name}: " + "; ".join(l.strip() for l in open(log, errors="replace") if "cuda graphs:" in l), file=sys.stderr)
    print(f"losses {name}: " + " ".join(f"{r['loss']:.3f}" for r in rows[:3]) + " ... " + f"{rows[-1]['loss']:.3f}", file=sys.stderr)
    # The products' tuning (kernels/dense.h): one line a problem, "candidate I of N, X ms against
    # the heuristic's first Y ms"; summed once a problem, not weighted by its calls a step.
    import re
    tuned = [re.search(r"candidate (\d+) of \d+, ([\d.]+) ms against the heuristic's first ([\d.]+) ms", l)
             for l in open(log, errors="replace") if "cuBLASLt tuned" in l]
    tuned = [m for m in tuned if m]
    if tuned:
        print(f"tuning {name}: {len(tuned)} problems, {sum(m.group(1) != '1' for m in tuned)} took another "
              f"algorithm than the heuristic's first; one launch of each: {sum(float(m.group(3)) for m in tuned):.3f} -> "
              f"{sum(float(m.group(2)) for m in tuned):.3f} ms", file=sys.stderr)
sys.stdout.flush()
PY
}

# (GPT-2 small first, the example last: a session cut short keeps the rows that matter most.)
echo "| model | GPU | run | tokens/s | step ms | MFU | peak memory | ratio |"
echo "|---|---|---|---|---|---|---|---|"
gpt() {  # LAYERS HEADS D T VOCAB TIE ACTIVATION: the model's YAML
  echo "{kind: gpt, n_layer: $1, n_head: $2, d_model: $3, seq_len: $4, vocab: $5, tie_weights: $6, activation: $7}"
}
# GPT-2 small with GPT-2's own GELU (transformers' gelu_new: tanh's approximation) on both sides.
run_case gpt2-small 16 "$work/tokens.u16" uint16 "$(gpt 12 12 768 1024 50304 true gelu_tanh)" \
  --n-layer 12 --n-head 12 --d-model 768 --seq-len 1024 --vocab 50304 --tie --gelu tanh
if [ $llama -eq 1 ]; then
  run_case llama-1b 4 "$work/tokens.u32" uint32 \
    "{kind: llama, n_layer: 16, n_head: 32, n_kv_head: 8, d_model: 2048, d_hidden: 8192, seq_len: 2048, vocab: 128256, tie_weights: true, rope_theta: 500000}" \
    --arch llama --n-layer 16 --n-head 32 --n-kv-head 8 --d-model 2048 --d-hidden 8192 \
    --seq-len 2048 --vocab 128256 --tie --rope-theta 500000
fi
run_case example-gpt 8 /usr/share/common-licenses/GPL-3 bytes "$(gpt 4 4 256 128 256 false gelu)" \
  --n-layer 4 --n-head 4 --d-model 256 --seq-len 128 --vocab 256
