"""The anchor of bench/lora_bench.sh: PyTorch + PEFT LoRA on the same llama, one process.

  build/hf-venv/bin/python bench/lora_reference.py N_LAYER D_MODEL N_HEAD N_KV_HEAD D_HIDDEN \
      SEQ_LEN BATCH STEPS WARMUP THREADS [full]

Builds transformers' LlamaForCausalLM (random, seed 1, vocab 256, untied head, eager attention),
wraps it with PEFT's LoRA (r 8, alpha 16, every projection) unless `full`, and times STEPS AdamW
steps of BATCH windows of GPL-3's bytes after WARMUP untimed ones. Prints one line:
"TOKENS_PER_S MODEL_STATE_BYTES TRAINABLE": the median tokens/s over the timed steps and the model
state counted as trainyard's tracker counts it (4 bytes per parameter, 12 more per trained one:
gradient and AdamW's two moments).
"""

import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    n_layer, d, heads, kv, hidden, seq, batch, steps, warmup, threads = map(int, sys.argv[1:11])
    full = len(sys.argv) > 11 and sys.argv[11] == "full"
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=hidden, num_hidden_layers=n_layer,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
                         tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    if not full:
        from peft import LoraConfig, get_peft_model
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    data = torch.tensor(list(open("/usr/share/common-licenses/GPL-3", "rb").read()), dtype=torch.long)
    generator = torch.Generator().manual_seed(1)
    rates = []
    for step in range(warmup + steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
        tokens = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        begin = time.perf_counter()
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            rates.append(batch * seq / (time.perf_counter() - begin))
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in trained)
    print(int(statistics.median(rates)), 4 * total + 12 * trainable, trainable)


if __name__ == "__main__":
    main()
