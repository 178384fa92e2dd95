#!/usr/bin/python3
"""Writes a small random Llama as a Hugging Face model directory, for examples/llama-lora.yaml.

  /usr/bin/python3 examples/make_tiny_llama.py [OUT_DIR]   (default /tmp/trainyard-tiny-llama)

OUT_DIR gets config.json (LlamaForCausalLM: 4 layers, hidden 64, 4 query heads sharing 2
key-value heads, byte vocabulary of 256) and model.safetensors in bfloat16, the way
save_pretrained writes a model of that size; weights drawn from seed 0: projections as
transformers initializes them (normal, std 0.02), norms 1, and the embedding and head wider
(std 1 and 0.3) so that frozen, as LoRA keeps them, they still let the adapters shape the logits
(a head of std 0.02 over a normalized hidden state caps every logit near 0.2). Needs only Debian's python3-torch: the safetensors file
(an 8-byte header length, a JSON header, the raw tensors) is written by hand.
"""

import json
import os
import struct
import sys

import torch

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def tensors(c):
    d, v, h = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    hd = d // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (d, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, d),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (h, d),
            p + "mlp.up_proj.weight": (h, d),
            p + "mlp.down_proj.weight": (d, h),
        })
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    generator = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in shapes.items():
        std = {"model.embed_tokens.weight": 1.0, "lm_head.weight": 0.3}.get(name, 0.02)
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.normal(0.0, std, shape, generator=generator)
    return out


def write_safetensors(path, named):
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in named.items():
        raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    os.replace(path + ".tmp", path)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/trainyard-tiny-llama"
    os.makedirs(out, exist_ok=True)
    named = tensors(CONFIG)
    write_safetensors(os.path.join(out, "model.safetensors"), named)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    count = sum(t.numel() for t in named.values())
    print(f"wrote a random Llama of {count} parameters to {out}")


if __name__ == "__main__":
    main()
