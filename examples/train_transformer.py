"""Train a small transformer with FSDP (batch axis) + tensor parallelism (model axis), beside one process.

Run (8 CPU ranks: batch=4 × model=2)::

    torchrun --nproc-per-node 8 examples/train_transformer.py --batch 4 --model 2 --steps 5

The model is built on the meta device and initialized mesh-independently (seed 0), so rank 0
can build the very same weights in one process and train them on the whole global batch: each
step prints the parallel loss beside the one-process loss.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

import mesh3d
from mesh3d import DistributedManager, Plan, parallelize
from mesh3d.parallel.init import capture_init_specs, materialize


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1: under tensor parallelism each rank holds n_heads / model heads.
        q, k, v = (w(h).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, n_heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def make_plan(**batch_options) -> Plan:
    return Plan(
        model={
            "tok": "rowwise",
            "layers.*.w[qkv]": "colwise",
            "layers.*.wo": "rowwise",
            "layers.*.up": "colwise",
            "layers.*.down": "rowwise",
            "head": ColwiseParallel(output_layouts=Replicate()),   # whole logits for the loss
        },
        **batch_options,
    )


def global_batch(step: int, n: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def token_loss_sum(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=-1)
    parser.add_argument("--model", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--per-rank", type=int, default=2, help="samples per batch rank")
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()

    dm = DistributedManager.initialize(batch=args.batch, domain=1, model=args.model)
    with torch.device("meta"):
        model = Transformer()
    specs = capture_init_specs(model)                 # for the one-process twin below
    model = parallelize(model, make_plan(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    twin = None
    if dm.rank == 0:                                  # the same weights, in one process
        with torch.device("meta"):
            twin = Transformer()
        materialize(twin, specs, seed=0, init_fn=None, device=torch.device("cpu"))
        twin_opt = torch.optim.AdamW(twin.parameters(), lr=3e-3)

    B, b, n = dm.axis_size("batch"), dm.axis_rank("batch"), args.per_rank
    for step in range(args.steps):
        x, y = global_batch(step, B * n, args.seq, 256)
        xs, ys = x[b * n:(b + 1) * n], y[b * n:(b + 1) * n]
        loss = mesh3d.global_mean_loss(token_loss_sum(model, xs, ys), ys.numel())
        loss.backward()
        mesh3d.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        shown = loss.detach().clone()
        dist.all_reduce(shown, group=dm.group("batch_domain"))
        shown /= B
        if twin is not None:
            ref = token_loss_sum(twin, x, y) / y.numel()
            ref.backward()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
            twin_opt.step()
            twin_opt.zero_grad()
            print(f"step {step}  loss {shown.item():.6f}  one-process {ref.item():.6f}  "
                  f"(mesh batch={B} model={dm.axis_size('model')})", flush=True)
    DistributedManager.shutdown()


if __name__ == "__main__":
    main()
