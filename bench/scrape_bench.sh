#!/usr/bin/env bash
# Does Prometheus scraping slow training? tokens/s of the same 2-rank DDP job on a local cluster
# whose processes serve /metrics, without and with a real Prometheus scraping the coordinator and
# the worker every second, interleaved, in one run.
#
#   bash bench/scrape_bench.sh [STEPS] [REPS]     # defaults 40 timed steps (+5 warm-up), 3 reps
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-40}
reps=${2:-3}
warmup=5
yard=build/bin/yard
tmp=$(mktemp -d /tmp/trainyard-scrape-bench-XXXXXX)
state="$tmp/cluster"
prom_pid=""
cleanup() {
  [ -n "$prom_pid" ] && kill "$prom_pid" 2>/dev/null && wait "$prom_pid" 2>/dev/null || true
  $yard local --state-dir "$state" down >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

source scripts/lib/cluster.sh
local_cluster_up "$yard" "$state" --workers 1 --slots 2 --metrics

cat >"$tmp/spec.yaml" <<SPEC
name: scrape-bench
resources: {slots: 2}
model: {kind: gpt, n_layer: 4, n_head: 4, d_model: 256, seq_len: 128, vocab: 256}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes}
train: {steps: $((steps + warmup)), micro_batch: 8, lr: 3.0e-4, warmup: 0, seed: 1}
SPEC
cat >"$tmp/prometheus.yml" <<PROM
global: {scrape_interval: 1s}
scrape_configs:
  - job_name: trainyard-coordinator
    honor_labels: true
    static_configs: [{targets: ["$COORDINATOR_METRICS"]}]
  - job_name: trainyard-worker
    static_configs: [{targets: ["$WORKER_METRICS"]}]
PROM

run_job() {
  local job
  job=$($yard submit "$tmp/spec.yaml")
  $yard wait "$job" >/dev/null 2>&1
  job_tokens_per_second "$yard" "$job" "$warmup"
}
start_prometheus() {
  local port
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  prometheus --config.file "$tmp/prometheus.yml" --storage.tsdb.path "$tmp/tsdb" \
    --web.listen-address "127.0.0.1:$port" >"$tmp/prometheus.log" 2>&1 &
  prom_pid=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/-/ready" >/dev/null && return; sleep 0.1; done
  echo "prometheus did not start" >&2; exit 1
}
stop_prometheus() { kill "$prom_pid"; wait "$prom_pid" 2>/dev/null || true; prom_pid=""; }

without=(); with=()
for ((r = 0; r < reps; r++)); do
  without+=("$(run_job)")
  start_prometheus
  with+=("$(run_job)")
  stop_prometheus
done
w0=$(printf "%s\n" "${without[@]}" | median)
w1=$(printf "%s\n" "${with[@]}" | median)
printf "GPT n_layer 4, d_model 256, seq_len 128, 2 ranks x micro_batch 8, 1 thread each;\n"
printf "median tokens/s over %d timed steps, median of %d interleaved reps\n\n" "$steps" "$reps"
printf "| case | tokens/s | per rep |\n|---|---|---|\n"
printf "| no Prometheus | %.0f | %s |\n" "$w0" "$(printf "%.0f " "${without[@]}")"
printf "| Prometheus scraping coordinator + worker every 1 s | %.0f | %s |\n" "$w1" "$(printf "%.0f " "${with[@]}")"
awk -v a="$w0" -v b="$w1" 'BEGIN {printf "\nwith / without: %.3f (%+.1f%%)\n", b / a, 100 * (b / a - 1)}'
