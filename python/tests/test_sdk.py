"""The Python SDK against a real local cluster (`yard local up`: a coordinator and a worker with
two CPU slots, on loopback): a command job whose program uses the rank API reports its steps and
metrics, answers `checkpoint`, and the client submits, lists, describes, waits, reads logs and
metrics and cancels. Run by scripts/test.sh (ctest SdkTest) with the SDK's venv; needs
TRAINYARD_BIN (the build's bin folder)."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import grpc
import pytest

import trainyard
from trainyard.v1 import job_pb2

from conftest import BIN, SDK, client_token, program  # noqa: E402  (shared helpers)


RANK_PROGRAM = """
    import os, sys, time
    sys.path.insert(0, {sdk!r})
    import trainyard
    ctx = trainyard.init()
    assert ctx.in_job and ctx.world_size == 2, ctx.__dict__
    print(f"rank {{ctx.rank}} of {{ctx.world_size}} in {{ctx.job_id}} attempt {{ctx.attempt}}",
          flush=True)
    steps = int(sys.argv[1])
    for step in range(1, steps + 1):
        commands = ctx.report(step, loss=10.0 / step, total_steps=steps, accuracy=step / steps)
        # A request stays pending until rank 0 reports the checkpoint: a rank that asks after that
        # sees none, so the others also stop once rank 0's checkpoint is there (a program with
        # torch.distributed would all-reduce the flags instead, as examples/pytorch-ddp.py does).
        if ctx.checkpoint_requested() or ctx.latest_checkpoint("step-*"):
            path = os.path.join(ctx.checkpoint_dir, f"step-{{step}}")
            if ctx.rank == 0:
                open(path, "w").write("state")
                ctx.report_checkpoint(step, path, size_bytes=5)
            print(f"checkpointed at step {{step}}", flush=True)
            break
        time.sleep(float(sys.argv[2]))
    print("done", flush=True)
"""



def test_a_rank_reports_steps_and_metrics_that_yard_and_the_client_read(client, tmp_path):
    folder = program(tmp_path, RANK_PROGRAM.format(sdk=SDK))
    job = client.submit(name="sdk-report", slots=2, command=[sys.executable, "train.py", "5", "0"],
                        workdir=str(folder))
    assert job.state == job_pb2.QUEUED
    assert len(job.request_id) == 32  # the submit's idempotency id, one per call
    done = client.wait(job.id, timeout=120)
    assert done.state == job_pb2.SUCCEEDED
    assert done.step == 5
    steps = list(client.metrics(job.id))
    # Rank 0's reports only (rank 1's fetched the commands), in order, with their own metrics.
    assert [s.step for s in steps] == [1, 2, 3, 4, 5]
    assert steps[0].loss > steps[-1].loss
    assert steps[-1].metrics["accuracy"] == pytest.approx(1.0)
    # The rank's resident set, as the built-in trainer reports its own (a Python rank: megabytes).
    assert all(s.resident_bytes > 1 << 20 for s in steps)
    assert steps[-1].cpu_seconds > 0 and steps[-1].device_peak_bytes == 0  # on CPU
    # Each rank's use at its end, as sacct: its peak RSS and CPU time.
    assert sorted(u.rank for u in done.rank_usage) == [0, 1]
    assert all(u.peak_rss_bytes > 1 << 20 and u.cpu_seconds > 0 for u in done.rank_usage)
    lines = [(line.rank, line.text) for line in client.logs(job.id)]
    assert (0, f"rank 0 of 2 in {job.id} attempt 1") in lines
    assert (1, f"rank 1 of 2 in {job.id} attempt 1") in lines
    # yard shows them too.
    table = subprocess.run([str(BIN / "yard"), "--coordinator", client.address, "metrics", job.id],
                           env=dict(os.environ, TRAINYARD_TOKEN=client_token(client)),
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "METRICS" in table.stdout.splitlines()[0]
    assert "CPU_S" in table.stdout.splitlines()[0]
    assert "accuracy=1" in table.stdout.splitlines()[-1]
    assert [j.id for j in client.list(limit=1)] == [job.id]
    assert client.describe(job.id).spec.command[1] == "train.py"


def test_a_checkpoint_request_reaches_every_rank_and_is_reported(client, tmp_path):
    folder = program(tmp_path, RANK_PROGRAM.format(sdk=SDK))
    job = client.submit(name="sdk-checkpoint", gpus=2,
                        command=[sys.executable, "train.py", "100000", "0.02"],
                        workdir=str(folder))
    # Once it runs and reports, ask for a checkpoint.
    for step in client.metrics(job.id, follow=True, timeout=120):
        break
    assert client.checkpoint(job.id).state == job_pb2.CHECKPOINTING
    done = client.wait(job.id, timeout=120)
    assert done.last_checkpoint.step > 0
    assert done.last_checkpoint.path.endswith(f"step-{done.last_checkpoint.step}")
    lines = [(line.rank, line.text) for line in client.logs(job.id)]
    assert any(r == 0 and t.startswith("checkpointed at step") for r, t in lines)
    assert any(r == 1 and t.startswith("checkpointed at step") for r, t in lines)


KEEPS = """
    import os, sys
    sys.path.insert(0, {sdk!r})
    import trainyard
    ctx = trainyard.init()
    for step in range(1, 6):
        path = os.path.join(ctx.checkpoint_dir, f"step-{{step}}")
        trainyard.save_checkpoint(path, lambda tmp: open(tmp, "w").write(str(step)), step=step)
    print("left", sorted(os.listdir(ctx.checkpoint_dir)), flush=True)
"""


def test_a_command_jobs_checkpoints_are_kept_to_the_specs_keep_last(client, tmp_path):
    """checkpoint.keep_last reaches a command job (the SDK's save_checkpoint removes the oldest it
    saved) and the coordinator lists the kept ones, as the built-in trainer's."""
    folder = program(tmp_path, KEEPS.format(sdk=SDK))
    job = client.submit({"name": "keeps", "resources": {"slots": 1},
                         "command": [sys.executable, "train.py"], "workdir": str(folder),
                         "checkpoint": {"keep_last": 2}})
    done = client.wait(job.id, timeout=120)
    assert done.state == job_pb2.SUCCEEDED, done.message
    lines = [line.text for line in client.logs(job.id)]
    assert "left ['step-4', 'step-5']" in lines, lines
    assert done.last_checkpoint.step == 5
    assert [(k.step, os.path.basename(k.path)) for k in done.kept_checkpoints] == [
        (4, "step-4"), (5, "step-5")]
    assert all(os.path.dirname(k.path) == os.path.dirname(done.last_checkpoint.path)
               for k in done.kept_checkpoints)


def test_a_bad_spec_is_refused_naming_the_field_and_a_failed_job_raises(client):
    with pytest.raises(grpc.RpcError) as refused:
        client.submit(name="bad", gpus=1, command=["python3"], workdir="relative")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("workdir: must be an absolute path")
    job = client.submit(name="fails", gpus=1, command=["/bin/sh", "-c", "echo 'error: no data'; exit 4"])
    with pytest.raises(trainyard.JobFailed) as failed:
        client.wait(job.id, timeout=120)
    assert failed.value.job.state == job_pb2.FAILED
    assert "code 4" in failed.value.job.message and "error: no data" in failed.value.job.message


def test_a_job_trains_on_what_trainyard_data_prepared(client, tmp_path):
    from test_data import RECORDS, make_tokenizer

    from trainyard import data

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS * 4))
    done = data.prepare(tokenizer, tmp_path / "in.jsonl", tmp_path / "chat")
    assert done.tokens == 4 * 54
    job = client.submit({
        "name": "prepared", "resources": {"gpus": 1},
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 1, "d_model": 8, "seq_len": 8,
                  "vocab": 32},
        "data": {"path": done.tokens_path, "format": done.dtype, "loss_mask": done.mask_path},
        "train": {"steps": 3, "micro_batch": 2, "lr": 1e-3}})
    finished = client.wait(job.id, timeout=180)
    assert finished.state == job_pb2.SUCCEEDED
    assert [s.step for s in client.metrics(job.id)] == [1, 2, 3]


def test_a_folder_submitted_as_the_context_runs_after_it_is_gone(client, tmp_path):
    project = tmp_path / "code"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "__init__.py").write_text("GREETING = 'hello from the uploaded package'\n")
    (project / "train.py").write_text("import os, pkg\nprint(pkg.GREETING, sorted(os.listdir('.')))\n")
    (project / "data.bin").write_bytes(b"\0" * 1024)
    (project / ".gitignore").write_text("*.bin\n__pycache__/\n")
    job = client.submit(name="uploaded", slots=1, command=["python3", "train.py"],
                        context=project)
    assert job.spec.context.startswith("sha256:")
    shutil.rmtree(project)
    finished = client.wait(job.id, timeout=120)
    assert finished.state == job_pb2.SUCCEEDED, finished.message
    lines = [line.text for line in client.logs(job.id)]
    assert "hello from the uploaded package ['.gitignore', 'pkg', 'train.py']" in lines, lines

    big = tmp_path / "big"
    big.mkdir()
    with open(big / "weights.bin", "wb") as f:
        f.truncate(65 << 20)
    with pytest.raises(ValueError, match=r"context: .* 65.0 MiB of files, at most 64.0 MiB"):
        client.submit(name="big", slots=1, command=["python3", "x.py"], context=big)


def test_cancel_and_list_by_state(client):
    job = client.submit(name="sleeper", gpus=1, command=["/bin/sleep", "600"])
    assert client.cancel(job.id, reason="not needed").state == job_pb2.CANCELLED
    assert job.id in [j.id for j in client.list(states=["CANCELLED"])]
    assert job.id not in [j.id for j in client.list(states=["RUNNING", "QUEUED"])]


def test_outside_a_job_the_rank_api_is_a_no_op(tmp_path):
    ctx = trainyard.Context(environ={})
    assert not ctx.in_job
    assert ctx.report(1, loss=2.0, accuracy=0.5) == {"checkpoint_requested": False,
                                                      "stop_requested": False}
    assert not ctx.checkpoint_requested() and not ctx.should_stop()
    assert ctx.report_checkpoint(1, "/nowhere")["stop_requested"] is False
    ctx.checkpoint_dir = str(tmp_path)
    assert ctx.latest_checkpoint() is None
    (tmp_path / "step-1").write_text("x")
    assert ctx.latest_checkpoint().endswith("step-1")


def test_init_destroys_a_process_group_the_program_left_at_exit():
    """A program that returns with torch.distributed's default group alive can abort in Gloo's
    threads at interpreter exit (a Trainer script's rank failed so); trainyard.init() registers
    an exit handler that destroys it first, and leaves alone a group already destroyed."""
    body = textwrap.dedent(f"""
        import sys, types
        sys.path.insert(0, {SDK!r})
        torch = types.ModuleType("torch")
        dist = types.ModuleType("torch.distributed")
        state = {{"initialized": sys.argv[1] == "alive"}}
        dist.is_available = lambda: True
        dist.is_initialized = lambda: state["initialized"]
        def destroy():
            state["initialized"] = False
            print("destroyed", flush=True)
        dist.destroy_process_group = destroy
        torch.distributed = dist
        sys.modules["torch"], sys.modules["torch.distributed"] = torch, dist
        import trainyard
        trainyard.init(environ={{}})
        trainyard.init(environ={{}})  # (registered once)
        print("returning", flush=True)
    """)
    for group, expected in (("alive", "returning\ndestroyed\n"), ("gone", "returning\n")):
        done = subprocess.run([sys.executable, "-c", body, group], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and done.stdout == expected, (group, done)


def test_the_client_finds_the_token_as_yard_does(cluster, monkeypatch):
    monkeypatch.setenv("HOME", str(cluster["home"]))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cluster["home"] / ".config"))
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.delenv("TRAINYARD_TOKEN_FILE", raising=False)
    monkeypatch.setenv("TRAINYARD_COORDINATOR", cluster["address"])
    with trainyard.Client() as c:
        c.list(limit=1)
    monkeypatch.setenv("TRAINYARD_TOKEN", "tyu.not-a-token")
    with trainyard.Client() as c, pytest.raises(grpc.RpcError) as refused:
        c.list(limit=1)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


# Both resuming programs start so: the step of the newest checkpoint, if any.
RESUME_PRELUDE = """
    import os, sys, time
    sys.path.insert(0, {sdk!r})
    import trainyard
    ctx = trainyard.init()
    latest = ctx.latest_checkpoint("step-*")
    start = int(open(latest).read()) if latest else 0
    if latest:
        print(f"resumed from step {{start}}", flush=True)
"""

RESUMING_PROGRAM = RESUME_PRELUDE + """
    steps, crash_at = int(sys.argv[1]), int(sys.argv[2])
    for step in range(start + 1, steps + 1):
        ctx.report(step, loss=1.0 / step, total_steps=steps)
        if ctx.checkpoint_requested() or step % 3 == 0:
            if ctx.rank == 0:
                # Atomic: a kill mid-write leaves no torn "step-*" for the next attempt to read.
                trainyard.save_checkpoint(os.path.join(ctx.checkpoint_dir, f"step-{{step:06d}}"),
                                          lambda tmp: open(tmp, "w").write(str(step)), step=step)
            if ctx.should_stop():
                print(f"stopping at step {{step}}", flush=True)
                sys.exit(0)
        # Once, in the first attempt that gets there (not by its number: an attempt lost before
        # its ranks ran, to a node's fault, is not a restart and leaves the next one number 2);
        # at crash_at, or at its first step if it resumed past it (ranks start apart: under load
        # rank 0 may have saved step 6 before rank 1 reads the folder).
        crashed = os.path.join(ctx.checkpoint_dir, "rank-1-crashed")
        if crash_at and step >= crash_at and ctx.rank == 1 and not os.path.exists(crashed):
            deadline = time.time() + 30
            while ctx.latest_checkpoint("step-*") is None and time.time() < deadline:
                time.sleep(0.01)  # once rank 0's first checkpoint is there
            open(crashed, "w").close()
            print("error: rank 1 crashes on purpose", flush=True)
            os._exit(9)
        time.sleep(float(sys.argv[3]))
    print("finished", flush=True)
"""


def attempt_lines(client, job_id):
    return [(line.attempt, line.rank, line.text) for line in client.logs(job_id)]


def test_a_killed_rank_restarts_the_attempt_from_the_latest_checkpoint(client, tmp_path):
    folder = program(tmp_path, RESUMING_PROGRAM.format(sdk=SDK))
    job = client.submit(name="sdk-restart", gpus=2, max_restarts=1, workdir=str(folder),
                        command=[sys.executable, "train.py", "8", "4", "0.02"])
    done = client.wait(job.id, timeout=120)
    lines = attempt_lines(client, job.id)
    crashed = [a for a, r, t in lines if r == 1 and t == "error: rank 1 crashes on purpose"]
    assert len(crashed) == 1, lines
    first, last = crashed[0], done.attempt
    assert done.restarts == 1 and last > first, (done, lines)
    # Rank 0 checkpointed step 3 before rank 1 crashed at step 4 (or, had rank 1 started after
    # rank 0's step 6, at step 7); the program has no barrier, so
    # rank 0 may have gone on, and it saves again when told to stop (its next report, or the
    # SIGTERM, in its grace). The next attempt starts from the last it saved, whole.
    stopped = [int(t.split()[-1]) for a, r, t in lines if a == first and r == 0
               and t.startswith("stopping at step")]
    resumed = [t for a, r, t in lines if a == last and r == 0 and t.startswith("resumed from step")]
    assert len(resumed) == 1 and 3 <= int(resumed[0].split()[-1]) <= 8, lines
    if stopped:
        assert resumed == [f"resumed from step {stopped[0]}"], lines
    assert (last, 0, "finished") in lines
    assert done.step == 8


def test_a_preempted_command_job_checkpoints_requeues_and_resumes(preemptive_cluster, tmp_path):
    with trainyard.Client(preemptive_cluster["address"], preemptive_cluster["token"]) as client:
        folder = program(tmp_path, RESUMING_PROGRAM.format(sdk=SDK))
        low = client.submit(name="sdk-low", gpus=2, priority=10, workdir=str(folder),
                            command=[sys.executable, "train.py", "200", "0", "0.05"])
        for _ in client.metrics(low.id, follow=True, timeout=120):
            break  # it runs and reports
        high = client.submit(name="sdk-high", gpus=2, priority=90,
                             command=["/bin/sh", "-c", "echo urgent"])
        assert client.wait(high.id, timeout=120).state == job_pb2.SUCCEEDED
        done = client.wait(low.id, timeout=180)
        lines = attempt_lines(client, low.id)
        assert done.preemptions == 1 and done.attempt == 2 and done.restarts == 0, (done, lines)
        stopped = [int(t.split()[-1]) for a, r, t in lines if a == 1 and r == 0
                   and t.startswith("stopping at step")]
        resumed = [int(t.split()[-1]) for a, r, t in lines if a == 2 and r == 0
                   and t.startswith("resumed from step")]
        assert stopped and resumed, lines
        assert resumed[0] == stopped[0]  # no step lost beyond the checkpoint
        assert (2, 0, "finished") in lines


LONG_STEP_PROGRAM = RESUME_PRELUDE + """
    step = start + 1
    ctx.report(step, loss=1.0 / step)
    if ctx.attempt == 1:
        # One long step: no report until it ends, so no answer can say "stop"; only SIGTERM can.
        deadline = time.time() + 120
        while not ctx.should_stop() and time.time() < deadline:
            time.sleep(0.02)
        if ctx.rank == 0:
            trainyard.save_checkpoint(os.path.join(ctx.checkpoint_dir, f"step-{{step:06d}}"),
                                      lambda tmp: open(tmp, "w").write(str(step)), step=step)
        print(f"stopped at step {{step}}", flush=True)
        sys.exit(0)
    print("finished", flush=True)
"""


def test_a_preempted_program_mid_step_saves_on_sigterm_and_resumes(quick_preemption_cluster,
                                                                   tmp_path):
    cluster = quick_preemption_cluster
    with trainyard.Client(cluster["address"], cluster["token"]) as client:
        folder = program(tmp_path, LONG_STEP_PROGRAM.format(sdk=SDK))
        low = client.submit(name="long-step", gpus=2, priority=10, workdir=str(folder),
                            command=[sys.executable, "train.py"])
        rows = []
        for row in client.metrics(low.id, follow=True, timeout=120):
            rows.append(row)
            break  # its step 1 is reported: it is inside its long step now
        assert rows and rows[0].step == 1
        high = client.submit(name="urgent", gpus=2, priority=90,
                             command=["/bin/sh", "-c", "echo urgent"])
        assert client.wait(high.id, timeout=120).state == job_pb2.SUCCEEDED
        done = client.wait(low.id, timeout=180)
        lines = attempt_lines(client, low.id)
        assert done.state == job_pb2.SUCCEEDED, (done, lines)
        assert done.preemptions == 1 and done.attempt == 2 and done.restarts == 0, (done, lines)
        # Each rank stopped in the worker's stop grace after SIGTERM (rank 0 saving), and attempt
        # 2 went on from the checkpoint.
        assert (1, 0, "stopped at step 1") in lines and (1, 1, "stopped at step 1") in lines, lines
        assert (2, 0, "resumed from step 1") in lines and (2, 0, "finished") in lines, lines
        assert done.last_checkpoint.step == 1 and done.last_checkpoint.attempt == 1, done
