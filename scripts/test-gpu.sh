#!/usr/bin/env bash
# On a GPU machine, from the project's root, with `.gpu` beside it (bash ../shared/gpu/fetch-kit.sh
# on the development machine fills it): builds the CUDA flavour into build-gpu/ against the
# machine's torch package (.gpu/device-build.sh, about 90 s on 16 cores), runs the tests labelled
# gpu and prints ctest's summary; with --bench, then bench/gpu_bench.sh. Logs go to $OUT (the
# device tool's output folder) or gpu-logs/.
#
# --only REGEX runs only the GPU tests whose names match (a rerun of those that failed).
# --quick builds only the trainer and fused_kernels_test (no servers, yard or worker: the cases
# that start a cluster cannot run), for a short session; give --only with it.
# --bench-args "ARGS" passes ARGS to bench/gpu_bench.sh (--llama, --only NAME, the steps).
#
#   bash scripts/test-gpu.sh [--bench] [--bench-args "ARGS"] [--quick] [--only REGEX]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
bench=0
only=""
quick=()
bench_args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1 ;;
    --only) only=$2; shift ;;
    --quick) quick=(-DTRAINYARD_GPU_TRAINER_ONLY=ON -DTRAINYARD_GPU_TEST_PROGRAMS=fused_kernels_test) ;;
    --bench-args) bench_args=$2; shift ;;
    *) echo "test-gpu: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ ! -x .gpu/device-build.sh ] && [ ! -f .gpu/device-build.sh ]; then
  echo "test-gpu: no .gpu/ here: run bash ../shared/gpu/fetch-kit.sh on the development machine" >&2
  exit 1
fi
{ nvidia-smi; python3 -c 'import torch; print("torch", torch.__version__)'; } >"$out/machine.txt" 2>&1
head -20 "$out/machine.txt"

start=$(date +%s)
# Without the benchmarks and the test programs no GPU test runs (about half the build).
if ! bash .gpu/device-build.sh -DTRAINYARD_BUILD_BENCH=OFF -DTRAINYARD_GPU_TESTS_ONLY=ON \
  ${quick[@]+"${quick[@]}"} >"$out/build.txt" 2>&1; then
  cat "$out/build.txt"
  cp build-gpu.log "$out/" 2>/dev/null
  echo "test-gpu: the build failed" >&2
  exit 1
fi
echo "test-gpu: built in $(($(date +%s) - start)) s"
eval "$(sed -n 's/^run with: //p' "$out/build.txt")"

rc=0
# One at a time (TRAINYARD_GPU_JOBS=N for more), then the cluster case alone: it checks that no
# process holds the GPU once its job is cancelled. Side by side they were far slower, not faster
# (by our reading, each run's 8 LibTorch threads spin-wait): on the H200 of 2026-11-28 a 10-step
# CPU reference run that takes 4 s alone took 84-288 s beside five other cases (141 s each beside
# three), a GPU run 227 s (bench/RESULTS.md, the sixth GPU session).
# Every case's whole output, passed or failed, comes back as $out/cases.tgz.
export TRAINYARD_GPU_LOGS=$PWD/gpu-case-logs
rm -rf "$TRAINYARD_GPU_LOGS"
select=(-L gpu)
[ -n "$only" ] && select+=(-R "$only")
ctest --test-dir build-gpu "${select[@]}" -E gpu_cluster -j "${TRAINYARD_GPU_JOBS:-1}" \
  --output-on-failure --timeout 240 \
  >"$out/ctest-gpu.txt" 2>&1 || rc=1
if [ -z "$only" ] || [[ gpu_cluster =~ $only ]]; then
  ctest --test-dir build-gpu -R gpu_cluster --output-on-failure --timeout 200 \
    >>"$out/ctest-gpu.txt" 2>&1 || rc=1
fi
tar czf "$out/cases.tgz" -C "$TRAINYARD_GPU_LOGS" . 2>/dev/null
grep -a -E "tests passed|Test +#|FAIL|worst relative|largest parameter|bf16 GPU|NCCL (refused|ran)" "$out/ctest-gpu.txt"
[ $rc -eq 0 ] || grep -a -B2 -A40 "FAIL\|Failed\|\*\*\*" "$out/ctest-gpu.txt" | tail -120

if [ $bench -eq 1 ]; then
  # shellcheck disable=SC2086
  bash bench/gpu_bench.sh $bench_args build-gpu >"$out/gpu-bench.md" 2>"$out/gpu-bench.err" || rc=1
  cat "$out/gpu-bench.md"
  tail -8 "$out/gpu-bench.err"
fi
exit $rc
