#!/usr/bin/env python3
"""PyTorch DDP reference for bench/ddp_bench.sh: the same GPT as trainyard-trainer (token and
position embeddings, pre-norm blocks with a fused qkv projection and a 4x GELU MLP, final
LayerNorm, untied head without bias), AdamW, Gloo, one process per rank with a fixed number of
threads. Prints one line: 'tokens_per_second <median over timed steps>'.

Debian's torchrun fails under Python 3.11, so this script starts its ranks itself with
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set by hand.

Under PyTorch 2.x (scripts/lib/torch211.sh: PyPI's 2.11, the CPU anchor of issue 56) --sdpa
runs the attention as F.scaled_dot_product_attention(is_causal=True), --fused-adamw steps
AdamW(fused=True), and --compile runs the DDP-wrapped model through torch.compile (the first
warm-up step compiles).
"""
import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, n_head, sdpa=False):
        super().__init__()
        self.n_head = n_head
        self.sdpa = sdpa
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def attention(self, x):
        b, t, d = x.shape
        hd = d // self.n_head
        qkv = self.qkv(x).view(b, t, 3, self.n_head, hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, d))
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        y = torch.softmax(scores, -1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))

    def forward(self, x):
        h = x + self.attention(self.ln1(x))
        return h + self.fc_out(F.gelu(self.fc(self.ln2(h))))


class Gpt(nn.Module):
    def __init__(self, n_layer, n_head, d, seq_len, vocab, sdpa=False):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, n_head, sdpa) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, windows):
        t = windows.size(1) - 1
        inputs, targets = windows[:, :t], windows[:, 1:]
        x = self.tok_emb(inputs) + self.pos_emb(torch.arange(t))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def run_rank(args):
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(args.seed)
    model = Gpt(args.n_layer, args.n_head, args.d_model, args.seq_len, 256, args.sdpa)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    if args.compile:
        ddp = torch.compile(ddp)
    extra = {"fused": True} if args.fused_adamw else {}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, **extra)
    data = torch.frombuffer(bytearray(open(args.data, "rb").read()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(args.seed + rank)
    n = data.numel() - args.seq_len - 1
    times = []
    for step in range(args.warmup + args.steps):
        starts = torch.randint(0, n, (args.micro_batch,), generator=gen)
        batch = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ddp(batch)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
    # Every rank timed the same steps; the slowest rank sets the pace.
    median = torch.tensor([statistics.median(times)])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    if rank == 0:
        tokens = world * args.micro_batch * args.seq_len
        print(f"tokens_per_second {tokens / median.item():.1f}", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--sdpa", action="store_true")
    p.add_argument("--fused-adamw", action="store_true")
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(args.world_size), OMP_NUM_THREADS=str(args.threads))
    procs = [subprocess.Popen([sys.executable] + sys.argv, env=dict(env, RANK=str(r)))
             for r in range(args.world_size)]
    codes = [proc.wait() for proc in procs]
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
