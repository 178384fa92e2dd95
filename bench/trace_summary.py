#!/usr/bin/env python3
"""Where a step's GPU time goes, from Chrome traces of a few steps (trainyard-trainer's
--profile-steps, bench/gpu_reference.py's --profile): each trace's kernel, copy and set time per
step by class (matrix products, attention, normalisation, loss, optimizer, element-wise, reductions,
copies; torch.compile's Triton kernels as pointwise or reduction), then its largest kernels. Prints
Markdown.

    python3 bench/trace_summary.py --steps 3 LABEL=TRACE.json [LABEL=TRACE.json ...]
"""
import argparse
import collections
import gzip
import json
import re

CLASSES = [  # (class, pattern on the kernel's name), first match wins
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matrix products", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm\d+_.*_tn|Kernel2"),
    ("optimizer", r"adam|multi_tensor_apply|foreach"),
    ("loss", r"cross_entropy|nll_loss|softmax|log_softmax"),
    ("normalisation", r"layer_norm|layernorm|rms_norm|rmsnorm|LayerNorm|RowwiseMoments"),
    ("triton pointwise", r"triton_poi"),
    ("triton reduction", r"triton_(red|per)"),
    ("triton other", r"triton"),
    ("reductions", r"reduce|Reduce|norm"),
    ("copies and casts", r"copy|Copy|cat_|CatArray|index|gather|scatter|embedding"),
    ("element-wise", r"elementwise|vectorized|unrolled|gelu|Gelu|silu|mul|add"),
]


def classify(name):
    for label, pattern in CLASSES:
        if re.search(pattern, name):
            return label
    return "other"


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def summarize(label, path, steps, top):
    by_name = collections.Counter()
    calls = collections.Counter()
    for e in load(path):
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        name = e.get("name", "?") if cat == "kernel" else cat
        by_name[name] += float(e["dur"])
        calls[name] += 1
    total = sum(by_name.values())
    by_class = collections.Counter()
    for name, us in by_name.items():
        by_class["copies and casts" if name.startswith("gpu_mem") else classify(name)] += us
    print(f"\n#### {label}: {total / steps / 1e3:.2f} ms of GPU time a step "
          f"({sum(calls.values()) / steps:.0f} kernels, copies and sets)\n")
    print("| class | ms a step | share |\n|---|---|---|")
    for cls, us in by_class.most_common():
        print(f"| {cls} | {us / steps / 1e3:.2f} | {100 * us / total:.1f}% |")
    print(f"\n| largest kernels ({label}) | calls a step | ms a step |\n|---|---|---|")
    for name, us in by_name.most_common(top):
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| `{short.replace('|', '/')}` | {calls[name] / steps:g} | {us / steps / 1e3:.3f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True, help="steps each trace holds")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("traces", nargs="+", help="LABEL=PATH")
    a = ap.parse_args()
    for item in a.traces:
        label, _, path = item.partition("=")
        summarize(label, path, a.steps, a.top)


if __name__ == "__main__":
    main()
