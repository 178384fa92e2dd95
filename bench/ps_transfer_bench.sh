#!/usr/bin/env bash
# Parameter-server push + pull throughput over gRPC against a plain TCP socket on loopback, 1 to 4
# trainyard-ps shards (issue #5), as one markdown table. Runs bench/ps_transfer_bench.cc three
# times, each with its own socket anchor using the same TCP congestion control as the gRPC
# connections of its rows: as shipped (the offload trainer's zero-copy client and malloc
# settings) with the host's congestion control, as shipped with `--tcp-congestion reno` on every
# connection (trainyard-ps --tcp-congestion, trainer --ps-tcp-congestion), the generated stub
# client (how offload.cc talked before the zero-copy client) with the host's, and, as a
# diagnostic, as shipped with reno against a socket whose receivers copy what they receive once
# more (--anchor-copies: what any receiver that cannot receive in place pays).
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

# --tcp-congestion "" is the host's default even where TRAINYARD_TCP_CONGESTION is set.
shipped=$(run --client zero-copy --tune-malloc --tcp-congestion "" --label "as shipped")
reno=$(run --client zero-copy --tune-malloc --tcp-congestion reno --label "as shipped" --rows-only)
stub=$(run --client stub --tune-malloc --tcp-congestion "" --label "stub client" --rows-only)
# Diagnostic: as shipped with reno, against a socket whose receivers copy out of a bounce buffer.
copies=$(run --client zero-copy --tune-malloc --tcp-congestion reno --anchor-copies \
  --label "as shipped, vs socket + receive copy" --rows-only)

# The first run's text up to the end of its table, the other runs' rows, then the first's notes.
printf '%s\n' "$shipped" | awk '/^\|/ {table = 1} table && !/^\|/ {exit} {print}'
printf '%s\n' "$reno" "$stub" "$copies"
printf '%s\n' "$shipped" | awk '/^\|/ {table = 1} table && !/^\|/ {notes = 1} notes {print}'
