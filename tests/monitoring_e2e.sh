#!/usr/bin/env bash
# Monitoring end to end: a local cluster with /metrics on every process (`yard local up
# --metrics`, 1 worker with 2 slots, 1 parameter server), a real 2-rank offload training job
# (so the parameter server works too), and a real Prometheus scraping them every second; every
# PromQL expression of the three dashboards must return data, and every alert rule must evaluate
# (tests/prometheus_dashboards_e2e.sh). Cleans up its cluster and temp dir whatever happens.
#
# usage: tests/monitoring_e2e.sh BIN_DIR
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:?usage: monitoring_e2e.sh BIN_DIR}"
yard="$bin/yard"
tmp=$(mktemp -d /tmp/trainyard-monitoring-XXXXXX)
state="$tmp/cluster"
cleanup() {
  "$yard" local --state-dir "$state" down >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

source "$repo/scripts/lib/cluster.sh"
local_cluster_up "$yard" "$state" --workers 1 --slots 2 --ps 1 --ps-memory-bytes 268435456 \
  --metrics

cat >"$tmp/spec.yaml" <<SPEC
name: monitoring-e2e
resources: {gpus: 2}
model: {kind: gpt, n_layer: 2, n_head: 2, d_model: 64, seq_len: 32, vocab: 256}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes}
train: {steps: 1000000, micro_batch: 4, lr: 1.0e-3, warmup: 10, seed: 1}
parallel: {strategy: offload}
SPEC
# The job runs in an account with a quota, so that the account panels have a quota series too.
"$yard" admin account add research --quota 2 >/dev/null
"$yard" admin user set "$("$yard" -o json whoami | python3 -c 'import json,sys; print(json.load(sys.stdin)["user"])')" \
  --account research >/dev/null
job=$("$yard" submit "$tmp/spec.yaml")

# The job trains once its first step is reported: `yard metrics -f` prints a line per step
# (yard then dies of SIGPIPE when head has gone, hence `|| true`).
first=$("$yard" metrics -f "$job" | head -n 1 || true)
if [[ "$first" != step* ]]; then
  echo "no training step reported: $("$yard" describe "$job")" >&2
  exit 1
fi

# Fails (and the trap stops the cluster) unless every expression has data.
bash "$repo/tests/prometheus_dashboards_e2e.sh" --job "$job" --timeout 90 \
  "coordinator=$COORDINATOR_METRICS" "worker=$WORKER_METRICS" "ps=$PS_METRICS"
