#!/usr/bin/env bash
# Makes the certificates of a mutual-TLS trainyard cluster with openssl: a CA, the coordinator's
# serving certificate (with the addresses clients dial as subjectAltNames), one client
# certificate per worker node (common name = node id) and one certificate per parameter server
# (common name = node id; it serves with it and presents it to the coordinator).
#
#   scripts/tls-init.sh --out DIR [--coordinator-san SAN]... [--node ID]... [--ps ID=SAN[,SAN]]...
#                       [--days N]
#
#   SAN: IP:10.0.0.5 or DNS:coord.example.org (default for the coordinator: IP:127.0.0.1 and
#   DNS:localhost). Run it again with the same --out to add nodes: the CA is reused, and an
#   existing certificate is never overwritten.
#
# Writes into DIR (made 0700): ca.pem, ca.key, coordinator.pem/.key, node-ID.pem/.key and
# ps-ID.pem/.key. Keys are 0600, certificates 0644; hand each program its own pair (e.g. chown
# the worker's key to the account the worker runs as), and keep ca.key off the cluster. Then:
#   trainyard-coordinator --tls-cert DIR/coordinator.pem --tls-key DIR/coordinator.key \
#       --tls-client-ca DIR/ca.pem ...
#   trainyard-worker --node-id ID --tls-cert DIR/node-ID.pem --tls-key DIR/node-ID.key \
#       --tls-ca DIR/ca.pem ...
#   trainyard-ps --node-id ID --tls-cert DIR/ps-ID.pem --tls-key DIR/ps-ID.key --tls-ca DIR/ca.pem
#   yard --tls-ca DIR/ca.pem ...        (or TRAINYARD_TLS_CA=DIR/ca.pem)
# docs/operations.md walks through it.
set -euo pipefail

out="" days=365
coordinator_sans=()
nodes=()
servers=()
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:?--out: a folder}"; shift 2 ;;
    --coordinator-san) coordinator_sans+=("${2:?--coordinator-san: e.g. IP:10.0.0.5}"); shift 2 ;;
    --node) nodes+=("${2:?--node: a node id}"); shift 2 ;;
    --ps) servers+=("${2:?--ps: ID=SAN[,SAN]}"); shift 2 ;;
    --days) days="${2:?--days: a count}"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "tls-init: unknown argument '$1'" >&2; usage ;;
  esac
done
[ -n "$out" ] || { echo "tls-init: --out: required" >&2; usage; }
[[ "$days" =~ ^[1-9][0-9]{0,4}$ ]] || { echo "tls-init: --days: a count of days, got '$days'" >&2; exit 2; }
[ ${#coordinator_sans[@]} -gt 0 ] || coordinator_sans=("IP:127.0.0.1" "DNS:localhost")

# A node id becomes a file name and a certificate's common name: the coordinator's own rules.
check_id() {
  [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$ ]] ||
    { echo "tls-init: $2: '$1' is not a node id (letters, digits, . _ -; at most 63)" >&2; exit 2; }
}
check_san() {
  [[ "$1" =~ ^(IP:[0-9A-Fa-f:.]+|DNS:[A-Za-z0-9*][A-Za-z0-9.-]*)$ ]] ||
    { echo "tls-init: $2: '$1' is not IP:ADDRESS or DNS:NAME" >&2; exit 2; }
}
for s in "${coordinator_sans[@]}"; do check_san "$s" --coordinator-san; done
for n in "${nodes[@]+"${nodes[@]}"}"; do check_id "$n" --node; done
for p in "${servers[@]+"${servers[@]}"}"; do
  [[ "$p" == *=* ]] || { echo "tls-init: --ps: '$p' is not ID=SAN[,SAN]" >&2; exit 2; }
  check_id "${p%%=*}" --ps
  IFS=, read -r -a sans <<< "${p#*=}"
  for s in "${sans[@]}"; do check_san "$s" --ps; done
done

umask 077
mkdir -p "$out"
chmod 700 "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ ! -f "$out/ca.pem" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
    -subj "/CN=trainyard CA" -keyout "$out/ca.key" -out "$out/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2> "$work/err" || { cat "$work/err" >&2; exit 1; }
  chmod 600 "$out/ca.key"
  chmod 644 "$out/ca.pem"
  echo "tls-init: made $out/ca.pem (keep $out/ca.key off the cluster)"
fi

# leaf NAME CN SANS(comma-separated or empty) USAGE
leaf() {
  local name="$1" cn="$2" sans="$3" usage="$4"
  if [ -e "$out/$name.pem" ] || [ -e "$out/$name.key" ]; then
    echo "tls-init: $out/$name.pem exists: left as it is (remove it to make a new one)"
    return
  fi
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -z "$sans" ] || echo "subjectAltName=$sans"
  } > "$work/$name.ext"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$cn" \
    -keyout "$out/$name.key" -out "$work/$name.csr" 2> "$work/err" || { cat "$work/err" >&2; exit 1; }
  openssl x509 -req -in "$work/$name.csr" -CA "$out/ca.pem" -CAkey "$out/ca.key" \
    -CAcreateserial -CAserial "$work/ca.srl" -days "$days" -extfile "$work/$name.ext" \
    -out "$out/$name.pem" 2> "$work/err" || { cat "$work/err" >&2; exit 1; }
  chmod 600 "$out/$name.key"
  chmod 644 "$out/$name.pem"
  echo "tls-init: made $out/$name.pem (CN=$cn${sans:+, $sans})"
}

join() { local IFS=,; echo "$*"; }
leaf coordinator trainyard-coordinator "$(join "${coordinator_sans[@]}")" serverAuth
for n in "${nodes[@]+"${nodes[@]}"}"; do
  leaf "node-$n" "$n" "" clientAuth
done
for p in "${servers[@]+"${servers[@]}"}"; do
  leaf "ps-${p%%=*}" "${p%%=*}" "${p#*=}" serverAuth,clientAuth
done
