"""What the SDK's tests share: a real local cluster (`yard local up`: a coordinator and a worker
with two CPU slots, on loopback) per test module, a client of it, and programs written to their
own folder. Needs TRAINYARD_BIN (the build's bin folder) or build/bin."""
import os
import pathlib
import re
import subprocess
import textwrap

import pytest

import trainyard

BIN = pathlib.Path(os.environ.get("TRAINYARD_BIN", pathlib.Path(__file__).parents[2] / "build" / "bin"))


def local_cluster(tmp_path_factory, *flags):
    home = tmp_path_factory.mktemp("home")
    state = home / "local"
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"))
    env.pop("TRAINYARD_TOKEN", None)
    env.pop("TRAINYARD_TOKEN_FILE", None)
    up = subprocess.run([str(BIN / "yard"), "local", "--state-dir", str(state), "up", "--listen",
                         "127.0.0.1:0", "--workers", "1", "--slots", "2", *flags],
                        env=env, capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    address = re.search(r"export TRAINYARD_COORDINATOR=(\S+)", up.stdout).group(1)
    token = (home / ".config" / "trainyard" / "token").read_text().strip()
    try:
        yield {"address": address, "token": token, "home": home, "env": env}
    finally:
        subprocess.run([str(BIN / "yard"), "local", "--state-dir", str(state), "down"], env=env,
                       capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from local_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def preemptive_cluster(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "--preemption", "--min-run-time", "1ms",
                             "--preemption-grace", "60s")


@pytest.fixture(scope="module")
def quick_preemption_cluster(tmp_path_factory):
    """Preemption whose grace (1 s) ends before a program that is mid-step reports again: the
    worker's SIGTERM is what stops it."""
    yield from local_cluster(tmp_path_factory, "--preemption", "--min-run-time", "1ms",
                             "--preemption-grace", "1s")


@pytest.fixture()
def client(cluster):
    with trainyard.Client(cluster["address"], cluster["token"]) as c:
        yield c


def client_token(client):
    return client._metadata[0][1][len("Bearer "):]


def program(tmp_path, body):
    """A training program in its own folder, run by the SDK's own Python."""
    folder = tmp_path / "project"
    folder.mkdir(exist_ok=True)
    os.chmod(tmp_path, 0o755)
    os.chmod(folder, 0o777)
    (folder / "train.py").write_text(textwrap.dedent(body))
    return folder


SDK = str(pathlib.Path(trainyard.__file__).parents[1])
