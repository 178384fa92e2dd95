"""Users' own programs as at home (issue 55), against a real local cluster: torchrun's whole
environment (compared with Debian's torchrun running the same script), a failing @record script's
exception as the job's failure, a Python rank's print in the logs while it runs, a program that
saves in its stop grace after a cancel, `yard signal`, and `yard submit -- PROGRAM`. Run by
scripts/test.sh (ctest SdkTest) with the SDK's venv (over Debian's python3-torch)."""
import json
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest

import trainyard
from trainyard.v1 import job_pb2

from conftest import BIN, SDK, program  # noqa: E402  (shared helpers)

DUMP_ENVIRONMENT = """
    import json, os, sys
    with open(os.path.join(sys.argv[1], f"{sys.argv[2]}-{os.environ['RANK']}.json"), "w") as f:
        json.dump(dict(os.environ), f)
"""

# Values that may differ between torchrun and trainyard: addresses, ports and ids (the error
# file's path holds the run's ids).
MAY_DIFFER = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
# torch < 2.2's name of what torchrun 2.x sets as TORCH_NCCL_ASYNC_ERROR_HANDLING.
RENAMED = {"NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_texts(client, job_id):
    return [line.text for line in client.logs(job_id)]


def wait_for_line(client, job_id, predicate, count=1, timeout=60):
    """Follows the job's log until `count` lines satisfy `predicate`; returns them."""
    found = []
    for line in client.logs(job_id, follow=True, timeout=timeout):
        if predicate(line.text):
            found.append(line)
            if len(found) == count:
                return found
    raise AssertionError(f"the job ended with {len(found)} of {count} lines: "
                         f"{log_texts(client, job_id)}")


def test_the_environment_is_torchruns(client, tmp_path):
    folder = program(tmp_path, DUMP_ENVIRONMENT)
    parent = dict(os.environ)
    parent.pop("OMP_NUM_THREADS", None)
    # torchrun itself: two ranks on one node, one restart allowed, its own store (c10d).
    # (--redirects/--tee 1: Debian's torch 1.13 reads their default "0" as None on Python 3.11.)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                    "--nproc_per_node", "2", "--max_restarts", "1", "--rdzv_backend", "c10d",
                    "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--redirects", "1", "--tee",
                    "1", str(folder / "train.py"), str(folder), "torchrun"], env=parent,
                   cwd=folder, check=True, timeout=120, capture_output=True)
    job = client.submit(name="torchrun-env", gpus=2, max_restarts=1, workdir=str(folder),
                        command=[sys.executable, "train.py", str(folder), "trainyard"])
    assert client.wait(job.id, timeout=120).state == job_pb2.SUCCEEDED
    for rank in (0, 1):
        theirs = json.loads((folder / f"torchrun-{rank}.json").read_text())
        ours = json.loads((folder / f"trainyard-{rank}.json").read_text())
        set_by_torchrun = {RENAMED.get(k, k): v for k, v in theirs.items() if parent.get(k) != v}
        assert "GROUP_WORLD_SIZE" in set_by_torchrun and "ROLE_RANK" in set_by_torchrun
        missing = sorted(set(set_by_torchrun) - set(ours))
        assert not missing, f"rank {rank}: torchrun sets {missing}, trainyard does not"
        differ = {k: (v, ours[k]) for k, v in set_by_torchrun.items()
                  if k not in MAY_DIFFER and ours[k] != v}
        assert not differ, f"rank {rank}: (torchrun, trainyard) {differ}"
        # The error file is the rank's own, where it may write.
        assert ours["TORCHELASTIC_ERROR_FILE"].endswith(f"/errors/rank-{rank}.json")
        assert ours["PYTHONUNBUFFERED"] == "1"


RECORDED_FAILURE = """
    import os
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        print("a line that is not the cause", flush=True)
        if os.environ["RANK"] == "1":
            raise RuntimeError("boom on rank 1")

    main()
"""


def test_a_failing_record_scripts_exception_is_the_jobs_failure(client, tmp_path):
    folder = program(tmp_path, RECORDED_FAILURE)
    job = client.submit(name="recorded", gpus=2, workdir=str(folder),
                        command=[sys.executable, "train.py"])
    with pytest.raises(trainyard.JobFailed) as failed:
        client.wait(job.id, timeout=120)
    message = failed.value.job.message
    # The root cause as torchelastic's ChildFailedError names it: the rank, its exception, where.
    assert "rank 1 on node" in message and "exited with code 1: RuntimeError: boom on rank 1" in \
        message, message
    assert 'raise RuntimeError("boom on rank 1")' in message, message
    assert "a line that is not the cause" not in message


UNBUFFERED = """
    import os, sys, time
    print(f"printed at {time.time()}")  # no flush: PYTHONUNBUFFERED=1 sends it at once
    deadline = time.time() + 60
    while not os.path.exists(sys.argv[1]) and time.time() < deadline:
        time.sleep(0.02)
"""


def test_a_python_ranks_print_reaches_the_logs_while_it_runs(client, tmp_path):
    folder = program(tmp_path, UNBUFFERED)
    release = folder / "release"
    job = client.submit(name="unbuffered", gpus=1, workdir=str(folder),
                        command=[sys.executable, "train.py", str(release)])
    try:
        (line,) = wait_for_line(client, job.id, lambda t: t.startswith("printed at"))
        lag = time.time() - float(line.text.split()[-1])
    finally:
        release.touch()
    assert lag < 2.0, f"the print took {lag:.1f} s to reach the logs"
    assert client.wait(job.id, timeout=60).state == job_pb2.SUCCEEDED


SAVES_WHEN_STOPPED = """
    import os, sys, time
    sys.path.insert(0, {sdk!r})
    import trainyard
    ctx = trainyard.init()
    step = 0
    while not ctx.should_stop():  # SIGTERM (the cancel) or the coordinator's answer says stop
        step += 1
        ctx.report(step, loss=1.0 / step)
        time.sleep(0.05)
    ctx.report(step + 1, loss=0.5)  # in the grace: no exception
    trainyard.save_checkpoint(os.path.join(ctx.checkpoint_dir, f"step-{{step}}"),
                              lambda tmp: open(tmp, "w").write(str(step)), step=step)
    print(f"saved step {{step}}", flush=True)
"""


def test_a_cancelled_program_saves_in_its_grace_and_the_checkpoint_is_recorded(cluster, client,
                                                                              tmp_path):
    folder = program(tmp_path, SAVES_WHEN_STOPPED.format(sdk=SDK))
    job = client.submit(name="saves-on-cancel", gpus=1, workdir=str(folder),
                        command=[sys.executable, "train.py"])
    for _ in client.metrics(job.id, follow=True, timeout=60):
        break  # it runs and reports
    assert client.cancel(job.id).state == job_pb2.CANCELLED
    deadline = time.time() + 60
    saved = []
    while not saved and time.time() < deadline:
        saved = [t for t in log_texts(client, job.id) if t.startswith("saved step")]
        if not saved:
            time.sleep(0.1)  # the cancelled job's logs do not follow: read again
    assert saved, log_texts(client, job.id)
    step = int(saved[0].split()[-1])
    described = client.describe(job.id)
    assert described.state == job_pb2.CANCELLED
    assert described.last_checkpoint.step == step, described
    assert described.last_checkpoint.path.endswith(f"/step-{step}")
    assert [c.step for c in described.kept_checkpoints] == [step]
    # The steps it reported in its grace were answered "stop", not recorded as the job's.
    assert max(r.step for r in client.metrics(job.id)) <= step
    shown = yard(cluster, "describe", job.id)
    assert shown.returncode == 0, shown.stderr
    size = len(str(step))  # the bytes the program wrote
    assert f"step {step} at {described.last_checkpoint.path}, {size} B, attempt 1" in shown.stdout
    assert f"kept step-{step} (keep_last all)" in shown.stdout, shown.stdout


WAITS_FOR_A_SIGNAL = """
    import os, signal, time
    got = []
    signal.signal(signal.SIGUSR1, lambda number, frame: got.append(number))
    print("ready", flush=True)
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        time.sleep(0.02)
    print(f"rank {os.environ['RANK']} got {'USR1' if got else 'nothing'}", flush=True)
"""


def test_yard_signal_reaches_every_rank(cluster, client, tmp_path):
    folder = program(tmp_path, WAITS_FOR_A_SIGNAL)
    job = client.submit(name="signalled", gpus=2, workdir=str(folder),
                        command=[sys.executable, "train.py"])
    wait_for_line(client, job.id, lambda t: t == "ready", count=2)
    with pytest.raises(grpc.RpcError) as bad:
        client.signal(job.id, "SEGV")
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.value.details().startswith("signal: 'SEGV' is not one of HUP, INT")
    env = dict(cluster["env"], TRAINYARD_COORDINATOR=cluster["address"])
    sent = subprocess.run([str(BIN / "yard"), "signal", job.id, "sigusr1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stderr
    assert client.wait(job.id, timeout=60).state == job_pb2.SUCCEEDED
    texts = log_texts(client, job.id)
    assert "rank 0 got USR1" in texts and "rank 1 got USR1" in texts, texts
    with pytest.raises(grpc.RpcError) as ended:
        client.signal(job.id, "USR1")
    assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def yard(cluster, *args, cwd=None):
    env = dict(cluster["env"], TRAINYARD_COORDINATOR=cluster["address"])
    return subprocess.run([str(BIN / "yard"), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_yard_submit_runs_a_program_given_after_a_double_dash(cluster, client, tmp_path):
    folder = program(tmp_path, "import os, sys; print('rank', os.environ['RANK'], sys.argv[1:])")
    submitted = yard(cluster, "submit", "--gpus", "2", "--env", "GREETING=hi there", "--",
                     sys.executable, "train.py", "--lr", "3e-4", cwd=folder)
    assert submitted.returncode == 0, submitted.stderr
    done = client.wait(submitted.stdout.strip(), timeout=120)
    assert done.spec.name == "train" and done.spec.resources.slots == 2
    assert list(done.spec.command) == [sys.executable, "train.py", "--lr", "3e-4"]
    # train.py is here: this folder went up as the job's context (no worker needs to see it).
    assert done.spec.context.startswith("sha256:") and done.spec.workdir == ""
    assert done.spec.env["GREETING"] == "hi there"
    assert "rank 1 ['--lr', '3e-4']" in log_texts(client, done.id)
    # A program that names no script here runs in this folder, as before.
    here = yard(cluster, "submit", "--", sys.executable, "-c", "print('in', __import__('os').getcwd())",
                cwd=folder)
    assert here.returncode == 0, here.stderr
    in_folder = client.wait(here.stdout.strip(), timeout=120)
    assert in_folder.spec.workdir == str(folder) and in_folder.spec.context == ""
    assert f"in {folder}" in log_texts(client, in_folder.id)

    # The flags over a spec file: they win, and are checked as its fields are.
    (folder / "job.yaml").write_text(
        "name: from-file\nresources: {gpus: 1}\ncommand: [python3, train.py, x]\nworkdir: .\n")
    over = yard(cluster, "submit", "job.yaml", "--slots", "2", "--name", "flagged", cwd=folder)
    assert over.returncode == 0, over.stderr
    job = client.describe(over.stdout.strip())
    assert job.spec.name == "flagged" and job.spec.resources.slots == 2
    assert list(job.spec.command) == ["python3", "train.py", "x"]
    client.wait(job.id, timeout=120)

    bad = yard(cluster, "submit", "--memory", "lots", "--", "python3", "train.py", cwd=folder)
    assert bad.returncode != 0 and "yard submit: resources.memory:" in bad.stderr, bad.stderr
    reserved = yard(cluster, "submit", "--env", "RANK=3", "--", "python3", "train.py", cwd=folder)
    assert reserved.returncode != 0 and "env" in reserved.stderr and "RANK" in reserved.stderr
    nothing = yard(cluster, "submit", cwd=folder)
    assert nothing.returncode != 0 and "a program after --" in nothing.stderr, nothing.stderr


WAITS_FOR_RELEASE = """
    import os, sys, time
    print("started", flush=True)
    deadline = time.time() + 60
    while not os.path.exists(sys.argv[1]) and time.time() < deadline:
        time.sleep(0.02)
    sys.exit(int(sys.argv[2]))
"""


def test_after_waits_for_success_and_fails_fast_when_a_dependency_fails(cluster, client,
                                                                        tmp_path):
    folder = program(tmp_path, WAITS_FOR_RELEASE)
    release = folder / "release"

    def submit(name, code, *after):
        return client.submit({"name": name, "resources": {"slots": 1}, "workdir": str(folder),
                              "command": [sys.executable, "train.py", str(release), str(code)],
                              "after": list(after)})

    first = submit("first", 0)
    wait_for_line(client, first.id, lambda t: t == "started")
    then = yard(cluster, "submit", "--after", first.id.split("-")[1], "--name", "then", "--",
                sys.executable, "train.py", str(release), "0", cwd=folder)
    assert then.returncode == 0, then.stderr
    then_id = then.stdout.strip()
    # It waits (a free slot notwithstanding) and says for what.
    waiting = client.describe(then_id)
    assert waiting.state == job_pb2.QUEUED and list(waiting.spec.after) == [first.id]
    assert waiting.why_waiting == f"waiting for job {first.id} (RUNNING) to succeed (after)"
    release.touch()
    assert client.wait(first.id, timeout=60).state == job_pb2.SUCCEEDED
    assert client.wait(then_id, timeout=60).state == job_pb2.SUCCEEDED

    # A dependency that fails fails its dependents at once, and theirs in turn.
    release.unlink()
    failing = submit("failing", 3)
    child = submit("child", 0, failing.id)
    grandchild = submit("grandchild", 0, child.id)
    release.touch()
    with pytest.raises(trainyard.JobFailed):
        client.wait(failing.id, timeout=60)
    with pytest.raises(trainyard.JobFailed) as child_failed:
        client.wait(child.id, timeout=60)
    assert child_failed.value.job.message == \
        f"after: job {failing.id} ended FAILED; this job cannot start"
    with pytest.raises(trainyard.JobFailed) as grandchild_failed:
        client.wait(grandchild.id, timeout=60)
    assert f"after: job {child.id} ended FAILED" in grandchild_failed.value.job.message

    # Refused at submit: after a job that already failed, one that does not exist, or itself twice.
    with pytest.raises(grpc.RpcError) as ended:
        submit("late", 0, failing.id)
    assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ended.value.details() == \
        f"after[0]: job {failing.id} ended FAILED: this job could never start"
    with pytest.raises(grpc.RpcError) as unknown:
        submit("unknown", 0, "job-99999")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert unknown.value.details() == "after[0]: job job-99999 not found"
    bad = yard(cluster, "submit", "--after", "first", "--", "true", cwd=folder)
    assert bad.returncode != 0 and "after[0]: expected a job id" in bad.stderr, bad.stderr


ARRAY_TASK = """
    import os, sys, time
    running = os.path.join(sys.argv[1], "running")
    os.makedirs(running, exist_ok=True)
    index = os.environ["TRAINYARD_ARRAY_INDEX"]
    open(os.path.join(running, index), "w").close()
    at_once = len(os.listdir(running))  # this task and any other running now
    time.sleep(0.3)
    os.unlink(os.path.join(running, index))
    print(f"task {index} of {os.environ['TRAINYARD_ARRAY_COUNT']} in "
          f"{os.environ['TRAINYARD_ARRAY_ID']}: {at_once} running", flush=True)
"""


def test_an_array_runs_a_job_per_index_never_more_than_its_limit_at_once(cluster, client,
                                                                         tmp_path):
    folder = program(tmp_path, ARRAY_TASK)
    submitted = yard(cluster, "submit", "--array", "0-5%1", "--name", "sweep", "--", sys.executable,
                     "train.py", str(folder), cwd=folder)
    assert submitted.returncode == 0, submitted.stderr
    first, *ids = submitted.stdout.split("\n")[:7]
    name = first.split()[1]
    assert first.startswith("array sweep-") and len(ids) == 6, submitted.stdout
    # Two slots are free, but the array runs one task at a time; the last says why it waits.
    expected = f"waiting: 1 tasks of array {name} run, at most 1 at once"
    deadline = time.time() + 30
    waits = []
    while expected not in waits and time.time() < deadline:
        waits.append(client.describe(ids[-1]).why_waiting)  # until a task runs
        time.sleep(0.02)
    assert expected in waits, waits[-5:]
    lines = []
    for index, job_id in enumerate(ids):
        done = client.wait(job_id, timeout=120)
        assert done.spec.array.index == index and done.spec.array.count == 6
        lines += log_texts(client, job_id)
    assert sorted(lines) == sorted(f"task {i} of 6 in {name}: 1 running" for i in range(6)), lines
    listed = yard(cluster, "ls", "--array", name)
    assert listed.returncode == 0 and listed.stdout.count("sweep[") == 6, listed.stdout

    # Cancelled as a group: every task that has not ended.
    held = yard(cluster, "submit", "--array", "0-3%1", "--name", "held", "--", sys.executable,
                "-c", "import time; time.sleep(60)", cwd=folder)
    assert held.returncode == 0, held.stderr
    held_name, *held_ids = held.stdout.split()[1:]
    cancelled = yard(cluster, "cancel", "--array", held_name)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.count("CANCELLED") == 4, cancelled.stdout
    assert all(client.describe(i).state == job_pb2.CANCELLED for i in held_ids)
    bad = yard(cluster, "submit", "--array", "3-1", "--", "true", cwd=folder)
    assert bad.returncode != 0 and "--array: expected indices" in bad.stderr, bad.stderr


ARRAY_TASK_SLOW_TO_STOP = """
    import os, signal, sys, time
    running = os.path.join(sys.argv[1], "running")
    os.makedirs(running, exist_ok=True)
    index = os.environ["TRAINYARD_ARRAY_INDEX"]
    marker = os.path.join(running, index)

    def stop(signum, frame):
        time.sleep(3)  # saving its work: still running, on its device
        os.unlink(marker)
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)  # (before the marker: the test cancels once it is there)
    open(marker, "w").close()
    print(f"task {index}: {len(os.listdir(running))} running", flush=True)
    if index == "0":
        time.sleep(600)
    os.unlink(marker)
"""


def test_a_cancelled_array_task_counts_against_the_limit_until_its_processes_exit(cluster, client,
                                                                                   tmp_path):
    """Slurm's %N counts a task until it has completed: a cancelled task whose program takes a few
    seconds to stop after SIGTERM still holds its place (and its device), so the next task waits
    for its exit, not only for its cancel, though the other slot is free."""
    folder = program(tmp_path, ARRAY_TASK_SLOW_TO_STOP)
    submitted = yard(cluster, "submit", "--array", "0-1%1", "--name", "slow", "--",
                     sys.executable, "train.py", str(folder), cwd=folder)
    assert submitted.returncode == 0, submitted.stderr
    name, *ids = submitted.stdout.split()[1:4]
    # Task 0 is running (its marker is written) before it is cancelled.
    deadline = time.time() + 60
    while not (folder / "running" / "0").exists() and time.time() < deadline:
        time.sleep(0.02)
    assert (folder / "running" / "0").exists(), client.describe(ids[0])
    cancelled = yard(cluster, "cancel", ids[0])
    assert cancelled.returncode == 0, cancelled.stderr
    assert client.describe(ids[0]).state == job_pb2.CANCELLED
    # While task 0 stops, task 1 says it waits for the array's limit (unless task 0 has exited by
    # the time the marker is looked at).
    expected = f"waiting: 1 tasks of array {name} run (1 stopping), at most 1 at once"
    why = client.describe(ids[1]).why_waiting
    assert why == expected or not (folder / "running" / "0").exists(), why
    done = client.wait(ids[1], timeout=120)
    assert done.state == job_pb2.SUCCEEDED, done.message
    assert log_texts(client, ids[1]) == ["task 1: 1 running"], log_texts(client, ids[1])
    assert not (folder / "running" / "0").exists()


def test_ranks_per_node_shares_a_slot_among_several_ranks(client):
    """torchrun's --nnodes 1 --nproc-per-node 4 through the client: four ranks on one CPU slot."""
    job = client.submit(name="four", nodes=1, ranks_per_node=4,
                        command=["/bin/sh", "-c", "echo rank $RANK local $LOCAL_RANK of "
                                 "$LOCAL_WORLD_SIZE world $WORLD_SIZE"])
    assert job.spec.resources.slots == 1 and job.world_size == 4
    done = client.wait(job.id, timeout=120)
    assert done.state == job_pb2.SUCCEEDED, done.message
    texts = log_texts(client, done.id)
    for rank in range(4):
        assert f"rank {rank} local {rank} of 4 world 4" in texts, texts
    # One slot, its four ranks.
    assert [(p.first_rank, p.ranks, len(p.device_indices)) for p in done.placement] == [(0, 4, 1)]
