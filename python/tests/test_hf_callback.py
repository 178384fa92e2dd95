"""trainyard.hf.TrainyardCallback: a Hugging Face Trainer script (a tiny Llama, two CPU ranks under
DDP, in build/hf-venv's transformers over Debian's torch) run as a command job on a real local
cluster with preemption: its logs are `yard metrics` rows, `yard checkpoint` is answered with a
Trainer checkpoint that describe shows, and a preemption saves, requeues and resumes from it."""
import os
import pathlib
import sys
import time

import trainyard
from trainyard.v1 import job_pb2

from conftest import SDK, program  # noqa: E402  (shared helpers)

HF_PYTHON = pathlib.Path(__file__).resolve().parents[2] / "build" / "hf-venv" / "bin" / "python"

TRAINER_SCRIPT = """
    import os, sys, time
    sys.path.insert(0, {sdk!r})
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments, default_data_collator)
    import trainyard
    from trainyard.hf import TrainyardCallback, last_checkpoint

    if not hasattr(torch.cpu, "device_count"):  # Debian's torch 1.13; transformers asks 2.x's
        torch.cpu.device_count = lambda: 1
        torch.cpu.set_device = lambda device: None
        load = torch.load  # 1.13 cannot map onto "cpu:0", accelerate's device name

        def load_on_cpu(*args, map_location=None, **kwargs):
            if str(map_location).startswith("cpu"):
                map_location = "cpu"
            return load(*args, map_location=map_location, **kwargs)

        torch.load = load_on_cpu

    class Paced(TrainerCallback):  # steps slow enough for the test to act between them
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(float(sys.argv[2]))

    ctx = trainyard.init()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, vocab_size=64,
                                         max_position_embeddings=32))
    tokens = torch.randint(0, 64, (256, 16), generator=torch.Generator().manual_seed(0))
    data = [{{"input_ids": t, "labels": t}} for t in tokens]
    args = TrainingArguments(output_dir=ctx.checkpoint_dir, max_steps=int(sys.argv[1]),
                             per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    resume = last_checkpoint(args.output_dir)
    if resume:
        print(f"resumed from {{os.path.basename(resume)}}", flush=True)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=default_data_collator,
                      callbacks=[TrainyardCallback(ctx), Paced()])
    trainer.train(resume_from_checkpoint=resume)
    print(f"train() returned at step {{trainer.state.global_step}}", flush=True)
"""


def test_a_trainer_script_reports_checkpoints_on_request_and_resumes_after_preemption(
        preemptive_cluster, tmp_path):
    assert HF_PYTHON.exists(), "scripts/setup.sh makes build/hf-venv"
    folder = program(tmp_path, TRAINER_SCRIPT.format(sdk=SDK))
    with trainyard.Client(preemptive_cluster["address"], preemptive_cluster["token"]) as client:
        job = client.submit(name="hf-trainer", gpus=2, priority=10, workdir=str(folder),
                            command=[str(HF_PYTHON), "train.py", "120", "0.05"])
        report = None
        for report in client.metrics(job.id, follow=True, timeout=180):
            if report.step >= 3:
                break
        assert report is not None, (client.describe(job.id).message,
                                    [line.text for line in client.logs(job.id)])
        assert report.loss > 0 and report.lr > 0 and "grad_norm" in report.metrics, report

        # yard checkpoint: a Trainer checkpoint at the end of the current step, reported.
        assert client.checkpoint(job.id).state == job_pb2.CHECKPOINTING
        deadline = time.time() + 120
        while client.describe(job.id).last_checkpoint.step == 0 and time.time() < deadline:
            time.sleep(0.1)  # the next step ends and rank 0 reports what it saved
        requested = client.describe(job.id).last_checkpoint
        assert requested.step >= 3 and requested.path.endswith(f"checkpoint-{requested.step}")
        assert (pathlib.Path(requested.path) / "trainer_state.json").is_file()

        # A preemption: the Trainer saves and returns, the job is requeued and resumes.
        high = client.submit(name="urgent", gpus=2, priority=90, command=["/bin/true"])
        assert client.wait(high.id, timeout=180).state == job_pb2.SUCCEEDED
        done = client.wait(job.id, timeout=300)
        lines = [(line.attempt, line.rank, line.text) for line in client.logs(job.id)]
        assert done.preemptions == 1 and done.attempt == 2 and done.restarts == 0, (done, lines)
        stopped = [t for a, r, t in lines if a == 1 and r == 0 and t.startswith("train() returned")]
        resumed = [t for a, r, t in lines if a == 2 and r == 0 and t.startswith("resumed from")]
        assert stopped and resumed, lines
        stop_step = int(stopped[0].split()[-1])
        assert stop_step > requested.step
        assert resumed == [f"resumed from checkpoint-{stop_step}"], lines
        assert (2, 0, "train() returned at step 120") in lines
        assert done.last_checkpoint.step == stop_step
        assert os.path.isdir(done.last_checkpoint.path)
