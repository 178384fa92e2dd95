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
gpu_worker=""
cleanup() {
  if [ -n "$gpu_worker" ]; then kill "$gpu_worker" 2>/dev/null && wait "$gpu_worker" 2>/dev/null || true; fi
  "$yard" local --state-dir "$state" down >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

source "$repo/scripts/lib/cluster.sh"
# A peak for the CPU (whose MFU is otherwise unknown): the worker's ranks inherit it and report
# their MFU, so that the job dashboard's MFU panel has data too.
export TRAINYARD_PEAK_TFLOPS=0.002
local_cluster_up "$yard" "$state" --workers 1 --slots 2 --ps 1 --ps-memory-bytes 268435456 \
  --metrics

cat >"$tmp/spec.yaml" <<SPEC
name: monitoring-e2e
resources: {slots: 2}
model: {kind: gpt, n_layer: 2, n_head: 2, d_model: 64, seq_len: 32, vocab: 256}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes, eval_path: /usr/share/common-licenses/GPL-2}
train: {steps: 1000000, micro_batch: 4, lr: 1.0e-3, warmup: 10, seed: 1, eval_every: 5, eval_batches: 1}
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

# A second worker on simulated GPUs (tests/fake_cuda_driver.cc and tests/fake_nvml.cc stand in for
# libcuda and NVML), so that the cluster dashboard's GPU row has data. Started once the job runs,
# so that the job is not placed on it.
test_bin="$(cd "$bin/.." && pwd)/tests"
"$yard" admin token create --node gpu-1 --out "$tmp/gpu-1.token" >/dev/null
echo "$(id -un) $(id -un)" >"$tmp/gpu-user-map"
# Its output file exists before the loop below reads it (the background process opens it only
# once forked, which may be after the first read).
: >"$tmp/gpu-1.out"
"$bin/trainyard-worker" --coordinator "$CLUSTER_ADDRESS" --node-id gpu-1 --gpus all \
  --cuda-library "$test_bin/libfake_cuda.so" --nvml-library "$test_bin/libfake_nvml.so" \
  --work-dir "$tmp/gpu-1" --token-file "$tmp/gpu-1.token" --user-map "$tmp/gpu-user-map" \
  --metrics-address 127.0.0.1:0 >"$tmp/gpu-1.out" 2>"$tmp/gpu-1.log" &
gpu_worker=$!
gpu_metrics=""
for _ in $(seq 100); do
  gpu_metrics=$(sed -n 's/^metrics //p' "$tmp/gpu-1.out" | head -n 1)
  [ -n "$gpu_metrics" ] && break
  kill -0 "$gpu_worker" 2>/dev/null || { cat "$tmp/gpu-1.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$gpu_metrics" ] || { echo "the GPU worker did not serve /metrics" >&2; cat "$tmp/gpu-1.log" >&2; exit 1; }

# Fails (and the trap stops the cluster) unless every expression has data. The job is the built-in
# trainer's, which reports no program metrics of its own: trainyard_job_metric may be empty here
# (tests/metrics_e2e_test.cc checks that series).
bash "$repo/tests/prometheus_dashboards_e2e.sh" --job "$job" --timeout 90 \
  --may-be-empty trainyard_job_metric \
  "coordinator=$COORDINATOR_METRICS" "worker=$WORKER_METRICS" "worker=$gpu_metrics" \
  "ps=$PS_METRICS"
