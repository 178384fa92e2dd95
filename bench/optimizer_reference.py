"""The anchors of bench/optimizer_bench.sh: PyTorch's AdamW (foreach), transformers' Adafactor and
lion-pytorch's Lion on the parameters of the same Llama-shaped model, on the same threads; the
median time of one step and the bytes of optimizer state. bitsandbytes' AdamW8bit has no CPU
implementation (its optimizers need CUDA), so it has no row here.

usage: optimizer_reference.py REPS THREADS LAYERS D_MODEL D_HIDDEN VOCAB N_HEAD
prints one JSON object per optimizer."""
import json
import sys
import time

import torch


def shapes(layers, d, h, vocab, heads):
    q = kv = (d // heads) * heads
    out = [(vocab, d)]
    for _ in range(layers):
        out += [(d,), (d,), (q, d), (kv, d), (kv, d), (d, q), (h, d), (h, d), (d, h)]
    return out + [(d,), (vocab, d)]


def main():
    reps, threads, layers, d, h, vocab, heads = (int(x) for x in sys.argv[1:8])
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes(layers, d, h, vocab, heads)]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3

    from lion_pytorch import Lion
    from transformers.optimization import Adafactor
    makers = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=0.1, foreach=True),
        "adafactor": lambda: Adafactor(params, lr=1e-4, relative_step=False,
                                       scale_parameter=False, warmup_init=False, weight_decay=0.1),
        "lion": lambda: Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
    }
    names = {"adamw": "torch.optim.AdamW(foreach=True)", "adafactor": "transformers Adafactor",
             "lion": "lion_pytorch.Lion"}
    for kind, make in makers.items():
        opt = make()
        opt.step()  # creates the state
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        state = sum(t.numel() * t.element_size() for st in opt.state.values()
                    for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        print(json.dumps({"impl": names[kind], "optimizer": kind,
                          "params": sum(p.numel() for p in params), "threads": threads,
                          "median_ms": times[len(times) // 2], "state_bytes": state}), flush=True)


if __name__ == "__main__":
    main()
