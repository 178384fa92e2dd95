#!/usr/bin/env bash
# train.optimizer's optimizers (build/bin/optimizer_bench) beside their references in PyTorch
# (bench/optimizer_reference.py in build/hf-venv: torch.optim.AdamW with foreach, transformers'
# Adafactor, lion-pytorch's Lion) on the parameters of the same Llama-shaped model (6 layers,
# d_model 768, MLP 2048, vocab 32000: 91M parameters in 57 tensors) and the same threads, in one
# run: the median time of a step over every parameter and the bytes of optimizer state.
# bitsandbytes' AdamW8bit needs CUDA, so 8-bit AdamW has no anchor on this machine.
#
#   bash bench/optimizer_bench.sh [REPS] [THREADS]     # defaults: 7 reps, every core
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-7}
threads=${2:-$(nproc)}
build=${BUILD_DIR:-build}
model=(6 768 2048 32000)  # layers, d_model, d_hidden, vocab (12 heads)
for f in "$build/bin/optimizer_bench" "$build/hf-venv/bin/python"; do
  [ -x "$f" ] || { echo "$f not found: run bash scripts/setup.sh first" >&2; exit 1; }
done
echo "$(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$build/bin/optimizer_bench" --reps "$reps" --threads "$threads" --layers "${model[0]}" \
  --d-model "${model[1]}" --d-hidden "${model[2]}" --vocab "${model[3]}" >> "$out"
"$build/hf-venv/bin/python" bench/optimizer_reference.py "$reps" "$threads" "${model[@]}" 12 >> "$out"
/usr/bin/python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
ours = {r["optimizer"]: r for r in rows if r["impl"] == "trainyard"}
anchors = {r["optimizer"]: r for r in rows if r["impl"] != "trainyard"}
p = rows[0]["params"]
print(f"{p / 1e6:.1f}M parameters, {rows[0]['threads']} threads; medians of the step time")
print(f"| optimizer | trainyard ms | state MiB | bytes/param | anchor | anchor ms | anchor state MiB | speed vs anchor |")
print("|---|---:|---:|---:|---|---:|---:|---:|")
for kind, r in ours.items():
    a = anchors.get(kind)
    cells = [kind, f"{r['median_ms']:.1f}", f"{r['state_bytes'] / 2**20:.1f}",
             f"{r['state_bytes'] / p:.3f}"]
    if a:
        cells += [a["impl"], f"{a['median_ms']:.1f}", f"{a['state_bytes'] / 2**20:.1f}",
                  f"{a['median_ms'] / r['median_ms']:.2f}x"]
    else:
        cells += ["(bitsandbytes: CUDA only)", "-", "-", "-"]
    print("| " + " | ".join(cells) + " |")
PY
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
