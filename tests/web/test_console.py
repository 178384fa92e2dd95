"""The web console in a real browser (Playwright driving Debian's chromium, headless) against a
real local cluster (`yard local up --web`): sign-in, a job appearing live, its charts and logs
following, the owner cancelling it, another user seeing none of it, an admin cordoning a node, job
text shown as text, cross-site requests refused, sign-out and revoked tokens. Screenshots of each
page go to TRAINYARD_WEB_ARTIFACTS (default build/test-artifacts/web).

Needs TRAINYARD_BIN (the build's bin folder) and chromium; run by ctest (WebConsoleTest) with
build/web-venv's Python (scripts/setup.sh)."""
import http.server
import json
import os
import pathlib
import pwd
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest
from playwright.sync_api import expect, sync_playwright

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("TRAINYARD_BIN", ROOT / "build" / "bin"))
ARTIFACTS = pathlib.Path(os.environ.get("TRAINYARD_WEB_ARTIFACTS",
                                        ROOT / "build" / "test-artifacts" / "web"))
XSS = "<img src=x onerror=alert(1)>"
TIMEOUT_MS = 90_000
# Assertions wait as long as actions do: under load (other tests on the 2 cores) a job takes a
# while to start and report.
expect.set_options(timeout=TIMEOUT_MS)


def run(args, env, check=True, cwd=None, timeout=120):
    r = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{args}: {r.stderr}"
    return r


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    state = home / "local"
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"))
    for k in ("TRAINYARD_TOKEN", "TRAINYARD_TOKEN_FILE", "TRAINYARD_COORDINATOR"):
        env.pop(k, None)
    me = pwd.getpwuid(os.geteuid()).pw_name
    up = run([str(BIN / "yard"), "local", "--state-dir", str(state), "up", "--listen",
              "127.0.0.1:0", "--workers", "1", "--slots", "2", "--web", "127.0.0.1:0",
              "--run-as", f"alice={me}", "--run-as", f"bob={me}"], env)
    try:
        address = re.search(r"export TRAINYARD_COORDINATOR=(\S+)", up.stdout).group(1)
        url = re.search(r"web console: (http://\S+)", up.stdout).group(1)
        env["TRAINYARD_COORDINATOR"] = address
        tokens = {"admin": (home / ".config" / "trainyard" / "token").read_text().strip()}
        for user in ("alice", "bob"):
            run([str(BIN / "yard"), "admin", "user", "add", user], env)
            out = home / f"{user}.token"
            run([str(BIN / "yard"), "admin", "token", "create", "--user", user, "--out", str(out)],
                env)
            tokens[user] = out.read_text().strip()
        yield {"url": url, "env": env, "tokens": tokens, "home": home, "state": state}
    finally:
        subprocess.run([str(BIN / "yard"), "local", "--state-dir", str(state), "down"], env=env,
                       capture_output=True, timeout=120)


def yard(cluster, user, *args, check=True, cwd=None):
    env = dict(cluster["env"], TRAINYARD_TOKEN=cluster["tokens"][user])
    return run([str(BIN / "yard"), *args], env, check=check, cwd=cwd)


def call(cluster, method, path, token=None, body=None, headers=None):
    """(status, JSON body, headers) of one API call, as curl would make it."""
    req = urllib.request.Request(cluster["url"] + path, method=method,
                                 data=None if body is None else json.dumps(body).encode())
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}"), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed (scripts/setup.sh installs Debian's)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


def signed_in(browser, cluster, key, user=None):
    """A page of a new browser context, signed in with token `key` (of `user`, by default the
    same name) through the sign-in page."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    # Any alert, confirm or prompt that is not ours fails the test (job text run as markup).
    page.dialogs = []

    def on_dialog(d):
        page.dialogs.append(d.message)
        if d.type == "confirm":
            d.accept()
        else:
            d.dismiss()
    page.on("dialog", on_dialog)
    page.goto(cluster["url"] + "/")
    page.wait_for_url(re.compile(r"#/signin$"))
    page.fill("#token", cluster["tokens"][key])
    page.click("#signin")
    expect(page.locator("#me")).to_contain_text(user or key)
    return page


def session_cookie(page):
    return next(c["value"] for c in page.context.cookies() if c["name"] == "ty_session")


def shot(page, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def alice_page(browser, cluster):
    page = signed_in(browser, cluster, "alice")
    yield page
    page.context.close()


@pytest.fixture(scope="module")
def alice_job(cluster, alice_page, tmp_path_factory):
    """Alice's job, submitted while her jobs page is open: it reports a step every 0.3 s and
    prints a line with markup in it, until cancelled."""
    page = alice_page
    expect(page.locator("#jobs-body")).to_be_visible()
    folder = tmp_path_factory.mktemp("project")
    (folder / "train.py").write_text(textwrap.dedent("""\
        import time
        import trainyard
        ctx = trainyard.init()
        for step in range(1, 1_000_000):
            print(f"step {step} <script>alert(1)</script>", flush=True)
            ctx.report(step, loss=10.0 / step, lr=0.001, accuracy=step / (step + 1.0))
            time.sleep(0.3)
        """))
    os.chmod(folder, 0o755)
    # A name is letters, digits, '-', '_' and '.' (refused otherwise); markup goes in the
    # description, which is free text.
    refused = yard(cluster, "alice", "submit", "--name", XSS, "--", "/bin/true", check=False)
    assert refused.returncode != 0 and "name: only letters" in refused.stderr, refused.stderr
    sub = yard(cluster, "alice", "submit", "--name", "markup", "--description", XSS, "--context",
               str(folder),
               "--env", f"PYTHONPATH={ROOT / 'python'}", "--env", "PYTHONDONTWRITEBYTECODE=1",
               "--", sys.executable, "train.py", cwd=folder)
    job = sub.stdout.strip()
    assert re.fullmatch(r"[A-Za-z0-9._:-]+", job), sub.stdout
    yield job
    yard(cluster, "admin", "cancel", job, check=False)


def test_the_api_answers_a_bearer_token_as_curl_would_and_nothing_else(cluster):
    status, body, headers = call(cluster, "GET", "/api/v1/whoami", cluster["tokens"]["alice"])
    assert status == 200, body
    assert body["user"] == "alice"
    csp = headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp, csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    status, body, _ = call(cluster, "GET", "/api/v1/jobs")
    assert status == 401 and body["error"]["code"] == "UNAUTHENTICATED", body
    status, body, _ = call(cluster, "GET", "/api/v1/jobs", "tyt.nope.nope")
    assert status == 401, body
    status, body, _ = call(cluster, "GET", "/api/v1/jobs?state=SLEEPING", cluster["tokens"]["alice"])
    assert status == 400 and "state" in body["error"]["message"], body
    status, body, _ = call(cluster, "GET", "/api/v1/nope", cluster["tokens"]["alice"])
    assert status == 404, body
    # A node's credential is not a user's: it does not sign in.
    status, body, _ = call(cluster, "POST", "/api/v1/session", body={"token": "x" * 2000})
    assert status == 400 and "token" in body["error"]["message"], body


def test_a_browsers_wrong_tokens_throttle_that_browser_only(cluster):
    """The console calls the coordinator in-process for every browser; it names the browser (with
    a key only it holds), so failed sign-ins count per browser address, as gRPC clients' do per
    peer, and not under the console's one peer for everyone."""
    import http.client
    host, port = cluster["url"][len("http://"):].rsplit(":", 1)

    def sign_in(source, token):
        c = http.client.HTTPConnection(host, int(port), timeout=30, source_address=(source, 0))
        try:
            c.request("POST", "/api/v1/session", body=json.dumps({"token": token}),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"{}")
        finally:
            c.close()

    # A guessing browser (127.0.0.2) is told to back off after its burst (30 a peer; one is
    # forgiven a second, so a slow machine needs more tries: the loop ends at the 429).
    for i in range(600):
        status, body = sign_in("127.0.0.2", f"tyt.guess{i}.wrong")
        if status != 401:
            break
    assert status == 429, body
    assert "too many failed authentications" in body["error"]["message"], body
    # Another browser's wrong token is only wrong, and its right one signs in.
    status, body = sign_in("127.0.0.3", "tyt.other.wrong")
    assert status == 401 and "too many" not in body["error"]["message"], body
    status, body = sign_in("127.0.0.3", cluster["tokens"]["bob"])
    assert status == 200, body
    # A valid token is taken even from the guessing browser's address.
    status, body = sign_in("127.0.0.2", cluster["tokens"]["bob"])
    assert status == 200, body


def test_a_job_appears_live_and_its_chart_and_logs_follow(cluster, alice_page, alice_job):
    page = alice_page
    row = page.locator(f'tr[data-job="{alice_job}"]')
    expect(row).to_be_visible()  # no reload: the list's stream brought it
    # The name is text, never markup.
    expect(row.locator(".job-name")).to_have_text("markup")
    expect(row.locator(".job-desc")).to_have_text(XSS)
    assert page.locator("#jobs img").count() == 0
    shot(page, "jobs")
    row.locator("a").click()
    page.wait_for_url(re.compile(r"#/jobs/"))
    expect(page.locator('#job-facts [data-fact="Description"]')).to_have_text(XSS)
    loss = page.locator('[data-chart="loss"]')
    expect(loss).to_have_attribute("data-points", re.compile(r"^([3-9]|\d\d+)$"))
    first = int(loss.get_attribute("data-points"))
    page.wait_for_function(
        "n => Number(document.querySelector('[data-chart=\"loss\"]').dataset.points) > n",
        arg=first, timeout=TIMEOUT_MS)
    expect(page.locator('[data-chart="metric:accuracy"]')).to_be_visible()
    expect(page.locator('[data-chart="lr"]')).to_be_visible()
    # The logs follow: a later step's line arrives while the page is open.
    logs = page.locator("#job-logs")
    expect(logs).to_contain_text("step 2 <script>alert(1)</script>")
    seen = int(re.findall(r"step (\d+)", logs.inner_text())[-1])
    expect(logs).to_contain_text(f"step {seen + 2} ")
    assert page.locator("#job-logs script").count() == 0
    assert page.locator("#job-facts img").count() == 0
    # Search keeps the matching lines only.
    page.fill("#log-search", "step 1 ")
    expect(page.locator("#job-logs .line:not(.hidden)")).to_have_count(1)
    page.fill("#log-search", "")
    expect(page.locator("#cancel")).to_be_visible()
    shot(page, "job")
    assert page.dialogs == []


def read_events(response, until, seconds):
    """A live stream's events, [(name, data)], until one named `until` (included), its end or
    `seconds` (an idle stream sends a comment each second, so no read waits longer)."""
    deadline = time.monotonic() + seconds
    events, name = [], None
    while time.monotonic() < deadline:
        line = response.readline()
        if not line:
            break
        line = line.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: ") and name is not None:
            events.append((name, json.loads(line[len("data: "):])))
            if name == until:
                break
            name = None
    return events


def test_a_jobs_logs_and_metrics_answer_whole_and_a_body_too_large_is_413(cluster, alice_job):
    status, body, _ = call(cluster, "GET", f"/api/v1/jobs/{alice_job}/logs?tail=3",
                           cluster["tokens"]["alice"])
    assert status == 200, body
    assert len(body["lines"]) == 3 and all("step " in l["text"] for l in body["lines"]), body
    assert "error" not in body
    status, body, _ = call(cluster, "GET", f"/api/v1/jobs/{alice_job}/metrics",
                           cluster["tokens"]["alice"])
    assert status == 200, body
    steps = [int(s["step"]) for s in body["steps"]]
    assert steps and steps == sorted(steps) and "omitted" not in body, body
    status, body, _ = call(cluster, "POST", "/api/v1/session", body={"token": "x" * (70 << 10)})
    assert status == 413 and "body: larger than" in body["error"]["message"], (status, body)


def test_a_live_job_stream_ends_once_its_token_is_revoked_or_its_session_ends(browser, cluster,
                                                                               alice_job):
    # A program's stream, by token: revoked, it ends within the console's recheck (10 s); it went
    # on for as long as the job ran.
    out = cluster["home"] / "watch.token"
    yard(cluster, "admin", "admin", "token", "create", "--user", "alice", "--out", str(out))
    token = out.read_text().strip()
    path = f"{cluster['url']}/api/v1/jobs/{alice_job}/events"
    req = urllib.request.Request(path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert read_events(r, "job", 60)[-1][0] == "job"
        yard(cluster, "admin", "admin", "token", "revoke", token.split(".")[1])
        revoked = time.monotonic()
        events = read_events(r, "refused", 60)
        assert events and events[-1][0] == "refused", events[-3:]
        assert events[-1][1]["code"] == "UNAUTHENTICATED", events[-1]
        assert time.monotonic() - revoked < 30
        assert r.read().strip() == b"", "the stream ends with its refusal"
    # A browser's stream, by its session's cookie: signed out, it ends at once.
    page = signed_in(browser, cluster, "alice")
    try:
        req = urllib.request.Request(path, headers={"Cookie": f"ty_session={session_cookie(page)}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert read_events(r, "job", 60)[-1][0] == "job"
            page.click("#signout")
            page.wait_for_url(re.compile(r"#/signin$"))
            events = read_events(r, "refused", 20)
            assert events and events[-1][0] == "refused", events[-3:]
            assert "session ended" in events[-1][1]["message"], events[-1]
    finally:
        page.context.close()


def test_another_user_sees_neither_the_job_nor_its_buttons(browser, cluster, alice_job):
    page = signed_in(browser, cluster, "bob")
    try:
        expect(page.locator("#jobs-body")).to_contain_text("No jobs.")
        assert page.locator(f'tr[data-job="{alice_job}"]').count() == 0
        page.goto(f"{cluster['url']}/#/jobs/{alice_job}")
        expect(page.locator("#flash")).to_contain_text(alice_job)
        assert page.locator("#cancel").count() == 0
        assert page.locator("#job-facts dd").count() == 0
        # Nor does the API answer bob, by cookie or by token.
        for verb, path in (("GET", f"/api/v1/jobs/{alice_job}"),
                           ("GET", f"/api/v1/jobs/{alice_job}/logs"),
                           ("GET", f"/api/v1/jobs/{alice_job}/events"),
                           ("POST", f"/api/v1/jobs/{alice_job}/cancel")):
            status, body, _ = call(cluster, verb, path, cluster["tokens"]["bob"],
                                   body={} if verb == "POST" else None)
            assert status in (403, 404), (path, status, body)
        status, body, _ = call(cluster, "GET", "/api/v1/jobs?owner=alice", cluster["tokens"]["bob"])
        assert status == 403, body
        assert page.dialogs == []
    finally:
        page.context.close()


def test_a_cross_site_post_is_refused(cluster, alice_page, alice_job, tmp_path):
    # Another origin on the same host (same site, so the SameSite=Strict cookie still goes along):
    # a page there posts a form to the console's cancel.
    target = f"{cluster['url']}/api/v1/jobs/{alice_job}/cancel"
    (tmp_path / "evil.html").write_text(
        f'<form method="post" action="{target}" enctype="text/plain">'
        '<input name="x" value="y"></form>')
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(tmp_path), **k)
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        page = alice_page.context.new_page()
        page.goto(f"http://127.0.0.1:{evil.server_address[1]}/evil.html")
        with page.expect_response(target) as answer:
            page.evaluate("document.forms[0].submit()")
        assert answer.value.status == 403, answer.value.text()
        page.close()
    finally:
        evil.shutdown()
    # The cookie alone, without the page's CSRF token, acts on nothing either.
    cookie = next(c for c in alice_page.context.cookies() if c["name"] == "ty_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    status, body, _ = call(cluster, "POST", f"/api/v1/jobs/{alice_job}/cancel", body={},
                           headers={"Cookie": f"ty_session={cookie['value']}"})
    assert status == 403 and "X-CSRF-Token" in body["error"]["message"], body
    status, body, _ = call(cluster, "GET", f"/api/v1/jobs/{alice_job}", cluster["tokens"]["alice"])
    assert body["state"] == "RUNNING", body


def test_why_a_job_waits_shows_on_its_page_and_on_the_sharing_page(browser, cluster, alice_job):
    # Alice's job holds one of the cluster's two slots: bob's job of two waits. (The job page
    # showed GetJob's reason until the stream's first event put "being placed" over it; the
    # sharing page's list never had one.)
    job = yard(cluster, "bob", "submit", "--name", "waits", "--gpus", "2", "--",
               "/bin/true").stdout.strip()
    page = signed_in(browser, cluster, "bob")
    try:
        page.goto(f"{cluster['url']}/#/jobs/{job}")
        page.wait_for_function(
            "() => Number(document.querySelector('#job-facts').dataset.shown) >= 2",
            timeout=TIMEOUT_MS)
        why = page.locator('#job-facts [data-fact="Why it waits"]')
        expect(why).not_to_have_text(re.compile(r"^(being placed|—)$"))
        page.goto(f"{cluster['url']}/#/sharing")
        row = page.locator("#waiting-body tr", has_text=job)
        expect(row).to_be_visible()
        expect(row.locator("td").nth(3)).not_to_have_text(re.compile(r"^(being placed)?$"))
        shot(page, "sharing-waiting")
    finally:
        yard(cluster, "bob", "cancel", job, check=False)
        page.context.close()


def test_the_owner_cancels_the_job_from_its_page(cluster, alice_page, alice_job):
    page = alice_page
    page.goto(f"{cluster['url']}/#/jobs/{alice_job}")
    page.click("#cancel")
    expect(page.locator('#job-title [data-state="CANCELLED"]')).to_be_visible()
    expect(page.locator("#cancel")).to_have_count(0)
    status, body, _ = call(cluster, "GET", f"/api/v1/jobs/{alice_job}", cluster["tokens"]["alice"])
    assert body["state"] == "CANCELLED" and "web console" in body.get("message", ""), body
    assert page.dialogs == [f"Cancel {alice_job}?"]


def test_a_failed_jobs_page_says_why_and_shows_its_attempts(cluster, alice_page):
    sub = yard(cluster, "alice", "submit", "--name", "fails", "--max-restarts", "1", "--",
               "/bin/sh", "-c", "echo about to fail; exit 3")
    job = sub.stdout.strip()
    page = alice_page
    page.goto(f"{cluster['url']}/#/jobs/{job}")
    expect(page.locator('#job-title [data-state="FAILED"]')).to_be_visible()
    expect(page.locator('#job-facts [data-fact="Message"]')).to_contain_text("3")
    # Both attempts, where their rank ran and how it exited; the logs of both.
    for attempt in (1, 2):
        expect(page.locator(f'#job-timeline [data-attempt="{attempt}"]')).to_contain_text(
            "1 rank on local-1 exited 3")
    expect(page.locator("#job-logs")).to_contain_text("[2:0] about to fail")
    expect(page.locator("#cancel")).to_have_count(0)
    shot(page, "failed-job")
    # An ended job's stream sends what there is, then "end", and the response ends.
    req = urllib.request.Request(f"{cluster['url']}/api/v1/jobs/{job}/events",
                                 headers={"Authorization": f"Bearer {cluster['tokens']['alice']}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = r.read().decode()
    assert "event: job\n" in events and "about to fail" in events, events
    assert events.rstrip().endswith("event: end\ndata: {}"), events[-200:]


def test_an_admin_cordons_a_node_from_the_page(browser, cluster, alice_page):
    # A user sees the nodes but no buttons, and the API refuses the user.
    alice_page.goto(f"{cluster['url']}/#/nodes")
    expect(alice_page.locator('tr[data-node="local-1"]')).to_be_visible()
    assert alice_page.locator("button[data-action]").count() == 0
    status, body, _ = call(cluster, "POST", "/api/v1/nodes/local-1/cordon",
                           cluster["tokens"]["alice"], body={"action": "CORDON"})
    assert status == 403, body
    page = signed_in(browser, cluster, "admin")
    try:
        page.goto(f"{cluster['url']}/#/nodes")
        node = page.locator('tr[data-node="local-1"]')
        node.locator('button[data-action="cordon"]').click()
        expect(node.locator(".cordon")).to_contain_text("cordoned by admin")
        shot(page, "nodes")
        status, body, _ = call(cluster, "GET", "/api/v1/nodes", cluster["tokens"]["admin"])
        assert next(n for n in body["nodes"] if n["id"] == "local-1").get("cordoned"), body
        node.locator('button[data-action="uncordon"]').click()
        expect(node.locator(".cordon")).to_have_text("—")
        page.goto(f"{cluster['url']}/#/sharing")
        expect(page.locator('tr[data-account="default"]')).to_be_visible()
        shot(page, "sharing")
        assert page.dialogs == []
    finally:
        page.context.close()


def test_sign_out_and_a_revoked_token_end_the_session(browser, cluster):
    page = signed_in(browser, cluster, "alice")
    try:
        cookie = session_cookie(page)
        page.click("#signout")
        page.wait_for_url(re.compile(r"#/signin$"))
        status, _, _ = call(cluster, "GET", "/api/v1/jobs",
                            headers={"Cookie": f"ty_session={cookie}"})
        assert status == 401
    finally:
        page.context.close()
    # A token of its own, signed in, then revoked: the next call finds the session gone.
    out = cluster["home"] / "short.token"
    yard(cluster, "admin", "admin", "token", "create", "--user", "alice", "--out", str(out))
    cluster["tokens"]["short"] = out.read_text().strip()
    page = signed_in(browser, cluster, "short", "alice")
    try:
        token_id = cluster["tokens"]["short"].split(".")[1]
        yard(cluster, "admin", "admin", "token", "revoke", token_id)
        page.goto(f"{cluster['url']}/#/sharing")
        page.wait_for_url(re.compile(r"#/signin$"))
        status, _, _ = call(cluster, "GET", "/api/v1/session", headers={
            "Cookie": f"ty_session={session_cookie(page)}"})
        assert status == 401
    finally:
        page.context.close()


def test_yard_web_prints_a_link_that_signs_a_browser_in_once(browser, cluster):
    # Without --url: the local cluster's console, found in the state directory it was started
    # with (yard web looked in the default one only).
    found = yard(cluster, "alice", "web", "--state-dir", str(cluster["state"])).stdout
    assert re.search(r"(http://\S+)/#/signin\?code=", found).group(1) == cluster["url"], found
    out = yard(cluster, "alice", "web", "--url", cluster["url"]).stdout
    link = re.search(r"(http://\S+/#/signin\?code=\S+)", out).group(1)
    assert cluster["tokens"]["alice"] not in out
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(link)
        # Never by opening it: the page asks first (a link someone else made signs in as them).
        expect(page.locator("#use-link")).to_be_visible()
        assert page.locator("#me").count() == 0
        page.click("#use-link")
        expect(page.locator("#me")).to_contain_text("alice")
        page.wait_for_url(re.compile(r"#/jobs$"))
        # Used: a second browser gets nothing from it.
        other = browser.new_context().new_page()
        other.goto(link)
        other.click("#use-link")
        expect(other.locator("#flash")).to_contain_text("used or expired")
        assert other.locator("#me").count() == 0
        other.context.close()
    finally:
        context.close()
    # Without a token of a user, no link.
    status, body, _ = call(cluster, "POST", "/api/v1/session/link", body={})
    assert status == 401, body


def test_one_address_past_its_connections_gets_503_and_a_trickled_request_is_cut(cluster):
    """A client that opens many connections and trickles its headers a byte at a time (slowloris)
    held one of the console's 48 threads with each for as long as it liked, before any sign-in:
    now one address holds 24 at most (8 while 36 threads are taken; one more is answered
    503 at once, while other addresses are served), and each request must arrive whole within
    10 s of its first byte."""
    import select
    import socket
    host, port = cluster["url"][len("http://"):].rsplit(":", 1)
    held, opened = [], []
    try:
        for _ in range(30):
            s = socket.create_connection((host, int(port)), timeout=30,
                                         source_address=("127.0.0.5", 0))
            s.sendall(b"GET /api/v1/whoami HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            held.append(s)
            opened.append(time.monotonic())
        # Meanwhile another address is answered.
        status, body, _ = call(cluster, "GET", "/api/v1/whoami", token=cluster["tokens"]["bob"])
        assert status == 200, body
        # Each is sent a byte every half second until the console closes it: those past the
        # address's limit at once, with a 503; the others when their time is up (counted from
        # when each was open: the console took it up after that).
        closed = {}
        while len(closed) < len(held) and time.monotonic() - opened[0] < 40:
            for i, s in enumerate(held):
                if i in closed:
                    continue
                if select.select([s], [], [], 0)[0]:
                    try:
                        answer = s.recv(4096)
                    except OSError:
                        answer = b""
                    closed[i] = (time.monotonic() - opened[i], answer)
                    continue
                try:
                    s.sendall(b"a")
                except OSError:
                    closed[i] = (time.monotonic() - opened[i], b"")
            time.sleep(0.5)
        assert len(closed) == len(held), f"{len(held) - len(closed)} still open after 40 s"
        refused = [a for _, a in closed.values() if a.startswith(b"HTTP/1.1 503")]
        cut = [t for t, a in closed.values() if not a.startswith(b"HTTP/1.1 503")]
        assert refused and all(b"too many connections from this address" in a for a in refused)
        # (24 while the console is not busy: more than the 8 it allows then, which tells the two
        # limits apart; fewer than 24 only if 12 others were open besides, as browser tests' are.)
        assert 8 < len(cut) <= 24, f"{len(cut)} connections held by one address"
        assert min(cut) >= 9, f"a trickled request was cut after {min(cut):.1f} s, before its time"
    finally:
        for s in held:
            s.close()


def test_a_users_live_streams_are_counted_together_whatever_their_tokens(cluster, tmp_path):
    # bob's two tokens: 8 live streams between them (each token had 8 of its own, so a user with
    # four tokens took the console's 32); alice still opens hers. (Last of the tests on this
    # cluster: the streams closed here end on the server when it next writes to them.)
    second = tmp_path / "bob2.token"
    run([str(BIN / "yard"), "admin", "token", "create", "--user", "bob", "--out", str(second)],
        cluster["env"])
    tokens = [cluster["tokens"]["bob"], second.read_text().strip()]
    opened = []

    def open_stream(token):
        req = urllib.request.Request(f"{cluster['url']}/api/v1/jobs/events",
                                     headers={"Authorization": f"Bearer {token}"})
        return urllib.request.urlopen(req, timeout=30)

    try:
        for i in range(8):
            opened.append(open_stream(tokens[i % 2]))
        with pytest.raises(urllib.error.HTTPError) as refused:
            opened.append(open_stream(tokens[1]))
        assert refused.value.code == 503
        assert "8 of them yours" in refused.value.read().decode()
        opened.append(open_stream(cluster["tokens"]["alice"]))
    finally:
        for r in opened:
            r.close()


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    """A local cluster (no workers) serving gRPC and the console over TLS, with certificates from
    scripts/tls-init.sh."""
    home = tmp_path_factory.mktemp("tls-home")
    pki = home / "pki"
    run(["bash", str(ROOT / "scripts" / "tls-init.sh"), "--out", str(pki)], dict(os.environ))
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               TRAINYARD_TLS_CA=str(pki / "ca.pem"))
    for k in ("TRAINYARD_TOKEN", "TRAINYARD_TOKEN_FILE", "TRAINYARD_COORDINATOR"):
        env.pop(k, None)
    state = home / "local"
    up = run([str(BIN / "yard"), "local", "--state-dir", str(state), "up", "--listen",
              "127.0.0.1:0", "--workers", "0", "--web", "127.0.0.1:0",
              "--tls-cert", str(pki / "coordinator.pem"), "--tls-key", str(pki / "coordinator.key")],
             env)
    try:
        env["TRAINYARD_COORDINATOR"] = re.search(r"export TRAINYARD_COORDINATOR=(\S+)",
                                                 up.stdout).group(1)
        url = re.search(r"web console: (https://\S+)", up.stdout).group(1)
        token = (home / ".config" / "trainyard" / "token").read_text().strip()
        yield {"url": url, "env": env, "ca": pki / "ca.pem", "token": token,
               "log": state / "coordinator.log"}
    finally:
        subprocess.run([str(BIN / "yard"), "local", "--state-dir", str(state), "down"], env=env,
                       capture_output=True, timeout=120)


def tls_sign_in(tls_cluster):
    """Signs in over HTTPS verified against the cluster's CA: the session cookie."""
    import ssl
    context = ssl.create_default_context(cafile=str(tls_cluster["ca"]))
    req = urllib.request.Request(tls_cluster["url"] + "/api/v1/session", method="POST",
                                 data=json.dumps({"token": tls_cluster["token"]}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=context, timeout=30) as r:
        assert r.status == 200
        return r.headers["Set-Cookie"]


def test_with_the_coordinators_certificate_the_console_is_https_only(browser, tls_cluster):
    cookie = tls_sign_in(tls_cluster)
    assert "; Secure" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
    # Plain HTTP on that port is not answered as HTTP.
    with pytest.raises(Exception):
        urllib.request.urlopen(tls_cluster["url"].replace("https://", "http://") + "/", timeout=10)
    # yard web speaks TLS, verified with the CA, and its link signs a browser in.
    out = run([str(BIN / "yard"), "web", "--url", tls_cluster["url"]], tls_cluster["env"]).stdout
    link = re.search(r"(https://\S+/#/signin\?code=\S+)", out).group(1)
    page = browser.new_context(ignore_https_errors=True).new_page()
    try:
        page.goto(link)
        page.click("#use-link")
        expect(page.locator("#me")).to_contain_text("admin")
        # Under TLS the cookie is __Host-: Secure, for this host only.
        assert next(c for c in page.context.cookies() if c["name"] == "__Host-ty_session")["secure"]
    finally:
        page.context.close()


def test_a_renewed_certificate_serves_new_connections_without_a_restart(tls_cluster, tmp_path):
    """As the gRPC listener does (--tls-reload, 10 s): a renewal (cert-manager's, or
    tls-init.sh's from the same CA) renames a new pair into place, and the console's next
    connections get it, verified by the same CA; until then, and while the files do not make a
    matching pair (the key renamed first), the old one serves."""
    import ssl
    import time
    host, port = tls_cluster["url"][len("https://"):].rsplit(":", 1)

    def served():
        return ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate((host, int(port)), timeout=10))

    pki = pathlib.Path(tls_cluster["ca"]).parent
    before = served()
    assert before == ssl.PEM_cert_to_DER_cert((pki / "coordinator.pem").read_text())
    renewed = tmp_path / "renewed"
    renewed.mkdir(mode=0o700)
    shutil.copy(pki / "ca.pem", renewed)
    shutil.copy(pki / "ca.key", renewed)
    run(["bash", str(ROOT / "scripts" / "tls-init.sh"), "--out", str(renewed)], dict(os.environ))
    after = ssl.PEM_cert_to_DER_cert((renewed / "coordinator.pem").read_text())
    assert after != before
    # The key first: a pair that does not match is left aside (the log says so), the old one serves.
    os.replace(renewed / "coordinator.key", pki / "coordinator.key")
    deadline = time.time() + 60
    while "do not load as a matching pair" not in tls_cluster["log"].read_text(errors="replace"):
        assert time.time() < deadline, "no word of the mismatched pair in the coordinator's log"
        assert served() == before
        time.sleep(0.2)
    assert served() == before
    os.replace(renewed / "coordinator.pem", pki / "coordinator.pem")
    deadline = time.time() + 60
    seen = served()
    while seen != after and time.time() < deadline:
        assert seen == before  # the old pair until the new one loads, nothing in between
        time.sleep(0.2)
        seen = served()
    assert seen == after, "the console still serves the certificate it started with"
    # Verified against the cluster's CA, the API answers over it.
    assert "; Secure" in tls_sign_in(tls_cluster)


def test_a_console_on_another_host_without_tls_is_refused(tmp_path):
    r = subprocess.run([str(BIN / "trainyard-coordinator"), "--state-dir", str(tmp_path / "s"),
                        "--listen", "127.0.0.1:0", "--web-address", "0.0.0.0:0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--web-address: a non-loopback address" in r.stderr, r.stderr



def test_behind_a_tls_proxy_its_origin_signs_in_and_forwarded_browsers_are_throttled_apart(
        tmp_path):
    """A proxy that terminates TLS in front of the console (--web-public-url): a page of that
    origin signs in and gets a Secure __Host- cookie, yard web's link is that URL, and another
    origin is refused. From the proxy (--web-trusted-proxies), failed sign-ins count under the
    browser the last X-Forwarded-For line names; anyone else's X-Forwarded-For is not believed."""
    import http.client
    public = "https://console.example:8443"
    log = tmp_path / "coordinator.log"
    with open(log, "w") as err:
        coordinator = subprocess.Popen(
            [str(BIN / "trainyard-coordinator"), "--state-dir", str(tmp_path / "s"), "--listen",
             "127.0.0.1:0", "--web-address", "127.0.0.1:0", "--web-public-url",
             "HTTPS://Console.Example:08443/", "--web-trusted-proxies", "::ffff:127.0.0.1,::1"],
            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        import queue
        printed = queue.Queue()
        threading.Thread(target=lambda: [printed.put(l.strip()) for l in coordinator.stdout],
                         daemon=True).start()
        lines = []
        while len(lines) < 2:  # its address, then its web URL
            try:
                lines.append(printed.get(timeout=60))
            except queue.Empty:
                pytest.fail(f"the coordinator printed only {lines}: {log.read_text()}")
        assert lines[1] == "web " + public, (lines, log.read_text())
        # The console itself, where the proxy reaches it.
        port = int(re.search(r"web console at http://127\.0\.0\.1:(\d+), reached at "
                             + re.escape(public), log.read_text()).group(1))
        token = (tmp_path / "s" / "admin.token").read_text().strip()

        def sign_in(body, source="127.0.0.1", headers=()):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30,
                                           source_address=(source, 0))
            try:
                data = json.dumps(body).encode()
                c.putrequest("POST", "/api/v1/session")
                for k, v in [("Content-Type", "application/json"),
                             ("Content-Length", str(len(data))), *headers]:
                    c.putheader(k, v)
                c.endheaders(data)
                r = c.getresponse()
                return r.status, json.loads(r.read() or b"{}"), r.getheader("Set-Cookie") or ""
            finally:
                c.close()

        status, body, cookie = sign_in({"token": token}, headers=[("Origin", public)])
        assert status == 200, body
        assert cookie.startswith("__Host-ty_session=") and "; Secure" in cookie, cookie
        for origin in ("https://evil.example", "http://console.example:8443"):
            status, body, _ = sign_in({"token": token}, headers=[("Origin", origin)])
            assert status == 403 and "Origin" in body["error"]["message"], (origin, body)
        # yard web, through the console's own address, hands out a link to the public one.
        env = dict(os.environ, TRAINYARD_COORDINATOR=lines[0], TRAINYARD_TOKEN=token,
                   HOME=str(tmp_path))
        out = run([str(BIN / "yard"), "web", "--url", f"http://127.0.0.1:{port}"], env).stdout
        assert re.search(re.escape(public) + r"/#/signin\?code=\S+", out), out

        def throttle(source, forwarded):
            """Wrong tokens from `source` with X-Forwarded-For lines `forwarded` until told to
            back off."""
            for i in range(600):
                status, body, _ = sign_in({"token": f"tyt.guess{i}.wrong"}, source,
                                          [("X-Forwarded-For", f) for f in forwarded])
                if status != 401:
                    break
            assert status == 429, body

        def wrong_once(source, forwarded):
            return sign_in({"token": "tyt.other.wrong"}, source,
                           [("X-Forwarded-For", f) for f in forwarded])

        # Through the proxy: the browser the proxy names last is told to back off (also where
        # the proxy adds a line of its own after the browser's), another is not.
        throttle("127.0.0.1", ["198.51.100.9", "10.0.0.1, 203.0.113.5"])
        status, body, _ = wrong_once("127.0.0.1", ["203.0.113.5, 198.51.100.9"])
        assert status == 401 and "too many" not in body["error"]["message"], body
        status, body, _ = wrong_once("127.0.0.1", ["203.0.113.5"])
        assert status == 429, body
        # Not the proxy: its header names nobody, its own address is throttled.
        throttle("127.0.0.2", ["203.0.113.7"])
        status, body, _ = wrong_once("127.0.0.2", ["203.0.113.8"])
        assert status == 429, body
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=60)


def test_a_public_url_is_refused_with_a_path_in_clear_or_without_a_console(tmp_path):
    base = [str(BIN / "trainyard-coordinator"), "--state-dir", str(tmp_path / "s"), "--listen",
            "127.0.0.1:0"]
    for extra, expected in [
            (["--web-address", "127.0.0.1:0", "--web-public-url",
              "https://console.example/trainyard"],
             "--web-public-url: 'https://console.example/trainyard' is not a scheme"),
            (["--web-address", "127.0.0.1:0", "--web-public-url", "http://console.example"],
             "--web-public-url: an http:// URL sends tokens and session cookies in clear"),
            (["--web-public-url", "https://console.example"],
             "--web-public-url: there is no web console without --web-address")]:
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0, extra
        assert expected in r.stderr, (extra, r.stderr)
