#!/usr/bin/env python3
"""PyTorch reference for bench/gpu_bench.sh: the GPT trainyard-trainer trains (token and position
embeddings, pre-norm blocks with a fused qkv projection and a 4x GELU MLP, final LayerNorm, head
tied to the token embedding or not), or with --arch llama its Llama (transformers' LlamaForCausalLM
written plainly: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, no biases), on one GPU, as a PyTorch user would write it today: bf16
autocast with fp32 master weights, scaled_dot_product_attention (flash attention), fused AdamW
(betas 0.9, 0.95, the trainer's), gradient clipping, eager or torch.compile. The same
initialisation scale (N(0, 0.02)) and random tokens; only speed and memory are compared.

Prints one JSON line: tokens_per_second (median over the timed steps), step_ms, peak_bytes.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, n_head, gelu="none"):
        super().__init__()
        self.n_head = n_head
        self.gelu = gelu  # "none": the exact GELU; "tanh": GPT-2's own (gelu_new)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return h + self.fc_out(F.gelu(self.fc(self.ln2(h)), approximate=self.gelu))


class RmsNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):  # transformers' LlamaRMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaLayer(nn.Module):
    def __init__(self, d, n_head, n_kv_head, d_hidden):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, d // n_head
        self.input_layernorm = RmsNorm(d)
        self.q_proj = nn.Linear(d, n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.v_proj = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.o_proj = nn.Linear(n_head * self.hd, d, bias=False)
        self.post_attention_layernorm = RmsNorm(d)
        self.gate_proj = nn.Linear(d, d_hidden, bias=False)
        self.up_proj = nn.Linear(d, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.n_head, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.n_kv_head, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.n_kv_head, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_head != self.n_head)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, n_layer, n_head, n_kv_head, d, d_hidden, seq_len, vocab, tie, rope_theta):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaLayer(d, n_head, n_kv_head, d_hidden)
                                    for _ in range(n_layer))
        self.norm = RmsNorm(d)
        self.lm_head = None if tie else nn.Linear(d, vocab, bias=False)
        hd = d // n_head
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        emb = torch.outer(torch.arange(seq_len).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.embed_tokens(idx)
        cos, sin = self.cos[:t], self.sin[:t]
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        logits = x @ self.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class Gpt(nn.Module):
    def __init__(self, n_layer, n_head, d, seq_len, vocab, tie, gelu="none"):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, n_head, gelu) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = None if tie else nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = x @ self.tok_emb.weight.t() if self.head is None else self.head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--n-kv-head", type=int, default=0)
    ap.add_argument("--d-hidden", type=int, default=0)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--n-layer", type=int, required=True)
    ap.add_argument("--n-head", type=int, required=True)
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--gelu", choices=["none", "tanh"], default="none",
                    help="gpt: the MLP's GELU, exact or tanh's approximation (the spec's "
                         "model.activation gelu or gelu_tanh)")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--profile", default="",
                    help="then 3 more steps (not timed) traced into this Chrome trace "
                         "(bench/trace_summary.py)")
    a = ap.parse_args()

    torch.manual_seed(1)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    if a.arch == "llama":
        model = Llama(a.n_layer, a.n_head, a.n_kv_head or a.n_head, a.d_model, a.d_hidden,
                      a.seq_len, a.vocab, a.tie, a.rope_theta).to(dev)
    else:
        model = Gpt(a.n_layer, a.n_head, a.d_model, a.seq_len, a.vocab, a.tie, a.gelu).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)
    step_fn = torch.compile(model) if a.compile else model
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=g)
               for _ in range(4)]
    times = []
    torch.cuda.reset_peak_memory_stats()
    profiler = None
    for i in range(a.steps + (3 if a.profile else 0)):
        if i == a.steps:  # --profile: the traced steps, after the timed ones
            torch.cuda.synchronize()
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        start = time.perf_counter()
        w = batches[i % len(batches)].pin_memory().to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = step_fn(w[:, :-1], w[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # as the trainer: the step's loss on the host
        if a.warmup_steps <= i < a.steps:
            times.append(time.perf_counter() - start)
    if profiler is not None:
        torch.cuda.synchronize()
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(a.profile)
    step_s = statistics.median(times)
    print(json.dumps({"tokens_per_second": a.batch * a.seq_len / step_s, "step_ms": step_s * 1e3,
                      "peak_bytes": torch.cuda.max_memory_allocated(),
                      "parameters": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
