"""trainyard's Python SDK.

Inside a rank of a job (a command job's program, or any script run by hand):

    import trainyard
    ctx = trainyard.init()
    for step in range(start, steps):
        ...
        ctx.report(step, loss=loss, accuracy=acc)       # rows in `yard metrics`
        if ctx.checkpoint_requested() or ctx.should_stop():
            trainyard.save_checkpoint(f"{ctx.checkpoint_dir}/step-{step}.pt",
                                      lambda tmp: torch.save(state, tmp), step=step)
            if ctx.should_stop():      # preempted, cancelled or SIGTERM: saved within the grace
                break

Outside a trainyard job every call works as a no-op, so the same script runs by hand. A Hugging
Face Trainer script needs only `callbacks=[trainyard.hf.TrainyardCallback()]` (trainyard/hf.py).

A client of the coordinator, as `yard` is (same address and token lookup):

    client = trainyard.Client()                          # TRAINYARD_COORDINATOR, the saved token
    job = client.submit(name="ddp", slots=2, command=["python3", "train.py"], workdir="/shared/x")
    client.wait(job.id)
    for line in client.logs(job.id): print(line.rank, line.text)

The protobuf and gRPC stubs (trainyard.v1) are generated from proto/ when the package is built
(python/build_stubs.py).
"""
from trainyard._client import Client, JobFailed
from trainyard._rank import Context, init, save_checkpoint

__all__ = ["Client", "Context", "JobFailed", "init", "save_checkpoint"]
