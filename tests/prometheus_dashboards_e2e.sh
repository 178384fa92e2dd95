#!/usr/bin/env bash
# End-to-end check of the Grafana dashboards against real /metrics endpoints, through a real
# Prometheus: every PromQL expression of dashboards/grafana/*.json must evaluate without error
# and return data. Also checks that the $job variable's query lists the job, and that every rule
# of dashboards/prometheus/alerts.yml evaluates without error.
#
# usage: tests/prometheus_dashboards_e2e.sh [options] TARGET...
#   TARGET          [coordinator=|worker=|ps=]HOST:PORT of a /metrics endpoint. Without a role, the
#                   role is read from the metric names the endpoint serves.
#   --job JOB_ID    value for $job (default: the first job of label_values(trainyard_job_step, job))
#   --skip-ps       skip the parameter-server dashboard (no trainyard-ps running)
#   --skip-job      skip the job dashboard (no job running)
#   --timeout SECS  bound of each wait: ready, targets up, $job listed, data, rules (default 60)
#   --rate-interval DUR   substituted for $__rate_interval (default 5s; scrapes are every 1s)
#   --prometheus PATH     the prometheus binary (default: prometheus on PATH)
#   --may-be-empty METRIC an expression selecting METRIC may return no data (a series the job
#                         under test has no reason to have); it must still evaluate
#
# Prometheus runs on 127.0.0.1 on a free port with its data in a temp dir; both are gone when the
# script exits, whatever the outcome. Exit 0 when everything has data, 1 otherwise (listing the
# failing expressions), 2 on bad usage.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
timeout=60
rate_interval=5s
job_id=""
skip_ps=0
skip_job=0
prometheus_bin="prometheus"
may_be_empty=""
targets=()
usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while (($#)); do
  case "$1" in
    --job) job_id="${2:?--job needs a value}"; shift 2 ;;
    --skip-ps) skip_ps=1; shift ;;
    --skip-job) skip_job=1; shift ;;
    --timeout) timeout="${2:?--timeout needs a value}"; shift 2 ;;
    --rate-interval) rate_interval="${2:?--rate-interval needs a value}"; shift 2 ;;
    --prometheus) prometheus_bin="${2:?--prometheus needs a value}"; shift 2 ;;
    --may-be-empty) may_be_empty="$may_be_empty ${2:?--may-be-empty needs a metric}"; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) targets+=("$1"); shift ;;
  esac
done
((${#targets[@]})) || { echo "no scrape targets given" >&2; usage; }
[[ "$timeout" =~ ^[0-9]+$ ]] || { echo "--timeout: not a number of seconds: $timeout" >&2; exit 2; }
command -v "$prometheus_bin" >/dev/null || { echo "prometheus not found (apt-get install prometheus)" >&2; exit 2; }
PY=/usr/bin/python3

tmp="$(mktemp -d -t trainyard-prom-e2e.XXXXXX)"
prom_pid=""
cleanup() {
  local rc=$?
  if [[ -n "$prom_pid" ]] && kill -0 "$prom_pid" 2>/dev/null; then
    kill -TERM "$prom_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$prom_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$prom_pid" 2>/dev/null || true
    wait "$prom_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The Python half: writes the config, waits, queries. Stdlib only.
read -r -d '' HELPER <<'PYEOF' || true
import json, os, re, socket, sys, time, urllib.error, urllib.parse, urllib.request

def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode("utf-8", "replace")

def api(base, path, **params):
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    try:
        _, body = get(url, timeout=30)
    except urllib.error.HTTPError as e:  # 400/422/503 carry a JSON error body
        body = e.read().decode("utf-8", "replace")
    try:
        return json.loads(body)
    except ValueError:
        return {"status": "error", "error": body[:300]}

def detect_role(target, deadline):
    last = None
    while time.time() < deadline:
        try:
            _, text = get(f"http://{target}/metrics", timeout=2)
            if re.search(r"^trainyard_worker_", text, re.M): return "worker"
            if re.search(r"^trainyard_ps_", text, re.M): return "ps"
            if re.search(r"^trainyard_", text, re.M): return "coordinator"
            last = "serves no trainyard_ metric"
        except Exception as e:  # not up yet
            last = str(e)
        time.sleep(0.5)
    sys.exit(f"{target}: cannot tell its role ({last}); give it as coordinator=, worker= or ps=")

def cmd_config(out, alerts, timeout, *targets):
    deadline = time.time() + float(timeout)
    jobs = {"coordinator": [], "worker": [], "ps": []}
    for t in targets:
        role, _, addr = t.rpartition("=")
        if role and role not in jobs:
            sys.exit(f"{t}: role must be coordinator, worker or ps")
        jobs[role or detect_role(addr, deadline)].append(addr)
    lines = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "  evaluation_interval: 1s",
             "rule_files:", f"  - {json.dumps(alerts)}", "scrape_configs:"]
    for role, addrs in jobs.items():
        if not addrs: continue
        lines += [f"  - job_name: trainyard-{role}"]
        if role == "coordinator":  # keep the per-job series' own "job" label (see prometheus.yml)
            lines += ["    honor_labels: true"]
        lines += ["    static_configs:", "      - targets: " + json.dumps(addrs)]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    for role, addrs in jobs.items():
        if addrs: print(f"  {role}: {' '.join(addrs)}")

def cmd_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()

def alive(pid):
    try:
        os.kill(int(pid), 0); return True
    except OSError:
        return False

def cmd_ready(base, pid, timeout):
    deadline = time.time() + float(timeout)
    while time.time() < deadline:
        if not alive(pid): sys.exit(3)  # exited (port taken?): the caller may retry
        try:
            if get(f"{base}/-/ready", timeout=2)[0] == 200: return
        except Exception:
            pass
        time.sleep(0.2)
    sys.exit(f"prometheus not ready after {timeout}s")

def extract(dashboards_dir, skip_ps, skip_job):
    exprs, jobq = [], None
    for fname in sorted(os.listdir(dashboards_dir)):
        if not fname.endswith(".json"): continue
        if skip_ps == "1" and fname == "parameter-server.json": continue
        if skip_job == "1" and fname == "job.json": continue
        with open(os.path.join(dashboards_dir, fname)) as f:
            d = json.load(f)
        def walk(ps):
            for p in ps:
                yield p
                yield from walk(p.get("panels", []))
        for p in walk(d.get("panels", [])):
            for t in p.get("targets", []):
                if t.get("expr", "").strip():
                    exprs.append((f"{fname} / {p.get('title')} / {t.get('refId')}", t["expr"]))
        for v in d.get("templating", {}).get("list", []):
            if v.get("name") == "job":
                q = v.get("query"); jobq = q.get("query") if isinstance(q, dict) else q
    return exprs, jobq

def has_data(res):
    data = res.get("data", {})
    r = data.get("result")
    if data.get("resultType") in ("scalar", "string"): return r is not None
    return bool(r)

def all_nan(res):
    r = res.get("data", {}).get("result") or []
    vals = [s.get("value", [0, None])[1] for s in r if isinstance(s, dict) and "value" in s]
    vals += [v[1] for s in r if isinstance(s, dict) for v in s.get("values", [])]
    return bool(vals) and all(v in ("NaN",) for v in vals)

def cmd_check(base, timeout, dashboards_dir, job, skip_ps, skip_job, rate_interval, started,
              may_be_empty=""):
    deadline = time.time() + float(timeout)
    started = float(started)
    # 1. every target up
    while True:
        t = api(base, "/api/v1/targets", state="active")
        active = t.get("data", {}).get("activeTargets", [])
        down = [f"{a['labels'].get('instance')} ({a.get('health')}: {a.get('lastError') or 'not scraped yet'})"
                for a in active if a.get("health") != "up"]
        if active and not down: break
        if time.time() > deadline:
            sys.exit("targets not up after %ss: %s" % (timeout, ", ".join(down) or "none active"))
        time.sleep(0.5)
    print(f"  {len(active)} target(s) up")
    exprs, jobq = extract(dashboards_dir, skip_ps, skip_job)
    failures = []
    deadline = time.time() + float(timeout)  # each phase gets its own bound
    # 2. the $job variable: label_values(METRIC, job) lists the job
    if skip_job != "1":
        m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*job\s*\)\s*", jobq or "")
        if not m:
            sys.exit(f"job.json: cannot read the $job variable's query {jobq!r}")
        while True:
            vals = api(base, "/api/v1/label/job/values", **{"match[]": m.group(1)}).get("data") or []
            if (job and job in vals) or (not job and vals): break
            if time.time() > deadline:
                failures.append(f"$job variable: {jobq} lists {vals}, not {job or 'any job'}")
                break
            time.sleep(0.5)
        if not job and vals: job = sorted(vals)[0]
        print(f"  $job = {job}  ({jobq} -> {vals})")
    subst = {"$__rate_interval": rate_interval, "${__rate_interval}": rate_interval,
             "$__interval": "1m", "${__interval}": "1m", "$__range": "5m", "${__range}": "5m"}
    def sub(e):
        for k, v in subst.items(): e = e.replace(k, v)
        return e.replace("${job}", job or "").replace("$job", job or "")
    pending = {i: (where, sub(e)) for i, (where, e) in enumerate(exprs)}
    errors, ranged, nan = {}, set(), set()
    optional = may_be_empty.split()
    def may_be_empty_expr(e):
        return any(re.search(r"\b" + re.escape(m) + r"\b", e) for m in optional)
    deadline = time.time() + float(timeout)
    # 3. every expr: no error, and data now (or, failing that, at some point since Prometheus started)
    while pending:
        for i, (where, e) in list(pending.items()):
            r = api(base, "/api/v1/query", query=e)
            if r.get("status") != "success":
                errors[i] = (where, e, r.get("error")); del pending[i]; continue
            if has_data(r):
                if all_nan(r): nan.add(i)
                del pending[i]; continue
            rr = api(base, "/api/v1/query_range", query=e, start=f"{started:.3f}", end=f"{time.time():.3f}", step="1")
            if rr.get("status") == "success" and has_data(rr):
                ranged.add(i); del pending[i]
        # What is still empty may stay empty (--may-be-empty): no reason to wait out the timeout.
        if all(may_be_empty_expr(e) for _, e in pending.values()) or time.time() > deadline: break
        time.sleep(1)
    # 4. alert rules evaluate without error
    rule_errors = []
    deadline = time.time() + float(timeout)
    while True:
        groups = api(base, "/api/v1/rules").get("data", {}).get("groups", [])
        rules = [r for g in groups for r in g.get("rules", [])]
        unevaluated = [r for r in rules if r.get("lastEvaluation", "").startswith("0001-")]
        if not unevaluated or time.time() > deadline: break
        time.sleep(0.5)
    for r in rules:
        if r.get("health") != "ok":
            rule_errors.append(f"{r.get('name')}: {r.get('health')} {r.get('lastError', '')}")
    firing = sorted({r.get("name") for r in rules if r.get("state") in ("pending", "firing")})
    n = len(exprs)
    print(f"  {n - len(errors) - len(pending)}/{n} expressions have data"
          + (f" ({len(ranged)} only earlier in the run)" if ranged else ""))
    for i in sorted(nan): print(f"  note: NaN only (no observations yet?): {exprs[i][0]}")
    print(f"  {len(rules)} alert rules evaluated" + (f"; pending/firing: {', '.join(firing)}" if firing else ""))
    for where, e, err in errors.values(): failures.append(f"ERROR   {where}: {err}\n          {e}")
    for where, e in pending.values():
        if may_be_empty_expr(e):
            print(f"  note: no data, as allowed (--may-be-empty): {where}")
            continue
        failures.append(f"NO DATA {where}\n          {e}")
    failures += [f"RULE    {x}" for x in rule_errors]
    if failures:
        print("FAILED:")
        for f in failures: print("  " + f)
        sys.exit(1)
    print("PASSED")

cmds = {"config": cmd_config, "port": cmd_port, "ready": cmd_ready, "check": cmd_check}
cmds[sys.argv[1]](*sys.argv[2:])
PYEOF

echo "prometheus e2e: scrape targets"
"$PY" -c "$HELPER" config "$tmp/prometheus.yml" "$repo/dashboards/prometheus/alerts.yml" "$timeout" "${targets[@]}"

base=""
for attempt in 1 2 3; do
  port="$("$PY" -c "$HELPER" port)"
  base="http://127.0.0.1:$port"
  rm -rf "$tmp/data"
  started="$(date +%s.%N)"
  "$prometheus_bin" --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
    --web.listen-address="127.0.0.1:$port" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
  prom_pid=$!
  rc=0
  "$PY" -c "$HELPER" ready "$base" "$prom_pid" "$timeout" || rc=$?
  ((rc == 0)) && break
  wait "$prom_pid" 2>/dev/null || true
  prom_pid=""
  if ((rc != 3 || attempt == 3)); then
    echo "prometheus did not start:"; tail -20 "$tmp/prometheus.log"; exit 1
  fi
done
echo "prometheus $("$prometheus_bin" --version 2>&1 | head -1 | awk '{print $3}') ready on $base"

rc=0
"$PY" -c "$HELPER" check "$base" "$timeout" "$repo/dashboards/grafana" "$job_id" "$skip_ps" "$skip_job" \
  "$rate_interval" "$started" "$may_be_empty" || rc=$?
if ((rc != 0)); then
  echo "--- prometheus log (tail) ---"; tail -20 "$tmp/prometheus.log"
fi
exit "$rc"
