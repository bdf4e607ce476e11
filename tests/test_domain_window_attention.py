"""Hand-written window attention on sharded fields trains equal to one process (fp64, 3 SGD steps): a Swin block
(windows cut by ``view``/``permute``, shifted by ``torch.roll``, the shifted windows' attention mask built from a plain
image mask and added per window, a relative-position bias table, ``q @ k.transpose(-2, -1)`` and ``attn @ v`` per
window, ``shortcut + x`` after the reverse) sharded along its height or its width; and a 3-D Earth-style block
(Pangu-like (Z, H, W) windows, shifted) sharded along each of its three dims. Shards are uneven and cut windows (an
empty shard among them), at 2 and 3 ranks: losses, then parameters after each step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from domain_cases import trained_alike

TOL = 1e-10
D64 = torch.float64


class SwinBlock(nn.Module):
    """Swin's block on (B, H, W, C): norm, (shifted) window attention with relative-position bias, MLP."""

    def __init__(self, size: tuple[int, int], dim: int = 4, heads: int = 2, window: int = 4, shift: int = 0) -> None:
        super().__init__()
        self.size, self.heads, self.window, self.shift = size, heads, window, shift
        self.norm1, self.norm2 = nn.LayerNorm(dim, dtype=D64), nn.LayerNorm(dim, dtype=D64)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, dtype=D64), nn.Linear(dim, dim, dtype=D64)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim, dtype=D64), nn.GELU(), nn.Linear(2 * dim, dim, dtype=D64))
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads, dtype=D64) * 0.1)
        grid = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (grid[:, :, None] - grid[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("index", rel[..., 0] * (2 * window - 1) + rel[..., 1], persistent=False)
        self.register_buffer("mask", self._mask() if shift else None, persistent=False)

    def _partition(self, x):
        b, h, w, c = x.shape
        ws = self.window
        return x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)

    def _reverse(self, windows, b):
        (h, w), ws = self.size, self.window
        return windows.view(b, h // ws, w // ws, ws, ws, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)

    def _mask(self):
        (h, w), ws, s = self.size, self.window, self.shift
        img, count = torch.zeros(1, h, w, 1, dtype=D64), 0
        for hs in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
            for wsl in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
                img[:, hs, wsl, :] = count
                count += 1
        windows = self._partition(img).squeeze(-1)
        diff = windows.unsqueeze(1) - windows.unsqueeze(2)
        return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)

    def forward(self, x):
        b, _, _, c = x.shape
        shortcut, x = x, self.norm1(x)
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), (1, 2))
        w = self._partition(x)
        n, tokens, _ = w.shape
        q, k, v = self.qkv(w).reshape(n, tokens, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
        attn = attn + self.table[self.index.view(-1)].view(tokens, tokens, -1).permute(2, 0, 1).unsqueeze(0)
        if self.mask is not None:
            per = self.mask.shape[0]
            attn = (attn.view(n // per, per, self.heads, tokens, tokens) + self.mask.unsqueeze(1).unsqueeze(0))
            attn = attn.view(-1, self.heads, tokens, tokens)
        out = (attn.softmax(-1) @ v).transpose(1, 2).reshape(n, tokens, c)
        y = self._reverse(self.proj(out), b)
        if self.shift:
            y = torch.roll(y, (self.shift, self.shift), (1, 2))
        x = shortcut + y
        return x + self.mlp(self.norm2(x))


class EarthBlock(nn.Module):
    """A 3-D window block on (B, Z, H, W, C), Pangu-Weather's shape: (2, 4, 4) windows, shifted by half."""

    def __init__(self, size: tuple[int, int, int], dim: int = 4, heads: int = 2, shift: bool = False) -> None:
        super().__init__()
        self.size, self.heads, self.shift, self.window = size, heads, shift, (2, 4, 4)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, dtype=D64), nn.Linear(dim, dim, dtype=D64)
        self.norm = nn.LayerNorm(dim, dtype=D64)

    def forward(self, x):
        b, (z, h, w), (wz, wh, ww), c = x.shape[0], self.size, self.window, x.shape[-1]
        shortcut, x = x, self.norm(x)
        if self.shift:
            x = torch.roll(x, (-wz // 2, -wh // 2, -ww // 2), (1, 2, 3))
        windows = x.view(b, z // wz, wz, h // wh, wh, w // ww, ww, c).permute(0, 1, 3, 5, 2, 4, 6, 7)
        windows = windows.reshape(-1, wz * wh * ww, c)
        n, tokens, _ = windows.shape
        q, k, v = self.qkv(windows).reshape(n, tokens, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = (((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(-1) @ v).transpose(1, 2)
        y = self.proj(out.reshape(n, tokens, c)).view(b, z // wz, h // wh, w // ww, wz, wh, ww, c)
        y = y.permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, z, h, w, c)
        if self.shift:
            y = torch.roll(y, (wz // 2, wh // 2, ww // 2), (1, 2, 3))
        return shortcut + y


def _train_body(world: int, kind: str, dim: int, sizes: tuple[int, ...], steps: int) -> float:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=world)
    torch.manual_seed(0)
    if kind == "swin":
        shape = (2, 8, 8, 4)
        ref = nn.Sequential(SwinBlock(shape[1:3]), SwinBlock(shape[1:3], shift=2))
    else:
        shape = (2, 4, 8, 8, 4)
        ref = nn.Sequential(EarthBlock(shape[1:4]), EarthBlock(shape[1:4], shift=True))

    def loss(model, step, sharded):
        x = torch.randn(shape, dtype=D64, generator=torch.Generator().manual_seed(step))
        x = domain.shard(x, dim=dim, sizes=sizes) if sharded else x
        return (model(x) - x.flip(-1)).square().mean()

    worst = trained_alike(ref, loss, steps, 0.1)
    DistributedManager.shutdown()
    return worst


CASES = [  # world, model, sharded dim, sizes (windows of 4 rows, 2 levels cut across ranks)
    (2, "swin", 1, (3, 5)),
    (3, "swin", 2, (1, 0, 7)),
    (3, "swin", 1, (1, 0, 7)),  # 2 rows of windows over 3 ranks (at batch 1: the zoo entry hand-written.SwinWindows)
    (2, "earth", 1, (3, 1)),
    (3, "earth", 2, (2, 5, 1)),
    (2, "earth", 3, (6, 2)),
]


@pytest.mark.parametrize("world, kind, dim, sizes", CASES, ids=[f"{c[1]}-dim{c[2]}-{c[3]}" for c in CASES])
def test_window_attention_trains_equal_to_one_process(ranks, world, kind, dim, sizes):
    assert max(ranks.run(world, _train_body, world, kind, dim, sizes, 3)) < TOL
