#!/usr/bin/env bash
# The main job: sets everything up, starts a local cluster on loopback (a coordinator and two
# worker daemons with one CPU slot each), trains examples/char-gpt.yaml with 2-rank DDP over Gloo
# while showing its progress, prints the loss before and after and a sample of generated text,
# then stops the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --programs  # only what the example runs: no tests, no Python environments

yard=build/bin/yard
state_dir="$(pwd)/build/example-cluster"
export TRAINYARD_COORDINATOR=127.0.0.1:${TRAINYARD_EXAMPLE_PORT:-7071}
# The example's own login, kept in its state folder: `yard local up` saves the local admin's
# token where yard looks (moving a saved one aside), and a token or CA of a real cluster in this
# shell would be sent to this one.
export XDG_CONFIG_HOME="$state_dir/config"
unset TRAINYARD_TOKEN TRAINYARD_TOKEN_FILE TRAINYARD_TLS_CA TRAINYARD_INSECURE
$yard local --state-dir "$state_dir" down >/dev/null 2>&1 || true
trap '$yard local --state-dir "$state_dir" down >/dev/null 2>&1 || true' EXIT

echo "== yard local up --workers 2 --slots 1"
$yard local --state-dir "$state_dir" up --listen "$TRAINYARD_COORDINATOR" --workers 2 --slots 1
echo
echo "== yard nodes"
$yard nodes
echo
echo "== yard submit examples/char-gpt.yaml"
job=$($yard submit examples/char-gpt.yaml)
echo "$job"
echo
echo "== yard metrics -f $job"
$yard metrics -f "$job"
echo
if ! $yard wait "$job"; then
  $yard describe "$job"
  exit 1
fi
echo
echo "== loss, first and last steps (yard metrics $job)"
$yard metrics "$job" | sed -n '1,2p;$p'
echo
echo "== a sample of generated text (yard logs $job)"
$yard logs "$job" | grep -A3 "sample (temperature" | sed "s/^\[rank 0\] //"
