"""Built-in models: the demo's transformer block, and the zoo tests and benchmarks use.

Small, dependency-free PyTorch modules covering the patterns the planner must
handle: matmul epilogues, LayerNorm/RMSNorm, softmax attention, rotary
embeddings, gated MLPs, conv + BatchNorm.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128, out: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(F.gelu(self.fc1(x)))))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class TransformerBlock(nn.Module):
    """Pre-norm encoder block: causal attention, LayerNorm, GELU MLP, residuals."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 256):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    """LLaMA-style decoder block: RMSNorm, rotary embeddings, SiLU-gated MLP."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 172, max_seq: int = 256):
        super().__init__()
        self.heads = heads
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        head_dim = dim // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(max_seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        out = torch.softmax(scores.float(), dim=-1).to(x.dtype) @ v
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ConvBNReLU(nn.Module):
    """Conv + BatchNorm + ReLU (eval without grad: one oneDNN call, lowering/conv.py)."""

    def __init__(self, cin: int = 3, cout: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class LayerNormGeluResidual(nn.Module):
    """The LayerNorm -> GELU -> residual chain the planner should fuse."""

    def __init__(self, dim: int = 1024):
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x):
        return x + F.gelu(self.ln(x), approximate="tanh")


ZOO = {
    "mlp": (lambda: MLP(), lambda: (torch.randn(8, 64),)),
    "transformer": (lambda: TransformerBlock(), lambda: (torch.randn(2, 16, 64),)),
    "llama": (lambda: LlamaBlock(), lambda: (torch.randn(2, 16, 64),)),
    "conv_bn_relu": (lambda: ConvBNReLU(), lambda: (torch.randn(2, 3, 8, 8),)),
    "ln_gelu_residual": (lambda: LayerNormGeluResidual(256), lambda: (torch.randn(4, 32, 256),)),
}


# Every built-in model: the small zoo (tests, calibration) plus the demo's model,
# large enough that kernel time, not per-call overhead, dominates.
MODELS = {
    **ZOO,
    "gpt_block": (lambda: TransformerBlock(512, 8, 2048), lambda: (torch.randn(4, 256, 512),)),
}


def build(name: str, seed: int = 0):
    """(model, example inputs) of a built-in model, deterministic for a seed."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; built-in models: {sorted(MODELS)}")
    torch.manual_seed(seed)
    make_model, make_inputs = MODELS[name]
    return make_model().eval(), make_inputs()
