#!/usr/bin/env bash
# Parameter-server push + pull throughput over gRPC against a plain TCP socket on loopback, 1 to 4
# trainyard-ps shards (issue #5), as one markdown table. Runs bench/ps_transfer_bench.cc three
# times, each with its own socket anchor: as shipped (the offload trainer's zero-copy client and
# malloc settings), the generated stub client with the same malloc settings, and the stub client
# with glibc's malloc defaults in the client (how offload.cc talked before). trainyard-ps always
# runs as shipped.
#
#   bash bench/ps_transfer_bench.sh [BIN_DIR] [REPS] [PARAMS]   # build/bin, 5 rounds, 32 Mi params
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/bin}
reps=${2:-5}
params=${3:-33554432}
for program in ps_transfer_bench trainyard-ps; do
  [ -x "$bin/$program" ] || { echo "$bin/$program: not built" >&2; exit 1; }
done
run() {
  "$bin/ps_transfer_bench" --params "$params" --reps "$reps" --warmup 1 --shards 1,2,3,4 \
    --ps "$bin/trainyard-ps" "$@"
}

shipped=$(run --client zero-copy --tune-malloc --label "as shipped (zero-copy client)")
stub=$(run --client stub --tune-malloc --label "stub client" --rows-only)
untuned=$(run --client stub --label "stub client, client malloc defaults" --rows-only)

# The first run's text up to the end of its table, the other runs' rows, then the first's notes.
printf '%s\n' "$shipped" | awk '/^\|/ {table = 1} table && !/^\|/ {exit} {print}'
printf '%s\n' "$stub" "$untuned"
printf '%s\n' "$shipped" | awk '/^\|/ {table = 1} table && !/^\|/ {notes = 1} notes {print}'
