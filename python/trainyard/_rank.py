"""The rank side: what a training program calls from inside a trainyard job."""
import collections
import glob
import os
import sys
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
        if self.in_job:
            from trainyard.v1 import trainer_pb2_grpc

            # (The replicas' list; reports follow the leader across a failover.)
            endpoints = Endpoints(env.get("TRAINYARD_COORDINATOR", "127.0.0.1:7070"),
                                  env.get("TRAINYARD_TLS_CA", ""))
            self._stub = FollowingStub(endpoints, trainer_pb2_grpc.TrainerServiceStub,
                                       follow_for=10.0)

    _KEEP = 1024  # reports kept unanswered, and answered for sending again

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
        from trainyard.v1 import trainer_pb2

        self._remember(self._stub.ReportCheckpoint(
            trainer_pb2.CheckpointReport(job_id=self.job_id, attempt=self.attempt, step=int(step),
                                         path=str(path), bytes=int(size_bytes)),
            timeout=self._timeout, metadata=bearer(self._credential)))
        return self._commands()

    def checkpoint_requested(self):
        """Whether `yard checkpoint` (or a preemption) asks for a checkpoint after this step."""
        return self._checkpoint_requested or self._stop_requested

    def should_stop(self):
        """Whether the job is asked to checkpoint and exit 0 (it is requeued, and its next attempt
        resumes from that checkpoint)."""
        return self._stop_requested

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


_context = None


def init(environ=None):
    """The rank's Context (made once per process)."""
    global _context
    if _context is None or environ is not None:
        _context = Context(environ)
    return _context


__all__ = ["Context", "init"]
