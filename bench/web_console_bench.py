"""The web console's jobs page with many jobs in the store (issue 57: under 200 ms for its first
page with 10,000). A coordinator without workers (--web-address) gets N jobs submitted
through the SDK (each cancelled at once but the last 50, which stay QUEUED: nobody can run
them), then this times, each as a median of
--repeat calls and beside the gRPC ListJobs the console calls (the anchor: what `yard ls` pays):
  - GET /api/v1/jobs?page_size=50, the jobs page's first page, with a bearer token;
  - the first page of the cancelled ones (read from the store: they left memory);
  - the same with a name filter that matches one job (the console scans up to 10,000 jobs);
  - the first event of /api/v1/jobs/events, what the page actually waits for (a browser session);
  - GET / (the page itself).

Usage (after scripts/setup.sh):
  PYTHONPATH=python build/web-venv/bin/python bench/web_console_bench.py [--jobs 10000] [--browser]
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


def browser_load(url, token, repeat):
    """The page as a person sees it: Debian's chromium (headless), signed in, from navigation to
    the first page's 50 rows on screen."""
    import shutil
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=shutil.which("chromium"), headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = b.new_page()
        page.goto(url + "/#/signin")
        page.fill("#token", token)
        page.click("#signin")
        page.wait_for_selector("tr[data-job]")
        wall, shown = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            page.reload()
            page.locator("tr[data-job]").nth(49).wait_for()
            wall.append((time.perf_counter() - start) * 1000)
            # From the navigation's start to the rows in the document (the page's own mark).
            shown.append(page.evaluate(
                "() => performance.getEntriesByName('jobs-shown')[0].startTime"))
        if os.environ.get("WEB_BENCH_TIMINGS"):
            print(page.evaluate("() => JSON.stringify(performance.getEntries().map("
                                "e => [e.name.slice(-40), Math.round(e.startTime), "
                                "Math.round(e.duration)]))"))
        b.close()
    return [(name, (statistics.median(s), sorted(s)[int(0.9 * (len(s) - 1))]))
            for name, s in (("chromium: reload #/jobs to 50 rows (Playwright's clock)", wall),
                            ("chromium: navigation start to rows shown (page's mark)", shown))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--browser", action="store_true",
                        help="also time the page in chromium (Playwright, build/web-venv)")
    args = parser.parse_args()
    coordinator = str(ROOT / "build" / "bin" / "trainyard-coordinator")
    with tempfile.TemporaryDirectory() as home:
        # A coordinator alone (no worker: nothing runs), which moves a finished job out of memory
        # a second after it ends: the list then reads the store, as a long-lived cluster's does.
        out = open(f"{home}/out", "w+")
        proc = subprocess.Popen([coordinator, "--state-dir", f"{home}/state", "--listen",
                                 "127.0.0.1:0", "--web-address", "127.0.0.1:0",
                                 "--finished-job-retention", "1s",
                                 "--max-queued-jobs-per-user", "100000"],
                                stdout=out, stderr=open(f"{home}/err", "w"))
        try:
            deadline = time.time() + 30
            while len(pathlib.Path(f"{home}/out").read_text().splitlines()) < 2:
                assert proc.poll() is None and time.time() < deadline, \
                    pathlib.Path(f"{home}/err").read_text()
                time.sleep(0.05)
            lines = pathlib.Path(f"{home}/out").read_text().splitlines()
            address, url = lines[0], lines[1].split()[1]
            token = pathlib.Path(f"{home}/state/admin.token").read_text().strip()
            client = trainyard.Client(address, token)
            stub = job_pb2_grpc.JobServiceStub(client._endpoints.channel)

            def submit(i):
                # Each is cancelled at once (most jobs in a store have ended); the newest 50 are
                # left queued.
                job = client.submit(name=f"bench-{i:05d}", command=["/bin/true"])
                if i < args.jobs - 50:
                    stub.CancelJob(job_pb2.CancelJobRequest(job_id=job.id, reason="bench"),
                                   metadata=client._metadata)

            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(submit, range(args.jobs)))
            print(f"submitted {args.jobs} jobs in {time.perf_counter() - start:.1f} s")
            time.sleep(3)  # past the retention: the cancelled jobs are in the store only
            # (As a browser asks: the console must not spend its time compressing.)
            bearer = {"Authorization": f"Bearer {token}", "Accept-Encoding": "gzip, deflate, br"}
            page = json.loads(get(url, "/api/v1/jobs?page_size=50", bearer))
            assert len(page["jobs"]) == 50 and page["nextPageToken"], page.keys()
            grpc_list = lambda: stub.ListJobs(job_pb2.ListJobsRequest(page_size=50),  # noqa: E731
                                              metadata=client._metadata)
            # A browser's session, as the page has it.
            u = urllib.parse.urlsplit(url)
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
            c.request("POST", "/api/v1/session", body=json.dumps({"token": token}),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            cookie = {"Cookie": r.getheader("Set-Cookie").split(";")[0],
                      "Accept-Encoding": "gzip, deflate, br"}
            rows = [
                ("gRPC ListJobs, 50 (the anchor: yard ls)", timed(grpc_list, args.repeat)),
                ("GET /api/v1/jobs?page_size=50 (bearer)",
                 timed(lambda: get(url, "/api/v1/jobs?page_size=50", bearer), args.repeat)),
                ("GET /api/v1/jobs?state=CANCELLED&page_size=50 (store)",
                 timed(lambda: get(url, "/api/v1/jobs?state=CANCELLED&page_size=50", bearer),
                       args.repeat)),
                ("first event of /api/v1/jobs/events (session)",
                 timed(lambda: first_event(url, "/api/v1/jobs/events?page_size=50", cookie),
                       args.repeat)),
                ("GET /api/v1/jobs?name=bench-00000 (scans 10,000)",
                 timed(lambda: get(url, "/api/v1/jobs?page_size=50&name=bench-00000", bearer),
                       max(5, args.repeat // 3))),
                ("GET /assets/dygraph.min.js (131 KB)", timed(lambda: get(url, "/assets/dygraph.min.js", bearer), args.repeat)),
            ]
            if args.browser:
                time.sleep(3)  # the streams above given back (their connections closed)
                rows += browser_load(url, token, args.repeat)
            print(f"{'':52} {'median ms':>10} {'p90 ms':>8}")
            for name, (median, p90) in rows:
                print(f"{name:52} {median:10.1f} {p90:8.1f}")
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
