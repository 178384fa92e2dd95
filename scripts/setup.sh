#!/usr/bin/env bash
# Installs trainyard's build and test dependencies from Debian's archive (only what is missing)
# and builds everything (Release) into ./build, then the Python environments the tests use. Safe
# to run again: it does only what is needed. With --programs, builds only the programs (yard, the
# coordinator, the worker, the trainer, the parameter server) and no test or Python environment:
# what scripts/run-example.sh needs.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  cmake g++ make pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  prometheus-cpp-dev libsqlite3-dev libpq-dev postgresql libhwy-dev libcli11-dev libyaml-cpp-dev
  nlohmann-json3-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev
  sqlite3 clang-format prometheus libssl-dev openssl zlib1g-dev libcpp-httplib-dev libjs-dygraphs
  chromium
  libtorch-dev libgloo-dev libdnnl-dev ocl-icd-opencl-dev libopenblas0-pthread python3-torch
  python3-venv python3-pip python3-yaml
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
if [ "${1:-}" = "--programs" ]; then
  cmake --build build -j "$jobs" --target yard trainyard-coordinator trainyard-worker \
    trainyard-trainer trainyard-ps
  echo "setup: built the programs into $(pwd)/build/bin"
  exit 0
fi
cmake --build build -j "$jobs"
echo "setup: built into $(pwd)/build/bin"

# Hugging Face transformers (and PEFT) from PyPI, for the tests that compare the llama model with
# the reference implementation: a virtual environment over Debian's python3-torch, made again
# only when tests/hf-requirements.txt changes.
venv=build/hf-venv
if ! cmp -s tests/hf-requirements.txt "$venv/requirements.txt" 2>/dev/null; then
  echo "setup: creating $venv (transformers from PyPI)"
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  # Debian's torch, not a download of another (a requirement that needs one fails here instead).
  echo "torch==$(/usr/bin/python3 -c 'import torch; print(torch.__version__)')" > "$venv/constraints.txt"
  "$venv/bin/pip" install -q --disable-pip-version-check -c "$venv/constraints.txt" \
    -r tests/hf-requirements.txt
  # PEFT declares torch>=1.13.0, which Debian's 1.13.0a0 (a pre-release number) does not meet,
  # though PEFT runs on it: installed without its dependencies, which the file above lists.
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps \
    $(sed -n 's/^# no-deps: //p' tests/hf-requirements.txt)
  cp tests/hf-requirements.txt "$venv/requirements.txt"
fi

# kubernetes-validate from PyPI, for the schema check of deploy/kubernetes (ctest
# KubernetesSchemas); made again only when tests/k8s-requirements.txt changes.
k8s=build/k8s-venv
if ! cmp -s tests/k8s-requirements.txt "$k8s/requirements.txt" 2>/dev/null; then
  echo "setup: creating $k8s (kubernetes-validate from PyPI)"
  rm -rf "$k8s"
  /usr/bin/python3 -m venv "$k8s"
  "$k8s/bin/pip" install -q --disable-pip-version-check -r tests/k8s-requirements.txt
  cp tests/k8s-requirements.txt "$k8s/requirements.txt"
fi

# Playwright from PyPI, for the web console's browser tests (ctest WebConsoleTest), which drive
# Debian's chromium (installed above); made again only when tests/web-requirements.txt changes.
web=build/web-venv
if ! cmp -s tests/web-requirements.txt "$web/requirements.txt" 2>/dev/null; then
  echo "setup: creating $web (Playwright from PyPI)"
  rm -rf "$web"
  /usr/bin/python3 -m venv "$web"
  "$web/bin/pip" install -q --disable-pip-version-check -r tests/web-requirements.txt
  cp tests/web-requirements.txt "$web/requirements.txt"
fi

# The Python SDK (python/): its stubs generated from proto/ at every run (cheap), installed
# editable into build/sdk-venv with grpcio and pytest from PyPI (over Debian's python3-torch, for
# the examples); the venv is made again only when python/requirements.txt changes.
sdk=build/sdk-venv
if ! cmp -s python/requirements.txt "$sdk/requirements.txt" 2>/dev/null; then
  echo "setup: creating $sdk (grpcio, protobuf and pytest from PyPI)"
  rm -rf "$sdk"
  /usr/bin/python3 -m venv --system-site-packages "$sdk"
  "$sdk/bin/pip" install -q --disable-pip-version-check -r python/requirements.txt
  cp python/requirements.txt "$sdk/requirements.txt"
fi
"$sdk/bin/python" python/build_stubs.py >/dev/null
if ! "$sdk/bin/python" -c 'import trainyard' 2>/dev/null; then
  "$sdk/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e python
fi
