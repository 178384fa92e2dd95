"""Learning rates of transformers' schedulers, for tests/lr_schedule_test.cc.

    python lr_schedule_reference.py OUT.json CASES_JSON

CASES_JSON: a list of {"name": get_scheduler's name, "steps": N, "warmup": W, "lr": LR,
"min_lr_rate": R (cosine_with_min_lr only)}. OUT.json receives, per case, the learning rate each
optimizer step (0-based) trains with, as a Trainer would step the scheduler after each.
"""
import json
import sys

import torch
from transformers import get_scheduler


def main():
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    results = []
    for case in cases:
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=case["lr"])
        kwargs = {"min_lr_rate": case["min_lr_rate"]} if "min_lr_rate" in case else None
        scheduler = get_scheduler(case["name"], optimizer, num_warmup_steps=case["warmup"],
                                  num_training_steps=case["steps"],
                                  scheduler_specific_kwargs=kwargs)
        lrs = []
        for _ in range(case["steps"]):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        results.append(lrs)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
