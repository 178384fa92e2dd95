#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz: the YAML spec parser, the data-plane wire decoder, the
# credential parsers, the safetensors header) with clang, AddressSanitizer and UBSan into
# build-fuzz/, and runs each for FUZZ_SECONDS (default 60), as many at once as there are cores, on a
# copy of its seed corpus (tests/fuzz/corpus/NAME; the copy keeps what libFuzzer finds, the
# repository stays as it is).
# A crash, a leak, undefined behaviour or a broken property stops it with the input saved in
# build-fuzz/findings/NAME/. Usage: scripts/fuzz.sh [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"
targets=("$@")
((${#targets[@]})) || targets=(spec_yaml_fuzz data_plane_wire_fuzz token_fuzz safetensors_header_fuzz)

missing=()
for p in clang libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -DNDEBUG" \
  -DTRAINYARD_FUZZ=ON -DTRAINYARD_BUILD_TESTS=OFF -DTRAINYARD_BUILD_BENCH=OFF \
  -DTRAINYARD_BUILD_TRAINER=OFF >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target "${targets[@]}"

# The targets run side by side, as many at once as there are cores (each is one process).
run_target() {  # TARGET: fuzzes it; its output in build-fuzz/NAME.log, its exit status in NAME.rc
  local t=$1 name="${1%_fuzz}" rc=0
  local corpus="build-fuzz/corpus/$name" findings="build-fuzz/findings/$name"
  mkdir -p "$corpus" "$findings"
  cp -n tests/fuzz/corpus/"$name"/* "$corpus"/ 2>/dev/null || true
  "build-fuzz/fuzz/$t" -max_total_time="$seconds" -max_len=65536 -timeout=10 \
    -rss_limit_mb=4096 -artifact_prefix="$findings/" -print_final_stats=1 "$corpus" \
    >"build-fuzz/$name.log" 2>&1 || rc=$?
  echo "$rc" >"build-fuzz/$name.rc"
}
for t in "${targets[@]}"; do
  rm -f "build-fuzz/${t%_fuzz}.rc"
  while (($(jobs -rp | wc -l) >= $(nproc))); do wait -n || true; done
  echo "fuzz: $t for ${seconds}s"
  run_target "$t" &
done
wait
passed=0
failed=0
for t in "${targets[@]}"; do
  name="${t%_fuzz}"
  if [ "$(cat "build-fuzz/$name.rc" 2>/dev/null)" = 0 ]; then
    echo "fuzz: $t passed"
    grep -E "^Done|stat::number_of_executed_units" "build-fuzz/$name.log" | head -2
    passed=$((passed + 1))
  else
    tail -40 "build-fuzz/$name.log"
    echo "fuzz: $t FAILED; the input is in build-fuzz/findings/$name/"
    failed=$((failed + 1))
  fi
done
echo "fuzz: $passed passed, $failed failed"
((failed == 0))
