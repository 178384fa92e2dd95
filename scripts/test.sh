#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs every test, unit and multi-process, with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 300 "$@"
