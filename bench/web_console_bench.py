"""The web console's jobs page with many jobs in the store (issue 57: under 200 ms for its first
page with 10,000). A local cluster without workers (`yard local up --web`) gets N jobs submitted
through the SDK (all stay QUEUED: nobody can run them), then this times, each as a median of
--repeat calls and beside the gRPC ListJobs the console calls (the anchor: what `yard ls` pays):
  - GET /api/v1/jobs?page_size=50, the jobs page's first page, with a bearer token;
  - the same with a name filter that matches one job (the console scans up to 10,000 jobs);
  - the first event of /api/v1/jobs/events, what the page actually waits for (a browser session);
  - GET / (the page itself).

Usage (after scripts/setup.sh):
  PYTHONPATH=python build/web-venv/bin/python bench/web_console_bench.py [--jobs 10000]
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
import trainyard  # noqa: E402
from trainyard.v1 import job_pb2, job_pb2_grpc  # noqa: E402


def timed(f, repeat):
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def get(url, path, headers):
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    c.request("GET", path, headers=headers)
    r = c.getresponse()
    body = r.read()
    c.close()
    assert r.status == 200, (path, r.status, body[:200])
    return body


def first_event(url, path, headers):
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    c.request("GET", path, headers=headers)
    r = c.getresponse()
    assert r.status == 200, r.status
    data = b""
    while b"\n\n" not in data:
        data += r.read1(65536)
    c.close()
    return data


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    yard = str(ROOT / "build" / "bin" / "yard")
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, HOME=home, XDG_CONFIG_HOME=f"{home}/.config")
        for k in ("TRAINYARD_TOKEN", "TRAINYARD_TOKEN_FILE", "TRAINYARD_COORDINATOR"):
            env.pop(k, None)
        state = f"{home}/local"
        up = subprocess.run([yard, "local", "--state-dir", state, "up", "--listen", "127.0.0.1:0",
                             "--workers", "0", "--web", "127.0.0.1:0"],
                            env=env, capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr
        try:
            address = re.search(r"export TRAINYARD_COORDINATOR=(\S+)", up.stdout).group(1)
            url = re.search(r"web console: (http://\S+)", up.stdout).group(1)
            token = pathlib.Path(f"{home}/.config/trainyard/token").read_text().strip()
            # (Admins may queue 1,000 jobs by default.)
            env["TRAINYARD_COORDINATOR"] = address
            subprocess.run([yard, "admin", "user", "set", "admin", "--max-queued", "none"], env=env,
                           check=True, capture_output=True, timeout=60)
            client = trainyard.Client(address, token)
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: client.submit(name=f"bench-{i:05d}", command=["/bin/true"]),
                              range(args.jobs)))
            print(f"submitted {args.jobs} jobs in {time.perf_counter() - start:.1f} s")
            bearer = {"Authorization": f"Bearer {token}"}
            page = json.loads(get(url, "/api/v1/jobs?page_size=50", bearer))
            assert len(page["jobs"]) == 50 and page["nextPageToken"], page.keys()
            stub = job_pb2_grpc.JobServiceStub(client._endpoints.channel)
            grpc_list = lambda: stub.ListJobs(job_pb2.ListJobsRequest(page_size=50),  # noqa: E731
                                              metadata=client._metadata)
            # A browser's session, as the page has it.
            u = urllib.parse.urlsplit(url)
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
            c.request("POST", "/api/v1/session", body=json.dumps({"token": token}),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            cookie = {"Cookie": r.getheader("Set-Cookie").split(";")[0]}
            rows = [
                ("gRPC ListJobs, 50 (the anchor: yard ls)", timed(grpc_list, args.repeat)),
                ("GET /api/v1/jobs?page_size=50 (bearer)",
                 timed(lambda: get(url, "/api/v1/jobs?page_size=50", bearer), args.repeat)),
                ("first event of /api/v1/jobs/events (session)",
                 timed(lambda: first_event(url, "/api/v1/jobs/events?page_size=50", cookie),
                       args.repeat)),
                ("GET /api/v1/jobs?name=bench-00000 (scans 10,000)",
                 timed(lambda: get(url, "/api/v1/jobs?page_size=50&name=bench-00000", bearer),
                       max(5, args.repeat // 3))),
                ("GET / (the page)", timed(lambda: get(url, "/", {}), args.repeat)),
            ]
            print(f"{'':52} {'median ms':>10} {'p90 ms':>8}")
            for name, (median, p90) in rows:
                print(f"{name:52} {median:10.1f} {p90:8.1f}")
        finally:
            subprocess.run([yard, "local", "--state-dir", state, "down"], env=env,
                           capture_output=True, timeout=120)


if __name__ == "__main__":
    main()
