#!/usr/bin/env bash
# The parameter server's CPU AdamW (kernels/adam) vs PyTorch's torch.optim.AdamW (foreach=True and
# foreach=False, Debian's python3-torch) vs the memory-bandwidth floor, on 1 thread and on every
# core, in one run of build/bin/cpu_adam_bench (which starts /usr/bin/python3 for PyTorch).
#
#   bash bench/cpu_adam_bench.sh [REPS] [PARAMS]     # defaults: 7 reps, 64 Mi params
#   BUILD_DIR=/tmp/build-adam bash bench/cpu_adam_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-7}
params=${2:-67108864}
build=${BUILD_DIR:-build}
bench="$build/bin/cpu_adam_bench"
if [ ! -x "$bench" ]; then
  echo "$bench not found: build it first (bash scripts/setup.sh, or cmake --build $build --target cpu_adam_bench)" >&2
  exit 1
fi
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "PyTorch is not importable by /usr/bin/python3 (apt-get install python3-torch)" >&2
  exit 1
fi
echo "$(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$bench" --reps "$reps" --params "$params" --python /usr/bin/python3
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
