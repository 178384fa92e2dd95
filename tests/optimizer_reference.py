"""The reference optimizers tests/optimizer_reference_test.cc compares trainyard's with.

  adafactor   transformers.optimization.Adafactor (lr given; relative_step, scale_parameter and
              warmup_init off), from PyPI;
  lion        lion_pytorch.Lion, from PyPI;
  adamw_8bit  bitsandbytes' AdamW8bit: its dynamic quantization maps (bitsandbytes 0.44.1 from
              PyPI) and the update of its CUDA kernel kOptimizerStatic8bit2StateBlockwise (ADAM),
              which has no CPU build, written here in the kernel's order and fp32 arithmetic
              (dequantize with the old absmax, update the moments, step the parameter, decay it,
              quantize to the nearest code with the new absmax, keep m's sign).

  adamw       torch.optim.AdamW.

usage: optimizer_reference.py KIND OUT_DIR [--settings]
Writes OUT_DIR/input.safetensors (the initial parameters "param.<i>", the gradients
"grad.<step>.<i>", the gradient scale of each step "grad_scale", "hyper" = [lr, weight_decay] and
"settings" = [beta1, beta2, eps, adafactor eps[0], clip_threshold, decay_rate, the index of the
parameter weight decay leaves alone or -1]) and OUT_DIR/expected.safetensors (the parameters after
the steps, "param.<i>", and the state, "state.<i>.<name>" named as trainyard's SlotOptimizer names
it). With --settings the constants are not the defaults (train.adam_beta1/2, adam_epsilon,
adafactor_*), and parameter 3 (a vector) is in a parameter group without weight decay
(train.no_weight_decay), as HF Trainer groups its parameters.
"""
import math
import sys

import torch
from safetensors.torch import save_file

SHAPES = [(64, 96), (17, 300), (3, 20, 30), (96,), (5000,)]
SCALES = [1.0, 0.5, 1.0, 1.0, 0.25, 1.0]
HYPER = {"adafactor": (1e-2, 0.1), "lion": (1e-3, 0.1), "adamw_8bit": (1e-2, 0.1),
         "adamw": (1e-2, 0.1)}
# [beta1, beta2, eps, adafactor eps[0], clip_threshold, decay_rate, undecayed parameter]
DEFAULTS = {"adafactor": [0, 0, 0, 1e-30, 1.0, -0.8, -1], "lion": [0.9, 0.99, 0, 0, 0, 0, -1],
            "adamw_8bit": [0.9, 0.95, 1e-8, 0, 0, 0, -1], "adamw": [0.9, 0.95, 1e-8, 0, 0, 0, -1]}
SETTINGS = {"adafactor": [0, 0, 0, 1e-20, 0.5, -0.6, 3], "lion": [0.8, 0.95, 0, 0, 0, 0, 3],
            "adamw_8bit": [0.85, 0.99, 1e-6, 0, 0, 0, 3], "adamw": [0.85, 0.99, 1e-6, 0, 0, 0, 3]}


def groups(params, wd, settings):
    """HF Trainer's two parameter groups: with weight decay, and the undecayed one without."""
    skip = int(settings[6])
    if skip < 0:
        return [{"params": params, "weight_decay": wd}]
    return [{"params": [p for i, p in enumerate(params) if i != skip], "weight_decay": wd},
            {"params": [params[skip]], "weight_decay": 0.0}]


def adafactor(params, lr, wd, settings):
    from transformers.optimization import Adafactor

    opt = Adafactor(groups(params, wd, settings), lr=lr, relative_step=False,
                    scale_parameter=False, warmup_init=False, eps=(settings[3], 1e-3),
                    clip_threshold=settings[4], decay_rate=settings[5])

    def state(i, p):
        st = opt.state[p]
        if "exp_avg_sq_row" in st:
            return {"factors": torch.cat([st["exp_avg_sq_row"].reshape(-1),
                                          st["exp_avg_sq_col"].reshape(-1)])}
        return {"factors": st["exp_avg_sq"].reshape(-1)}

    return opt.step, state


def lion(params, lr, wd, settings):
    from lion_pytorch import Lion

    opt = Lion(groups(params, wd, settings), lr=lr, betas=(settings[0], settings[1]))
    return opt.step, lambda i, p: {"exp_avg": opt.state[p]["exp_avg"].reshape(-1)}


def adamw(params, lr, wd, settings):
    opt = torch.optim.AdamW(groups(params, wd, settings), lr=lr, betas=(settings[0], settings[1]),
                            eps=settings[2])
    return opt.step, lambda i, p: {"exp_avg": opt.state[p]["exp_avg"].reshape(-1),
                                   "exp_avg_sq": opt.state[p]["exp_avg_sq"].reshape(-1)}


def nearest(x, code):
    """The index of the code nearest each x (the lower one of two as near): what the kernel's
    quantize_2D finds. bitsandbytes' CPU quantize_blockwise finds it too, except next to -1: it
    sets its map's first value (-0.9930) to -1 for its binary search, which the kernel does not."""
    return (x.unsqueeze(-1) - code).abs().argmin(-1)


def adamw_8bit(params, lr, wd, settings):
    import bitsandbytes.functional as F

    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # the kernel's float arithmetic
    b1, b2, eps, rate = f32(settings[0]), f32(settings[1]), f32(settings[2]), f32(lr)
    skip = int(settings[6])
    q1, q2 = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    states = {}
    step = [0]

    def update():
        step[0] += 1
        t = f32(step[0])
        correction1 = 1.0 - torch.pow(b1, t)
        correction2 = torch.sqrt(1.0 - torch.pow(b2, t))
        step_size = -rate * correction2 / correction1
        for index, p in enumerate(params):
            decay = f32(0.0 if index == skip else wd)
            g = p.grad.reshape(-1)
            n = p.numel()
            st = states.setdefault(p, {})
            if n < 4096:  # min_8bit_size: 32-bit state
                m = st.setdefault("exp_avg", torch.zeros(n))
                v = st.setdefault("exp_avg_sq", torch.zeros(n))
                m.copy_(m * b1 + (1.0 - b1) * g)
                v.copy_(v * b2 + (1.0 - b2) * g * g)
                s1, s2 = m, v
            else:
                blocks = (n + 255) // 256
                c1 = st.setdefault("exp_avg.codes", torch.zeros(n, dtype=torch.uint8))
                c2 = st.setdefault("exp_avg_sq.codes", torch.zeros(n, dtype=torch.uint8))
                a1 = st.setdefault("exp_avg.absmax", torch.zeros(blocks))
                a2 = st.setdefault("exp_avg_sq.absmax", torch.zeros(blocks))
                block = torch.arange(n) // 256
                s1 = q1[c1.long()] * a1[block] * b1 + (1.0 - b1) * g
                s2 = q2[c2.long()] * a2[block] * b2 + (1.0 - b2) * g * g
                new_a1 = torch.zeros(blocks).index_reduce_(0, block, s1.abs(), "amax")
                new_a2 = torch.zeros(blocks).index_reduce_(0, block, s2.abs(), "amax")
                new1 = nearest(s1 / new_a1[block], q1)
                new2 = nearest(s2 / new_a2[block], q2)
                wrong = torch.signbit(q1[new1]) != torch.signbit(s1)
                new1 = torch.where(wrong, torch.where(s1 > 0, new1 + 1, new1 - 1), new1)
                c1.copy_(new1.to(torch.uint8))
                c2.copy_(new2.to(torch.uint8))
                a1.copy_(new_a1)
                a2.copy_(new_a2)
            flat = p.data.reshape(-1)
            flat.copy_(flat + step_size * (s1 / (torch.sqrt(s2) + eps * correction2)))
            flat.copy_(flat * (1.0 - rate * decay))

    update.maps = {"map.signed": q1, "map.unsigned": q2}
    return update, lambda i, p: dict(states[p])


def main():
    kind, out = sys.argv[1], sys.argv[2]
    settings = (SETTINGS if "--settings" in sys.argv[3:] else DEFAULTS)[kind]
    lr, wd = HYPER[kind]
    torch.manual_seed(7)
    params = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) * (0.1 + i) for i, s in enumerate(SHAPES)] for _ in SCALES]
    inputs = {f"param.{i}": p.clone() for i, p in enumerate(params)}
    for k, step_grads in enumerate(grads):
        for i, g in enumerate(step_grads):
            inputs[f"grad.{k}.{i}"] = g
    inputs["grad_scale"] = torch.tensor(SCALES, dtype=torch.float32)
    inputs["hyper"] = torch.tensor([lr, wd], dtype=torch.float32)
    inputs["settings"] = torch.tensor(settings, dtype=torch.float64)
    save_file(inputs, f"{out}/input.safetensors")

    params = [torch.nn.Parameter(p) for p in params]
    step, state = {"adafactor": adafactor, "lion": lion, "adamw_8bit": adamw_8bit,
                   "adamw": adamw}[kind](params, lr, wd, settings)
    for scale, step_grads in zip(SCALES, grads):
        for p, g in zip(params, step_grads):
            p.grad = g * scale
        step()
    expected = {f"param.{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for name, t in state(i, p).items():
            expected[f"state.{i}.{name}"] = t.clone().contiguous()
    expected.update(getattr(step, "maps", {}))
    save_file(expected, f"{out}/expected.safetensors")


if __name__ == "__main__":
    main()
