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
# The tests' venvs come from PyPI while the build compiles (the downloads wait on the network, not
# on the cores). Each is made again only when its requirements file changes.
venv_is_current() {  # DIR REQUIREMENTS
  cmp -s "$2" "$1/requirements.txt" 2>/dev/null
}
make_venv() {  # DIR REQUIREMENTS WHAT [venv options]: the venv with REQUIREMENTS from PyPI
  local dir=$1 requirements=$2 what=$3
  shift 3
  venv_is_current "$dir" "$requirements" && return 0
  echo "setup: creating $dir ($what from PyPI)"
  rm -rf "$dir"
  /usr/bin/python3 -m venv "$@" "$dir"
  "$dir/bin/pip" install -q --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$dir/requirements.txt"
}
make_venvs() {
  # Hugging Face transformers (and PEFT), for the tests that compare the llama model with the
  # reference implementation: over Debian's python3-torch, never a download of another torch (a
  # requirement that needs one fails here instead).
  local hf=build/hf-venv
  if ! venv_is_current "$hf" tests/hf-requirements.txt; then
    echo "setup: creating $hf (transformers from PyPI)"
    rm -rf "$hf"
    /usr/bin/python3 -m venv --system-site-packages "$hf"
    echo "torch==$(/usr/bin/python3 -c 'import torch; print(torch.__version__)')" >"$hf/constraints.txt"
    "$hf/bin/pip" install -q --disable-pip-version-check -c "$hf/constraints.txt" \
      -r tests/hf-requirements.txt
    # PEFT declares torch>=1.13.0, which Debian's 1.13.0a0 (a pre-release number) does not meet,
    # though PEFT runs on it: installed without its dependencies, which the file above lists.
    "$hf/bin/pip" install -q --disable-pip-version-check --no-deps \
      $(sed -n 's/^# no-deps: //p' tests/hf-requirements.txt)
    cp tests/hf-requirements.txt "$hf/requirements.txt"
  fi
  # kubernetes-validate, for the schema check of deploy/kubernetes (ctest KubernetesSchemas).
  make_venv build/k8s-venv tests/k8s-requirements.txt kubernetes-validate
  # Playwright, for the web console's browser tests (ctest WebConsoleTest), which drive Debian's
  # chromium (installed above).
  make_venv build/web-venv tests/web-requirements.txt Playwright
  # The Python SDK (python/): grpcio, protobuf and pytest over Debian's python3-torch (for the
  # examples); its stubs generated from proto/ at every run (cheap), the SDK installed editable.
  local sdk=build/sdk-venv
  make_venv "$sdk" python/requirements.txt "grpcio, protobuf and pytest" --system-site-packages
  "$sdk/bin/python" python/build_stubs.py >/dev/null
  if ! "$sdk/bin/python" -c 'import trainyard' 2>/dev/null; then
    "$sdk/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e python
  fi
}
make_venvs &
venvs_pid=$!
if ! cmake --build build -j "$jobs"; then
  wait "$venvs_pid" || true
  exit 1
fi
echo "setup: built into $(pwd)/build/bin (${SECONDS} s since setup began)"
if ! wait "$venvs_pid"; then
  echo "setup: making the test venvs failed (above)" >&2
  exit 1
fi
