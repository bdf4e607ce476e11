"""A Llama-style decoder (RMSNorm, causal attention, SwiGLU MLP) for planning and checking long-sequence jobs.

Usage::

    mesh3d plan examples/llama_decoder.py:llama_8b --world 4096 --batch 32 --domain 16 --model 8 \\
        --input 1x131072 --dtype int64 --shard-dims 1 --plan examples/llama_decoder.py:PLAN --device-memory 80GiB
    mesh3d check examples/llama_decoder.py:tiny --input 2x24 --dtype int64 --shard-dims 1 \\
        --plan examples/llama_decoder.py:PLAN

The sequence is split over the domain axis (causal attention gathers keys and values, with global
positions); the projections are tensor parallel over the model axis (heads split whole), FSDP runs over
batch x domain. Positions are learned, one per token of the sequence the model is built for (``max_seq``: the
input's length), and added whole; rotary embeddings would index their tables with ``domain.positions(x)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mesh3d import Plan


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))
        b, t = q.shape[:2]  # -1 heads: each model rank holds n_heads / model of them
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False), \
            nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, n_heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), SwiGLU(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, n_heads: int, hidden: int, layers: int, max_seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(max_seq, dim))  # sequence first: FSDP cuts dim 0
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos  # the whole table: on a sequence shard, mesh3d adds this rank's rows
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


#: Heads and the MLP split over the model axis; the vocabulary projection whole (its logits feed the loss).
PLAN = Plan(model={"layers.*.attn.w[qkv]": "colwise", "layers.*.attn.wo": "rowwise",
                   "layers.*.mlp.w[13]": "colwise", "layers.*.mlp.w2": "rowwise"}, batch="fsdp")

#: The same with bf16 compute (FSDP's mixed precision: fp32 weights, gradients and optimizer state).
PLAN_BF16 = Plan(model=PLAN.model, batch="fsdp", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def llama_8b() -> Decoder:
    """Llama-3-8B's shapes (32 layers, dim 4096, 32 heads, SwiGLU 14336, vocabulary 128256), 128 Ki positions."""
    return Decoder(vocab=128256, dim=4096, n_heads=32, hidden=14336, layers=32, max_seq=131072)


def tiny() -> Decoder:
    """The same architecture, small enough to check against one process in seconds."""
    return Decoder(vocab=32, dim=16, n_heads=4, hidden=24, layers=2, max_seq=24)
