#!/usr/bin/env bash
# scripts/tls-init.sh end to end: its files verify against its CA, carry the names the programs
# check (the coordinator's address as a subjectAltName, a node's id as its common name) and the
# modes they need; and they make a working mutual-TLS cluster: a coordinator asking for client
# certificates, a worker that registers by its certificate alone (no token), yard over TLS; a
# worker presenting another node's certificate is refused. Cleans up whatever happens.
#
# usage: tests/tls_init_e2e.sh BIN_DIR
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:?usage: tls_init_e2e.sh BIN_DIR}"
tmp=$(mktemp -d /tmp/trainyard-tls-init-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]+"${pids[@]}"}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]+"${pids[@]}"}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "tls_init_e2e: $*" >&2; exit 1; }

pki="$tmp/pki"
bash "$repo/scripts/tls-init.sh" --out "$pki" --node w1 --ps ps1=IP:127.0.0.1 >/dev/null
# Run again to add a node: the CA stays, nothing is overwritten.
ca_before=$(sha256sum <"$pki/ca.pem")
bash "$repo/scripts/tls-init.sh" --out "$pki" --node w1 --node w2 >"$tmp/again.out"
[ "$(sha256sum <"$pki/ca.pem")" = "$ca_before" ] || fail "a second run replaced the CA"
grep -q "node-w1.pem exists: left as it is" "$tmp/again.out" || fail "w1's certificate was not kept"
[ -f "$pki/node-w2.pem" ] || fail "a second run did not add w2"
if bash "$repo/scripts/tls-init.sh" --out "$pki" --node "w1;rm" 2>"$tmp/bad.err"; then
  fail "a node id with ';' was accepted"
fi
grep -q -- "--node: 'w1;rm' is not a node id" "$tmp/bad.err" || fail "bad id: $(cat "$tmp/bad.err")"

for f in coordinator node-w1 node-w2 ps-ps1; do
  openssl verify -CAfile "$pki/ca.pem" "$pki/$f.pem" >/dev/null || fail "$f.pem does not verify"
  [ "$(stat -c %a "$pki/$f.key")" = 600 ] || fail "$f.key is not 0600"
done
[ "$(stat -c %a "$pki/ca.key")" = 600 ] || fail "ca.key is not 0600"
[ "$(stat -c %a "$pki")" = 700 ] || fail "the folder is not 0700"
openssl x509 -in "$pki/coordinator.pem" -noout -ext subjectAltName | grep -q "IP Address:127.0.0.1" ||
  fail "the coordinator's certificate lacks IP:127.0.0.1"
openssl x509 -in "$pki/node-w1.pem" -noout -subject | grep -q "CN = w1$" || fail "node-w1 is not CN=w1"
openssl x509 -in "$pki/ps-ps1.pem" -noout -ext extendedKeyUsage | grep -q "Client Authentication" ||
  fail "ps-ps1 cannot be a client certificate"

# A mutual-TLS coordinator: its first line of stdout is the address it serves on.
"$bin/trainyard-coordinator" --listen 127.0.0.1:0 --state-dir "$tmp/state" \
  --tls-cert "$pki/coordinator.pem" --tls-key "$pki/coordinator.key" --tls-client-ca "$pki/ca.pem" \
  >"$tmp/coordinator.out" 2>"$tmp/coordinator.log" &
pids+=($!)
address=""
for _ in $(seq 1 300); do  # up to 30 s: a detached server prints when it serves
  address=$(head -n 1 "$tmp/coordinator.out" 2>/dev/null || true)
  [ -n "$address" ] && break
  kill -0 "${pids[0]}" 2>/dev/null || fail "the coordinator exited: $(tail -5 "$tmp/coordinator.log")"
  sleep 0.1
done
[ -n "$address" ] || fail "the coordinator did not start"
yard=("$bin/yard" --coordinator "$address" --tls-ca "$pki/ca.pem" --token-file "$tmp/state/admin.token")

echo "$(id -un) $(id -un)" >"$tmp/user-map"
start_worker() {  # NODE_ID CERT_NAME
  "$bin/trainyard-worker" --coordinator "$address" --node-id "$1" --cpu-slots 1 \
    --work-dir "$tmp/work-$1" --trainer "$bin/trainyard-trainer" --user-map "$tmp/user-map" \
    --tls-ca "$pki/ca.pem" --tls-cert "$pki/$2.pem" --tls-key "$pki/$2.key" \
    >"$tmp/worker-$1.out" 2>"$tmp/worker-$1.log" &
  pids+=($!)
}
# w1 with its own certificate and no token; w2 with w1's certificate.
start_worker w1 node-w1
start_worker w2 node-w1
ready=""
for _ in $(seq 1 300); do  # up to 30 s for the registration
  nodes=$("${yard[@]}" -o json nodes 2>"$tmp/yard.err" || true)
  ready=$(printf '%s' "$nodes" | python3 -c '
import json, sys
text = sys.stdin.read()
print(" ".join(n["id"] for n in json.loads(text).get("nodes", []) if n.get("state") == "NODE_READY") if text else "")
' 2>/dev/null || true)
  [ "$ready" = "w1" ] && grep -q "certificate is for node w1, not w2" "$tmp/coordinator.log" && break
  sleep 0.1
done
[ "$ready" = "w1" ] || fail "w1 did not register over mutual TLS (ready: '$ready'): $(tail -5 "$tmp/worker-w1.log") $(cat "$tmp/yard.err")"
grep -q "certificate is for node w1, not w2" "$tmp/coordinator.log" ||
  fail "w2 with w1's certificate was not refused: $(tail -5 "$tmp/coordinator.log")"
echo "tls_init_e2e: the files verify, w1 registered by its certificate, w2 was refused"
