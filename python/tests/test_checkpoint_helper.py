"""trainyard.save_checkpoint and the rank's stop on SIGTERM, outside a cluster: a checkpoint is
there whole or not at all, keep_last removes the oldest, and SIGTERM turns into should_stop()."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import trainyard


def context(tmp_path, keep_last=""):
    return trainyard.Context({"TRAINYARD_CHECKPOINT_DIR": str(tmp_path),
                              "TRAINYARD_CHECKPOINT_KEEP_LAST": keep_last})


def test_a_write_that_fails_leaves_neither_a_checkpoint_nor_its_temporary(tmp_path):
    ctx = context(tmp_path)
    path = tmp_path / "step-1.pt"

    def torn(tmp):
        with open(tmp, "w") as f:
            f.write("half of it")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        trainyard.save_checkpoint(path, torn, step=1, context=ctx)
    assert os.listdir(tmp_path) == []


def test_while_written_it_is_not_where_readers_look_and_then_replaces_the_old_one(tmp_path):
    ctx = context(tmp_path)
    path = tmp_path / "step-1.pt"
    path.write_text("old")
    seen = []

    def write(tmp):
        seen.append(sorted(p.name for p in tmp_path.glob("step-*")))
        with open(tmp, "w") as f:
            f.write("new")

    assert trainyard.save_checkpoint(path, write, context=ctx) == str(path)
    assert seen == [["step-1.pt"]]  # the temporary is hidden from a "step-*" glob
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["step-1.pt"]


def test_a_folder_checkpoint_replaces_a_folder(tmp_path):
    ctx = context(tmp_path)
    for text in ("one", "two"):
        def write(tmp, text=text):
            os.makedirs(tmp)
            (tmp_path / os.path.basename(tmp) / "weights").write_text(text)

        trainyard.save_checkpoint(tmp_path / "step-5", write, context=ctx)
    assert (tmp_path / "step-5" / "weights").read_text() == "two"
    assert os.listdir(tmp_path) == ["step-5"]


def test_keep_last_removes_the_oldest_checkpoints_this_program_saved(tmp_path):
    ctx = context(tmp_path, keep_last="2")
    for step in range(1, 5):
        trainyard.save_checkpoint(tmp_path / f"step-{step}", lambda tmp: open(tmp, "w").close(),
                                  step=step, context=ctx)
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]
    assert ctx._kept_checkpoints(4, str(tmp_path / "step-4")) == [
        (3, str(tmp_path / "step-3")), (4, str(tmp_path / "step-4"))]


SIGTERMED = """
    import os, signal, sys
    sys.path.insert(0, {sdk!r})
    import trainyard
    handled = []
    signal.signal(signal.SIGTERM, lambda n, f: handled.append(n))  # the program's own, first
    ctx = trainyard.init()
    assert ctx.in_job and not ctx.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    print(ctx.should_stop(), handled == [signal.SIGTERM])
"""


def run_as_rank(tmp_path, body):
    """Runs `body` (its {sdk} filled) as a rank of a job would be: in a process of its own, with
    a job's id and credential (a coordinator it never reaches)."""
    sdk = os.path.dirname(os.path.dirname(trainyard.__file__))
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body.format(sdk=sdk)))
    env = dict(os.environ, TRAINYARD_JOB_ID="job-1", TRAINYARD_JOB_CREDENTIAL="tyj.x",
               TRAINYARD_COORDINATOR="127.0.0.1:1")
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=60)


def test_sigterm_makes_should_stop_true_and_the_programs_own_handler_still_runs(tmp_path):
    out = run_as_rank(tmp_path, SIGTERMED)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], (out.stdout,
                                                                          out.stderr)


NEVER_ASKS = """
    import os, signal, sys, time
    sys.path.insert(0, {sdk!r})
    import trainyard
    ctx = trainyard.init()
    # never asks ctx.should_stop(): SIGTERM ends it, as without the SDK
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("still alive")
"""


def test_a_program_that_never_asks_should_stop_still_ends_on_sigterm(tmp_path):
    out = run_as_rank(tmp_path, NEVER_ASKS)
    assert out.returncode == -signal.SIGTERM and "still alive" not in out.stdout, out


def test_a_failed_write_over_a_folder_keeps_the_folder_that_was_there(tmp_path):
    ctx = context(tmp_path)
    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "weights").write_text("good")

    def torn(tmp):
        os.makedirs(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError):
        trainyard.save_checkpoint(tmp_path / "step-5", torn, context=ctx)
    assert (tmp_path / "step-5" / "weights").read_text() == "good"
    assert os.listdir(tmp_path) == ["step-5"]
