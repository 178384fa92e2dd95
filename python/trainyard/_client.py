"""A client of the coordinator's JobService, as yard is, in the manner of Ray's
JobSubmissionClient. Every call is made as the token's user: users see their own jobs, admins
everyone's."""
import ipaddress
import os
import re
import stat
import time
import uuid

import grpc
from google.protobuf import json_format

from trainyard._channel import Endpoints, FollowingStub, bearer


class JobFailed(Exception):
    """wait() on a job that ended FAILED or CANCELLED; .job is the final Job."""

    def __init__(self, job):
        from trainyard.v1 import job_pb2

        super().__init__(f"{job.id} {job_pb2.JobState.Name(job.state)}: {job.message}")
        self.job = job


class _Seen:
    """Whether a log line or step report was yielded already, by its seq per attempt and rank
    (the stream starts again from the first after a failover); unsequenced ones never were. A
    log position (after a tail: a rank's last line kept when the stream opened) is never yielded:
    it marks the lines the tail left out as seen."""

    def __init__(self):
        self._last = {}

    def __call__(self, message):
        if message.seq <= 0:
            return False
        key = (message.attempt, message.rank)
        if message.seq <= self._last.get(key, 0):
            return True
        self._last[key] = message.seq
        return getattr(message, "position", False)


def _read_secret_file(path):
    """A token file's text, refused as yard refuses it (common/credentials.cc ReadSecretFile) when
    it is not a regular file or others may read or change it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # (a link is followed, as yard follows it)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path}: not a regular file")
        if st.st_mode & 0o077:
            raise PermissionError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read "
                                  f"or change it; chmod 600 {path}")
        with os.fdopen(fd, closefd=False) as f:
            return f.read().strip()
    finally:
        os.close(fd)


def _default_token():
    """--token-file's env TRAINYARD_TOKEN_FILE, else TRAINYARD_TOKEN, else the token `yard login`
    saved ($XDG_CONFIG_HOME/trainyard/token or ~/.config/trainyard/token), as yard looks."""
    path = os.environ.get("TRAINYARD_TOKEN_FILE")
    if path:
        return _read_secret_file(path)
    if os.environ.get("TRAINYARD_TOKEN"):
        return os.environ["TRAINYARD_TOKEN"]
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    saved = os.path.join(config, "trainyard", "token")
    if os.path.exists(saved):
        return _read_secret_file(saved)
    raise ValueError("token: none given, no TRAINYARD_TOKEN_FILE or TRAINYARD_TOKEN, and no "
                     f"saved token in {saved} (yard login)")


def _env_flag(name):
    """A yes/no environment variable as yard (CLI11's flag values) reads it: unset or empty is
    no; true/t/yes/y/on/enable/+ and a non-zero integer yes; false/f/no/n/off/disable/- and 0 no."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "false", "f", "no", "n", "off", "disable", "-"):
        return False
    if value in ("true", "t", "yes", "y", "on", "enable", "+"):
        return True
    try:
        return int(value) != 0
    except ValueError:
        raise ValueError(f"{name}: expected 1/true/yes/on or 0/false/no/off, got {value!r}")


def normalize_job_id(job):
    """`7` or "7" is job-7, as yard reads a job id; "job-7" (or anything else) as it is."""
    text = str(job)
    return f"job-{text}" if text.isdigit() else text


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
               "tib": 2**40}


def parse_bytes(value):
    """Bytes from an int or "16GiB", "512MiB", "1.5GB", as the spec's memory fields read them
    (ValueError otherwise)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"memory: expected bytes such as 16GiB or 512MiB, got {value!r}")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def _name_of(command):
    """A program's job name, as `yard submit -- PROGRAM` names it: its script's (a .py or .sh
    argument) else the program's, with characters a name may not have left out."""
    program = os.path.basename(command[0]) if command else ""
    for arg in command:
        if arg.endswith((".py", ".sh")):
            program = os.path.splitext(os.path.basename(arg))[0]
            break
    name = "".join(c for c in program if c.isascii() and (c.isalnum() or c in "-_."))
    if not name or name[0].isdigit():
        name = "job-" + name
    return name[:64]


def _is_loopback(address):
    """Whether HOST:PORT's host is this host's loopback (127.0.0.0/8, ::1, localhost), as yard
    decides (common/tls.h IsLoopback)."""
    host = address.strip().rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Client:
    def __init__(self, address=None, token=None, tls_ca=None, timeout=30.0, insecure=None):
        """`insecure`: send the token without TLS to a coordinator that is not on this host
        (default: env TRAINYARD_INSECURE=1); otherwise, without `tls_ca` (env TRAINYARD_TLS_CA),
        such an address is refused with ValueError before any call, as yard refuses it."""
        from trainyard.v1 import job_pb2_grpc

        self.address = address or os.environ.get("TRAINYARD_COORDINATOR") or "127.0.0.1:7070"
        if insecure is None:
            insecure = _env_flag("TRAINYARD_INSECURE")
        ca = tls_ca if tls_ca is not None else os.environ.get("TRAINYARD_TLS_CA", "")
        remote = [a.strip() for a in self.address.split(",") if a.strip() and not _is_loopback(a)]
        if remote and not ca and not insecure:
            raise ValueError(f"refusing to send your API token in clear to {remote[0]}, which is "
                             "not this host: give tls_ca= (env TRAINYARD_TLS_CA), or "
                             "insecure=True (env TRAINYARD_INSECURE=1) on a network you trust")
        self._metadata = bearer(token if token is not None else _default_token())
        self._timeout = timeout
        # (Several replicas: "a:7070,b:7070"; calls follow the leader.)
        self._endpoints = Endpoints(self.address, tls_ca)
        self._jobs = FollowingStub(self._endpoints, job_pb2_grpc.JobServiceStub)

    def close(self):
        self._endpoints.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(self, spec=None, **fields):
        """Submits a job and returns it (QUEUED). `spec`: a trainyard.v1.JobSpec, or a dict in
        the JobSpec's JSON form; or keyword fields: name (default: the command's script's, as
        yard names it), description, slots (or gpus, its old name), nodes and ranks_per_node
        (torchrun's --nnodes and --nproc-per-node), cpus and memory (per rank: 1.5, "16GiB"),
        command, workdir, context, env, after (job ids: 7 or "job-7"), priority, max_restarts,
        max_runtime_seconds, preemptible, stop_grace_seconds. A context that is a folder (not an
        uploaded "sha256:..." digest) is packed
        and uploaded first, as `yard submit --context DIR` does (ValueError naming "context" when
        it holds more than 64 MiB of files). The coordinator
        validates it: a bad one raises grpc.RpcError INVALID_ARGUMENT naming the field."""
        from trainyard.v1 import job_pb2

        if isinstance(spec, job_pb2.JobSpec):
            message = spec
        elif isinstance(spec, dict):
            resources = spec.get("resources")
            if isinstance(resources, dict) and "gpus" in resources:  # the old name of slots
                if "slots" in resources:
                    raise ValueError("resources.gpus is the old name of resources.slots: give one")
                resources = dict(resources)
                resources["slots"] = resources.pop("gpus")
                spec = dict(spec, resources=resources)
            message = json_format.ParseDict(spec, job_pb2.JobSpec())
        elif spec is None:
            command = list(fields.pop("command", []))
            name = fields.pop("name", "") or (_name_of(command) if command else "")
            message = job_pb2.JobSpec(name=name,
                                      description=fields.pop("description", ""))
            if "slots" in fields and "gpus" in fields:
                raise TypeError("submit: gpus is the old name of slots: give one")
            nodes = int(fields.pop("nodes", 0))
            message.resources.nodes = nodes
            message.resources.ranks_per_node = int(fields.pop("ranks_per_node", 0))
            # With nodes (torchrun's --nnodes), slots default to one a node (the coordinator's).
            message.resources.slots = int(fields.pop("slots", fields.pop("gpus", 0 if nodes else 1)))
            message.resources.cpus = float(fields.pop("cpus", 0))
            message.resources.memory_bytes = parse_bytes(fields.pop("memory", 0))
            message.command.extend(command)
            message.workdir = fields.pop("workdir", "")
            message.context = os.fspath(fields.pop("context", ""))
            message.env.update(fields.pop("env", {}))
            message.after.extend(normalize_job_id(j) for j in fields.pop("after", []))
            for key in ("priority", "max_restarts", "max_runtime_seconds", "preemptible",
                        "stop_grace_seconds"):
                if key in fields:
                    setattr(message, key, fields.pop(key))
            if fields:
                raise TypeError(f"submit: unknown fields {sorted(fields)}")
        else:
            raise TypeError("submit: spec must be a JobSpec or a dict")
        if message.context and not message.context.startswith("sha256:"):
            message.context = self.upload_context(message.context)
        # One request id for this submit and every retry of it (the stub follows the leader and
        # retries): the coordinator stores the job once.
        request = job_pb2.SubmitJobRequest(spec=message, request_id=uuid.uuid4().hex)
        response = self._jobs.SubmitJob(request, timeout=self._timeout, metadata=self._metadata)
        return response.job

    def upload_context(self, folder):
        """Packs and uploads `folder` as a job's context; returns its digest for JobSpec.context
        (kept for you alone: a day, or as long as the logs of a job that names it)."""
        from trainyard import _context

        from trainyard.v1 import job_pb2_grpc

        archive, digest = _context.pack(folder)
        chunks = _context.chunks(archive, digest)
        # Sent whole again to the leader when a standby or a leader going away answers.
        give_up = time.monotonic() + 30
        while True:
            stub = job_pb2_grpc.JobServiceStub(self._endpoints.channel)
            try:
                return stub.UploadContext(iter(chunks), timeout=max(self._timeout or 0, 600),
                                          metadata=self._metadata).context
            except grpc.RpcError as error:
                if time.monotonic() > give_up or not self._endpoints.follow(error):
                    raise
                time.sleep(0.2)

    def describe(self, job_id):
        from trainyard.v1 import job_pb2

        request = job_pb2.GetJobRequest(job_id=normalize_job_id(job_id))
        return self._jobs.GetJob(request, timeout=self._timeout, metadata=self._metadata)

    def list(self, states=(), owner="", limit=None):
        """Jobs, newest first (every page), optionally only in `states` (names or values)."""
        from trainyard.v1 import job_pb2

        values = [job_pb2.JobState.Value(s.upper()) if isinstance(s, str) else s for s in states]
        request = job_pb2.ListJobsRequest(states=values, owner=owner)
        out = []
        while True:
            page = self._jobs.ListJobs(request, timeout=self._timeout, metadata=self._metadata)
            out.extend(page.jobs)
            if not page.next_page_token or (limit is not None and len(out) >= limit):
                return out[:limit] if limit is not None else out
            request.page_token = page.next_page_token

    def cancel(self, job_id, reason=""):
        from trainyard.v1 import job_pb2

        request = job_pb2.CancelJobRequest(job_id=normalize_job_id(job_id), reason=reason)
        return self._jobs.CancelJob(request, timeout=self._timeout, metadata=self._metadata)

    def checkpoint(self, job_id):
        """Asks a running job for a checkpoint (its ranks see checkpoint_requested())."""
        from trainyard.v1 import job_pb2

        request = job_pb2.CheckpointJobRequest(job_id=normalize_job_id(job_id))
        return self._jobs.CheckpointJob(request, timeout=self._timeout, metadata=self._metadata)

    def signal(self, job_id, signal):
        """Sends `signal` ("USR1", "SIGUSR1", ...) to every rank of the running job, each rank's
        whole process tree, as `yard signal` does (the job's owner and admins)."""
        from trainyard.v1 import job_pb2

        request = job_pb2.SignalJobRequest(job_id=normalize_job_id(job_id), signal=str(signal))
        return self._jobs.SignalJob(request, timeout=self._timeout, metadata=self._metadata)

    def wait(self, job_id, timeout=None):
        """Blocks until the job ends; returns it when SUCCEEDED, raises JobFailed otherwise and
        grpc.RpcError DEADLINE_EXCEEDED past `timeout` seconds."""
        from trainyard.v1 import job_pb2

        job_id = normalize_job_id(job_id)
        terminal = (job_pb2.SUCCEEDED, job_pb2.FAILED, job_pb2.CANCELLED)
        # (Across a failover the watch starts again at the new leader, which sends the job first.)
        stream = self._jobs.stream("WatchJob", job_pb2.WatchJobRequest(job_id=job_id),
                                   seen=lambda event: False, timeout=timeout,
                                   metadata=self._metadata)
        last = None
        for event in stream:
            last = event.job
            if last.state in terminal:
                stream.close()
                break
        if last is None or last.state not in terminal:
            raise RuntimeError(f"{job_id}: the watch ended before the job did")
        if last.state != job_pb2.SUCCEEDED:
            raise JobFailed(last)
        return last

    def logs(self, job_id, follow=False, tail=0, timeout=None):
        """The job's log lines (LogLine: attempt, rank, text, seq), oldest first; with `follow`,
        until the job ends (or `timeout` seconds: grpc.RpcError DEADLINE_EXCEEDED). Across a
        failover it goes on at the new leader, each line once (with a `tail`, none it left out)."""
        from trainyard.v1 import job_pb2

        job_id = normalize_job_id(job_id)
        request = job_pb2.StreamLogsRequest(job_id=job_id, follow=follow, tail=tail,
                                            positions=tail > 0)
        yield from self._jobs.stream(
            "StreamLogs", request, seen=_Seen(),
            resume_request=job_pb2.StreamLogsRequest(job_id=job_id, follow=follow),
            metadata=self._metadata, timeout=timeout if follow else self._timeout)

    def metrics(self, job_id, follow=False, timeout=None):
        """The job's step reports (StepReport: step, loss, ..., and `metrics` by name); with
        `follow`, until the job ends (or `timeout` seconds). Across a failover it goes on at the
        new leader, each step once."""
        from trainyard.v1 import job_pb2

        request = job_pb2.StreamMetricsRequest(job_id=normalize_job_id(job_id), follow=follow)
        yield from self._jobs.stream("StreamMetrics", request, seen=_Seen(),
                                     metadata=self._metadata,
                                     timeout=timeout if follow else self._timeout)
