"""Small models and helpers shared by the parallelize tests (imported on every rank)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ = 16, 16, 8, 32, 2, 6


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))
        # Shapes from the projections: under sequence parallelism x holds a sequence shard and
        # the projections gather it. -1 heads: each model rank holds n_heads / model of them.
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(dim), Attention(dim, n_heads), nn.LayerNorm(dim), MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, n_heads=HEADS, hidden=HIDDEN, layers=LAYERS) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def transformer_plan_model() -> dict:
    return {
        "tok": "rowwise",
        "layers.*.attn.w[qkv]": "colwise",
        "layers.*.attn.wo": "rowwise",
        "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise",
        # The loss needs whole logits: an instance with a Replicate output.
        "head": ColwiseParallel(output_layouts=Replicate()),
    }


def mlp_model(dim=DIM, hidden=HIDDEN) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.Tanh(), nn.Linear(dim, 4))


MLP_PLAN = {"0": "colwise", "2": "rowwise"}


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a parameter (gathers a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p).detach() for n, p in model.named_parameters()}


def make(kind: str, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = (Transformer() if kind == "transformer" else mlp_model()).to(dtype)
    return model, copy.deepcopy(model)


def batch_for(kind: str, n: int, seed: int, dtype=torch.float64):
    """(inputs, targets) of a global batch of ``n`` samples."""
    g = torch.Generator().manual_seed(seed)
    if kind == "transformer":
        tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(n, DIM, generator=g, dtype=dtype), torch.randn(n, 4, generator=g, dtype=dtype)


def loss_sum(kind: str, model: nn.Module, x, y):
    """Sum of per-sample losses (per-token for the transformer, averaged over its tokens)."""
    out = model(x)
    if kind == "transformer":
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1).sum()
    return ((out - y) ** 2).mean(1).sum()


def example_plan():
    """The transformer plan as a factory (for `mesh3d explain ... parallel_models:example_plan`)."""
    from mesh3d import Plan

    return Plan(model=transformer_plan_model())


def sequence_parallel_plan() -> dict:
    """Megatron-style sequence parallelism: norms work on sequence shards, projections gather/scatter."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    seq = Shard(1)
    return {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.ln[12]": "sequence",
        "layers.*.attn.w[qkv]": ColwiseParallel(input_layouts=seq),
        "layers.*.attn.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.mlp.up": ColwiseParallel(input_layouts=seq),
        "layers.*.mlp.down": RowwiseParallel(output_layouts=seq),
        "norm": "sequence",
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
