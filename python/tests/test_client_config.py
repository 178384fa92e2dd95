"""The client's own rules, as yard has them (pure logic, no cluster): token files others can read
are refused, TRAINYARD_INSECURE reads as a yes/no, `7` is job-7, memory takes units, a program's
job is named after its script, and submit's keyword fields reach the spec."""
import os

import pytest

import trainyard
from trainyard import _client


def test_a_token_file_others_can_read_is_refused_as_yard_refuses_it(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("tyu.abc\n")
    os.chmod(token, 0o644)
    monkeypatch.setenv("TRAINYARD_TOKEN_FILE", str(token))
    with pytest.raises(PermissionError, match=r"mode 0644 lets others read or change it; chmod 600"):
        trainyard.Client("127.0.0.1:1")
    os.chmod(token, 0o600)
    assert _client._default_token() == "tyu.abc"
    # The saved login too.
    monkeypatch.delenv("TRAINYARD_TOKEN_FILE")
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "trainyard").mkdir()
    saved = tmp_path / "trainyard" / "token"
    saved.write_text("tyu.saved")
    os.chmod(saved, 0o640)
    with pytest.raises(PermissionError, match="chmod 600"):
        _client._default_token()


def test_trainyard_insecure_is_a_yes_or_no(monkeypatch):
    monkeypatch.setenv("TRAINYARD_TOKEN", "tyu.x")
    monkeypatch.delenv("TRAINYARD_TLS_CA", raising=False)
    # "false" was read as yes (anything but "" and "0"): the token sent in clear.
    for no in ("false", "0", "no", "off", "", "n"):
        monkeypatch.setenv("TRAINYARD_INSECURE", no)
        with pytest.raises(ValueError, match="refusing to send your API token in clear"):
            trainyard.Client("10.1.2.3:7070")
    for yes in ("1", "true", "YES", "on", "y", "2"):
        monkeypatch.setenv("TRAINYARD_INSECURE", yes)
        trainyard.Client("10.1.2.3:7070").close()
    monkeypatch.setenv("TRAINYARD_INSECURE", "maybe")
    with pytest.raises(ValueError, match="TRAINYARD_INSECURE: expected"):
        trainyard.Client("10.1.2.3:7070")


def test_job_ids_memory_and_names_read_as_yard_reads_them():
    assert _client.normalize_job_id(7) == "job-7"
    assert _client.normalize_job_id("7") == "job-7"
    assert _client.normalize_job_id("job-7") == "job-7"
    assert _client.parse_bytes("16GiB") == 16 * 2**30
    assert _client.parse_bytes("1.5GB") == 1_500_000_000
    assert _client.parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="memory: expected bytes"):
        _client.parse_bytes("lots")
    assert _client._name_of(["python3", "train.py", "--lr", "3e-4"]) == "train"
    assert _client._name_of(["./run.sh"]) == "run"
    assert _client._name_of(["/usr/bin/7z", "x"]) == "job-7z"


class _Stub:
    def __init__(self):
        self.requests = []

    def SubmitJob(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        return type("Response", (), {"job": request.spec})()

    def GetJob(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        return request


def test_submit_takes_yards_fields_and_ids_are_normalised(monkeypatch):
    monkeypatch.setenv("TRAINYARD_TOKEN", "tyu.x")
    with trainyard.Client("127.0.0.1:1") as c:
        stub = _Stub()
        c._jobs = stub
        spec = c.submit(command=["python3", "train.py"], cpus=1.5, memory="16GiB",
                        description="a sweep", after=[3, "job-4"])
        assert spec.name == "train"
        assert spec.description == "a sweep"
        assert spec.resources.cpus == 1.5
        assert spec.resources.memory_bytes == 16 * 2**30
        assert list(spec.after) == ["job-3", "job-4"]
        assert c.submit(name="mine", command=["true"]).name == "mine"
        assert c.submit(slots=1).name == ""  # (no command: the coordinator says name is required)
        assert c.describe(7).job_id == "job-7"
