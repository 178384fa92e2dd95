#!/usr/bin/env python3
"""PyTorch's own AdamW on inputs written by tests/cpu_adam_test.cc (CpuAdamTorchTest).

Usage: adam_torch_reference.py IN OUT

IN (little endian): the header "TYAD", int64 n, steps, n_probe, then float64 lr, beta1, beta2,
eps, weight_decay, grad_scale; then float32 params[n], grads[steps][n], probe[n_probe].
Runs torch.optim.AdamW (amsgrad=False, maximize=False) for `steps` steps from zero state, with
p.grad = grads[s] * grad_scale, once with foreach=False and once with foreach=True.
OUT: for foreach=False then foreach=True, float32 params[n], exp_avg[n], exp_avg_sq[n]; then
uint16 probe.to(torch.bfloat16)[n_probe].
Exit status 3 when PyTorch cannot be imported.
"""
import struct
import sys

try:
    import numpy as np
    import torch
except ImportError as e:
    sys.stderr.write(f"adam_torch_reference.py: cannot import PyTorch/numpy ({e}); "
                     "install Debian's python3-torch\n")
    sys.exit(3)

HEADER = struct.Struct("<4sqqq6d")


def main():
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    data = open(sys.argv[1], "rb").read()
    magic, n, steps, n_probe, lr, beta1, beta2, eps, weight_decay, grad_scale = \
        HEADER.unpack_from(data, 0)
    if magic != b"TYAD":
        sys.stderr.write("adam_torch_reference.py: bad input header\n")
        return 2
    floats = np.frombuffer(data, dtype="<f4", offset=HEADER.size)
    params0 = torch.from_numpy(floats[:n].copy())
    grads = torch.from_numpy(floats[n:n + steps * n].copy()).view(steps, n)
    probe = torch.from_numpy(floats[n + steps * n:n + steps * n + n_probe].copy())

    out = bytearray()
    for foreach in (False, True):
        p = torch.nn.Parameter(params0.clone())
        opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps,
                                weight_decay=weight_decay, amsgrad=False, maximize=False,
                                foreach=foreach)
        for s in range(steps):
            p.grad = grads[s] * grad_scale
            opt.step()
        state = opt.state[p]
        for t in (p.detach(), state["exp_avg"], state["exp_avg_sq"]):
            out += t.numpy().astype("<f4").tobytes()
    out += probe.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    with open(sys.argv[2], "wb") as f:
        f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
