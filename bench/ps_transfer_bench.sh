#!/usr/bin/env bash
# Parameter-server push + pull throughput against a plain TCP socket on loopback, 1 to 4
# trainyard-ps shards (issue #5), as one markdown table. Runs bench/ps_transfer_bench.cc four
# times, each with its own socket anchor using the same TCP congestion control as the
# connections of its rows: as shipped (the offload trainer's default, each server's TCP data
# plane, with its malloc settings) with the host's congestion control and with
# `--tcp-congestion reno` on every connection (trainyard-ps --tcp-congestion, trainer
# --ps-tcp-congestion), then the trainer's gRPC path (--ps-transport grpc, or a server started
# with --data-listen off: the zero-copy client on gRPC byte buffers) with both; then both over TLS
# (the host's congestion control).
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
    --ps "$bin/trainyard-ps" --tune-malloc "$@"
}

# --tcp-congestion "" is the host's default even where TRAINYARD_TCP_CONGESTION is set.
shipped=$(run --client tcp --tcp-congestion "" --label "as shipped: data plane")
reno=$(run --client tcp --tcp-congestion reno --label "as shipped: data plane" --rows-only)
grpc=$(run --client zero-copy --tcp-congestion "" --label "gRPC (--ps-transport grpc)" --rows-only)
grpc_reno=$(run --client zero-copy --tcp-congestion reno --label "gRPC (--ps-transport grpc)" \
  --rows-only)
# TLS (trainyard-ps --tls-cert/--tls-key, the trainer verifying with the CA): the data plane over
# TLS (the default where gRPC has TLS; --data-plane-insecure turns it off) and gRPC over TLS,
# with a throw-away CA and certificate for 127.0.0.1.
tls_dir=$(mktemp -d)
trap 'rm -rf "$tls_dir"' EXIT
printf 'subjectAltName=IP:127.0.0.1\n' > "$tls_dir/ext.cnf"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -keyout "$tls_dir/ca.key" -out "$tls_dir/ca.pem" -subj "/CN=bench ca" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=127.0.0.1" \
  -keyout "$tls_dir/server.key" -out "$tls_dir/server.csr" 2>/dev/null
openssl x509 -req -in "$tls_dir/server.csr" -CA "$tls_dir/ca.pem" -CAkey "$tls_dir/ca.key" \
  -CAcreateserial -days 2 -extfile "$tls_dir/ext.cnf" -out "$tls_dir/server.pem" 2>/dev/null
tls=$(run --client tcp --tcp-congestion "" --tls-dir "$tls_dir" --label "data plane over TLS" \
  --rows-only)
grpc_tls=$(run --client zero-copy --tcp-congestion "" --tls-dir "$tls_dir" \
  --label "gRPC over TLS" --rows-only)

# The first run's text up to the end of its table, the other runs' rows, then the first's notes.
printf '%s\n' "$shipped" | awk '/^\|/ {table = 1} table && !/^\|/ {exit} {print}'
printf '%s\n' "$reno" "$grpc" "$grpc_reno" "$tls" "$grpc_tls"
printf '%s\n' "$shipped" | awk '/^\|/ {table = 1} table && !/^\|/ {notes = 1} notes {print}'
