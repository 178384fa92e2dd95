#!/usr/bin/env bash
# The main job: sets everything up, starts a local cluster on loopback, submits
# examples/char-gpt.yaml and shows it in the queue, then stops the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

yard=build/bin/yard
state_dir="$(pwd)/build/example-cluster"
export TRAINYARD_COORDINATOR=127.0.0.1:${TRAINYARD_EXAMPLE_PORT:-7071}
$yard local --state-dir "$state_dir" down >/dev/null 2>&1 || true
trap '$yard local --state-dir "$state_dir" down >/dev/null 2>&1 || true' EXIT

echo "== yard local up"
$yard local --state-dir "$state_dir" up --listen "$TRAINYARD_COORDINATOR"
echo
echo "== yard submit examples/char-gpt.yaml"
job=$($yard submit examples/char-gpt.yaml)
echo "$job"
echo
echo "== yard ls"
$yard ls
echo
echo "== yard describe $job"
$yard describe "$job"
echo
echo "== yard nodes"
$yard nodes
echo
echo "The job waits in the queue: no worker daemon has joined this cluster yet."
echo "Stopping the local cluster (yard local down)."
