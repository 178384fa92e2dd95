#!/usr/bin/env bash
# Builds trainyard-trainer against a CUDA LibTorch 2.x, the one inside the torch Python package
# that GPU hosts have, on a machine without a GPU: the check that the CUDA flavour compiles, links
# and starts. CI runs it after the tests (.ci/run). Needs what scripts/setup.sh installs, the CUDA
# toolkit in $CUDA_HOME (default /usr/local/cuda: nvcc, cuDNN, NCCL) and PyPI, from which it takes
# the torch wheel and the three NVIDIA libraries that libtorch_cuda needs beyond the toolkit
# (cuFile, cuSPARSELt, NVSHMEM). Downloads are kept in $TRAINYARD_CACHE (default
# ~/.cache/trainyard); the build goes to build-cuda/.
#
#   bash scripts/check-cuda-build.sh [extra CMake arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${TRAINYARD_CUDA_TORCH_VERSION:-2.11.0}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CACHE=${TRAINYARD_CACHE:-$HOME/.cache/trainyard}
KIT="$CACHE/torch-$TORCH_VERSION"
# The versions torch $TORCH_VERSION asks for (its wheel's Requires-Dist).
EXTRA_WHEELS=("nvidia-cusparselt-cu13==0.8.0" "nvidia-nvshmem-cu13==3.4.5" "nvidia-cufile==1.15.1.6")

if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "check-cuda-build: no CUDA toolkit at $CUDA_HOME (set CUDA_HOME)" >&2
  exit 1
fi

if [ ! -f "$KIT/.complete" ]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends python3-pip
  fi
  rm -rf "$KIT"
  mkdir -p "$KIT/wheels" "$KIT/lib"
  echo "check-cuda-build: downloading torch==$TORCH_VERSION and ${EXTRA_WHEELS[*]} from PyPI"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$KIT/wheels" \
    "torch==$TORCH_VERSION" "${EXTRA_WHEELS[@]}"
  # Only what a C++ build needs: headers, libraries, CMake files.
  python3 -m zipfile -e "$KIT"/wheels/torch-*.whl "$KIT/unpacked"
  mv "$KIT/unpacked/torch" "$KIT/torch"
  rm -rf "$KIT/unpacked"
  for w in "$KIT"/wheels/nvidia_*.whl; do
    python3 -m zipfile -e "$w" "$KIT/unpacked"
    find "$KIT/unpacked" -name '*.so*' -path '*/lib/*' -exec mv {} "$KIT/lib/" \;
    rm -rf "$KIT/unpacked"
  done
  rm -rf "$KIT/wheels"
  touch "$KIT/.complete"
fi

LIBS="$KIT/torch/lib:$KIT/lib:$CUDA_HOME/lib64"
mkdir -p build-cuda
cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$KIT/torch/share/cmake" \
  -DCUDAToolkit_ROOT="$CUDA_HOME" -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$LIBS" \
  -DTRAINYARD_BUILD_BENCH=OFF "$@" >build-cuda/cmake.log 2>&1 || {
  tail -40 build-cuda/cmake.log
  echo "check-cuda-build: cmake failed (build-cuda/cmake.log)" >&2
  exit 1
}
grep "trainyard-trainer:" build-cuda/cmake.log
if ! grep -q "trainyard-trainer: LibTorch 2.*CUDA" build-cuda/cmake.log; then
  echo "check-cuda-build: the CUDA LibTorch was not taken (build-cuda/cmake.log)" >&2
  exit 1
fi
cmake --build build-cuda -j "$(nproc)" --target trainyard-trainer

# It starts: loads every library and answers as the worker asks it (no GPU here: "cpu").
LD_LIBRARY_PATH="$LIBS" build-cuda/bin/trainyard-trainer --version
devices=$(LD_LIBRARY_PATH="$LIBS" build-cuda/bin/trainyard-trainer --supported-devices)
echo "check-cuda-build: --supported-devices: $devices"
if [ "$devices" != "cpu" ] && ! command -v nvidia-smi >/dev/null; then
  echo "check-cuda-build: --supported-devices says '$devices' on a machine without a GPU" >&2
  exit 1
fi

# It trains: a few steps of the example GPT on the CPU give the default build's losses (same
# initialisation, data order and arithmetic; LibTorch's CPU kernels may round differently).
if [ -x build/bin/trainyard-trainer ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  sed -e 's/steps: 300/steps: 4/' -e 's/warmup: 30/warmup: 2/' examples/char-gpt.yaml >"$work/spec.yaml"
  run() {  # BINARY DIR LIBRARY_PATH: the losses of the 4 steps, one per line
    LD_LIBRARY_PATH="$3" "$1" --spec "$work/spec.yaml" --job-id "" --attempt 1 --rank 0 \
      --world-size 1 --coordinator 127.0.0.1:1 --checkpoint-dir "$work/$2" --threads "$(nproc)" |
      awk '$1 == "step" { print $4 }'
  }
  run build/bin/trainyard-trainer default "" >"$work/default.txt"
  run build-cuda/bin/trainyard-trainer cuda "$LIBS" >"$work/cuda.txt"
  paste "$work/default.txt" "$work/cuda.txt"
  if [ "$(wc -l <"$work/cuda.txt")" -ne 4 ] ||
    ! paste "$work/default.txt" "$work/cuda.txt" |
      awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-3 * $1) exit 1 }'; then
    echo "check-cuda-build: the CUDA build's losses differ from the default build's" >&2
    exit 1
  fi
  echo "check-cuda-build: 4 steps on the CPU: the same losses as build/ (within 1e-3)"
fi
# The GPU hosts' image (deploy/container/Dockerfile.worker) installs what this trainer links from
# the system; it copies the folders of $LIBS.
if [ -x build/bin/trainyard-worker ]; then
  python3 tests/check_deploy.py . build/bin build-cuda/bin/trainyard-trainer "$LIBS"
fi
echo "check-cuda-build: trainyard-trainer built against the CUDA LibTorch $TORCH_VERSION"
