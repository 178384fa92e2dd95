#!/usr/bin/env bash
# A whole GPU session in one device call, most valuable first, each part cut to the time left
# (BUDGET seconds, default 570, from the call's start): the trainer and fused_kernels_test built
# (.gpu/device-build.sh, about 115 s on the H200), the fused kernels' CUDA cases, bench/gpu_bench.sh
# for GPT-2 small and Llama 1B (the fused run, untuned products, 1 GiB loss chunks) and the example GPT
# (the fused run), then the trainer-only GPU cases (cpu_losses, bf16, cuda_graphs, llama).
# Logs and the bench's Markdown rows land in $OUT (the device tool's folder) or gpu-logs/.
# (gpu_fsdp and the cluster cases need yard and the worker: scripts/test-gpu.sh without --quick.)
#
#   BUDGET=560 bash scripts/gpu-session.sh        # on the GPU machine, .gpu/ carried beside
# FUSED_FILTER (gtest filter, default *Cuda*), GPT2_VARIANTS and LLAMA_VARIANTS (gpu_bench's,
# default "auto no-tune big-chunks", Llama's with "torch-adamw" too) narrow a short session. PROFILE=1 traces GPT-2 small and Llama 1B too (gpu_bench's
# --profile, the trainer run eagerly unless TRAINYARD_PROFILE_FLAGS says otherwise, so each
# kernel traces to its operation), packed as $OUT/profile.tgz (the device tool brings back only a
# handful of files); EXAMPLE=0 leaves the example GPT out.
set -uo pipefail
PROFILE=${PROFILE:-0}
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
T0=$(date +%s)
DEADLINE=$((T0 + ${BUDGET:-570}))
el() { echo "[$(($(date +%s) - T0)) s] $*"; }
left() { echo $((DEADLINE - $(date +%s))); }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c 'import torch; print("torch", torch.__version__)'; } >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
el build
if ! bash .gpu/device-build.sh -DTRAINYARD_BUILD_BENCH=OFF -DTRAINYARD_GPU_TESTS_ONLY=ON \
  -DTRAINYARD_GPU_TRAINER_ONLY=ON -DTRAINYARD_GPU_TEST_PROGRAMS=fused_kernels_test >"$out/build.txt" 2>&1; then
  tail -80 "$out/build.txt"; cp build-gpu.log "$out/" 2>/dev/null; el "build failed"; exit 1
fi
eval "$(sed -n 's/^run with: //p' "$out/build.txt")"
el built
t=$(left)
[ "$t" -gt 100 ] && t=100
[ "$t" -lt 1 ] && t=1
TRAINYARD_REQUIRE_CUDA=1 timeout "$t" build-gpu/tests/fused_kernels_test --gtest_filter="${FUSED_FILTER:-*Cuda*}" >"$out/fused.txt" 2>&1
echo "fused rc=$?"
# (Not the tuning's line a problem: bench-*.err and the trainer's logs have the bench's.)
grep -a -E "^\[  (PASSED|FAILED) |^\[       OK|^\[  FAILED|Failure|dense:|norm backward|adamw" "$out/fused.txt" |
  grep -v "dense: cuBLASLt tuned" | head -60
el fused
bench() {  # NAME TIMEOUT VARIANTS ARGS...
  local name=$1 t=$2 variants=$3; shift 3
  local l; l=$(left)
  [ "$l" -lt 40 ] && { el "skip $name (no time)"; return; }
  [ "$t" -gt "$l" ] && t=$l
  local profile=()
  [ "${PROFILE:-0}" = 1 ] && profile=(--profile "$out/profile")
  TRAINYARD_PROFILE_FLAGS=${TRAINYARD_PROFILE_FLAGS---cuda-graphs off} TRAINYARD_BENCH_VARIANTS="$variants" \
    timeout "$t" bash bench/gpu_bench.sh ${profile[@]+"${profile[@]}"} "$@" build-gpu \
    >"$out/bench-$name.md" 2>"$out/bench-$name.err"
  echo "bench $name rc=$?"
  cat "$out/bench-$name.md"; tail -6 "$out/bench-$name.err"
  el "$name"
}
bench gpt2 $((PROFILE ? 260 : 200)) "${GPT2_VARIANTS:-auto no-tune big-chunks}" --only gpt2-small
bench llama $((PROFILE ? 290 : 220)) "${LLAMA_VARIANTS:-auto no-tune big-chunks torch-adamw}" --llama --only llama-1b
[ "${EXAMPLE:-1}" = 1 ] && bench example 80 "auto" --only example-gpt
l=$(left)
if [ "$l" -gt 30 ]; then
  timeout "$l" ctest --test-dir build-gpu -L gpu -R 'cpu_losses|bf16|cuda_graphs|llama' \
    --output-on-failure --timeout 120 >"$out/ctest.txt" 2>&1
  echo "ctest rc=$?"
  grep -a -E "tests passed|Test +#|worst relative|bf16 GPU|Failed" "$out/ctest.txt" | head -30
fi
if [ "$PROFILE" = 1 ] && [ -d "$out/profile" ]; then
  tar czf "$out/profile.tgz" -C "$out" profile && rm -rf "$out/profile"
fi
el done
