#!/usr/bin/python3
"""Checks trainyard's Grafana dashboards and alert rules (stdlib only).

usage: check_dashboards.py REPO_ROOT [--promtool PATH]

For each dashboards/grafana/*.json: it parses; its uid is the fixed one expected and unique;
every panel (rows aside) has at least one target with a non-empty expr; every datasource is the
Prometheus variable ${DS_PROMETHEUS}; the job dashboard has the $job variable, fed by
label_values(trainyard_job_step, job), and every one of its exprs selects job="$job".
Every metric name in a dashboard expr, in the $job variable's query and in alerts.yml /
alerts_test.yml is one the coordinator, worker or parameter server exports (KNOWN below), so a
typo fails. With --promtool, every dashboard expr (Grafana variables substituted) must also parse
as PromQL: they are written as recording rules to a temporary file for `promtool check rules`.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

GAUGES = {
    # coordinator
    "trainyard_jobs", "trainyard_nodes", "trainyard_devices",
    "trainyard_job_loss", "trainyard_job_tokens_per_second", "trainyard_job_step_seconds",
    "trainyard_job_step", "trainyard_job_total_steps", "trainyard_job_grad_norm",
    "trainyard_job_resident_bytes", "trainyard_job_eval_loss", "trainyard_job_eval_perplexity",
    "trainyard_job_device_peak_bytes", "trainyard_job_metric", "trainyard_job_mfu",
    "trainyard_account_running_devices", "trainyard_account_queued_devices",
    "trainyard_account_quota_devices", "trainyard_account_share_ratio",
    "trainyard_account_usage_ratio", "trainyard_account_usage_device_seconds",
    # worker
    "trainyard_worker_devices", "trainyard_worker_running_ranks", "trainyard_worker_connected",
    "trainyard_worker_gpu_utilization_ratio", "trainyard_worker_gpu_memory_used_bytes",
    "trainyard_worker_gpu_memory_total_bytes", "trainyard_worker_gpu_temperature_celsius",
    "trainyard_worker_gpu_power_watts", "trainyard_worker_gpu_ecc_uncorrected_errors",
    "trainyard_worker_gpu_healthy",
    # parameter server
    "trainyard_ps_resident_bytes", "trainyard_ps_capacity_bytes", "trainyard_ps_jobs",
}
COUNTERS = {
    "trainyard_placements_total", "trainyard_rpc_requests_total", "trainyard_preemptions_total",
    "trainyard_auth_refusals_total", "trainyard_auth_failures_total",
    "trainyard_rank_cpu_seconds_total", "trainyard_node_log_lines_dropped_total",
    "trainyard_worker_rank_exits_total", "trainyard_worker_gpu_xid_events_total",
    "trainyard_ps_pushed_bytes_total", "trainyard_ps_pulled_bytes_total",
}
HISTOGRAMS = {
    "trainyard_job_queue_wait_seconds", "trainyard_scheduling_pass_seconds",
    "trainyard_rpc_duration_seconds", "trainyard_store_commit_seconds",
    "trainyard_worker_heartbeat_rtt_seconds", "trainyard_ps_adam_step_seconds",
    "trainyard_node_event_delay_seconds", "trainyard_rank_peak_rss_bytes",
}
BUILTIN = {"up"}  # Prometheus's own per-target series
KNOWN = GAUGES | COUNTERS | BUILTIN | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}

EXPECTED_UIDS = {
    "cluster-overview.json": "trainyard-cluster",
    "job.json": "trainyard-job",
    "parameter-server.json": "trainyard-ps",
}
DS_UIDS = {"${DS_PROMETHEUS}", "$DS_PROMETHEUS", "Prometheus", "prometheus"}

# PromQL words that look like identifiers but are not metric names.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
            "offset", "bool", "inf", "nan", "atan2"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
IDENT = re.compile(r"(?<![\w.:])[a-zA-Z_:][a-zA-Z0-9_:]*")

GRAFANA_VARS = {"$__rate_interval": "1m", "${__rate_interval}": "1m", "$__interval": "1m",
                "${__interval}": "1m", "$__range": "1h", "${__range}": "1h"}


def metric_names(expr):
    """Metric names an expr selects: identifiers that are neither functions, keywords, label
    names (in {...} or grouping clauses) nor inside strings or [ranges]."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)           # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)         # ranges, subqueries
    s = re.sub(r"\$\{?\w+\}?", " ", s)          # Grafana variables
    prev = None
    while prev != s:                             # nested grouping clauses are not a thing, but
        prev, s = s, GROUPING.sub(" ", s)        # be safe
    names = []
    for m in IDENT.finditer(s):
        word = m.group(0)
        rest = s[m.end():].lstrip()
        if rest.startswith("("):                 # a function (or aggregation) call
            continue
        if word.lower() in KEYWORDS:
            continue
        names.append(word)
    return names


def substitute(expr, job="job-1"):
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    return expr.replace("${job}", job).replace("$job", job)


def walk_panels(panels):
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    root = sys.argv[1]
    promtool = None
    if "--promtool" in sys.argv:
        promtool = sys.argv[sys.argv.index("--promtool") + 1]
    errors = []
    all_exprs = []  # (where, expr)
    uids = {}
    gdir = os.path.join(root, "dashboards", "grafana")
    found = sorted(f for f in os.listdir(gdir) if f.endswith(".json"))
    for missing in sorted(set(EXPECTED_UIDS) - set(found)):
        errors.append(f"{missing}: missing")
    for fname in found:
        path = os.path.join(gdir, fname)
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            errors.append(f"{fname}: does not parse: {e}")
            continue
        uid = d.get("uid")
        if not isinstance(uid, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", uid):
            errors.append(f"{fname}: uid {uid!r} is not a fixed uid (1-40 of [A-Za-z0-9_-])")
        elif uid in uids:
            errors.append(f"{fname}: uid {uid} also used by {uids[uid]}")
        else:
            uids[uid] = fname
        if fname in EXPECTED_UIDS and uid != EXPECTED_UIDS[fname]:
            errors.append(f"{fname}: uid {uid!r}, expected {EXPECTED_UIDS[fname]!r}")
        if not d.get("title"):
            errors.append(f"{fname}: no title")
        variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
        ds = variables.get("DS_PROMETHEUS")
        if ds is None or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
            errors.append(f"{fname}: no datasource variable DS_PROMETHEUS of type prometheus")
        ids = set()
        panels = [p for p in walk_panels(d.get("panels", []))]
        if not any(p.get("type") != "row" for p in panels):
            errors.append(f"{fname}: no panels")
        for p in panels:
            where = f"{fname}: panel {p.get('id')} {p.get('title')!r}"
            if p.get("id") in ids:
                errors.append(f"{where}: duplicate panel id")
            ids.add(p.get("id"))
            if p.get("type") == "row":
                continue
            for holder in [p] + p.get("targets", []):
                dsref = holder.get("datasource")
                if dsref is not None and (not isinstance(dsref, dict) or dsref.get("uid") not in DS_UIDS):
                    errors.append(f"{where}: datasource {dsref!r} is not the Prometheus variable")
            exprs = [t.get("expr", "") for t in p.get("targets", [])]
            if not exprs or not any(isinstance(e, str) and e.strip() for e in exprs):
                errors.append(f"{where}: no target with a non-empty expr")
            for t in p.get("targets", []):
                e = t.get("expr", "")
                if not isinstance(e, str) or not e.strip():
                    errors.append(f"{where}: target {t.get('refId')} has an empty expr")
                    continue
                all_exprs.append((where, e))
                names = metric_names(e)
                if not names:
                    errors.append(f"{where}: expr selects no metric: {e}")
                for n in names:
                    if n not in KNOWN:
                        errors.append(f"{where}: unknown metric {n!r} in: {e}")
                if fname == "job.json" and not re.search(r'\bjob\s*=\s*"\$\{?job\}?"', e):
                    errors.append(f"{where}: expr does not select job=\"$job\": {e}")
        if fname == "job.json":
            job = variables.get("job")
            if job is None:
                errors.append(f"{fname}: no $job variable")
            else:
                q = job.get("query")
                q = q.get("query", "") if isinstance(q, dict) else (q or "")
                m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*job\s*\)\s*", q)
                if not m or m.group(1) not in KNOWN:
                    errors.append(f"{fname}: $job variable query {q!r} is not label_values(<known metric>, job)")

    # Alert rules and their tests: every trainyard_* / ps name must be known (promtool checks syntax).
    for rel in ("dashboards/prometheus/alerts.yml", "dashboards/prometheus/alerts_test.yml"):
        try:
            with open(os.path.join(root, rel)) as f:
                text = f.read()
        except OSError as e:
            errors.append(f"{rel}: {e}")
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0] if not line.lstrip().startswith(("summary", "description")) else line
            for n in re.findall(r"(?<![\w.-])trainyard_[a-z0-9_]+", code):
                if n not in KNOWN:
                    errors.append(f"{rel}:{lineno}: unknown metric {n!r}")

    if promtool and all_exprs:
        with tempfile.TemporaryDirectory() as tmp:
            rules = os.path.join(tmp, "dashboard_exprs.yml")
            with open(rules, "w") as f:
                f.write("groups:\n  - name: dashboard_exprs\n    rules:\n")
                for i, (_, e) in enumerate(all_exprs):
                    f.write(f"      - record: dashboard:expr_{i}\n        expr: {json.dumps(substitute(e))}\n")
            r = subprocess.run([promtool, "check", "rules", rules], capture_output=True, text=True)
            if r.returncode != 0:
                out = r.stdout + r.stderr
                errors.append("promtool rejects dashboard PromQL:\n" + out)
                for i, (where, e) in enumerate(all_exprs):
                    if f"dashboard:expr_{i}" in out or f"expr_{i}\"" in out:
                        errors.append(f"  {where}: {e}")

    if errors:
        print("dashboard check failed:")
        for e in errors:
            print("  " + e)
        return 1
    print(f"{len(uids)} dashboards, {len(all_exprs)} exprs: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
