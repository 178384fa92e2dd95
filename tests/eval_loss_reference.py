"""The held-out loss trainyard's evaluation (train.eval_every) must report, computed by Hugging Face
transformers itself from a model directory trainyard exported (tests/model_e2e_test.cc).

  eval_loss_reference.py MODEL_DIR TOKENS MASK SEQ_LEN WINDOWS

TOKENS: little-endian uint16 tokens; MASK: one 0/1 byte per token, or "-" for none. Window i is
tokens [i * SEQ_LEN, i * SEQ_LEN + SEQ_LEN + 1) (the trainer's windows), for i < WINDOWS; each
target is weighted by its token's mask byte. Prints {"loss": sum(weighted cross-entropy) /
sum(weights), "count": sum(weights)} as JSON.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main():
    model_dir, tokens_path, mask_path, seq_len, windows = sys.argv[1:6]
    seq_len, windows = int(seq_len), int(windows)
    tokens = torch.frombuffer(bytearray(open(tokens_path, "rb").read()), dtype=torch.int16)
    tokens = tokens.to(torch.int64) & 0xFFFF
    if mask_path == "-":
        mask = torch.ones(tokens.numel())
    else:
        mask = torch.frombuffer(bytearray(open(mask_path, "rb").read()), dtype=torch.uint8).float()
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    ids = torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(windows)])
    weights = torch.stack([mask[i * seq_len + 1:i * seq_len + seq_len + 1] for i in range(windows)])
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                           ids[:, 1:].reshape(-1), reduction="none")
    total = (ce * weights.reshape(-1)).double().sum().item()
    count = weights.sum().item()
    print(json.dumps({"loss": total / count, "count": count}))


if __name__ == "__main__":
    main()
