"""A plain PyTorch DDP program, as users bring their own: run by trainyard as a command job.

torch.distributed reads the environment torchrun would set (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, ...), which trainyard gives every rank. The checkpoint goes to
TRAINYARD_CHECKPOINT_DIR when it is set (else ./checkpoints), and a restarted or preempted attempt
resumes from it. With trainyard's Python SDK installed (python/), each step's loss is reported
(`yard metrics`) and `yard checkpoint` or a preemption reaches the loop; without it, or outside
trainyard (`torchrun --nproc-per-node 2 examples/pytorch-ddp.py`), it trains all the same.

    python3 pytorch-ddp.py [--steps N] [--checkpoint-every N]
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    import trainyard
except ImportError:  # without the SDK: no reports, no commands
    trainyard = None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")
    print("env " + " ".join(f"{n}={os.environ.get(n, '')}" for n in names), flush=True)

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # Each rank its own slice of one regression problem.
    g = torch.Generator().manual_seed(1)
    true_w = torch.randn(16, 1, generator=g)
    x = torch.randn(256, 16, generator=g)[rank::world]
    y = x @ true_w

    ckpt_dir = os.environ.get("TRAINYARD_CHECKPOINT_DIR", "checkpoints")
    ckpt = os.path.join(ckpt_dir, "pytorch-ddp.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed from step {start}", flush=True)

    ctx = trainyard.init() if trainyard else None
    for step in range(start + 1, args.steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # The mean over ranks, as a user would report it.
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        mean_loss = reported.item() / world
        if rank == 0:
            print(f"step {step} loss {mean_loss:.6f}", flush=True)
        # Every rank asks (only rank 0's report is recorded); the ranks then agree, so that all
        # checkpoint or stop at the same step.
        requested = stop = False
        if ctx is not None:
            ctx.report(step, loss=mean_loss, total_steps=args.steps)
            flags = torch.tensor([float(ctx.checkpoint_requested()), float(ctx.should_stop())])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            requested, stop = bool(flags[0]), bool(flags[1])
        if step % args.checkpoint_every == 0 or requested or step == args.steps:
            if rank == 0:
                os.makedirs(ckpt_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "step": step}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
                if ctx is not None:
                    ctx.report_checkpoint(step, ckpt, os.path.getsize(ckpt))
        dist.barrier()
        if stop:  # preempted: checkpointed; exit 0 to be requeued
            print(f"stopping at step {step}", flush=True)
            break
    # Teardown in this order, while the tensors the collectives used are still referenced here:
    # with torch 1.13's Gloo, a process group destroyed holding the GIL (the DDP reducer's, when
    # the model goes at the function's end) can deadlock with its worker thread freeing such a
    # tensor (pytorch/pytorch#56297); one rank then never exits.
    dist.barrier()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
