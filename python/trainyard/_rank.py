"""The rank side: what a training program calls from inside a trainyard job."""
import collections
import glob
import os
import shutil
import signal
import socket
import sys
import threading
import time


def resident_bytes():
    """This process's resident set now (/proc/self/statm), as the built-in trainer reports it;
    0 where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_peak_bytes():
    """The peak GPU memory torch allocated in this process (torch.cuda.max_memory_allocated),
    when the program imported torch and uses CUDA; else 0. Never imports torch itself."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
    except Exception:  # a torch without CUDA, or a broken one: no figure rather than a failure
        pass
    return 0

from trainyard._channel import Endpoints, FollowingStub, bearer


class Context:
    """A rank's view of its job, from the environment its worker gave it.

    Every rank may call report(); rank 0's reports are the job's metrics, the others' only fetch
    the job's commands. A checkpoint request is pending until rank 0 reports the checkpoint, a
    stop until the attempt ends: ranks that must act at the same step agree on the flags (e.g.
    an all-reduce of them, as examples/pytorch-ddp.py does). Outside a trainyard job (no TRAINYARD_JOB_ID or credential) nothing is sent and no
    command ever comes: the same script runs by hand."""

    def __init__(self, environ=None, timeout=30.0):
        env = os.environ if environ is None else environ
        self.job_id = env.get("TRAINYARD_JOB_ID", "")
        self._credential = env.get("TRAINYARD_JOB_CREDENTIAL", "")
        self.in_job = bool(self.job_id and self._credential)
        self.attempt = int(env.get("TRAINYARD_ATTEMPT") or 1)
        self.rank = int(env.get("RANK") or env.get("TRAINYARD_RANK") or 0)
        self.world_size = int(env.get("WORLD_SIZE") or 1)
        self.local_rank = int(env.get("LOCAL_RANK") or 0)
        self.checkpoint_dir = env.get("TRAINYARD_CHECKPOINT_DIR") or os.path.abspath("checkpoints")
        self._timeout = timeout
        self._checkpoint_requested = False
        self._stop_requested = False
        self._stub = None
        # Step reports not yet answered, and the newest answered ones: sent again to a coordinator
        # of a new incarnation (a failover or restart may have lost what the last one had not
        # stored; it keeps each seq once), as the built-in trainer does.
        self._seq = 0
        self._unsent = collections.deque(maxlen=self._KEEP)
        self._recent = collections.deque(maxlen=self._KEEP)
        self._incarnation = ""
        self._sigterm = False
        self._polled = False  # should_stop() asked at least once: SIGTERM is the program's to act on
        self._kept = []  # (step, path) that save_checkpoint keeps, oldest first
        keep = env.get("TRAINYARD_CHECKPOINT_KEEP_LAST", "")
        self.keep_last = int(keep) if keep.isdigit() else 0
        if self.in_job:
            self._catch_sigterm()
            from trainyard.v1 import trainer_pb2_grpc

            # (The replicas' list; reports follow the leader across a failover.)
            endpoints = Endpoints(env.get("TRAINYARD_COORDINATOR", "127.0.0.1:7070"),
                                  env.get("TRAINYARD_TLS_CA", ""))
            self._stub = FollowingStub(endpoints, trainer_pb2_grpc.TrainerServiceStub,
                                       follow_for=10.0)

    _KEEP = 1024  # reports kept unanswered, and answered for sending again

    def _catch_sigterm(self):
        """SIGTERM (a cancel, a preemption past its grace, a drain) makes should_stop() true, so
        the loop saves and exits within the grace instead of dying mid-step. A handler the
        program set before init() still runs after ours; one it sets afterwards replaces ours.
        Only from the main thread (Python runs handlers there)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            again = self._sigterm
            self._sigterm = True
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL and (again or not self._polled):
                # A program that never asks should_stop() (or a second SIGTERM): ends as it
                # would have without the SDK.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)

    def report(self, step, loss=0.0, total_steps=0, lr=0.0, **metrics):
        """Reports optimizer step `step` (1-based) with its loss and any other metrics by name
        (numbers). Returns the job's pending commands, also kept for checkpoint_requested() and
        should_stop().

        A report that finds no coordinator (after following the replicas for 10 s: a failover,
        a restart) is kept and sent before the next one, and the recent ones are sent again to a
        coordinator that is not the one before, so `yard metrics` keeps every step."""
        if not self._stub:
            return self._commands()
        from trainyard.v1 import trainer_pb2

        self._seq += 1
        report = trainer_pb2.StepReport(
            job_id=self.job_id, attempt=self.attempt, rank=self.rank, step=int(step),
            total_steps=int(total_steps), loss=float(loss), lr=float(lr),
            time_ms=int(time.time() * 1000), resident_bytes=resident_bytes(),
            device_peak_bytes=device_peak_bytes(), cpu_seconds=time.process_time(),
            seq=self._seq)
        for name, value in metrics.items():
            report.metrics[name] = float(value)
        self._unsent.append(report)
        self._send_unsent()
        return self._commands()

    def _send_unsent(self):
        import grpc

        retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                     grpc.StatusCode.RESOURCE_EXHAUSTED)
        while self._unsent:
            report = self._unsent[0]
            report.incarnation = self._incarnation
            try:
                commands = self._stub.ReportStep(report, timeout=self._timeout,
                                                 metadata=bearer(self._credential))
            except grpc.RpcError as error:
                if error.code() in retryable:
                    return  # kept: sent before the next report
                self._unsent.popleft()
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # The attempt has ended (cancelled, preempted, failed elsewhere): stop,
                    # rather than die before the checkpoint a stopping program saves.
                    self._stop_requested = True
                    self._unsent.clear()
                    return
                raise
            self._unsent.popleft()
            self._remember(commands)
            moved = bool(self._incarnation) and commands.incarnation != self._incarnation
            self._incarnation = commands.incarnation
            if moved and self.rank == 0:
                # It recorded nothing of this one: the kept ones and it again, oldest first.
                again = list(self._recent) + [report]
                self._recent.clear()
                self._unsent.extendleft(reversed(again))
                continue
            self._recent.append(report)

    def report_checkpoint(self, step, path, size_bytes=0):
        """Says that the job's checkpoint of step `step` is complete at `path` (rank 0, once every
        rank wrote its part): `yard describe` shows it and a requested checkpoint is answered."""
        if not self._stub or self.rank != 0:
            return self._commands()
        import grpc
        from trainyard.v1 import trainer_pb2

        report = trainer_pb2.CheckpointReport(job_id=self.job_id, attempt=self.attempt,
                                              step=int(step), path=str(path),
                                              bytes=int(size_bytes))
        for kept_step, kept_path in self._kept_checkpoints(step, path):
            report.kept.add(step=kept_step, path=kept_path)
        try:
            self._remember(self._stub.ReportCheckpoint(report, timeout=self._timeout,
                                                       metadata=bearer(self._credential)))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._stop_requested = True  # the attempt has ended; the checkpoint is on disk
        return self._commands()

    def _kept_checkpoints(self, step, path):
        """(step, path) of the checkpoints save_checkpoint keeps with `path`, oldest first: the
        newest keep_last (when set), at most 100 (what a report carries)."""
        kept = [(s, p) for s, p in self._kept if p != str(path)] + [(int(step), str(path))]
        if self.keep_last > 0:
            kept = kept[-self.keep_last:]
        return kept[-100:]

    def checkpoint_requested(self):
        """Whether `yard checkpoint` asks for a checkpoint after this step; also whenever
        should_stop() is true (a stop saves first)."""
        return self._checkpoint_requested or self.should_stop()

    def should_stop(self):
        """Whether the job is asked to checkpoint and exit 0: a preemption (it is requeued, and
        its next attempt resumes from that checkpoint), a cancel or SIGTERM (the rank has its stop
        grace, the spec's stop_grace or else the worker's --stop-grace, to save before SIGKILL)."""
        self._polled = True
        return self._stop_requested or self._sigterm

    def latest_checkpoint(self, pattern="*"):
        """The newest entry of checkpoint_dir matching `pattern` (by modification time), or None."""
        found = glob.glob(os.path.join(self.checkpoint_dir, pattern))
        return max(found, key=os.path.getmtime) if found else None

    def _remember(self, commands):
        self._checkpoint_requested = commands.checkpoint_requested
        self._stop_requested = commands.stop_requested

    def _commands(self):
        return {"checkpoint_requested": self._checkpoint_requested,
                "stop_requested": self._stop_requested}


def _fsync_tree(path):
    """fsync every file under `path` (or `path` itself), then the folders that hold them."""
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            for name in files:
                _fsync_tree(os.path.join(root, name))
            _fsync_dir(root)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def save_checkpoint(path, write, step=None, context=None):
    """Saves a checkpoint atomically: `write(tmp)` writes it to a temporary path beside `path`
    (a file, or a folder it creates), which is fsynced and renamed to `path` (a checkpoint that
    exists is replaced: a folder is first moved aside, then removed), so that a kill mid-write
    never leaves a torn checkpoint where the next attempt looks. With `step`, rank 0 then reports
    it (describe shows it; a requested checkpoint is answered), and checkpoint.keep_last (when the
    spec sets it) removes the oldest ones this program saved once the new one is reported. Call it
    from one rank for a path the ranks share. Returns `path`.

        trainyard.save_checkpoint(f"{ctx.checkpoint_dir}/step-{step}.pt",
                                  lambda tmp: torch.save(state, tmp), step=step)
    """
    ctx = context if context is not None else init()
    path = os.path.abspath(str(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    unique = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{unique}")
    old = os.path.join(folder, f".{os.path.basename(path)}.old-{unique}")
    try:
        write(tmp)
        if not os.path.exists(tmp):
            raise FileNotFoundError(f"save_checkpoint: write() did not create {tmp}")
        _fsync_tree(tmp)
        if os.path.isdir(tmp) and os.path.isdir(path):
            os.replace(path, old)  # a folder cannot be renamed over a full one
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException:
        _remove(tmp)
        if os.path.exists(old) and not os.path.exists(path):
            os.replace(old, path)  # the checkpoint that was there stays
        raise
    _remove(old)
    if step is None:
        return path
    size = 0
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    else:
        size = os.path.getsize(path)
    ctx._kept = [(s, p) for s, p in ctx._kept if p != path] + [(int(step), path)]
    ctx.report_checkpoint(step, path, size)
    if ctx.keep_last > 0 and ctx.rank == 0:
        while len(ctx._kept) > ctx.keep_last:
            _, gone = ctx._kept.pop(0)
            _remove(gone)
    ctx._kept = ctx._kept[-max(ctx.keep_last, 100):]
    return path


_context = None
_exit_hook = False


def _destroy_process_group_at_exit():
    """A rank whose program returns without torch.distributed.destroy_process_group() can abort
    at interpreter exit ("terminate called without an active exception": Gloo's worker threads
    outlive the interpreter, pytorch/pytorch#190489), and the job fails after its work is done, as
    a Hugging Face Trainer script's rank did here. The handler PyTorch proposed in
    pytorch/pytorch#179291: destroy the default group while the interpreter is whole. A no-op
    where torch was never imported or the program destroyed its group itself."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # the program is ending: say it, do not mask its own exit
        print(f"trainyard: destroying the process group at exit: {e!r}", file=sys.stderr)


def init(environ=None):
    """The rank's Context (made once per process). Also registers, once, an exit handler that
    destroys torch.distributed's default process group if the program left it."""
    global _context, _exit_hook
    if _context is None or environ is not None:
        _context = Context(environ)
    if not _exit_hook:
        import atexit
        atexit.register(_destroy_process_group_at_exit)
        _exit_hook = True
    return _context


__all__ = ["Context", "init", "save_checkpoint"]
