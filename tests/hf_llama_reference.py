"""Reference outputs of Hugging Face transformers' LlamaForCausalLM for tests/llama_reference_test.

Builds a small random Llama with transformers itself, saves it with save_pretrained (sharded), and
writes what the model computes on fixed tokens into reference.safetensors beside it:
  tokens       int64 [batch, seq + 1]
  logits       float32 [batch, seq + 1, vocab] of the whole window
  loss         float32 [] (labels = tokens: the mean next-token cross-entropy)
  grad.<name>  float32, the loss's gradient for each parameter, by its state-dict name

  hf_llama_reference.py OUT_DIR VARIANT [DTYPE]
  train_losses float32 [10]: the losses of 10 steps of torch.optim.AdamW (lr 1e-2, betas 0.9 and
               0.95, eps 1e-8, no weight decay) on those tokens, from the saved weights

VARIANT: mha (4 heads), gqa (4 query heads, 2 key-value heads, llama3 rope scaling), tied (tied
embeddings); gelu, gelu_tanh, relu (mha with hidden_act gelu, gelu_pytorch_tanh, relu); mistral
(MistralForCausalLM with a sliding window of 5 positions, shorter than the tokens); qwen2 and
qwen2_tied (Qwen2ForCausalLM: q/k/v biases, two key-value heads). DTYPE: float32 (default),
bfloat16 or float16 for the saved weights (the outputs are always those of the float32 model).

With --check-export DIR: loads a model directory trainyard exported, runs it on OUT_DIR's tokens,
and writes DIR/transformers_logits.safetensors (the logits transformers computes with it).

  hf_llama_reference.py --lora OUT_DIR [VARIANT]
LoRA with PEFT: the VARIANT base (default gqa) saved into OUT_DIR as above, then PEFT's LoRA (r 4, alpha 8, every
projection targeted) with random A and B saved by save_pretrained into OUT_DIR/adapter, and what
the adapted model computes into OUT_DIR/lora_reference.safetensors: tokens, logits, loss and
grad.<name> for each adapter matrix, named as in the adapter file.

  hf_llama_reference.py --check-adapter OUT_DIR ADAPTER_DIR
Loads OUT_DIR's base with the adapter trainyard exported into ADAPTER_DIR (PeftModel) and writes
ADAPTER_DIR/peft_logits.safetensors.
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

MHA = dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
VARIANTS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "gelu": dict(MHA, hidden_act="gelu"),
    "gelu_tanh": dict(MHA, hidden_act="gelu_pytorch_tanh"),
    "relu": dict(MHA, hidden_act="relu"),
    "mistral": dict(MHA, num_key_value_heads=2, sliding_window=5),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  use_sliding_window=False),
    "qwen2_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                       use_sliding_window=False),
}
CONFIGS = {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen2_tied": Qwen2Config}
TRAIN_STEPS = 10


def forward_backward(model, tokens):
    """Tokens, logits and loss of one step on `tokens`, after its backward."""
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    return {
        "tokens": tokens,
        "logits": out.logits.detach().float().contiguous(),
        "loss": out.loss.detach().float().reshape(()),
    }


def reference(out_dir, variant, dtype):
    torch.manual_seed(7)
    config = CONFIGS.get(variant, LlamaConfig)(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        max_position_embeddings=64,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
        **VARIANTS[variant],
    )
    model = AutoModelForCausalLM.from_config(config).float()
    # Norm weights away from 1, so that a norm without its weight shows; biases away from 0.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    saved = model.to(getattr(torch, dtype))
    saved.save_pretrained(out_dir, max_shard_size="20KB", safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tokens = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    tensors = forward_backward(model, tokens)
    for name, p in model.named_parameters():
        if p.grad is not None:
            tensors["grad." + name] = p.grad.detach().float().clone()  # zero_grad reuses it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0)
    losses = []
    for _ in range(TRAIN_STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    tensors["train_losses"] = torch.tensor(losses, dtype=torch.float32)
    save_file(tensors, f"{out_dir}/reference.safetensors")


def logits_of(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().contiguous()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_reference(out_dir, variant):
    from peft import LoraConfig, get_peft_model

    reference(out_dir, variant, "float32")
    base = AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS))
    torch.manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))  # B too, so that the adapters change the output
    model.save_pretrained(f"{out_dir}/adapter")
    model.eval()
    tensors = forward_backward(model, load_file(f"{out_dir}/reference.safetensors")["tokens"])
    trained = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            trained += 1
            # "base_model.model.<name>.lora_A.default.weight" -> the adapter file's name
            tensors["grad." + name.replace(".default", "")] = p.grad.detach().float().contiguous()
        else:
            assert p.grad is None, name
    assert trained == 2 * len(LORA_TARGETS) * base.config.num_hidden_layers, trained
    save_file(tensors, f"{out_dir}/lora_reference.safetensors")


def check_adapter(base_dir, adapter_dir):
    from peft import PeftModel

    tokens = load_file(f"{base_dir}/reference.safetensors")["tokens"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, adapter_dir)
    save_file({"logits": logits_of(model, tokens)}, f"{adapter_dir}/peft_logits.safetensors")


def main():
    if sys.argv[1] == "--lora":
        lora_reference(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "gqa")
        return
    if sys.argv[1] == "--check-adapter":
        check_adapter(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1] == "--check-export":
        tokens = load_file(f"{sys.argv[2]}/reference.safetensors")["tokens"]
        model = AutoModelForCausalLM.from_pretrained(sys.argv[3], attn_implementation="eager")
        save_file({"logits": logits_of(model, tokens)}, f"{sys.argv[3]}/transformers_logits.safetensors")
        return
    reference(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "float32")


if __name__ == "__main__":
    main()
