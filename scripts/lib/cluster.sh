# Shell helpers shared by bench/*.sh and tests/monitoring_e2e.sh; source it. Python is Debian's
# /usr/bin/python3 (stdlib only).

# The median of the numbers on stdin, one per line.
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# local_cluster_up YARD STATE_DIR [ARGS of `yard local up`...]: starts a local cluster on a free
# loopback port and sets CLUSTER_ADDRESS (exported as TRAINYARD_COORDINATOR), COORDINATOR_METRICS,
# WORKER_METRICS (the first worker's) and PS_METRICS (the first parameter server's); all empty
# without --metrics. Exports TRAINYARD_TOKEN_FILE, the cluster's admin token.
local_cluster_up() {
  local yard=$1 state=$2 up
  shift 2
  # This cluster's admin token for every later yard call; the user's saved token stays untouched
  # (`yard local up` saves to $XDG_CONFIG_HOME/trainyard/token).
  export XDG_CONFIG_HOME="$state/config" TRAINYARD_TOKEN_FILE="$state/admin.token"
  up=$("$yard" local --state-dir "$state" up --listen 127.0.0.1:0 -o json "$@")
  read -r CLUSTER_ADDRESS COORDINATOR_METRICS WORKER_METRICS PS_METRICS < <(/usr/bin/python3 -c '
import json, sys
c = json.loads(sys.argv[1])
procs = {p["name"]: p for p in c["processes"]}
worker = procs.get("worker local-1", {})
ps = procs.get("parameter server local-ps-1", {})
print(c["coordinator_address"], procs["coordinator"].get("metrics_address") or "-",
      worker.get("metrics_address") or "-", ps.get("metrics_address") or "-")' "$up")
  if [ "$COORDINATOR_METRICS" = "-" ]; then COORDINATOR_METRICS=""; fi
  if [ "$WORKER_METRICS" = "-" ]; then WORKER_METRICS=""; fi
  if [ "$PS_METRICS" = "-" ]; then PS_METRICS=""; fi
  export TRAINYARD_COORDINATOR="$CLUSTER_ADDRESS"
}

# bench_cluster_up NAME [ARGS of `yard local up`...]: a benchmark's local cluster (see
# local_cluster_up) in a fresh state dir, set as $state; stopped and removed when the script exits.
# Uses $yard.
bench_cluster_up() {
  state=$(mktemp -d "/tmp/trainyard-$1-XXXXXX")
  shift
  trap '"$yard" local --state-dir "$state" down >/dev/null 2>&1 || true; rm -rf "$state"' EXIT
  local_cluster_up "$yard" "$state" "$@" >/dev/null
}

# job_step_summary YARD JOB WARMUP: "TOKENS_PER_S PEAK_STATE_BYTES COMM_BYTES_PER_STEP" of the
# job's steps after WARMUP: medians, the peak model state its maximum.
job_step_summary() {
  "$1" metrics "$2" -o json | /usr/bin/python3 -c "
import json, statistics, sys
rows = [s for s in json.load(sys.stdin) if s['step'] > $3]
print(statistics.median(s['tokens_per_second'] for s in rows),
      max(s['model_state_peak_bytes'] for s in rows),
      statistics.median(s['comm_bytes'] for s in rows))"
}

# job_tokens_per_second YARD JOB WARMUP: the median tokens/s of the job's steps after WARMUP.
job_tokens_per_second() {
  "$1" metrics "$2" -o json | /usr/bin/python3 -c "
import json, statistics, sys
print(statistics.median(s['tokens_per_second'] for s in json.load(sys.stdin) if s['step'] > $3))"
}
