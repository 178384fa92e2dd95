"""A Hugging Face `transformers.Trainer` callback for trainyard (`import trainyard.hf`; needs
transformers): a Trainer script runs as a command job with nothing else to write.

    from trainyard.hf import TrainyardCallback, last_checkpoint
    ctx = trainyard.init()
    args = TrainingArguments(output_dir=ctx.checkpoint_dir, ...)   # shared by the job's attempts
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[TrainyardCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

What it does, as DeepSpeed's and Determined's Trainer integrations do:
- each `logs` the Trainer writes (loss, learning_rate, grad_norm, eval_*, ...) reaches
  `yard metrics` (and Prometheus) from rank 0, step by step;
- `yard checkpoint` makes the Trainer save a checkpoint (checkpoint-N in output_dir) at the end of
  the current step, on every rank at once, and rank 0 reports it (`yard describe` shows it);
- a preemption makes it save and stop training: the script returns from `train()`, exits 0, and
  the next attempt resumes from that checkpoint; so does a cancel or SIGTERM, within the job's
  stop grace (its spec's stop_grace, else the worker's --stop-grace, 10 s by default);
- every checkpoint the Trainer saves (save_steps, ...) is reported.
The ranks agree on the job's commands with one all-reduce of two flags per step (torch.distributed,
when the Trainer runs distributed), so that they save and stop at the same step.
"""
import glob
import os
import re

from transformers import TrainerCallback

import trainyard


def last_checkpoint(output_dir):
    """The Trainer checkpoint to resume from: the highest-numbered checkpoint-N in `output_dir`
    that is complete (its trainer_state.json written, which the Trainer does last), or None."""
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*")):
        match = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(path))
        if match and os.path.isfile(os.path.join(path, "trainer_state.json")):
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def _agree(flags):
    """The flags (0/1 each) OR-ed over the ranks of torch.distributed's default group."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return flags
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flags
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(x) for x in tensor.tolist()]


def _numbers(logs):
    out = {}
    for name, value in (logs or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name] = float(value)
    return out


class TrainyardCallback(TrainerCallback):
    """Reports a Trainer's logs and checkpoints to trainyard and answers its commands (see the
    module's docstring). `context`: a trainyard.Context (default: trainyard.init())."""

    def __init__(self, context=None):
        self.ctx = context if context is not None else trainyard.init()
        self._logs = {}
        self._reported = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        numbers = _numbers(logs)
        self._logs.update(numbers)
        step = state.global_step
        if step <= 0:
            return
        extra = {k: v for k, v in self._logs.items()
                 if k not in ("loss", "learning_rate", "epoch", "step")}
        self.ctx.report(step, loss=self._logs.get("loss", 0.0), total_steps=state.max_steps,
                        lr=self._logs.get("learning_rate", 0.0), **dict(list(extra.items())[:60]))
        self._reported = step

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        # A step the Trainer logs is reported from on_log, which comes after this with the
        # step's loss; one without logs is reported here (a row of yard metrics, and the job's
        # commands). Either way the ranks act on the commands of the last report.
        if state.is_world_process_zero and step > self._reported and not control.should_log:
            self.ctx.report(step, loss=self._logs.get("loss", 0.0), total_steps=state.max_steps,
                            lr=self._logs.get("learning_rate", 0.0))
            self._reported = step
        checkpoint, stop = _agree([int(self.ctx.checkpoint_requested()),
                                   int(self.ctx.should_stop())])
        if checkpoint or stop:
            control.should_save = True
        if stop:
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        size = 0
        for root, _, files in os.walk(path):
            size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        self.ctx.report_checkpoint(state.global_step, path, size)


__all__ = ["TrainyardCallback", "last_checkpoint"]
